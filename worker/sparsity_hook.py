"""Wires sparsity measurements into a loop: every `measure_interval` optimizer steps."""

from __future__ import annotations


class SparsityTracker:
    @classmethod
    def maybe(cls, spec, setup, reporter):
        if spec.sparsity is None:
            return None
        raise NotImplementedError("sparsity reports are not implemented yet")

"""The sampler's own copy of the LoRA-adapted weights, W = W0 + s·B·A, refolded at every sync.

A LoRA layer's forward is three matmuls (x·W0ᵀ, then x·Aᵀ and its result by Bᵀ); decoding runs it once per
token on a few dozen rows, where the two thin factor matmuls cost a fifth of the layer's time. A copy of
the adapted weights with the adapter folded in runs one. The rollout copy keeps the unfolded layers for the
old log-probs, whose "ratio exactly 1 before the first update" needs the training forward's own arithmetic;
only `generate` runs on the folded copy, whose logits differ from the unfolded ones by rounding alone.

The copy costs the adapted weights' bytes (0.40 GB for SmolLM2-135M with every projection adapted), so the
engine folds only where that is a small share of the memory a step plans on (`memory.plan_fold`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from worker.algos.lora import LoraLayer, base_model, is_lora, lora_layers


def foldable(model: torch.nn.Module) -> list[LoraLayer] | None:
    """The model's LoRA layers when every adapted module is a plain LoRA linear layer (no DoRA, no transposed
    Conv1D weight, one adapter): what `FoldedSampler` can fold. None otherwise."""
    if not is_lora(model):
        return None
    layers = lora_layers(base_model(model))
    tuners = [m for m in base_model(model).modules() if hasattr(m, "lora_A")]
    if not layers or len(tuners) != len(layers):  # an embedding or a convolution adapted too
        return None
    for layer in layers:
        m = layer.module
        if (len(m.lora_A) != 1 or any(m.use_dora.values()) or getattr(m, "fan_in_fan_out", False)
                or not isinstance(m.base_layer, torch.nn.Linear)):
            return None
    return layers


def adapted_bytes(layers: list[LoraLayer]) -> int:
    """What a folded copy of these layers' base weights takes."""
    return sum(w.numel() * w.element_size() for w in (la.module.base_layer.weight for la in layers))


@dataclass(frozen=True)
class _Fold:
    """One adapted layer: `weight` (the sampler's) = W0 + scaling · B·A, from `source` (the rollout copy's)."""

    weight: torch.Tensor  # [d_out, d_in], the sampler's own
    source: LoraLayer


class FoldedSampler:
    """A plain transformers model that shares every weight of `model` (the rollout copy, a peft model) but
    the adapted layers', which are its own and hold W0 + s·B·A as of the last `fold()`."""

    def __init__(self, model: torch.nn.Module, layers: list[LoraLayer]) -> None:
        base: Any = base_model(model)  # a transformers model: its submodules' attributes are untyped
        adapted = {id(la.module.base_layer.weight) for la in layers}
        shared = {id(p): p for p in base.parameters() if id(p) not in adapted}
        self.model = copy.deepcopy(base, shared)  # shares all but the adapted weights, which it copies
        self._folds: list[_Fold] = []
        for la in layers:  # the same names in the copy: each peft layer gives way to its base linear layer
            parent, _, child = la.name.rpartition(".")
            linear = self.model.get_submodule(la.name).base_layer
            setattr(self.model.get_submodule(parent) if parent else self.model, child, linear)
            self._folds.append(_Fold(weight=linear.weight, source=la))
        self.model.eval().requires_grad_(False)
        self.fold()

    @torch.no_grad()
    def fold(self) -> None:
        """W = W0 + s·B·A for every adapted layer, from the rollout copy's current factors, in W0's dtype."""
        for f in self._folds:
            w0, a, b = f.source.module.base_layer.weight, f.source.a.weight, f.source.b.weight  # [o, i], [r, i], [o, r]
            torch.addmm(w0, b.to(w0.dtype), a.to(w0.dtype), alpha=f.source.scaling, out=f.weight)

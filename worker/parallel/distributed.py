"""Data parallelism over torch.distributed: each process's share of a step, and the collectives
that make N processes' step the step one process takes on the whole batch.

A job with `resources.processes: N` runs its loop in N processes (ranks, launched by
worker/parallel/launch.py). Every rank holds the whole model and
  - draws the same units (prompts, queries) from the same seeded stream, then samples, scores
    and trains on its contiguous share of them (`Ranks.share`); sampling is seeded per row, so a
    row's completion does not depend on which rank drew it or what else was in its batch;
  - divides its samples' losses by the whole batch's normaliser (token and sequence counts summed
    over ranks), so the sum of the ranks' gradients is the gradient of the whole batch's loss;
  - sums its gradient with the others' before clipping (`reduce_gradients`), so every rank's
    optimizer makes the same update and the copies never drift apart;
  - reduces its statistics (`sum`, `max`), so rank 0 reports what one process would.
With one process (`SINGLE`) every collective is the identity and torch.distributed is not used.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def row_seed(*parts: object) -> int:
    """A 63-bit seed from (seed, step, tag, unit, row...): the same on every rank, for any batch."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "big") >> 1


@dataclass(frozen=True)
class Ranks:
    """This process's place among a job's processes."""

    rank: int = 0
    world: int = 1
    device: str = "cpu"  # where collectives' tensors live: cpu with gloo, this rank's GPU with nccl
    per_node: int = 0  # the ranks on this rank's machine, when the job spans several (0: one machine, all of them)

    @property
    def local_world(self) -> int:
        """The ranks sharing this rank's machine (its GPUs, its cores, its memory)."""
        return self.per_node or self.world

    @property
    def main(self) -> bool:
        """Rank 0: the one that reports and writes checkpoints."""
        return self.rank == 0

    def share(self, n: int) -> range:
        """This rank's contiguous share of n items; the first n % world ranks take one more."""
        base, extra = divmod(n, self.world)
        start = self.rank * base + min(self.rank, extra)
        return range(start, start + base + (self.rank < extra))

    # -- collectives (all ranks call them in the same order) -------------------------------------
    def sum(self, values: dict[str, float]) -> dict[str, float]:
        """Each value summed over ranks (in float64), in one all-reduce."""
        return self._reduce(values, torch.distributed.ReduceOp.SUM if self.world > 1 else None)

    def max(self, values: dict[str, float]) -> dict[str, float]:
        return self._reduce(values, torch.distributed.ReduceOp.MAX if self.world > 1 else None)

    def _reduce(self, values: dict[str, float], op) -> dict[str, float]:
        if self.world == 1:
            return dict(values)
        keys = sorted(values)
        t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(t, op=op)
        return dict(zip(keys, t.tolist()))

    def gather(self, obj: T) -> list[T]:
        """Every rank's `obj`, in rank order, on every rank."""
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        torch.distributed.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: T) -> T:
        """Rank 0's `obj` on every rank."""
        if self.world == 1:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def cat(self, rows: torch.Tensor) -> torch.Tensor:
        """Every rank's rows [n_r, ...] concatenated in rank order (n_r may differ)."""
        if self.world == 1:
            return rows
        sizes = self.gather(rows.shape[0])
        padded = torch.zeros((max(sizes), *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
        padded[: rows.shape[0]] = rows
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        torch.distributed.all_gather(parts, padded)
        return torch.cat([p[:n] for p, n in zip(parts, sizes)])

    def reduce_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Sum .grad over ranks, in one flat all-reduce. A parameter no rank has a gradient for
        keeps None (AdamW skips it, as it would in one process)."""
        if self.world == 1:
            return
        has = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=params[0].device)
        # summed in at least float32 (a float64 policy's gradients stay float64)
        dtype = torch.promote_types(params[0].dtype, torch.float32)
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(dtype)
                          for p in params])
        torch.distributed.all_reduce(has)
        torch.distributed.all_reduce(flat)
        offset = 0
        for p, seen in zip(params, has.tolist()):
            n = p.numel()
            p.grad = flat[offset: offset + n].view_as(p).to(p.dtype) if seen else None
            offset += n


SINGLE = Ranks()


def shard(model: torch.nn.Module, ranks: Ranks) -> torch.nn.Module:
    """FSDP2 (`fully_shard`): each decoder layer and the rest of the model sharded across the
    ranks; a layer's weights are gathered for its forward and backward and freed after, and its
    gradient is reduce-scattered, summed (not averaged: every rank's loss is its share of the
    whole batch's loss). Parameters become DTensors; each rank keeps 1/world of them, of their
    gradients and of the optimizer's state."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from worker.model.loading import enable_checkpointing

    if getattr(model, "is_gradient_checkpointing", False):  # FSDP2's hooks need the non-reentrant kind
        enable_checkpointing(model, reentrant=False)
    mesh = init_device_mesh(torch.device(ranks.device).type, (ranks.world,))
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in model.modules():  # each sharded module reduces its own gradients
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM
    return model

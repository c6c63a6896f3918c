"""Optimizer, schedule and seeding shared by every loop (checkpoints: worker/model/checkpoints.py)."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from worker.algos.optim import MasterWeightsAdamW
from worker.model.loading import trainable_parameters


@contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """The model without dropout for the block, then back in the mode it was in."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def step_seed(seed: int, step: int) -> int:
    """Each step reseeds from (seed, step), so a resumed run samples exactly what a straight run does."""
    return (seed * 1_000_003 + step * 7919) % 2**31


def make_optimizer(params, *, lr: float, weight_decay: float, betas: tuple[float, float]) -> torch.optim.Optimizer:
    """AdamW; bf16/fp16 parameters (full fine-tuning of a low-precision model) step through float32 master
    weights (worker/algos/optim.py), float32 ones exactly as torch's AdamW."""
    return MasterWeightsAdamW(params, lr=lr, weight_decay=weight_decay, betas=betas)


def make_scheduler(opt: torch.optim.Optimizer, *, schedule: str, warmup: int, total: int):
    """Linear warm-up, then constant or cosine decay to zero over the remaining steps."""

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if schedule == "cosine":
            progress = (step - warmup) / max(1, total - warmup)
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


class NonFiniteUpdate(FloatingPointError):
    """A NaN or infinite loss or gradient, found before the optimizer applied it (the runner records
    the `non_finite` health flag; the job fails with its last checkpoint intact)."""

    def __init__(self, what: str, *, step: int | None = None, hint: str = "") -> None:
        super().__init__(f"{what}{f' at step {step}' if step is not None else ''}{f'; {hint}' if hint else ''}")
        self.what, self.step = what, step


def has_dropout(model: torch.nn.Module) -> bool:
    """Whether a training forward is noisy: a dropout module or an attention dropout that is not 0."""
    if any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules()):
        return True
    config = getattr(model, "config", None)
    return bool(getattr(config, "attention_dropout", 0.0) or 0.0)


def grad_norm(params) -> float:
    norms = [p.grad.detach().float().norm() for p in params if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0


def trainable(model) -> list[torch.nn.Parameter]:
    return [p for _, p in trainable_parameters(model)]

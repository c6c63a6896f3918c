"""Optimizer, schedule, seeding and checkpoints shared by every loop."""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_model

from worker.models import is_lora, trainable_parameters

STATE_FILE = "trainer_state.pt"


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def step_seed(seed: int, step: int) -> int:
    """Each step reseeds from (seed, step), so a resumed run samples exactly what a straight run does."""
    return (seed * 1_000_003 + step * 7919) % 2**31


def make_optimizer(params, *, lr: float, weight_decay: float, betas: tuple[float, float]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas)


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


def grad_norm(params) -> float:
    norms = [p.grad.detach().float().norm() for p in params if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0


def _dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def save_checkpoint(path: Path, *, model, tokenizer, optimizers: dict, schedulers: dict, step: int,
                    extra: dict | None = None) -> tuple[str, int]:
    """Weights as safetensors (a peft adapter folder with LoRA, a transformers folder otherwise)
    plus optimizer, scheduler and step. Written to a temp folder and renamed, so a crash never
    leaves a half checkpoint behind. Returns (format, size in bytes)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp, safe_serialization=True)
    fmt = "peft-lora" if is_lora(model) else "transformers"
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    torch.save({"step": step,
                "optimizers": {k: o.state_dict() for k, o in optimizers.items()},
                "schedulers": {k: s.state_dict() for k, s in schedulers.items()},
                "extra": extra or {}}, tmp / STATE_FILE)
    if path.exists():
        import shutil
        shutil.rmtree(path)
    tmp.rename(path)
    return fmt, _dir_size(path)


def load_weights(path: Path, *, model) -> None:
    """The trained weights of a checkpoint folder: the adapter with LoRA, else the full model."""
    path = Path(path)
    if is_lora(model):
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        set_peft_model_state_dict(model, load_file(path / "adapter_model.safetensors"))
    else:
        load_model(model, path / "model.safetensors", strict=False)


def load_checkpoint(path: Path, *, model, optimizers: dict, schedulers: dict) -> dict:
    """Restore weights, optimizer and scheduler state; returns the saved state (step, extra)."""
    path = Path(path)
    load_weights(path, model=model)
    state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)
    for k, o in optimizers.items():
        o.load_state_dict(state["optimizers"][k])
    for k, s in schedulers.items():
        s.load_state_dict(state["schedulers"][k])
    return state


def latest_checkpoint(root: Path) -> Path | None:
    if not root.exists():
        return None
    done = [p for p in root.glob("step-*") if (p / STATE_FILE).exists() and p.name[5:].isdigit()]
    return max(done, key=lambda p: int(p.name[5:]), default=None)


def trainable(model) -> list[torch.nn.Parameter]:
    return [p for _, p in trainable_parameters(model)]

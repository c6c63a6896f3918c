"""Checkpoint folders: what a loop saves, how a resumed attempt or `model.init_from` reads it back.

A folder `step-N/` holds the trained weights (a peft adapter folder with LoRA, a transformers folder
otherwise) with the tokenizer, `<name>.safetensors` for each other trained module (the joint loop's
retriever), and `trainer_state.pt` (optimizers, schedulers, step, counters). It is written to
`step-N.tmp/` and renamed, so a crash never leaves a half checkpoint that looks whole.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model, save_model

from service.core.artifacts import COMPLETE, folder_store, newest_step
from worker.algos.lora import is_lora

STATE_FILE = COMPLETE  # written last: its presence marks a whole checkpoint


@dataclass(frozen=True)
class SavedState:
    """What `load_checkpoint` restored besides the weights."""

    step: int
    opt_steps: int | None  # optimizer steps taken (absent from checkpoints of older versions)
    extra: dict[str, Any] = field(default_factory=dict)  # what save_checkpoint's `extra` held


@dataclass
class Trainables:
    """Everything a checkpoint saves and a resume restores, by name ("policy" is the model)."""

    model: torch.nn.Module
    tokenizer: object | None
    optimizers: dict[str, torch.optim.Optimizer]
    schedulers: dict[str, torch.optim.lr_scheduler.LRScheduler]
    modules: dict[str, torch.nn.Module] = field(default_factory=dict)  # other trained modules
    sharded: bool = False  # the model is sharded across processes (FSDP2): its states are gathered


@dataclass(frozen=True)
class FullStates:
    """A sharded model's whole weights and its optimizer's whole state, gathered on rank 0."""

    model: dict[str, torch.Tensor]
    optimizer: dict


def gather_states(t: Trainables) -> FullStates:
    """A collective (every rank calls it): the full state dicts of the sharded policy and its
    optimizer, through torch.distributed.checkpoint, on rank 0's CPU (empty elsewhere)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return FullStates(get_model_state_dict(t.model, options=options),
                      get_optimizer_state_dict(t.model, t.optimizers["policy"], options=options))


def _dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@dataclass(frozen=True)
class Saved:
    """A checkpoint folder as written."""

    format: str  # peft-lora | transformers
    size_bytes: int


def save_checkpoint(path: Path, t: Trainables, *, step: int, opt_steps: int,
                    full: FullStates | None = None, extra: dict[str, Any] | None = None) -> Saved:
    """Write checkpoint folder `path` (`full`: a sharded model's gathered states, written in the
    same format as an unsharded one's; `extra`: the loop's own counters, back in SavedState.extra)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    if is_lora(t.model):  # embeddings are never resized here: no hub lookup of the base's config to check
        t.model.save_pretrained(tmp, safe_serialization=True, save_embedding_layers=False)
    else:
        t.model.save_pretrained(tmp, safe_serialization=True, state_dict=None if full is None else full.model)
    if t.tokenizer is not None:
        t.tokenizer.save_pretrained(tmp)
    for name, module in t.modules.items():
        save_model(module, str(tmp / f"{name}.safetensors"))
    torch.save({"step": step,
                "optimizers": {k: full.optimizer if full is not None and k == "policy" else o.state_dict()
                               for k, o in t.optimizers.items()},
                "schedulers": {k: s.state_dict() for k, s in t.schedulers.items()},
                "extra": {"opt_steps": opt_steps, **(extra or {})}}, tmp / STATE_FILE)
    if path.exists():
        shutil.rmtree(path)
    tmp.rename(path)
    return Saved(format="peft-lora" if is_lora(t.model) else "transformers", size_bytes=_dir_size(path))


def load_weights(path: Path, *, model: torch.nn.Module) -> None:
    """The trained weights of a checkpoint folder: the adapter with LoRA, else the full model."""
    path = Path(path)
    if is_lora(model):
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        set_peft_model_state_dict(model, load_file(path / "adapter_model.safetensors"))
    else:
        load_model(model, path / "model.safetensors", strict=False)


def load_checkpoint(path: Path, t: Trainables) -> SavedState:
    """Restore weights, other modules, optimizer and scheduler states from folder `path`."""
    path = Path(path)
    state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)
    if t.sharded:  # the policy's weights and optimizer state go back to their shards
        _load_sharded_policy(path, t, state["optimizers"]["policy"])
    else:
        load_weights(path, model=t.model)
    for name, module in t.modules.items():
        if (path / f"{name}.safetensors").exists():
            load_model(module, str(path / f"{name}.safetensors"))
    for k, o in t.optimizers.items():
        if k in state["optimizers"] and not (t.sharded and k == "policy"):
            o.load_state_dict(state["optimizers"][k])
    for k, s in t.schedulers.items():
        if k in state["schedulers"]:
            s.load_state_dict(state["schedulers"][k])
    return SavedState(int(state["step"]), state["extra"].get("opt_steps"), extra=state["extra"])


def _load_sharded_policy(path: Path, t: Trainables, optimizer_state: dict) -> None:
    """Every rank reads the whole weights and optimizer state and keeps its shards of them."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, strict=False)  # tied weights are saved once
    set_model_state_dict(t.model, load_file(path / "model.safetensors"), options=options)
    set_optimizer_state_dict(t.model, t.optimizers["policy"], optimizer_state,
                             options=StateDictOptions(full_state_dict=True))


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint folder under `root`."""
    if not root.exists():
        return None
    step = newest_step(folder_store(root, name=str(root)).list(""))
    return None if step is None else root / f"step-{step}"

"""What ran, measured on the worker: the spec's hash, code and library versions, the hardware, the
seeds, and hashes of the loaded data and the base model's weights (service/core/fingerprint.py)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
from pathlib import Path

import torch

from service.core.fingerprint import Fingerprint, Hardware
from service.core.settings import Settings
from worker.machine.hardware import cpu_name
from worker.model.loading import TINY_PRESETS, model_source

SOURCE = Path(__file__).resolve().parents[1]
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def sha256_json(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


@functools.cache
def source_commit() -> str | None:
    """The worker's source commit ('+dirty' with uncommitted changes), or None outside a git checkout."""
    if not (SOURCE / ".git").exists():
        return None
    try:
        head = subprocess.run(["git", "-C", str(SOURCE), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(SOURCE), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def vllm_version(python: str | None) -> str | None:
    """The vllm version installed beside the interpreter GRPO_VLLM_PYTHON names (read from its metadata,
    without starting it)."""
    if not python:
        return None
    for dist in sorted(Path(python).resolve().parents[1].glob("lib/python*/site-packages/vllm-*.dist-info")):
        return dist.name.removeprefix("vllm-").removesuffix(".dist-info")
    return None


def libraries(engine: str, settings: Settings) -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "peft"):
        out[name] = importlib.metadata.version(name)
    if engine == "vllm" and (v := vllm_version(settings.vllm_python)):
        out["vllm"] = v
    return out


def hardware(device: str) -> Hardware:
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return Hardware(cpu=cpu_name(), cores=os.cpu_count() or 1, threads=torch.get_num_threads(),
                    cpu_capability=torch.backends.cpu.get_cpu_capability(), gpus=gpus, device=device)


def files_sha256(folder: Path, cache: Path) -> str:
    """SHA-256 over a model folder's weight files (names and bytes), cached by each file's size and
    modification time, so a worker hashes a model once."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
    h = hashlib.sha256()
    for p in files:
        st = p.stat()
        key = hashlib.sha256(f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()
        memo = cache / key
        try:
            digest = memo.read_text().strip()
        except OSError:
            fh = hashlib.sha256()
            with p.open("rb") as f:
                for chunk in iter(lambda: f.read(1 << 22), b""):
                    fh.update(chunk)
            digest = fh.hexdigest()
            cache.mkdir(parents=True, exist_ok=True)
            tmp = memo.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(digest)
            tmp.replace(memo)
        h.update(f"{p.relative_to(folder)}:{digest}\n".encode())
    return h.hexdigest()


def _named_sha256(tensors) -> str:
    h = hashlib.sha256()
    for name, t in sorted(tensors, key=lambda nt: nt[0]):
        h.update(name.encode())
        h.update(t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def tensors_sha256(module: torch.nn.Module) -> str:
    return _named_sha256(module.state_dict().items())


def trainable_sha256(model: torch.nn.Module) -> str:
    """The trainable parameters (LoRA's factors, or every weight), by name: what training starts from."""
    return _named_sha256((n, p) for n, p in model.named_parameters() if p.requires_grad)


def model_sha256(name: str, settings: Settings, base: torch.nn.Module) -> str:
    if name in TINY_PRESETS:  # built from the seed at load: its weights are what identifies it
        return tensors_sha256(base)
    folder = model_source(name, models_root=settings.models_dir, model_roots=settings.model_roots)
    return files_sha256(folder, settings.cache_dir / "fingerprints")


def task_sha256(task) -> str:
    return sha256_json(dataclasses.asdict(task) if dataclasses.is_dataclass(task) else task)


def fingerprint(spec, settings: Settings, *, model_hash: str, task, device: str, model: torch.nn.Module) -> Fingerprint:
    """`model_hash`: model_sha256 of the weights as loaded, before `model.init_from`'s or training;
    `model`: the policy as training starts from it."""
    return Fingerprint(spec_sha256=sha256_json(spec.model_dump(mode="json")), version=importlib.metadata.version(
        "grpo-jobs"), commit=source_commit(), libraries=libraries(spec.rollout.engine, settings),
        hardware=hardware(device), seeds={"train": spec.train.seed, "dataset": spec.dataset.seed},
        processes=spec.resources.processes, data_sha256=task_sha256(task), model_sha256=model_hash,
        dtype=spec.model.dtype, activations=spec.model.activations, trainable_sha256=trainable_sha256(model))

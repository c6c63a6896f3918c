"""Where a spec may point: models, retrievers and data files, resolved against the admin's
settings and the owner, the same way at submit time (the API) and at run time (the worker).

- A model or retriever is a bundled preset, a folder under one of the admin's model roots
  (`GRPO_MODEL_ROOTS`), or a Hugging Face id already in the local cache (never downloaded).
- A data file is relative to the owner's own folder of the datasets root, or, written
  `shared/...`, to the admin's shared folder (`GRPO_SHARED_DATASETS`), read-only.
- An uploaded file is named by its id in the `dataset` fields of `FILE_FIELDS`.

Containment is checked after following symlinks, and "missing" and "not allowed" read the
same, so a spec cannot probe the server's filesystem. The checks against the store (whose
checkpoint, whose file) are the API's: service/api/sources.py.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path, PurePosixPath

from service.core.settings import Settings
from service.core.specs import _HF_ID, JobSpec, unavailable_model

SHARED_PREFIX = "shared/"
# An owner name that is a folder name as it is; `keys create` accepts only these.
OWNER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def unavailable_file(field: str, rel: str) -> str:
    return (f"{field} {rel!r} is not available: give a file in your folder of the datasets root, "
            f"or '{SHARED_PREFIX}...' for the admin's shared datasets")


def contained(root: Path, rel: str | PurePosixPath) -> Path | None:
    """root/rel with every symlink resolved, if it exists and stays inside root; else None."""
    p = PurePosixPath(rel)
    if p.is_absolute() or ".." in p.parts or not str(rel).strip() or str(rel).startswith("~"):
        return None
    try:
        base = root.resolve(strict=True)
        target = (base / p).resolve(strict=True)
    except (OSError, RuntimeError):  # missing, a symlink loop, unreadable
        return None
    return target if target.is_relative_to(base) else None


def owner_folder(owner: str) -> str:
    """A folder name for an owner: the name itself when it is a plain one, else a stable hash."""
    return owner if OWNER_NAME.match(owner) else "_" + hashlib.sha256(owner.encode()).hexdigest()[:16]


def for_owner(settings: Settings, owner: str) -> Settings:
    """The settings a job of `owner` runs with: its datasets root is the owner's own folder."""
    return settings.model_copy(update={"datasets_root": settings.datasets_dir / owner_folder(owner)})


def hf_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    return Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")).expanduser() / "hub"


def _cached_hub_model(name: str) -> Path | None:
    """The newest snapshot folder of a Hugging Face id in the local cache, if it holds a config."""
    if not _HF_ID.match(name):
        return None
    repo = hf_cache_dir() / ("models--" + name.replace("/", "--"))
    snapshots = contained(repo, "snapshots") if repo.is_dir() else None
    if snapshots is None:
        return None
    found = [s for s in snapshots.iterdir() if (s / "config.json").exists()]
    return max(found, key=lambda s: s.stat().st_mtime, default=None)


def model_path(name: str, model_roots: list[Path]) -> Path | None:
    """Where a non-preset model or retriever name points, or None when it is not available."""
    for root in model_roots:
        found = contained(root, name)
        if found is not None and found.is_dir() and (found / "config.json").is_file():
            return found
    return _cached_hub_model(name)


def require_model_path(name: str, model_roots: list[Path], *, what: str, presets: tuple[str, ...]) -> Path:
    """model_path, or the one 'not available' error (at run time, when it went away since submit)."""
    found = model_path(name, model_roots)
    if found is None:
        raise ValueError(unavailable_model(what, name, presets))
    return found


def dataset_file(rel: str, settings: Settings) -> Path | None:
    """A data file of the job's owner (settings scoped with `for_owner`), or of the shared folder."""
    if rel.startswith(SHARED_PREFIX):
        if settings.shared_datasets_root is None:
            return None
        found = contained(settings.shared_datasets_root, rel[len(SHARED_PREFIX):])
    else:
        found = contained(settings.datasets_dir, rel)
    return found if found is not None and found.is_file() else None


def unavailable_checkpoint(job: int, step: int | None) -> str:
    at = "any checkpoint" if step is None else f"a checkpoint at step {step}"
    return f"model.init_from: you have no job {job} with {at}"


# dataset fields that name uploaded files -> the purpose their file must have
FILE_FIELDS = {"train_file": "train", "val_file": "eval", "corpus_file": "corpus"}


def files_named(spec: JobSpec | None) -> set[str]:
    """The uploaded file ids a spec names (none for a stored spec this version cannot read)."""
    dataset = getattr(spec, "dataset", None)  # session runs name no data
    return set() if dataset is None else {v for f in FILE_FIELDS if (v := getattr(dataset, f))}


def unavailable_upload(field: str, file_id: str) -> str:
    return f"dataset.{field}: you have no file {file_id!r} (GET /v1/files lists yours)"

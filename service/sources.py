"""Where a spec may point: models, retrievers and data files, resolved against the admin's
settings and the owner, the same way at submit time (the API) and at run time (the worker).

- A model or retriever is a bundled preset, a folder under one of the admin's model roots
  (`GRPO_MODEL_ROOTS`), or a Hugging Face id already in the local cache (never downloaded).
- A data file is relative to the owner's own folder of the datasets root, or, written
  `shared/...`, to the admin's shared folder (`GRPO_SHARED_DATASETS`), read-only.

Containment is checked after following symlinks, and "missing" and "not allowed" read the
same, so a spec cannot probe the server's filesystem. Never imports torch.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path, PurePosixPath

from sqlalchemy.orm import Session

from service.grader_urls import UrlRefused, check_url
from service.settings import Settings
from service.store import jobs as jobs_q
from service.store import files as files_q
from service.store import records
from service.store.models import Checkpoint, Job
from service.specs import _HF_ID, MODEL_PRESETS, RETRIEVER_PRESETS, DatasetSpec, unavailable_model

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


def init_checkpoint(session: Session, *, owner: str, job_id: int, step: int | None) -> tuple[Job, Checkpoint] | None:
    """One of `owner`'s own checkpoints (`step` None: the latest), or None (another owner's reads as missing)."""
    job = jobs_q.get_job(session, job_id=job_id, owner=owner)
    if job is None:
        return None
    ckpt = (records.latest_checkpoint(session, job_id=job_id) if step is None
            else records.get_checkpoint(session, job_id=job_id, step=step))
    return None if ckpt is None else (job, ckpt)


def _init_errors(spec, session: Session, owner: str) -> list[dict]:
    init = spec.model.init_from
    if init is None:
        return []
    found = init_checkpoint(session, owner=owner, job_id=init.job, step=init.step)
    if found is None:
        return [{"loc": ("model", "init_from"), "msg": unavailable_checkpoint(init.job, init.step), "type": "unavailable"}]
    earlier = found[0].spec.get("model", {})
    lora = spec.model.lora
    same_lora = (lora is None and earlier.get("lora") is None) or (
        lora is not None and earlier.get("lora") is not None
        and {k: earlier["lora"].get(k) for k in ("r", "alpha", "target_modules")}
        == {"r": lora.r, "alpha": lora.alpha, "target_modules": lora.target_modules})
    if earlier.get("name") != spec.model.name or not same_lora:
        return [{"loc": ("model", "init_from"), "type": "mismatch",
                 "msg": f"job {init.job} trained {earlier.get('name')!r} with lora {earlier.get('lora')}: model.name and "
                 "model.lora (r, alpha, target_modules) must be the same to start from its weights"}]
    return []


def _reward_errors(spec, settings: Settings) -> list[dict]:
    """Reward models that cannot be found, and graders off the admin's allow-list."""
    errors = []
    presets = {"reward_model": (), "judge": MODEL_PRESETS, "similarity": RETRIEVER_PRESETS}
    for i, r in enumerate(spec.rewards or ()):
        if r.name in presets and r.model not in presets[r.name] and model_path(r.model, settings.model_roots) is None:
            errors.append({"loc": ("rewards", i, "model"), "type": "unavailable",
                           "msg": unavailable_model(f"{r.name} model", r.model, presets[r.name] or ("none",))})
        if r.name == "http":
            try:
                check_url(r.url, settings.reward_urls)
            except UrlRefused as exc:
                errors.append({"loc": ("rewards", i, "url"), "type": "not_allowed", "msg": f"url {exc}"})
    return errors


# dataset fields that name uploaded files -> the purpose their file must have
FILE_FIELDS = {"train_file": "train", "val_file": "eval", "corpus_file": "corpus"}


def files_named(spec: dict) -> set[str]:
    """The uploaded file ids a stored spec names."""
    dataset = spec.get("dataset") or {}
    return {dataset[f] for f in FILE_FIELDS if dataset.get(f)}


def unavailable_upload(field: str, file_id: str) -> str:
    return f"dataset.{field}: you have no file {file_id!r} (GET /v1/files lists yours)"


def _file_errors(d: DatasetSpec, session: Session, owner: str) -> list[dict]:
    """Uploaded files a spec names: the owner's own, of the purpose the field needs."""
    errors = []
    for field, purpose in FILE_FIELDS.items():
        file_id = getattr(d, field)
        if file_id is None:
            continue
        f = files_q.get_file(session, file_id=file_id, owner=owner)
        if f is None:
            errors.append({"loc": ("dataset", field), "msg": unavailable_upload(field, file_id), "type": "unavailable"})
        elif f.purpose != purpose:
            errors.append({"loc": ("dataset", field), "type": "wrong_purpose",
                           "msg": f"dataset.{field}: file {file_id} was uploaded for {f.purpose!r}; this field needs a "
                           f"file of purpose {purpose!r}"})
    return errors


def check_sources(spec, settings: Settings, *, session: Session, owner: str) -> list[dict]:
    """Errors (pydantic's shape: loc, msg, type) for everything `spec` names that this owner may
    not use under the admin's settings. Empty when all is well."""
    settings = for_owner(settings, owner)
    errors = _init_errors(spec, session, owner)
    named = [(("model", "name"), spec.model.name, "model", MODEL_PRESETS)]
    if getattr(spec, "retriever", None) is not None:
        named.append((("retriever", "name"), spec.retriever.name, "retriever", RETRIEVER_PRESETS))
    for loc, name, what, presets in named:
        if name not in presets and model_path(name, settings.model_roots) is None:
            errors.append({"loc": loc, "msg": unavailable_model(what, name, presets), "type": "unavailable"})
    errors += _reward_errors(spec, settings)
    if spec.resources.processes > settings.max_processes:
        errors.append({"loc": ("resources", "processes"), "type": "unavailable",
                       "msg": f"resources.processes: {spec.resources.processes} is more than this deployment "
                       f"allows a job ({settings.max_processes}, GRPO_MAX_PROCESSES)"})
    d: DatasetSpec = spec.dataset
    errors += _file_errors(d, session, owner)
    for field in ("path", "corpus_path"):
        rel = getattr(d, field)
        if d.name == "jsonl" and rel is not None and dataset_file(rel, settings) is None:
            errors.append({"loc": ("dataset", field), "msg": unavailable_file(f"dataset.{field}", rel),
                           "type": "unavailable"})
    return errors

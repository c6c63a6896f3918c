"""Submit-time checks of what a spec names against the store and the admin's settings: the
owner's own checkpoints and files, models that exist, graders on the allow-list. Path resolution
itself is shared with the workers (service/core/sources.py)."""

from __future__ import annotations

from sqlalchemy.orm import Session

from service.core.grader_urls import UrlRefused, check_url
from service.core.settings import Settings
from service.core.sources import (
    FILE_FIELDS,
    dataset_file,
    for_owner,
    model_path,
    unavailable_checkpoint,
    unavailable_file,
    unavailable_upload,
)
from service.core.specs import (
    MODEL_PRESETS,
    RETRIEVER_PRESETS,
    DatasetSpec,
    unavailable_model,
)
from service.store import files as files_q
from service.store import records


def _init_errors(spec, session: Session, owner: str) -> list[dict]:
    init = spec.model.init_from
    if init is None:
        return []
    found = records.owned_checkpoint(session, owner=owner, job_id=init.job, step=init.step)
    if found is None:
        return [{"loc": ("model", "init_from"), "msg": unavailable_checkpoint(init.job, init.step), "type": "unavailable"}]
    earlier_spec = found.job.job_spec()
    earlier = None if earlier_spec is None else earlier_spec.model

    if earlier is None or not spec.model.same_weights_as(earlier):
        trained = "a model this version cannot read" if earlier is None else \
            f"{earlier.name!r} with lora {None if earlier.lora is None else earlier.lora.model_dump(mode='json')}"
        return [{"loc": ("model", "init_from"), "type": "mismatch",
                 "msg": f"job {init.job} trained {trained}: model.name and model.lora (r, alpha, target_modules) "
                 "must be the same to start from its weights"}]
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


def model_unavailable(name: str, settings: Settings, *, owner: str, what: str = "model",
                      presets: tuple[str, ...] = MODEL_PRESETS) -> str | None:
    """Why this owner may not train model `name` here, or None: a preset, or a folder under the admin's
    model roots (or the local Hugging Face cache)."""
    if name in presets or model_path(name, for_owner(settings, owner).model_roots) is not None:
        return None
    return unavailable_model(what, name, presets)


def check_sources(spec, settings: Settings, *, session: Session, owner: str) -> list[dict]:
    """Errors (pydantic's shape: loc, msg, type) for everything `spec` names that this owner may
    not use under the admin's settings. Empty when all is well."""
    settings = for_owner(settings, owner)
    errors = _init_errors(spec, session, owner)
    named = [(("model", "name"), spec.model.name, "model", MODEL_PRESETS)]
    if getattr(spec, "retriever", None) is not None:
        named.append((("retriever", "name"), spec.retriever.name, "retriever", RETRIEVER_PRESETS))
    for loc, name, what, presets in named:
        if (why := model_unavailable(name, settings, owner=owner, what=what, presets=presets)) is not None:
            errors.append({"loc": loc, "msg": why, "type": "unavailable"})
    errors += _reward_errors(spec, settings)
    env = getattr(spec, "environment", None)
    if env is not None and env.url is not None:
        try:
            check_url(env.url, settings.environment_urls, "GRPO_ENVIRONMENT_URLS", what="environment servers")
        except UrlRefused as exc:
            errors.append({"loc": ("environment", "url"), "type": "not_allowed", "msg": f"url {exc}"})
    if spec.resources.processes > settings.max_processes:
        errors.append({"loc": ("resources", "processes"), "type": "unavailable",
                       "msg": f"resources.processes: {spec.resources.processes} is more than this deployment "
                       f"allows a job ({settings.max_processes}, GRPO_MAX_PROCESSES)"})
    if spec.resources.nodes > settings.max_nodes:
        errors.append({"loc": ("resources", "nodes"), "type": "unavailable",
                       "msg": f"resources.nodes: {spec.resources.nodes} is more than this deployment runs a job on "
                       f"({settings.max_nodes}, GRPO_MAX_NODES)"})
    if spec.rollout.engine == "vllm" and settings.vllm_python is None:
        errors.append({"loc": ("rollout", "engine"), "type": "unavailable",
                       "msg": "rollout.engine: 'vllm' is not available in this deployment (its workers have no "
                       "GRPO_VLLM_PYTHON); use 'hf'"})
    d: DatasetSpec = spec.dataset
    errors += _file_errors(d, session, owner)
    for field in ("path", "val_path", "corpus_path"):
        rel = getattr(d, field)
        if d.name == "jsonl" and rel is not None and dataset_file(rel, settings) is None:
            errors.append({"loc": ("dataset", field), "msg": unavailable_file(f"dataset.{field}", rel),
                           "type": "unavailable"})
    return errors

"""Sampling: sessions on saved or base weights, and `asample`, run by the worker that holds the run."""

from __future__ import annotations

from typing import Annotated

from fastapi import HTTPException, Path

from service.api.deps import OwnerDep, ReleasedOwnerDep, SessionDep, SettingsDep
from service.api.schemas import error_responses
from service.api.sources import model_unavailable
from service.api.tinker.operations import service_model_name, start_run, submit_op
from service.api.tinker.schemas import REFUSED, SamplerOut, SamplingSessionOut, UntypedFuture, refused, tinker_router
from service.core.specs import TERMINAL, InitFrom, ModelSpec, SessionJob, SessionSpec
from service.core.tinker.requests import CreateSamplingSessionIn, SampleIn
from service.core.tinker.sampling import DEFAULT_MAX_TOKENS, prompt_ask
from service.core.tinker.wire import WireError, parse_sampler_id, parse_tinker_path, sampler_id, saved_sampler_id
from service.store import session_ops as ops_q
from service.store.db import session_scope
from service.store.models import new_uid

router = tinker_router()


@router.post("/create_sampling_session", response_model=SamplingSessionOut, responses=error_responses(404) | REFUSED)
def create_sampling_session(body: CreateSamplingSessionIn, owner: OwnerDep, session: SessionDep,
                            settings: SettingsDep):
    """A sampling session on weights a run saved (`model_path`, a tinker:// path), run by that run's
    worker (or, once that run has ended, by a run of its own that only samples them); or on a base
    model's own weights (`base_model`), run by a run of its own that only samples."""
    if body.model_path is None:
        return _sample_base_model(body, owner, session, settings)
    parsed = parse_tinker_path(body.model_path)
    if parsed is None:
        return refused("model_path", "not a path of this server: tinker://<model_id>/<weights|sampler_weights>/<name>")
    found = ops_q.find_named(session, path=parsed, owner=owner)
    if found is None:
        raise HTTPException(404, f"checkpoint {body.model_path} not found")
    job, step = found
    if job.status not in TERMINAL:  # the run's own worker samples the saved weights beside its training
        return {"sampling_session_id": saved_sampler_id(job.uid, step)}
    # the run has ended: a run of its own samples them, loaded as its model's init_from
    trained = job.job_spec()
    model = trained.model.model_copy(update={"init_from": InitFrom(job=job.id, step=step)})
    return _start_sampler(body, owner, session, settings, name=f"tinker sampler {parsed.name} of {job.uid}",
                          model=model, seed=trained.session.seed)


def _sample_base_model(body: CreateSamplingSessionIn, owner: str, session, settings):
    if body.base_model is None:
        return refused("base_model", "either model_path or base_model is required")
    name = service_model_name(body.base_model)
    if (why := model_unavailable(name, settings, owner=owner)) is not None:
        return refused("base_model", why)
    return _start_sampler(body, owner, session, settings, name=f"tinker sampler {name}",
                          model=ModelSpec(name=name, dtype="float32"),
                          seed=0)  # the base the tiny presets build by default


def _start_sampler(body: CreateSamplingSessionIn, owner: str, session, settings, *, name: str, model: ModelSpec,
                   seed: int | None) -> dict:
    """A run that only samples `model`'s weights, for this session: its sampler samples version 0."""
    if ops_q.get_session(session, session_id=body.session_id, owner=owner) is None:
        raise HTTPException(404, f"session {body.session_id} not found")
    spec = SessionJob(name=name, model=model,
                      session=SessionSpec(tinker_session=body.session_id, model_id=new_uid(),
                                          model_seq_id=body.sampling_session_seq_id, sampling_only=True, seed=seed,
                                          idle_timeout_s=settings.session_idle_s))
    future = start_run(settings, session, owner=owner, spec=spec)
    return {"sampling_session_id": sampler_id(future.model_id, 0)}


def _sampler_run(session, *, sampling_session_id: str, owner: str, for_update: bool = False):
    parsed = parse_sampler_id(sampling_session_id)
    if parsed is None:
        raise HTTPException(404, f"sampling session {sampling_session_id} not found")
    job = ops_q.run_for_model(session, model_id=parsed.model_id, owner=owner, for_update=for_update)
    if job is None:
        raise HTTPException(404, f"sampling session {sampling_session_id} not found")
    return job


@router.get("/samplers/{sampling_session_id}", response_model=SamplerOut, responses=error_responses(404))
def get_sampler(sampling_session_id: Annotated[str, Path(max_length=100)], owner: OwnerDep, session: SessionDep):
    job = _sampler_run(session, sampling_session_id=sampling_session_id, owner=owner)
    return {"sampler_id": sampling_session_id, "base_model": job.job_spec().model.name, "model_path": None}


@router.post("/asample", response_model=UntypedFuture, responses=error_responses(404) | REFUSED)
def asample(body: SampleIn, owner: ReleasedOwnerDep, settings: SettingsDep):
    """Completions of one prompt from a snapshot of a run's weights, run by the run's worker."""
    if any(c.type != "encoded_text" for c in body.prompt.chunks):
        return refused("prompt.chunks", "only text chunks (token ids) are supported here, not images or audio")
    prompt_len = sum(len(c.tokens) for c in body.prompt.chunks)
    if prompt_len == 0:
        return refused("prompt", "no tokens")
    try:
        prompt_ask(body, prompt_len=prompt_len)
    except WireError as exc:
        return refused(exc.field, exc.message)
    positions = body.num_samples * (prompt_len + (body.sampling_params.max_tokens or DEFAULT_MAX_TOKENS))
    if positions > settings.sample_request_tokens:
        return refused("num_samples", f"{body.num_samples} samples x ({prompt_len} prompt tokens + max_tokens) = "
                        f"{positions} token positions, over this server's {settings.sample_request_tokens} a request "
                        "(GRPO_SAMPLE_REQUEST_TOKENS): send fewer samples or a shorter prompt")
    with session_scope(settings.store_url) as session:
        job = _sampler_run(session, sampling_session_id=body.sampling_session_id, owner=owner, for_update=True)
        future = submit_op(settings, session, job=job, kind="sample", body=body.model_dump_json().encode(), seq=None)
    return future.model_copy(update={"sample_sequence_ids": [f"{future.request_id}.{i}"
                                                             for i in range(body.num_samples)]})


"""The tinker-compatible API (`/api/v1`): the routes the unmodified tinker SDK calls, at its paths and
in its formats (SDK versions tested: service.core.tinker_wire.SDK_VERSIONS_TESTED).

A tinker session is a row of `tinker_sessions`; each training run it creates (`create_model`) is a job of
kind `session` owned by the key's owner, whose id for the SDK (`model_id`) is the job's uid. Every
training operation is stored as a `session_ops` row and answered at once with a future (its
`request_id`); the worker holding the run runs the operations in order, and `retrieve_future` hands
back each result once written. Keys: the owner's API keys, sent by the SDK as `X-API-Key`.
"""

from __future__ import annotations

import asyncio
import io
import re
import secrets
import time
from typing import Annotated, Literal

from fastapi import APIRouter, HTTPException, Path, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, ValidationError

from service.api.deps import OwnerDep, ReleasedOwnerDep, SessionDep, SettingsDep
from service.api.schemas import OCTET_STREAM, ErrorOut, ValidationErrorOut, error_responses
from service.api.sources import model_unavailable
from service.core import queue
from service.core.errors import format_errors
from service.core.records import OpState
from service.core.specs import (
    HUB_NAMES,
    MODEL_PRESETS,
    TERMINAL,
    InitFrom,
    LoraSpec,
    ModelSpec,
    SessionJob,
    SessionSpec,
)
from service.core.tinker_requests import (
    ClientConfigIn,
    CreateModelIn,
    CreateSamplingSessionIn,
    CreateSessionIn,
    LoadWeightsIn,
    LoadWeightsOp,
    LoraConfigIn,
    ModelIdIn,
    OptimStepIn,
    RetrieveFutureIn,
    SampleIn,
    SaveForSamplerIn,
    SaveNamedOp,
    SaveWeightsIn,
    SessionIdIn,
)
from service.core.tinker_sampling import DEFAULT_MAX_TOKENS, prompt_ask, sample_response_json
from service.core.tinker_wire import (
    CHECKPOINT_NAME,
    WireError,
    decode_forward_backward,
    forward_backward_output_json,
    parse_sampler_id,
    parse_tinker_path,
    sampler_id,
    saved_sampler_id,
)
from service.store import session_ops as ops_q
from service.store.db import session_scope
from service.store.models import new_uid, utcnow

router = APIRouter(prefix="/api/v1", tags=["tinker"], responses=error_responses(401, 422, 503))
PROTOBUF = "application/x-protobuf"
FORWARD_BACKWARD_MAX_BYTES = 8 * 2**20  # decompressed; the SDK's chunks are kept under half of it (client config)
RETRIEVE_WAIT_S = 10.0  # retrieve_future holds a pending future this long before answering try_again


class SessionListOut(BaseModel):
    sessions: list[str]


class SessionInfoOut(BaseModel):
    training_run_ids: list[str]
    sampler_ids: list[str]  # snapshots live in their run's worker: none are listed
    user_metadata: dict[str, str] | None = None
    display_name: str | None = None


class SamplerOut(BaseModel):
    model_config = ConfigDict(protected_namespaces=())
    sampler_id: str
    base_model: str
    model_path: str | None = None


class UntypedFuture(BaseModel):
    """An operation accepted: poll `/api/v1/retrieve_future` with its `request_id`."""

    request_id: str
    model_id: str | None = None
    sample_sequence_ids: list[str] | None = None  # sampling only: one per requested sample, in order


class ClientConfigOut(BaseModel):
    pjwt_auth_enabled: bool
    use_pyqwest_transport: bool
    parallel_fwdbwd_chunks: bool
    proto_compress_fwdbwd: bool
    fwdbwd_max_chunk_bytes_count: int
    custom_loss_server_side: bool
    sample_use_retrieve_futures: bool
    sample_join_sampling_session: bool


class DynamicConfigOut(BaseModel):
    refresh_interval_sec: int
    sample_cancel_enabled: bool


class SupportedModelOut(BaseModel):
    model_config = ConfigDict(protected_namespaces=())
    model_name: str
    trainable: bool
    sampleable: bool


class CapabilitiesOut(BaseModel):
    supported_models: list[SupportedModelOut]


class StatusOut(BaseModel):
    status: str


class TypedOut(BaseModel):
    type: str


class SessionOut(TypedOut):
    session_id: str


class ModelDataOut(BaseModel):
    model_config = ConfigDict(protected_namespaces=())
    model_name: str
    arch: str | None = None
    tokenizer_id: str | None = None


class InfoOut(TypedOut):
    model_config = ConfigDict(protected_namespaces=())
    model_id: str
    model_name: str
    is_lora: bool
    lora_rank: int | None
    model_data: ModelDataOut


REFUSED = {400: {"model": ValidationErrorOut, "description": "The request names a field wrongly (the body says "
                 "which); nothing was stored. The SDK retries a bare 400 a few times, then raises with it."}}


def _refused(field: str, message: str, status: int = 400) -> JSONResponse:
    """A request the SDK sent that cannot run: 400 (the SDK retries a bare 400 a few times, then
    raises with this body), naming the field."""
    return JSONResponse(format_errors([{"loc": ("body", *field.split(".")), "msg": message, "type": "invalid"}]),
                        status_code=status)


def _lora_spec(cfg: LoraConfigIn) -> LoraSpec:
    modules = ((["q_proj", "k_proj", "v_proj", "o_proj"] if cfg.train_attn else [])
               + (["gate_proj", "up_proj", "down_proj"] if cfg.train_mlp else [])
               + (["lm_head"] if cfg.train_unembed else []))
    return LoraSpec(r=cfg.rank, alpha=cfg.rank, target_modules=modules)  # alpha = r: the adapter's scale is 1


def owned_run(session, *, model_id: str, owner: str):
    job = ops_q.run_for_model(session, model_id=model_id, owner=owner)
    if job is None:  # another owner's run reads as missing
        raise HTTPException(404, f"model {model_id} not found")
    return job


def _submit_op(settings, session, *, job, kind: str, body: bytes, seq: int | None) -> UntypedFuture:
    """The operation, and an idle run woken, in one transaction on the caller's one connection (a second
    connection taken while holding one starves the pool under concurrent requests)."""
    if job.status in TERMINAL:  # nothing will ever run it: refused, never stored as a future that cannot end
        raise HTTPException(409, f"model {job.uid} has ended ({job.status}): start a new training client",
                            headers={"x-should-retry": "false"})  # the SDK retries a 409 unless told not to
    if seq is not None and (op := ops_q.sent_before(session, job_id=job.id, kind=kind, body=body, seq=seq)):
        return UntypedFuture(request_id=op.request_id, model_id=job.uid)  # a retry: the same future, stored once
    op = ops_q.add_op(session, job=job, kind=kind, body=body, seq=seq)
    uid = ops_q.wake(session, job_id=job.id)
    session.commit()  # both exist before a worker is told
    if uid is not None:
        _enqueue(settings, session, job_id=job.id, uid=uid)
    return UntypedFuture(request_id=op.request_id, model_id=job.uid)


def _enqueue(settings, session, *, job_id: int, uid: str) -> None:
    """Tell a worker, once the run and its operation are committed. With the broker down the answer is still
    the stored operation's future, never a 5xx: the SDK retries a 5xx, and a retry would store the operation
    (or the run) again. The run goes back to idle and the sweep queues it once the broker answers."""
    try:
        queue.enqueue(job_id, uid, broker_url=settings.broker)
    except Exception as exc:  # any transport error: the operation is stored, the sweep delivers it
        ops_q.unwake(session, job_id=job_id, why=f"the broker was unreachable ({type(exc).__name__})")
        session.commit()


def _start_run(settings, session, *, owner: str, spec: SessionJob,
               then: tuple[str, bytes] | None = None) -> UntypedFuture:
    """A new session run, queued with its `create_model` operation (and `then`, an operation after it):
    the future of the last. create_model, a run from a saved state and a base model's sampler start so."""
    job = ops_q.create_run(session, owner=owner, spec=spec)
    op = ops_q.add_op(session, job=job, kind="create_model", body=job.uid.encode(), seq=0)
    if then is not None:
        op = ops_q.add_op(session, job=job, kind=then[0], body=then[1], seq=1)
    session.commit()  # the run and its operations exist before a worker is told
    _enqueue(settings, session, job_id=job.id, uid=job.uid)
    return UntypedFuture(request_id=op.request_id, model_id=job.uid)


@router.get("/healthz", response_model=StatusOut)
def healthz() -> dict:
    return {"status": "ok"}


@router.post("/client/config", response_model=ClientConfigOut)
def client_config(_: ClientConfigIn, owner: OwnerDep) -> dict:
    """The SDK's feature flags for this server: API keys (no JWT exchange), plain httpx, forward_backward
    chunks sent in order and small enough for the body limit, custom losses run client-side."""
    return {"pjwt_auth_enabled": False, "use_pyqwest_transport": False, "parallel_fwdbwd_chunks": False,
            "proto_compress_fwdbwd": True, "fwdbwd_max_chunk_bytes_count": FORWARD_BACKWARD_MAX_BYTES // 2,
            "custom_loss_server_side": False, "sample_use_retrieve_futures": False,
            "sample_join_sampling_session": False}


@router.post("/client/dynamic_config", response_model=DynamicConfigOut)
def client_dynamic_config(_: ClientConfigIn, owner: OwnerDep) -> dict:
    return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}


@router.get("/get_server_capabilities", response_model=CapabilitiesOut)
def server_capabilities(owner: OwnerDep) -> dict:
    """The bundled models (a folder under the admin's model roots also works, by its name)."""
    return {"supported_models": [{"model_name": m, "trainable": True, "sampleable": False} for m in MODEL_PRESETS]}


@router.post("/telemetry", response_model=StatusOut)
def telemetry(owner: OwnerDep) -> dict:
    return {"status": "accepted"}  # the SDK's own diagnostics: not kept here


@router.post("/create_session", response_model=SessionOut)
def create_session(body: CreateSessionIn, owner: OwnerDep, session: SessionDep) -> dict:
    row = ops_q.create_session(session, owner=owner, tags=body.tags, user_metadata=body.user_metadata or {},
                               sdk_version=body.sdk_version)
    return {"type": "create_session", "session_id": row.id}


@router.post("/session_heartbeat", response_model=TypedOut,
             responses=error_responses(404) | {410: {"model": ErrorOut, "description": "The session finished."}})
def session_heartbeat(body: SessionIdIn, owner: OwnerDep, session: SessionDep) -> dict:
    row = ops_q.get_session(session, session_id=body.session_id, owner=owner)
    if row is None:
        raise HTTPException(404, f"session {body.session_id} not found")
    if row.finished_at is not None:
        raise HTTPException(410, f"session {body.session_id} has finished")
    row.heartbeat_at = utcnow()
    return {"type": "session_heartbeat"}


Scope = Annotated[Literal["owned", "accessible"], Query(description="Either way, your own sessions only.")]


@router.get("/sessions", response_model=SessionListOut)
def list_sessions(owner: OwnerDep, session: SessionDep, limit: Annotated[int, Query(ge=1, le=1000)] = 20,
                  offset: Annotated[int, Query(ge=0, le=2**31 - 1)] = 0, access_scope: Scope = "owned") -> dict:
    """Your tinker sessions, newest first."""
    return {"sessions": [s.id for s in ops_q.list_sessions(session, owner=owner, limit=limit, offset=offset)]}


@router.get("/sessions/{session_id}", response_model=SessionInfoOut, responses=error_responses(404))
def get_session(session_id: Annotated[str, Path(max_length=40)], owner: OwnerDep, session: SessionDep,
                access_scope: Scope = "owned") -> dict:
    row = ops_q.get_session(session, session_id=session_id, owner=owner)
    if row is None:
        raise HTTPException(404, f"session {session_id} not found")
    runs = ops_q.session_runs(session, session_id=session_id, owner=owner)
    return {"training_run_ids": [job.uid for job in runs], "sampler_ids": [],
            "user_metadata": {str(k): str(v) for k, v in row.user_metadata.items()} or None}


@router.post("/sessions/{session_id}/finish", status_code=204, responses=error_responses(404))
def finish_session(session_id: Annotated[str, Path(max_length=40)], owner: OwnerDep, session: SessionDep) -> Response:
    row = ops_q.get_session(session, session_id=session_id, owner=owner)
    if row is None:
        raise HTTPException(404, f"session {session_id} not found")
    row.finished_at = row.finished_at or utcnow()
    return Response(status_code=204)


def _model_name(base_model: str) -> str:
    """The service's name of a model the SDK names by its hub name."""
    return {hub: name for name, hub in HUB_NAMES.items()}.get(base_model, base_model)


@router.post("/create_model", response_model=UntypedFuture, responses=error_responses(404) | REFUSED)
def create_model(body: CreateModelIn, owner: OwnerDep, session: SessionDep, settings: SettingsDep):
    if ops_q.get_session(session, session_id=body.session_id, owner=owner) is None:
        raise HTTPException(404, f"session {body.session_id} not found")
    name = _model_name(body.base_model)
    if (why := model_unavailable(name, settings, owner=owner)) is not None:
        return _refused("base_model", why)
    if body.lora_config is not None and not (body.lora_config.train_attn or body.lora_config.train_mlp
                                             or body.lora_config.train_unembed):
        return _refused("lora_config", "train_attn, train_mlp and train_unembed are all false: nothing to train")
    try:
        lora = None if body.lora_config is None else _lora_spec(body.lora_config)
        model = ModelSpec(name=name, lora=lora, dtype="float32")
    except ValidationError as exc:  # a combination the model cannot take (no module to train): named, not a 500
        where = "base_model" if "name" in exc.errors()[0]["loc"] else "lora_config"
        return _refused(where, exc.errors()[0]["msg"])
    spec = SessionJob(name=f"tinker {name}", model=model,
                      session=SessionSpec(tinker_session=body.session_id, model_id=new_uid(),
                                          model_seq_id=body.model_seq_id,
                                          # chosen here when not sent: a run from its saved state builds the same
                                          # base (the tiny test models are built from the seed)
                                          seed=secrets.randbelow(2**32) if body.lora_config is None
                                          or body.lora_config.seed is None else body.lora_config.seed,
                                          idle_timeout_s=settings.session_idle_s))
    return _start_run(settings, session, owner=owner, spec=spec)


@router.post("/get_info", response_model=InfoOut, responses=error_responses(404))
def get_info(body: ModelIdIn, owner: OwnerDep, session: SessionDep) -> dict:
    job = owned_run(session, model_id=body.model_id, owner=owner)
    spec = job.job_spec()
    lora = spec.model.lora
    return {"type": "get_info", "model_id": job.uid, "model_name": spec.model.name, "is_lora": lora is not None,
            "lora_rank": None if lora is None else lora.r,
            "model_data": {"model_name": spec.model.name, "arch": None, "tokenizer_id": None}}


@router.post("/forward_backward", response_model=UntypedFuture, responses=error_responses(404, 409, 413) | REFUSED,
             openapi_extra={"requestBody": {"required": True, "content": {m: {"schema": {
                 "type": "string", "format": "binary"}} for m in (PROTOBUF, OCTET_STREAM)}}})
async def forward_backward(request: Request, owner: ReleasedOwnerDep, settings: SettingsDep):
    body = await request.body()
    if request.headers.get("content-encoding", "") == "zstd":
        body = await run_in_threadpool(_unzstd, body)
        if body is None:
            return _refused("body", "Content-Encoding says zstd; the body is not zstd-compressed")
        if len(body) > FORWARD_BACKWARD_MAX_BYTES:
            return JSONResponse({"detail": f"the body is over {FORWARD_BACKWARD_MAX_BYTES} bytes once "
                                 "decompressed"}, status_code=413)
    try:
        decoded = await run_in_threadpool(decode_forward_backward, body)
    except WireError as exc:
        return _refused(exc.field, exc.message)
    return await run_in_threadpool(_queue_op, settings, owner, decoded.model_id, "forward_backward", body,
                                   decoded.seq_id)


def _unzstd(body: bytes) -> bytes | None:
    """The decompressed body, read to one byte past the limit at most (a small body may expand to any
    size); None when it is not zstd."""
    import zstandard

    try:
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body)) as reader:
            return reader.read(FORWARD_BACKWARD_MAX_BYTES + 1)
    except zstandard.ZstdError:
        return None


def _queue_op(settings, owner: str, model_id: str, kind: str, body: bytes, seq: int | None) -> UntypedFuture:
    with session_scope(settings.store_url) as session:
        job = owned_run(session, model_id=model_id, owner=owner)
        return _submit_op(settings, session, job=job, kind=kind, body=body, seq=seq)


@router.post("/optim_step", responses=error_responses(404, 409))
def optim_step(body: OptimStepIn, owner: ReleasedOwnerDep, settings: SettingsDep) -> UntypedFuture:
    return _queue_op(settings, owner, body.model_id, "optim_step", body.model_dump_json().encode(), body.seq_id)


@router.post("/save_weights_for_sampler", response_model=UntypedFuture, responses=error_responses(404, 409) | REFUSED)
def save_weights_for_sampler(body: SaveForSamplerIn, owner: ReleasedOwnerDep, settings: SettingsDep):
    """A snapshot of the run's weights to sample from (`save_weights_and_get_sampling_client`)."""
    if body.path is not None:  # a named checkpoint to sample from later
        return _save_named(settings, owner, body.model_id, "sampler_weights", body.path, body.seq_id)
    return _queue_op(settings, owner, body.model_id, "save_weights_for_sampler", body.model_dump_json().encode(),
                     body.seq_id)


def _save_named(settings, owner: str, model_id: str, kind: Literal["weights", "sampler_weights"], name: str | None,
                seq_id: int | None):
    if name is None or not re.match(CHECKPOINT_NAME, name):
        return _refused("path", f"a checkpoint name is needed: letters, digits, '_', '.', '-', at most 100 "
                        f"({name!r})")
    body = SaveNamedOp(kind=kind, name=name).model_dump_json().encode()
    return _queue_op(settings, owner, model_id, "save_weights", body, seq_id)


@router.post("/save_weights", response_model=UntypedFuture, responses=error_responses(404, 409) | REFUSED)
def save_weights(body: SaveWeightsIn, owner: ReleasedOwnerDep, settings: SettingsDep):
    """The run's state (weights and optimizer) as `tinker://<model_id>/weights/<name>` (`save_state`)."""
    return _save_named(settings, owner, body.model_id, "weights", body.path, body.seq_id)


@router.post("/load_weights", response_model=UntypedFuture, responses=error_responses(404, 409) | REFUSED)
def load_weights(body: LoadWeightsIn, owner: OwnerDep, session: SessionDep, settings: SettingsDep):
    """A saved checkpoint into a run (`load_state`), or into a new run of this session
    (`create_training_client_from_state`), with its optimizer state when asked."""
    parsed = parse_tinker_path(body.path)
    if parsed is None or (parsed.kind != "weights" and body.optimizer):
        return _refused("path", "expected tinker://<model_id>/weights/<name> (sampler_weights/<name> without the "
                        f"optimizer), got {body.path!r}")
    found = ops_q.find_named(session, path=parsed, owner=owner)
    if found is None:
        raise HTTPException(404, f"checkpoint {body.path} not found")
    source, step = found
    trained = source.job_spec().model
    load = LoadWeightsOp(job=source.id, step=step, optimizer=body.optimizer, path=body.path).model_dump_json().encode()
    if body.model_id is not None:
        target = owned_run(session, model_id=body.model_id, owner=owner)
        if not target.job_spec().model.same_weights_as(trained):
            return _refused("path", f"{body.path} holds weights of {trained.name} with lora "
                            f"{None if trained.lora is None else trained.lora.r}: not the shape of this run")
        return _submit_op(settings, session, job=target, kind="load_weights", body=load,
                          seq=body.seq_id)
    if body.session_id is None or ops_q.get_session(session, session_id=body.session_id, owner=owner) is None:
        raise HTTPException(404, f"session {body.session_id} not found")
    spec = SessionJob(name=f"tinker {trained.name} from {parsed.name}", model=trained,
                      session=SessionSpec(tinker_session=body.session_id, model_id=new_uid(),
                                          model_seq_id=body.model_seq_id or 0, idle_timeout_s=settings.session_idle_s,
                                          seed=source.job_spec().session.seed))
    future = _start_run(settings, session, owner=owner, spec=spec, then=("load_weights", load))
    return future.model_copy(update={"model_id": f"{body.session_id}:train:{spec.session.model_seq_id}"})


class SamplingSessionOut(BaseModel):
    type: Literal["create_sampling_session"] = "create_sampling_session"
    sampling_session_id: str


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
        return _refused("model_path", "not a path of this server: tinker://<model_id>/<weights|sampler_weights>/<name>")
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
        return _refused("base_model", "either model_path or base_model is required")
    name = _model_name(body.base_model)
    if (why := model_unavailable(name, settings, owner=owner)) is not None:
        return _refused("base_model", why)
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
    future = _start_run(settings, session, owner=owner, spec=spec)
    return {"sampling_session_id": sampler_id(future.model_id, 0)}


def _sampler_run(session, *, sampling_session_id: str, owner: str):
    parsed = parse_sampler_id(sampling_session_id)
    if parsed is None:
        raise HTTPException(404, f"sampling session {sampling_session_id} not found")
    job = ops_q.run_for_model(session, model_id=parsed.model_id, owner=owner)
    if job is None:
        raise HTTPException(404, f"sampling session {sampling_session_id} not found")
    return job


@router.get("/samplers/{sampling_session_id}", response_model=SamplerOut, responses=error_responses(404))
def get_sampler(sampling_session_id: Annotated[str, Path(max_length=100)], owner: OwnerDep, session: SessionDep):
    job = _sampler_run(session, sampling_session_id=sampling_session_id, owner=owner)
    return {"sampler_id": sampling_session_id, "base_model": job.job_spec().model.name, "model_path": None}


@router.post("/asample", response_model=UntypedFuture, responses=error_responses(404, 409) | REFUSED)
def asample(body: SampleIn, owner: ReleasedOwnerDep, settings: SettingsDep):
    """Completions of one prompt from a snapshot of a run's weights, run by the run's worker."""
    if any(c.type != "encoded_text" for c in body.prompt.chunks):
        return _refused("prompt.chunks", "only text chunks (token ids) are supported here, not images or audio")
    prompt_len = sum(len(c.tokens) for c in body.prompt.chunks)
    if prompt_len == 0:
        return _refused("prompt", "no tokens")
    try:
        prompt_ask(body, prompt_len=prompt_len)
    except WireError as exc:
        return _refused(exc.field, exc.message)
    positions = body.num_samples * (prompt_len + (body.sampling_params.max_tokens or DEFAULT_MAX_TOKENS))
    if positions > settings.sample_request_tokens:
        return _refused("num_samples", f"{body.num_samples} samples x ({prompt_len} prompt tokens + max_tokens) = "
                        f"{positions} token positions, over this server's {settings.sample_request_tokens} a request "
                        "(GRPO_SAMPLE_REQUEST_TOKENS): send fewer samples or a shorter prompt")
    with session_scope(settings.store_url) as session:
        job = _sampler_run(session, sampling_session_id=body.sampling_session_id, owner=owner)
        future = _submit_op(settings, session, job=job, kind="sample", body=body.model_dump_json().encode(), seq=None)
    return future.model_copy(update={"sample_sequence_ids": [f"{future.request_id}.{i}"
                                                             for i in range(body.num_samples)]})


@router.post("/retrieve_future", response_class=Response, responses=error_responses(404) | {200: {
    "description": "The result as JSON: `{error, category}` when the operation failed, `{type: try_again}` while "
    "it is pending. A forward_backward or sample result is protobuf (`ForwardBackwardOutput`, `SampleResponse`) "
    "only when the request's Accept header asks for application/x-protobuf (the tinker SDK does), JSON otherwise.",
    "content": {PROTOBUF: {"schema": {"type": "string", "format": "binary"}}, "application/json": {"schema": {
        "type": "object"}}}}})
async def retrieve_future(body: RetrieveFutureIn, request: Request, owner: ReleasedOwnerDep,
                          settings: SettingsDep) -> Response:
    """The operation's result once its worker wrote it: protobuf for forward_backward, JSON otherwise;
    `{error, category}` when it failed; `try_again` while it is pending after a wait of up to
    RETRIEVE_WAIT_S, polled without holding a thread or a connection."""
    deadline, pause = time.monotonic() + RETRIEVE_WAIT_S, 0.002
    while True:
        op = await run_in_threadpool(_op_state, settings, body.request_id, owner)
        if op is None:
            raise HTTPException(404, f"request {body.request_id} not found")
        if op.status == "done":
            result = op.result or b""  # a done operation always has one
            if op.result_format != "proto":
                return Response(result, media_type="application/json")
            if PROTOBUF in request.headers.get("accept", ""):
                return Response(result, media_type=PROTOBUF)
            as_json = sample_response_json if op.kind == "sample" else forward_backward_output_json
            return JSONResponse(await run_in_threadpool(as_json, result))
        if op.status == "failed":
            return JSONResponse({"error": op.error, "category": op.category})
        if time.monotonic() >= deadline:
            return JSONResponse({"type": "try_again", "request_id": body.request_id, "queue_state": "active"})
        await asyncio.sleep(pause)
        pause = min(pause * 1.25, 0.1)  # a 20 ms operation is answered within ~5 ms of its end


def _op_state(settings, request_id: str, owner: str) -> OpState | None:
    with session_scope(settings.store_url, read_only=True) as session:
        op = ops_q.op_for(session, request_id=request_id, owner=owner)
        return None if op is None else OpState(kind=op.kind, status=op.status, result=op.result,
                                               result_format=op.result_format, error=op.error, category=op.category)


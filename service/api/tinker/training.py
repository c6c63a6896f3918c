"""A training run's operations: created (`create_model`), described, and its forward_backward
and optim_step, each stored and answered with a future."""

from __future__ import annotations

import io
import secrets

from fastapi import HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from service.api.deps import OwnerDep, ReleasedOwnerDep, SessionDep, SettingsDep
from service.api.schemas import OCTET_STREAM, error_responses
from service.api.sources import model_unavailable
from service.api.tinker.operations import lora_spec, owned_run, queue_op, service_model_name, start_run
from service.api.tinker.schemas import (
    FORWARD_BACKWARD_MAX_BYTES,
    PROTOBUF,
    REFUSED,
    InfoOut,
    UntypedFuture,
    refused,
    tinker_router,
)
from service.core.specs import ModelSpec, SessionJob, SessionSpec
from service.core.tinker.requests import CreateModelIn, ModelIdIn, OptimStepIn
from service.core.tinker.wire import WireError, decode_forward_backward
from service.store import session_ops as ops_q
from service.store.models import new_uid

router = tinker_router()


@router.post("/create_model", response_model=UntypedFuture, responses=error_responses(404) | REFUSED)
def create_model(body: CreateModelIn, owner: OwnerDep, session: SessionDep, settings: SettingsDep):
    if ops_q.get_session(session, session_id=body.session_id, owner=owner) is None:
        raise HTTPException(404, f"session {body.session_id} not found")
    name = service_model_name(body.base_model)
    if (why := model_unavailable(name, settings, owner=owner)) is not None:
        return refused("base_model", why)
    if body.lora_config is not None and not (body.lora_config.train_attn or body.lora_config.train_mlp
                                             or body.lora_config.train_unembed):
        return refused("lora_config", "train_attn, train_mlp and train_unembed are all false: nothing to train")
    try:
        lora = None if body.lora_config is None else lora_spec(body.lora_config)
        model = ModelSpec(name=name, lora=lora, dtype="float32")
    except ValidationError as exc:  # a combination the model cannot take (no module to train): named, not a 500
        where = "base_model" if "name" in exc.errors()[0]["loc"] else "lora_config"
        return refused(where, exc.errors()[0]["msg"])
    spec = SessionJob(name=f"tinker {name}", model=model,
                      session=SessionSpec(tinker_session=body.session_id, model_id=new_uid(),
                                          model_seq_id=body.model_seq_id,
                                          # chosen here when not sent: a run from its saved state builds the same
                                          # base (the tiny test models are built from the seed)
                                          seed=secrets.randbelow(2**32) if body.lora_config is None
                                          or body.lora_config.seed is None else body.lora_config.seed,
                                          idle_timeout_s=settings.session_idle_s))
    return start_run(settings, session, owner=owner, spec=spec)


@router.post("/get_info", response_model=InfoOut, responses=error_responses(404))
def get_info(body: ModelIdIn, owner: OwnerDep, session: SessionDep) -> dict:
    job = owned_run(session, model_id=body.model_id, owner=owner)
    spec = job.job_spec()
    lora = spec.model.lora
    return {"type": "get_info", "model_id": job.uid, "model_name": spec.model.name, "is_lora": lora is not None,
            "lora_rank": None if lora is None else lora.r,
            "model_data": {"model_name": spec.model.name, "arch": None, "tokenizer_id": None}}


@router.post("/forward_backward", response_model=UntypedFuture, responses=error_responses(404, 413) | REFUSED,
             openapi_extra={"requestBody": {"required": True, "content": {m: {"schema": {
                 "type": "string", "format": "binary"}} for m in (PROTOBUF, OCTET_STREAM)}}})
async def forward_backward(request: Request, owner: ReleasedOwnerDep, settings: SettingsDep):
    body = await request.body()
    if request.headers.get("content-encoding", "") == "zstd":
        body = await run_in_threadpool(_unzstd, body)
        if body is None:
            return refused("body", "Content-Encoding says zstd; the body is not zstd-compressed")
        if len(body) > FORWARD_BACKWARD_MAX_BYTES:
            return JSONResponse({"detail": f"the body is over {FORWARD_BACKWARD_MAX_BYTES} bytes once "
                                 "decompressed"}, status_code=413)
    try:
        decoded = await run_in_threadpool(decode_forward_backward, body)
    except WireError as exc:
        return refused(exc.field, exc.message)
    return await run_in_threadpool(queue_op, settings, owner, decoded.model_id, "forward_backward", body,
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



@router.post("/optim_step", responses=error_responses(404))
def optim_step(body: OptimStepIn, owner: ReleasedOwnerDep, settings: SettingsDep) -> UntypedFuture:
    return queue_op(settings, owner, body.model_id, "optim_step", body.model_dump_json().encode(), body.seq_id)

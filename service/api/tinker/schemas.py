"""The tinker API's answers (the SDK's response types, as this server sends them), its limits, and
its one way of refusing a request the SDK sent."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from service.api.schemas import ValidationErrorOut, error_responses
from service.core.errors import format_errors


def tinker_router() -> APIRouter:
    """A router of the tinker API's: its prefix, tag and the errors every route may answer."""
    return APIRouter(prefix="/api/v1", tags=["tinker"], responses=error_responses(401, 422, 503))


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


def refused(field: str, message: str, status: int = 400) -> JSONResponse:
    """A request the SDK sent that cannot run: 400 (the SDK retries a bare 400 a few times, then
    raises with this body), naming the field."""
    return JSONResponse(format_errors([{"loc": ("body", *field.split(".")), "msg": message, "type": "invalid"}]),
                        status_code=status)




class SamplingSessionOut(BaseModel):
    type: Literal["create_sampling_session"] = "create_sampling_session"
    sampling_session_id: str


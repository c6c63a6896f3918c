"""What the SDK asks of a server before it trains: health, its feature flags, the models here."""

from __future__ import annotations

from service.api.deps import OwnerDep
from service.api.tinker.schemas import (
    FORWARD_BACKWARD_MAX_BYTES,
    CapabilitiesOut,
    ClientConfigOut,
    DynamicConfigOut,
    StatusOut,
    tinker_router,
)
from service.core.specs import MODEL_PRESETS
from service.core.tinker.requests import ClientConfigIn

router = tinker_router()


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



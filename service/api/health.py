"""Liveness, readiness (store, broker and artifact store reachable) and Prometheus metrics."""

from __future__ import annotations

import hmac
from typing import Literal

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel

from service.api.deps import SettingsDep
from service.core import queue
from service.core.artifacts import open_store
from service.store.db import ping

router = APIRouter(tags=["health"])


class Liveness(BaseModel):
    status: Literal["ok"]


@router.get("/healthz", response_model=Liveness)
def healthz():
    """The process answers (nothing else is checked: /readyz does)."""
    return {"status": "ok"}


class Readiness(BaseModel):
    ready: bool
    checks: dict[str, str]  # store, broker, artifacts: "ok" or what is wrong


@router.get("/readyz", response_model=Readiness, responses={503: {"model": Readiness, "description": "Not ready: "
                                                                  "`checks` says what is missing."}})
def readyz(settings: SettingsDep, request: Request):
    """Ready when the store is reachable and migrated, and the broker and the artifact store are reachable;
    says what is missing."""
    checks = {}
    schema = request.app.state.schema
    try:
        ping(settings.store_url)
        checks["store"] = "ok" if schema.ready.is_set() else f"not migrated yet ({schema.error or 'migrating'})"
    except Exception as exc:
        checks["store"] = f"unreachable: {type(exc).__name__}"
    checks["broker"] = "ok" if queue.broker_reachable(settings.broker) else "unreachable"
    try:
        open_store(settings).ping()
        checks["artifacts"] = "ok"
    except Exception as exc:  # the message names the store, never its credentials
        checks["artifacts"] = f"unreachable: {exc.__cause__.__class__.__name__ if exc.__cause__ else type(exc).__name__}"
    ready = all(v == "ok" for v in checks.values())
    return JSONResponse({"ready": ready, "checks": checks}, status_code=200 if ready else 503)


@router.get("/metrics", include_in_schema=False)
def prometheus(request: Request, settings: SettingsDep):
    """Prometheus exposition; with GRPO_METRICS_TOKEN set, only for `Authorization: Bearer <that token>`."""
    if settings.metrics_token is not None:
        sent = request.headers.get("authorization", "")
        if not hmac.compare_digest(sent.encode(), f"Bearer {settings.metrics_token.get_secret_value()}".encode()):
            return JSONResponse({"detail": "send 'Authorization: Bearer <GRPO_METRICS_TOKEN>'"}, status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})
    return Response(generate_latest(request.app.state.registry), media_type=CONTENT_TYPE_LATEST)

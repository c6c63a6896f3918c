"""create_app(): the FastAPI application, its routers, error shapes and the dashboard mount."""

from __future__ import annotations

import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from starlette.types import ASGIApp, Receive, Scope, Send

from service.api import health, jobs, metrics, reports, specs
from service.api.errors import format_errors
from service.settings import Settings, get_settings
from service.specs import STATUSES
from service.store import jobs as jobs_q
from service.store.db import session_scope

DASHBOARD_DIR = Path(__file__).parent / "dashboard"


class BodySizeLimit:
    """413 for bodies over the limit, whether or not the client sent Content-Length."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._reject(send)
        seen = 0

        async def limited() -> dict:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise _TooLarge
            return message

        try:
            await self.app(scope, limited, send)
        except _TooLarge:
            await self._reject(send)

    async def _reject(self, send: Send) -> None:
        body = f'{{"detail":"request body larger than {self.max_bytes} bytes"}}'.encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass


async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    return JSONResponse(format_errors(exc.errors()), status_code=422)


class _JobCollector:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def collect(self):
        g = GaugeMetricFamily("grpo_jobs", "Jobs in the store by status", labels=["status"])
        try:
            with session_scope(self.settings.store_url) as s:
                counts = jobs_q.count_by_status(s)
        except Exception:
            counts = {}
        for st in STATUSES:
            g.add_metric([st], counts.get(st, 0))
        yield g


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    app = FastAPI(
        title="grpo-jobs",
        version="0.1.0",
        description="Submit GRPO, TracIn-selected GRPO and joint retriever+generator GRPO training jobs; "
        "poll, stream and chart their metrics and reports. Authenticate with `Authorization: Bearer <key>` "
        f"(`grpo-jobs keys create --owner NAME`). Request bodies are limited to {settings.max_body_bytes} bytes.",
    )
    app.state.settings = settings
    registry = CollectorRegistry()
    registry.register(_JobCollector(settings))
    requests = Counter("grpo_http_requests", "HTTP requests", ["method", "route", "status"], registry=registry)
    latency = Histogram("grpo_http_request_seconds", "HTTP request latency", ["route"], registry=registry)
    app.state.registry = registry

    @app.middleware("http")
    async def _count(request: Request, call_next):
        t0 = time.perf_counter()
        response = await call_next(request)
        route = getattr(request.scope.get("route"), "path", "unmatched")
        requests.labels(request.method, route, str(response.status_code)).inc()
        latency.labels(route).observe(time.perf_counter() - t0)
        return response

    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    app.add_exception_handler(RequestValidationError, _validation_error)
    for r in (health.router, jobs.router, metrics.router, reports.router, specs.router):
        app.include_router(r)
    if (DASHBOARD_DIR / "index.html").exists():
        app.mount("/", StaticFiles(directory=DASHBOARD_DIR, html=True), name="dashboard")
    return app

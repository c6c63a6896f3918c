"""create_app(): the FastAPI application wired from its parts: routers, the body limit, strict
routing, error shapes, security headers, Prometheus metrics, the store's readiness, the dashboard."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.staticfiles import StaticFiles

from service import webhook_delivery
from service.api import (
    errors,
    files,
    health,
    jobs,
    prometheus,
    reports,
    rewards,
    series,
    specs,
    stream,
    tinker,
    webhooks,
    workers,
)
from service.api.body_limit import BodySizeLimit
from service.api.errors import store_unavailable
from service.api.readiness import StoreSchema
from service.api.security import security_headers
from service.api.strict import StrictRouting
from service.core import tracing
from service.core.settings import Settings, get_settings

DASHBOARD_DIR = Path(__file__).parent / "dashboard"
ROUTERS = (health.router, jobs.router, stream.router, series.router, reports.router, rewards.router,
           specs.router, files.router, *tinker.ROUTERS, webhooks.router, workers.router,
           workers.nodes_router)


def serve_app() -> FastAPI:
    """`grpo-jobs serve`'s app, made in each of its processes: it migrates the store in the background."""
    return create_app(migrate=True)


def create_app(settings: Settings | None = None, *, migrate: bool = False) -> FastAPI:
    """The API. With `migrate`, the store is migrated in the background (retrying until it is
    reachable) and /v1 answers 503 until then."""
    settings = settings or get_settings()
    schema = StoreSchema(settings, migrate=migrate)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        task = asyncio.create_task(schema.run()) if not schema.ready.is_set() else None
        sender = webhook_delivery.deliverer(settings, ready=schema.ready.is_set)  # webhooks, in a thread
        sender.start()
        yield
        sender.stop()
        if task is not None:
            task.cancel()

    app = FastAPI(
        lifespan=lifespan,
        title="grpo-jobs",
        version="0.1.0",
        description="Submit GRPO, TracIn-selected GRPO and joint retriever+generator GRPO training jobs; "
        "poll, stream and chart their metrics and reports. Authenticate with `Authorization: Bearer <key>` "
        f"(`grpo-jobs keys create --owner NAME`). Request bodies are limited to {settings.max_body_bytes} bytes, "
        f"file uploads to {settings.max_file_bytes} bytes.",
    )
    if tracing.setup("grpo-jobs-api"):  # OTEL_EXPORTER_OTLP_ENDPOINT set: a span per request
        from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

        FastAPIInstrumentor.instrument_app(app, excluded_urls="healthz,readyz,metrics")
    app.state.settings = settings
    app.state.schema = schema
    app.state.upload_slots = files.UploadSlots(per_process=settings.max_uploads,
                                               per_owner=settings.max_uploads_per_owner)
    app.state.stream_hub = stream.StreamHub(settings.store_url)

    async def ready_and_headed(request: Request, call_next):
        if not schema.ready.is_set() and request.url.path.startswith(("/v1/", "/api/v1/")):
            response = store_unavailable("not migrated yet")
        else:
            response = await call_next(request)
        response.headers.update(security_headers(request.url.path))
        return response

    prometheus.install(app, settings, before=ready_and_headed)
    app.add_middleware(StrictRouting, routes=[route for r in ROUTERS for route in r.routes])
    # an upload may carry a file of max_file_bytes, plus its multipart framing
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes,
                       streamed={"/v1/files": settings.max_file_bytes + 64 * 1024,
                                "/api/v1/forward_backward": tinker.FORWARD_BACKWARD_MAX_BYTES},
                       gates={"/v1/files": app.state.upload_slots.receiving})
    errors.install(app)
    for r in ROUTERS:
        app.include_router(r)
    if (DASHBOARD_DIR / "index.html").exists():
        app.mount("/", StaticFiles(directory=DASHBOARD_DIR, html=True), name="dashboard")
    return app

"""create_app(): the FastAPI application, its routers, error shapes and the dashboard mount."""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from sqlalchemy.exc import DBAPIError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api import files, health, jobs, metrics, reports, rewards, specs, stream
from service.api.errors import format_errors
from service.api.strict import StrictRouting
from service.core.artifacts import ArtifactStoreError
from service.core.settings import Settings, get_settings
from service.core.specs import STATUSES
from service.store import jobs as jobs_q
from service.store.db import is_unreachable, session_scope

DASHBOARD_DIR = Path(__file__).parent / "dashboard"
log = logging.getLogger(__name__)


class _TooLarge(Exception):
    pass


class BodySizeLimit:
    """413 for bodies over the limit, whether or not the client sent Content-Length.

    The body is read (up to the limit) before the app sees it, so an oversize chunked body is a
    413 on every route, never a parse error half-way through. Uploads (`streamed` paths) are not
    buffered: they stream to the route under their own, larger limit, and going past it ends the
    request with the same 413."""

    def __init__(self, app: ASGIApp, max_bytes: int, streamed: dict[str, int] | None = None) -> None:
        self.app, self.max_bytes, self.streamed = app, max_bytes, streamed or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        limit = self.streamed.get(scope["path"].rstrip("/")) if scope["method"] == "POST" else None
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > (limit or self.max_bytes):
            return await self._reject(send, limit or self.max_bytes)
        if limit is not None:
            return await self._stream(scope, receive, send, limit)
        chunks, seen = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > self.max_bytes:
                return await self._reject(send, self.max_bytes)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # after the body: wait for the disconnect as the app expects

        await self.app(scope, replay, send)

    async def _stream(self, scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        seen, started, over = 0, False, False

        async def counted() -> Message:
            nonlocal seen, over
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit:
                over = True
                raise _TooLarge
            return message

        async def sending(message: Message) -> None:
            nonlocal started
            if over:  # the app answered the cut-off body (as a parse error): answer 413 instead
                if not started and message["type"] == "http.response.start":
                    started = True
                    await self._reject(send, limit)
                return
            started = True
            await send(message)

        try:
            await self.app(scope, counted, sending)
        except _TooLarge:
            if not started:
                await self._reject(send, limit)

    async def _reject(self, send: Send, limit: int) -> None:
        body = f'{{"detail":"request body larger than {limit} bytes"}}'.encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    return JSONResponse(format_errors(exc.errors()), status_code=422)


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    # FastAPI answers a body that json.loads refused for other reasons than syntax (nested too
    # deep, a number too long) with a bare 400; it gets the shape of every other malformed body.
    if exc.status_code == 400 and request.headers.get("content-type", "").startswith("multipart/"):
        # Starlette's multipart parser refused the body (framing, a missing boundary, too many parts)
        why = "" if exc.detail == "There was an error parsing the body" else f" ({exc.detail})"
        return JSONResponse(format_errors([{"loc": ("body",), "type": "multipart_invalid",
                                            "msg": f"not a valid multipart/form-data body{why}"}]), 422)
    if exc.status_code == 400 and exc.detail == "There was an error parsing the body":
        return JSONResponse(format_errors([{"loc": ("body",), "type": "json_invalid",
                                            "msg": "not valid JSON: nested too deeply or a number too long"}]), 422)
    return await http_exception_handler(request, exc)


STORE_RETRY_AFTER_S = 5


def store_unavailable(reason: str) -> JSONResponse:
    """503 with Retry-After: the request was fine, the store is not (yet) reachable."""
    return JSONResponse({"detail": f"the job store is unavailable ({reason}); retry shortly"}, status_code=503,
                        headers={"Retry-After": str(STORE_RETRY_AFTER_S)})


async def _artifact_store_error(_: Request, exc: ArtifactStoreError) -> JSONResponse:
    log.warning("%s", exc)
    return JSONResponse({"detail": "the artifact store is unavailable; retry shortly"}, status_code=503,
                        headers={"Retry-After": str(STORE_RETRY_AFTER_S)})


async def _store_error(_: Request, exc: DBAPIError) -> JSONResponse:
    if not is_unreachable(exc):
        raise exc  # a statement the store refused is a bug, not an outage: let it surface as 500
    log.warning("store unreachable: %s", type(exc.orig).__name__ if exc.orig else type(exc).__name__)
    return store_unavailable("unreachable")


class StoreSchema:
    """Migrates the store in the background until it succeeds, so `serve` starts (and answers
    /healthz, /readyz and 503s) while the store is still down."""

    def __init__(self, settings: Settings, *, migrate: bool) -> None:
        self.settings = settings
        self.ready = threading.Event()
        self.error: str | None = None
        if not migrate:
            self.ready.set()

    async def run(self, retry_s: float = 2.0) -> None:
        from service.store.migrate import upgrade

        while not self.ready.is_set():
            try:
                await run_in_threadpool(upgrade, self.settings.store_url)
            except Exception as exc:
                self.error = f"{type(exc).__name__}"
                log.warning("store not migrated yet (%s); retrying in %.0f s", self.error, retry_s)
                await asyncio.sleep(retry_s)
            else:
                self.error = None
                self.ready.set()


DASHBOARD_CSP = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
                 "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
API_PREFIXES = ("/v1/", "/docs", "/redoc", "/openapi.json", "/healthz", "/readyz", "/metrics")


def security_headers(path: str) -> dict[str, str]:
    """Headers for every response; the dashboard's pages also get a CSP without inline script
    (the API's /docs page loads Swagger UI with an inline script, so it is only kept unframed)."""
    headers = {"X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "X-Frame-Options": "DENY"}
    dashboard = not path.startswith(API_PREFIXES)
    headers["Content-Security-Policy"] = DASHBOARD_CSP if dashboard else "frame-ancestors 'none'"
    return headers


class RedactTokens(logging.Filter):
    """Access logs print the request line: keep stream tokens (the only credential a URL may
    carry) out of them."""

    PATTERN = re.compile(r"(access_token=)[^&\s]*")

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(self.PATTERN.sub(r"\1[redacted]", a) if isinstance(a, str) else a
                                for a in record.args)
        return True


_access_log = logging.getLogger("uvicorn.access")
if not any(isinstance(f, RedactTokens) for f in _access_log.filters):
    _access_log.addFilter(RedactTokens())


class _JobCollector:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def collect(self):
        up = GaugeMetricFamily("grpo_store_up", "1 if the job store answered this scrape, else 0")
        try:
            with session_scope(self.settings.store_url) as s:
                counts = jobs_q.count_by_status(s)
        except Exception:  # no job counts at all rather than zeros that look like an empty store
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        g = GaugeMetricFamily("grpo_jobs", "Jobs in the store by status", labels=["status"])
        for st in STATUSES:
            g.add_metric([st], counts.get(st, 0))
        yield g


def create_app(settings: Settings | None = None, *, migrate: bool = False) -> FastAPI:
    """The API. With `migrate`, the store is migrated in the background (retrying until it is
    reachable) and /v1 answers 503 until then."""
    settings = settings or get_settings()
    schema = StoreSchema(settings, migrate=migrate)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        task = asyncio.create_task(schema.run()) if not schema.ready.is_set() else None
        yield
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
    app.state.settings = settings
    app.state.schema = schema
    app.state.upload_slots = files.UploadSlots(per_process=settings.max_uploads,
                                               per_owner=settings.max_uploads_per_owner)
    app.state.stream_hub = stream.StreamHub(settings.store_url)
    registry = CollectorRegistry()
    registry.register(_JobCollector(settings))
    requests = Counter("grpo_http_requests", "HTTP requests", ["method", "route", "status"], registry=registry)
    latency = Histogram("grpo_http_request_seconds", "HTTP request latency", ["route"], registry=registry)
    app.state.registry = registry

    @app.middleware("http")
    async def _count(request: Request, call_next):
        t0 = time.perf_counter()
        if not schema.ready.is_set() and request.url.path.startswith("/v1/"):
            response = store_unavailable("not migrated yet")
        else:
            response = await call_next(request)
        response.headers.update(security_headers(request.url.path))
        route = getattr(request.scope.get("route"), "path", "unmatched")
        requests.labels(request.method, route, str(response.status_code)).inc()
        latency.labels(route).observe(time.perf_counter() - t0)
        return response

    routers = (health.router, jobs.router, stream.router, metrics.router, reports.router, rewards.router,
               specs.router, files.router)
    app.add_middleware(StrictRouting, routes=[route for r in routers for route in r.routes])
    # an upload may carry a file of max_file_bytes, plus its multipart framing
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes,
                       streamed={"/v1/files": settings.max_file_bytes + 64 * 1024})
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(DBAPIError, _store_error)
    app.add_exception_handler(ArtifactStoreError, _artifact_store_error)
    for r in routers:
        app.include_router(r)
    if (DASHBOARD_DIR / "index.html").exists():
        app.mount("/", StaticFiles(directory=DASHBOARD_DIR, html=True), name="dashboard")
    return app

"""Error shapes: every validation failure as `detail[]` of {field, message, type, loc} plus a summary
(service/core/errors.py); an unreachable store or artifact store as a 503 with Retry-After; and the
exception handlers that give every error its documented shape (`install`)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.api.conditional import NotModified, not_modified
from service.core.artifacts import ArtifactStoreError
from service.core.errors import format_errors
from service.store.db import is_unreachable

log = logging.getLogger(__name__)


async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    return JSONResponse(format_errors(exc.errors()), status_code=422)


async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
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


async def artifact_store_error(_: Request, exc: ArtifactStoreError) -> JSONResponse:
    log.warning("%s", exc)
    return JSONResponse({"detail": "the artifact store is unavailable; retry shortly"}, status_code=503,
                        headers={"Retry-After": str(STORE_RETRY_AFTER_S)})


async def store_error(_: Request, exc: DBAPIError) -> JSONResponse:
    if not is_unreachable(exc):
        raise exc  # a statement the store refused is a bug, not an outage: let it surface as 500
    log.warning("store unreachable: %s", type(exc.orig).__name__ if exc.orig else type(exc).__name__)
    return store_unavailable("unreachable")


async def store_busy(_: Request, exc: PoolTimeout) -> JSONResponse:
    log.warning("store connection pool exhausted: %s", exc)
    return store_unavailable("every connection is busy")


def install(app: FastAPI) -> None:
    app.add_exception_handler(NotModified, not_modified)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(DBAPIError, store_error)
    app.add_exception_handler(PoolTimeout, store_busy)
    app.add_exception_handler(ArtifactStoreError, artifact_store_error)

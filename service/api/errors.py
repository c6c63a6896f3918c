"""Error shapes: every validation failure as `detail[]` of {field, message, type, loc} plus a
summary; an unreachable store or artifact store as a 503 with Retry-After; and the exception
handlers that give every error its documented shape (`install`)."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.core.artifacts import ArtifactStoreError
from service.core.reward_specs import ENTRY_MODELS
from service.core.specs import KINDS
from service.store.db import is_unreachable

log = logging.getLogger(__name__)


def field_path(loc: tuple) -> str:
    """`grpo.num_generations` from pydantic's loc, without the request part or the union tag."""
    parts = [str(p) for p in loc if p != "body"]
    # A discriminated union puts the chosen kind first in the path; it is not a field
    # (a loc of the tag alone is a rule over the whole spec: field "").
    if parts and parts[0] in KINDS:
        parts = parts[1:]
    # A rewards entry's kind tag follows its index: rewards.0.judge.rubric -> rewards.0.rubric
    if len(parts) > 2 and parts[0] == "rewards" and parts[1].isdigit() and parts[2] in ENTRY_MODELS:
        parts = parts[:2] + parts[3:]
    return ".".join(parts)


def format_errors(errors: Iterable[dict]) -> dict:
    detail = []
    for e in errors:
        loc = tuple(e.get("loc", ()))
        msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
        detail.append({"field": field_path(loc), "message": msg, "type": e.get("type"), "loc": list(loc)})
    summary = "; ".join(f"{x['field'] or 'body'}: {x['message']}" for x in detail)
    return {"detail": detail, "message": summary}


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
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(DBAPIError, store_error)
    app.add_exception_handler(PoolTimeout, store_busy)
    app.add_exception_handler(ArtifactStoreError, artifact_store_error)

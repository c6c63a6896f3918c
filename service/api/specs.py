"""Validate a spec written as YAML or JSON, with the source line of every error (the dashboard's submit form)."""

from __future__ import annotations

import yaml
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

from service.api.deps import OwnerDep, SettingsDep
from service.api.schemas import error_responses
from service.api.sources import check_sources
from service.core.errors import format_errors
from service.core.settings import Settings
from service.core.spec_text import SpecTextBeyondLimits, SpecTextError, parse_spec_text
from service.core.specs import parse_spec
from service.store.db import session_scope

router = APIRouter(prefix="/v1/specs", tags=["specs"], responses=error_responses(401, 413, 422, 503))
# YAML is read as text, whatever it holds (the answer says what is wrong with it), so its schema
# sets no type; a JSON body must be an object.
_YAML_TEXT = {"schema": {"description": "The spec as YAML text."}}
_TEXT_BODY = {"requestBody": {"required": True, "content": {
    "application/yaml": _YAML_TEXT, "text/plain": _YAML_TEXT, "application/json": {"schema": {"type": "object"}}}}}


class SpecError(BaseModel):
    field: str
    message: str
    type: str | None = None
    loc: list = []
    line: int | None = None  # 1-based line in the submitted text


class SpecCheck(BaseModel):
    valid: bool
    kind: str | None = None
    spec: dict | None = None  # with every default filled in: what POST /v1/jobs would store
    detail: list[SpecError] = []
    message: str | None = None


def line_of(root: yaml.Node | None, field: str) -> int | None:
    """1-based line of `field` (a dotted path like `grpo.num_generations` or `rewards.0.name`) in the
    composed YAML; for a missing field, the line of its nearest present parent."""
    node, line = root, (root.start_mark.line + 1 if root is not None else None)
    for part in [p for p in field.split(".") if p]:
        if isinstance(node, yaml.MappingNode):
            match = next(((k, v) for k, v in node.value if getattr(k, "value", None) == part), None)
            if match is None:
                return line
            node, line = match[1], match[0].start_mark.line + 1
        elif isinstance(node, yaml.SequenceNode) and part.isdigit() and int(part) < len(node.value):
            node = node.value[int(part)]
            line = node.start_mark.line + 1
        else:
            return line
    return line


def _check_sources(spec, settings: Settings, owner: str) -> list[dict]:
    with session_scope(settings.store_url, read_only=True) as session:
        return check_sources(spec, settings, session=session, owner=owner)


def _refuse(message: str, type_: str) -> JSONResponse:
    return JSONResponse(format_errors([{"loc": ("body",), "msg": message, "type": type_}]), 422)


def _error(detail: list[dict], message: str) -> SpecCheck:
    return SpecCheck(valid=False, detail=detail, message=message)


@router.post("/validate", response_model=SpecCheck, openapi_extra=_TEXT_BODY)
async def validate_spec(request: Request, owner: OwnerDep, settings: SettingsDep):
    """Check a YAML or JSON job spec without submitting it (a linter: the answer is 200 for any
    YAML text). Valid: the spec with every default filled in. Invalid: each error with the field
    it names and its line in the text, in the same shape as a 422 from POST /v1/jobs. A body
    that is no spec at all is a 422: none, beyond the parsing limits, or JSON that is not an object."""
    body = await request.body()
    if not body.strip():
        return _refuse("send the spec as the request body", "missing")
    as_json = "json" in request.headers.get("content-type", "")
    try:  # off the event loop: a large text must not stall other requests
        parsed = await run_in_threadpool(parse_spec_text, body.decode("utf-8", errors="replace"))  # JSON is YAML
    except SpecTextBeyondLimits as exc:
        return _refuse(exc.message, "limit")
    except SpecTextError as exc:
        if as_json:
            return _refuse(exc.message, "json_invalid")
        return _error([{"field": "", "message": exc.message, "type": "yaml", "loc": [], "line": exc.line}],
                      exc.message)
    data, root = parsed.data, parsed.root
    if not isinstance(data, dict):
        msg = "a spec is a mapping of fields (kind, model, dataset, ...)"
        if as_json:
            return _refuse(msg, "dict_type")
        return _error([{"field": "", "message": msg, "type": "type", "loc": [], "line": 1}], msg)
    try:
        spec = await run_in_threadpool(parse_spec, data)
        errors = await run_in_threadpool(_check_sources, spec, settings, owner)
    except ValidationError as exc:
        errors = exc.errors()
    if errors:
        out = format_errors(errors)
        for d in out["detail"]:
            d["line"] = line_of(root, d["field"])
        return SpecCheck(valid=False, kind=data.get("kind") if isinstance(data.get("kind"), str) else None, **out)
    return SpecCheck(valid=True, kind=spec.kind, spec=spec.model_dump(mode="json"))

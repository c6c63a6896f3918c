"""Validate a spec written as YAML or JSON, with the source line of every error (the dashboard's submit form)."""

from __future__ import annotations

import yaml
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from pydantic import BaseModel, TypeAdapter, ValidationError

from service.api.deps import OwnerDep, SettingsDep
from service.api.errors import format_errors
from service.sources import check_sources, for_owner
from service.spec_text import SpecTextBeyondLimits, SpecTextError, parse_spec_text
from service.specs import JobSpec

router = APIRouter(prefix="/v1/specs", tags=["specs"])
_ADAPTER: TypeAdapter = TypeAdapter(JobSpec)
_TEXT_BODY = {"requestBody": {"required": True, "content": {
    "application/yaml": {"schema": {"type": "string"}}, "text/plain": {"schema": {"type": "string"}},
    "application/json": {"schema": {"type": "object"}}}}}


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


def _error(detail: list[dict], message: str) -> SpecCheck:
    return SpecCheck(valid=False, detail=detail, message=message)


@router.post("/validate", response_model=SpecCheck, openapi_extra=_TEXT_BODY)
async def validate_spec(request: Request, owner: OwnerDep, settings: SettingsDep):
    """Check a YAML or JSON job spec without submitting it (a linter: the answer is 200 either way).
    Valid: the spec with every default filled in. Invalid: each error with the field it names
    and its line in the text, in the same shape as a 422 from POST /v1/jobs."""
    text = (await request.body()).decode("utf-8", errors="replace")
    try:  # off the event loop: a large text must not stall other requests
        parsed = await run_in_threadpool(parse_spec_text, text)  # JSON is YAML
    except SpecTextBeyondLimits as exc:  # not a spec a linter can help with: refuse the body
        return JSONResponse(format_errors([{"loc": ("body",), "msg": exc.message, "type": "limit"}]), 422)
    except SpecTextError as exc:
        msg = exc.message
        return _error([{"field": "", "message": msg, "type": "yaml", "loc": [], "line": exc.line}], msg)
    data, root = parsed.data, parsed.root
    if not isinstance(data, dict):
        msg = "a spec is a mapping of fields (kind, model, dataset, ...)"
        return _error([{"field": "", "message": msg, "type": "type", "loc": [], "line": 1}], msg)
    try:
        spec = await run_in_threadpool(_ADAPTER.validate_python, data)
        errors = await run_in_threadpool(check_sources, spec, for_owner(settings, owner))
    except ValidationError as exc:
        errors = exc.errors()
    if errors:
        out = format_errors(errors)
        for d in out["detail"]:
            d["line"] = line_of(root, d["field"])
        return SpecCheck(valid=False, kind=data.get("kind") if isinstance(data.get("kind"), str) else None, **out)
    return SpecCheck(valid=True, kind=spec.kind, spec=spec.model_dump(mode="json"))

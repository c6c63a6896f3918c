"""A validation failure as a person reads it: `detail[]` of {field, message, type, loc} plus a one-line
summary. The API answers it as a 422; `grpo-jobs run` and `submit` print it with each field's line."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from service.core.reward_specs import ENTRY_MODELS
from service.core.specs import KINDS


def field_path(loc: tuple[int | str, ...]) -> str:
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


def format_errors(errors: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    detail = []
    for e in errors:
        loc = tuple(e.get("loc", ()))
        msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
        detail.append({"field": field_path(loc), "message": msg, "type": e.get("type"), "loc": list(loc)})
    summary = "; ".join(f"{x['field'] or 'body'}: {x['message']}" for x in detail)
    return {"detail": detail, "message": summary}

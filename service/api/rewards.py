"""GET /v1/rewards: every reward a spec may name on this deployment, with its parameters."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter
from pydantic import BaseModel, Field

from service.api.deps import OwnerDep, SettingsDep
from service.api.schemas import error_responses
from service.core.reward_specs import (
    BUILTIN_REWARDS,
    ENTRY_MODELS,
    MODEL_KINDS,
    plugins,
)

router = APIRouter(prefix="/v1/rewards", tags=["rewards"], responses=error_responses(401, 503))
_COMMON = ("name", "weight", "tag")


class RewardParam(BaseModel):
    name: str
    description: str | None = None
    default: object | None = None
    required: bool = False
    schema_: dict = Field({}, alias="schema")  # the JSON schema of its values

    model_config = {"populate_by_name": True}


class RewardOut(BaseModel):
    name: str  # what a rewards entry's `name` says
    kind: Literal["function", "plugin", "reward_model", "judge", "similarity", "http"]
    description: str
    parameters: list[RewardParam]  # besides name, weight and tag, which every entry has


class RewardsOut(BaseModel):
    items: list[RewardOut]
    http_url_prefixes: list[str]  # the URLs an `http` grader may be under (GRPO_REWARD_URLS, canonical form); empty: none


def _params(kind: str) -> list[RewardParam]:
    model = ENTRY_MODELS[kind]
    schema = model.model_json_schema()
    out = []
    for name, field in model.model_fields.items():
        if name in _COMMON:
            continue
        prop = schema["properties"][name]
        out.append(RewardParam(name=name, description=field.description, required=field.is_required(),
                               default=None if field.is_required() else field.get_default(call_default_factory=True),
                               schema_={k: v for k, v in prop.items() if k not in ("description", "title")}))
    return out


@router.get("", response_model=RewardsOut, summary="The rewards a spec may name here")
def list_rewards(owner: OwnerDep, settings: SettingsDep) -> RewardsOut:
    """Built-in functions, the plugins installed on this deployment, and the model-based and remote
    kinds with their parameters. `http` is listed only where the admin allows some grader URLs."""
    items = [RewardOut(name=n, kind="function", description=d, parameters=[]) for n, d in BUILTIN_REWARDS.items()]
    items += [RewardOut(name=n, kind="plugin", description=f"installed reward function {where}", parameters=[])
              for n, where in plugins().items() if n not in BUILTIN_REWARDS]
    for kind in MODEL_KINDS:
        if kind == "http" and not settings.reward_urls:
            continue
        doc = (ENTRY_MODELS[kind].__doc__ or "").strip()
        items.append(RewardOut(name=kind, kind=kind, description=" ".join(doc.split()), parameters=_params(kind)))
    return RewardsOut(items=items, http_url_prefixes=[str(u) for u in settings.reward_urls])

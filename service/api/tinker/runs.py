"""The tinker SDK's RestClient on this server: an owner's training runs (session jobs) and the names
their checkpoints were saved under (`tinker://<run>/<weights|sampler_weights>/<name>`).

  GET    /training_runs                          a page of runs, newest first
  GET    /training_runs/{run}                    one run, with its newest named checkpoints
  GET    /training_runs/{run}/checkpoints        a run's named checkpoints
  GET    /checkpoints                            a page of the owner's named checkpoints, newest first
  DELETE /training_runs/{run}/checkpoints/{kind}/{name}   the name goes; the step's checkpoint stays the run's
  POST   /weights_info                           what a path holds: base model and LoRA rank

Another owner's runs and paths read as missing (404).
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from fastapi import HTTPException, Path, Query, Response
from pydantic import BaseModel, ConfigDict, Field

from service.api.deps import OwnerDep, SessionDep
from service.api.schemas import error_responses
from service.api.tinker.operations import owned_run
from service.api.tinker.schemas import tinker_router
from service.core.tinker.requests import Wire
from service.core.tinker.wire import CHECKPOINT_KINDS, CHECKPOINT_NAME, parse_tinker_path, tinker_path
from service.store import session_ops as ops_q
from service.store.models import Job

router = tinker_router()
RunId = Annotated[str, Path(max_length=100)]


class CursorOut(BaseModel):
    offset: int
    limit: int
    total_count: int


class TinkerCheckpointOut(BaseModel):
    checkpoint_id: str  # <kind>/<name>
    checkpoint_type: Literal["training", "sampler"]
    time: datetime
    tinker_path: str
    size_bytes: int | None = None
    public: bool = False


class CheckpointsOut(BaseModel):
    checkpoints: list[TinkerCheckpointOut]
    cursor: CursorOut | None = None


class TrainingRunOut(BaseModel):
    training_run_id: str
    base_model: str
    model_owner: str
    is_lora: bool
    corrupted: bool = False
    lora_rank: int | None = None
    last_request_time: datetime
    last_checkpoint: TinkerCheckpointOut | None = None
    last_sampler_checkpoint: TinkerCheckpointOut | None = None
    user_metadata: dict[str, str] | None = None


class TrainingRunsOut(BaseModel):
    training_runs: list[TrainingRunOut]
    cursor: CursorOut


class WeightsInfoIn(Wire):
    tinker_path: str = Field(max_length=300)


class WeightsInfoOut(BaseModel):
    model_config = ConfigDict(protected_namespaces=())
    base_model: str
    is_lora: bool
    lora_rank: int | None = None
    train_unembed: bool | None = None
    train_mlp: bool | None = None
    train_attn: bool | None = None


def _checkpoint(named: ops_q.NamedCheckpoint) -> TinkerCheckpointOut:
    job, name, step = named
    return TinkerCheckpointOut(checkpoint_id=f"{name.kind}/{name.name}", time=name.created_at,
                         checkpoint_type="training" if name.kind == "weights" else "sampler",
                         tinker_path=tinker_path(job.uid, name.kind, name.name),
                         size_bytes=None if step is None else step.size_bytes)


def _weights(job: Job) -> WeightsInfoOut:
    model = job.job_spec().model
    if model.lora is None:
        return WeightsInfoOut(base_model=model.name, is_lora=False)
    every = model.lora.target_modules == "all-linear"
    modules = set() if every else set(model.lora.target_modules)
    return WeightsInfoOut(base_model=model.name, is_lora=True, lora_rank=model.lora.r,
                          train_attn=every or "q_proj" in modules, train_mlp=every or "up_proj" in modules,
                          train_unembed="lm_head" in modules)


def _runs(session, jobs: list[Job], owner: str) -> list[TrainingRunOut]:
    newest: dict[tuple[int, str], TinkerCheckpointOut] = {}
    for named in ops_q.owned_named(session, owner=owner, job_ids=[j.id for j in jobs]):  # newest first
        newest.setdefault((named[0].id, named[1].kind), _checkpoint(named))
    out = []
    for job in jobs:
        weights = _weights(job)
        out.append(TrainingRunOut(training_run_id=job.uid, base_model=weights.base_model, model_owner=job.owner,
                                  is_lora=weights.is_lora, lora_rank=weights.lora_rank,
                                  corrupted=job.status == "failed",
                                  last_request_time=job.updated_at, last_checkpoint=newest.get((job.id, "weights")),
                                  last_sampler_checkpoint=newest.get((job.id, "sampler_weights"))))
    return out


@router.get("/training_runs", response_model=TrainingRunsOut)
def list_training_runs(owner: OwnerDep, session: SessionDep, limit: Annotated[int, Query(ge=1, le=1000)] = 20,
                       offset: Annotated[int, Query(ge=0, le=2**31 - 1)] = 0,
                       access_scope: Annotated[Literal["owned", "accessible"], Query()] = "owned"):
    """This owner's session runs, newest first (`accessible` is `owned` here: runs are never shared)."""
    jobs, total = ops_q.owned_runs(session, owner=owner, limit=limit, offset=offset)
    return TrainingRunsOut(training_runs=_runs(session, jobs, owner),
                           cursor=CursorOut(offset=offset, limit=limit, total_count=total))


@router.get("/training_runs/{model_id}", response_model=TrainingRunOut, responses=error_responses(404))
def get_training_run(model_id: RunId, owner: OwnerDep, session: SessionDep,
                     access_scope: Annotated[Literal["owned", "accessible"], Query()] = "owned"):
    return _runs(session, [owned_run(session, model_id=model_id, owner=owner)], owner)[0]


@router.get("/training_runs/{model_id}/checkpoints", response_model=CheckpointsOut, responses=error_responses(404))
def list_checkpoints(model_id: RunId, owner: OwnerDep, session: SessionDep):
    """A run's named checkpoints, newest first; each is also `GET /v1/jobs/{id}/checkpoints/{step}/archive`."""
    job = owned_run(session, model_id=model_id, owner=owner)
    return CheckpointsOut(checkpoints=[_checkpoint(n) for n in ops_q.owned_named(session, owner=owner,
                                                                                  job_ids=[job.id])])


@router.get("/checkpoints", response_model=CheckpointsOut)
def list_user_checkpoints(owner: OwnerDep, session: SessionDep, limit: Annotated[int, Query(ge=1, le=1000)] = 100,
                          offset: Annotated[int, Query(ge=0, le=2**31 - 1)] = 0):
    """Every named checkpoint of this owner's runs, newest first."""
    named = ops_q.owned_named(session, owner=owner, limit=limit, offset=offset)
    return CheckpointsOut(checkpoints=[_checkpoint(n) for n in named], cursor=CursorOut(
        offset=offset, limit=limit, total_count=ops_q.count_named(session, owner=owner)))


@router.delete("/training_runs/{model_id}/checkpoints/{kind}/{name}", status_code=204, response_class=Response,
               responses=error_responses(404))
def delete_checkpoint(model_id: RunId, kind: Annotated[Literal[CHECKPOINT_KINDS], Path()],  # type: ignore[valid-type]
                      name: Annotated[str, Path(pattern=CHECKPOINT_NAME)], owner: OwnerDep, session: SessionDep):
    """The name no longer names the checkpoint; the step's files stay among the run's checkpoints
    (`/v1/jobs/{id}/checkpoints`) until the run is deleted."""
    job = owned_run(session, model_id=model_id, owner=owner)
    if not ops_q.drop_name(session, job_id=job.id, kind=kind, name=name):
        raise HTTPException(404, f"checkpoint {tinker_path(job.uid, kind, name)} not found")
    return Response(status_code=204)


@router.post("/weights_info", response_model=WeightsInfoOut, responses=error_responses(404))
def weights_info(body: WeightsInfoIn, owner: OwnerDep, session: SessionDep):
    """What the weights a tinker path names are: their base model, and the LoRA adapter's rank and layers."""
    parsed = parse_tinker_path(body.tinker_path)
    found = None if parsed is None else ops_q.find_named(session, path=parsed, owner=owner)
    if found is None:
        raise HTTPException(404, f"checkpoint {body.tinker_path} not found")
    return _weights(found[0])

"""A training run's checkpoints: saved for sampling or under a name (`tinker://<run>/weights/<name>`),
and loaded into the run or into a new run of the session, each stored and answered with a future."""

from __future__ import annotations

import re
from typing import Literal

from fastapi import HTTPException

from service.api.deps import OwnerDep, ReleasedOwnerDep, SessionDep, SettingsDep
from service.api.schemas import error_responses
from service.api.tinker.operations import owned_run, queue_op, start_run, submit_op
from service.api.tinker.schemas import REFUSED, UntypedFuture, refused, tinker_router
from service.core.specs import SessionJob, SessionSpec
from service.core.tinker.requests import LoadWeightsIn, LoadWeightsOp, SaveForSamplerIn, SaveNamedOp, SaveWeightsIn
from service.core.tinker.wire import CHECKPOINT_NAME, parse_tinker_path
from service.store import session_ops as ops_q
from service.store.models import new_uid

router = tinker_router()


@router.post("/save_weights_for_sampler", response_model=UntypedFuture, responses=error_responses(404) | REFUSED)
def save_weights_for_sampler(body: SaveForSamplerIn, owner: ReleasedOwnerDep, settings: SettingsDep):
    """A snapshot of the run's weights to sample from (`save_weights_and_get_sampling_client`)."""
    if body.path is not None:  # a named checkpoint to sample from later
        return _save_named(settings, owner, body.model_id, "sampler_weights", body.path, body.seq_id)
    return queue_op(settings, owner, body.model_id, "save_weights_for_sampler", body.model_dump_json().encode(),
                     body.seq_id)


def _save_named(settings, owner: str, model_id: str, kind: Literal["weights", "sampler_weights"], name: str | None,
                seq_id: int | None):
    if name is None or not re.match(CHECKPOINT_NAME, name):
        return refused("path", f"a checkpoint name is needed: letters, digits, '_', '.', '-', at most 100 "
                        f"({name!r})")
    body = SaveNamedOp(kind=kind, name=name).model_dump_json().encode()
    return queue_op(settings, owner, model_id, "save_weights", body, seq_id)


@router.post("/save_weights", response_model=UntypedFuture, responses=error_responses(404) | REFUSED)
def save_weights(body: SaveWeightsIn, owner: ReleasedOwnerDep, settings: SettingsDep):
    """The run's state (weights and optimizer) as `tinker://<model_id>/weights/<name>` (`save_state`)."""
    return _save_named(settings, owner, body.model_id, "weights", body.path, body.seq_id)


@router.post("/load_weights", response_model=UntypedFuture, responses=error_responses(404) | REFUSED)
def load_weights(body: LoadWeightsIn, owner: OwnerDep, session: SessionDep, settings: SettingsDep):
    """A saved checkpoint into a run (`load_state`), or into a new run of this session
    (`create_training_client_from_state`), with its optimizer state when asked."""
    parsed = parse_tinker_path(body.path)
    if parsed is None or (parsed.kind != "weights" and body.optimizer):
        return refused("path", "expected tinker://<model_id>/weights/<name> (sampler_weights/<name> without the "
                        f"optimizer), got {body.path!r}")
    found = ops_q.find_named(session, path=parsed, owner=owner)
    if found is None:
        raise HTTPException(404, f"checkpoint {body.path} not found")
    source, step = found
    trained = source.job_spec().model
    load = LoadWeightsOp(job=source.id, step=step, optimizer=body.optimizer, path=body.path).model_dump_json().encode()
    if body.model_id is not None:
        target = owned_run(session, model_id=body.model_id, owner=owner, for_update=True)
        if not target.job_spec().model.same_weights_as(trained):
            return refused("path", f"{body.path} holds weights of {trained.name} with lora "
                            f"{None if trained.lora is None else trained.lora.r}: not the shape of this run")
        return submit_op(settings, session, job=target, kind="load_weights", body=load,
                          seq=body.seq_id)
    if body.session_id is None or ops_q.get_session(session, session_id=body.session_id, owner=owner) is None:
        raise HTTPException(404, f"session {body.session_id} not found")
    spec = SessionJob(name=f"tinker {trained.name} from {parsed.name}", model=trained,
                      session=SessionSpec(tinker_session=body.session_id, model_id=new_uid(),
                                          model_seq_id=body.model_seq_id or 0, idle_timeout_s=settings.session_idle_s,
                                          seed=source.job_spec().session.seed))
    future = start_run(settings, session, owner=owner, spec=spec, then=("load_weights", load))
    return future.model_copy(update={"model_id": f"{body.session_id}:train:{spec.session.model_seq_id}"})


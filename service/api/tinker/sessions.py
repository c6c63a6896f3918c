"""Tinker sessions: created, kept alive by the SDK's heartbeat, listed, read and finished."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import HTTPException, Path, Query
from fastapi.responses import Response

from service.api.deps import OwnerDep, SessionDep
from service.api.schemas import ErrorOut, error_responses
from service.api.tinker.schemas import SessionInfoOut, SessionListOut, SessionOut, TypedOut, tinker_router
from service.core.tinker.requests import CreateSessionIn, SessionIdIn
from service.store import session_ops as ops_q
from service.store.models import utcnow

router = tinker_router()


@router.post("/create_session", response_model=SessionOut)
def create_session(body: CreateSessionIn, owner: OwnerDep, session: SessionDep) -> dict:
    row = ops_q.create_session(session, owner=owner, tags=body.tags, user_metadata=body.user_metadata or {},
                               sdk_version=body.sdk_version)
    return {"type": "create_session", "session_id": row.id}


@router.post("/session_heartbeat", response_model=TypedOut,
             responses=error_responses(404) | {410: {"model": ErrorOut, "description": "The session finished."}})
def session_heartbeat(body: SessionIdIn, owner: OwnerDep, session: SessionDep) -> dict:
    row = ops_q.get_session(session, session_id=body.session_id, owner=owner)
    if row is None:
        raise HTTPException(404, f"session {body.session_id} not found")
    if row.finished_at is not None:
        raise HTTPException(410, f"session {body.session_id} has finished")
    row.heartbeat_at = utcnow()
    return {"type": "session_heartbeat"}


Scope = Annotated[Literal["owned", "accessible"], Query(description="Either way, your own sessions only.")]


@router.get("/sessions", response_model=SessionListOut)
def list_sessions(owner: OwnerDep, session: SessionDep, limit: Annotated[int, Query(ge=1, le=1000)] = 20,
                  offset: Annotated[int, Query(ge=0, le=2**31 - 1)] = 0, access_scope: Scope = "owned") -> dict:
    """Your tinker sessions, newest first."""
    return {"sessions": [s.id for s in ops_q.list_sessions(session, owner=owner, limit=limit, offset=offset)]}


@router.get("/sessions/{session_id}", response_model=SessionInfoOut, responses=error_responses(404))
def get_session(session_id: Annotated[str, Path(max_length=40)], owner: OwnerDep, session: SessionDep,
                access_scope: Scope = "owned") -> dict:
    row = ops_q.get_session(session, session_id=session_id, owner=owner)
    if row is None:
        raise HTTPException(404, f"session {session_id} not found")
    runs = ops_q.session_runs(session, session_id=session_id, owner=owner)
    return {"training_run_ids": [job.uid for job in runs], "sampler_ids": [],
            "user_metadata": {str(k): str(v) for k, v in row.user_metadata.items()} or None}


@router.post("/sessions/{session_id}/finish", status_code=204, responses=error_responses(404))
def finish_session(session_id: Annotated[str, Path(max_length=40)], owner: OwnerDep, session: SessionDep) -> Response:
    row = ops_q.get_session(session, session_id=session_id, owner=owner)
    if row is None:
        raise HTTPException(404, f"session {session_id} not found")
    row.finished_at = row.finished_at or utcnow()
    return Response(status_code=204)



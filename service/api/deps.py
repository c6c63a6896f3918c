"""FastAPI dependencies, as Annotated aliases."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncIterator, Iterator
from typing import Annotated

from fastapi import Depends, HTTPException, Path, Request
from sqlalchemy.orm import Session

from service.core.settings import Settings
from service.store import jobs as jobs_q
from service.store import keys as keys_q
from service.store.db import MAX_OVERFLOW, POOL_SIZE, session_scope
from service.store.models import Job


async def get_settings_dep(request: Request) -> Settings:  # async: no thread hop for a lookup
    return request.app.state.settings


SettingsDep = Annotated[Settings, Depends(get_settings_dep)]


# At most ADMITTED requests of one API process hold a store session at once; the others wait their turn in
# the event loop, where waiting costs nothing. A request holds its connection from its first query until its
# route returns, while its sync parts take turns on the thread pool (40 threads): unbounded, 40 threads could
# all wait for connections held by requests that wait for a thread, a stall until the pool's 30 s timeout and
# then 503s (100 pollers on one process did so in bench/api_load.py). Below the pool's 30, a third is left to
# the streams, webhook deliveries and readiness checks that take connections of their own.
ADMITTED = (POOL_SIZE + MAX_OVERFLOW) * 2 // 3
_turns: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = weakref.WeakKeyDictionary()


async def admitted() -> AsyncIterator[None]:
    """A turn among the requests that hold a store session (taken after the body is read, so a slow
    sender never holds one)."""
    loop = asyncio.get_running_loop()
    turns = _turns.get(loop) or _turns.setdefault(loop, asyncio.Semaphore(ADMITTED))
    async with turns:
        yield


def get_db(settings: SettingsDep, request: Request, _turn: Annotated[None, Depends(admitted, scope="function")],
           ) -> Iterator[Session]:
    with session_scope(settings.store_url, read_only=request.method in ("GET", "HEAD")) as session:
        yield session


# Closed when the route function returns, before the response is sent: a streaming response
# never holds a connection (or an open transaction) for its whole life.
SessionDep = Annotated[Session, Depends(get_db, scope="function")]


def bearer_key(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    return auth[7:].strip() or None if auth.lower().startswith("bearer ") else None


def unauthorized(message: str) -> HTTPException:
    return HTTPException(401, message, headers={"WWW-Authenticate": "Bearer"})


def get_owner(request: Request, session: SessionDep) -> str:
    """The owner of the presented API key: `Authorization: Bearer KEY` (or `X-API-Key: KEY`, as the
    tinker SDK sends it), never in a URL (a URL ends up in logs; a browser's EventSource uses a
    stream token instead, see stream.py)."""
    return _owner(request, session)


def get_owner_released(request: Request, settings: SettingsDep) -> str:
    """The key's owner, looked up on a connection given back before the route runs: for routes that open
    their own sessions or wait (holding one while taking another starves the pool under load)."""
    with session_scope(settings.store_url) as session:
        return _owner(request, session)


def _owner(request: Request, session: Session) -> str:
    key = bearer_key(request) or request.headers.get("x-api-key", "").strip() or None
    if not key:
        raise unauthorized("missing API key: send 'Authorization: Bearer <key>'")
    owner = keys_q.owner_for_key(session, key=key)
    if owner is None:
        raise unauthorized("invalid, revoked or expired API key")
    return owner


OwnerDep = Annotated[str, Depends(get_owner)]
ReleasedOwnerDep = Annotated[str, Depends(get_owner_released)]


def sees_cluster(owner: OwnerDep, settings: SettingsDep) -> bool:
    """Whether this key's owner is the admin's (GRPO_ADMIN_OWNERS): only they see hosts, processes, ports."""
    return owner in settings.admin_owners


SeesClusterDep = Annotated[bool, Depends(sees_cluster)]


MAX_INT = 2**31 - 1  # ids and steps are 32-bit integer columns
JobId = Annotated[int, Path(ge=1, le=MAX_INT, description="Job id.")]


def get_owned_job(job_id: JobId, owner: OwnerDep, session: SessionDep) -> Job:
    job = jobs_q.get_job(session, job_id=job_id, owner=owner)
    if job is None:  # another owner's job is indistinguishable from a missing one
        raise HTTPException(404, f"job {job_id} not found")
    return job


JobDep = Annotated[Job, Depends(get_owned_job)]

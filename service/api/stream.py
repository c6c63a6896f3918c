"""Live job streams (server-sent events) that hold no database connection between polls.

One `StreamHub` per API process watches every job that has an open stream with a single
statement per interval (a version of each job: status, step, newest event id, newest metric
step). A stream reads the store only when its job's version changed, in a short session of
its own; in between it waits on an asyncio event. So 200 open streams cost one small query a
second, not 200 idle transactions.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import defaultdict
from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Request
from pydantic import BaseModel
from pydantic import Field as PydanticField
from sse_starlette.sse import EventSourceResponse
from starlette.concurrency import run_in_threadpool

from service.api.deps import (
    MAX_INT,
    JobDep,
    JobId,
    SessionDep,
    SettingsDep,
    bearer_key,
    sees_cluster,
    unauthorized,
)
from service.api.schemas import error_responses, event_out
from service.core.specs import TERMINAL
from service.store import events as events_q
from service.store import jobs as jobs_q
from service.store import keys as keys_q
from service.store import metrics as metrics_q
from service.store.db import session_scope

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=error_responses(401, 404, 422, 503))
log = logging.getLogger(__name__)


class StreamHub:
    def __init__(self, url: str, interval_s: float = 1.0) -> None:
        self.url, self.interval_s = url, interval_s
        self._waiters: dict[int, set[asyncio.Event]] = defaultdict(set)
        self._versions: dict[int, tuple] = {}  # the version each watched job was last seen at
        self._task: asyncio.Task | None = None
        self._idle: set[int] = set()  # watched jobs no stream waited on at the last poll
        self.polls = 0  # statements run: one per interval however many streams wait

    def _read_versions(self, job_ids: list[int]) -> dict[int, tuple]:
        with session_scope(self.url, read_only=True) as s:
            return jobs_q.job_versions(s, job_ids=job_ids)

    async def wait_change(self, job_id: int, timeout_s: float) -> None:
        """Return once the job's version changes (or after `timeout_s`)."""
        changed = asyncio.Event()
        self._waiters[job_id].add(changed)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._poll())
        try:
            await asyncio.wait_for(changed.wait(), timeout_s)
        except TimeoutError:
            pass
        finally:
            self._waiters[job_id].discard(changed)
            if not self._waiters[job_id]:
                del self._waiters[job_id]

    async def _poll(self) -> None:
        while self._waiters:
            await asyncio.sleep(self.interval_s)
            ids = list(self._waiters)
            if not ids:
                break
            try:
                self.polls += 1
                versions = await run_in_threadpool(self._read_versions, ids)
            except Exception as exc:  # store away: streams keep waiting; their timeouts re-read
                log.warning("stream poll failed: %s", type(exc).__name__)
                continue
            for job_id, version in versions.items():
                if self._versions.get(job_id) != version:
                    self._versions[job_id] = version
                    for ev in list(self._waiters.get(job_id, ())):
                        ev.set()
            # a stream is between two waits while it reads what changed: a job is forgotten only once no
            # stream has waited on it for two polls, or each read would wake its stream again
            idle = set(self._versions) - set(self._waiters)
            for gone in idle & self._idle:
                del self._versions[gone]
            self._idle = idle


def _read(url: str, job_id: int, last_step: int, last_event: int, admin: bool):
    with session_scope(url) as s:
        row = jobs_q.get_job(s, job_id=job_id)
        points = metrics_q.points_between(s, job_id=job_id, after_step=last_step, to_step=MAX_INT)
        evs = [event_out(e, admin=admin).model_dump(mode="json")
               for e in events_q.list_events(s, job_id=job_id, after_id=last_event, limit=200)]
        status = {"status": row.status, "step": row.step, "total_steps": row.total_steps, "error": row.error}
    return status, points, evs


STREAM_TOKEN_TTL_S = 3600


class StreamToken(BaseModel):
    token: str = PydanticField(description="Pass as `?access_token=` to this job's stream; nothing else accepts it.")
    expires_at: datetime


@router.post("/{job_id}/stream-token", response_model=StreamToken, responses=error_responses(413))
def stream_token(job: JobDep, session: SessionDep, request: Request):
    """A short-lived token that opens this job's live stream, for clients that cannot send headers
    (a browser's EventSource). It is valid for an hour, for this job only, while the key that
    asked for it is live: the key itself never goes into a URL."""
    token, expires = keys_q.stream_token(session, key=bearer_key(request), job_id=job.id, ttl_s=STREAM_TOKEN_TTL_S)
    return StreamToken(token=token, expires_at=expires)


def _stream_owner(url: str, job_id: int, key: str | None, token: str | None) -> str | None:
    """Owner of the job's stream by API key (header) or stream token (query), if they own the job."""
    with session_scope(url) as s:
        owner = (keys_q.owner_for_key(s, key=key) if key else
                 keys_q.owner_for_stream_token(s, token=token, job_id=job_id) if token else None)
        if owner is None:
            raise unauthorized("send 'Authorization: Bearer <key>', or `access_token` from POST "
                               f"/v1/jobs/{job_id}/stream-token")
        return owner if jobs_q.get_job(s, job_id=job_id, owner=owner) is not None else None


@router.get("/{job_id}/stream", response_class=EventSourceResponse,
            responses={200: {"description": "Server-sent events: `status`, `metrics`, `event`, then `end` once the job "
                             "has ended.", "content": {"text/event-stream": {"schema": {"type": "string"}}}}})
async def stream_job(
    job_id: JobId, settings: SettingsDep, request: Request,
    from_step: Annotated[int, Query(ge=-1, le=MAX_INT, description="Send metrics of steps after this one.")] = -1,
    access_token: Annotated[str | None, Query(max_length=200, description="A token from POST "
                                              "/v1/jobs/{job_id}/stream-token, where no header can be sent.")] = None,
):
    """Server-sent events: `status` on every change, `metrics` per new step, `event` per job event;
    `end` when the job reaches a terminal status."""
    url = settings.store_url
    owner = await run_in_threadpool(_stream_owner, url, job_id, bearer_key(request), access_token)
    if owner is None:
        raise HTTPException(404, f"job {job_id} not found")
    admin = sees_cluster(owner, settings)  # the same rule as every other route's SeesClusterDep
    hub: StreamHub = request.app.state.stream_hub

    async def gen():
        last_step, last_event, last_status = from_step, 0, None
        while not await request.is_disconnected():
            status, points, evs = await run_in_threadpool(_read, url, job_id, last_step, last_event, admin)
            if status != last_status:
                last_status = status
                yield {"event": "status", "data": json.dumps(status)}
            for ev in evs:
                last_event = ev["id"]
                yield {"event": "event", "data": json.dumps(ev)}
            for step in sorted(points):
                last_step = max(last_step, step)
                yield {"event": "metrics", "data": json.dumps({"step": step, "metrics": points[step]})}
            if len(evs) == 200:  # a full page means more events are waiting: read again at once
                continue
            if status["status"] in TERMINAL:  # every event sent, the outcome's last
                yield {"event": "end", "data": json.dumps(status)}
                return
            await hub.wait_change(job_id, timeout_s=15.0)

    return EventSourceResponse(gen(), ping=15)

"""Conditional reads: a validator (`ETag`) for a job's records, and `304 Not Modified` to a poller whose
`If-None-Match` still names it, answered without reading or serialising the records themselves.

A job's validator changes when anything its read routes show can have changed: its row (status, step,
attempt, a cancel, its error), a new event (a checkpoint, a resume and a health flag are events), a new
metric step or point. Between two of those, a poll of the job, its metrics, events, samples or checkpoints
costs the job's row and two index lookups.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Annotated

from fastapi import Depends, Header, Request, Response
from fastapi.responses import Response as PlainResponse

from service.api.deps import JobDep, SessionDep
from service.store import jobs as jobs_q
from service.store.models import Job

NOT_MODIFIED = {304: {"description": "Nothing changed since the `ETag` named by the request's `If-None-Match`: "
                      "no body."}}
IfNoneMatch = Annotated[str | None, Header(max_length=1000, description="The `ETag` of an earlier answer: while "
                                           "nothing it covers has changed, the answer is a 304 with no body.")]


class NotModified(Exception):
    """Answered as a 304 with the validator (service/api/errors.py registers the handler)."""

    def __init__(self, etag: str) -> None:
        self.etag = etag


def _tag(parts: Iterable[object]) -> str:
    return '"' + hashlib.blake2b(repr(tuple(parts)).encode(), digest_size=12).hexdigest() + '"'


def job_etag(session, job: Job) -> str:
    """The validator of everything the job's read routes show."""
    return _tag((job.id, job.status, job.step, job.attempt, job.cancel_requested, job.error,
                 *jobs_q.job_changes(session, job_id=job.id)))


def rows_etag(rows: Iterable[Job], *extra: object) -> str:
    """The validator of a page of jobs as listed (their rows, and `extra`: what else the page shows)."""
    return _tag([(j.id, j.status, j.step, j.total_steps, j.attempt, j.cancel_requested, j.updated_at)
                 for j in rows] + list(extra))


def matches(if_none_match: str | None, etag: str) -> bool:
    """Whether If-None-Match names `etag` (weak or strong, in a list, or `*`)."""
    if not if_none_match:
        return False
    tags = [t.strip().removeprefix("W/") for t in if_none_match.split(",")]
    return "*" in tags or etag in tags


def cache_headers(etag: str) -> dict[str, str]:
    # private: the answer is one owner's; no-cache: a client revalidates every time, which a 304 makes cheap
    return {"ETag": etag, "Cache-Control": "private, no-cache", "Vary": "Authorization"}


def check(etag: str, if_none_match: str | None, response: Response) -> str:
    """NotModified when the poller already has `etag`; else `etag`, set on the answer."""
    if matches(if_none_match, etag):
        raise NotModified(etag)
    response.headers.update(cache_headers(etag))
    return etag


def job_unchanged(job: JobDep, session: SessionDep, response: Response, if_none_match: IfNoneMatch = None) -> str:
    """A job route's conditional read: NotModified (a 304) while the job is as the poller last saw it."""
    return check(job_etag(session, job), if_none_match, response)


JobETag = Annotated[str, Depends(job_unchanged)]


async def not_modified(_request: Request, exc: NotModified) -> PlainResponse:
    return PlainResponse(status_code=304, headers=cache_headers(exc.etag))

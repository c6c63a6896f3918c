"""Reports the loops produce besides metrics: selections, sparsity, samples, checkpoints."""

from __future__ import annotations

import json
from dataclasses import dataclass

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from service.core.records import SampleRow, SelectionRecord, SparsityRecord
from service.store import jobs as jobs_q
from service.store.models import Checkpoint, Job, Sample, Selection, SparsityReport


def put_selection(session: Session, *, job_id: int, record: SelectionRecord) -> None:
    """Upsert by (job_id, step) so a resumed step replaces, never duplicates."""
    r = record
    session.execute(delete(Selection).where(Selection.job_id == job_id, Selection.step == r.step))
    session.add(Selection(job_id=job_id, step=r.step, policy=r.policy, total=r.total, selected=r.selected,
                          ratio=r.ratio, mean_influence=r.mean_influence, min_influence=r.min_influence,
                          max_influence=r.max_influence, histogram=r.histogram,
                          scores=[list(s) for s in r.scores]))


def list_selections(session: Session, *, job_id: int, from_step: int = 0, limit: int = 1000) -> list[Selection]:
    q = (select(Selection).where(Selection.job_id == job_id, Selection.step >= from_step)
         .order_by(Selection.step).limit(limit))
    return list(session.scalars(q))


def put_sparsity(session: Session, *, job_id: int, record: SparsityRecord) -> None:
    r = record
    session.execute(delete(SparsityReport).where(
        SparsityReport.job_id == job_id, SparsityReport.step == r.step, SparsityReport.scope == r.scope))
    session.add(SparsityReport(job_id=job_id, step=r.step, from_step=r.from_step, scope=r.scope,
                               sparsity=r.sparsity, report=json.loads(r.report.model_dump_json())))  # NaN/inf -> null


def list_sparsity(session: Session, *, job_id: int, scope: str | None = None) -> list[SparsityReport]:
    q = select(SparsityReport).where(SparsityReport.job_id == job_id)
    if scope:
        q = q.where(SparsityReport.scope == scope)
    return list(session.scalars(q.order_by(SparsityReport.step, SparsityReport.scope)))


def get_sparsity(session: Session, *, job_id: int, report_id: int) -> SparsityReport | None:
    r = session.get(SparsityReport, report_id)
    return r if r is not None and r.job_id == job_id else None


def put_samples(session: Session, *, job_id: int, step: int, rows: list[SampleRow]) -> None:
    session.execute(delete(Sample).where(Sample.job_id == job_id, Sample.step == step))
    session.add_all(Sample(job_id=job_id, step=step, index=r.index, prompt=r.prompt, completion=r.completion,
                           reward=r.reward, advantage=r.advantage, influence=r.influence, selected=r.selected,
                           extra=r.extra) for r in rows)


def append_samples(session: Session, *, job_id: int, step: int, rows: list[SampleRow]) -> None:
    """Rows added to a step's, their indexes after those already there (a session run records a step's
    samples a call at a time)."""
    first = (session.scalar(select(func.max(Sample.index)).where(Sample.job_id == job_id, Sample.step == step))
             if rows else None)
    first = 0 if first is None else first + 1
    session.add_all(Sample(job_id=job_id, step=step, index=first + i, prompt=r.prompt, completion=r.completion,
                           reward=r.reward, advantage=r.advantage, influence=r.influence, selected=r.selected,
                           extra=r.extra) for i, r in enumerate(rows))


def list_samples(session: Session, *, job_id: int, step: int | None = None, after_id: int = 0,
                 limit: int = 200) -> list[Sample]:
    q = select(Sample).where(Sample.job_id == job_id, Sample.id > after_id)
    if step is not None:
        q = q.where(Sample.step == step)
    return list(session.scalars(q.order_by(Sample.id).limit(limit)))


def put_checkpoint(session: Session, *, job_id: int, step: int, path: str, format: str, size_bytes: int) -> None:
    session.execute(delete(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.step == step))
    session.add(Checkpoint(job_id=job_id, step=step, path=path, format=format, size_bytes=size_bytes))


def list_checkpoints(session: Session, *, job_id: int) -> list[Checkpoint]:
    return list(session.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step)))


def get_checkpoint(session: Session, *, job_id: int, step: int) -> Checkpoint | None:
    return session.scalar(select(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.step == step))


def latest_checkpoint(session: Session, *, job_id: int) -> Checkpoint | None:
    return session.scalars(
        select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step.desc()).limit(1)
    ).first()


@dataclass(frozen=True)
class OwnedCheckpoint:
    job: Job
    checkpoint: Checkpoint


def owned_checkpoint(session: Session, *, owner: str, job_id: int, step: int | None) -> OwnedCheckpoint | None:
    """One of `owner`'s own checkpoints (`step` None: the latest), or None (another owner's reads as missing)."""
    job = jobs_q.get_job(session, job_id=job_id, owner=owner)
    if job is None:
        return None
    ckpt = (latest_checkpoint(session, job_id=job_id) if step is None
            else get_checkpoint(session, job_id=job_id, step=step))
    return None if ckpt is None else OwnedCheckpoint(job, ckpt)

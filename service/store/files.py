"""Uploaded data files: rows of the `files` table, always looked up with their owner."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.store.models import DataFile


def add_file(session: Session, *, file_id: str, owner: str, purpose: str, filename: str, format: str,
             size: int, rows: int, columns: list[str], sha256: str, key: str) -> DataFile:
    f = DataFile(id=file_id, owner=owner, purpose=purpose, filename=filename, format=format, bytes=size,
                 rows=rows, columns=columns, sha256=sha256, key=key)
    session.add(f)
    session.flush()
    return f


def get_file(session: Session, *, file_id: str, owner: str) -> DataFile | None:
    """The owner's file; another owner's reads as missing."""
    return session.scalar(select(DataFile).where(DataFile.id == file_id, DataFile.owner == owner))


def list_files(session: Session, *, owner: str, purpose: str | None = None, after: str | None = None,
               limit: int = 50) -> tuple[list[DataFile], bool]:
    """Newest first; `after` is the last id of the previous page. (files, has_more)."""
    q = select(DataFile).where(DataFile.owner == owner)
    if purpose:
        q = q.where(DataFile.purpose == purpose)
    if after:
        cursor = select(DataFile.pk).where(DataFile.id == after, DataFile.owner == owner).scalar_subquery()
        q = q.where(DataFile.pk < cursor)
    rows = list(session.scalars(q.order_by(DataFile.pk.desc()).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def delete_file(session: Session, *, file: DataFile) -> None:
    session.delete(file)

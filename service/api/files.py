"""Files: upload data (JSONL or Parquet) for training, evaluation or retrieval; list, read, delete.

An upload streams to a temporary file (never whole in memory), is hashed and checked row by row
for its purpose, and only then goes to the artifact store and gets a row: a refused file
stores nothing. A file belongs to its owner: another owner's id is a 404 here and a 422 in a spec.

The check reads untrusted bytes, so it runs in a child process within the upload budget (rows,
bytes per row, decoded bytes, memory, time: 413 naming the setting past which it went), and only
so many run at once (429): per process, a slot taken before the body's first byte is read (so at most
GRPO_MAX_UPLOADS bodies are ever on the API's disk), and per owner while checking. A flood of hostile
files costs its sender waiting, never the other tenants their API.
"""

from __future__ import annotations

import hashlib
import tempfile
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path as FsPath
from pathlib import PurePath
from typing import Annotated, Literal

from fastapi import (
    APIRouter,
    File,
    Form,
    HTTPException,
    Path,
    Query,
    Request,
    Response,
    UploadFile,
)
from fastapi.responses import JSONResponse, StreamingResponse

from service.api.deps import OwnerDep, SessionDep, SettingsDep
from service.api.schemas import (
    FileOut,
    FilePage,
    binary_content,
    download_type,
    error_responses,
)
from service.core.artifacts import file_key, open_store
from service.core.datafiles import MAX_ERRORS, OverBudget, check_file_isolated
from service.core.errors import format_errors
from service.core.sources import files_named, owner_folder
from service.core.specs import FILE_ID
from service.store import files as files_q
from service.store import jobs as jobs_q
from service.store.models import new_file_id

router = APIRouter(prefix="/v1/files", tags=["files"], responses=error_responses(401, 422, 503))
FileId = Annotated[str, Path(pattern=FILE_ID, description="A file id, `file-` and 24 hex digits.")]
PurposeField = Literal["train", "eval", "corpus"]
MEDIA = {"jsonl": "application/jsonl", "parquet": "application/vnd.apache.parquet"}


class UploadSlots:
    """How many uploads one API process takes at once: bodies being received (a slot taken before the
    first byte is read, so no more than `per_process` bodies are ever on this process's disk), and, per
    owner, uploads being checked."""

    def __init__(self, *, per_process: int, per_owner: int) -> None:
        self.per_process, self.per_owner = per_process, per_owner
        self.lock, self.owners, self.bodies = threading.Lock(), Counter(), 0

    @contextmanager
    def receiving(self) -> Iterator[str | None]:
        """A slot for one upload's body, taken before it is read: None, or why there is none (the middleware
        answers 429 with it)."""
        with self.lock:
            full = self.bodies >= self.per_process
            if not full:
                self.bodies += 1
        if full:
            yield f"{self.per_process} uploads are being received and checked, the most at once (GRPO_MAX_UPLOADS)"
            return
        try:
            yield None
        finally:
            with self.lock:
                self.bodies -= 1

    @contextmanager
    def take(self, owner: str) -> Iterator[None]:
        with self.lock:
            if self.owners[owner] >= self.per_owner:
                raise HTTPException(429, f"{self.owners[owner]} of your uploads are being checked; at most "
                                    f"{self.per_owner} at once (GRPO_MAX_UPLOADS_PER_OWNER)", {"Retry-After": "2"})
            self.owners[owner] += 1
        try:
            yield
        finally:
            with self.lock:
                self.owners[owner] -= 1


def binary_part(schema: dict) -> None:
    """A file part as generated clients know one (`format: binary`), not JSON Schema's `contentMediaType`."""
    schema.pop("contentMediaType", None)
    schema["format"] = "binary"


def _refused(message: str) -> JSONResponse:
    return JSONResponse(format_errors([{"loc": ("body", "file"), "msg": message, "type": "invalid_file"}]), 422)


@router.post("", status_code=201, response_model=FileOut, responses=error_responses(413, 429))
def upload_file(
    request: Request, owner: OwnerDep, session: SessionDep, settings: SettingsDep,
    file: Annotated[UploadFile, File(description="A JSONL or Parquet file. train/eval rows: {prompt, answer} or "
                                     "{prompt|query, answers: [...], gold_doc_id?}; corpus rows: {id, text}.",
                                     json_schema_extra=binary_part)],
    purpose: Annotated[PurposeField, Form(description="What the file is for: train, eval or corpus.")],
):
    filename = PurePath((file.filename or "upload").replace("\\", "/")).name[:255] or "upload"
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=settings.data_dir, prefix="upload-", suffix=".part") as tmp:
        digest = hashlib.sha256()  # hashed as it is copied: one read of the upload fewer
        while chunk := file.file.read(1 << 20):
            digest.update(chunk)
            tmp.write(chunk)
        tmp.flush()
        path = FsPath(tmp.name)
        with request.app.state.upload_slots.take(owner):
            try:
                checked = check_file_isolated(path, purpose, budget=settings.upload_budget,
                                              memory_bytes=settings.upload_memory_bytes,
                                              timeout_s=settings.upload_check_s)
            except OverBudget as exc:
                raise HTTPException(413, f"{filename} is refused: {exc}") from None
        if checked.errors:
            more = " (and perhaps more: checking stopped there)" if len(checked.errors) >= MAX_ERRORS else ""
            return _refused(f"{filename} cannot be used for {purpose}: " + "; ".join(checked.errors) + more)
        file_id = new_file_id()
        key = file_key(owner_folder(owner), file_id)
        with path.open("rb") as src:
            open_store(settings).put_fileobj(key, src)
        return files_q.add_file(session, file_id=file_id, owner=owner, purpose=purpose, filename=filename,
                                format=checked.format, size=path.stat().st_size, rows=checked.rows,
                                columns=checked.columns, sha256=digest.hexdigest(), key=key)


@router.get("", response_model=FilePage)
def list_files(owner: OwnerDep, session: SessionDep,
               purpose: Annotated[PurposeField | None, Query(description="Only files of this purpose.")] = None,
               after: Annotated[str | None, Query(pattern=FILE_ID, description="Cursor: `next_after` of the previous page.")] = None,
               limit: Annotated[int, Query(ge=1, le=200)] = 50):
    rows, has_more = files_q.list_files(session, owner=owner, purpose=purpose, after=after, limit=limit)
    return FilePage(items=[FileOut.model_validate(r) for r in rows], has_more=has_more,
                    next_after=rows[-1].id if has_more and rows else None)


def _owned(session, owner: str, file_id: str):
    f = files_q.get_file(session, file_id=file_id, owner=owner)
    if f is None:  # another owner's file reads as missing
        raise HTTPException(404, f"file {file_id} not found")
    return f


@router.get("/{file_id}", response_model=FileOut, responses=error_responses(404))
def get_file(file_id: FileId, owner: OwnerDep, session: SessionDep):
    return _owned(session, owner, file_id)


@router.get("/{file_id}/content", response_class=StreamingResponse, responses={
    200: {"content": binary_content(*MEDIA.values()), "description": "The file as uploaded: application/jsonl or "
          "application/vnd.apache.parquet, or application/octet-stream to a client that accepts only that."},
    **error_responses(404)})
def file_content(request: Request, file_id: FileId, owner: OwnerDep, session: SessionDep, settings: SettingsDep):
    f = _owned(session, owner, file_id)
    try:
        src = open_store(settings).open(f.key)
    except FileNotFoundError:  # the row outlived its bytes (removed from the store by hand)
        raise HTTPException(404, f"the content of file {file_id} is gone from the artifact store") from None

    def chunks():
        with src:
            while chunk := src.read(1 << 16):
                yield chunk

    media = download_type(request.headers.get("accept", ""), MEDIA[f.format])
    return StreamingResponse(chunks(), media_type=media, headers={
        "Content-Disposition": f'attachment; filename="{f.id}.{f.format}"', "Content-Length": str(f.bytes)})


@router.delete("/{file_id}", status_code=204, response_class=Response, responses=error_responses(404, 409, 413))
def delete_file(file_id: FileId, owner: OwnerDep, session: SessionDep, settings: SettingsDep) -> Response:
    f = _owned(session, owner, file_id)
    users = [j.id for j in jobs_q.active_jobs(session, owner=owner) if file_id in files_named(j.job_spec())]
    if users:
        raise HTTPException(409, f"file {file_id} is used by unfinished job(s) {', '.join(map(str, users))}: "
                            "delete it once they have finished")
    files_q.delete_file(session, file=f)
    open_store(settings).delete(f.key)  # before the commit: if the store fails, the row stays (503, retry)
    return Response(status_code=204)

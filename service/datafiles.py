"""Data files: how a JSONL or Parquet file's rows read, and what a row must hold for its purpose.

One definition for both ends: the API checks an upload with `check_file` before it accepts it,
and the worker reads the same rows with `read_rows` and `task_row` / `corpus_row`.

- `train` / `eval` rows: `{"prompt": str, "answer": str | number}`, or `"answers": [...]` for
  several references; joint jobs may write `query` for `prompt` and add `gold_doc_id`.
- `corpus` rows: `{"id": str | int, "text": str}`, ids unique.

Never imports torch.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

Purpose = Literal["train", "eval", "corpus"]
PURPOSES: tuple[str, ...] = ("train", "eval", "corpus")
Format = Literal["jsonl", "parquet"]
PARQUET_MAGIC = b"PAR1"
MAX_ERRORS = 10  # reported per refused file


class RowError(ValueError):
    """A row that cannot be used, with its 1-based line (JSONL) or row (Parquet) number."""

    def __init__(self, n: int, message: str, *, where: str = "line") -> None:
        super().__init__(f"{where} {n}: {message}")
        self.n, self.message, self.where = n, message, where


@dataclass(frozen=True)
class TaskRow:
    question: str
    answers: tuple[str, ...]
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)  # e.g. gold_doc_id


@dataclass(frozen=True)
class CorpusRow:
    id: str
    text: str


def _scalar(v: Any) -> bool:
    return isinstance(v, (str, int, float)) and not isinstance(v, bool)


def task_row(row: dict[str, Any]) -> TaskRow:
    """A train/eval row, or ValueError saying what it lacks."""
    question = row.get("prompt", row.get("query"))
    if not isinstance(question, str) or not question.strip():
        raise ValueError("needs a non-empty string 'prompt' (or 'query')")
    if "answers" in row:
        answers = row["answers"]
        if not isinstance(answers, list) or not answers or not all(_scalar(a) for a in answers):
            raise ValueError("'answers' must be a non-empty list of strings or numbers")
    elif _scalar(row.get("answer")):
        answers = [row["answer"]]
    else:
        raise ValueError("needs an 'answer' (a string or number) or 'answers' (a list of them)")
    if "gold_doc_id" in row and not _scalar(row["gold_doc_id"]):
        raise ValueError("'gold_doc_id' must be a string or number")
    meta = {k: v for k, v in row.items() if k not in ("prompt", "query", "answer", "answers")}
    if "gold_doc_id" in meta:
        meta["gold_doc_id"] = str(meta["gold_doc_id"])
    return TaskRow(question, tuple(str(a) for a in answers), meta)


def corpus_row(row: dict[str, Any]) -> CorpusRow:
    """A corpus row, or ValueError saying what it lacks."""
    if not _scalar(row.get("id")) or str(row["id"]) == "":
        raise ValueError("needs an 'id' (a string or number)")
    if not isinstance(row.get("text"), str) or not row["text"].strip():
        raise ValueError("needs a non-empty string 'text'")
    return CorpusRow(str(row["id"]), row["text"])


def sniff(path: Path) -> Format:
    """Parquet files start with PAR1; anything else is read as JSONL."""
    with path.open("rb") as f:
        return "parquet" if f.read(4) == PARQUET_MAGIC else "jsonl"


def read_rows(path: Path, fmt: Format) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line or row number, row) for every row; RowError for one that does not parse."""
    if fmt == "parquet":
        yield from _parquet_rows(path)
        return
    with path.open("rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise RowError(n, f"not UTF-8 (byte {exc.start})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except (json.JSONDecodeError, RecursionError) as exc:
                raise RowError(n, f"not valid JSON ({getattr(exc, 'msg', 'nested too deeply')})") from None
            if not isinstance(row, dict):
                raise RowError(n, f"a row must be a JSON object, not {type(row).__name__}")
            yield n, row


def _parquet_rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=1024)
        n = 0
        for batch in batches:
            for row in batch.to_pylist():
                n += 1
                yield n, row
    except (pa.ArrowException, OSError) as exc:
        raise RowError(n if "n" in locals() else 0, f"not a readable Parquet file ({exc})", where="row") from None


@dataclass
class Checked:
    """What `check_file` found: the rows and columns of a usable file, or its first errors."""

    format: Format
    rows: int = 0
    columns: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def check_file(path: Path, purpose: Purpose, *, max_errors: int = MAX_ERRORS) -> Checked:
    """Read every row of `path` and check it for `purpose`; stops after `max_errors` errors."""
    fmt = sniff(path)
    out = Checked(fmt)
    where = "row" if fmt == "parquet" else "line"
    seen_ids: dict[str, int] = {}
    columns: set[str] = set()
    parse = corpus_row if purpose == "corpus" else task_row
    try:
        for n, row in read_rows(path, fmt):
            out.rows += 1
            columns.update(row)
            try:
                parsed = parse(row)
            except ValueError as exc:
                out.errors.append(f"{where} {n}: {exc}")
            else:
                if isinstance(parsed, CorpusRow):
                    if parsed.id in seen_ids:
                        out.errors.append(f"{where} {n}: duplicate id {parsed.id!r} (first on {where} {seen_ids[parsed.id]})")
                    seen_ids.setdefault(parsed.id, n)
            if len(out.errors) >= max_errors:
                break
    except RowError as exc:
        out.errors.append(str(exc) if fmt == "jsonl" or exc.n else f"not a JSONL or Parquet file: {exc.message}")
    if not out.errors and out.rows == 0:
        out.errors.append("the file has no rows")
    out.columns = sorted(columns)
    return out

"""Data files: how a JSONL or Parquet file's rows read, and what a row must hold for its purpose.

One definition for both ends: the API checks an upload with `check_file` before it accepts it,
and the worker reads the same rows with `read_rows` and `task_row` / `corpus_row`.

- `train` / `eval` rows: `{"prompt": str, "answer": str | number}`, or `"answers": [...]` for
  several references; joint jobs may write `query` for `prompt` and add `gold_doc_id`. Or chat
  rows, `{"messages": [{"role": "system" | "user" | "assistant", "content": str}, ...]}` ending with
  the assistant's turn: the conversation before it is the prompt and its content the answer.
- `corpus` rows: `{"id": str | int, "text": str}`, ids unique.

An upload is untrusted: a 41 KB Parquet file can decode to gigabytes, a 100 KB one can hold 20
million rows. `check_file` reads within a `Budget` (rows, bytes per row, decoded bytes, bytes per
Parquet row group) and stops at the first limit it meets, before decoding what lies past it; the
API runs it in a child process (`check_file_isolated`) under a memory and a time limit, so that
what the budgets cannot foresee (a Parquet footer that lies) costs the child, never the API.

Never imports torch.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

Purpose = Literal["train", "eval", "corpus"]
PURPOSES: tuple[str, ...] = ("train", "eval", "corpus")
Format = Literal["jsonl", "parquet"]
PARQUET_MAGIC = b"PAR1"
MAX_ERRORS = 10  # reported per refused file
BATCH_ROWS = 64  # Parquet rows decoded at a time within a budget (an upload being checked)
TRUSTED_BATCH_ROWS = 1024  # and without one (the worker, reading a file the API already checked)


@dataclass(frozen=True)
class Budget:
    """What reading one uploaded file may cost; each limit is named after its setting."""

    max_rows: int = 1_000_000  # GRPO_MAX_FILE_ROWS
    max_row_bytes: int = 1 << 20  # GRPO_MAX_ROW_BYTES: one JSONL line, or one Parquet row's values
    max_decoded_bytes: int = 1 << 30  # GRPO_MAX_DECODED_BYTES: all rows, decoded
    max_row_group_bytes: int = 128 << 20  # GRPO_MAX_ROW_GROUP_BYTES: one Parquet row group, uncompressed


class OverBudget(ValueError):
    """A file past one of its budget's limits: `limit` names the setting."""

    def __init__(self, limit: str, message: str) -> None:
        super().__init__(f"{message} ({limit})")
        self.limit, self.message = limit, message


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


ROLES = ("system", "user", "assistant")


def chat_row(row: dict[str, Any]) -> TaskRow:
    """A `messages` row: the question is the last user turn, the answer the final assistant turn, and
    meta["messages"] the conversation before it (what the prompt renders)."""
    messages = row["messages"]
    if not isinstance(messages, list) or len(messages) < 2:
        raise ValueError("'messages' must be a list of at least a user and an assistant turn")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            raise ValueError(f"messages[{i}] must be an object with exactly 'role' and 'content'")
        if m["role"] not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(ROLES)}, not {m['role']!r}")
        if not isinstance(m["content"], str) or not m["content"].strip():
            raise ValueError(f"messages[{i}].content must be a non-empty string")
    if messages[-1]["role"] != "assistant":
        raise ValueError("the last of 'messages' must be the assistant's turn: it is the answer")
    users = [m for m in messages[:-1] if m["role"] == "user"]
    if not users:
        raise ValueError("'messages' needs a user turn before the assistant's answer")
    if other := sorted(set(row) - {"messages"}):
        raise ValueError(f"a 'messages' row takes no other fields: {', '.join(other)}")
    return TaskRow(users[-1]["content"], (messages[-1]["content"],),
                   {"messages": [dict(m) for m in messages[:-1]]})


def task_row(row: dict[str, Any]) -> TaskRow:
    """A train/eval row, or ValueError saying what it lacks."""
    if "messages" in row:
        return chat_row(row)
    question = row.get("prompt", row.get("query"))
    if not isinstance(question, str) or not question.strip():
        raise ValueError("needs a non-empty string 'prompt' (or 'query'), or 'messages'")
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


def read_rows(path: Path, fmt: Format, budget: Budget | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line or row number, row) for every row; RowError for one that does not parse, OverBudget for
    a file past `budget` (unlimited when None: the worker reads files the API already checked)."""
    if fmt == "parquet":
        yield from _parquet_rows(path, budget)
        return
    limit = budget.max_row_bytes if budget else -1
    with path.open("rb") as f:
        n = 0
        while raw := f.readline(limit + 1 if budget else -1):
            n += 1
            if budget and len(raw) > limit:  # never read past the limit to find the line's end
                raise OverBudget("GRPO_MAX_ROW_BYTES", f"line {n} is longer than {limit} bytes")
            if budget and n > budget.max_rows:
                raise OverBudget("GRPO_MAX_FILE_ROWS", f"the file has more than {budget.max_rows} lines")
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


def _value_bytes(v: Any) -> int:
    """About what a decoded value holds: its text's bytes, 8 for a number."""
    if isinstance(v, (str, bytes)):
        return len(v)
    if isinstance(v, dict):
        return sum(len(str(k)) + _value_bytes(x) for k, x in v.items())
    if isinstance(v, (list, tuple)):
        return sum(_value_bytes(x) for x in v)
    return 8


def _batch_bytes(batch: Any) -> int:
    """What a record batch's values hold once turned into Python rows: a dictionary-encoded text
    column counts each row's entry, not the dictionary once (that is how such pages expand)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    total = 0
    for col in batch.columns:
        if pa.types.is_dictionary(col.type) and (pa.types.is_string(col.type.value_type) or pa.types.is_binary(
                col.type.value_type) or pa.types.is_large_string(col.type.value_type)):
            total += pc.sum(pc.take(pc.binary_length(col.dictionary), col.indices)).as_py() or 0
        else:
            total += col.nbytes
    return total


def _parquet_rows(path: Path, budget: Budget | None) -> Iterator[tuple[int, dict[str, Any]]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = 0
    try:
        pf = pq.ParquetFile(path)
        md = pf.metadata
        if budget:  # the footer's figures, before anything is decompressed
            if md.num_rows > budget.max_rows:
                raise OverBudget("GRPO_MAX_FILE_ROWS", f"the file has {md.num_rows} rows, more than {budget.max_rows}")
            sizes = [sum(md.row_group(g).column(c).total_uncompressed_size for c in range(md.num_columns))
                     for g in range(md.num_row_groups)]
            for g, size in enumerate(sizes):
                if size > budget.max_row_group_bytes:
                    raise OverBudget("GRPO_MAX_ROW_GROUP_BYTES", f"row group {g} decompresses to {size} bytes, "
                                     f"more than {budget.max_row_group_bytes}")
            if sum(sizes) > budget.max_decoded_bytes:
                raise OverBudget("GRPO_MAX_DECODED_BYTES", f"the file decompresses to {sum(sizes)} bytes, "
                                 f"more than {budget.max_decoded_bytes}")
        decoded = 0
        for g in range(md.num_row_groups):
            # small batches: a dictionary-encoded column can decode far past what its pages hold
            for batch in pf.iter_batches(batch_size=BATCH_ROWS if budget else TRUSTED_BATCH_ROWS, row_groups=[g],
                                         use_threads=False):
                batch_bytes = _batch_bytes(batch) if budget else 0
                decoded += batch_bytes
                if budget and decoded > budget.max_decoded_bytes:
                    raise OverBudget("GRPO_MAX_DECODED_BYTES", f"the rows decode to more than "
                                     f"{budget.max_decoded_bytes} bytes")
                if budget and batch_bytes > BATCH_ROWS * budget.max_row_bytes:  # before any row becomes Python
                    raise OverBudget("GRPO_MAX_ROW_BYTES", f"rows {n + 1}-{n + batch.num_rows} hold {batch_bytes} "
                                     f"bytes: more than {budget.max_row_bytes} in a row")
                for row in batch.to_pylist():
                    n += 1
                    if budget and n > budget.max_rows:  # a footer that undercounts
                        raise OverBudget("GRPO_MAX_FILE_ROWS", f"the file has more than {budget.max_rows} rows")
                    if budget and (row_bytes := _value_bytes(row)) > budget.max_row_bytes:
                        raise OverBudget("GRPO_MAX_ROW_BYTES", f"row {n} holds {row_bytes} bytes, more than "
                                         f"{budget.max_row_bytes}")
                    yield n, row
    except (pa.ArrowException, OSError) as exc:
        if isinstance(exc, MemoryError):
            raise
        raise RowError(n, f"not a readable Parquet file ({exc})", where="row") from None


@dataclass
class Checked:
    """What `check_file` found: the rows and columns of a usable file, or its first errors."""

    format: Format
    rows: int = 0
    columns: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def check_file(path: Path, purpose: Purpose, *, budget: Budget | None = None,
               max_errors: int = MAX_ERRORS) -> Checked:
    """Read every row of `path` and check it for `purpose`; stops after `max_errors` errors.
    OverBudget for a file past `budget`."""
    fmt = sniff(path)
    out = Checked(fmt)
    where = "row" if fmt == "parquet" else "line"
    seen_ids: dict[str, int] = {}
    columns: set[str] = set()
    parse = corpus_row if purpose == "corpus" else task_row
    try:
        for n, row in read_rows(path, fmt, budget or Budget()):
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


def check_file_isolated(path: Path, purpose: Purpose, *, budget: Budget, memory_bytes: int,
                        timeout_s: float) -> Checked:
    """`check_file` in a child process whose heap may not pass `memory_bytes` and that is killed
    after `timeout_s`: OverBudget naming GRPO_UPLOAD_MEMORY_BYTES or GRPO_UPLOAD_CHECK_S then."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ARROW_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    try:
        proc = subprocess.run(
            [sys.executable, "-c", "from service.core.datafiles import _child; _child()", str(path), purpose,
             json.dumps(asdict(budget)), str(memory_bytes)],
            capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        raise OverBudget("GRPO_UPLOAD_CHECK_S", f"checking the file took longer than {timeout_s:g} s") from None
    try:
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):  # killed, or out of memory before it could answer
        raise OverBudget("GRPO_UPLOAD_MEMORY_BYTES", f"reading the file needed more than {memory_bytes} bytes of "
                         f"memory (the check ended with status {proc.returncode})") from None
    if "over" in result:
        raise OverBudget(result["over"]["limit"], result["over"]["message"])
    return Checked(**result["checked"])


def _child() -> None:
    """The child of `check_file_isolated`: argv PATH PURPOSE BUDGET_JSON MEMORY_BYTES; one JSON line on
    stdout. Its heap is capped first, before pyarrow is imported (RLIMIT_DATA counts what malloc and
    mmap take, not the shared libraries)."""
    memory = int(sys.argv[4])
    resource.setrlimit(resource.RLIMIT_DATA, (memory, memory))
    path, purpose, budget = Path(sys.argv[1]), sys.argv[2], Budget(**json.loads(sys.argv[3]))
    try:
        result: dict[str, Any] = {"checked": asdict(check_file(path, purpose, budget=budget))}  # type: ignore[arg-type]
    except OverBudget as exc:
        result = {"over": {"limit": exc.limit, "message": exc.message}}
    except MemoryError:
        result = {"over": {"limit": "GRPO_UPLOAD_MEMORY_BYTES", "message": "reading the file needed more memory "
                           "than the check may use"}}
    print(json.dumps(result), flush=True)

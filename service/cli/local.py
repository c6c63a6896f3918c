"""Commands that work in this process: run a job without the service, migrate the store, manage keys."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import click

from service.cli.common import load_spec_file, spec_errors
from service.cli.group import main
from service.cli.malloc import reexec_for_training
from service.core.settings import get_settings


@main.group()
def db() -> None:
    """The SQL store."""


@db.command("upgrade")
def db_upgrade() -> None:
    """Apply Alembic migrations to DATABASE_URL."""
    from service.store.migrate import upgrade

    upgrade(get_settings().store_url)
    click.echo("store is at the newest schema")


@main.group()
def keys() -> None:
    """API keys."""


def _store_session():
    from service.store.db import session_scope
    from service.store.migrate import upgrade

    settings = get_settings()
    upgrade(settings.store_url)
    return session_scope(settings.store_url)


def _create_key(owner: str, expires_in_days: float | None = None) -> str:
    from datetime import timedelta

    from service.store import keys as keys_q

    with _store_session() as s:
        return keys_q.create_key(s, owner=owner,
                                 expires_in=timedelta(days=expires_in_days) if expires_in_days else None)


@keys.command("create")
@click.option("--owner", required=True, help="Who the key belongs to; a key sees only its owner's jobs and data "
              "(letters, digits, '_', '.', '-'; it names the owner's datasets folder).")
@click.option("--expires-in-days", type=click.FloatRange(min=0, min_open=True), default=None,
              help="The key stops working after this many days (default: never).")
def keys_create(owner: str, expires_in_days: float | None) -> None:
    """Print a new API key (shown once; only its hash is stored)."""
    from service.core.sources import OWNER_NAME

    if not OWNER_NAME.match(owner):
        raise click.BadParameter("use letters, digits, '_', '.' and '-' (at most 64)", param_hint="--owner")
    click.echo(_create_key(owner, expires_in_days))


@keys.command("list")
@click.option("--owner", default=None, help="Only this owner's keys.")
def keys_list(owner: str | None) -> None:
    """Every key's id, owner, prefix, creation, expiry, last use and state (never the key)."""
    from rich.console import Console
    from rich.table import Table

    from service.store import keys as keys_q

    with _store_session() as s:
        rows = keys_q.list_keys(s, owner=owner)
    table = Table("id", "owner", "prefix", "created", "expires", "last used", "state")
    when = lambda t: t.strftime("%Y-%m-%d %H:%M") if t else "-"  # noqa: E731
    for k in rows:
        table.add_row(str(k.id), k.owner, k.prefix + "…", when(k.created_at), when(k.expires_at),
                      when(k.last_used_at), "revoked" if k.revoked else "active")
    Console(width=120).print(table)


@keys.command("revoke")
@click.argument("key_id", type=int)
def keys_revoke(key_id: int) -> None:
    """Revoke a key by its id (from `keys list`): it, and the stream tokens made with it, stop working."""
    from service.store import keys as keys_q

    with _store_session() as s:
        if not keys_q.revoke_key(s, key_id=key_id):
            raise click.ClickException(f"no active key with id {key_id}")
    click.echo(f"key {key_id} revoked")



def _find_vllm() -> None:
    """`make vllm` builds .venv-vllm beside the code: `grpo-jobs run` takes it where GRPO_VLLM_PYTHON is
    unset (a worker's admin names it; one machine's checkout is a clear enough choice)."""
    if get_settings().vllm_python is not None:
        return
    for root in (Path.cwd(), Path(__file__).resolve().parents[2]):
        python = root / ".venv-vllm" / "bin" / "python"
        if python.exists():
            os.environ["GRPO_VLLM_PYTHON"] = str(python)
            get_settings.cache_clear()
            return


@main.command()
@click.argument("spec_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--out", "out", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Writes metrics.jsonl, events.jsonl, selections.jsonl, sparsity.jsonl, checkpoints/.")
@click.option("--init-from", "init_from", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="Start the model from an earlier run's folder (its --out): its latest checkpoint, or the step "
              "model.init_from.step names. Locally the folder stands for model.init_from's job of the service's.")
def run(spec_file: Path, out: Path, init_from: Path | None) -> None:
    """Run a job in this process, no service needed."""
    from pydantic import ValidationError

    from service.core.errors import format_errors
    from service.core.specs import parse_spec

    raw = load_spec_file(spec_file)
    if init_from is not None:  # the job id is the service's; locally the folder stands for it
        model = raw.get("model") if isinstance(raw.get("model"), dict) else {}
        raw["model"] = {**model, "init_from": {"job": 1, **(model.get("init_from") or {})}}
    try:
        spec = parse_spec(raw)
    except ValidationError as exc:
        raise spec_errors(spec_file, format_errors(exc.errors())["detail"]) from None
    if spec.resources.nodes > 1:
        raise click.ClickException(f"{spec_file}: resources.nodes {spec.resources.nodes}: a job on several machines "
                                   "runs on the service's workers (`grpo-jobs submit`); `run` uses this machine only: "
                                   "set resources.nodes to 1")
    _find_vllm()
    reexec_for_training(get_settings())
    from functools import partial

    from worker.jobs.runner import run_spec

    # The composition root: the one place the service imports the worker (lazily: torch loads only
    # for `grpo-jobs run`, never for the API).
    from worker.parallel.launch import RanksFailed
    from worker.reporting import FileReporter

    reporter = FileReporter(out, echo=click.echo, init_from=init_from)
    try:  # with several processes, rank 0 appends to the same files
        result = run_spec(spec, reporter, settings=get_settings(),
                          rank_reporter=partial(FileReporter, out, echo=click.echo))
    except RanksFailed as exc:
        reporter.event("failed", str(exc), level="error")
        raise click.ClickException(f"job failed: {exc}") from exc
    except Exception as exc:
        reporter.event("failed", f"{type(exc).__name__}: {exc}", level="error")
        raise click.ClickException(f"job failed: {type(exc).__name__}: {exc}") from exc
    summary = json.dumps(dataclasses.asdict(result))
    reporter.event(result.status, summary)
    click.echo(summary)


@main.command("settings")
def settings_cmd() -> None:
    """Every setting the service and workers read from the environment, as a Markdown table."""
    from service.core.settings import settings_table

    click.echo(settings_table())

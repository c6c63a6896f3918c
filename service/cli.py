"""`grpo-jobs`: serve, worker, dev, submit, status, watch, run, keys create, db upgrade."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import click
import httpx
import yaml

from service.settings import get_settings

DEV_KEY_FILE = "dev-api-key"


def _load_spec_file(path: Path) -> dict:
    text = path.read_text()
    data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    if not isinstance(data, dict):
        raise click.ClickException(f"{path}: a job spec must be a mapping, got {type(data).__name__}")
    return data


def _client(url: str | None, key: str | None) -> httpx.Client:
    settings = get_settings()
    url = url or os.environ.get("GRPO_URL", "http://127.0.0.1:8000")
    key = key or os.environ.get("GRPO_API_KEY")
    if key is None and (settings.data_dir / DEV_KEY_FILE).exists():
        key = (settings.data_dir / DEV_KEY_FILE).read_text().strip()
    if key is None:
        raise click.ClickException("no API key: pass --key, set GRPO_API_KEY, or run `grpo-jobs dev` locally")
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30)


def _check(resp: httpx.Response) -> dict | list:
    if resp.status_code >= 400:
        try:
            body = resp.json()
            msg = body.get("message") or body.get("detail")
        except ValueError:
            msg = resp.text
        raise click.ClickException(f"HTTP {resp.status_code}: {msg}")
    return resp.json()


url_opt = click.option("--url", envvar="GRPO_URL", help="Service address (default http://127.0.0.1:8000).")
key_opt = click.option("--key", envvar="GRPO_API_KEY", help="API key (default: the local dev key).")


@click.group()
def main() -> None:
    """Train language models with GRPO as jobs."""


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
    from service.sources import OWNER_NAME

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


@main.command()
@click.option("--host", default="127.0.0.1")
@click.option("--port", default=8000, type=int)
def serve(host: str, port: int) -> None:
    """Run the API. It starts even while the store is down: it migrates the store as soon as it
    can, answers 503 on /v1 until then, and /readyz says what is missing."""
    import uvicorn

    from service.app import create_app

    uvicorn.run(create_app(migrate=True), host=host, port=port, log_level="info")


def _worker_cmd(concurrency: int, loglevel: str) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", "worker.celery_app", "worker", "-Q", "gpu",
            "-c", str(concurrency), "--loglevel", loglevel, "--without-gossip", "--without-mingle"]


@main.command()
@click.option("--concurrency", default=1, type=int, help="Jobs at once (one per GPU).")
@click.option("--loglevel", default="INFO")
def worker(concurrency: int, loglevel: str) -> None:
    """Run a Celery worker on the `gpu` queue."""
    os.execv(sys.executable, _worker_cmd(concurrency, loglevel))


@main.command()
@click.option("--host", default="127.0.0.1")
@click.option("--port", default=8000, type=int)
def dev(host: str, port: int) -> None:
    """API + one worker on the embedded defaults (SQLite store, SQLite broker)."""
    import uvicorn

    from service.app import create_app
    from service.store import keys as keys_q
    from service.store.db import session_scope
    from service.store.migrate import upgrade

    settings = get_settings()
    upgrade(settings.store_url)
    key_file = settings.data_dir / DEV_KEY_FILE
    key = key_file.read_text().strip() if key_file.exists() else None
    with session_scope(settings.store_url) as s:
        if key is None or keys_q.owner_for_key(s, key=key) is None:
            key = keys_q.create_key(s, owner="local")
            key_file.write_text(key)
            key_file.chmod(0o600)
    click.echo(f"store:     {settings.store_url}\nbroker:    {settings.broker}")
    click.echo(f"API key:   {key}   (owner 'local'; saved in {key_file})")
    click.echo(f"dashboard: http://{host}:{port}/   API docs: http://{host}:{port}/docs", err=False)
    sys.stdout.flush()
    proc = subprocess.Popen(_worker_cmd(1, "WARNING"))
    # uvicorn re-raises SIGTERM once it has shut down; unhandled, that would end this process
    # before `finally` stops the worker, leaving it orphaned on the broker.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        uvicorn.run(create_app(settings), host=host, port=port, log_level="warning")
    finally:
        _stop_worker(proc)


def _exit_on_sigterm(_signum, _frame) -> None:
    raise SystemExit(0)


def _stop_worker(proc: subprocess.Popen) -> None:
    """Warm shutdown (finish the current step's bookkeeping), then cold, then kill. A job cut
    short keeps its lease until it goes stale and resumes from its checkpoint on the next start."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGQUIT, 5)):
        proc.send_signal(sig)
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
    proc.kill()
    proc.wait()


@main.command()
@click.argument("spec_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--wait", is_flag=True, help="Watch the job until it ends.")
@click.option("--idempotency-key", default=None)
@url_opt
@key_opt
def submit(spec_file: Path, wait: bool, idempotency_key: str | None, url: str | None, key: str | None) -> None:
    """Submit a job spec (YAML or JSON)."""
    with _client(url, key) as c:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        job = _check(c.post("/v1/jobs", json=_load_spec_file(spec_file), headers=headers))
        click.echo(f"job {job['id']} {job['status']}")
        if wait:
            _watch(c, job["id"])


@main.command()
@click.argument("job_id", type=int)
@url_opt
@key_opt
def status(job_id: int, url: str | None, key: str | None) -> None:
    """A job's status, progress and newest metrics."""
    with _client(url, key) as c:
        job = _check(c.get(f"/v1/jobs/{job_id}"))
        latest = _check(c.get(f"/v1/jobs/{job_id}/metrics/latest"))
    click.echo(f"job {job['id']} ({job['kind']}): {job['status']}, step {job['step']}/{job['total_steps']}")
    if job["error"]:
        click.echo(f"error: {job['error']}")
    for k in sorted(latest):
        click.echo(f"  {k:32s} {latest[k]['value']:.6g}  (step {latest[k]['step']})")


def _watch(c: httpx.Client, job_id: int) -> dict:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    with Progress(TextColumn("job {task.fields[job]}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn()) as bar:
        task = None
        while True:
            job = _check(c.get(f"/v1/jobs/{job_id}"))
            latest = _check(c.get(f"/v1/jobs/{job_id}/metrics/latest"))
            info = job["status"]
            if "reward/mean" in latest:
                info += f"  reward {latest['reward/mean']['value']:.3f}"
            if "eval/accuracy" in latest:
                info += f"  eval acc {latest['eval/accuracy']['value']:.3f}"
            if task is None:
                task = bar.add_task("", total=job["total_steps"], job=job_id, info=info)
            bar.update(task, completed=job["step"], info=info)
            if job["status"] in ("succeeded", "failed", "cancelled"):
                break
            time.sleep(2)
    if job["status"] == "failed":
        click.echo(f"job {job_id} failed: {job['error']}", err=True)
    return job


@main.command()
@click.argument("job_id", type=int)
@url_opt
@key_opt
def watch(job_id: int, url: str | None, key: str | None) -> None:
    """A live progress bar (step/total, reward, ETA) until the job ends."""
    with _client(url, key) as c:
        job = _watch(c, job_id)
    sys.exit(0 if job["status"] == "succeeded" else 1)


@main.command()
@click.argument("spec_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--out", "out", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Writes metrics.jsonl, events.jsonl, selections.jsonl, sparsity.jsonl, checkpoints/.")
def run(spec_file: Path, out: Path) -> None:
    """Run a job in this process, no service needed."""
    from pydantic import TypeAdapter, ValidationError

    from service.specs import JobSpec

    try:
        spec = TypeAdapter(JobSpec).validate_python(_load_spec_file(spec_file))
    except ValidationError as exc:
        raise click.ClickException(f"{spec_file}: invalid job spec\n{exc}") from exc
    from worker.reporting import FileReporter
    from worker.runner import loop_for

    reporter = FileReporter(out, echo=click.echo)
    try:
        result = loop_for(spec.kind)(spec, reporter, settings=get_settings())
    except Exception as exc:
        reporter.event("failed", f"{type(exc).__name__}: {exc}", level="error")
        raise click.ClickException(f"job failed: {type(exc).__name__}: {exc}") from exc
    summary = json.dumps(dataclasses.asdict(result))
    reporter.event(result.status, summary)
    click.echo(summary)


def _first(points: list[dict], n: int) -> float | None:
    vals = [p["value"] for p in points[:n]]
    return sum(vals) / len(vals) if vals else None


def _last(points: list[dict], n: int) -> float | None:
    vals = [p["value"] for p in points[-n:]]
    return sum(vals) / len(vals) if vals else None


@main.command()
@click.option("--port", default=8000, type=int)
@click.option("--spec", "spec_file", default="examples/demo-smollm2.yaml",
              type=click.Path(exists=True, dir_okay=False, path_type=Path))
def demo(port: int, spec_file: Path) -> None:
    """Start `dev`, run a real GRPO job on SmolLM2-135M end to end, report what it learned, stop."""
    settings = get_settings()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "service.cli", "dev", "--port", str(port)])
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise click.ClickException(f"`grpo-jobs dev` exited with {proc.returncode}; is port {port} free?")
            time.sleep(0.2)
        key = (settings.data_dir / DEV_KEY_FILE).read_text().strip()
        with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=30) as c:
            job = _check(c.post("/v1/jobs", json=_load_spec_file(spec_file)))
            click.echo(f"submitted job {job['id']} ({spec_file}); the first run converts the bundled model (~20 s)")
            job = _watch(c, job["id"])
            series = {s["key"]: s["points"] for s in _check(c.get(
                f"/v1/jobs/{job['id']}/metrics", params={"keys": "reward/mean,eval/accuracy,time/step_s"}))["series"]}
        reward, acc, step_s = series.get("reward/mean", []), series.get("eval/accuracy", []), series.get("time/step_s", [])
        click.echo(f"\njob {job['id']} {job['status']} after {job['step']}/{job['total_steps']} steps")
        if reward:
            click.echo(f"  reward/mean    first 3 steps {_first(reward, 3):.3f}  ->  last 3 steps {_last(reward, 3):.3f}")
        if acc:
            click.echo(f"  eval/accuracy  step {acc[0]['step']}: {acc[0]['value']:.3f}  ->  step {acc[-1]['step']}: "
                       f"{acc[-1]['value']:.3f}   (greedy, held-out problems)")
        if step_s:
            click.echo(f"  {sum(p['value'] for p in step_s) / len(step_s) / 60:.2f} minutes per step")
        click.echo(f"  dashboard: {base}/    API docs: {base}/docs    API key: {key}")
        click.echo(f"  keep it running with `make dev`; inspect with `grpo-jobs status {job['id']}`")
        if job["status"] != "succeeded":
            sys.exit(1)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    main()

"""Commands that start the service's processes: the API, workers, both at once, the demo."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import click
import httpx

from service.cli.client import watch_job
from service.cli.common import DEV_KEY_FILE, check, load_spec_file
from service.cli.group import main
from service.cli.malloc import training_env
from service.core import queue
from service.core.settings import get_settings


@main.command()
@click.option("--host", default="127.0.0.1")
@click.option("--port", default=8000, type=int)
@click.option("--workers", default=None, type=click.IntRange(1, 64),
              help="API processes behind the port (default: GRPO_API_WORKERS, else the machine's cores).")
def serve(host: str, port: int, workers: int | None) -> None:
    """Run the API. It starts even while the store is down: it migrates the store as soon as it
    can, answers 503 on /v1 until then, and /readyz says what is missing. Each of its processes migrates
    (one at a time: the others find the store at head), delivers webhooks (each delivery claimed by one)
    and watches its own streams."""
    import uvicorn

    n = workers or get_settings().api_workers or os.cpu_count() or 1
    uvicorn.run("service.app:serve_app", factory=True, workers=n, host=host, port=port, log_level="info")


def _worker_cmd(concurrency: int, loglevel: str) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", "worker.jobs.celery_app", "worker", "-Q", queue.ANY_WORKER,
            "-c", str(concurrency), "--loglevel", loglevel, "--without-gossip", "--without-mingle"]


@main.command()
@click.option("--concurrency", default=1, type=int, help="Jobs at once (one per GPU).")
@click.option("--loglevel", default="INFO")
def worker(concurrency: int, loglevel: str) -> None:
    """Run a Celery worker: the `jobs` queue, and the `gpu` queues its GPUs can hold."""
    os.execve(sys.executable, _worker_cmd(concurrency, loglevel), training_env(get_settings()))


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
    if not settings.admin_owners:  # one machine, one user: its key is the operator's and sees the workers
        settings = settings.model_copy(update={"admin_owners_env": "local"})
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
    proc = subprocess.Popen(_worker_cmd(1, "WARNING"), env=training_env(settings))
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
    # The service's own output (the worker's banner, model conversion progress, access logs) goes
    # to a file: the terminal shows what the demo is doing.
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    log_path = settings.data_dir / "demo.log"
    log = log_path.open("w")
    click.echo(f"starting the service on {base} (SQLite store and broker under {settings.data_dir}); "
               f"its log: {log_path}")
    proc = subprocess.Popen([sys.executable, "-m", "service.cli", "dev", "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise click.ClickException(f"`grpo-jobs dev` exited with {proc.returncode} (is port {port} free?); "
                                           f"see {log_path}")
            time.sleep(0.2)
        key = (settings.data_dir / DEV_KEY_FILE).read_text().strip()
        with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=30) as c:
            job = check(c.post("/v1/jobs", json=load_spec_file(spec_file)))
            click.echo(f"submitted job {job['id']} ({spec_file}): GRPO with LoRA on SmolLM2-135M; the first run "
                       "converts the bundled model (~20 s)")
            job = watch_job(c, job["id"])
            series = {s["key"]: s["points"] for s in check(c.get(
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
        click.echo(f"  keep it running with `make dev`; inspect with `grpo-jobs status {job['id']}`; "
                   f"service log: {log_path}")
        if job["status"] != "succeeded":
            sys.exit(1)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()

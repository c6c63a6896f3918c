"""Commands that talk to a running service over its API."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click
import httpx

from service.cli.common import check, client, key_opt, load_spec_file, url_opt
from service.cli.group import main


@main.command()
@click.argument("spec_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--wait", is_flag=True, help="Watch the job until it ends.")
@click.option("--idempotency-key", default=None)
@url_opt
@key_opt
def submit(spec_file: Path, wait: bool, idempotency_key: str | None, url: str | None, key: str | None) -> None:
    """Submit a job spec (YAML or JSON)."""
    with client(url, key) as c:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        job = check(c.post("/v1/jobs", json=load_spec_file(spec_file), headers=headers))
        click.echo(f"job {job['id']} {job['status']}")
        if wait:
            watch_job(c, job["id"])


@main.command()
@click.argument("job_id", type=int)
@url_opt
@key_opt
def status(job_id: int, url: str | None, key: str | None) -> None:
    """A job's status, progress and newest metrics."""
    with client(url, key) as c:
        job = check(c.get(f"/v1/jobs/{job_id}"))
        latest = check(c.get(f"/v1/jobs/{job_id}/metrics/latest"))
    click.echo(f"job {job['id']} ({job['kind']}): {job['status']}, step {job['step']}/{job['total_steps']}")
    if job["error"]:
        click.echo(f"error: {job['error']}")
    for k in sorted(latest):
        click.echo(f"  {k:32s} {latest[k]['value']:.6g}  (step {latest[k]['step']})")


def watch_job(c: httpx.Client, job_id: int) -> dict:
    from rich.progress import (
        BarColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    with Progress(TextColumn("job {task.fields[job]}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn()) as bar:
        task = None
        while True:
            job = check(c.get(f"/v1/jobs/{job_id}"))
            latest = check(c.get(f"/v1/jobs/{job_id}/metrics/latest"))
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
    with client(url, key) as c:
        job = watch_job(c, job_id)
    sys.exit(0 if job["status"] == "succeeded" else 1)

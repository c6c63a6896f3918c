"""Commands that talk to a running service over its API."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click
import httpx

from service.cli.common import check, client, key_opt, load_spec_file, url_opt
from service.cli.group import main
from service.core.fingerprint import Fingerprint, largest_difference


@main.command()
@click.argument("spec_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--wait", is_flag=True, help="Watch the job until it ends.")
@click.option("--idempotency-key", default=None)
@click.option("--init-from", "init_from", type=click.IntRange(min=1), default=None,
              help="Start the model from this earlier job's latest checkpoint (sets model.init_from.job): "
              "a cold start's SFT job before a GRPO job, say.")
@url_opt
@key_opt
def submit(spec_file: Path, wait: bool, idempotency_key: str | None, init_from: int | None, url: str | None,
           key: str | None) -> None:
    """Submit a job spec (YAML or JSON)."""
    spec = load_spec_file(spec_file)
    if init_from is not None:
        if not isinstance(spec.get("model", {}), dict):
            raise click.ClickException(f"{spec_file}: model is not a mapping; --init-from sets model.init_from")
        spec["model"] = {**spec.get("model", {}), "init_from": {"job": init_from}}
    with client(url, key) as c:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        job = check(c.post("/v1/jobs", json=spec, headers=headers), spec_file=spec_file)
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
    if health := job.get("health"):
        click.echo(f"health: {health['level']}")
        for flag in (f for f in health["guards"].values() if f and f["level"] != "ok"):
            click.echo(f"  {flag['level']:8s} {flag['message']}")
    for k in sorted(latest):
        click.echo(f"  {k:32s} {latest[k]['value']:.6g}  (step {latest[k]['step']})")


@main.command()
@click.argument("job_id", type=int)
@click.option("--wait", is_flag=True, help="Watch the new job to its end, then compare its fingerprint and learned "
              "metrics with the original's (exit 1 if they differ).")
@click.option("--rtol", default=1e-6, show_default=True, help="Largest relative difference of a metric counted as equal.")
@url_opt
@key_opt
def reproduce(job_id: int, wait: bool, rtol: float, url: str | None, key: str | None) -> None:
    """Submit a job's spec again as it ran (every default filled in)."""
    with client(url, key) as c:
        job = check(c.get(f"/v1/jobs/{job_id}"))
        if job["kind"] == "session":
            raise click.ClickException("a session run's steps were its client's: run the client again")
        new = check(c.post("/v1/jobs", json=job["spec"]))
        click.echo(f"job {new['id']} {new['status']} (reproduces job {job_id})")
        if not wait:
            return
        done = watch_job(c, new["id"])
        same = _compare_runs(c, job_id, new["id"], rtol) if done["status"] == job["status"] == "succeeded" else False
    sys.exit(0 if same else 1)


def _series(c: httpx.Client, job_id: int) -> dict[str, dict[int, float]]:
    body = check(c.get(f"/v1/jobs/{job_id}/metrics", params={"max_points": 100_000}))
    return {s["key"]: {p["step"]: p["value"] for p in s["points"]} for s in body["series"]}


def _compare_runs(c: httpx.Client, a: int, b: int, rtol: float) -> bool:
    """Print whether two finished jobs ran the same (fingerprints) and learned the same (metrics)."""
    fa, fb = (check(c.get(f"/v1/jobs/{j}"))["fingerprint"] for j in (a, b))
    if fa is None or fb is None:
        click.echo("fingerprints: missing (a job recorded none)")
        return False
    diffs = Fingerprint.model_validate(fa).differences(Fingerprint.model_validate(fb))
    click.echo("fingerprints: identical" if not diffs else f"fingerprints differ in: {', '.join(diffs)}")
    mismatched, worst = largest_difference(_series(c, a), _series(c, b))
    equal = not mismatched and worst <= rtol
    click.echo(f"metrics: {'equal' if equal else 'different'} (largest relative difference {worst:.3g}"
               f"{'; steps differ for ' + ', '.join(mismatched) if mismatched else ''})")
    return not diffs and equal


class ConditionalGet:
    """GETs that send the validator of the last answer to the same path (If-None-Match): while nothing
    changed the server answers 304 with no body, and the last answer stands."""

    def __init__(self, c: httpx.Client) -> None:
        self.c = c
        self.seen: dict[str, tuple[str, dict | list]] = {}  # path -> (ETag, its answer)
        self.unchanged = 0  # answers that were 304s

    def __call__(self, path: str) -> dict | list:
        tag, body = self.seen.get(path, (None, None))
        r = self.c.get(path, headers={"If-None-Match": tag} if tag else {})
        if r.status_code == 304 and body is not None:
            self.unchanged += 1
            return body
        body = check(r)
        if etag := r.headers.get("etag"):
            self.seen[path] = (etag, body)
        return body


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
        task, get = None, ConditionalGet(c)
        while True:
            job = get(f"/v1/jobs/{job_id}")
            latest = get(f"/v1/jobs/{job_id}/metrics/latest")
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

"""Data in, model out: `files upload|list|delete` and `download` (a checkpoint, unpacked)."""

from __future__ import annotations

import tarfile
import tempfile
from pathlib import Path

import click

from service.cli.common import check, client, key_opt, url_opt
from service.cli.group import main

PURPOSES = ("train", "eval", "corpus")


@main.group()
def files() -> None:
    """Upload data files (JSONL or Parquet) and name them in a spec's dataset."""


@files.command("upload")
@click.argument("path", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--purpose", type=click.Choice(PURPOSES), required=True,
              help="train / eval: rows {prompt, answer}; corpus: rows {id, text}.")
@url_opt
@key_opt
def upload(path: Path, purpose: str, url: str | None, key: str | None) -> None:
    """Upload PATH; prints the file id to put in dataset.train_file / val_file / corpus_file."""
    with client(url, key) as c, path.open("rb") as f:
        out = check(c.post("/v1/files", files={"file": (path.name, f)}, data={"purpose": purpose}, timeout=600))
    click.echo(f"{out['id']}  {out['purpose']}  {out['rows']} rows  {out['bytes']} bytes  {out['filename']}")


@files.command("list")
@click.option("--purpose", type=click.Choice(PURPOSES), default=None)
@url_opt
@key_opt
def list_(purpose: str | None, url: str | None, key: str | None) -> None:
    """Your files, newest first."""
    params = {"purpose": purpose} if purpose else {}
    with client(url, key) as c:
        while True:
            page = check(c.get("/v1/files", params={**params, "limit": 200}))
            for f in page["items"]:
                click.echo(f"{f['id']}  {f['purpose']:6s}  {f['rows']:>8} rows  {f['created_at'][:19]}  {f['filename']}")
            if not page["has_more"]:
                break
            params["after"] = page["next_after"]


@files.command("delete")
@click.argument("file_id")
@url_opt
@key_opt
def delete(file_id: str, url: str | None, key: str | None) -> None:
    """Delete a file (refused while an unfinished job uses it)."""
    with client(url, key) as c:
        r = c.delete(f"/v1/files/{file_id}")
        if r.status_code != 204:
            check(r)
    click.echo(f"deleted {file_id}")


@main.command()
@click.argument("job_id", type=int)
@click.option("--step", type=int, default=None, help="The checkpoint's step; default: the latest.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Folder to unpack into; the checkpoint lands in OUT/job-<id>-step-<step>/.")
@url_opt
@key_opt
def download(job_id: int, step: int | None, out: Path, url: str | None, key: str | None) -> None:
    """Download a job's checkpoint (the peft adapter or the model folder, with the tokenizer) and unpack it."""
    with client(url, key) as c:
        if step is None:
            ckpts = check(c.get(f"/v1/jobs/{job_id}/checkpoints"))
            if not ckpts:
                raise click.ClickException(f"job {job_id} has no checkpoints yet")
            step = ckpts[-1]["step"]
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile() as tmp:
            with c.stream("GET", f"/v1/jobs/{job_id}/checkpoints/{step}/archive", timeout=600) as r:
                if r.status_code != 200:
                    r.read()
                    check(r)
                for chunk in r.iter_bytes():
                    tmp.write(chunk)
            tmp.seek(0)
            with tarfile.open(fileobj=tmp, mode="r:gz") as tar:
                tar.extractall(out, filter="data")  # no absolute paths, links out or devices
    click.echo(str(out / f"job-{job_id}-step-{step}"))

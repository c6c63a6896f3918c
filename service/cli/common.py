"""What every command shares: the spec file reader, the API client, its options."""

from __future__ import annotations

import json
import os
from pathlib import Path

import click
import httpx
import yaml

from service.core.settings import get_settings

DEV_KEY_FILE = "dev-api-key"


def load_spec_file(path: Path) -> dict:
    text = path.read_text()
    data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    if not isinstance(data, dict):
        raise click.ClickException(f"{path}: a job spec must be a mapping, got {type(data).__name__}")
    return data


def client(url: str | None, key: str | None) -> httpx.Client:
    settings = get_settings()
    url = url or os.environ.get("GRPO_URL", "http://127.0.0.1:8000")
    key = key or os.environ.get("GRPO_API_KEY")
    if key is None and (settings.data_dir / DEV_KEY_FILE).exists():
        key = (settings.data_dir / DEV_KEY_FILE).read_text().strip()
    if key is None:
        raise click.ClickException("no API key: pass --key, set GRPO_API_KEY, or run `grpo-jobs dev` locally")
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30)


def check(resp: httpx.Response) -> dict | list:
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

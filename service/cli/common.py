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
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise click.ClickException(f"{path}: not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {exc}") from exc
    if not isinstance(data, dict):
        raise click.ClickException(f"{path}: a job spec must be a mapping, got {type(data).__name__}")
    return data


def field_line(text: str, field: str) -> int | None:
    """The line of `text` (YAML, or JSON, which YAML reads too) where `field` (`grpo.num_generations`,
    `rewards.0.name`) is written, or its nearest written parent's; None where no part of it is."""
    try:
        node = yaml.compose(text)
    except yaml.YAMLError:
        return None
    line = None
    for part in field.split(".") if field else []:
        if isinstance(node, yaml.MappingNode):
            match = next(((k, v) for k, v in node.value if getattr(k, "value", None) == part), None)
            if match is None:
                break
            line, node = match[0].start_mark.line + 1, match[1]
        elif isinstance(node, yaml.SequenceNode) and part.isdigit() and int(part) < len(node.value):
            node = node.value[int(part)]
            line = node.start_mark.line + 1
        else:
            break
    return line


def spec_errors(path: Path, detail: list[dict]) -> click.ClickException:
    """A refused spec's errors, one a line, as the API names them (`field: message`), each with the
    line of the file it is about."""
    text = path.read_text()
    lines = []
    for d in detail:
        line = field_line(text, d["field"])
        where = f"line {line}, " if line else ""
        lines.append(f"  {where}{d['field'] or 'the spec'}: {d['message']}")
    return click.ClickException(f"{path}: invalid job spec\n" + "\n".join(lines))


def client(url: str | None, key: str | None) -> httpx.Client:
    settings = get_settings()
    url = url or os.environ.get("GRPO_URL", "http://127.0.0.1:8000")
    key = key or os.environ.get("GRPO_API_KEY")
    if key is None and (settings.data_dir / DEV_KEY_FILE).exists():
        key = (settings.data_dir / DEV_KEY_FILE).read_text().strip()
    if key is None:
        raise click.ClickException("no API key: pass --key, set GRPO_API_KEY, or run `grpo-jobs dev` locally")
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30)


def check(resp: httpx.Response, *, spec_file: Path | None = None) -> dict | list:
    """The answer's JSON; an error answer raises with its message (a refused `spec_file`, field by field)."""
    if resp.status_code == 422 and spec_file is not None:
        detail = resp.json().get("detail")
        if isinstance(detail, list):
            raise spec_errors(spec_file, detail)
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

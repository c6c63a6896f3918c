"""A refused spec reads as the API says it, field by field, each with the line of the file it is about:
from `grpo-jobs run` (validated here) and from `grpo-jobs submit` (validated by the API)."""

import json

import click
import pytest

from service.cli.common import check, field_line, spec_errors
from service.core.errors import format_errors
from service.core.specs import parse_spec

SPEC = """\
kind: grpo
model:
  name: smollm2-135m-instruct
grpo:
  steps: 3
  num_generations: 1
rewards:
  - {name: numeric_match}
  - {name: nope}
"""


def test_field_line_finds_the_field_or_its_nearest_parent():
    assert field_line(SPEC, "grpo.num_generations") == 6
    assert field_line(SPEC, "rewards.1.name") == 9
    assert field_line(SPEC, "grpo.learning_rate") == 4  # not written: its section's line
    assert field_line(SPEC, "") is None and field_line("kind: [", "kind") is None
    as_json = json.dumps({"kind": "grpo", "grpo": {"num_generations": 1}}, indent=1)
    assert field_line(as_json, "grpo.num_generations") == 4


def test_run_prints_each_error_with_its_line_and_not_pydantics_repr(tmp_path):
    import yaml
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as exc:
        parse_spec(yaml.safe_load(SPEC))
    path = tmp_path / "job.yaml"
    path.write_text(SPEC)
    message = spec_errors(path, format_errors(exc.value.errors())["detail"]).message
    assert "line 6, grpo.num_generations: Input should be greater than or equal to 2" in message
    assert "line 9, rewards.1.name: unknown reward 'nope'" in message
    assert "tagged-union" not in message and "validation error" not in message


def test_submit_prints_the_apis_errors_with_their_lines(tmp_path, sqlite_api):
    import yaml

    path = tmp_path / "job.yaml"
    path.write_text(SPEC)
    answer = sqlite_api.post("/v1/jobs", json=yaml.safe_load(SPEC))
    assert answer.status_code == 422
    with pytest.raises(click.ClickException) as exc:
        check(answer, spec_file=path)
    assert exc.value.message.splitlines()[0] == f"{path}: invalid job spec"
    assert "line 6, grpo.num_generations: Input should be greater than or equal to 2" in exc.value.message
    assert "line 9, rewards.1.name: unknown reward 'nope'" in exc.value.message
    assert sqlite_api.get("/v1/jobs").json()["items"] == []  # nothing stored


def test_run_finds_the_vllm_environment_make_vllm_built(tmp_path, monkeypatch):
    from service.cli.local import _find_vllm
    from service.core.settings import get_settings

    python = tmp_path / ".venv-vllm" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GRPO_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.delenv("GRPO_VLLM_PYTHON", raising=False)
    get_settings.cache_clear()
    try:
        _find_vllm()
        assert get_settings().vllm_python == python
        monkeypatch.setenv("GRPO_VLLM_PYTHON", "/opt/vllm/bin/python")  # an admin's choice stands
        get_settings.cache_clear()
        _find_vllm()
        assert str(get_settings().vllm_python) == "/opt/vllm/bin/python"
    finally:
        get_settings.cache_clear()


def test_submit_init_from_sets_the_models_starting_job(tmp_path, sqlite_api, monkeypatch):
    """`grpo-jobs submit SPEC --init-from N`: the spec's model.init_from.job is N, checked by the API as if
    written in the file (an unknown job is refused naming the field, and nothing is stored)."""
    from contextlib import nullcontext

    from click.testing import CliRunner

    from service.cli import client as cli_client
    from service.cli.group import main

    monkeypatch.setattr(cli_client, "client", lambda url, key: nullcontext(sqlite_api))
    path = tmp_path / "job.yaml"
    path.write_text("kind: grpo\nmodel: {name: tiny-random-llama}\n")
    r = CliRunner().invoke(main, ["submit", str(path), "--init-from", "424242"])
    assert r.exit_code != 0 and "model.init_from" in r.output, r.output
    assert sqlite_api.get("/v1/jobs").json()["items"] == []
    r = CliRunner().invoke(main, ["submit", str(path)])
    assert r.exit_code == 0 and r.output.startswith("job "), r.output

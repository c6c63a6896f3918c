"""OpenEnv servers as their users run them, unmodified: the echo server `openenv init` generates with
openenv 0.10 (one WebSocket session at a time, its default) trains a job that asks for four sessions at
once, losing no episode and leaving its slot free; and a job's worker killed mid-episode leaves no
session open on the server (counted by the server)."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import yaml

from service.core.specs import GRPOJob
from worker.engines.vllm_engine import free_port
from worker.environments.client import Slots, opened
from worker.environments.servers import BundledServer
from worker.loops import grpo
from worker.reporting import FileReporter


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def _job(url, **env):
    return {"kind": "grpo", "model": {"name": "tiny-random-llama", "lora": {"r": 4}},
            "environment": {"url": url, "max_turns": 2, "max_episode_tokens": 160, "max_observation_tokens": 48,
                            "eval_episodes": 2, "timeout_s": 10.0, "max_concurrent": 4, **env},
            "grpo": {"steps": 2, "prompts_per_step": 2, "num_generations": 2, "max_new_tokens": 6}}


@pytest.fixture
def echo_server(openenv_python, tmp_path):
    """`openenv init echo_env`, served as its README says (`python -m server.app`), untouched."""
    subprocess.run([str(openenv_python.parent / "openenv"), "init", "echo_env"], cwd=tmp_path, check=True,
                   capture_output=True, timeout=120)
    port = free_port()
    log = (tmp_path / "echo.log").open("wb")
    proc = subprocess.Popen([str(openenv_python), "-m", "server.app", "--port", str(port)], cwd=tmp_path / "echo_env",
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.3)
    else:
        pytest.fail(f"the echo server did not start: {(tmp_path / 'echo.log').read_text()[-2000:]}")
    yield url
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def test_the_echo_server_openenv_init_makes_trains_a_job_asking_for_four_sessions(echo_server, tmp_path,
                                                                                  settings_factory):
    spec = GRPOJob.model_validate(_job(echo_server, observation_field="echoed_message"))
    result = grpo.run(spec, FileReporter(tmp_path / "out"), settings=settings_factory(GRPO_ENVIRONMENT_URLS=echo_server))
    assert result.status == "succeeded"
    metrics = {m["step"]: m["metrics"] for m in _lines(tmp_path / "out" / "metrics.jsonl")}
    assert [metrics[s]["env/error_ratio"] for s in (1, 2)] == [0.0, 0.0]  # every episode played
    assert [metrics[s]["env/sessions_open_max"] for s in (1, 2)] == [1.0, 1.0]  # one at a time, as the server has
    assert sum(metrics[s]["env/sessions_refused"] for s in (1, 2)) > 0  # the other three waited for its slot
    events = _lines(tmp_path / "out" / "events.jsonl")
    assert not [e for e in events if e["type"] == "health" and e["data"]["guard"] == "environment"]

    async def slot_is_free() -> int:  # the server's one slot: free at once, no session of the job left on it
        slots = Slots()
        async with opened(echo_server, 0, timeout_s=5.0, max_bytes=1 << 20, slots=slots):
            return slots.refused

    assert asyncio.run(slot_is_free()) == 0


def test_a_worker_killed_mid_episode_leaves_no_session_open(tmp_path):
    # each step first waits up to 0.5 s, so an episode's session stays open long enough for the 10 ms poll below
    # to see it on a loaded machine (a tiny model's episode is otherwise over within milliseconds)
    server = BundledServer("guess-number", tmp_path / "guess.log", step_delay_s=0.5)
    url = server.start()
    try:
        spec = _job(url, max_turns=4)
        spec["grpo"]["steps"] = 50
        (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
        log = tmp_path / "job.log"
        with log.open("wb") as out:
            job = subprocess.Popen([sys.executable, "-m", "service.cli", "run", str(tmp_path / "job.yaml"), "--out",
                                    str(tmp_path / "out")], env={**os.environ, "GRPO_ENVIRONMENT_URLS": url,
                                                                  "GRPO_DATA_DIR": str(tmp_path / "data")},
                                   stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 300  # the job's start (imports, the model) on a loaded machine
        while server.sessions()["open"] == 0 and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.sessions()["open"] > 0, f"the job never opened a session: {log.read_text()[-3000:]}"
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
        deadline = time.monotonic() + 10
        while server.sessions()["open"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.sessions()["open"] == 0  # the server saw each connection drop, and closed its session
    finally:
        server.stop()


def test_a_job_draws_the_task_apis_tasks_by_split_where_the_server_has_them(openenv_python, tmp_path,
                                                                           settings_factory):
    """openenv 0.10's create_app serves the bundled multiplication's tasks (train: 100,000; test: 1,000);
    openenv-core 0.3's has no Task API, and a job asking for tasks there fails at its start, saying so."""
    from worker.environments.bundled import MultiplicationEnvironment, multiplication

    spec = _job("", tasks={"train": "train", "eval": "test"}, max_concurrent=8)
    for python, log in ((openenv_python, "new.log"), (None, "old.log")):
        server = BundledServer("multiplication", tmp_path / log, python=python)
        url = server.start()
        try:
            spec["environment"]["url"] = url
            out = tmp_path / log.replace(".log", "")
            settings = settings_factory(GRPO_ENVIRONMENT_URLS=url)
            if python is None:
                with pytest.raises(Exception, match="the server has no Task API"):
                    grpo.run(GRPOJob.model_validate(spec), FileReporter(out), settings=settings)
                continue
            assert grpo.run(GRPOJob.model_validate(spec), FileReporter(out), settings=settings).status == "succeeded"
        finally:
            server.stop()
    samples = _lines(tmp_path / "new" / "samples.jsonl")
    train = MultiplicationEnvironment.SPLITS["train"][1]
    for s in samples:  # each episode is its train task's: the question of the seed the split gives its index
        index = s["extra"]["episode"]["seed"]
        assert 0 <= index < 100_000 and s["prompt"].startswith(multiplication(train + index)[0])

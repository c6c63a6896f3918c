"""Agent jobs (multi-turn episodes in a bundled environment) on the production layout: `grpo-jobs serve`
and a separate `grpo-jobs worker` on PostgreSQL and Redis: on one worker, a cold start (SFT on an
environment's demonstrations, then GRPO from it, shown the environment's MCP tools) beside a game, and
an environment server killed mid-job. The embedded default runs one in tests/dashboard (`grpo-jobs dev`); episodes
sampled by a vLLM server are checked token by token in tests/worker/engines/test_vllm_engine.py."""

import os
import signal
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import parent_pid, wait_job
from tests.e2e.test_celery_redis_postgres import service  # noqa: F401  (the fixture)

AGENT_JOB = {"kind": "grpo", "name": "agent-hf", "model": {"name": "tiny-random-llama", "lora": {"r": 4}},
             "environment": {"name": "calculator", "max_turns": 2, "max_episode_tokens": 192,
                             "max_observation_tokens": 48, "eval_episodes": 2},
             "grpo": {"steps": 2, "prompts_per_step": 2, "num_generations": 2, "max_new_tokens": 8,
                      "checkpoint_every": 1}}
GAME_JOB = {**AGENT_JOB, "name": "agent-game", "environment": {**AGENT_JOB["environment"], "name": "guess-number"}}
# the model shown the bundled multiplication's MCP calculator tool, in the ChatML tools template
TOOL_JOB = {**AGENT_JOB, "name": "agent-tools", "model": {**AGENT_JOB["model"], "chat_template": "chatml-tools"},
            "environment": {**AGENT_JOB["environment"], "name": "multiplication", "tools": "mcp",
                            "max_episode_tokens": 320}}
# its cold start: SFT on the environment's demonstrations (examples/agent-tools-sft.yaml at a small size)
SFT_JOB = {"kind": "sft", "name": "agent-sft", "model": TOOL_JOB["model"],
           "dataset": {"name": "env-demos", "num_train": 8, "num_val": 4}, "environment": TOOL_JOB["environment"],
           "sft": {"steps": 2, "batch_size": 4, "max_new_tokens": 8, "learning_rate": 3e-3, "checkpoint_every": 1}}

def _servers_under(pid: int) -> list[int]:
    """Bundled environment servers among the descendants of `pid`."""
    found = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "worker.environments.serve" not in cmd:
            continue
        up = int(p)
        while up not in (pid, 1, 0) and up is not None:
            up = parent_pid(up)
        if up == pid:
            found.append(int(p))
    return found


def _episodes(c, job):
    samples = c.get(f"/v1/jobs/{job['id']}/samples", params={"step": job["total_steps"]}).json()
    assert samples, job
    return [s["extra"]["episode"] for s in samples]


def _check_agent_job(c, job, procs):
    assert job["status"] == "succeeded", (job, procs.logs())
    for ep in _episodes(c, job):
        assert 1 <= len(ep["turns"]) <= 2 and ep["tokens"]["sampled"] > 0
        assert ep["done"] or ep["truncated"] or ep["error"]
    keys = "env/turns_mean,env/episode_tokens_mean,eval/reward_mean,time/env_s"
    series = {s["key"]: s["points"] for s in c.get(f"/v1/jobs/{job['id']}/metrics", params={"keys": keys}).json()["series"]}
    assert len(series["env/turns_mean"]) == 2 and len(series["eval/reward_mean"]) == 2  # steps 1-2; evals 0 and 2
    types = [e["type"] for e in c.get(f"/v1/jobs/{job['id']}/events").json()]
    assert "environment" in types and types[-1] == "succeeded"


@pytest.mark.redis
@pytest.mark.postgres
def test_two_agent_jobs_on_one_worker(service, procs):  # noqa: F811
    c = service()
    worker = dict(procs.procs)["worker"].pid
    cold, second = c.post("/v1/jobs", json=SFT_JOB), c.post("/v1/jobs", json=GAME_JOB)
    assert cold.status_code == second.status_code == 201, (cold.text, second.text)
    sft = wait_job(c, cold.json()["id"], procs)  # the recipe's first command: SFT on demonstrations
    assert sft["status"] == "succeeded", (sft, procs.logs())
    events = c.get(f"/v1/jobs/{sft['id']}/events").json()
    assert [e["data"] for e in events if e["type"] == "demonstrations"] == [{"train": 8, "val": 4}]
    tools = {**TOOL_JOB, "model": {**TOOL_JOB["model"], "init_from": {"job": sft["id"]}}}  # then GRPO from it
    first = c.post("/v1/jobs", json=tools)
    assert first.status_code == 201, first.text
    _check_agent_job(c, wait_job(c, first.json()["id"], procs), procs)
    _check_agent_job(c, wait_job(c, second.json()["id"], procs), procs)
    events = c.get(f"/v1/jobs/{first.json()['id']}/events").json()
    (shown,) = [e for e in events if e["type"] == "environment"]
    assert shown["data"]["tools"] == ["calculator"], shown
    assert [e["message"] for e in events if e["type"] == "initialised"] == [f"weights from job {sft['id']}, step 2"]
    assert _servers_under(worker) == []  # each job's environment server ended with it


@pytest.mark.redis
@pytest.mark.postgres
def test_an_environment_server_killed_mid_job_costs_one_attempt(service, procs):  # noqa: F811
    c = service()
    worker = dict(procs.procs)["worker"].pid
    spec = {**AGENT_JOB, "name": "agent-killed", "grpo": {**AGENT_JOB["grpo"], "steps": 6}}
    job = c.post("/v1/jobs", json=spec).json()
    deadline = time.time() + 300
    while time.time() < deadline and not c.get(f"/v1/jobs/{job['id']}/checkpoints").json():
        time.sleep(0.5)
    (server,) = _servers_under(worker)
    os.kill(server, signal.SIGKILL)
    done = wait_job(c, job["id"], procs, timeout=400)
    assert done["status"] == "succeeded", (done, procs.logs())
    events = c.get(f"/v1/jobs/{job['id']}/events").json()
    down = [e for e in events if "environment server is down" in e["message"]]
    assert down, [e["message"] for e in events]
    started = [e for e in events if e["type"] == "started"]
    assert len(started) == 2 and any(e["type"] == "resumed" for e in events)
    steps = [p["step"] for p in c.get(f"/v1/jobs/{job['id']}/metrics", params={"keys": "reward/mean"}).json()["series"][0]["points"]]
    assert sorted(set(steps)) == [1, 2, 3, 4, 5, 6]
    assert _servers_under(worker) == []

"""A GRPO job whose episodes run on an OpenEnv server named by URL: the admin's allow-list checked again by
the worker, and a server that answers some steps too slowly costs those episodes, not the job."""

import asyncio
import json

import pytest

from service.core.grader_urls import UrlRefused
from service.core.specs import GRPOJob
from tests.worker.environments.test_client import Hostile
from worker.environments.servers import BundledServer
from worker.loops import grpo
from worker.reporting import FileReporter


def _spec(url, steps=2, **env):
    # timeout_s also bounds opening a session: 1 s once timed out a lone eval episode's connect on a loaded CI box
    return GRPOJob.model_validate({
        "kind": "grpo", "model": {"name": "tiny-random-llama", "lora": {"r": 4}},
        "environment": {"url": url, "max_turns": 2, "max_episode_tokens": 160, "max_observation_tokens": 48,
                        "eval_episodes": 2, "timeout_s": 2.0, **env},
        "grpo": {"steps": steps, "prompts_per_step": 2, "num_generations": 2, "max_new_tokens": 6}})


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_a_server_by_url_on_the_allow_list(tmp_path, settings_factory):
    server = BundledServer("calculator", tmp_path / "calculator.log")
    url = server.start()
    try:
        spec = _spec(url + "/")
        with pytest.raises(UrlRefused, match="not on the admin's allow-list"):  # the worker checks again
            grpo.run(spec, FileReporter(tmp_path / "refused"), settings=settings_factory())
        result = grpo.run(spec, FileReporter(tmp_path / "out"), settings=settings_factory(GRPO_ENVIRONMENT_URLS=url))
    finally:
        server.stop()
    assert result.status == "succeeded"
    metrics = {m["step"]: m["metrics"] for m in _lines(tmp_path / "out" / "metrics.jsonl")}
    assert metrics[1]["env/error_ratio"] == 0.0 and metrics[1]["env/turns_mean"] >= 1


async def _slow_every_other(ws, calls=[0]):  # noqa: B006  (one counter for the server's life)
    calls[0] += 1
    if calls[0] % 2:
        await asyncio.sleep(6.0)  # past the spec's timeout_s
    await ws.send(json.dumps({"type": "observation", "data": {"observation": {"message": "ok"}, "reward": 1.0,
                                                             "done": True}}))


@pytest.mark.parametrize("on_error", ["zero", "drop_group"])
def test_episodes_the_server_fails_are_counted_and_the_job_goes_on(tmp_path, settings_factory, on_error):
    server = Hostile(_slow_every_other)
    spec = _spec(server.url, steps=1, on_error=on_error, eval_episodes=1)
    result = grpo.run(spec, FileReporter(tmp_path), settings=settings_factory(GRPO_ENVIRONMENT_URLS=server.url))
    assert result.status == "succeeded"
    metrics = {m["step"]: m["metrics"] for m in _lines(tmp_path / "metrics.jsonl")}
    assert 0 < metrics[1]["env/error_ratio"] < 1
    failed = [x for x in _lines(tmp_path / "samples.jsonl") if x["extra"]["episode"]["error"]]
    assert failed and all("no answer to step within 2 s" in x["extra"]["episode"]["error"] for x in failed)
    flags = [e for e in _lines(tmp_path / "events.jsonl") if e["type"] == "health" and e["data"]["guard"] == "environment"]
    assert [f["data"]["step"] for f in flags] == [1] and flags[0]["data"]["level"] in ("warn", "critical")
    assert "episodes failed: no answer to step within 2 s" in flags[0]["message"]  # in the server's words
    if on_error == "zero":  # kept, with what they earned: nothing
        assert all(x["reward"] == 0.0 for x in failed)
    else:  # their groups left out: no advantage for any of their episodes
        groups = {x["index"] // 2 for x in failed}
        assert all(x["advantage"] == 0.0 for x in _lines(tmp_path / "samples.jsonl") if x["index"] // 2 in groups)


async def _always_slow(ws):
    await asyncio.sleep(6.0)  # past the spec's timeout_s, every time


def test_a_step_whose_every_episode_failed_is_skipped_and_still_reports_its_environment(tmp_path, settings_factory):
    """Every episode fails, so every group ties and the step is skipped: its episodes' env/* metrics and what it
    sampled are still reported, and the environment guard flags it (a skipped step used to report neither)."""
    server = Hostile(_always_slow)
    spec = _spec(server.url, steps=1, eval_episodes=1)
    spec = spec.model_copy(update={"grpo": spec.grpo.model_copy(update={"drop_zero_std_groups": True,
                                                                         "max_refill_rounds": 0})})
    result = grpo.run(spec, FileReporter(tmp_path), settings=settings_factory(GRPO_ENVIRONMENT_URLS=server.url))
    assert result.status == "succeeded"
    step1 = next(m["metrics"] for m in _lines(tmp_path / "metrics.jsonl") if m["step"] == 1)
    assert step1["frac_reward_zero_std"] == 1.0 and step1["env/error_ratio"] == 1.0
    assert step1["selection/rollouts"] == 4 and step1["selection/observed_signal"] == 0.0
    events = _lines(tmp_path / "events.jsonl")
    assert [e["type"] for e in events if e["type"] == "skipped"] == ["skipped"]
    flags = [e for e in events if e["type"] == "health" and e["data"]["guard"] == "environment"]
    assert flags and flags[0]["data"]["level"] == "critical" and "no answer to step within 2 s" in flags[0]["message"]


def test_episodes_longer_than_the_model_holds_fail_at_the_start(tmp_path, settings_factory):
    spec = _spec("http://127.0.0.1:9/", max_episode_tokens=1000, max_observation_tokens=100)
    with pytest.raises(ValueError, match=r"\(100 \+ 1000\) is more than tiny-random-llama holds \(1024 positions"):
        grpo.run(spec, FileReporter(tmp_path), settings=settings_factory())


class CancelledAt(FileReporter):
    """A reporter whose cancel arrives at its `at`-th question (as a heartbeat would bring it, mid-step)."""

    def __init__(self, out, at: int) -> None:
        super().__init__(out)
        self.asked, self.at = 0, at

    def should_stop(self) -> bool:
        self.asked += 1
        return self.asked >= self.at


def test_a_cancel_mid_step_stops_the_episodes_and_the_job_without_an_update(tmp_path, settings_factory):
    """One session at a time, four episodes a step: the cancel heard before episode 0's second turn (the 4th
    question: step 1's start, episode 0's, its turn 0, its turn 1) ends the job at once, step 1 dropped,
    nothing trained, and no session left open on the server."""
    server = BundledServer("calculator", tmp_path / "calculator.log")
    url = server.start()
    try:
        reporter = CancelledAt(tmp_path / "out", at=4)
        result = grpo.run(_spec(url, steps=3, max_concurrent=1), reporter,
                          settings=settings_factory(GRPO_ENVIRONMENT_URLS=url))
        assert server.sessions()["open"] == 0
    finally:
        server.stop()
    assert (result.status, result.step, reporter.asked) == ("cancelled", 0, 4)
    stopping = [e for e in _lines(tmp_path / "out" / "events.jsonl") if e["type"] == "stopping"]
    assert len(stopping) == 1 and "step 1 stopped (cancelled at turn 1 of episode 0)" in stopping[0]["message"]
    assert [m["step"] for m in _lines(tmp_path / "out" / "metrics.jsonl")] == [0]  # step 0's evaluation only

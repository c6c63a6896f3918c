"""The `http` reward against a real grader process: scores, retries, exclusions and the failure limit."""

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from service.core.reward_specs import HttpReward
from service.core.settings import Settings
from tests.e2e.conftest import free_port
from tests.metrics import MEASURED
from worker.rewards import Item, RewardUnavailable, Scorer, numeric_match
from worker.rewards.remote import HttpGrader


@contextmanager
def _served(host: str) -> Iterator[str]:
    """The test grader app under uvicorn on `host`, a free port; its base URL."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "tests.worker.rewards.grader_app:app", "--host", host,
                             "--port", str(port), "--log-level", "warning"])
    base = f"http://{host}:{port}"
    for _ in range(100):
        try:
            httpx.get(f"{base}/calls", timeout=1)
            break
        except httpx.HTTPError:
            time.sleep(0.1)
    try:
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def grader():
    with _served("127.0.0.1") as base:
        yield base


@pytest.fixture(scope="module")
def offlist():
    """A second grader on another loopback address, on no allow-list: nothing may ever reach it."""
    with _served("127.0.0.2") as base:
        yield base


def _settings(tmp_path, allow: str, **extra) -> Settings:
    return Settings(GRPO_DATA_DIR=tmp_path, GRPO_REWARD_URLS=allow, GRPO_REWARD_AUTH_HEADER="X-Grader-Key",
                    GRPO_REWARD_AUTH_ENV="TEST_GRADER_SECRET", **extra)


def _grader(base, path, tmp_path, monkeypatch=None, **kw):
    return HttpGrader(HttpReward(name="http", url=f"{base}/{path}", **kw), settings=_settings(tmp_path, f"{base}/"),
                      job_id=7)


ITEMS = [Item("Tom has 3 eggs and gets 4 more.", c, ("7",)) for c in
         ["He has 7 eggs.", "8", "7", "no idea", "UNSCORABLE 7", "It is 7"]]


def test_scores_match_the_builtin_across_requests(grader, tmp_path):
    g = _grader(grader, "numeric", tmp_path, batch_size=4, concurrency=2)
    out = Scorer([g]).score(ITEMS, step=1)
    expected = [numeric_match(it.completion, it.answers) for it in ITEMS]
    assert [v for i, v in enumerate(out.per_fn["http"]) if i != 4] == [v for i, v in enumerate(expected) if i != 4]
    assert out.per_fn["http"][4] != out.per_fn["http"][4]  # null: NaN, so the completion is excluded
    assert out.total[4] != out.total[4] and out.failures == []


@pytest.mark.parametrize("path,kw,error", [
    ("slow", {"timeout_s": 0.3, "max_retries": 1}, "ReadTimeout calling the grader (2 attempts)"),
    ("error", {"max_retries": 2}, "the grader answered HTTP 500 (3 attempts)"),
    ("short", {}, "answered 5 scores for 6 items"),
])
def test_a_failing_grader_excludes_its_batch_and_the_job_goes_on(grader, tmp_path, path, kw, error):
    g = _grader(grader, path, tmp_path, max_failed_steps=2, **kw)
    out = Scorer([g]).score(ITEMS, step=1)
    assert all(v != v for v in out.total)  # every completion excluded
    assert len(out.failures) == 1 and error in out.failures[0].error
    # a second failed step in a row is the limit: the job fails with a readable reason
    with pytest.raises(RewardUnavailable, match="could not score on 2 steps in a row"):
        Scorer([g]).score(ITEMS, step=2)


def test_a_step_that_scores_resets_the_count(grader, tmp_path):
    g = _grader(grader, "numeric", tmp_path, max_failed_steps=2)
    g._count(1, failed=True)
    Scorer([g]).score(ITEMS, step=2)
    g._count(3, failed=True)  # one failed step in a row again, not two
    assert g.failed_steps == [3]


def test_the_secret_comes_from_the_workers_environment(grader, tmp_path, monkeypatch):
    assert Scorer([_grader(grader, "auth", tmp_path)]).score(ITEMS[:1], step=1).total == [0.0]
    monkeypatch.setenv("TEST_GRADER_SECRET", "s3cret")
    assert Scorer([_grader(grader, "auth", tmp_path)]).score(ITEMS[:1], step=1).total == [1.0]


def test_a_url_taken_off_the_allow_list_is_refused_at_run_time(grader, tmp_path):
    settings = Settings(GRPO_DATA_DIR=tmp_path, GRPO_REWARD_URLS="https://graders.example/")
    with pytest.raises(RewardUnavailable, match="allow-list"):
        HttpGrader(HttpReward(name="http", url=f"{grader}/numeric"), settings=settings, job_id=1)


def test_a_job_trained_on_a_remote_grader_equals_the_builtin_run(grader, tmp_path, settings_factory, digit_reward):
    """The same reward computed by the grader process and in the worker: the same job, step for step."""
    import json

    from service.core.specs import GRPOJob
    from worker.loops import grpo
    from worker.reporting import FileReporter

    def run(rewards, out):
        spec = GRPOJob.model_validate({
            "model": {"name": "tiny-random-llama", "lora": {"r": 4}}, "dataset": {"num_train": 30, "num_val": 4},
            "rewards": rewards, "grpo": {"steps": 3, "prompts_per_step": 2, "num_generations": 4,
                                         "max_new_tokens": 8, "learning_rate": 1e-2, "eval_prompts": 2}})
        grpo.run(spec, FileReporter(out), settings=settings_factory(GRPO_REWARD_URLS=f"{grader}/"))
        return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]

    local = run([{"name": "digit_share"}], tmp_path / "local")
    remote = run([{"name": "http", "url": f"{grader}/digits", "tag": "digit_share"}], tmp_path / "remote")
    assert [m["step"] for m in local] == [m["step"] for m in remote] == [0, 1, 2, 3]
    for a, b in zip(local, remote):
        for k, v in a["metrics"].items():
            if not k.startswith(MEASURED):
                assert b["metrics"][k] == pytest.approx(v, rel=1e-6, abs=1e-9), (a["step"], k)
        if a["step"] > 0:
            assert b["metrics"]["time/reward_s"] > 0


def test_a_grader_that_stays_down_fails_the_job_with_a_readable_event(grader, settings_factory):
    from service.core.specs import GRPOJob
    from service.store import events as events_q
    from service.store import jobs as jobs_q
    from service.store.db import session_scope
    from service.store.migrate import upgrade
    from worker.jobs import runner

    settings = settings_factory(GRPO_REWARD_URLS=f"{grader}/")
    upgrade(settings.store_url)
    spec = GRPOJob.model_validate({
        "model": {"name": "tiny-random-llama"}, "dataset": {"num_train": 20, "num_val": 2},
        "rewards": [{"name": "http", "url": f"{grader}/error", "max_retries": 0, "max_failed_steps": 2}],
        "grpo": {"steps": 4, "prompts_per_step": 2, "num_generations": 2, "max_new_tokens": 4, "eval_prompts": 2}})
    with session_scope(settings.store_url) as s:
        job, _ = jobs_q.create_job(s, owner="o", kind="grpo", spec=spec.model_dump(mode="json"), name=None,
                                   total_steps=4)
    assert runner.run_job(job.id, settings=settings) == "failed"
    with session_scope(settings.store_url) as s:
        job = jobs_q.get_job(s, job_id=job.id)
        events = events_q.list_events(s, job_id=job.id)
    assert "could not score on 2 steps in a row" in job.error and "RewardUnavailable" in job.error
    warnings = [e for e in events if e.type == "warning"]  # the first failure, in the evaluation at step 0
    assert len(warnings) == 1 and "HTTP 500" in warnings[0].data["failures"][0]["error"]
    assert "eval/reward_mean" in warnings[0].message


# Issue 25's cases, as the worker meets them: a stored spec whose URL was never checked (or an
# allow-list changed since submit). The allow-list is `{g}/ok/` (the real grader, below /ok/ only)
# and `{a}` (a whole port on which nothing listens); `{o}` is the off-list grader.
OFF_LIST = [
    "{g}/ok/../numeric",
    "{g}/ok/%2e%2e/numeric",
    "http://{a_netloc}@{o_netloc}/numeric",
    "{o}/ok/numeric",
]


@pytest.mark.parametrize("url", OFF_LIST)
def test_the_worker_calls_no_url_off_the_list(grader, offlist, tmp_path, monkeypatch, url):
    monkeypatch.setenv("TEST_GRADER_SECRET", "s3cret")
    allowed_port = f"127.0.0.1:{free_port()}"
    url = url.format(g=grader, o=offlist, a_netloc=allowed_port, o_netloc=offlist.split("//")[1])
    before = httpx.get(f"{offlist}/calls").json()
    spec = HttpReward.model_construct(**{**HttpReward(name="http", url=f"{grader}/ok/x").model_dump(), "url": url})
    with pytest.raises(RewardUnavailable, match="not on the admin's allow-list|userinfo"):
        HttpGrader(spec, settings=_settings(tmp_path, f"{grader}/ok/,http://{allowed_port}"), job_id=7)
    assert httpx.get(f"{offlist}/calls").json() == before


def test_a_redirect_off_the_list_is_not_followed(grader, offlist, tmp_path, monkeypatch):
    monkeypatch.setenv("TEST_GRADER_SECRET", "s3cret")
    before = httpx.get(f"{offlist}/calls").json()
    g = _grader(grader, f"redirect?to={offlist}/numeric", tmp_path)
    out = Scorer([g]).score(ITEMS, step=1)
    assert all(v != v for v in out.total)
    assert "a redirect" in out.failures[0].error and "HTTP 302" in out.failures[0].error
    assert httpx.get(f"{offlist}/calls").json() == before
    # the secret went to the allowed grader only
    assert httpx.get(f"{grader}/calls").json().get("/redirect with secret", 0) >= 1


@pytest.mark.parametrize("path,words", [("big", "answered 50000037 bytes, over 1000000"),
                                        ("big?chunked=true", "answered more than 1000000 bytes")])
def test_an_answer_past_the_cap_is_not_read(grader, tmp_path, path, words):
    """With a Content-Length the answer is refused by its header; without one (chunked) the worker stops
    reading past the cap, so the server gets to send few of its 50 MB (what the sockets buffer), not all."""
    g = HttpGrader(HttpReward(name="http", url=f"{grader}/{path}", max_retries=0),
                   settings=_settings(tmp_path, f"{grader}/", GRPO_REWARD_MAX_RESPONSE_BYTES=1_000_000), job_id=7)
    # the counter's own requests wait longer than httpx's 5 s: under a loaded machine the grader may still be
    # writing the previous case's 50 MB when this one asks
    before = httpx.get(f"{grader}/sent", timeout=60).json()["big_chunks"]
    out = Scorer([g]).score(ITEMS, step=1)
    assert f"{words} (GRPO_REWARD_MAX_RESPONSE_BYTES)" in out.failures[0].error
    time.sleep(0.5)  # the server notices the closed connection at its next send
    assert httpx.get(f"{grader}/sent", timeout=60).json()["big_chunks"] - before < 25  # of 52, 1 MB each (9 here)


def test_a_compressed_answer_is_refused_not_decoded(grader, tmp_path):
    """50 KB of zstd that would decode to 1 GiB: refused by its Content-Encoding, before a byte is decoded."""
    import resource

    g = _grader(grader, "bomb", tmp_path, max_retries=0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = Scorer([g]).score(ITEMS, step=1)
    assert "answered with Content-Encoding 'zstd'" in out.failures[0].error
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100_000  # KiB: nothing expanded


def test_non_finite_scores_exclude_their_items_only(grader, tmp_path):
    g = _grader(grader, "nonfinite", tmp_path, max_failed_steps=1)
    for step in (1, 2):  # not a failed step: the limit of one is never reached
        out = Scorer([g]).score(ITEMS, step=step)
        assert out.per_fn["http"][4:] == [0.5, 0.5]
        assert all(v != v for v in out.per_fn["http"][:4])
        assert sorted(f.index for f in out.failures) == [0, 1, 2, 3]
        assert all("not a finite number" in f.error for f in out.failures)
    assert g.failed_steps == []


def test_a_host_name_resolving_to_a_metadata_address_is_not_called(tmp_path, monkeypatch):
    import socket

    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: [(2, 1, 6, "", ("169.254.169.254", 80))])
    g = HttpGrader(HttpReward(name="http", url="http://grader.internal.test/score", max_retries=0),
                   settings=_settings(tmp_path, "http://grader.internal.test/"), job_id=7)
    out = Scorer([g]).score(ITEMS, step=1)
    assert "resolves to 169.254.169.254, a cloud metadata address" in out.failures[0].error

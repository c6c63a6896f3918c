"""Session runs driven by the real tinker SDK on the production layout (`serve` and separate workers on
PostgreSQL and a Redis of the test's own): a worker killed mid-session, the run taken over by another
worker from its last saved state, and two runs in a row on one worker; tinker-cookbook's supervised loop
through the same, resumed from its own save; its RL loop, learning as on the embedded default."""

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.cookbook.harness import check_rl_learning, output, recipe_env, recipe_metrics, start_recipe
from tests.faults.conftest import wait_for
from tests.numerics import approx

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.faults]
MODEL = "tiny-random-llama"
CE = [types.Datum(model_input=types.ModelInput.from_ints([5, 9, 14, 3, 22, 7]),
                  loss_fn_inputs={"target_tokens": [9, 14, 3, 22, 7, 11], "weights": [1.0] * 6})]


def step(client) -> float:
    loss = client.forward_backward(CE, "cross_entropy").result().metrics["loss:sum"]
    client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    return loss


def test_a_killed_workers_session_fails_its_pending_futures_and_resumes_from_its_saved_state(cluster,
                                                                                            tinker_service):
    cluster.serve(GRPO_SESSION_IDLE_S="3")  # an idle run gives its worker back after 3 s
    cluster.worker("w1", GRPO_SESSION_SAVE_EVERY_S="0")  # state saved at every optim_step
    service = tinker_service(cluster.base, cluster.key)
    client = service.create_lora_training_client(base_model=MODEL, rank=4, seed=0).result()
    losses = [step(client), step(client)]
    client.forward_backward(CE, "cross_entropy").result()  # gradients on w1 only
    cluster.kill_group("w1")
    cluster.worker("w2", GRPO_SESSION_SAVE_EVERY_S="0")
    # pending when the run resumes on w2, after the lease of w1 ran out: failed, with where the run stands
    with pytest.raises(tinker.RequestFailedError, match="state saved at step 2"):
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    losses.append(step(client))  # sent again from the saved state, it goes on
    assert losses[2] < losses[0]
    with cluster.client() as c:
        job = c.get("/v1/jobs", params={"kind": "session"}).json()["items"][0]
        assert job["uid"] == client.model_id and job["step"] == 3 and job["attempt"] == 2, cluster.logs()
        events = [e["type"] for e in c.get(f"/v1/jobs/{job['id']}/events").json()]
        # attempt 2 on w2, from w1's expired lease: requeued by the sweep, or taken at once by a second message
        # for the run that w2 found queued (the sweep sends one again for a run queued over 15 s, as when w1 was
        # slow to start on a loaded machine); either way the lease had run out, and w2 says it resumed after one
        assert "resumed_after_failure" in events and events.count("started") == 2, events
        series = c.get(f"/v1/jobs/{job['id']}/metrics", params={"keys": "loss/total"}).json()["series"][0]
        assert [p["step"] for p in series["points"]] == [1, 2, 3]  # nothing recorded is lost or doubled
    # a second run on the same worker, once the first has given it back
    other = service.create_lora_training_client(base_model=MODEL, rank=4, seed=1).result()
    step(other)
    with cluster.client() as c:
        wait_for(lambda: c.get("/v1/jobs", params={"kind": "session"}).json()["items"][0]["step"] == 1,
                 "the second run's step", cluster)


def test_through_a_broker_outage_each_sdk_call_is_one_operation_and_one_run(cluster, redis_server, tinker_service):
    """Redis killed for 20 s while SDK calls that must queue a run arrive: a forward_backward to a run that
    went idle, and a new training client. Each is stored once (answered with its future, not a 5xx the SDK
    would retry into a copy), and once Redis is back the sweep delivers them: the gradient is one call's
    (two copies would double the next step's gradient norm), and there is one run per create_model."""
    cluster.serve(GRPO_SESSION_IDLE_S="2")
    cluster.worker("w1")
    service = tinker_service(cluster.base, cluster.key)
    client = service.create_lora_training_client(base_model=MODEL, rank=4, seed=0).result()
    once = client.forward_backward(CE, "cross_entropy").result().metrics["loss:sum"]
    norm = client.optim_step(types.AdamParams(learning_rate=0.0)).result().metrics["grad_norm:mean"]  # lr 0: same weights
    with cluster.client() as c:
        run = lambda: c.get("/v1/jobs", params={"kind": "session"}).json()["items"]  # noqa: E731
        wait_for(lambda: run()[0]["status"] == "idle", "the run to go idle", cluster)
        redis_server.kill()
        pending = client.forward_backward(CE, "cross_entropy")  # wakes the idle run: no broker to tell
        with ThreadPoolExecutor(1) as pool:
            second = pool.submit(lambda: service.create_lora_training_client(base_model=MODEL, rank=4, seed=1).result())
            time.sleep(20)
            assert not second.done() and len(run()) == 2, cluster.logs()  # stored once, waiting for the broker
            redis_server.start()
            assert pending.result().metrics["loss:sum"] == approx(once, terms=len(CE[0].model_input.to_ints()))
            stepped = client.optim_step(types.AdamParams(learning_rate=0.0)).result().metrics["grad_norm:mean"]
            assert stepped == approx(norm, terms=64), (stepped, norm)  # one gradient, not two
            assert second.result(timeout=120).forward_backward(CE, "cross_entropy").result().metrics["loss:sum"] > 0
        runs = run()
        assert len(runs) == 2, runs
        events = c.get(f"/v1/jobs/{runs[1]['id']}/events").json()
        assert any(e["message"].startswith("not queued: the broker was unreachable") for e in events), events


def test_a_stopping_worker_hands_its_session_run_back_and_an_api_restart_loses_no_future(cluster, tinker_service):
    """SIGTERM (a warm shutdown, as a deploy sends) to the worker holding a run: once no gradient waits
    for its optim_step, the run's state is saved and the run given back, far sooner than its idle timeout
    (120 s here); another worker takes it from that state, as the same attempt, with nothing failed.
    Then the API is killed with a future pending and started again: the SDK gets the future's result."""
    cluster.serve()
    w1 = cluster.worker("w1")
    service = tinker_service(cluster.base, cluster.key)
    client = service.create_lora_training_client(base_model=MODEL, rank=4, seed=0).result()
    losses = [step(client)]
    losses.append(client.forward_backward(CE, "cross_entropy").result().metrics["loss:sum"])
    w1.send_signal(signal.SIGTERM)
    time.sleep(2)
    assert w1.poll() is None, cluster.logs()  # the gradient would be lost: the run is not handed back yet
    client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    stopped = time.monotonic()
    assert w1.wait(timeout=60) == 0, cluster.logs()
    took = time.monotonic() - stopped
    pending = client.forward_backward(CE, "cross_entropy")  # sent with no worker up: it waits
    w2 = cluster.worker("w2")
    losses.append(pending.result().metrics["loss:sum"])
    client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert losses[2] < losses[1] < losses[0] and took < 30, (losses, took)
    with cluster.client() as c:
        job = c.get("/v1/jobs", params={"kind": "session"}).json()["items"][0]
        assert job["step"] == 3 and job["attempt"] == 1, cluster.logs()
        events = c.get(f"/v1/jobs/{job['id']}/events").json()
        handed = [e for e in events if e["type"] == "idle"]
        assert handed and handed[0]["message"].startswith("its worker is stopping: state saved at step 2")
        assert "resumed" in [e["type"] for e in events] and "resumed_after_failure" not in [e["type"] for e in events]
        series = c.get(f"/v1/jobs/{job['id']}/metrics", params={"keys": "loss/total"}).json()["series"][0]
        assert [p["step"] for p in series["points"]] == [1, 2, 3]
    os.killpg(w2.pid, signal.SIGSTOP)  # the run's worker frozen: the next operation stays pending
    pending = client.forward_backward(CE, "cross_entropy")
    time.sleep(1)  # the SDK sends it in the background, then polls its future
    cluster.kill_group("api")  # kill -9: whatever it held in memory is gone
    os.killpg(w2.pid, signal.SIGCONT)  # within its lease: the result is written while no API is up
    cluster.serve(port=int(cluster.base.rsplit(":", 1)[1]))
    assert pending.result().metrics["loss:sum"] < losses[2]  # the SDK retried through the restart
    client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    with cluster.client() as c:
        assert c.get(f"/v1/jobs/{job['id']}").json()["step"] == 4


@pytest.mark.long
def test_the_cookbooks_supervised_loop_resumes_from_its_own_save_after_a_worker_is_killed(
        cluster, models_root, cookbook_python, tmp_path):
    """tinker-cookbook's supervised loop, unmodified, saving every 2 steps, loses its worker after a save: its
    pending future fails and the loop stops. Run again, it resumes from its last save into a new run,
    on the other worker, and its loss goes on falling from where it was; the new run charts each of its
    steps, and the cookbook's final save is listed."""
    cluster.serve(GRPO_SESSION_IDLE_S="3")  # the orphaned run gives its worker back soon
    cluster.worker("w1")
    log = tmp_path / "sl"
    env = recipe_env(base=cluster.base, key=cluster.key, models_root=models_root, root=tmp_path, SL_SAVE_EVERY="2")
    first = start_recipe(cookbook_python, "sl_conversations.py", log, 8, env)
    with cluster.client() as c:
        runs = lambda: c.get("/v1/jobs", params={"kind": "session"}).json()["items"]  # noqa: E731
        def saved() -> list[int]:  # the steps of the loop's saves that completed
            if not (log / "checkpoints.jsonl").exists():
                return []
            return [json.loads(line)["batch"] for line in (log / "checkpoints.jsonl").read_text().splitlines()]

        # killed once a save has completed and the run has trained past it
        wait_for(lambda: saved() and runs()[0]["step"] > saved()[-1], "a save and a step after it", cluster,
                 timeout=300, every=0.1)
        cluster.kill_group("w1")
        cluster.worker("w2")
        assert first.wait(timeout=300) != 0  # the future pending on w1 failed: the loop stops
        assert "state saved at step" in output(log), output(log)
        resume_at = saved()[-1]
        again = start_recipe(cookbook_python, "sl_conversations.py", log, 8, env)
        assert again.wait(timeout=600) == 0, output(log) + cluster.logs()
        nll = [m["train_mean_nll"] for m in recipe_metrics(log) if "train_mean_nll" in m]
        assert len(nll) == 8 and nll[-1] < 0.6 * nll[0], nll  # every step once, and the loss fell
        first_run, second_run = sorted(runs(), key=lambda j: j["id"])
        taken_over = [e["type"] for e in c.get(f"/v1/jobs/{first_run['id']}/events").json()]
        assert "resumed_after_failure" in taken_over, taken_over  # by w2, once w1's lease ran out
        events = c.get(f"/v1/jobs/{second_run['id']}/events").json()
        assert any(e["type"] == "loaded" and first_run["uid"] in e["message"] for e in events), events
        assert second_run["step"] == 8 - resume_at
        # each step of the run it resumed into is charted
        series = c.get(f"/v1/jobs/{second_run['id']}/metrics", params={"keys": "loss/total"}).json()["series"][0]
        assert [p["step"] for p in series["points"]] == list(range(1, 8 - resume_at + 1))
        listed = c.get(f"/api/v1/training_runs/{second_run['uid']}/checkpoints", headers={"X-API-Key": cluster.key})
    # the cookbook's final save: a state, and weights to sample from, both named "final"
    assert {ckpt["tinker_path"] for ckpt in listed.json()["checkpoints"]} >= {
        f"tinker://{second_run['uid']}/sampler_weights/final", f"tinker://{second_run['uid']}/weights/final"}


@pytest.mark.long
def test_the_cookbooks_rl_loop_learns_on_the_production_layout(cluster, models_root, cookbook_python, tmp_path):
    """tinker-cookbook's RL loop, unmodified, against `serve` and a separate worker: its sample requests of
    a step reach the worker through PostgreSQL and are sampled together, it learns the format, and the run
    charts each of its steps."""
    cluster.serve()
    cluster.worker("w1")
    log = tmp_path / "rl"
    env = recipe_env(base=cluster.base, key=cluster.key, models_root=models_root, root=tmp_path)
    assert start_recipe(cookbook_python, "rl_arithmetic.py", log, 3, env).wait(timeout=900) == 0, \
        output(log) + cluster.logs()
    check_rl_learning(recipe_metrics(log), steps=3)
    with cluster.client() as c:
        job = c.get("/v1/jobs", params={"kind": "session"}).json()["items"][0]
        assert job["step"] == 3
        series = c.get(f"/v1/jobs/{job['id']}/metrics", params={"keys": "loss/total,tokens"}).json()["series"]
        assert {s["key"]: s["total_points"] for s in series} == {"loss/total": 3, "tokens": 3}
        # the answers sampled before the first optim_step: 8 problems x 4, graded by the client
        samples = c.get(f"/v1/jobs/{job['id']}/samples", params={"step": 0, "limit": 100}).json()
        assert len(samples) == 32 and all(s["reward"] is None for s in samples), samples


def _every_call(client, sampler, saved: str) -> dict:
    """One call of each kind the SDK sends to a run, each returning the future it waits on."""
    ask = types.SamplingParams(max_tokens=2, temperature=1.0)
    return {"forward_backward": lambda: client.forward_backward(CE, "cross_entropy"),
            "forward": lambda: client.forward(CE, "cross_entropy"),
            "optim_step": lambda: client.optim_step(types.AdamParams(learning_rate=1e-2)),
            "sample": lambda: sampler.sample(types.ModelInput.from_ints([5, 9]), 1, ask),
            "save_state": lambda: client.save_state("late"),
            "save_weights_for_sampler": lambda: client.save_weights_for_sampler("late"),
            "load_state": lambda: client.load_state(saved)}


def _raises_at_once(calls: dict, state: str) -> dict[str, float]:
    """Seconds each call took to raise, through the unmodified SDK (it retries every 409 for 300 s)."""
    took = {}
    for name, call in calls.items():
        t0 = time.monotonic()
        with pytest.raises(tinker.RequestFailedError, match=state):
            call().result(timeout=30)
        took[name] = time.monotonic() - t0
    return took


def test_from_the_moment_a_cancel_is_accepted_every_call_on_the_run_raises_within_2_s(cluster, pg_url,
                                                                                     tinker_service):
    """A cancelled run takes no new work: calls sent 0, 1 and 5 s after the cancel (the run's worker hears of
    it at its next heartbeat), and every kind of call on a run that was cancelled, failed or finished, each
    raise within 2 s naming the run's state; what was pending when the cancel arrived fails with it."""
    from service.store.db import session_scope
    from service.store.models import Job

    cluster.serve()
    cluster.worker("w1", GRPO_HEARTBEAT_S="5")  # a wide window between the cancel and the worker's hearing it
    service = tinker_service(cluster.base, cluster.key)
    client = service.create_lora_training_client(base_model=MODEL, rank=4, seed=0).result()
    step(client)
    sampler = client.save_weights_and_get_sampling_client().result()
    saved = client.save_state("s1").result().path
    with cluster.client() as c:
        job = c.get("/v1/jobs", params={"kind": "session"}).json()["items"][0]
        pending = client.forward_backward(CE * 64, "cross_entropy")  # likely still queued when the cancel lands
        assert c.post(f"/v1/jobs/{job['id']}/cancel").status_code == 200
        accepted, took = time.monotonic(), {}
        for after in (0, 1, 5):
            time.sleep(max(0.0, accepted + after - time.monotonic()))
            took[after] = _raises_at_once(_every_call(client, sampler, saved), "cancel")
        try:  # it ran before the cancel, or failed with it: never left waiting
            pending.result(timeout=10)
        except tinker.RequestFailedError as exc:
            assert "cancelled" in str(exc)
        wait_for(lambda: c.get(f"/v1/jobs/{job['id']}").json()["status"] == "cancelled", "the run to end", cluster)
        assert "started" not in [e["type"] for e in c.get(f"/v1/jobs/{job['id']}/events").json()[-3:]]
    for status in ("failed", "succeeded"):  # how a run that ended otherwise reads to its client
        with session_scope(pg_url) as s:
            s.get(Job, job["id"]).status = status
        took[status] = _raises_at_once(_every_call(client, sampler, saved), f"has ended \\({status}\\)")
    slowest = max(t for row in took.values() for t in row.values())
    assert slowest < 2, took

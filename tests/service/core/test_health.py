"""The health guards on hand-built step metrics: levels, changes, stops and the job's summary."""

import pytest
from pydantic import ValidationError

from service.core.health import HealthMonitor, HealthSpec, flag_from_event, non_finite_flag, summarise
from service.core.specs import GRPOJob


def _step(tied=0.0, entropy=1.0, clipped=0.0, ratio=1.0, reward_s=0.1, step_s=1.0, grad=0.5):
    return {"frac_reward_zero_std": tied, "entropy": entropy, "completions/clipped_ratio": clipped,
            "ratio/max": ratio, "time/reward_s": reward_s, "time/step_s": step_s, "grad_norm": grad}


def test_a_run_whose_groups_all_tie_is_red_at_its_first_step_and_says_why():
    m = HealthMonitor(HealthSpec())
    first = m.observe(1, _step(tied=1.0, grad=0.0))
    assert {(f.guard, f.level) for f in first.changes} == {("informative_groups", "critical"), ("update", "warn")}
    flag = next(f for f in first.changes if f.guard == "informative_groups")
    assert (flag.step, flag.value, flag.threshold) == (1, 0.0, 0.0)
    assert "step 1: informative_groups is 0, at or below its critical threshold 0" in flag.message
    assert first.metrics["health/informative_groups"] == 0.0 and first.stop is None  # stop_on is empty
    assert m.observe(2, _step(tied=1.0, grad=0.0)).changes == []  # still red: no new event
    third = m.observe(3, _step(tied=1.0, grad=0.0))
    assert [(f.guard, f.level, f.value) for f in third.changes] == [("update", "critical", 3.0)]


def test_a_guard_gets_worse_at_once_and_better_only_once_it_holds():
    m = HealthMonitor(HealthSpec())
    assert m.observe(1, _step(tied=0.6)).changes[0].level == "warn"  # 0.4 informative: at or below warn 0.5
    # at the edge of a band (a few prompts a step) it would flap: better counts only after RECOVER_STEPS in a row
    assert m.observe(2, _step(tied=0.2)).changes == [] and m.observe(3, _step(tied=0.2)).changes == []
    assert m.observe(4, _step(tied=0.6)).changes == []  # worse again: still amber, the count starts over
    assert [m.observe(s, _step(tied=0.2)).changes for s in (5, 6)] == [[], []]
    back = m.observe(7, _step(tied=0.2))
    assert [(f.guard, f.level, f.threshold, f.step) for f in back.changes] == [("informative_groups", "ok", None, 7)]
    assert m.observe(8, _step(tied=0.2)).changes == []
    assert m.observe(9, _step(tied=1.0)).changes[0].level == "critical"  # worse: at once


def test_entropy_is_measured_against_the_first_step():
    m = HealthMonitor(HealthSpec())
    assert m.observe(1, _step(entropy=2.0)).metrics["health/entropy"] == 1.0
    warn = m.observe(2, _step(entropy=0.5))  # 0.25 of the first
    assert [(f.guard, f.level) for f in warn.changes] == [("entropy", "warn")]
    red = m.observe(3, _step(entropy=0.1))
    assert [(f.guard, f.level) for f in red.changes] == [("entropy", "critical")]
    assert red.metrics["health/entropy"] == pytest.approx(0.05)


@pytest.mark.parametrize(("metrics", "guard"), [(_step(clipped=0.95), "truncation"), (_step(ratio=12.0), "ratio"),
                                                (_step(reward_s=0.9, step_s=1.0), "grader_time")])
def test_each_band_past_critical_is_red(metrics, guard):
    reading = HealthMonitor(HealthSpec()).observe(1, metrics)
    assert [(f.guard, f.level) for f in reading.changes] == [(guard, "critical")]


def test_failed_episodes_turn_the_environment_guard_amber_then_red_in_the_servers_words():
    m = HealthMonitor(HealthSpec())
    assert m.observe(1, {**_step(), "env/error_ratio": 0.0}).changes == []
    amber = m.observe(2, {**_step(), "env/error_ratio": 0.125}, why={"environment": "1 of 8 episodes failed: x (1x)"})
    assert [(f.guard, f.level, f.threshold) for f in amber.changes] == [("environment", "warn", 0.1)]
    why = "7 of 8 episodes failed: the server closed the session (1000) (7x)"
    red = m.observe(3, {**_step(), "env/error_ratio": 0.875}, why={"environment": why})
    assert [(f.guard, f.level) for f in red.changes] == [("environment", "critical")]
    assert red.changes[0].message.endswith(why) and "env/error_ratio" in red.changes[0].message
    assert red.metrics["health/environment"] == 0.875
    # a job with no environment never reads it, and a joint job's summary does not list it
    assert "health/environment" not in HealthMonitor(HealthSpec()).observe(1, _step()).metrics
    assert "environment" not in summarise("joint", []).guards and "environment" in summarise("grpo", []).guards


def test_a_red_guard_named_in_stop_on_stops_and_others_do_not():
    spec = HealthSpec(stop_on=["truncation"])
    m = HealthMonitor(spec)
    assert m.observe(1, _step(tied=1.0)).stop is None  # red, but not a stop_on guard
    stop = m.observe(2, _step(tied=1.0, clipped=1.0)).stop
    assert stop is not None and stop.guard == "truncation" and stop.step == 2


def test_a_skipped_step_counts_as_no_update_and_an_sft_step_reads_only_what_it_has():
    m = HealthMonitor(HealthSpec(update={"warn": 2, "critical": 2}))
    assert m.observe(1, {"frac_reward_zero_std": 1.0}, updated=False).changes[-1].guard == "informative_groups"
    assert [(f.guard, f.level) for f in m.observe(2, {"frac_reward_zero_std": 1.0}, updated=False).changes] == [
        ("update", "critical")]
    sft = HealthMonitor(HealthSpec())
    assert set(sft.observe(1, {"loss/train": 2.0, "grad_norm": 1.0}).metrics) == {"health/update"}


def test_thresholds_in_the_wrong_order_are_refused_naming_the_guard():
    with pytest.raises(ValidationError, match=r"health.truncation: critical \(0.2\) must be at or above warn"):
        GRPOJob.model_validate({"health": {"truncation": {"warn": 0.5, "critical": 0.2}}})
    with pytest.raises(ValidationError, match="stop_on"):
        GRPOJob.model_validate({"health": {"stop_on": ["nonsense"]}})


def test_the_summary_is_each_guards_latest_flag_and_the_worst_level():
    m = HealthMonitor(HealthSpec())
    flags = [f for step, metrics in enumerate([_step(tied=1.0), _step(), _step(), _step(), _step(clipped=0.6)], 1)
             for f in m.observe(step, metrics).changes]
    summary = summarise("grpo", [flag_from_event(f.event_data()) for f in flags])
    assert summary.level == "warn"  # informative_groups recovered; truncation is amber
    assert summary.guards["informative_groups"].level == "ok" and summary.guards["truncation"].level == "warn"
    assert summary.guards["entropy"] is None  # never flagged
    assert summarise("sft", []).guards == {"update": None, "non_finite": None}
    assert summarise("grpo", [non_finite_flag("the gradient norm is nan", 4)]).level == "critical"
    assert flag_from_event({"guard": "bogus", "level": "warn"}) is None and flag_from_event(None) is None

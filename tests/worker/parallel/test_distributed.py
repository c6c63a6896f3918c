"""Data parallel over torch.distributed (gloo, on CPU): a job run as 2 processes makes the same
updates and reports the same metrics as 1 process on the same global batch and seed."""

import json
import os
import signal
import threading
import time
from functools import partial

import pytest
import torch
from pydantic import TypeAdapter
from safetensors.torch import load_file

from service.core.specs import JobSpec
from tests.conftest import free_port
from tests.metrics import MEASURED
from worker.jobs import runner
from worker.jobs.runner import loop_for, run_spec
from worker.parallel.distributed import Ranks
from worker.parallel.launch import (
    Gang,
    GangIncomplete,
    LauncherStopped,
    RanksFailed,
    agreed_backend,
    launch,
    place,
    placement_warning,
    rank_device,
    trainer_gpus,
)
from worker.reporting import FileReporter

STEPS = {"steps": 3, "prompts_per_step": 4, "num_generations": 4, "max_new_tokens": 6, "micro_batch_size": 3,
         "eval_prompts": 3, "seed": 3, "samples_per_step": 48}
CASES = {
    # micro-batches of whole groups, in one process and in each of two: a prompt's forward is shared by the same
    # rows either way (with rows grouped otherwise, its gradient sums them before or after RMSNorm's float32 cast)
    "grpo-lora": {"kind": "grpo", "model": {"name": "tiny-random-llama", "lora": {"r": 4}},
                  "grpo": {**STEPS, "micro_batch_size": 4, "learning_rate": 1e-2, "kl_coef": 0.05},
                  "sparsity": {"measure_interval": 1, "quality": {"enabled": True, "probe_size": 2}}},
    # two epochs (old log-probs, shuffled micro-batches), Dr. GRPO's constant, refilled tied groups; one forward
    # per row, since shuffled micro-batches cut groups apart differently in one process and in two
    "grpo-full": {"kind": "grpo", "model": {"name": "tiny-random-llama"},
                  "grpo": {**STEPS, "learning_rate": 1e-3, "kl_coef": 0.05, "epochs_per_rollout_batch": 2,
                           "loss_agg": "dr_grpo", "drop_zero_std_groups": True, "max_refill_rounds": 2,
                           "share_prompts": False}},
    # FSDP2 for the 2-process run: the policy and reference sharded, gathered to the usual checkpoint (a sharded
    # policy runs one forward per row, so the one-process run does too)
    "grpo-fsdp": {"kind": "grpo", "model": {"name": "tiny-random-llama"}, "sharding": "fsdp",
                  "grpo": {**STEPS, "learning_rate": 1e-3, "kl_coef": 0.05, "epochs_per_rollout_batch": 2,
                           "loss_agg": "dr_grpo", "checkpoint_every": 2, "share_prompts": False},
                  "sparsity": {"measure_interval": 2}},
    # a worker short of memory: the plan turns checkpointing on, the same on every rank (FSDP2's non-reentrant kind)
    "grpo-fsdp-low-memory": {"kind": "grpo", "model": {"name": "tiny-random-llama"}, "sharding": "fsdp",
                             "grpo": {**STEPS, "learning_rate": 1e-3, "kl_coef": 0.05, "loss_agg": "dr_grpo"}},
    # micro-batches of whole groups, as in grpo-lora: each prompt's forward is shared by the same rows either way
    "tracin-positive": {"kind": "tracin", "model": {"name": "tiny-random-llama", "lora": {"r": 4}},
                        "tracin": {"val_prompts": 3, "val_generations": 4},
                        "grpo": {**STEPS, "micro_batch_size": 4, "learning_rate": 1e-2}},
    # scored in AdamW's geometry from step 2: D_t from the batch gradient summed over both ranks
    "tracin-adam": {"kind": "tracin", "model": {"name": "tiny-random-llama", "lora": {"r": 4}},
                    "tracin": {"score": "adam", "val_prompts": 3, "val_generations": 4},
                    "grpo": {**STEPS, "micro_batch_size": 4, "learning_rate": 1e-2}},
    "tracin-greedy": {"kind": "tracin", "model": {"name": "tiny-random-llama", "lora": {"r": 4}},
                      "tracin": {"selection": "greedy", "fraction": 0.5, "val_prompts": 3, "val_generations": 4},
                      "grpo": {**STEPS, "learning_rate": 1e-2}},
    "joint": {"kind": "joint", "model": {"name": "tiny-random-llama", "lora": {"r": 4}},
              "retriever": {"name": "tiny-random-bert", "k": 3, "candidates": 6, "learning_rate": 1e-2, "kl_coef": 0.1},
              "dataset": {"name": "persona-facts", "corpus_size": 12, "num_val": 6},
              "grpo": {**STEPS, "num_generations": 3, "eval_prompts": 5, "drop_zero_std_groups": True,
                       "max_refill_rounds": 1}},
    # each process takes half of each step's examples; loss/val and token accuracy over both halves
    "sft": {"kind": "sft", "model": {"name": "tiny-random-llama"},
            "sft": {"steps": 3, "batch_size": 6, "micro_batch_size": 2, "max_new_tokens": 6, "eval_prompts": 3,
                    "seed": 3, "learning_rate": 1e-3, "val_batches": 1, "checkpoint_every": 1},
            "sparsity": {"measure_interval": 1}},
}

CASE_SETTINGS = {"grpo-fsdp-low-memory": {"GRPO_MEMORY_BUDGET_GB": 1e-4}}


def _spec(case: str, processes: int):
    d = {"dataset": {"name": "arith", "num_train": 50, "num_val": 6}, **CASES[case],
         "rewards": [{"name": "digit_share"}], "resources": {"processes": processes}}
    # float64 weights, so rounding cannot pass for a difference (see test_two_processes_equal_one)
    d["model"] = {**d["model"], "dtype": "float64"}
    if "retriever" in d:
        d["retriever"] = {**d["retriever"], "dtype": "float64"}
    if (sharding := d.pop("sharding", None)) and processes > 1:
        d["resources"]["sharding"] = sharding
    return TypeAdapter(JobSpec).validate_python(d)


class StopsAfter(FileReporter):
    """Asks the loop to stop once `after` steps are recorded (a cancel)."""

    def __init__(self, out, after):
        super().__init__(out)
        self.after = after

    def should_stop(self):
        return sum(m["step"] > 0 for m in _lines(self.out / "metrics.jsonl")) >= self.after


def _run(case, out, settings, processes, *, reporter=FileReporter):
    """One process: the loop itself; several: as the worker runs them (run_spec, then the launcher)."""
    spec = _spec(case, processes)
    if processes == 1:
        return loop_for(spec.kind)(spec, reporter(out), settings=settings)
    return run_spec(spec, reporter(out), settings=settings, rank_reporter=partial(reporter, out))


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize("case", list(CASES))
def test_two_processes_equal_one(case, tmp_path, settings_factory, digit_plugin, monkeypatch):
    settings = settings_factory(**CASE_SETTINGS.get(case, {}))
    one, two = tmp_path / "one", tmp_path / "two"
    if case == "sft":  # a worker that sees one GPU (its ranks see none here): they train on the CPU, and it says so
        monkeypatch.setattr(runner, "visible_gpus", lambda: 1)
    assert _run(case, one, settings, 1).status == "succeeded"
    assert _run(case, two, settings, 2).status == "succeeded"
    plans = [e["data"]["checkpointing"] for out in (one, two) for e in _lines(out / "events.jsonl")
             if e["type"] == "memory_plan"]
    assert plans == [case in CASE_SETTINGS] * 2  # rank 0 reports the plan every rank follows
    placed = [e for e in _lines(two / "events.jsonl") if e["type"] == "placement"]
    assert [(e["level"], e["data"]) for e in placed] == ([("warning", {"processes": 2, "gpus": 1})] if case == "sft"
                                                         else [])

    # The same weights after 3 steps. Two processes sum the same per-sample gradients in another
    # order, so the summed gradient differs from one process's by rounding only (~1e-16 of its size
    # in float64). AdamW divides by sqrt(v) + eps: an element whose gradient is near zero moves by up
    # to lr * rounding / eps per step. In float32 (rounding ~1e-7 of a gradient, eps 1e-8) that is up
    # to a whole learning rate, a machine-dependent flip; in float64 it is under lr * 1e-7 per step.
    spec = _spec(case, 1)
    for f in sorted((one / "checkpoints" / "step-3").glob("*.safetensors")):
        a, b = load_file(f), load_file(two / "checkpoints" / "step-3" / f.name)
        assert a.keys() == b.keys()
        lr = spec.retriever.learning_rate if f.name == "retriever.safetensors" else spec.train.learning_rate
        atol = STEPS["steps"] * lr * 1e-7  # the bound above; what two processes differ by is ~1e-14
        for k in a:
            assert a[k].dtype == torch.float64, k
            torch.testing.assert_close(b[k], a[k], rtol=0, atol=atol, msg=lambda m, where=f"{f.name} {k}": f"{where}: {m}")

    # the same metrics, reported once per step
    m1, m2 = _lines(one / "metrics.jsonl"), _lines(two / "metrics.jsonl")
    assert [m["step"] for m in m1] == [m["step"] for m in m2] == [0, 1, 2, 3]
    for a, b in zip(m1, m2):
        kept = {k for k in a["metrics"] if not k.startswith(MEASURED)}
        assert kept == {k for k in b["metrics"] if not k.startswith(MEASURED)}
        for k in kept:
            # the same values summed in another order; reward and advantage sums are float32 (~1e-7)
            assert b["metrics"][k] == pytest.approx(a["metrics"][k], rel=1e-6, abs=1e-9), (a["step"], k)
    assert any(m["metrics"].get("grad_norm", 0) > 0 for m in m1)  # something was learned from

    # the same samples, from both ranks, in the same order
    s1, s2 = _lines(one / "samples.jsonl"), _lines(two / "samples.jsonl")
    assert len(s1) == len(s2) > 0 or spec.kind == "sft"  # SFT records no samples
    assert [(s["step"], s["index"], s["completion"]) for s in s1] == [(s["step"], s["index"], s["completion"]) for s in s2]
    if "sparsity" in CASES[case]:  # measured by rank 0 over the whole (identical) weights
        r1, r2 = _lines(one / "sparsity.jsonl"), _lines(two / "sparsity.jsonl")
        assert len(r1) == len(r2) >= 3
        for a, b in zip(r1, r2):
            assert (a["step"], a["from_step"], a["scope"]) == (b["step"], b["from_step"], b["scope"])
            assert b["sparsity"] == pytest.approx(a["sparsity"], abs=1e-3)
    if case.startswith("tracin"):
        sel1, sel2 = _lines(one / "selections.jsonl"), _lines(two / "selections.jsonl")
        assert [s["selected"] for s in sel1] == [s["selected"] for s in sel2]
        for a, b in zip(sel1, sel2):
            assert [c for _, _, c in b["scores"]] == [c for _, _, c in a["scores"]]
            assert [v for _, v, _ in b["scores"]] == pytest.approx([v for _, v, _ in a["scores"]], rel=1e-9, abs=1e-12)
        assert 0 < sum(s["selected"] for s in sel1) < sum(s["total"] for s in sel1)
    # one checkpoint folder per save, written by rank 0 alone
    assert sorted(p.name for p in (two / "checkpoints").iterdir()) == sorted(p.name for p in (one / "checkpoints").iterdir())


def test_a_sharded_job_resumes_from_its_gathered_checkpoint(tmp_path, settings_factory, digit_plugin):
    """FSDP2: cancelled after step 2 and resumed (weights and AdamW's state scattered back to the
    shards), it ends where a straight run ends; its checkpoint is a plain transformers folder."""
    from transformers import AutoModelForCausalLM

    settings = settings_factory()
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert _run("grpo-fsdp", straight, settings, 2).status == "succeeded"
    assert _run("grpo-fsdp", split, settings, 2, reporter=partial(StopsAfter, after=2)).status == "cancelled"
    assert _run("grpo-fsdp", split, settings, 2).status == "succeeded"
    assert "resumed" in [e["type"] for e in _lines(split / "events.jsonl")]
    a = load_file(straight / "checkpoints" / "step-3" / "model.safetensors")
    b = load_file(split / "checkpoints" / "step-3" / "model.safetensors")
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=0)  # the same computation, resumed: bit for bit
    model = AutoModelForCausalLM.from_pretrained(straight / "checkpoints" / "step-3")
    torch.testing.assert_close(model.state_dict()["model.norm.weight"], a["model.norm.weight"])


def test_each_rank_has_a_gpu_of_its_own_or_every_rank_trains_on_the_cpu():
    """NCCL refuses two ranks on one GPU ("Duplicate GPU detected"): fewer GPUs than ranks is gloo on the
    CPU for all of them, and the job is told why and what to set."""
    assert [rank_device(2, local, gpus=2) for local in (0, 1)] == [("nccl", "cuda:0"), ("nccl", "cuda:1")]
    assert [rank_device(2, local, gpus=4) for local in (0, 1)] == [("nccl", "cuda:0"), ("nccl", "cuda:1")]
    assert [rank_device(4, local, gpus=2) for local in range(4)] == [("gloo", "cpu")] * 4
    assert rank_device(2, 0, gpus=0) == ("gloo", "cpu")
    assert placement_warning(2, 0) is None and placement_warning(2, 2) is None  # a CPU worker; enough GPUs
    message = placement_warning(4, 2)
    assert message and "resources.processes to at most 2" in message and "CPU" in message
    # the GPUs the trainer holds (where a vLLM server must not take most of the memory): rank_device's
    assert trainer_gpus("cuda:1", 1) == {1} and trainer_gpus("cuda", 1) == {0}
    assert trainer_gpus(rank_device(2, 1, gpus=2)[1], 2) == {0, 1} and trainer_gpus("cpu", 2) == set()


def test_a_job_with_no_devices_trains_on_the_workers_gpu_where_it_has_one():
    """devices.policy 'auto' (the default) is the worker's first GPU, or its CPU; a GPU named that the
    worker does not see is refused with the field, not torch's "invalid device ordinal"."""
    assert TypeAdapter(JobSpec).validate_python({"kind": "grpo"}).devices.policy == "auto"
    assert [place("auto", gpus) for gpus in (0, 1, 8)] == ["cpu", "cuda:0", "cuda:0"]
    assert [place(d, 2) for d in ("cpu", "cuda", "cuda:1", "mps")] == ["cpu", "cuda", "cuda:1", "mps"]
    for asked, gpus in (("cuda", 0), ("cuda:0", 0), ("cuda:2", 2)):
        with pytest.raises(ValueError, match=f"devices.policy '{asked}': this worker sees"):
            place(asked, gpus)


def test_shares_are_contiguous_and_cover_everything():
    for world in (1, 2, 3, 4):
        for n in (0, 1, 5, 8):
            shares = [Ranks(r, world).share(n) for r in range(world)]
            assert [i for s in shares for i in s] == list(range(n))
            assert max(map(len, shares)) - min(map(len, shares)) <= 1


def _raises_on_rank_1(*, ranks):
    torch.distributed.barrier()
    if ranks.rank == 1:
        raise FloatingPointError("loss is nan at step 2")
    torch.distributed.barrier()  # rank 0 waits for a peer that is gone
    return "unreachable"


def _killed_on_rank_1(pid_file, *, ranks):
    with open(f"{pid_file}.{ranks.rank}", "w") as f:
        f.write(str(os.getpid()))
    if ranks.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    torch.distributed.barrier()
    return "unreachable"


def test_a_rank_error_stops_every_rank_and_names_itself():
    t0 = time.monotonic()
    with pytest.raises(RanksFailed) as info:
        launch(_raises_on_rank_1, (), processes=2)
    assert info.value.rank == 1 and not info.value.killed
    assert info.value.message.startswith("FloatingPointError: loss is nan at step 2")
    assert time.monotonic() - t0 < 60  # rank 0 did not wait out the collective's timeout


def test_a_killed_rank_is_reported_as_killed_and_leaves_no_rank_behind(tmp_path):
    with pytest.raises(RanksFailed) as info:
        launch(_killed_on_rank_1, (str(tmp_path / "pid"),), processes=2)
    assert info.value.killed and info.value.rank == 1 and "SIGKILL" in info.value.message
    pid0 = int((tmp_path / "pid.0").read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid0, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("rank 0 outlived the failed launch")


def test_a_rank_failure_passes_through_a_context_manager_unchanged():
    """A rank's error is an exception like any other: a `with` block (a generator context manager
    re-raises it and sets its traceback) hands on the same error, not a FrozenInstanceError."""
    from contextlib import contextmanager

    @contextmanager
    def around():
        yield

    err = RanksFailed(1, "FloatingPointError: loss is nan", killed=False)
    with pytest.raises(RanksFailed) as caught:
        with around():
            raise err
    assert caught.value is err and str(caught.value) == "rank 1: FloatingPointError: loss is nan"


def _where_am_i(*, ranks):
    """Each rank's place, and the sum of every rank's number over all the nodes (a collective across them)."""
    total = torch.tensor([float(ranks.rank)])
    torch.distributed.all_reduce(total)
    return ranks.rank, ranks.world, ranks.local_world, total.item()


def _node(node: int, endpoint: str, out) -> None:
    """Another machine's worker: its launcher, as node `node` of 2."""
    out.put(launch(_where_am_i, (), processes=2, run_id="gang", gang=Gang(2, node, endpoint, wait_s=60)))


def test_two_launchers_meet_as_two_nodes_and_number_their_ranks_node_by_node():
    import multiprocessing

    endpoint = f"127.0.0.1:{free_port()}"
    ctx = multiprocessing.get_context("spawn")  # a clean interpreter, as another machine's worker would be
    out = ctx.Queue()
    other = ctx.Process(target=_node, args=(1, endpoint, out))
    other.start()
    try:
        here = launch(_where_am_i, (), processes=2, run_id="gang", gang=Gang(2, 0, endpoint, wait_s=60))
        there = out.get(timeout=120)
    finally:
        other.join(30)
    assert here == {0: (0, 4, 2, 6.0), 1: (1, 4, 2, 6.0)}  # node 0 holds ranks 0 and 1, and rank 0 reports
    assert there == {2: (2, 4, 2, 6.0), 3: (3, 4, 2, 6.0)}


def test_a_machine_without_a_gpu_per_rank_puts_every_node_on_gloo():
    assert agreed_backend(["nccl"] * 4) == "nccl"
    assert agreed_backend(["nccl", "nccl", "gloo", "gloo"]) == "gloo"  # NCCL and gloo ranks would never meet


def test_a_node_alone_gives_up_after_its_wait():
    t0 = time.monotonic()
    with pytest.raises(GangIncomplete, match="node 0 of 2 at 127.0.0.1:.*1/2 clients joined"):
        launch(_where_am_i, (), processes=1, run_id="alone", gang=Gang(2, 0, f"127.0.0.1:{free_port()}", wait_s=1))
    assert time.monotonic() - t0 < 30


def test_a_stop_during_the_rendezvous_stops_the_launch_and_never_reaches_the_callers_handler():
    """A node's watch stops its launch with SIGTERM; before any rank starts, the signal is the launcher's to raise
    (a Celery pool process's own handler exits the process on it, and a second one kills it with code 70)."""
    seen: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
        with pytest.raises(LauncherStopped, match="SIGTERM"):  # node 1, whose node 0 never comes
            launch(_where_am_i, (), processes=1, run_id="stopped", gang=Gang(2, 1, f"127.0.0.1:{free_port()}",
                                                                             wait_s=2))
        assert seen == []
        os.kill(os.getpid(), signal.SIGTERM)  # the caller's handler is back
        time.sleep(0.1)
        assert seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


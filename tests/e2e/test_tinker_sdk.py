"""The unmodified tinker SDK against `grpo-jobs dev` (embedded store and broker): every built-in loss's
value, log-probs and gradient norm against a hand computation in torch on the same weights, a session
run that gives its worker back and comes back from its saved state, tenancy, and refused input.

One `grpo-jobs dev` serves the module (a start costs its API and worker imports, about 12 CPU-s here);
each test is an owner of its own on it, so what it lists and counts is its own, as another tenant's
would be."""

from __future__ import annotations

import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from service.core.settings import Settings
from service.store import keys as keys_q
from service.store.db import session_scope
from tests.e2e.conftest import BIN, Procs, embedded_env, start_dev

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402

# one `grpo-jobs dev` for the module (its fixture): pytest-xdist runs the module's tests in one process
pytestmark = pytest.mark.xdist_group("tinker_sdk")

MODEL, RANK, SEED = "tiny-random-llama", 4, 3
LOSS_CONFIGS = {  # clip bounds tight enough that some of the ratios below are clipped
    "cross_entropy": None, "importance_sampling": None,
    "ppo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
    "cispo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
    "dro": {"beta": 0.3},
    "gspo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
}


@dataclass(frozen=True)
class DevService:
    base: str  # its URL
    procs: Procs  # `grpo-jobs dev`, and the environment its commands run with
    store_url: str  # its embedded store, where each test's owner gets a key


@pytest.fixture(scope="module")
def dev_service(tmp_path_factory, models_root):
    """The module's `grpo-jobs dev`, stopped once its last test is done."""
    tmp = tmp_path_factory.mktemp("tinker-dev")
    procs = Procs(embedded_env(tmp / "data", models_root), tmp)
    try:
        base, _ = start_dev(procs, GRPO_SESSION_IDLE_S="4", TINKER_TELEMETRY="0")
        yield DevService(base, procs, Settings(GRPO_DATA_DIR=tmp / "data").store_url)
    finally:
        procs.stop()


@pytest.fixture
def dev(dev_service):
    """The module's service and the key of an owner of this test's own."""
    with session_scope(dev_service.store_url) as s:
        key = keys_q.create_key(s, owner=f"sdk-{uuid.uuid4().hex[:8]}")
    return dev_service.base, key


def reference_model():
    """The run's weights, built as the worker builds them: the tiny model of this seed with a fresh
    LoRA adapter (B = 0, so the policy is the base model), rank RANK on every linear layer and the head."""
    from service.core.specs import LoraSpec, ModelSpec
    from worker.model.loading import load_policy

    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
    spec = ModelSpec(name=MODEL, dtype="float32", lora=LoraSpec(r=RANK, alpha=RANK, target_modules=modules))
    model, _ = load_policy(spec, models_root=Path("/nonexistent"), device="cpu", seed=SEED)
    return model


def hand_loss(name: str, logp: torch.Tensor, d: dict, cfg: dict | None) -> torch.Tensor:
    """The SDK's documented definitions, written out again here: token sums."""
    if name == "cross_entropy":
        return -(d["weights"] * logp).sum()
    q, a = d["logprobs"], d["advantages"]
    r = torch.exp(logp - q)
    if name == "importance_sampling":
        return -(r * a).sum()
    if name == "dro":
        return -(logp * a - 0.5 * cfg["beta"] * (logp - q) ** 2).sum()
    lo, hi = cfg["clip_low_threshold"], cfg["clip_high_threshold"]
    if name == "ppo":
        return -torch.minimum(r * a, r.clamp(lo, hi) * a).sum()
    if name == "cispo":
        return -(r.clamp(lo, hi).detach() * logp * a).sum()
    s = torch.exp((logp.detach() - q).mean())  # gspo: the sequence ratio over every token
    ratio = s * torch.exp(logp - logp.detach())
    return -torch.minimum(ratio * a, ratio.clamp(lo, hi) * a).sum()


def make_data(model, rng: np.random.Generator) -> list[dict]:
    """Two sequences whose sampler log-probs sit near the policy's, so ratios fall inside and outside
    the clip band."""
    vocab = model.get_input_embeddings().num_embeddings
    data = []
    for n in (7, 5):
        tokens = rng.integers(1, vocab, size=n + 1)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor(tokens[:-1])[None]).logits[0]
            logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
        data.append({"tokens": tokens[:-1], "target_tokens": tokens[1:],
                     "weights": (np.arange(n) >= 2).astype(np.float32),
                     "logprobs": (logp.numpy() + rng.normal(0, 0.15, n)).astype(np.float32),
                     "advantages": rng.choice([-1.0, 0.5, 1.0], size=n).astype(np.float32)})
    return data


def datum(d: dict, loss: str) -> types.Datum:
    names = ("target_tokens", "weights") if loss == "cross_entropy" else ("target_tokens", "logprobs", "advantages")
    return types.Datum(model_input=types.ModelInput.from_ints(d["tokens"].tolist()),
                       loss_fn_inputs={k: d[k] for k in names})


def test_every_builtin_loss_matches_a_hand_computation(dev, tinker_service):
    base, key = dev
    service = tinker_service(base, key)
    client = service.create_lora_training_client(base_model=MODEL, rank=RANK, seed=SEED).result()
    model = reference_model()
    data = make_data(model, np.random.default_rng(0))
    for loss, cfg in LOSS_CONFIGS.items():
        out = client.forward_backward([datum(d, loss) for d in data], loss, loss_fn_config=cfg).result()
        # learning rate 0: the weights stay, the step's gradient norm is reported
        stepped = client.optim_step(types.AdamParams(learning_rate=0.0)).result()
        model.zero_grad()
        total = 0.0
        for d, got in zip(data, out.loss_fn_outputs):
            logits = model(input_ids=torch.tensor(d["tokens"])[None]).logits[0]
            logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(d["target_tokens"])[:, None])[:, 0]
            inputs = {k: torch.tensor(v) for k, v in d.items() if k in ("weights", "logprobs", "advantages")}
            value = hand_loss(loss, logp, inputs, cfg)
            value.backward()
            total += value.item()
            np.testing.assert_allclose(got["logprobs"].to_numpy(), logp.detach().numpy(), rtol=1e-5, atol=1e-5)
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()
                                                     if p.grad is not None])).item()
        # float32 on both sides, summed in different orders: 1e-4 relative
        assert out.metrics["loss:sum"] == pytest.approx(total, rel=1e-4, abs=1e-5), loss
        assert stepped.metrics["grad_norm:mean"] == pytest.approx(norm, rel=1e-4, abs=1e-6), loss

    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=30) as c:
        job = c.get("/v1/jobs", params={"kind": "session"}).json()["items"][0]
        assert job["uid"] == client.model_id and job["step"] == len(LOSS_CONFIGS)
        series = c.get(f"/v1/jobs/{job['id']}/metrics", params={"keys": "loss/total,grad_norm"}).json()["series"]
        assert {s["key"]: s["total_points"] for s in series} == {"loss/total": len(LOSS_CONFIGS),
                                                                 "grad_norm": len(LOSS_CONFIGS)}


def test_a_session_run_gives_its_worker_back_and_resumes_from_its_state(dev, tinker_service):
    base, key = dev
    service = tinker_service(base, key)
    client = service.create_lora_training_client(base_model=MODEL, rank=RANK, seed=SEED).result()
    rng = np.random.default_rng(1)
    tokens = rng.integers(1, 60, size=12).tolist()
    ce = [types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                      loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 11})]
    losses = []
    for _ in range(3):
        losses.append(client.forward_backward(ce, "cross_entropy").result().metrics["loss:sum"])
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    before = client.forward(ce, "cross_entropy").result().metrics["loss:sum"]
    assert before < losses[0]
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=30) as c:
        job_id = c.get("/v1/jobs", params={"kind": "session"}).json()["items"][0]["id"]
        deadline = time.time() + 60
        while c.get(f"/v1/jobs/{job_id}").json()["status"] != "idle":
            assert time.time() < deadline, "the run never went idle"
            time.sleep(0.3)
        # the next operation brings the run back, from the state saved at step 3: the same weights
        after = client.forward(ce, "cross_entropy").result().metrics["loss:sum"]
        client.forward_backward(ce, "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        job = c.get(f"/v1/jobs/{job_id}").json()
        events = [e["type"] for e in c.get(f"/v1/jobs/{job_id}/events").json()]
    assert job["status"] == "running" and job["step"] == 4 and job["attempt"] == 1
    assert events.count("idle") == 1 and "resumed" in events
    assert after == pytest.approx(before, rel=1e-6)  # the trained weights came back, not the base model's


def test_another_owner_cannot_read_or_drive_a_run_and_bad_input_is_refused(dev, dev_service, tinker_service):
    base, key = dev
    other = subprocess.run([str(BIN), "keys", "create", "--owner", "mallory"], env=dev_service.procs.env,
                           capture_output=True, text=True, check=True).stdout.strip().split()[-1]
    assert other.startswith("tml-")
    service = tinker_service(base, key)
    client = service.create_lora_training_client(base_model=MODEL, rank=RANK, seed=SEED).result()
    d = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                    loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]})

    def body(loss: str, model_id: str, data=(d,)) -> bytes:
        req = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(
            data=list(data), loss_fn=loss), model_id=model_id, seq_id=99)
        return forward_backward_request_to_proto(req).SerializeToString()

    proto = {"Content-Type": "application/x-protobuf"}
    with httpx.Client(base_url=base, timeout=30) as c:
        theirs = {"X-API-Key": other}
        assert c.post("/api/v1/get_info", json={"model_id": client.model_id}, headers=theirs).status_code == 404
        r = c.post("/api/v1/forward_backward", content=body("cross_entropy", client.model_id),
                   headers={**theirs, **proto})
        assert r.status_code == 404  # cannot drive it
        mine = {"X-API-Key": key}
        request_id = c.post("/api/v1/forward_backward", content=body("cross_entropy", client.model_id),
                            headers={**mine, **proto}).json()["request_id"]
        assert c.post("/api/v1/retrieve_future", json={"request_id": request_id}, headers=theirs).status_code == 404
        assert c.post("/api/v1/retrieve_future", json={"request_id": request_id}, headers=mine).status_code == 200
        r = c.post("/api/v1/forward_backward", content=body("nope", client.model_id), headers={**mine, **proto})
        assert r.status_code == 400 and r.json()["detail"][0]["field"] == "loss_fn"
        short = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                            loss_fn_inputs={"target_tokens": [2, 3], "weights": [1.0, 1.0]})
        r = c.post("/api/v1/forward_backward", content=body("cross_entropy", client.model_id, (short,)),
                   headers={**mine, **proto})
        assert r.status_code == 400 and r.json()["detail"][0]["field"] == "data.0.loss_fn_inputs.target_tokens"
        assert c.post("/api/v1/forward_backward", content=b"\xff" * 40, headers={**mine, **proto}).status_code == 400
        sampler_id = f"{client.model_id}:v0"
        ask = {"sampling_session_id": sampler_id, "prompt": {"chunks": [{"tokens": [1, 2, 3]}]},
               "sampling_params": {"max_tokens": 2}}
        for extra, status, field in (
                ({"prompt_logprobs_last_n": 2}, 400, "prompt_logprobs_last_n"),
                ({"prompt_logprobs": True, "prompt_logprobs_last_n": 3}, 400, "prompt_logprobs_last_n"),
                ({"topk_prompt_logprobs": 65}, 422, "topk_prompt_logprobs"),
                ({"target_prompt_logprobs": {"data": [1, 2], "dtype": "int64", "shape": [1, 2]}}, 400,
                 "target_prompt_logprobs.shape")):
            r = c.post("/api/v1/asample", json=ask | extra, headers=mine)
            assert r.status_code == status and r.json()["detail"][0]["field"] == field, (extra, r.text)
    # a token beyond the vocabulary: the worker knows the vocabulary, the future fails naming the field
    huge = types.Datum(model_input=types.ModelInput.from_ints([1, 10**6]),
                       loss_fn_inputs={"target_tokens": [2, 3], "weights": [1.0, 1.0]})
    with pytest.raises(tinker.RequestFailedError, match="data.0.model_input: token id 1000000"):
        client.forward_backward([huge], "cross_entropy").result()
    # the run goes on after a refused operation
    assert client.forward_backward([d], "cross_entropy").result().metrics["loss:sum"] > 0
    # another owner cannot sample what the run saved, by its tinker:// path, nor list or download it
    path = client.save_weights_for_sampler("mine").result().path
    with httpx.Client(base_url=base, timeout=30) as c:
        ask = {"session_id": "theirs", "model_path": path}
        assert c.post("/api/v1/create_sampling_session", json=ask, headers=theirs).status_code == 404
        assert c.post("/api/v1/create_sampling_session", json=ask, headers=mine).status_code == 200
        assert c.get(f"/api/v1/training_runs/{client.model_id}/checkpoints", headers=theirs).status_code == 404
        assert c.get(f"/api/v1/training_runs/{client.model_id}", headers=theirs).status_code == 404
        assert c.get("/api/v1/training_runs", headers=theirs).json()["cursor"]["total_count"] == 0
        assert c.get("/api/v1/checkpoints", headers=theirs).json()["checkpoints"] == []
        assert c.post("/api/v1/weights_info", json={"tinker_path": path}, headers=theirs).status_code == 404
        assert c.delete(f"/api/v1/training_runs/{client.model_id}/checkpoints/sampler_weights/mine",
                        headers=theirs).status_code == 404
        assert c.post("/api/v1/weights_info", json={"tinker_path": path}, headers=mine).status_code == 200


def check_prompt_scoring(sampler, model) -> None:
    """What a request can ask of its prompt and its completion, through the SDK, against a hand
    computation on the same weights."""
    prompt = [5, 9, 14, 3, 22, 8, 1, 40]
    ids = torch.tensor(prompt)
    with torch.no_grad():
        full = torch.log_softmax(model(input_ids=ids[None]).logits[0, :-1], -1)  # [P-1, V]: row i, position i + 1
    picked = full.gather(-1, ids[1:, None])[:, 0].numpy()
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(prompt), prompt_logprobs_last_n=3).result()
    assert scored[:5] == [None] * 5
    np.testing.assert_allclose(scored[5:], picked[4:], atol=1e-4)
    named = torch.full((7, 3), -1, dtype=torch.int64)
    named[2, :2], named[6, 2] = torch.tensor([4, 100]), 17
    params = types.SamplingParams(max_tokens=3, temperature=0.7, seed=11, stop=[])
    out = sampler.sample(types.ModelInput.from_ints(prompt), 1, params, include_prompt_logprobs=True,
                         topk_prompt_logprobs=3, topk_sample_logprobs=2, prompt_logprobs_last_n=5,
                         target_prompt_logprobs=types.TensorData.from_torch_sparse(named, pad_value=-1),
                         prompt_alt_tokens_k=4).result()
    top = torch.topk(full, 3, -1)
    assert out.prompt_logprobs[:3] == [None] * 3 and out.topk_prompt_logprobs[:3] == [None] * 3
    np.testing.assert_allclose(out.prompt_logprobs[3:], picked[2:], atol=1e-4)
    for i in range(3, 8):
        assert [t for t, _ in out.topk_prompt_logprobs[i]] == top.indices[i - 1].tolist()
        np.testing.assert_allclose([lp for _, lp in out.topk_prompt_logprobs[i]], top.values[i - 1], atol=1e-4)
    want = torch.zeros(7, 3)
    want[2, :2], want[6, 2] = full[2, [4, 100]], full[6, 17]
    assert out.target_prompt_logprobs.sparse_crow_indices is not None  # answered sparse, as sent
    np.testing.assert_allclose(out.target_prompt_logprobs.to_torch(), want, atol=1e-4)
    alt = out.prompt_alt_tokens.tokens.to_torch()  # [P-1, 4], drawn at temperature 0.7
    assert alt.shape == (7, 4)
    np.testing.assert_allclose(out.prompt_alt_tokens.logprobs.to_torch(),
                               torch.log_softmax(full / 0.7, -1).gather(-1, alt), atol=1e-4)
    seq = out.sequences[0]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(prompt + seq.tokens)[None]).logits[0, len(prompt) - 1:-1] / 0.7
    top = torch.topk(torch.log_softmax(logits, -1), 2, -1)
    assert [[t for t, _ in row] for row in seq.topk_logprobs] == top.indices.tolist()
    np.testing.assert_allclose([[lp for _, lp in row] for row in seq.topk_logprobs], top.values, atol=1e-4)


def test_sampling_from_snapshots_of_the_trained_weights(dev, tinker_service):
    base, key = dev
    service = tinker_service(base, key)
    client = service.create_lora_training_client(base_model=MODEL, rank=RANK, seed=SEED).result()
    model = reference_model()
    prompt = [5, 9, 14, 3]
    sampler = client.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=7, stop=[])  # [] : no stop, not even EOS
    out = sampler.sample(types.ModelInput.from_ints(prompt), 3, params, include_prompt_logprobs=True).result()
    assert len(out.sequences) == 3 and all(len(s.tokens) == 6 and s.stop_reason == "length" for s in out.sequences)
    with torch.no_grad():  # each sampled token's log-prob, and the prompt's, from the same weights
        for s in out.sequences:
            ids = torch.tensor(prompt + s.tokens)
            logp = torch.log_softmax(model(input_ids=ids[None]).logits[0, :-1], -1).gather(-1, ids[1:, None])[:, 0]
            np.testing.assert_allclose(s.logprobs, logp[len(prompt) - 1:].numpy(), rtol=1e-4, atol=1e-4)
        assert out.prompt_logprobs[0] is None
        np.testing.assert_allclose(out.prompt_logprobs[1:], logp[:len(prompt) - 1].numpy(), rtol=1e-4, atol=1e-4)
        greedy = model(input_ids=torch.tensor(prompt)[None]).logits[0, -1].argmax().item()
    # a stop token ends a completion with reason "stop"
    first = sampler.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(
        max_tokens=6, temperature=0.0, stop=[greedy])).result().sequences[0]
    assert first.tokens == [greedy] and first.stop_reason == "stop"
    check_prompt_scoring(sampler, model)
    # train a step: the earlier sampler still samples the weights it was made from, a new one the new weights
    d = types.Datum(model_input=types.ModelInput.from_ints(prompt),
                    loss_fn_inputs={"target_tokens": prompt[1:] + [7], "weights": [1.0] * 4})
    client.forward_backward([d], "cross_entropy").result()
    client.optim_step(types.AdamParams(learning_rate=0.05)).result()
    again = sampler.sample(types.ModelInput.from_ints(prompt), 3, params).result()
    assert [s.tokens for s in again.sequences] == [s.tokens for s in out.sequences]
    np.testing.assert_allclose([s.logprobs for s in again.sequences], [s.logprobs for s in out.sequences], atol=1e-5)
    newer = client.save_weights_and_get_sampling_client().result()
    moved = newer.sample(types.ModelInput.from_ints(prompt), 3, params).result()
    assert not np.allclose(moved.sequences[0].logprobs[:1], out.sequences[0].logprobs[:1], atol=1e-4)
    # a base model's own weights, sampled by a run that only samples (the tiny presets' base: seed 0)
    from service.core.specs import ModelSpec
    from worker.model.loading import load_policy

    base_sampler = service.create_sampling_client(base_model=MODEL).result()
    from_base = base_sampler.sample(types.ModelInput.from_ints(prompt), 2, params).result()
    base_model = load_policy(ModelSpec(name=MODEL, dtype="float32"), models_root=Path("/nonexistent"), device="cpu",
                             seed=0)[0].eval()
    with torch.no_grad():
        for q in from_base.sequences:
            ids = torch.tensor(prompt + q.tokens)
            logits = base_model(input_ids=ids[None]).logits[0, :-1]
            logp = torch.log_softmax(logits, -1).gather(-1, ids[1:, None])[:, 0]
            np.testing.assert_allclose(q.logprobs, logp[len(prompt) - 1:].numpy(), rtol=1e-4, atol=1e-4)
    # requests sent together are sampled as one batch, each as it is alone
    prompts = [[5, 9, 14, 3, 22, 8, 1], [7], [30, 31, 32], [2, 4, 6, 8, 10]]

    def params_of(i: int) -> types.SamplingParams:
        return types.SamplingParams(max_tokens=5, temperature=1.0, seed=100 + i, stop=[])

    futures = [newer.sample(types.ModelInput.from_ints(p), 2, params_of(i)) for i, p in enumerate(prompts)]
    together = [f.result() for f in futures]
    for i, (p, got) in enumerate(zip(prompts, together)):
        alone = newer.sample(types.ModelInput.from_ints(p), 2, params_of(i)).result()
        assert [s.tokens for s in got.sequences] == [s.tokens for s in alone.sequences]
        np.testing.assert_allclose([s.logprobs for s in got.sequences], [s.logprobs for s in alone.sequences],
                                   atol=1e-5)
    # every completion is recorded as a sample of the step it was drawn at, ungraded
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=30) as c:
        job = next(j for j in c.get("/v1/jobs", params={"kind": "session"}).json()["items"]
                   if j["uid"] == client.model_id)
        rows = c.get(f"/v1/jobs/{job['id']}/samples", params={"limit": 1000}).json()
    by_step = {step: [r for r in rows if r["step"] == step] for step in (0, 1)}
    assert len(rows) == 6 + 22 and [len(by_step[0]), len(by_step[1])] == [6, 22]  # 3 + 1 + 2; 3 + 3 + 4 x 2 x 2
    for step_rows in by_step.values():
        assert sorted(r["index"] for r in step_rows) == list(range(len(step_rows)))
    assert all(r["reward"] is None and r["advantage"] is None for r in rows)
    assert [r["extra"]["tokens"] for r in by_step[0]][:4] == [6, 6, 6, 1]  # then the prompt scoring's two
    assert [r["extra"]["stop_reason"] for r in by_step[0]][:4] == ["length"] * 3 + ["stop"]
    assert by_step[0][0]["extra"]["logprob"] == pytest.approx(sum(out.sequences[0].logprobs), abs=1e-4)


def test_save_state_and_load_it_into_this_run_or_a_new_one(dev, tinker_service):
    base, key = dev
    service = tinker_service(base, key)
    client = service.create_lora_training_client(base_model=MODEL, rank=RANK, seed=SEED).result()
    ce = [types.Datum(model_input=types.ModelInput.from_ints([5, 9, 14, 3, 22]),
                      loss_fn_inputs={"target_tokens": [9, 14, 3, 22, 7], "weights": [1.0] * 5})]

    def train() -> None:
        client.forward_backward(ce, "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result()

    def loss(c) -> float:
        return c.forward(ce, "cross_entropy").result().metrics["loss:sum"]

    train()
    saved = client.save_state("after-one").result().path
    assert saved == f"tinker://{client.model_id}/weights/after-one"
    to_sample = client.save_weights_for_sampler("one").result().path
    live = client.save_weights_and_get_sampling_client().result()  # the same weights, in memory
    at_save = loss(client)
    train()
    train()
    assert loss(client) < at_save
    # a sampling client on the saved path samples the weights as they were saved
    from_path = service.create_sampling_client(model_path=to_sample).result()
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=3, stop=[])
    prompt = types.ModelInput.from_ints([5, 9, 14])
    got, want = from_path.sample(prompt, 2, params).result(), live.sample(prompt, 2, params).result()
    assert [q.tokens for q in got.sequences] == [q.tokens for q in want.sequences]
    np.testing.assert_allclose([q.logprobs for q in got.sequences], [q.logprobs for q in want.sequences], atol=1e-5)
    with pytest.raises(tinker.NotFoundError):
        service.create_sampling_client(model_path=f"tinker://{client.model_id}/sampler_weights/nope").result()
    client.load_state_with_optimizer(saved).result()
    assert loss(client) == pytest.approx(at_save, rel=1e-6)  # the weights as they were saved
    # a new run of this session from the saved state, optimizer included: it trains on as the first did
    resumed = service.create_training_client_from_state_with_optimizer(saved).result()
    assert loss(resumed) == pytest.approx(at_save, rel=1e-6)
    rest = tinker.RestClient(base_url=base, api_key=key)
    listed = rest.list_checkpoints(client.model_id).result()
    assert sorted(c.tinker_path for c in listed.checkpoints) == sorted([saved, to_sample])
    sessions = rest.list_sessions().result().sessions
    assert len(sessions) == 1  # this client's session: both runs belong to it
    runs_of_session = rest.get_session(sessions[0]).result().training_run_ids
    assert client.model_id in runs_of_session and len(runs_of_session) == 2
    # the RestClient's view of runs and their checkpoints
    runs = rest.list_training_runs().result()
    assert runs.cursor.total_count == 2 and runs.training_runs[1].training_run_id == client.model_id  # newest first
    # the SDK names a run made from a state <session>:train:<n>; its training run id is the run's own
    assert rest.get_training_run(resumed.model_id).result().training_run_id == runs.training_runs[0].training_run_id
    run = rest.get_training_run(client.model_id).result()
    assert (run.base_model, run.is_lora, run.lora_rank) == (MODEL, True, RANK)
    assert run.last_checkpoint.tinker_path == saved and run.last_sampler_checkpoint.tinker_path == to_sample
    info = rest.get_weights_info_by_tinker_path(saved).result()
    assert (info.base_model, info.is_lora, info.lora_rank, info.train_unembed) == (MODEL, True, RANK, True)
    assert {c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints} == {saved, to_sample}
    spare = client.save_state("spare").result().path
    rest.delete_checkpoint_from_tinker_path(spare).result()
    assert spare not in {c.tinker_path for c in rest.list_checkpoints(client.model_id).result().checkpoints}
    with pytest.raises(tinker.NotFoundError):
        rest.get_weights_info_by_tinker_path(spare).result()
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=30) as c:
        runs = c.get("/v1/jobs", params={"kind": "session"}).json()["items"]
        assert len(runs) == 2
        first = next(r for r in runs if r["uid"] == client.model_id)
        archive = c.get(f"/v1/jobs/{first['id']}/checkpoints/1/archive")
        assert archive.status_code == 200 and archive.content[:2] == b"\x1f\x8b"  # the state, as a .tar.gz
        # once the run has ended, its saved path is sampled by a run of its own, from the same weights
        assert c.post(f"/v1/jobs/{first['id']}/cancel").status_code == 200
        deadline = time.monotonic() + 60
        while c.get(f"/v1/jobs/{first['id']}").json()["status"] != "cancelled" and time.monotonic() < deadline:
            time.sleep(0.2)
        after_end = service.create_sampling_client(model_path=to_sample).result()
        got = after_end.sample(prompt, 2, params).result()
        assert [q.tokens for q in got.sequences] == [q.tokens for q in want.sequences]
        np.testing.assert_allclose([q.logprobs for q in got.sequences], [q.logprobs for q in want.sequences],
                                   atol=1e-5)
        samplers = [r for r in c.get("/v1/jobs", params={"kind": "session"}).json()["items"]
                    if r["name"].startswith("tinker sampler one")]
        assert len(samplers) == 1 and samplers[0]["uid"] != first["uid"]

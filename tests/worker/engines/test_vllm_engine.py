"""The vLLM rollout engine against a real server from GRPO_VLLM_PYTHON (`make vllm`): what the
server serves is what the trainer holds, before and after a sync, and after the server died."""

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from service.core.specs import LoraSpec, ModelSpec
from worker.batch import RolloutBatch, SamplingParams
from worker.engines.hf_engine import eos_token_ids
from worker.engines.vllm_engine import ServerConfig, VLLMEngine, VLLMServer, write_model_folder
from worker.environments.continuous import Continuous
from worker.environments.episodes import rows
from worker.environments.runner import Limits, Players, play
from worker.environments.servers import BundledServer
from worker.environments.turns import ChatTurns
from worker.model.checkpoints import Trainables, save_checkpoint
from worker.model.forward import sequence_logprobs
from worker.model.loading import load_policy

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
PROMPT = "<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n"
COMPLETION = "12 + 30 = 42. The answer is 42."
TOLERANCE = 1e-4  # fp32; measured up to 3.4e-5 (vLLM's CPU kernels against transformers')


def _served_logprobs(server: VLLMServer, prompt: list[int], completion: list[int], model: str = "base") -> torch.Tensor:
    """The server's log-probs of `completion` after `prompt`, teacher-forced (prompt_logprobs). [T]"""
    out = server.post("/v1/completions", {"model": model, "prompt": prompt + completion, "max_tokens": 1,
                                          "prompt_logprobs": 0, "temperature": 1.0})
    rows = out["choices"][0]["prompt_logprobs"][len(prompt):]  # {token id: {"logprob": ...}} per position
    return torch.tensor([row[str(t)]["logprob"] for row, t in zip(rows, completion)], dtype=torch.float64)


def _trainer_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1].double()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None]).squeeze(1)


def _group_gone(pgid: int, within_s: float = 30.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def _server(vllm_python, folder: Path, log: Path, lora_rank: int | None) -> VLLMServer:
    server = VLLMServer(ServerConfig(python=vllm_python, model_dir=folder, dtype="float32", max_model_len=1024,
                                     lora_rank=lora_rank, log_path=log, extra_args=("--enforce-eager",)))
    server.start()
    return server


def test_a_full_fine_tuning_checkpoint_and_its_sync_serve_the_trainers_logprobs(vllm_python, models_root, tmp_path):
    """A full-fine-tuning checkpoint folder (what the service archives), served from a fresh start, and
    the engine's folder reloaded in place; the LoRA folders are the sync test's."""
    model, tok = load_policy(ModelSpec(name="smollm2-135m-instruct", dtype="float32"), models_root=models_root, device="cpu")
    prompt, completion = tok(PROMPT)["input_ids"], tok(COMPLETION)["input_ids"] + [tok.eos_token_id]
    base = _trainer_logprobs(model.eval(), prompt, completion)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "mlp" in name or "embed" in name:
                p.add_(torch.randn_like(p) * 0.01)
    save_checkpoint(tmp_path / "full", Trainables(model, tok, {}, {}), step=1, opt_steps=1)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "full", dtype=torch.float32).eval()
    expected = _trainer_logprobs(saved, prompt, completion)
    assert (expected - base).abs().max() > 100 * TOLERANCE  # the weights really differ
    server = _server(vllm_python, tmp_path / "full", tmp_path / "vllm.log", lora_rank=None)
    pgid = server.proc.pid
    try:
        assert (_served_logprobs(server, prompt, completion) - expected).abs().max() < TOLERANCE
        # the full-fine-tuning sync: the engine's folder, reloaded in place (embeddings included)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "embed" in name or "self_attn" in name:
                    p.add_(torch.randn_like(p) * 0.01)
        write_model_folder(model, tok, tmp_path / "synced")
        server.post("/collective_rpc", {"method": "reload_weights",
                                        "kwargs": {"weights_path": str(tmp_path / "synced")}})
        server.post("/reset_prefix_cache", {})
        expected = _trainer_logprobs(model, prompt, completion)
        assert (_served_logprobs(server, prompt, completion) - expected).abs().max() < TOLERANCE
    finally:
        server.stop()
    assert _group_gone(pgid)


def test_a_sync_serves_the_updated_policy_and_a_dead_server_comes_back_once(vllm_python, models_root, tmp_path):
    policy, tok = load_policy(ModelSpec(name="smollm2-135m-instruct", dtype="float32", lora=LoraSpec(r=8)), models_root=models_root,
                              device="cpu")
    events = []
    engine = VLLMEngine(policy, tok, "cpu", SamplingParams(max_new_tokens=16, temperature=0.8), python=vllm_python,
                        workdir=tmp_path / "engine", max_model_len=1024, extra_args=("--enforce-eager",),
                        on_event=lambda kind, message, data: events.append(kind))
    pgid = engine.server.proc.pid
    prompt, completion = tok(PROMPT)["input_ids"], tok(COMPLETION)["input_ids"] + [tok.eos_token_id]
    try:
        # the folder the engine wrote from the trainer's base, and a LoRA checkpoint's adapter folder on it
        with policy.disable_adapter():
            base = _trainer_logprobs(policy.eval(), prompt, completion)
        assert (_served_logprobs(engine.server, prompt, completion) - base).abs().max() < TOLERANCE
        _perturb(policy)
        save_checkpoint(tmp_path / "lora", Trainables(policy, tok, {}, {}), step=1, opt_steps=1)
        engine.server.post("/v1/load_lora_adapter", {"lora_name": "ckpt", "lora_path": str(tmp_path / "lora")})
        expected = _trainer_logprobs(policy, prompt, completion)
        assert (_served_logprobs(engine.server, prompt, completion, model="ckpt") - expected).abs().max() < TOLERANCE
        engine.server.post("/v1/unload_lora_adapter", {"lora_name": "ckpt"})

        engine.sync(policy)
        before = engine.generate([PROMPT], 4, seeds=[3])
        _perturb(policy)  # one "update": what a training step does to the adapter
        engine.sync(policy)
        after = engine.generate([PROMPT], 4, seeds=[3])
        assert after.version.tolist() == [2] * 4 and before.version.tolist() == [1] * 4
        updated = _policy_logprobs(policy, after)
        with policy.disable_adapter():
            old = _policy_logprobs(policy, after)
        real = after.completion_mask.bool()
        assert (after.sampler_logp - updated)[real].abs().max() < TOLERANCE  # the engine samples the new weights
        assert (after.sampler_logp - old)[real].abs().max() > 100 * TOLERANCE
        # the same seeds draw the same rows again
        assert engine.generate([PROMPT], 4, seeds=[3]).completions == after.completions

        # a batch in flight through the next sync (max_staleness 1) is sampled by the adapter it was sent to,
        # which is unloaded once a later sync finds it idle; weights unchanged since the last push are not pushed
        engine.sync(policy)
        assert engine.version == 2
        expected = engine.generate([PROMPT] * 4, 4, seeds=[5, 6, 7, 8])  # by v2
        ahead = engine.submit([PROMPT] * 4, 4, seeds=[5, 6, 7, 8])  # by v2, still sampling during the next sync
        _perturb(policy)
        engine.sync(policy)  # v3
        stale = ahead()
        assert stale.version.tolist() == [2] * 16 and engine.version == 3
        assert stale.completions == expected.completions
        assert torch.allclose(stale.sampler_logp, expected.sampler_logp, atol=TOLERANCE)
        _perturb(policy)
        engine.sync(policy)
        assert _served_models(engine.server) == {"base", "v4"}

        os.kill(_server_child(pgid), signal.SIGKILL)  # the API server itself, not the watchdog
        assert _wait(lambda: not engine.server.alive())
        first, second = (engine.submit([PROMPT], 4, seeds=[3]) for _ in range(2))  # both sent to the dead server
        again = first()  # started again, with the synced adapter
        assert second().completions == again.completions  # sent again to the new server, not failed
        assert events == ["engine_started", "engine_restarted"]
        mismatch = (again.sampler_logp - _policy_logprobs(policy, again))[again.completion_mask.bool()]
        assert mismatch.abs().max() < TOLERANCE
        assert engine.server.proc.pid != pgid
        pgid2 = engine.server.proc.pid
        _episodes_are_rows_of_what_the_engine_sampled(engine, policy, tok, tmp_path)
    finally:
        engine.close()
    assert _group_gone(pgid) and _group_gone(pgid2)
    assert sorted(p.name for p in (tmp_path / "engine").iterdir()) == ["vllm.log"]  # the weights went with it


def _episodes_are_rows_of_what_the_engine_sampled(engine, policy, tok, tmp_path) -> None:
    """Multi-turn episodes sampled token in, token out by the server: each training row's engine log-probs
    are the trainer's own on the same row, turn after turn (the observations between turns are context
    the row carries and the loss masks)."""
    server = BundledServer("guess-number", tmp_path / "guess.log")
    try:
        players = Players(engine=engine, tokenizer=tok, turns=ChatTurns.of(tok), max_new_tokens=16,
                          eos_ids=frozenset(eos_token_ids(tok, policy)))
        limits = Limits(max_turns=3, max_episode_tokens=200, max_observation_tokens=64, max_concurrent=4,
                        timeout_s=30.0, max_bytes=1 << 20)
        episodes, _ = play(players, server.start(), [4, 5], 2, limits, seed_of=lambda i, turn: 10 * i + turn,
                           scheduler=Continuous())
    finally:
        server.stop()
    batch = rows(episodes, tok.pad_token_id)
    assert any(len(e.turns) > 1 for e in episodes)
    trained = batch.loss_mask().bool()
    assert (batch.completion_mask.bool() & ~trained).any()  # observations between turns: context, not trained
    mismatch = (batch.sampler_logp.double() - _policy_logprobs(policy, batch))[trained]
    assert mismatch.abs().max() < TOLERANCE


def _perturb(policy) -> None:
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)


def _served_models(server: VLLMServer) -> set[str]:
    return {m["id"] for m in server.http.get(f"{server.url}/v1/models").json()["data"]}


def _policy_logprobs(policy, batch: RolloutBatch) -> torch.Tensor:
    with torch.no_grad():
        policy.eval()
        return sequence_logprobs(policy, batch, 0.8)[0].double()


def _server_child(pgid: int) -> int:
    """The watchdog's child: the API server."""
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(stat[1]) == pgid and int(pid) != pgid:  # ppid is the watchdog
                return int(pid)
    raise AssertionError("no server process under the watchdog")


def _wait(cond, within_s: float = 30.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.2)
    return False

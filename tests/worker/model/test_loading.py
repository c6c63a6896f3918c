"""Every model folder the service writes loads as what it is, in transformers and in loaders that
read a tied embedding pair from the input embedding's name only (vLLM)."""

import shutil

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from service.core.specs import LoraSpec, ModelSpec
from tests.numerics import assert_close
from worker.algos.logprobs import Float32Head
from worker.batch import SamplingParams
from worker.engines.hf_engine import HFEngine
from worker.model import loading as models
from worker.model.checkpoints import Trainables, save_checkpoint
from worker.model.forward import forward_inputs, sequence_logprobs

EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


def _keys(path) -> set[str]:
    with safe_open(str(path), "pt") as f:
        return set(f.keys())


def _logits(folder) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([[1, 504, 3287, 28, 2]])).logits


def test_the_bundled_model_stores_its_tied_embeddings_under_the_input_name(models_root):
    folder = models.smollm2_dir(models_root)
    keys = _keys(folder / "model.safetensors")
    assert EMBED in keys and LM_HEAD not in keys
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.embed_tokens.weight.abs().sum() > 0


def test_a_folder_converted_before_is_renamed_in_place(tmp_path, models_root):
    good = models.smollm2_dir(models_root)
    old = tmp_path / "models" / "smollm2-135m-instruct"
    shutil.copytree(good, old)
    tensors = load_file(str(old / "model.safetensors"))
    tensors[LM_HEAD] = tensors.pop(EMBED)  # what safetensors' save_model kept of the tied pair
    save_file(tensors, str(old / "model.safetensors"), metadata={"format": "pt"})
    assert models.smollm2_dir(tmp_path / "models") == old
    keys = _keys(old / "model.safetensors")
    assert EMBED in keys and LM_HEAD not in keys
    assert torch.equal(_logits(old), _logits(good))


def test_a_full_fine_tuning_checkpoint_stores_tied_embeddings_under_the_input_name(tmp_path, models_root):
    model, tok = models.load_policy(ModelSpec(name="smollm2-135m-instruct", dtype="float32", lora=None), models_root=models_root,
                                    device="cpu", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    t = Trainables(model=model, tokenizer=tok, optimizers={"policy": opt},
                   schedulers={"policy": torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)})
    save_checkpoint(tmp_path / "step-1", t, step=1, opt_steps=1)
    keys = _keys(tmp_path / "step-1" / "model.safetensors")
    assert EMBED in keys and LM_HEAD not in keys
    assert torch.equal(_logits(tmp_path / "step-1"), _logits(models.smollm2_dir(models_root)))


def test_paired_arms_start_from_identical_lora_weights(tmp_path):
    """Two jobs with the same seed start from the same adapter whatever the global random stream did
    before (the adapter is created under the job's seed), so paired comparisons pair identical weights."""
    from service.core.specs import LoraSpec

    spec = ModelSpec(name="tiny-random-llama", lora=LoraSpec(r=4))
    first, _ = models.load_policy(spec, models_root=tmp_path, device="cpu", seed=3)
    torch.randn(1000)  # another arm's work moved the global stream
    second, _ = models.load_policy(spec, models_root=tmp_path, device="cpu", seed=3)
    other, _ = models.load_policy(spec, models_root=tmp_path, device="cpu", seed=4)
    a, b, c = ({n: p for n, p in m.named_parameters() if "lora_" in n} for m in (first, second, other))
    assert a.keys() == b.keys() and a
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert any(not torch.equal(a[n], c[n]) for n in a), "the seed should choose the adapter"


def test_a_float32_head_serves_the_sampler_and_the_trainer_alike(models_root):
    """With model.fp32_head, the logits `generate` samples from and the log-probs training takes come from the
    same float32 matmul over the bf16 weights: they agree to float32 rounding, not bf16's."""
    spec = ModelSpec(name="tiny-random-llama", dtype="bfloat16", fp32_head=True, lora=LoraSpec(r=4))
    model, tok = models.load_policy(spec, models_root=models_root, device="cpu", seed=0)
    head = model.get_output_embeddings()
    assert type(head) is Float32Head and head.weight.dtype == torch.bfloat16
    engine = HFEngine(model, tok, "cpu", SamplingParams(max_new_tokens=6))
    assert type(engine.model.get_output_embeddings()) is Float32Head
    batch = engine.generate(["12+3=", "4+5="], 3, seeds=[0, 1])
    with torch.no_grad():
        trainer = sequence_logprobs(model, batch, 1.0)[0]  # the chunked head, cast once
        logits = model(**forward_inputs(batch)).logits  # the module's forward, as generate() calls it
        assert logits.dtype == torch.float32
        t = batch.completion_ids.shape[1]
        sampler = logits[:, -(t + 1):-1].log_softmax(-1).gather(-1, batch.completion_ids[..., None]).squeeze(-1)
    mask = batch.completion_mask.bool()
    assert_close(trainer[mask], sampler[mask], dtype=torch.float32, terms=model.config.hidden_size,
                 scale=float(logits.abs().max()))




def test_float32_activations_run_between_bfloat16_matmuls_in_the_policy_and_the_samplers_copy(models_root):
    """`model.activations: float32` over bfloat16 weights: hidden states are float32 in the policy and in the
    sampler's folded copy (which keeps the layers' hooks), which samples with either cache, gradients reach the adapter in float32, and log-probs
    stay within bfloat16's rounding of float32's. How much closer they are than with bfloat16 activations, and
    what each costs, is bench/precision.py's to measure."""
    from worker.engines.folded import FoldedSampler, foldable

    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 5646, 30, 2, 198, 1, 4093, 198, 1780, 314, 216, 33,
                         31, 28, 216, 34, 36, 47, 2, 198, 1, 520, 9531, 198, 33, 31, 1232, 216, 34, 36, 429, 216,
                         36, 34, 30, 378, 3365, 314, 216, 36, 34, 30]])  # a chat turn's tokens
    logps, states = {}, {}
    for key, dtype, acts in (("reference", "float32", "auto"), ("weights", "bfloat16", "weights"),
                             ("float32", "bfloat16", "float32")):
        model, tok = models.load_policy(ModelSpec(name="smollm2-135m-instruct", dtype=dtype, activations=acts,
                                                  lora=LoraSpec(r=16, alpha=32)), models_root=models_root,
                                        device="cpu", seed=0)
        out = model(input_ids=ids, output_hidden_states=True)
        logp = torch.log_softmax(out.logits[0, :-1].double(), -1).gather(-1, ids[0, 1:, None]).squeeze(-1)  # [T-1]
        logp.sum().backward()
        trained = [p for p in model.parameters() if p.requires_grad]
        assert all(p.dtype == p.grad.dtype == torch.float32 for p in trained)
        assert any(float(p.grad.abs().sum()) > 0 for p in trained)
        logps[key] = logp.detach()
        folded = FoldedSampler(model, foldable(model)).model
        with torch.no_grad():
            copied = folded(input_ids=ids, output_hidden_states=True).hidden_states
        states[key] = {h.dtype for h in (*out.hidden_states, *copied)}
        engine = HFEngine(model, tok, "cpu", SamplingParams(max_new_tokens=3), fold=True)
        for g, greedy in ((1, True), (2, False)):  # generate()'s own cache, and a prompt's shared one
            sampled = engine.generate(["What is 2 + 3?"], g, seeds=None if greedy else [0], greedy=greedy)
            assert sampled.completion_ids.shape[0] == g and int(sampled.completion_mask.sum()) > 0
    assert states == {"reference": {torch.float32}, "weights": {torch.bfloat16}, "float32": {torch.float32}}
    off = (logps["float32"] - logps["reference"]).abs()
    assert 1e-3 < float(off.mean()) < 0.08 and float(off.max()) < 0.5, (float(off.mean()), float(off.max()))

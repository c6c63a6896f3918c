"""A fingerprint's trainable_sha256: equal exactly when two runs start training from the same weights."""

import torch

from service.core.specs import LoraSpec, ModelSpec
from worker.machine.fingerprint import trainable_sha256
from worker.model.loading import load_policy

SPEC = ModelSpec(name="tiny-random-llama", dtype="float32", lora=LoraSpec(r=4, dropout=0.0))


def _policy(tmp_path, seed):
    return load_policy(SPEC, models_root=tmp_path, device="cpu", seed=seed)[0]


def test_equal_for_one_seed_and_only_the_trainable_weights_count(tmp_path):
    a, b = _policy(tmp_path, 0), _policy(tmp_path, 0)
    assert trainable_sha256(a) == trainable_sha256(b)
    assert trainable_sha256(_policy(tmp_path, 1)) != trainable_sha256(a)  # another seed: another LoRA A
    frozen = next(p for n, p in b.named_parameters() if not p.requires_grad)
    with torch.no_grad():
        frozen.add_(1.0)
    assert trainable_sha256(b) == trainable_sha256(a)  # the base is model_sha256's part
    lora_a = next(p for n, p in b.named_parameters() if "lora_A" in n)
    with torch.no_grad():
        lora_a[0, 0] = torch.nextafter(lora_a[0, 0], torch.tensor(1.0))  # one ulp of one weight
    assert trainable_sha256(b) != trainable_sha256(a)

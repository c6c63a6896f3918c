"""What a spec may point at: models from named places only, data from the owner's own folder,
no server paths in answers. Missing and forbidden read the same."""

from __future__ import annotations

import json
import os

import pytest

from tests.conftest import Api

TINY = {"kind": "grpo", "grpo": {"steps": 1, "prompts_per_step": 2, "num_generations": 2, "max_new_tokens": 4,
                                 "eval_prompts": 2}}


def _model(name: str) -> dict:
    return {**TINY, "model": {"name": name}}


def _data(path: str) -> dict:
    return {**TINY, "dataset": {"name": "jsonl", "path": path, "num_val": 2}}


def _refused(api, spec, field, key=None) -> str:
    before = api.get("/v1/jobs", key=key).json()["items"]
    r = api.post("/v1/jobs", json=spec, key=key)
    assert r.status_code == 422, r.text
    [err] = [d for d in r.json()["detail"] if d["field"] == field]
    check = api.post("/v1/specs/validate", key=key, content=json.dumps(spec).encode(),
                     headers={"Content-Type": "application/json"}).json()
    assert not check["valid"] and any(d["field"] == field for d in check["detail"])
    assert api.get("/v1/jobs", key=key).json()["items"] == before  # nothing stored
    return err["message"]


@pytest.fixture
def roots(tmp_path, settings_factory, monkeypatch):
    """An API with a model root, a shared datasets folder and an empty Hugging Face cache."""
    model_root, shared, hf = tmp_path / "models-root", tmp_path / "shared", tmp_path / "hf"
    for d in (model_root / "team" / "tiny", shared, hf):
        d.mkdir(parents=True)
    (model_root / "team" / "tiny" / "config.json").write_text("{}")
    monkeypatch.setenv("HF_HUB_CACHE", str(hf))
    api = Api(settings_factory(GRPO_MODEL_ROOTS=str(model_root), GRPO_SHARED_DATASETS=str(shared)))
    datasets = api.settings.datasets_dir
    for owner in ("alice", "bob"):
        (datasets / owner).mkdir(parents=True)
    rows = "".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(8))
    (datasets / "alice" / "mine.jsonl").write_text(rows)
    (shared / "common.jsonl").write_text(rows)
    return api, model_root, hf


def test_models_come_from_named_places_only(roots, tmp_path):
    api, model_root, hf = roots
    assert api.post("/v1/jobs", json=_model("team/tiny")).status_code == 201  # a folder under a root
    (hf / "models--org--cached" / "snapshots" / "abc").mkdir(parents=True)
    (hf / "models--org--cached" / "snapshots" / "abc" / "config.json").write_text("{}")
    assert api.post("/v1/jobs", json=_model("org/cached")).status_code == 201  # in the local HF cache
    api2 = Api(api.settings)  # a clean list for the refusals below
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "config.json").write_text("{}")
    (model_root / "escape").symlink_to(outside)
    messages = {
        "missing folder": _refused(api2, _model("team/nope"), "model.name", api2.bob),
        "symlink out of the root": _refused(api2, _model("escape"), "model.name", api2.bob),
        "hub id not cached": _refused(api2, _model("org/not-cached"), "model.name", api2.bob),
        "absolute path": _refused(api2, _model(str(outside)), "model.name", api2.bob),
        "home": _refused(api2, _model("~/models/x"), "model.name", api2.bob),
        "dot-dot": _refused(api2, _model("team/../../elsewhere"), "model.name", api2.bob),
        "etc": _refused(api2, _model("/etc/passwd"), "model.name", api2.bob),
    }
    names = {"missing folder": "team/nope", "symlink out of the root": "escape", "hub id not cached": "org/not-cached",
             "absolute path": str(outside), "home": "~/models/x", "dot-dot": "team/../../elsewhere",
             "etc": "/etc/passwd"}
    shapes = {m.replace(repr(names[k]), "NAME") for k, m in messages.items()}
    assert len(shapes) == 1, messages  # nothing tells a missing model from a forbidden one
    assert str(model_root) not in next(iter(shapes))


def test_another_owners_checkpoint_cannot_be_loaded(roots):
    api, _, _ = roots
    jid = api.run_job({**TINY, "model": {"name": "tiny-random-llama", "lora": {"r": 2}}})
    ckpts = api.get(f"/v1/jobs/{jid}/checkpoints").json()
    assert ckpts and all(set(c) == {"id", "step", "format", "size_bytes", "created_at"} for c in ckpts)
    uid = api.get(f"/v1/jobs/{jid}").json()["uid"]
    on_disk = api.settings.artifacts_dir / uid / "checkpoints" / f"step-{ckpts[-1]['step']}"
    assert on_disk.is_dir()
    events = api.get(f"/v1/jobs/{jid}/events").json()
    assert str(api.settings.data_dir) not in json.dumps(events)  # no server path in any event
    for name in (str(on_disk), os.path.relpath(on_disk, api.settings.data_dir), f"artifacts/{uid}"):
        _refused(api, _model(name), "model.name", api.bob)


def test_data_is_per_owner_and_contained(roots, tmp_path):
    api, _, _ = roots
    datasets = api.settings.datasets_dir
    assert api.post("/v1/jobs", json=_data("mine.jsonl")).status_code == 201  # alice's own file
    assert api.post("/v1/jobs", json=_data("shared/common.jsonl"), key=api.bob).status_code == 201
    secret = tmp_path / "secret.jsonl"
    secret.write_text('{"prompt": "p", "answer": "a"}\n' * 4)
    (datasets / "bob" / "alias.jsonl").symlink_to(datasets / "alice" / "mine.jsonl")
    (datasets / "bob" / "out.jsonl").symlink_to(secret)
    bob = Api(api.settings)
    messages = [
        _refused(bob, _data("mine.jsonl"), "dataset.path", bob.bob),  # alice's file, from bob's folder
        _refused(bob, _data("alias.jsonl"), "dataset.path", bob.bob),  # a link into alice's folder
        _refused(bob, _data("out.jsonl"), "dataset.path", bob.bob),  # a link out of the datasets root
        _refused(bob, _data("missing.jsonl"), "dataset.path", bob.bob),
        _refused(bob, _data("shared/../alice/mine.jsonl"), "dataset.path", bob.bob),
    ]
    # a validation file is checked like the training file: bob's own path with alice's file as validation
    (datasets / "bob" / "own.jsonl").write_text('{"prompt": "p", "answer": "a"}\n' * 4)
    spec = {**TINY, "dataset": {"name": "jsonl", "path": "own.jsonl", "val_path": "alias.jsonl"}}
    assert "is not available" in _refused(bob, spec, "dataset.val_path", bob.bob)
    assert all("is not available" in m for m in messages[:4]), messages
    assert len({m.split("'")[0] + m.split("'")[2] for m in messages[:4]}) == 1  # one message, whatever the cause


def test_an_owners_data_job_runs_on_its_own_folder(roots):
    api, _, _ = roots
    jid = api.run_job(_data("mine.jsonl"))
    rows = api.get(f"/v1/jobs/{jid}/samples").json()
    assert rows and all(r["prompt"] for r in rows)


def test_train_on_from_your_own_checkpoint_only(roots, digit_reward):
    from safetensors.torch import load_file

    api, _, _ = roots
    lora = {"name": "tiny-random-llama", "lora": {"r": 2}}
    first = api.run_job({**TINY, "model": lora, "rewards": [{"name": "digit_share"}],
                         "grpo": {**TINY["grpo"], "num_generations": 4, "max_new_tokens": 8, "learning_rate": 0.05}})
    step = api.get(f"/v1/jobs/{first}/checkpoints").json()[-1]["step"]
    init = {"job": first, "step": step}
    bob = Api(api.settings)
    missing = _refused(bob, {**TINY, "model": {**lora, "init_from": {"job": 999, "step": step}}}, "model.init_from", bob.bob)
    foreign = _refused(bob, {**TINY, "model": {**lora, "init_from": init}}, "model.init_from", bob.bob)
    assert missing.replace("999", str(first)) == foreign  # another owner's job reads as missing
    mismatch = _refused(api, {**TINY, "model": {**lora, "lora": {"r": 4}, "init_from": init}}, "model.init_from")
    assert "must be the same" in mismatch
    # alice trains on from her checkpoint: with a negligible learning rate the weights stay hers
    second = api.run_job({**TINY, "model": {**lora, "init_from": init},
                          "grpo": {**TINY["grpo"], "learning_rate": 1e-12}})
    assert "initialised" in [e["type"] for e in api.get(f"/v1/jobs/{second}/events").json()]
    uid = {j: api.get(f"/v1/jobs/{j}").json()["uid"] for j in (first, second)}
    a = load_file(api.settings.artifacts_dir / uid[first] / "checkpoints" / f"step-{step}" / "adapter_model.safetensors")
    b = load_file(api.settings.artifacts_dir / uid[second] / "checkpoints" / "step-1" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all((a[k] - b[k]).abs().max() < 1e-6 for k in a)
    assert any(a[k].abs().max() > 0 for k in a if "lora_B" in k)  # and they are trained weights, not zeros


def test_the_vllm_engine_only_where_the_deployment_has_one(settings_factory, tmp_path):
    spec = {**TINY, "rollout": {"engine": "vllm"}}
    api = Api(settings_factory(GRPO_VLLM_PYTHON=None))
    assert "GRPO_VLLM_PYTHON" in _refused(api, spec, "rollout.engine", api.bob)
    api = Api(settings_factory(GRPO_VLLM_PYTHON=str(tmp_path / "python")))
    assert api.post("/v1/jobs", json=spec).status_code == 201

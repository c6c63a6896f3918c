"""POST /v1/specs/validate (YAML or JSON text, errors with their line) and job lists with `latest=`."""

from service.store import metrics as metrics_q
from service.store.db import session_scope

BAD = """kind: grpo
name: typo
model:
  name: tiny-random-llama
grpo:
  steps: 3
  num_generations: 1
  learning_rat: 0.1
"""


def _validate(api, text, key=None, content_type="application/yaml"):
    return api.post("/v1/specs/validate", key=key, content=text.encode(), headers={"Content-Type": content_type})


def test_errors_name_the_field_and_its_line(api):
    r = _validate(api, BAD)
    assert r.status_code == 200 and r.json()["valid"] is False
    by_field = {d["field"]: d for d in r.json()["detail"]}
    assert by_field["grpo.num_generations"]["line"] == 7
    assert "greater than or equal to 2" in by_field["grpo.num_generations"]["message"]
    assert by_field["grpo.learning_rat"]["line"] == 8
    assert "grpo.num_generations" in r.json()["message"]


def test_valid_yaml_and_json_come_back_with_defaults(api):
    r = _validate(api, "kind: tracin\ngrpo: {steps: 2}\n")
    assert not r.json()["valid"] and r.json()["detail"][0]["field"] == ""  # a rule over the whole spec
    assert "model.lora is required" in r.json()["message"]
    r = _validate(api, "kind: tracin\nmodel: {lora: {r: 4}}\ngrpo: {steps: 2}\n")
    assert r.status_code == 200 and r.json()["valid"], r.text
    body = r.json()
    assert body["detail"] == [] and body["kind"] == "tracin" and body["spec"]["tracin"]["selection"] == "positive"
    assert body["spec"]["grpo"]["steps"] == 2 and body["spec"]["model"]["lora"] is not None
    r = _validate(api, '{"kind": "grpo", "grpo": {"steps": 4}}', content_type="application/json")
    assert r.json()["valid"] and r.json()["spec"]["grpo"]["steps"] == 4
    # what comes back is exactly what POST /v1/jobs accepts
    assert api.post("/v1/jobs", json=r.json()["spec"]).status_code == 201


def test_unparseable_and_non_mapping_text(api):
    r = _validate(api, "kind: grpo\ngrpo: {steps: [\n")
    assert not r.json()["valid"] and r.json()["detail"][0]["line"] >= 2
    assert "not valid YAML" in r.json()["message"]
    r = _validate(api, "- 1\n- 2\n")
    assert not r.json()["valid"] and "mapping" in r.json()["message"]
    r = _validate(api, "kind: nope\n")
    assert not r.json()["valid"] and r.json()["detail"][0]["line"] == 1


def test_validate_needs_a_key(api):
    assert api.client.post("/v1/specs/validate", content=b"kind: grpo").status_code == 401


def test_job_list_carries_latest_points_when_asked(api):
    ids = [api.post("/v1/jobs", json={"kind": "grpo"}).json()["id"] for _ in range(2)]
    with session_scope(api.settings.store_url) as s:
        for step in (1, 2, 3):
            metrics_q.upsert_step(s, job_id=ids[0], step=step, values={"reward/mean": step / 10, "kl": 0.5})
    items = api.get("/v1/jobs", params={"latest": "reward/mean,eval/accuracy"}).json()["items"]
    latest = {j["id"]: j["latest"] for j in items}
    assert latest[ids[0]] == {"reward/mean": {"step": 3, "value": 0.3}}
    assert latest[ids[1]] == {}
    assert all(j["latest"] is None for j in api.get("/v1/jobs").json()["items"])


IGNORED = [  # (spec, the section the error is on, the setting it names)
    ({"kind": "grpo", "grpo": {"max_refill_rounds": 5}}, "grpo", "grpo.max_refill_rounds"),
    ({"kind": "tracin", "model": {"lora": {"r": 4}}, "tracin": {"fraction": 0.3}}, "tracin", "tracin.fraction"),
    ({"kind": "joint", "dataset": {"name": "persona-facts"},
      "retriever": {"generator_only": True, "learning_rate": 0.1}}, "retriever", "retriever.learning_rate"),
    ({"kind": "grpo", "sparsity": {"quality": {"probe_size": 8}}}, "sparsity.quality", "sparsity.quality.probe_size"),
    ({"kind": "grpo", "dataset": {"corpus_size": 10}}, "dataset", "dataset.corpus_size"),
    ({"kind": "joint", "dataset": {"name": "persona-facts", "difficulty": 2}}, "dataset", "dataset.difficulty"),
]


def test_settings_a_job_would_ignore_are_refused_by_name(api):
    import json

    for spec, field, name in IGNORED:
        r = api.post("/v1/jobs", json=spec)
        assert r.status_code == 422, (spec, r.text)
        detail = r.json()["detail"]
        assert any(d["field"] == field and name in d["message"] and "no effect" in d["message"] for d in detail), detail
        v = _validate(api, json.dumps(spec), content_type="application/json").json()
        assert not v["valid"] and name in v["message"]
    assert api.get("/v1/jobs").json()["items"] == []  # nothing stored
    # the same settings where they take effect are accepted
    ok = {"kind": "grpo", "grpo": {"drop_zero_std_groups": True, "max_refill_rounds": 5}}
    assert _validate(api, json.dumps(ok), content_type="application/json").json()["valid"]

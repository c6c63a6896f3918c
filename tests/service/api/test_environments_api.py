"""A spec's environment at submit time: bundled ones by name, servers only on the admin's allow-list,
and every combination that cannot work a 422 naming the field. Nothing is stored for a refused spec."""

import pytest

from service.core.specs import BUNDLED_ENVIRONMENTS
from tests.conftest import Api

ALLOWED = "http://127.0.0.1:8811/envs/"


@pytest.fixture
def env_api(settings_factory):
    return Api(settings_factory(GRPO_ENVIRONMENT_URLS=ALLOWED))


@pytest.fixture
def pg_env_api(settings_factory, pg_url):
    return Api(settings_factory(database_url=pg_url, GRPO_ENVIRONMENT_URLS=ALLOWED))


def _job(environment, **more):
    return {"kind": "grpo", "model": {"name": "tiny-random-llama"}, "environment": environment, **more}


@pytest.mark.filterwarnings("error::UserWarning")  # the stored spec reads back as this version's (no fallback)
def test_a_bundled_environment_and_a_listed_server_are_accepted(env_api):
    r = env_api.post("/v1/jobs", json=_job({"name": "calculator", "max_turns": 3}))
    assert r.status_code == 201, r.text
    assert r.json()["spec"]["environment"]["name"] == "calculator"
    r = env_api.post("/v1/jobs", json=_job({"url": "http://127.0.0.1:8811/envs/./wordle"}))
    assert r.status_code == 201, r.text
    assert r.json()["spec"]["environment"]["url"] == "http://127.0.0.1:8811/envs/wordle"  # what the worker opens


@pytest.mark.parametrize(("spec", "field", "words"), [
    (_job({"url": "http://127.0.0.1:8811/other"}), "environment.url", "not on the admin's allow-list"),
    (_job({"url": "http://127.0.0.1:8811/envs/../x"}), "environment.url", "not on the admin's allow-list"),
    (_job({"url": "ftp://127.0.0.1/envs/"}), "environment.url", "http:// or https://"),
    (_job({"name": "chess"}), "environment.name", "calculator"),
    (_job({}), "environment", "give exactly one of `name`"),
    (_job({"name": "calculator", "url": "http://127.0.0.1:8811/envs/"}), "environment", "exactly one"),
    (_job({"name": "calculator", "max_turns": 0}), "environment.max_turns", "greater than or equal to 1"),
    (_job({"name": "calculator", "sessions": 3}), "environment.sessions", "Extra inputs"),
    (_job({"name": "calculator"}, rewards=[{"name": "exact_match"}]), "", "rewards would have no effect"),
    (_job({"name": "calculator"}, dataset={"name": "arith", "difficulty": 2}), "", "dataset would have no effect"),
    (_job({"name": "calculator"}, resources={"processes": 2}), "", "runs as one process"),
    ({**_job({"name": "calculator"}), "kind": "joint", "dataset": {"name": "persona-facts"}}, "",
     "supported for kinds 'grpo', 'tracin' and 'sft', not 'joint'"),
])
def test_what_cannot_work_is_a_422_naming_the_field(env_api, spec, field, words):
    r = env_api.post("/v1/jobs", json=spec)
    assert r.status_code == 422, r.text
    assert any(d["field"] == field and words in d["message"] for d in r.json()["detail"]), r.json()
    assert env_api.get("/v1/jobs").json()["items"] == []


def test_the_bundled_names_are_the_workers():
    from worker.environments.bundled import ENVIRONMENTS

    assert set(ENVIRONMENTS) == set(BUNDLED_ENVIRONMENTS)


def test_on_postgresql_too(pg_env_api):
    assert pg_env_api.post("/v1/jobs", json=_job({"url": "http://127.0.0.1:8811/envs/x"})).status_code == 201
    r = pg_env_api.post("/v1/jobs", json=_job({"url": "http://127.0.0.1:8812/envs/x"}))
    assert r.status_code == 422 and r.json()["detail"][0]["field"] == "environment.url"
    assert len(pg_env_api.get("/v1/jobs").json()["items"]) == 1

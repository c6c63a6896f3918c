"""GET /v1/rewards and the submit-time checks of reward entries."""

import pytest

from tests.conftest import Api


@pytest.fixture
def reward_api(settings_factory):
    return Api(settings_factory(GRPO_REWARD_URLS="https://graders.example/team-a/,http://127.0.0.1:9/"))


def test_lists_what_a_spec_may_name_here(reward_api, sqlite_api):
    body = reward_api.get("/v1/rewards").json()
    by_name = {r["name"]: r for r in body["items"]}
    assert {"numeric_match", "token_f1", "reward_model", "judge", "similarity", "http"} <= by_name.keys()
    assert by_name["numeric_match"]["kind"] == "function" and by_name["numeric_match"]["description"]
    judge = {p["name"]: p for p in by_name["judge"]["parameters"]}
    assert judge["model"]["default"] == "smollm2-135m-instruct" and not judge["model"]["required"]
    assert judge["mode"]["schema"]["enum"] == ["yes_probability", "number"]
    assert {p["name"]: p for p in by_name["http"]["parameters"]}["url"]["required"]
    assert body["http_url_prefixes"] == ["https://graders.example/team-a/", "http://127.0.0.1:9/"]
    # with no allowed grader URLs, http is not offered
    names = {r["name"] for r in sqlite_api.get("/v1/rewards").json()["items"]}
    assert "http" not in names and "judge" in names
    assert sqlite_api.client.get("/v1/rewards").status_code == 401


BAD = [  # (rewards, the field named, words of the message)
    ([{"name": "numeric_matchh"}], "rewards.0.name", "unknown reward"),
    ([{"name": "http", "url": "https://graders.example/team-b/score"}], "rewards.0.url", "allow-list"),
    ([{"name": "http", "url": "ftp://graders.example/team-a/x"}], "rewards.0.url", "http:// or https://"),
    ([{"name": "reward_model", "model": "team/no-such-rm"}], "rewards.0.model", "not available"),
    ([{"name": "judge", "model": "/etc/passwd"}], "rewards.0.model", "not available"),
    ([{"name": "judge", "rubric": "Is it right? {response}"}], "rewards.0.rubric", "unknown placeholder"),
    ([{"name": "similarity", "threshold": 0.5}], "rewards.0.threshold", "Extra inputs"),
    ([{"name": "exact_match"}, {"name": "judge"}, {"name": "judge"}], "", "different `tag`"),
]


@pytest.mark.parametrize("rewards,field,words", BAD)
def test_bad_entries_are_a_422_naming_the_field(reward_api, rewards, field, words):
    r = reward_api.post("/v1/jobs", json={"kind": "grpo", "rewards": rewards})
    assert r.status_code == 422, r.text
    assert any(d["field"] == field and words in d["message"] for d in r.json()["detail"]), r.json()["detail"]
    assert reward_api.get("/v1/jobs").json()["items"] == []


def test_good_entries_are_accepted(reward_api):
    rewards = [{"name": "numeric_match"}, {"name": "http", "url": "https://graders.example/team-a/score", "weight": 0.5},
               {"name": "judge", "tag": "judge_yes", "weight": 0.2}, {"name": "similarity", "weight": 0.1}]
    r = reward_api.post("/v1/jobs", json={"kind": "grpo", "rewards": rewards})
    assert r.status_code == 201, r.text
    assert [e["name"] for e in r.json()["spec"]["rewards"]] == ["numeric_match", "http", "judge", "similarity"]


@pytest.fixture(params=["sqlite", "postgres"])
def issue_api(request, settings_factory):
    """The allow-list an operator set in issue 25: one grader below /ok/, and a whole port."""
    url = request.getfixturevalue("pg_url") if request.param == "postgres" else None
    return Api(settings_factory(database_url=url, GRPO_REWARD_URLS="http://127.0.0.1:8791/ok/,http://127.0.0.1:8793"))


@pytest.mark.parametrize("url,words", [
    ("http://127.0.0.1:8791/ok/../other/score", "not on the admin's allow-list"),
    ("http://127.0.0.1:8791/ok/%2e%2e/other/score", "not on the admin's allow-list"),
    ("http://127.0.0.1:8793@127.0.0.2:8792/score", "userinfo"),
    ("http://127.0.0.1:8791/okay/score", "not on the admin's allow-list"),
    ("http://127.0.0.1:8791/ok/score#x", "fragment"),
    ("http://127.0.0.1:8791\\ok/score", "backslash"),
])
def test_grader_urls_off_the_list_are_refused_at_submit(issue_api, url, words):
    r = issue_api.post("/v1/jobs", json={"kind": "grpo", "rewards": [{"name": "http", "url": url}]})
    assert r.status_code == 422, r.text
    assert any(d["field"] == "rewards.0.url" and words in d["message"] for d in r.json()["detail"]), r.json()
    assert issue_api.get("/v1/jobs").json()["items"] == []


def test_grader_urls_under_the_list_are_accepted_as_written(issue_api):
    urls = ["http://127.0.0.1:8791/ok/./grade", "HTTP://127.0.0.1:8793/x"]
    r = issue_api.post("/v1/jobs", json={"kind": "grpo", "rewards": [
        {"name": "http", "url": urls[0]}, {"name": "http", "url": urls[1], "tag": "second"}]})
    assert r.status_code == 201, r.text
    assert [e["url"] for e in r.json()["spec"]["rewards"]] == urls  # the worker calls their canonical forms

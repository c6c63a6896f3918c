"""Conditional and incremental reads: a job's validator changes when a step, a point or an event lands and not
otherwise; a 304 has no body; `after_step` returns exactly the newer points, across a resume too (SQLite and
PostgreSQL)."""

from service.store import events as events_q
from service.store import metrics as metrics_q
from service.store.db import session_scope

JOB = {"kind": "grpo", "model": {"name": "tiny-random-llama"}, "grpo": {"steps": 5}}
ROUTES = ["", "/metrics", "/metrics/latest", "/events", "/samples", "/checkpoints"]


def _write(api, job_id: int, *steps: int, value: float = 1.0) -> None:
    with session_scope(api.settings.store_url) as s:
        for step in steps:
            metrics_q.upsert_step(s, job_id=job_id, step=step, values={"reward/mean": value * step, "kl": 0.1})


def _tags(api, job_id: int) -> dict[str, str]:
    out = {}
    for route in ROUTES:
        r = api.get(f"/v1/jobs/{job_id}{route}")
        assert r.status_code == 200 and r.headers["cache-control"] == "private, no-cache", (route, r.text)
        out[route] = r.headers["etag"]
    return out


def test_a_poll_of_an_unchanged_job_is_a_304_without_a_body_until_a_point_or_an_event_lands(api):
    job_id = api.post("/v1/jobs", json=JOB).json()["id"]
    _write(api, job_id, 1)
    first = _tags(api, job_id)
    assert _tags(api, job_id) == first  # nothing landed: the same validators
    for route, tag in first.items():
        r = api.get(f"/v1/jobs/{job_id}{route}", headers={"If-None-Match": tag})
        assert (r.status_code, r.content, r.headers["etag"]) == (304, b"", tag), route
        weak = api.get(f"/v1/jobs/{job_id}{route}", headers={"If-None-Match": f'"other", W/{tag}'})
        assert weak.status_code == 304, route
    assert api.get(f"/v1/jobs/{job_id}/metrics", headers={"If-None-Match": first["/metrics"]},
                   key=api.bob).status_code == 404  # another owner's job: missing, whatever the validator
    _write(api, job_id, 2)  # a step lands
    after_step = _tags(api, job_id)
    assert all(after_step[r] != first[r] for r in ROUTES)
    r = api.get(f"/v1/jobs/{job_id}/metrics", headers={"If-None-Match": first["/metrics"]})
    assert r.status_code == 200 and [p["step"] for p in r.json()["series"][0]["points"]] == [1, 2]
    _write(api, job_id, 2, value=3.0)  # a point rewritten: only a resume does so, and says so first (below)
    assert _tags(api, job_id) == after_step
    with session_scope(api.settings.store_url) as s:
        events_q.add_event(s, job_id=job_id, type="resumed", message="resumed from checkpoint at step 1")
    assert all(tag != after_step[r] for r, tag in _tags(api, job_id).items())


def test_the_job_list_is_conditional_on_its_page(api):
    first = api.get("/v1/jobs")
    assert api.get("/v1/jobs", headers={"If-None-Match": first.headers["etag"]}).status_code == 304
    job_id = api.post("/v1/jobs", json=JOB).json()["id"]
    listed = api.get("/v1/jobs", headers={"If-None-Match": first.headers["etag"]})
    assert listed.status_code == 200 and [j["id"] for j in listed.json()["items"]] == [job_id]
    assert api.get("/v1/jobs", params={"latest": "kl"},  # another page: its own validator
                   headers={"If-None-Match": listed.headers["etag"]}).status_code == 200
    api.post(f"/v1/jobs/{job_id}/cancel")
    assert api.get("/v1/jobs", headers={"If-None-Match": listed.headers["etag"]}).status_code == 200


def test_after_step_returns_exactly_the_newer_points_across_a_resume(api):
    job_id = api.post("/v1/jobs", json=JOB).json()["id"]
    _write(api, job_id, 1, 2, 3, 4)

    def points(after: int) -> dict[str, list[tuple[int, float]]]:
        body = api.get(f"/v1/jobs/{job_id}/metrics", params={"after_step": after}).json()
        return {s["key"]: [(p["step"], p["value"]) for p in s["points"]] for s in body["series"]}

    assert points(2) == {"kl": [(3, 0.1), (4, 0.1)], "reward/mean": [(3, 3.0), (4, 4.0)]}
    assert points(4) == {"kl": [], "reward/mean": []}
    assert points(-1) == points(0)  # every step, the evaluation's 0 included
    # resumed from step 2's checkpoint: steps 3 and 4 are done again (other values), then step 5
    _write(api, job_id, 3, 4, 5, value=2.0)
    assert points(4) == {"kl": [(5, 0.1)], "reward/mean": [(5, 10.0)]}
    assert points(2)["reward/mean"] == [(3, 6.0), (4, 8.0), (5, 10.0)]
    r = api.get(f"/v1/jobs/{job_id}/metrics", params={"after_step": "x"})
    assert r.status_code == 422 and r.json()["detail"][0]["field"] == "query.after_step"


def test_watch_polls_conditionally(api):
    """`grpo-jobs watch`'s reads: the second poll of an unchanged job is two 304s, and a new step is seen."""
    from service.cli.client import ConditionalGet

    job_id = api.post("/v1/jobs", json=JOB).json()["id"]
    _write(api, job_id, 1)
    api.client.headers.update(api.auth())
    get = ConditionalGet(api.client)
    paths = [f"/v1/jobs/{job_id}", f"/v1/jobs/{job_id}/metrics/latest"]
    first = [get(p) for p in paths]
    assert [get(p) for p in paths] == first and get.unchanged == 2
    _write(api, job_id, 2)
    assert get(paths[1])["reward/mean"]["step"] == 2 and get.unchanged == 2

"""The metrics body: written by orjson from the store's series, byte for byte what the MetricsOut model wrote
before it (and would write now), whatever the floats; and so through the route, bucketed or not."""

import random

from service.api.schemas import MetricsOut
from service.api.series import metrics_body
from service.store import metrics as metrics_q
from service.store.db import session_scope
from service.store.metrics import JobSeries, SeriesData

JOB = {"kind": "grpo", "model": {"name": "tiny-random-llama"}, "grpo": {"steps": 5}}
# Floats whose text differs between JSON writers when one gets them wrong: signed zero, subnormals, the
# exponent's switch-over points, integers past 2^53, non-finite values (null in both), thirds.
EDGES = [0.0, -0.0, 1.0, -2.5, 0.1, 1 / 3, 1e-4, 1e-5, 1e-7, 1.5e-300, 5e-324, 1e15 + 0.3, 1e16, 1e21, 1e22,
         float(2**53), 12345678901234567890.0, float("nan"), float("inf"), -float("inf")]


def _model_bytes(job_id: int, found: JobSeries) -> bytes:
    return MetricsOut.model_validate({"job_id": job_id, "keys": found.keys, "series": found.series},
                                     from_attributes=True).model_dump_json().encode()


def test_the_body_is_the_models_bytes_for_every_kind_of_float():
    rng = random.Random(0)
    values = EDGES + [rng.uniform(-1e6, 1e6) for _ in range(3000)] + \
        [rng.random() * 10.0 ** rng.randint(-30, 30) for _ in range(3000)]
    points = [{"step": i, "value": v, "min": min(v, 0.0), "max": max(v, 1.0)} for i, v in enumerate(values)]
    found = JobSeries(keys=["kl", 'odd "key"/ü\u2028'], series=[
        SeriesData(key="kl", points=points, downsampled=True, total_points=2 * len(points), bucket_steps=2),
        SeriesData(key='odd "key"/ü\u2028')])
    assert metrics_body(7, found) == _model_bytes(7, found)


def test_the_route_serves_the_models_bytes_bucketed_or_not(api):
    job_id = api.post("/v1/jobs", json=JOB).json()["id"]
    rng = random.Random(1)
    with session_scope(api.settings.store_url) as s:
        metrics_q.upsert_points(s, rows=[(job_id, key, step, rng.choice(EDGES[:17]) * rng.random())
                                         for step in range(1, 301) for key in ("reward/mean", "kl", "loss/total")])
    for params in ({}, {"max_points": 7}, {"keys": "kl,missing", "after_step": 250}):
        body = api.get(f"/v1/jobs/{job_id}/metrics", params=params).content
        with session_scope(api.settings.store_url) as s:
            keys = params["keys"].split(",") if "keys" in params else None
            lo = params["after_step"] + 1 if "after_step" in params else None
            found = metrics_q.job_series(s, job_id=job_id, keys=keys, from_step=lo,
                                         max_points=params.get("max_points", 1000))
        assert body == _model_bytes(job_id, found), params

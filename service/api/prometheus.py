"""Prometheus metrics of the API process: requests, latency, and jobs by status (served at /metrics)."""

from __future__ import annotations

import time

from fastapi import FastAPI, Request
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from service.core.settings import Settings
from service.core.specs import STATUSES
from service.store import jobs as jobs_q
from service.store.db import session_scope


class _JobCollector:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def collect(self):
        up = GaugeMetricFamily("grpo_store_up", "1 if the job store answered this scrape, else 0")
        try:
            with session_scope(self.settings.store_url) as s:
                counts = jobs_q.count_by_status(s)
        except Exception:  # no job counts at all rather than zeros that look like an empty store
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        g = GaugeMetricFamily("grpo_jobs", "Jobs in the store by status", labels=["status"])
        for st in STATUSES:
            g.add_metric([st], counts.get(st, 0))
        yield g


def install(app: FastAPI, settings: Settings, *, before) -> None:
    """A registry on `app.state.registry`, and a middleware that counts and times every request
    around `before(request, call_next)` (which may answer itself)."""
    registry = CollectorRegistry()
    registry.register(_JobCollector(settings))
    requests = Counter("grpo_http_requests", "HTTP requests", ["method", "route", "status"], registry=registry)
    latency = Histogram("grpo_http_request_seconds", "HTTP request latency", ["route"], registry=registry)
    app.state.registry = registry

    @app.middleware("http")
    async def _count(request: Request, call_next):
        t0 = time.perf_counter()
        response = await before(request, call_next)
        route = getattr(request.scope.get("route"), "path", "unmatched")
        requests.labels(request.method, route, str(response.status_code)).inc()
        latency.labels(route).observe(time.perf_counter() - t0)
        return response

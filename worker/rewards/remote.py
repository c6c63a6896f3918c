"""A remote grader the user runs: POST {job_id, step, items: [{prompt, completion, answer, answers}]}
and read back {scores: [float | null, ...]} of the same length.

Requests carry `batch_size` items each, `concurrency` at a time; a request that cannot connect, times
out or gets a 5xx answer is retried with exponential backoff, `max_retries` times. A request that
still fails, or whose answer is not the promised shape, leaves its items unscored (excluded, with a
warning event). After `max_failed_steps` steps in a row with such a failure the job fails: a grader
that stays down must not let a job train on nothing for hours. The URL was checked against the
admin's allow-list at submit time; the auth header's secret comes from the worker's environment.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import httpx

from service.reward_specs import HttpReward, url_allowed
from worker.rewards.scoring import Item, RewardFailure, RewardUnavailable, Scores


class GraderError(Exception):
    """This request's items could not be scored."""


def parse_scores(body: object, n: int) -> list[float | None]:
    """The `scores` of a grader's answer, checked: n numbers or nulls."""
    scores = body.get("scores") if isinstance(body, dict) else None
    if not isinstance(scores, list):
        raise GraderError('answered without a "scores" list')
    if len(scores) != n:
        raise GraderError(f"answered {len(scores)} scores for {n} items")
    out: list[float | None] = []
    for v in scores:
        if v is None:
            out.append(None)
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out.append(float(v))
        else:
            raise GraderError(f"answered a score that is not a finite number or null: {v!r:.40}")
    return out


class HttpGrader:
    counts = True

    def __init__(self, spec: HttpReward, *, settings, job_id: int | None) -> None:
        if not url_allowed(spec.url, settings.reward_urls):  # the allow-list may have changed since submit
            raise RewardUnavailable(f"reward {spec.key}: {spec.url} is not on the allow-list (GRPO_REWARD_URLS)")
        self.key, self.weight, self.spec, self.job_id = spec.key, spec.weight, spec, job_id
        headers = {}
        if settings.reward_auth_env and (secret := os.environ.get(settings.reward_auth_env)):
            headers[settings.reward_auth_header] = secret
        self.client = httpx.Client(timeout=spec.timeout_s, headers=headers, follow_redirects=False)
        self.failed_steps: list[int] = []  # the steps in a row, up to now, with a failed request

    def _post(self, payload: dict, n: int) -> list[float | None]:
        delay = 0.5
        for attempt in range(self.spec.max_retries + 1):
            try:
                r = self.client.post(self.spec.url, json=payload)
            except httpx.HTTPError as exc:
                error = f"{type(exc).__name__} calling the grader"
            else:
                if r.status_code < 400:
                    try:
                        return parse_scores(r.json(), n)
                    except ValueError:
                        raise GraderError("answered with a body that is not JSON") from None
                error = f"the grader answered HTTP {r.status_code}"
                if r.status_code < 500:
                    raise GraderError(error)  # the request itself is wrong: retrying will not help
            if attempt < self.spec.max_retries:
                time.sleep(delay)
                delay *= 2
        raise GraderError(f"{error} ({self.spec.max_retries + 1} attempts)")

    def score(self, items: Sequence[Item], step: int) -> Scores:
        size = self.spec.batch_size
        chunks = [range(i, min(i + size, len(items))) for i in range(0, len(items), size)]

        def call(rows: range) -> list[float | None]:
            payload = {"job_id": self.job_id, "step": step, "items": [
                {"prompt": items[i].prompt, "completion": items[i].completion, "answer": items[i].answer,
                 "answers": list(items[i].answers)} for i in rows]}
            return self._post(payload, len(rows))

        out = Scores([None] * len(items))
        with ThreadPoolExecutor(max_workers=min(self.spec.concurrency, len(chunks) or 1)) as pool:
            futures = [(rows, pool.submit(call, rows)) for rows in chunks]
            for rows, fut in futures:
                try:
                    out.values[rows.start:rows.stop] = fut.result()
                except GraderError as exc:
                    out.failures.append(RewardFailure(-1, self.key, f"items {rows.start}-{rows.stop - 1}: {exc}"))
        self._count(step, failed=bool(out.failures))
        return out

    def _count(self, step: int, *, failed: bool) -> None:
        if not failed:
            self.failed_steps.clear()
            return
        if step not in self.failed_steps:
            self.failed_steps.append(step)
        if len(self.failed_steps) >= self.spec.max_failed_steps:
            raise RewardUnavailable(f"reward {self.key}: the grader at {self.spec.url} could not score on "
                                    f"{len(self.failed_steps)} steps in a row (max_failed_steps)")

"""A remote grader the user runs: POST {job_id, step, items: [{prompt, completion, answer, answers}]}
and read back {scores: [float | null, ...]} of the same length.

Requests carry `batch_size` items each, `concurrency` at a time; a request that cannot connect, times
out or gets a 5xx answer is retried with exponential backoff, `max_retries` times. A request that
still fails, or whose answer is not the promised shape, leaves its items unscored (excluded, with a
warning event). After `max_failed_steps` steps in a row with such a failure the job fails: a grader
that stays down must not let a job train on nothing for hours. A null, NaN or infinite score leaves
just that item unscored.

The URL was checked against the admin's allow-list at submit time and is checked again here
(service/core/grader_urls.py), and the canonical form is what is called. Every request resolves the host
once, refuses a link-local or metadata address, and connects to that very address (no second lookup
that could answer otherwise). Redirects are never followed, and an answer is read up to
`GRPO_REWARD_MAX_RESPONSE_BYTES`. The auth header's secret comes from the worker's environment and
goes only to a URL that passed all of this.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

from service.core.grader_urls import GraderUrl, UrlRefused, check_url, resolve_address
from service.core.reward_specs import HttpReward
from worker.rewards.scoring import Item, RewardFailure, RewardUnavailable, Scores


class GraderError(Exception):
    """This request's items could not be scored."""


@dataclass(frozen=True)
class Answer:
    """A grader's answer to one request, checked."""

    scores: list[float | None]  # one per item; None: it could not be scored
    non_finite: list[int]  # positions of numbers that were not finite (NaN, Infinity, 1e400): excluded, reported


def parse_scores(body: object, n: int) -> Answer:
    """The `scores` of a grader's answer, checked: n numbers or nulls. A score that is not finite
    reads as null: that item cannot be scored."""
    scores = body.get("scores") if isinstance(body, dict) else None
    if not isinstance(scores, list):
        raise GraderError('answered without a "scores" list')
    if len(scores) != n:
        raise GraderError(f"answered {len(scores)} scores for {n} items")
    out = Answer(scores=[], non_finite=[])
    for i, v in enumerate(scores):
        if v is None:
            out.scores.append(None)
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out.scores.append(f := _finite(v))
            if f is None:
                out.non_finite.append(i)
        else:
            raise GraderError(f"answered a score that is not a number or null: {v!r:.40}")
    return out


def _finite(v: int | float) -> float | None:
    try:
        f = float(v)
    except OverflowError:  # an integer past float's range
        return None
    return f if math.isfinite(f) else None


def resolve(url: GraderUrl) -> str:
    """The one address this request connects to (service.core.grader_urls.resolve_address)."""
    try:
        return resolve_address(url)
    except UrlRefused as exc:
        raise GraderError(f"url {exc}") from None
    except OSError as exc:  # as httpx reports a failed lookup: retried like any failed connection
        raise httpx.ConnectError(f"cannot resolve {url.host} ({exc})") from None


class HttpGrader:
    counts = True

    def __init__(self, spec: HttpReward, *, settings, job_id: int | None) -> None:
        try:  # the allow-list may have changed since submit
            self.url = check_url(spec.url, settings.reward_urls)
        except UrlRefused as exc:
            raise RewardUnavailable(f"reward {spec.key}: url {exc}") from None
        self.key, self.weight, self.spec, self.job_id = spec.key, spec.weight, spec, job_id
        self.max_bytes = settings.reward_max_response_bytes
        # identity: a compressed answer could expand far past max_bytes before it is counted
        headers = {"Host": self.url.netloc, "Accept-Encoding": "identity"}
        if settings.reward_auth_env and (secret := os.environ.get(settings.reward_auth_env)):
            headers[settings.reward_auth_header] = secret
        self.client = httpx.Client(timeout=spec.timeout_s, headers=headers, follow_redirects=False, trust_env=False)
        self.failed_steps: list[int] = []  # the steps in a row, up to now, with a failed request

    def _read(self, r: httpx.Response) -> bytes:
        """The answer's bytes as sent, counted as they arrive. An encoded answer is refused, not decoded: it
        was asked for as identity, and a few KB of zstd or gzip can expand to GBs before a cap is checked."""
        encoding = r.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            raise GraderError(f"answered with Content-Encoding {encoding!r}: graders are asked for identity "
                              "(an encoded answer is not decoded)")
        declared = r.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            raise GraderError(f"answered {int(declared)} bytes, over {self.max_bytes} (GRPO_REWARD_MAX_RESPONSE_BYTES)")
        body = bytearray()
        for chunk in r.iter_raw():  # raw: httpx would decode a Content-Encoding despite Accept-Encoding
            body += chunk
            if len(body) > self.max_bytes:
                raise GraderError(f"answered more than {self.max_bytes} bytes (GRPO_REWARD_MAX_RESPONSE_BYTES)")
        return bytes(body)

    def _request(self, payload: dict) -> tuple[int, bytes]:
        """(status, body) from the one checked address; a redirect is an error, never followed."""
        target = httpx.URL(str(self.url)).copy_with(host=resolve(self.url))
        extensions = {"sni_hostname": self.url.host} if self.url.scheme == "https" else {}
        with self.client.stream("POST", target, json=payload, extensions=extensions) as r:
            if r.is_redirect:
                raise GraderError(f"answered HTTP {r.status_code} (a redirect): graders are called at their own "
                                  "URL only, never redirected")
            return r.status_code, self._read(r) if r.status_code < 400 else b""

    def _post(self, payload: dict, n: int) -> Answer:
        delay = 0.5
        for attempt in range(self.spec.max_retries + 1):
            try:
                status, raw = self._request(payload)
            except httpx.HTTPError as exc:
                error = f"{type(exc).__name__} calling the grader"
            else:
                if status < 400:
                    try:
                        body = json.loads(raw)
                    except (ValueError, RecursionError):
                        raise GraderError("answered with a body that is not JSON") from None
                    return parse_scores(body, n)
                error = f"the grader answered HTTP {status}"
                if status < 500:
                    raise GraderError(error)  # the request itself is wrong: retrying will not help
            if attempt < self.spec.max_retries:
                time.sleep(delay)
                delay *= 2
        raise GraderError(f"{error} ({self.spec.max_retries + 1} attempts)")

    def score(self, items: Sequence[Item], step: int) -> Scores:
        size = self.spec.batch_size
        chunks = [range(i, min(i + size, len(items))) for i in range(0, len(items), size)]

        def call(rows: range) -> Answer:
            payload = {"job_id": self.job_id, "step": step, "items": [
                {"prompt": items[i].prompt, "completion": items[i].completion, "answer": items[i].answer,
                 "answers": list(items[i].answers)} for i in rows]}
            return self._post(payload, len(rows))

        out = Scores([None] * len(items))
        failed = False
        with ThreadPoolExecutor(max_workers=min(self.spec.concurrency, len(chunks) or 1)) as pool:
            futures = [(rows, pool.submit(call, rows)) for rows in chunks]
            for rows, fut in futures:
                try:
                    answer = fut.result()
                except GraderError as exc:
                    failed = True
                    out.failures.append(RewardFailure(-1, self.key, f"items {rows.start}-{rows.stop - 1}: {exc}"))
                else:  # the grader answered: a bad number excludes its item, not the step
                    out.values[rows.start:rows.stop] = answer.scores
                    out.failures += [RewardFailure(rows.start + i, self.key, "the grader's score is not a finite "
                                                   "number (NaN or infinite): excluded") for i in answer.non_finite]
        self._count(step, failed=failed)
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

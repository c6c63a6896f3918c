"""OpenTelemetry spans: the API's requests, and a job's attempt with each step's phases.

Off unless an OTLP endpoint is configured with the standard variables (`OTEL_EXPORTER_OTLP_ENDPOINT`
or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, with `OTEL_EXPORTER_OTLP_HEADERS` and the rest as the
OpenTelemetry SDK reads them); then every process exports over OTLP/HTTP. Until a process calls
`setup`, every span here is OpenTelemetry's no-op.

Span names follow the open `rl.*` proposal (open-telemetry/semantic-conventions-genai#88) where it
has them: `rl.loop` (one step), `rl.sync`, `rl.sample`, `rl.reward`, `rl.train`; the rest are
`grpo_jobs.*`: `grpo_jobs.attempt` (a job's attempt, the root of its steps),
`grpo_jobs.old_logprobs`, `grpo_jobs.ref_logprobs`, `grpo_jobs.evaluate`, `grpo_jobs.checkpoint`.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import Token
from typing import Any, ParamSpec, TypeVar

from opentelemetry import context, trace
from opentelemetry.context import Context

TRACER = trace.get_tracer("grpo_jobs")
ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
TIMEOUT_VARS = ("OTEL_EXPORTER_OTLP_TIMEOUT", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT")
EXPORT_TIMEOUT_S = 2.0  # one export's bound, retries included, where no OTEL_*_TIMEOUT is set
FLUSH_S = 1.0  # how long a job's end waits for its spans to be exported
_provider = None  # this process's, once set up
_step: tuple[trace.Span, Token[Context]] | None = None  # the step span in progress and its context token


def configured() -> bool:
    return any(os.environ.get(v) for v in ENDPOINT_VARS)


P = ParamSpec("P")
R = TypeVar("R")


def setup(service: str, *, exporter: Any = None) -> bool:
    """Install this process's tracer provider, exporting over OTLP/HTTP where an endpoint is
    configured (or to `exporter`, for tests). Returns whether spans are recorded. Idempotent."""
    global _provider
    if _provider is not None:
        return True
    if exporter is None and not configured():
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    attrs = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": service}
    # no flush at exit beyond ours (`flush`): an exit never waits on a collector
    provider = TracerProvider(resource=Resource.create(attrs), shutdown_on_exit=False)
    if exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        # a collector that does not answer must cost a job no visible time: each export gives up after
        # EXPORT_TIMEOUT_S unless the standard variables say otherwise
        timeout = None if any(os.environ.get(v) for v in TIMEOUT_VARS) else EXPORT_TIMEOUT_S
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(timeout=timeout)))
    else:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _provider = provider
    return True


def flush() -> None:
    """Export what is buffered (a Celery pool process may end without running atexit), waiting at most
    FLUSH_S: a silent collector delays a job's end by that, no more (what is left is sent in the background)."""
    if _provider is not None:  # in a thread: the SDK's flush waits out an export in progress, whatever its bound
        flusher = threading.Thread(target=_provider.force_flush, args=(int(EXPORT_TIMEOUT_S * 1000),),
                                   name="otlp-flush", daemon=True)
        flusher.start()
        flusher.join(FLUSH_S)


def _clean(attributes: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in attributes.items() if v is not None}


@contextmanager
def span(name: str, **attributes: Any) -> Iterator[trace.Span]:
    """A span around a block, a child of the current one; an exception marks it as an error."""
    with TRACER.start_as_current_span(name, attributes=_clean(attributes)) as s:
        yield s


def traced(name: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """A function's calls as spans named `name`."""
    def wrap(fn: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def inner(*args: P.args, **kwargs: P.kwargs) -> R:
            with TRACER.start_as_current_span(name):
                return fn(*args, **kwargs)
        return inner
    return wrap


def begin_step(step: int, **attributes: Any) -> None:
    """Open a step's `rl.loop` span and make it current, so the phases of the step are its children."""
    global _step
    end_step()
    s = TRACER.start_span("rl.loop", attributes=_clean({"grpo_jobs.step": step, **attributes}))
    _step = (s, context.attach(trace.set_span_in_context(s)))


def end_step(error: BaseException | None = None, **attributes: Any) -> None:
    """Close the step's span (with `error`: marked failed); nothing when no step is open."""
    global _step
    if _step is None:
        return
    s, token = _step
    _step = None
    s.set_attributes(_clean(attributes))
    if error is not None:
        s.record_exception(error)
        s.set_status(trace.Status(trace.StatusCode.ERROR, f"{type(error).__name__}: {error}"))
    context.detach(token)
    s.end()

"""A job's lifecycle: lease, status transitions, resume, and a readable error when it fails.

queued -> running -> succeeded | failed | cancelled. The lease is a conditional UPDATE in SQL,
so a redelivered message can never run one job twice. A job whose worker stopped renewing its
lease (killed, cut off from the store) is queued again by the sweep of any live worker
(worker/jobs/sweeper.py) and resumes from its last checkpoint; after `max_attempts` attempts it
fails with a clear error. The outcome (status and final event) is one transaction.
"""

from __future__ import annotations

import importlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial, wraps
from typing import Literal

from service.core import queue, tracing
from service.core.health import non_finite_flag
from service.core.settings import Settings
from service.core.sources import for_owner
from service.core.specs import KINDS, TERMINAL, JobSpec
from service.store import jobs as jobs_q
from service.store import leases, session_ops
from service.store import nodes as nodes_q
from service.store.db import is_unreachable, session_scope
from worker.environments.client import EnvironmentDown
from worker.jobs import nodes
from worker.jobs.sql_reporter import SqlReporter
from worker.machine import allocator
from worker.parallel.distributed import Ranks
from worker.parallel.launch import (
    Gang,
    GangIncomplete,
    LauncherStopped,
    RanksFailed,
    fork_server_here,
    launch,
    placement_warning,
    preload_in_ranks,
    visible_gpus,
)
from worker.reporting import LeaseLost, LoopResult, RankReporter, Reporter

log = logging.getLogger(__name__)
# lost: the lease went away mid-job (store unreachable too long, or taken over); the sweep requeues it
# requeued: a process of a multi-process job was killed; the job is queued again and resumes
# waiting: a multi-node job's other nodes did not come; it is queued again, the attempt not counted
Outcome = Literal["succeeded", "failed", "cancelled", "skipped", "busy", "missing", "lost", "requeued", "idle",
                  "waiting"]
# what a node other than node 0 did: ran its ranks to the end, or not (node 0 records what the job did)
NodeOutcome = Literal["done", "failed", "refused", "gave up", "stopped"]
LOOPS = {"grpo": "worker.loops.grpo", "tracin": "worker.loops.tracin", "joint": "worker.loops.joint",
         "sft": "worker.loops.sft", "session": "worker.session.run"}
assert set(LOOPS) == set(KINDS), "every job kind has its loop"
preload_in_ranks(["worker.jobs.runner", *LOOPS.values()])  # a job's ranks start with every loop imported


def preload() -> None:
    """Import every loop in a worker's main process, before its pool forks: each job runs in a fresh
    child (`worker_max_tasks_per_child` 1), which then inherits torch, transformers and peft instead of
    importing them again (about 3 s of CPU a job). Nothing runs on a device here."""
    for module in LOOPS.values():
        importlib.import_module(module)


def loop_for(kind: str):
    """The training loop of a job kind (imported lazily: each pulls in torch and transformers)."""
    if kind not in LOOPS:
        raise ValueError(f"unknown job kind {kind!r}")
    run = importlib.import_module(LOOPS[kind]).run
    from worker.loops.skeleton import report_health  # torch is in now, with the loop
    from worker.training import NonFiniteUpdate

    @wraps(run)
    def run_then_stop_engines(spec, reporter: Reporter, **kwargs):
        tracing.setup("grpo-jobs-worker")  # where OTEL_EXPORTER_OTLP_ENDPOINT is set; once per process
        attempt = {"grpo_jobs.job.id": reporter.job_id, "grpo_jobs.attempt": reporter.attempt, "rl.algorithm": kind,
                   "rl.model.name": getattr(getattr(spec, "model", None), "name", None)}
        try:
            with tracing.span("grpo_jobs.attempt", **attempt):  # the root of the attempt's step spans
                try:
                    return run(spec, reporter, **kwargs)
                except BaseException as exc:  # a step that raised ends its span as an error
                    tracing.end_step(error=exc)
                    raise
        except NonFiniteUpdate as exc:  # the job fails with it; the guard's flag says what and where first
            report_health(reporter, [non_finite_flag(exc.what, exc.step)])
            raise
        finally:
            tracing.flush()  # a pool process may end without atexit
            # a job's vLLM server and environment server end with its loop, whatever its end
            from worker.engines.vllm_engine import stop_servers
            from worker.environments.servers import stop_servers as stop_environments

            stop_servers()
            stop_environments()

    return run_then_stop_engines


def run_spec(spec: JobSpec, reporter: Reporter, *, settings: Settings, rank_reporter: Callable[[], Reporter],
             run_id: str | None = None, gang: Gang | None = None) -> LoopResult:
    """Run a spec's loop to its end: in this process, or as `resources.processes` ranks (on node 0 of `gang`
    when the job spans several machines) that each record through `rank_reporter()` while this process waits
    (`grpo-jobs run` and the worker)."""
    if not on_ranks(spec, spans_nodes=gang is not None):
        return loop_for(spec.kind)(spec, reporter, settings=settings)
    gpus = visible_gpus()
    if warning := placement_warning(spec.resources.processes, gpus):
        reporter.event("placement", warning, level="warning", data={"processes": spec.resources.processes,
                                                                    "gpus": gpus})
    return launch(loop_on_ranks, (spec, settings, rank_reporter), processes=spec.resources.processes,
                  run_id=run_id, gang=gang)[0]


def on_ranks(spec: JobSpec, *, spans_nodes: bool) -> bool:
    """Whether run_spec runs a spec's loop as ranks (several processes, or this node of a job on several machines)
    rather than in this process."""
    return spec.kind != "session" and (spec.resources.processes > 1 or spans_nodes)


def run_node(message: queue.NodeMessage, *, settings: Settings) -> NodeOutcome:
    """Node `message.node` of a multi-node job's attempt: this node's ranks, joined to node 0's rendezvous,
    until the attempt ends. Node 0 holds the lease and records the job; this records only that it joined, and
    why its ranks failed if they did."""
    holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    joined = nodes_q.join(settings.store_url, job_id=message.job_id, uid=message.uid, attempt=message.attempt,
                          head=message.head, node=message.node, node_name=settings.node, holder=holder)
    if joined == "same machine":  # another worker of this machine holds a node of it: one elsewhere may take this
        log.info("job %s node %s: this machine (%s) runs another node of it; sending it back", message.job_id,
                 message.node, settings.node)
        time.sleep(1.0)  # bounds the churn while only this machine's workers are free
        queue.enqueue_node(message, broker_url=settings.broker)
        return "refused"
    if isinstance(joined, str):
        log.info("job %s node %s attempt %s: %s; dropping the message", message.job_id, message.node,
                 message.attempt, joined)
        return "refused"
    if not nodes.sees_node_0(settings, message):
        log.error("job %s node %s: node 0's files are not in this worker's GRPO_CACHE_DIR", message.job_id,
                  message.node)
        nodes_q.node_failed(settings.store_url, job_id=joined.job_id, attempt=joined.attempt, node=message.node,
                            message=f"the worker of node {message.node} does not see node 0's files: the nodes of a job "
                            "share checkpoints and data files through one GRPO_DATA_DIR (GRPO_CACHE_DIR) on shared "
                            "storage; node 0 waits for another worker")
        return "refused"
    spec, owner_settings = joined.spec, for_owner(settings, joined.owner)
    gang = Gang(nodes=spec.nodes, node=message.node, endpoint=message.endpoint, wait_s=settings.gang_wait_s)
    rank_reporter = partial(SqlReporter, joined.job_id, uid=joined.uid, owner=joined.owner, holder=holder,
                            settings=owner_settings)  # rank 0 reports, and it runs on node 0: never called here
    fork_server_here()  # while this process has no other thread: its ranks inherit its imports
    try:
        with nodes.watch_node_0(message, settings=settings):
            launch(loop_on_ranks, (spec, owner_settings, rank_reporter), processes=spec.resources.processes,
                   run_id=nodes.run_id(joined.uid, joined.attempt), gang=gang)
    except GangIncomplete as exc:
        log.warning("job %s: %s", message.job_id, exc)
        return "gave up"
    except LauncherStopped:
        return "stopped"
    except RanksFailed as exc:
        if not exc.peer_gone:  # the cause is here: say it, node 0 fails the attempt over
            nodes_q.node_failed(settings.store_url, job_id=joined.job_id, attempt=joined.attempt, node=message.node,
                                message=without_server_paths(str(exc), settings))
        return "failed"
    return "done"


def run_job(job_id: int, *, settings: Settings, uid: str | None = None, holder: str | None = None) -> Outcome:
    holder = holder or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    url = settings.store_url
    lease = leases.acquire_lease(url, job_id=job_id, uid=uid, holder=holder, lease_timeout_s=settings.lease_timeout_s)
    if lease is None:
        with session_scope(url) as s:
            return _not_leased(s, job_id=job_id, uid=uid)
    if lease.spec is not None and on_ranks(lease.spec, spans_nodes=lease.spec.nodes > 1):  # _run's gang rule
        fork_server_here()  # before the heartbeat's thread starts: the job's ranks inherit this process's imports
    reporter = SqlReporter(job_id, uid=lease.uid, owner=lease.owner, holder=holder, settings=settings)
    reporter.attempt = lease.attempt
    reporter.start()
    try:
        return _run(lease, reporter, settings)
    except LeaseLost:
        log.warning("job %s: lease lost; not recording an outcome (the sweep requeues it)", job_id)
        return "lost"
    finally:
        reporter.stop()
        allocator.release_freed_memory()  # where the process outlives the job (tests, embedded runs)


def without_server_paths(message: str, settings: Settings) -> str:
    """A message for the API: the admin's folders named by their setting, not their path."""
    roots = [(settings.artifacts_dir, "$GRPO_ARTIFACTS_ROOT"), (settings.cache_dir, "$GRPO_CACHE_DIR"),
             (settings.datasets_dir, "$GRPO_DATASETS_ROOT"),
             (settings.models_dir, "$GRPO_MODELS_ROOT"), (settings.shared_datasets_root, "$GRPO_SHARED_DATASETS"),
             *((root, "$GRPO_MODEL_ROOTS") for root in settings.model_roots), (settings.data_dir, "$GRPO_DATA_DIR")]
    for root, name in roots:  # the data dir last: it usually holds the others
        if root is not None:
            message = message.replace(str(root.resolve()), name).replace(str(root), name)
    return message


def loop_on_ranks(spec: JobSpec, settings: Settings, make_reporter: Callable[[], Reporter], *, ranks: Ranks) -> LoopResult:
    """One rank of a job that spans several processes: its loop, recording through rank 0's reporter."""
    return loop_for(spec.kind)(spec, RankReporter(make_reporter() if ranks.main else None, ranks), settings=settings,
                               ranks=ranks)


def _requeue(lease: leases.Lease, reporter: SqlReporter, settings: Settings, message: str, *,
             waiting: nodes.Waiting | None = None) -> Outcome:
    """An attempt that failed for a reason outside the job (a killed rank, a lost environment server):
    queued again with `message`, it resumes from its last checkpoint (up to max_attempts attempts). With
    `waiting`, a multi-node attempt that never started: not counted, and sent again after its pause."""
    again = leases.requeue(settings.store_url, job_id=lease.job_id, holder=reporter.holder, message=message,
                           failed=waiting is None, data=waiting.data if waiting else None)
    if again is None:
        raise LeaseLost(f"job {lease.job_id}: lease lost")
    pause_s = 0.0 if waiting is None else waiting.pause_s
    if waiting is not None:  # sent with a countdown, not slept on: this worker takes other work meanwhile
        log.info("job %s: %s; sending it again in %.1f s", lease.job_id, message, pause_s)
    try:
        queue.enqueue(again, broker_url=settings.broker, countdown_s=pause_s)
    except Exception as err:  # the sweep enqueues a queued job nobody takes
        log.warning("job %s: could not enqueue it again (%s); the sweep will", lease.job_id, err)
    return "requeued" if waiting is None else "waiting"


def _ranks_failed(lease: leases.Lease, reporter: SqlReporter, settings: Settings, exc: RanksFailed) -> Outcome:
    """A rank killed (out of memory, by hand) fails the attempt: queued again, it resumes from the
    last checkpoint. A rank's own error fails the job, with that error."""
    if exc.message.startswith("LeaseLost"):
        raise LeaseLost(f"job {lease.job_id}: {exc}")
    if exc.killed:
        return _requeue(lease, reporter, settings, f"attempt {lease.attempt} failed: {exc}; the other ranks were "
                        "stopped. Queued again, it resumes from its last checkpoint")
    if exc.peer_gone and lease.spec is not None and lease.spec.nodes > 1:  # another node's ranks went
        return _requeue(lease, reporter, settings, f"attempt {lease.attempt} failed: another node of the job was "
                        f"lost ({exc}). Queued again, it resumes from its last checkpoint")
    log.error("job %s failed on %s", lease.job_id, exc)
    message = without_server_paths(str(exc), settings)
    reporter.finish("failed", message, error=message, data={"error_type": exc.message.split(":")[0], "rank": exc.rank})
    return "failed"


def _not_leased(session, *, job_id: int, uid: str | None) -> Outcome:
    job = jobs_q.get_job(session, job_id=job_id)
    if job is None or (uid is not None and job.uid != uid):
        log.warning("job %s (uid %s) is not in this store; dropping the message", job_id, uid)
        return "missing"
    return "skipped" if job.status in TERMINAL else "busy"  # busy: another worker's lease is live


def _run(lease: leases.Lease, reporter: SqlReporter, settings: Settings) -> Outcome:
    if lease.cancel_requested:
        reporter.finish("cancelled", "cancelled before this attempt started")
        return "cancelled"
    if lease.attempt > settings.max_attempts:
        message = (f"gave up after {settings.max_attempts} attempts: none finished (the worker running it "
                   "stopped: out of memory, killed or lost; or a rank or its environment server was lost)")
        reporter.finish("failed", message, error=message)
        return "failed"
    reporter.event("started", f"attempt {lease.attempt} started",
                   data={"attempt": lease.attempt, "holder": reporter.holder})
    if (spec := lease.spec) is None:
        reporter.finish("failed", lease.spec_error, error=lease.spec_error)
        return "failed"
    owner_settings = for_owner(settings, lease.owner)  # the job sees its owner's data folder, nobody else's
    # with several ranks, they record through their own reporters; this process holds the lease meanwhile
    rank_reporter = partial(SqlReporter, lease.job_id, uid=lease.uid, owner=lease.owner, holder=reporter.holder,
                            settings=owner_settings)
    gang, watch = None, None
    try:
        if spec.nodes > 1:  # node 0 of a job on several machines; it watches the others
            if isinstance(hosted := _host_gang(lease, reporter, settings), str):
                return hosted
            gang, watch = hosted
        with watch or nullcontext():
            result = run_spec(spec, reporter, settings=owner_settings, rank_reporter=rank_reporter,
                              run_id=nodes.run_id(lease.uid, lease.attempt), gang=gang)
    except LeaseLost:
        raise
    except LauncherStopped as exc:
        if watch is not None and watch.why is not None:  # a node went silent: its ranks were stopped here too
            return _requeue(lease, reporter, settings, f"attempt {lease.attempt} failed: {watch.why}; this node's "
                            "ranks were stopped. Queued again, it resumes from its last checkpoint")
        raise LeaseLost(f"job {lease.job_id}: {exc}") from exc  # the worker is stopping: the sweep requeues it
    except (GangIncomplete, nodes.NoRendezvousPort) as exc:
        waiting = nodes.waiting(spec, settings=settings)
        return _requeue(lease, reporter, settings, f"waiting for {spec.nodes} workers on different machines "
                        f"(GRPO_NODE_NAME) to take a node each: {exc}. Queued again; single-node jobs run meanwhile",
                        waiting=waiting)
    except RanksFailed as exc:
        return _ranks_failed(lease, reporter, settings, exc)
    except EnvironmentDown as exc:
        return _requeue(lease, reporter, settings, f"attempt {lease.attempt} failed: the environment server is "
                        f"down ({exc}). Queued again, it resumes from its last checkpoint")
    except Exception as exc:
        if is_unreachable(exc):
            raise LeaseLost(f"job {lease.job_id}: store unreachable") from exc
        log.exception("job %s failed", lease.job_id)  # the full traceback stays in the worker's log
        message = without_server_paths(f"{type(exc).__name__}: {exc}", settings)
        reporter.finish("failed", message, error=message, data={"error_type": type(exc).__name__})
        return "failed"
    if result.status == "idle":
        return _release_idle(lease, reporter, settings, result)
    reporter.finish(result.status, f"job {result.status} at step {result.step}",
                    data={"step": result.step, **result.eval})
    return result.status


def _host_gang(lease: leases.Lease, reporter: SqlReporter, settings: Settings) -> tuple[Gang, nodes.Watch] | Outcome:
    """Node 0 of a job on several machines, once every node is taken: its gang and the watch on the others.
    Else the outcome: waiting, queued again before any node is taken, while too few machines have a live
    worker; cancelled while it waited. GangIncomplete when the others did not come within GRPO_GANG_WAIT_S."""
    spec = lease.spec
    assert spec is not None
    if (short := nodes.too_few_machines(spec, settings=settings)) is not None:  # no node taken, no worker held
        return _requeue(lease, reporter, settings, short, waiting=nodes.waiting(spec, settings=settings))
    gang, watch = nodes.host(lease, settings=settings, holder=reporter.holder), nodes.watch_others(
        lease, settings=settings)
    reporter.event("waiting", f"node 0 waits up to {settings.gang_wait_s:g} s (GRPO_GANG_WAIT_S) for "
                   f"{spec.nodes - 1} more node(s) to be taken by workers on other machines",
                   data={"nodes": spec.nodes, "wait_s": settings.gang_wait_s})
    if not nodes.await_nodes(lease, settings=settings, cancelled=reporter.should_stop):
        reporter.finish("cancelled", "cancelled while waiting for its other nodes")
        return "cancelled"
    return gang, watch


def _release_idle(lease: leases.Lease, reporter: SqlReporter, settings: Settings, result: LoopResult) -> Outcome:
    """A session run that gives its worker back (nothing to do, or the worker is stopping): idle, or queued
    again at once when operations are pending."""
    message = f"{result.why}: state saved at step {result.step}"
    given = session_ops.give_back(settings.store_url, job_id=lease.job_id, holder=reporter.holder, message=message)
    if given is None:
        raise LeaseLost(f"job {lease.job_id}: lease lost")
    if given == "idle":
        return "idle"
    queue.enqueue(given, broker_url=settings.broker)
    return "requeued"

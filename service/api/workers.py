"""The workers that are running: their GPUs and the queues they take jobs from (service/store/workers.py); and
which worker runs each node of a multi-node job (service/store/nodes.py)."""

from __future__ import annotations

from datetime import datetime

from fastapi import APIRouter
from pydantic import BaseModel, Field

from service.api.deps import JobDep, SeesClusterDep, SessionDep, SettingsDep
from service.api.schemas import _Out, error_responses
from service.store import nodes as nodes_q
from service.store import workers as workers_q

router = APIRouter(prefix="/v1/workers", tags=["workers"], responses=error_responses(401, 503))
nodes_router = APIRouter(prefix="/v1/jobs", tags=["workers"], responses=error_responses(401, 404, 422, 503))


class GpuOut(BaseModel):
    index: int = Field(description="Its `cuda:N` in the worker's jobs (CUDA_VISIBLE_DEVICES applied).")
    name: str = Field(description="The device's name, e.g. 'NVIDIA H100 80GB HBM3'.")
    memory_bytes: int = Field(description="Its total memory.")


class WorkerOut(_Out):
    id: int = Field(description="Its row in the registry: how a tenant tells two workers apart.")
    name: str | None = Field(description="hostname:pid:random of its main process (a job's `started` event names the "
                             "pool process that runs it, a child of this pid); only for the admin's keys "
                             "(GRPO_ADMIN_OWNERS), null for others.")
    hostname: str | None = Field(description="Its machine (GRPO_NODE_NAME, else its hostname); only for the admin's "
                                 "keys, null for others.")
    gpus: list[GpuOut] = Field(description="The GPUs it has; empty for a CPU worker.")
    queues: list[str] = Field(description="The queues it takes jobs from: `jobs` (jobs that need no GPU), and "
                              "`gpu`, `gpu2`... up to its GPU count (jobs whose devices name that many).")
    concurrency: int = Field(description="Jobs it runs at once.")
    started_at: datetime
    seen_at: datetime = Field(description="When it last said it is alive (every GRPO_SWEEP_S).")


class WorkerList(BaseModel):
    items: list[WorkerOut]


@router.get("", response_model=WorkerList)
def list_workers(admin: SeesClusterDep, session: SessionDep, settings: SettingsDep):
    """The live workers, the oldest first: those heard from within the lease timeout (GRPO_LEASE_TIMEOUT_S).
    Where they run (host and process) only to the admin's keys."""
    items = [WorkerOut.model_validate(w) for w in workers_q.live_workers(session, within_s=settings.lease_timeout_s)]
    return {"items": items if admin else [w.model_copy(update={"name": None, "hostname": None}) for w in items]}


class NodeOut(_Out):
    node: int = Field(description="0 leased the job, hosts its rendezvous and reports; ranks go node by node.")
    attempt: int = Field(description="The attempt it ran (each attempt's nodes may be other workers).")
    node_name: str | None = Field(description="The machine, as its worker names it (GRPO_NODE_NAME, else its "
                                  "hostname); only for the admin's keys (GRPO_ADMIN_OWNERS), null for others.")
    holder: str | None = Field(description="hostname:pid:random of the worker process that runs the node's ranks; "
                               "only for the admin's keys, null for others.")
    joined_at: datetime


class NodeList(BaseModel):
    items: list[NodeOut]


@nodes_router.get("/{job_id}/nodes", response_model=NodeList)
def job_nodes(job: JobDep, session: SessionDep, admin: SeesClusterDep):
    """The nodes of the job's latest attempt to start (a job on one machine: none), and, to the admin's keys,
    the worker that ran each."""
    items = [NodeOut.model_validate(n) for n in nodes_q.nodes_of(session, job_id=job.id)]
    return {"items": items if admin else [n.model_copy(update={"node_name": None, "holder": None}) for n in items]}

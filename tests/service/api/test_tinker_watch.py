"""`retrieve_future` while operations are pending: every future an API process holds open is checked by one
query a tick (service/api/tinker/watch.py), on the embedded store and on PostgreSQL."""

import asyncio
import json

import httpx
import pytest
from sqlalchemy import select

from service.api.tinker import futures, watch
from service.core.records import OpResult, PendingOp
from service.store import session_ops
from service.store.db import session_scope
from service.store.models import SessionOp

STEP = {"adam_params": {"learning_rate": 0.01}}
WAITING = 40


def _pending_ops(api, n: int) -> list[str]:
    """A run with `n` optimizer steps sent, none run (no worker here): their request ids."""
    session_id = api.post("/api/v1/create_session", json={}).json()["session_id"]
    model_id = api.post("/api/v1/create_model", json={"session_id": session_id, "base_model": "tiny-random-llama",
                                                      "lora_config": {"rank": 4}}).json()["model_id"]
    return [api.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": 1 + i, **STEP}).json()["request_id"]
            for i in range(n)]


def _complete(url: str, request_ids: list[str]) -> None:
    """What the run's worker does: each operation's result written."""
    with session_scope(url) as s:
        ops = s.scalars(select(SessionOp).where(SessionOp.request_id.in_(request_ids))).all()
        pending = [PendingOp(id=op.id, request_id=op.request_id, kind=op.kind, body=op.body) for op in ops]
    session_ops.complete_ops(url, results=[OpResult(op=op, result=json.dumps({"metrics": {"n": op.id}}).encode(),
                                                    result_format="json") for op in pending])


async def _retrieve_all(api, request_ids: list[str], while_waiting, after_s: float = 0.5) -> list[httpx.Response]:
    """Every future retrieved at once, in one event loop as uvicorn runs them; `while_waiting` runs in a
    thread once they have waited `after_s`."""
    transport = httpx.ASGITransport(app=api.client.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://api", headers=api.auth()) as c:
        waits = [asyncio.create_task(c.post("/api/v1/retrieve_future", json={"request_id": r})) for r in request_ids]
        await asyncio.sleep(after_s)
        await asyncio.to_thread(while_waiting)
        return await asyncio.gather(*waits)


def test_pending_futures_are_checked_together_and_each_gets_its_own_result(api, monkeypatch):
    request_ids = _pending_ops(api, WAITING)
    checked: list[int] = []  # how many request ids each store check asked about
    settled = session_ops.settled
    monkeypatch.setattr(session_ops, "settled", lambda s, *, request_ids: checked.append(len(request_ids))
                        or settled(s, request_ids=request_ids))

    answers = asyncio.run(_retrieve_all(api, request_ids, lambda: _complete(api.settings.store_url, request_ids)))

    with session_scope(api.settings.store_url) as s:
        ids = dict(s.execute(select(SessionOp.request_id, SessionOp.id)).all())
    assert [(a.status_code, a.json()) for a in answers] == [(200, {"metrics": {"n": ids[r]}}) for r in request_ids]
    # 40 futures waiting 0.5 s, each polling alone at 2 ms growing to 100 ms, would have asked about 600 times.
    # Together: at most one check as each future starts waiting, then one a tick for all of them.
    assert max(checked) == WAITING and len(checked) < WAITING + 30, checked
    assert not watch._watches  # the loop is gone, and its watch with it


def test_a_future_still_pending_at_the_deadline_is_try_again_and_a_failed_one_its_error(api, monkeypatch):
    monkeypatch.setattr(futures, "RETRIEVE_WAIT_S", 1.0)
    slow, failing = _pending_ops(api, 2)

    def fail() -> None:
        with session_scope(api.settings.store_url) as s:
            op_id = s.scalar(select(SessionOp.id).where(SessionOp.request_id == failing))
        session_ops.fail_op(api.settings.store_url, op_id=op_id, error="out of memory", category="server")

    later, failed = asyncio.run(_retrieve_all(api, [slow, failing], fail, after_s=0.2))
    assert later.json() == {"type": "try_again", "request_id": slow, "queue_state": "active"}
    assert failed.json() == {"error": "out of memory", "category": "server"}
    # asked again, the one still pending waits again; an unknown one is a 404 at once
    assert api.post("/api/v1/retrieve_future", json={"request_id": slow}).json()["type"] == "try_again"
    assert api.post("/api/v1/retrieve_future", json={"request_id": "nope"}).status_code == 404


@pytest.mark.parametrize("n", [1, 3])
def test_a_watch_forgets_a_future_once_its_caller_leaves(sqlite_api, n):
    """A client that hangs up (its request cancelled) leaves nothing behind for the watch to check."""
    request_ids = _pending_ops(sqlite_api, n)

    async def leave() -> dict:
        w = watch.op_watch(sqlite_api.settings.store_url)
        waits = [asyncio.create_task(w.ended(r, 10.0)) for r in request_ids]
        await asyncio.sleep(0.1)
        for t in waits:
            t.cancel()
        await asyncio.gather(*waits, return_exceptions=True)
        await asyncio.sleep(0.15)  # past the watch's longest pause: its task has seen nobody waits
        return {"waiting": dict(w._waiting), "polling": not w._task.done()}

    assert asyncio.run(leave()) == {"waiting": {}, "polling": False}

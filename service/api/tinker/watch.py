"""Pending operations, watched together: an API process checks every future it holds open with one query a
tick, instead of one query a tick for each (the cookbook's RL loop keeps a step's 8 sample requests
waiting at once; a platform's clients, hundreds)."""

from __future__ import annotations

import asyncio
import logging
import weakref

from fastapi.concurrency import run_in_threadpool

from service.store import session_ops as ops_q
from service.store.db import session_scope

log = logging.getLogger(__name__)

FIRST_PAUSE_S = 0.002  # after a new waiter or an ended operation: a 20 ms operation is answered ~5 ms after it ends
MAX_PAUSE_S = 0.1  # the pause grows by a quarter each quiet tick up to this
MAX_IDS = 500  # request ids per query (SQLite's and PostgreSQL's parameter limits are far above)


class OpWatch:
    """The request ids this event loop's `retrieve_future` calls wait on, polled by one task while any wait."""

    def __init__(self, store_url: str) -> None:
        self.store_url = store_url
        self._waiting: dict[str, set[asyncio.Event]] = {}
        self._nudge = asyncio.Event()  # a new waiter: check again soon
        self._task: asyncio.Task | None = None

    async def ended(self, request_id: str, within_s: float) -> bool:
        """True once the operation has ended (done or failed), False if it is still pending after `within_s`."""
        event = asyncio.Event()
        self._waiting.setdefault(request_id, set()).add(event)
        self._nudge.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._poll())
        try:
            await asyncio.wait_for(event.wait(), within_s)
            return True
        except TimeoutError:
            return False
        finally:
            waiters = self._waiting.get(request_id, set())
            waiters.discard(event)
            if not waiters:
                self._waiting.pop(request_id, None)

    def _ended(self, request_ids: list[str]) -> set[str]:
        with session_scope(self.store_url, read_only=True) as session:
            return set().union(*(ops_q.settled(session, request_ids=request_ids[i:i + MAX_IDS])
                                 for i in range(0, len(request_ids), MAX_IDS)))

    async def _poll(self) -> None:
        pause = FIRST_PAUSE_S
        while self._waiting:
            self._nudge.clear()
            try:
                ended = await run_in_threadpool(self._ended, list(self._waiting))
            except Exception as exc:  # the store is away: the waiters answer try_again at their deadline
                log.warning("checking %d pending operations failed: %s", len(self._waiting), exc)
                ended, pause = set(), MAX_PAUSE_S
            for request_id in ended:
                for event in self._waiting.get(request_id, ()):
                    event.set()
            pause = FIRST_PAUSE_S if ended else min(pause * 1.25, MAX_PAUSE_S)
            try:  # a new waiter cuts the pause short: its operation may have ended already
                await asyncio.wait_for(self._nudge.wait(), pause)
                pause = FIRST_PAUSE_S
            except TimeoutError:
                pass
        # nobody waits: gone from the registry (a new waiter starts a new watch), so nothing holds the loop
        loop_watches = _watches.get(asyncio.get_running_loop(), {})
        if loop_watches.get(self.store_url) is self:
            del loop_watches[self.store_url]


_watches: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, OpWatch]] = weakref.WeakKeyDictionary()


def op_watch(store_url: str) -> OpWatch:
    """This event loop's watch over `store_url`'s operations while any is waited on (a test client may run each
    request in a loop of its own; a watch's task and events belong to one loop)."""
    by_store = _watches.setdefault(asyncio.get_running_loop(), {})
    if store_url not in by_store:
        by_store[store_url] = OpWatch(store_url)
    return by_store[store_url]

"""The store's schema, migrated in the background so the API starts while the store is down."""

from __future__ import annotations

import asyncio
import logging
import threading

from starlette.concurrency import run_in_threadpool

from service.core.settings import Settings

log = logging.getLogger(__name__)


class StoreSchema:
    """Migrates the store in the background until it succeeds, so `serve` starts (and answers
    /healthz, /readyz and 503s) while the store is still down."""

    def __init__(self, settings: Settings, *, migrate: bool) -> None:
        self.settings = settings
        self.ready = threading.Event()
        self.error: str | None = None
        if not migrate:
            self.ready.set()

    async def run(self, retry_s: float = 2.0) -> None:
        from service.store.migrate import upgrade

        while not self.ready.is_set():
            try:
                await run_in_threadpool(upgrade, self.settings.store_url)
            except Exception as exc:
                self.error = f"{type(exc).__name__}"
                log.warning("store not migrated yet (%s); retrying in %.0f s", self.error, retry_s)
                await asyncio.sleep(retry_s)
            else:
                self.error = None
                self.ready.set()

"""A scratch PostgreSQL database beside an existing one, for the store benchmarks."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import create_engine, text

from service.store.db import get_engine

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


@contextmanager
def scratch_database(url: str, *, keep: bool = False) -> Iterator[str]:
    """Create a fresh database on the server of `url`, yield its URL, drop it afterwards."""
    name = f"grpo_bench_{uuid.uuid4().hex[:8]}"
    admin = create_engine(url, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text(f'CREATE DATABASE "{name}"'))
    scratch = url.rsplit("/", 1)[0] + f"/{name}"
    try:
        yield scratch
    finally:
        get_engine(scratch).dispose()
        if not keep:
            with admin.connect() as c:
                c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()

"""Engine and session factory. SQLite gets WAL and a busy timeout so API and worker can share it."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import lru_cache

from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

# How long a connection attempt may take before the store counts as unreachable.
CONNECT_TIMEOUT_S = 5
POOL_SIZE, MAX_OVERFLOW = 10, 20  # a process's PostgreSQL connections: 10 kept, 20 more at peaks


def normalize_url(url: str) -> str:
    # psycopg 3 is the driver we ship; plain postgresql:// would ask for psycopg2.
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix):]
    return url


_ENGINES: dict[str, Engine] = {}
# A burst of first requests on the API's threads each made a pool of its own without it (20 threads, 20 pools),
# and one API process held 51 PostgreSQL connections through a tinker-cookbook run against a pool of 30
_ENGINES_LOCK = threading.Lock()


def _in_forked_child() -> None:
    """A forked child (a Celery pool process, a rank from a fork server forked from one) shares its parent's
    pooled sockets: using one corrupts both sessions (on PostgreSQL: 'prepared statement "_pg3_0" already
    exists'), so it drops them unclosed. And a fork while another thread held the lock would leave the child's
    copy held."""
    global _ENGINES_LOCK
    _ENGINES_LOCK = threading.Lock()
    dispose_engines(close=False)


os.register_at_fork(after_in_child=_in_forked_child)


def get_engine(url: str) -> Engine:
    """One engine (one pool) per URL per process, whichever threads ask first."""
    if (engine := _ENGINES.get(url)) is None:
        with _ENGINES_LOCK:
            if (engine := _ENGINES.get(url)) is None:
                engine = _ENGINES[url] = _create_engine(normalize_url(url))
    return engine


def _create_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn, _record):  # noqa: ANN001
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        return engine
    return create_engine(url, pool_pre_ping=True, pool_size=POOL_SIZE, max_overflow=MAX_OVERFLOW,
                         connect_args={"connect_timeout": CONNECT_TIMEOUT_S})


def dispose_engines(*, close: bool) -> None:
    """Drop every pooled connection. A forked child passes close=False, so it never uses (nor
    closes) a socket it shares with its parent; a parent about to fork passes close=True."""
    for engine in _ENGINES.values():
        engine.dispose(close=close)


def is_unreachable(exc: BaseException) -> bool:
    """The store could not be reached or dropped the connection (retrying later may succeed),
    as opposed to a statement it refused."""
    if isinstance(exc, (OperationalError, InterfaceError)):
        return True
    return isinstance(exc, DBAPIError) and exc.connection_invalidated


@lru_cache(maxsize=16)
def get_sessionmaker(url: str, read_only: bool = False) -> sessionmaker[Session]:
    engine = get_engine(url)
    if read_only:  # each statement on its own: no BEGIN and COMMIT round trips around a read
        engine = engine.execution_options(isolation_level="AUTOCOMMIT")
    return sessionmaker(engine, expire_on_commit=False)


@contextmanager
def session_scope(url: str, *, read_only: bool = False) -> Iterator[Session]:
    """A session that commits on success and rolls back on error. A `read_only` one runs each
    statement in its own implicit transaction (for requests that only read)."""
    session = get_sessionmaker(url, read_only)()
    try:
        yield session
        session.commit()
        committed = session.info.pop(AFTER_COMMIT, ())
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()
    for then in committed:  # with the connection given back
        then()


AFTER_COMMIT = "grpo_jobs.after_commit"


def after_commit(session: Session, then: Callable[[], None]) -> None:
    """`then()` once the transaction of the `session_scope` holding `session` has committed (never if it
    rolls back): what may happen only once the rows exist, such as telling a worker about them. It runs
    outside the transaction; what it writes, it writes in a scope of its own."""
    session.info.setdefault(AFTER_COMMIT, []).append(then)


def ping(url: str) -> None:
    """One round trip to the store; raises when it does not answer."""
    with session_scope(url, read_only=True) as s:
        s.execute(text("SELECT 1"))


# the flush hook that records a job event's webhook deliveries with it, in every session
from service.store import webhooks as _webhooks  # noqa: E402,F401

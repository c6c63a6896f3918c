"""Shared fixtures: real stores and brokers where they run, a clear skip (or, under CI, a failure)
where they do not."""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path

import pytest

CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
PG_ADMIN_URL = os.environ.get("TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
ARTIFACTS = Path(__file__).parent.parent / "test-artifacts"


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def require(service: str, host: str, port: int) -> None:
    if not _reachable(host, port):
        msg = f"{service} is not reachable at {host}:{port}"
        if CI:
            pytest.fail(msg + " (CI=true: the suite needs it)")
        pytest.skip(msg)


@pytest.fixture(scope="session")
def pg_admin_url() -> str:
    require("PostgreSQL", "127.0.0.1", 5432)
    return PG_ADMIN_URL


@pytest.fixture
def pg_url_factory(pg_admin_url):
    """Fresh PostgreSQL databases for one test, dropped afterwards."""
    from sqlalchemy import create_engine, text

    from service.store.db import get_engine

    admin = create_engine(pg_admin_url, isolation_level="AUTOCOMMIT")
    made: list[tuple[str, str]] = []

    def make() -> str:
        name = f"grpo_test_{uuid.uuid4().hex[:10]}"
        with admin.connect() as c:
            c.execute(text(f'CREATE DATABASE "{name}"'))
        url = pg_admin_url.rsplit("/", 1)[0] + f"/{name}"
        made.append((name, url))
        return url

    yield make
    for name, url in made:
        get_engine(url).dispose()
        with admin.connect() as c:
            c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture
def pg_url(pg_url_factory):
    """A fresh PostgreSQL database for one test, dropped afterwards."""
    return pg_url_factory()


@pytest.fixture
def redis_url():
    require("Redis", "127.0.0.1", 6379)
    return REDIS_URL


@pytest.fixture(scope="session")
def models_root(tmp_path_factory) -> Path:
    """One model cache for the whole run (the bundled model converts once)."""
    root = os.environ.get("GRPO_TEST_MODELS_ROOT")
    return Path(root) if root else tmp_path_factory.mktemp("models")


@pytest.fixture
def settings_factory(tmp_path, models_root):
    from service.settings import Settings

    def make(database_url: str | None = None, broker_url: str | None = None, **extra):
        return Settings(GRPO_DATA_DIR=tmp_path, DATABASE_URL=database_url, BROKER_URL=broker_url,
                        GRPO_MODELS_ROOT=models_root, **extra)

    return make


@pytest.fixture
def artifacts_dir() -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS


def _digit_share(completion, answers):
    """A reward a 2-layer random model can learn fast: the share of digits in its completion."""
    return sum(ch.isdigit() for ch in completion) / max(1, len(completion))


@pytest.fixture
def digit_reward(monkeypatch):
    """Registers `digit_share`, a dense reward with spread even for random models."""
    from service import reward_specs
    from worker import rewards as R

    monkeypatch.setitem(R.REGISTRY, "digit_share", R.RewardInfo(_digit_share))
    monkeypatch.setitem(reward_specs.BUILTIN_REWARDS, "digit_share", "share of digits in the completion (tests)")


from fastapi.testclient import TestClient  # noqa: E402

from service.app import create_app  # noqa: E402
from service.store import keys as keys_q  # noqa: E402
from service.store.db import session_scope  # noqa: E402
from service.store.migrate import upgrade  # noqa: E402


class Api:
    """A TestClient on a migrated store with two owners' keys."""

    def __init__(self, settings):
        self.settings = settings
        upgrade(settings.store_url)
        with session_scope(settings.store_url) as s:
            self.alice = keys_q.create_key(s, owner="alice")
            self.bob = keys_q.create_key(s, owner="bob")
        self.client = TestClient(create_app(settings))

    def auth(self, key=None):
        return {"Authorization": f"Bearer {key or self.alice}"}

    def get(self, path, key=None, **kw):
        return self.client.get(path, headers={**self.auth(key), **kw.pop("headers", {})}, **kw)

    def post(self, path, key=None, **kw):
        return self.client.post(path, headers={**self.auth(key), **kw.pop("headers", {})}, **kw)

    def run_job(self, spec: dict) -> int:
        """Submit `spec` over HTTP, run it in this process as a worker would, expect success; the job id."""
        from worker import runner

        r = self.post("/v1/jobs", json=spec)
        assert r.status_code == 201, r.text
        jid = r.json()["id"]
        assert runner.run_job(jid, settings=self.settings) == "succeeded"
        return jid


@pytest.fixture(params=["sqlite", "postgres"])
def api(request, settings_factory):
    url = request.getfixturevalue("pg_url") if request.param == "postgres" else None
    return Api(settings_factory(database_url=url))


@pytest.fixture
def sqlite_api(settings_factory):
    return Api(settings_factory())

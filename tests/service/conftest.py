import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.store import keys as keys_q
from service.store.db import session_scope
from service.store.migrate import upgrade


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


@pytest.fixture(params=["sqlite", "postgres"])
def api(request, settings_factory):
    url = request.getfixturevalue("pg_url") if request.param == "postgres" else None
    return Api(settings_factory(database_url=url))


@pytest.fixture
def sqlite_api(settings_factory):
    return Api(settings_factory())

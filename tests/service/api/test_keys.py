"""API keys: expiry, revocation (with the stream tokens made from them), last use, and the CLI."""

from __future__ import annotations

from datetime import timedelta

from click.testing import CliRunner
from sqlalchemy import update

from service.store import keys as keys_q
from service.store.db import session_scope
from service.store.models import ApiKey, utcnow


def test_expired_and_revoked_keys_stop_working(api):
    jid = api.post("/v1/jobs", json={"kind": "grpo"}).json()["id"]
    token = api.post(f"/v1/jobs/{jid}/stream-token").json()["token"]
    with session_scope(api.settings.store_url) as s:
        mine = [k for k in keys_q.list_keys(s, owner="alice")][-1]
        assert mine.last_used_at is not None  # the requests above touched it
        expiring = keys_q.create_key(s, owner="alice", expires_in=timedelta(hours=1))
    assert api.get("/v1/jobs", key=expiring).status_code == 200
    with session_scope(api.settings.store_url) as s:
        s.execute(update(ApiKey).where(ApiKey.key_hash == keys_q._hash(expiring))
                  .values(expires_at=utcnow() - timedelta(seconds=1)))
    assert api.get("/v1/jobs", key=expiring).status_code == 401
    with session_scope(api.settings.store_url) as s:
        assert keys_q.revoke_key(s, key_id=mine.id)
        assert not keys_q.revoke_key(s, key_id=mine.id)  # once
    assert api.get("/v1/jobs").status_code == 401
    assert api.client.get(f"/v1/jobs/{jid}/stream", params={"access_token": token}).status_code == 401


def test_keys_cli_creates_lists_and_revokes(tmp_path, monkeypatch):
    from service import cli
    from service.core.settings import get_settings

    monkeypatch.setenv("GRPO_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("DATABASE_URL", raising=False)
    get_settings.cache_clear()
    try:
        runner = CliRunner()
        bad = runner.invoke(cli.main, ["keys", "create", "--owner", "../alice"])
        assert bad.exit_code != 0 and "--owner" in bad.output
        made = runner.invoke(cli.main, ["keys", "create", "--owner", "alice", "--expires-in-days", "30"])
        assert made.exit_code == 0, made.output
        key = made.output.strip()
        listed = runner.invoke(cli.main, ["keys", "list"])
        assert listed.exit_code == 0 and "alice" in listed.output and key[:10] in listed.output
        assert key not in listed.output  # only the prefix is ever shown
        revoked = runner.invoke(cli.main, ["keys", "revoke", "1"])
        assert revoked.exit_code == 0 and "revoked" in revoked.output
        assert "revoked" in runner.invoke(cli.main, ["keys", "list", "--owner", "alice"]).output
        assert runner.invoke(cli.main, ["keys", "revoke", "1"]).exit_code != 0
    finally:
        get_settings.cache_clear()

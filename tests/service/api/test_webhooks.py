"""Webhooks over the API: registered under the admin's allow-list, kept apart between owners, and
delivered signed, retried after an error, with every attempt visible (SQLite and PostgreSQL)."""

from __future__ import annotations

import socket
import threading
import time
from datetime import UTC, datetime

import pytest
from sqlalchemy import update

from service import webhook_delivery
from service.store import webhooks as webhooks_q
from service.store.db import session_scope
from service.store.models import WebhookDelivery
from service.webhook_delivery import deliver_once
from tests.conftest import Api
from tests.webhook_receiver import WebhookReceiver

TINY = {"kind": "grpo", "model": {"name": "tiny-random-llama", "lora": {"r": 4}},
        "dataset": {"name": "arith", "num_train": 20, "num_val": 2},
        "grpo": {"steps": 2, "prompts_per_step": 2, "num_generations": 2, "max_new_tokens": 4, "eval_prompts": 2}}


@pytest.fixture
def receiver():
    r = WebhookReceiver(fail_first=1)
    yield r
    r.close()


@pytest.fixture(params=["sqlite", "postgres"])
def hooked(request, settings_factory, receiver):
    url = request.getfixturevalue("pg_url") if request.param == "postgres" else None
    return Api(settings_factory(database_url=url, GRPO_WEBHOOK_URLS=f"{receiver.base}/hooks"))


def test_a_webhook_is_checked_at_registration_and_belongs_to_its_owner(hooked, receiver):
    for url, why in [("http://10.0.0.1/hooks", "not on the admin's allow-list (GRPO_WEBHOOK_URLS"),
                     (f"{receiver.base}/hooks/../other", "not on the admin's allow-list"),
                     (f"http://user:pw@{receiver.base.removeprefix('http://')}/hooks", "userinfo")]:
        r = hooked.post("/v1/webhooks", json={"url": url})
        assert r.status_code == 422 and r.json()["detail"][0]["field"] == "url" and why in r.text, r.text
    r = hooked.post("/v1/webhooks", json={"url": f"{receiver.base}/hooks/a", "events": ["job.bogus"]})
    assert r.status_code == 422 and r.json()["detail"][0]["field"] == "events.0"
    assert hooked.get("/v1/webhooks").json() == []  # nothing refused was stored
    made = hooked.post("/v1/webhooks", json={"url": f"{receiver.base}/hooks/a", "events": ["job.failed"]})
    assert made.status_code == 201 and made.json()["secret"].startswith("whsec_"), made.text
    listed = hooked.get("/v1/webhooks").json()
    assert [(h["id"], h["events"]) for h in listed] == [(made.json()["id"], ["job.failed"])]
    assert "secret" not in listed[0]  # shown once
    hid = made.json()["id"]
    assert hooked.get("/v1/webhooks", key=hooked.bob).json() == []
    assert hooked.get(f"/v1/webhooks/{hid}/deliveries", key=hooked.bob).status_code == 404
    assert hooked.delete(f"/v1/webhooks/{hid}", key=hooked.bob).status_code == 404
    assert hooked.delete(f"/v1/webhooks/{hid}").status_code == 204
    assert hooked.get("/v1/webhooks").json() == []


def test_a_jobs_end_and_its_red_flag_are_delivered_signed_and_retried_after_an_error(hooked, receiver):
    made = hooked.post("/v1/webhooks", json={"url": f"{receiver.base}/hooks"}).json()
    only_failures = hooked.post("/v1/webhooks", json={"url": f"{receiver.base}/hooks/f", "events": ["job.failed"]})
    theirs = hooked.post("/v1/webhooks", key=hooked.bob, json={"url": f"{receiver.base}/hooks"}).json()
    jid = hooked.run_job(TINY)  # a random model: every group ties, informative_groups turns red at step 1
    deliveries = hooked.get(f"/v1/webhooks/{made['id']}/deliveries").json()
    events = [d["event"] for d in deliveries]  # every red flag (informative_groups first), then the outcome
    assert events[-1] == "job.succeeded" and set(events[:-1]) == {"job.health"} and len(events) >= 2, events
    assert all(d["status"] == "pending" and d["attempts"] == 0 and d["job_id"] == jid for d in deliveries)
    assert hooked.get(f"/v1/webhooks/{only_failures.json()['id']}/deliveries").json() == []
    assert hooked.get(f"/v1/webhooks/{theirs['id']}/deliveries", key=hooked.bob).json() == []  # not bob's job

    assert deliver_once(hooked.settings) == len(events)  # the receiver answers the first request with a 500
    first, *rest = hooked.get(f"/v1/webhooks/{made['id']}/deliveries").json()
    assert (first["status"], first["attempts"], first["last_status"], first["last_error"]) == (
        "pending", 1, 500, "answered HTTP 500")
    assert datetime.fromisoformat(first["next_attempt_at"]) > datetime.now(UTC)  # backing off
    assert all((d["status"], d["attempts"], d["last_status"]) == ("delivered", 1, 200) for d in rest)
    assert deliver_once(hooked.settings) == 0  # nothing due until the backoff has passed
    with session_scope(hooked.settings.store_url) as s:
        s.execute(update(WebhookDelivery).where(WebhookDelivery.id == first["id"])
                  .values(next_attempt_at=datetime.now(UTC)))
    assert deliver_once(hooked.settings) == 1
    first = hooked.get(f"/v1/webhooks/{made['id']}/deliveries").json()[0]
    assert (first["status"], first["attempts"], first["next_attempt_at"]) == ("delivered", 2, None)

    got = receiver.received
    assert [r.delivery_id for r in got] == [first["id"], *(d["id"] for d in rest), first["id"]]
    assert all(r.signed_by(made["secret"]) for r in got) and not got[0].signed_by(theirs["secret"])
    done = got[-2]
    tampered = done.body.replace(b"succeeded", b"failed")
    assert not type(done)(done.delivery_id, done.timestamp, done.signature, tampered).signed_by(made["secret"])
    health = got[-1].event
    assert health["type"] == "job.health" and health["data"]["event"]["data"]["guard"] == "informative_groups"
    assert done.event["type"] == "job.succeeded" and done.event["data"]["job"] == {
        "id": jid, "uid": done.event["data"]["job"]["uid"], "name": None, "kind": "grpo", "status": "succeeded",
        "step": 2, "total_steps": 2}


class Hostile:
    """A receiver on loopback that misbehaves as `how` says: `drip` answers a status line, then a byte of its
    headers every 0.5 s; `silent` reads the request and never answers; `huge` answers 200 with a 50 MB body."""

    def __init__(self, how: str) -> None:
        self.how, self.conns = how, []
        self.server = socket.create_server(("127.0.0.1", 0))
        self.base = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        try:
            conn.recv(65536)
            if self.how == "drip":
                conn.sendall(b"HTTP/1.1 200 OK\r\n")
                while True:
                    conn.sendall(b"X")
                    time.sleep(0.5)
            elif self.how == "huge":
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 52428800\r\n\r\n")
                chunk = b"x" * 65536
                for _ in range(800):
                    conn.sendall(chunk)
            else:
                time.sleep(60)
        except OSError:  # the deliverer hung up: what a receiver sees once its time is up
            pass

    def close(self) -> None:
        self.server.close()
        for conn in self.conns:
            conn.close()


def _pending(s, hook, n: int) -> list[int]:
    rows = [WebhookDelivery(webhook_id=hook.id, job_id=0, event="job.succeeded", status="pending", attempts=0,
                            payload={"type": "job.succeeded", "data": {}}, next_attempt_at=datetime.now(UTC))
            for _ in range(n)]
    s.add_all(rows)
    s.flush()
    return [r.id for r in rows]


@pytest.mark.parametrize("db", ["sqlite", "postgres"])
def test_no_receiver_holds_the_deliverer_and_another_owners_deliveries_go_out_at_once(db, request, settings_factory,
                                                                                     receiver):
    """One owner's receivers drip, never answer, or answer 50 MB; another owner's healthy receiver gets each of
    its deliveries within a round of it being due, while theirs are in flight. Each send has one deadline for
    the whole exchange, and no answer's body is read."""
    hostile = {how: Hostile(how) for how in ("drip", "silent", "huge")}
    allowed = ",".join([f"{receiver.base}/hooks"] + [f"{h.base}/hooks" for h in hostile.values()])
    url = request.getfixturevalue("pg_url") if db == "postgres" else None
    settings = settings_factory(database_url=url, GRPO_WEBHOOK_URLS=allowed, GRPO_WEBHOOK_TIMEOUT_S="2")
    Api(settings)  # migrated
    with session_scope(settings.store_url) as s:
        theirs = {how: webhooks_q.create_webhook(s, owner="alice", url=f"{h.base}/hooks", events=["job.succeeded"])
                  for how, h in hostile.items()}
        healthy = webhooks_q.create_webhook(s, owner="bob", url=f"{receiver.base}/hooks", events=["job.succeeded"])
        slow_ids = {how: _pending(s, hook, 3) for how, hook in theirs.items()}
        first = _pending(s, healthy, 1)
    receiver.received.clear()
    sender = webhook_delivery.deliverer(settings)
    started = time.monotonic()
    sender.start()
    try:
        while len(receiver.received) < 1 and time.monotonic() - started < 30:
            time.sleep(0.05)
        took_first = time.monotonic() - started  # fail_first=1: a 500, retried after its backoff
        while _delivery(settings, first[0]).attempts < 1:  # recorded, before it is made due again
            time.sleep(0.05)
        with session_scope(settings.store_url) as s:
            s.execute(update(WebhookDelivery).where(WebhookDelivery.id == first[0])
                      .values(next_attempt_at=datetime.now(UTC)))
            second = _pending(s, healthy, 1)  # due while alice's are in flight
        due = time.monotonic()
        while len(receiver.received) < 3 and time.monotonic() - due < 30:
            time.sleep(0.05)
        took_second = time.monotonic() - due
        assert sorted(r.delivery_id for r in receiver.received[1:]) == sorted(first + second)
        assert took_first < 1.5 + webhook_delivery.POLL_S and took_second < 1.5 + webhook_delivery.POLL_S, (
            took_first, took_second)
        tried = lambda: [d for ids in slow_ids.values() for d in ids if _delivery(settings, d).attempts]  # noqa: E731
        deadline = time.monotonic() + 30
        while len(tried()) < 9 and time.monotonic() < deadline:
            time.sleep(0.2)
        spent = time.monotonic() - started
    finally:
        sender.stop()
        for h in hostile.values():
            h.close()
    # three deliveries a receiver, one after another, 2 s each at most: the three receivers side by side
    assert len(tried()) == 9 and spent < 3 * 2 + 3 * webhook_delivery.POLL_S + 3, spent
    for how in ("drip", "silent"):
        for d in slow_ids[how]:
            got = _delivery(settings, d)
            assert got.last_error == "no whole answer within 2 s (GRPO_WEBHOOK_TIMEOUT_S)", (how, got.last_error)
    assert all(_delivery(settings, d).status == "delivered" for d in slow_ids["huge"])  # its body never read


def _delivery(settings, delivery_id: int) -> WebhookDelivery:
    with session_scope(settings.store_url) as s:
        d = s.get(WebhookDelivery, delivery_id)
        s.expunge(d)
        return d

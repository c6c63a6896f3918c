"""A webhook receiver on loopback that checks every delivery's signature as a user's would, and can
answer the first requests with an error to make the sender retry."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from service.core import webhooks as hooks


@dataclass(frozen=True)
class Received:
    delivery_id: int
    timestamp: int
    signature: str
    body: bytes

    @property
    def event(self) -> dict:
        return json.loads(self.body)

    def signed_by(self, secret: str) -> bool:
        return hooks.verify(secret, self.timestamp, self.body, self.signature)


class WebhookReceiver:
    def __init__(self, *, fail_first: int = 0) -> None:
        self.received: list[Received] = []
        self.answered: list[int] = []
        state = {"left": fail_first}
        lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with lock:
                    status = 500 if state["left"] > 0 else 200
                    state["left"] -= 1
                    outer.received.append(Received(int(self.headers[hooks.DELIVERY_ID]),
                                                   int(self.headers[hooks.TIMESTAMP]), self.headers[hooks.SIGNATURE],
                                                   body))
                    outer.answered.append(status)
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait_for(self, event_type: str, job_id: int, timeout: float = 60) -> Received:
        deadline = time.time() + timeout
        while time.time() < deadline:
            for r, status in zip(list(self.received), list(self.answered)):
                if status == 200 and r.event["type"] == event_type and r.event["data"]["job"]["id"] == job_id:
                    return r
            time.sleep(0.2)
        raise AssertionError(f"no {event_type} delivery for job {job_id}: {[r.event['type'] for r in self.received]}")

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

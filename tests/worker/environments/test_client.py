"""A session with an OpenEnv server: a bundled one (openenv-core's own server) and hostile ones that
answer too much, too slowly, garbage, or not at all. Each ends the episode with a readable error, in
bounded time."""

import asyncio
import json
import threading
import time

import pytest
from websockets.asyncio.server import serve

from worker.environments.client import EnvironmentFailed, Session
from worker.environments.servers import BundledServer


@pytest.fixture(scope="module")
def calculator(tmp_path_factory):
    server = BundledServer("calculator", tmp_path_factory.mktemp("env") / "calculator.log")
    url = server.start()
    yield url
    server.stop()


def _play(url, *steps, seed=7, timeout_s=5.0, max_bytes=1 << 20):
    async def main():
        async with Session(url, timeout_s=timeout_s, max_bytes=max_bytes) as env:
            out = [await env.reset(seed)]
            for action in steps:
                out.append(await env.step(action))
            return out

    return asyncio.run(main())


def test_an_episode_in_a_bundled_environment(calculator):
    first, calc, answer = _play(calculator, {"message": "<calc>(17 + 3) * 2</calc>"}, {"message": "<answer>1</answer>"})
    assert "<calc>" in first.observation["message"] and not first.done and first.reward is None
    assert calc.observation["message"] == "= 40" and calc.observation["tool_call"] and calc.reward == 0.0
    assert answer.done and answer.reward == 0.1  # well formed, wrong
    again = _play(calculator, seed=7)[0]
    assert again.observation == first.observation  # the task is the seed's


class Hostile:
    """A WebSocket server on loopback whose answer to a step is `answer(message)` (None: no answer)."""

    def __init__(self, answer):
        self.answer, self.port = answer, 0
        self.ready, self.stop = threading.Event(), None
        threading.Thread(target=asyncio.run, args=(self._main(),), daemon=True).start()
        assert self.ready.wait(10)

    async def _main(self):
        self.stop = asyncio.Event()

        async def handler(ws):
            async for raw in ws:
                msg = json.loads(raw)
                if msg["type"] == "reset":
                    await ws.send(json.dumps({"type": "observation", "data": {"observation": {"message": "hi"}}}))
                elif msg["type"] == "step":
                    await self.answer(ws)

        async with serve(handler, "127.0.0.1", 0, max_size=None) as server:
            self.port = server.sockets[0].getsockname()[1]
            self.ready.set()
            await self.stop.wait()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"


async def _huge(ws):
    await ws.send(json.dumps({"type": "observation", "data": {"observation": {"message": "x" * 10_000_000}}}))


async def _slow(ws):
    await asyncio.sleep(9.0)  # longer than the session waits
    await ws.send("late")


async def _garbage(ws):
    await ws.send("\x00not json{")


async def _error(ws):
    await ws.send(json.dumps({"type": "error", "data": {"message": "tool crashed", "code": "EXECUTION_ERROR"}}))


async def _nan(ws):
    await ws.send('{"type": "observation", "data": {"observation": {}, "reward": NaN}}')


async def _closes(ws):
    await ws.close()


# Only the slow server needs a short timeout (its answer comes after 9 s). With 1 s for every case, the session's
# handshake, bounded by the same timeout, sometimes took longer on a loaded CI machine and the case failed on that.
@pytest.mark.parametrize(("answer", "why", "timeout_s"), [
    (_huge, "larger than 1048576 bytes", 4.0), (_slow, "no answer to step within 1 s", 1.0),
    (_garbage, "not JSON", 4.0), (_error, "an error: tool crashed", 4.0), (_nan, "not a finite number", 4.0),
    (_closes, "closed the session", 4.0)])
def test_a_hostile_answer_ends_the_episode_readably_and_in_bounded_time(answer, why, timeout_s):
    server = Hostile(answer)
    start = time.monotonic()
    with pytest.raises(EnvironmentFailed, match=why):
        _play(server.url, {"message": "x"}, timeout_s=timeout_s)
    assert time.monotonic() - start < 5.0


def test_a_server_that_is_not_there_fails_the_session():
    with pytest.raises(EnvironmentFailed, match="could not open a session"):
        _play("http://127.0.0.1:9", timeout_s=1.0)


def test_a_session_that_cannot_open_in_time_says_it_timed_out():
    """A handshake the server never answers: the reason names the timeout, not an empty message."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts the TCP connection, never the handshake
        port = silent.getsockname()[1]
        with pytest.raises(EnvironmentFailed, match=r"could not open a session at ws://127\.0\.0\.1:\d+/ws: \w+"):
            _play(f"http://127.0.0.1:{port}", timeout_s=0.5)

"""One episode's session with an OpenEnv server, over its WebSocket protocol.

OpenEnv's own client (`openenv.core.EnvClient`) speaks the same messages; this one is a few lines of
`websockets` because the worker needs what that client leaves open and must not import what it
brings (its package imports a web UI and an MCP stack, ~10 s per process): every message capped in
size (`max_size`, the admin's GRPO_ENVIRONMENT_MAX_MESSAGE_BYTES), every answer bounded in time
(a slow drip cannot hold the step), and the server's errors raised as one exception type.

Messages (JSON text frames on `<url>/ws`): `{"type": "reset", "data": {"seed": ...}}` and
`{"type": "step", "data": <action>}` are answered `{"type": "observation", "data": {"observation": {...},
"reward": r, "done": d}}`, or `{"type": "error", "data": {"message", "code"}}`; `{"type": "close"}` ends
the session. MCP tools (OpenEnv RFC 003) travel in the same session as JSON-RPC 2.0:
`{"type": "mcp", "data": {"jsonrpc": "2.0", "id": n, "method": "tools/list" | "tools/call", "params": ...}}`,
answered `{"type": "mcp", "data": {"id": n, "result": ...}}` or `{..., "error": {"code", "message"}}`.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, PayloadTooBig, WebSocketException


class EnvironmentFailed(RuntimeError):
    """The environment could not answer: down, too slow, too large, garbled, or it said it failed."""


class EnvironmentBusy(EnvironmentFailed):
    """The server refused a new session: every one of its slots (`max_concurrent_envs`) is taken, or it
    closed the session before answering its first reset. Another try may find a slot free."""


class EnvironmentDown(EnvironmentFailed):
    """The server could not start a single episode (down, or refusing sessions): the attempt, not one
    episode, has failed."""


@dataclass(frozen=True)
class ToolResult:
    """A tool call's answer: its text for the model, and whether the tool failed (a JSON-RPC error, or a
    result marked as an error); the text then says why."""

    text: str
    error: bool


@dataclass(frozen=True)
class StepResult:
    observation: dict[str, Any]
    reward: float | None
    done: bool


def ws_url(base: str) -> str:
    """The session endpoint of an OpenEnv server at `base` (http(s)://host:port/path)."""
    scheme, rest = base.split("://", 1)
    return f"{'wss' if scheme == 'https' else 'ws'}://{rest.rstrip('/')}/ws"


class Session:
    """One episode's session (`async with Session(...) as env:` then `reset`, `step`)."""

    def __init__(self, base_url: str, *, timeout_s: float, max_bytes: int) -> None:
        self.url, self.timeout_s, self.max_bytes = ws_url(base_url), timeout_s, max_bytes
        self._ws: ClientConnection | None = None
        self.answered = False  # the server has answered a message of this session
        self._rpc_id = 0

    async def __aenter__(self) -> Session:
        try:
            self._ws = await asyncio.wait_for(
                connect(self.url, max_size=self.max_bytes, open_timeout=self.timeout_s, proxy=None),
                self.timeout_s)
        except (OSError, TimeoutError, WebSocketException) as exc:
            raise EnvironmentFailed(f"could not open a session at {self.url}: {str(exc) or type(exc).__name__}") from None
        return self

    async def __aexit__(self, *exc: object) -> None:
        ws, self._ws = self._ws, None
        if ws is None:
            return
        try:  # the server closes the connection on `close`; closing it first from here races its close
            await asyncio.wait_for(ws.send(json.dumps({"type": "close"})), 1.0)
            await asyncio.wait_for(ws.wait_closed(), 2.0)
        except (OSError, TimeoutError, WebSocketException):
            pass
        try:
            await asyncio.wait_for(ws.close(), 2.0)
        except (OSError, TimeoutError, WebSocketException):
            pass

    async def _call(self, message: dict[str, Any]) -> StepResult:
        return parse_answer(await self._exchange(message), message["type"])

    async def _exchange(self, message: dict[str, Any]) -> str | bytes:
        """`message` sent, and the server's answer as it came."""
        if self._ws is None:
            raise EnvironmentFailed("the session is closed")
        try:
            await asyncio.wait_for(self._ws.send(json.dumps(message)), self.timeout_s)
            raw = await asyncio.wait_for(self._ws.recv(), self.timeout_s)
        except TimeoutError:
            raise EnvironmentFailed(f"no answer to {message['type']} within {self.timeout_s:g} s") from None
        except PayloadTooBig:
            raise EnvironmentFailed(f"its answer to {message['type']} is larger than {self.max_bytes} bytes") from None
        except ConnectionClosed as exc:
            if isinstance(exc.__cause__, PayloadTooBig):
                raise EnvironmentFailed(f"its answer to {message['type']} is larger than {self.max_bytes} bytes") \
                    from None
            closed = f"the server closed the session ({exc.rcvd.code if exc.rcvd else 'no close frame'})"
            if not self.answered:  # refused before it answered anything: what a server at capacity does
                raise EnvironmentBusy(f"{closed} before answering {message['type']}") from None
            raise EnvironmentFailed(closed) from None
        except (OSError, WebSocketException) as exc:
            raise EnvironmentFailed(f"the session failed: {exc}") from None
        self.answered = True
        return raw

    async def reset(self, seed: int, split: str | None = None) -> StepResult:
        """A new episode from `seed`; with `split`, the Task API's task `seed` of that split (reset(split, index))."""
        task = {} if split is None else {"split": split, "index": seed}
        return await self._call({"type": "reset", "data": {"seed": seed, **task}})

    async def step(self, action: dict[str, Any]) -> StepResult:
        return await self._call({"type": "step", "data": action})

    async def _rpc(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        """A JSON-RPC call to the session's MCP server: its `data` (with `result` or `error`)."""
        self._rpc_id += 1
        raw = await self._exchange({"type": "mcp", "data": {"jsonrpc": "2.0", "id": self._rpc_id, "method": method,
                                                            "params": params}})
        msg = decoded(raw, method)
        data = msg.get("data")
        if msg.get("type") != "mcp" or not isinstance(data, dict) or ("result" not in data and "error" not in data):
            raise EnvironmentFailed(f"its answer to {method} is not an MCP message")
        return data

    async def list_tools(self) -> list[dict[str, Any]]:
        """The server's MCP tools (`tools/list`): name, description, input schema each."""
        data = await self._rpc("tools/list", {})
        tools = data.get("result", {}).get("tools") if isinstance(data.get("result"), dict) else None
        if not isinstance(tools, list) or not all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                                  for t in tools):
            error = data.get("error")
            said = error.get("message") if isinstance(error, dict) else error
            raise EnvironmentFailed(f"it has no MCP tool list: {str(said)[:300]}")
        return tools

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        """One MCP tool call (`tools/call`). A tool's failure is the model's to read, not the episode's."""
        data = await self._rpc("tools/call", {"name": name, "arguments": arguments})
        if isinstance(error := data.get("error"), dict) or error is not None:
            said = error.get("message") if isinstance(error, dict) else error
            return ToolResult(text=f"error: {str(said)[:2000]}", error=True)
        result = data.get("result")
        if not isinstance(result, dict):
            return ToolResult(text=str(result), error=False)
        parts = [c.get("text", "") if c.get("type") == "text" else f"[{c.get('type')} content]"
                 for c in result.get("content") or [] if isinstance(c, dict)]
        failed = bool(result.get("isError", result.get("is_error", False)))
        return ToolResult(text="\n".join(parts), error=failed)


def decoded(raw: str | bytes, asked: str) -> dict[str, Any]:
    """A server's message as a JSON object; EnvironmentFailed for anything else, or for an `error` message
    (EnvironmentBusy when it says every session slot is taken)."""
    try:
        msg = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise EnvironmentFailed(f"its answer to {asked} is not JSON") from None
    if not isinstance(msg, dict):
        raise EnvironmentFailed(f"its answer to {asked} is not a JSON object")
    data = msg.get("data")
    if msg.get("type") == "error":
        detail = data.get("message") if isinstance(data, dict) else None
        if isinstance(data, dict) and data.get("code") == "CAPACITY_REACHED":
            raise EnvironmentBusy(f"the server is at capacity: {str(detail)[:300]}")
        raise EnvironmentFailed(f"it answered {asked} with an error: {str(detail)[:300]}")
    return msg


def parse_answer(raw: str | bytes, asked: str) -> StepResult:
    """An observation message as a StepResult; EnvironmentFailed for an error or anything malformed."""
    msg = decoded(raw, asked)
    data = msg.get("data")
    if msg.get("type") != "observation" or not isinstance(data, dict) or not isinstance(data.get("observation"), dict):
        raise EnvironmentFailed(f"its answer to {asked} is not an observation message")
    reward = data.get("reward")
    if reward is not None and (not isinstance(reward, (int, float)) or not math.isfinite(reward)):  # a bool counts 0/1
        raise EnvironmentFailed(f"its reward for {asked} is not a finite number: {str(reward)[:40]}")
    return StepResult(observation=data["observation"], reward=None if reward is None else float(reward),
                      done=bool(data.get("done", False)))


@dataclass
class Slots:
    """The sessions a step holds open on one server: now, the most at once, and refusals waited out."""

    open: int = 0
    most: int = 0
    refused: int = 0


BACKOFF_S = (0.05, 2.0)  # the first wait after a refusal, and the longest


@asynccontextmanager
async def opened(url: str, seed: int, *, timeout_s: float, max_bytes: int, slots: Slots,
                 split: str | None = None) -> AsyncIterator[tuple[Session, StepResult]]:
    """A session reset to `seed` (of `split`'s tasks, with the Task API), closed on leaving. A refusal
    (EnvironmentBusy: every slot taken) is waited out, backing off from 50 ms to 2 s: for as long as the step
    holds another session on the server (its episodes end and free their slots), else for `timeout_s`; then
    EnvironmentBusy."""
    wait, waited = BACKOFF_S[0], 0.0
    while True:
        session = Session(url, timeout_s=timeout_s, max_bytes=max_bytes)
        await session.__aenter__()
        try:
            first = await session.reset(seed, split)
            break
        except EnvironmentBusy:
            await session.__aexit__(None, None, None)
            slots.refused += 1
            if slots.open == 0 and waited >= timeout_s:
                raise
            await asyncio.sleep(wait * random.uniform(0.5, 1.0))  # jittered: refused episodes do not retry in step
            waited, wait = waited + wait, min(wait * 2, BACKOFF_S[1])
        except BaseException:
            await session.__aexit__(None, None, None)
            raise
    slots.open += 1
    slots.most = max(slots.most, slots.open)
    try:
        yield session, first
    finally:
        slots.open -= 1
        await session.__aexit__(None, None, None)

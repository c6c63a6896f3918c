"""Request bodies within their limits, however they are sent."""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import AbstractContextManager

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class _TooLarge(Exception):
    pass


def _too_large(exc: BaseException) -> bool:
    if isinstance(exc, BaseExceptionGroup):
        return exc.subgroup(_TooLarge) is not None
    return isinstance(exc, _TooLarge)


class BodySizeLimit:
    """413 for bodies over the limit, whether or not the client sent Content-Length.

    The body is read (up to the limit) before the app sees it, so an oversize chunked body is a
    413 on every route, never a parse error half-way through. Uploads (`streamed` paths) are not
    buffered: they stream to the route under their own, larger limit, and going past it ends the
    request with the same 413."""

    def __init__(self, app: ASGIApp, max_bytes: int, streamed: dict[str, int] | None = None,
                 gates: dict[str, Callable[[], AbstractContextManager[str | None]]] | None = None) -> None:
        self.app, self.max_bytes, self.streamed, self.gates = app, max_bytes, streamed or {}, gates or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        limit = self.streamed.get(scope["path"].rstrip("/")) if scope["method"] == "POST" else None
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > (limit or self.max_bytes):
            return await self._reject(send, limit or self.max_bytes)
        if limit is not None and (gate := self.gates.get(scope["path"].rstrip("/"))) is not None:
            with gate() as refused:  # a slot before the first byte is read: 429 without reading the body
                if refused is not None:
                    return await self._reject(send, limit, status=429, detail=refused)
                return await self._stream(scope, receive, send, limit)
        if limit is not None:
            return await self._stream(scope, receive, send, limit)
        chunks, seen = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > self.max_bytes:
                return await self._reject(send, self.max_bytes)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # after the body: wait for the disconnect as the app expects

        await self.app(scope, replay, send)

    async def _stream(self, scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        seen, started, over = 0, False, False

        async def counted() -> Message:
            nonlocal seen, over
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit:
                over = True
                raise _TooLarge
            return message

        async def sending(message: Message) -> None:
            nonlocal started
            if over:  # the app answered the cut-off body (as a parse error): answer 413 instead
                if not started and message["type"] == "http.response.start":
                    started = True
                    await self._reject(send, limit)
                return
            started = True
            await send(message)

        try:
            await self.app(scope, counted, sending)
        except Exception as exc:  # a middleware's task group may wrap it in an ExceptionGroup
            if not _too_large(exc):
                raise
            if not started:
                await self._reject(send, limit)

    async def _reject(self, send: Send, limit: int, *, status: int = 413, detail: str | None = None) -> None:
        body = json.dumps({"detail": detail or f"request body larger than {limit} bytes"}).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        if status == 429:
            headers.append((b"retry-after", b"2"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

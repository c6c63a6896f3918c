"""`retrieve_future`: an operation's result once its worker wrote it, polled without holding a
thread or a connection."""

from __future__ import annotations

import asyncio
import time

from fastapi import HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response

from service.api.deps import ReleasedOwnerDep, SettingsDep
from service.api.schemas import error_responses
from service.api.tinker.schemas import PROTOBUF, RETRIEVE_WAIT_S, tinker_router
from service.core.records import OpState
from service.core.tinker.requests import RetrieveFutureIn
from service.core.tinker.sampling import sample_response_json
from service.core.tinker.wire import forward_backward_output_json
from service.store import session_ops as ops_q
from service.store.db import session_scope

router = tinker_router()


@router.post("/retrieve_future", response_class=Response, responses=error_responses(404) | {200: {
    "description": "The result as JSON: `{error, category}` when the operation failed, `{type: try_again}` while "
    "it is pending. A forward_backward or sample result is protobuf (`ForwardBackwardOutput`, `SampleResponse`) "
    "only when the request's Accept header asks for application/x-protobuf (the tinker SDK does), JSON otherwise.",
    "content": {PROTOBUF: {"schema": {"type": "string", "format": "binary"}}, "application/json": {"schema": {
        "type": "object"}}}}})
async def retrieve_future(body: RetrieveFutureIn, request: Request, owner: ReleasedOwnerDep,
                          settings: SettingsDep) -> Response:
    """The operation's result once its worker wrote it: protobuf for forward_backward, JSON otherwise;
    `{error, category}` when it failed; `try_again` while it is pending after a wait of up to
    RETRIEVE_WAIT_S, polled without holding a thread or a connection."""
    deadline, pause = time.monotonic() + RETRIEVE_WAIT_S, 0.002
    while True:
        op = await run_in_threadpool(_op_state, settings, body.request_id, owner)
        if op is None:
            raise HTTPException(404, f"request {body.request_id} not found")
        if op.status == "done":
            result = op.result or b""  # a done operation always has one
            if op.result_format != "proto":
                return Response(result, media_type="application/json")
            if PROTOBUF in request.headers.get("accept", ""):
                return Response(result, media_type=PROTOBUF)
            as_json = sample_response_json if op.kind == "sample" else forward_backward_output_json
            return JSONResponse(await run_in_threadpool(as_json, result))
        if op.status == "failed":
            return JSONResponse({"error": op.error, "category": op.category})
        if time.monotonic() >= deadline:
            return JSONResponse({"type": "try_again", "request_id": body.request_id, "queue_state": "active"})
        await asyncio.sleep(pause)
        pause = min(pause * 1.25, 0.1)  # a 20 ms operation is answered within ~5 ms of its end


def _op_state(settings, request_id: str, owner: str) -> OpState | None:
    with session_scope(settings.store_url, read_only=True) as session:
        op = ops_q.op_for(session, request_id=request_id, owner=owner)
        return None if op is None else OpState(kind=op.kind, status=op.status, result=op.result,
                                               result_format=op.result_format, error=op.error, category=op.category)


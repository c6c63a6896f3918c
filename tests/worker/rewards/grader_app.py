"""A remote grader as users run one, served by uvicorn in the tests: POST /numeric scores with the
built-in numeric match; /slow never answers in time; /error answers 500; /short returns one score
too few; /auth checks the header the worker adds from its environment; /redirect answers 302 to the
URL in its query; /big answers more bytes than the worker reads; /bomb answers about 50 KB of zstd
that decode to 1 GiB, whatever was asked; /nonfinite scores NaN, Infinity and
1e400. /calls counts what arrived, and whether a secret came with it, per path; /sent how many of /big's
chunks were sent."""

import time

from fastapi import FastAPI, Request
from fastapi.responses import (
    JSONResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)

from worker.rewards.functions import numeric_match

app = FastAPI()
CALLS: dict[str, int] = {}
SENT = {"big_chunks": 0}  # chunks of /big?chunked=true handed to the server to send, in all


@app.middleware("http")
async def count(request: Request, call_next):
    """Every request, by path: off-list tests assert that none arrived."""
    if request.url.path != "/calls":
        key = request.url.path + (" with secret" if request.headers.get("x-grader-key") else "")
        CALLS[key] = CALLS.get(key, 0) + 1
    return await call_next(request)


def _items(body: dict) -> list[dict]:
    return body["items"]


@app.post("/numeric")
async def numeric(request: Request):
    body = await request.json()
    return {"scores": [None if "UNSCORABLE" in it["completion"] else numeric_match(it["completion"], it["answers"])
                       for it in _items(body)]}


@app.post("/digits")
async def digits(request: Request):
    """The share of digits in each completion: the tests' `digit_share`, computed remotely."""
    return {"scores": [sum(ch.isdigit() for ch in it["completion"]) / max(1, len(it["completion"]))
                       for it in _items(await request.json())]}


@app.post("/slow")
async def slow(request: Request):
    time.sleep(2)
    return {"scores": [0.0 for _ in _items(await request.json())]}


@app.post("/error")
async def error(request: Request):
    return JSONResponse({"detail": "boom"}, status_code=500)


@app.post("/short")
async def short(request: Request):
    return {"scores": [1.0 for _ in _items(await request.json())][1:]}


@app.post("/auth")
async def auth(request: Request):
    ok = request.headers.get("x-grader-key") == "s3cret"
    return {"scores": [1.0 if ok else 0.0 for _ in _items(await request.json())]}


@app.post("/redirect")
async def redirect(to: str):
    return RedirectResponse(to, status_code=302)


@app.post("/big")
async def big(request: Request, chunked: bool = False):
    """50 MB of valid JSON, with a Content-Length or (chunked) without one."""
    n = len(_items(await request.json()))
    head, pad = b'{"scores": [' + b"1.0," * (n - 1) + b"1.0]", b" " * 1_000_000
    if chunked:
        def chunks():
            for part in [head, *[pad] * 50, b"}"]:
                SENT["big_chunks"] += 1
                yield part
        return StreamingResponse(chunks(), media_type="application/json")
    return Response(head + pad * 50 + b"}", media_type="application/json")


@app.get("/sent")
async def sent():
    return SENT


@app.post("/bomb")
async def bomb(request: Request):
    """A valid answer padded with 1 GiB of spaces, zstd-compressed (about 50 KB on the wire), sent with
    Content-Encoding: zstd although the worker asked for identity."""
    import zstandard

    n = len(_items(await request.json()))
    c = zstandard.ZstdCompressor()
    # zstd frames decode one after another: a valid answer, then 1024 frames of 1 MiB of spaces each,
    # compressed once (building the bomb costs milliseconds; decoding it would cost 1 GiB)
    pad = c.compress(b" " * 2**20)
    body = c.compress(b'{"scores": [' + b"1.0," * (n - 1) + b"1.0]") + pad * 1024 + c.compress(b"}")
    return Response(body, media_type="application/json", headers={"Content-Encoding": "zstd"})


@app.post("/nonfinite")
async def nonfinite(request: Request):
    n = len(_items(await request.json()))
    return Response(b'{"scores": [NaN, Infinity, 1e400, -Infinity' + b", 0.5" * (n - 4) + b"]}",
                    media_type="application/json")


@app.get("/calls")
async def calls():
    return CALLS

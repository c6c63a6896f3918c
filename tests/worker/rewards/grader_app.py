"""A remote grader as users run one, served by uvicorn in the tests: POST /numeric scores with the
built-in numeric match; /slow never answers in time; /error answers 500; /short returns one score
too few; /auth checks the header the worker adds from its environment."""

import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from worker.rewards.functions import numeric_match

app = FastAPI()
CALLS: dict[str, int] = {}


def _items(body: dict) -> list[dict]:
    return body["items"]


@app.post("/numeric")
async def numeric(request: Request):
    body = await request.json()
    CALLS["numeric"] = CALLS.get("numeric", 0) + 1
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


@app.get("/calls")
async def calls():
    return CALLS

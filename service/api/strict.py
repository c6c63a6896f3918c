"""Strict routing for /v1 and /api/v1: a wrong method gets 405 with every method the path supports in
`Allow`, and an unknown query parameter (a typo like `?limt=5`) is a 422 naming it, as an
unknown field in a spec is. FastAPI's own routing would answer 405 with only the first
matching route's methods, or let the dashboard's catch-all mount answer, and ignores unknown
query parameters."""

from __future__ import annotations

from urllib.parse import parse_qsl

from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.routing import Match
from starlette.types import ASGIApp, Receive, Scope, Send

from service.core.errors import format_errors


class StrictRouting:
    def __init__(self, app: ASGIApp, routes: list, prefix: tuple[str, ...] = ("/v1/", "/api/v1/")) -> None:
        self.app, self.routes, self.prefix = app, routes, prefix
        self._query: dict[int, frozenset[str]] = {}

    def query_names(self, route: APIRoute) -> frozenset[str]:
        if id(route) not in self._query:
            names, todo = set(), [route.dependant]
            while todo:  # the route's own query parameters and those of its dependencies
                dependant = todo.pop()
                names |= {p.alias for p in dependant.query_params}
                todo += dependant.dependencies
            self._query[id(route)] = frozenset(names)
        return self._query[id(route)]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(self.prefix):
            return await self.app(scope, receive, send)
        allowed: set[str] = set()
        for route in self.routes:
            if not isinstance(route, APIRoute):
                continue
            match, _ = route.matches(scope)
            if match is Match.FULL:
                unknown = sorted({k for k, _ in parse_qsl(scope["query_string"].decode("latin-1"),
                                                          keep_blank_values=True)} - self.query_names(route))
                if unknown:
                    errors = [{"loc": ("query", k), "msg": "unknown query parameter", "type": "extra_forbidden"}
                              for k in unknown]
                    return await JSONResponse(format_errors(errors), 422)(scope, receive, send)
                return await self.app(scope, receive, send)
            if match is Match.PARTIAL:
                allowed |= route.methods
        if allowed:
            response = JSONResponse({"detail": f"method {scope['method']} not allowed here"}, 405,
                                    headers={"Allow": ", ".join(sorted(allowed))})
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)

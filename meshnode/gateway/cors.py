"""Cross-origin requests (CORS), so a web page can call the API: browser front-ends (Open WebUI's direct
connections, playgrounds) send a preflight `OPTIONS` and read an answer only when it names their origin.

Pages served from this host (http(s)://localhost, 127.0.0.1, [::1], any port) are answered by default, as
llama-server answers them; other origins only when configured (`--cors-origins`, the node's
`http_cors_origins`: a comma-separated list, or `*` for any). A preflight is answered before the API key
check (browsers send none with it); the request that follows still needs its key.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from aiohttp import web

LOCAL = re.compile(r"^https?://(localhost|127\.0\.0\.1|\[::1\])(:\d{1,5})?$", re.I)
METHODS = "GET, POST, OPTIONS"
MAX_AGE_S = "600"


@dataclass(frozen=True)
class Cors:
    origins: frozenset = frozenset()  # configured origins beside this host's; "*" for any

    @classmethod
    def of(cls, spec: str | None) -> "Cors":
        return cls(frozenset(o.strip().rstrip("/") for o in (spec or "").split(",") if o.strip()))

    def allowed(self, origin: str | None) -> str | None:
        """The Access-Control-Allow-Origin value for a request from `origin`, or None (no CORS answer)."""
        if not origin:
            return None
        if "*" in self.origins:
            return "*"
        return origin if LOCAL.match(origin) or origin.rstrip("/") in self.origins else None

    @web.middleware
    async def preflight(self, request: web.Request, handler):
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            allow = self.allowed(request.headers.get("Origin"))
            if allow is None:
                return web.Response(status=403, text="this origin may not call the API (--cors-origins)\n")
            asked = request.headers.get("Access-Control-Request-Headers", "Authorization, Content-Type")
            return web.Response(status=204, headers={
                "Access-Control-Allow-Origin": allow, "Access-Control-Allow-Methods": METHODS,
                "Access-Control-Allow-Headers": asked, "Access-Control-Max-Age": MAX_AGE_S, "Vary": "Origin"})
        return await handler(request)

    async def headers(self, request: web.Request, response: web.StreamResponse) -> None:
        """Every answer to an allowed origin names it (before the headers go: streams included)."""
        allow = self.allowed(request.headers.get("Origin"))
        if allow is not None:
            response.headers["Access-Control-Allow-Origin"] = allow
            response.headers.setdefault("Vary", "Origin")

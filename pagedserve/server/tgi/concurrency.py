"""--max-concurrent-requests (TGI's launcher flag): answer 429 when that many generation requests
are already in flight (queued or running, streams until their last byte), as TGI does.

A pure ASGI middleware, so streaming and disconnect detection pass through untouched.
"""
from __future__ import annotations

from fastapi.responses import JSONResponse

from pagedserve.server.protocol import error_body

# Routes that start generation; everything else (health, metrics, tokenize) is never limited.
GENERATION_PATHS = ("/", "/generate", "/generate_stream", "/v1/completions", "/v1/chat/completions",
                    "/v1/responses")


class ConcurrencyLimitMiddleware:
    def __init__(self, app, limit: int):
        self.app = app
        self.limit = limit
        self.in_flight = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in GENERATION_PATHS:
            return await self.app(scope, receive, send)
        if self.in_flight >= self.limit:
            msg = f"Model is overloaded: {self.in_flight} requests in flight (--max-concurrent-requests {self.limit})"
            if scope["path"].startswith("/v1/"):
                body = error_body(msg, 429, code="server_overloaded")
            else:
                body = {"error": msg, "error_type": "overloaded"}
            return await JSONResponse(body, status_code=429)(scope, receive, send)
        self.in_flight += 1  # one event loop: no lock needed
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1

"""Limits that keep hostile or broken clients from starving the others.

* `BodySizeLimitMiddleware`: a request body over --max-request-body-bytes gets 413 before it is
  parsed: at once from Content-Length, or as soon as a chunked body passes the cap.
* `HeaderDeadlineProtocol`: uvicorn's h11 protocol with one more timer. A connection must deliver
  a complete request head within --timeout-request-header seconds of opening (or of its previous
  response); otherwise it is closed. Without it a client that opens a socket and sends nothing, or
  dribbles one header byte at a time (slowloris), holds its connection and file descriptor
  forever: uvicorn's keep-alive timer only starts after a first response and any byte resets it.
* `raise_open_files_limit`: the soft RLIMIT_NOFILE up to the hard one, so that many idle
  connections do not exhaust descriptors before the timers reap them.
"""
from __future__ import annotations

import logging

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedserve.server.protocol import error_body

logger = logging.getLogger("pagedserve.server")

DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * 1024 * 1024
DEFAULT_TIMEOUT_REQUEST_HEADER = 20.0


def _too_large(limit: int) -> str:
    return f"The request body is larger than this server accepts ({limit} bytes, --max-request-body-bytes)."


class BodySizeLimitMiddleware:
    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.max_bytes:
            return await self.app(scope, receive, send)
        length = None
        for k, v in scope.get("headers") or ():
            if k == b"content-length":
                length = v
                break
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                n = -1
            if n < 0 or n > self.max_bytes:
                status, msg = (413, _too_large(self.max_bytes)) if n > 0 else (400, "Invalid Content-Length header.")
                resp = JSONResponse(error_body(msg, status), status_code=status, headers={"Connection": "close"})
                return await resp(scope, receive, send)
            return await self.app(scope, receive, send)
        seen = 0
        limit = self.max_bytes

        async def counted_receive():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:  # the app's error handler renders it (OpenAI body, 413)
                    raise HTTPException(413, _too_large(limit), headers={"Connection": "close"})
            return msg

        return await self.app(scope, counted_receive, send)


class HeaderDeadlineProtocol(H11Protocol):
    """H11Protocol that closes a connection which has not sent a whole request head in time."""

    timeout_request_header = DEFAULT_TIMEOUT_REQUEST_HEADER  # set per server by `with_header_deadline`

    def connection_made(self, transport):  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer = None
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._waiting_cycle = self.cycle
        self._head_timer = self.loop.call_later(self.timeout_request_header, self._expire)

    def _disarm(self) -> None:
        if getattr(self, "_head_timer", None) is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _expire(self) -> None:
        self._head_timer = None
        if self.cycle is self._waiting_cycle and not self.transport.is_closing():
            logger.debug("closing a connection that sent no complete request head in %.1fs",
                         self.timeout_request_header)
            self.transport.close()

    def handle_events(self) -> None:
        super().handle_events()
        if self._head_timer is not None and self.cycle is not self._waiting_cycle:
            self._disarm()  # a request head arrived: the request's own handling takes over

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)


def with_header_deadline(seconds: float) -> type[HeaderDeadlineProtocol]:
    return type("HeaderDeadlineProtocol", (HeaderDeadlineProtocol,), {"timeout_request_header": float(seconds)})


def raise_open_files_limit() -> tuple[int, int] | None:
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY:
            hard = max(soft, 1 << 16)
        if soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, ValueError, OSError):
        return None

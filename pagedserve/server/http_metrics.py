"""HTTP request metrics (the http_* families prometheus-fastapi-instrumentator exports, same names
and labels) and the in-flight count behind GET /load, as one pure ASGI middleware: it wraps
`send` only, so streaming and disconnect detection are untouched.

`handler` is the route's path template (/v1/models/{model_id:path}), or "none" for paths no
route matched, so that scanners cannot grow the label set without bound.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, Summary

# the routes whose in-flight requests GET /load reports (vLLM's server_load: generation work)
LOAD_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})


class HTTPMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.requests = Counter("http_requests_total", "Total number of requests by method, status and handler.",
                                ["method", "status", "handler"], registry=registry)
        self.duration = Histogram("http_request_duration_seconds",
                                  "Latency with only few buckets by handler and method.", ["handler", "method"],
                                  buckets=(0.1, 0.5, 1.0, float("inf")), registry=registry)
        self.duration_highr = Histogram(
            "http_request_duration_highr_seconds", "Latency with many buckets but no API specific labels.",
            buckets=(0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0,
                     7.5, 10.0, 30.0, 60.0, float("inf")), registry=registry)
        self.request_size = Summary("http_request_size_bytes", "Content length of incoming requests by handler.",
                                    ["handler"], registry=registry)
        self.response_size = Summary("http_response_size_bytes", "Content length of outgoing responses by handler.",
                                     ["handler"], registry=registry)
        self.server_load = 0  # generation requests in progress (GET /load)


class HTTPMetricsMiddleware:
    def __init__(self, app, metrics: HTTPMetrics):
        self.app = app
        self.m = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status, sent = [500], [0]
        received = [0]

        async def counting_receive():
            msg = await receive()
            if msg["type"] == "http.request":
                received[0] += len(msg.get("body", b""))
            return msg

        async def counting_send(msg):
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
            elif msg["type"] == "http.response.body":
                sent[0] += len(msg.get("body", b""))
            await send(msg)

        counted = scope.get("method") == "POST" and scope.get("path") in LOAD_PATHS
        if counted:
            self.m.server_load += 1
        try:
            await self.app(scope, counting_receive, counting_send)
        finally:
            if counted:
                self.m.server_load -= 1
            route = scope.get("route")
            handler = getattr(route, "path", None) or "none"
            method = scope.get("method", "")
            elapsed = time.perf_counter() - start
            self.m.requests.labels(method, f"{status[0] // 100}xx", handler).inc()
            self.m.duration.labels(handler, method).observe(elapsed)
            self.m.duration_highr.observe(elapsed)
            self.m.request_size.labels(handler).observe(received[0])
            self.m.response_size.labels(handler).observe(sent[0])

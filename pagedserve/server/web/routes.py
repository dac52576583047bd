"""Routes of the web page: `/` (the page), /ui/static/* (its files), /ui/stats (a server-sent
events feed of one sample per second) and /ui/config (the configuration in effect)."""
from __future__ import annotations

import asyncio
import json
from importlib import resources
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from pagedserve.server.serving_base import SSEResponse
from pagedserve.server.web.engine_config import engine_configuration
from pagedserve.doctor.scrape import Scrape
from pagedserve.server.web.stats_feed import PREFIX, StatsFeed

PUBLIC_PREFIX = "/ui/static/"
STATIC_DIR = resources.files("pagedserve.server.web") / "static"
# The SSE feed sends a comment line when no sample came for this long, so proxies keep it open.
KEEPALIVE_S = 5.0


def is_public_request(method: str | None, path: str) -> bool:
    """GET of the page or its static files: no data in them, so no key needed to load them.
    Only GET/HEAD: other routes share the path (TGI's POST / generates, behind the key)."""
    return method in ("GET", "HEAD") and (path == "/" or path.startswith(PUBLIC_PREFIX))


def _page(api_key_required: bool) -> str:
    html = (STATIC_DIR / "index.html").read_text(encoding="utf-8")
    return html.replace('data-auth="none"', f'data-auth="{"required" if api_key_required else "none"}"', 1)


def mount_web_ui(app: FastAPI, *, read_metrics: Callable[[], bytes], configuration: Callable[[float | None], dict],
                 api_key_required: bool, alive: Callable[[], bool], shutting_down: Callable[[], bool],
                 doctor_config: Callable[[], dict]) -> StatsFeed:
    """Add the page's routes to `app`; returns the stats feed, which the app's lifespan starts.

    `read_metrics` is what /metrics serves; `configuration(num_kv_blocks)` builds /ui/config;
    `shutting_down()` ends open feeds so that a graceful stop is not held up by an open page;
    `doctor_config()` is the engine settings `pagedserve doctor`'s advice names."""
    feed = StatsFeed(read_metrics, alive=alive, doctor_config=doctor_config)

    @app.get("/", include_in_schema=False)
    async def index():
        return HTMLResponse(_page(api_key_required), headers={"Cache-Control": "no-cache"})

    app.mount(PUBLIC_PREFIX.rstrip("/"), StaticFiles(directory=str(STATIC_DIR)), name="ui-static")

    @app.get("/ui/config", include_in_schema=False)
    async def config():
        raw = read_metrics()
        scrape = Scrape.parse(raw.decode() if isinstance(raw, bytes) else raw, 0.0)
        return JSONResponse(configuration(scrape.total(PREFIX + "num_kv_cache_blocks") or None))

    @app.get("/ui/stats", include_in_schema=False)
    async def stats(request: Request):
        feed.start()  # normally running since startup; an app driven without lifespan starts it here
        q = feed.subscribe()

        async def events():
            try:
                yield f"retry: 1000\nevent: history\ndata: {json.dumps(feed.history())}\n\n"
                while not shutting_down():
                    try:
                        s = await asyncio.wait_for(q.get(), KEEPALIVE_S)
                    except asyncio.TimeoutError:
                        yield ": keepalive\n\n"
                        continue
                    yield f"data: {json.dumps(s)}\n\n"
            finally:
                feed.unsubscribe(q)

        return SSEResponse(events())

    return feed

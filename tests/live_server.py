"""The real app over real sockets, in this process: uvicorn in a thread on 127.0.0.1, so a test can
look inside the engine and the server's event loop while clients hammer it."""
from __future__ import annotations

import argparse
import asyncio
import threading
import time

from server_utils import free_port


class LiveServer:
    def __init__(self, model_dir, engine_kw: dict | None = None, async_kw: dict | None = None):
        import uvicorn

        from pagedserve import EngineConfig
        from pagedserve.engine.async_engine import AsyncEngine
        from pagedserve.server.app import build_app

        cfg = EngineConfig(model=str(model_dir), num_threads=1, **(engine_kw or {}))
        self.engine = AsyncEngine.from_config(cfg, log_requests=False, log_stats=False, **(async_kw or {}))
        app = build_app(self.engine, argparse.Namespace(api_key=None, shutdown_timeout=1.0))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="on"))
        self._thread = threading.Thread(target=self.server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.05)

    def loop_tasks(self) -> int:
        """asyncio tasks on the server's loop (besides the one counting)."""
        loop = next(iter(self.server.servers))._loop

        async def count() -> int:
            return len(asyncio.all_tasks()) - 1

        return asyncio.run_coroutine_threadsafe(count(), loop).result(timeout=10)

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=20)

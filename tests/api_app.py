"""An in-process OpenAI server over the tiny random Llama for API tests: the real engine and app,
reached through httpx's ASGI transport (no port, no subprocess), so a test can also watch what the
serving code reads from a request."""
from __future__ import annotations

import argparse
import asyncio

import httpx

TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] }}"
    "{% if not (loop.last and continue_final_message) %}{{ '<|im_end|>' + '\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class InProcessServer:
    def __init__(self, model_dir, max_model_len: int = 256, **engine_kw):
        from pagedserve import EngineConfig
        from pagedserve.engine.async_engine import AsyncEngine
        from pagedserve.server.app import build_app

        cfg = EngineConfig(model=str(model_dir), max_model_len=max_model_len, num_gpu_blocks_override=64,
                           block_size=16, num_threads=1, seed=0, **engine_kw)
        self.engine = AsyncEngine.from_config(cfg, log_requests=False, log_stats=False)
        args = argparse.Namespace(chat_template=TOOLS_TEMPLATE, shutdown_timeout=1.0, api_key=None,
                                  served_model_name=["tiny"])
        self.app = build_app(self.engine, args)
        self.engine.start()  # httpx's ASGITransport does not run the lifespan
        self.model = "tiny"

    def http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://test", timeout=60)

    def openai(self, http: httpx.AsyncClient):
        import openai

        return openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http, max_retries=0)

    def run(self, fn):
        """Run `await fn(http, client)` in a fresh event loop."""

        async def main():
            async with self.http() as h:
                return await fn(h, self.openai(h))

        return asyncio.run(main())

    def free_blocks_ok(self) -> bool:
        eng = self.engine.engine
        return eng.block_manager.num_free_blocks == eng.block_manager.num_blocks

"""Admission under ten times the load the queue allows (--max-num-queued-reqs): the excess gets
503 + Retry-After at once, the accepted requests all finish with a bounded time to first token,
and once the burst is over the server is idle and serves normally."""
from __future__ import annotations

import asyncio
import json
import math
import threading
import time

import httpx
import pytest
from live_server import LiveServer

MAX_SEQS, MAX_QUEUED, TOKENS = 4, 8, 16
BURST = 10 * (MAX_SEQS + MAX_QUEUED)


@pytest.fixture(scope="module")
def live(llama_dir):
    srv = LiveServer(llama_dir, dict(max_model_len=128, num_gpu_blocks_override=64, max_num_seqs=MAX_SEQS),
                     dict(max_num_queued_reqs=MAX_QUEUED))
    yield srv
    srv.stop()


async def _one(h, body) -> dict:
    t0 = time.perf_counter()
    async with h.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return {"status": r.status_code, "t": time.perf_counter() - t0, "retry_after": r.headers.get("retry-after"),
                    "error": r.json().get("error")}
        ttft, n = None, 0
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                usage = json.loads(line[6:]).get("usage")
                n = usage["completion_tokens"] if usage else n
        return {"status": 200, "ttft": ttft, "tokens": n, "t": time.perf_counter() - t0}


def test_ten_times_overload(live):
    body = {"prompt": "Once upon a time", "max_tokens": TOKENS, "stream": True, "ignore_eos": True, "temperature": 0,
            "stream_options": {"include_usage": True}}

    async def main():
        limits = httpx.Limits(max_connections=BURST + 8, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=live.url, timeout=120, limits=limits) as h:
            alone = [await _one(h, body) for _ in range(2)][-1]
            burst = await asyncio.gather(*(_one(h, body) for _ in range(BURST)))
            return alone, burst

    max_waiting = [0]
    done = threading.Event()

    def watch():  # the scheduler's queue, sampled while the burst runs
        while not done.is_set():
            max_waiting[0] = max(max_waiting[0], len(live.engine.engine.scheduler.waiting))
            time.sleep(0.001)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        alone, burst = asyncio.run(main())
    finally:
        done.set()
        watcher.join()
    assert alone["status"] == 200 and alone["tokens"] == TOKENS
    ok = [r for r in burst if r["status"] == 200]
    rejected = [r for r in burst if r["status"] != 200]
    assert len(ok) >= MAX_SEQS and len(rejected) >= BURST // 2, (len(ok), len(rejected))
    # the bound held throughout the burst: never more than MAX_QUEUED waiting in the scheduler
    assert 0 < max_waiting[0] <= MAX_QUEUED, max_waiting
    for r in rejected:
        assert r["status"] == 503 and int(r["retry_after"]) >= 1 and r["error"]["code"] == "server_overloaded", r
    # at once: a rejection costs no more than a short request alone
    # (the median: on a busy 2-core host a few answers wait behind the loop's other 100 connections)
    rej_t = sorted(r["t"] for r in rejected)
    ok_t = sorted(r["t"] for r in ok)
    assert rej_t[len(rej_t) // 2] < max(2.0, ok_t[len(ok_t) // 2]) and rej_t[-1] < 15.0, (rej_t, ok_t)
    # every accepted request ran to the end; the last one waited for about len(ok)/MAX_SEQS batches
    assert all(r["tokens"] == TOKENS for r in ok)
    bound = 3 * (math.ceil(len(ok) / MAX_SEQS) + 1) * alone["t"] + 2.0
    assert max(r["ttft"] for r in ok) < bound, (max(r["ttft"] for r in ok), bound, alone)
    # afterwards: idle, and a request alone is served as before
    eng = live.engine
    deadline = time.monotonic() + 10
    while (eng.num_in_flight() or eng.stats().num_running or eng.stats().num_waiting) and time.monotonic() < deadline:
        time.sleep(0.05)
    bm = eng.engine.block_manager
    assert eng.num_in_flight() == 0 and bm.num_free_blocks == bm.num_blocks
    r = httpx.post(live.url + "/v1/completions", json={**body, "stream": False, "stream_options": None}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == TOKENS

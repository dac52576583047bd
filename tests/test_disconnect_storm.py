"""A bounded disconnect storm (benchmarks/disconnect_storm.py runs 3,000 per configuration):
streaming requests cut before the first byte, during a multi-step prefill and mid-stream, with
prefix caching on and a pool small enough to preempt. Afterwards nothing runs or waits, every KV
block is back, and the server's loop holds no more asyncio tasks and the process no more file
descriptors than before the storm."""
from __future__ import annotations

import asyncio
import os
import sys
import time

import pytest
from live_server import LiveServer
from server_utils import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
N_REQUESTS = 120


@pytest.fixture(scope="module")
def live(llama_dir):
    srv = LiveServer(llama_dir, dict(max_model_len=256, num_gpu_blocks_override=48, max_num_batched_tokens=64,
                                     max_num_seqs=32))
    yield srv
    srv.stop()


def test_cut_streams_leave_nothing_behind(live):
    import disconnect_storm as ds

    url, ae = live.url, live.engine
    asyncio.run(ds.storm(url, 12, 6, seed=1))  # warm-up
    ds.wait_idle(url)
    time.sleep(0.5)
    fds0, tasks0 = len(os.listdir("/proc/self/fd")), live.loop_tasks()
    res = asyncio.run(ds.storm(url, N_REQUESTS, 24, seed=0))
    counts = res["counts"]
    assert all(counts.get(m, 0) > 0 for m in ("before_first_byte", "during_prefill", "mid_stream")), counts
    st = ds.wait_idle(url)
    assert (st["running"], st["waiting"], st["kv_cache_usage"]) == (0, 0, 0), st
    assert st["preemptions"] > 0 and st["prefix_hits"] > 0, st  # both were in play
    bm = ae.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not ae.engine.requests and ae.num_in_flight() == 0
    deadline = time.monotonic() + 10
    while (live.loop_tasks() > tasks0 or len(os.listdir("/proc/self/fd")) > fds0) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert live.loop_tasks() <= tasks0 and len(os.listdir("/proc/self/fd")) <= fds0
    import httpx

    r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3

"""Fuzz every route of the real app (the tiny random Llama, in process): a few hundred cases drawn
from the server's OpenAPI document (valid and invalid) plus the hand-written hostile ones.
No 5xx, every error an OpenAI body, the KV pool back to full. benchmarks/fuzz_server.py runs the
same code at 3,000 requests against a `pagedserve serve` process."""
from __future__ import annotations

import argparse
import sys

import pytest
from server_utils import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
N_CASES = 300


@pytest.fixture(scope="module")
def client(llama_dir):
    from starlette.testclient import TestClient

    from pagedserve import EngineConfig
    from pagedserve.engine.async_engine import AsyncEngine
    from pagedserve.server.app import build_app

    cfg = EngineConfig(model=str(llama_dir), max_model_len=64, num_gpu_blocks_override=64, num_threads=1,
                       max_num_seqs=64)
    ae = AsyncEngine.from_config(cfg, log_requests=False, log_stats=False)
    app = build_app(ae, argparse.Namespace(api_key=None, shutdown_timeout=1.0))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c, ae


def test_fuzz_every_route_no_5xx_openai_errors_pool_full(client):
    import fuzz_server

    c, ae = client
    summary = fuzz_server.fuzz(c, N_CASES, seed=0)
    assert summary["n_5xx"] == 0 and summary["n_problems"] == 0, summary["problems"]
    assert summary["requests"] >= N_CASES
    # every documented route was exercised
    paths = {r.split(" ", 1)[1] for r in summary["routes"]}
    for route in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/v1/models",
                  "/v1/models/{id}", "/health", "/metrics", "/version"):
        assert route in paths, (route, sorted(paths))
    assert any(k.startswith("2") for k in summary["by_status"]) and any(k.startswith("4") for k in summary["by_status"])
    a = summary["after"]
    assert (a["running"], a["waiting"], a["kv_cache_usage"], a["health"], a["completion_status"]) == (0, 0, 0, 200, 200)
    bm = ae.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and ae.is_alive()

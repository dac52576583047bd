"""The web page's data, in-process (no browser, no model): the stats feed's arithmetic from the
/metrics text (rates, last-minute percentiles, the window), the doctor's findings, --disable-web-ui."""
from __future__ import annotations

import argparse
import asyncio

import httpx
import pytest

from pagedserve.server.web.stats_feed import StatsFeed


def test_stats_feed_rates_percentiles_and_the_one_minute_window():
    from pagedserve.engine.stats import EngineStats
    from pagedserve.server.metrics import ServerMetrics

    load = {"running": 0, "hits": 0, "queries": 0, "preemptions": 2}
    m = ServerMetrics("m", 1024, stats_fn=lambda: EngineStats(load["running"], 0, 0.25, 96, 128, load["preemptions"],
                                                              load["queries"], load["hits"], 0, 0))
    feed = StatsFeed(lambda: m.render()[0], doctor_config=lambda: {"kv_cache_space": 4.0, "max_num_seqs": 8})
    first = feed.sample(now=1000.0)
    assert first["generation_tps"] is None and first["ttft"]["p50"] is None  # nothing to compare with yet
    assert first["diagnoses"] is None
    m.generation_tokens.inc(50)
    m.prompt_tokens.inc(200)
    for v in (0.03, 0.03, 0.03, 0.07):  # TTFT buckets ... 0.02, 0.04, 0.06, 0.08 ...
        m.ttft.observe(v)
    load.update(running=3, queries=100, hits=40, preemptions=5)
    s = feed.sample(now=1002.0)
    assert s["generation_tps"] == 25.0 and s["prompt_tps"] == 100.0
    assert (s["running"], s["waiting"], s["kv_usage"], s["kv_blocks"], s["preemptions_total"]) == (3, 0, 0.25, 128, 5)
    assert s["prefix_hit_rate"] == pytest.approx(0.4)
    assert s["ttft"]["p50"] == pytest.approx(0.02 + 0.02 * 2 / 3)  # rank 2 of the 3 in the (0.02, 0.04] bucket
    assert s["ttft"]["p99"] == pytest.approx(0.06 + 0.02 * (3.96 - 3))  # in the (0.06, 0.08] bucket
    assert s["ttft"]["count"] == 4
    # the doctor's rules see the window: 3 preemptions, a TTFT P90 of 70 ms (under its 1 s target)
    assert [d["id"] for d in s["diagnoses"]] == ["preemptions"]
    assert "3 preemptions in 2 s" in s["diagnoses"][0]["evidence"][0] and "--kv-cache-space" in s["diagnoses"][0]["change"]
    # a minute later with no new requests: those observations left the window
    feed.sample(now=1030.0)
    late = feed.sample(now=1063.0)
    assert late["ttft"]["count"] == 0 and late["ttft"]["p50"] is None and late["generation_tps"] == 0.0
    assert late["prefix_hit_rate"] is None
    assert late["diagnoses"] == []  # the preemptions left the window too
    assert len(feed.history()) == 4


def _stub_app(disable: bool, api_key: str | None = None):
    from types import SimpleNamespace

    from pagedserve import EngineConfig
    from pagedserve.engine.async_engine import AsyncEngine
    from pagedserve.engine.stats import EngineStats
    from pagedserve.server.app import build_app

    class IdleEngine:  # what build_app reads from an engine, without a model
        config = EngineConfig(model="stub", max_model_len=64, served_model_name="stub")
        tokenizer = None
        spec = SimpleNamespace(vocab_size=10)

        def stats(self):
            return EngineStats(0, 0, 0.0, 4, 4, 0, 0, 0, 0, 0)

        def has_unfinished_requests(self):
            return False

    args = argparse.Namespace(disable_web_ui=disable, api_key=api_key)
    return build_app(AsyncEngine(IdleEngine(), log_requests=False, log_stats=False), args)


def test_disable_web_ui_removes_the_page_and_its_routes():
    async def get_all(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://stub") as h:
            return [(await h.get(path)).status_code for path in ("/", "/ui/static/main.js", "/ui/config")]

    assert asyncio.run(get_all(_stub_app(disable=False))) == [200, 200, 200]
    page, static, config = asyncio.run(get_all(_stub_app(disable=True)))
    assert page in (404, 405) and static == 404 and config == 404  # 405: TGI's POST / is still there

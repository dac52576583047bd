"""The dashboard's once-a-second samples, computed from the server's Prometheus exposition.

The feed reads the very text /metrics serves (whatever process the engine runs in, that text is
complete) and parses it as `pagedserve doctor` does, so the page never shows a number a
Prometheus scrape or the doctor would not. Counters become per-second rates between two samples;
histograms become percentiles over the last minute, from the bucket counts' growth across that
minute; the prefix-cache hit rate is taken over the same minute, and so are the doctor's
diagnoses (refreshed every few seconds).
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Callable

from pagedserve.doctor.diagnose import diagnose_live, window_stats
from pagedserve.doctor.scrape import Scrape, bucket_delta, quantile

logger = logging.getLogger("pagedserve.server.web")

PREFIX = "pagedserve:"
QUANTILES = (0.5, 0.9, 0.99)
# sample key -> histogram name
HISTOGRAMS = {"ttft": "time_to_first_token_seconds", "itl": "inter_token_latency_seconds",
              "e2e": "e2e_request_latency_seconds"}
DIAGNOSE_EVERY_S = 5.0  # seconds between two runs of the doctor's rules (each reads the whole window)


class StatsFeed:
    """Samples the metrics once per `interval` seconds and fans each sample out to subscribers.

    `read_metrics` returns the Prometheus text exposition (bytes or str), exactly what /metrics
    serves. The last `history` samples are kept so that a page opened now draws the recent past.
    `doctor_config()` gives the engine settings the doctor's advice names (EngineConfig's fields).
    """

    def __init__(self, read_metrics: Callable[[], bytes | str], interval: float = 1.0, window: float = 60.0,
                 history: int = 300, alive: Callable[[], bool] | None = None,
                 doctor_config: Callable[[], dict] | None = None, ttft_slo_s: float = 1.0):
        self.read_metrics = read_metrics
        self.interval = interval
        self.window = window
        self.alive = alive or (lambda: True)
        self.doctor_config = doctor_config or dict
        self.ttft_slo_s = ttft_slo_s
        self._scrapes: collections.deque[Scrape] = collections.deque()
        self._history: collections.deque[dict] = collections.deque(maxlen=history)
        self._diagnoses: list[dict] | None = None
        self._diagnosed_at = float("-inf")
        self._subscribers: set[asyncio.Queue] = set()
        self._task: asyncio.Task | None = None

    # -- sampling ------------------------------------------------------------------------------
    def sample(self, now: float | None = None) -> dict:
        """Take one sample now; returns it (and keeps it in the history)."""
        now = time.time() if now is None else now
        raw = self.read_metrics()
        scrape = Scrape.parse(raw.decode() if isinstance(raw, bytes) else raw, now)
        prev = self._scrapes[-1] if self._scrapes else None
        # baseline for "the last minute": the newest scrape at least a window old, else the oldest kept
        while len(self._scrapes) > 1 and self._scrapes[1].t <= now - self.window:
            self._scrapes.popleft()
        base = self._scrapes[0] if self._scrapes else scrape  # the first sample has no past: empty window
        self._scrapes.append(scrape)
        out = self._describe(scrape, prev, base)
        if self._diagnoses is None or now - self._diagnosed_at >= DIAGNOSE_EVERY_S:
            self._diagnoses = self._diagnose()
            self._diagnosed_at = now
        out["diagnoses"] = self._diagnoses
        self._history.append(out)
        return out

    def _diagnose(self) -> list[dict] | None:
        if len(self._scrapes) < 2:
            return None
        try:
            stats = window_stats(list(self._scrapes))
            return [d.to_dict() for d in diagnose_live(stats, self.doctor_config(), self.ttft_slo_s)]
        except Exception:  # noqa: BLE001 - advice must never stop the feed
            logger.exception("doctor rules failed on the dashboard's window")
            return None

    def _describe(self, now: Scrape, prev: Scrape | None, base: Scrape) -> dict:
        def value(name: str) -> float | None:
            return now.total(PREFIX + name) if now.has(PREFIX + name) else None

        def rate(name: str) -> float | None:
            if prev is None or not now.has(PREFIX + name) or now.t <= prev.t:
                return None
            return max(0.0, now.total(PREFIX + name) - prev.total(PREFIX + name)) / (now.t - prev.t)

        def window_delta(name: str) -> float:
            return now.total(PREFIX + name) - base.total(PREFIX + name)

        queries = window_delta("prefix_cache_queries_total")
        out: dict = {
            "t": round(now.t, 3),
            "alive": bool(self.alive()),
            "prompt_tps": rate("prompt_tokens_total"),
            "generation_tps": rate("generation_tokens_total"),
            "running": value("num_requests_running"),
            "waiting": value("num_requests_waiting"),
            "kv_usage": value("kv_cache_usage_perc"),
            "kv_blocks": value("num_kv_cache_blocks"),
            "preemptions_total": value("num_preemptions_total"),
            "preemptions_ps": rate("num_preemptions_total"),
            "requests_finished_total": value("request_success_total"),
            "window_s": round(now.t - base.t, 3),
            "prefix_hit_rate": window_delta("prefix_cache_hits_total") / queries if queries > 0 else None,
        }
        for key, name in HISTOGRAMS.items():
            if not now.has(PREFIX + name + "_count"):
                out[key] = None
                continue
            buckets = bucket_delta(base.buckets(PREFIX + name), now.buckets(PREFIX + name))
            out[key] = {f"p{round(q * 100)}": quantile(q, buckets) for q in QUANTILES}
            out[key]["count"] = buckets[-1][1] if buckets else 0.0
        return out

    def history(self) -> list[dict]:
        return list(self._history)
    # -- fan-out -------------------------------------------------------------------------------
    def subscribe(self) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue(maxsize=64)
        self._subscribers.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue) -> None:
        self._subscribers.discard(q)

    def start(self) -> None:
        """Start sampling on the running event loop (idempotent)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="pagedserve-ui-stats")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_t = loop.time()
        while True:
            try:
                s = self.sample()
            except Exception:  # noqa: BLE001 - a broken scrape must not end the feed
                logger.exception("dashboard stats sample failed")
            else:
                for q in list(self._subscribers):
                    if q.full():  # a stalled page: drop its oldest sample rather than grow without bound
                        q.get_nowait()
                    q.put_nowait(s)
            next_t += self.interval
            await asyncio.sleep(max(0.0, next_t - loop.time()))

"""The dashboard's once-a-second samples, computed from the server's Prometheus exposition.

The feed reads the very text /metrics serves (whatever process the engine runs in, that text is
complete), so the page never shows a number a Prometheus scrape would not. Counters become
per-second rates between two samples; histograms become percentiles over the last minute, from
the bucket counts' growth across that minute (linear inside a bucket, as PromQL's
histogram_quantile does); the prefix-cache hit rate is taken over the same minute.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from typing import Callable

from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger("pagedserve.server.web")

PREFIX = "pagedserve:"
QUANTILES = (0.5, 0.9, 0.99)
# sample key -> histogram family name (without the prefix)
HISTOGRAMS = {"ttft": "time_to_first_token_seconds", "itl": "inter_token_latency_seconds",
              "e2e": "e2e_request_latency_seconds"}
COUNTERS = {"prompt_tokens": "prompt_tokens_total", "generation_tokens": "generation_tokens_total",
            "preemptions": "num_preemptions_total", "prefix_queries": "prefix_cache_queries_total",
            "prefix_hits": "prefix_cache_hits_total", "requests_finished": "request_success_total"}
GAUGES = {"running": "num_requests_running", "waiting": "num_requests_waiting", "kv_usage": "kv_cache_usage_perc",
          "kv_blocks": "num_kv_cache_blocks"}


class Snapshot:
    """Counter totals, gauge values and cumulative histogram buckets at one instant."""

    __slots__ = ("t", "values", "buckets")

    def __init__(self, t: float, values: dict[str, float], buckets: dict[str, list[tuple[float, float]]]):
        self.t = t
        self.values = values
        self.buckets = buckets  # key -> [(upper bound, cumulative count)], sorted, ending at +Inf


def parse_exposition(text: str, t: float) -> Snapshot:
    """Sum every sample over its labels (one model per server) into a Snapshot."""
    sums: dict[str, float] = collections.defaultdict(float)
    les: dict[str, dict[float, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith("_bucket") and "le" in s.labels:
                les[s.name[: -len("_bucket")]][float(s.labels["le"])] += s.value
            else:
                sums[s.name] += s.value
    values = {}
    for key, name in {**COUNTERS, **GAUGES}.items():
        if PREFIX + name in sums:
            values[key] = sums[PREFIX + name]
    buckets = {key: sorted(les[PREFIX + name].items()) for key, name in HISTOGRAMS.items() if PREFIX + name in les}
    return Snapshot(t, values, buckets)


def bucket_quantile(q: float, upper_bounds: list[float], counts: list[float]) -> float | None:
    """The q-quantile of observations counted in cumulative buckets; None when there are none.

    Linear interpolation inside the bucket that holds the rank; a rank in the +Inf bucket answers
    the highest finite bound (the histogram cannot say more)."""
    total = counts[-1] if counts else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for ub, c in zip(upper_bounds, counts):
        if c >= rank:
            if math.isinf(ub):
                return lower
            if c == below:
                return ub
            return lower + (ub - lower) * (rank - below) / (c - below)
        lower, below = ub, c
    return lower


def _delta_buckets(now: list[tuple[float, float]], then: list[tuple[float, float]] | None):
    base = dict(then or ())
    ubs = [ub for ub, _ in now]
    counts = [max(0.0, c - base.get(ub, 0.0)) for ub, c in now]
    return ubs, counts


class StatsFeed:
    """Samples the metrics once per `interval` seconds and fans each sample out to subscribers.

    `read_metrics` returns the Prometheus text exposition (bytes or str), exactly what /metrics
    serves. The last `history` samples are kept so that a page opened now draws the recent past.
    """

    def __init__(self, read_metrics: Callable[[], bytes | str], interval: float = 1.0, window: float = 60.0,
                 history: int = 300, alive: Callable[[], bool] | None = None):
        self.read_metrics = read_metrics
        self.interval = interval
        self.window = window
        self.alive = alive or (lambda: True)
        self._snaps: collections.deque[Snapshot] = collections.deque()
        self._history: collections.deque[dict] = collections.deque(maxlen=history)
        self._subscribers: set[asyncio.Queue] = set()
        self._task: asyncio.Task | None = None

    # -- sampling ------------------------------------------------------------------------------
    def sample(self, now: float | None = None) -> dict:
        """Take one sample now; returns it (and keeps it in the history)."""
        now = time.time() if now is None else now
        raw = self.read_metrics()
        snap = parse_exposition(raw.decode() if isinstance(raw, bytes) else raw, now)
        prev = self._snaps[-1] if self._snaps else None
        # baseline for "the last minute": the newest snapshot at least a window old, else the oldest kept
        while len(self._snaps) > 1 and self._snaps[1].t <= now - self.window:
            self._snaps.popleft()
        base = self._snaps[0] if self._snaps else snap  # the first sample has no past: empty window
        self._snaps.append(snap)
        out = self._describe(snap, prev, base)
        self._history.append(out)
        return out

    def _describe(self, snap: Snapshot, prev: Snapshot | None, base: Snapshot) -> dict:
        v = snap.values

        def rate(key: str) -> float | None:
            if prev is None or key not in v or snap.t <= prev.t:
                return None
            return max(0.0, v[key] - prev.values.get(key, 0.0)) / (snap.t - prev.t)

        out: dict = {
            "t": round(snap.t, 3),
            "alive": bool(self.alive()),
            "prompt_tps": rate("prompt_tokens"),
            "generation_tps": rate("generation_tokens"),
            "running": v.get("running"),
            "waiting": v.get("waiting"),
            "kv_usage": v.get("kv_usage"),
            "kv_blocks": v.get("kv_blocks"),
            "preemptions_total": v.get("preemptions"),
            "preemptions_ps": rate("preemptions"),
            "requests_finished_total": v.get("requests_finished"),
            "window_s": round(snap.t - base.t, 3),
        }
        dq = v.get("prefix_queries", 0.0) - base.values.get("prefix_queries", 0.0)
        out["prefix_hit_rate"] = (v.get("prefix_hits", 0.0) - base.values.get("prefix_hits", 0.0)) / dq if dq > 0 else None
        for key in HISTOGRAMS:
            if key not in snap.buckets:
                out[key] = None
                continue
            ubs, counts = _delta_buckets(snap.buckets[key], base.buckets.get(key))
            out[key] = {f"p{round(q * 100)}": bucket_quantile(q, ubs, counts) for q in QUANTILES}
            out[key]["count"] = counts[-1] if counts else 0.0
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

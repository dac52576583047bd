"""Reading a server: /metrics parsed into samples, histogram deltas and quantiles, JSON routes.

Only the standard library and prometheus_client's text parser: the doctor runs next to a server
(or on a laptop pointed at one) without torch.
"""
from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

# Metric prefixes the doctor understands: ours, and vLLM's (same names) for servers it can compare.
PREFIXES = ("pagedserve:", "vllm:")


def get(url: str, timeout: float = 10.0, headers: dict | None = None) -> bytes:
    req = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 - the user names the server
        return r.read()


def get_json(url: str, timeout: float = 10.0, headers: dict | None = None) -> dict | None:
    """The route's JSON, or None when the server does not have it (404) or it is not JSON."""
    try:
        return json.loads(get(url, timeout, headers))
    except urllib.error.HTTPError as e:
        if e.code in (404, 405):
            return None
        raise
    except ValueError:
        return None


@dataclass
class Scrape:
    """One /metrics read: {(sample name, sorted label items): value} and when it was taken."""

    t: float
    samples: dict

    @classmethod
    def parse(cls, text: str, t: float) -> "Scrape":
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return cls(t, out)

    def prefix(self) -> str:
        names = {n for n, _ in self.samples}
        for p in PREFIXES:
            if any(n.startswith(p) for n in names):
                return p
        raise ValueError("no pagedserve: or vllm: metrics found: is this a pagedserve (or vLLM) server's /metrics?")

    def total(self, name: str, **labels) -> float:
        want = set(labels.items())
        return sum(v for (n, ls), v in self.samples.items() if n == name and want <= set(ls))

    def has(self, name: str) -> bool:
        return any(n == name for n, _ in self.samples)

    def buckets(self, name: str) -> list[tuple[float, float]]:
        """Cumulative (le, count) of a histogram, summed over every other label."""
        acc: dict[float, float] = {}
        for (n, ls), v in self.samples.items():
            if n == name + "_bucket":
                le = float(dict(ls)["le"])
                acc[le] = acc.get(le, 0.0) + v
        return sorted(acc.items())


def bucket_delta(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    before = dict(a)
    return [(le, c - before.get(le, 0.0)) for le, c in b]


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile: linear inside the bucket that holds the q-th observation."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    rank = q * total
    prev_le, prev_c = 0.0, 0.0
    for le, c in buckets:
        if c >= rank:
            if math.isinf(le):
                return prev_le  # beyond the last finite bucket: its bound is all we know
            if c == prev_c:
                return le
            return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c)
        prev_le, prev_c = le, c
    return prev_le

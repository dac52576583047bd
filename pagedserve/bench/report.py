"""Metrics, the end-of-run table, the result JSON and the PNG for `pagedserve bench serve`.

Definitions (over successful requests only):

* TTFT: request start -> first chunk carrying generated text.
* ITL: gaps between consecutive chunks carrying generated text (all requests pooled).
* TPOT: (e2e - ttft) / (output_tokens - 1) per request with more than one output token.
* E2E: request start -> end of the stream.
* Throughputs divide by the run's duration (first request sent -> last one finished).
* Goodput: requests meeting every `--goodput` SLO, per second (a request with one output token has
  no TPOT and meets a TPOT SLO).

Percentiles use numpy's default linear interpolation. Per-request times in the JSON are seconds;
summary statistics are milliseconds (keys end in `_ms`).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

SCHEMA_VERSION = 1
METRICS = ("ttft", "tpot", "itl", "e2e")
METRIC_TITLES = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2e": ("End-to-end Latency", "E2E"),
}
STAT_KEYS = ("mean", "median", "p90", "p99", "min", "max", "std")
MAX_ERRORS_SHOWN = 5


@dataclass
class RequestRecord:
    """One request's outcome. Times are seconds; `start` is relative to the run start."""

    index: int
    prompt_len: int = 0  # from usage.prompt_tokens (else the dataset's target)
    output_len: int = 0  # from usage.completion_tokens (else the count of text chunks)
    expected_output_len: int = 0  # max_tokens asked for
    start: float = 0.0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float | None = None
    success: bool = False
    error: str | None = None
    http_status: int | None = None
    usage_reported: bool = False
    sent: bool = False  # False: never sent (the run hit --timeout first)
    end: float | None = None  # when it ended (answer, error or the run's --timeout), from the run start

    @property
    def tpot(self) -> float | None:
        if not self.success or self.ttft is None or self.e2e is None or self.output_len <= 1:
            return None
        return (self.e2e - self.ttft) / (self.output_len - 1)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tpot"] = self.tpot
        return d


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """`["ttft:200", "tpot:50", "e2e:2000"]` -> {"ttft": 200.0, ...} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        for part in item.replace(",", " ").split():
            name, sep, value = part.partition(":")
            name = name.strip().lower()
            if not sep or name not in ("ttft", "tpot", "e2e"):
                raise ValueError(f"bad --goodput item {part!r}: use ttft:MS, tpot:MS or e2e:MS")
            try:
                ms = float(value)
            except ValueError:
                raise ValueError(f"bad --goodput value in {part!r}: not a number") from None
            if not ms > 0:
                raise ValueError(f"bad --goodput value in {part!r}: must be > 0 ms")
            slos[name] = ms
    return slos


def meets_slos(rec: RequestRecord, slos: dict[str, float]) -> bool:
    if not rec.success:
        return False
    for name, ms in slos.items():
        value = rec.ttft if name == "ttft" else rec.e2e if name == "e2e" else rec.tpot
        if value is None:
            if name == "tpot":
                continue  # one output token: no TPOT to miss
            return False
        if value * 1000.0 > ms:
            return False
    return True


def stats_ms(values_s: list[float]) -> dict[str, float | None]:
    """mean/median/p90/p99/min/max/std in milliseconds; all None when there is nothing to measure."""
    if not values_s:
        return {k: None for k in STAT_KEYS}
    a = np.asarray(values_s, dtype=np.float64) * 1000.0
    return {
        "mean": float(a.mean()),
        "median": float(np.median(a)),
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
        "min": float(a.min()),
        "max": float(a.max()),
        "std": float(a.std()),
    }


def metric_values(records: list[RequestRecord], name: str) -> list[float]:
    ok = [r for r in records if r.success]
    if name == "ttft":
        return [r.ttft for r in ok if r.ttft is not None]
    if name == "e2e":
        return [r.e2e for r in ok if r.e2e is not None]
    if name == "tpot":
        return [t for r in ok if (t := r.tpot) is not None]
    if name == "itl":
        return [g for r in ok for g in r.itl]
    raise KeyError(name)


def max_concurrency_observed(records: list[RequestRecord]) -> int:
    """Most requests in flight at once: every request sent counts from its start to its end, failed
    ones and ones cut by --timeout too (counting only completed ones printed 0 for a run that
    --timeout stopped with 64 requests in flight)."""
    events = []
    for r in records:
        end = r.end if r.end is not None else (r.start + r.e2e if r.e2e is not None else None)
        if r.sent and end is not None:
            events.append((r.start, 1))
            events.append((end, -1))
    events.sort(key=lambda e: (e[0], e[1]))  # ends before starts at equal times
    cur = best = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best


def summarize(
    records: list[RequestRecord],
    duration_s: float,
    slos: dict[str, float] | None = None,
    *,
    timed_out: bool = False,
) -> dict[str, Any]:
    """The run's summary (the JSON's "summary" and "metrics" parts)."""
    slos = slos or {}
    ok = [r for r in records if r.success]
    failed = [r for r in records if not r.success]
    dur = duration_s if duration_s > 0 else float("nan")
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)

    def per_s(x: float) -> float:
        return 0.0 if not math.isfinite(dur) else x / dur

    errors: list[str] = []
    for r in failed:
        msg = r.error or "unknown error"
        if msg not in errors:
            errors.append(msg)
        if len(errors) >= MAX_ERRORS_SHOWN:
            break
    summary = {
        "duration_s": duration_s,
        "num_prompts": len(records),
        "completed": len(ok),
        "failed": len(failed),
        "not_sent": sum(not r.sent for r in failed),
        "errors": errors,
        "timed_out": timed_out,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": per_s(len(ok)),
        "input_throughput": per_s(total_in),
        "output_throughput": per_s(total_out),
        "total_token_throughput": per_s(total_in + total_out),
        "goodput_slos_ms": dict(slos),
        "goodput_completed": sum(meets_slos(r, slos) for r in ok) if slos else None,
        "goodput": per_s(sum(meets_slos(r, slos) for r in ok)) if slos else None,
        "usage_reported": all(r.usage_reported for r in ok) if ok else None,
        "max_concurrency_observed": max_concurrency_observed(records),
    }
    metrics = {f"{m}_ms": stats_ms(metric_values(records, m)) for m in METRICS}
    return {"summary": summary, "metrics": metrics}


def failure_line(result: dict[str, Any]) -> str | None:
    """One line saying why, when at least half of the requests failed (None otherwise)."""
    s = result["summary"]
    if not s["num_prompts"] or s["failed"] * 2 < s["num_prompts"]:
        return None
    first = s["errors"][0] if s["errors"] else "unknown error"
    hint = ""
    if "HTTP 401" in first or "HTTP 403" in first:
        hint = "; pass the server's key with --api-key"
    elif "--timeout" in first:
        hint = "; raise --timeout or send fewer / shorter requests (--num-prompts, --random-input-len)"
    elif "Connect" in first:
        hint = "; is the server running at --base-url?"
    return f"bench serve: {s['failed']} of {s['num_prompts']} requests failed, first error: {first[:200]}{hint}"


def _fmt(v: Any, nd: int = 2) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def format_table(result: dict[str, Any]) -> str:
    """A vllm-bench-like text table of a result dict (from `build_result`)."""
    s, m = result["summary"], result["metrics"]
    width = 50
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=width, c="=")]

    def row(label: str, value: Any, nd: int = 2) -> None:
        lines.append(f"{label:<40}{_fmt(value, nd):>10}")

    row("Successful requests:", s["completed"])
    row("Failed requests:", s["failed"])
    if s.get("not_sent"):
        row("  of which never sent:", s["not_sent"])
    if s.get("timed_out"):
        row("Stopped by --timeout:", "yes")
    cfg = result.get("config", {})
    if cfg.get("max_concurrency"):
        row("Maximum request concurrency:", cfg["max_concurrency"])
    rate = cfg.get("request_rate")
    if rate is not None and rate != "inf":
        row("Request rate (req/s):", float(rate))
    row("Benchmark duration (s):", s["duration_s"])
    row("Total input tokens:", s["total_input_tokens"])
    row("Total generated tokens:", s["total_output_tokens"])
    row("Request throughput (req/s):", s["request_throughput"])
    if s.get("goodput") is not None:
        row("Request goodput (req/s):", s["goodput"])
    row("Output token throughput (tok/s):", s["output_throughput"])
    row("Input token throughput (tok/s):", s["input_throughput"])
    row("Total token throughput (tok/s):", s["total_token_throughput"])
    row("Max concurrent requests seen:", s["max_concurrency_observed"])
    for name in METRICS:
        title, short = METRIC_TITLES[name]
        st = m[f"{name}_ms"]
        lines.append("{s:{c}^{n}}".format(s=title, n=width, c="-"))
        row(f"Mean {short} (ms):", st["mean"])
        row(f"Median {short} (ms):", st["median"])
        row(f"P90 {short} (ms):", st["p90"])
        row(f"P99 {short} (ms):", st["p99"])
    lines.append("=" * width)
    if s.get("usage_reported") is False:
        lines.append("note: the server sent no `usage`; token counts are estimates")
    if s["errors"]:
        lines.append(f"First errors ({len(s['errors'])} distinct shown):")
        for e in s["errors"]:
            lines.append(f"  - {e[:300]}")
    return "\n".join(lines)


def build_result(
    config: dict[str, Any],
    records: list[RequestRecord],
    duration_s: float,
    slos: dict[str, float] | None = None,
    *,
    timed_out: bool = False,
) -> dict[str, Any]:
    """The result JSON: schema_version, config, summary, metrics, requests (every record)."""
    out: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "config": config}
    out.update(summarize(records, duration_s, slos, timed_out=timed_out))
    out["requests"] = [r.to_dict() for r in records]
    return out


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def write_json(result: dict[str, Any], path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(_json_safe(result), f, indent=2)
        f.write("\n")


def throughput_timeline(records: list[RequestRecord], duration_s: float, bins: int | None = None):
    """(bin centres s, output tok/s, completed req/s). A request's output tokens are spread evenly
    over its text chunks' arrival times."""
    dur = max(duration_s, 1e-9)
    if bins is None:
        bins = int(min(60, max(5, round(dur))))  # ~1 s bins, 5 to 60 of them
    width = dur / bins
    tok = np.zeros(bins)
    req = np.zeros(bins)
    for r in records:
        if not r.success or r.ttft is None or r.e2e is None:
            continue
        times = r.start + r.ttft + np.concatenate([[0.0], np.cumsum(r.itl)])
        per = r.output_len / len(times)
        idx = np.clip((times / width).astype(int), 0, bins - 1)
        np.add.at(tok, idx, per)
        req[min(int((r.start + r.e2e) / width), bins - 1)] += 1
    centres = (np.arange(bins) + 0.5) * width
    return centres, tok / width, req / width


def plot(result: dict[str, Any], records: list[RequestRecord], path: str) -> None:
    """Latency CDFs (TTFT, TPOT, ITL, E2E) and throughput over time, to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, name in zip(axes.flat[:4], METRICS):
        vals = np.sort(np.asarray(metric_values(records, name)) * 1000.0)
        title, short = METRIC_TITLES[name]
        if len(vals):
            ax.plot(vals, np.arange(1, len(vals) + 1) / len(vals), drawstyle="steps-post")
            st = result["metrics"][f"{name}_ms"]
            for q, style in (("median", "--"), ("p99", ":")):
                ax.axvline(st[q], linestyle=style, color="gray", label=f"{q} {st[q]:.1f} ms")
            ax.legend(loc="lower right", fontsize=8)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(f"{title} CDF", fontsize=10)
        ax.set_xlabel(f"{short} (ms)")
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
    s = result["summary"]
    x, tok, req = throughput_timeline(records, s["duration_s"] or 0.0)
    ax = axes.flat[4]
    ax.plot(x, tok, label="output tok/s")
    ax.set_title("Output token throughput over time", fontsize=10)
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("tokens/s")
    ax.grid(alpha=0.3)
    ax = axes.flat[5]
    ax.plot(x, req, color="tab:green")
    ax.set_title("Completed requests over time", fontsize=10)
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("requests/s")
    ax.grid(alpha=0.3)
    cfg = result.get("config", {})
    fig.suptitle(
        f"{cfg.get('model', '?')} @ {cfg.get('base_url', '?')}{cfg.get('endpoint', '')} — "
        f"{s['completed']} ok / {s['failed']} failed in {s['duration_s']:.1f} s, "
        f"{s['output_throughput']:.1f} out tok/s",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

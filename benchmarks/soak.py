"""Soak: hold a server at 80 % of its measured capacity for a long time and check nothing drifts.

1. Starts `pagedserve serve` (or uses --url), measures capacity: completed requests per second
   with --concurrency closed-loop clients for --capacity-seconds.
2. Sends a Poisson stream at --load-fraction of that rate for --minutes: streaming (50 %),
   non-streaming (25 %), streams the client abandons midway (15 %) and invalid requests (10 %,
   which must get 400).
3. Every few seconds samples the server process's resident memory and open fds, and the KV usage,
   running and waiting counts from /metrics.

Writes summary.json and soak.png to --out (a directory outside the repository): request counts by
outcome, latency percentiles per minute, and the slope per minute of RSS, fds, KV usage and the
latency percentiles (least squares over the run, first minute of warm-up left out).

    python benchmarks/soak.py --model DIR --out /tmp/soak [--minutes 30] [--load-fraction 0.8]
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["Once upon a time", "The quick brown fox", "In a small village there lived", "Paged attention stores",
           "The cat sat on", "Numbers like 12345 and", "A story about a dragon who"]


def slope_per_minute(ts: list[float], ys: list[float]) -> float | None:
    pts = [(t, y) for t, y in zip(ts, ys) if y is not None]
    if len(pts) < 3:
        return None
    n = len(pts)
    mt = sum(t for t, _ in pts) / n
    my = sum(y for _, y in pts) / n
    var = sum((t - mt) ** 2 for t, _ in pts)
    return 60.0 * sum((t - mt) * (y - my) for t, y in pts) / var if var else None


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def one_request(h, model: str, kind: str, rng: random.Random, log: list) -> None:
    t0 = time.perf_counter()
    body = {"model": model, "prompt": rng.choice(PROMPTS) + " " + str(rng.randint(0, 10**6)),
            "max_tokens": rng.randint(16, 64), "temperature": rng.choice([0.0, 0.8]), "ignore_eos": True}
    rec = {"t": time.time(), "kind": kind}
    try:
        if kind == "invalid":
            body["temperature"] = -1
            r = await h.post("/v1/completions", json=body)
            rec["outcome"] = "ok" if r.status_code == 400 else f"status_{r.status_code}"
        elif kind == "non_streaming":
            r = await h.post("/v1/completions", json=body)
            rec["outcome"] = "ok" if r.status_code == 200 else f"status_{r.status_code}"
            rec["e2e"] = time.perf_counter() - t0
        else:
            body["stream"] = True
            cut = rng.randint(1, 8) if kind == "aborted" else None
            async with h.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    rec["outcome"] = f"status_{r.status_code}"
                else:
                    n = 0
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            n += 1
                            if n == 1:
                                rec["ttft"] = time.perf_counter() - t0
                            if cut is not None and n >= cut:
                                break
                    rec["outcome"] = "ok"
                    if cut is None:
                        rec["e2e"] = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001
        rec["outcome"] = f"client_{type(e).__name__}"
    log.append(rec)


async def measure_capacity(h, model: str, concurrency: int, seconds: float) -> float:
    done = 0
    stop = time.monotonic() + seconds
    rng = random.Random(1)

    async def worker():
        nonlocal done
        log: list = []
        while time.monotonic() < stop:
            await one_request(h, model, "non_streaming", rng, log)
            done += 1

    t0 = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done / (time.monotonic() - t0)


def proc_sample(pid: int | None) -> dict:
    if pid is None:
        return {}
    try:
        rss = 0
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) / 1024
        return {"rss_mib": rss, "fds": len(os.listdir(f"/proc/{pid}/fd"))}
    except OSError:
        return {}


async def metrics_sample(h) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    vals: dict = collections.defaultdict(float)
    for fam in text_string_to_metric_families((await h.get("/metrics")).text):
        for s in fam.samples:
            vals[s.name] += s.value
    return {"kv_usage": vals["pagedserve:kv_cache_usage_perc"], "running": vals["pagedserve:num_requests_running"],
            "waiting": vals["pagedserve:num_requests_waiting"]}


async def soak(url: str, pid: int | None, minutes: float, fraction: float, concurrency: int, cap_s: float,
               seed: int) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as h:
        model = (await h.get("/v1/models")).json()["data"][0]["id"]
        capacity = await measure_capacity(h, model, concurrency, cap_s)
        rate = capacity * fraction
        print(f"capacity {capacity:.2f} req/s; soaking at {rate:.2f} req/s for {minutes} min", file=sys.stderr)
        rng = random.Random(seed)
        log: list = []
        samples: list = []
        tasks: set = set()
        t_start = time.time()
        end = time.monotonic() + minutes * 60
        next_sample = 0.0

        while time.monotonic() < end:
            kind = rng.choices(["streaming", "non_streaming", "aborted", "invalid"], [0.5, 0.25, 0.15, 0.10])[0]
            t = asyncio.ensure_future(one_request(h, model, kind, random.Random(rng.random()), log))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
            if time.monotonic() >= next_sample:
                samples.append({"t": time.time() - t_start, **proc_sample(pid), **(await metrics_sample(h)),
                                "in_flight_clients": len(tasks)})
                next_sample = time.monotonic() + 5.0
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(2.0)
        final = {**proc_sample(pid), **(await metrics_sample(h)), "health": (await h.get("/health")).status_code}
    return {"capacity_rps": capacity, "rate_rps": rate, "t_start": t_start, "log": log, "samples": samples,
            "final": final}


def summarize(res: dict, minutes: float) -> dict:
    log, samples, t0 = res["log"], res["samples"], res["t_start"]
    outcomes = collections.Counter(f"{r['kind']}:{r['outcome']}" for r in log)
    per_min = []
    for m in range(int(minutes + 0.999)):
        win = [r for r in log if m * 60 <= r["t"] - t0 < (m + 1) * 60]
        e2e = [r["e2e"] for r in win if "e2e" in r]
        ttft = [r["ttft"] for r in win if "ttft" in r]
        per_min.append({"minute": m, "requests": len(win), "e2e_p50": pct(e2e, 0.5), "e2e_p99": pct(e2e, 0.99),
                        "ttft_p50": pct(ttft, 0.5), "ttft_p99": pct(ttft, 0.99)})
    warm = [s for s in samples if s["t"] >= 60] or samples
    ts = [s["t"] for s in warm]
    steady = [p for p in per_min if p["minute"] >= 1] or per_min
    mt = [p["minute"] * 60 for p in steady]
    slopes = {
        "rss_mib_per_min": slope_per_minute(ts, [s.get("rss_mib") for s in warm]),
        "fds_per_min": slope_per_minute(ts, [s.get("fds") for s in warm]),
        "kv_usage_per_min": slope_per_minute(ts, [s.get("kv_usage") for s in warm]),
        "e2e_p50_s_per_min": slope_per_minute(mt, [p["e2e_p50"] for p in steady]),
        "e2e_p99_s_per_min": slope_per_minute(mt, [p["e2e_p99"] for p in steady]),
        "ttft_p99_s_per_min": slope_per_minute(mt, [p["ttft_p99"] for p in steady]),
    }
    bad = {k: v for k, v in outcomes.items() if not k.endswith(":ok")}
    return {"minutes": minutes, "capacity_rps": round(res["capacity_rps"], 3), "rate_rps": round(res["rate_rps"], 3),
            "requests": len(log), "outcomes": dict(sorted(outcomes.items())), "not_ok": bad,
            "slopes": slopes, "per_minute": per_min, "first_sample": samples[0] if samples else None,
            "last_sample": samples[-1] if samples else None, "final": res["final"]}


def plot(res: dict, summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = res["samples"]
    ts = [x["t"] / 60 for x in s]
    fig, ax = plt.subplots(2, 2, figsize=(11, 7))
    ax[0][0].plot(ts, [x.get("rss_mib") for x in s])
    ax[0][0].set_title("server RSS (MiB)")
    ax[0][1].plot(ts, [x.get("fds") for x in s])
    ax[0][1].set_title("server open fds")
    ax[1][0].plot(ts, [x.get("kv_usage") for x in s])
    ax[1][0].set_title("KV cache usage")
    pm = summary["per_minute"]
    for key in ("e2e_p50", "e2e_p99", "ttft_p99"):
        ax[1][1].plot([p["minute"] for p in pm], [p[key] for p in pm], label=key, marker="o")
    ax[1][1].legend()
    ax[1][1].set_title("latency (s) per minute")
    for a in ax.flat:
        a.set_xlabel("minutes")
    fig.suptitle(f"soak at {summary['rate_rps']:.2f} req/s ({summary['requests']} requests)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory for a server started here")
    ap.add_argument("--url", help="a running server instead (RSS and fds are then not sampled)")
    ap.add_argument("--out", required=True, help="directory for summary.json and soak.png (outside the repo)")
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--load-fraction", type=float, default=0.8)
    ap.add_argument("--concurrency", type=int, default=16, help="closed-loop clients for the capacity run")
    ap.add_argument("--capacity-seconds", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--server-args", default="--max-model-len 256 --kv-cache-space 0.25",
                    help="extra `pagedserve serve` flags (default: %(default)s)")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    if out == REPO or REPO in out.parents:
        ap.error("--out must be outside the repository (measurements stay on the machine that made them)")
    out.mkdir(parents=True, exist_ok=True)
    srv = None
    pid = None
    if args.url is None:
        if not args.model:
            ap.error("give --model or --url")
        sys.path.insert(0, str(REPO / "tests"))
        from server_utils import RemoteServer

        srv = RemoteServer(args.model, [*args.server_args.split(), "--disable-log-requests",
                                        "--uvicorn-log-level", "warning"]).wait_ready()
        args.url, pid = srv.base_url, srv.proc.pid
    try:
        res = asyncio.run(soak(args.url, pid, args.minutes, args.load_fraction, args.concurrency,
                               args.capacity_seconds, args.seed))
    finally:
        if srv is not None:
            srv.stop()
    summary = summarize(res, args.minutes)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    plot(res, summary, out / "soak.png")
    print(json.dumps({k: summary[k] for k in ("capacity_rps", "rate_rps", "requests", "not_ok", "slopes", "final")},
                     indent=1))
    print(f"wrote {out / 'summary.json'} and {out / 'soak.png'}")
    return 0 if not summary["not_ok"] and summary["final"].get("health", 200) == 200 else 1


if __name__ == "__main__":
    sys.exit(main())

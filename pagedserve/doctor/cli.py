"""`pagedserve doctor`: diagnose a running server, or a `bench serve` result.

    pagedserve doctor --url http://host:8000 [--window 60] [--interval 1] [--ttft-slo-ms 1000] [--json]
    pagedserve doctor --bench result.json [--url http://host:8000] [--json]

Live: reads /metrics every --interval seconds for --window seconds (and /v1/models and /info
for the engine's configuration), then prints each diagnosis with its evidence and the flag to
change. Exit status: 0 nothing found, 1 diagnoses printed, 2 the server or file could not be read.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error

from pagedserve.doctor.diagnose import Diagnosis, diagnose_bench, diagnose_live, window_stats
from pagedserve.doctor.scrape import Scrape, get, get_json


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("doctor", help="diagnose a running server (or a bench serve result): evidence and "
                                             "the flag to change",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="the server's root, e.g. http://127.0.0.1:8000")
    p.add_argument("--bench", default=None, metavar="RESULT.json", help="a `bench serve --result-json` file")
    p.add_argument("--window", type=float, default=60.0, help="seconds to watch the server (default: %(default)s)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between reads (default: %(default)s)")
    p.add_argument("--ttft-slo-ms", type=float, default=1000.0,
                   help="time to first token above this (P90) is slow (default: %(default)s)")
    p.add_argument("--api-key", default=None, help="bearer token for /v1 routes (/metrics needs none)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=run)
    return p


def server_config(url: str, headers: dict) -> dict:
    """The engine flags the server reports (GET /info); {} when it reports none (e.g. vLLM)."""
    info = get_json(url.rstrip("/") + "/info", headers=headers) or {}
    cfg = dict(info.get("pagedserve_config") or {})
    models = get_json(url.rstrip("/") + "/v1/models", headers=headers) or {}
    data = models.get("data") or [{}]
    cfg.setdefault("model", data[0].get("id"))
    cfg.setdefault("max_model_len", data[0].get("max_model_len"))
    return cfg


def watch(url: str, window: float, interval: float) -> list[Scrape]:
    scrapes = []
    start = time.monotonic()
    while True:
        now = time.monotonic()
        scrapes.append(Scrape.parse(get(url.rstrip("/") + "/metrics").decode(), now))
        if now - start >= window:
            return scrapes
        time.sleep(max(0.0, min(interval, start + window - time.monotonic())))


def render(diagnoses: list[Diagnosis], header: str) -> str:
    lines = [header]
    if not diagnoses:
        lines.append("No problems found.")
    for d in diagnoses:
        lines.append(f"\n[{d.id}] {d.title}")
        for e in d.evidence:
            lines.append(f"  evidence: {e}")
        lines.append(f"  change:   {d.change}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if not args.url and not args.bench:
        print("error: give --url http://host:port (a live server) or --bench RESULT.json", file=sys.stderr)
        return 2
    if args.window <= 0 or args.interval <= 0:
        print("error: --window and --interval must be > 0", file=sys.stderr)
        return 2
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    slo = args.ttft_slo_ms / 1000.0
    try:
        cfg = server_config(args.url, headers) if args.url else {}
        if args.bench:
            with open(args.bench, encoding="utf-8") as f:
                result = json.load(f)
            diagnoses = diagnose_bench(result, cfg, slo)
            stats = result.get("summary", {})
            header = (f"bench result {args.bench}: {stats.get('completed')} completed, "
                      f"{stats.get('request_throughput', 0):.2f} req/s, "
                      f"up to {stats.get('max_concurrency_observed')} in flight")
        else:
            scrapes = watch(args.url, args.window, args.interval)
            w = window_stats(scrapes)
            stats = w.to_dict()
            diagnoses = diagnose_live(w, cfg, slo)
            header = (f"{args.url} ({cfg.get('model')}): {w.seconds:.0f} s watched, {w.finished:g} requests "
                      f"finished, {w.generation_tokens / w.seconds:.1f} generated tokens/s")
    except (OSError, urllib.error.URLError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"config": cfg, "stats": stats, "diagnoses": [d.to_dict() for d in diagnoses]}, indent=2))
    else:
        print(render(diagnoses, header))
    return 1 if diagnoses else 0

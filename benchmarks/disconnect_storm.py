"""Disconnect storm: streaming requests cut at random points, then nothing may be left behind.

Each request is a streaming completion or chat request that the client abandons at one of three
points, chosen at random: before the first byte (cancelled within a few ms of sending), during a
prefill that spans several steps (a long prompt, --max-num-batched-tokens small, cut before the
first token), or mid-stream (after a random number of events); a few run to the end. The server
runs once with prefix caching on and once off, with a KV pool small enough that preemption is in
play (the script reports how many preemptions happened).

Afterwards, for each run: 0 running, 0 waiting, KV usage 0, /health 200, a normal request still
served, and the server's open file descriptors and threads back to their level before the storm.

    python benchmarks/disconnect_storm.py --model DIR [--requests 3000] [--concurrency 64] [--output-json PATH]

tests/test_disconnect_storm.py runs `storm` on a bounded count in process, where it also checks
that no asyncio task is left on the server's loop.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))  # fuzz_server's /metrics helpers

MODES = ("before_first_byte", "during_prefill", "mid_stream", "complete")
WEIGHTS = (0.25, 0.25, 0.4, 0.1)
SHARED_PREFIX = "You are a helpful assistant who answers briefly. " * 4


async def _one(client, model: str, rng: random.Random, counts: collections.Counter) -> None:
    mode = rng.choices(MODES, WEIGHTS)[0]
    chat = rng.random() < 0.3
    long_prompt = mode == "during_prefill"
    text = SHARED_PREFIX + (" ".join(str(rng.randint(0, 9999)) for _ in range(rng.randint(60, 90) if long_prompt
                                                                               else rng.randint(1, 12))))
    body = {"model": model, "max_tokens": rng.randint(8, 48), "stream": True, "temperature": rng.choice([0, 1]),
            "ignore_eos": True, "n": rng.choice([1, 1, 1, 2])}
    if chat:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": text}]
    else:
        path, body["prompt"] = "/v1/completions", text

    async def run() -> None:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                counts[f"status_{r.status_code}"] += 1
                await r.aread()
                return
            k = rng.randint(1, 20) if mode == "mid_stream" else 10**9
            seen = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if mode == "during_prefill" and seen >= 1 and "role" not in line:
                        counts["prefill_cut_late"] += 1  # the first token came before the cut
                        return
                    if seen >= k:
                        return  # leaving the block closes the connection mid-stream
            counts["finished"] += 1

    try:
        if mode == "before_first_byte":
            await asyncio.wait_for(run(), timeout=rng.uniform(0.0005, 0.01))
        elif mode == "during_prefill":
            await asyncio.wait_for(run(), timeout=rng.uniform(0.005, 0.05))
        else:
            await run()
    except (asyncio.TimeoutError, asyncio.CancelledError):
        pass
    except Exception as e:  # noqa: BLE001 - a client-side error while cutting is part of the storm
        counts[f"client_{type(e).__name__}"] += 1
    counts[mode] += 1


async def storm(base_url: str, n: int, concurrency: int, seed: int = 0, model: str | None = None) -> dict:
    """Send n cut streaming requests, at most `concurrency` at a time; each on its own connection."""
    import httpx

    rng = random.Random(seed)
    counts: collections.Counter = collections.Counter()
    limits = httpx.Limits(max_keepalive_connections=0, max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=60, limits=limits) as client:
        if model is None:
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
        sem = asyncio.Semaphore(concurrency)

        async def guarded(i: int) -> None:
            async with sem:
                await _one(client, model, random.Random(rng.random() + i), counts)

        t0 = time.time()
        await asyncio.gather(*(guarded(i) for i in range(n)))
        return {"requests": n, "seconds": round(time.time() - t0, 1), "counts": dict(sorted(counts.items()))}


def wait_idle(base_url: str, timeout: float = 30.0) -> dict:
    import httpx

    from fuzz_server import wait_idle as wait_client_idle

    with httpx.Client(base_url=base_url, timeout=10) as client:
        return wait_client_idle(client, timeout)


def process_resources(pid: int) -> dict:
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    threads = len(os.listdir(f"/proc/{pid}/task"))
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    return {"fds": fds, "threads": threads, "rss_mib": round(rss / 2**20, 1)}


def run_config(model_dir: str, label: str, extra: list, n: int, concurrency: int, seed: int) -> dict:
    import httpx

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from server_utils import RemoteServer

    srv = RemoteServer(model_dir, ["--max-model-len", 256, "--num-gpu-blocks-override", 48,
                                   "--max-num-batched-tokens", 64, "--max-num-seqs", 32, "--disable-log-requests",
                                   "--uvicorn-log-level", "warning", *extra]).wait_ready()
    try:
        asyncio.run(storm(srv.base_url, 16, 8, seed=seed + 1))  # warm-up: lazily made threads and buffers
        wait_idle(srv.base_url)
        time.sleep(1.0)
        before = process_resources(srv.proc.pid)
        result = asyncio.run(storm(srv.base_url, n, concurrency, seed=seed))
        after_state = wait_idle(srv.base_url)
        time.sleep(1.0)  # sockets in their last close steps
        after = process_resources(srv.proc.pid)
        ok = httpx.post(srv.url("/v1/completions"), json={"prompt": "hi", "max_tokens": 3}, timeout=60).status_code
        health = httpx.get(srv.url("/health")).status_code
    finally:
        srv.stop()
    good = (after_state["running"] == 0 and after_state["waiting"] == 0 and after_state["kv_cache_usage"] == 0
            and ok == 200 and health == 200 and after["fds"] <= before["fds"] and after["threads"] <= before["threads"])
    return {"config": label, **result, "after": after_state, "resources_before": before, "resources_after": after,
            "completion_after": ok, "health_after": health, "pass": good}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="model directory (a small one: the storm is about the server)")
    ap.add_argument("--requests", type=int, default=3000, help="per configuration")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    runs = [run_config(args.model, "prefix caching on", ["--enable-prefix-caching"], args.requests,
                       args.concurrency, args.seed),
            run_config(args.model, "prefix caching off", ["--no-enable-prefix-caching"], args.requests,
                       args.concurrency, args.seed)]
    print(json.dumps(runs, indent=1))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(runs, indent=1))
    good = all(r["pass"] for r in runs)
    print("PASS" if good else "FAIL")
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())

"""The served figures with the engine core in its own process against the engine thread in the
server process (--no-engine-process), on the same requests, and both against offline
`LLM.generate` on those requests.

    python benchmarks/serve_engine_process_ab.py [--model small] [--dtype float32] [--rounds 3]
        [--concurrency 16 64] [--input-len 128] [--output-len 64]

Both servers run side by side (an idle server sleeps); each round runs every concurrency on both,
in alternating order, with `pagedserve bench serve` (random token-id prompts, 4 x concurrency
requests: 64 at 16 and 256 at 64 as in WORKLOADS.md's S2). Reported: medians over rounds of
output tok/s, TTFT and TPOT P50/P99, the ratio engine-process / in-process, online / offline
output tok/s, the CPU seconds each process used per request, and a per-request profile of the
server process's own work (parse, tokenize, queue, detokenize, SSE) timed on the real code paths.
The load average is printed: on a shared host the figures move with the neighbours.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import psutil

REPO = Path(__file__).resolve().parents[1]
MODES = {"in-process": ["--no-engine-process"], "engine-process": []}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="small", help="small | medium (WORKLOADS.md) or a model folder")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--kv-cache-space", type=float, default=2.0)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--output-json", default=None)
    return p.parse_args()


def model_dir(name: str) -> str:
    if os.path.isdir(name):
        return name
    from pagedserve.bench.workloads import bench_model_dir

    return str(bench_model_dir(name))


def write_prompts(path: Path, n: int, input_len: int, output_len: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 32000, size=input_len).tolist() for _ in range(n)]
    with open(path, "w") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p, "output_len": output_len}) + "\n")
    return prompts


def engine_args(a) -> list[str]:
    return ["--dtype", a.dtype, "--kv-cache-space", str(a.kv_cache_space), "--max-num-seqs", str(a.max_num_seqs),
            "--seed", "0"]


def start_server(model: str, mode_args: list[str], a, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pagedserve", "serve", "--model", model, "--port", str(port),
           "--disable-log-requests", "--disable-log-stats", "--uvicorn-log-level", "warning",
           *engine_args(a), *mode_args]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_ready(port: int, proc: subprocess.Popen, timeout: float = 900) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server on port {port} exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"server on port {port} not ready")


def cpu_seconds(proc: psutil.Process) -> tuple[float, float]:
    """(the server process's own CPU seconds, its children's: the engine core)."""
    own = proc.cpu_times()
    kids = 0.0
    for c in proc.children(recursive=True):
        try:
            t = c.cpu_times()
            kids += t.user + t.system
        except psutil.Error:
            pass
    return own.user + own.system, kids


def bench_serve(port: int, jsonl: Path, n: int, conc: int, out_len: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result = f.name
    cmd = [sys.executable, "-m", "pagedserve", "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
           "--dataset", str(jsonl), "--num-prompts", str(n), "--random-output-len", str(out_len),
           "--max-concurrency", str(conc), "--result-json", result, "--disable-tqdm"]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    with open(result) as f:
        data = json.load(f)
    os.unlink(result)
    return data


OFFLINE = """
import json, sys, time
from pagedserve import LLM, SamplingParams
a = json.loads(sys.argv[1])
prompts = [json.loads(l)["prompt"] for l in open(a["jsonl"])]
llm = LLM(model=a["model"], dtype=a["dtype"], kv_cache_space=a["kv"], max_num_seqs=a["seqs"], seed=0)
sp = SamplingParams(temperature=0.0, max_tokens=a["out"], ignore_eos=True)
llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=2))  # warm-up
t0 = time.perf_counter()
outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
dt = time.perf_counter() - t0
print(json.dumps({"output_throughput": sum(len(o.outputs[0].token_ids) for o in outs) / dt, "seconds": dt}))
"""


def offline(model: str, a, jsonl: Path) -> float:
    arg = json.dumps({"model": model, "dtype": a.dtype, "kv": a.kv_cache_space, "seqs": a.max_num_seqs,
                      "jsonl": str(jsonl), "out": a.output_len})
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", OFFLINE, arg], env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["output_throughput"]


def front_end_profile(model: str, out_len: int, input_len: int, reps: int = 50) -> dict[str, float]:
    """Microseconds of server-process CPU per request, by part, on the code the server runs."""
    from transformers import AutoTokenizer

    from pagedserve import SamplingParams
    from pagedserve.engine import core_messages as m
    from pagedserve.engine.output_processor import OutputProcessor
    from pagedserve.server.protocol import CompletionRequest, CompletionResponseChoice, CompletionStreamResponse, sse

    tok = AutoTokenizer.from_pretrained(model)
    rng = np.random.default_rng(1)
    ids = rng.integers(3, 32000, size=input_len).tolist()
    text = tok.decode(ids)
    body = json.dumps({"model": "m", "prompt": ids, "max_tokens": out_len, "stream": True, "temperature": 0,
                       "ignore_eos": True, "stream_options": {"include_usage": True}})
    out_ids = rng.integers(3, 32000, size=out_len).tolist()
    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)

    def timed(fn) -> float:
        fn()
        t0 = time.process_time()
        for _ in range(reps):
            fn()
        return (time.process_time() - t0) / reps * 1e6

    def detok():
        proc = OutputProcessor(tok)
        proc.add("r", None, ids, params)
        for k, t in enumerate(out_ids):
            last = k == len(out_ids) - 1
            proc.process(("r", last, [(0, [t], None, 0.0, "length" if last else None, None, None)], None, None, 0))

    def sse_chunks():
        for k in range(out_len):
            sse(CompletionStreamResponse(id="cmpl-x", created=0, model="m", choices=[
                CompletionResponseChoice(index=0, text="word ", logprobs=None, finish_reason=None)]))

    return {
        "parse (JSON body to CompletionRequest)": timed(lambda: CompletionRequest.model_validate_json(body)),
        f"tokenize ({input_len}-token text prompt; id prompts skip it)": timed(lambda: tok.encode(text)),
        "queue (pickle the add for the core)": timed(lambda: m.dumps((m.ADD, b"c", "r", ids, params, 0.0))),
        f"detokenize + stop checks ({out_len} tokens)": timed(detok),
        f"SSE ({out_len} chunks)": timed(sse_chunks),
    }


def main() -> int:
    a = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the servers are stopped on the way out
    model = model_dir(a.model)
    work = Path(tempfile.mkdtemp(prefix="serve-ab-"))
    sets = {}
    for c in a.concurrency:
        n = 4 * c
        jsonl = work / f"prompts-{n}.jsonl"
        write_prompts(jsonl, n, a.input_len, a.output_len)
        sets[c] = (jsonl, n)
    print(f"model {model} ({a.dtype}); load average before: {os.getloadavg()}; {os.cpu_count()} CPUs (shared host)")
    ports = {"in-process": 18731, "engine-process": 18732}
    procs = {mode: start_server(model, args, a, ports[mode]) for mode, args in MODES.items()}
    res: dict = {c: {mode: [] for mode in MODES} for c in a.concurrency}
    offline_tps: dict = {c: [] for c in a.concurrency}
    try:
        for mode, p in procs.items():
            wait_ready(ports[mode], p)
        ps = {mode: psutil.Process(p.pid) for mode, p in procs.items()}
        for r in range(a.rounds):
            order = list(MODES) if r % 2 == 0 else list(reversed(MODES))
            for c in a.concurrency:
                jsonl, n = sets[c]
                for mode in order:
                    own0, kids0 = cpu_seconds(ps[mode])
                    data = bench_serve(ports[mode], jsonl, n, c, a.output_len)
                    own1, kids1 = cpu_seconds(ps[mode])
                    s, met = data["summary"], data["metrics"]
                    res[c][mode].append({
                        "tok_s": s["output_throughput"], "failed": s["failed"],
                        "ttft_p50": met["ttft_ms"]["median"], "ttft_p99": met["ttft_ms"]["p99"],
                        "tpot_p50": met["tpot_ms"]["median"], "tpot_p99": met["tpot_ms"]["p99"],
                        "server_cpu_ms_per_req": (own1 - own0) / n * 1e3,
                        "core_cpu_ms_per_req": (kids1 - kids0) / n * 1e3,
                    })
                    print(f"round {r} c={c} {mode}: {s['output_throughput']:.1f} tok/s", flush=True)
                if not a.skip_offline:
                    offline_tps[c].append(offline(model, a, jsonl))
                    print(f"round {r} c={c} offline: {offline_tps[c][-1]:.1f} tok/s", flush=True)
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            p.wait(60)
    print(f"\nload average after: {os.getloadavg()} (shared host: figures are medians of {a.rounds} alternated rounds)")
    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    summary = {}
    for c in a.concurrency:
        print(f"\nrandom {a.input_len} in / {a.output_len} out, {sets[c][1]} requests, {c} concurrent")
        print(f"{'':16s}{'out tok/s':>10s}{'TTFT p50':>10s}{'TTFT p99':>10s}{'TPOT p50':>10s}{'TPOT p99':>10s}"
              f"{'srv CPU ms/req':>16s}{'core CPU ms/req':>17s}")
        row = {}
        for mode in MODES:
            rs = res[c][mode]
            row[mode] = {k: med([x[k] for x in rs]) for k in rs[0]}
            v = row[mode]
            print(f"{mode:16s}{v['tok_s']:10.1f}{v['ttft_p50']:10.1f}{v['ttft_p99']:10.1f}{v['tpot_p50']:10.1f}"
                  f"{v['tpot_p99']:10.1f}{v['server_cpu_ms_per_req']:16.2f}{v['core_cpu_ms_per_req']:17.2f}")
        ratio = med([e["tok_s"] / i["tok_s"] for e, i in zip(res[c]["engine-process"], res[c]["in-process"])])
        print(f"engine-process / in-process output tok/s: {ratio:.3f} (median of per-round ratios)")
        row["ratio"] = ratio
        if offline_tps[c]:
            off = med(offline_tps[c])
            row["offline_tok_s"] = off
            for mode in MODES:
                print(f"{mode} online / offline LLM.generate ({off:.1f} tok/s): {row[mode]['tok_s'] / off:.3f}")
        summary[c] = row
    prof = front_end_profile(model, a.output_len, a.input_len)
    total = sum(prof.values())
    srv = med([x["server_cpu_ms_per_req"] for c in a.concurrency for x in res[c]["engine-process"]]) * 1e3
    print(f"\nserver-process CPU per request (engine-process mode, measured): {srv:.0f} us; its parts, timed alone:")
    for k, v in prof.items():
        print(f"  {k:55s}{v:9.0f} us  {100 * v / srv:5.1f} % of the measured")
    print(f"  {'(the rest: HTTP, asyncio, routing, metrics)':55s}{srv - total:9.0f} us  {100 * (srv - total) / srv:5.1f} %")
    if a.output_json:
        with open(a.output_json, "w") as f:
            json.dump({"summary": summary, "profile_us": prof, "server_cpu_us_per_req": srv}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

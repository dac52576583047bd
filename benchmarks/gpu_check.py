"""The one prepared GPU check (issue 7): correctness on CUDA, offline throughput, online S1.

Written for a session that gets one H200 for ~15 minutes of device time, all in one run:
    bash benchmarks/gpu_check.sh                 # on the GPU machine; results under $OUT
    python benchmarks/gpu_check.py --cpu-smoke   # here: tiny models, tiny counts, proves it runs
Every step appends to results.json as soon as it finishes (a timeout keeps what was done) and
records its command line; each step is bounded by what is left of --budget-s.

(a) correctness: greedy pagedserve vs transformers on CUDA, bf16 and fp32, for tiny llama/qwen2
    checkpoints (tests/tiny_models.py, temp dir), per attention backend (triton, torch, flash-attn
    when usable) and with CUDA graphs on, plus SmolLM2 (pagedserve.default_model) when installed.
    Pass: fp32 identical for every prompt; bf16 identical, or at the first divergence each side's
    token is in the other's top-5, for >= 95 % of prompts.
(b) throughput: the "medium" bench model and a Llama-3-8B-shaped random bf16 model (built on the
    GPU, saved once), W1 and W2 through `pagedserve bench throughput --baseline hf --output-json`,
    with the fraction of the H200's bandwidth (4.3 TB/s) and bf16 FLOP (790 TFLOP/s) ceilings.
(c) S1 online: `pagedserve serve` + `pagedserve bench serve --num-prompts 256 --max-concurrency 64
    --random-input-len 520 --random-range-ratio 0.97 --random-output-len 136`.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

PEAK_BW = 4.3e12  # H200 HBM3e bytes/s
PEAK_FLOPS = 790e12  # H200 dense bf16 FLOP/s (as given in the issue)
LLAMA8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, vocab_size=128256)
SMOKE_8B = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=32000)


class Runner:
    def __init__(self, out: Path, budget_s: float, smoke: bool):
        self.out, self.smoke = out, smoke
        self.deadline = time.time() + budget_s
        self.results = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "smoke": smoke, "steps": {}}
        self.py = sys.executable

    def left(self) -> float:
        return self.deadline - time.time()

    def save(self):
        (self.out / "results.json").write_text(json.dumps(self.results, indent=2, default=str))

    def record(self, name, value):
        self.results["steps"][name] = value
        self.save()
        print(f"== {name}: {json.dumps(value, default=str)[:400]}", flush=True)

    def step(self, name, fn, min_s=20.0):
        if self.left() < min_s:
            self.record(name, {"skipped": f"out of time ({self.left():.0f}s left)"})
            return None
        t0 = time.time()
        try:
            v = fn()
            if isinstance(v, dict):
                v.setdefault("seconds", round(time.time() - t0, 1))
            self.record(name, v)
            return v
        except Exception as e:
            self.record(name, {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:],
                               "seconds": round(time.time() - t0, 1)})
            return None

    def sh(self, cmd: list[str], timeout: float, env=None, log=None) -> dict:
        timeout = max(5.0, min(timeout, self.left() - 5))
        t0 = time.time()
        full_env = {**os.environ, **(env or {})}
        try:
            p = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
            rc, so, se = p.returncode, p.stdout, p.stderr
        except subprocess.TimeoutExpired as e:
            rc, so, se = "timeout", (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or ""), \
                (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        if log:
            (self.out / log).write_text(f"$ {shlex.join(cmd)}\n--- stdout\n{so}\n--- stderr\n{se}")
        return {"command": shlex.join(cmd), "env": env or {}, "rc": rc, "seconds": round(time.time() - t0, 1),
                "tail": (so + se)[-1500:]}


# ---------------------------------------------------------------- (a) correctness


def compare_greedy(model_dir: str, dtype: str, device: str, prompts, max_tokens: int, engine_kw: dict,
                   hf_loader=None) -> dict:
    """pagedserve vs transformers greedy on one device/dtype: per prompt identical / top-5 compatible."""
    import torch
    from transformers import AutoModelForCausalLM

    from pagedserve import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype=dtype, device=device, **engine_kw)
    backend = llm.llm_engine.runner.backend.name
    graphs = getattr(llm.llm_engine.runner, "graphs", None) is not None
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=5))
    del llm
    tdt = getattr(torch, dtype)
    hf = (hf_loader() if hf_loader else AutoModelForCausalLM.from_pretrained(model_dir, dtype=tdt)).to(device, tdt).eval()
    identical = compatible = 0
    details = []
    for p, o in zip(prompts, outs):
        ours = o.outputs[0].token_ids
        ids = torch.tensor([p], device=device)
        with torch.no_grad():
            g = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                            min_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                            output_scores=True, return_dict_in_generate=True)
        ref = g.sequences[0, len(p):].tolist()
        if ours == ref:
            identical += 1
            compatible += 1
            continue
        i = next(j for j in range(min(len(ours), len(ref))) if ours[j] != ref[j])
        hf_top5 = g.scores[i][0].float().topk(5).indices.tolist()
        our_top5 = list(o.outputs[0].logprobs[i].keys())
        ok = ours[i] in hf_top5 and ref[i] in our_top5
        compatible += ok
        details.append({"prompt_len": len(p), "first_divergence": i, "ours": ours[i], "hf": ref[i],
                        "top5_compatible": ok})
    del hf
    torch.cuda.empty_cache() if device == "cuda" else None
    n = len(prompts)
    passed = identical == n if dtype == "float32" else compatible >= math.ceil(0.95 * n)
    return {"backend": backend, "cuda_graphs": graphs, "dtype": dtype, "prompts": n, "identical": identical,
            "top5_compatible": compatible, "pass": passed, "divergences": details[:10]}


def correctness(r: Runner, device: str):
    from hf_reference import random_prompts
    from tiny_models import make_tiny_checkpoint

    tmp = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    models = {"tiny-llama": make_tiny_checkpoint(tmp / "llama", "llama"),
              "tiny-qwen2": make_tiny_checkpoint(tmp / "qwen2", "qwen2", num_kv_heads=1),
              "tiny-llama-hd64": make_tiny_checkpoint(tmp / "llama64", "llama", hidden_size=128, num_heads=2,
                                                      num_kv_heads=1)}
    lengths = [1, 3, 17, 64, 100, 129, 200, 300, 5, 48, 77, 160] if not r.smoke else [1, 17, 40]
    n_prompts, max_tokens = (24, 16) if not r.smoke else (3, 4)
    kw = dict(max_num_batched_tokens=256, max_num_seqs=32, num_gpu_blocks_override=1024)
    backends = ["torch"] if device == "cpu" else ["triton", "torch", "flash-attn"]
    dtypes = ["float32"] if device == "cpu" else ["float32", "bfloat16"]
    for name, d in models.items():
        prompts = random_prompts(n_prompts, 384, lengths, seed=1)
        for be in backends:
            for dt in dtypes:
                def run(be=be, dt=dt, d=d, prompts=prompts):
                    os.environ["PAGEDSERVE_ATTENTION_BACKEND"] = be
                    try:
                        return compare_greedy(str(d), dt, device, prompts, max_tokens, kw)
                    finally:
                        os.environ.pop("PAGEDSERVE_ATTENTION_BACKEND", None)
                r.step(f"a/{name}/{be}/{dt}", run, min_s=60)
    if device == "cuda":  # CUDA graphs (opt-in path) on the tiny models, Triton backend
        for name in ("tiny-llama", "tiny-llama-hd64"):
            def run_graphs(d=models[name]):
                os.environ.update(PAGEDSERVE_ATTENTION_BACKEND="triton", PAGEDSERVE_CUDA_GRAPHS="1")
                try:
                    prompts = random_prompts(n_prompts, 384, lengths, seed=2)
                    return {dt: compare_greedy(str(d), dt, device, prompts, max_tokens, kw) for dt in dtypes}
                finally:
                    os.environ.pop("PAGEDSERVE_ATTENTION_BACKEND", None)
                    os.environ.pop("PAGEDSERVE_CUDA_GRAPHS", None)
            r.step(f"a/{name}/triton+cuda-graphs", run_graphs, min_s=60)

    def smollm2():
        from pagedserve.default_model import default_model_path

        try:
            path = default_model_path()
        except RuntimeError as e:
            return {"skipped": f"default model not installed: {e}"}
        from transformers import AutoModelForCausalLM

        def loader():
            return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name)

        prompts = random_prompts(n_prompts, 49152, lengths, seed=3)
        return {dt: compare_greedy(str(path), dt, device, prompts, max_tokens,
                                   dict(max_num_seqs=32, num_gpu_blocks_override=2048, max_model_len=2048),
                                   hf_loader=loader) for dt in dtypes}

    r.step("a/smollm2", smollm2, min_s=90)


# ---------------------------------------------------------------- (b) throughput


def build_llama8b(out: Path, shape: dict, device: str) -> Path:
    """A Llama-3-8B-shaped random-weight bf16 checkpoint, initialised on the device, saved once."""
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedserve.bench.workloads import _word_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(max_position_embeddings=8192, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                      rope_theta=500000.0, **shape)
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    model.save_pretrained(str(out), safe_serialization=True)
    del model
    _word_tokenizer(out)
    return out


def ceilings(result: dict, cfg: dict, dtype_bytes: int, max_num_seqs: int) -> dict:
    """Fractions of the bandwidth and FLOP ceilings. Traffic is a lower bound: the weights once per
    decode step (steps >= output_tokens / max_num_seqs) plus every decode token's KV reads."""
    from pagedserve.bench.workloads import make_workload

    h, L = cfg["hidden_size"], cfg["num_hidden_layers"]
    hd = h // cfg["num_attention_heads"]
    kvh = cfg["num_key_value_heads"]
    params = L * (h * hd * (2 * cfg["num_attention_heads"] + 2 * kvh) + 3 * h * cfg["intermediate_size"]) \
        + 2 * h * cfg["vocab_size"]
    wl = make_workload(result["workload"], result.get("requests"))
    kv_per_tok = 2 * L * kvh * hd * dtype_bytes
    kv_reads = sum(kv_per_tok * (len(p) * o + o * (o - 1) // 2) for p, o in zip(wl.prompts, wl.output_lens))
    steps = math.ceil(wl.output_tokens / max_num_seqs)
    s = result["pagedserve"]["seconds_median"]
    bytes_lb = params * dtype_bytes * steps + kv_reads
    return {"params": params, "bytes_lower_bound": bytes_lb, "bandwidth_fraction": bytes_lb / s / PEAK_BW,
            "flop_fraction": result["pagedserve"]["achieved_gflops"] * 1e9 / PEAK_FLOPS}


def throughput(r: Runner, device: str, llama8b_dir: Path | None):
    from pagedserve.bench.workloads import MODEL_SHAPES, bench_model_dir

    # (smoke: the tiny 8B-stand-in serves as "medium" too; building the bench models takes minutes on a CPU)
    models = {"medium": str(bench_model_dir("medium")) if not r.smoke else str(llama8b_dir)}
    if llama8b_dir is not None:
        models["llama8b"] = str(llama8b_dir)
    dtype = "bfloat16" if device == "cuda" else "float32"
    for name, mdir in models.items():
        cfg = json.loads((Path(mdir) / "config.json").read_text())
        for wl in ("W1", "W2"):
            def run(name=name, mdir=mdir, wl=wl, cfg=cfg):
                js = r.out / f"throughput_{name}_{wl}.json"
                cmd = [r.py, "-m", "pagedserve", "bench", "throughput", "--model", mdir, "--workload", wl,
                       "--dtype", dtype, "--device", device, "--baseline", "hf", "--output-json", str(js)]
                if r.smoke:
                    cmd += ["--num-prompts", "3", "--max-model-len", "2048", "--num-gpu-blocks-override", "512",
                            "--hf-batch-size", "3"]
                else:
                    cmd += ["--hf-batch-size", "64"]
                res = r.sh(cmd, timeout=240 if name == "llama8b" else 150, log=f"throughput_{name}_{wl}.log")
                if js.exists():
                    data = json.loads(js.read_text())
                    res["result"] = {k: data[k] for k in ("pagedserve", "hf", "ratio_output_tokens_per_s") if k in data}
                    res["ceilings"] = ceilings(data, cfg, 2 if dtype == "bfloat16" else 4, 256)
                return res
            r.step(f"b/{name}/{wl}", run, min_s=45 if name == "medium" else 120)


# ---------------------------------------------------------------- (c) S1 online


def serve_s1(r: Runner, device: str, model: str):
    def free_port():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    port = free_port()
    dtype = "bfloat16" if device == "cuda" else "float32"
    server_cmd = [r.py, "-m", "pagedserve", "serve", model, "--port", str(port), "--dtype", dtype, "--device", device,
                  "--disable-log-requests"]
    if r.smoke:
        server_cmd += ["--max-model-len", "256", "--num-gpu-blocks-override", "256"]
    log = open(r.out / "serve_s1_server.log", "w")
    srv = subprocess.Popen(server_cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        import urllib.request

        t0 = time.time()
        while True:
            if srv.poll() is not None:
                return {"error": f"server exited with {srv.returncode}", "server_command": shlex.join(server_cmd)}
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except Exception:
                if time.time() - t0 > min(240, r.left() - 30):
                    return {"error": "server did not become healthy", "server_command": shlex.join(server_cmd)}
                time.sleep(1)
        js = r.out / "serve_s1.json"
        if r.smoke:
            load = ["--num-prompts", "4", "--max-concurrency", "2", "--random-input-len", "16",
                    "--random-range-ratio", "0.5", "--random-output-len", "8"]
        else:
            load = ["--num-prompts", "256", "--max-concurrency", "64", "--random-input-len", "520",
                    "--random-range-ratio", "0.97", "--random-output-len", "136"]
        cmd = [r.py, "-m", "pagedserve", "bench", "serve", "--base-url", f"http://127.0.0.1:{port}", *load,
               "--disable-tqdm", "--result-json", str(js)]
        res = r.sh(cmd, timeout=300, log="serve_s1_client.log")
        res["server_command"] = shlex.join(server_cmd)
        res["startup_seconds"] = round(time.time() - t0, 1)
        if js.exists():
            res["summary"] = json.loads(js.read_text()).get("summary")
        return res
    finally:
        os.killpg(srv.pid, signal.SIGTERM)
        try:
            srv.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(srv.pid, signal.SIGKILL)
        log.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", "--dry-run", dest="smoke", action="store_true",
                    help="tiny models and counts on the CPU: proves the script runs end to end")
    ap.add_argument("--budget-s", type=float, default=float(os.environ.get("GPU_CHECK_BUDGET_S", 750)))
    ap.add_argument("--only", default="abc", help="which parts to run: any of a, b, c (default: abc)")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "benchmarks" / "results" / "gpu_check"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    r = Runner(out, args.budget_s, args.smoke)
    import torch

    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        r.record("device", {"error": "no CUDA device; use --cpu-smoke on a CPU machine"})
        return 2
    r.record("device", {"device": device, "name": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                        "torch": torch.__version__, "argv": sys.argv})
    if "a" in args.only:
        correctness(r, device)
    llama8b = None
    if "b" in args.only or "c" in args.only:
        cache = Path(os.environ.get("PAGEDSERVE_CACHE", Path.home() / ".cache" / "pagedserve"))
        v = r.step("b/build-llama8b", lambda: {"path": str(build_llama8b(
            cache / ("llama8b-shape" if not r.smoke else "llama8b-shape-smoke"),
            LLAMA8B if not r.smoke else SMOKE_8B, device))}, min_s=150 if not r.smoke else 10)
        llama8b = Path(v["path"]) if v and "path" in v else None
    if "b" in args.only:
        throughput(r, device, llama8b)
    if "c" in args.only:
        model = str(llama8b) if llama8b is not None else None
        if model is None:
            from pagedserve.bench.workloads import bench_model_dir
            model = str(bench_model_dir("medium"))
        r.step("c/S1", lambda: serve_s1(r, device, model), min_s=60)
    r.results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    r.save()
    steps = r.results["steps"]
    failed = [k for k, v in steps.items() if isinstance(v, dict) and ("error" in v or v.get("pass") is False
                                                                      or v.get("rc") not in (None, 0))]
    print(f"gpu_check: {len(steps)} steps, {len(failed)} with errors/failures: {failed}; results in {out}/results.json")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

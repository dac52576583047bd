"""Where a CPU workload's forward time goes, op by op (issue #8).

`pagedserve bench throughput --profile` splits each engine step into phases (schedule, forward,
logits, sample, ...); this goes inside the forward. It runs one workload through the Python API
with timers around the model's pieces (attention layer, MLP, the native attention call, the fused
element-wise ops, the LM head) and prints seconds and calls for each, then the attention calls
split into decode-only batches and batches with prompt chunks, with the FLOPs and the K/V bytes
the decodes must read: decode attention reads every running sequence's whole K/V each step, so
its rate in GB/s against the machine's memory bandwidth says how far it is from its floor.
Last, the MLP calls by row count with their GEMM rate (GFLOP/s of gate_up + down), to set against
`benchmarks/cpu_gemm_ab.py` on the same rows: what the engine's GEMMs reach beside the microbench.

Not part of CI. The timers add a few microseconds per call (~1 % of a W1 run).

    python benchmarks/cpu_op_breakdown.py --workload W1 --dtype bfloat16
    python benchmarks/cpu_op_breakdown.py --workload W2 --model medium
"""
from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def timed(owner, name: str, key: str, totals, calls, after=None):
    """Replaces owner.name with a wrapper that adds its wall time to totals[key]."""
    fn = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        dt = time.perf_counter() - t
        totals[key] += dt
        calls[key] += 1
        if after is not None:
            after(dt, *args)
        return out

    setattr(owner, name, wrapper)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small", help="a benchmark model of benchmarks/README.md (small | medium)")
    p.add_argument("--workload", default="W1")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--num-prompts", type=int, default=None)
    # the size the vLLM comparison uses (compare_vllm_cpu.sh, KVCACHE_GIB): the engine's default 4 GiB holds only
    # ~170 of W1's 256 sequences of the medium model in float32, so its batches would be smaller
    p.add_argument("--kv-cache-space", type=float, default=6.0, help="GiB of KV cache (default: %(default)s)")
    args = p.parse_args()

    from pagedserve import LLM, SamplingParams
    from pagedserve.bench.workloads import bench_model_dir, make_workload
    from pagedserve.kernels.cpu import fused_ops as cpu_fused
    from pagedserve.model import llama
    from pagedserve.attention import cpu_backend

    totals: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()
    attn_calls: list[tuple] = []  # (seconds, decode-only, decode FLOPs, prompt FLOPs, decode K/V bytes)

    def attention_call(dt, _backend, q, k_cache, _v_cache, meta, _scale):
        heads, head_dim = q.shape[1], q.shape[2]
        kv_heads = k_cache.shape[-2]  # the cache's rows: [slots, kv heads, head size]
        qn = (meta.paged_query_starts[1:] - meta.paged_query_starts[:-1]).tolist()
        lens = meta.paged_seq_lens.tolist()
        dec_keys = sum(n for n, k in zip(lens, qn) if k == 1)
        # a prompt chunk of k queries ending at context n: query i sees n - k + i + 1 keys
        pre_keys = sum(k * n - k * (k - 1) / 2 for n, k in zip(lens, qn) if k > 1)
        per_key = heads * head_dim * 4  # q·k and p·v, multiply and add
        attn_calls.append((dt, all(k == 1 for k in qn), dec_keys * per_key, pre_keys * per_key,
                           dec_keys * kv_heads * head_dim * 2 * k_cache.element_size()))

    mlp_calls: list[tuple[int, float, float]] = []  # (rows, seconds, FLOPs)

    def mlp_call(dt, mlp, x):
        hidden = x.shape[-1]
        rows = x.numel() // hidden
        mlp_calls.append((rows, dt, rows * 2 * 3 * hidden * mlp.inter))

    for name in ("rms_norm", "silu_mul", "rope_qkv", "argmax"):
        timed(cpu_fused, name, f"fused {name}", totals, calls)
    timed(cpu_backend.CpuPagedAttentionBackend, "attend_cached", "attention kernel (paged, native)", totals, calls,
          after=attention_call)
    timed(llama.Attention, "forward_fused", "attention layer (qkv + rope + kernel + o)", totals, calls)
    timed(llama.MLP, "forward_fused", "MLP (gate_up + silu_mul + down)", totals, calls, after=mlp_call)
    timed(llama.LlamaForCausalLM, "forward", "model forward (all layers)", totals, calls)
    timed(llama.LlamaForCausalLM, "compute_logits", "LM head (logits)", totals, calls)

    wl = make_workload(args.workload, args.num_prompts)
    llm = LLM(model=str(bench_model_dir(args.model)), dtype=args.dtype, kv_cache_space=args.kv_cache_space)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in wl.output_lens]
    prompts = [{"prompt_token_ids": ids} for ids in wl.prompts]
    llm.llm_engine.kv_cache.wait_resident()  # the pool's pages faulted in first, as `bench throughput` does
    llm.generate(prompts[:8], params[:8])  # warm-up
    totals.clear()
    calls.clear()
    attn_calls.clear()
    mlp_calls.clear()
    t0 = time.perf_counter()
    llm.generate(prompts, params)
    wall = time.perf_counter() - t0

    print(f"{args.workload}, model {args.model}, {args.dtype}: wall {wall:.2f} s")
    for key, secs in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"  {key:45s} {secs:8.3f} s  {100 * secs / wall:5.1f} %  {calls[key]:6d} calls")
    for label, decode_only in (("decode-only batches", True), ("with prompt chunks", False)):
        rows = [c for c in attn_calls if c[1] == decode_only]
        if not rows:
            continue
        secs = sum(c[0] for c in rows)
        dec_flops, pre_flops, kv = (sum(c[i] for c in rows) for i in (2, 3, 4))
        print(f"  attention, {label:20s} {secs:7.3f} s in {len(rows)} calls: decode {dec_flops / 1e9:.1f} GFLOP "
              f"reading {kv / 1e9:.1f} GB of K/V, prompts {pre_flops / 1e9:.1f} GFLOP"
              + (f"; {kv / secs / 1e9:.1f} GB/s" if decode_only and secs > 0 else ""))
    buckets = ((1, 32), (33, 128), (129, 512), (513, 2048), (2049, 1 << 40))
    for lo, hi in buckets:
        rows = [c for c in mlp_calls if lo <= c[0] <= hi]
        if rows:
            secs, flops = sum(c[1] for c in rows), sum(c[2] for c in rows)
            span = f"{lo}-{hi}" if hi < 1 << 40 else f">{lo - 1}"
            print(f"  MLP, {span:>9s} rows {secs:7.3f} s in {len(rows)} calls: {flops / secs / 1e9:6.1f} GFLOP/s")


if __name__ == "__main__":
    main()

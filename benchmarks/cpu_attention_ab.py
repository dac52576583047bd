"""A/B of the native CPU paged-attention kernel: this checkout's source against another git revision's.

Not part of CI. Builds both versions with the engine's flags, then alternates them (A, B, A, B, ...)
on batches shaped like the workloads' attention calls, checks that both give the same output, and
prints median milliseconds and B/A speed ratios (> 1: this checkout is faster):

    python benchmarks/cpu_attention_ab.py --base fb048ad          # against an older kernel
    python benchmarks/cpu_attention_ab.py --base HEAD~1 --cases W1-decode,prompt-512
    python benchmarks/cpu_attention_ab.py --base HEAD~1 --dtype bfloat16    # bfloat16 caches and queries
    python benchmarks/cpu_attention_ab.py --base HEAD~1 --cold     # caches evicted before every call
    python benchmarks/cpu_attention_ab.py --base HEAD~1 --exact    # outputs must be bit for bit equal

Cases (small model: 8 heads, 4 kv heads, head size 64, block size 16, float32 unless --dtype):
  W1-decode     256 decodes, contexts 128-256, blocks in allocation order (memory-bound)
  W2-decode     200 decodes, contexts 300-1100, blocks shuffled (memory-bound)
  W3-decode     128 decodes over one shared 1056-token context (compute-bound, L3-resident)
  W3-suffix     64 prompt chunks of 32 tokens after 1024 cached tokens (prefix-cache hits)
  prompt-512    4 fresh 512-token prompts
  prompt-1056   one fresh 1056-token prompt
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from pagedserve.kernels.cpu import paged_attention as cpu_kernels  # noqa: E402
from pagedserve.runner.cpu_memory import zeroed_cpu_tensor  # noqa: E402

CSRC = "pagedserve/kernels/cpu"
H, KVH, D, BS = 8, 4, 64, 16
ARGS = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int]


def build(src_dir: Path, out: Path, dtype: torch.dtype):
    subprocess.run(["g++", *cpu_kernels._FLAGS, str(src_dir / "paged_attention_cpu.cpp"), "-o", str(out)],
                   check=True, capture_output=True, text=True)
    lib = ctypes.CDLL(str(out))
    if hasattr(lib, "paged_attention_set_bf16_dot"):  # the engine's default (set from Python since 2026-12)
        lib.paged_attention_set_bf16_dot(int(cpu_kernels.bf16_dot()))
    fn = getattr(lib, cpu_kernels._FN[dtype])
    fn.restype, fn.argtypes = None, ARGS
    return fn


def checkout_kernel(rev: str, dest: Path) -> Path:
    """The kernel sources of git revision `rev` (the .cpp and any headers beside it) under dest."""
    names = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", f"{rev}:{CSRC}"], check=True,
                           capture_output=True, text=True).stdout.split()
    for name in names:
        blob = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{CSRC}/{name}"], check=True,
                              capture_output=True).stdout
        (dest / name).write_bytes(blob)
    return dest


def in_pool_memory(t: torch.Tensor) -> torch.Tensor:
    """t copied into memory like the engine's KV pool: 2 MiB aligned, asked for huge pages
    (runner/cpu_memory.py); a random block walk over 4 KiB pages misses the TLB far more often."""
    pool, _ = zeroed_cpu_tensor(t.shape, t.dtype)
    pool.copy_(t)
    return pool


def make_case(dtype: torch.dtype, n_seqs: int, lo: int, hi: int, *, qn: int = 1, shuffle: bool = False,
              shared: bool = False):
    rng = np.random.default_rng(0)
    ctx = rng.integers(lo, hi + 1, n_seqs)
    n_blocks = [(int(c) + BS - 1) // BS for c in ctx]
    total = max(n_blocks) if shared else sum(n_blocks)
    ids = rng.permutation(total) if shuffle else np.arange(total)
    bt = torch.zeros(n_seqs, max(n_blocks), dtype=torch.int64)
    k = 0
    for b, nb in enumerate(n_blocks):
        bt[b, :nb] = torch.arange(nb) if shared else torch.from_numpy(ids[k:k + nb])
        k += 0 if shared else nb
    g = torch.Generator().manual_seed(0)
    kc, vc = (in_pool_memory(torch.randn(total, BS, KVH, D, generator=g).to(dtype)) for _ in range(2))
    q = torch.randn(n_seqs * qn, H, D, generator=g).to(dtype)
    starts = torch.arange(n_seqs + 1, dtype=torch.int64) * qn
    return q, kc, vc, bt, torch.tensor(ctx, dtype=torch.int64), starts


CASES = {
    "W1-decode": dict(n_seqs=256, lo=128, hi=256),
    "W2-decode": dict(n_seqs=200, lo=300, hi=1100, shuffle=True),
    "W3-decode": dict(n_seqs=128, lo=1056, hi=1056, shared=True),
    "W3-suffix": dict(n_seqs=64, lo=1056, hi=1056, qn=32, shared=True),
    "prompt-512": dict(n_seqs=4, lo=512, hi=512, qn=512),
    "prompt-1056": dict(n_seqs=1, lo=1056, hi=1056, qn=1056),
}


# --cold: written before every call, so the call finds its K/V in memory rather than in the caches,
# as in the engine, where the other layers' K/V and weights pass through between two calls of a layer
_EVICT = None


def evict_caches():
    global _EVICT
    if _EVICT is None:
        _EVICT = torch.empty(64 << 20, dtype=torch.uint8)  # 2x this class of CPU's L3
    _EVICT.fill_(1)


def kv_bytes_read(case) -> int:
    """The bytes of K and V the call must read at least once: each sequence's blocks, a shared one once."""
    q, kc, vc, bt, lens, starts = case
    blocks = {int(x) for b in range(lens.shape[0]) for x in bt[b, :(int(lens[b]) + BS - 1) // BS]}
    return 2 * len(blocks) * BS * KVH * D * kc.element_size()


def call(fn, case, threads: int, cold: bool = False):
    q, kc, vc, bt, lens, starts = case
    out = torch.empty_like(q)
    if cold:
        evict_caches()
    t = time.perf_counter()
    fn(q.data_ptr(), kc.data_ptr(), vc.data_ptr(), bt.data_ptr(), lens.data_ptr(), starts.data_ptr(), out.data_ptr(),
       lens.shape[0], H, KVH, D, BS, bt.shape[1], D ** -0.5, threads)
    return time.perf_counter() - t, out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", default="HEAD", help="git revision to compare this checkout's kernel against")
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated: " + ", ".join(CASES))
    p.add_argument("--repeats", type=int, default=9, help="alternated calls per version and case")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--cold", action="store_true", help="evict the caches before every call (the engine's case)")
    p.add_argument("--exact", action="store_true", help="require bit-identical outputs (a change meant to keep the bits)")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    # both versions sum in float32; bfloat16 outputs may then round one unit apart
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "base").mkdir()
        base = build(checkout_kernel(args.base, tmp / "base"), tmp / "base.so", dtype)
        this = build(ROOT / CSRC, tmp / "this.so", dtype)
        print(f"paged attention, {args.dtype}, {args.threads} threads: {args.base} (A) vs this checkout (B); "
              f"medians of {args.repeats}{', caches evicted before each call' if args.cold else ''}")
        for name in args.cases.split(","):
            case = make_case(dtype, **CASES[name])
            times = {"A": [], "B": []}
            for r in range(args.repeats):
                ta, oa = call(base, case, args.threads, args.cold)
                tb, ob = call(this, case, args.threads, args.cold)
                times["A"].append(ta)
                times["B"].append(tb)
                same = (torch.equal(oa.view(torch.int16), ob.view(torch.int16)) if dtype == torch.bfloat16 else
                        torch.equal(oa.view(torch.int32), ob.view(torch.int32))) if args.exact else \
                    torch.allclose(oa.float(), ob.float(), atol=tol, rtol=tol)
                if r == 0 and not same:
                    print(f"{name}: outputs differ (max {(oa.float() - ob.float()).abs().max():.2e})", file=sys.stderr)
                    return 1
            a, b = statistics.median(times["A"]), statistics.median(times["B"])
            kv_bytes = kv_bytes_read(case)
            print(f"  {name:12s} A {a * 1e3:8.2f} ms   B {b * 1e3:8.2f} ms   B/A speed {a / b:5.2f}x   "
                  f"(K/V read: {kv_bytes / 1e6:.1f} MB, B {kv_bytes / b / 1e9:.1f} GB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

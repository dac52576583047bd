"""A/B of the native CPU GEMM library: this checkout's kernels/cpu/gemm_cpu.cpp against another git revision's.

Not part of CI. Builds the base revision's library with the engine's flags beside this checkout's,
packs a benchmark model's weights with each (every layer its own weights, so that, as in the
engine, they come from memory when the model is larger than L3), then alternates passes over the
model's linears in the forward's order (each layer's qkv, o, gate_up with its SiLU epilogue where
the engine uses it, down; then the LM head): A, B, A, B, ... Prints per-linear and whole-pass
median milliseconds and B/A speed ratios (> 1: this checkout is faster), and checks both give the
same outputs (bit for bit with --exact):

    python benchmarks/cpu_gemm_lib_ab.py --base HEAD                       # float32, 256 and 2048 rows
    python benchmarks/cpu_gemm_lib_ab.py --base HEAD~1 --dtype bfloat16 --rows 64,512 --exact
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

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from pagedserve.bench.workloads import MODEL_SHAPES, VOCAB  # noqa: E402
from pagedserve.kernels.cpu import gemm as cpu_gemm
from pagedserve.runner import cpu_packing as cpu_linear  # noqa: E402

CSRC = "pagedserve/kernels/cpu"


def build_base(rev: str, dest: Path):
    """The library of git revision `rev`, built from its kernels/cpu folder with this checkout's flags."""
    names = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", f"{rev}:{CSRC}"], check=True,
                           capture_output=True, text=True).stdout.split()
    for name in names:
        blob = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{CSRC}/{name}"], check=True,
                              capture_output=True).stdout
        (dest / name).write_bytes(blob)
    out = dest / "libbase_gemm.so"
    subprocess.run(["g++", *cpu_gemm._native.flags, str(dest / "gemm_cpu.cpp"), "-o", str(out)], check=True,
                   capture_output=True, text=True)
    lib = ctypes.CDLL(str(out))
    for fn, (restype, argtypes) in cpu_gemm._native.signatures.items():
        if hasattr(lib, fn):
            getattr(lib, fn).restype, getattr(lib, fn).argtypes = restype, argtypes
    return lib


def model_linears(shape: dict, dtype: torch.dtype) -> list[tuple[str, nn.Linear]]:
    h, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    kv = shape["num_key_value_heads"] * (h // shape["num_attention_heads"])
    torch.manual_seed(0)
    out = []
    for _ in range(layers):
        for name, n, k in (("qkv", h + 2 * kv, h), ("o", h, h), ("gate_up", 2 * inter, h), ("down", h, inter)):
            lin = nn.Linear(k, n, bias=False).to(dtype)
            lin.gate_up_halves = name == "gate_up"
            out.append((name, lin))
    out.append(("lm_head", nn.Linear(h, VOCAB, bias=False).to(dtype)))
    return out


def packed_modules(linears, lib) -> list[tuple[str, nn.Module]]:
    """Each linear packed by `lib` (the engine's own choice of module: NativeGateUp for gate_up)."""
    cpu_gemm._native.lib = lib
    return [(name, cpu_linear._native_linear(lin)) for name, lin in linears]


def run_pass(mods, xs, lib) -> tuple[dict[str, float], list[torch.Tensor]]:
    cpu_gemm._native.lib = lib
    times: dict[str, float] = {}
    outs = []
    for name, mod in mods:
        x = xs[mod.in_features]
        t0 = time.perf_counter()
        y = mod.silu_mul(x) if isinstance(mod, cpu_gemm.NativeGateUp) else mod(x)
        times[name] = times.get(name, 0.0) + time.perf_counter() - t0
        outs.append(y)
    return times, outs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="HEAD", help="git revision whose library is A")
    ap.add_argument("--model", default="small", choices=sorted(MODEL_SHAPES))
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rows", default="256,2048", help="comma-separated row counts (tokens per GEMM)")
    ap.add_argument("--repeats", type=int, default=9, help="alternated passes per version and row count")
    ap.add_argument("--exact", action="store_true", help="require bit-identical outputs")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    new = cpu_gemm._native.load()
    if new is None:
        print(f"native GEMM unavailable: {cpu_gemm._native.failure_reason}")
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        base = build_base(args.base, Path(tmp))
        linears = model_linears(MODEL_SHAPES[args.model], dtype)
        mods = {"A": packed_modules(linears, base), "B": packed_modules(linears, new)}
        libs = {"A": base, "B": new}
        print(f"native GEMM library, model {args.model}, {args.dtype}, {torch.get_num_threads()} threads: "
              f"{args.base} (A) vs this checkout (B); medians of {args.repeats} alternated passes")
        worst = 0.0
        for rows in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(rows, k).to(dtype) for k in {lin.in_features for _, lin in linears}}
            per: dict[str, dict[str, list[float]]] = {"A": {}, "B": {}}
            for rep in range(args.repeats + 1):
                outs = {}
                for v in ("A", "B") if rep % 2 == 0 else ("B", "A"):
                    times, outs[v] = run_pass(mods[v], xs, libs[v])
                    if rep == 0:
                        continue  # warm-up
                    for name, t in times.items():
                        per[v].setdefault(name, []).append(t)
                    per[v].setdefault("all", []).append(sum(times.values()))
                for a, b in zip(outs["A"], outs["B"]):
                    diff = (a.float() - b.float()).abs().max().item()
                    worst = max(worst, diff)
                    if args.exact and diff != 0:
                        print(f"outputs differ by {diff} at {rows} rows")
                        return 1
            for name in per["A"]:
                ta, tb = statistics.median(per["A"][name]), statistics.median(per["B"][name])
                print(f"  rows {rows:5d} {name:8s} A {1e3 * ta:8.2f} ms  B {1e3 * tb:8.2f} ms  B/A speed {ta / tb:5.3f}x")
        print(f"largest output difference A vs B: {worst:.3g}")
        cpu_gemm._native.lib = new
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

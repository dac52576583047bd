"""Linear layers with their weights prepacked at load time, for float32 and bfloat16 on the CPU.

torch's default `linear` on the CPU re-lays the weight out for the GEMM kernel on every call. Two
prepacked paths replace it, the first that works on this machine:
  1. our own GEMM (kernels/cpu/gemm.py; AVX2 or AVX-512 tiles), 1.1-1.3× oneDNN's rate on the
     decoder's float32 shapes on AVX2 CPUs, about its rate on AVX-512 ones; for bfloat16
     weights ~9× torch's linear on AVX2-only CPUs and ~1.3× on AVX512-BF16 Xeons without AMX,
     and on AMD Zen 4 a vdpbf16ps tile at ~0.85-1.1× oneDNN's bfloat16 rate;
  2. oneDNN with the weight reordered once into its blocked format (torch's own ops, the ones
     torch.compile's freezing pass emits), ~1.4× torch's plain `linear` on the decode shapes.
     float32 everywhere; bfloat16 too on CPUs with AMX, where oneDNN's bfloat16 GEMM runs on
     the matrix units (native GEMM: vector FMAs only) and prepacking still beats torch's `linear`
     (small-model shapes, 2 threads: 1.3-2.5x at 8-32 rows, ~1.25x at 256).
Where both are missing or refuse a dtype/CPU the layer simply stays a plain nn.Linear.
EngineConfig.cpu_gemm (PAGEDSERVE_CPU_GEMM) = onednn skips the first; avx2 keeps the native GEMM
on its AVX2 tile on an AVX-512 CPU (A/B runs).
"""
from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger("pagedserve")


class PackedLinear(nn.Module):
    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int):
        super().__init__()
        self.packed = packed
        self.bias = bias
        self.out_features = out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def _pack_onednn(linear: nn.Linear, batch_hint: int) -> PackedLinear | None:
    try:
        w = linear.weight.detach()
        packed = torch.ops.mkldnn._reorder_linear_weight(w, batch_hint)
        bias = linear.bias.detach() if linear.bias is not None else None
        layer = PackedLinear(packed, bias, w.shape[0])
        probe = torch.randn(3, w.shape[1], dtype=w.dtype)
        got, want = layer(probe).float(), nn.functional.linear(probe, w, bias).float()
        # bfloat16 keeps 8 mantissa bits: two correct GEMMs may differ by a rounding step of the output
        tol = 1e-4 if w.dtype == torch.float32 else 1e-2 * max(1.0, want.abs().max().item())
        if not torch.allclose(got, want, rtol=tol, atol=tol):
            return None
        return layer
    except (RuntimeError, AttributeError):
        return None


def _native_linear(layer: nn.Linear, silu_epilogue: bool) -> nn.Module:
    """A layer marked `gate_up_halves` (the MLP's fused [gate | up] projection) gets the GEMM whose
    tiles store silu(gate) · up where its shape allows; every other layer a plain NativeLinear."""
    from pagedserve.kernels.cpu import gemm as cpu_gemm

    if getattr(layer, "gate_up_halves", False) and silu_epilogue:
        try:
            return cpu_gemm.NativeGateUp(layer)
        except ValueError:
            pass
    return cpu_gemm.NativeLinear(layer)


def _onednn_dtypes() -> tuple[torch.dtype, ...]:
    from pagedserve.kernels.cpu import gemm as cpu_gemm

    if not torch.backends.mkldnn.is_available():
        return ()
    return (torch.float32, torch.bfloat16) if cpu_gemm.amx() else (torch.float32,)


def _packers(batch_hint: int, native: bool, cpu_gemm_choice: str, silu_epilogue: bool):
    """[(name, function nn.Linear → packed module or None, weight dtypes it takes)], best path first."""
    from pagedserve.kernels.cpu import gemm as cpu_gemm

    packers = []
    if native and cpu_gemm_choice != "onednn" and cpu_gemm.usable():
        cpu_gemm.set_avx512(cpu_gemm_choice != "avx2")
        packers.append(("native GEMM", lambda layer: _native_linear(layer, silu_epilogue), cpu_gemm.fast_dtypes()))
    onednn_dtypes = _onednn_dtypes()
    if onednn_dtypes:
        packers.append(("oneDNN", lambda layer: _pack_onednn(layer, batch_hint), onednn_dtypes))
    return packers


def pack_linears(model: nn.Module, batch_hint: int, native: bool = True, cpu_gemm: str = "auto",
                 silu_epilogue: bool = True) -> tuple[int, str | None]:
    """Swap every nn.Linear of a CPU model for a prepacked one on the first path that takes its
    dtype; returns (how many, which path(s)). A path that refuses a layer is not tried again.
    native=False (native kernels off) leaves only oneDNN."""
    packers = _packers(batch_hint, native, cpu_gemm, silu_epilogue)
    if not packers:
        return 0, None
    refused: set[str] = set()
    used: list[str] = []
    swapped = 0
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear) or child.weight.device.type != "cpu":
                continue
            for name, pack, dtypes in packers:
                if name in refused or child.weight.dtype not in dtypes:
                    continue
                packed = pack(child)
                if packed is None:
                    refused.add(name)
                    continue
                setattr(parent, child_name, packed)
                swapped += 1
                if name not in used:
                    used.append(name)
                break
    return swapped, (" + ".join(used) if used else packers[0][0])

"""Greedy tokens from a float32 LM head at about half its cost: a bfloat16 screen, then exact checks.

The LM head is ~40 % of a decode token's FLOPs on the small benchmark model (vocab 32000, hidden
512). A step whose rows only take the argmax (greedy, no logprobs, penalties or masks: the
sampler's `argmax_only`) does not need every logit exactly, only the largest. So the product runs
first on bfloat16 copies of the hidden states and of W (the vdpbf16ps GEMM tile, twice the float32
FMA rate where the CPU issues it as fast: AMD Zen 4), and every token whose screened logit could
still be the row's largest is computed again in float32, bit for bit as the float32 GEMM computes
it (csrc/greedy_screen.h). The result is the float32 head's argmax, ties included, not an
approximation of it.

Why it is exact. For a row h and token v, with u = 2⁻⁸ (bfloat16's unit roundoff) and
γ = K·2⁻²⁴ / (1 − K·2⁻²⁴) (a K-term float32 sum), let P = Σᵢ |hᵢ·W[v,i]|:
  - rounding h and W[v] to bfloat16 moves the exact dot product by at most (2u + u²)·P;
  - the screen's float32 sums of the exact bfloat16 products add at most γ·(1 + u)²·P (doubled
    here, in case an implementation rounds vdpbf16ps's steps less carefully than to nearest);
  - the float32 GEMM's own result is within γ·P of the exact dot product.
P ≤ ‖h‖₂·‖W[v]‖₂ (Cauchy-Schwarz), so |screen − float32| ≤ coef·‖h‖₂·‖W[v]‖₂ with coef the sum of
these factors plus 1 % (which also covers the float rounding of the test itself), and 2⁻¹⁰⁰ more
for flushed denormals. The float32 argmax v* has screen[v*] + bound[v*] ≥ float32[v*] ≥
float32[u] ≥ screen[u] − bound[u] for every u, so it is among the tokens that pass that test.

On the small model's random weights ~2-3 tokens per row pass. Rows with a NaN or an infinity
anywhere fall back to the full float32 row. PAGEDSERVE_GREEDY_SCREEN: `auto` (default: on where
the vdpbf16ps tile runs, the only place it is faster), `1` (on wherever the native GEMM packs
bfloat16, for tests), `0` (off).
"""
from __future__ import annotations

import logging
import os

import torch

from pagedserve.model import cpu_gemm

log = logging.getLogger("pagedserve")

_U = 2.0 ** -8  # bfloat16 unit roundoff


def bound_coef(k: int) -> float:
    """The factor c of |screen − float32 logit| ≤ c·‖h‖₂·‖W[v]‖₂ for K = k (module docstring)."""
    g = k * 2.0 ** -24 / (1 - k * 2.0 ** -24)
    return ((2 * _U + _U * _U) + 2 * g * (1 + _U) ** 2 + g) * 1.01


def _mode() -> str:
    mode = os.environ.get("PAGEDSERVE_GREEDY_SCREEN", "auto")
    if mode not in ("auto", "0", "1"):
        raise ValueError(f"PAGEDSERVE_GREEDY_SCREEN={mode!r}: use auto, 1 or 0")
    return mode


class ScreenedGreedyHead:
    """The argmax of a float32 NativeLinear LM head (no bias) through its bfloat16 screen."""

    def __init__(self, head: cpu_gemm.NativeLinear):
        packed = head.packed
        n, k = packed.out_features, packed.in_features
        # the float32 panels [N/16][K][16] back to W [N, K]
        w = packed.panels.view(-1, k, 16).transpose(1, 2).reshape(-1, k)[:n]
        if not torch.isfinite(w).all():
            raise ValueError("the LM head holds non-finite weights")
        self.head = head
        self.screen_weight = cpu_gemm.pack_weight(w.to(torch.bfloat16))
        norms = w.double().norm(dim=1)
        # rounded up to float32, so that the bound only widens
        self.w_norms = torch.nextafter(norms.float(), torch.tensor(float("inf"))).contiguous()
        self.coef = bound_coef(k)
        self.rows = self.computed = 0  # rows screened and float32 logits computed for them (stats)

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """Token ids [M] (int64): the first index of each row's largest float32 logit."""
        x = hidden.float().contiguous()
        xb = x.to(torch.bfloat16)
        m = x.shape[0]
        out = torch.empty(m, dtype=torch.int64)
        packed, screen = self.head.packed, self.screen_weight
        self.computed += cpu_gemm._native.lib.greedy_screen_argmax(
            x.data_ptr(), x.stride(0), xb.data_ptr(), xb.stride(0), m, packed.in_features, packed.panels.data_ptr(),
            screen.panels.data_ptr(), int(screen.k_pairs), packed.out_features, self.w_norms.data_ptr(), self.coef,
            out.data_ptr(), torch.get_num_threads())
        self.rows += m
        fallback = (out < 0).nonzero().flatten()
        if len(fallback):  # a non-finite value somewhere in these rows: the plain float32 head
            from pagedserve.model import cpu_fused

            out[fallback] = cpu_fused.argmax(self.head(x[fallback]))
        return out


def attach(model) -> str | None:
    """Gives `model` a `greedy_head` where this CPU and the LM head allow one; returns a line for
    the load log, or None when the screen stays off."""
    mode = _mode()
    head = getattr(model, "lm_head", None)
    if mode == "0" or not isinstance(head, cpu_gemm.NativeLinear) or head.packed.dtype != torch.float32:
        return None
    if head.bias is not None:
        return None
    if mode == "auto" and not (cpu_gemm.bf16_k_pairs() and cpu_gemm.bf16_dot()):
        return None
    try:
        model.greedy_head = ScreenedGreedyHead(head)
    except ValueError as e:
        log.info("greedy LM-head screen off: %s", e)
        return None
    mib = model.greedy_head.screen_weight.panels.numel() * 2 / 2**20
    return f"greedy steps take the float32 LM head's argmax through a bfloat16 screen ({mib:.0f} MiB more)"

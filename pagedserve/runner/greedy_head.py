"""Greedy tokens from a float32 LM head at a fraction of its cost: a low-precision screen, then
exact checks.

The LM head is ~40 % of a decode token's FLOPs on the small benchmark model (vocab 32000, hidden
512). A step whose rows only take the argmax (greedy, no logprobs, penalties or masks: the
sampler's `argmax_only`) does not need every logit exactly, only the largest. So the product runs
first on a cheap copy of the hidden rows and of W, and every token whose screened logit could still
be the row's largest is computed again in float32, bit for bit as the float32 GEMM computes it
(greedy_screen.h). The result is the float32 head's argmax, ties included, not an
approximation of it. The screen's logits are never stored: each finished GEMM tile updates its
thread's running threshold per row and keeps the tokens within reach.

Two screens, by what the CPU runs fastest:
  - **int8** (vpdpbusd, AVX512-VNNI: 64 multiply-adds per instruction, 4× an FMA's; on AMD Zen 4
    it issues as often as one): each token's weights W[v] = w' + f with w' = sw[v]·q_w (int8 q_w)
    and each row h = h' + e with h' = sx·q_h, both scales picked among a few clipping levels for
    the smallest error; the int32 sums of q_h·q_w are exact. Since h·w − h'·w' = h'·f + e·w,
        |h·w − h'·w'| ≤ ‖h'‖₂·‖f‖₂ + ‖e‖₂·‖w‖₂   (Cauchy-Schwarz, with the errors measured);
  - **bfloat16** (the vdpbf16ps GEMM tile, twice the float32 FMA rate on Zen 4), where VNNI is
    missing: rounding h and W[v] to bfloat16 (u = 2⁻⁸) moves the dot product by at most (2u +
    u²)·P, P = Σᵢ |hᵢ·W[v,i]| ≤ ‖h‖₂·‖W[v]‖₂, and its float32 sums of exact products add at most
    γ·(1 + u)²·P (doubled here, in case an implementation rounds vdpbf16ps's steps less carefully
    than to nearest).
Both add the float32 GEMM's own error, ≤ γ·‖h‖₂·‖W[v]‖₂ with γ = K·2⁻²⁴ / (1 − K·2⁻²⁴) (and, for
int8, the screen's three float roundings), then 1 % on top, which also covers the float rounding
of the test itself, and 2⁻¹⁰⁰ for flushed denormals. The float32 argmax v* has screen[v*] +
bound[v*] ≥ float32[v*] ≥ float32[u] ≥ screen[u] − bound[u] for every u, so it passes the test.

On the small model's random weights ~4 (bfloat16) and ~14 (int8) tokens of 32000 per row pass,
and the LM head takes 20 (bfloat16) or 12 ms (int8) instead of 39 at 256 rows (Zen 4, 2 threads).

A bfloat16 head (the engine's bfloat16 models, where the head runs the vdpbf16ps tile and stores
bfloat16 logits) takes the int8 screen too. Its exact checks replay the tile: a chain of
vdpbf16ps over the k pairs per token (read from a row-major copy of W, as for a float32 head),
rounded to bfloat16 as the tile stores it; ties after that rounding are common, so every token
within one bfloat16 step of the largest logit stays in as well, and the first of the largest
wins, as argmax over the head's own logits. The tiles keep tokens within a step of the largest
logit possible (2⁻⁷·‖h‖·max‖W[v]‖); before the exact checks that margin is cut to a step of the
largest logit's own bounds (gemm_cpu.cpp, screen_finish). ~17 tokens per row pass; 13
instead of 21 ms at 256 rows (the medium model's head: ~48, 28 instead of 41 ms). Rows with a NaN
or an infinity fall back to the full float32 row. EngineConfig.greedy_screen (PAGEDSERVE_GREEDY_SCREEN): `auto`
(default: int8 where the CPU has AVX512-VNNI, else bfloat16 where the vdpbf16ps tile runs, else
off; bfloat16 heads: int8 only; a screen that leaves too many tokens per row gives way to the
next, see `_review`), `int8` or `bf16` (that screen wherever it can run, kept whatever it costs:
for tests and A/B runs), `0` (off).
"""
from __future__ import annotations

import logging

import torch

from pagedserve.kernels.cpu import gemm as cpu_gemm

log = logging.getLogger("pagedserve")

_U = 2.0 ** -8  # bfloat16 unit roundoff
_U32 = 2.0 ** -24  # float32 unit roundoff
MODES = ("auto", "int8", "bf16", "0")
REVIEW_ROWS = 256  # rows screened before auto mode judges a screen (ScreenedGreedyHead._review)
MAX_SHARE = 256  # ... which keeps it while it computes at most 1/MAX_SHARE of the vocabulary per row


def _gamma(k: int) -> float:
    return k * _U32 / (1 - k * _U32)


def bound_coef(k: int) -> float:
    """The bfloat16 screen's factor c of |screen − float32 logit| ≤ c·‖h‖₂·‖W[v]‖₂ for K = k."""
    g = _gamma(k)
    return ((2 * _U + _U * _U) + 2 * g * (1 + _U) ** 2 + g) * 1.01


def _round_up(x: torch.Tensor) -> torch.Tensor:
    """float64 → the float32 at or above each value, so that a bound only widens."""
    f = x.float()
    return torch.where(f.double() < x, torch.nextafter(f, torch.tensor(float("inf"))), f)


def _quantise_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row of w [N, K] as int8 values q (kept as float) times a float32 scale, the scale
    clipping at the level (max |w|, or 4, 3 or 2.5 × the row's rms) that leaves the smallest
    ‖w − scale·q‖₂: the bound grows with that error. Returns (scales, q, errors in float64)."""
    wd = w.double()
    amax = w.abs().amax(dim=1)
    rms = wd.pow(2).mean(dim=1).sqrt().float()
    best = None
    for level in (amax, 4 * rms, 3 * rms, 2.5 * rms):
        clip = torch.minimum(level, amax)
        scale = torch.where(clip > 0, clip / 127, torch.ones_like(clip)).float()
        q = torch.round(w / scale[:, None]).clamp(-127, 127)
        err = (wd - scale.double()[:, None] * q.double()).norm(dim=1)
        if best is None:
            best = [scale, q, err]
        else:
            better = err < best[2]
            best[0] = torch.where(better, scale, best[0])
            best[1] = torch.where(better[:, None], q, best[1])
            best[2] = torch.where(better, err, best[2])
    return best[0].contiguous(), best[1], best[2]


class ScreenedGreedyHead:
    """The argmax of a NativeLinear LM head (no bias; float32, or bfloat16 on the vdpbf16ps tile)
    through an int8 or (float32 heads) bfloat16 screen."""

    def __init__(self, head: cpu_gemm.NativeLinear, kind: str):
        self.owner, self.next_kinds = None, None  # set by attach() in auto mode (see _review)
        packed = head.packed
        n, k = packed.out_features, packed.in_features
        self.bf16_head = packed.dtype == torch.bfloat16
        if self.bf16_head:
            if kind != "int8":
                raise ValueError("a bfloat16 LM head takes the int8 screen only")
            if not (packed.k_pairs and packed.bf16_out and cpu_gemm.bf16_dot()):
                raise ValueError("a bfloat16 LM head is screened only where it runs on the vdpbf16ps tile")
            # the k-pair panels [N/16][K/2][16][2] back to W [N, K] (K rounded up to even)
            wk = (k + 1) // 2 * 2
            w_pairs = packed.panels.view(-1, wk // 2, 16, 2).permute(0, 2, 1, 3).reshape(-1, wk)[:n]
            w = w_pairs[:, :k].float()
        else:
            # the float32 panels [N/16][K][16] back to W [N, K]
            w = packed.panels.view(-1, k, 16).transpose(1, 2).reshape(-1, k)[:n]
        if not torch.isfinite(w).all():
            raise ValueError("the LM head holds non-finite weights")
        self.head, self.kind = head, kind
        # W row-major (bfloat16 heads: as k-pair words) for the exact checks: in the GEMM's panels
        # one token's weights are 64 bytes apart, a cache line each
        self.w_rows = w_pairs.contiguous() if self.bf16_head else w.contiguous()
        self.rows = self.computed = 0  # rows screened and logits computed exactly for them (stats)
        lib = cpu_gemm._native.lib
        if kind == "int8":
            if not lib.greedy_screen_int8_takes(k):
                raise ValueError(f"the int8 screen needs AVX512-VNNI and K in one k block (K = {k})")
            self.sw, q, f = _quantise_rows(w)
            self.f = _round_up(f).contiguous()
            self.w_norms = _round_up(w.double().norm(dim=1)).contiguous()
            self.colsum128 = (q.sum(dim=1) * 128).to(torch.int32).contiguous()
            q8 = q.to(torch.int8).contiguous()
            self.screen_panels = torch.empty(lib.greedy_screen_int8_packed_size(n, k), dtype=torch.int8)
            lib.greedy_screen_int8_pack(q8.data_ptr(), n, k, self.screen_panels.data_ptr(), torch.get_num_threads())
            # the head's float32 sums (doubled for vdpbf16ps, whose steps' rounding is the CPU's own)
            # and the screen's float roundings
            self.g = (2 if self.bf16_head else 1) * _gamma(k) + 4 * _U32
            # a bfloat16 head rounds its logits: a token whose float32 sum is within one bfloat16
            # step (≤ 2⁻⁷ of the largest logit, |logit| ≤ ‖h‖·‖W[v]‖) of the largest may tie it
            self.rho = 2.0 ** -7 * (1 + _U) * 1.01 * self.w_norms.double().max().item() if self.bf16_head else 0.0
        elif kind == "bf16":
            self.screen_weight = cpu_gemm.pack_weight(w.to(torch.bfloat16))
            self.screen_panels = self.screen_weight.panels
            self.w_norms = _round_up(w.double().norm(dim=1)).contiguous()
            self.coef = bound_coef(k)
        else:
            raise ValueError(f"unknown screen {kind!r}")

    @property
    def extra_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.screen_panels, self.w_rows) if t is not None)

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """Token ids [M] (int64): the first index of each row's largest logit, as the head computes
        them (float32, or rounded to bfloat16 for a bfloat16 head)."""
        from pagedserve.kernels.cpu import fused_ops as cpu_fused

        if self.bf16_head and not cpu_gemm.bf16_dot():  # the head left the vdpbf16ps tile (an A/B switch)
            return cpu_fused.argmax(self.head(hidden))
        xb = hidden.to(torch.bfloat16).contiguous() if self.bf16_head else None
        x = xb.float() if self.bf16_head else hidden.float().contiguous()
        m = x.shape[0]
        out = torch.empty(m, dtype=torch.int64)
        lib = cpu_gemm._native.lib
        packed = self.head.packed
        n, k, threads = packed.out_features, packed.in_features, torch.get_num_threads()
        if self.kind == "int8":
            computed = lib.greedy_screen_int8_argmax(
                x.data_ptr(), x.stride(0), m, k, None if self.bf16_head else self.w_rows.data_ptr(),
                self.screen_panels.data_ptr(), n, self.colsum128.data_ptr(), self.sw.data_ptr(), self.f.data_ptr(),
                self.w_norms.data_ptr(), self.g, xb.data_ptr() if self.bf16_head else None,
                xb.stride(0) if self.bf16_head else 0, self.w_rows.data_ptr() if self.bf16_head else None, self.rho,
                out.data_ptr(), threads)
            cpu_gemm.check(computed, "greedy_screen_int8_argmax", k)
        else:
            xs = x.to(torch.bfloat16)
            computed = lib.greedy_screen_argmax(
                x.data_ptr(), x.stride(0), xs.data_ptr(), xs.stride(0), m, k, self.w_rows.data_ptr(),
                self.screen_panels.data_ptr(), int(self.screen_weight.k_pairs), n, self.w_norms.data_ptr(),
                self.coef, out.data_ptr(), threads)
        self.computed += computed
        self.rows += m
        fallback = (out < 0).nonzero().flatten()
        if len(fallback):  # a non-finite value somewhere in these rows: the plain head
            rows = (xb if self.bf16_head else x)[fallback]
            out[fallback] = cpu_fused.argmax(self.head(rows))
        if self.next_kinds is not None and self.rows >= REVIEW_ROWS:
            self._review()
        return out

    def _review(self) -> None:
        """In auto mode, once REVIEW_ROWS rows are screened: a screen that leaves more than
        1/MAX_SHARE of the vocabulary per row to compute exactly costs more than it saves, and
        gives way to the next kind, or to the plain head. The bound is in the model's hands: int8
        rows are quantised at one scale each, and trained models' hidden states carry a few
        outlier features (SmolLM2-135M: ~1300 of 49152 tokens per row pass the int8 test, 3 the
        bfloat16 one; the random-weight benchmark models: 15 and 5)."""
        per_row = self.computed / self.rows
        owner, rest, self.next_kinds = self.owner, self.next_kinds, None
        if per_row <= self.head.packed.out_features / MAX_SHARE:
            return
        owner.greedy_head = None
        for kind in rest:
            try:
                nxt = ScreenedGreedyHead(self.head, kind)
            except ValueError:
                continue
            nxt.owner, nxt.next_kinds = owner, rest[rest.index(kind) + 1:]
            owner.greedy_head = nxt
            log.info("greedy LM-head screen: %s left %.0f tokens per row to compute exactly; %s screen from now on",
                     self.kind, per_row, kind)
            return
        log.info("greedy LM-head screen: %s left %.0f tokens per row to compute exactly; plain LM head from now on",
                 self.kind, per_row)


def _auto_kinds(head: cpu_gemm.NativeLinear) -> list[str]:
    """The screens to try in auto mode, best first."""
    kinds = []
    if cpu_gemm._native.lib.greedy_screen_int8_takes(head.in_features):
        kinds.append("int8")
    if head.packed.dtype == torch.float32 and cpu_gemm.bf16_k_pairs() and cpu_gemm.bf16_dot():
        kinds.append("bf16")
    return kinds


def attach(owner, head, mode: str = "auto") -> str | None:
    """Gives `owner` (the CPU model runner) a `greedy_head` screening `head` (the model's LM head)
    where this CPU and the head allow one; returns a line for
    the load log, or None when the screen stays off."""
    if mode not in MODES:
        raise ValueError(f"greedy_screen={mode!r}: use one of {', '.join(MODES)}")
    if mode == "0" or not isinstance(head, cpu_gemm.NativeLinear) or head.bias is not None:
        return None
    if head.packed.dtype not in (torch.float32, torch.bfloat16):
        return None
    kinds = _auto_kinds(head) if mode == "auto" else [mode]
    for i, kind in enumerate(kinds):
        try:
            screen = ScreenedGreedyHead(head, kind)
        except ValueError as e:
            log.info("greedy LM-head screen %s off: %s", kind, e)
            continue
        if mode == "auto":
            screen.owner, screen.next_kinds = owner, kinds[i + 1:]
        owner.greedy_head = screen
        break
    else:
        return None
    mib = owner.greedy_head.extra_bytes / 2**20
    kind = owner.greedy_head.kind
    name = "an int8" if kind == "int8" else "a bfloat16"
    dtype = str(head.packed.dtype).replace("torch.", "")
    return f"greedy steps take the {dtype} LM head's argmax through {name} screen ({mib:.0f} MiB more)"

"""How many KV-cache blocks fit on the device: the budget arithmetic, and the CUDA peak measurement.

budget      = total_memory * gpu_memory_utilization
kv_bytes    = budget - weights - peak_activations - non_torch_overhead
num_blocks  = floor(kv_bytes / kv_bytes_per_block)

`plan_kv_cache` is pure (unit-tested anywhere); `profile_peak_memory` and `non_torch_memory_bytes`
touch torch.cuda and are only called on CUDA.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from pagedserve.errors import ConfigError

GiB = 1 << 30


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes of one block across all layers: K and V, each [block_size, num_kv_heads, head_dim]."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype_bytes


@dataclass(frozen=True)
class KVCachePlan:
    num_blocks: int
    kv_cache_bytes: int  # num_blocks * kv_bytes_per_block
    max_concurrency: float  # how many max_model_len-long sequences fit at once
    summary: str  # one log line


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def plan_kv_cache(
    *,
    total_memory: int,
    gpu_memory_utilization: float,
    weights_bytes: int,
    peak_activation_bytes: int,
    non_torch_bytes: int,
    kv_bytes_per_block: int,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
) -> KVCachePlan:
    """Size the KV cache; ConfigError (saying what fits and which flag to change) when even one
    sequence of max_model_len does not fit."""
    if not 0 < gpu_memory_utilization <= 1:
        raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {gpu_memory_utilization}")
    if kv_bytes_per_block <= 0 or block_size <= 0 or max_model_len <= 0 or total_memory <= 0:
        raise ValueError("total_memory, kv_bytes_per_block, block_size and max_model_len must be positive")
    budget = int(total_memory * gpu_memory_utilization)
    fixed = weights_bytes + peak_activation_bytes + non_torch_bytes
    kv_bytes = budget - fixed
    num_blocks = max(0, kv_bytes // kv_bytes_per_block)
    blocks_per_seq = math.ceil(max_model_len / block_size)

    if num_blocks < blocks_per_seq:
        fits_len = num_blocks * block_size  # the longest context the cache can hold
        needed = fixed + blocks_per_seq * kv_bytes_per_block
        # smallest utilization (rounded up to 0.01) at which one max_model_len sequence fits
        need_util = math.ceil(needed / total_memory * 100) / 100
        while need_util * total_memory < needed:  # float rounding
            need_util += 0.01
        usage = (
            f"weights {_gib(weights_bytes)} + activations {_gib(peak_activation_bytes)} + other "
            f"{_gib(non_torch_bytes)} of a {_gib(budget)} budget ({gpu_memory_utilization:.2f} x {_gib(total_memory)})"
        )
        fixes = []
        if need_util <= 1.0:
            fixes.append(f"raise --gpu-memory-utilization to {need_util:.2f}")
        if fits_len > 0:
            fixes.append(f"lower --max-model-len to {fits_len}")
        if fixes:
            fix = " or ".join(fixes)
        else:
            fix = (
                "use a device with more memory, a smaller or quantized model, or a lower "
                "--max-num-batched-tokens (it sets the activation peak)"
            )
        raise ConfigError(
            f"KV cache too small for --max-model-len {max_model_len}: it needs {blocks_per_seq} blocks "
            f"({_gib(blocks_per_seq * kv_bytes_per_block)}) but only {num_blocks} fit after {usage}; "
            f"estimated maximum model length that fits: {fits_len}. Fix: {fix}."
        )

    max_concurrency = num_blocks * block_size / max_model_len
    summary = (
        f"memory: weights {_gib(weights_bytes)}, activations {_gib(peak_activation_bytes)}, "
        f"other {_gib(non_torch_bytes)}, KV cache {_gib(num_blocks * kv_bytes_per_block)} "
        f"({num_blocks} blocks, {num_blocks * block_size} tokens) of a {_gib(budget)} budget "
        f"({gpu_memory_utilization:.2f} x {_gib(total_memory)}); max concurrency at "
        f"{max_model_len} tokens per sequence: {max_concurrency:.2f}x (max_num_seqs {max_num_seqs})"
    )
    return KVCachePlan(num_blocks, num_blocks * kv_bytes_per_block, max_concurrency, summary)


def profile_peak_memory(run_forward: Callable[[], object], device: torch.device | str) -> int:
    """Peak bytes torch allocates during `run_forward()` above what was allocated before (weights
    and other resident tensors are excluded). CUDA only: run with the largest batch the engine
    will schedule (max_num_batched_tokens) so the KV cache is not sized on an underestimate."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"profile_peak_memory needs a CUDA device, got {device}")
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run_forward()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    return max(0, peak - baseline)


def non_torch_memory_bytes(device: torch.device | str) -> int:
    """Device memory in use but not reserved by torch's allocator (CUDA context, NCCL, cuBLAS
    workspaces, other processes). CUDA only."""
    device = torch.device(device)
    free, total = torch.cuda.mem_get_info(device)
    return max(0, (total - free) - torch.cuda.memory_reserved(device))


# ---------------------------------------------------------------- the profile batch


def profile_batch_lengths(max_num_batched_tokens: int, max_model_len: int, max_num_seqs: int) -> list[int]:
    """Prompt lengths of the largest step the scheduler can produce: max_num_batched_tokens new
    tokens, as few sequences as max_model_len allows (long first chunks: the largest attention
    tiles), never more than max_num_seqs sequences."""
    if min(max_num_batched_tokens, max_model_len, max_num_seqs) < 1:
        raise ValueError("max_num_batched_tokens, max_model_len and max_num_seqs must be >= 1")
    n = min(max_num_seqs, -(-max_num_batched_tokens // max_model_len))
    base, extra = divmod(max_num_batched_tokens, n)
    lengths = [base + (i < extra) for i in range(n)]
    # more tokens than n sequences of max_model_len can hold: cap (the scheduler could not fill it either)
    return [min(length, max_model_len) for length in lengths]


class _DummySeq:
    __slots__ = ("token_ids", "block_table")

    def __init__(self, token_ids, block_table):
        self.token_ids, self.block_table = token_ids, block_table


class _DummyEntry:
    __slots__ = ("seq", "start", "num_new_tokens")
    num_spec_tokens = 0  # a profile batch verifies no drafts

    def __init__(self, seq, start, num_new_tokens):
        self.seq, self.start, self.num_new_tokens = seq, start, num_new_tokens


def dummy_entries(lengths: list[int], block_size: int) -> tuple[list, int]:
    """ScheduledSeq look-alikes (first prefill chunks of token 0) over consecutive fresh blocks,
    and the number of KV blocks they need."""
    entries, next_block = [], 0
    for n in lengths:
        nb = -(-n // block_size)
        entries.append(_DummyEntry(_DummySeq([0] * n, list(range(next_block, next_block + nb))), 0, n))
        next_block += nb
    return entries, next_block


def run_dummy_forward(runner, entries: list, num_logit_rows: int) -> None:
    """One forward of the profile batch through the runner's own batch construction, attention
    backend and KV cache, plus logits and a softmax for num_logit_rows rows (the sampler's peak)."""
    with torch.inference_mode():
        input_ids, positions, meta, _ = runner._prepare(entries)
        hidden = runner.model(input_ids, positions, meta, runner.kv.layers, runner.backend)
        logits = runner.model.compute_logits(hidden[:num_logit_rows])
        torch.softmax(logits, dim=-1)

"""CUDA graphs for decode steps: which batch sizes to capture, padding to them, capture and replay.

A decode step launches dozens of small kernels per layer; replaying a captured CUDA graph removes the
CPU launch overhead, which dominates at small batch sizes. A graph has fixed shapes, so we capture
one graph per batch size of a "ladder" and pad each live batch up to the next captured size.

Ladder choice: 1, 2, 4, 8, then every 8 (16, 24, ...) up to max_num_seqs, capped at 512, plus
max_num_seqs itself when it is not already on the ladder (so every batch that can occur has a
graph). Small sizes are dense because padding 3 -> 4 wastes little but padding 1 -> 8 would waste
8x on the smallest, most launch-bound batches; past 8 the step of 8 keeps padding waste below
8 rows (< 50% at 16, < 6% at 128) while the number of graphs (capture time and graph memory) grows
only linearly. Above 512 the step is compute-bound, graphs gain little, and the batch runs eager.

Everything device-specific (torch.cuda) happens inside CudaGraphRunner methods, so this module
imports and its logic is unit-tested on a CPU-only machine.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping

import torch

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int, max_capture_size: int = MAX_CAPTURE_SIZE) -> list[int]:
    """The ascending batch sizes to capture: 1, 2, 4, 8, 16, 24, ... <= min(max_num_seqs, cap)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    top = min(max_num_seqs, max_capture_size)
    if top < 1:
        return []
    ladder = [s for s in (1, 2, 4, 8) if s <= top]
    ladder += list(range(16, top + 1, 8))
    if ladder[-1] != top:
        ladder.append(top)
    return ladder


def padded_batch_size(n: int, ladder: list[int]) -> int | None:
    """The smallest captured size >= n, or None when n is above the ladder (run eager)."""
    if n < 1:
        raise ValueError(f"batch size must be >= 1, got {n}")
    # the ladder is short (< 70 entries): a linear scan is as fast as bisect here
    for size in ladder:
        if size >= n:
            return size
    return None


def _slice_outputs(out: Any, n: int) -> Any:
    if isinstance(out, torch.Tensor):
        return out[:n]
    if isinstance(out, tuple):
        return tuple(_slice_outputs(o, n) for o in out)
    if isinstance(out, list):
        return [_slice_outputs(o, n) for o in out]
    if isinstance(out, dict):
        return {k: _slice_outputs(v, n) for k, v in out.items()}
    return out


class CudaGraphRunner:
    """Captures `forward_fn(**inputs)` once per ladder size and replays it for padded batches.

    static_inputs: buffers sized for the largest captured batch, batch-major (dim 0), on the device
      (e.g. input_ids [N], positions [N], slot_mapping [N], seq_lens [N], block_tables [N, W]).
      The graphs read these exact buffers; a replay copies the live batch into them.
    pad_values: what padding rows (and unused trailing columns) are filled with, per input; default 0.
      For the paged-attention contract use slot_mapping -1 (the padding row's KV is not stored) and
      seq_lens 0 (the Triton decode kernel returns zeros for a 0-length context).
    forward_fn: returns a tensor, or a tuple/list/dict of tensors, batch-major; its output tensors
      are static too (owned by the graph), so callers must consume/copy them before the next replay.
    """

    def __init__(
        self,
        forward_fn: Callable[..., Any],
        static_inputs: Mapping[str, torch.Tensor],
        ladder: list[int],
        pad_values: Mapping[str, int | float] | None = None,
    ):
        if not ladder:
            raise ValueError("empty capture ladder")
        if sorted(set(ladder)) != list(ladder):
            raise ValueError(f"ladder must be strictly ascending: {ladder}")
        too_small = {k: v.shape[0] for k, v in static_inputs.items() if v.shape[0] < ladder[-1]}
        if too_small:
            raise ValueError(f"static inputs smaller than the largest capture size {ladder[-1]}: {too_small}")
        self.forward_fn = forward_fn
        self.static_inputs = dict(static_inputs)
        self.ladder = list(ladder)
        self.pad_values = dict(pad_values or {})
        unknown = set(self.pad_values) - set(self.static_inputs)
        if unknown:
            raise ValueError(f"pad_values for unknown inputs: {sorted(unknown)}")
        self._graphs: dict[int, Any] = {}  # batch size -> torch.cuda.CUDAGraph
        self._outputs: dict[int, Any] = {}  # batch size -> the graph's (static) outputs
        self._pool = None

    @property
    def captured_sizes(self) -> list[int]:
        return sorted(self._graphs)

    def _static_view(self, bs: int) -> dict[str, torch.Tensor]:
        return {k: v[:bs] for k, v in self.static_inputs.items()}

    def stage_inputs(self, bs: int, inputs: Mapping[str, torch.Tensor]) -> int:
        """Copy a live batch into the static buffers of size bs, padding the rest; returns n.

        Each input may be smaller than its buffer in every dim (fewer rows; a narrower block table):
        the buffer's first bs rows are filled with the pad value, then the input is copied into the
        leading corner.
        """
        missing = set(self.static_inputs) - set(inputs)
        extra = set(inputs) - set(self.static_inputs)
        if missing or extra:
            raise ValueError(f"inputs do not match the captured ones: missing {sorted(missing)}, extra {sorted(extra)}")
        sizes = {k: v.shape[0] for k, v in inputs.items()}
        n = next(iter(sizes.values()))
        if any(s != n for s in sizes.values()):
            raise ValueError(f"inputs disagree on the batch size: {sizes}")
        if n > bs:
            raise ValueError(f"batch of {n} does not fit the graph for {bs}")
        for name, src in inputs.items():
            buf = self.static_inputs[name]
            if src.dim() != buf.dim() or any(s > b for s, b in zip(src.shape[1:], buf.shape[1:])):
                raise ValueError(f"input {name} {tuple(src.shape)} does not fit its buffer {tuple(buf.shape)}")
            view = buf[:bs]
            if n < bs or src.shape[1:] != buf.shape[1:]:
                view.fill_(self.pad_values.get(name, 0))
            view[tuple(slice(0, s) for s in src.shape)].copy_(src, non_blocking=True)
        return n

    def capture(self, warmup_iters: int = 2) -> None:
        """Capture one graph per ladder size, largest first (the shared memory pool is sized by the
        largest graph and the smaller ones reuse it). Only on CUDA."""
        if not torch.cuda.is_available():
            raise RuntimeError("CUDA graphs need a CUDA device")
        for name, buf in self.static_inputs.items():
            if not buf.is_cuda:
                raise ValueError(f"static input {name} is on {buf.device}, not CUDA")
        for name, buf in self.static_inputs.items():
            buf.fill_(self.pad_values.get(name, 0))
        for bs in sorted(self.ladder, reverse=True):
            inputs = self._static_view(bs)
            # warm up outside the graph (lazy inits, autotuning, allocator growth), on a side stream
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(warmup_iters):
                    self.forward_fn(**inputs)
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = self.forward_fn(**inputs)
            if self._pool is None:
                self._pool = graph.pool()
            self._graphs[bs] = graph
            self._outputs[bs] = out
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s", self.captured_sizes)

    def replay(self, inputs: Mapping[str, torch.Tensor]) -> Any | None:
        """Run the graph for a live batch; None when its size has no graph (the caller runs eager).

        The returned tensors are views of the graph's static outputs, sliced to the live batch.
        """
        n = next(iter(inputs.values())).shape[0]
        bs = padded_batch_size(n, self.ladder)
        if bs is None or bs not in self._graphs:
            return None
        self.stage_inputs(bs, inputs)
        self._graphs[bs].replay()
        return _slice_outputs(self._outputs[bs], n)

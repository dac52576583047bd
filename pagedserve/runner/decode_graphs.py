"""Pure-decode steps replayed from captured CUDA graphs (experimental: opt-in, not yet run on a GPU).

Glue between the model runner and `cuda_graphs.CudaGraphRunner`: static input buffers sized for the
largest ladder size (input_ids, positions, slot_mapping, seq_lens [N]; block_tables [N, W] with
W = blocks of max_model_len), and a forward that builds the kernel-style AttentionMetadata from them.
A live decode batch of n sequences is padded to the next captured size: padding rows get slot -1
(their K/V are not stored) and seq_len 0 (the Triton decode kernel returns zeros for them), so they
touch no real sequence's cache. Only backends with `needs_block_tables` (Triton, flash-attn) are
graph-safe: the torch backend's gathers have data-dependent shapes.

The decode split-K factor must not depend on device values or on the live context lengths, so the
metadata carries max_decode_seq_len=None (the factor then follows from the padded batch size only).
"""
from __future__ import annotations

import torch

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.runner.cuda_graphs import CudaGraphRunner, capture_sizes


class DecodeGraphs:
    def __init__(self, runner, max_num_seqs: int, max_model_len: int):
        if not getattr(runner.backend, "needs_block_tables", False):
            raise ValueError(f"CUDA graphs need a block-table attention backend, not {runner.backend.name}")
        self.runner = runner
        ladder = capture_sizes(max_num_seqs)
        n = ladder[-1]
        width = -(-max_model_len // runner.block_size)
        dev = runner.device
        static = {
            "input_ids": torch.zeros(n, dtype=torch.long, device=dev),
            "positions": torch.zeros(n, dtype=torch.long, device=dev),
            "slot_mapping": torch.full((n,), -1, dtype=torch.long, device=dev),
            "seq_lens": torch.zeros(n, dtype=torch.int32, device=dev),
            "block_tables": torch.zeros(n, width, dtype=torch.int32, device=dev),
        }
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)  # one query per sequence
        self.graphs = CudaGraphRunner(self._forward, static, ladder, pad_values={"slot_mapping": -1, "seq_lens": 0})

    @property
    def captured_sizes(self) -> list[int]:
        return self.graphs.captured_sizes

    def _forward(self, input_ids, positions, slot_mapping, seq_lens, block_tables):
        r = self.runner
        b = input_ids.shape[0]
        meta = AttentionMetadata(
            slot_mapping=slot_mapping, num_decode_tokens=b, decode_slots=None, decode_mask=None, prefills=[],
            block_tables=block_tables, seq_lens=seq_lens, query_start_loc=self.query_start_loc[:b + 1],
            block_size=r.block_size, max_decode_seq_len=None,
        )
        return r.model(input_ids, positions, meta, r.kv.layers, r.backend)

    def capture(self) -> None:
        with torch.inference_mode():
            self.graphs.capture()

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """Hidden states [n, hidden] of a pure-decode batch from its graph (a view of the graph's
        static output: consume it before the next step), or None: not pure decode, or no graph."""
        n = input_ids.shape[0]
        if meta.prefills or meta.num_decode_tokens != n or meta.block_tables is None:
            return None
        if meta.block_tables.shape[1] > self.graphs.static_inputs["block_tables"].shape[1]:
            return None
        return self.graphs.replay({
            "input_ids": input_ids, "positions": positions, "slot_mapping": meta.slot_mapping,
            "seq_lens": meta.seq_lens, "block_tables": meta.block_tables,
        })

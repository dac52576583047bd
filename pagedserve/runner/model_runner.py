"""Turns a SchedulerOutput into one flat, padding-free batch, runs the model, samples.

The only place where the schedule becomes tensors. Index arithmetic (positions, cache slots,
context gathers) is vectorised with numpy; Python loops run over sequences, never over tokens.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from pagedserve.engine.profiler import NULL_PHASE
from pagedserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from pagedserve.attention import select_backend
from pagedserve.attention.metadata import FlatBatch
from pagedserve.config import EngineConfig
from pagedserve.runner.kv_cache import GiB, KVCache, num_blocks_for_budget
from pagedserve.runner.sampler import SampledToken, Sampler, SamplingBatch


class StepResult:
    __slots__ = ("sampled", "prompt_logprobs", "verified")

    def __init__(self):
        self.sampled: list[tuple] = []  # (ScheduledSeq, SampledToken) for sequences that produced a token
        self.prompt_logprobs: list[tuple] = []  # (ScheduledSeq, list of per-position entries)
        # speculative decoding: (ScheduledSeq, Verdict) for sequences whose drafts were verified
        self.verified: list[tuple] = []


class ModelRunner:
    """Device-neutral: batch construction, the forward, sampling. CpuModelRunner (runner/cpu_runner.py)
    and CudaModelRunner (runner/cuda_runner.py) add what their device needs at start; `for_device`
    picks one, once."""

    greedy_head = None  # a screened LM head for argmax-only batches (CPU, runner/greedy_head.py)

    @staticmethod
    def for_device(device: torch.device) -> type["ModelRunner"]:
        if device.type == "cpu":
            from pagedserve.runner.cpu_runner import CpuModelRunner

            return CpuModelRunner
        if device.type == "cuda":
            from pagedserve.runner.cuda_runner import CudaModelRunner

            return CudaModelRunner
        return ModelRunner

    @staticmethod
    def prepare_process(config: EngineConfig) -> None:
        """Process-wide settings, before the weights load."""

    def __init__(self, model, config: EngineConfig, device: torch.device, kv_cache: KVCache | None = None):
        self.model = model
        self.config = config
        self.block_size = config.block_size
        self.device = device
        self.dtype = next(model.parameters()).dtype
        self.kv = kv_cache
        self.backend = select_backend(device, self.block_size, self.dtype, config.attention_backend,
                                      config.cpu_kernels)
        self.sampler = Sampler()
        self.vocab_size = model.spec.vocab_size
        self.graphs = None  # DecodeGraphs when CUDA graphs are on (CudaModelRunner)

    def enable_cuda_graphs(self, max_num_seqs: int, max_model_len: int, capture: bool = True) -> None:
        """Pure-decode steps replayed from graphs (CudaModelRunner turns this on; the glue is
        device-neutral, so tests drive it on the CPU with capture=False)."""
        from pagedserve.runner.decode_graphs import DecodeGraphs

        self.graphs = DecodeGraphs(self, max_num_seqs, max_model_len)
        if capture:
            self.graphs.capture()

    # ---- the KV cache -----------------------------------------------------------------------
    def num_kv_blocks(self) -> int:
        """KV-cache blocks: --num-gpu-blocks-override, else --kv-cache-space GiB, capped to the memory
        available at start (runner/host_memory.py: a lazily mapped pool larger than memory would fail
        under load, not at start)."""
        cfg = self.config
        if cfg.num_gpu_blocks_override is not None:
            return cfg.num_gpu_blocks_override
        from pagedserve.runner import host_memory

        budget, note = host_memory.kv_budget_bytes(int(cfg.kv_cache_space * GiB), host_memory.available_bytes())
        if note:
            logging.getLogger("pagedserve").warning("%s", note)
        return num_blocks_for_budget(cfg, self.model.spec, self.dtype, budget)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv = KVCache(self.model.spec, num_blocks, self.block_size, self.dtype, self.device,
                          populate=self.config.populate_kv)

    # ---- batch construction -----------------------------------------------------------------
    def _prepare(self, entries: list[ScheduledSeq]):
        bs = self.block_size
        n_seqs = len(entries)
        q_lens = np.fromiter((e.num_new_tokens for e in entries), dtype=np.int64, count=n_seqs)
        starts = np.fromiter((e.start for e in entries), dtype=np.int64, count=n_seqs)
        cu = np.zeros(n_seqs + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu[1:])
        total = int(cu[-1])
        ids: list[int] = []
        for e in entries:
            ids.extend(e.seq.token_ids[e.start:e.start + e.num_new_tokens - e.num_spec_tokens])
            if e.num_spec_tokens:
                ids.extend(e.seq.spec_token_ids[:e.num_spec_tokens])
        seq_of_token = np.repeat(np.arange(n_seqs), q_lens)
        positions = np.arange(total, dtype=np.int64) - np.repeat(cu[:-1] - starts, q_lens)
        seq_lens = starts + q_lens
        max_blocks = int(-(-seq_lens.max() // bs))
        tables = np.zeros((n_seqs, max_blocks), dtype=np.int64)
        for i, e in enumerate(entries):
            bt = e.seq.block_table[:max_blocks]  # a draft model's shadow may hold blocks for later steps
            tables[i, :len(bt)] = bt
        slots = tables[seq_of_token, positions // bs] * bs + positions % bs
        num_decodes = int(np.searchsorted(q_lens != 1, True))  # entries are sorted: decodes first
        batch = FlatBatch(bs, tables, starts, seq_lens, cu, slots, num_decodes, self.device)
        meta = self.backend.build_metadata(batch)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        return input_ids, torch.from_numpy(positions).to(self.device), meta, cu

    # ---- one step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, phase=None) -> StepResult:
        phase = phase or (lambda name: NULL_PHASE)
        with phase("prepare_inputs"):
            # decodes first so attention can batch them in one call; then chunks with earlier
            # context (the native CPU kernel takes these in the same call), then fresh prompts
            entries = sorted(sched.scheduled, key=lambda e: (e.num_new_tokens != 1, e.start == 0))
            input_ids, positions, meta, cu = self._prepare(entries)
        with phase("forward"):
            hidden = self.graphs.run(input_ids, positions, meta) if self.graphs is not None else None
            if hidden is None:
                hidden = self.model(input_ids, positions, meta, self.kv.layers, self.backend)
        return self._sample(entries, hidden, cu, phase)

    def _sample(self, entries, hidden, cu, phase) -> StepResult:
        result = StepResult()

        sampling = [(i, e) for i, e in enumerate(entries)
                    if e.start + e.num_new_tokens == e.seq.num_tokens and not e.num_spec_tokens]
        speculating = [(i, e) for i, e in enumerate(entries) if e.num_spec_tokens]
        if speculating:
            from pagedserve.spec.verifier import verify

            with phase("verify"):  # every position of every draft, one LM head call
                rows = torch.tensor([r for i, e in speculating
                                     for r in range(int(cu[i + 1]) - e.num_spec_tokens - 1, int(cu[i + 1]))],
                                    device=self.device)
                verdicts = verify(self.model, self.sampler, hidden[rows], [e.seq for _, e in speculating],
                                  self.vocab_size, self.device, screen=self.greedy_head)
                result.verified = [(e, v) for (_, e), v in zip(speculating, verdicts)]
        if sampling:
            with phase("sample"):
                batch = SamplingBatch([e.seq for _, e in sampling], self.vocab_size, self.device)
            screen = self.greedy_head if batch.argmax_only else None
            with phase("logits"):  # the LM head, only for the rows that sample
                rows = torch.tensor([int(cu[i + 1]) - 1 for i, _ in sampling], device=self.device)
                if screen is not None:  # the head's own argmax without computing every logit (runner/greedy_head.py)
                    tokens = [SampledToken(t) for t in screen.argmax(hidden[rows]).tolist()]
                else:
                    # a batch that only takes argmaxes skips the float32 copy of bfloat16 logits
                    logits = self.model.compute_logits(hidden[rows], upcast=not batch.argmax_only)
            with phase("sample"):
                if screen is None:
                    tokens = self.sampler(logits, batch)
                result.sampled = [(e, t) for (_, e), t in zip(sampling, tokens)]

        with phase("sample"):
            for i, e in enumerate(entries):
                req = e.seq.request
                if req.prompt_logprobs is not None and e.seq.index == 0 and e.start < e.seq.prompt_len - 1:
                    result.prompt_logprobs.append((e, self._prompt_logprobs(hidden, int(cu[i]), e)))
        return result

    def _prompt_logprobs(self, hidden: torch.Tensor, offset: int, e: ScheduledSeq) -> list:
        """Logprob of each next prompt token predicted inside this chunk, plus the top-N."""
        seq = e.seq
        end = min(e.start + e.num_new_tokens, seq.prompt_len - 1)
        n = end - e.start
        logprobs = torch.log_softmax(self.model.compute_logits(hidden[offset:offset + n]), dim=-1)
        targets = torch.tensor(seq.token_ids[e.start + 1:end + 1], device=logprobs.device)
        chosen = logprobs.gather(1, targets[:, None]).squeeze(1)
        ranks = (logprobs > chosen[:, None]).sum(-1) + 1
        k = seq.params.prompt_logprobs
        top_v, top_i = logprobs.topk(k, dim=-1) if k else (None, None)
        out = []
        for j in range(n):
            top = list(zip(top_i[j].tolist(), top_v[j].tolist())) if k else []
            out.append(SampledToken(int(targets[j]), float(chosen[j]), int(ranks[j]), top))
        return out

"""The model runner on CUDA: KV pool sized by a measured profile, optional decode CUDA graphs."""
from __future__ import annotations

import logging
import time

import torch

from pagedserve.runner.kv_cache import KVCache, bytes_per_block
from pagedserve.runner.model_runner import ModelRunner

log = logging.getLogger("pagedserve")


class CudaModelRunner(ModelRunner):
    def num_kv_blocks(self) -> int:
        """--num-gpu-blocks-override, else a measured profile: run the largest step the scheduler
        can produce (max_num_batched_tokens dummy prompt tokens, through the real attention backend,
        with a temporary KV cache just big enough for it) and measure its activation peak;
        `plan_kv_cache` turns weights + peak + non-torch memory into a block count, or a ConfigError
        naming the flag to change. The arithmetic is unit-tested in tests/test_cuda_logic.py; only
        the measurements here touch the device."""
        from pagedserve.runner import memory_profile as mp

        cfg, spec = self.config, self.model.spec
        if cfg.num_gpu_blocks_override is not None:
            return cfg.num_gpu_blocks_override
        lengths = mp.profile_batch_lengths(cfg.max_num_batched_tokens, cfg.max_model_len, cfg.max_num_seqs)
        entries, blocks = mp.dummy_entries(lengths, cfg.block_size)
        self.kv = KVCache(spec, blocks, cfg.block_size, self.dtype, self.device)
        peak = mp.profile_peak_memory(lambda: mp.run_dummy_forward(self, entries, cfg.max_num_seqs), self.device)
        self.kv = None
        torch.cuda.empty_cache()
        _, total = torch.cuda.mem_get_info(self.device)
        plan = mp.plan_kv_cache(
            total_memory=total,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            weights_bytes=torch.cuda.memory_allocated(self.device),  # weights, rope tables, other resident tensors
            peak_activation_bytes=peak,
            non_torch_bytes=mp.non_torch_memory_bytes(self.device),
            kv_bytes_per_block=bytes_per_block(spec, cfg.block_size, self.dtype),
            block_size=cfg.block_size,
            max_model_len=cfg.max_model_len,
            max_num_seqs=cfg.max_num_seqs,
        )
        log.info("%s (profiled with %d dummy tokens in %d sequences)", plan.summary, sum(lengths), len(lengths))
        return plan.num_blocks

    def allocate_kv_cache(self, num_blocks: int) -> None:
        super().allocate_kv_cache(num_blocks)
        self._setup_cuda_graphs()

    def _setup_cuda_graphs(self) -> None:
        """CUDA graphs for pure-decode steps: opt-in (cuda_graphs / PAGEDSERVE_CUDA_GRAPHS=1) until
        they have run on a GPU."""
        cfg, backend = self.config, self.backend
        if cfg.enforce_eager:
            log.info("CUDA graphs: off (--enforce-eager)")
        elif not cfg.cuda_graphs:
            log.info("CUDA graphs: off (experimental, not yet validated on a GPU; opt in with PAGEDSERVE_CUDA_GRAPHS=1)")
        elif not getattr(backend, "needs_block_tables", False):
            log.info("CUDA graphs: off (the %s attention backend is not graph-safe; use triton or flash-attn)",
                     backend.name)
        else:
            t0 = time.time()
            self.enable_cuda_graphs(cfg.max_num_seqs, cfg.max_model_len, capture=True)
            log.info("CUDA graphs: captured decode batch sizes %s in %.1fs (PAGEDSERVE_CUDA_GRAPHS=1, experimental)",
                     self.graphs.captured_sizes, time.time() - t0)

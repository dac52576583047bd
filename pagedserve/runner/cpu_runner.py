"""The model runner on the CPU: the one place that decides the CPU's compute path.

At start it sets the process up (torch threads, denormals flushed, native kernels compiling while
the weights load), then, once the model is loaded: packs the linear layers for the fastest GEMM
this CPU has (runner/cpu_packing.py), turns the model's fused native ops on where they run, gives
greedy batches a screened LM head where one pays (runner/greedy_head.py), sizes the KV pool from
--kv-cache-space and, after allocating it, tunes malloc (runner/cpu_malloc.py). The attention
backend (native paged kernel, or torch's SDPA) is chosen by the base class from the same config.
"""
from __future__ import annotations

import logging

import torch

from pagedserve.config import EngineConfig, default_num_threads
from pagedserve.runner.model_runner import ModelRunner

log = logging.getLogger("pagedserve")


class CpuModelRunner(ModelRunner):
    @staticmethod
    def prepare_process(config: EngineConfig) -> None:
        torch.set_num_threads(config.num_threads or default_num_threads())
        # dequantized / small-magnitude weights produce denormals that slow x86 FP units many-fold
        torch.set_flush_denormal(True)
        if config.cpu_kernels:  # compile any native kernel not cached yet while the tokenizer and weights load
            from pagedserve.kernels.cpu.build import build_all_in_background

            build_all_in_background()

    def __init__(self, model, config: EngineConfig, device: torch.device, kv_cache=None):
        super().__init__(model, config, device, kv_cache)
        if config.cpu_kernels:
            from pagedserve.kernels.cpu import fused_ops

            model.fused_cpu_ops = self.dtype in (torch.float32, torch.bfloat16) and fused_ops.load() is not None
        if config.pack_weights:
            self._pack_weights()

    def _pack_weights(self) -> None:
        from pagedserve.runner import greedy_head
        from pagedserve.runner.cpu_packing import pack_linears

        cfg = self.config
        n, path = pack_linears(self.model, batch_hint=min(cfg.max_num_seqs, 256), native=cfg.cpu_kernels,
                               cpu_gemm=cfg.cpu_gemm, silu_epilogue=cfg.silu_epilogue)
        log.info("prepacked %d linear layers for %s", n, path)
        if cfg.cpu_kernels:
            screen = greedy_head.attach(self, self.model.lm_head, cfg.greedy_screen)
            if screen:
                log.info("%s", screen)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        super().allocate_kv_cache(num_blocks)
        if self.config.malloc_tuning:
            from pagedserve.runner.cpu_malloc import keep_freed_memory

            log.info("malloc: %s", keep_freed_memory())  # after the KV pool: see runner/cpu_malloc.py

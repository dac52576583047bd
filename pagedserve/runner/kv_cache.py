"""The paged KV cache: one preallocated pool of blocks per layer, sized from a memory budget."""
from __future__ import annotations

import logging

import torch

from pagedserve.config import EngineConfig
from pagedserve.errors import ConfigError
from pagedserve.model.spec import ModelSpec

log = logging.getLogger("pagedserve")

GiB = 1 << 30


def bytes_per_block(spec: ModelSpec, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * spec.num_layers * block_size * spec.num_kv_heads * spec.head_dim * elem


def num_blocks_for_budget(config: EngineConfig, spec: ModelSpec, dtype: torch.dtype, budget_bytes: int) -> int:
    if config.num_gpu_blocks_override is not None:
        return config.num_gpu_blocks_override
    return int(budget_bytes // bytes_per_block(spec, config.block_size, dtype))


def check_fits(config: EngineConfig, num_blocks: int) -> None:
    need = -(-config.max_model_len // config.block_size)
    if num_blocks < need:
        raise ConfigError(
            f"the maximum model length is {config.max_model_len} tokens, but the KV cache holds only {num_blocks} "
            f"blocks ({num_blocks * config.block_size} tokens), fewer than one such sequence needs ({need} blocks); "
            "raise --kv-cache-space (or free memory) / "
            f"--gpu-memory-utilization / --num-gpu-blocks-override, or lower --max-model-len to "
            f"{num_blocks * config.block_size}"
        )


class KVCache:
    """Per layer a (key, value) pair of [num_blocks, block_size, kv_heads, head_dim] tensors.

    `layers[i]` gives flat [num_slots, kv_heads, head_dim] views of them (slot = block * block_size + offset),
    the form the attention backends index.
    """

    def __init__(self, spec: ModelSpec, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
                 populate: bool = True):
        """populate (CPU): fault the pool's pages in on a background thread (runner/cpu_memory.py)."""
        shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        self._populator = None
        if device.type == "cpu":
            from pagedserve.runner.cpu_memory import Populator, zeroed_cpu_tensor

            pairs = [(zeroed_cpu_tensor(shape, dtype), zeroed_cpu_tensor(shape, dtype)) for _ in range(spec.num_layers)]
            self.blocks = [(k, v) for (k, _), (v, _) in pairs]
            if populate:
                self._populator = Populator([r for (_, rk), (_, rv) in pairs for r in (rk, rv)])
                self._populator.start()
        else:
            self.blocks = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                           for _ in range(spec.num_layers)]
        flat = (num_blocks * block_size, spec.num_kv_heads, spec.head_dim)
        self.layers = [(k.view(flat), v.view(flat)) for k, v in self.blocks]
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype

    def wait_resident(self, timeout: float | None = None) -> bool:
        """Block until the CPU pool's pages are all faulted in (see runner/cpu_memory.py); True when
        they are. Benchmarks call it so that timed runs see the steady state, as a long-running
        server does."""
        return self._populator is None or self._populator.wait(timeout)

"""The paged KV cache: one preallocated pool of blocks per layer, sized from a memory budget."""
from __future__ import annotations

import logging

import numpy as np
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
            f"the KV cache holds {num_blocks} blocks ({num_blocks * config.block_size} tokens), fewer than one "
            f"sequence of max_model_len={config.max_model_len} needs ({need} blocks); raise --kv-cache-space / "
            f"--gpu-memory-utilization / --num-gpu-blocks-override, or lower --max-model-len to "
            f"{num_blocks * config.block_size}"
        )


def _zeros(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed pool. On the CPU the memory comes from calloc (through numpy), which maps fresh
    zero pages from the OS instead of writing gigabytes of zeros up front: start-up does not pay for
    a pool most of which a short run never touches."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    n = 1
    for d in shape:
        n *= d
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    raw = np.zeros(nbytes + 64, dtype=np.uint8)
    start = -raw.ctypes.data % 64  # cache-line aligned, like torch's own allocations: rows do not straddle lines
    return torch.from_numpy(raw[start:start + nbytes]).view(dtype).view(shape)


class KVCache:
    """Per layer a (key, value) pair of [num_blocks, block_size, kv_heads, head_dim] tensors.

    `layers[i]` gives flat [num_slots, kv_heads, head_dim] views of them (slot = block * block_size + offset),
    the form the attention backends index.
    """

    def __init__(self, spec: ModelSpec, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device):
        shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        self.blocks = [(_zeros(shape, dtype, device), _zeros(shape, dtype, device)) for _ in range(spec.num_layers)]
        flat = (num_blocks * block_size, spec.num_kv_heads, spec.head_dim)
        self.layers = [(k.view(flat), v.view(flat)) for k, v in self.blocks]
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype

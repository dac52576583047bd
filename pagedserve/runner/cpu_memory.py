"""Host memory for the CPU KV pool: zeroed lazily, backed by huge pages, made resident in the background.

A pool of several GiB written with zeros up front costs seconds of start-up (torch.zeros of 4 GiB
took 7.4 s here), yet leaving the pages untouched moves the cost into the first steps that write
K/V: every first touch of a page is a fault, about 4 ms per MiB under this machine's hypervisor
(a 2048-token prefill spent ~9 ms per layer in them). So the pool is its own anonymous mapping
(fresh pages, zero by contract, nothing written; not malloc, whose reuse of freed heap memory,
see cpu_malloc.py, would have calloc clear it byte by byte), Linux is asked for 2 MiB pages, and an
idle-priority thread makes the pages resident with MADV_POPULATE_WRITE, which faults them in
without changing a byte, so it can run while the engine already writes K/V. Lowest blocks first:
the block manager hands them out first. Everything is best effort: elsewhere the pool is simply
mapped memory, and where mmap is missing, calloc'd memory.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys
import threading

import numpy as np
import torch

log = logging.getLogger("pagedserve")

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23  # Linux 5.14+
_CHUNK = HUGE_PAGE  # one huge page per call: madvise holds the mm lock, which large allocations wait for


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def zeroed_cpu_tensor(shape, dtype: torch.dtype) -> tuple[torch.Tensor, tuple[int, int]]:
    """A zero tensor of `shape` whose memory starts on a 2 MiB boundary, and its (address, bytes)."""
    n = 1
    for d in shape:
        n *= d
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    # private (MAP_SHARED, mmap's default, would be shmem: no huge pages, shared with forked children);
    # unmapped when the last view of it goes (numpy keeps the mmap object as the array's base)
    try:
        raw = np.frombuffer(mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE), dtype=np.uint8)
    except (OSError, ValueError, AttributeError):
        raw = np.zeros(nbytes + HUGE_PAGE, dtype=np.uint8)
    start = -raw.ctypes.data % HUGE_PAGE  # rows never straddle cache lines; huge pages fit
    addr = raw.ctypes.data + start
    libc = _libc()
    if libc is not None and nbytes >= HUGE_PAGE:
        libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(nbytes - nbytes % HUGE_PAGE), _MADV_HUGEPAGE)
    return torch.from_numpy(raw[start:start + nbytes]).view(dtype).view(shape), (addr, nbytes)


class Populator(threading.Thread):
    """Faults the regions in, chunk by chunk, at idle priority; `wait()` blocks until it is done."""

    def __init__(self, regions: list[tuple[int, int]]):
        super().__init__(name="pagedserve-kv-populate", daemon=True)
        self.regions = regions
        self.done = threading.Event()

    def run(self) -> None:
        try:
            libc = _libc()
            if libc is None:
                return
            try:  # only idle CPU time: never slows a running step
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            except (AttributeError, OSError):
                pass
            longest = max((n for _, n in self.regions), default=0)
            for off in range(0, longest, _CHUNK):  # block order across all layers
                for addr, n in self.regions:
                    if off < n and libc.madvise(ctypes.c_void_p(addr + off), ctypes.c_size_t(min(_CHUNK, n - off)),
                                                _MADV_POPULATE_WRITE) != 0:
                        log.debug("MADV_POPULATE_WRITE unavailable (errno %d)", ctypes.get_errno())
                        return
        finally:
            self.done.set()

    def wait(self, timeout: float | None = None) -> bool:
        return self.done.wait(timeout)

"""Keep glibc's malloc from giving activation memory back to the kernel after every step.

A CPU step allocates activations of tens of MiB (a 2048-token chunk of the 1B model: 92 MiB of
gate/up output) and frees them a few microseconds later. glibc serves blocks above its mmap
threshold (at most 32 MiB) with a fresh mmap and returns them with munmap, and trims the top of
the heap once more than twice that is free. Either way the next step faults every page back in,
and the kernel zeroes each one. With mmap off for malloc and trimming pushed out of reach, freed
blocks stay in the heap and are reused (tcmalloc, which vLLM's CPU docs preload, gets the same by
keeping freed spans).

Measured on 2 cores (PAGEDSERVE_MALLOC_TUNING=1 vs 0, 3 alternated runs of W2's first requests):
small, 100 requests, medians 50.2 vs 52.4 s; medium, 48 requests, 97.5 vs 99.0 s; faults 2.5-5x
fewer. The settings are process-wide; the KV pool does not depend on them (it is its own mapping,
see cpu_memory.py, so it stays lazily zeroed however malloc reuses memory). A user who chose an allocator
(LD_PRELOAD of tcmalloc/jemalloc/mimalloc) or set glibc's MALLOC_* / GLIBC_TUNABLES malloc
knobs keeps their choice; PAGEDSERVE_MALLOC_TUNING=0 turns this off. Threads other than the
main one allocate from their own arenas, whose heaps glibc caps at 64 MiB: there blocks above
that still come from mmap.
"""
from __future__ import annotations

import ctypes
import logging
import os
import sys

log = logging.getLogger("pagedserve")

# mallopt parameter numbers from glibc's malloc.h
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_MAX = -4

_NEVER_TRIM = -1  # mallopt takes an int; glibc reads it as size_t, so -1 is SIZE_MAX: the freed top
#                  of the heap is the next step's activations, never worth returning
_TOP_PAD = 256 << 20  # grow the heap in big steps: fewer brk calls while it reaches its working size

_USER_KNOBS = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_THRESHOLD_")
_OTHER_ALLOCATORS = ("tcmalloc", "jemalloc", "mimalloc")

_applied: str | None = None


def _reason_to_leave_alone() -> str | None:
    preload = os.environ.get("LD_PRELOAD", "")
    for name in _OTHER_ALLOCATORS:
        if name in preload:
            return f"{name} is preloaded"
    for knob in _USER_KNOBS:
        if knob in os.environ:
            return f"{knob} is set"
    if "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES sets malloc tunables"
    if not sys.platform.startswith("linux"):
        return "not Linux"
    return None


def keep_freed_memory() -> str:
    """Apply the settings once per process; returns what was done, for the start-up log."""
    global _applied
    if _applied is not None:
        return _applied
    reason = _reason_to_leave_alone()
    if reason is None:
        try:
            libc = ctypes.CDLL(None)
            libc.gnu_get_libc_version  # glibc only: musl and others have no (or a different) mallopt
            ok = (libc.mallopt(_M_MMAP_MAX, 0) == 1
                  and libc.mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM) == 1
                  and libc.mallopt(_M_TOP_PAD, _TOP_PAD) == 1)
            reason = "freed activations stay in the heap" if ok else "mallopt refused the settings"
        except (OSError, AttributeError):
            reason = "not glibc"
    _applied = reason
    log.debug("malloc tuning: %s", reason)
    return reason

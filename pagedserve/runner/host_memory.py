"""How much host memory this process may still take: the CPU KV pool is sized within it.

The pool is mapped lazily (runner/cpu_memory.py), so a budget larger than the memory left would
not fail at start but much later, when load first touches the last blocks: the OOM killer in the
middle of serving. Sizing the pool against what is available at start turns that into a smaller
pool, or into a clear error at start when not even one max_model_len sequence fits.
"""
from __future__ import annotations

import os

GiB = 1 << 30
# left free beside the pool: activations, tokenizer, HTTP buffers, allocator slack
RESERVE_FRACTION = 0.10
RESERVE_MIN_BYTES = GiB // 2


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_headroom() -> int | None:
    """memory.max - memory.current of this process's cgroup (v2), when a limit is set."""
    try:
        with open("/proc/self/cgroup") as f:
            rel = next((ln.split(":", 2)[2].strip() for ln in f if ln.startswith("0::")), None)
        if rel is None:
            return None
        base = os.path.join("/sys/fs/cgroup", rel.lstrip("/"))
        with open(os.path.join(base, "memory.max")) as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open(os.path.join(base, "memory.current")) as f:
            return int(limit) - int(f.read().strip())
    except (OSError, ValueError, StopIteration):
        return None


def available_bytes() -> int | None:
    """The smaller of the kernel's MemAvailable and the cgroup's headroom (None: unknown)."""
    vals = [v for v in (_meminfo_available(), _cgroup_headroom()) if v is not None]
    return min(vals) if vals else None


def kv_budget_bytes(requested: int, available: int | None) -> tuple[int, str | None]:
    """The CPU KV pool's budget: `requested` (--kv-cache-space), capped to what is available minus
    a reserve. Returns (budget, a log line when the cap applied)."""
    if available is None:
        return requested, None
    usable = max(0, available - max(RESERVE_MIN_BYTES, int(available * RESERVE_FRACTION)))
    if requested <= usable:
        return requested, None
    return usable, (f"KV cache: --kv-cache-space asks for {requested / GiB:.2f} GiB but only {available / GiB:.2f} "
                    f"GiB of memory is available; using {usable / GiB:.2f} GiB (a pool larger than memory would "
                    "fail under load, not at start)")

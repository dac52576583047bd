"""Builds the small C++ CPU libraries on first use and caches them.

The libraries have no torch headers, so each builds in about a second with the system C++
compiler. A build is cached per source, flags and CPU model (the flags say -march=native) under
$PAGEDSERVE_CACHE (default ~/.cache/pagedserve)/kernels, and several processes starting at once
build it only once.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

# no -ffinite-math: the kernels rely on -inf and NaN where they say so
BASE_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno"]


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [l for l in f if l.startswith(("model name", "flags"))][:2]
        return "".join(lines)
    except OSError:
        return os.uname().machine


def build(src: Path, flags: list[str], lib_name: str) -> Path:
    """The path of the shared library built from `src` with `flags` (built now if not cached)."""
    key = hashlib.sha256(src.read_bytes() + " ".join(flags).encode() + _cpu_id().encode()).hexdigest()[:16]
    root = Path(os.environ.get("PAGEDSERVE_CACHE", Path.home() / ".cache" / "pagedserve")) / "kernels" / key
    lib = root / lib_name
    if lib.exists():
        return lib
    root.mkdir(parents=True, exist_ok=True)
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        raise RuntimeError("no C++ compiler found (install g++)")
    with open(root / ".lock", "w") as lk:
        fcntl.flock(lk, fcntl.LOCK_EX)
        if not lib.exists():
            tmp = root / f"tmp-{os.getpid()}.so"
            subprocess.run([cxx, *flags, str(src), "-o", str(tmp)], check=True, capture_output=True, text=True)
            tmp.rename(lib)
    return lib

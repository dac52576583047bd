"""Builds the small C++ CPU libraries on first use, caches them, and loads them.

The libraries have no torch headers, so each builds in about a second with the system C++
compiler. A build is cached per source (with the headers beside it), flags and CPU model (the
flags say -march=native) under $PAGEDSERVE_CACHE (default ~/.cache/pagedserve)/kernels, and
several processes starting at once build it only once.
"""
from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import threading
from pathlib import Path

log = logging.getLogger("pagedserve")

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
    # the headers beside the source are part of it (the attention kernel is split into several)
    sources = b"".join(p.read_bytes() for p in [src, *sorted(src.parent.glob("*.h"))])
    key = hashlib.sha256(sources + " ".join(flags).encode() + _cpu_id().encode()).hexdigest()[:16]
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


class NativeLibrary:
    """A C++ library of this package, built on first use and loaded through ctypes.

    `load()` returns the library, or None when it cannot be built (no compiler) or the user
    turned the native code off with PAGEDSERVE_CPU_KERNELS=0; the reason is logged once and kept
    in `failure_reason`. `signatures` maps each C function to (restype, argtypes).
    """

    def __init__(self, src: Path, flags: list[str], lib_name: str, signatures: dict, what: str, instead: str):
        self.src, self.flags, self.lib_name, self.signatures = src, flags, lib_name, signatures
        self.what, self.instead = what, instead
        self.lib = None
        self.failure_reason: str | None = None
        self._lock = threading.Lock()

    def load(self):
        if self.lib is not None or self.failure_reason is not None:
            return self.lib
        with self._lock:
            if self.lib is None and self.failure_reason is None:
                if os.environ.get("PAGEDSERVE_CPU_KERNELS", "1") == "0":
                    self.failure_reason = "disabled by PAGEDSERVE_CPU_KERNELS=0"
                    return None
                try:
                    lib = ctypes.CDLL(str(build(self.src, self.flags, self.lib_name)))
                    for name, (restype, argtypes) in self.signatures.items():
                        fn = getattr(lib, name)
                        fn.restype, fn.argtypes = restype, argtypes
                    self.lib = lib
                except Exception as e:
                    err = (getattr(e, "stderr", "") or str(e)).strip()
                    self.failure_reason = f"{type(e).__name__}: {err.splitlines()[-1] if err else ''}"
                    log.warning("%s unavailable (%s); %s", self.what, self.failure_reason, self.instead)
        return self.lib

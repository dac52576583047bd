"""Builds the small C++ CPU libraries on first use, caches them, and loads them.

The libraries have no torch headers, so each builds in 2-5 s with the system C++ compiler. A
build is cached per source (with the headers beside it), flags and CPU model (the flags say
-march=native) under $PAGEDSERVE_CACHE (default ~/.cache/pagedserve)/kernels, and several
processes starting at once build it only once.

A cold start compiles three libraries, ~12 s of one Zen 3 core in all; `build_all_in_background`
starts them side by side, in threads (the compiler runs as a subprocess, so they do not wait on
the GIL), while the engine imports transformers and loads the weights. `python -m
pagedserve.kernels.cpu.build` builds them ahead, at install time (scripts/setup.sh runs it).
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

from pagedserve.config import cache_dir, env_flag

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


def cached_path(src: Path, flags: list[str], lib_name: str) -> Path:
    """Where the library built from `src` with `flags` on this CPU is cached (it may not be yet)."""
    # the headers beside the source are part of it (the attention kernel is split into several)
    sources = b"".join(p.read_bytes() for p in [src, *sorted(src.parent.glob("*.h"))])
    key = hashlib.sha256(sources + " ".join(flags).encode() + _cpu_id().encode()).hexdigest()[:16]
    return Path(cache_dir()) / "kernels" / key / lib_name


def build(src: Path, flags: list[str], lib_name: str) -> Path:
    """The path of the shared library built from `src` with `flags` (built now if not cached)."""
    lib = cached_path(src, flags, lib_name)
    if lib.exists():
        return lib
    root = lib.parent
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


def _kernels_enabled() -> bool:
    return env_flag("cpu_kernels", True)


_LIBRARIES: list["NativeLibrary"] = []  # every library declared (one per module that declares it)


def _declare_cpu_libraries() -> list["NativeLibrary"]:
    """The CPU libraries of the engine (importing their modules declares them)."""
    import pagedserve.kernels.cpu.paged_attention  # noqa: F401
    import pagedserve.kernels.cpu.fused_ops  # noqa: F401
    import pagedserve.kernels.cpu.gemm  # noqa: F401
    import pagedserve.quant.cpu_kernels  # noqa: F401

    return list(_LIBRARIES)


def build_all_in_background() -> list[threading.Thread]:
    """Starts building every CPU library that is not cached yet, side by side; returns the threads."""
    return [t for lib in _declare_cpu_libraries() if (t := lib.build_in_background()) is not None]


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
        _LIBRARIES.append(self)

    def build_in_background(self) -> threading.Thread | None:
        """Starts building the library in a daemon thread unless it is cached, loaded or turned off;
        returns the thread, or None. `load()` then waits for that build on the cache's file lock
        instead of starting its own. A failure here is ignored: `load()` tries again and says why."""
        if self.lib is not None or self.failure_reason is not None or not _kernels_enabled():
            return None
        try:
            if cached_path(self.src, self.flags, self.lib_name).exists():
                return None
        except OSError:  # an unreadable source: load() reports it
            return None

        def run():
            try:
                build(self.src, self.flags, self.lib_name)
            except Exception:  # noqa: BLE001 -- load() rebuilds and says why
                pass

        t = threading.Thread(target=run, name=f"build {self.lib_name}", daemon=True)
        t.start()
        return t

    def load(self):
        if self.lib is not None or self.failure_reason is not None:
            return self.lib
        with self._lock:
            if self.lib is None and self.failure_reason is None:
                if not _kernels_enabled():
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


def build_all_now() -> None:
    """Builds every CPU library now, side by side, and prints what it found (install time)."""
    import time

    t0 = time.time()
    for thread in build_all_in_background():
        thread.join()
    for lib in _declare_cpu_libraries():
        lib.load()
        print(f"{lib.lib_name}: {'ready' if lib.lib is not None else 'unavailable: ' + str(lib.failure_reason)}")
    print(f"native CPU libraries checked in {time.time() - t0:.1f}s")


if __name__ == "__main__":
    # through the package's module, not this __main__ copy: the libraries register there
    from pagedserve.kernels.cpu import build as native_build

    native_build.build_all_now()

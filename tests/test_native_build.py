"""The native CPU libraries: built side by side ahead of use (engine start, install time), cached."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

LIBS = ["libpagedserve_cpu.so", "libpagedserve_ops.so", "libpagedserve_gemm.so", "libpagedserve_quant.so"]


def _python(args: list[str], cache, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PAGEDSERVE_CACHE": str(cache), **env})


def _run(code: str, cache, **env) -> subprocess.CompletedProcess:
    return _python(["-c", textwrap.dedent(code)], cache, **env)


def test_background_build_fills_an_empty_cache_then_has_nothing_to_do(tmp_path):
    out = _run("""
        from pagedserve.kernels.cpu import build as native_build
        threads = native_build.build_all_in_background()
        print("started", sorted(t.name for t in threads))
        for t in threads:
            t.join()
        print("again", len(native_build.build_all_in_background()))
    """, tmp_path)
    assert out.returncode == 0, out.stderr
    assert f"started {sorted('build ' + lib for lib in LIBS)}" in out.stdout
    assert "again 0" in out.stdout
    assert sorted(p.name for p in tmp_path.glob("kernels/*/*.so")) == sorted(LIBS)
    assert not list(tmp_path.glob("kernels/*/tmp-*"))

    # the install-time entry point finds them cached and loads each one
    pre = _python(["-m", "pagedserve.kernels.cpu.build"], tmp_path)
    assert pre.returncode == 0, pre.stderr
    for lib in LIBS:
        assert f"{lib}: ready" in pre.stdout


def test_turned_off_kernels_are_not_built(tmp_path):
    out = _run("""
        from pagedserve.kernels.cpu import build as native_build
        print("started", len(native_build.build_all_in_background()))
    """, tmp_path, PAGEDSERVE_CPU_KERNELS="0")
    assert out.returncode == 0, out.stderr
    assert "started 0" in out.stdout
    assert not list(tmp_path.glob("kernels/*/*.so"))


def test_every_library_compiles_for_the_other_instruction_set_family(tmp_path):
    """CI hosts differ (AVX-512 on some, AVX2 only on others) and the kernels are built with
    -march=native, so a guard missing around AVX-512 code breaks only the hosts without it. Compile
    each library for the family this host is not (code generation only, nothing is run)."""
    import shutil

    import pytest

    from pagedserve.kernels.cpu import build as native_build

    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("no g++ on this machine")
    with open("/proc/cpuinfo") as f:
        has_avx512 = " avx512f" in f.read()
    other = "haswell" if has_avx512 else "sapphirerapids"
    for lib in native_build._declare_cpu_libraries():
        flags = [f if f != "-march=native" else f"-march={other}" for f in lib.flags]
        out = subprocess.run([cxx, *flags, "-O1", str(lib.src), "-o", str(tmp_path / lib.lib_name)],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, f"{lib.lib_name} for -march={other}:\n{out.stderr[-3000:]}"

"""The native CPU libraries: built side by side ahead of use (engine start, install time), cached."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

LIBS = ["libpagedserve_cpu.so", "libpagedserve_ops.so", "libpagedserve_gemm.so"]


def _python(args: list[str], cache, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PAGEDSERVE_CACHE": str(cache), **env})


def _run(code: str, cache, **env) -> subprocess.CompletedProcess:
    return _python(["-c", textwrap.dedent(code)], cache, **env)


def test_background_build_fills_an_empty_cache_then_has_nothing_to_do(tmp_path):
    out = _run("""
        from pagedserve.model import native_build
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
    pre = _python(["-m", "pagedserve.model.native_build"], tmp_path)
    assert pre.returncode == 0, pre.stderr
    for lib in LIBS:
        assert f"{lib}: ready" in pre.stdout


def test_turned_off_kernels_are_not_built(tmp_path):
    out = _run("""
        from pagedserve.model import native_build
        print("started", len(native_build.build_all_in_background()))
    """, tmp_path, PAGEDSERVE_CPU_KERNELS="0")
    assert out.returncode == 0, out.stderr
    assert "started 0" in out.stdout
    assert not list(tmp_path.glob("kernels/*/*.so"))

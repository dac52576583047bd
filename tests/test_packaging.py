"""The native kernels compile from sources shipped in the package: a wheel must carry every .cpp
and every header they include, or an installed (not editable) pagedserve falls back to the slow
torch paths. Checked against pyproject's package-data patterns, without building a wheel."""
import fnmatch
import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "pagedserve"


def _shipped(path: Path, patterns: list[str]) -> bool:
    rel = path.relative_to(PACKAGE).as_posix()
    return any(fnmatch.fnmatch(rel, p) for p in patterns)


def test_native_sources_and_their_local_includes_are_package_data():
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["pagedserve"]
    sources = sorted(PACKAGE.rglob("*.cpp"))
    assert sources, "no native sources found"
    seen = set()
    todo = list(sources)
    while todo:
        src = todo.pop()
        if src in seen:
            continue
        seen.add(src)
        assert src.exists(), f"{src.relative_to(ROOT)} is included but missing"
        assert _shipped(src, patterns), f"{src.relative_to(ROOT)} is not in pyproject's package-data: a wheel would lack it"
        for name in re.findall(r'^\s*#\s*include\s+"([^"]+)"', src.read_text(), re.M):
            todo.append((src.parent / name).resolve())
    assert any(p.suffix == ".h" for p in seen)  # the walk followed includes


def test_web_page_files_are_package_data():
    """The page at / is served from the installed package: every static file must ship."""
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["pagedserve"]
    static = [p for p in (PACKAGE / "server" / "web" / "static").rglob("*") if p.is_file()]
    assert any(p.name == "index.html" for p in static) and any(p.name == "uPlot.iife.min.js" for p in static)
    missing = [str(p.relative_to(ROOT)) for p in static if not _shipped(p, patterns)]
    assert not missing, f"not in pyproject's package-data (a wheel would lack them): {missing}"

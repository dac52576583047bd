#!/usr/bin/env bash
# Sets up (if needed) and runs the whole test suite on the CPU. With no arguments it then runs the
# engine, prefix-caching and robustness tests a second time with the native CPU kernels off
# (PAGEDSERVE_CPU_KERNELS=0): the torch path a machine without a C++ compiler takes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/install_ops_tools.sh  # promtool for the deploy/ checks
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
if [ $# -eq 0 ]; then
  PAGEDSERVE_CPU_KERNELS=0 .venv/bin/python -m pytest -q -p no:cacheprovider \
    tests/test_engine_greedy.py tests/test_prefix_caching.py tests/test_engine_robustness.py
fi

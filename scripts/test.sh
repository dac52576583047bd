#!/usr/bin/env bash
# Sets up (if needed) and runs the whole test suite on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/install_ops_tools.sh  # promtool for the deploy/ checks
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"

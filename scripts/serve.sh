#!/usr/bin/env bash
# Sets up (if needed) and starts the OpenAI-compatible server. With no arguments it serves the
# embedded SmolLM2-135M-Instruct on http://127.0.0.1:8000 — no GPU, account or download of weights.
set -euo pipefail
cd "$(dirname "$0")/.."
PAGEDSERVE_EXTRAS=${PAGEDSERVE_EXTRAS:-bench,client} bash scripts/setup.sh
exec .venv/bin/pagedserve serve "$@"

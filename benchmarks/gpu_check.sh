#!/usr/bin/env bash
# The one prepared GPU check (issue 7). On the device machine:  bash benchmarks/gpu_check.sh
# Here, on a CPU:                                               bash benchmarks/gpu_check.sh --cpu-smoke
# Writes JSON + logs under $OUT (the device tool's output folder), else benchmarks/results/gpu_check/.
# Order (cheapest, most informative first): Triton kernels on the GPU (pytest), (a) correctness,
# (b) throughput, (c) S1 online; gpu_check.py stops starting steps when the time budget runs out.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=${OUT:-benchmarks/results/gpu_check}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1
START=$(date +%s)
BUDGET=${GPU_CHECK_BUDGET_S:-780}
if [[ " $* " != *" --cpu-smoke "* && " $* " != *" --dry-run "* ]]; then
  nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
  # the kernels compiled for the GPU, against the naive reference (no interpreter)
  TRITON_INTERPRET=0 timeout 150 "$PY" -m pytest tests/test_triton_kernels.py -q -x > "$OUT/triton_kernels_pytest.txt" 2>&1
  echo "triton kernels on GPU: rc=$?" | tee -a "$OUT/summary.txt"
fi
LEFT=$(( BUDGET - ($(date +%s) - START) ))
"$PY" benchmarks/gpu_check.py --budget-s "$LEFT" "$@" 2>&1 | tee "$OUT/gpu_check.log"
rc=${PIPESTATUS[0]}
echo "gpu_check.py rc=$rc" | tee -a "$OUT/summary.txt"
exit $rc

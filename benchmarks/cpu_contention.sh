#!/usr/bin/env bash
# W1 (first 64 requests, small model, fp32) alone and with a busy-loop process holding one of the two cores.
cd "$(dirname "$0")/.."
run() { echo "== $1"; shift; env "$@" timeout 200 .venv/bin/pagedserve bench throughput --workload W1 --num-prompts 64 2>&1 | grep -E "^pagedserve" || echo "timed out (>200 s)"; }
run "alone, 2 threads" X=1
( while :; do :; done ) & HOG=$!
run "with a 1-core hog, 2 threads (default)" X=1
run "with a 1-core hog, 2 threads, OMP_WAIT_POLICY=PASSIVE" OMP_WAIT_POLICY=PASSIVE
echo "== with a 1-core hog, --num-threads 1"; timeout 200 .venv/bin/pagedserve bench throughput --workload W1 --num-prompts 64 --num-threads 1 2>&1 | grep -E "^pagedserve" || echo "timed out"
kill $HOG

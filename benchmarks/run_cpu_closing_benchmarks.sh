#!/usr/bin/env bash
# The CPU figures quoted in closing notes: W1/W2 vs transformers, W3 with prefix caching on/off,
# S1 online against our own server. Run on a quiet machine; results land in benchmarks/results/.
# transformers on full W2 (padded static batches up to 1024 + 256 tokens) runs for over 20 min on
# 2 cores, so its W2 ratio is measured on the first 64 requests (two static batches).
set -uo pipefail
cd "$(dirname "$0")/.."
PS=.venv/bin/pagedserve
R=benchmarks/results
mkdir -p $R
{ uptime; lscpu | grep -E "Model name|^CPU\(s\)"; } > $R/cpu_machine.txt
step() { echo "== $*"; "$@" 2>&1 | grep -v -E "^INFO|Loading weights"; }
[ -n "${SKIP_W1:-}" ] || step $PS bench throughput --model small --workload W1 --baseline hf --output-json $R/cpu_small_W1.json
step $PS bench throughput --model small --workload W2 --output-json $R/cpu_small_W2.json
step $PS bench throughput --model small --workload W2 --num-prompts 64 --baseline hf --output-json $R/cpu_small_W2_first64.json
step $PS bench throughput --model small --workload W3 --output-json $R/cpu_small_W3_cache_on.json
step $PS bench throughput --model small --workload W3 --no-enable-prefix-caching --output-json $R/cpu_small_W3_cache_off.json
step $PS bench throughput --model small --workload W3 --output-json $R/cpu_small_W3_cache_on_2.json
# S1 online: our server on the small model, 64 concurrent clients, 256 requests (WORKLOADS.md)
.venv/bin/python benchmarks/make_s1.py /tmp/s1.jsonl
MODEL=$(.venv/bin/python -c "from pagedserve.bench.workloads import bench_model_dir; print(bench_model_dir('small'))")
$PS serve --model "$MODEL" --port 8123 --disable-log-requests > /tmp/s1_server.log 2>&1 &
SERVER=$!
for _ in $(seq 120); do curl -sf http://127.0.0.1:8123/health >/dev/null && break; sleep 1; done
step $PS bench serve --base-url http://127.0.0.1:8123 --dataset /tmp/s1.jsonl --num-prompts 256 --max-concurrency 64 \
  --goodput ttft:5000 tpot:200 --result-json $R/cpu_small_S1.json --plot $R/cpu_small_S1.png --disable-tqdm
kill -TERM $SERVER; wait $SERVER

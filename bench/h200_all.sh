#!/usr/bin/env bash
# Issue 7's missing H200 tables in two device calls of <= 9 min each, on nvidia-h200-x2:
#   OUT=/some/dir PYTHONPATH=. bash bench/h200_all.sh 1   # persist_blocking (1B, 1.7B, 3B) | recovery_serve (8B)
#   OUT=/some/dir PYTHONPATH=. bash bench/h200_all.sh 2   # e2e_faults (1B)               | e2e_serve (8B)
#   BENCH_EXTRA=--tiny OUT=/tmp/x bash bench/h200_all.sh 1   # CPU dry run (smoke sizes, *_tiny.json)
#   LANE_A="first_step ; restart_latency --size 1b" LANE_B="e2e_serve" bash bench/h200_all.sh x  # any scenarios:
#     a lane runs its ';'-separated scenarios in turn, each within what is left of LANE_S
# Each call runs two independent scenarios at once, one per GPU (CUDA_VISIBLE_DEVICES=0 and 1;
# every scenario sees its GPU as cuda:0).  Each lane has its own time limit (LANE_S) and writes
# its JSON under $OUT after every method, so a lane that runs over keeps what it measured and
# the other lane is unaffected.  Each lane appends its scenarios' output to $OUT/logs/laneN.log.  Then the report is rendered (on the device) for its verdict lines.
# Results that shared the host with the other lane say so (GPU_ANCHOR_BENCH_CONCURRENT).
# The device tool brings back at most 8 files: $OUT gets the result JSONs and one log per
# scenario; the rendered report and plots stay on the device (render them here from the JSONs
# with `python -m bench report`).
#
# Time plan (H200 figures from earlier runs: 1B step 0.1 s, torch.save of 1B state 14.6 s, 3B
# in-memory first save 19 s, 8B engine warm restart 1.6-5.5 s, 14B safetensors written in 34 s):
#   call 1, GPU0: persist_blocking 1B (all methods), 1.7B and 3B without torch.save (~6-8 min)
#           GPU1: recovery_serve Qwen3-14B and 32B, warm + prewarm (the 8B table has every mode)
#   call 2, GPU0: e2e_faults 1B, 600 steps, checkpoint every 100, 2 %/s, 4 methods with torch.save
#           GPU1: e2e_serve Qwen3-8B, 1000 requests, 5 %/s, 3 methods (at 400 requests Replay
#                 finished before the first fault)
# The paper's 2 000 steps at 0.1 %/s do not fit: ~200 s per method for the steps alone, and at
# 0.1 %/s a run that short expects 0.2 faults.
set -u
PART=${1:-}
OUT=${OUT:-bench/results}
X=${BENCH_EXTRA:-}
LANE_S=${LANE_S:-470}        # per lane; + <= 20 s to stop + ~20 s report: a call stays under 9 min
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT/logs"
TMP=$(mktemp -d)
t0=$(date +%s)

case "$PART" in
  1) A="persist_blocking --models llama3.2-1b,qwen3-1.7b,llama3.2-3b --repeat 1
        --skip qwen3-1.7b:torch_save,llama3.2-3b:torch_save --timeout 200"
     B="recovery_serve --models qwen3-14b,qwen3-32b --repeat 1 --modes warm,prewarm" ;;
  2) A="e2e_faults --steps 600 --ckpt-every 100 --rates 0.02 --methods gpu_anchor,inmemory,checkfreq,torch_save"
     B="e2e_serve --requests 1000 --rates 0.05" ;;
  *) [ -n "${LANE_A:-}" ] && [ -n "${LANE_B:-}" ] || { echo "usage: OUT=DIR PYTHONPATH=. bash bench/h200_all.sh 1|2 (or LANE_A=... LANE_B=... and any other word)" >&2; exit 2; }
     A=$LANE_A; B=$LANE_B ;;
esac
A=${LANE_A:-$A}; B=${LANE_B:-$B}   # a budget-cut call names its own scenarios
A=$(echo $A); B=$(echo $B)   # one line each (they are recorded in the results); ';' separates scenarios

echo "== machine (call $PART)"
nvidia-smi --query-gpu=index,name,driver_version,memory.used,memory.total --format=csv,noheader 2>/dev/null \
  || echo "no nvidia-smi (CPU dry run)"
df -h /dev/shm /tmp | tail -n +2; free -g | head -2
python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

lane() {  # lane GPU OTHER "SCENARIO ARGS ; SCENARIO ARGS ...": scenarios in turn on one GPU, within LANE_S
  local gpu=$1 other=$2 cmds=$3 end=$(( $(date +%s) + LANE_S )) cmd left log
  while [ -n "$cmds" ]; do
    cmd=${cmds%%;*}; [ "$cmd" = "$cmds" ] && cmds="" || cmds=${cmds#*;}
    set -- $cmd; [ $# -eq 0 ] && continue
    left=$(( end - $(date +%s) ))
    [ "$left" -le 5 ] && { echo "== $1 on GPU $gpu: not started, lane time used up"; continue; }
    log="$OUT/logs/lane$gpu.log"   # one log per lane (the device tool returns at most 8 files)
    echo "===== python -m bench $cmd" >> "$log"
    case " $cmd " in *" --out "*) ;; *) set -- "$@" --out "$OUT" ;; esac   # a scenario may name its own file
    CUDA_VISIBLE_DEVICES=$gpu GPU_ANCHOR_BENCH_CONCURRENT="python -m bench $other" \
      timeout -k 20 "$left" python -m bench "$@" $X > "$log.part" 2>&1
    echo "== $1 on GPU $gpu: rc=$? after $(( $(date +%s) - t0 )) s"
    grep -v "Warning\|return func\|warnings.warn\|self.rotary" "$log.part" | tail -n 25
    cat "$log.part" >> "$log"; rm -f "$log.part"
  done
}

lane 0 "$B" "$A" > "$TMP/lane0.txt" 2>&1 &
p0=$!
lane 1 "$A" "$B" > "$TMP/lane1.txt" 2>&1 &
p1=$!
wait $p0; wait $p1
cat "$TMP/lane0.txt" "$TMP/lane1.txt"

echo "== report after $(( $(date +%s) - t0 )) s"
# the report renders every result under $OUT (tiny ones too on a dry run)
if [ -n "$X" ]; then
  python -c "import sys; from bench import report; open(sys.argv[2] + '/benchmarks.md', 'w').write(
report.render_all(sys.argv[1], include_tiny=True, img_dir=sys.argv[2] + '/img'))" "$OUT" "$TMP"
else
  python -m bench report --results "$OUT" --out "$TMP/benchmarks.md"
fi
grep -n "MISSED\|met\b\|FAILED" "$TMP/benchmarks.md" | head -30
ls -la "$OUT" "$OUT/logs" 2>/dev/null
rm -rf "$TMP"
echo "== done after $(( $(date +%s) - t0 )) s"

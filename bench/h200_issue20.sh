#!/usr/bin/env bash
# Issue 20's re-measurement on ONE H200 in <= 9 minutes (one device call):
#   OUT=/some/dir PYTHONPATH=. bash bench/h200_issue20.sh
#   BENCH_EXTRA=--tiny OUT=/tmp/x PYTHONPATH=. bash bench/h200_issue20.sh     # CPU dry run (*_tiny.json)
# Then, on this machine: copy $OUT/recovery_*_n3.json into bench/results/ (new files, next to the stored
# n = 1 tables of the modes not re-measured here), `python -m bench report`, and move README's recovery
# sentences to the n = 3 results (`python -m bench figures` shows every quoted number against its JSON).
#
# What it measures (every cell n = 3 under bench/protocol.py; each step has its own time limit and
# writes its JSON after every method, so a step that runs over keeps what it measured):
#   1. the DCP baseline's stager probe on cuda:0: does torch's cached DefaultStager survive a save
#      here (pytorch#183413 in torch 2.11), or the kept-open workaround?  (~15 s; printed)
#   2. recovery_train, Llama3.2-1B, kill -> next step: gpu-anchor, torch.save (the strongest baseline
#      in the issue's re-measurement) and the in-memory checkpoint, in the standby and prewarm modes
#      (the fork server's runtime.Standby, the same one for every method), 3 kills each; plus
#      `gpu-anchor run` WITHOUT recovery flags (issue 20 item 8: a standby per rank by default on a
#      GPU job), 3 kills; fault-free step time per method.  (<= 300 s)
#   3. recovery_serve, Qwen3-8B shape, 64 streams, kill -> every stream's next token: gpu-anchor,
#      KV-memory (now: asynchronous pinned mirror on its own stream, live blocks restored) and Replay,
#      pre-warmed standby for every method, 3 kills each; fault-free tokens/s per method.  (<= 190 s)
# Not in this call (no time left): the warm (fork) and cold modes, e2e_faults / e2e_serve with 3
# seeds, serve_throughput's fair generate_batch timing (the serving engineer's next serve_throughput
# run measures it: `python bench/serve_throughput.py --out $OUT`), persist_blocking's DCP row.
set -u
OUT=${OUT:-bench/results}
X=${BENCH_EXTRA:-}
TRAIN_S=${TRAIN_S:-300}
SERVE_S=${SERVE_S:-190}
export NCCL_NVLS_ENABLE=0 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
LOG="$OUT/issue20.log"
t0=$(date +%s)

TRAIN="recovery_train --models llama3.2-1b --modes standby,prewarm --methods gpu_anchor,torch_save,inmemory
       --repeat 3 --supervised default --tag n3"
SERVE="recovery_serve --models qwen3-8b --modes prewarm --methods gpu_anchor,kv_memory,replay --repeat 3
       --steady-steps 20 --tag n3"
TRAIN=$(echo $TRAIN); SERVE=$(echo $SERVE)

echo "== plan (results and log under $OUT)"
echo "  1. DCP stager probe on cuda:0"
echo "  2. python -m bench $TRAIN   (limit ${TRAIN_S} s)"
echo "  3. python -m bench $SERVE   (limit ${SERVE_S} s)"
echo "== machine"
nvidia-smi --query-gpu=index,name,driver_version,memory.used,memory.total --format=csv,noheader 2>/dev/null \
  || echo "no nvidia-smi (CPU dry run)"
python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

step() {  # step LIMIT_S SCENARIO ARGS...: one scenario within its own limit, output to the log
  local limit=$1 from; shift
  echo "===== python -m bench $* (limit ${limit} s)" | tee -a "$LOG"
  from=$(( $(wc -l < "$LOG") + 1 ))
  timeout -k 20 "$limit" python -m bench "$@" --out "$OUT" $X >> "$LOG" 2>&1
  echo "== $1: rc=$? after $(( $(date +%s) - t0 )) s"
  tail -n +"$from" "$LOG" | grep -E "total [0-9.]+s|FAILED|Error" | tail -n 40
}

echo "===== DCP stager probe" | tee -a "$LOG"
timeout 120 python - >> "$LOG" 2>&1 <<'EOF'
import torch
from bench.baselines.dcp_async import stager_support
dev = "cuda:0" if torch.cuda.is_available() else "cpu"
stager, note, kind = stager_support(dev)
print(f"DCP stager on {dev}, torch {torch.__version__}: {kind}: {note}")
EOF
grep "DCP stager on" "$LOG" | tail -1

step "$TRAIN_S" $TRAIN
step "$SERVE_S" $SERVE

echo "== report (for its verdict lines) after $(( $(date +%s) - t0 )) s"
TMP=$(mktemp -d)
python -c "import sys; from bench import report; open(sys.argv[2] + '/benchmarks.md', 'w').write(
report.render_all(sys.argv[1], include_tiny=True, img_dir=sys.argv[2] + '/img'))" "$OUT" "$TMP" \
  && grep -n "Strongest baseline\|against the strongest\|MISSED\|met\b\|FAILED" "$TMP/benchmarks.md" | head -30
rm -rf "$TMP"
ls -la "$OUT"
echo "== done after $(( $(date +%s) - t0 )) s"

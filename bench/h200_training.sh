#!/usr/bin/env bash
# The training tables of issue 7 on one H200, in one command (~6 min):
#   OUT=/some/dir PYTHONPATH=. bash bench/h200_training.sh [--all-shapes]
# Writes persist_blocking.json and recovery_train.json (partial results survive a time limit)
# plus benchmarks.md and img/*.png rendered from them, all under $OUT.
set -u
OUT=${OUT:-bench/results}
X=${BENCH_EXTRA:-}   # BENCH_EXTRA=--tiny: a dry run of this script on CPU
MODELS=llama3.2-1b
[ "${1:-}" = "--all-shapes" ] && MODELS=llama3.2-1b,qwen3-1.7b,llama3.2-3b
mkdir -p "$OUT"
echo "== machine"; nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
df -h /dev/shm /tmp | tail -n +2; free -g | head -2; python -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
t0=$(date +%s)
echo "== persist_blocking ($MODELS)"
timeout 170 python -m bench persist_blocking --models "$MODELS" --repeat 2 --out "$OUT" $X 2>&1 | grep -v "Warning\|return func"
echo "== recovery_train ($MODELS) after $(( $(date +%s) - t0 )) s"
timeout $(( 560 - ( $(date +%s) - t0 ) )) python -m bench recovery_train --models "$MODELS" --repeat 1 --supervised --out "$OUT" $X 2>&1 \
  | grep -v "Warning\|return func"
echo "== report after $(( $(date +%s) - t0 )) s"
python -m bench report --results "$OUT" --out "$OUT/benchmarks.md"
ls -la "$OUT" "$OUT/img" 2>/dev/null

#!/usr/bin/env bash
# The inference recovery table of issue 7 on one H200 (~5 min; Qwen3-8B shape):
#   OUT=/some/dir PYTHONPATH=. bash bench/h200_serving.sh
# and, as a separate call (~8 min), the end-to-end runs under faults:
#   OUT=/some/dir PYTHONPATH=. bash bench/h200_serving.sh --e2e
set -u
OUT=${OUT:-bench/results}
X=${BENCH_EXTRA:-}   # BENCH_EXTRA=--tiny: a dry run of this script on CPU
mkdir -p "$OUT"
t0=$(date +%s)
if [ "${1:-}" = "--e2e" ]; then
  echo "== e2e_faults (training, 1B, 5 %/s)"
  timeout 300 python -m bench e2e_faults --steps 400 --rates 0.05 --methods torch_save,checkfreq,inmemory,gpu_anchor \
    --out "$OUT" $X 2>&1 | grep -v "Warning\|return func"
  echo "== e2e_serve (Qwen3-8B, 1 %/s) after $(( $(date +%s) - t0 )) s"
  timeout $(( 570 - ( $(date +%s) - t0 ) )) python -m bench e2e_serve --requests 600 --rates 0.01 --out "$OUT" $X 2>&1 \
    | grep -v "Warning\|return func"
else
  echo "== recovery_serve (Qwen3-8B)"
  timeout 560 python -m bench recovery_serve --models qwen3-8b --repeat 1 --out "$OUT" $X 2>&1 | grep -v "Warning\|return func"
fi
echo "== report after $(( $(date +%s) - t0 )) s"
python -m bench report --results "$OUT" --out "$OUT/benchmarks.md"
ls -la "$OUT"

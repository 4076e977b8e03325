#!/usr/bin/env bash
# What the session of 2026-12-03 could not measure (issue 20, items 6 and 7), on ONE H200 in one
# device call of <= 8 minutes:
#   OUT=/some/dir PYTHONPATH=. bash bench/h200_issue20_next.sh
#   BENCH_EXTRA=--tiny OUT=/tmp/x PYTHONPATH=. bash bench/h200_issue20_next.sh    # CPU dry run (no kernels)
# It writes up to 5 files:
#   1. decode_attention_sweep_cap.json: the split kernel with its cap of 16 splits a token against
#      a cap of 4 (128 x 320, 64 x 1024, 128 x 1024: the shapes where 60621e2's kernel, capless and
#      with partials sized by the table's splits, was 7-9 % faster), twice, alternating.
#   2. train_overhead_short.json: 1B AdamW at batch 4 x 1024 with the fused kernel that computes
#      before it publishes a block's tag (target <= 3 % against AdamW(fused=True)).
#   3. serve_throughput_sweep.json: the engine at 32 / 64 / 128 streams with split-major partials.
# Run the GPU tests first, each in a call of its own: tests/test_serve_attention.py and
# tests/test_train_fused_adam.py (-m gpu), then the 1B kill campaign with the reordered kernel:
#   OUT=$OUT PYTHONPATH=. python -m pytest -q -s -m gpu tests/test_train_gpu.py -k llama_1b   # <= 9 min
set -u
OUT=${OUT:-bench/results}
X=${BENCH_EXTRA:-}
export NCCL_NVLS_ENABLE=0 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
t0=$(date +%s)
say() { echo "== $* after $(( $(date +%s) - t0 )) s"; }
nvidia-smi --query-gpu=index,name,driver_version,memory.used,memory.total --format=csv,noheader 2>/dev/null
if [ -z "$X" ]; then
  timeout -k 10 90 python -m bench decode_attention --shapes 128x320,64x1024,128x1024 --out /tmp/cap \
    --sweep 256x32p2048w4s2,256x32p2048w4s2c4,256x32p2048w4s2,256x32p2048w4s2c4 > /tmp/cap.log 2>&1
  say "cap sweep rc=$?"; grep " x " /tmp/cap.log | tail -3
  cp /tmp/cap/decode_attention_sweep.json "$OUT/decode_attention_sweep_cap.json"
fi
timeout -k 10 200 python -m bench train_overhead --rounds 3 --batch 4 --seq 1024 $X --out /tmp/to_short \
  > /tmp/to_short.log 2>&1
say "train_overhead 4x1024 rc=$?"; grep -i "fastest plain" /tmp/to_short.log | head -2
cp /tmp/to_short/train_overhead*.json "$OUT/train_overhead_short.json"
timeout -k 10 200 python -m bench serve_throughput --async-scheduling on --max-tokens 128 --rounds 3 --skip-hf \
  --skip-recovery --skip-startup --eager-rounds 0 --streams-list 32,64,128 $X \
  --out "$OUT/serve_throughput_sweep.json" > /tmp/st_sweep.log 2>&1
say "serve_throughput 32/64/128 rc=$?"
ls -la "$OUT"
say done

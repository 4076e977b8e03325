#!/usr/bin/env bash
# The next device call for issue 20 (item 7), on ONE H200, <= 6 minutes:
#   OUT=/some/dir PYTHONPATH=. bash bench/h200_issue20_next.sh
#   BENCH_EXTRA=--tiny OUT=/tmp/x PYTHONPATH=. bash bench/h200_issue20_next.sh    # CPU dry run (no kernels)
# First the GPU tests of the attention kernel that applies the split cap only to tables wider
# than MAX_SPLITS splits (52a5fb3; run this way on 2026-12-03: 21 passed, with test_serve_async.py
# and test_serve_sampling.py added; the figures are decode_attention_cap_flag*.json and
# serve_throughput_cap_flag_sweep_*.json):
#   pip install -q --no-index --find-links .whl --target /tmp/site openai     # carry .whl (README)
#   PYTHONPATH=.:/tmp/site python -m pytest -q -m gpu tests/test_serve_attention.py \
#     tests/test_serve_gpu.py tests/test_serve_fused.py tests/test_serve_deterministic.py
# Then this script writes 3 files:
#   1. decode_attention.json: this tree's kernel at the shapes of decode_attention_capped_*.json
#      (tables as wide as the context: the kernel without the cap);
#   2. decode_attention_wide.json: the same with 32 768-key tables (the kernel with the cap);
#   3. serve_throughput_sweep.json: the engine at 32 / 64 / 128 streams (compare
#      serve_throughput_split_major_sweep.json, b4ddc2e's kernel).
set -u
OUT=${OUT:-bench/results}
X=${BENCH_EXTRA:-}
export NCCL_NVLS_ENABLE=0 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
t0=$(date +%s)
say() { echo "== $* after $(( $(date +%s) - t0 )) s"; }
nvidia-smi --query-gpu=index,name,driver_version,memory.used,memory.total --format=csv,noheader 2>/dev/null
SH=1x4096,16x1024,64x320,128x320,64x1024,128x1024
if [ -z "$X" ]; then
  timeout -k 10 120 python -m bench decode_attention --shapes $SH --out /tmp/da > /tmp/da.log 2>&1
  say "decode_attention rc=$?"; grep " x " /tmp/da.log | tail -6
  cp /tmp/da/decode_attention.json "$OUT/decode_attention.json"
  timeout -k 10 120 python -m bench decode_attention --shapes $SH --table-keys 32768 --out /tmp/daw > /tmp/daw.log 2>&1
  say "decode_attention wide rc=$?"; grep " x " /tmp/daw.log | tail -6
  cp /tmp/daw/decode_attention.json "$OUT/decode_attention_wide.json"
fi
timeout -k 10 200 python -m bench serve_throughput --async-scheduling on --max-tokens 128 --rounds 3 --skip-hf \
  --skip-recovery --skip-startup --eager-rounds 0 --streams-list 32,64,128 $X \
  --out "$OUT/serve_throughput_sweep.json" > /tmp/st_sweep.log 2>&1
say "serve_throughput 32/64/128 rc=$?"
ls -la "$OUT"
say done

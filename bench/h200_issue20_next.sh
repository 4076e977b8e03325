#!/usr/bin/env bash
# Attention with fixed keys per split (issue 20, item 7) under an engine's wide block tables, on
# ONE H200 in one device call of <= 7 minutes:
#   OUT=/some/dir PYTHONPATH=. bash bench/h200_issue20_next.sh
#   BENCH_EXTRA=--tiny OUT=/tmp/x PYTHONPATH=. bash bench/h200_issue20_next.sh    # CPU dry run (no kernels)
# The kernel's grid and partials are sized by the block table's width (an engine's
# --max-model-len): with a wide table, short contexts get programs that have no split to take.
# The runs of 2026-12-02 all had tables as wide as the longest context.  It writes 8 files:
#   1-2. decode_attention{,_wide}.json: 1 x 4096 to 128 x 1024 tokens x context, tables as wide as
#        the context, then 32 768 keys wide.
#   3.   decode_attention_sweep_wide.json: PROGRAMS 1024 / 2048 / 4096 with 32 768-key tables.
#   4-7. serve_throughput_{tight,wide}_{1,2}.json: 64 streams, max_model_len 392 then 32 768,
#        alternating, twice.
#   8.   serve_throughput_long.json: 1 and 4 streams of 3 968-token prompts.
# Run the serving GPU tests in a call of their own first (docs/serving.md, "Tests").
set -u
OUT=${OUT:-bench/results}
X=${BENCH_EXTRA:-}
export NCCL_NVLS_ENABLE=0 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
LOG=/tmp/issue20_next.log
: > "$LOG"
t0=$(date +%s)
SHAPES=1x4096,4x4096,8x2048,16x1024,32x320,64x320,128x320,64x1024,128x1024
WIDE=32768
nvidia-smi --query-gpu=index,name,driver_version,memory.used,memory.total --format=csv,noheader 2>/dev/null
say() { echo "== $* after $(( $(date +%s) - t0 )) s" | tee -a "$LOG"; }
if [ -z "$X" ]; then
  timeout -k 10 60 python -m bench decode_attention --shapes $SHAPES --out "$OUT" >> "$LOG" 2>&1
  say "tight tables rc=$?"
  timeout -k 10 60 python -m bench decode_attention --shapes $SHAPES --table-keys $WIDE --out /tmp/wide >> "$LOG" 2>&1
  say "wide tables rc=$?"; cp /tmp/wide/decode_attention.json "$OUT/decode_attention_wide.json"
  timeout -k 10 90 python -m bench decode_attention --shapes $SHAPES --table-keys $WIDE --out /tmp/wide \
    --sweep 256x32p2048w4s2,256x32p1024w4s2,256x32p4096w4s2 >> "$LOG" 2>&1
  say "wide sweep rc=$?"; cp /tmp/wide/decode_attention_sweep.json "$OUT/decode_attention_sweep_wide.json"
fi
COMMON="--async-scheduling on --max-tokens 128 --rounds 3 --skip-hf --skip-recovery --skip-startup --eager-rounds 0 $X"
serve() {   # serve NAME ARGS...: one serve_throughput run into $OUT/serve_throughput_NAME.json
  local name=$1; shift
  timeout -k 10 100 python -m bench serve_throughput $COMMON "$@" --out "$OUT/serve_throughput_$name.json" \
    > /tmp/st_$name.log 2>&1
  say "serve_throughput $name rc=$?"
  python - "$OUT/serve_throughput_$name.json" <<'PY' 2>&1 | tee -a "$LOG"
import json, sys
t = json.load(open(sys.argv[1]))["throughput"]["sweep"]
for n, row in t.items():
    a = row["anchored"]
    spec = a.get("roofline_fraction", {}).get("spec_4.8TB/s")   # none on the CPU
    print(n, "streams: %.3f ms/step" % a["decode_step_ms"]["median"],
          "%.1f %% of 4.8 TB/s" % (100 * spec["median"]) if spec else "")
PY
}
for i in 1 2; do
  serve tight_$i --streams-list 64
  serve wide_$i --streams-list 64 --max-model-len $WIDE
done
serve long --requests 4 --streams-list 1,4 --prompt-len 3968
grep -v "^\[bench\]" "$LOG" | grep "x " | tail -30
ls -la "$OUT"
say done

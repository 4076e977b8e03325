#!/usr/bin/env bash
# Whether attention should run with 2 splits instead of 4 (issue 20, item 7), on ONE H200 in one
# device call of <= 8 minutes:
#   OUT=/some/dir PYTHONPATH=. bash bench/h200_issue20_next.sh
#   BENCH_EXTRA=--tiny OUT=/tmp/x PYTHONPATH=. bash bench/h200_issue20_next.sh    # CPU dry run (no attention sweep)
# 2 splits took 0.86-0.90x the time at 64-128 tokens x 320-1024 context (decode_attention_sweep.json)
# and 5.61 ms a decode step at 64 streams (serve_throughput_splits2.json); what is not measured is
# the small batch with a long context, where 2 splits halve a token's programs.  It writes 6 files:
#   1. decode_attention_sweep.json: 4 vs 2 splits from 1 x 4096 to 128 x 1024 tokens x context.  (<= 60 s)
#   2. serve_throughput_s{2,4}_{sweep,64}.json: the decode sweep at 32 / 64 / 128 streams with each
#      split count, then 64 streams again with each (alternating).  (<= 4 x 100 s)
# Then: copy the JSONs into bench/results/, `python -m bench report`; if 2 splits wins or ties at
# every shape, set attention.SPLITS = 2, run the serving GPU tests, and move README's figures.
set -u
OUT=${OUT:-bench/results}
X=${BENCH_EXTRA:-}
export NCCL_NVLS_ENABLE=0 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
LOG="$OUT/issue20_next.log"
t0=$(date +%s)
nvidia-smi --query-gpu=index,name,driver_version,memory.used,memory.total --format=csv,noheader 2>/dev/null
[ -z "$X" ] && timeout -k 10 60 python -m bench decode_attention --sweep 4x32w4s2,2x32w4s2 \
  --shapes 1x4096,4x4096,8x2048,16x1024,32x320,64x320,128x320,64x1024,128x1024 --out "$OUT" >> "$LOG" 2>&1
echo "== attention sweep rc=$? after $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
for run in "2 sweep 32,64,128" "4 sweep 32,64,128" "2 64 64" "4 64 64"; do
  set -- $run
  timeout -k 10 100 python -m bench serve_throughput --attention-splits "$1" --streams-list "$3" --async-scheduling on \
    --max-tokens 128 --rounds 3 --skip-hf --skip-recovery --skip-startup --eager-rounds 0 $X \
    --out "$OUT/serve_throughput_s$1_$2.json" > /tmp/st.log 2>&1
  echo "== serve_throughput splits $1 streams $3: rc=$? after $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
  python - "$OUT/serve_throughput_s$1_$2.json" <<'PY' 2>&1 | tee -a "$LOG"
import json, sys
t = json.load(open(sys.argv[1]))["throughput"]["sweep"]
for n, row in t.items():
    a = row["anchored"]
    spec = a.get("roofline_fraction", {}).get("spec_4.8TB/s")   # none on the CPU
    print(n, "streams: %.3f ms/step" % a["decode_step_ms"]["median"],
          "%.1f %% of 4.8 TB/s" % (100 * spec["median"]) if spec else "")
PY
done
ls -la "$OUT"
echo "== done after $(( $(date +%s) - t0 )) s"

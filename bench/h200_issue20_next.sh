#!/usr/bin/env bash
# Attention with fixed keys per split (issue 20, item 7) against the kernel before it (4 splits per
# token), on ONE H200 in one device call of <= 9 minutes:
#   OLD=/path/to/the/tree/before OUT=/some/dir PYTHONPATH=. bash bench/h200_issue20_next.sh
#   BENCH_EXTRA=--tiny OUT=/tmp/x PYTHONPATH=. bash bench/h200_issue20_next.sh    # CPU dry run (no kernels)
# OLD (optional): a checkout of the tree before the change; its runs come first in each pair.
# It writes 8 files:
#   1-2. decode_attention{_old,}.json: each kernel from 1 x 4096 to 128 x 1024 tokens x context.
#   3.   decode_attention_sweep.json: keys per split 128 / 256 / 512 and programs 1024 / 4096.
#   4-5. serve_throughput{_old,}_64.json: 64 streams, old then new.
#   6-7. serve_throughput{_old,}_long.json: 1 and 4 streams of 3 968-token prompts, old then new.
#   8.   serve_throughput_sweep.json: the new kernel's decode sweep at 32 / 64 / 128 streams.
set -u
OUT=${OUT:-bench/results}
X=${BENCH_EXTRA:-}
OLD=${OLD:-}
HERE=$PWD
export NCCL_NVLS_ENABLE=0 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
LOG=/tmp/issue20_next.log
: > "$LOG"
t0=$(date +%s)
SHAPES=1x4096,4x4096,8x2048,16x1024,32x320,64x320,128x320,64x1024,128x1024
nvidia-smi --query-gpu=index,name,driver_version,memory.used,memory.total --format=csv,noheader 2>/dev/null
say() { echo "== $* after $(( $(date +%s) - t0 )) s" | tee -a "$LOG"; }
if [ -z "$X" ]; then
  if [ -n "$OLD" ]; then
    (cd "$OLD" && PYTHONPATH=. timeout -k 10 60 python -m bench decode_attention --shapes $SHAPES --out /tmp/old >> "$LOG" 2>&1)
    say "old kernel rc=$?"; cp /tmp/old/decode_attention.json "$OUT/decode_attention_old.json"
  fi
  timeout -k 10 60 python -m bench decode_attention --shapes $SHAPES --out "$OUT" >> "$LOG" 2>&1
  say "new kernel rc=$?"
  timeout -k 10 90 python -m bench decode_attention --shapes $SHAPES --out "$OUT" \
    --sweep 256x32p4096w4s2,256x32p1024w4s2,128x32p4096w4s2,512x32p4096w4s2 >> "$LOG" 2>&1
  say "sweep rc=$?"
fi
COMMON="--async-scheduling on --max-tokens 128 --rounds 3 --skip-hf --skip-recovery --skip-startup --eager-rounds 0 $X"
serve() {   # serve TREE NAME ARGS...: one serve_throughput run from TREE into $OUT/serve_throughput_NAME.json
  local tree=$1 name=$2; shift 2
  (cd "$tree" && PYTHONPATH=. timeout -k 10 110 python -m bench serve_throughput $COMMON "$@" \
     --out "$OUT/serve_throughput_$name.json" > /tmp/st_$name.log 2>&1)
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
LONG="--requests 4 --streams-list 1,4 --prompt-len 3968"
[ -n "$OLD" ] && serve "$OLD" old_64 --streams-list 64
serve "$HERE" 64 --streams-list 64
[ -n "$OLD" ] && serve "$OLD" old_long $LONG
serve "$HERE" long $LONG
serve "$HERE" sweep --streams-list 32,64,128
ls -la "$OUT"
say done

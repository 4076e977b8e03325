#!/usr/bin/env bash
# Issue 8 GPU work on nvidia-h200-x2 (at most 8 minutes, about 6 expected): the checkpoint GPU
# tests (incl. the 2-GPU serving-engine migration), the migration-downtime bench (Qwen3-8B
# shape, cuda:0 -> cuda:1 vs stop-and-restart), the cold-start bench (serving engine restart
# with/without the warm pool) and training restart latency (1B) with/without the warm pool.
# Each part has its own timeout and writes into $OUT as it goes.  The device tool brings back
# at most 8 files, so $OUT gets only rc.txt, logs.txt (every part's log, appended) and the
# four result JSONs.
#   usage: OUT=/some/dir bash bench/h200_migration.sh    (TINY=1: CPU dry run at toy sizes)
set -u
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export GPU_ANCHOR_BENCH_OUT="$OUT"
mkdir -p "$OUT"
LOGS="$OUT/logs.txt"
TMP=$(mktemp -d)
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > "$LOGS" 2>&1

part() {  # part NAME TIMEOUT CMD...: run, record rc, append the log
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" > "$TMP/$name.log" 2>&1
  echo "$name rc=$?" >> "$OUT/rc.txt"
  { echo "===== $name"; tail -n 200 "$TMP/$name.log"; } >> "$LOGS"
}

part checkpoint_gpu 100 python -m pytest -q -m gpu tests/test_checkpoint_gpu.py -p no:cacheprovider
part migration 150 python -m bench migration ${TINY:+--tiny} --out "$OUT"
part coldstart 100 python -m bench coldstart ${TINY:+--tiny} --kills 2 --out "$OUT"
RL="--size 1b --device cuda --kills 2 --kill-every 5 --modes warm"
[ -n "${TINY:-}" ] && RL="--tiny --modes warm"
part restart_latency_fork 60 python -m bench restart_latency $RL --out "$OUT/restart_latency_fork.json"
part restart_latency_warm_pool 60 \
  env GPU_ANCHOR_WARM_POOL=1 python -m bench restart_latency $RL --out "$OUT/restart_latency_warm_pool.json"
cat "$OUT/rc.txt"
grep -A3 "short test summary\|passed\|failed" "$TMP/checkpoint_gpu.log" | tail -4
rm -rf "$TMP"

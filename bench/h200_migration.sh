#!/usr/bin/env bash
# Issue 8 GPU work on nvidia-h200-x2 (at most 8 minutes, about 6 expected): the checkpoint GPU
# tests (incl. the 2-GPU serving-engine migration), the migration-downtime bench (Qwen3-8B
# shape, cuda:0 -> cuda:1 vs stop-and-restart), the cold-start bench (serving engine restart
# with/without the warm pool) and training restart latency (1B) with/without the warm pool.
# Each part has its own timeout and writes into $OUT as it goes.
#   usage: OUT=/some/dir bash bench/h200_migration.sh    (TINY=1: CPU dry run at toy sizes)
set -u
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export GPU_ANCHOR_BENCH_OUT="$OUT"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > "$OUT/gpus.txt" 2>&1
timeout 100 python -m pytest -q -m gpu tests/test_checkpoint_gpu.py -p no:cacheprovider \
    --junitxml="$OUT/checkpoint_gpu.xml" > "$OUT/checkpoint_gpu.log" 2>&1
echo "checkpoint_gpu rc=$?" >> "$OUT/rc.txt"
timeout 150 python -m bench migration ${TINY:+--tiny} --out "$OUT" > "$OUT/migration.log" 2>&1
echo "migration rc=$?" >> "$OUT/rc.txt"
timeout 100 python -m bench coldstart ${TINY:+--tiny} --kills 2 --out "$OUT" > "$OUT/coldstart.log" 2>&1
echo "coldstart rc=$?" >> "$OUT/rc.txt"
RL="--size 1b --device cuda --kills 2 --kill-every 5 --modes warm"
[ -n "${TINY:-}" ] && RL="--tiny --modes warm"
timeout 60 python -m bench restart_latency $RL --out "$OUT/restart_latency_fork.json" \
    > "$OUT/restart_fork.log" 2>&1
echo "restart_latency fork rc=$?" >> "$OUT/rc.txt"
GPU_ANCHOR_WARM_POOL=1 timeout 60 python -m bench restart_latency $RL --out "$OUT/restart_latency_warm_pool.json" \
    > "$OUT/restart_warm_pool.log" 2>&1
echo "restart_latency warm_pool rc=$?" >> "$OUT/rc.txt"
cat "$OUT/rc.txt"
tail -3 "$OUT/checkpoint_gpu.log"

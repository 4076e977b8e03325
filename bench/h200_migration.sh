#!/usr/bin/env bash
# Issue 8 GPU work on nvidia-h200-x2 (about 7 minutes): the checkpoint GPU tests (incl. the
# 2-GPU serving-engine migration), the migration-downtime bench (Qwen3-8B shape, cuda:0 ->
# cuda:1 vs stop-and-restart) and the cold-start bench (engine restart with/without the warm
# pool).  Each part has its own timeout and writes into $OUT as it goes.
#   usage: OUT=/some/dir bash bench/h200_migration.sh    (TINY=1: CPU dry run at toy sizes)
set -u
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export GPU_ANCHOR_BENCH_OUT="$OUT"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > "$OUT/gpus.txt" 2>&1
timeout 130 python -m pytest -q -m gpu tests/test_checkpoint_gpu.py -p no:cacheprovider \
    --junitxml="$OUT/checkpoint_gpu.xml" > "$OUT/checkpoint_gpu.log" 2>&1
echo "checkpoint_gpu rc=$?" >> "$OUT/rc.txt"
timeout 190 python -m bench migration ${TINY:+--tiny} --out "$OUT" > "$OUT/migration.log" 2>&1
echo "migration rc=$?" >> "$OUT/rc.txt"
timeout 140 python -m bench coldstart ${TINY:+--tiny} --out "$OUT" > "$OUT/coldstart.log" 2>&1
echo "coldstart rc=$?" >> "$OUT/rc.txt"
cat "$OUT/rc.txt"
tail -3 "$OUT/checkpoint_gpu.log"

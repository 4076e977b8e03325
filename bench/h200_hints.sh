#!/usr/bin/env bash
# The fused Adam kernel's L2 eviction hints (27bcf0e) on one H200, one device call (about 9 min):
# the kernel's pass with and without them, then the 1B AdamW step with every gradient byte lent,
# at 8 x 2 048 (three runs with the hints, two without, alternating; it does not fit an H100's
# 80 GB) and at 4 x 1 024 (three with, one without; one H100 ran three of each on 2026-12-06).
# Without the hints: `bench train_overhead --no-l2-hints`, adam_kernel's `nohints` variant.
#   OUT=/some/dir PYTHONPATH=. bash bench/h200_hints.sh
#   BENCH_EXTRA=--tiny OUT=/tmp/x PYTHONPATH=. bash bench/h200_hints.sh    # CPU dry run (toy sizes)
# Writes $OUT/hints.tgz (re-made after each run, so a call cut short keeps what finished), holding
# adam_kernel_graph.json and {long,short}_{h,n}N.json / .log, named as they are to be stored.
set -u
R=/tmp/hints TGZ=hints.tgz
source "$(dirname "$0")/device_call.sh"
G=--graph; [ -n "$X" ] && G=     # a dry run on a CPU: no CUDA graphs
timeout -k 5 60 python -m bench adam_kernel $G --reps 20 $X --out "$R" > "$R/adam_kernel.log" 2>&1; say kernel rc=$?
pack
L="--rounds 3 --lend-grad-bytes=2471628800 --no-grads-in-place"; S="--rounds 5 --batch 4 --seq 1024 --lend-grad-bytes=2471628800 --no-grads-in-place"
H="python -m bench train_overhead"; N="python -m bench train_overhead --no-l2-hints"
# one run of each kind first, so that a call cut short still has a pair at each size;
# RUNS="short_h1 short_n1 ..." runs those instead, in that order (a call with little device time left)
RUNS=${RUNS:-long_h1 long_n1 short_h1 short_n1 long_h2 short_h2 long_n2 long_h3 short_h3}
for r in $RUNS; do
  case $r in
    long_h*) one "$r" 100 $H $L ;; long_n*) one "$r" 100 $N $L ;;
    short_h*) one "$r" 60 $H $S ;; short_n*) one "$r" 60 $N $S ;;
    *) echo "unknown run $r" ;;
  esac
done

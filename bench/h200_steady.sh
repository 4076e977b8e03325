#!/usr/bin/env bash
# The anchored step's spread at 4 x 1 024 with gradient lending, once the setup's garbage is
# collected before the timed windows (bench train_overhead does so since 2026-12-04), with the
# caching allocator's driver calls by window.  One H200, one device call (<= 8 min):
#   OUT=/some/dir PYTHONPATH=. bash bench/h200_steady.sh
#   BENCH_EXTRA=--tiny OUT=/tmp/x PYTHONPATH=. bash bench/h200_steady.sh     # CPU dry run (toy sizes)
# Writes, named as they are to be stored in bench/results:
#   train_overhead_short_lendall_steady_{1,2,3}.json   every gradient byte lendable, 5 windows a mode
#   train_overhead_short_lendall_steady_long.json      the same, 10 windows a mode
#   train_overhead_short_steady_nolend.json            no lending, 5 windows a mode
#   train_overhead_lendall_steady_{1,2}.json           8 x 2 048, every byte lendable, 3 windows a mode
#   train_overhead_short_lendall_hostfwd.json          the forward's, backward's and step()'s own host
#                                                      time per mode, and the anchored forward's and
#                                                      step()'s Python by own time (cProfile)
# Stored from its first run (2026-12-04, 8d1737f's lending): the *_steady_* files.  The host-forward
# run was added after it (b35f484); it ran alone at ef4de65 (stored under the name above, forward
# only then).  Name a later run's files anew.
set -u
OUT=${OUT:-bench/results}
X=${BENCH_EXTRA:-}
export TOKENIZERS_PARALLELISM=false PYTORCH_NVML_BASED_CUDA_CHECK=1
mkdir -p "$OUT" /tmp/steady
t0=$(date +%s)
say() { echo "== $* after $(( $(date +%s) - t0 )) s"; }
one() {   # name, then train_overhead's arguments
  local name=$1; shift
  timeout -k 5 150 python -m bench train_overhead "$@" $X --out /tmp/steady > "/tmp/steady/$name.log" 2>&1
  say "$name rc=$?"
  mv /tmp/steady/train_overhead*.json "$OUT/$name.json" 2>/dev/null
  tail -c 2000 "/tmp/steady/$name.log" > "$OUT/$name.log"
}
ALL="--lend-grad-bytes=2471628800 --no-grads-in-place"
for i in 1 2 3; do one train_overhead_short_lendall_steady_$i --rounds 5 --batch 4 --seq 1024 $ALL; done
one train_overhead_short_steady_nolend --rounds 5 --batch 4 --seq 1024 --lend-grad-bytes 0 --no-grads-in-place
if [ -z "${STEADY_SHORT_ONLY:-}" ]; then     # STEADY_SHORT_ONLY=1: 4 x 1 024 only (a shorter call)
  for i in 1 2; do one train_overhead_lendall_steady_$i --rounds 3 $ALL; done
  one train_overhead_short_lendall_steady_long --rounds 10 --batch 4 --seq 1024 $ALL
fi
one train_overhead_short_lendall_hostfwd --rounds 2 --batch 4 --seq 1024 $ALL --host-forward 10

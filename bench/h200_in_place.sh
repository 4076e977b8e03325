#!/usr/bin/env bash
# Linear weight gradients written in place (StepProtocolConfig.grads_in_place) on one GPU, one
# device call (about 9 min): the tests of grads_in_place (bit for bit against torch; the GPU's too), then the
# 1B AdamW step at 4 x 1 024 with every gradient byte lent, with the gradients written in place
# (i) and copied home (n), alternating, or with no setting named (d: the optimizer's defaults, on
# a GPU both on); `long_*` runs are the 8 x 2 048 step (H200 only: it does not fit an H100's
# 80 GB beside its three plain twins); `prof_*` adds `--profile 3`; `camp`: the
# 1B Llama's ten kills and `chunk`: the MLP killed at every chunk, both with the defaults (on a GPU:
# gradients lent and written in place).
#   OUT=/some/dir PYTHONPATH=. bash bench/h200_in_place.sh
#   RUNS="long_i1 long_n1" OUT=/some/dir PYTHONPATH=. bash bench/h200_in_place.sh
#   BENCH_EXTRA=--tiny TESTS=0 OUT=/tmp/x PYTHONPATH=. bash bench/h200_in_place.sh   # CPU dry run
# Writes $OUT/in_place.tgz (re-made after each run, so a call cut short keeps what finished),
# holding gpu_tests.txt and {short,long,prof}_{i,n}N.json / .log, named as they are to be stored.
set -u
R=/tmp/in_place TGZ=in_place.tgz
source "$(dirname "$0")/device_call.sh"
if [ "${TESTS:-1}" != 0 ]; then
  # the whole module (its CPU tests too: this machine's torch), and Trainer's with and without LoRA.
  # The tests that fork workers running backward go first, in a process of their own: on a machine
  # with a GPU any backward starts autograd's device threads, after which a forked child's
  # backward refuses to run
  F="ddp_on_one_rank or kills"
  T="python -m pytest -q -p no:cacheprovider tests/test_train_grads_in_place.py"
  { timeout -k 5 "${TESTS_S:-120}" $T -k "$F"
    timeout -k 5 "${TESTS_S:-120}" $T tests/test_train_hf.py -k "(in_place or inplace or grads_in_place) and not ($F)"
  } 2>&1 | grep -v Warning | grep -E "passed|failed|FAILED|Error|error" > "$R/gpu_tests.txt"; say "tests"; cat "$R/gpu_tests.txt"; pack
fi
LEND=--lend-grad-bytes=2471628800
L="--rounds 3 $LEND"; S="--rounds 5 --batch 4 --seq 1024 $LEND"
B="python -m bench train_overhead"
RUNS=${RUNS:-short_i1 short_n1 short_i2 short_n2 camp short_i3 short_n3}
C="python -m gpu_anchor.testing.gpu_campaign"    # the defaults: lending and in place on a GPU
for r in $RUNS; do
  case $r in
    short_i*) one "$r" 65 $B $S --grads-in-place ;; short_n*) one "$r" 65 $B $S --no-grads-in-place ;;
    short_d*) one "$r" 65 $B --rounds 5 --batch 4 --seq 1024 ;;    # the defaults: no setting named
    long_i*) one "$r" 100 $B $L --grads-in-place ;; long_n*) one "$r" 100 $B $L --no-grads-in-place ;;
    long_d*) one "$r" 100 $B --rounds 3 ;;
    prof_i*) one "$r" 90 $B $S --grads-in-place --profile 3 ;; prof_n*) one "$r" 90 $B $S --no-grads-in-place --profile 3 ;;
    camp) timeout -k 5 80 $C $X --out "$R/camp.json" > "$R/camp.log" 2>&1; say "camp rc=$?"
          grep -o '"ok": [a-z]*' "$R/camp.json"; pack ;;
    chunk) timeout -k 5 80 $C --every-chunk --out "$R/chunk.json" > "$R/chunk.log" 2>&1; say "chunk rc=$?"
           grep -o '"ok": [a-z]*' "$R/chunk.json"; pack ;;
    *) echo "unknown run $r" ;;
  esac
done

#!/usr/bin/env bash
# Gradient lending as shipped, one H200, one device call (<= 8 min):
#   OUT=/some/dir PYTHONPATH=. bash bench/h200_lending.sh
#   BENCH_EXTRA=--tiny OUT=/tmp/x PYTHONPATH=. bash bench/h200_lending.sh    # CPU dry run (toy sizes, no GPU tests)
# Writes, named as they are to be stored in bench/results:
#   train_overhead_short_lendall_shipped_{1,2,3}.json and train_overhead_lendall_shipped_{1,2,3}.json:
#     every gradient byte lendable at 4 x 1 024 and 8 x 2 048, alternating (targets: step <= 3 % and
#     <= 1 % against plain AdamW(fused=True), memory <= 2 % against set_to_none=True; the files also
#     carry the garbage collector's time per mode and the ratio of mean steps);
#   train_peak_lend2357m.json: where the 4 x 1 024 peak is and what is alive there, plain and lending;
#   train_gpu_faults_lend.json: the 1B Llama's 10-kill campaign, lending;
#   pytest_lending.log, logs.tgz.
# Stored from its runs: 3421dc8's lending as *_s44final*.json, 8d1737f's as *_shipped*.json
# (train_peak_lend2357m_shipped.json, train_gpu_faults_lend_shipped.json); name a later run's files anew.
set -u
OUT=${OUT:-bench/results}
X=${BENCH_EXTRA:-}
export NCCL_NVLS_ENABLE=0 TOKENIZERS_PARALLELISM=false PYTORCH_NVML_BASED_CUDA_CHECK=1
mkdir -p "$OUT" /tmp/lending
t0=$(date +%s)
say() { echo "== $* after $(( $(date +%s) - t0 )) s"; }
if [ -z "$X" ]; then
  timeout -k 5 150 python -m pytest -q -m gpu tests/test_train_grad_lending.py > "$OUT/pytest_lending.log" 2>&1
  say "lending GPU tests rc=$? ($(tail -1 "$OUT/pytest_lending.log"))"
fi
for i in 1 2 3; do
  for shape in short long; do
    args=$([ $shape = short ] && echo "--batch 4 --seq 1024" || echo "")
    name=$([ $shape = short ] && echo train_overhead_short_lendall_shipped_$i || echo train_overhead_lendall_shipped_$i)
    timeout -k 5 150 python -m bench train_overhead --rounds 3 $args --lend-grad-bytes 2471628800 --no-grads-in-place $X \
      --out /tmp/lending > "/tmp/lending/$name.log" 2>&1
    say "$name rc=$?"
    mv /tmp/lending/train_overhead*.json "$OUT/$name.json" 2>/dev/null
  done
done
timeout -k 5 120 python -m bench train_peak --batch 4 --seq 1024 --lend-grad-bytes 2471628800 --no-grads-in-place $X --out "$OUT" \
  > /tmp/lending/train_peak.log 2>&1
say "train_peak rc=$?"
if [ -z "$X" ]; then
  OUT="$OUT" timeout -k 5 200 python -m pytest -q -s -m gpu tests/test_train_gpu.py -k "ten_kills and lending and not no" \
    > /tmp/lending/campaign.log 2>&1
  say "1B lending campaign rc=$? ($(grep -E 'kills=' /tmp/lending/campaign.log | tail -1))"
fi
tar czf "$OUT/logs.tgz" -C /tmp/lending . 2>/dev/null

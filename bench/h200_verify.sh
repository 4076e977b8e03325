#!/usr/bin/env bash
# The training code's GPU checks, in one H200 call (<= 10 min), before any benchmark (first run
# 2026-12-05, stop 49):
#   OUT=/some/dir PYTHONPATH=. bash bench/h200_verify.sh
# - the training GPU tests: gradient lending (the lend_plan / lend_hooks refactor, the compile
#   fix, the empty-plan warning), the gradient buffers (the check on parameters replaced after
#   the optimizer was built sits on every step's boundary), the fused Adam kernel,
#   AnchoredTrainer's GPU test (Hugging Face Trainer; written without a GPU) and the accelerate
#   loop's (stop 49);
# - the 1B Llama's 10-kill campaigns, with and without lending (they write
#   train_gpu_faults{,_lend}.json under $OUT: name them anew before storing them).
# Each part's output goes to $OUT/<part>.log; the exit codes are printed.
set -u
OUT=${OUT:-/tmp/verify}
export TOKENIZERS_PARALLELISM=false PYTORCH_NVML_BASED_CUDA_CHECK=1 NCCL_NVLS_ENABLE=0
mkdir -p "$OUT"
t0=$(date +%s)
part() {   # name, timeout (s), command...
  local name=$1 limit=$2; shift 2
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name rc=$? after $(( $(date +%s) - t0 )) s"
  tail -n 3 "$OUT/$name.log"
}
part gpu_tests 300 python -m pytest -q -m gpu -p no:cacheprovider tests/test_train_hf.py \
  tests/test_train_accelerate.py tests/test_train_grad_lending.py tests/test_train_grads.py \
  tests/test_train_fused_adam.py
part campaigns_1b ${CAMPAIGN_S:-280} env OUT="$OUT" python -m pytest -q -s -m gpu -p no:cacheprovider \
  tests/test_train_gpu.py -k "ten_kills or every_chunk"

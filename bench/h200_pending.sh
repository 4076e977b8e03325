#!/usr/bin/env bash
# The serving and training GPU checks, one H200 or H100 call each, <= 10 min (all three parts
# passed on one H100 on 2026-12-06 at b6d4686; serve again there at dd02e58, 33 of 33; the fused
# Adam tests with the kernel's L2 hints at 27bcf0e; `firsts` (tests that had run on the CPU only)
# and `rest` (the one-GPU test files of no other part) on one H100 at bd28a83; the hints' timings
# on an H200 are bench/h200_hints.sh's call):
#   OUT=/some/dir PYTHONPATH=. PART=serve bash bench/h200_pending.sh     # then train, bench, firsts, rest
# - serve: the serving GPU tests at this tree (the engine split into step_sampling / engine_takeover,
#   structured output's standby warm-up, LoRA through the fused kernels and the CUDA graphs, prefix
#   caching, on by default since 2026-12-06, under every serving GPU test);
# - train: the training GPU tests that did not finish on 2026-12-05 (gradient buffers, lending,
#   fused Adam, accelerate's fp16 loop with clipping);
# - bench: what LoRA adapters cost a decode step (Qwen3-8B shape, 64 streams, 4 adapters of rank 16);
#   what prefix caching saves (shared system prompts, conversation turns).
# Each part's output goes to $OUT/<part>.log; the exit codes and test verdicts are printed.
# The machine has no openai / llguidance: carry their cp312 wheels in .gpu/wheels (pip download
# --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64 ...
# "llguidance>=1.7" openai): without the manylinux_2_31 tag pip picks llguidance 1.6.1, which takes one
# end-of-sequence token only, and the hot standby's and structured output's CUDA tests fail at its LLTokenizer.
set -u
OUT=${OUT:-/tmp/pending}
export TOKENIZERS_PARALLELISM=false PYTORCH_NVML_BASED_CUDA_CHECK=1 NCCL_NVLS_ENABLE=0
mkdir -p "$OUT"
t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
if [ -d .gpu/wheels ]; then
  pip install -q --no-index --find-links .gpu/wheels --target /tmp/pending-site llguidance openai > "$OUT/pip.log" 2>&1
  export PYTHONPATH=${PYTHONPATH:-.}:/tmp/pending-site
fi
part() {   # name, timeout (s), command...
  local name=$1 limit=$2; shift 2
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name rc=$? after $(( $(date +%s) - t0 )) s"
  grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/$name.log" | tail -n 40
}
case ${PART:-serve} in
serve)
  part serve 560 python -m pytest -v -m gpu -p no:cacheprovider --durations=8 tests/test_serve_prefix_cache.py tests/test_serve_lora.py tests/test_serve_lora_kernels.py \
    tests/test_serve_gpu.py tests/test_serve_structured.py tests/test_takeover_fences.py \
    tests/test_serve_hot_standby.py tests/test_serve_api.py tests/test_serve_async.py tests/test_serve_sampling.py \
    tests/test_serve_fused.py tests/test_serve_attention.py tests/test_serve_daemon_loss.py \
    tests/test_serve_deterministic.py ;;
train)
  part train 240 python -m pytest -v -m gpu -p no:cacheprovider tests/test_train_grads.py \
    tests/test_train_grad_lending.py tests/test_train_fused_adam.py
  part accelerate_fp16 320 python -m pytest -v -m gpu -p no:cacheprovider tests/test_train_accelerate.py -k fp16 ;;
firsts)   # GPU tests that had run on the CPU only: Trainer's fp16 fix (5af5e16), lending under
          # inductor, adapters loaded while serving through the graphs, Qwen2 / Mistral greedy
  part firsts_serve 200 python -m pytest -v -m gpu -p no:cacheprovider tests/test_serve_lora_runtime.py \
    tests/test_serve_lora.py "tests/test_serve_gpu.py::test_greedy_equals_hf_generate_on_cuda"
  part firsts_compile 150 python -m pytest -v -m gpu -p no:cacheprovider tests/test_train_grad_lending.py -k compile
  part firsts_trainer 420 python -m pytest -v -m gpu -p no:cacheprovider --durations=4 tests/test_train_hf.py ;;
firsts2)  # what did not finish in the first call of `firsts` (one H100, 2026-12-06)
  part firsts_compile 150 python -m pytest -v -m gpu -p no:cacheprovider tests/test_train_grad_lending.py -k compile
  part firsts_trainer 420 python -m pytest -v -m gpu -p no:cacheprovider --durations=4 tests/test_train_hf.py -k fp16 ;;
rest)     # the GPU test files no other part runs (one GPU; the two-GPU tests skip themselves)
  part rest_cuda 60 python -m pytest -v -m gpu -p no:cacheprovider tests/test_cuda_gpu.py
  part rest_scope 150 python -m pytest -v -m gpu -p no:cacheprovider --durations=5 tests/test_scope_gpu.py
  part rest_checkpoint 120 python -m pytest -v -m gpu -p no:cacheprovider --durations=5 tests/test_checkpoint_gpu.py
  part rest_launch 150 python -m pytest -v -m gpu -p no:cacheprovider --durations=5 tests/test_launch_gpu.py \
    tests/test_launch_auto_prewarm.py ;;
bench)
  part lora_decode 300 python -m bench lora_decode --device cuda:0 --out "$OUT"
  part prefix_cache 240 python -m bench prefix_cache --device cuda:0 --out "$OUT" ;;
esac
echo "done after $(( $(date +%s) - t0 )) s"

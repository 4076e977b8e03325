# Sourced by the one-call device scripts (bench/h200_hints.sh, bench/h200_in_place.sh) once R
# (a scratch directory) and TGZ (the archive's name under $OUT) are set: BENCH_EXTRA as X, the
# GPU named, say (elapsed time), pack ($OUT/$TGZ re-made from R, so that a call cut short keeps
# what finished) and one (a train_overhead run stored as R/<name>.json and .log).
X=${BENCH_EXTRA:-}
export PYTORCH_NVML_BASED_CUDA_CHECK=1 TOKENIZERS_PARALLELISM=false
t0=$(date +%s); say() { echo "== $* after $(( $(date +%s) - t0 )) s"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null
mkdir -p "$R"
pack() { tar czf "$OUT/$TGZ" -C "$R" .; }
one() {   # name, timeout (s), command...
  local name=$1 limit=$2; shift 2; mkdir -p "$R/$name"
  timeout -k 5 "$limit" "$@" $X --out "$R/$name" > "$R/$name.log" 2>&1; say "$name rc=$?"
  mv "$R/$name"/train_overhead*.json "$R/$name.json" 2>/dev/null && rmdir "$R/$name"
  grep -o '"step_overhead_vs_fastest_plain_pct": [0-9.-]*' "$R/$name.json" 2>/dev/null
  pack
}

#!/usr/bin/env bash
# Session 3's last device call (carry .whl; about 4 minutes): re-tune the bias keys
# after causal fwd/dQ with a bias moved to the window kernel (flashgen.spec.
# compiled_variant), then the causal score-mod cases of mods_bench.py (the first run's
# budget ended before them).  Copy $out/h200.sqlite back into tuning_db/.
# Usage (repository root, on the GPU machine):  bash benchmarks/gpu_final.sh "$OUT"
set -uo pipefail
out=${1:-gpu_final_out}
mkdir -p "$out"
source benchmarks/_gpu_env.sh
tune_step 100 tune_bias.log --preset mods-bias --kernels fwd,bwd_dq --storage /tmp/bias.journal --trials 6 \
  --timeout-per-key 3
timeout 130 python3 benchmarks/mods_bench.py --out "$out/mods_causal.json" --budget-s 100 --causal yes \
  --shapes 128:2048,128:8192 > "$out/mods_bench_causal.log" 2>&1
tail -16 "$out/mods_bench_causal.log"

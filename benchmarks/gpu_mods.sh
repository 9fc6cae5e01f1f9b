#!/usr/bin/env bash
# Issue 8's score mods on the H200, one device call (carry .whl; about 8 minutes):
#   1. every valid, feasible config of the dense search space (d64/d128, none/causal/
#      window, bf16) with softcap + ALiBi + bias + dropout compiled in at once, checked
#      against float64 on awkward shapes (gpu_exactness.py --mods);
#   2. flashgen tune --preset mods-bench (kernels $KERNELS, default fwd) into tuning_db/h200.sqlite (copied to $out:
#      copy it back into tuning_db/ and commit it).
# Usage (repository root, on the GPU machine):  bash benchmarks/gpu_mods.sh "$OUT"
set -uo pipefail
out=${1:-gpu_mods_out}
mkdir -p "$out"
source benchmarks/_gpu_env.sh
timeout 260 python3 benchmarks/gpu_exactness.py --skip big,matrix --mods softcap_alibi_bias_dropout \
  --out "$out/mods_exactness.json" 2>&1 | grep -v "space: [0-9]*/" | tee "$out/mods_exactness.log" | tail -12
tune_step 250 tune_mods.log --preset mods-bench --kernels "${KERNELS:-fwd}" --storage /tmp/mods.journal \
  --trials 8 --timeout-per-key 3

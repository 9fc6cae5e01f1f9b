#!/usr/bin/env bash
# Issue 8 on the H200, one device call (carry .whl; about 9 minutes): tuning rows for the
# score-mod backward kernels (mods-bench preset; every variant precompiled and checked
# against float64 first), then the side-by-side benches: score mods vs FlexAttention and
# SDPA (mods_bench.py) and ragged batches vs FlexAttention document masks and padded SDPA
# (varlen_bench.py).  Copy $out/h200.sqlite back into tuning_db/ and commit it.
# Usage (repository root, on the GPU machine):  bash benchmarks/gpu_benches.sh "$OUT"
set -uo pipefail
out=${1:-gpu_benches_out}
mkdir -p "$out"
source benchmarks/_gpu_env.sh
tune_step 270 tune_mods_bwd.log --preset mods-bench --kernels bwd_dq,bwd_dkdv --storage /tmp/mods_bwd.journal \
  --trials 6 --timeout-per-key 3
timeout 120 python3 benchmarks/mods_bench.py --out "$out/mods.json" --budget-s 80 --shapes 128:2048,128:8192 \
  > "$out/mods_bench.log" 2>&1
timeout 110 python3 benchmarks/varlen_bench.py --out "$out/varlen.json" --budget-s 75 > "$out/varlen_bench.log" 2>&1
tail -30 "$out/mods_bench.log"; tail -24 "$out/varlen_bench.log"

#!/usr/bin/env bash
# The GPU work still owed after session 5 (device time ran out), one device call
# (carry .whl; at most 590 s of step timeouts on an H200):
#   1. the head_dim 64 score-mod backward keys (dQ, dK/dV) of mods_bench.py's default
#      shapes: session 5 tuned their forward only (`--preset mods-d64 --kernels fwd`);
#      the backward runs the nearest rows;
#   2. mods_bench.py's head_dim 64 cases on those rows (session 5's run predates them);
#   3. host_cost.py: whether the host is the 0.27 ms by which fwd+bwd exceeded fwd and
#      bwd timed apart at d128 32x512 (session 5's fa-grid).
# Session 4's list (bias descriptor checks, the all-mods walk, BLOCK_M 256, the d64
# score-mod bench) ran in session 5: docs/notes.md, "Session 5".
# Usage (repository root, on the GPU machine):  bash benchmarks/gpu_pending.sh "$OUT"
set -uo pipefail
out=${1:-gpu_pending_out}
mkdir -p "$out"
source benchmarks/_gpu_env.sh
tune_step 330 tune_mods_d64_bwd.log --preset mods-d64 --kernels bwd_dq,bwd_dkdv --trials 6 --timeout-per-key 4
timeout 160 python3 benchmarks/mods_bench.py --out "$out/mods_d64.json" --shapes 64:2048 --budget-s 130 \
  > "$out/mods_d64.log" 2>&1; tail -14 "$out/mods_d64.log"
timeout 90 python3 benchmarks/host_cost.py > "$out/host_cost.log" 2>&1; head -20 "$out/host_cost.log"

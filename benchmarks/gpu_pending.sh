#!/usr/bin/env bash
# The GPU work still owed after session 4 (device time ran out), one device call
# (carry .whl; about 9-10 minutes on an H200):
#   0. the bias variants' float64 checks on their descriptor (BIAS_TMA) binaries: session
#      4's checks ran their pointer binaries (review 4; bench.mod_inputs now pads the
#      check bias's rows so the descriptor path runs), d128 none/causal/window;
#   1. the 90 variants of the all-four-score-mods exactness walk that session 4's two
#      budgets did not reach (docs/h200/session4/mods_exactness_left.json);
#   2. probe_fwd_configs.py: BLOCK_M 256 forward configs (16 warps; spill-free per ptxas)
#      against the tuned forward and SDPA cuDNN, before adding them to the tuning domain
#      (which re-keys every forward row);
#   3. mods_bench.py's head_dim 64 score-mod cases (out of session 4's budget).
# Usage (repository root, on the GPU machine):  bash benchmarks/gpu_pending.sh "$OUT"
set -uo pipefail
out=${1:-gpu_pending_out}
mkdir -p "$out"
source benchmarks/_gpu_env.sh
timeout 200 python3 benchmarks/gpu_exactness.py --skip big,matrix --mods bias --head-dims 128 --space-budget-s 150 \
  --out "$out/bias_exactness.json" 2>&1 | grep -v "space: [0-9]*/" | tee "$out/bias_exactness.log" | tail -9
timeout 150 python3 benchmarks/gpu_exactness.py --skip big,matrix --mods softcap_alibi_bias_dropout --head-dims 128 \
  --resume-skipped docs/h200/session4/mods_exactness_left.json --space-budget-s 100 \
  --out "$out/mods_exactness_rest.json" 2>&1 | grep -v "space: [0-9]*/" | tee "$out/mods_exactness_rest.log" | tail -9
timeout 200 python3 benchmarks/probe_fwd_configs.py --out "$out/fwd_probe.json" --budget-s 170 \
  > "$out/fwd_probe.log" 2>&1; grep -v "^ \|Traceback" "$out/fwd_probe.log" | tail -12
timeout 150 python3 benchmarks/mods_bench.py --out "$out/mods_d64.json" --shapes 64:2048 --budget-s 120 \
  > "$out/mods_d64.log" 2>&1; tail -14 "$out/mods_d64.log"

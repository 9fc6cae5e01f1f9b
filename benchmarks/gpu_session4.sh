#!/usr/bin/env bash
# Session 4's device calls after the bias-TMA and 4-per-Philox dropout kernels (carry .whl;
# each part about 9 minutes on an H200):
#   part 1: re-tune the bias and dropout keys (their code changed, so their old rows no
#           longer match; every variant is precompiled and checked against float64
#           first), then the search-space exactness walk with all four score mods
#           compiled in at once (d128).
#   part 2: the exactness walk's dQ variants (part 1's walk ran out of budget before
#           them), then mods_bench.py on every case (TFLOP/s against FlexAttention and
#           SDPA).
#   probe:  benchmarks/probe_dq_atomic.py (single-pass backward with dQ atomics against
#           the two-pass backward), then decode_bench.py.
# Usage (repository root, on the GPU machine):  bash benchmarks/gpu_session4.sh "$OUT" probe|1|2
# After part 1, copy $OUT/h200.sqlite into tuning_db/ (journal_mode DELETE) and commit it.
set -uo pipefail
out=${1:-gpu_session4_out}
part=${2:-1}
mkdir -p "$out"
source benchmarks/_gpu_env.sh
if [ "$part" = probe ]; then
  timeout 280 python3 benchmarks/probe_dq_atomic.py --out "$out/probe_dq_atomic.json" --budget-s 230 \
    --configs 64:64:4:2:1,32:64:4:2:1,32:128:8:2:1,64:128:8:2:1 > "$out/probe_dq_atomic.log" 2>&1
  grep -v "^ \|^Traceback\|Error" "$out/probe_dq_atomic.log" | tail -60
  timeout 160 python3 benchmarks/decode_bench.py --out "$out/decode.json" --budget-s 120 --rep-ms 20 \
    > "$out/decode_bench.log" 2>&1; tail -40 "$out/decode_bench.log"
elif [ "$part" = 1 ]; then
  tune_step 300 tune_bias_dropout.log --preset mods-bias --preset mods-dropout --storage /tmp/retune.journal \
    --trials 6 --timeout-per-key 4
  timeout 60 python3 -c "
import sys, torch; sys.path.insert(0, 'benchmarks'); import gpu_op_checks as g
for r in g.check_bias_tma(torch.device('cuda'), torch.bfloat16): print(f'{r.name:50} {r.status:5} {r.detail}')
" 2>&1 | tee "$out/bias_tma_checks.log" | grep -v Warn
  timeout 220 python3 benchmarks/gpu_exactness.py --skip big,matrix --mods softcap_alibi_bias_dropout --head-dims 128 --space-budget-s 140 \
    --out "$out/mods_exactness.json" 2>&1 | grep -v "space: [0-9]*/" | tee "$out/mods_exactness.log" | tail -10
else
  timeout 150 python3 benchmarks/gpu_exactness.py --skip big,matrix --mods softcap_alibi_bias_dropout --head-dims 128 \
    --kernels bwd_dq --space-budget-s 90 --out "$out/mods_exactness_dq.json" 2>&1 | grep -v "space: [0-9]*/" \
    | tee "$out/mods_exactness_dq.log" | tail -9
  timeout 270 python3 benchmarks/mods_bench.py --out "$out/mods.json" --budget-s 240 \
    > "$out/mods_bench.log" 2>&1; tail -34 "$out/mods_bench.log"
fi

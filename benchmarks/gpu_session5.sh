#!/usr/bin/env bash
# Session 5's device calls (carry .whl):
#   part 0: call 1, the work session 4 left (f46a25c's gpu_pending.sh with its step
#           timeouts cut to fit one 600 s call): the bias variants' float64 checks on
#           their descriptor binaries, the 90 all-mods walk variants left, the BLOCK_M
#           256 probe and mods_bench.py's head_dim 64 cases;
#   part 1: the 114 bias variants gpu_pending.sh's budget left (float64, descriptor
#           binaries; resumes docs/h200/session5/bias_exactness.json), the d64 score-mod
#           cases left, the pipe_qk probe (issue 4: tile j+1's QK^T before tile j's
#           softmax) and fa-grid d64 non-causal with all five backends;
#   part 2: `flashgen tune --preset mods-d64` (the head_dim 64 score-mod keys of
#           mods_bench.py's default shapes: part 1 ran them on other modes' rows), then
#           mods_bench.py's head_dim 64 cases on the new rows;
#   part 3: the rest of fa-grid (d64 causal, d128 none and causal), five backends.
# Each fa-grid quarter is one `flashgen bench` run (tuned, default, SDPA flash, SDPA
# cuDNN, FlexAttention side by side per shape) under its own timeout, so a cut loses at
# most one quarter; `python3 benchmarks/merge_bench.py` joins them offline.
# Usage (repository root, on the GPU machine):  bash benchmarks/gpu_session5.sh "$OUT" 0|1|2|3|4
set -uo pipefail
out=${1:-gpu_session5_out}
part=${2:-1}
mkdir -p "$out"
source benchmarks/_gpu_env.sh
bench_quarter() {  # bench_quarter SECONDS D MASK
  local secs=$1 d=$2 mask=$3 shapes=() n
  for n in 512 1024 2048 4096 8192 16384; do
    shapes+=(--shape "$((16384 / n)),$((2048 / d)),$((2048 / d)),$n,$n,$d$([ "$mask" = causal ] && echo ,causal)")
  done
  timeout "$secs" python3 -m flashgen bench "${shapes[@]}" --backends flashgen,flashgen-default,sdpa-flash,sdpa-cudnn,flex \
    --no-plots --out "$out/bench_d${d}_$mask" 2>&1 | grep -v "━" > "$out/bench_d${d}_$mask.log"
  grep -E "geomean|│" "$out/bench_d${d}_$mask.log" | tail -12
  # One file per quarter: the device tool brings back at most eight files per call.
  tar czf "$out/bench_d${d}_$mask.tgz" -C "$out" "bench_d${d}_$mask" "bench_d${d}_$mask.log" && \
    rm -r "$out/bench_d${d}_$mask" "$out/bench_d${d}_$mask.log"
}
if [ "$part" = 0 ]; then
  timeout 190 python3 benchmarks/gpu_exactness.py --skip big,matrix --mods bias --head-dims 128 --space-budget-s 140 \
    --out "$out/bias_exactness.json" 2>&1 | grep -v "space: [0-9]*/" | tee "$out/bias_exactness.log" | tail -9
  timeout 120 python3 benchmarks/gpu_exactness.py --skip big,matrix --mods softcap_alibi_bias_dropout --head-dims 128 \
    --resume-skipped docs/h200/session4/mods_exactness_left.json --space-budget-s 75 \
    --out "$out/mods_exactness_rest.json" 2>&1 | grep -v "space: [0-9]*/" | tee "$out/mods_exactness_rest.log" | tail -9
  timeout 170 python3 benchmarks/probe_fwd_configs.py --out "$out/fwd_probe.json" --budget-s 140 \
    > "$out/fwd_probe.log" 2>&1; grep -v "^ \|Traceback" "$out/fwd_probe.log" | tail -12
  timeout 110 python3 benchmarks/mods_bench.py --out "$out/mods_d64.json" --shapes 64:2048 --budget-s 80 \
    > "$out/mods_d64.log" 2>&1; tail -14 "$out/mods_d64.log"
elif [ "$part" = 1 ]; then
  timeout 110 python3 benchmarks/gpu_exactness.py --skip big,matrix --mods bias --head-dims 128 \
    --resume-skipped docs/h200/session5/bias_exactness.json --space-budget-s 80 \
    --out "$out/bias_exactness_rest.json" 2>&1 | grep -v "space: [0-9]*/" | tee "$out/bias_exactness_rest.log" | tail -9
  timeout 80 python3 benchmarks/probe_fwd_configs.py --configs "" --pipe-qk tuned \
    --shapes 128:none:8:16:2048,128:none:2:16:8192,64:none:8:32:2048 --out "$out/pipe_qk.json" --budget-s 60 \
    > "$out/pipe_qk.log" 2>&1; grep -v "^ \|Traceback" "$out/pipe_qk.log" | tail -6
  timeout 90 python3 benchmarks/mods_bench.py --out "$out/mods_d64_causal.json" --shapes 64:2048 --causal yes \
    --budget-s 70 > "$out/mods_d64_causal.log" 2>&1; tail -8 "$out/mods_d64_causal.log"
  timeout 50 python3 benchmarks/mods_bench.py --out "$out/mods_d64_dropout.json" --shapes 64:2048 --causal no \
    --mods dropout --budget-s 30 > "$out/mods_d64_dropout.log" 2>&1; tail -4 "$out/mods_d64_dropout.log"
  bench_quarter 220 64 none
elif [ "$part" = 4 ]; then
  # What the device budget left room for (495 s): the three fa-grid quarters, then the
  # forward of the head_dim 64 score-mod keys (part 2's tune spent its 300 s compiling
  # all 1752 variants of the three kernels and tuned one key).
  bench_quarter 110 64 causal
  bench_quarter 110 128 none
  bench_quarter 110 128 causal
  tune_step 130 tune_mods_d64_fwd.log --preset mods-d64 --kernels fwd --trials 6 --timeout-per-key 4
elif [ "$part" = 2 ]; then
  tune_step 300 tune_mods_d64.log --preset mods-d64 --trials 6 --timeout-per-key 4
  timeout 230 python3 benchmarks/mods_bench.py --out "$out/mods_d64.json" --shapes 64:2048 --budget-s 190 \
    > "$out/mods_d64.log" 2>&1; tail -14 "$out/mods_d64.log"
else
  bench_quarter 190 64 causal
  bench_quarter 190 128 none
  bench_quarter 190 128 causal
fi

#!/usr/bin/env bash
# The GPU checks this repository's last session wrote but could not run (device time ran
# out), in one call of the device tool (carry .whl; about 8-9 minutes on an H200):
#   issue 3: the exactness matrix in bf16/fp16, every search-space config per mask mode,
#            >2^31 elements, 70000 batch*heads
#   issue 5: torch.compile (inductor) and CUDA-graph replay of the op, host overhead
# Usage (repository root, on the GPU machine):  bash benchmarks/gpu_pending.sh "$OUT"
set -uo pipefail
out=${1:-gpu_pending_out}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
timeout 120 python3 benchmarks/gpu_op_checks.py 2>&1 | tee "$out/op_checks.log"
timeout 60 python3 benchmarks/overhead.py 2>&1 | tee "$out/overhead.log"
timeout 420 python3 benchmarks/gpu_exactness.py --out "$out/gpu_exactness.json" --budget-s 300 2>&1 | tee "$out/exactness.log"

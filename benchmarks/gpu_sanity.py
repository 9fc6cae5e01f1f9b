"""Quick GPU sanity check before a long run: the default variant of every kernel for
bf16/fp16, head_dim 64/128, masks none/causal against the float64 reference (awkward
shape), plus one timing against torch SDPA's cuDNN backend.  Exits 1 on a failure.

    PYTHONPATH=. python3 benchmarks/gpu_sanity.py
"""

import sys

import torch
import torch.nn.functional as F

from flashgen import attention
from flashgen.arch import current
from flashgen.bench import check_variant, time_ms
from flashgen.heuristics import default_config
from flashgen.spec import KERNELS, KernelSpec, Variant

arch = current()
print(f"device: {arch.name} cc {arch.compute_capability} sms {arch.sm_count} smem/block {arch.smem_per_block_optin}")
bad = 0
for dtype in ("bfloat16", "float16"):
    for d in (64, 128):
        for mask in ("none", "causal"):
            for kernel in KERNELS:
                spec = KernelSpec(kernel, dtype, d, d, mask)
                v = Variant(spec, default_config(spec, arch))
                for group in (1, 4):
                    ok, ratio, msg = check_variant(v, group)
                    bad += not ok
                    print(f"{'ok ' if ok else 'BAD'} {v.id} group {group}: ratio {ratio:.3f}  {msg}", flush=True)
b, h, n, d = 4, 16, 4096, 128
q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
for causal in (False, True):
    flops = 4 * b * h * n * n * d / (2 if causal else 1)
    ms_fg = time_ms(lambda: attention(q, k, v, causal=causal))
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        ms_cu = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
    print(f"fwd b{b} h{h} n{n} d{d} causal={causal}: flashgen default {flops / ms_fg / 1e9:.0f} TFLOP/s, "
          f"cudnn {flops / ms_cu / 1e9:.0f} TFLOP/s")
sys.exit(1 if bad else 0)

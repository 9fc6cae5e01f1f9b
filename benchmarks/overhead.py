"""Host time per call that flashgen adds on top of launching the same Triton kernel
directly, next to torch SDPA's call, on small decode-like shapes.  Where the kernel's
GPU time (last column, do_bench) is below the per-call time, calls are host-bound and
the difference between the first two columns is flashgen's added host time.  Time =
wall time of N back-to-back calls / N, synchronized once at the end.

    PYTHONPATH=. python3 benchmarks/overhead.py
"""

import time

import torch
import torch.nn.functional as F
import triton.testing

from flashgen import attention, ops
from flashgen.api import _key
from flashgen.dispatch import default_dispatcher
from flashgen.masks import mask_bounds


def per_call_us(fn, n=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


print(f"{'shape':32} {'flashgen.attention':>18} {'ops.fwd direct':>15} {'added':>8} {'sdpa':>8} {'kernel (GPU)':>12}  (us per call)")
for sq, sk in ((1, 128), (4, 128), (16, 128), (1, 4096)):
    b, h, hk, d = 1, 32, 8, 128
    q = torch.randn(b, h, sq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, hk, sk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, hk, sk, d, device="cuda", dtype=torch.bfloat16)
    mode, lo, hi = mask_bounds(sq, sk, causal=True, window=(-1, -1))
    cfg = default_dispatcher().config_for(_key("fwd", q, k, v, mode))
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device="cuda", dtype=torch.float32)
    t_op = per_call_us(lambda: attention(q, k, v, causal=True))
    t_direct = per_call_us(lambda: ops.fwd(q, k, v, softmax_scale=d ** -0.5, mask=mode, diag_lo=lo, diag_hi=hi,
                                           config=cfg, out=out, lse=lse))
    t_sdpa = per_call_us(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    t_gpu = triton.testing.do_bench(lambda: ops.fwd(q, k, v, softmax_scale=d ** -0.5, mask=mode, diag_lo=lo,
                                                    diag_hi=hi, config=cfg, out=out, lse=lse),
                                    return_mode="median") * 1e3
    print(f"{f'b{b} h{h}/{hk} sq{sq} sk{sk} d{d} causal':32} {t_op:18.1f} {t_direct:15.1f} {t_op - t_direct:8.1f} {t_sdpa:8.1f} {t_gpu:12.1f}")

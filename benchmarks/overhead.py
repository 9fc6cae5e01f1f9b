"""Host time per call that flashgen adds on top of launching the same Triton kernel
directly, next to torch SDPA's call, on small decode-like shapes (issue: the op users
import).  The GPU work at these sizes is a few microseconds, so calls are host-bound:
time = wall time of N back-to-back calls / N, synchronized once at the end.

    PYTHONPATH=. python3 benchmarks/overhead.py
"""

import time

import torch
import torch.nn.functional as F

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


print(f"{'shape':32} {'flashgen.attention':>18} {'ops.fwd direct':>15} {'added':>8} {'sdpa':>8}   (us per call)")
for sq in (1, 4, 16):
    b, h, hk, sk, d = 8, 32, 8, 4096, 128
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
    print(f"{f'b{b} h{h}/{hk} sq{sq} sk{sk} d{d} causal':32} {t_op:18.1f} {t_direct:15.1f} {t_op - t_direct:8.1f} {t_sdpa:8.1f}")

"""Forward output, LSE and dQ/dK/dV of the generated kernels against the float64
reference, in Triton's interpreter (float16/float32, small awkward shapes).

Pass rule (FlashAttention's): max |kernel - ref64| <= 2 * max |torch_at_dtype - ref64|
+ floor.  Output buffers are poisoned with NaN first, so an unwritten element fails.
"""

import pytest
import torch

from flashgen import ops, reference
from flashgen.masks import mask_bounds
from flashgen.spec import TileConfig

FLOOR = {torch.float16: 2e-3, torch.float32: 2e-5}


_err = reference.max_error


def _check(name, got, ref64, base, dtype):
    err, base_err = _err(got, ref64), _err(base, ref64)
    assert not torch.isnan(got).any(), f"{name}: NaN"
    assert err <= 2 * base_err + FLOOR[dtype], f"{name}: err {err:.3g} > 2 x {base_err:.3g} + {FLOOR[dtype]}"


CASES = [
    # b, h, hk, sq, sk, d, dv, causal, window, dtype, fwd cfg, dq cfg, dkdv cfg
    (1, 2, 2, 40, 40, 64, 64, False, (-1, -1), torch.float16, (32, 16), (32, 16), (16, 32)),
    (2, 2, 1, 37, 53, 32, 32, True, (-1, -1), torch.float16, (16, 32), (32, 16), (16, 16)),
    (1, 2, 2, 53, 37, 32, 32, True, (-1, -1), torch.float32, (32, 16), (16, 16), (32, 16)),
    (1, 4, 2, 45, 61, 40, 40, False, (5, 3), torch.float16, (16, 16), (16, 32), (16, 32)),
    (1, 2, 2, 33, 33, 24, 16, True, (7, -1), torch.float16, (32, 32), (32, 16), (16, 32)),
    (1, 1, 1, 1, 17, 16, 16, False, (-1, -1), torch.float32, (16, 16), (16, 16), (16, 16)),
    (1, 2, 2, 17, 1, 16, 16, True, (-1, -1), torch.float16, (16, 16), (16, 16), (16, 16)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}h{c[1]}kv{c[2]}q{c[3]}k{c[4]}d{c[5]}v{c[6]}"
                         f"{'c' if c[7] else ''}w{c[8][0]}_{c[8][1]}{str(c[9])[-7:]}")
def test_forward_backward_match_reference(case):
    b, h, hk, sq, sk, d, dv, causal, window, dtype, cf, cq, ckv = case
    torch.manual_seed(sq * 131 + sk)
    q = torch.randn(b, h, sq, d, dtype=dtype)
    k = torch.randn(b, hk, sk, d, dtype=dtype)
    v = torch.randn(b, hk, sk, dv, dtype=dtype)
    do = torch.randn(b, h, sq, dv, dtype=dtype)
    scale = d ** -0.5
    mode, lo, hi = mask_bounds(sq, sk, causal=causal, window=window)
    kw = dict(softmax_scale=scale, mask=mode, diag_lo=lo, diag_hi=hi)
    nan = float("nan")
    o, lse = ops.fwd(q, k, v, config=TileConfig(*cf, 4, 1), out=torch.full((b, h, sq, dv), nan, dtype=dtype),
                     lse=torch.full((b, h, sq), nan), **kw)
    dq, dk, dv_ = ops.bwd(do, q, k, v, o, lse, config_dq=TileConfig(*cq, 4, 1), config_dkdv=TileConfig(*ckv, 4, 1),
                          dq=torch.full_like(q, nan), dk=torch.full_like(k, nan), dv=torch.full_like(v, nan),
                          delta=torch.full_like(lse, nan), **kw)
    rkw = dict(causal=causal, window=window, softmax_scale=scale)
    ro, rlse, _ = reference.forward(q, k, v, **rkw)
    bo, blse, _ = reference.forward(q, k, v, dtype=dtype, **rkw)
    _check("O", o, ro, bo, dtype)
    _check("LSE", lse, rlse, blse.float(), torch.float32)
    rg = reference.backward(do, q, k, v, **rkw)
    bg = reference.backward(do, q, k, v, dtype=dtype, **rkw)
    for name, got, r, bb in zip(("dQ", "dK", "dV"), (dq, dk, dv_), rg, bg):
        _check(name, got, r, bb, dtype)

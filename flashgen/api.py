"""The public op: input checks, dispatch, autograd.

``attention`` computes exact softmax attention with FlashAttention's algorithm (Dao et
al. 2022, "FlashAttention: Fast and Memory-Efficient Exact Attention with
IO-Awareness"; Dao 2023, "FlashAttention-2"): tiled, online softmax, no
seqlen_q x seqlen_k matrix in memory, and a backward that recomputes the probabilities
from the saved log-sum-exp.
"""

from __future__ import annotations

import contextlib
import os

import torch

from . import ops, reference
from .dispatch import default_dispatcher
from .errors import InputError
from .masks import mask_bounds
from .spec import KernelSpec, ProblemKey

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _check(q, k, v, softmax_scale):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise InputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise InputError(f"{name} must have 4 dims (batch, heads, seqlen, head_dim), got shape {tuple(t.shape)}")
    if q.dtype not in _DTYPES:
        raise InputError(f"q.dtype must be float16, bfloat16 or float32, got {q.dtype}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise InputError(f"{name}.dtype ({t.dtype}) must equal q.dtype ({q.dtype})")
        if t.device != q.device:
            raise InputError(f"{name}.device ({t.device}) must equal q.device ({q.device})")
    b, h, _, d = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise InputError(f"batch sizes differ: q {b}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[1] != v.shape[1]:
        raise InputError(f"k and v must have the same number of heads, got {k.shape[1]} and {v.shape[1]}")
    if k.shape[2] != v.shape[2]:
        raise InputError(f"k and v must have the same seqlen_k, got {k.shape[2]} and {v.shape[2]}")
    hk = k.shape[1]
    if hk == 0 or h % hk != 0:
        raise InputError(f"num_heads of q ({h}) must be a multiple of num_kv_heads of k/v ({hk})")
    if k.shape[3] != d:
        raise InputError(f"k.shape[-1] (head_dim {k.shape[3]}) must equal q.shape[-1] ({d})")
    for name, dd in (("q/k head_dim", d), ("v head_dim", v.shape[3])):
        if not (8 <= dd <= 256 and dd % 8 == 0):
            raise InputError(f"{name} must be a multiple of 8 in [8, 256], got {dd}")
    if softmax_scale is not None and not isinstance(softmax_scale, (int, float)):
        raise InputError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")


def _last_dim_contiguous(t):
    return t if t.stride(-1) == 1 else t.contiguous()


def _key(kernel, q, k, v, mask) -> ProblemKey:
    spec = KernelSpec(kernel, ops.dtype_name(q.dtype), q.shape[3], v.shape[3], mask)
    return ProblemKey.from_sizes(spec, batch=q.shape[0], num_heads=q.shape[1], num_kv_heads=k.shape[1],
                                 seqlen_q=q.shape[2], seqlen_k=k.shape[2])


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, mask, lo, hi):
        # The kernels scale the masked (-inf) scores too, so they need scale > 0:
        # softmax(scale * q k^T) is computed as softmax(|scale| * (sign * q) k^T), and
        # scale 0 (uniform attention) as scale 1 with q = 0; dQ is sign * dQ'.
        sign = -1 if scale < 0 else 0 if scale == 0 else 1  # NaN stays NaN
        if sign != 1:
            q = q.neg() if sign < 0 else torch.zeros_like(q)
            scale = -scale if sign else 1.0
        disp = default_dispatcher()
        cfg = disp.config_for(_key("fwd", q, k, v, mask))
        with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
            o, lse = ops.fwd(q, k, v, softmax_scale=scale, mask=mask, diag_lo=lo, diag_hi=hi, config=cfg)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.args = (scale, mask, lo, hi, sign)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        scale, mask, lo, hi, sign = ctx.args
        do = _last_dim_contiguous(do)
        disp = default_dispatcher()
        cfg_dq = disp.config_for(_key("bwd_dq", q, k, v, mask))
        cfg_kv = disp.config_for(_key("bwd_dkdv", q, k, v, mask))
        with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
            dq, dk, dv = ops.bwd(do, q, k, v, o, lse, softmax_scale=scale, mask=mask, diag_lo=lo, diag_hi=hi,
                                 config_dq=cfg_dq, config_dkdv=cfg_kv)
        if sign != 1:
            dq = dq.neg() if sign < 0 else torch.zeros_like(dq)
        return dq, dk, dv, None, None, None, None


class _Reference(torch.autograd.Function):
    """CPU path without the Triton interpreter: float32 math with the same conventions."""

    @staticmethod
    def forward(ctx, q, k, v, scale, causal, window, align):
        o, lse, _ = reference.forward(q, k, v, causal=causal, window=window, softmax_scale=scale, align=align,
                                      dtype=torch.float32)
        ctx.save_for_backward(q, k, v)
        ctx.args = (scale, causal, window, align)
        ctx.mark_non_differentiable(lse)
        return o.to(q.dtype), lse.float()

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v = ctx.saved_tensors
        scale, causal, window, align = ctx.args
        dq, dk, dv = reference.backward(do, q, k, v, causal=causal, window=window, softmax_scale=scale,
                                        align=align, dtype=torch.float32)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


class _Empty(torch.autograd.Function):
    """batch, heads, seqlen_q or seqlen_k of 0: zeros and -inf, no launch; zero grads."""

    @staticmethod
    def forward(ctx, q, k, v):
        b, h, sq, _ = q.shape
        ctx.meta = [(t.shape, t.dtype, t.device) for t in (q, k, v)]
        o = q.new_zeros((b, h, sq, v.shape[3]))
        lse = torch.full((b, h, sq), float("-inf"), dtype=torch.float32, device=q.device)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        return tuple(torch.zeros(s, dtype=dt, device=dev) for s, dt, dev in ctx.meta)


def _attention(q, k, v, *, causal, window, softmax_scale, return_lse, align):
    _check(q, k, v, softmax_scale)
    b, h, sq, d = q.shape
    sk = k.shape[2]
    scale = d ** -0.5 if softmax_scale is None else float(softmax_scale)
    mask, lo, hi = mask_bounds(sq, sk, causal=causal, window=window, align=align)
    if b == 0 or h == 0 or sq == 0 or sk == 0:
        # Nothing to launch: every row sees no key (O = 0, LSE = -inf); gradients are 0.
        o, lse = _Empty.apply(q, k, v)
        return (o, lse) if return_lse else o
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    if q.is_cuda or _interpreting():
        o, lse = _Attention.apply(q, k, v, scale, mask, lo, hi)
    else:
        o, lse = _Reference.apply(q, k, v, scale, causal, tuple(window), align)
    return (o, lse) if return_lse else o


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              window: tuple[int, int] = (-1, -1), softmax_scale: float | None = None,
              return_lse: bool = False):
    """Exact attention ``softmax(q @ k^T * softmax_scale) @ v``, FlashAttention-style.

    Args:
        q: (batch, num_heads, seqlen_q, head_dim), float16 / bfloat16 / float32, CUDA
            (or CPU: see below).  Any strides; a last-dim stride other than 1 is copied.
        k: (batch, num_kv_heads, seqlen_k, head_dim), same dtype and device as q.
            num_heads must be a multiple of num_kv_heads (GQA/MQA): query head h reads
            key/value head h // (num_heads // num_kv_heads).
        v: (batch, num_kv_heads, seqlen_k, head_dim_v); head_dim_v may differ from
            head_dim.  Head dims are multiples of 8 in [8, 256].
        causal: FlashAttention's bottom-right alignment: query i sees key j iff
            j <= i + seqlen_k - seqlen_q::

                seqlen_q = 3, seqlen_k = 5       seqlen_q = 5, seqlen_k = 3
                    j: 0 1 2 3 4                     j: 0 1 2
                i=0    x x x . .                 i=0    . . .    (sees no key:
                i=1    x x x x .                 i=1    . . .     O = 0,
                i=2    x x x x x                 i=2    x . .     LSE = -inf)
                                                 i=3    x x .
                                                 i=4    x x x
        window: (left, right), inclusive, -1 = unbounded: with off = seqlen_k - seqlen_q,
            query i sees key j iff i + off - left <= j <= i + off + right.  With
            causal=True, right is 0.
        softmax_scale: multiplies q @ k^T; None means 1 / sqrt(head_dim).  0.0 is used
            as given (uniform attention over the visible keys).
        return_lse: also return the log-sum-exp of each score row.

    Returns:
        O of shape (batch, num_heads, seqlen_q, head_dim_v), q's dtype; with
        ``return_lse``, also LSE (batch, num_heads, seqlen_q), float32, natural log,
        -inf for rows that see no key.  Differentiable in q, k, v (the backward
        recomputes P from the LSE; dK and dV are summed over each GQA group).

    Precision: float16/bfloat16 inputs are multiplied on tensor cores with float32
    accumulation; float32 inputs in IEEE float32 (no tf32).

    CPU tensors run through flashgen's reference implementation (float32 math), or
    through the Triton interpreter when ``TRITON_INTERPRET=1``.

    Raises:
        InputError (a ValueError): an argument breaks a rule; the message names it.
    """
    return _attention(q, k, v, causal=causal, window=window, softmax_scale=softmax_scale,
                      return_lse=return_lse, align="bottom_right")

"""dK and dV of a group-split Gluon backward (``GluonBwdConfig.group_split`` > 1) from
their float32 partial sums: one Triton kernel, one launch for both.

The main kernel's ``group_split`` programs of one (batch, kv head) each write the sum
over their query heads of the GQA group into slab ``sp`` of a float32 scratch
(batch, num_kv_heads, group_split, seqlen_k, head_dim), dK not yet scaled.  Here

    dK[z, hk] = (P_dK[z, hk, 0] + P_dK[z, hk, 1] + ... + P_dK[z, hk, S - 1]) * softmax_scale
    dV[z, hk] =  P_dV[z, hk, 0] + P_dV[z, hk, 1] + ... + P_dV[z, hk, S - 1]

in float32, added in split order (deterministic for a given split), then cast to the
outputs' dtype.  It reads the scratch once and writes the outputs once: 4 * S + 2 *
elem_bytes bytes per output element (the least traffic a separate pass can have; a
torch ``sum`` then ``mul`` then ``to`` makes three passes).

A plain Triton kernel (no Gluon), so it also runs in Triton's interpreter on CPU.
Imports triton (the launcher imports this module when a split variant launches).
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

#: Elements per program (16 float32 per thread at 4 warps: four 16-byte loads per slab).
BLOCK = 2048
NUM_WARPS = 4


@triton.jit
def _sum_slabs(P, OUT, zh, pid, slab, scale, num_kv_heads, so_z, so_h, so_n, SPLIT: tl.constexpr,
               D: tl.constexpr, BLOCK: tl.constexpr):
    """OUT[z, hk, n, :] = (sum over s in order of P[zh, s, n, :]) * scale in float32 for
    the BLOCK elements (n, d) of program ``pid``, zh = z * num_kv_heads + hk; P: (.,
    SPLIT, slab) contiguous, OUT of strides (so_z, so_h, so_n, 1)."""
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    keep = offs < slab
    src = P + zh.to(tl.int64) * SPLIT * slab + offs
    acc = tl.load(src, mask=keep, other=0.0).to(tl.float32)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(src + s * slab, mask=keep, other=0.0).to(tl.float32)
    z = (zh // num_kv_heads).to(tl.int64)
    hk = (zh % num_kv_heads).to(tl.int64)
    n = (offs // D).to(tl.int64)
    dst = OUT + z * so_z + hk * so_h + n * so_n + offs % D
    tl.store(dst, (acc * scale).to(OUT.dtype.element_ty), mask=keep)


@triton.jit
def group_reduce(DK_P, DV_P, DK, DV, slab, softmax_scale, num_kv_heads, sdk_z, sdk_h, sdk_n, sdv_z, sdv_h, sdv_n,
                 SPLIT: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (cdiv(slab, BLOCK), z * hk, 2); slab = seqlen_k * head_dim, D = head_dim; DK,
    DV (z, hk, seqlen_k, D) of any strides with last stride 1.  Axis 2: 0 sums dK's
    partials (times softmax_scale), 1 dV's (times 1.0, exact)."""
    pid = tl.program_id(0)
    zh = tl.program_id(1)
    if tl.program_id(2) == 0:
        _sum_slabs(DK_P, DK, zh, pid, slab, softmax_scale, num_kv_heads, sdk_z, sdk_h, sdk_n, SPLIT, D, BLOCK)
    else:
        _sum_slabs(DV_P, DV, zh, pid, slab, 1.0, num_kv_heads, sdv_z, sdv_h, sdv_n, SPLIT, D, BLOCK)


def args(dk_partial, dv_partial, dk, dv, softmax_scale: float, split: int) -> tuple:
    """The argument tuple of :func:`group_reduce` writing ``dk``, ``dv`` (batch,
    num_kv_heads, seqlen_k, head_dim; any strides with last stride 1)."""
    _, hk, sk, d = dk.shape
    return (dk_partial, dv_partial, dk, dv, sk * d, float(softmax_scale), hk, *dk.stride()[:3], *dv.stride()[:3],
            split, d, BLOCK)


def grid(batch: int, num_kv_heads: int, seqlen_k: int, head_dim: int) -> tuple[int, int, int]:
    """The launch grid of :func:`group_reduce` for outputs (batch, num_kv_heads, seqlen_k,
    head_dim)."""
    return (math.ceil(seqlen_k * head_dim / BLOCK), batch * num_kv_heads, 2)


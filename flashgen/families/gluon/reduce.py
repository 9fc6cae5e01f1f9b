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
def _sum_slabs(P, OUT, zh, pid, slab, scale, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """OUT[zh, e] = (sum over s in order of P[zh, s, e]) * scale in float32 for the BLOCK
    elements e of program ``pid``; P: (., SPLIT, slab), OUT: (., slab), both contiguous."""
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    keep = offs < slab
    src = P + zh.to(tl.int64) * SPLIT * slab + offs
    acc = tl.load(src, mask=keep, other=0.0).to(tl.float32)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(src + s * slab, mask=keep, other=0.0).to(tl.float32)
    tl.store(OUT + zh.to(tl.int64) * slab + offs, (acc * scale).to(OUT.dtype.element_ty), mask=keep)


@triton.jit
def group_reduce(DK_P, DV_P, DK, DV, slab, softmax_scale, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (cdiv(slab, BLOCK), z * hk, 2); slab = seqlen_k * head_dim.  Axis 2: 0 sums
    dK's partials (times softmax_scale), 1 dV's (times 1.0, exact)."""
    pid = tl.program_id(0)
    zh = tl.program_id(1)
    if tl.program_id(2) == 0:
        _sum_slabs(DK_P, DK, zh, pid, slab, softmax_scale, SPLIT, BLOCK)
    else:
        _sum_slabs(DV_P, DV, zh, pid, slab, 1.0, SPLIT, BLOCK)


def grid(batch: int, num_kv_heads: int, seqlen_k: int, head_dim: int) -> tuple[int, int, int]:
    """The launch grid of :func:`group_reduce` for outputs (batch, num_kv_heads, seqlen_k,
    head_dim)."""
    return (math.ceil(seqlen_k * head_dim / BLOCK), batch * num_kv_heads, 2)


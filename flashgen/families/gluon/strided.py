"""The Gluon backward's first and last pass for inputs and gradients of any layout.

The template's ``attn_bwd_preprocess`` reads O and dO, and its ``attn_bwd_convert``
writes dQ, as contiguous (batch, num_heads, seqlen_q, head_dim) tensors.  A caller whose
tensors are views of another memory order (transformers' attention hands flashgen
(batch, seqlen, heads, head_dim) tensors through ``transpose(1, 2)``; flashgen's forward
then writes O in that order too, :func:`flashgen.library.out_like`) would otherwise pay
a copy of O, one of dO and one of dQ per backward.  These two Triton kernels do the same
work with the tensors' strides instead:

* :func:`preprocess`: rows r of the padded (batch * num_heads, m_pad), bh = r // m_pad,
  m = r % m_pad: DELTA[r] = sum_d dO[bh, m, d] * O[bh, m, d] in float32, LSE2[r] =
  LSE[bh, m] * log2(e) (0 where LSE = -inf), both 0 for m >= seqlen_q; DQACC[bh, m, :] = 0
  (DQACC: float32, contiguous (batch, num_heads, seqlen_q, head_dim); LSE contiguous);
  with ``PADDED`` DQACC is (batch * num_heads, m_pad, head_dim) and every row of it is
  zeroed (the accumulator of a dq_stage "fragment" backward, whose convert is the
  template's own).
* :func:`convert`: DQ[z, h, m, :] = DQACC[z, h, m, :] * softmax_scale in DQ's dtype, DQ
  of any strides (last stride 1).
A padded head dim (96: the tiles are 128 wide, :func:`.bwd.tile_dim`) has a DQACC as wide
as the tiles (``D``) and O, dO and dQ of ``DG`` columns, which the loads and stores mask.

The same arithmetic as the template's kernels (float32 products summed over head_dim,
one multiply per dQ element), so the gradients do not depend on the layout beyond the
summation order of delta's reduction.  Plain Triton: they also run in Triton's
interpreter on CPU.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

#: Rows per program: 64 rows of 128 float32 at 4 warps is 64 values per thread.
ROWS = 64
NUM_WARPS = 4


@triton.jit
def preprocess(O, DO, LSE, LSE2, DELTA, DQACC, total_rows, num_heads, seqlen_q, m_pad,
               so_z, so_h, so_m, sdo_z, sdo_h, sdo_m, D: tl.constexpr, ROWS: tl.constexpr,
               PADDED: tl.constexpr, DG: tl.constexpr):
    """Grid (cdiv(batch * num_heads * m_pad, ROWS),); see the module docstring."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, D)
    rmask = rows < total_rows
    bh = rows // m_pad
    m = rows % m_pad
    valid = rmask & (m < seqlen_q)
    z = (bh // num_heads).to(tl.int64)
    hh = (bh % num_heads).to(tl.int64)
    m64 = m.to(tl.int64)
    keep = valid[:, None]
    # O and dO: DG columns (the tensors' head_dim); DQACC: D (its padded width)
    cols_g = (cols < DG)[None, :]
    o = tl.load(O + (z * so_z + hh * so_h + m64 * so_m)[:, None] + cols[None, :], mask=keep & cols_g, other=0.0)
    do = tl.load(DO + (z * sdo_z + hh * sdo_h + m64 * sdo_m)[:, None] + cols[None, :], mask=keep & cols_g,
                 other=0.0)
    tl.store(DELTA + rows, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=rmask)
    src = bh.to(tl.int64) * seqlen_q + m64
    lse = tl.load(LSE + src, mask=valid, other=0.0)
    tl.store(LSE2 + rows, tl.where(lse == float("-inf"), 0.0, lse * 1.4426950408889634), mask=rmask)
    if PADDED:  # DQACC (z * h, m_pad, D): every row, the padding too
        tl.store(DQACC + (rows.to(tl.int64) * D)[:, None] + cols[None, :], tl.zeros([ROWS, D], tl.float32),
                 mask=rmask[:, None])
    else:
        tl.store(DQACC + (src * D)[:, None] + cols[None, :], tl.zeros([ROWS, D], tl.float32), mask=keep)


@triton.jit
def convert(DQACC, DQ, total_rows, num_heads, seqlen_q, sdq_z, sdq_h, sdq_m, softmax_scale,
            D: tl.constexpr, ROWS: tl.constexpr, DG: tl.constexpr):
    """Grid (cdiv(batch * num_heads * seqlen_q, ROWS),); see the module docstring."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, D)
    keep = (rows < total_rows)[:, None]
    r64 = rows.to(tl.int64)
    m = r64 % seqlen_q
    bh = r64 // seqlen_q
    z = bh // num_heads
    hh = bh % num_heads
    acc = tl.load(DQACC + (r64 * D)[:, None] + cols[None, :], mask=keep, other=0.0)
    tl.store(DQ + (z * sdq_z + hh * sdq_h + m * sdq_m)[:, None] + cols[None, :],
             (acc * softmax_scale).to(DQ.dtype.element_ty), mask=keep & (cols < DG)[None, :])


@triton.jit
def varlen_preprocess(O, DO, LSE, LSE2, DELTA, DQACC, CU_Q, total_q, m_pad, so_t, so_h, sdo_t, sdo_h,
                      D: tl.constexpr, ROWS: tl.constexpr, DG: tl.constexpr):
    """The ragged-batch backward's first pass.  Grid (cdiv(max_seqlen_q, ROWS), num_seqs,
    num_heads): rows m < seqlen_q of sequence z and head hh, with q = CU_Q[z] and
    p = 4 * (q // 4 + z) (:func:`flashgen.families.gluon.bwd.varlen_row_starts`):
    DELTA[hh, p + m] = sum_d dO[q + m, hh, d] * O[q + m, hh, d] in float32,
    LSE2[hh, p + m] = LSE[hh, q + m] * log2(e) (0 where LSE = -inf), DQACC[0, hh, q + m, :]
    = 0.  O, DO packed (total_q, num_heads, DG), any row and head strides (last stride 1);
    LSE (num_heads, total_q) contiguous; LSE2, DELTA (num_heads, m_pad), zero elsewhere
    (the caller's); DQACC (1, num_heads, total_q, D) contiguous."""
    m = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    z = tl.program_id(1)
    hh = tl.program_id(2).to(tl.int64)
    q0 = tl.load(CU_Q + z)
    valid = m < tl.load(CU_Q + z + 1) - q0
    p0 = 4 * (q0 // 4 + z)
    rows = (q0 + m).to(tl.int64)
    cols = tl.arange(0, D)
    keep = valid[:, None] & (cols < DG)[None, :]
    o = tl.load(O + (rows * so_t + hh * so_h)[:, None] + cols[None, :], mask=keep, other=0.0)
    do = tl.load(DO + (rows * sdo_t + hh * sdo_h)[:, None] + cols[None, :], mask=keep, other=0.0)
    out = hh * m_pad + p0 + m
    tl.store(DELTA + out, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=valid)
    lse = tl.load(LSE + hh * total_q + rows, mask=valid, other=0.0)
    tl.store(LSE2 + out, tl.where(lse == float("-inf"), 0.0, lse * 1.4426950408889634), mask=valid)
    tl.store(DQACC + ((hh * total_q + rows) * D)[:, None] + cols[None, :], tl.zeros([ROWS, D], tl.float32),
             mask=valid[:, None])


def preprocess_launch(o, do, lse, lse2, delta, dqacc, m_pad: int, padded: bool = False):
    """(grid, args) of :func:`preprocess` for O, dO (batch, num_heads, seqlen_q, head_dim)
    of any strides with last stride 1; ``padded``: DQACC is (batch * num_heads, m_pad,
    head_dim) and zeroed whole."""
    b, h, sq, d = o.shape
    total = b * h * m_pad
    dt = dqacc.shape[-1]  # the accumulator's width: d, or d padded (DG = d)
    return (math.ceil(total / ROWS),), (o, do, lse, lse2, delta, dqacc, total, h, sq, m_pad,
                                         *o.stride()[:3], *do.stride()[:3], dt, ROWS, bool(padded), d)


def convert_launch(dqacc, dq, softmax_scale: float):
    """(grid, args) of :func:`convert` into ``dq`` (batch, num_heads, seqlen_q, head_dim),
    any strides with last stride 1."""
    b, h, sq, d = dq.shape
    total = b * h * sq
    dt = dqacc.shape[-1]
    return (math.ceil(total / ROWS),), (dqacc, dq, total, h, sq, *dq.stride()[:3], float(softmax_scale), dt, ROWS, d)


def varlen_preprocess_launch(o, do, lse, lse2, delta, dqacc, cu_seqlens_q, max_seqlen_q: int, m_pad: int):
    """(grid, args) of :func:`varlen_preprocess` for packed O, dO (total_q, num_heads,
    head_dim) and the int32 offsets cu_seqlens_q (num_seqs + 1,)."""
    tq, h, d = o.shape
    return (math.ceil(max_seqlen_q / ROWS), cu_seqlens_q.shape[0] - 1, h), \
        (o, do, lse, lse2, delta, dqacc, cu_seqlens_q, tq, m_pad, o.stride(0), o.stride(1), do.stride(0),
         do.stride(1), dqacc.shape[-1], ROWS, d)

"""Launcher of the Gluon (Hopper, sm_90) attention forward: tensors in, (O, LSE) out.

Same contract as :func:`flashgen.ops.fwd`: q (batch, num_heads, seqlen_q, head_dim),
k (batch, num_kv_heads, seqlen_k, head_dim), v (batch, num_kv_heads, seqlen_k,
head_dim_v), float16 or bfloat16, any strides a tensor descriptor accepts
(:func:`flashgen.ops.tma_ok`: last stride 1, the others multiples of 16 bytes, a 16-byte
aligned base); num_heads a multiple of num_kv_heads (GQA/MQA: query head h reads kv
head h // (num_heads // num_kv_heads)).  Returns O (batch, num_heads, seqlen_q,
head_dim_v) in q's dtype and LSE (batch, num_heads, seqlen_q) float32, natural log; a
row that sees no key gets O = 0 and LSE = -inf.  The mask is given as bounds on j - i
(:func:`flashgen.masks.mask_bounds`): query i sees key j iff diag_lo <= j - i <= diag_hi.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from ... import plans
from ...fastlaunch import launch
from ..triton.launch import tma_ok as _tma_ok
from .config import (
    GluonFwdConfig, GluonFwdSpec, GluonFwdVariant, check, default_config, longest_first_section, pad, walk_section,
)

LOG2E = 1.4426950408889634
_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
_SM_COUNT: dict[int, int] = {}


def unsupported(q, k, v, *, mask: str, config: GluonFwdConfig | None = None, out=None) -> str | None:
    """Why the Gluon forward cannot serve this call (None when it can): the reason names
    the argument and the rule, for ``explain`` and for the fallback to the Triton family."""
    from .shim import IMPORT_ERROR

    if IMPORT_ERROR is not None:
        return IMPORT_ERROR
    if not q.is_cuda:
        return "q is not on a CUDA device"
    cc = torch.cuda.get_device_capability(q.device)
    if cc[0] != 9:
        return f"the Gluon forward is built for sm_90 (wgmma, setmaxnreg); this GPU is sm_{cc[0]}{cc[1]}"
    if q.dtype not in _DTYPES:
        return f"q.dtype {q.dtype}: float16 or bfloat16"
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return f"k and v must have q's dtype {q.dtype} (got {k.dtype}, {v.dtype})"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "q, k, v must be 4-D (batch, heads, seqlen, head_dim)"
    b, h, _, d = q.shape
    if k.shape[0] != b or v.shape[0] != b or k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2] or k.shape[3] != d:
        return f"k {tuple(k.shape)} and v {tuple(v.shape)} do not match q {tuple(q.shape)}"
    if h % k.shape[1]:
        return f"num_heads {h} is not a multiple of num_kv_heads {k.shape[1]}"
    for name, t in (("q", q), ("k", k), ("v", v)) + ((("out", out),) if out is not None else ()):
        if not _tma_ok(t):
            return f"{name} (strides {t.stride()}) cannot be addressed by a tensor descriptor"
    spec = GluonFwdSpec(_DTYPES[q.dtype], d, v.shape[3], mask)
    why = _spec_why(spec) or check(GluonFwdVariant(spec, config or default_config(spec)))
    return "; ".join(why) if why else None


def _spec_why(spec: GluonFwdSpec) -> list[str]:
    from .config import HEAD_DIMS, MASKS

    why = []
    if spec.head_dim not in HEAD_DIMS or spec.head_dim_v not in HEAD_DIMS:
        why.append(f"head dims ({spec.head_dim}, {spec.head_dim_v}): the Gluon forward is built for {HEAD_DIMS}")
    if spec.mask not in MASKS:
        why.append(f"mask {spec.mask!r}: one of {MASKS}")
    return why


def _descriptor(t: torch.Tensor, rows: int, cols: int):
    from .shim import descriptor, nvmma_layout

    block = [1, 1, rows, cols]
    return descriptor(t, list(t.shape), list(t.stride()), block, nvmma_layout(block, _DTYPES[t.dtype]))


def _sm_count(device: torch.device) -> int:
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _SM_COUNT:
        _SM_COUNT[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _SM_COUNT[i]


def fwd(q, k, v, *, softmax_scale: float, mask: str, diag_lo: int, diag_hi: int,
        config: GluonFwdConfig | None = None, out=None, lse=None, check_inputs: bool = True, module=None,
        sinks=None, user=None):
    """O and LSE of softmax(q k^T * softmax_scale) v under the mask (see the module
    docstring for shapes and layout).  ``config``: the knobs (default:
    :func:`flashgen.families.gluon.config.default_config`).  ``out``/``lse``: buffers to
    write (e.g. NaN-poisoned by a test); ``lse`` must be contiguous float32.
    ``check_inputs=False`` skips :func:`unsupported` (the caller has run it).
    ``module``: the variant's loaded module when the caller holds it (skips the lookup).
    ``sinks``: float32 (num_heads,) contiguous on q's device, one more logit per head in
    every row's softmax denominator (the ``sinks`` variant; LSE includes it, a row that
    sees no key gets O = 0 and LSE = sinks[h]).  ``user``: the runtime arguments
    (:class:`flashgen.user_mods.UserArgs`) of user score/mask functions, compiled into
    the ``user`` variant of their lowering (``mask`` must then be the variant's mode:
    "window" with a mask function, :func:`.user.compiled_mask`; their sinks, if any,
    come as ``sinks``).

    Raises ValueError with the reason when the Gluon forward cannot serve the inputs."""
    key, inputs, uargs = None, (q, k, v, out, lse), ()
    if user is not None:
        # its arguments (fixed per function, sizes and tile) before the plan's lookup:
        # the tensors are the plan's inputs, the rest part of its key (flashgen.plans)
        config = config or default_config(GluonFwdSpec(_DTYPES[q.dtype], q.shape[3], v.shape[3], mask,
                                                       sinks=sinks is not None, user=user.name))
        uargs = tuple(user.gluon_fwd_args(softmax_scale, config.BLOCK_M * config.num_consumers, config.BLOCK_N))
    tail = ()
    if sinks is not None or user is not None:  # their tensors are inputs too, the rest in the key
        inputs, tail = plans.extend(inputs, ((sinks,) if sinks is not None else ()) + uargs, sinks is not None,
                                    *((user.name, tuple(user.sizes)) if user is not None else ()))
    key, bufs = plans.replay(_PLANS, inputs, config, module, mask, softmax_scale, diag_lo, diag_hi, check_inputs,
                             *tail)
    if bufs is not None:
        return bufs.get("out", out), bufs.get("lse", lse)
    if check_inputs:
        why = unsupported(q, k, v, mask=mask, config=config, out=out)
        if why:
            raise ValueError(f"gluon fwd: {why}")
    from .render import load

    b, h, sq, d = q.shape
    hk, sk, dv = k.shape[1], k.shape[2], v.shape[3]
    spec = GluonFwdSpec(_DTYPES[q.dtype], d, dv, mask, sinks=sinks is not None,
                        user=user.name if user is not None else "")
    config = config or default_config(spec)
    if out is None:
        out = torch.empty((b, h, sq, dv), dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    if sq == 0 or b * h == 0:
        return out, lse
    if sk == 0:  # no key at all: every row is empty (a descriptor cannot have a 0 extent)
        out.zero_()
        if sinks is None:
            lse.fill_(-math.inf)
        else:
            lse.copy_(sinks[None, :, None].expand(b, h, sq))
        return out, lse
    mod = module if module is not None else load(GluonFwdVariant(spec, config))
    rows = config.BLOCK_M
    num_m_blocks = -(-sq // (rows * config.num_consumers))
    num_tiles = num_m_blocks * b * h
    grid = (min(num_tiles, _sm_count(q.device) * config.ctas_per_sm) if config.persistent else num_tiles,)
    args = (
        _descriptor(q, rows, pad(d)), _descriptor(k, config.BLOCK_N, pad(d)), _descriptor(v, config.BLOCK_N, pad(dv)),
        _descriptor(out, rows, pad(dv)), lse, *(() if sinks is None else (sinks,)), softmax_scale * LOG2E,
        num_tiles, num_m_blocks, h, h // hk, sq, sk, diag_lo, diag_hi,
        *((walk_section(b * h, h // hk, sq, sk, pad(d), pad(dv), mask, diag_lo, diag_hi, rows * config.num_consumers,
                        config.BLOCK_N, grid[0], config.snake),) if config.persistent >= 2 and mask != "none"
          else (longest_first_section(b * h, h // hk, sk, pad(d), pad(dv)),) if config.longest_first and mask != "none"
          else ()),
        *uargs,
    )
    kernel = launch(mod.attn_fwd, grid, args, num_warps=mod.NUM_WARPS, maxnreg=mod.MAXNREG)
    if key is not None:
        plans.record_one(_PLANS, key, kernel, grid, args, inputs, {"out": out, "lse": lse})
    return out, lse


#: Launch plans of :func:`fwd` (:mod:`flashgen.plans`; sinks and a user variant's
#: tensors are inputs too, its other arguments part of the key), by config, module,
#: scalars, sizes, strides, dtypes, alignments, tensor identity and device.
_PLANS: dict = {}


def attention(q, k, v, *, causal: bool = False, window: tuple[int, int] = (-1, -1), softmax_scale: float | None = None,
              align: str = "bottom_right", config: GluonFwdConfig | None = None, out=None, lse=None):
    """:func:`fwd` with FlashAttention's mask conventions (:func:`flashgen.masks.mask_bounds`:
    bottom-right causal by default, ``window=(left, right)`` inclusive, -1 unbounded).
    softmax_scale defaults to head_dim ** -0.5."""
    from ...masks import mask_bounds

    mode, lo, hi = mask_bounds(q.shape[2], k.shape[2], causal=causal, window=window, align=align)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    return fwd(q, k, v, softmax_scale=scale, mask=mode, diag_lo=lo, diag_hi=hi, config=config, out=out, lse=lse)


def _packed_view(t: torch.Tensor) -> torch.Tensor:
    """A packed (total, heads, head_dim) tensor as (1, heads, total, head_dim): the 4-D
    form the forward's descriptors address (rows of one head are ``t.stride(0)`` apart)."""
    return t.permute(1, 0, 2).unsqueeze(0)


def _varlen_why(q, k, v, cu_seqlens_q, cu_seqlens_k) -> str | None:
    """Why packed q, k, v and their offsets are not what :func:`fwd_varlen` takes (the
    layout checks; :func:`unsupported` then checks the GPU, dtypes and head dims)."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        return (f"q, k, v must be 3-D (total, heads, head_dim), got shapes {tuple(q.shape)}, {tuple(k.shape)}, "
                f"{tuple(v.shape)}")
    if k.shape[:2] != v.shape[:2] or k.shape[2] != q.shape[2]:
        return (f"k {tuple(k.shape)} and v {tuple(v.shape)} must share (total_k, num_kv_heads), and k q's head_dim "
                f"{q.shape[2]}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        return f"num_heads {q.shape[1]} is not a multiple of num_kv_heads {k.shape[1]}"
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if t.dtype != torch.int32 or t.dim() != 1 or t.device != q.device:
            return (f"{name} must be a 1-D int32 tensor on q's device {q.device}, got {t.dtype} {tuple(t.shape)} "
                    f"on {t.device}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape or cu_seqlens_q.shape[0] < 1:
        return (f"cu_seqlens_q {tuple(cu_seqlens_q.shape)} and cu_seqlens_k {tuple(cu_seqlens_k.shape)} must both be "
                "(batch + 1,)")
    return None


#: The packed program layout of the varlen forward (``GluonFwdSpec.varlen_packed``) is
#: launched where it runs at most this fraction of the programs of one slot per query
#: block of the longest sequence.  Each packed program first searches cu_seqlens_q for
#: its sequence (a load of 128 offsets per step), which costs more than an idle program
#: at batches of short documents (290 documents of 16-96 tokens: 0.53-0.84x), while
#: removing idle programs pays at skewed batches (one document in ten long: 1.23-1.64x;
#: ``benchmarks/probe_varlen_grid.py``, docs/design.md).
VARLEN_PACKED_FRACTION = 0.5


def varlen_slots(total_q: int, batch: int, max_seqlen_q: int, block_rows: int) -> tuple[int, bool]:
    """(query block slots per head, packed) of the varlen forward's grid for programs of
    ``block_rows`` query rows: one slot per block of the longest sequence for each
    sequence, or packed (total_q // block_rows + batch slots, sequence z's blocks from
    cu_seqlens_q[z] // block_rows + z on, found by the kernel) where that launches at
    most :data:`VARLEN_PACKED_FRACTION` of the programs.  (0, False) when max_seqlen_q
    is 0 (no program)."""
    per_seq = -(-max_seqlen_q // block_rows)
    packed = total_q // block_rows + batch
    if per_seq > 0 and packed <= VARLEN_PACKED_FRACTION * per_seq * batch:
        return packed, True
    return per_seq * batch, False


@functools.lru_cache(maxsize=256)
def _varlen_spec(dtype: str, d: int, dv: int, mask: str) -> GluonFwdSpec:
    return GluonFwdSpec(dtype, d, dv, mask, varlen=True)


@functools.lru_cache(maxsize=256)
def _packed_module(spec: GluonFwdSpec, config: GluonFwdConfig):
    """The loaded packed twin (``varlen_packed``) of the varlen variant (spec, config)."""
    from .render import load

    return load(GluonFwdVariant(dataclasses.replace(spec, varlen_packed=True), config))


@functools.lru_cache(maxsize=1024)
def _checked(spec: GluonFwdSpec, config: GluonFwdConfig) -> str:
    """The broken rules of a variant, "" when it can be built (memoized: the launch path)."""
    return "; ".join(check(GluonFwdVariant(spec, config)))


def fwd_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *, softmax_scale: float,
               mask: str, win_left: int, win_right: int, config: GluonFwdConfig | None = None, out=None, lse=None,
               module=None, check_inputs: bool = True, layout: tuple[int, bool] | None = None):
    """O and LSE of a ragged batch, :func:`flashgen.ops.fwd_varlen`'s contract: q
    (total_q, num_heads, head_dim), k (total_k, num_kv_heads, head_dim), v (total_k,
    num_kv_heads, head_dim_v), float16 or bfloat16, last-dim stride 1 (a tensor whose
    other strides a descriptor cannot take is copied); cu_seqlens_q / cu_seqlens_k int32
    (batch + 1,) on q's device, the checked offsets of
    :func:`flashgen.api.attention_varlen`; max_seqlen_q / max_seqlen_k the longest
    sequences (they size the grid with total_q and the batch: :func:`varlen_slots`; 0:
    nothing to compute).  ``win_left`` / ``win_right``: the window per sequence,
    bottom-right aligned, -1 unbounded (causal: right 0), the mode ``mask``.
    ``config`` runs as its packed twin (``GluonFwdSpec.varlen_packed``, ignoring
    ``module``) where :func:`varlen_slots` takes the packed layout; ``layout``: its
    answer for these sizes and ``config`` when the caller has it (not computed again).
    Returns O (total_q, num_heads, head_dim_v) in q's dtype and LSE (num_heads,
    total_q) float32, natural log; a row that sees no key gets O = 0 and LSE = -inf.
    ``out`` / ``lse``: buffers to write, contiguous.  ``check_inputs=False`` skips
    :func:`unsupported` (the dispatcher has chosen the family for the inputs' key).

    Raises ValueError with the reason when the Gluon forward cannot serve the inputs."""
    from .render import load

    if check_inputs:
        why = _varlen_why(q, k, v, cu_seqlens_q, cu_seqlens_k)
        if why:
            raise ValueError(f"gluon fwd_varlen: {why}")
    # A descriptor needs 16-byte aligned row strides: a packed tensor of other strides is copied.
    q4, k4, v4 = (t4 if _tma_ok(t4) else _packed_view(t.contiguous()) for t in (q, k, v) for t4 in (_packed_view(t),))
    if check_inputs:
        why = unsupported(q4, k4, v4, mask=mask)
        if why:
            raise ValueError(f"gluon fwd_varlen: {why}")
    tq, h, d = q.shape
    hk, dv = k.shape[1], v.shape[2]
    batch = cu_seqlens_q.shape[0] - 1
    spec = _varlen_spec(_DTYPES[q.dtype], d, dv, mask)
    config = config or default_config(spec)
    why = _checked(spec, config)
    if why:
        raise ValueError("gluon fwd_varlen: " + why)
    if out is None:
        out = torch.empty((tq, h, dv), dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty((h, tq), dtype=torch.float32, device=q.device)
    slots, packed = layout or varlen_slots(tq, batch, max_seqlen_q, config.BLOCK_M * config.num_consumers)
    num_tiles = slots * h
    if num_tiles == 0 or tq == 0:
        return out, lse
    if k.shape[0] == 0:  # no key at all (a descriptor cannot have a 0 extent)
        out.zero_()
        lse.fill_(-math.inf)
        return out, lse
    if out.stride(2) != 1 or lse.stride() != (tq, 1):
        raise ValueError("gluon fwd_varlen: out needs a last-dim stride of 1 and lse must be contiguous (h, total_q)")
    if packed:  # its slots per head, and the sequences' count for the search
        mod = _packed_module(spec, config)
        tail = (batch,)
    else:  # the query blocks of the longest sequence
        mod = module if module is not None else load(GluonFwdVariant(spec, config))
        slots, tail = slots // batch, ()
    rows = config.BLOCK_M
    args = (
        _descriptor(q4, rows, pad(d)), _descriptor(k4, config.BLOCK_N, pad(d)), _descriptor(v4, config.BLOCK_N, pad(dv)),
        _descriptor(_packed_view(out), rows, pad(dv)), lse,
        softmax_scale * LOG2E, num_tiles, slots, h, h // hk, int(max_seqlen_q), int(max_seqlen_k),
        int(win_left), int(win_right), cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), *tail, out,
        out.stride(0), out.stride(1), tq,
    )
    launch(mod.attn_fwd, (num_tiles,), args, num_warps=mod.NUM_WARPS, maxnreg=mod.MAXNREG)
    return out, lse

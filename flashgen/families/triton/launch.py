"""The Triton family's kernel launchers: tensors in, tensors out, one TileConfig per kernel.

Also importable as :mod:`flashgen.ops` (the same module object).  No dispatching, no
autograd, no input validation beyond what the launch itself needs (that is
:mod:`flashgen.api`'s job).  Tensors are (batch, heads, seqlen, head_dim) with
any strides whose last is 1; LSE and delta are float32 (batch, heads, seqlen_q),
contiguous.  The optional ``out``/``lse``/``dq``... arguments let tests pass buffers
poisoned with NaN, to prove every element is written.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading

import torch

from ... import compile as _compile
from ... import plans
from ...fastlaunch import launch
from ...masks import decode_mask
from ...spec import KernelSpec, TileConfig, Variant, mods_name

_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
LOG2E = 1.4426950408889634


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES[dtype]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def tma_ok(t: torch.Tensor) -> bool:
    """Whether a tensor descriptor (TMA) can address ``t``: a 16-byte aligned base,
    last stride 1, every other stride a positive multiple of 16 bytes (CUDA's
    cuTensorMapEncodeTiled rules)."""
    es = t.element_size()
    return (t.data_ptr() % 16 == 0 and t.stride(-1) == 1
            and all(s > 0 and (s * es) % 16 == 0 for s in t.stride()[:-1]))


def _descriptor(t: torch.Tensor, block_rows: int, block_cols: int, shape=None, strides=None):
    """A 4-D descriptor of a (batch, heads, seqlen, head_dim) tensor whose box is one
    (block_rows, block_cols) tile of one (batch, head): reads past seqlen or head_dim
    return zeros.  ``shape``/``strides``: another view of ``t``'s storage (default
    its own)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    # TensorDescriptor's own checks (__post_init__: alignment, strides, rank) repeat
    # tma_ok, which every caller has passed; built without them it costs ~0.5 us
    # instead of ~2.3 us per descriptor (host time of every call).
    d = object.__new__(TensorDescriptor)
    d.__dict__.update(base=t, shape=list(t.shape) if shape is None else shape,
                      strides=list(t.stride()) if strides is None else strides,
                      block_shape=[1, 1, block_rows, block_cols], padding="zero")
    return d


def padded_row(n: int, element_size: int) -> int:
    """Elements in a row of ``n`` elements padded to a multiple of 16 bytes (the stride
    a tensor descriptor's rows need)."""
    return -(-n * element_size // 16) * 16 // element_size


def bias_tma_view(bias: torch.Tensor):
    """(shape, strides) of the 4-D descriptor that addresses ``bias`` (expanded to
    (batch, heads, seqlen_q, seqlen_k)) tile by tile, or None when none can (the kernel
    then loads it through pointers).

    A batch or head dim broadcast by stride 0 (or of size 1) gets extent 1 and a
    synthetic stride (the kernels read it at coordinate 0, ``bias_z``/``bias_h`` in
    ``templates/_common.j2``): the driver is never asked to encode a stride-0 dim,
    whose acceptance by ``cuTensorMapEncodeTiled`` is not documented.  Rows broadcast
    by stride 0 (a (batch, 1, 1, seqlen_k) key mask) would need a (1, BLOCK_N) box and
    other kernel code: pointer loads.  Otherwise :func:`tma_ok`'s rules: a 16-byte
    aligned base, last stride 1, the others positive multiples of 16 bytes."""
    es = bias.element_size()
    (b, h, sq, sk), (sz, sh, sm, sn) = bias.shape, bias.stride()
    if bias.data_ptr() % 16 or (sn != 1 and sk > 1) or 0 in bias.shape:
        return None
    if sq > 1 and (sm <= 0 or (sm * es) % 16):
        return None
    rows = sm if sq > 1 else padded_row(sk, es)
    plane = rows * sq
    ext_h, st_h = (h, sh) if h > 1 and sh != 0 else (1, plane)
    ext_z, st_z = (b, sz) if b > 1 and sz != 0 else (1, st_h * ext_h)
    if any(s <= 0 or (s * es) % 16 for s in (st_h, st_z)):
        return None
    return [ext_z, ext_h, sq, sk], [st_z, st_h, rows, 1]


def bias_descriptor(bias: torch.Tensor, block_m: int, block_n: int, view=False):
    """The descriptor of :func:`bias_tma_view` with a (block_m, block_n) box (zeros
    past seqlen_q / seqlen_k), or None where no descriptor addresses ``bias``.
    ``view``: that view when the caller has it (ScoreMods computes it once per call)."""
    view = bias_tma_view(bias) if view is False else view
    return None if view is None else _descriptor(bias, block_m, block_n, *view)


@dataclasses.dataclass(frozen=True)
class ScoreMods:
    """The runtime arguments of the score modifications (:data:`flashgen.spec.MODS`).

    softcap: > 0 caps the scores (0: off).  alibi: float32 slopes, (num_heads,) or
    (batch, num_heads) (None: off).  bias: an additive tensor expanded to (batch,
    num_heads, seqlen_q, seqlen_k) (stride 0 where broadcast), any float dtype, read as
    float32 (None: off).  dropout_p in [0, 1) with rng, an int64 (2,) [seed, offset]
    tensor on the device (the kernels read it; 0: off).  The caller has checked them
    (:func:`flashgen.api.attention`)."""

    softcap: float = 0.0
    alibi: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    dropout_p: float = 0.0
    rng: torch.Tensor | None = None

    @functools.cached_property
    def bias_view(self):
        """:func:`bias_tma_view` of the bias, computed once for the call's launches."""
        return bias_tma_view(self.bias)

    @property
    def name(self) -> str:
        """The KernelSpec ``mods`` these arguments compile."""
        return mods_name(softcap=self.softcap > 0, alibi=self.alibi is not None, bias=self.bias is not None,
                         dropout=self.dropout_p > 0)

    def kernel_args(self, softmax_scale: float, with_scale: bool, mod=None, config: TileConfig | None = None) -> list:
        """The extra kernel arguments, in the order of ``_common.j2``'s
        ``mod_kernel_params``.  A tma module ``mod`` (tiles of ``config``) with a bias
        takes it through a descriptor when one addresses it (:func:`bias_tma_view`),
        and the constexpr BIAS_TMA saying which."""
        name = self.name
        out: list = []
        if with_scale and (self.softcap > 0 or self.alibi is not None or self.bias is not None):
            out.append(softmax_scale)
        if self.softcap > 0:
            out.append(float(self.softcap))
        if self.alibi is not None:
            a = self.alibi
            out += [a, a.stride(0) if a.dim() == 2 else 0, a.stride(-1)]
        if self.bias is not None:
            if mod is not None and mod.TMA:
                desc = bias_descriptor(self.bias, config.BLOCK_M, config.BLOCK_N, self.bias_view)
                out += [self.bias if desc is None else desc, *self.bias.stride(), desc is not None]
            else:
                out += [self.bias, *self.bias.stride()]
        if "dropout" in name:
            out += [self.rng, float(self.dropout_p)]
        return out


def _mods_of(mods: "ScoreMods | None") -> str:
    return mods.name if mods is not None else ""


def _plan_args(mods, softmax_scale: float, with_scale: bool, config: TileConfig, kernel: str) -> tuple | None:
    """A launch's arguments after the bounds where its calls may keep a launch plan: ()
    without score modifications, a user variant's (``plannable``: tensors and values
    fixed per function, sizes and tile, :mod:`flashgen.plans`), None for the built-in
    modifications (dropout draws its seed per call) and their own path."""
    if mods is None:
        return ()
    if not getattr(mods, "plannable", False):
        return None
    return tuple(mods.kernel_args(softmax_scale, with_scale, config=config, kernel=kernel))


def _plan_inputs(inputs: tuple, mods, margs: tuple) -> tuple[tuple, tuple]:
    """(a plan's inputs, the key's values after the launcher's own): without score
    modifications ``inputs`` and nothing; with a user variant's arguments ``margs``
    (:func:`_plan_args`) also their tensors, and its name, sizes and other values."""
    if mods is None:
        return inputs, ()
    return plans.extend(inputs, margs, mods.name, mods.sizes)


def _module_and_streamed(kernel: str, dtype, d: int, dv: int, mask: str, config: TileConfig, module,
                         a, b, rows: int, checked: bool, mods: str = ""):
    """(config, loaded module, a_arg, b_arg) for a launch whose streamed tiles are ``a``
    (head dim d) and ``b`` (head dim dv), ``rows`` rows per tile: descriptors for a tma
    module, the tensors themselves otherwise.  A tma config whose a or b no descriptor
    can address (``checked`` False and :func:`tma_ok` fails) becomes the same tiles on
    pointer loads."""
    if config.tma and not (checked or (tma_ok(a) and tma_ok(b))):
        config, module = dataclasses.replace(config, tma=0), None
    mod = module or _compile.load(Variant(KernelSpec(kernel, dtype_name(dtype), d, dv, mask, mods), config))
    if mod.TMA:
        return config, mod, _descriptor(a, rows, mod.D_PAD.value), _descriptor(b, rows, mod.DV_PAD.value)
    return config, mod, a, b


def fwd(q, k, v, *, softmax_scale: float, mask: str, diag_lo: int, diag_hi: int,
        config: TileConfig, out=None, lse=None, module=None, addressable: bool = False,
        mods: ScoreMods | None = None):
    """O (batch, heads, seqlen_q, head_dim_v) in q's dtype and LSE (batch, heads,
    seqlen_q) float32, natural log.  ``module``: the loaded module of this variant, when
    the caller already holds it (skips building the Variant and the load lookup).

    A config with ``tma`` whose K or V a tensor descriptor cannot address (see
    :func:`tma_ok`: an unaligned slice, expanded heads) runs the same tiles with
    pointer loads instead.  ``addressable=True``: the caller has established that q, k
    and v are (their ProblemKey layout is ""), so the check is skipped.  ``mods``: the
    score modifications' arguments (the variant compiled with ``mods.name``).

    A config with ``num_splits`` >= 1 is the decode kernel's: the forward runs in its
    flash-decoding form (:func:`flashgen.library.decode_form`), ``module`` the decode
    kernel's, k and v a full cache of seqlen_k keys (:func:`_fwd_decode_form`)."""
    if config.num_splits:
        return _fwd_decode_form(q, k, v, softmax_scale, mask, config, out, lse, module)
    key, inputs = None, (q, k, v, out, lse)
    margs = _plan_args(mods, softmax_scale, True, config, "fwd")
    if margs is not None:
        inputs, tail = _plan_inputs(inputs, mods, margs)
        key, bufs = plans.replay(_FWD_PLANS, inputs, config, module, mask, softmax_scale, diag_lo, diag_hi,
                                 addressable, *tail)
        if bufs is not None:
            return bufs.get("out", out), bufs.get("lse", lse)
    b, h, sq, d = q.shape
    hk, sk, dv = k.shape[1], k.shape[2], v.shape[3]
    config, mod, k_arg, v_arg = _module_and_streamed("fwd", q.dtype, d, dv, mask, config, module, k, v,
                                                     config.BLOCK_N, addressable, _mods_of(mods))
    if out is None:
        out = torch.empty((b, h, sq, dv), dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    num_m_blocks = _cdiv(sq, config.BLOCK_M)
    grid = (num_m_blocks * b * h,)
    args = (
        q, k_arg, v_arg, out, lse, softmax_scale * LOG2E,
        *q.stride()[:3],
        *k.stride()[:3],
        *v.stride()[:3],
        *out.stride()[:3],
        h, h // hk, sq, sk, num_m_blocks, diag_lo, diag_hi,
        *(margs if margs is not None else mods.kernel_args(softmax_scale, True, mod, config)),
    )
    kernel = launch(mod.attn_fwd, grid, args, num_warps=mod.NUM_WARPS, num_stages=mod.NUM_STAGES)
    _record(mod, kernel)
    if key is not None:
        plans.record_one(_FWD_PLANS, key, kernel, grid, args, inputs, {"out": out, "lse": lse})
    return out, lse


def _fwd_decode_form(q, k, v, softmax_scale, mask, config, out, lse, module):
    """O (batch, heads, seqlen_q, head_dim_v) and LSE of the dense forward by the decode
    kernel (:func:`decode`) over q seen as (batch, seqlen_q, heads, head_dim) and k, v as
    a contiguous cache of seqlen_k keys (every batch entry's length seqlen_k); ``mask``
    "causal" is bottom-right (:func:`flashgen.library.decode_form`).  O is written
    through its strides (default: contiguous, as :func:`fwd` allocates it).

    One launch plan per key of q, k, v, out, lse (``_FORM_PLANS``), recorded with the
    transposed views the decode kernel reads, each replayed as the tensor it views (the
    kernels read the same address) and the kept lengths tensor (:func:`_lengths`) held
    by the plan: a replay makes no view and builds no nine-tensor key."""
    inputs = (q, k, v, out, lse)
    key, bufs = plans.replay(_FORM_PLANS, inputs, config, module, mask, softmax_scale)
    if bufs is not None:
        return bufs.get("out", out), bufs.get("lse", lse)
    b, h, sq, _ = q.shape
    dv = v.shape[3]
    if out is None:
        out = torch.empty((b, h, sq, dv), dtype=q.dtype, device=q.device)
    lens = _lengths(b, q.device)
    if key is not None and _LENGTHS.get(q.device) is not lens:  # a capture's own lengths: not kept
        plans.taint()
        key = None
    rec = plans.Recorder() if key is not None else None
    views = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), out.transpose(1, 2))
    _, lse, o_part, lse_part = _decode_launches(*views[:3], lens, None, softmax_scale,
                                                decode_mask(mask == "causal", sq), config, views[3], lse, None,
                                                None, module, rec)
    if rec is not None:
        plans.record_outputs(_FORM_PLANS, key, rec, inputs,
                             {"out": out, "lse": lse, "o_part": o_part, "lse_part": lse_part},
                             views=tuple(zip(views, (q, k, v, out))), kept=(lens,))
    return out, lse


#: Per device, the decode form's cache lengths (:func:`_lengths`).
_LENGTHS: dict = {}
#: The lengths tensors a larger one replaced, kept alive: a CUDA graph captured earlier
#: may read one (a plan holds its own, but with plans off nothing else would).
_LENGTHS_RETIRED: list = []
_LENGTHS_LOCK = threading.Lock()


def _lengths(batch: int, device) -> torch.Tensor:
    """An int32 tensor of ``batch`` (or more) entries, each the int32 maximum, on
    ``device``: the decode form's ``cache_seqlens``, which the decode kernel clamps to
    the cache's capacity (seqlen_k).  One per device, made once and grown (at least
    doubled) when a larger batch comes, never written after and never freed (a graph
    captured with an earlier one still reads it), so repeated calls pass the same tensor
    and replay their plan instead of filling one per call.  During CUDA-graph capture a tensor made
    now would live in the graph's pool: a fresh one is made and not kept."""
    t = _LENGTHS.get(device)
    if t is not None and t.numel() >= batch:
        return t
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.full((batch,), 2 ** 31 - 1, dtype=torch.int32, device=device)
    with _LENGTHS_LOCK:
        t = _LENGTHS.get(device)
        if t is None or t.numel() < batch:
            if t is not None:
                _LENGTHS_RETIRED.append(t)
            t = torch.full((max(batch, 64, 2 * (t.numel() if t is not None else 0)),), 2 ** 31 - 1,
                           dtype=torch.int32, device=device)
            if device.type == "cuda":  # filled before any stream reads it
                torch.cuda.synchronize(device)
            _LENGTHS[device] = t
    return t


def bwd_dq(do, q, k, v, o, lse, *, softmax_scale: float, mask: str, diag_lo: int, diag_hi: int,
           config: TileConfig, dq=None, delta=None, module=None, addressable: bool = False,
           mods: ScoreMods | None = None):
    """dQ (q's shape and dtype) and delta = rowsum(dO * O) (float32, like lse)."""
    key, inputs = None, (q, k, v, o, do, lse, dq, delta)
    margs = _plan_args(mods, softmax_scale, False, config, "bwd_dq")
    if margs is not None:
        inputs, tail = _plan_inputs(inputs, mods, margs)
        key, bufs = plans.replay(_DQ_PLANS, inputs, config, module, mask, softmax_scale, diag_lo, diag_hi,
                                 addressable, *tail)
        if bufs is not None:
            return bufs.get("dq", dq), bufs.get("delta", delta)
    b, h, sq, d = q.shape
    hk, sk, dvd = k.shape[1], k.shape[2], v.shape[3]
    config, mod, k_arg, v_arg = _module_and_streamed("bwd_dq", q.dtype, d, dvd, mask, config, module, k, v,
                                                     config.BLOCK_N, addressable, _mods_of(mods))
    dq = torch.empty_like(q) if dq is None else dq
    delta = torch.empty_like(lse) if delta is None else delta
    num_m_blocks = _cdiv(sq, config.BLOCK_M)
    grid = (num_m_blocks * b * h,)
    args = (
        q, k_arg, v_arg, o, do, dq, lse, delta, softmax_scale * LOG2E, softmax_scale,
        *q.stride()[:3],
        *k.stride()[:3],
        *v.stride()[:3],
        *o.stride()[:3],
        *do.stride()[:3],
        *dq.stride()[:3],
        h, h // hk, sq, sk, num_m_blocks, diag_lo, diag_hi,
        *(margs if margs is not None else mods.kernel_args(softmax_scale, False, mod, config)),
    )
    kernel = launch(mod.attn_bwd_dq, grid, args, num_warps=mod.NUM_WARPS, num_stages=mod.NUM_STAGES)
    _record(mod, kernel)
    if key is not None:
        plans.record_one(_DQ_PLANS, key, kernel, grid, args, inputs, {"dq": dq, "delta": delta})
    return dq, delta


def bwd_dkdv(do, q, k, v, lse, delta, *, softmax_scale: float, mask: str, diag_lo: int, diag_hi: int,
             config: TileConfig, dk=None, dv=None, module=None, addressable: bool = False,
             mods: ScoreMods | None = None):
    """dK, dV (k's and v's shapes; summed over each GQA group).  Reads delta."""
    key, inputs = None, (q, k, v, do, lse, delta, dk, dv)
    margs = _plan_args(mods, softmax_scale, False, config, "bwd_dkdv")
    if margs is not None:
        inputs, tail = _plan_inputs(inputs, mods, margs)
        key, bufs = plans.replay(_DKDV_PLANS, inputs, config, module, mask, softmax_scale, diag_lo, diag_hi,
                                 addressable, *tail)
        if bufs is not None:
            return bufs.get("dk", dk), bufs.get("dv", dv)
    b, h, sq, d = q.shape
    hk, sk, dvd = k.shape[1], k.shape[2], v.shape[3]
    # ``addressable`` vouches for q, not for dO
    checked = addressable and (not config.tma or tma_ok(do))
    config, mod, q_arg, do_arg = _module_and_streamed("bwd_dkdv", q.dtype, d, dvd, mask, config, module, q, do,
                                                      config.BLOCK_M, checked, _mods_of(mods))
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    num_n_blocks = _cdiv(sk, config.BLOCK_N)
    grid = (num_n_blocks * b * hk,)
    args = (
        q_arg, k, v, do_arg, dk, dv, lse, delta, softmax_scale * LOG2E, softmax_scale,
        *q.stride()[:3],
        *k.stride()[:3],
        *v.stride()[:3],
        *do.stride()[:3],
        *dk.stride()[:3],
        *dv.stride()[:3],
        h, h // hk, sq, sk, num_n_blocks, diag_lo, diag_hi,
        *(margs if margs is not None else mods.kernel_args(softmax_scale, False, mod, config)),
    )
    kernel = launch(mod.attn_bwd_dkdv, grid, args, num_warps=mod.NUM_WARPS, num_stages=mod.NUM_STAGES)
    _record(mod, kernel)
    if key is not None:
        plans.record_one(_DKDV_PLANS, key, kernel, grid, args, inputs, {"dk": dk, "dv": dv})
    return dk, dv


#: Launch plans of :func:`fwd`, :func:`bwd_dq`, :func:`bwd_dkdv` and :func:`decode` (its
#: split kernel and combine kernel as one plan), one table each (:mod:`flashgen.plans`;
#: with a user variant, its tensors are inputs too and its other arguments part of the
#: key; not with the built-in score modifications, :func:`_plan_args`), by config,
#: module, scalars, sizes, strides, dtypes, alignments and device.
_FWD_PLANS: dict = {}
_DQ_PLANS: dict = {}
_DKDV_PLANS: dict = {}
_DECODE_PLANS: dict = {}
#: Launch plans of the dense forward's flash-decoding form (:func:`_fwd_decode_form`).
_FORM_PLANS: dict = {}


def bwd(do, q, k, v, o, lse, *, softmax_scale: float, mask: str, diag_lo: int, diag_hi: int,
        config_dq: TileConfig, config_dkdv: TileConfig, dq=None, dk=None, dv=None, delta=None,
        module_dq=None, module_dkdv=None, addressable: bool = False, mods: ScoreMods | None = None):
    """dQ, dK, dV (shapes of q, k, v; dK and dV summed over each GQA group).

    Two launches: ``bwd_dq`` (also writes delta = rowsum(dO * O), float32) and then
    ``bwd_dkdv``, which reads delta.  Both recompute P from Q, K and the LSE.
    ``addressable``: as in :func:`fwd` (dO is still checked).
    """
    kw = dict(softmax_scale=softmax_scale, mask=mask, diag_lo=diag_lo, diag_hi=diag_hi, addressable=addressable,
              mods=mods)
    dq, delta = bwd_dq(do, q, k, v, o, lse, config=config_dq, dq=dq, delta=delta, module=module_dq, **kw)
    dk, dv = bwd_dkdv(do, q, k, v, lse, delta, config=config_dkdv, dk=dk, dv=dv, module=module_dkdv, **kw)
    return dq, dk, dv


# -- ragged batches (varlen): packed (total, heads, head_dim) tensors --------------------
#
# cu_seqlens_q/k: int32 (batch + 1,) offsets of each sequence's rows; max_seqlen_q/k
# size the grid (programs past a sequence's length exit).  win_left/win_right: the
# window sizes per sequence, bottom-right aligned (-1 = unbounded; causal is right = 0);
# the mask mode says which of them the kernel reads.  LSE and delta are float32
# (heads, total_q), contiguous.

def fwd_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
               softmax_scale: float, mask: str, win_left: int, win_right: int, config: TileConfig,
               out=None, lse=None, module=None):
    """O (total_q, heads, head_dim_v) in q's dtype and LSE (heads, total_q) float32."""
    tq, h, d = q.shape
    hk, dv = k.shape[1], v.shape[2]
    batch = cu_seqlens_q.shape[0] - 1
    mod = module or _compile.load(Variant(KernelSpec("fwd_varlen", dtype_name(q.dtype), d, dv, mask), config))
    if out is None:
        out = torch.empty((tq, h, dv), dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty((h, tq), dtype=torch.float32, device=q.device)
    num_m_blocks = _cdiv(max_seqlen_q, config.BLOCK_M)
    grid = (num_m_blocks * batch * h,)
    if grid[0] == 0:
        return out, lse
    _record(mod, launch(mod.attn_fwd_varlen, grid, (
        q, k, v, out, lse, cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), softmax_scale * LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        h, h // hk, tq, num_m_blocks, win_left, win_right,
    ), num_warps=mod.NUM_WARPS, num_stages=mod.NUM_STAGES))
    return out, lse


def bwd_dq_varlen(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
                  softmax_scale: float, mask: str, win_left: int, win_right: int, config: TileConfig,
                  dq=None, delta=None, module=None):
    """dQ (q's shape and dtype) and delta = rowsum(dO * O) (float32, like lse)."""
    tq, h, d = q.shape
    hk, dvd = k.shape[1], v.shape[2]
    batch = cu_seqlens_q.shape[0] - 1
    mod = module or _compile.load(Variant(KernelSpec("bwd_dq_varlen", dtype_name(q.dtype), d, dvd, mask), config))
    dq = torch.empty_like(q) if dq is None else dq
    delta = torch.empty_like(lse) if delta is None else delta
    num_m_blocks = _cdiv(max_seqlen_q, config.BLOCK_M)
    grid = (num_m_blocks * batch * h,)
    if grid[0] == 0:
        return dq, delta
    _record(mod, launch(mod.attn_bwd_dq_varlen, grid, (
        q, k, v, o, do, dq, lse, delta, cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), softmax_scale * LOG2E, softmax_scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        o.stride(0), o.stride(1), do.stride(0), do.stride(1), dq.stride(0), dq.stride(1),
        h, h // hk, tq, num_m_blocks, win_left, win_right,
    ), num_warps=mod.NUM_WARPS, num_stages=mod.NUM_STAGES))
    return dq, delta


def bwd_dkdv_varlen(do, q, k, v, lse, delta, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                    *, softmax_scale: float, mask: str, win_left: int, win_right: int, config: TileConfig,
                    dk=None, dv=None, module=None):
    """dK, dV (k's and v's shapes; summed over each GQA group).  Reads delta.  Rows of
    K/V that belong to no sequence (past cu_seqlens_k[-1]) are not written."""
    tq, h, d = q.shape
    hk, dvd = k.shape[1], v.shape[2]
    batch = cu_seqlens_q.shape[0] - 1
    mod = module or _compile.load(Variant(KernelSpec("bwd_dkdv_varlen", dtype_name(q.dtype), d, dvd, mask), config))
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    num_n_blocks = _cdiv(max_seqlen_k, config.BLOCK_N)
    grid = (num_n_blocks * batch * hk,)
    if grid[0] == 0:
        return dk, dv
    _record(mod, launch(mod.attn_bwd_dkdv_varlen, grid, (
        q, k, v, do, dk, dv, lse, delta, cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), softmax_scale * LOG2E, softmax_scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        do.stride(0), do.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
        h, h // hk, tq, num_n_blocks, win_left, win_right,
    ), num_warps=mod.NUM_WARPS, num_stages=mod.NUM_STAGES))
    return dk, dv


def bwd_varlen(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
               softmax_scale: float, mask: str, win_left: int, win_right: int, config_dq: TileConfig,
               config_dkdv: TileConfig, dq=None, dk=None, dv=None, delta=None, module_dq=None, module_dkdv=None):
    """dQ, dK, dV of a varlen forward: ``bwd_dq_varlen`` (writes delta), then
    ``bwd_dkdv_varlen`` (reads it)."""
    kw = dict(softmax_scale=softmax_scale, mask=mask, win_left=win_left, win_right=win_right)
    seqs = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    dq, delta = bwd_dq_varlen(do, q, k, v, o, lse, *seqs, config=config_dq, dq=dq, delta=delta,
                              module=module_dq, **kw)
    dk, dv = bwd_dkdv_varlen(do, q, k, v, lse, delta, *seqs, config=config_dkdv, dk=dk, dv=dv,
                             module=module_dkdv, **kw)
    return dq, dk, dv


#: The compiled kernel of each loaded module, set at its first launch (for the
#: compiler's report: shared memory, registers, spills).
compiled: dict[str, object] = {}


def _record(mod, kernel) -> None:
    if mod.VARIANT_ID not in compiled and kernel is not None:
        compiled[mod.VARIANT_ID] = kernel


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


# -- decode with a KV cache (flash-decoding) ---------------------------------------------
#
# q (batch, seqlen_q, heads, d); a contiguous cache k (batch, seqlen_cache, kv_heads, d),
# v (batch, seqlen_cache, kv_heads, dv), or a paged one k (num_pages, page_size,
# kv_heads, d), v (num_pages, page_size, kv_heads, dv) with block_table int32 (batch,
# max_pages); cache_seqlens int32 (batch,).  Any strides whose last is 1.  O is (batch,
# seqlen_q, heads, dv) in q's dtype, LSE (batch, heads, seqlen_q) float32.

def decode_partials(batch: int, num_heads: int, seqlen_q: int, head_dim_v: int, num_splits: int, device):
    """Float32 buffers for the splits' partial O (num_splits, rows, dv) and LSE
    (num_splits, rows), rows = batch * heads * seqlen_q (None, None for one split)."""
    if num_splits <= 1:
        return None, None
    rows = batch * num_heads * seqlen_q
    return (torch.empty((num_splits, rows, head_dim_v), dtype=torch.float32, device=device),
            torch.empty((num_splits, rows), dtype=torch.float32, device=device))


def decode(q, k_cache, v_cache, cache_seqlens, block_table=None, *, softmax_scale: float, mask: str,
           config: TileConfig, out=None, lse=None, o_part=None, lse_part=None, module=None):
    """O and LSE of decode attention over the cache (see the section comment).  The split
    kernel runs on (batch * kv_heads * row blocks * num_splits) programs; with more than
    one split the partials (``o_part``/``lse_part``, allocated when None) are merged by
    the combine kernel.  Needs softmax_scale > 0."""
    inputs = (q, k_cache, v_cache, cache_seqlens, block_table, out, lse, o_part, lse_part)
    key, bufs = plans.replay(_DECODE_PLANS, inputs, config, module, mask, softmax_scale)
    if bufs is not None:
        return bufs.get("out", out), bufs.get("lse", lse)
    rec = plans.Recorder() if key is not None else None
    out, lse, o_part, lse_part = _decode_launches(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale,
                                                  mask, config, out, lse, o_part, lse_part, module, rec)
    if rec is not None:
        plans.record_outputs(_DECODE_PLANS, key, rec, inputs,
                             {"out": out, "lse": lse, "o_part": o_part, "lse_part": lse_part})
    return out, lse


def _decode_launches(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, mask, config, out, lse,
                     o_part, lse_part, module, rec):
    """:func:`decode`'s launches (the split kernel, then with more than one split the
    combine kernel), each added to ``rec`` when it is a Recorder; returns (out, lse,
    o_part, lse_part), the buffers it allocated where None was given."""
    b, sq, h, d = q.shape
    paged = block_table is not None
    hk, dv = k_cache.shape[2], v_cache.shape[3]
    kernel = "decode_paged" if paged else "decode"
    mod = module or _compile.load(Variant(KernelSpec(kernel, dtype_name(q.dtype), d, dv, mask), config))
    if out is None:
        out = torch.empty((b, sq, h, dv), dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    splits = mod.NUM_SPLITS
    if splits > 1 and (o_part is None or lse_part is None):
        o_part, lse_part = decode_partials(b, h, sq, dv, splits, q.device)
    if b == 0 or sq == 0 or h == 0:
        plans.taint()
        return out, lse, o_part, lse_part
    group = h // hk
    num_m_blocks = _cdiv(group * sq, config.BLOCK_M)
    if paged:
        page_size = k_cache.shape[1]
        capacity = block_table.shape[1] * page_size
        kb = vb = 0
        kp, kn, kh = k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)
        vp, vn, vh = v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)
        bt, stride_bt = block_table, block_table.stride(0)
    else:
        page_size, capacity = 1, k_cache.shape[1]
        kb, kn, kh, kp = *k_cache.stride()[:3], 0
        vb, vn, vh, vp = *v_cache.stride()[:3], 0
        bt, stride_bt = cache_seqlens, 0  # not read
    rows = b * h * sq
    op = out if o_part is None else o_part
    lp = lse if lse_part is None else lse_part
    grid = (b * hk * num_m_blocks * splits,)
    args = (
        q, k_cache, v_cache, cache_seqlens, bt, out, lse, op, lp, softmax_scale * LOG2E,
        *q.stride()[:3],
        kb, kp, kn, kh, vb, vp, vn, vh, stride_bt,
        *out.stride()[:3],
        h, hk, group, sq, capacity, num_m_blocks, page_size, rows,
    )
    kernel = launch(mod.attn_decode, grid, args, num_warps=mod.NUM_WARPS, num_stages=mod.NUM_STAGES)
    _record(mod, kernel)
    if rec is not None:
        rec.add(kernel, grid, args)
    if splits > 1:
        grid = (_cdiv(rows, mod.COMBINE_ROWS),)
        args = (o_part, lse_part, out, lse, *out.stride()[:3], h, sq, rows)
        kernel = launch(mod.attn_decode_combine, grid, args, num_warps=mod.COMBINE_WARPS, num_stages=1)
        if rec is not None:
            rec.add(kernel, grid, args)
    return out, lse, o_part, lse_part

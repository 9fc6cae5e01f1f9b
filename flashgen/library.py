"""flashgen's attention as torch.library custom ops, and their real implementations.

Two ops (namespace ``flashgen``), so that ``torch.compile(fullgraph=True)`` sees one
opaque node per direction and never breaks the graph:

``torch.ops.flashgen.fwd(q, k, v, scale, mask, lo, hi) -> (O, LSE)``
    q (b, h, sq, d), k (b, hk, sk, d), v (b, hk, sk, dv), last-dim stride 1 (the caller
    makes it so); ``mask``/``lo``/``hi`` from :func:`flashgen.masks.mask_bounds` (query
    i sees key j iff lo <= j - i <= hi).  O is (b, h, sq, dv) in q's dtype and LSE
    (b, h, sq) float32, both freshly allocated and contiguous: the fake (meta)
    implementation returns exactly those shapes and strides.
``torch.ops.flashgen.bwd(do, q, k, v, o, lse, scale, mask, lo, hi) -> (dQ, dK, dV)``
    ``torch.empty_like`` of q, k and v (their strides where dense, as the fake says).

Autograd is wired with ``torch.library.register_autograd``: the forward saves q, k, v,
O and LSE; LSE is not differentiable.

What the real implementation runs, by input:

* batch, heads, seqlen_q or seqlen_k of 0: nothing is launched; O = 0, LSE = -inf and
  the gradients are 0.
* CUDA tensors (or any tensors with ``TRITON_INTERPRET=1``): the generated kernels of
  the dispatcher's kernel family and TileConfig, launched by that family's launcher
  (:mod:`flashgen.families`) on the inputs' device (cuda:1 inputs run on cuda:1 whatever
  the current device is).

The path of a call is one-way: :mod:`flashgen.api` (checks) -> this module (the op,
autograd) -> :mod:`flashgen.dispatch` (ProblemKey -> family + TileConfig) -> the family's
launcher -> kernel.  The decode op's implementation (:func:`kvcache_forward`) lives here
too, so nothing here imports :mod:`flashgen.api`.
* CPU tensors otherwise: the reference path, float32 math with the same mask and LSE
  conventions (:func:`reference_forward`), outputs cast to the input dtype.

The kernels scale the masked (-inf) scores too, so they are launched with scale > 0: a
negative scale runs as ``|scale|`` with q negated (dQ negated back), scale 0 (uniform
attention) as scale 1 with q = 0 (dQ = 0).
"""

import math
from typing import Optional

import torch
import torch.autograd.forward_ad as _fwad
from torch import Tensor

from . import dispatch, families, fastlaunch, ops, reference
from .errors import LaunchLimitError, UnsupportedError
from .masks import decode_mask
from .spec import KernelSpec, ProblemKey, Variant, is_user_mods


#: Entries of a per-call memo table before it is emptied and refilled.
FAST_TABLE_MAX = 4096


def interpreting() -> bool:
    """Whether Triton's interpreter runs the kernels (``TRITON_INTERPRET`` set, not 0)."""
    return fastlaunch.interpreting()


#: Whether a functorch transform (vmap's batched tensors) is active.
functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: True)


def use_kernels(q: Tensor) -> bool:
    """Whether the Triton kernels run for ``q``'s device and dtype: always on CUDA; on
    the CPU only in Triton's interpreter, and not for bfloat16 there (the interpreter
    multiplies bfloat16 bit patterns in tl.dot: a known Triton bug), which takes the
    float32 reference path instead (as do meta tensors: sizes only)."""
    return q.is_cuda or (interpreting() and q.device.type == "cpu" and q.dtype != torch.bfloat16)


def is_empty(q: Tensor, k: Tensor) -> bool:
    return q.shape[0] == 0 or q.shape[1] == 0 or q.shape[2] == 0 or k.shape[2] == 0


# -- kernel selection (memoized per exact problem size) --------------------------------

def layout_signature(q: Tensor, k: Tensor, v: Tensor) -> str:
    """The ProblemKey layout of dense inputs: "" when a tensor descriptor can address
    q, k and v (:func:`flashgen.ops.tma_ok`), else "strided"."""
    return "" if ops.tma_ok(q) and ops.tma_ok(k) and ops.tma_ok(v) else "strided"


def load_or_fall_back(disp, key: ProblemKey, cfg, choose):
    """(cfg, module): ``cfg``'s module for ``key``; when a non-portable family's load
    raises (a Gluon build failure on the installed Triton, of any exception type), the
    variant is marked failed (one warning per variant per process) and ``choose()``
    answers again (the dispatcher then skips it; ``choose()`` may answer None: then
    ``(None, None)``)."""
    while True:
        try:
            return cfg, families.load(Variant(key.spec, cfg))
        except Exception as e:  # noqa: BLE001 - any build failure of a non-portable family
            if cfg.family == families.portable().name:
                raise
            disp.mark_failed(Variant(key.spec, cfg), e)
            cfg = choose()
            if cfg is None:
                return None, None


def _choose(disp, fk, key: ProblemKey, capturing: bool):
    """(TileConfig, loaded module) of ``key``: the dispatcher's family and config, the
    module loaded by that family; memoized under ``fk`` and under ``key`` (the
    dispatcher's answer is a function of the key, whose seqlen buckets hold many exact
    sizes: a generation loop's growing seqlen_k asks again only per bucket) in the
    dispatcher's ``fast`` table unless ``capturing`` (a CUDA graph capture's answer may
    be the default, which a later call must not take from the table)."""
    # another exact size of this key: its answer (the module loaded depends on the
    # interpreter too; clear() forgets both entries)
    kkey = ("choice", key, interpreting())
    hit = disp.fast.get(kkey)
    if hit is None:
        cfg = disp.choose(key, capturing=capturing).config
        hit = load_or_fall_back(disp, key, cfg, lambda: disp.choose(key, capturing=capturing).config)
    if not capturing:
        if len(disp.fast) >= FAST_TABLE_MAX:  # e.g. a decode loop with a growing seqlen_k
            disp.fast.clear()
        disp.fast[fk] = disp.fast[kkey] = hit
    return hit


def _dense_key(kernel: str, q: Tensor, k: Tensor, v: Tensor, mask: str, mods: str) -> ProblemKey:
    spec = KernelSpec(kernel, ops.dtype_name(q.dtype), q.shape[3], v.shape[3], mask, mods)
    return ProblemKey.from_sizes(spec, batch=q.shape[0], num_heads=q.shape[1], num_kv_heads=k.shape[1],
                                 seqlen_q=q.shape[2], seqlen_k=k.shape[2], layout=layout_signature(q, k, v))


def _fast_key(kernel, q, k, v, mask, mods):
    # Strides, dtype and the bases' low address bits decide the layout signature, so
    # a hit needs no layout_signature() call.
    return (kernel, mask, q.dtype, q.shape, k.shape, v.shape[3], not q.is_cuda and interpreting(), q.stride(),
            k.stride(), v.stride(), (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15, mods)


#: When the dense forward runs in its flash-decoding form (:func:`decode_form`): rules of
#: (at most this many query rows per kv head, i.e. seqlen_q x the GQA group; from this
#: seqlen_k; at most this many batch x num_heads, None: any).  From the decode kernel
#: against the forward kernels on the same calls (``python -m benchmarks decode-form``:
#: 32 / 8 heads, head_dim 128, bf16, batch 1 and 8, 4k and 32k keys, 4-256 rows per kv
#: head; docs/benchmarks.md, the dense op's flash-decoding form): up to 64 rows the
#: decode kernel took 0.24-1.02x the forward kernels' GPU time at every measured size;
#: 128 and 256 rows 0.37-0.74x at batch 1 (the forward kernels run one program per
#: (batch, head), 32 on a 132-SM GPU) and 0.84-1.73x at batch 8 (an H100).  At batch 8,
#: 128 rows over 32k keys the decode kernel took 0.56x the forward kernels' time on the
#: H200 and 0.68x on an H100 with each GPU's tuned decode rows, 0.83x with the untuned
#: default (H100); over 4k keys 0.78x (H200) and 0.73-0.96x (H100, two runs) tuned but
#: 1.39x untuned, so that rule starts at 32k keys; 256 rows at batch 8 stay on the
#: forward kernels (1.04-1.15x).
#: Below 512 keys both are bound by their launches.
DECODE_FORM_RULES = ((64, 512, None), (128, 32768, None), (256, 4096, 64))


def decode_form_rule(q: Tensor, k: Tensor) -> tuple | None:
    """The first of :data:`DECODE_FORM_RULES` that q (batch, num_heads, seqlen_q, ...)
    over k (batch, num_kv_heads, seqlen_k, ...) meets, or None (sizes only; the mask is
    :func:`decode_form`'s)."""
    b, h, sq = q.shape[:3]
    rows, sk = sq * (h // max(1, k.shape[1])), k.shape[2]
    for rule in DECODE_FORM_RULES:
        if rows <= rule[0] and sk >= rule[1] and (rule[2] is None or b * h <= rule[2]):
            return rule
    return None


def decode_form(q: Tensor, k: Tensor, v: Tensor, mask: str, lo: int, hi: int) -> bool:
    """Whether the dense forward of q (batch, num_heads, seqlen_q, head_dim) over k, v
    (batch, num_kv_heads, seqlen_k, head_dim[_v]) with mask bounds (``mask``, ``lo``,
    ``hi``: :func:`flashgen.masks.mask_bounds`) runs as flash-decoding, as
    FlashAttention's forward does for a single query (its split-KV path with the GQA
    group's heads swapped into the rows): the decode kernel of
    :func:`flashgen.attention_with_kvcache` over k and v as a full cache, which packs
    the group's query heads x seqlen_q rows into one tile (each K/V element read once per
    kv head) and splits the keys over programs.  For a few query rows per kv head over
    many keys (:data:`DECODE_FORM_RULES`, :func:`decode_form_rule`), without a mask or
    with bottom-right causal alone (the decode kernel's two masks; a window, a top-left
    alignment and score modifications take the forward kernels).  O and LSE are the same
    function; the backward is unchanged."""
    sq, sk = q.shape[2], k.shape[2]
    return (decode_form_rule(q, k) is not None
            and (mask == "none" or (mask == "causal" and hi == sk - sq and lo <= -sq)))


def decode_form_kernel(q: Tensor, k: Tensor, v: Tensor, mask: str):
    """(TileConfig, loaded module) of the decode kernel that runs the dense forward of
    these inputs in its flash-decoding form (:func:`decode_form`): the ``decode``
    kernel's tuned row or default for q seen as (batch, seqlen_q, num_heads, head_dim)
    and k, v as a cache of seqlen_k keys.  Its config has ``num_splits`` >= 1, which
    the Triton family's forward launcher runs as that kernel."""
    disp = dispatch._default or dispatch.default_dispatcher()
    return _decode_kernel(disp, "decode", q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                          decode_mask(mask == "causal", q.shape[2]), k.shape[2])


def decode_form_key(q: Tensor, k: Tensor, v: Tensor, mask: str) -> ProblemKey:
    """The ``decode`` ProblemKey whose row or default :func:`decode_form_kernel` takes for
    these inputs (q (batch, num_heads, seqlen_q, head_dim); sizes only)."""
    b, h, sq, d = q.shape
    return _decode_key("decode", q.dtype, b, sq, h, k.shape[1], d, v.shape[3], decode_mask(mask == "causal", sq),
                       k.shape[2])


def kernel_for(kernel: str, q: Tensor, k: Tensor, v: Tensor, mask: str, mods: str = "",
               bounds: tuple[int, int] | None = None):
    """(TileConfig, loaded module) of ``kernel`` for these inputs, from the default
    dispatcher.  Memoized per exact sizes in the dispatcher's ``fast`` table (cleared
    with it); inside a CUDA graph capture a miss takes the dispatcher's capture-safe
    answer (cache or default) and is not memoized.  ``bounds``: the forward's (lo, hi),
    with which a "fwd" call without ``mods`` that :func:`decode_form` takes gets the
    decode kernel's (:func:`decode_form_kernel`)."""
    if kernel == "fwd" and bounds is not None and not mods and decode_form(q, k, v, mask, *bounds):
        return decode_form_kernel(q, k, v, mask)
    disp = dispatch.default_dispatcher()
    fk = _fast_key(kernel, q, k, v, mask, mods)
    hit = disp.fast.get(fk)
    if hit is not None:
        return hit
    return _choose(disp, fk, _dense_key(kernel, q, k, v, mask, mods), dispatch.graph_capturing())


def deterministic_backward(deterministic: "bool | None") -> bool:
    """Whether the backward must be bitwise repeatable: ``deterministic`` when it is a
    bool, else torch's flag (``torch.use_deterministic_algorithms``) when the backward
    runs."""
    return torch.are_deterministic_algorithms_enabled() if deterministic is None else deterministic


def backward_kernels(q: Tensor, k: Tensor, v: Tensor, mask: str, mods: str, deterministic: bool):
    """The backward's kernels for these inputs, from the default dispatcher
    (:meth:`flashgen.dispatch.Dispatcher.backward`): ``(cfg, module)`` of one family's
    whole backward, or ``((cfg_dq, module_dq), (cfg_dkdv, module_dkdv))``.  Memoized per
    exact sizes like :func:`kernel_for`."""
    disp = dispatch.default_dispatcher()
    fk = _fast_key(("bwd", deterministic), q, k, v, mask, mods)
    hit = disp.fast.get(fk)
    if hit is not None:
        return hit
    hit = _backward_plan(disp, fk, _dense_key("bwd_dq", q, k, v, mask, mods), deterministic)
    return backward_kernels(q, k, v, mask, mods, deterministic) if hit is None else hit


def _backward_plan(disp, fk, key: ProblemKey, deterministic: bool):
    """The loaded modules of the dispatcher's backward plan for ``key`` (a ``bwd_dq`` or
    ``bwd_dq_varlen`` key), memoized under ``fk`` unless capturing; None when the
    whole backward it chose failed to build (mark_failed forgot the choice: ask again)."""
    capturing = dispatch.graph_capturing()
    plan = disp.backward(key, deterministic=deterministic, capturing=capturing)
    if plan.whole:
        c = plan.choices[0]
        hit = load_or_fall_back(disp, c.key, c.config, lambda: None)
        if hit[0] is None:
            return None
    else:
        hit = tuple(load_or_fall_back(disp, c.key, c.config, lambda c=c: disp.choose(c.key, capturing=capturing).config)
                    for c in plan.choices)
    if not capturing:
        if len(disp.fast) >= FAST_TABLE_MAX:
            disp.fast.clear()
        disp.fast[fk] = hit
    return hit


def fall_back(cfg, kernel: str, q: Tensor, error: BaseException, spec_args) -> None:
    """A launch of ``cfg`` (its first launch compiles it) raised ``error``: mark the
    variant failed (one warning per variant per process; the dispatcher then skips it
    and the caller asks again) when it is a non-portable family's, or a user variant's
    (:func:`flashgen.spec.is_user_mods`) that ran out of shared memory or registers
    (Triton's OutOfResources: a config the resource model let through); else, or when
    the variant had failed before (the dispatcher's next answer was the same), re-raise."""
    spec = KernelSpec(kernel, *spec_args)
    variant = Variant(spec, cfg)
    portable = cfg.family == families.portable().name
    if portable and not (is_user_mods(spec.mods) and type(error).__name__ == "OutOfResources"):
        raise error
    if dispatch.has_failed(variant):
        raise error
    dispatch.default_dispatcher().mark_failed(variant, error)


class _on_device:
    """``torch.cuda.device(index)`` only when it is not already the current device
    (Triton launches on the current device's current stream)."""

    __slots__ = ("index", "prev")

    def __init__(self, t: Tensor):
        self.index = t.device.index if t.is_cuda else None
        self.prev = None

    def __enter__(self):
        if self.index is not None:
            cur = torch.cuda.current_device()
            if cur != self.index:
                self.prev = cur
                torch.cuda.set_device(self.index)
        return self

    def __exit__(self, *exc):
        if self.prev is not None:
            torch.cuda.set_device(self.prev)


def _signed_q(q: Tensor, scale: float):
    """(q', scale', sign) with scale' > 0 such that scale'·q'kᵀ = scale·qkᵀ (scale 0:
    q' = 0, scale' = 1).  NaN stays NaN."""
    if scale > 0 or scale != scale:
        return q, scale, 1
    if scale < 0:
        return q.neg(), -scale, -1
    return torch.zeros_like(q), 1.0, 0


# -- the reference path (CPU without the interpreter) -----------------------------------

def check_dropout_runs(q: Tensor, k: Tensor, dropout_p: float) -> None:
    """InputError when dropout is asked of inputs that take the reference path (it has
    no dropout); empty inputs launch nothing and pass."""
    if dropout_p > 0 and not is_empty(q, k) and not use_kernels(q):
        from .errors import InputError

        raise InputError("dropout_p > 0 runs in the Triton kernels only: use a CUDA device, or TRITON_INTERPRET=1 "
                         "on the CPU with float16 or float32 inputs (bfloat16 takes the reference path there)")


def _reference_mods(q, k, mods) -> dict:
    """The keyword arguments of :mod:`flashgen.reference` for ``mods`` (ScoreMods or
    None); InputError for dropout, which the reference path does not have."""
    if mods is None:
        return {}
    check_dropout_runs(q, k, mods.dropout_p)
    return dict(softcap=mods.softcap, alibi=mods.alibi, bias=mods.bias)


def reference_forward(q, k, v, scale, lo, hi, mods=None):
    """O (q's dtype, contiguous) and LSE (float32), :func:`flashgen.reference.forward_bounds`
    in float32 math, with the score mods of ``mods`` (no dropout)."""
    o, lse, _ = reference.forward_bounds(q, k, v, scale, lo, hi, torch.float32, **_reference_mods(q, k, mods))
    return o.to(q.dtype).contiguous(), lse.contiguous()


def reference_backward(do, q, k, v, scale, lo, hi, mods=None):
    """dQ, dK, dV (float32), :func:`flashgen.reference.backward_bounds` in float32 math."""
    return reference.backward_bounds(do, q, k, v, scale, lo, hi, torch.float32, **_reference_mods(q, k, mods))


def _zeros_like(t: Tensor) -> Tensor:
    """Zeros laid out as the fake's ``torch.empty_like(t)``: a tensor with no elements
    gets contiguous strides (the real ``empty_like`` would keep a view's strides)."""
    return torch.zeros_like(t) if t.numel() else torch.zeros(t.shape, dtype=t.dtype, device=t.device)


def _into(like: Tensor, value: Tensor) -> Tensor:
    """``value`` in a tensor laid out like ``torch.empty_like(like)`` (what the fake says)."""
    out = torch.empty_like(like)
    out.copy_(value)
    return out


def out_like(q: Tensor, head_dim_v: int) -> Tensor:
    """An uninitialized O of shape (batch, num_heads, seqlen_q, head_dim_v), q's dtype and
    device, laid out like ``q``: its first three dims in the order of q's strides
    (largest first), head_dim innermost.  A q that is a (batch, seqlen, heads, head_dim)
    tensor seen through ``transpose(1, 2)`` (transformers' layout) gets an O of the same
    memory order, which the caller's ``transpose(1, 2).contiguous()`` then returns
    without a copy; a contiguous q gets a contiguous O.  The op's fake kernel uses the
    same rule, so compiled graphs see the strides the kernels write."""
    b, h, sq, _ = q.shape
    st = q.stride()
    if q.is_contiguous() or st[3] != 1:
        return q.new_empty((b, h, sq, head_dim_v))
    order = sorted(range(3), key=lambda i: (-st[i], i))
    if order == [0, 1, 2]:
        return q.new_empty((b, h, sq, head_dim_v))
    t = q.new_empty([q.shape[i] for i in order] + [head_dim_v])
    return t.permute(*[order.index(i) for i in range(3)], 3)


# -- real implementations -----------------------------------------------------------

def forward(q: Tensor, k: Tensor, v: Tensor, scale: float, mask: str, lo: int, hi: int,
            mods: "ops.ScoreMods | None" = None, out: Optional[Tensor] = None):
    """(O, LSE): the forward ops' real implementation (see the module docstring);
    ``mods``: the score modifications of ``flashgen::fwd_mods`` (None: none); ``out``:
    the O the kernels write, laid out as :func:`out_like` lays it out (default: one
    allocated so)."""
    b, h, sq, _ = q.shape
    if out is None:
        out = out_like(q, v.shape[3])
    if is_empty(q, k):
        return out.zero_(), torch.full((b, h, sq), float("-inf"), dtype=torch.float32, device=q.device)
    if not use_kernels(q):
        o, lse = reference_forward(q, k, v, scale, lo, hi, mods)
        return out.copy_(o), lse
    q, scale, _ = _signed_q(q, scale)
    name = mods.name if mods is not None else ""
    with _on_device(q):
        while True:
            cfg, mod = kernel_for("fwd", q, k, v, mask, name, (lo, hi))
            # kernel_for gives a tma config only to inputs a descriptor can address
            try:
                return families.launcher(cfg.family, "fwd")(q, k, v, softmax_scale=scale, mask=mask, diag_lo=lo,
                                                            diag_hi=hi, config=cfg, module=mod, addressable=True,
                                                            mods=mods, out=out)
            except Exception as e:  # noqa: BLE001 - a non-portable family's build failure: fall back
                fall_back(cfg, "fwd", q, e, (ops.dtype_name(q.dtype), q.shape[3], v.shape[3], mask, name))


def backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, scale: float, mask: str,
             lo: int, hi: int, mods: "ops.ScoreMods | None" = None, delta: Optional[Tensor] = None,
             deterministic: Optional[bool] = None):
    """(dQ, dK, dV): the backward ops' real implementation.  ``delta``: a float32 buffer
    like lse that receives rowsum(dO * O) when the kernels run, whichever run (bwd_dq,
    or a whole backward's first pass; the sinks' gradient reads it).  ``deterministic``
    (None: torch's ``use_deterministic_algorithms`` flag
    now): True runs the bwd_dq + bwd_dkdv kernels (bitwise repeatable); otherwise the
    dispatcher may pick a family's whole backward (:meth:`flashgen.dispatch.Dispatcher.backward`;
    the Gluon one on sm_90, whose dQ accumulation order varies)."""
    if is_empty(q, k):
        return _zeros_like(q), _zeros_like(k), _zeros_like(v)
    if do.stride(-1) != 1:
        do = do.contiguous()
    if not use_kernels(q):
        dq, dk, dv = reference_backward(do, q, k, v, scale, lo, hi, mods)
        return _into(q, dq), _into(k, dk), _into(v, dv)
    q, scale, sign = _signed_q(q, scale)
    name = mods.name if mods is not None else ""
    det = deterministic_backward(deterministic)
    with _on_device(q):
        kw = dict(softmax_scale=scale, mask=mask, diag_lo=lo, diag_hi=hi, addressable=True, mods=mods)
        spec_args = (ops.dtype_name(q.dtype), q.shape[3], v.shape[3], mask, name)
        dq_delta = None  # (dQ, delta) once bwd_dq ran: a failed bwd_dkdv launch does not run it again
        while True:
            plan = backward_kernels(q, k, v, mask, name, det)
            if not (len(plan) == 2 and isinstance(plan[0], tuple)):
                cfg, mod = plan  # one family's whole backward
                try:
                    dq, dk, dv = families.launcher(cfg.family, "bwd")(do, q, k, v, o, lse, config=cfg, module=mod,
                                                                       delta=delta, **kw)
                    return _signed_dq(dq, sign), dk, dv
                except LaunchLimitError:  # these sizes only: the two kernels take this call
                    plan = (kernel_for("bwd_dq", q, k, v, mask, name), kernel_for("bwd_dkdv", q, k, v, mask, name))
                except Exception as e:  # noqa: BLE001 - a non-portable family's build failure: fall back
                    fall_back(cfg, "bwd", q, e, spec_args)
                    continue
            # dQ (and delta) by bwd_dq, then dK/dV by bwd_dkdv (each by its own family)
            (cfg_dq, mod_dq), (cfg_kv, mod_kv) = plan
            if dq_delta is None:
                try:
                    dq_delta = families.launcher(cfg_dq.family, "bwd_dq")(do, q, k, v, o, lse, config=cfg_dq,
                                                                          module=mod_dq, delta=delta, **kw)
                except Exception as e:  # noqa: BLE001 - see fall_back
                    fall_back(cfg_dq, "bwd_dq", q, e, spec_args)
                    continue
            try:
                dk, dv = families.launcher(cfg_kv.family, "bwd_dkdv")(do, q, k, v, lse, dq_delta[1], config=cfg_kv,
                                                                      module=mod_kv, **kw)
            except Exception as e:  # noqa: BLE001 - see fall_back
                fall_back(cfg_kv, "bwd_dkdv", q, e, spec_args)
                continue
            return _signed_dq(dq_delta[0], sign), dk, dv


def _signed_dq(dq: Tensor, sign: int) -> Tensor:
    """dQ of the launched (non-negative) scale back to the caller's (see :func:`_signed_q`)."""
    if sign == -1:
        dq = dq.neg_()
    elif sign == 0:
        dq = dq.zero_()
    return dq


def forward_ad(*tensors) -> bool:
    """Whether a forward-mode derivative (``torch.func.jvp``, ``jacfwd``, dual tensors of
    ``torch.autograd.forward_ad``) is taken through one of ``tensors``: flashgen's ops
    have none, and their tangent would silently be zero.  On every call of the public
    entry points: one module attribute read when no dual level is open."""
    if getattr(_fwad, "_current_level", 0) < 0 or torch.compiler.is_compiling():
        return False
    return any(isinstance(t, torch.Tensor) and _fwad.unpack_dual(t).tangent is not None for t in tensors)


_GRAD_TRANSFORM = getattr(getattr(torch._C._functorch, "TransformType", None), "Grad", None)


def grad_transform(*tensors) -> bool:
    """Whether a reverse-mode transform of ``torch.func`` (``grad``, ``grad_and_value``,
    ``vjp``, ``jacrev``) differentiates through one of ``tensors``: the ops' autograd,
    registered with ``torch.library.register_autograd``, is an ``autograd.Function``
    without ``setup_context``, which those transforms refuse with an internal
    RuntimeError.  Under a ``vmap`` inside the transform the batched tensors hide which
    are tracked; they are taken as tracked.  One C call when no transform is active."""
    if not functorch_active() or _GRAD_TRANSFORM is None or torch.compiler.is_compiling():
        return False
    keys = [i.key() for i in (torch._C._functorch.get_interpreter_stack() or ())]
    if _GRAD_TRANSFORM not in keys:
        return False
    return keys[-1] != _GRAD_TRANSFORM or any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def no_forward_ad(name: str, *tensors) -> None:
    """UnsupportedError when :func:`forward_ad` or :func:`grad_transform`: the
    derivatives flashgen's ops do not take."""
    if forward_ad(*tensors):
        raise UnsupportedError(f"{name} has no forward-mode derivative (torch.func.jvp, jacfwd, "
                               "torch.autograd.forward_ad): its tangent would be taken as zero; take reverse-mode "
                               "derivatives (backward(), torch.autograd.grad) or use torch's "
                               "scaled_dot_product_attention")
    if grad_transform(*tensors):
        raise UnsupportedError(f"{name} cannot be differentiated by torch.func's grad, vjp or jacrev (its "
                               "autograd, registered with torch.library.register_autograd, does not take functorch "
                               "transforms); take derivatives with backward() or torch.autograd.grad, or use "
                               "torch's scaled_dot_product_attention")


# -- the ops --------------------------------------------------------------------------
# (No ``from __future__ import annotations`` in this module: custom_op reads the
# annotations to infer the schema.)

@torch.library.custom_op("flashgen::dropout_take", mutates_args=("state",))
def dropout_take_op(state: Tensor, n: int) -> Tensor:
    """:func:`flashgen.dropout.take` as an op that declares its mutation: traced
    (torch.compile), the copy it returns is a value of its own.  A clone and an in-place
    add of a graph input, traced, left both the forward and the saved-for-backward
    state as the input itself, which the graph's epilogue then advanced: the backward
    recomputed the mask at the next call's offset."""
    used = state.clone()
    state[1:].add_(n)
    return used


@dropout_take_op.register_fake
def _(state, n):
    return torch.empty_like(state)


@torch.library.custom_op("flashgen::fwd", mutates_args=())
def fwd_op(q: Tensor, k: Tensor, v: Tensor, scale: float, mask: str, lo: int, hi: int,
           deterministic: Optional[bool] = None) -> tuple[Tensor, Tensor]:
    return forward(q, k, v, scale, mask, lo, hi)


@fwd_op.register_fake
def _fwd_fake(q, k, v, scale, mask, lo, hi, deterministic=None):
    b, h, sq, _ = q.shape
    return out_like(q, v.shape[3]), q.new_empty((b, h, sq), dtype=torch.float32)


@torch.library.custom_op("flashgen::bwd", mutates_args=())
def bwd_op(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, scale: float, mask: str,
           lo: int, hi: int, deterministic: Optional[bool] = None) -> tuple[Tensor, Tensor, Tensor]:
    return backward(do, q, k, v, o, lse, scale, mask, lo, hi, deterministic=deterministic)


@bwd_op.register_fake
def _bwd_fake(do, q, k, v, o, lse, scale, mask, lo, hi, deterministic=None):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, scale, mask, lo, hi, deterministic = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.args = (scale, mask, lo, hi, deterministic)
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)  # see EagerAttention.forward


def _backward(ctx, do, _dlse):
    if do is None:
        return None, None, None, None, None, None, None, None
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.flashgen.bwd(do, q, k, v, o, lse, *ctx.args)
    return dq, dk, dv, None, None, None, None, None


fwd_op.register_autograd(_backward, setup_context=_setup_context)

def versioned(tensors) -> tuple:
    """``tensors`` to save for a backward only for autograd's version check (the
    backward reads them elsewhere): None and inference tensors (no version counter,
    not savable; outside inference mode they cannot be modified in place) left out."""
    return tuple(t for t in tensors if t is not None and not t.is_inference())


class _NoDoubleBackward(torch.autograd.Function):
    """The gradients of an eager backward run under ``create_graph=True``, unchanged,
    joined to the graph of their inputs: differentiating them again (a double backward
    through attention: gradient penalties, Hessian-vector products) raises, as it does
    through flashgen's ops (no autograd formula for their backward), instead of
    silently leaving attention's second-order terms out.

    apply(n, *inputs, *grads) -> views of the grads: ``inputs`` the first ``n``
    arguments, the tensors the gradients depend on (q, k, v, dO, ...); ``grads`` no
    None."""

    @staticmethod
    def forward(ctx, n, *tensors):
        return tuple(t.view_as(t) for t in tensors[n:])

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("flashgen's attention has no double backward: a gradient computed through it with "
                           "create_graph=True was differentiated again (its backward kernels have no autograd "
                           "formula)")


def no_double_backward(inputs: tuple, grads: tuple) -> tuple:
    """``grads`` as an eager backward returns them: unchanged outside ``create_graph=True``
    (grad mode off in the backward); under it, joined to ``inputs``' graph by
    :class:`_NoDoubleBackward`, so a double backward raises."""
    if not torch.is_grad_enabled():
        return grads
    out = iter(_NoDoubleBackward.apply(len(inputs), *inputs, *(g for g in grads if g is not None)))
    return tuple(None if g is None else next(out) for g in grads)


class EagerAttention(torch.autograd.Function):
    """The autograd path of plain eager calls: the same implementations and formula as
    ``flashgen::fwd``/``flashgen::bwd`` without the torch.library dispatcher, which
    costs about 115 us per call on the H200's host in torch 2.11 (``benchmarks/
    host_cost.py``).  torch.compile, TorchDispatchModes and functorch transforms still
    go through the ops (:func:`flashgen.api._attention` decides).

    apply(q, k, v, scale, mask, lo, hi, mods, deterministic=None, calls=None) -> (O, LSE),
    ``mods`` a ScoreMods or None (the eager path of both ``flashgen::fwd`` and
    ``flashgen::fwd_mods``), ``deterministic`` as :func:`backward` takes it, ``calls``
    the :class:`flashgen.hot.Calls` of the API's fast-table entry of these inputs (plain
    calls, no mods: forward and backward replay their recipes); LSE is not
    differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, scale, mask, lo, hi, mods, deterministic=None, calls=None):
        if calls is not None and mods is None:
            o, lse = calls.forward(q, k, v, scale, mask, lo, hi)
        else:
            calls = None
            o, lse = forward(q, k, v, scale, mask, lo, hi, mods)
        # the mods' tensors too: autograd's version check then refuses a backward after
        # the bias or the slopes were modified in place (the backward re-reads them)
        if mods is None:
            ctx.save_for_backward(q, k, v, o, lse)
        else:
            ctx.save_for_backward(q, k, v, o, lse, *versioned((mods.alibi, mods.bias)))
        ctx.args = (scale, mask, lo, hi, mods)
        ctx.deterministic = deterministic
        ctx.calls = calls
        ctx.mark_non_differentiable(lse)
        # LSE's incoming gradient is never read: without this autograd fills a zero
        # tensor for it on every backward (a fill kernel, and 0.2 ms of host time per
        # call on the H200's host, benchmarks/launch_cost.py --profile); dO is then None
        # when O does not reach the loss
        ctx.set_materialize_grads(False)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        if do is None:
            return None, None, None, None, None, None, None, None, None, None
        q, k, v, o, lse = ctx.saved_tensors[:5]
        if ctx.calls is not None:
            scale, mask, lo, hi, _ = ctx.args
            dq, dk, dv = ctx.calls.backward(do, q, k, v, o, lse, scale, mask, lo, hi, ctx.deterministic)
        else:
            dq, dk, dv = backward(do, q, k, v, o, lse, *ctx.args, deterministic=ctx.deterministic)
        if torch.is_grad_enabled():  # create_graph=True
            dq, dk, dv = no_double_backward((q, k, v, do), (dq, dk, dv))
        return dq, dk, dv, None, None, None, None, None, None, None


# -- score modifications (softcap, ALiBi, bias, dropout) -----------------------------
#
# ``torch.ops.flashgen.fwd_mods(q, k, v, scale, mask, lo, hi, softcap, alibi, bias,
# dropout_p, rng, deterministic=None) -> (O, LSE)`` and ``torch.ops.flashgen.bwd_mods(do,
# q, k, v, o, lse, scale, mask, lo, hi, softcap, alibi, bias, dropout_p, rng,
# deterministic=None) -> (dQ, dK, dV)``: the dense ops with the mods of
# :class:`flashgen.ops.ScoreMods` (alibi float32 (h,) or (b, h); bias expanded to (b, h,
# sq, sk), no gradient; rng the int64 [seed, offset] this call uses, already taken from
# the state by the caller; ``deterministic`` as :func:`backward` takes it).  Separate
# ops, so the plain ops' schema and hot path stay as they are.

def score_mods(softcap, alibi, bias, dropout_p, rng) -> "ops.ScoreMods":
    return ops.ScoreMods(softcap, alibi, bias, dropout_p, rng if dropout_p > 0 else None)


def forward_mods(q: Tensor, k: Tensor, v: Tensor, scale: float, mask: str, lo: int, hi: int, softcap: float,
                 alibi: Optional[Tensor], bias: Optional[Tensor], dropout_p: float, rng: Optional[Tensor]):
    """(O, LSE) with score mods: :func:`forward` with their ScoreMods."""
    return forward(q, k, v, scale, mask, lo, hi, score_mods(softcap, alibi, bias, dropout_p, rng))


def backward_mods(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, scale: float, mask: str,
                  lo: int, hi: int, softcap: float, alibi: Optional[Tensor], bias: Optional[Tensor],
                  dropout_p: float, rng: Optional[Tensor], deterministic: Optional[bool] = None):
    """(dQ, dK, dV) with score mods: :func:`backward` with their ScoreMods."""
    return backward(do, q, k, v, o, lse, scale, mask, lo, hi, score_mods(softcap, alibi, bias, dropout_p, rng),
                    deterministic=deterministic)


@torch.library.custom_op("flashgen::fwd_mods", mutates_args=())
def fwd_mods_op(q: Tensor, k: Tensor, v: Tensor, scale: float, mask: str, lo: int, hi: int, softcap: float,
                alibi: Optional[Tensor], bias: Optional[Tensor], dropout_p: float,
                rng: Optional[Tensor], deterministic: Optional[bool] = None) -> tuple[Tensor, Tensor]:
    return forward_mods(q, k, v, scale, mask, lo, hi, softcap, alibi, bias, dropout_p, rng)


@fwd_mods_op.register_fake
def _fwd_mods_fake(q, k, v, scale, mask, lo, hi, softcap, alibi, bias, dropout_p, rng, deterministic=None):
    return _fwd_fake(q, k, v, scale, mask, lo, hi)


@torch.library.custom_op("flashgen::bwd_mods", mutates_args=())
def bwd_mods_op(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, scale: float, mask: str,
                lo: int, hi: int, softcap: float, alibi: Optional[Tensor], bias: Optional[Tensor],
                dropout_p: float, rng: Optional[Tensor],
                deterministic: Optional[bool] = None) -> tuple[Tensor, Tensor, Tensor]:
    return backward_mods(do, q, k, v, o, lse, scale, mask, lo, hi, softcap, alibi, bias, dropout_p, rng,
                         deterministic)


@bwd_mods_op.register_fake
def _bwd_mods_fake(do, q, k, v, o, lse, scale, mask, lo, hi, softcap, alibi, bias, dropout_p, rng,
                   deterministic=None):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context_mods(ctx, inputs, output):
    q, k, v, scale, mask, lo, hi, softcap, alibi, bias, dropout_p, rng, deterministic = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, alibi, bias, rng)
    ctx.args = (scale, mask, lo, hi, softcap, dropout_p, deterministic)
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)  # see EagerAttention.forward


def _backward_mods(ctx, do, _dlse):
    if do is None:
        return (None,) * 13
    q, k, v, o, lse, alibi, bias, rng = ctx.saved_tensors
    scale, mask, lo, hi, softcap, dropout_p, deterministic = ctx.args
    dq, dk, dv = torch.ops.flashgen.bwd_mods(do, q, k, v, o, lse, scale, mask, lo, hi, softcap, alibi, bias,
                                             dropout_p, rng, deterministic)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, None


fwd_mods_op.register_autograd(_backward_mods, setup_context=_setup_context_mods)


# -- decode with a KV cache -------------------------------------------------------------

def _decode_kernel(disp, kernel, q, k_cache, v_cache, mask, capacity):
    """(TileConfig, module) for a decode call, memoized per exact sizes in the
    dispatcher's fast table (a CUDA graph capture takes the capture-safe answer, not
    memoized)."""
    interp = not q.is_cuda
    fk = ("decode", kernel, mask, q.dtype, q.shape, k_cache.shape[2], v_cache.shape[3], capacity, interp)
    hit = disp.fast.get(fk)
    if hit is not None:
        return hit
    capturing = dispatch.graph_capturing()
    b, sq, h, d = q.shape
    key = _decode_key(kernel, q.dtype, b, sq, h, k_cache.shape[2], d, v_cache.shape[3], mask, capacity)
    return _choose(disp, fk, key, capturing)


def _decode_key(kernel, dtype, batch, seqlen_q, num_heads, num_kv_heads, head_dim, head_dim_v, mask, capacity):
    """The ProblemKey of a decode call: ``capacity`` keys in the cache."""
    spec = KernelSpec(kernel, ops.dtype_name(dtype), head_dim, head_dim_v, mask)
    return ProblemKey.from_sizes(spec, batch=batch, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                 seqlen_q=seqlen_q, seqlen_k=capacity)


def kvcache_forward(q, k_cache, v_cache, cache_seqlens, block_table, scale: float, causal: bool):
    """(O, LSE) of a checked :func:`attention_with_kvcache` call: the implementation of
    the ``flashgen::decode`` op.  O (batch, seqlen_q, num_heads, head_dim_v) in q's
    dtype, LSE (batch, num_heads, seqlen_q) float32, both contiguous."""
    b, sq, h, d = q.shape
    dv = v_cache.shape[3]
    capacity = k_cache.shape[1] if block_table is None else block_table.shape[1] * k_cache.shape[1]
    mask = decode_mask(causal, sq)
    q, k_cache, v_cache = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k_cache, v_cache))
    cache_seqlens = cache_seqlens.contiguous()  # the kernel reads it with stride 1
    if b == 0 or sq == 0:
        o = q.new_zeros((b, sq, h, dv))
        lse = torch.full((b, h, sq), float("-inf"), dtype=torch.float32, device=q.device)
    elif not use_kernels(q):
        o, lse = reference.decode_forward(q, k_cache, v_cache, cache_seqlens, block_table, causal=causal,
                                          softmax_scale=scale, dtype=torch.float32)
        o = o.to(q.dtype)
    else:
        q, scale, _ = _signed_q(q, scale)
        kernel = "decode_paged" if block_table is not None else "decode"
        disp = dispatch._default or dispatch.default_dispatcher()
        with _on_device(q):
            cfg, mod = _decode_kernel(disp, kernel, q, k_cache, v_cache, mask, capacity)
            o, lse = families.launcher(cfg.family, "decode")(q, k_cache, v_cache, cache_seqlens, block_table,
                                                             softmax_scale=scale, mask=mask, config=cfg, module=mod)
    return o.contiguous(), lse.contiguous()


@torch.library.custom_op("flashgen::decode", mutates_args=())
def decode_op(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor, block_table: Optional[Tensor],
              scale: float, causal: bool) -> tuple[Tensor, Tensor]:
    """``flashgen.attention_with_kvcache`` as an op (forward only: inference), so
    torch.compile traces decode steps without a graph break."""
    return kvcache_forward(q, k_cache, v_cache, cache_seqlens, block_table, scale, causal)


@decode_op.register_fake
def _decode_fake(q, k_cache, v_cache, cache_seqlens, block_table, scale, causal):
    b, sq, h, _ = q.shape
    return q.new_empty((b, sq, h, v_cache.shape[3])), q.new_empty((b, h, sq), dtype=torch.float32)


#: The op overloads, resolved once (calling the overload skips a lookup).
FWD = torch.ops.flashgen.fwd.default
BWD = torch.ops.flashgen.bwd.default
DECODE = torch.ops.flashgen.decode.default
FWD_MODS = torch.ops.flashgen.fwd_mods.default


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


# -- ragged batches (varlen) ------------------------------------------------------------
#
# ``torch.ops.flashgen.fwd_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
# max_seqlen_k, scale, mask, left, right) -> (O, LSE)`` on packed q (total_q, h, d),
# k (total_k, hk, d), v (total_k, hk, dv), last-dim stride 1, cu_seqlens int32
# (batch + 1,) on q's device (checked by :func:`flashgen.api.attention_varlen`).
# ``left``/``right`` are the window sizes per sequence (-1 = unbounded; causal passes
# right = 0), bottom-right aligned within each sequence; ``mask`` the mode they make.
# O is (total_q, h, dv) in q's dtype, LSE (h, total_q) float32, both contiguous.
# ``torch.ops.flashgen.bwd_varlen(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k,
# max_seqlen_q, max_seqlen_k, scale, mask, left, right) -> (dQ, dK, dV)``, empty_like
# of q, k, v.  Same paths as the dense op: kernels on CUDA or in the interpreter, else
# the float32 reference, one sequence at a time.

def varlen_kernel_for(kernel: str, q: Tensor, k: Tensor, v: Tensor, mask: str, batch: int,
                      max_seqlen_q: int, max_seqlen_k: int):
    """(TileConfig, loaded module) of varlen ``kernel``: the dispatcher's choice for the
    bucket of (max_seqlen_q, max_seqlen_k, batch * heads), memoized like
    :func:`kernel_for`."""
    disp = dispatch.default_dispatcher()
    interp = not q.is_cuda and interpreting()
    fk = (kernel, mask, q.dtype, q.shape[1:], k.shape[1], v.shape[2], batch, max_seqlen_q, max_seqlen_k, interp)
    hit = disp.fast.get(fk)
    if hit is not None:
        return hit
    capturing = dispatch.graph_capturing()
    spec = KernelSpec(kernel, ops.dtype_name(q.dtype), q.shape[2], v.shape[2], mask)
    key = ProblemKey.from_varlen_sizes(spec, batch=batch, num_heads=q.shape[1], num_kv_heads=k.shape[1],
                                       max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    return _choose(disp, fk, key, capturing)


def varlen_backward_kernels(q: Tensor, k: Tensor, v: Tensor, mask: str, batch: int, max_seqlen_q: int,
                            max_seqlen_k: int, deterministic: bool):
    """The ragged-batch backward's kernels, as :func:`backward_kernels` for the dense one:
    ``(cfg, module)`` of one family's whole backward (``bwd_varlen``), or
    ``((cfg_dq, module_dq), (cfg_dkdv, module_dkdv))`` of ``bwd_dq_varlen`` and
    ``bwd_dkdv_varlen`` (:meth:`flashgen.dispatch.Dispatcher.backward`), memoized per
    exact sizes."""
    disp = dispatch.default_dispatcher()
    interp = not q.is_cuda and interpreting()
    fk = (("bwd_varlen", deterministic), mask, q.dtype, q.shape[1:], k.shape[1], v.shape[2], batch, max_seqlen_q,
          max_seqlen_k, interp)
    hit = disp.fast.get(fk)
    if hit is not None:
        return hit
    spec = KernelSpec("bwd_dq_varlen", ops.dtype_name(q.dtype), q.shape[2], v.shape[2], mask)
    key = ProblemKey.from_varlen_sizes(spec, batch=batch, num_heads=q.shape[1], num_kv_heads=k.shape[1],
                                       max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    hit = _backward_plan(disp, fk, key, deterministic)
    return varlen_backward_kernels(q, k, v, mask, batch, max_seqlen_q, max_seqlen_k, deterministic) \
        if hit is None else hit


def varlen_bounds(seqlen_q: int, seqlen_k: int, left: int, right: int) -> tuple[int, int]:
    """(diag_lo, diag_hi) of one sequence, as the varlen kernels compute them."""
    off = seqlen_k - seqlen_q
    return (off - left if left >= 0 else -seqlen_q), (off + right if right >= 0 else seqlen_k)


def _sequences(cu_seqlens_q: Tensor, cu_seqlens_k: Tensor):
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    return [(cq[i], cq[i + 1], ck[i], ck[i + 1]) for i in range(len(cq) - 1)]


def _per_seq(t: Tensor) -> Tensor:
    """(n, h, d) rows of one sequence -> (1, h, n, d) for the dense reference."""
    return t.transpose(0, 1).unsqueeze(0)


def reference_forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, left, right, dtype=torch.float32):
    """O (total_q, h, dv) in ``dtype`` and LSE (h, total_q) in ``dtype`` (float64 for the
    tests' reference): :func:`flashgen.reference.forward_bounds` per sequence."""
    o = torch.zeros((q.shape[0], q.shape[1], v.shape[2]), dtype=dtype, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=dtype, device=q.device)
    for a, b, c, e in _sequences(cu_seqlens_q, cu_seqlens_k):
        if b == a:
            continue
        lo, hi = varlen_bounds(b - a, e - c, left, right)
        oi, li, _ = reference.forward_bounds(_per_seq(q[a:b]), _per_seq(k[c:e]), _per_seq(v[c:e]), scale, lo, hi,
                                             dtype)
        o[a:b] = oi[0].transpose(0, 1)
        lse[:, a:b] = li[0]
    return o, lse


def reference_backward_varlen(do, q, k, v, cu_seqlens_q, cu_seqlens_k, scale, left, right, dtype=torch.float32):
    """dQ, dK, dV in ``dtype``: :func:`flashgen.reference.backward_bounds` per sequence."""
    dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=dtype, device=q.device)
    dv = torch.zeros(v.shape, dtype=dtype, device=q.device)
    for a, b, c, e in _sequences(cu_seqlens_q, cu_seqlens_k):
        if b == a or e == c:
            continue
        lo, hi = varlen_bounds(b - a, e - c, left, right)
        g = reference.backward_bounds(_per_seq(do[a:b]), _per_seq(q[a:b]), _per_seq(k[c:e]), _per_seq(v[c:e]),
                                      scale, lo, hi, dtype)
        dq[a:b], dk[c:e], dv[c:e] = (x[0].transpose(0, 1) for x in g)
    return dq, dk, dv


def _varlen_empty(q: Tensor, k: Tensor, cu_seqlens_q: Tensor) -> bool:
    return q.shape[0] == 0 or q.shape[1] == 0 or k.shape[0] == 0 or cu_seqlens_q.shape[0] <= 1


def forward_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                   max_seqlen_q: int, max_seqlen_k: int, scale: float, mask: str, left: int, right: int):
    """(O, LSE): the varlen forward op's real implementation."""
    tq, h, _ = q.shape
    if _varlen_empty(q, k, cu_seqlens_q):
        return (q.new_zeros((tq, h, v.shape[2])),
                torch.full((h, tq), float("-inf"), dtype=torch.float32, device=q.device))
    if not use_kernels(q):
        o, lse = reference_forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, left, right)
        return o.to(q.dtype), lse
    q, scale, _ = _signed_q(q, scale)
    batch = cu_seqlens_q.shape[0] - 1
    with _on_device(q):
        cfg, mod = varlen_kernel_for("fwd_varlen", q, k, v, mask, batch, max_seqlen_q, max_seqlen_k)
        return families.launcher(cfg.family, "fwd_varlen")(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=scale, mask=mask,
            win_left=left, win_right=right, config=cfg, module=mod)


def backward_varlen(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, cu_seqlens_q: Tensor,
                    cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, scale: float, mask: str,
                    left: int, right: int):
    """(dQ, dK, dV): the varlen backward op's real implementation: one family's whole
    backward (``bwd_varlen``; the Gluon one on sm_90, whose dQ accumulation order varies)
    or the ``bwd_dq_varlen`` + ``bwd_dkdv_varlen`` kernels (bitwise repeatable; always
    under torch's ``use_deterministic_algorithms``), as the dispatcher chooses."""
    if _varlen_empty(q, k, cu_seqlens_q):
        return _zeros_like(q), _zeros_like(k), _zeros_like(v)
    if do.stride(-1) != 1:
        do = do.contiguous()
    if not use_kernels(q):
        dq, dk, dv = reference_backward_varlen(do, q, k, v, cu_seqlens_q, cu_seqlens_k, scale, left, right)
        return _into(q, dq), _into(k, dk), _into(v, dv)
    q, scale, sign = _signed_q(q, scale)
    batch = cu_seqlens_q.shape[0] - 1
    sizes = (batch, max_seqlen_q, max_seqlen_k)
    det = deterministic_backward(None)
    with _on_device(q):
        while True:
            plan = varlen_backward_kernels(q, k, v, mask, *sizes, det)
            if len(plan) == 2 and isinstance(plan[0], tuple):
                break
            cfg, mod = plan  # one family's whole backward
            try:
                dq, dk, dv = families.launcher(cfg.family, "bwd_varlen")(
                    do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=scale,
                    mask=mask, win_left=left, win_right=right, config=cfg, module=mod)
                return _signed_dq(dq, sign), dk, dv
            except LaunchLimitError:  # these sizes only: the two kernels take this call
                plan = (varlen_kernel_for("bwd_dq_varlen", q, k, v, mask, *sizes),
                        varlen_kernel_for("bwd_dkdv_varlen", q, k, v, mask, *sizes))
                break
            except Exception as e:  # noqa: BLE001 - a non-portable family's build failure: fall back
                fall_back(cfg, "bwd_varlen", q, e, (ops.dtype_name(q.dtype), q.shape[2], v.shape[2], mask, ""))
        # the two kernels (the Triton family's launcher runs both)
        (cfg_dq, mod_dq), (cfg_kv, mod_kv) = plan
        dq, dk, dv = families.launcher(cfg_dq.family, "bwd_varlen")(
            do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=scale,
            mask=mask, win_left=left, win_right=right, config_dq=cfg_dq, config_dkdv=cfg_kv, module_dq=mod_dq,
            module_dkdv=mod_kv)
    return _signed_dq(dq, sign), dk, dv


@torch.library.custom_op("flashgen::fwd_varlen", mutates_args=())
def fwd_varlen_op(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                  max_seqlen_k: int, scale: float, mask: str, left: int, right: int) -> tuple[Tensor, Tensor]:
    return forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, mask, left, right)


@fwd_varlen_op.register_fake
def _fwd_varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, mask, left, right):
    tq, h, _ = q.shape
    return q.new_empty((tq, h, v.shape[2])), q.new_empty((h, tq), dtype=torch.float32)


@torch.library.custom_op("flashgen::bwd_varlen", mutates_args=())
def bwd_varlen_op(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, cu_seqlens_q: Tensor,
                  cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, scale: float, mask: str, left: int,
                  right: int) -> tuple[Tensor, Tensor, Tensor]:
    return backward_varlen(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
                           mask, left, right)


@bwd_varlen_op.register_fake
def _bwd_varlen_fake(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, mask,
                     left, right):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context_varlen(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_sq, max_sk, scale, mask, left, right = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_k)
    ctx.args = (max_sq, max_sk, scale, mask, left, right)
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)  # see EagerAttention.forward


def _backward_varlen(ctx, do, _dlse):
    if do is None:
        return (None,) * 11
    q, k, v, o, lse, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = torch.ops.flashgen.bwd_varlen(do, q, k, v, o, lse, cu_q, cu_k, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None, None, None


fwd_varlen_op.register_autograd(_backward_varlen, setup_context=_setup_context_varlen)

FWD_VARLEN = torch.ops.flashgen.fwd_varlen.default
BWD_VARLEN = torch.ops.flashgen.bwd_varlen.default

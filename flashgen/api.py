"""The public ops: input checks, the per-call fast path, torch's SDPA signature, explain.

``attention`` computes exact softmax attention with FlashAttention's algorithm (Dao et
al. 2022, "FlashAttention: Fast and Memory-Efficient Exact Attention with
IO-Awareness"; Dao 2023, "FlashAttention-2"): tiled, online softmax, no
seqlen_q x seqlen_k matrix in memory, and a backward that recomputes the probabilities
from the saved log-sum-exp.
"""

from __future__ import annotations

from dataclasses import dataclass

import math
import numbers
import weakref

import torch

from . import dispatch, documents, dropout, families, hot, library, ops
from .errors import InputError, type_name
from .masks import mask_bounds
from .spec import KernelSpec, ProblemKey

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


#: The magnitudes a non-zero softmax_scale may have: the kernels multiply scores by
#: softmax_scale * log2(e) in float32, where smaller values round to 0 and larger ones
#: overflow for ordinary scores.
SCALE_MIN, SCALE_MAX = 1e-30, 1e30


def _check_return_lse(return_lse):
    if type(return_lse) is not bool:
        raise InputError(f"return_lse must be a bool, got {type_name(return_lse)}")


def _scale_in_range(softmax_scale) -> bool:
    return softmax_scale == 0 or SCALE_MIN <= abs(softmax_scale) <= SCALE_MAX


def _symbolic(x) -> bool:
    """Whether the value of the number ``x`` may be unknown here: under torch.compile a
    float argument that changed between calls is traced symbolically, and a Python
    check of its value cannot be traced (``math.isfinite``: the graph breaks, an error
    under fullgraph), so the value checks are left out while compiling (torch's SDPA
    checks none either); the type checks stay."""
    return isinstance(x, (torch.SymFloat, torch.SymInt)) or torch.compiler.is_compiling()


def scale_range_reason(name: str, scale) -> str | None:
    """Why a real ``scale`` (named ``name``) is handed to torch's attention: not finite,
    or neither 0 nor a magnitude in [SCALE_MIN, SCALE_MAX]; None when flashgen takes it
    (or cannot tell: a symbolic scale under torch.compile)."""
    if _symbolic(scale) or (math.isfinite(scale) and _scale_in_range(scale)):
        return None
    return f"{name} = {scale!r} (flashgen: 0 or a magnitude in [{SCALE_MIN:g}, {SCALE_MAX:g}])"


def _check_scale_causal(softmax_scale, causal):
    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (numbers.Real, torch.SymFloat)):
            raise InputError(f"softmax_scale must be a real number or None, got {type_name(softmax_scale)}")
        if not _symbolic(softmax_scale):  # else its value may be the compiled graph's input
            if not math.isfinite(softmax_scale):
                raise InputError(f"softmax_scale must be finite, got {softmax_scale}")
            if not _scale_in_range(softmax_scale):
                raise InputError(f"softmax_scale must be 0 or have a magnitude in [{SCALE_MIN:g}, {SCALE_MAX:g}] "
                                 f"(the kernels apply it in float32), got {softmax_scale!r}")
    if not isinstance(causal, bool):
        raise InputError(f"causal must be a bool, got {type_name(causal)}")


def _check_like_q(q, others):
    """q's dtype is served; each (name, tensor) of ``others`` has q's dtype and device."""
    if q.dtype not in _DTYPES:
        raise InputError(f"q.dtype must be float16, bfloat16 or float32, got {q.dtype}")
    for name, t in others:
        if t.dtype != q.dtype:
            raise InputError(f"{name}.dtype ({t.dtype}) must equal q.dtype ({q.dtype})")
        if t.device != q.device:
            raise InputError(f"{name}.device ({t.device}) must equal q.device ({q.device})")


def _check_heads(h: int, hk: int, kv: str, where: str = "") -> None:
    """num_kv_heads >= 1 and num_heads a multiple of it (GQA/MQA groups)."""
    if hk == 0:
        raise InputError(f"num_kv_heads of {kv} is 0: it must be at least 1 (q has {h} heads){where}")
    if h % hk != 0:
        raise InputError(f"num_heads of q ({h}) must be a multiple of num_kv_heads of {kv} ({hk}){where}")


def _check_head_dims(dims):
    for name, dd in dims:
        if not (8 <= dd <= 256 and dd % 8 == 0):
            raise InputError(f"{name} must be a multiple of 8 in [8, 256], got {dd}")


def _check(q, k, v, softmax_scale, causal=False):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise InputError(f"{name} must be a torch.Tensor, got {type_name(t)}")
        if t.dim() != 4:
            raise InputError(f"{name} must have 4 dims (batch, heads, seqlen, head_dim), got shape {tuple(t.shape)}")
    _check_like_q(q, (("k", k), ("v", v)))
    b, h, _, d = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise InputError(f"batch sizes differ: q {b}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[1] != v.shape[1]:
        raise InputError(f"k and v must have the same number of heads, got {k.shape[1]} and {v.shape[1]}")
    if k.shape[2] != v.shape[2]:
        raise InputError(f"k and v must have the same seqlen_k, got {k.shape[2]} and {v.shape[2]}")
    hk = k.shape[1]
    _check_heads(h, hk, "k/v")
    if k.shape[3] != d:
        raise InputError(f"k.shape[-1] (head_dim {k.shape[3]}) must equal q.shape[-1] ({d})")
    _check_head_dims((("q/k head_dim", d), ("v head_dim", v.shape[3])))
    _check_scale_causal(softmax_scale, causal)


def _last_dim_contiguous(t):
    return t if t.stride(-1) == 1 else t.contiguous()


# -- the per-call path -----------------------------------------------------------------
#
# A call is checked once per distinct (shapes, dtypes, devices, mask arguments): the
# rules of ``_check`` depend on nothing else, so a later call with the same tuple only
# re-checks what can differ (the tensors' exact type and softmax_scale's type) and
# reuses the mask bounds and, for CUDA tensors, the forward kernel's TileConfig and
# loaded module.  These entries live in the dispatcher's ``fast`` table, so clearing or
# replacing the dispatcher drops them; an entry made during a CUDA graph capture is not
# kept (its config may be the capture-time default).  Plain tensors outside
# torch.compile, TorchDispatchModes and functorch transforms skip the torch.library
# dispatcher (about 115 us per call on the H200's host, benchmarks/host_cost.py): with
# no autograd they are launched directly, with autograd they go through
# :class:`flashgen.library.EagerAttention`.  Everything else goes through
# ``torch.ops.flashgen.fwd``, which carries the autograd formula and the fake kernel.
# All run the same implementations, :func:`flashgen.library.forward` / ``backward``.

_Tensor = torch.Tensor
_dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", lambda: 0)
_functorch_active = library.functorch_active


def _values_unreadable(*tensors) -> bool:
    """Whether the values of ``tensors`` cannot be read on the host here: traced
    (torch.compile), meta or fake tensors, a dispatch mode (FakeTensorMode, ...) or a
    functorch transform (vmap's batched tensors) active."""
    if torch.compiler.is_compiling() or _dispatch_modes() or _functorch_active():
        return True
    return any(isinstance(t, torch.Tensor) and (t.is_meta or type(t) is not _Tensor) for t in tensors)


_forward_ad = library.forward_ad
_no_forward_ad = library.no_forward_ad


def _prepare(q, k, v, causal, window, softmax_scale, align):
    """Checked call: (q, k, v with last-dim stride 1, scale, mask, lo, hi)."""
    _check(q, k, v, softmax_scale, causal)
    sq, d, sk = q.shape[2], q.shape[3], k.shape[2]
    mask, lo, hi = mask_bounds(sq, sk, causal=causal, window=window, align=align)
    scale = d ** -0.5 if softmax_scale is None else float(softmax_scale)
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    return q, k, v, scale, mask, lo, hi


def _fast_lookup(disp, q, k, v, causal, window, align, tag):
    """(key, entry) of a call in the dispatcher's fast table (entry None: none yet); the
    key holds what ``_check`` and ``mask_bounds`` read, plus ``tag`` (what else the entry
    depends on).  The argument types are part of the key: 1 == True and (1.0, 0) ==
    (1, 0), but only bools and ints pass the checks.  Strides and base alignment decide
    the layout signature (a ProblemKey's layout).  (None, None) for a window that makes
    no key (a list, a non-sequence): the checked path, which names the error."""
    try:
        key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
               q.stride(), k.stride(), v.stride(), (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15,
               causal, type(causal), window, tuple(map(type, window)), align, tag)
        return key, disp.fast.get(key)
    except TypeError:
        return None, None


def _fast_scale(softmax_scale) -> bool:
    """Whether a call whose other arguments passed the checks before needs no check of
    ``softmax_scale`` (None, or a float in range; anything else takes the checked path)."""
    return softmax_scale is None or (type(softmax_scale) is float and _scale_in_range(softmax_scale))


def _prepare_memo(q, k, v, causal, window, softmax_scale, align):
    """:func:`_prepare` of the paths that launch through :mod:`flashgen.library` (user
    functions), its checks and mask bounds memoized in the dispatcher's fast table per
    :func:`_fast_lookup` (plain tensors only, as in :func:`_attention`)."""
    disp = dispatch._default or dispatch.default_dispatcher()
    ekey = None
    if type(q) is _Tensor and type(k) is _Tensor and type(v) is _Tensor and not _functorch_active():
        ekey, entry = _fast_lookup(disp, q, k, v, causal, window, align, "prepared")
        if entry is not None and _fast_scale(softmax_scale):
            mask, lo, hi, default = entry
            scale = default if softmax_scale is None else float(softmax_scale)
            return _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v), scale, mask, lo, hi
    q, k, v, scale, mask, lo, hi = _prepare(q, k, v, causal, window, softmax_scale, align)
    if ekey is not None:
        if len(disp.fast) >= library.FAST_TABLE_MAX:
            disp.fast.clear()
        disp.fast[ekey] = (mask, lo, hi, q.shape[3] ** -0.5)
    return q, k, v, scale, mask, lo, hi


def _entry(disp, ekey, q, k, v, mask, lo, hi, kernel_path):
    """The fast-path entry of a checked call: (mask, lo, hi, default scale, config,
    module, CUDA device index, :class:`flashgen.hot.Calls`); config, module and the
    calls' recipes only where kernels run, the recipes only for 16-byte aligned q, k,
    v (the key's alignment bits 0)."""
    cfg = mod = dev = calls = None
    capturing = False
    if kernel_path and not library.is_empty(q, k):
        if q.is_cuda:
            dev = q.device.index
            with torch.cuda.device(dev):
                capturing = dispatch.graph_capturing()
                cfg, mod = library.kernel_for("fwd", q, k, v, mask, bounds=(lo, hi))
        else:
            capturing = dispatch.graph_capturing()
            cfg, mod = library.kernel_for("fwd", q, k, v, mask, bounds=(lo, hi))
        if ekey[12] == 0:
            # a call whose scale takes the checked path comes here every time: keep its recipes
            old = disp.fast.get(ekey)
            calls = old[7] if old is not None and old[7] is not None else hot.Calls(dev if dev is not None else -1)
    entry = (mask, lo, hi, q.shape[3] ** -0.5, cfg, mod, dev, calls)
    if not capturing:
        if len(disp.fast) >= library.FAST_TABLE_MAX:
            disp.fast.clear()
        disp.fast[ekey] = entry
    return entry


def _check_deterministic(deterministic):
    if deterministic is not None and type(deterministic) is not bool:
        raise InputError(f"deterministic must be None or a bool, got {type_name(deterministic)}")


def _attention(q, k, v, *, causal, window, softmax_scale, return_lse, align, deterministic=None):
    _check_return_lse(return_lse)
    if torch.compiler.is_compiling():
        # Traced by dynamo: the checks run at trace time, the op is one graph node.
        q, k, v, scale, mask, lo, hi = _prepare(q, k, v, causal, window, softmax_scale, align)
        o, lse = library.FWD(q, k, v, scale, mask, lo, hi, deterministic)
        return (o, lse) if return_lse else o
    disp = dispatch._default or dispatch.default_dispatcher()
    entry = ekey = None
    # functorch's wrappers (vmap, grad) are Tensors without storage: no fast path
    plain = type(q) is _Tensor and type(k) is _Tensor and type(v) is _Tensor and not _functorch_active()
    if plain:
        kernel_path = library.use_kernels(q)
        ekey, entry = _fast_lookup(disp, q, k, v, causal, window, align, kernel_path)
    if entry is not None and _fast_scale(softmax_scale):
        mask, lo, hi, default, cfg, mod, dev, calls = entry
        scale = default if softmax_scale is None else softmax_scale
        q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    else:
        q, k, v, scale, mask, lo, hi = _prepare(q, k, v, causal, window, softmax_scale, align)
        cfg = mod = dev = calls = None
        if ekey is not None:
            _, _, _, _, cfg, mod, dev, calls = _entry(disp, ekey, q, k, v, mask, lo, hi, kernel_path)
    if not plain or _dispatch_modes():  # plain excludes functorch transforms
        o, lse = library.FWD(q, k, v, scale, mask, lo, hi, deterministic)
    elif torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        o, lse = library.EagerAttention.apply(q, k, v, scale, mask, lo, hi, None, deterministic, calls)
    elif calls is not None and calls.ready(scale):
        # Kernels, non-empty, no autograd, 16-byte aligned, plans usable: the call's recipe
        # (flashgen.hot), recorded through library.forward on its first call
        o, lse = calls.forward(q, k, v, scale, mask, lo, hi)
    elif mod is not None and scale > 0:
        # Kernels, non-empty, no autograd: launch the memoized kernel on the inputs' device,
        # into an O laid out as every other path lays it out (library.out_like)
        launch = families.launcher(cfg.family, "fwd")
        out = library.out_like(q, v.shape[3])
        try:
            if dev is None or dev == torch.cuda.current_device():
                o, lse = launch(q, k, v, softmax_scale=scale, mask=mask, diag_lo=lo, diag_hi=hi, config=cfg,
                                module=mod, addressable=True, out=out)
            else:
                with torch.cuda.device(dev):
                    o, lse = launch(q, k, v, softmax_scale=scale, mask=mask, diag_lo=lo, diag_hi=hi, config=cfg,
                                    module=mod, addressable=True, out=out)
        except Exception as e:  # noqa: BLE001 - a non-portable family's build failure: warn, fall back
            library.fall_back(cfg, "fwd", q, e, (ops.dtype_name(q.dtype), q.shape[3], v.shape[3], mask, ""))
            o, lse = library.forward(q, k, v, scale, mask, lo, hi)
    else:
        o, lse = library.forward(q, k, v, scale, mask, lo, hi)
    return (o, lse) if return_lse else o


def _check_mods(q, k, softcap, alibi_slopes, bias, dropout_p, rng_state):
    """Checked score-mod arguments: (softcap, alibi float32 (h,) or (b, h), bias expanded
    to (b, h, sq, sk) in q's dtype or None, dropout_p, the rng state or None)."""
    b, h, sq, _ = q.shape
    sk = k.shape[2]
    if isinstance(softcap, bool) or not isinstance(softcap, (numbers.Real, torch.SymFloat)):
        raise InputError(f"softcap must be a finite real >= 0 (0: off), got {softcap!r}")
    if not _symbolic(softcap):  # else its value may be the compiled graph's input
        if not math.isfinite(softcap) or softcap < 0:
            raise InputError(f"softcap must be a finite real >= 0 (0: off), got {softcap!r}")
        if softcap > SCALE_MAX:  # past float32's range the kernels' s / softcap and softcap * tanh(...) give NaN
            raise InputError(f"softcap must be at most {SCALE_MAX:g} (the kernels apply it in float32), "
                             f"got {softcap!r}")
        if 0 < softcap < SCALE_MIN:  # 1 / softcap overflows float32: a score of 0 gives 0 * inf = NaN
            raise InputError(f"softcap must be 0 (off) or at least {SCALE_MIN:g} (the kernels apply 1 / softcap "
                             f"in float32), got {softcap!r}")
    dropout_p = dropout.check_p(dropout_p)
    if alibi_slopes is not None:
        a = alibi_slopes
        if not isinstance(a, torch.Tensor) or a.dtype != torch.float32:
            raise InputError("alibi_slopes must be a float32 tensor of shape (num_heads,) or (batch, num_heads), got "
                             + (str(a.dtype) if isinstance(a, torch.Tensor) else type(a).__name__))
        if tuple(a.shape) not in ((h,), (b, h)):
            raise InputError(f"alibi_slopes must have shape ({h},) or ({b}, {h}) (num_heads = {h}), "
                             f"got {tuple(a.shape)}")
        if a.device != q.device:
            raise InputError(f"alibi_slopes.device ({a.device}) must equal q.device ({q.device})")
        if a.requires_grad:
            raise InputError("alibi_slopes must not require grad (flashgen computes no gradient for them)")
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise InputError(f"bias must be a torch.Tensor or None, got {type_name(bias)}")
        if bias.dtype != q.dtype and bias.dtype != torch.bool:
            raise InputError(f"bias.dtype must be q.dtype ({q.dtype}) or torch.bool (True = attend), got {bias.dtype}")
        if bias.device != q.device:
            raise InputError(f"bias.device ({bias.device}) must equal q.device ({q.device})")
        if bias.requires_grad:
            raise InputError("bias must not require grad: flashgen computes no bias gradient (detach it)")
        if bias.dim() > 4:
            raise InputError(f"bias must have at most 4 dims, got shape {tuple(bias.shape)}")
        if bias.dtype == torch.bool:
            bias = torch.zeros((), dtype=q.dtype, device=q.device).masked_fill(~bias, float("-inf"))
        try:
            bias = bias.expand(b, h, sq, sk)
        except RuntimeError:
            raise InputError(f"bias of shape {tuple(bias.shape)} does not broadcast to (batch, num_heads, seqlen_q, "
                             f"seqlen_k) = {(b, h, sq, sk)}") from None
    if rng_state is not None:
        dropout._check_state(rng_state, q.device)
    return float(softcap), alibi_slopes, bias, float(dropout_p), rng_state


def _attention_mods(q, k, v, *, causal, window, softmax_scale, return_lse, align, softcap, alibi_slopes, bias,
                    dropout_p, rng_state, deterministic=None):
    """The path of calls with score modifications (no per-call memo: the checks run each call).
    Their backward is the dispatcher's (:meth:`flashgen.dispatch.Dispatcher.backward`):
    the Triton family's two kernels (bitwise repeatable), or with softcap and ALiBi alone
    the Gluon whole backward where it serves and measured faster, unless
    ``deterministic`` (or torch's flag) asks for repeatable gradients."""
    _check_return_lse(return_lse)
    q, k, v, scale, mask, lo, hi = _prepare(q, k, v, causal, window, softmax_scale, align)
    softcap, alibi, bias, dropout_p, rng_state = _check_mods(q, k, softcap, alibi_slopes, bias, dropout_p, rng_state)
    rng = None
    if dropout_p > 0:
        library.check_dropout_runs(q, k, dropout_p)  # before the state advances
        rng = dropout.draw(q.device, dropout.counters(q.shape[0], q.shape[1], q.shape[2], k.shape[2]), rng_state)
    args = (q, k, v, scale, mask, lo, hi, softcap, alibi, bias, dropout_p, rng)
    plain = type(q) is _Tensor and type(k) is _Tensor and type(v) is _Tensor
    if torch.compiler.is_compiling() or not plain or _dispatch_modes() or _functorch_active():
        o, lse = library.FWD_MODS(*args, deterministic)
    elif torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        o, lse = library.EagerAttention.apply(q, k, v, scale, mask, lo, hi, library.score_mods(*args[7:]),
                                              deterministic)
    else:
        o, lse = library.forward_mods(*args)
    return (o, lse) if return_lse else o


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              window: tuple[int, int] = (-1, -1), softmax_scale: float | None = None,
              return_lse: bool = False, softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
              bias: torch.Tensor | None = None, dropout_p: float = 0.0, rng_state: torch.Tensor | None = None,
              score_mod=None, mask_mod=None, sinks: torch.Tensor | None = None,
              deterministic: bool | None = None):
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
            as given (uniform attention over the visible keys); any other value needs a
            magnitude in [1e-30, 1e30] (it is applied in float32).  The backward
            recomputes P = exp(s - LSE) from the float32 LSE (FlashAttention's
            recomputation), so its accuracy falls with the scores' magnitude: an
            absolute error of about |LSE| * 6e-8 in every exponent (rows with scores
            of 1e4 lose about 1e-3 of their probabilities' relative accuracy; from
            about 1e6 the gradients are wrong, from 1e8 not finite); the forward is
            exact at any magnitude up to about 2.3e38 (past it the kernels' base-2
            scaling by log2(e) overflows float32).
        return_lse: a bool: also return the log-sum-exp of each score row.
        deterministic: None (default) follows ``torch.are_deterministic_algorithms_enabled()``
            when the backward runs; True makes the backward bitwise repeatable (on sm_90
            the Gluon backward with dQ added in a fixed order where a tuning row
            measured it faster, else the Triton family's bwd_dq + bwd_dkdv kernels,
            dQ by its own pass); False lets
            the dispatcher pick the fastest backward, which on sm_90 may be the Gluon
            family's (dQ accumulated in float32 by TMA reduce-add, in an order that varies
            from run to run: repeated gradients can differ in the last bits).  The
            forward is deterministic either way.  ``explain`` says which backward runs.

    Score modifications, each compiled into the kernels only when used (a separate
    tuned variant; :data:`flashgen.spec.MODS`), applied to s = softmax_scale * q.k in
    this order, before the mask (softcap and ALiBi run in either kernel family on sm_90,
    the dispatcher choosing per problem by measurement, the Gluon family's as fixed score
    functions, :mod:`flashgen.families.gluon.builtin_mods`; bias and dropout in the
    Triton family's kernels):

        softcap: > 0: s <- softcap * tanh(s / softcap) (Gemma 2's logit soft-capping,
            FlashAttention-2's ``softcap``); 0 (default) is off; at most 1e30 (it is
            applied in float32).
        alibi_slopes: float32 (num_heads,) or (batch, num_heads): s <- s - slope *
            |i + seqlen_k - seqlen_q - j| (Press et al. 2022, "Train Short, Test Long";
            FlashAttention-2's bottom-right ALiBi).  No gradient.
        bias: an additive bias broadcastable to (batch, num_heads, seqlen_q, seqlen_k),
            q's dtype (added in float32), or torch.bool (True = attend, False = -inf).
            Read tile by tile, never materialized at full size; -inf entries mask (a
            row left with no finite score outputs 0, LSE = -inf), finite ones do not
            (finfo.min is a very low score; scores are clamped to +-2.3e38, where
            float32 base-2 logits end).  No gradient: a bias that requires grad is an
            error.
        dropout_p: in [0, 1): drops normalized probabilities with this rate and scales
            the kept ones by 1 / (1 - dropout_p) (the LSE is of the undropped scores).
            The mask comes from Philox keyed by (seed, offset, batch, head, row,
            column) (:mod:`flashgen.dropout`), so it does not depend on the tile
            config, the backward recomputes it exactly, and :func:`flashgen.dropout_mask`
            returns it.  Needs the Triton kernels (CUDA, or TRITON_INTERPRET=1 on CPU).
        rng_state: int64 (2,) [seed, offset] on q's device that dropout reads and
            advances in place by batch * num_heads * seqlen_q * ceil(seqlen_k / 4), the
            Philox counters it used (one per 4 key columns of a row).  Default: a
            (seed, offset) drawn from torch's generator of q's device, as torch's
            dropout draws (``torch.manual_seed`` reproduces it, ``torch.utils.checkpoint``
            restores it for a recomputed forward), or after :func:`flashgen.manual_seed`
            flashgen's own per-device state.  A CUDA graph replay draws anew either way.

    User functions (FlexAttention's signatures, :mod:`flashgen.user_mods`), each
    distinct function compiled into its own tuned variants; not combined with softcap,
    alibi_slopes, bias or dropout_p (write those into ``score_mod``):

        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score`` on s =
            softmax_scale * q.k (float32, natural units) of batch b, query head h, query
            row q_idx and key column kv_idx (integers), written with torch operations
            (arithmetic, comparisons, torch.where, abs, tanh, exp, log, clamp,
            minimum/maximum, floor, integer division, casts) and reading captured
            tensors by integer indices (``table[bucket, h]``).  Applied before the
            mask.  Captured float tensors that require grad get their gradient
            (accumulated in float32); their values must be finite (mask with
            ``mask_mod``).  The result is clamped to +-2.3e38, as ``bias`` scores
            are, where it can leave that range: a captured float32 or bfloat16
            tensor or a constant beyond the bound that reaches the score through
            sums, differences, selects, bounds and products with constants (an
            additive finfo.min mask), or log, exp, a division by a traced value,
            pow.  A row whose scores all sit at the clamp gets the forward of
            torch (the mean of its values) and the backward accuracy of such
            magnitudes (``softmax_scale``): hide whole rows with ``mask_mod``.  A function is traced once (cached by its code and its
            closure's objects, so a closure made again on every call over the same
            objects is not traced again, and by the values it may have taken as
            constants from the objects it reads: a changed ``self.temperature``,
            attribute of a callable object or list item is traced again); captured
            tensors are read at each call (one the function also computes with
            outside its indices, ``int(doc.max())`` beside ``doc[q_idx]``, is traced
            again when it changes in place).
            Indices must lie in [0, size) of each dim (a negative index is not
            wrapped as torch wraps it): on the kernel path every index that does not
            depend on the score is checked over the whole (b, h, q_idx, kv_idx) grid
            before the kernels run (once per function, sizes and, for an index read
            from a captured tensor, the tensors' versions); InputError otherwise.  An
            index computed from the score is known inside the kernels only: they check
            it (every dim of that read) and, where it lies outside the tensor, read
            nothing and make that score NaN, so the query rows it touches come out NaN
            (O, LSE, and in the backward those rows' dQ, and dK, dV and the captured
            tensors' gradients they reach); nothing is read or written past a tensor.
            CPU tensors without Triton's interpreter run the function in torch itself,
            whose indexing applies: such an index out of range raises torch's
            IndexError, and a negative one wraps.
            Integer arithmetic is int32 in the kernels unless a constant needs int64
            (int64 from there on, as in torch); a constant outside int64 is an
            UnsupportedError.
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (True = attend), ANDed with
            ``causal``/``window``.  It also gives the block mask: tiles it hides
            entirely are skipped, tiles it shows entirely run with no mask arithmetic
            (computed once per function, captured tensors' versions, sizes and tile
            shape, by evaluating mask_mod with torch on index tensors; cached).
        sinks: float32 (num_heads,), finite (not checked: checking would synchronize
            with the device; a non-finite sink gives NaN on the kernel path): one extra
            logit per head in every row's softmax
            denominator (attention sinks, as in gpt-oss): p_ij = exp(s_ij - LSE_i) with
            LSE_i = log(exp(sinks[h]) + sum_j exp(s_ij)).  The returned LSE includes the
            sink; a row that sees no key gets O = 0 and LSE = sinks[h].  Differentiable
            when it requires grad.

    Returns:
        O of shape (batch, num_heads, seqlen_q, head_dim_v), q's dtype; with
        ``return_lse``, also LSE (batch, num_heads, seqlen_q), float32, natural log,
        -inf for rows that see no key.  Differentiable in q, k, v (the backward
        recomputes P from the LSE; dK and dV are summed over each GQA group).  The
        LSE is returned as a constant (no gradient flows through it, as in
        FlashAttention's interface): a loss that uses it gets no gradient from that
        term.  No double backward: gradients taken with ``create_graph=True`` raise
        RuntimeError when differentiated again.  Of torch.func's transforms ``vmap``
        runs (torch's per-sample fallback, slow); ``grad``, ``vjp`` and ``jacrev``
        raise UnsupportedError (the op's autograd, registered with
        ``torch.library.register_autograd``, does not take them), and so do
        forward-mode derivatives (``jvp``, ``jacfwd``, dual tensors of
        ``torch.autograd.forward_ad``; the op's tangent would be zero);
        :func:`scaled_dot_product_attention` hands all of these to torch's own.  The backward re-reads q, k, v, the
        bias, the ALiBi slopes, the sinks and the tensors the user functions read:
        modifying one in place before it runs raises autograd's RuntimeError
        ("modified by an inplace operation").

    Precision: float16/bfloat16 inputs are multiplied on tensor cores with float32
    accumulation; float32 inputs in IEEE float32 (no tf32).

    CPU tensors run through flashgen's reference implementation (float32 math), or
    through the Triton interpreter when ``TRITON_INTERPRET=1`` (float16/float32 only:
    bfloat16 stays on the reference path, as the interpreter's bfloat16 dot is wrong).  CUDA tensors run on
    their own device (cuda:1 inputs on cuda:1, whatever the current device).

    The op is ``torch.ops.flashgen.fwd`` (with a fake kernel and autograd), so
    ``torch.compile(fullgraph=True)`` traces it without a graph break and CUDA graphs
    capture it; inside a capture the dispatcher reads no database.  A call with
    ``score_mod``, ``mask_mod`` or ``sinks`` is not an op: it traces the functions in
    Python and runs outside the compiled graph (``torch.compile`` breaks the graph
    there; ``fullgraph=True`` raises torch's ``Unsupported``).

    Raises:
        InputError (a ValueError): an argument breaks a rule; the message names it
            (a score_mod / mask_mod indexing a captured tensor outside its size: the
            function, the tensor's shape, the dim and the range of indices found).
        UnsupportedError (a NotImplementedError): a score_mod / mask_mod that flashgen
            cannot compile (the message names the operation), e.g. Python control flow
            on traced values.
    """
    if deterministic is not None:
        _check_deterministic(deterministic)
    _no_forward_ad("flashgen.attention", q, k, v, alibi_slopes, bias, sinks)
    if score_mod is not None or mask_mod is not None or sinks is not None:
        return _attention_user(q, k, v, causal=causal, window=window, softmax_scale=softmax_scale,
                               return_lse=return_lse, score_mod=score_mod, mask_mod=mask_mod, sinks=sinks,
                               builtin=(softcap, alibi_slopes, bias, dropout_p, rng_state),
                               deterministic=deterministic)
    if softcap or alibi_slopes is not None or bias is not None or dropout_p or rng_state is not None:
        return _attention_mods(q, k, v, causal=causal, window=window, softmax_scale=softmax_scale,
                               return_lse=return_lse, align="bottom_right", softcap=softcap,
                               alibi_slopes=alibi_slopes, bias=bias, dropout_p=dropout_p, rng_state=rng_state,
                               deterministic=deterministic)
    return _attention(q, k, v, causal=causal, window=window, softmax_scale=softmax_scale,
                      return_lse=return_lse, align="bottom_right", deterministic=deterministic)


def _check_user_alone(softcap, alibi_slopes, bias, dropout_p, rng_state=None) -> None:
    """User functions take none of the built-in score mods (InputError)."""
    if softcap or alibi_slopes is not None or bias is not None or dropout_p or rng_state is not None:
        raise InputError("score_mod, mask_mod and sinks are not combined with softcap, alibi_slopes, bias or "
                         "dropout_p: write those into score_mod")


def _attention_user(q, k, v, *, causal, window, softmax_scale, return_lse, score_mod, mask_mod, sinks, builtin,
                    deterministic=None):
    """The path of calls with user functions or sinks (:mod:`flashgen.user_mods`)."""
    from . import user_mods

    _check_user_alone(*builtin)
    _check_return_lse(return_lse)
    q, k, v, scale, mask, lo, hi = _prepare_memo(q, k, v, causal, window, softmax_scale, "bottom_right")
    o, lse = user_mods.attention(q, k, v, scale, mask, lo, hi, score_mod=score_mod, mask_mod=mask_mod, sinks=sinks,
                                 deterministic=deterministic)
    return (o, lse) if return_lse else o


# -- ragged batches (varlen) -------------------------------------------------------------

def _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise InputError(f"{name} must be a torch.Tensor, got {type_name(t)}")
        if t.dim() != 3:
            raise InputError(f"{name} must have 3 dims (total_tokens, heads, head_dim) for attention_varlen, "
                             f"got shape {tuple(t.shape)}")
    _check_like_q(q, (("k", k), ("v", v)))
    if k.shape[0] != v.shape[0]:
        raise InputError(f"k and v must have the same total_k (dim 0), got {k.shape[0]} and {v.shape[0]}")
    if k.shape[1] != v.shape[1]:
        raise InputError(f"k and v must have the same number of heads, got {k.shape[1]} and {v.shape[1]}")
    h, hk, d = q.shape[1], k.shape[1], q.shape[2]
    _check_heads(h, hk, "k/v")
    if k.shape[2] != d:
        raise InputError(f"k.shape[-1] (head_dim {k.shape[2]}) must equal q.shape[-1] ({d})")
    _check_head_dims((("q/k head_dim", d), ("v head_dim", v.shape[2])))
    for name, cu, total in (("cu_seqlens_q", cu_seqlens_q, q.shape[0]), ("cu_seqlens_k", cu_seqlens_k, k.shape[0])):
        if not isinstance(cu, torch.Tensor):
            raise InputError(f"{name} must be a torch.Tensor, got {type_name(cu)}")
        if cu.dtype != torch.int32:
            raise InputError(f"{name} must be int32, got {cu.dtype}")
        if cu.device != q.device:
            raise InputError(f"{name} must be on q's device ({q.device}), got {cu.device}")
        if cu.dim() != 1 or cu.shape[0] < 1:
            raise InputError(f"{name} must have shape (batch + 1,), got {tuple(cu.shape)}")
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        raise InputError(f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got "
                         f"{cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}")
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(m, bool) or not isinstance(m, numbers.Integral) or m < 0:
            raise InputError(f"{name} must be an int >= 0, got {m!r}")
    _check_scale_causal(softmax_scale, causal)
    if _values_unreadable(cu_seqlens_q, cu_seqlens_k) or dispatch.graph_capturing():
        # No values to read (traced, meta or fake tensors), or reading them would synchronize
        # inside a CUDA graph capture: only the shapes are checked then.
        return
    try:
        seen = (q.shape[0], k.shape[0], int(max_seqlen_q), int(max_seqlen_k), cu_seqlens_q._version,
                cu_seqlens_k._version)
    except RuntimeError:  # inference tensors keep no version counter: checked every call
        seen = None
    memo = _CHECKED_OFFSETS.get((id(cu_seqlens_q), id(cu_seqlens_k)))
    if seen is not None and memo is not None and memo[0]() is cu_seqlens_q and memo[1]() is cu_seqlens_k \
            and memo[2] == seen:
        return  # these tensors' values, unchanged since (same objects, same version), passed for these sizes
    # One device-to-host copy of the offsets (a synchronization on CUDA).
    cus = torch.stack([cu_seqlens_q, cu_seqlens_k]).cpu()
    for name, cu, total, mname, m in (("cu_seqlens_q", cus[0], q.shape[0], "max_seqlen_q", max_seqlen_q),
                                      ("cu_seqlens_k", cus[1], k.shape[0], "max_seqlen_k", max_seqlen_k)):
        if cu[0].item() != 0:
            raise InputError(f"{name}[0] must be 0, got {cu[0].item()}")
        lens = cu[1:] - cu[:-1]
        if lens.numel() and lens.min().item() < 0:
            i = int(torch.nonzero(lens < 0)[0, 0])
            raise InputError(f"{name} must be non-decreasing, but {name}[{i + 1}] = {cu[i + 1].item()} < "
                             f"{name}[{i}] = {cu[i].item()}")
        if cu[-1].item() != total:
            which = "q" if name == "cu_seqlens_q" else "k"
            raise InputError(f"{name}[-1] ({cu[-1].item()}) must equal the number of packed tokens of {which} "
                             f"({which}.shape[0] = {total})")
        longest = int(lens.max().item()) if lens.numel() else 0
        if m < longest:
            i = int(torch.argmax(lens))
            raise InputError(f"{mname} ({m}) is smaller than the length of sequence {i} ({longest}); "
                             f"it must be >= every length in {name}")
    if seen is None:
        return
    if len(_CHECKED_OFFSETS) >= _CHECKED_OFFSETS_MAX:
        _CHECKED_OFFSETS.pop(next(iter(_CHECKED_OFFSETS)))
    _CHECKED_OFFSETS[(id(cu_seqlens_q), id(cu_seqlens_k))] = (weakref.ref(cu_seqlens_q), weakref.ref(cu_seqlens_k),
                                                                seen)


#: Offsets whose values :func:`_check_varlen` read and passed: (id(cu_seqlens_q),
#: id(cu_seqlens_k)) -> (weak references to both, (total_q, total_k, max_seqlen_q,
#: max_seqlen_k, both tensors' versions)).  A model's layers pass the same cu_seqlens
#: tensors to every attention call of a step; the values are read (a synchronization on
#: CUDA) by the first call only, while the tensors are the same objects at the same
#: version (an in-place torch operation on them bumps it).  The oldest entry goes first.
_CHECKED_OFFSETS: dict = {}
_CHECKED_OFFSETS_MAX = 8


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = False,
                     window: tuple[int, int] = (-1, -1), softmax_scale: float | None = None,
                     return_lse: bool = False):
    """Exact attention on a ragged batch of packed sequences (FlashAttention-2's
    variable-length interface, ``flash_attn_varlen_func``: Dao 2023, "FlashAttention-2:
    Faster Attention with Better Parallelism and Work Partitioning").

    Sequence ``z`` of the batch is rows ``cu_seqlens_q[z]:cu_seqlens_q[z + 1]`` of q
    and rows ``cu_seqlens_k[z]:cu_seqlens_k[z + 1]`` of k and v; it attends only to
    itself, as its own (seqlen_q, seqlen_k) problem with :func:`attention`'s
    conventions.

    Args:
        q: (total_q, num_heads, head_dim), float16 / bfloat16 / float32, packed: the
            sequences' rows one after another.  Any strides; a last-dim stride other
            than 1 is copied.
        k: (total_k, num_kv_heads, head_dim), same dtype and device as q.  num_heads
            must be a multiple of num_kv_heads (GQA/MQA): query head h reads key/value
            head h // (num_heads // num_kv_heads).
        v: (total_k, num_kv_heads, head_dim_v).  Head dims are multiples of 8 in [8, 256].
        cu_seqlens_q, cu_seqlens_k: int32, shape (batch + 1,), on q's device: the
            cumulative sequence lengths, starting at 0, non-decreasing, ending at
            total_q (resp. total_k).  A sequence may have length 0 (on either side).
        max_seqlen_q, max_seqlen_k: ints >= the longest query (key) sequence; they size
            the launch grid (programs past a sequence's end exit at once) and pick the
            tuned config's bucket, so pass the true maxima (a value above total_q
            (total_k) is taken as total_q (total_k)).
        causal: FlashAttention's bottom-right alignment, per sequence: with
            off_z = seqlen_k(z) - seqlen_q(z), query i of sequence z sees key j of that
            sequence iff j <= i + off_z (i, j counted from the sequence's first row).
            A query that sees no key (seqlen_q > seqlen_k) returns 0 with LSE = -inf.
        window: (left, right), inclusive, -1 = unbounded, per sequence:
            i + off_z - left <= j <= i + off_z + right.  With causal=True, right is 0.
        softmax_scale: multiplies q @ k^T; None means 1 / sqrt(head_dim).
        return_lse: also return the log-sum-exp of each score row.

    Returns:
        O of shape (total_q, num_heads, head_dim_v), q's dtype; with ``return_lse``,
        also LSE of shape (num_heads, total_q), float32, natural log, -inf for rows
        that see no key (all rows of a sequence with seqlen_k = 0).  Differentiable in
        q, k, v (dK and dV summed over each GQA group); the LSE is a constant.  The
        backward's kernels are the dispatcher's choice: the Triton family's
        bwd_dq_varlen + bwd_dkdv_varlen are bitwise repeatable; on sm_90 the Gluon
        family's whole backward (bwd_varlen) runs where a tuned row or its default's
        measurement puts it ahead (head_dim 128, head_dim 64 without a window, a batch with
        the work the dispatcher asks of a Gluon launch), whose dQ is
        summed by float32 reduce-adds in arrival order (not bitwise repeatable, as
        FlashAttention's); ``torch.use_deterministic_algorithms(True)`` keeps the
        Triton kernels.

    The offsets are checked on the host: on CUDA this copies cu_seqlens to the CPU (one
    synchronization), once per pair of cu_seqlens tensors and sizes: a later call with the
    same tensor objects, unmodified (their version counter; an in-place torch operation
    bumps it), and the same totals and maxima is not checked again, so the layers of a
    model that share a step's offsets synchronize once.  A write that bypasses the
    version counter (through ``.data``, a NumPy view or a DLPack export) is not seen:
    the kernels then read the sequences the new offsets name, past the packed tensors'
    ends if they are out of range, as FlashAttention's would.  CPU tensors run through flashgen's reference, one
    sequence at a time (float32 math), or the Triton interpreter with
    ``TRITON_INTERPRET=1`` (float16/float32).  The op is ``torch.ops.flashgen.fwd_varlen``.

    Raises:
        InputError (a ValueError), naming the argument and the rule: tensors of the wrong
        rank, dtype or device; head counts that are not a multiple; cu_seqlens that are
        not int32, not on q's device, not 1-D, of different lengths, not starting at 0,
        decreasing, or not ending at total_q / total_k; a max_seqlen below a sequence's
        length; a bad window, causal or softmax_scale.  Checking the offsets' values
        copies them to the host (a synchronization on CUDA) once per new or modified
        pair of cu_seqlens tensors; inside a CUDA graph capture they are not read, so
        there they must already be valid.
    """
    _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal)
    _no_forward_ad("flashgen.attention_varlen", q, k, v)
    _check_return_lse(return_lse)
    mask, _, _ = mask_bounds(0, 0, causal=causal, window=window)
    left, right = int(window[0]), (0 if causal else int(window[1]))
    # a side wider than every sequence (e.g. sys.maxsize) hides nothing: bounded to fit the kernels' integers
    left, right = min(left, k.shape[0]), min(right, q.shape[0])
    scale = q.shape[2] ** -0.5 if softmax_scale is None else float(softmax_scale)
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    # No sequence is longer than its side's packed tokens: a larger maximum (an upper bound
    # such as the model's context) would only add launch programs that exit at once.
    max_seqlen_q, max_seqlen_k = min(int(max_seqlen_q), q.shape[0]), min(int(max_seqlen_k), k.shape[0])
    o, lse = library.FWD_VARLEN(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
                                mask, left, right)
    return (o, lse) if return_lse else o


# -- decode with a KV cache (flash-decoding) ----------------------------------------------

#: The layouts attention_with_kvcache takes, named in its shape errors.
_KV_LAYOUT = ("q is (batch, seqlen_q, num_heads, head_dim) and k_cache/v_cache are (batch, seqlen_cache, "
              "num_kv_heads, head_dim) (paged: (num_pages, page_size, num_kv_heads, head_dim)), FlashAttention's "
              "layout; a tensor in (batch, heads, seqlen, head_dim) layout needs .transpose(1, 2)")


def _check_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, causal, softmax_scale, return_lse):
    """Checks of :func:`attention_with_kvcache`; returns the cache capacity (key slots per
    batch entry: seqlen_cache, or max_pages * page_size)."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise InputError(f"{name} must be a torch.Tensor, got {type_name(t)}")
        if t.dim() != 4:
            layout = "(batch, seqlen_q, num_heads, head_dim)" if name == "q" else (
                "(batch, seqlen_cache, num_kv_heads, head_dim), or (num_pages, page_size, num_kv_heads, "
                "head_dim) with block_table")
            raise InputError(f"{name} must have 4 dims {layout}, got shape {tuple(t.shape)}")
    _check_like_q(q, (("k_cache", k_cache), ("v_cache", v_cache)))
    if torch.is_grad_enabled():
        for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
            if t.requires_grad:
                raise InputError(f"{name} requires grad, but attention_with_kvcache is not differentiable (inference "
                                 "only): call it under torch.no_grad() or torch.inference_mode(), or pass detached "
                                 "tensors; flashgen.attention is the differentiable op")
    b, _, h, d = q.shape
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise InputError(f"k_cache and v_cache must agree in their first 3 dims, got {tuple(k_cache.shape)} "
                         f"and {tuple(v_cache.shape)}")
    hk = k_cache.shape[2]
    _check_heads(h, hk, "k_cache/v_cache", f"; attention_with_kvcache reads dim 2 as the heads: {_KV_LAYOUT}")
    if k_cache.shape[3] != d:
        raise InputError(f"k_cache.shape[-1] (head_dim {k_cache.shape[3]}) must equal q.shape[-1] ({d})")
    _check_head_dims((("q/k_cache head_dim", d), ("v_cache head_dim", v_cache.shape[3])))
    if not isinstance(cache_seqlens, torch.Tensor):
        raise InputError(f"cache_seqlens must be a torch.Tensor (int32, shape (batch,)), got "
                         f"{type_name(cache_seqlens)}")
    if cache_seqlens.dtype != torch.int32:
        raise InputError(f"cache_seqlens must be int32, got {cache_seqlens.dtype}")
    if cache_seqlens.device != q.device:
        raise InputError(f"cache_seqlens must be on q's device ({q.device}), got {cache_seqlens.device}")
    if tuple(cache_seqlens.shape) != (b,):
        raise InputError(f"cache_seqlens must have shape (batch,) = ({b},), got {tuple(cache_seqlens.shape)}")
    if block_table is None:
        if k_cache.shape[0] != b:
            raise InputError(f"k_cache.shape[0] ({k_cache.shape[0]}) must equal q's batch ({b}) for a contiguous "
                             f"cache (pass block_table for a paged one); {_KV_LAYOUT}")
        capacity = k_cache.shape[1]
    else:
        if not isinstance(block_table, torch.Tensor):
            raise InputError(f"block_table must be a torch.Tensor or None, got {type_name(block_table)}")
        if block_table.dtype != torch.int32:
            raise InputError(f"block_table must be int32, got {block_table.dtype}")
        if block_table.device != q.device:
            raise InputError(f"block_table must be on q's device ({q.device}), got {block_table.device}")
        if block_table.dim() != 2 or block_table.shape[0] != b:
            raise InputError(f"block_table must have shape (batch, max_pages) with batch = {b}, got "
                             f"{tuple(block_table.shape)}")
        page_size = k_cache.shape[1]
        if page_size == 0 or page_size % 16 != 0:
            raise InputError(f"page_size (k_cache.shape[1] of a paged cache) must be a positive multiple of 16, "
                             f"got {page_size}")
        if block_table.stride(1) != 1:
            raise InputError("block_table must have a last-dim stride of 1 (e.g. block_table.contiguous())")
        capacity = block_table.shape[1] * page_size
    _check_scale_causal(softmax_scale, causal)
    _check_return_lse(return_lse)
    if q.device.type == "cpu" and not _values_unreadable(cache_seqlens, block_table):
        # Values are read only where that is free (CPU); on CUDA it would synchronize
        # every decode step, so there the kernel clamps the lengths instead.
        lens = cache_seqlens
        if b and (int(lens.min()) < 0 or int(lens.max()) > capacity):
            raise InputError(f"cache_seqlens must be in [0, {capacity}] (the cache's capacity), got values in "
                             f"[{int(lens.min())}, {int(lens.max())}]")
        if block_table is not None and b:
            used = (torch.arange(block_table.shape[1]) * k_cache.shape[1])[None, :] < lens[:, None].long()
            pages = block_table[used]
            if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= k_cache.shape[0]):
                raise InputError(f"block_table entries of the pages in use must be in [0, {k_cache.shape[0]}) "
                                 f"(num_pages), got values in [{int(pages.min())}, {int(pages.max())}]")
    return capacity


def attention_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           cache_seqlens: torch.Tensor, *, block_table: torch.Tensor | None = None,
                           causal: bool = False, softmax_scale: float | None = None, return_lse: bool = False):
    """Decode attention over a KV cache (inference, forward only), split-KV.

    FlashAttention's ``flash_attn_with_kvcache`` conventions (layouts (batch, seqlen,
    heads, head_dim), bottom-right causal), computed with flash-decoding (Tri Dao, Daniel
    Haziza, Francisco Massa, Grigory Sizov, "Flash-Decoding for long-context inference",
    2023): the cache's keys are split across ``num_splits`` programs per (batch, kv
    head), each writes a partial output and its log-sum-exp, and a second kernel merges
    the splits by their LSEs.  The GQA group's query heads x seqlen_q rows share one
    tile, so each K/V element is read once per kv head.  ``num_splits`` and the tiles are
    tuned per problem key (``flashgen tune --preset decode``); untuned keys use a
    heuristic (enough splits to fill the GPU).

    Args:
        q: (batch, seqlen_q, num_heads, head_dim), float16 / bfloat16 / float32.  Any
            seqlen_q >= 0 is served; the kernels are tuned for 1..16 (decode steps,
            speculative chunks).  Any strides (a last-dim stride other than 1 is copied).
        k_cache, v_cache: the cache, same dtype and device as q, either
            contiguous: (batch, seqlen_cache, num_kv_heads, head_dim[_v]), or
            paged (with ``block_table``): (num_pages, page_size, num_kv_heads,
            head_dim[_v]), page_size a positive multiple of 16.  Any strides whose last
            is 1 (other tensors are copied).  num_heads must be a multiple of
            num_kv_heads: query head h reads kv head h // (num_heads // num_kv_heads)
            (GQA; MQA with one kv head).  Head dims are multiples of 8 in [8, 256].
        cache_seqlens: int32 (batch,), on q's device: batch entry b sees its first
            cache_seqlens[b] keys (in tokens), 0 <= cache_seqlens[b] <= capacity
            (seqlen_cache, or max_pages * page_size).  What the cache holds past that
            length is never read into the result (it may be garbage or NaN).
        block_table: None (contiguous cache), or int32 (batch, max_pages) on q's device:
            key j of batch b is row j % page_size of page block_table[b, j // page_size].
            Entries past a batch entry's last used page are not read.
        causal: bottom-right: query i of batch b sees key j iff
            j <= i + cache_seqlens[b] - seqlen_q (the new tokens are the last
            seqlen_q of the cache: query i is token cache_seqlens[b] - seqlen_q + i).
            With seqlen_q = 1 causal changes nothing.
        softmax_scale: multiplies q @ k^T; None means 1 / sqrt(head_dim).
        return_lse: also return the log-sum-exp of each score row.

    Returns:
        O of shape (batch, seqlen_q, num_heads, head_dim_v), q's dtype; with
        ``return_lse`` also LSE (batch, num_heads, seqlen_q), float32, natural log.
        A row that sees no key (cache_seqlens[b] == 0, or causal rows before the first
        key) gets O = 0 and LSE = -inf.  Not differentiable (inference only): with
        grad mode on, an input that requires grad is an InputError on every path
        (eager, torch.compile, the reference and the kernels alike).

    The ProblemKey buckets seqlen_q (1, 2, 4, 8, 16, ...), the cache's capacity (not
    the per-batch lengths: reading them would synchronize) and batch * num_heads; the
    paged and contiguous caches are different kernels (``decode_paged``, ``decode``).
    CPU tensors run through flashgen's reference (float32 math), or the
    Triton interpreter with ``TRITON_INTERPRET=1`` (float16/float32).

    Raises:
        InputError (a ValueError), naming the argument and the rule: wrong rank, dtype
        or device; q, k_cache or v_cache requiring grad while grad mode is on;
        k_cache/v_cache shapes that disagree with each other or with q; head counts
        that are not a multiple (the message names the expected layouts); head dims not a multiple of 8 in [8, 256];
        cache_seqlens not int32 of shape (batch,); block_table not int32 of shape
        (batch, max_pages) with a last-dim stride of 1; a page_size that is not a
        multiple of 16; a bad causal, softmax_scale or return_lse.  For CPU tensors
        also cache_seqlens values outside [0, capacity] and block_table entries of used
        pages outside [0, num_pages).  On CUDA those values are not read on the host
        (that would synchronize every decode step): lengths are clamped to
        [0, capacity] in the kernel, and block_table entries must be valid page indices.
    """
    _check_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, causal, softmax_scale, return_lse)
    _no_forward_ad("flashgen.attention_with_kvcache", q, k_cache, v_cache)
    scale = q.shape[3] ** -0.5 if softmax_scale is None else float(softmax_scale)
    if _values_unreadable(q, k_cache, v_cache):
        # Traced, meta or under a transform (one op, its fake kernel gives the shapes) or inspected.
        o, lse = library.DECODE(q, k_cache, v_cache, cache_seqlens, block_table, scale, causal)
    else:  # eager: the same implementation without the torch.library dispatcher
        o, lse = library.kvcache_forward(q, k_cache, v_cache, cache_seqlens, block_table, scale, causal)
    return (o, lse) if return_lse else o


# -- torch's SDPA signature ------------------------------------------------------------

_sdpa_reasons: dict = {}


def _sdpa_shape_reason(query, key, value, enable_gqa) -> str | None:
    """Why flashgen cannot serve these tensors under SDPA's semantics (None: it can)."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            return f"{name} is not a torch.Tensor"
        if t.dim() != 4:
            return f"{name} has {t.dim()} dims; flashgen takes (batch, heads, seqlen, head_dim)"
    if query.dtype not in _DTYPES:
        return f"dtype {query.dtype} (flashgen: float16, bfloat16, float32)"
    if key.dtype != query.dtype or value.dtype != query.dtype:
        return f"dtypes differ (query {query.dtype}, key {key.dtype}, value {value.dtype})"
    if key.device != query.device or value.device != query.device:
        return f"devices differ (query {query.device}, key {key.device}, value {value.device})"
    b, hq, _, d = query.shape
    if key.shape[0] != b or value.shape[0] != b:
        return f"batch sizes differ (query {b}, key {key.shape[0]}, value {value.shape[0]})"
    hk = key.shape[1]
    if value.shape[1] != hk:
        return f"key and value head counts differ ({hk}, {value.shape[1]})"
    if hq != hk:
        if not enable_gqa:
            return f"query has {hq} heads and key/value {hk}, and enable_gqa=False (torch raises)"
        if hk == 0 or hq % hk:
            return f"query heads ({hq}) are not a multiple of key/value heads ({hk})"
    if key.shape[2] != value.shape[2]:
        return f"key and value seqlens differ ({key.shape[2]}, {value.shape[2]})"
    if key.shape[3] != d:
        return f"query and key head dims differ ({d}, {key.shape[3]})"
    for name, dd in (("head_dim", d), ("value head_dim", value.shape[3])):
        if not (8 <= dd <= 256 and dd % 8 == 0):
            return f"{name} {dd} (flashgen: a multiple of 8 in [8, 256])"
    return None


def sdpa_fallback_reason(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                         enable_gqa=False) -> str | None:
    """Why :func:`scaled_dot_product_attention` hands these arguments to torch's SDPA,
    or None when flashgen runs them."""
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            return f"attn_mask of type {type_name(attn_mask)}"
        if is_causal:
            return "attn_mask with is_causal=True (torch's documented error; some of its versions apply both instead)"
        if isinstance(query, torch.Tensor) and attn_mask.dtype not in (torch.bool, query.dtype):
            return f"attn_mask dtype {attn_mask.dtype} (flashgen: bool or the query's dtype)"
        if isinstance(query, torch.Tensor) and attn_mask.device != query.device:
            return f"attn_mask on {attn_mask.device}, query on {query.device}"
        if attn_mask.requires_grad:
            return "attn_mask requires grad (flashgen computes no bias gradient)"
        if not 2 <= attn_mask.dim() <= 4:
            return f"attn_mask has {attn_mask.dim()} dims (torch's SDPA reads its last two as the scores')"
        if isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor) and query.dim() == 4 and key.dim() == 4:
            try:
                torch.broadcast_shapes(tuple(attn_mask.shape), (query.shape[0], query.shape[1], query.shape[2],
                                                               key.shape[2]))
            except RuntimeError:
                return f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to the scores"
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        return f"dropout_p = {dropout_p!r}"
    if scale is not None and (not isinstance(scale, (int, float)) or isinstance(scale, bool)):
        return f"scale of type {type_name(scale)}"
    if scale is not None and (reason := scale_range_reason("scale", scale)):
        return reason
    if not isinstance(is_causal, bool):
        return f"is_causal of type {type_name(is_causal)}"
    if _forward_ad(query, key, value, attn_mask):
        return "a forward-mode derivative (jvp, jacfwd, forward_ad): flashgen's ops have none"
    if library.grad_transform(query, key, value, attn_mask):
        return "torch.func's grad, vjp or jacrev: flashgen's ops' autograd does not take functorch transforms"
    if torch.compiler.is_compiling() or not (type(query) is _Tensor and type(key) is _Tensor
                                             and type(value) is _Tensor):
        reason = _sdpa_shape_reason(query, key, value, enable_gqa)
    else:
        rkey = (query.shape, key.shape, value.shape, query.dtype, key.dtype, value.dtype, query.device,
                key.device, value.device, bool(enable_gqa))
        reason = _sdpa_reasons.get(rkey, False)
        if reason is False:
            if len(_sdpa_reasons) >= library.FAST_TABLE_MAX:
                _sdpa_reasons.clear()
            reason = _sdpa_reasons[rkey] = _sdpa_shape_reason(query, key, value, enable_gqa)
    if reason is None and dropout_p and not library.use_kernels(query):
        # flashgen's dropout lives in the Triton kernels; the reference path has none
        return (f"dropout_p > 0 with {query.dtype} on {query.device} (flashgen's dropout runs in the Triton "
                "kernels: CUDA, or TRITON_INTERPRET=1 with float16/float32)")
    return reason


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: float | None = None,
                                 enable_gqa: bool = False) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention``'s signature and semantics,
    run by flashgen's kernels where it can: swap the import, keep the call.

    query (batch, heads, seqlen_q, head_dim); key, value (batch, kv_heads, seqlen_k,
    head_dim / head_dim_v).  ``is_causal`` is torch's top-left alignment (query i sees
    key j iff j <= i), not :func:`attention`'s bottom-right one.  ``scale`` None means
    1 / sqrt(head_dim).  Different head counts need ``enable_gqa=True`` (as in torch).

    ``attn_mask`` (bool: True = take part; or the query's dtype: added to the scores),
    broadcastable to (batch, heads, seqlen_q, seqlen_k), is served as flashgen's
    ``bias`` (read tile by tile); a row it masks entirely outputs 0.  A bool mask of packed documents (one (seqlen, seqlen) pattern
    per batch entry or for all, block-causal or bidirectional within consecutive
    documents, as packed-dataset training builds it; without dropout) runs as one
    ragged batch through :func:`attention_varlen` instead: the mask is checked once per
    mask object (one pass over it per pattern tried, block-causal first, each with up to
    four host synchronizations) and not read again.  ``dropout_p`` in [0, 1) is served by flashgen's dropout
    (Philox keyed by element, :mod:`flashgen.dropout`, its seed and offset drawn from
    torch's generator: other masks than torch's own dropout draws, reproduced by
    ``torch.manual_seed``).

    Everything flashgen cannot serve goes to torch's own SDPA with the same arguments
    (so torch's errors are raised unchanged): an ``attn_mask`` of another dtype or
    device, with ``is_causal``, or that requires grad, other ranks or dtypes, head dims
    that are not a multiple of 8 in [8, 256], mismatched head counts without
    ``enable_gqa``, and ``dropout_p`` > 0 where flashgen's kernels do not run (CPU
    tensors outside ``TRITON_INTERPRET=1``, bfloat16 in the interpreter).  Empty inputs
    (batch, heads or a seqlen of 0) are served by flashgen without a launch: the empty
    output, or zeros where seqlen_k is 0 (torch's CUDA path can return None there).
    :func:`explain` with ``sdpa=True`` says which path a call takes and why.
    """
    if sdpa_fallback_reason(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) is not None:
        kw = {"enable_gqa": True} if enable_gqa else {}  # (torch < 2.5 has no enable_gqa)
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **kw)
    if key.shape[1] == 0:
        # No heads on either side (torch requires equal counts here): nothing to compute,
        # and flashgen's ops take num_kv_heads >= 1.  Zero gradients flow to the inputs.
        o = query.new_zeros(query.shape[0], 0, query.shape[2], value.shape[3])
        if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
            o = o + (query.sum() + key.sum() + value.sum()) * 0
        return o
    if attn_mask is not None and not dropout_p:
        found = _sdpa_documents(query, key, attn_mask)
        if found is not None:  # packed documents: a ragged batch, the mask not read
            return documents_attention(query, key, value, found[0], found[1], None, scale)
    if attn_mask is not None or dropout_p:
        return _attention_mods(query, key, value, causal=is_causal, window=(-1, -1), softmax_scale=scale,
                               return_lse=False, align="top_left", softcap=0.0, alibi_slopes=None,
                               bias=attn_mask, dropout_p=float(dropout_p), rng_state=None)
    return _attention(query, key, value, causal=is_causal, window=(-1, -1), softmax_scale=scale,
                      return_lse=False, align="top_left")


def documents_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, docs: tuple, causal: bool,
                        window_left: int | None, softmax_scale: float | None) -> torch.Tensor:
    """Attention over the packed documents ``docs`` (:func:`flashgen.documents.find`:
    cu_seqlens over the batch's tokens flattened, the longest document, document
    numbers) of query (batch, num_heads, seqlen, head_dim) and key / value (batch,
    num_kv_heads, seqlen, head_dim[_v]): one ragged batch through
    :func:`attention_varlen` (the tokens flattened: a view when the heads are the middle
    dimension in memory, as models' projections give them), or, with one document per
    entry, :func:`attention` with that pattern and no mask.  ``causal`` and
    ``window_left`` (None or >= 0 keys before the diagonal) are the pattern within each
    document.  Returns O (batch, num_heads, seqlen, head_dim_v) in memory order (batch,
    seqlen, num_heads, head_dim_v) for the ragged batch."""
    cu, longest, _ = docs
    b, h, n, _ = query.shape
    window = (-1, -1) if window_left is None else (window_left, 0)
    if cu.shape[0] == b + 1:
        return attention(query, key, value, causal=causal, window=window, softmax_scale=softmax_scale)

    def flat(t):
        return t.transpose(1, 2).reshape(b * n, t.shape[1], t.shape[3])

    out = attention_varlen(flat(query), flat(key), flat(value), cu, cu, longest, longest, causal=causal,
                           window=window, softmax_scale=softmax_scale)
    return out.view(b, n, h, value.shape[3]).transpose(1, 2)


def _sdpa_documents(query, key, attn_mask):
    """(documents, causal) when ``attn_mask``, as scaled_dot_product_attention
    broadcasts it, is one bool (batch or 1, 1, seqlen, seqlen) mask of packed documents,
    causal (block-causal: each query sees its document's keys up to itself) or
    bidirectional within each (:func:`flashgen.documents.find`); else None."""
    m = attn_mask
    if type(m) is not torch.Tensor or m.dtype != torch.bool or not 2 <= m.dim() <= 4:
        return None
    if m.dim() < 4:  # sdpa aligns a smaller mask with the trailing dims: (heads, sq, sk), (sq, sk)
        if m.dim() == 3 and m.shape[0] != 1:
            return None
        m = m.reshape((1, 1) + tuple(m.shape[-2:]))
    if not documents.readable(m, query, key):
        return None
    for causal in (True, False):
        docs = documents.find(m, query.shape[0], query.shape[2], causal, None, source=attn_mask)
        if docs is not None:
            return docs, causal
    return None


# -- explain ---------------------------------------------------------------------------

@dataclass(frozen=True)
class KernelChoice:
    """One kernel's dispatch: its ProblemKey, the kernel family and TileConfig, and
    where they came from; ``unserved``: (family, why not) of each registered family that
    cannot serve this key here (the chosen one then serves it)."""

    kernel: str  # fwd | bwd_dq | bwd_dkdv
    key: str  # ProblemKey.id
    config: str  # TileConfig.id
    source: str  # tuned | nearest | default
    tuned_key: str | None  # the key of the database row used (nearest: another bucket)
    database: str | None
    median_ms: float | None  # of that row, as measured by the tuner
    tflops: float | None
    smem_bytes: int
    smem_breakdown: str
    family: str = "triton"
    unserved: tuple[tuple[str, str], ...] = ()
    tuned_under: str | None = None  # the row's versions where not the installed ones ("triton 3.6.0")
    note: str | None = None  # why another family's default serves an untuned key

    def __str__(self) -> str:
        row = "no tuned row" if self.tuned_key is None else (
            f"row {self.tuned_key} in {self.database}: median {self.median_ms:.4f} ms"
            + ("" if self.tflops is None else f", {self.tflops:.4g} TFLOP/s")
            + ("" if self.tuned_under is None else f"; tuned under {self.tuned_under}"))
        why = "".join(f"; {name} does not serve it: {reason}" for name, reason in self.unserved)
        note = "" if self.note is None else f" ({self.note})"
        return (f"{self.kernel}: key {self.key}\n    config {self.config} ({self.source}; {row})\n"
                f"    kernel family {self.family}{note}{why}\n"
                f"    shared memory (model): {self.smem_breakdown}")

    @classmethod
    def of(cls, c: "dispatch.Choice") -> "KernelChoice":
        return cls(c.key.spec.kernel, c.key.id, c.config.id, c.source, c.tuned_key, c.database, c.median_ms,
                   c.tflops, c.smem_bytes, c.smem_breakdown, c.family, c.unserved, c.tuned_under, c.note)


@dataclass(frozen=True)
class Explanation:
    """What a call would run (see :func:`explain`; ``str()`` prints it).

    Fields: ``backend`` "flashgen" or "torch-sdpa-fallback"; ``path`` where flashgen
    runs it (generated kernels on a device, the CPU reference, Triton's interpreter);
    ``reason`` why torch's SDPA runs it (fallback only, else None); ``mask`` "none",
    "causal" or "window" and its bounds ``diag_lo`` / ``diag_hi`` (query i sees key j
    iff diag_lo <= j - i <= diag_hi); ``softmax_scale``; ``kernels`` one
    :class:`flashgen.api.KernelChoice` per kernel (its family, config, where the
    config came from, measured time and shared-memory budget); ``backward`` which
    backward runs and whether it is bitwise repeatable.  None where a field does not
    apply."""

    backend: str  # "flashgen" | "torch-sdpa-fallback"
    path: str  # e.g. "generated kernels on cuda:0 (...)", "reference (CPU, float32 math)"
    reason: str | None  # why torch's SDPA runs it (backend torch-sdpa-fallback)
    mask: str | None  # none | causal | window
    diag_lo: int | None  # query i sees key j iff diag_lo <= j - i <= diag_hi
    diag_hi: int | None
    softmax_scale: float | None
    kernels: tuple[KernelChoice, ...]
    #: Which backward runs: "<family> whole backward (bwd)" or "<family> bwd_dq + bwd_dkdv",
    #: whether it is bitwise repeatable, and why it was chosen; None where no kernel runs.
    backward: str | None = None

    def __str__(self) -> str:
        if self.backend != "flashgen":
            return f"{self.backend}: {self.reason}"
        lines = [f"flashgen: {self.path}; mask {self.mask} ({self.diag_lo} <= j - i <= {self.diag_hi}), "
                 f"softmax_scale {self.softmax_scale:.6g}"]
        if self.backward is not None:
            lines.append(f"backward: {self.backward}")
        lines += [str(c) for c in self.kernels]
        return "\n".join(lines)


def explain(q, k, v, *, causal: bool = False, window: tuple[int, int] = (-1, -1),
            softmax_scale: float | None = None, sdpa: bool = False, attn_mask=None, dropout_p: float = 0.0,
            enable_gqa: bool = False, dispatcher: "dispatch.Dispatcher | None" = None,
            deterministic: bool | None = None, softcap: float = 0.0, alibi_slopes=None,
            bias=None, score_mod=None, mask_mod=None, sinks=None) -> Explanation:
    """What ``attention(q, k, v, causal=..., window=..., softmax_scale=..., softcap=...,
    alibi_slopes=..., bias=..., dropout_p=..., deterministic=..., score_mod=...,
    mask_mod=..., sinks=...)`` runs, per kernel (fwd, then the backward's: bwd_dq and bwd_dkdv,
    or one family's whole backward ``bwd``; ``backward`` says which, whether it is
    bitwise repeatable and why): the ProblemKey, the kernel family (and why each
    other registered family cannot serve it), the TileConfig, its source (a tuned
    row, the nearest tuned bucket, or the heuristic default), the row's measured median
    time and TFLOP/s, and the modelled shared memory by buffer.  ``str()`` of the result
    is a readable report.

    With ``sdpa=True`` it explains ``scaled_dot_product_attention(q, k, v,
    attn_mask=attn_mask, dropout_p=dropout_p, is_causal=causal, scale=softmax_scale,
    enable_gqa=enable_gqa)`` instead (top-left causal), including why a call goes to
    torch's SDPA.  Meta tensors explain by their sizes and strides (no device
    needed; an expanded or sliced meta tensor gives the "strided" key its real
    counterpart gets, a meta tensor's base taken as 16-byte aligned).  Reads the
    tuning databases of ``dispatcher`` (default: the process-wide one).  User functions
    (``score_mod``, ``mask_mod``, ``sinks``; ``sdpa=False``) are traced as the call
    traces them, with gradients enabled: their kernels' keys carry the lowerings' names
    (:func:`flashgen.user_mods.variant_names`; sinks alone: the plain backward), and
    the indices they compute are checked against their tensors' sizes as the call
    checks them (reading the captured tensors, never q, k, v); the block mask's tiles
    are not counted.

    Raises InputError for arguments :func:`attention` rejects (``sdpa=False``),
    UnsupportedError for user functions it cannot compile.
    """
    _check_deterministic(deterministic)
    if not sdpa and (attn_mask is not None or enable_gqa):
        raise InputError("attn_mask and enable_gqa are scaled_dot_product_attention's arguments: pass sdpa=True "
                         "with them")
    user = score_mod is not None or mask_mod is not None or sinks is not None
    if sdpa and (softcap or alibi_slopes is not None or bias is not None or user):
        raise InputError("softcap, alibi_slopes, bias, score_mod, mask_mod and sinks are flashgen.attention's "
                         "arguments, not scaled_dot_product_attention's")
    if user:
        _check_user_alone(softcap, alibi_slopes, bias, dropout_p)
    if sdpa:
        reason = sdpa_fallback_reason(q, k, v, attn_mask, dropout_p, causal, softmax_scale, enable_gqa)
        if reason is None and window != (-1, -1):
            raise InputError("window is not an argument of scaled_dot_product_attention")
        if reason is not None:
            return Explanation("torch-sdpa-fallback", "torch.nn.functional.scaled_dot_product_attention", reason,
                               None, None, None, None, ())
        if k.shape[1] == 0:  # no heads on either side: scaled_dot_product_attention returns the empty output
            _check_scale_causal(softmax_scale, causal)
            mask, lo, hi = mask_bounds(q.shape[2], k.shape[2], causal=causal, window=window, align="top_left")
            scale = q.shape[3] ** -0.5 if softmax_scale is None else float(softmax_scale)
            return Explanation("flashgen", "no launch (no heads: an empty output)", None, mask, lo, hi, scale, ())
        found = None if attn_mask is None or dropout_p else _sdpa_documents(q, k, attn_mask)
        if found is not None:  # as the call: a ragged batch (reads the mask's values once)
            (cu, longest, _), docs_causal = found
            _check(q, k, v, softmax_scale, False)
            mask, lo, hi = mask_bounds(longest, longest, causal=docs_causal, window=(-1, -1))
            scale = q.shape[3] ** -0.5 if softmax_scale is None else float(softmax_scale)
            return Explanation("flashgen", f"packed documents: the mask is {cu.shape[0] - 1} documents (longest "
                               f"{longest}), {'causal' if docs_causal else 'bidirectional'} within each, run as "
                               "one ragged batch by attention_varlen (the mask is not read; explain the "
                               "attention_varlen call for its kernels)", None, mask, lo, hi, scale, ())
    _check(q, k, v, softmax_scale, causal)
    if not sdpa:
        _check_mods(q, k, softcap, alibi_slopes, bias, dropout_p, None)
        if not q.is_meta:
            library.check_dropout_runs(q, k, dropout_p)  # as attention refuses it
    b, h, sq, d = q.shape
    hk, sk, dv = k.shape[1], k.shape[2], v.shape[3]
    mask, lo, hi = mask_bounds(sq, sk, causal=causal, window=window, align="top_left" if sdpa else "bottom_right")
    scale = d ** -0.5 if softmax_scale is None else float(softmax_scale)
    if user:  # traced and checked as the call does on every path (empty, reference, kernels)
        from . import user_mods

        names = user_mods.variant_names(q, k, score_mod=score_mod, mask_mod=mask_mod, sinks=sinks)
    if library.is_empty(q, k):
        path = "no launch (an empty input: O = 0, LSE = -inf)"
    elif q.is_cuda:
        path = f"generated kernels on {q.device} (each kernel's family below)"
    elif q.is_meta:
        path = "sizes only (meta tensors): the kernels a GPU run would launch"
    elif library.use_kernels(q):
        path = f"triton interpreter on {q.device} (TRITON_INTERPRET=1)"
    else:
        why = "bfloat16 in Triton's interpreter, " if library.interpreting() and q.device.type == "cpu" else ""
        path = f"reference (no kernel: {why}{q.device} tensors, float32 math)"
    kernels: tuple[KernelChoice, ...] = ()
    backward = None
    if not library.is_empty(q, k) and not path.startswith("reference"):
        disp = dispatcher or dispatch.default_dispatcher()
        dtype = ops.dtype_name(q.dtype)
        # (of the tensors the call launches on: a last dim with stride != 1 is copied first)
        # (meta tensors: by their strides, their bases taken as 16-byte aligned)
        layout = library.layout_signature(*(_last_dim_contiguous(t) for t in (q, k, v)))
        if sdpa:
            mods = bwd_mods = _sdpa_mods(attn_mask, dropout_p)
        elif user:
            mods, bwd_mods = names
        else:
            from .spec import mods_name

            mods = bwd_mods = mods_name(softcap=bool(softcap), alibi=alibi_slopes is not None, bias=bias is not None,
                                        dropout=bool(dropout_p))

        def key_of(kernel):
            m = mods if kernel == "fwd" else bwd_mods
            return ProblemKey.from_sizes(KernelSpec(kernel, dtype, d, dv, mask, m), batch=b, num_heads=h,
                                         num_kv_heads=hk, seqlen_q=sq, seqlen_k=sk, layout=layout)

        det = library.deterministic_backward(deterministic)
        plan = disp.backward(key_of("bwd_dq"), deterministic=det, capturing=False)
        fwd_key = key_of("fwd")
        if not mods and library.decode_form(q, k, v, mask, lo, hi):
            fwd_key = library.decode_form_key(q, k, v, mask)
            rows, from_k, most = library.decode_form_rule(q, k)
            path += (f"; the forward runs as flash-decoding (seqlen_q x group = {sq * (h // hk)} <= {rows} query "
                     f"rows per kv head, seqlen_k >= {from_k}"
                     + (f", batch x num_heads <= {most}" if most is not None else "")
                     + "): the decode kernel over k, v as a full cache")
        elif library.decode_form_rule(q, k) is not None:
            why = (f"user functions ({mods})" if user else f"score modifications ({mods})" if mods else
                   "a window" if mask == "window" else
                   "top-left causal (scaled_dot_product_attention's)" if mask == "causal" else f"mask {mask}")
            path += (f"; not as flash-decoding, which these sizes would take (library.DECODE_FORM_RULES): {why} "
                     "(the decode kernel runs no mask or bottom-right causal alone, without score modifications)")
        kernels = tuple(KernelChoice.of(c) for c in (disp.choose(fwd_key, capturing=False), *plan.choices))
        how = "whole backward (bwd)" if plan.whole else "bwd_dq + bwd_dkdv"
        repeat = ("bitwise repeatable" if not plan.whole else "bitwise repeatable (dQ added in a fixed order)"
                  if plan.repeatable else "not bitwise repeatable (dQ by reduce-add)")
        most = max(plan.choices, key=lambda c: c.config.group_split).config if plan.choices else None
        if most is not None and most.group_split > 1:
            repeat += (f"; dK, dV summed in order over the {'16-bit' if most.half_partials else 'float32'} "
                       f"partials of the {most.group_split} programs (group_split) that share each kv head's "
                       "GQA group")
        asked = ("deterministic=True" if deterministic else "deterministic=False" if deterministic is False
                 else f"torch.are_deterministic_algorithms_enabled() is {det}")
        backward = f"{plan.family} {how}, {repeat}; {asked}; {plan.reason}"
    return Explanation("flashgen", path, None, mask, lo, hi, scale, kernels, backward)


def _sdpa_mods(attn_mask, dropout_p) -> str:
    """The score mods an SDPA call flashgen serves compiles (attn_mask -> bias)."""
    from .spec import mods_name

    return mods_name(bias=attn_mask is not None, dropout=bool(dropout_p))


def explain_sizes(*, batch: int, heads: int, kv_heads: int, seqlen_q: int, seqlen_k: int, head_dim: int,
                  head_dim_v: int | None = None, dtype: str = "bfloat16", causal: bool = False,
                  window: tuple[int, int] = (-1, -1), softmax_scale: float | None = None,
                  dispatcher: "dispatch.Dispatcher | None" = None, deterministic: bool | None = None,
                  softcap: float = 0.0, alibi: bool = False, bias: bool = False,
                  dropout_p: float = 0.0) -> Explanation:
    """:func:`explain` from sizes alone (meta tensors; what ``flashgen explain`` prints).
    ``alibi`` / ``bias``: explain with ALiBi slopes / a full (batch, heads, seqlen_q,
    seqlen_k) bias (their sizes alone matter)."""
    try:
        tdtype = getattr(torch, dtype)
    except AttributeError:
        raise InputError(f"dtype must be one of float16, bfloat16, float32; got {dtype!r}") from None
    if not isinstance(tdtype, torch.dtype):
        raise InputError(f"dtype must be one of float16, bfloat16, float32; got {dtype!r}")
    for name, n in (("batch", batch), ("heads", heads), ("kv_heads", kv_heads), ("seqlen_q", seqlen_q),
                    ("seqlen_k", seqlen_k)):
        if n < 0:
            raise InputError(f"{name} must be >= 0, got {n}")
    _check_head_dims((("head_dim", head_dim), ("head_dim_v", head_dim if head_dim_v is None else head_dim_v)))
    # the meta tensors' sizes in elements must fit int64, as a real tensor's must
    dv = head_dim if head_dim_v is None else head_dim_v
    largest = max(batch * heads * seqlen_q * max(head_dim, dv), batch * kv_heads * seqlen_k * max(head_dim, dv))
    if bias:
        largest = max(largest, batch * heads * seqlen_q * seqlen_k)
    if largest >= 2 ** 63:
        raise InputError(f"sizes too large for a tensor: {largest} elements (batch {batch} x heads "
                         f"{max(heads, kv_heads)} x seqlen {max(seqlen_q, seqlen_k)} x head_dim {max(head_dim, dv)}"
                         + (", or the bias's batch x heads x seqlen_q x seqlen_k" if bias else "")
                         + ") exceed int64")
    meta = dict(device="meta", dtype=tdtype)
    q = torch.empty(batch, heads, seqlen_q, head_dim, **meta)
    k = torch.empty(batch, kv_heads, seqlen_k, head_dim, **meta)
    v = torch.empty(batch, kv_heads, seqlen_k, head_dim if head_dim_v is None else head_dim_v, **meta)
    slopes = torch.empty(heads, device="meta", dtype=torch.float32) if alibi else None
    full = torch.empty(batch, heads, seqlen_q, seqlen_k, **meta) if bias else None
    return explain(q, k, v, causal=causal, window=window, softmax_scale=softmax_scale, dispatcher=dispatcher,
                   deterministic=deterministic, softcap=softcap, alibi_slopes=slopes, bias=full, dropout_p=dropout_p)

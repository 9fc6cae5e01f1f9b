"""Measuring kernels on the GPU: the tuner's real benchmarker and the peer runners.

Timing is Triton's ``do_bench`` (CUDA events, warm-up, L2 flushed between repetitions,
median in ms).  Correctness is checked per variant on small awkward shapes (every mask
the variant's mode serves: both causal alignments, windows, causal + window; NaN in the
memory past seqlen_k; outputs poisoned with NaN) against the float64 reference, with
FlashAttention's rule: max error <= 2 x the error of the same computation in torch at
the input dtype, plus a floor.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import itertools
import math
import multiprocessing as mp
import os
import time

import torch

from . import families, ops, reference
from .masks import mask_bounds
from .spec import TIMING_WINDOW, Measurement, Shape, Variant, is_decode, is_varlen, varlen_lengths
from .heuristics import default_config

_TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
FLOOR = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 2e-5}


_max_err = reference.max_error


def _ratios(outs: dict, refs: dict, dt) -> dict[str, tuple[float, float, float]]:
    """{name: (err, torch_err, ratio)}: ``refs[name]`` is (float64 reference, torch at
    the input dtype ``dt``); ratio = err / (2 * torch_err + FLOOR), <= 1 passes."""
    res = {}
    for name, out in outs.items():
        ref64, base = refs[name]
        floor = FLOOR[torch.float32 if name == "LSE" else dt]
        err, base_err = _max_err(out, ref64), _max_err(base, ref64)
        res[name] = (err, base_err, err / (2 * base_err + floor))
    return res


def make_inputs(spec, shape: Shape, device="cuda", seed=0, requires_grad=False):
    g = torch.Generator(device=device).manual_seed(seed)
    dt = _TORCH_DTYPES[spec.dtype]

    def rnd(*s):
        return torch.randn(*s, device=device, dtype=dt, generator=g).requires_grad_(requires_grad)

    q = rnd(shape.batch, shape.num_heads, shape.seqlen_q, spec.head_dim)
    k = rnd(shape.batch, shape.num_kv_heads, shape.seqlen_k, spec.head_dim)
    v = rnd(shape.batch, shape.num_kv_heads, shape.seqlen_k, spec.head_dim_v)
    do = rnd(shape.batch, shape.num_heads, shape.seqlen_q, spec.head_dim_v)
    return q, k, v, do


#: The window of the correctness checks of ``window`` variants (left, right): not a
#: multiple of any block, wider than the smallest tiles on the left, and with rows that
#: see no key once seqlen_q > seqlen_k (bottom-right alignment).
CHECK_WINDOW = (37, 11)
#: The checks' (shorter, longer) seqlens: not multiples of any block.
CHECK_SEQLENS = (301, 397)


def mask_cases(spec, group: int = 1) -> list[tuple[Shape, dict]]:
    """The (shape, mask) pairs ``check_variant`` runs for ``spec``'s mask mode; a mask is
    dict(causal=, window=, align=), the arguments of :func:`flashgen.masks.mask_bounds`.

    Shapes are small and awkward (seqlens not multiples of any block, seqlen_q !=
    seqlen_k both ways).  ``none``: one case.  ``causal`` (one kernel for both
    alignments, only the diagonal differs): bottom-right with seqlen_q > seqlen_k (rows
    that see no key) and top-left with seqlen_q < seqlen_k (keys that no query sees).
    ``window``: CHECK_WINDOW bottom-right (empty rows at the top), causal + window, and
    CHECK_WINDOW top-left with seqlen_q > seqlen_k (empty rows at the bottom).
    """
    short, long = CHECK_SEQLENS
    long_k = Shape(2, 2 * group, group, short, long)
    long_q = Shape(2, 2 * group, group, long, short)
    br, tl = "bottom_right", "top_left"
    cases = {
        "none": [(long_k, dict(causal=False, window=(-1, -1), align=br))],
        "causal": [(long_q, dict(causal=True, window=(-1, -1), align=br)),
                   (long_k, dict(causal=True, window=(-1, -1), align=tl))],
        "window": [(long_q, dict(causal=False, window=CHECK_WINDOW, align=br)),
                   (long_k, dict(causal=True, window=(CHECK_WINDOW[0], -1), align=br)),
                   (long_q, dict(causal=False, window=CHECK_WINDOW, align=tl))],
    }[spec.mask]
    for shape, m in cases:  # each case must run this variant's kernel, not another mode's
        assert mask_bounds(shape.seqlen_q, shape.seqlen_k, **m)[0] == spec.mask, (spec.mask, m)
    return cases


def _default_mask(spec) -> dict:
    window = TIMING_WINDOW if spec.mask == "window" else (-1, -1)
    return dict(causal=spec.mask == "causal", window=window, align="bottom_right")


def _mask_kw(spec, shape: Shape, mask: dict | None = None):
    """(kernel keyword arguments, mask) for ``spec`` on ``shape``; ``mask`` is
    dict(causal=, window=, align=) or None for the spec's default (none / bottom-right
    causal / TIMING_WINDOW)."""
    mask = _default_mask(spec) if mask is None else mask
    mode, lo, hi = mask_bounds(shape.seqlen_q, shape.seqlen_k, **mask)
    if mode != spec.mask:
        raise ValueError(f"mask {mask} is mode {mode!r} on seqlens {shape.seqlen_q}/{shape.seqlen_k}, "
                         f"but the variant is compiled for {spec.mask!r}")
    return dict(softmax_scale=spec.head_dim ** -0.5, mask=mode, diag_lo=lo, diag_hi=hi), mask


#: The score-mod arguments the tuner and the checks use: a Gemma-2-like soft cap, the
#: ALiBi paper's slopes, a bias of shape (1, heads, seqlen_q, seqlen_k) (a relative-
#: position bias: shared over the batch), dropout 0.1.
TUNE_SOFTCAP = 20.0
TUNE_DROPOUT_P = 0.1


def alibi_slopes(num_heads: int) -> list[float]:
    """ALiBi's geometric slopes 2^(-8 i / n), i = 1..n (Press et al. 2022, for n a power
    of two; other n take the same formula)."""
    return [2.0 ** (-8.0 * (i + 1) / num_heads) for i in range(num_heads)]


def mod_inputs(spec, shape: Shape, device="cuda", seed=0) -> "ops.ScoreMods | None":
    """The ScoreMods of ``spec.mods`` for ``shape`` (None when it has none)."""
    from .spec import mods_set

    ms = mods_set(spec.mods)
    if not ms:
        return None
    g = torch.Generator(device=device).manual_seed(seed + 77)
    bias = None
    if "bias" in ms:
        # Rows padded to 16 bytes: a tma variant reads it through a descriptor
        # (ops.bias_tma_view), the path its timings and aligned user biases run, also on
        # the checks' awkward seqlens (a contiguous 397-column bias would check only the
        # pointer fallback).
        dt = _TORCH_DTYPES[spec.dtype]
        bias = torch.randn(1, shape.num_heads, shape.seqlen_q, ops.padded_row(shape.seqlen_k, dt.itemsize),
                           device=device, generator=g,
                           dtype=dt)[..., :shape.seqlen_k].expand(shape.batch, -1, -1, -1)
    return ops.ScoreMods(
        softcap=TUNE_SOFTCAP if "softcap" in ms else 0.0,
        alibi=torch.tensor(alibi_slopes(shape.num_heads), dtype=torch.float32, device=device) if "alibi" in ms else None,
        bias=bias,
        dropout_p=TUNE_DROPOUT_P if "dropout" in ms else 0.0,
        rng=torch.tensor([seed + 5, 0], dtype=torch.int64, device=device) if "dropout" in ms else None)


def reference_mods(mods, shape: Shape) -> dict:
    """The keyword arguments of :func:`flashgen.reference.forward` for ``mods``."""
    if mods is None:
        return {}
    from .dropout import dropout_mask

    out = dict(softcap=mods.softcap, alibi=mods.alibi, bias=mods.bias)
    if mods.dropout_p > 0:
        out.update(keep=dropout_mask(mods.rng, shape.batch, shape.num_heads, shape.seqlen_q, shape.seqlen_k,
                                     mods.dropout_p), dropout_p=mods.dropout_p)
    return out


def run_variant(variant: Variant, q, k, v, do, *seqs, arch=None, mask: dict | None = None, mods=None):
    """A zero-argument callable that launches ``variant``'s kernel on these inputs with
    its family's launcher (the other kernels it needs run once, here, with their default
    configs), and the outputs
    it checks: {name: tensor}.  ``mask``: dict(causal=, window=, align=), or None for
    the spec's default (see :func:`_mask_kw`).  ``mods``: the ScoreMods of a spec with
    score mods (None: :func:`mod_inputs`)."""
    spec, cfg = variant.spec, variant.config
    if is_varlen(spec.kernel):
        return run_variant_varlen(variant, q, k, v, do, *seqs, arch=arch, mask=mask)
    if is_decode(spec.kernel):  # (q, k_cache, v_cache, cache_seqlens, block_table)
        return run_variant_decode(variant, q, k, v, do, *seqs)
    shape = Shape(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2])
    kw, _ = _mask_kw(spec, shape, mask)
    if spec.mods:
        kw["mods"] = mods if mods is not None else mod_inputs(spec, shape, device=q.device)
    if spec.kernel == "fwd":
        out = torch.empty(q.shape[:3] + (v.shape[3],), dtype=q.dtype, device=q.device)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)

        launch = families.launcher(cfg.family, "fwd")

        def fn():
            launch(q, k, v, config=cfg, out=out, lse=lse, **kw)
        return fn, {"O": out, "LSE": lse}
    from .spec import KernelSpec

    arch = arch or _arch()
    fspec = KernelSpec("fwd", spec.dtype, spec.head_dim, spec.head_dim_v, spec.mask, spec.mods)
    o, lse = ops.fwd(q, k, v, config=default_config(fspec, arch), **kw)
    if spec.kernel == "bwd":  # a family's whole backward: dQ, dK, dV (every launch it makes)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        launch = families.launcher(cfg.family, "bwd")

        def fn():
            launch(do, q, k, v, o, lse, config=cfg, dq=dq, dk=dk, dv=dv, **kw)
        return fn, {"dQ": dq, "dK": dk, "dV": dv}
    if spec.kernel == "bwd_dq":
        dq = torch.empty_like(q)
        delta = torch.empty_like(lse)

        launch = families.launcher(cfg.family, "bwd_dq")

        def fn():
            launch(do, q, k, v, o, lse, config=cfg, dq=dq, delta=delta, **kw)
        return fn, {"dQ": dq}
    qspec = KernelSpec("bwd_dq", spec.dtype, spec.head_dim, spec.head_dim_v, spec.mask, spec.mods)
    _, delta = ops.bwd_dq(do, q, k, v, o, lse, config=default_config(qspec, arch), **kw)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    launch = families.launcher(cfg.family, "bwd_dkdv")

    def fn():
        launch(do, q, k, v, lse, delta, config=cfg, dk=dk, dv=dv, **kw)
    return fn, {"dK": dk, "dV": dv}


# -- ragged batches (varlen kernels) ---------------------------------------------------

#: The per-sequence lengths of the varlen checks: a length-0 and a length-1 sequence,
#: lengths not multiples of any block, seqlen_q > seqlen_k and < on different sequences.
CHECK_VARLEN_LENS = ([150, 0, 61, 1, 37], [61, 13, 150, 1, 0])

#: A second varlen check of the Gluon family (its programs search cu_seqlens_q for their
#: sequence in chunks of 128): 200 sequences, skewed (most of 0-40 tokens, one of 700
#: among them, empty ones on either side), so the search crosses chunks.
CHECK_VARLEN_MANY_LENS = ([700 if i == 150 else (i * 37) % 41 for i in range(200)],
                          [700 if i == 150 else (i * 23 + 5) % 43 for i in range(200)])


def make_varlen_inputs(spec, lens_q, lens_k, num_heads, num_kv_heads, device="cuda", seed=0):
    """(q, k, v, do, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), packed."""
    g = torch.Generator(device=device).manual_seed(seed)
    dt = _TORCH_DTYPES[spec.dtype]
    tq, tk = sum(lens_q), sum(lens_k)

    def rnd(*s):
        return torch.randn(*s, device=device, dtype=dt, generator=g)

    def cu(lens):
        return torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32, device=device)

    return (rnd(tq, num_heads, spec.head_dim), rnd(tk, num_kv_heads, spec.head_dim),
            rnd(tk, num_kv_heads, spec.head_dim_v), rnd(tq, num_heads, spec.head_dim_v),
            cu(lens_q), cu(lens_k), max(lens_q, default=0), max(lens_k, default=0))


def _varlen_mask_kw(spec, mask: dict | None):
    """Kernel keywords for a varlen variant; ``mask`` is dict(causal=, window=) (bottom-
    right per sequence), None for the spec's default."""
    mask = _default_mask(spec) if mask is None else mask
    causal, window = mask["causal"], tuple(mask["window"])
    mode = mask_bounds(0, 0, causal=causal, window=window)[0]
    if mode != spec.mask:
        raise ValueError(f"mask {mask} is mode {mode!r}, but the variant is compiled for {spec.mask!r}")
    return dict(softmax_scale=spec.head_dim ** -0.5, mask=mode, win_left=window[0],
                win_right=0 if causal else window[1])


def run_variant_varlen(variant: Variant, q, k, v, do, cu_q, cu_k, max_q, max_k, arch=None, mask=None):
    """:func:`run_variant` for a varlen kernel on packed inputs (see make_varlen_inputs)."""
    spec, cfg = variant.spec, variant.config
    kw = _varlen_mask_kw(spec, mask)
    seqs = (cu_q, cu_k, max_q, max_k)
    if spec.kernel == "fwd_varlen":
        out = torch.empty(q.shape[:2] + (v.shape[2],), dtype=q.dtype, device=q.device)
        lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)

        launch = families.launcher(cfg.family, "fwd_varlen")

        def fn():
            launch(q, k, v, *seqs, config=cfg, out=out, lse=lse, **kw)
        return fn, {"O": out, "LSE": lse}
    from .spec import KernelSpec

    arch = arch or _arch()
    fspec = KernelSpec("fwd_varlen", spec.dtype, spec.head_dim, spec.head_dim_v, spec.mask)
    fcfg = default_config(fspec, arch)
    o, lse = families.launcher(fcfg.family, "fwd_varlen")(q, k, v, *seqs, config=fcfg, **kw)
    if spec.kernel == "bwd_varlen":  # a family's whole ragged-batch backward: dQ, dK, dV (every launch it makes)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        launch = families.launcher(cfg.family, "bwd_varlen")

        def fn():
            launch(do, q, k, v, o, lse, *seqs, config=cfg, dq=dq, dk=dk, dv=dv, **kw)
        return fn, {"dQ": dq, "dK": dk, "dV": dv}
    if spec.kernel == "bwd_dq_varlen":
        dq, delta = torch.empty_like(q), torch.empty_like(lse)

        def fn():
            ops.bwd_dq_varlen(do, q, k, v, o, lse, *seqs, config=cfg, dq=dq, delta=delta, **kw)
        return fn, {"dQ": dq}
    qspec = KernelSpec("bwd_dq_varlen", spec.dtype, spec.head_dim, spec.head_dim_v, spec.mask)
    _, delta = ops.bwd_dq_varlen(do, q, k, v, o, lse, *seqs, config=default_config(qspec, arch), **kw)
    dk, dv = torch.empty_like(k), torch.empty_like(v)

    def fn():
        ops.bwd_dkdv_varlen(do, q, k, v, lse, delta, *seqs, config=cfg, dk=dk, dv=dv, **kw)
    return fn, {"dK": dk, "dV": dv}


def varlen_mask_cases(spec) -> list[dict]:
    """The masks ``check_variant`` runs for a varlen variant's mode (bottom-right per
    sequence): none; causal; CHECK_WINDOW and causal + window."""
    return {"none": [dict(causal=False, window=(-1, -1))],
            "causal": [dict(causal=True, window=(-1, -1))],
            "window": [dict(causal=False, window=CHECK_WINDOW), dict(causal=True, window=(CHECK_WINDOW[0], -1))],
            }[spec.mask]


def compare_varlen(outs: dict, q, k, v, do, cu_q, cu_k, *, kw: dict) -> dict[str, tuple[float, float, float]]:
    """:func:`compare` for varlen outputs, against the per-sequence float64 reference."""
    from . import library

    dt = q.dtype
    args = (cu_q, cu_k, kw["softmax_scale"], kw["win_left"], kw["win_right"])
    refs = {}
    if {"O", "LSE"} & set(outs):
        r = library.reference_forward_varlen(q, k, v, *args, torch.float64)
        b = library.reference_forward_varlen(q, k, v, *args, dt)
        refs.update(O=(r[0], b[0]), LSE=(r[1], b[1].float()))
    if {"dQ", "dK", "dV"} & set(outs):
        r = library.reference_backward_varlen(do, q, k, v, *args, torch.float64)
        b = library.reference_backward_varlen(do, q, k, v, *args, dt)
        refs.update(dQ=(r[0], b[0]), dK=(r[1], b[1]), dV=(r[2], b[2]))
    return _ratios(outs, refs, dt)


def _check_varlen_detail(variant: Variant, group: int, device: str) -> dict:
    spec = variant.spec
    worst, ratios, msgs, cases = 0.0, {}, [], []
    lens = [CHECK_VARLEN_LENS] + ([CHECK_VARLEN_MANY_LENS] if variant.family == "gluon" else [])
    for i, ((lens_q, lens_k), mask) in enumerate(itertools.product(lens, varlen_mask_cases(spec))):
        q, k, v, do, *seqs = make_varlen_inputs(spec, lens_q, lens_k, 2 * group, 2, device=device, seed=1234 + i)
        fn, outs = run_variant_varlen(variant, q, k, v, do, *seqs, mask=mask)
        for t in outs.values():
            t.fill_(float("nan"))
        fn()
        if q.is_cuda:
            torch.cuda.synchronize()
        res = compare_varlen(outs, q, k, v, do, seqs[0], seqs[1], kw=_varlen_mask_kw(spec, mask))
        tag = "varlen" + ("" if (lens_q, lens_k) == CHECK_VARLEN_LENS else f"x{len(lens_q)}") + \
            ("c" if mask["causal"] else "") + \
            (f"w{mask['window'][0]}_{mask['window'][1]}" if tuple(mask["window"]) != (-1, -1) else "")
        for name, (err, base_err, ratio) in res.items():
            worst = max(worst, ratio)
            ratios[name] = max(ratios.get(name, 0.0), ratio)
            msgs.append(f"{tag} {name} err {err:.3g} (torch {q.dtype} {base_err:.3g})")
        cases.append({"lens": [lens_q, lens_k], "mask": {**mask, "window": list(mask["window"])}, "outputs": res})
    return {"ok": worst <= 1.0, "ratio": worst, "ratios": ratios, "message": "; ".join(msgs), "cases": cases}


# -- decode with a KV cache (decode kernels) -------------------------------------------

#: The checks' decode problem: cache lengths with a 0 (O = 0, LSE = -inf), a 1, lengths
#: that are not multiples of any tile or page, one shorter than seqlen_q (causal rows
#: that see no key) and a full cache; seqlen_q 3; page size 16 (the smallest).
CHECK_DECODE_LENS = (0, 1, 77, 2, 200, 208)
CHECK_DECODE_SEQLEN_Q = 3
CHECK_DECODE_PAGE_SIZE = 16


def make_decode_inputs(spec, batch: int, num_heads: int, num_kv_heads: int, seqlen_q: int, lens,
                       capacity: int | None = None, page_size: int | None = None, device="cuda", seed=0):
    """(q, k_cache, v_cache, cache_seqlens, block_table) for a decode kernel.

    q (batch, seqlen_q, heads, d); the cache holds ``capacity`` (default max(lens)) key
    slots per batch entry, filled with NaN past each entry's length (they must never be
    read into the result).  ``spec.kernel`` decode: contiguous (batch, capacity, kv_heads,
    d); decode_paged: pages of ``page_size`` (default presets.DECODE_PAGE_SIZE) in a
    shuffled pool (with one spare page of NaN), block_table int32 (batch, max_pages)."""
    from .presets import DECODE_PAGE_SIZE

    g = torch.Generator(device=device).manual_seed(seed)
    dt = _TORCH_DTYPES[spec.dtype]
    lens = list(lens)
    capacity = max(lens, default=0) if capacity is None else capacity
    q = torch.randn(batch, seqlen_q, num_heads, spec.head_dim, device=device, dtype=dt, generator=g)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=device)

    def cache(d):
        c = torch.randn(batch, capacity, num_kv_heads, d, device=device, dtype=dt, generator=g)
        for z, n in enumerate(lens):
            c[z, n:] = float("nan")
        return c

    k, v = cache(spec.head_dim), cache(spec.head_dim_v)
    if spec.kernel != "decode_paged":
        return q, k, v, lens_t, None
    ps = page_size or DECODE_PAGE_SIZE
    max_pages = max(1, -(-capacity // ps))

    def pages(c):
        pad = max_pages * ps - capacity
        c = torch.cat([c, c.new_full((batch, pad) + c.shape[2:], float("nan"))], 1) if pad else c
        pool = c.reshape(batch * max_pages, ps, *c.shape[2:])
        return torch.cat([pool, pool.new_full((1,) + pool.shape[1:], float("nan"))])  # a spare page

    # Slot s of the pool holds page perm[s] of the contiguous order, so page p (batch
    # p // max_pages) is found at slot inv[p].
    perm = torch.randperm(batch * max_pages, generator=torch.Generator().manual_seed(seed)).to(device)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=device)
    kp, vp = pages(k), pages(v)
    kp = torch.cat([kp[:-1][perm], kp[-1:]])
    vp = torch.cat([vp[:-1][perm], vp[-1:]])
    bt = inv.reshape(batch, max_pages).to(torch.int32)
    return q, kp, vp, lens_t, bt


def run_variant_decode(variant: Variant, q, k_cache, v_cache, cache_seqlens, block_table=None):
    """:func:`run_variant` for a decode kernel: a zero-argument callable (split kernel,
    then the combine kernel when num_splits > 1) and its outputs {"O", "LSE"}."""
    spec, cfg = variant.spec, variant.config
    b, sq, h, _ = q.shape
    dv = v_cache.shape[-1]
    out = torch.empty((b, sq, h, dv), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    parts = ops.decode_partials(b, h, sq, dv, cfg.num_splits, q.device)
    kw = dict(softmax_scale=spec.head_dim ** -0.5, mask=spec.mask, config=cfg, out=out, lse=lse,
              o_part=parts[0], lse_part=parts[1])

    def fn():
        ops.decode(q, k_cache, v_cache, cache_seqlens, block_table, **kw)
    return fn, {"O": out, "LSE": lse}


def decode_bytes(spec, num_kv_heads: int, lens) -> int:
    """Bytes of K and V a decode call must read: each batch entry's cache_seqlens
    tokens, every kv head (what the achieved-bandwidth figures divide by)."""
    return int(sum(int(n) for n in lens)) * num_kv_heads * (spec.head_dim + spec.head_dim_v) * spec.dtype_bytes


def compare_decode(outs: dict, q, k_cache, v_cache, cache_seqlens, block_table, *, causal: bool,
                   softmax_scale: float) -> dict[str, tuple[float, float, float]]:
    """:func:`compare` for decode outputs (O, LSE) against the float64 decode reference."""
    dt = q.dtype
    kw = dict(causal=causal, softmax_scale=softmax_scale)
    r = reference.decode_forward(q, k_cache, v_cache, cache_seqlens, block_table, **kw)
    b = reference.decode_forward(q, k_cache, v_cache, cache_seqlens, block_table, dtype=dt, **kw)
    refs = {"O": (r[0], b[0]), "LSE": (r[1], b[1].float())}
    return _ratios(outs, refs, dt)


def _check_decode_detail(variant: Variant, group: int, device: str) -> dict:
    spec = variant.spec
    lens = CHECK_DECODE_LENS
    inputs = make_decode_inputs(spec, len(lens), 2 * group, 2, CHECK_DECODE_SEQLEN_Q, lens,
                                page_size=CHECK_DECODE_PAGE_SIZE, device=device, seed=1234)
    fn, outs = run_variant_decode(variant, *inputs)
    for t in outs.values():
        t.fill_(float("nan"))
    fn()
    if inputs[0].is_cuda:
        torch.cuda.synchronize()
    res = compare_decode(outs, *inputs, causal=spec.mask == "causal", softmax_scale=spec.head_dim ** -0.5)
    worst = max(r[2] for r in res.values())
    msgs = [f"decode lens {list(lens)} {name} err {e:.3g} (torch {spec.dtype} {b:.3g})" for name, (e, b, _) in res.items()]
    return {"ok": worst <= 1.0, "ratio": worst, "ratios": {n: r[2] for n, r in res.items()},
            "message": "; ".join(msgs), "cases": [{"lens": list(lens), "outputs": res}]}


def _arch():
    from .arch import current

    return current()


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _beyond(t, extra: int = 64):
    """A view of ``t`` inside a larger buffer that holds NaN past its seqlen (dim 2):
    keys past seqlen_k must never contribute, whatever the memory after them holds."""
    b, h, s, d = t.shape
    buf = torch.full((b, h, s + extra, d), float("nan"), dtype=t.dtype, device=t.device)
    buf[:, :, :s] = t
    return buf[:, :, :s]


def compare(outs: dict, q, k, v, do, *, mask: dict, softmax_scale: float,
            mods: dict | None = None) -> dict[str, tuple[float, float, float]]:
    """{name: (err, torch_err, ratio)} for the outputs in ``outs`` (any of O, LSE, dQ, dK,
    dV): err = max |out - float64 reference|, torch_err the same for torch at the input
    dtype, ratio = err / (2 * torch_err + FLOOR); ratio <= 1 passes (inf for a NaN, or
    for an -inf LSE where the reference is finite or vice versa)."""
    dt = q.dtype
    rkw = dict(softmax_scale=softmax_scale, **mask, **(mods or {}))
    refs = {}
    if {"O", "LSE"} & set(outs):
        r, b = reference.forward(q, k, v, **rkw), reference.forward(q, k, v, dtype=dt, **rkw)
        refs.update(O=(r[0], b[0]), LSE=(r[1], b[1].float()))
    if {"dQ", "dK", "dV"} & set(outs):
        r, b = reference.backward(do, q, k, v, **rkw), reference.backward(do, q, k, v, dtype=dt, **rkw)
        refs.update(dQ=(r[0], b[0]), dK=(r[1], b[1]), dV=(r[2], b[2]))
    return _ratios(outs, refs, dt)


#: A walk of the Gluon forward (``persistent`` >= 1: one program per SM slot taking
#: tiles in turn) is checked on at least this many tiles per program (:func:`check_shape`).
WALK_CHECK_TILES_PER_PROGRAM = 3


def walk_tiles(variant: Variant, sm_count: int | None = None) -> tuple[int, int] | None:
    """For a walk of the Gluon forward (``persistent`` >= 1), (query rows per tile, the
    tiles a check needs: :data:`WALK_CHECK_TILES_PER_PROGRAM` x its programs, ``sm_count``
    (default: this GPU's) x programs per SM); None for any other variant."""
    c = variant.config
    if variant.spec.kernel != "fwd" or c.family != "gluon" or c.persistent < 1:
        return None
    if sm_count is None:
        from .arch import current

        sm_count = current().sm_count
    return c.BLOCK_M * max(1, c.num_warps // 4), WALK_CHECK_TILES_PER_PROGRAM * sm_count * (c.ctas_per_sm or 1)


def check_shape(variant: Variant, shape: Shape, sm_count: int | None = None) -> Shape:
    """``shape``, or with the least multiple of its query heads per kv head that the
    variant's ``group_split`` divides (a whole backward that splits each kv head's GQA
    group over that many programs serves only such groups); for a walk of the Gluon
    forward, with its heads (and kv heads) multiplied until the tiles number
    :data:`WALK_CHECK_TILES_PER_PROGRAM` times the walk's programs (``sm_count`` x
    programs per SM; default: this GPU's), so the check runs a program's later tiles: at
    the check's small sizes every program of a walk took one tile."""
    split = variant.config.group_split
    ratio = shape.num_heads // shape.num_kv_heads
    if split > 1 and ratio % split:
        shape = dataclasses.replace(shape, num_heads=shape.num_kv_heads * ratio * split // math.gcd(ratio, split))
    walk = walk_tiles(variant, sm_count)
    if walk is not None:
        rows, needed = walk
        times = -(-needed // (shape.batch * shape.num_heads * -(-shape.seqlen_q // rows)))
        if times > 1:
            shape = dataclasses.replace(shape, num_heads=shape.num_heads * times,
                                        num_kv_heads=shape.num_kv_heads * times)
    return shape


def check_variant_detail(variant: Variant, group: int = 1, device: str | None = None) -> dict:
    """Run ``variant`` on each of :func:`mask_cases` (inputs k, v slices of buffers
    holding NaN past seqlen_k; outputs poisoned with NaN; each shape as
    :func:`check_shape` makes it) against the float64 reference.

    A variant whose family declares it bitwise repeatable (the family's
    ``deterministic(config)``, e.g. the Gluon backward with ``dq_ordered``) runs twice
    more on each case, and every output must equal the first run's bit for bit, else the
    check fails ("not bitwise repeatable").

    Returns {"ok", "ratio" (worst), "ratios" ({output: worst ratio}), "message",
    "cases" ([{shape, mask, outputs: {name: (err, torch_err, ratio)}}])}."""
    spec = variant.spec
    device = device or _default_device()
    if is_varlen(spec.kernel):
        return _check_varlen_detail(variant, group, device)
    if is_decode(spec.kernel):
        return _check_decode_detail(variant, group, device)
    worst, ratios, msgs, cases = 0.0, {}, [], []
    fam = families.FAMILIES.get(variant.config.family)
    repeatable = getattr(fam, "deterministic", None)
    repeatable = bool(repeatable and repeatable(variant.config))
    unrepeated = []
    for i, (shape, mask) in enumerate(mask_cases(spec, group)):
        shape = check_shape(variant, shape)
        q, k, v, do = make_inputs(spec, shape, device=device, seed=1234 + i)
        k, v = _beyond(k), _beyond(v)
        mods = mod_inputs(spec, shape, device=device, seed=i)
        fn, outs = run_variant(variant, q, k, v, do, mask=mask, mods=mods)
        for t in outs.values():
            t.fill_(float("nan"))
        fn()
        if q.is_cuda:
            torch.cuda.synchronize()
        tag = f"q{shape.seqlen_q}k{shape.seqlen_k}" + ("c" if mask["causal"] else "") + \
            (f"w{mask['window'][0]}_{mask['window'][1]}" if tuple(mask["window"]) != (-1, -1) else "") + \
            ("tl" if mask["align"] == "top_left" else "")
        if repeatable:
            first = {name: t.clone() for name, t in outs.items()}
            for _ in range(2):
                fn()
                unrepeated += [f"{tag} {name}" for name, t in outs.items()
                               if not _same_bits(t, first[name]) and f"{tag} {name}" not in unrepeated]
        res = compare(outs, q, k, v, do, mask=mask, softmax_scale=spec.head_dim ** -0.5,
                      mods=reference_mods(mods, shape))
        for name, (err, base_err, ratio) in res.items():
            worst = max(worst, ratio)
            ratios[name] = max(ratios.get(name, 0.0), ratio)
            msgs.append(f"{tag} {name} err {err:.3g} (torch {q.dtype} {base_err:.3g})")
        cases.append({"shape": list(dataclasses.astuple(shape)), "mask": {**mask, "window": list(mask["window"])},
                      "outputs": res})
    if unrepeated:
        msgs.insert(0, f"not bitwise repeatable: {', '.join(unrepeated)} differ between runs")
    return {"ok": worst <= 1.0 and not unrepeated, "ratio": worst, "ratios": ratios, "message": "; ".join(msgs),
            "cases": cases}


def _same_bits(a, b) -> bool:
    """Whether two tensors of one dtype and shape hold the same bits (NaN included)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return bool(torch.equal(a.view(ints), b.view(ints)))


def check_variant(variant: Variant, group: int = 1, device: str | None = None) -> tuple[bool, float, str]:
    """Run ``variant`` on small awkward shapes (seqlens not multiples of any block,
    seqlen_q != seqlen_k), for every mask :func:`mask_cases` lists for its mode (both
    causal alignments; windows, causal + window), and compare with the float64 reference.

    Returns (ok, worst error ratio err / (2 * baseline + floor), message)."""
    d = check_variant_detail(variant, group, device)
    return d["ok"], d["ratio"], d["message"]


#: The fewest timed repetitions and warm-up calls of one :func:`time_ms` measurement.
#: ``do_bench`` sizes both in milliseconds of GPU time, so a 10 ms call measured with
#: ``rep_ms`` 25 is timed twice and its median is the mean of two calls; a long call is
#: given these counts instead.
MIN_REPEATS = 10
MIN_WARMUP_CALLS = 2


def time_ms(fn, warmup_ms: int = 10, rep_ms: int = 40) -> float:
    """Median ms of ``fn`` (CUDA events, L2 flushed between repetitions;
    ``triton.testing.do_bench``): ``warmup_ms`` and ``rep_ms`` of GPU time, and at least
    :data:`MIN_WARMUP_CALLS` warm-up calls and :data:`MIN_REPEATS` timed ones, sized
    from one timed call first."""
    import triton.testing

    one = float(triton.testing.do_bench(fn, warmup=1, rep=1, return_mode="median"))
    # do_bench divides by its own estimate, which includes the L2 flush: a fifth more
    return float(triton.testing.do_bench(fn, warmup=max(warmup_ms, 1.2 * MIN_WARMUP_CALLS * one),
                                         rep=max(rep_ms, 1.2 * MIN_REPEATS * one), return_mode="median"))


def script_device(smoke: bool, dtype: str | None = None):
    """A benchmark script's (device, dtype name, torch dtype): the CPU (its smoke run, in
    Triton's interpreter, which the script turned on before importing flashgen) with
    float16, or CUDA with bfloat16; ``dtype`` overrides the dtype.  None, with the
    message printed, when a GPU run finds no CUDA device."""
    if not smoke and not torch.cuda.is_available():
        import sys

        print("no CUDA device: run with --smoke for the CPU (interpreter) run", file=sys.stderr)
        return None
    name = dtype or ("float16" if smoke else "bfloat16")
    return ("cpu" if smoke else "cuda"), name, getattr(torch, name)


def script_backends(text: str, known) -> list[str] | None:
    """The backends a benchmark script's comma-separated ``--backends`` names; None, with
    the message printed, when one is not in ``known``."""
    wanted = [b.strip() for b in text.split(",") if b.strip()]
    bad = [b for b in wanted if b not in known]
    if bad:
        import sys

        print(f"unknown backends {bad}; known: {', '.join(known)}", file=sys.stderr)
        return None
    return wanted


def script_time_ms(fn, cuda: bool, warmup_ms: int = 10, rep_ms: int = 40) -> float:
    """Median ms of ``fn`` for the benchmark scripts: one call first (compile, warm-up),
    then :func:`time_ms` on CUDA, or on the CPU (their smoke runs, in Triton's
    interpreter) the wall-clock median of 3 calls."""
    fn()
    if cuda:
        torch.cuda.synchronize()
        return time_ms(fn, warmup_ms, rep_ms)
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return sorted(ts)[1]


def compiler_report(variant: Variant) -> dict:
    from .spec import compiled_variant

    k = ops.compiled.get(compiled_variant(variant).id)
    if k is None:
        return {}
    return {"smem_bytes_compiled": int(k.metadata.shared), "n_regs": getattr(k, "n_regs", None),
            "n_spills": getattr(k, "n_spills", None)}


def _precompile_one(variant: Variant, group: int = 1) -> tuple[str, str | None, dict]:
    """Worker: compile (by running once on small shapes) and report.  A failure that left
    this process's CUDA context unusable (a kernel that faulted: an illegal instruction
    or address is sticky, every later CUDA call of the process fails) says so in the
    report (``context_lost``, with the worker's ``pid``): :meth:`KernelBenchmarker.precompile`
    then checks the variants that worker would have taken in a fresh process."""
    try:
        d = check_variant_detail(variant, group)
        ok, ratio, msg = d["ok"], d["ratio"], d["message"]
        report = {**compiler_report(variant), "check_ratio": ratio, "check_ratios": d["ratios"]}
        return variant.id, None if ok else f"wrong_result: ratio {ratio:.3g}: {msg}", report
    except Exception as e:  # noqa: BLE001 - a failure is a value
        report = {"context_lost": True, "pid": os.getpid(), "t_done": time.monotonic()} if _cuda_context_lost() \
            else {}
        return variant.id, f"compile_failed: {type(e).__name__}: {str(e)[-500:]}", report


def _cuda_context_lost() -> bool:
    """Whether this process's CUDA context is unusable (a synchronize, or a one-element
    kernel and its copy back, raises); False where CUDA was never initialized."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return False
    try:
        torch.cuda.synchronize()
        return torch.ones(1, device="cuda").add_(1).item() != 2.0
    except Exception:  # noqa: BLE001 - any error here means the context is gone
        return True


class KernelBenchmarker:
    """The tuner's benchmarker on a CUDA GPU: compile, verify once per variant, time.

    ``precompile`` compiles (and verifies) many variants in parallel worker processes,
    which fills Triton's on-disk cache so the trials only load binaries.
    """

    def __init__(self, warmup_ms: int = 10, rep_ms: int = 40, workers: int | None = None,
                 compile_timeout_s: float = 300.0, startup_grace_s: float = 120.0):
        self.warmup_ms, self.rep_ms = warmup_ms, rep_ms
        self.workers = workers or min(16, os.cpu_count() or 1)
        self.compile_timeout_s = compile_timeout_s
        self.startup_grace_s = startup_grace_s
        self._checked: dict[str, tuple[str | None, dict]] = {}  # variant id -> (failure, report)
        self._inputs: dict = {}

    def precompile(self, variants: list[Variant], progress=None, group: int = 1,
                   worker_fn=None) -> dict[str, str | None]:
        """Compile and verify ``variants`` in worker processes; returns {variant id:
        failure message or None}.  ``progress(variant_id, failure)`` after each.
        ``group``: the GQA group size of the check's shapes.

        A variant whose worker runs longer than ``compile_timeout_s`` (a hung compile or
        kernel) is recorded as ``timeout``; the pool is then killed and the variants not
        finished yet run again in a fresh one.  So is the pool after a variant whose
        failure left its worker's CUDA context unusable (``context_lost`` in its report:
        a kernel that faulted): that variant keeps its failure, and the variants its
        worker finished after it (failed only because of it) run again with the
        unfinished ones.  ``worker_fn(variant, group)`` replaces the real
        compile-and-check (tests)."""

        fn = worker_fn or _precompile_one
        todo = [v for v in dict.fromkeys(variants) if v.id not in self._checked]
        ctx = mp.get_context("spawn")

        def record(vid, failure, report):
            self._checked[vid] = (failure, report)
            if progress:
                progress(vid, failure)

        while todo:
            ex = cf.ProcessPoolExecutor(self.workers, mp_context=ctx)
            pool_t0 = time.monotonic()
            futs = {ex.submit(fn, v, group): v for v in todo}
            pending, started, hung = set(futs), {}, []
            # A future counts as running once it sits in the pool's call queue, which can
            # be before a worker process is up (spawning one imports torch: seconds on a
            # loaded host).  So a clock starts no earlier than the pool's first result, or,
            # before any result, than startup_grace_s after the pool was made.
            first_done = None
            lost, again = set(), []  # workers whose CUDA context a fault took; variants to check again
            while pending and not hung and not lost:
                done, pending = cf.wait(pending, timeout=0.5, return_when=cf.FIRST_COMPLETED)
                results = []
                for f in done:
                    try:
                        results.append(f.result())
                    except Exception as e:  # noqa: BLE001 - a crashed worker is a value too
                        results.append((futs[f].id, f"launch_failed: {type(e).__name__}: {e}", {}))
                # a worker finishes its variants in order: the first that lost its context
                # is the one that faulted, the later ones of that worker failed because of it
                results.sort(key=lambda r: r[2].get("t_done", 0.0))
                for vid, failure, report in results:
                    pid = report.get("pid")
                    if pid is not None and pid in lost:
                        again.append(vid)
                        continue
                    if report.get("context_lost"):
                        lost.add(pid)
                        failure = f"{failure} (the fault left its process's CUDA context unusable)"
                    record(vid, failure, report)
                now = time.monotonic()
                if done and first_done is None:
                    first_done = now
                floor = first_done if first_done is not None else pool_t0 + self.startup_grace_s
                for f in pending:
                    if f.running():
                        started.setdefault(f, now)
                hung = [f for f in pending if f in started and now - max(started[f], floor) > self.compile_timeout_s]
            for f in hung:
                record(futs[f].id, f"timeout: no result after {self.compile_timeout_s:.0f} s", {})
            if hung or lost:  # the hung or broken worker cannot be told apart: kill them all, redo the rest
                for p in list(getattr(ex, "_processes", {}).values()):
                    p.terminate()
            ex.shutdown(wait=not (hung or lost), cancel_futures=True)
            by_id = {v.id: v for v in todo}
            todo = [futs[f] for f in pending if f not in hung] + [by_id[vid] for vid in again]
        return {v.id: self._checked[v.id][0] for v in variants}

    def __call__(self, variant: Variant, shape: Shape) -> Measurement:
        if variant.id not in self._checked:
            self._checked[variant.id] = _precompile_one(variant, shape.num_heads // shape.num_kv_heads)[1:]
        failure, report = self._checked[variant.id]
        report = {k: v for k, v in report.items() if k in _REPORTED and v is not None}
        if failure is not None:
            return Measurement(failure.split(":", 1)[0], error=failure, **report)
        key = (variant.spec, shape)
        if key not in self._inputs:
            self._inputs.clear()
            if is_varlen(variant.spec.kernel):  # shape.batch documents of up to seqlen_q tokens
                lens_q = varlen_lengths(shape.batch, shape.seqlen_q)
                lens_k = lens_q if shape.seqlen_k == shape.seqlen_q else varlen_lengths(shape.batch, shape.seqlen_k)
                self._inputs[key] = make_varlen_inputs(variant.spec, lens_q, lens_k, shape.num_heads,
                                                       shape.num_kv_heads, device=_default_device())
            elif is_decode(variant.spec.kernel):  # full caches of seqlen_k tokens
                self._inputs[key] = make_decode_inputs(variant.spec, shape.batch, shape.num_heads,
                                                       shape.num_kv_heads, shape.seqlen_q,
                                                       [shape.seqlen_k] * shape.batch, device=_default_device())
            else:
                self._inputs[key] = make_inputs(variant.spec, shape)
        try:
            fn, _ = run_variant(variant, *self._inputs[key])
            ms = time_ms(fn, self.warmup_ms, self.rep_ms)
        except Exception as e:  # noqa: BLE001
            return Measurement("launch_failed", error=f"{type(e).__name__}: {e}"[-500:])
        report.update({k: v for k, v in compiler_report(variant).items() if v is not None})
        return Measurement("ok", median_ms=ms, **report)

    def check_ratios(self) -> dict[str, float]:
        """variant id -> error ratio of its correctness check (<= 1 passes)."""
        return {vid: r["check_ratio"] for vid, (_, r) in self._checked.items() if "check_ratio" in r}

    def check_reports(self) -> dict[str, tuple[str | None, dict]]:
        """variant id -> (failure or None, report: compiler facts, check_ratio and
        check_ratios {output: worst ratio})."""
        return dict(self._checked)


_REPORTED = ("smem_bytes_compiled", "n_regs", "n_spills")

"""Exactness on the GPU (issue 3): the CPU matrix of tests/test_exactness.py in bfloat16
and float16 at larger sizes, every valid + feasible config of the tuning search space,
a tensor of more than 2^31 elements, and batch * heads = 70000 (the 1-D grid).

    PYTHONPATH=. python3 benchmarks/gpu_exactness.py --out gpu_exactness.json

Parts (each case's outputs are poisoned with NaN first, and compared per output -- O,
LSE, dQ, dK, dV -- with the float64 reference: ratio = err / (2 * err of torch at the
input dtype + floor), <= 1 passes; rows that see no key must give exactly O = 0,
LSE = -inf, dQ = 0 and keys that no query sees dK = dV = 0):

* ``big``: q of shape (1, 1, 2^31 / 64 + 4113, 64) bf16 (> 2^31 elements; checked on
  its first and last rows, dO zero elsewhere so dK/dV are exact sums of those rows),
  mask none and bottom-right causal; batch 8750 x heads 8 with seqlens 17/16.
* ``space``: every config of ``space.valid_configs`` that fits this GPU's shared memory
  (``resources.estimate``), for fwd / bwd_dq / bwd_dkdv, head_dim 64 and 128, bf16,
  masks none / causal / window, via ``KernelBenchmarker().precompile`` (worker
  processes; ``bench.check_variant``: awkward seqlens 301/397 both ways, GQA 2, both
  causal alignments, window (37, 11), causal + window, NaN past seqlen_k).
* ``matrix``: mask modes x seqlens (1 .. 4097, q != k both ways), head dims 8..256
  incl. 192/128, GQA/MQA group sizes, NaN/Inf past seqlen_k and in padded head-dim
  columns, layouts (packed QKV, transposed views, expanded stride-0 heads, stride-0 dO,
  last-dim stride 2), softmax_scale (None, 0.3, 0.0, 2.0), determinism, empty inputs;
  in worker processes (compiles in parallel), default configs at ops level and the
  dispatcher's configs through flashgen.attention.

Prints the number of cases, the failures and the worst ratio per output; writes every
case to --out as JSON (after each part, so a cut-off run still leaves the earlier ones).
CPU smoke test of the script itself (interpreter, float16, tiny sizes):

    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/gpu_exactness.py --smoke --out /tmp/gx.json
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import math
import multiprocessing as mp
import os
import sys
import time
import traceback

OUTPUTS = ("O", "LSE", "dQ", "dK", "dV")
DTYPE_NAMES = ("bfloat16", "float16")


# ---------------------------------------------------------------------------------------
# one case


def _torch():
    import torch

    return torch


def _device():
    torch = _torch()
    return "cuda" if torch.cuda.is_available() else "cpu"


def _sync():
    torch = _torch()
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _dtype(name):
    torch = _torch()
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def _mask(c):
    return dict(causal=bool(c["causal"]), window=tuple(c["window"]), align=c["align"])


def _visible(sq, sk, mask, device):
    torch = _torch()
    from flashgen.masks import mask_bounds

    _, lo, hi = mask_bounds(sq, sk, **mask)
    rel = torch.arange(sk, device=device)[None, :] - torch.arange(sq, device=device)[:, None]
    return (rel >= lo) & (rel <= hi)


def _exact_zero_errors(outs, sq, sk, mask, device):
    """Rows that see no key: O == 0, dQ == 0 exactly; keys no query sees: dK = dV = 0."""
    torch = _torch()
    vis = _visible(sq, sk, mask, device)
    rows, cols = ~vis.any(1), ~vis.any(0)
    errs = []
    for name, idx in (("O", rows), ("dQ", rows), ("dK", cols), ("dV", cols)):
        t = outs.get(name)
        if t is not None and bool(idx.any()):
            sel = t[:, :, idx]
            if not torch.equal(sel, torch.zeros_like(sel)):
                errs.append(f"{name} not exactly 0 where nothing is visible")
    return errs


def _ratios(outs, q, k, v, do, mask, scale):
    from flashgen import bench

    res = bench.compare(outs, q, k, v, do, mask=mask, softmax_scale=scale)
    return {n: r[2] for n, r in res.items()}, {n: [r[0], r[1]] for n, r in res.items()}


def _rand(shape, dt, g, device):
    torch = _torch()
    return torch.randn(*shape, generator=g, device=device, dtype=torch.float32).to(dt)


def _in_buffer(t, fill, rows=64, cols=16):
    """t's values inside a larger buffer holding ``fill`` past seqlen and past head_dim."""
    torch = _torch()
    b, h, s, d = t.shape
    buf = torch.full((b, h, s + rows, d + cols), fill, dtype=t.dtype, device=t.device)
    buf[:, :, :s, :d] = t
    return buf[:, :, :s, :d]


def _ops_outputs(c, q, k, v, do, mask, scale):
    """ops.fwd + ops.bwd with the heuristic default configs into NaN-poisoned buffers."""
    torch = _torch()
    from flashgen import ops
    from flashgen.arch import current
    from flashgen.heuristics import default_config
    from flashgen.masks import mask_bounds
    from flashgen.spec import KernelSpec

    b, h, sq, d = q.shape
    hk, sk, dv = k.shape[1], k.shape[2], v.shape[3]
    mode, lo, hi = mask_bounds(sq, sk, **mask)
    arch = current()
    cfg = {kern: default_config(KernelSpec(kern, c["dtype"], d, dv, mode), arch) for kern in ("fwd", "bwd_dq", "bwd_dkdv")}
    nan = float("nan")
    extra = {}
    if c["layout"] in ("past_nan", "past_inf"):
        fill = nan if c["layout"] == "past_nan" else float("inf")
        q, do = _in_buffer(q, nan), _in_buffer(do, nan)
        k, v = _in_buffer(k, fill), _in_buffer(v, -fill)
    if c["layout"] == "packed":  # q, k, v slices of one (b, s, h + 2 hk, d) tensor; grads into one too
        assert sq == sk and d == dv
        qkv = torch.cat([t.transpose(1, 2) for t in (q, k, v)], dim=2)
        q, k, v = (qkv[:, :, a:z].transpose(1, 2) for a, z in ((0, h), (h, h + hk), (h + hk, h + 2 * hk)))
        dqkv = torch.full_like(qkv, nan)
        o_buf = torch.full((b, sq, h, dv), nan, dtype=q.dtype, device=q.device)
        bufs = dict(O=o_buf.transpose(1, 2), dQ=dqkv[:, :, :h].transpose(1, 2),
                    dK=dqkv[:, :, h:h + hk].transpose(1, 2), dV=dqkv[:, :, h + hk:].transpose(1, 2))
        extra = dict(dqkv=dqkv, o_buf=o_buf)
    else:
        bufs = dict(O=torch.full((b, h, sq, dv), nan, dtype=q.dtype, device=q.device), dQ=torch.full_like(q, nan),
                    dK=torch.full_like(k, nan), dV=torch.full_like(v, nan))
    bufs["LSE"] = torch.full((b, h, sq), nan, dtype=torch.float32, device=q.device)
    kw = dict(softmax_scale=scale, mask=mode, diag_lo=lo, diag_hi=hi)
    o, lse = ops.fwd(q, k, v, config=cfg["fwd"], out=bufs["O"], lse=bufs["LSE"], **kw)
    ops.bwd(do, q, k, v, o, lse, config_dq=cfg["bwd_dq"], config_dkdv=cfg["bwd_dkdv"], dq=bufs["dQ"],
            dk=bufs["dK"], dv=bufs["dV"], delta=torch.full_like(lse, nan), **kw)
    _sync()
    errs = []
    for name, t in extra.items():
        if torch.isnan(t).any():
            errs.append(f"{name}: elements never written")
    return bufs, errs, {n: c_.id for n, c_ in cfg.items()}


def _api_call(q, k, v, mask, scale):
    import flashgen

    if mask["align"] == "top_left":
        from flashgen.api import _attention

        return _attention(q, k, v, causal=mask["causal"], window=mask["window"], softmax_scale=scale,
                          return_lse=True, align="top_left")
    return flashgen.attention(q, k, v, causal=mask["causal"], window=mask["window"], softmax_scale=scale,
                              return_lse=True)


def _api_outputs(c, q, k, v, do, mask, scale):
    """flashgen.attention (autograd) with the layout ``c["layout"]``.  Returns the
    outputs, errors, and the (do, dK/dV reduction) the reference must use."""
    torch = _torch()
    b, h, sq, d = q.shape
    hk, sk, dv = k.shape[1], k.shape[2], v.shape[3]
    lay = c["layout"]
    errs, reduce_heads = [], False
    if lay == "transposed":
        leaves = [t.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for t in (q, k, v)]
        qi, ki, vi = leaves
    elif lay == "last_dim_stride2":
        leaves = []
        for t in (q, k, v):
            x = torch.zeros(*t.shape[:3], 2 * t.shape[3], dtype=t.dtype, device=t.device)
            x[..., ::2] = t
            leaves.append(x[..., ::2].requires_grad_())
        qi, ki, vi = leaves
    elif lay == "expanded_kv":  # one kv head expanded (stride 0) to all heads
        assert hk == h
        kb, vb = k[:, :1].clone().requires_grad_(), v[:, :1].clone().requires_grad_()
        qi = q.clone().requires_grad_()
        ki, vi = kb.expand(b, h, sk, d), vb.expand(b, h, sk, dv)
        k, v = ki.detach(), vi.detach()
        leaves, reduce_heads = [qi, kb, vb], True
    elif lay == "packed_api":
        assert sq == sk and d == dv
        qkv = torch.cat([t.transpose(1, 2) for t in (q, k, v)], dim=2).requires_grad_()
        qi, ki, vi = (qkv[:, :, a:z].transpose(1, 2) for a, z in ((0, h), (h, h + hk), (h + hk, h + 2 * hk)))
        leaves = None
    else:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        qi, ki, vi = leaves
    o, lse = _api_call(qi, ki, vi, mask, scale)
    if lay == "do_bcast":  # dO = w expanded: strides (0, 0, 0, 1)
        w = do[0, 0, 0].clone()
        (o * w).sum().backward()
        do = w.expand(b, h, sq, dv)
    elif lay == "sum_backward":  # dO = ones with every stride 0
        o.sum().backward()
        do = torch.ones_like(do)
    else:
        o.backward(do)
    _sync()
    if leaves is None:
        g = qkv.grad
        grads = (g[:, :, :h].transpose(1, 2), g[:, :, h:h + hk].transpose(1, 2), g[:, :, h + hk:].transpose(1, 2))
    else:
        grads = tuple(t.grad for t in leaves)
    for name, gr, t in zip(("dQ", "dK", "dV"), grads, (qi, kb if reduce_heads else ki, vb if reduce_heads else vi)):
        if gr is None or gr.shape != t.shape:
            errs.append(f"{name}: gradient shape {None if gr is None else tuple(gr.shape)} != input {tuple(t.shape)}")
    if lse.dtype != torch.float32 or tuple(lse.shape) != (b, h, sq) or o.dtype != q.dtype:
        errs.append(f"return_lse: O {o.dtype}, LSE {lse.dtype} {tuple(lse.shape)}")
    outs = dict(O=o.detach(), LSE=lse, dQ=grads[0], dK=grads[1], dV=grads[2])
    return outs, errs, k, v, do, reduce_heads


def run_case(c):
    """One matrix case -> a JSON-able record."""
    torch = _torch()
    from flashgen import bench, reference

    t0 = time.time()
    rec = dict(c, ratios={}, errors={}, problems=[], error=None)
    try:
        device = _device()
        dt = _dtype(c["dtype"])
        g = torch.Generator(device=device).manual_seed(c["seed"])
        b, h, hk, sq, sk, d, dv = (c[x] for x in ("b", "h", "hk", "sq", "sk", "d", "dv"))
        q, k, v, do = (_rand(s, dt, g, device) for s in ((b, h, sq, d), (b, hk, sk, d), (b, hk, sk, dv), (b, h, sq, dv)))
        mask = _mask(c)
        if c["kind"] == "empty":
            rec["problems"] += _empty_case(q, k, v, mask)
        else:
            eff = d ** -0.5 if c["scale"] is None else c["scale"]
            if c["path"] == "ops":
                outs, errs, rec["configs"] = _ops_outputs(c, q, k, v, do, mask, eff)
                reduce_heads = False
            else:
                outs, errs, k, v, do, reduce_heads = _api_outputs(c, q, k, v, do, mask, c["scale"])
                if c["kind"] == "determinism":
                    outs2 = _api_outputs(c, q, k, v, do, mask, c["scale"])[0]
                    for n in OUTPUTS:
                        if not torch.equal(outs[n], outs2[n]):
                            errs.append(f"{n}: a repeated call differs")
            rec["problems"] += errs
            if reduce_heads:  # dK, dV of the one expanded kv head: sums over heads
                main = {n: outs[n] for n in ("O", "LSE", "dQ")}
                rec["ratios"], rec["errors"] = _ratios(main, q, k, v, do, mask, eff)
                rkw = dict(softmax_scale=eff, **mask)
                r64 = reference.backward(do, q, k, v, **rkw)
                rdt = reference.backward(do, q, k, v, dtype=dt, **rkw)
                for i, n in ((1, "dK"), (2, "dV")):
                    ref, base = r64[i].sum(1, keepdim=True), rdt[i].sum(1, keepdim=True)
                    err, berr = reference.max_error(outs[n], ref), reference.max_error(base, ref)
                    rec["ratios"][n] = err / (2 * berr + bench.FLOOR[dt])
                    rec["errors"][n] = [err, berr]
            else:
                rec["ratios"], rec["errors"] = _ratios(outs, q, k, v, do, mask, eff)
                rec["problems"] += _exact_zero_errors(outs, sq, sk, mask, device)
    except Exception as e:  # noqa: BLE001 - a crash is a failed case
        rec["error"] = f"{type(e).__name__}: {e}"[-800:]
        rec["traceback"] = traceback.format_exc()[-3000:]
    rec["ok"] = rec["error"] is None and not rec["problems"] and all(r <= 1.0 for r in rec["ratios"].values())
    rec["seconds"] = round(time.time() - t0, 3)
    return rec


def _empty_case(q, k, v, mask):
    """batch 0 / seqlen 0: zeros and -inf, zero gradients, no NaN."""
    torch = _torch()
    qi, ki, vi = (t.clone().requires_grad_() for t in (q, k, v))
    o, lse = _api_call(qi, ki, vi, mask, None)
    probs = []
    if o.shape != (*q.shape[:3], v.shape[3]) or lse.shape != q.shape[:3]:
        probs.append(f"shapes O {tuple(o.shape)} LSE {tuple(lse.shape)}")
    if not torch.equal(o, torch.zeros_like(o)) or not bool(torch.isneginf(lse).all()):
        probs.append("O not 0 or LSE not -inf")
    (o.float().sum() + 1.0).backward()
    for n, t in zip(("dQ", "dK", "dV"), (qi, ki, vi)):
        if t.grad is None or t.grad.shape != t.shape or not torch.equal(t.grad, torch.zeros_like(t)):
            probs.append(f"{n} not zeros of the input's shape")
    return probs


def run_chunk(cases):
    return [run_case(c) for c in cases]


# ---------------------------------------------------------------------------------------
# the matrix


def _case(kind, name, dtype, b, h, hk, sq, sk, d, dv=None, causal=False, window=(-1, -1), align="bottom_right",
          scale=None, path="ops", layout="contiguous", seed=0):
    return dict(kind=kind, name=f"{kind}/{dtype}/{name}", dtype=dtype, b=b, h=h, hk=hk, sq=sq, sk=sk, d=d,
                dv=dv or d, causal=causal, window=list(window), align=align, scale=scale, path=path, layout=layout,
                seed=seed)


MASKS = {
    "none": dict(),
    "causal": dict(causal=True),
    "causal_tl": dict(causal=True, align="top_left"),
    "window": dict(window=(37, 11)),
    "window_wide": dict(window=(300, 200)),
    "window_left": dict(window=(300, -1)),
    "window_right": dict(window=(-1, 64)),
    "causal_window": dict(causal=True, window=(128, -1)),
    "window_tl": dict(window=(37, 11), align="top_left"),
    "window_0_0": dict(window=(0, 0)),
}


def build_matrix(smoke: bool):
    dtypes = ("float16",) if smoke else DTYPE_NAMES
    if smoke:
        seqs = [(1, 45), (45, 1), (17, 97), (97, 17), (45, 45)]
        big_pair, mid, hds, groups = (45, 45), (45, 33), [16, 40, (64, 40)], [(4, 4), (4, 1), (3, 1)]
    else:
        seqs = [(1, 1025), (1025, 1), (17, 4097), (4097, 17), (113, 1025), (1025, 113), (1025, 1025),
                (4097, 4097), (1, 1), (255, 17)]
        big_pair, mid = (1025, 1025), (777, 1025)
        hds = [8, 40, 64, 72, 80, 96, 128, 160, 192, 256, (192, 128)]
        groups = [(8, 8), (8, 4), (8, 2), (8, 1), (32, 8), (7, 1)]
    cases = []
    for dt in dtypes:
        seed = 0
        # mask modes x seqlens, d 128 (16 in smoke), GQA 2
        dm = 16 if smoke else 128
        for m, mk in MASKS.items():
            for sq, sk in seqs:
                seed += 1
                b = 1 if max(sq, sk) > 2000 else 2
                path = "api" if mk.get("align") == "top_left" else "ops"
                cases.append(_case("mask", f"{m}/q{sq}k{sk}", dt, b, 4, 2, sq, sk, dm, **mk, path=path, seed=seed))
        # head dims
        hd_masks = ["none", "causal", "window", "causal_window", "causal_tl"]
        for i, hd in enumerate(hds):
            d, dv = hd if isinstance(hd, tuple) else (hd, hd)
            for j, m in enumerate(hd_masks):
                seed += 1
                sq, sk = (113, 1025) if (i + j) % 2 else (1025, 113)
                if smoke:
                    sq, sk = (17, 45) if (i + j) % 2 else (45, 17)
                mk = MASKS[m]
                path = "api" if mk.get("align") == "top_left" else "ops"
                cases.append(_case("head_dim", f"d{d}v{dv}/{m}/q{sq}k{sk}", dt, 2, 2, 1, sq, sk, d, dv, **mk,
                                   path=path, seed=seed))
        # GQA / MQA
        for h, hk in groups:
            for m in ("causal", "window"):
                seed += 1
                sq, sk = mid if m == "causal" else mid[::-1]
                cases.append(_case("group", f"h{h}kv{hk}/{m}/q{sq}k{sk}", dt, 2, h, hk, sq, sk, dm, **MASKS[m],
                                   seed=seed))
        # memory past seqlen (and past head_dim) holding NaN / Inf
        for m in ("none", "causal", "window", "causal_window"):
            for d, lay in ((64, "past_nan"), (96, "past_inf")):
                seed += 1
                sq, sk = (17, 45) if smoke else (1025, 4097)
                if m == "causal":
                    sq, sk = sk, sq
                cases.append(_case("past", f"{lay}/d{d}/{m}/q{sq}k{sk}", dt, 1, 4, 2, sq, sk, 16 if smoke else d,
                                   **MASKS[m], layout=lay, seed=seed))
        # layouts
        lays = [("packed", "ops", "none"), ("packed", "ops", "causal"), ("packed_api", "api", "window"),
                ("transposed", "api", "causal"), ("transposed", "api", "window_tl"), ("expanded_kv", "api", "window"),
                ("do_bcast", "api", "causal"), ("sum_backward", "api", "none"), ("last_dim_stride2", "api", "causal"),
                ("contiguous_api", "api", "causal_window")]
        for lay, path, m in lays:
            seed += 1
            sq, sk = big_pair if lay.startswith("packed") else mid
            hk = 4 if lay == "expanded_kv" else 2
            cases.append(_case("layout", f"{lay}/{m}/q{sq}k{sk}", dt, 2, 4, hk, sq, sk, dm, **MASKS[m], path=path,
                               layout=lay, seed=seed))
        # softmax_scale
        for scale, m, hd in ((None, "causal", (192, 128)), (0.3, "window", (dm, dm)), (0.0, "window", (dm, dm)),
                             (2.0, "causal_tl", (dm, dm))):
            seed += 1
            sq, sk = mid[::-1]
            if smoke:
                hd = (64, 40) if hd[0] == 192 else hd
            cases.append(_case("scale", f"scale{scale}/d{hd[0]}v{hd[1]}/{m}/q{sq}k{sk}", dt, 1, 4, 2, sq, sk, *hd,
                               **MASKS[m], scale=scale, path="api", seed=seed))
        # determinism through the API (the dispatcher's configs)
        seed += 1
        sq, sk = mid
        cases.append(_case("determinism", f"gqa4/causal/q{sq}k{sk}", dt, 2, 8, 2, sq, sk, dm, causal=True, path="api",
                           seed=seed))
        # empty inputs
        for b, sq, sk in ((0, 33, 33), (1, 0, 33), (1, 33, 0)):
            cases.append(_case("empty", f"b{b}q{sq}k{sk}", dt, b, 4, 2, sq, sk, dm, causal=True, path="api"))
    return cases


def run_matrix(cases, workers, deadline, log):
    """Cases in worker processes, grouped by compiled spec so each worker compiles its own
    kernels (in parallel with the others).  Cases not started by the deadline are skipped."""
    from flashgen.masks import mask_bounds

    def group_key(c):
        mode = mask_bounds(c["sq"], c["sk"], causal=c["causal"], window=tuple(c["window"]), align=c["align"])[0]
        return (c["dtype"], c["d"], c["dv"], mode, c["path"])

    groups: dict = {}
    for c in cases:
        groups.setdefault(group_key(c), []).append(c)
    chunks = []
    for g in groups.values():  # at most 12 cases per chunk so the pool stays balanced
        chunks += [g[i:i + 12] for i in range(0, len(g), 12)]
    chunks.sort(key=lambda ch: -sum(max(c["sq"], 1) * max(c["sk"], 1) * c["b"] * c["h"] for c in ch))
    results, skipped = [], []
    if workers <= 1:
        for ch in chunks:
            if time.time() > deadline:
                skipped += ch
                continue
            results += run_chunk(ch)
        return results, skipped
    ctx = mp.get_context("spawn")
    with cf.ProcessPoolExecutor(workers, mp_context=ctx) as ex:
        futs = {ex.submit(run_chunk, ch): ch for ch in chunks}
        pending = set(futs)
        while pending:
            done, pending = cf.wait(pending, timeout=max(1.0, min(30.0, deadline - time.time())),
                                    return_when=cf.FIRST_COMPLETED)
            for f in done:
                try:
                    results += f.result()
                except Exception as e:  # noqa: BLE001 - a crashed worker fails its cases
                    for c in futs[f]:
                        results.append(dict(c, ratios={}, errors={}, problems=[], ok=False,
                                            error=f"worker crashed: {type(e).__name__}: {e}"[-800:]))
            log(f"  matrix: {len(results)}/{len(cases)} cases done")
            if time.time() > deadline and pending:
                for f in list(pending):
                    if f.cancel():
                        skipped += futs[f]
                        pending.discard(f)
    return results, skipped


# ---------------------------------------------------------------------------------------
# every config of the search space


def space_variants(dtype="bfloat16", head_dims=(64, 128), masks=("none", "causal", "window"), mods="", kernels=None):
    from flashgen import resources, space
    from flashgen.arch import current
    from flashgen.spec import KERNELS, KernelSpec, Variant, is_decode, is_varlen

    arch = current()
    out = []
    # The decode kernels have their own float64 check of every config (flashgen tune
    # --preset decode precompiles and checks them; benchmarks/decode_bench.py).
    # Score mods are compiled into the dense kernels only.
    for kern in (k for k in KERNELS if not is_decode(k) and not (mods and is_varlen(k))
                 and (kernels is None or k in kernels)):
        for d in head_dims:
            for m in masks:
                spec = KernelSpec(kern, dtype, d, d, m, mods)
                out += [Variant(spec, c) for c in space.valid_configs(spec)
                        if resources.estimate(Variant(spec, c), arch).feasible]
    return out


def run_space(variants, workers, log, deadline=None, on_chunk=None, chunk=64):
    """Compile and check ``variants`` (float64 reference, KernelBenchmarker.precompile),
    ``chunk`` at a time; chunks not started by ``deadline`` are skipped, and
    ``on_chunk(records)`` sees the records so far after each chunk (a run cut short keeps
    them).  Returns (records, skipped variants)."""
    from flashgen.bench import KernelBenchmarker

    kb = KernelBenchmarker(workers=workers)
    n = [0]

    def progress(vid, failure):
        n[0] += 1
        if failure or n[0] % 50 == 0 or n[0] == len(variants):
            log(f"  space: {n[0]}/{len(variants)}" + (f"  FAIL {vid}: {failure[:300]}" if failure else ""))

    recs, skipped = [], []
    for i in range(0, len(variants), chunk):
        part = variants[i:i + chunk]
        if deadline is not None and time.time() > deadline:
            skipped += part
            continue
        failures = kb.precompile(part, progress=progress, group=2)
        reports = kb.check_reports()
        for v in part:
            failure, rep = reports.get(v.id, (failures.get(v.id), {}))
            ratios = {k: float(x) for k, x in (rep.get("check_ratios") or {}).items()}
            recs.append(dict(kind="space", name=f"space/{v.id}", ratios=ratios, problems=[], error=failure,
                             ok=failure is None and bool(ratios) and all(r <= 1.0 for r in ratios.values()),
                             smem=rep.get("smem_bytes_compiled"), n_spills=rep.get("n_spills")))
        if on_chunk:
            on_chunk(recs)
    return recs, skipped


# ---------------------------------------------------------------------------------------
# big cases: > 2^31 elements, batch * heads = 70000


def big_int64_case(n_rows, head_rows, tail_rows, sk=97, causal=False, dtype="bfloat16"):
    """q, O, dO, dQ of shape (1, 1, n_rows, 64): more than 2^31 elements when
    n_rows > 2^31 / 64.  Checked on the first ``head_rows`` and last ``tail_rows`` rows;
    dO is zero elsewhere, so those rows contribute exactly 0 to dK / dV and the float64
    reference of the selected rows gives the whole dK / dV.  With bottom-right causal
    (off = sk - n_rows) only the last sk rows see keys: the tail's problem is the same as
    a (tail_rows, sk) bottom-right causal problem."""
    torch = _torch()
    from flashgen import ops, reference
    from flashgen.arch import current
    from flashgen.bench import FLOOR
    from flashgen.heuristics import default_config
    from flashgen.masks import mask_bounds
    from flashgen.spec import KernelSpec

    t0 = time.time()
    name = f"big/{dtype}/int64/{'causal' if causal else 'none'}/q{n_rows}k{sk}"
    rec = dict(kind="big", name=name, numel=n_rows * 64, ratios={}, errors={}, problems=[], error=None)
    try:
        device, dt, d = _device(), _dtype(dtype), 64
        g = torch.Generator(device=device).manual_seed(7)
        nan = float("nan")
        q = torch.empty(1, 1, n_rows, d, dtype=dt, device=device)
        for s in range(0, n_rows, 1 << 22):  # fill in chunks (no float32 temporary of 2^31 elements)
            e = min(n_rows, s + (1 << 22))
            q[:, :, s:e] = torch.randn(1, 1, e - s, d, generator=g, device=device, dtype=torch.float32).to(dt)
        k, v = (_rand((1, 1, sk, d), dt, g, device) for _ in range(2))
        do = torch.zeros_like(q)
        do[:, :, :head_rows] = _rand((1, 1, head_rows, d), dt, g, device)
        do[:, :, -tail_rows:] = _rand((1, 1, tail_rows, d), dt, g, device)
        mode, lo, hi = mask_bounds(n_rows, sk, causal=causal, window=(-1, -1))
        arch = current()
        cfg = {kern: default_config(KernelSpec(kern, dtype, d, d, mode), arch) for kern in ("fwd", "bwd_dq", "bwd_dkdv")}
        rec["configs"] = {n: c.id for n, c in cfg.items()}
        o = torch.full_like(q, nan)
        lse = torch.full((1, 1, n_rows), nan, dtype=torch.float32, device=device)
        scale = d ** -0.5
        kw = dict(softmax_scale=scale, mask=mode, diag_lo=lo, diag_hi=hi)
        ops.fwd(q, k, v, config=cfg["fwd"], out=o, lse=lse, **kw)
        _sync()
        dq = torch.full_like(q, nan)
        dk, dv = torch.full_like(k, nan), torch.full_like(v, nan)
        ops.bwd(do, q, k, v, o, lse, config_dq=cfg["bwd_dq"], config_dkdv=cfg["bwd_dkdv"], dq=dq, dk=dk, dv=dv,
                delta=torch.full_like(lse, nan), **kw)
        _sync()
        rec["kernel_seconds"] = round(time.time() - t0, 2)
        # every element written, no NaN (in chunks: no 2^31-element temporaries)
        for nm, t in (("O", o), ("dQ", dq)):
            for s in range(0, n_rows, 1 << 24):
                if torch.isnan(t[:, :, s:s + (1 << 24)]).any():
                    rec["problems"].append(f"{nm}: NaN in rows {s}..")
                    break
        if torch.isnan(lse).any():
            rec["problems"].append("LSE: NaN")
        # rows whose dO is 0 have dQ = 0 exactly (dS = P * (0 - 0))
        for s in range(head_rows, n_rows - tail_rows, 1 << 24):
            e = min(n_rows - tail_rows, s + (1 << 24))
            if dq[:, :, s:e].abs().max().item() != 0:
                rec["problems"].append(f"dQ not 0 in rows {s}..{e} where dO = 0")
                break
        parts = [(0, head_rows), (n_rows - tail_rows, n_rows)] if not causal else [(n_rows - tail_rows, n_rows)]
        if causal:  # the head rows see no key: exactly 0 / -inf
            hs = slice(0, head_rows)
            if not (torch.equal(o[:, :, hs], torch.zeros_like(o[:, :, hs])) and bool(torch.isneginf(lse[:, :, hs]).all())
                    and torch.equal(dq[:, :, hs], torch.zeros_like(dq[:, :, hs]))):
                rec["problems"].append("head rows (no key visible) not O = 0, LSE = -inf, dQ = 0")
        idx = torch.cat([torch.arange(a, z, device=device) for a, z in parts])
        qs, dos = q[:, :, idx], do[:, :, idx]
        rkw = dict(causal=causal, softmax_scale=scale)
        r64 = reference.forward(qs, k, v, **rkw)[:2] + reference.backward(dos, qs, k, v, **rkw)
        rdt = reference.forward(qs, k, v, dtype=dt, **rkw)[:2] + reference.backward(dos, qs, k, v, dtype=dt, **rkw)
        got = dict(O=o[:, :, idx], LSE=lse[:, :, idx], dQ=dq[:, :, idx], dK=dk, dV=dv)
        for nm, r, bb in zip(OUTPUTS, r64, rdt):
            if nm == "LSE":
                bb = bb.float()
            floor = FLOOR[torch.float32 if nm == "LSE" else dt]
            err, berr = reference.max_error(got[nm], r), reference.max_error(bb, r)
            rec["ratios"][nm] = err / (2 * berr + floor)
            rec["errors"][nm] = [err, berr]
        del q, do, o, dq, lse
    except Exception as e:  # noqa: BLE001
        rec["error"] = f"{type(e).__name__}: {e}"[-800:]
        rec["traceback"] = traceback.format_exc()[-3000:]
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    rec["ok"] = rec["error"] is None and not rec["problems"] and all(r <= 1.0 for r in rec["ratios"].values())
    rec["seconds"] = round(time.time() - t0, 2)
    return rec


def big_grid_case(batch, heads, sq=17, sk=16, dtype="bfloat16"):
    """batch * heads programs on grid axis 0 (> 65535, CUDA's limit on axes 1 and 2)."""
    c = _case("big", f"grid/b{batch}h{heads}/causal/q{sq}k{sk}", dtype, batch, heads, heads, sq, sk, 64, causal=True,
              seed=99)
    rec = run_case(c)
    rec["batch_heads"] = batch * heads
    return rec


def _in_subprocess(fn, fargs, name):
    ctx = mp.get_context("spawn")
    try:
        with cf.ProcessPoolExecutor(1, mp_context=ctx) as ex:
            return ex.submit(fn, *fargs).result()
    except Exception as e:  # noqa: BLE001 - a crashed process fails its case
        return dict(kind="big", name=name, ratios={}, errors={}, problems=[], ok=False,
                    error=f"process failed: {type(e).__name__}: {e}"[-800:])


# ---------------------------------------------------------------------------------------
# report


def _clean(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def summarize(records, skipped):
    worst = {n: (0.0, "") for n in OUTPUTS}
    for r in records:
        for n, x in r.get("ratios", {}).items():
            if n in worst and (x > worst[n][0] or math.isnan(x)):
                worst[n] = (x, r["name"])
    fails = [r for r in records if not r["ok"]]
    by_kind: dict = {}
    for r in records:
        by_kind[r["kind"]] = by_kind.get(r["kind"], 0) + 1
    return dict(cases=len(records), failures=len(fails), skipped=len(skipped), by_kind=by_kind,
                worst={n: {"ratio": w[0], "case": w[1]} for n, w in worst.items()},
                failed=[dict(name=r["name"], error=r.get("error"), problems=r.get("problems"),
                             ratios=r.get("ratios")) for r in fails])


def write(path, meta, records, skipped):
    s = summarize(records, skipped)
    with open(path, "w") as f:
        json.dump(_clean(dict(meta=meta, summary=s, cases=records, skipped=[c["name"] for c in skipped])), f, indent=1)
    return s


def print_summary(s):
    print()
    for f in s["failed"][:40]:
        print(f"FAIL {f['name']}: {f['error'] or ''} {'; '.join(f['problems'] or [])} "
              f"{ {k: round(v, 3) for k, v in (f['ratios'] or {}).items()} }")
    print(f"\ncases run: {s['cases']} ({', '.join(f'{k} {v}' for k, v in s['by_kind'].items())}); "
          f"failures: {s['failures']}; skipped (time budget): {s['skipped']}")
    print(f"{'output':<7}{'worst ratio':>12}  case")
    for n, w in s["worst"].items():
        print(f"{n:<7}{w['ratio']:>12.3f}  {w['case']}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON file for every case")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU-interpreter run of the script itself (float16)")
    ap.add_argument("--workers", type=int, default=None, help="worker processes (default: min(16, cpus))")
    ap.add_argument("--budget-s", type=float, default=400.0,
                    help="matrix cases not started after this many seconds are skipped (reported)")
    ap.add_argument("--space-budget-s", type=float, default=float("inf"),
                    help="search-space chunks not started after this many seconds are skipped (reported)")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: big,space,matrix")
    ap.add_argument("--kernels", default="", help="the search-space part for these kernels only (e.g. bwd_dq; "
                    "default: all)")
    ap.add_argument("--resume-skipped", default="", help="the search-space part for the variants an earlier "
                    "run's JSON lists as skipped only")
    ap.add_argument("--head-dims", default="64,128", help="head dims of the search-space part (default 64,128)")
    ap.add_argument("--mods", default="", help="the search-space part with these score mods compiled in "
                    "(e.g. softcap_alibi_bias_dropout: every mod's code at once; dense kernels only)")
    args = ap.parse_args(argv)
    # The search-space arguments are checked (and the resume file read: it may be --out
    # itself, which the first part rewrites) before any part runs.
    from flashgen.spec import KERNELS, is_decode, is_varlen

    space_kernels = [k for k in KERNELS if not is_decode(k) and not (args.mods and is_varlen(k))]
    kernels = set(args.kernels.split(",")) if args.kernels else None
    if kernels and kernels - set(space_kernels):
        ap.error(f"--kernels: {', '.join(sorted(kernels - set(space_kernels)))} not in the search-space part's "
                 f"kernels ({', '.join(space_kernels)})")
    resume = None
    if args.resume_skipped:
        try:
            with open(args.resume_skipped) as f:
                resume = json.load(f)["skipped"]
            if not isinstance(resume, list):
                raise TypeError("'skipped' is not a list")
            resume = set(resume)
        except (OSError, ValueError, KeyError, TypeError) as e:
            ap.error(f"--resume-skipped {args.resume_skipped}: not an earlier run's JSON with a 'skipped' list "
                     f"({type(e).__name__}: {e})")
    t_start = time.time()
    deadline = t_start + args.budget_s
    skip = {s for s in args.skip.split(",") if s}

    def log(msg):
        print(f"[{time.time() - t_start:6.1f}s] {msg}", flush=True)

    torch = _torch()
    if not torch.cuda.is_available():
        if not args.smoke:
            sys.exit("no CUDA GPU: run with --smoke (and TRITON_INTERPRET=1) for the CPU smoke test")
        os.environ["TRITON_INTERPRET"] = "1"
    workers = args.workers or (2 if args.smoke else min(16, os.cpu_count() or 1))
    import triton

    from flashgen.arch import current

    arch = current()
    meta = dict(device=arch.name, cc=list(arch.compute_capability), torch=torch.__version__, triton=triton.__version__,
                smoke=args.smoke, workers=workers, argv=sys.argv[1:])
    log(f"device {arch.name} cc {arch.compute_capability}, torch {torch.__version__}, triton {triton.__version__}, "
        f"{workers} workers")
    records, skipped = [], []

    if "big" not in skip:
        if args.smoke:
            n, hr, tr, gb, gh = 300, 40, 60, 4, 4
        else:
            n, hr, tr, gb, gh = 2 ** 31 // 64 + 4113, 2048, 4096, 8750, 8
        dt = "float16" if args.smoke else "bfloat16"
        # one fresh process each (a fault cannot spoil the next), one after another (memory)
        for fn, fargs, name in ((big_int64_case, (n, hr, tr, 97, False, dt), f"big/{dt}/int64/none"),
                                (big_int64_case, (n, hr, tr, 97, True, dt), f"big/{dt}/int64/causal"),
                                (big_grid_case, (gb, gh, 17, 16, dt), f"big/{dt}/grid/b{gb}h{gh}")):
            r = _in_subprocess(fn, fargs, name)
            records.append(r)
            log(f"big: {r['name']} ({r.get('numel', '?')} elements, batch*heads {r.get('batch_heads', 1)}) "
                f"ok={r['ok']} {r.get('seconds')}s { {k: round(v, 3) for k, v in r['ratios'].items()} } "
                f"{r['error'] or ''} {r['problems']}")
        write(args.out, meta, records, skipped)

    if "space" not in skip:
        if args.smoke:  # float16 (the interpreter's bf16 dots are wrong), one config per kernel x mask
            vs = space_variants("float16", (64,), mods=args.mods, kernels=kernels)
            pick = {}
            for v in vs:
                pick.setdefault((v.spec.kernel, v.spec.mask), v)
            vs = [pick[k] for k in (("fwd", "none"), ("bwd_dq", "causal"), ("bwd_dkdv", "window")) if k in pick]
        else:
            vs = space_variants(head_dims=tuple(int(x) for x in args.head_dims.split(",")), mods=args.mods,
                                kernels=kernels)
        if resume is not None:
            listed = {n for n in resume if isinstance(n, str) and n.startswith("space/")}
            vs = [v for v in vs if f"space/{v.id}" in listed]
            log(f"space: --resume-skipped lists {len(listed)} space variants; {len(vs)} of them are in this run's "
                f"space" + (" (other --mods / --head-dims / --kernels than that run?)" if len(vs) < len(listed) else ""))
        log(f"space: {len(vs)} valid + feasible variants (fwd/bwd_dq/bwd_dkdv x d {args.head_dims} x none/causal/window"
            f"{', mods ' + args.mods if args.mods else ''})")
        t0 = time.time()
        before = list(records)
        res, space_skipped = run_space(vs, workers, log, deadline=t_start + args.space_budget_s,
                                       on_chunk=lambda recs: write(args.out, meta, before + recs,
                                                                   [{"name": f"space/{v.id}"} for v in vs[len(recs):]]))
        records += res
        skipped += [{"name": f"space/{v.id}"} for v in space_skipped]
        log(f"space: done in {time.time() - t0:.0f}s ({len(space_skipped)} skipped by --space-budget-s)")
        write(args.out, meta, records, skipped)

    if "matrix" not in skip:
        cases = build_matrix(args.smoke)
        log(f"matrix: {len(cases)} cases")
        t0 = time.time()
        res, matrix_skipped = run_matrix(cases, workers, deadline, log)
        records += res
        skipped += matrix_skipped
        log(f"matrix: done in {time.time() - t0:.0f}s ({len(matrix_skipped)} skipped by the time budget)")

    meta["seconds"] = round(time.time() - t_start, 1)
    s = write(args.out, meta, records, skipped)
    print_summary(s)
    log(f"wrote {args.out}")
    return 1 if s["failures"] or s["skipped"] else 0


if __name__ == "__main__":
    sys.exit(main())

"""User score/mask functions and sinks on the GPU: flashgen (score_mod / mask_mod /
sinks compiled into its kernels) against FlexAttention (compiled, with its BlockMask)
and, where it has the feature, SDPA's cuDNN backend, side by side in one run (issue 19).

Cases (bf16, batch 8, 16 heads, head_dim 128, seqlen 2048 by default):

* ``plain-causal``: no function, for reference: flashgen, Flex, SDPA cuDNN.
* ``relpos``: T5's bucketed relative-position bias with a learned (32, heads) float32
  table (its gradient included in forward+backward): flashgen, Flex (same score_mod).
* ``alibi``: ALiBi as a score_mod: flashgen, flashgen's built-in ``alibi_slopes``
  (``flashgen-builtin``: the user function should be within 5% of it), Flex.
* ``softcap``: 30 tanh(s / 30) as a score_mod: flashgen, flashgen ``softcap=30``, Flex.
* ``prefix-lm``: mask_mod (kv <= q) | (kv < 512): flashgen, Flex.
* ``document`` / ``document-causal``: mask_mod doc[q] == doc[kv] from a per-token
  document id tensor (documents of 128..1024 tokens), without and with causal:
  flashgen, Flex.
* ``window-causal``: mask_mod q - kv <= 256 with causal=True: flashgen, flashgen's
  ``window=(256, 0)`` (``flashgen-builtin``), Flex.
* ``sinks``: learnable sinks (float32 (heads,), gradient included) with causal and a
  window of 128 (gpt-oss): flashgen, and flashgen without sinks (``flashgen-builtin``:
  the sinks' cost over the plain kernels, forward and backward).

SDPA cuDNN serves only ``plain-causal`` here: the others need a materialized
seqlen_q x seqlen_k mask or bias (no learned-bias gradient, no sinks).

Before timing, every backend's output and gradients (q, k, v, and the table or sinks)
are checked on batch entry 0 against the float64 reference
(``flashgen.user_mods.reference``) with the project's rule: max error <= 2 x the error
of the same computation in torch at bf16 + floor.  A failed flashgen check makes the
exit status 1.  Then forward and forward+backward are timed (triton.testing.do_bench,
median ms, L2 flushed); TFLOP/s counts 4·b·h·d·(visible score entries) forward, 3.5x
that forward+backward.  JSON goes to --out; a table is printed last.

    PYTHONPATH=. python3 benchmarks/user_mods_bench.py --out user_mods.json        # GPU
    PYTHONPATH=. python3 benchmarks/user_mods_bench.py --smoke --out /tmp/u.json   # CPU, interpreter

``--smoke`` runs flashgen's code paths and checks on the CPU in Triton's interpreter
(float16, b1 h2 seqlen 64 d16; FlexAttention uncompiled, forward only; wall-clock
timing).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
import warnings


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="user_mods.json")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--cases", default="all", help="comma-separated case names, or all")
    p.add_argument("--smoke", action="store_true", help="CPU interpreter run at a tiny size")
    p.add_argument("--warmup-ms", type=int, default=100)
    p.add_argument("--rep-ms", type=int, default=400)
    return p.parse_args(argv)


CASES = ("plain-causal", "relpos", "alibi", "softcap", "prefix-lm", "document", "document-causal",
         "window-causal", "sinks")


def t5_bucket(rel, num_buckets=32, max_distance=128):
    import torch

    num_buckets //= 2
    buckets = (rel > 0).to(torch.long) * num_buckets
    rel = torch.abs(rel)
    max_exact = num_buckets // 2
    large = max_exact + (torch.log(rel.float() / max_exact) / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).to(torch.long)
    large = torch.min(large, torch.full_like(large, num_buckets - 1))
    return buckets + torch.where(rel < max_exact, rel, large)


def _case(name, b, h, s, device):
    """(flashgen kwargs maker, builtin kwargs or None, flex (score_mod, mask_mod) maker,
    causal, window, extra tensors with gradients).  Makers take the extra tensors."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(5)
    if name == "plain-causal":
        return dict(causal=True, extras=[], fn=lambda: (None, None), builtin=None)
    if name == "relpos":
        table = (torch.randn(32, h, generator=g) * 0.5).to(device)
        def fn(table):
            return (lambda score, b_, h_, q, kv: score + table[t5_bucket(kv - q), h_]), None
        return dict(causal=False, extras=[table], fn=fn, builtin=None)
    if name == "alibi":
        slopes = torch.tensor([2 ** (-8 * (i + 1) / h) for i in range(h)], device=device)
        def fn():
            return (lambda score, b_, h_, q, kv: score - slopes[h_] * torch.abs(q - kv)), None
        return dict(causal=True, extras=[], fn=fn, builtin=dict(alibi_slopes=slopes))
    if name == "softcap":
        def fn():
            return (lambda score, b_, h_, q, kv: 30.0 * torch.tanh(score / 30.0)), None
        return dict(causal=True, extras=[], fn=fn, builtin=dict(softcap=30.0))
    if name == "prefix-lm":
        prefix = s // 4
        def fn():
            return None, (lambda b_, h_, q, kv: (kv <= q) | (kv < prefix))
        return dict(causal=False, extras=[], fn=fn, builtin=None)
    if name in ("document", "document-causal"):
        lens, total = [], 0
        while total < s:
            n = min(s - total, int(torch.randint(s // 16, s // 2 + 1, (1,), generator=g)))
            lens.append(n)
            total += n
        doc = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)).to(device)
        def fn():
            return None, (lambda b_, h_, q, kv: doc[q] == doc[kv])
        return dict(causal=name == "document-causal", extras=[], fn=fn, builtin=None)
    if name == "window-causal":
        w = s // 8
        def fn():
            return None, (lambda b_, h_, q, kv: q - kv <= w)
        return dict(causal=True, extras=[], fn=fn, builtin=dict(window=(w, 0)))
    if name == "sinks":
        sinks = torch.randn(h, generator=g).to(device)
        return dict(causal=True, window=(s // 16, 0), extras=[], fn=lambda: (None, None), sinks=sinks,
                    builtin={})
    raise ValueError(name)


def main(argv=None) -> int:
    args = _parse(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    import flashgen
    from flashgen import bench, user_mods
    from flashgen.masks import mask_bounds

    device = "cpu" if args.smoke else "cuda"
    dtype = torch.float16 if args.smoke else torch.bfloat16
    b, h, s, d = (1, 2, 64, 16) if args.smoke else (args.batch, args.heads, args.seqlen, args.head_dim)
    names = CASES if args.cases == "all" else tuple(args.cases.split(","))
    scale = d ** -0.5
    out = {"argv": sys.argv[1:], "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
           "torch": torch.__version__, "sizes": dict(batch=b, heads=h, seqlen=s, head_dim=d, dtype=str(dtype)),
           "cases": {}}
    failed = False

    def timer(fn):
        if device == "cuda":
            import triton.testing

            return float(triton.testing.do_bench(fn, warmup=args.warmup_ms, rep=args.rep_ms, return_mode="median"))
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    flex_compiled = None
    if device == "cuda":
        import torch._functorch.config
        from torch.nn.attention.flex_attention import flex_attention

        torch._functorch.config.donated_buffer = False
        flex_compiled = torch.compile(flex_attention)

    for name in names:
        c = _case(name, b, h, s, device)
        causal, window = c["causal"], c.get("window", (-1, -1))
        sinks = c.get("sinks")
        gen = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype, generator=gen) for _ in range(3))
        do = torch.randn(b, h, s, d, device=device, dtype=dtype, generator=gen)
        _, lo, hi = mask_bounds(s, s, causal=causal, window=window)
        sm, mm = c["fn"](*c["extras"])
        with torch.no_grad():
            i = torch.arange(s, device=device)[:, None]
            j = torch.arange(s, device=device)[None, :]
            vis = ((j - i) >= lo) & ((j - i) <= hi)
            if mm is not None:
                vis = vis & mm(torch.zeros((), dtype=torch.long, device=device), torch.zeros((), dtype=torch.long,
                                                                                              device=device), i, j)
            visible = float(vis.sum()) * b * h
        rec = {"causal": causal, "window": list(window), "visible_fraction": visible / (b * h * s * s),
               "results": {}}
        out["cases"][name] = rec

        def backends():
            yield "flashgen", lambda qkv, fns, snk: flashgen.attention(
                *qkv, causal=causal, window=window, softmax_scale=scale, sinks=snk, score_mod=fns[0], mask_mod=fns[1])
            if c["builtin"] is not None:
                kw = dict(causal=causal, window=window, softmax_scale=scale)
                kw.update(c["builtin"])
                yield "flashgen-builtin", lambda qkv, fns, snk: flashgen.attention(*qkv, **kw)
            if name != "sinks":
                yield "flex", lambda qkv, fns, snk: _flex(qkv, fns, lo, hi, scale, flex_compiled)
            if name == "plain-causal" and device == "cuda":
                yield "sdpa-cudnn", lambda qkv, fns, snk: _cudnn(qkv, scale)

        for backend, run in backends():
            res = rec["results"][backend] = {}
            try:
                fwd_only = backend == "flex" and device != "cuda"
                # float64 check on batch entry 0 (the builtin without sinks: its own function)
                snk = sinks if backend != "flashgen-builtin" else None
                ratio = _check(run, q[:1], k[:1], v[:1], do[:1], c, snk, lo, hi, scale, dtype, fwd_only,
                               builtin=backend == "flashgen-builtin")
                res["check_ratio"] = ratio
                if backend == "flashgen" and not ratio <= 1.0:
                    failed = True
                # the functions are made once, as a model would (their tensors require grad)
                fns = c["fn"](*[t.clone().requires_grad_() for t in c["extras"]])
                snk_t = None if snk is None else snk.clone().requires_grad_()
                qkv = [t.clone().requires_grad_(not fwd_only) for t in (q, k, v)]
                with torch.no_grad():
                    res["fwd_ms"] = timer(lambda: run(qkv, fns, snk_t))
                if not fwd_only:
                    def fb():
                        o = run(qkv, fns, snk_t)
                        o.backward(do)
                    res["fwd_bwd_ms"] = timer(fb)
                flops = 4.0 * d * visible
                res["fwd_tflops"] = flops / res["fwd_ms"] * 1e-9
                if "fwd_bwd_ms" in res:
                    res["fwd_bwd_tflops"] = 3.5 * flops / res["fwd_bwd_ms"] * 1e-9
            except Exception as e:  # noqa: BLE001 (a failing backend is recorded, the run goes on)
                res["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                if backend == "flashgen":
                    failed = True
                    traceback.print_exc()
        f, x = rec["results"].get("flashgen", {}), rec["results"].get("flex", {})
        for m in ("fwd", "fwd_bwd"):
            if f.get(f"{m}_ms") and x.get(f"{m}_ms"):
                rec[f"flashgen/flex_{m}"] = x[f"{m}_ms"] / f[f"{m}_ms"]
            bi = rec["results"].get("flashgen-builtin", {})
            if f.get(f"{m}_ms") and bi.get(f"{m}_ms"):
                rec[f"flashgen/builtin_{m}"] = bi[f"{m}_ms"] / f[f"{m}_ms"]
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1)

    _table(out)
    return 1 if failed else 0


def _flex(qkv, fns, lo, hi, scale, compiled):
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q = qkv[0]
    sm, mm = fns
    s = q.shape[2]

    def mask(b, h, qi, kv):
        rel = kv - qi
        m = (rel >= lo) & (rel <= hi)
        return m & mm(b, h, qi, kv) if mm is not None else m
    bm = create_block_mask(mask, B=None, H=None, Q_LEN=s, KV_LEN=s, device=q.device)
    if compiled is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return flex_attention(*(t.detach() for t in qkv), score_mod=sm, block_mask=bm, scale=scale)
    return compiled(*qkv, score_mod=sm, block_mask=bm, scale=scale)


def _cudnn(qkv, scale):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(*qkv, is_causal=True, scale=scale)


def _check(run, q, k, v, do, c, sinks, lo, hi, scale, dtype, fwd_only, builtin):
    """Worst ratio err / (2 * torch's bf16 error + floor) over O and the gradients."""
    import torch

    from flashgen import bench, user_mods

    def once(kind):
        qkv = [t.detach().clone().requires_grad_(not fwd_only) for t in (q, k, v)]
        ex = [t.detach().clone().to(torch.float64 if kind == torch.float64 else t.dtype).requires_grad_(not fwd_only)
              for t in c["extras"]]
        snk = None if sinks is None else sinks.detach().clone().requires_grad_(not fwd_only)
        if kind == "run":
            o = run(qkv, c["fn"](*ex), snk)
        else:
            sm, mm = c["fn"](*ex)
            if builtin:
                bkw = c["builtin"]
                if "alibi_slopes" in bkw:
                    sl = bkw["alibi_slopes"]
                    sm = lambda s_, b_, h_, qi, kv: s_ - sl[h_] * torch.abs(qi - kv)  # noqa: E731
                if "softcap" in bkw:
                    sm = lambda s_, b_, h_, qi, kv: bkw["softcap"] * torch.tanh(s_ / bkw["softcap"])  # noqa: E731
                if "window" in bkw:
                    wl = bkw["window"][0]
                    mm = lambda b_, h_, qi, kv: (qi - kv <= wl)  # noqa: E731
            o, _ = user_mods.reference(*qkv, scale, lo, hi, sm, mm, snk, kind)
        res = {"O": o.detach()}
        if not fwd_only:
            o.backward(do.to(o.dtype))
            res.update(dQ=qkv[0].grad, dK=qkv[1].grad, dV=qkv[2].grad)
            res.update({f"d{n}": t.grad for n, t in enumerate(ex)})
            if snk is not None:
                res["dsinks"] = snk.grad
        return res

    got, ref, base = once("run"), once(torch.float64), once(dtype)
    return max(r for _, _, r in bench._ratios(got, {n: (ref[n], base[n]) for n in got}, dtype).values())


def _table(out):
    rows = [("case", "backend", "check", "fwd ms", "fwd TF/s", "f+b ms", "f+b TF/s")]
    for name, rec in out["cases"].items():
        for backend, r in rec["results"].items():
            if "error" in r:
                rows.append((name, backend, "error", r["error"][:40], "", "", ""))
                continue
            rows.append((name, backend, f"{r.get('check_ratio', float('nan')):.2f}",
                         f"{r.get('fwd_ms', float('nan')):.3f}", f"{r.get('fwd_tflops', float('nan')):.1f}",
                         f"{r.get('fwd_bwd_ms', float('nan')):.3f}", f"{r.get('fwd_bwd_tflops', float('nan')):.1f}"))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip())
    print("speedups (ratio of median times; builtin: the same feature built into flashgen):")
    for name, rec in out["cases"].items():
        ratios = ", ".join(f"{k} {v:.2f}x" for k, v in rec.items() if k.startswith("flashgen/"))
        if ratios:
            print(f"  {name}: {ratios}")


if __name__ == "__main__":
    sys.exit(main())

"""User score/mask functions and sinks on the GPU: flashgen (score_mod / mask_mod /
sinks compiled into its kernels) against FlexAttention (compiled, with its BlockMask)
and, where it has the feature, SDPA's cuDNN backend, side by side in one run (issue 19).

Cases (bf16, batch 8, 16 heads, head_dim 128, seqlen 2048 by default): ``plain-causal``
(no function, for reference: flashgen, Flex, SDPA cuDNN), then the examples of
:mod:`flashgen.user_examples` (defined there once; ``flashgen tune --preset
user-examples`` tunes the same functions), with FlexAttention running the same
score_mod / mask_mod:

* ``relpos``: T5's bucketed relative-position bias with a learned (32, heads) float32
  table (its gradient included in forward+backward): flashgen, Flex.
* ``alibi``: ALiBi as a score_mod: flashgen, flashgen's built-in ``alibi_slopes``
  (``flashgen-builtin``: the user function should be within 5% of it), Flex.
* ``softcap``: 30 tanh(s / 30) as a score_mod: flashgen, flashgen ``softcap=30``, Flex.
* ``prefix-lm``: mask_mod (kv <= q) | (kv < seqlen / 4): flashgen, Flex.
* ``document`` / ``document-causal``: mask_mod doc[q] == doc[kv] from a per-token
  document id tensor (documents of seqlen/16 .. seqlen/2 tokens), without and with
  causal: flashgen, Flex.
* ``window-causal``: mask_mod q - kv <= seqlen / 8 with causal=True: flashgen,
  flashgen's ``window=(seqlen / 8, 0)`` (``flashgen-builtin``), Flex.
* ``sinks``: learnable sinks (float32 (heads,), gradient included) with causal and a
  window of seqlen / 16 (gpt-oss): flashgen, and flashgen without sinks
  (``flashgen-builtin``: the sinks' cost over the plain kernels, forward and backward).
* ``sinks-causal``: the same sinks with causal alone (gpt-oss's full-attention layers),
  whose backward the dispatcher may give to the Gluon whole backward on the H200.

FlexAttention is compiled per case: ``torch.compile(flex_attention, dynamic=False,
fullgraph=True)`` after ``torch._dynamo.reset()``, its block mask made once per case
with ``create_block_mask(..., _compile=True)`` where torch has that flag.  It is run at
the timed size for both grad modes before timing with FlexAttention's "called without
torch.compile()" warning turned into an error, dynamo's recompile limit raising rather
than falling back, and a timing that compiled another graph is an error too: a Flex
row is a compiled kernel's time or an error, never the unfused eager path.

SDPA cuDNN serves only ``plain-causal`` here: the others need a materialized
seqlen_q x seqlen_k mask or bias (no learned-bias gradient, no sinks).

Before timing, every backend's output and gradients (q, k, v, and the table or sinks)
are checked on batch entry 0 (``--check-batch N``: the first N) against the float64 reference
(``flashgen.user_mods.reference``) with the project's rule: max error <= 2 x the error
of the same computation in torch at bf16 + floor.  A failed flashgen check makes the
exit status 1.  Then forward and forward+backward are timed (triton.testing.do_bench,
median ms, L2 flushed); TFLOP/s counts 4·b·h·d·(visible score entries) forward, 3.5x
that forward+backward.  JSON goes to --out; a table is printed last.

    PYTHONPATH=. python3 benchmarks/user_mods_bench.py --out user_mods.json        # GPU
    PYTHONPATH=. python3 benchmarks/user_mods_bench.py --smoke --out /tmp/u.json   # CPU, interpreter

``--smoke`` runs flashgen's code paths and checks on the CPU in Triton's interpreter
(float16, b1 h2 seqlen 64 d16; FlexAttention uncompiled, forward only, which the JSON's
"flex" says; wall-clock timing).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
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
    p.add_argument("--check-batch", type=int, default=1,
                   help="batch entries the float64 check runs (default 1; the batch size makes the dispatcher's "
                        "choices: --check-batch 8 checks the timed path itself)")
    p.add_argument("--warmup-ms", type=int, default=100)
    p.add_argument("--rep-ms", type=int, default=400)
    return p.parse_args(argv)


def cases() -> tuple:
    """The case names: the plain causal problem, then flashgen.user_examples' examples
    (imported here, after --smoke has turned the interpreter on)."""
    from flashgen import user_examples

    return ("plain-causal",) + user_examples.NAMES + ("sinks-causal",)


def _example(name, h, s, device):
    """The flashgen.user_examples example ``name`` (learned tensors without grad: each
    run makes its own copies), or the plain causal problem."""
    from flashgen import user_examples

    if name == "plain-causal":
        return user_examples.Example(name, lambda: (None, None), [], causal=True)
    if name == "sinks-causal":  # sinks with causal alone (gpt-oss's full-attention layers)
        ex = user_examples.make("sinks", h, s, device, requires_grad=False)
        return dataclasses.replace(ex, name=name, window=(-1, -1))
    return user_examples.make(name, h, s, device, requires_grad=False)


def main(argv=None) -> int:
    args = _parse(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    import flashgen
    from flashgen.masks import mask_bounds

    device = "cpu" if args.smoke else "cuda"
    dtype = torch.float16 if args.smoke else torch.bfloat16
    b, h, s, d = (1, 2, 64, 16) if args.smoke else (args.batch, args.heads, args.seqlen, args.head_dim)
    known = cases()
    names = known if args.cases == "all" else tuple(args.cases.split(","))
    bad = [n for n in names if n not in known]
    if bad:
        print(f"unknown cases {bad}; known: {', '.join(known)}", file=sys.stderr)
        return 2
    scale = d ** -0.5
    out = {"argv": sys.argv[1:], "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
           "torch": torch.__version__, "sizes": dict(batch=b, heads=h, seqlen=s, head_dim=d, dtype=str(dtype)),
           "flex": "compiled (torch.compile(flex_attention, dynamic=False, fullgraph=True), compiled block mask)"
           if device == "cuda" else "eager (smoke run: unfused, forward only)", "cases": {}}
    failed = False

    def timer(fn):
        if device == "cuda":
            import triton.testing

            return float(triton.testing.do_bench(fn, warmup=args.warmup_ms, rep=args.rep_ms, return_mode="median"))
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    if device == "cuda":
        import torch._functorch.config

        torch._functorch.config.donated_buffer = False  # the timing runs backward on the same graph repeatedly

    for name in names:
        c = _example(name, h, s, device)
        causal, window, sinks = c.causal, c.window, c.sinks
        gen = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype, generator=gen) for _ in range(3))
        do = torch.randn(b, h, s, d, device=device, dtype=dtype, generator=gen)
        _, lo, hi = mask_bounds(s, s, causal=causal, window=window)
        sm, mm = c.functions(*c.tensors)
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
        flex = None

        def backends():
            nonlocal flex
            yield "flashgen", lambda qkv, fns, snk: flashgen.attention(
                *qkv, causal=causal, window=window, softmax_scale=scale, sinks=snk, score_mod=fns[0], mask_mod=fns[1])
            if c.builtin is not None:
                kw = dict(causal=causal, window=window, softmax_scale=scale)
                kw.update(c.builtin)
                yield "flashgen-builtin", lambda qkv, fns, snk: flashgen.attention(*qkv, **kw)
            if not name.startswith("sinks"):  # FlexAttention has no sinks
                flex = _Flex(mm, lo, hi, s, scale, device, compiled=device == "cuda")
                yield "flex", flex
            if name == "plain-causal" and device == "cuda":
                yield "sdpa-cudnn", lambda qkv, fns, snk: _cudnn(qkv, scale)

        for backend, run in backends():
            res = rec["results"][backend] = {}
            try:
                fwd_only = backend == "flex" and device != "cuda"
                # float64 check on batch entry 0 (the builtin: the same function, without sinks)
                snk = sinks if backend != "flashgen-builtin" else None
                nb = min(args.check_batch, b)
                ratio = _check(run, q[:nb], k[:nb], v[:nb], do[:nb], c, snk, lo, hi, scale, dtype, fwd_only)
                res["check_ratio"] = ratio
                if backend == "flashgen" and not ratio <= 1.0:
                    failed = True
                # the functions are made once, as a model would (their tensors require grad)
                fns = c.functions(*[t.clone().requires_grad_() for t in c.tensors])
                snk_t = None if snk is None else snk.clone().requires_grad_()
                qkv = [t.clone().requires_grad_(not fwd_only) for t in (q, k, v)]

                def fb():
                    o = run(qkv, fns, snk_t)
                    o.backward(do)
                if backend == "flex" and flex.compiled:
                    # compile at the timed size (batch b) for both grad modes first, with the
                    # detector of an unfused fallback on; the timing then must compile nothing
                    with torch.no_grad(), flex.fused():
                        run(qkv, fns, snk_t)
                    with flex.fused():
                        fb()
                    graphs = flex.graphs()
                with torch.no_grad():
                    res["fwd_ms"] = timer(lambda: run(qkv, fns, snk_t))
                if not fwd_only:
                    res["fwd_bwd_ms"] = timer(fb)
                if backend == "flex" and flex.compiled and flex.graphs() != graphs:
                    raise RuntimeError(f"FlexAttention compiled again while it was timed ({graphs} -> "
                                       f"{flex.graphs()} graphs): the times may include compiles or the eager path")
                flops = 4.0 * d * visible
                res["fwd_tflops"] = flops / res["fwd_ms"] * 1e-9
                if "fwd_bwd_ms" in res:
                    res["fwd_bwd_tflops"] = 3.5 * flops / res["fwd_bwd_ms"] * 1e-9
            except Exception as e:  # noqa: BLE001 (a failing backend is recorded, the run goes on)
                for key in ("fwd_ms", "fwd_bwd_ms", "fwd_tflops", "fwd_bwd_tflops"):
                    res.pop(key, None)
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


class _Flex:
    """FlexAttention for one case: its block mask (the built-in bounds lo <= kv - q <= hi
    and ``mask_mod``) made once for the case's sizes (compiled where torch offers it),
    and, on CUDA, a compiled flex_attention of its own: ``torch.compile(flex_attention,
    dynamic=False, fullgraph=True)`` after ``torch._dynamo.reset()``, so that every size
    it meets (the check's batch 1, the timing's batch b) gets its own static graph and
    no case's graphs count against another's recompile limit.  A graph break, a
    dynamic-shape fallback or hitting the recompile limit raises instead of running
    the unfused path (``fail_on_recompile_limit_hit``); :meth:`fused` also turns
    FlexAttention's "called without torch.compile()" warning into an error.  On the CPU
    (the smoke run) it is flex_attention itself, unfused, forward only."""

    def __init__(self, mask_mod, lo, hi, seqlen, scale, device, compiled: bool):
        import inspect

        import torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        self.compiled, self.scale = compiled, scale

        def mask(b, h, q_idx, kv_idx):
            rel = kv_idx - q_idx
            m = (rel >= lo) & (rel <= hi)
            return m & mask_mod(b, h, q_idx, kv_idx) if mask_mod is not None else m
        kw = {}
        if compiled:
            import torch._dynamo

            torch._dynamo.reset()
            cfg = torch._dynamo.config
            if hasattr(cfg, "fail_on_recompile_limit_hit"):
                cfg.fail_on_recompile_limit_hit = True
            cfg.cache_size_limit = max(cfg.cache_size_limit, 16)
            if "_compile" in inspect.signature(create_block_mask).parameters:
                kw["_compile"] = True
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # newer torch: _compile -> torch.compile
            warnings.simplefilter("ignore", FutureWarning)
            self.block_mask = create_block_mask(mask, B=None, H=None, Q_LEN=seqlen, KV_LEN=seqlen, device=device,
                                                **kw)
        self.fn = torch.compile(flex_attention, dynamic=False, fullgraph=True) if compiled else flex_attention

    def __call__(self, qkv, fns, snk):
        if not self.compiled:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "called without torch.compile()": the smoke run's eager path
                return self.fn(*(t.detach() for t in qkv), score_mod=fns[0], block_mask=self.block_mask,
                               scale=self.scale)
        return self.fn(*qkv, score_mod=fns[0], block_mask=self.block_mask, scale=self.scale)

    @staticmethod
    def graphs() -> int:
        """Graphs dynamo has compiled in this process so far."""
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])

    @contextlib.contextmanager
    def fused(self):
        """Raise when FlexAttention runs its unfused eager implementation inside (its
        warning, normally given once per process, is re-armed and recorded)."""
        import torch.nn.attention.flex_attention as fa

        shown = getattr(fa, "_WARNINGS_SHOWN", None)
        if shown is not None:
            shown.discard("flex_attention_performance")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
        for w in caught:
            if "without torch.compile" in str(w.message) or "unfused" in str(w.message):
                raise RuntimeError("FlexAttention ran its unfused eager implementation, not a compiled kernel: "
                                   + str(w.message).splitlines()[0])


def _cudnn(qkv, scale):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(*qkv, is_causal=True, scale=scale)


def _check(run, q, k, v, do, c, sinks, lo, hi, scale, dtype, fwd_only):
    """Worst ratio err / (2 * torch's bf16 error + floor) over O and the gradients (q, k,
    v, the learned tensors, the sinks) against the float64 reference of the example's
    functions (a built-in equivalent computes the same function)."""
    import torch

    from flashgen import bench, user_mods

    def once(kind):
        qkv = [t.detach().clone().requires_grad_(not fwd_only) for t in (q, k, v)]
        ex = [t.detach().clone().to(torch.float64 if kind == torch.float64 else t.dtype).requires_grad_(not fwd_only)
              for t in c.tensors]
        snk = None if sinks is None else sinks.detach().clone().requires_grad_(not fwd_only)
        if kind == "run":
            o = run(qkv, c.functions(*ex), snk)
        else:
            sm, mm = c.functions(*ex)
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
    missing = [n for n, t in got.items() if t is None]
    if missing:
        raise RuntimeError(f"no gradient for {', '.join(missing)}")
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

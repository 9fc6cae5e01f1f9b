"""Programmatic dependent launch (PDL) across the Gluon backward's launches, as a probe.

The backward is three launches on one stream (preprocess, main kernel, convert; a GQA
group split adds a Triton reduction).  With PDL a kernel launched with the
``launch_pdl`` attribute may start while the kernel before it finishes: its programs
execute ``griddepcontrol.wait`` before touching memory, and the kernel before it lets
them start early with ``griddepcontrol.launch_dependents``.  This probe renders each
timed variant twice, as the template writes it and with ``griddepcontrol.wait;
griddepcontrol.launch_dependents`` at the start of the three Gluon kernels
(:func:`pdl_source`, a text edit of the rendered source, never tuned or served), launches
the second with ``launch_pdl=True``, and times both through
``flashgen.families.gluon.bwd.attention_bwd`` (launch plans on, CUDA events, median, L2
flushed), twice each, in alternation.  It also compares the outputs: dK and dV bitwise,
dQ by its largest difference over its largest value, beside the same comparison of two
runs without PDL (dQ's reduce-adds arrive in a run-dependent order).  Random inputs
(O and LSE not those of a forward): timings and run-to-run comparisons only.

    PYTHONPATH=. python3 benchmarks/probe_pdl.py --out probe_pdl.json

Prints a table last: ms without and with PDL, their ratio, and the comparisons.

``--fwd``: the Gluon forward instead, the dispatcher's shipped row at each of FWD_SHAPES
(``griddepcontrol.wait; griddepcontrol.launch_dependents`` first in ``attn_fwd``,
:func:`fwd_pdl_source`), timed by ``do_bench`` (L2 flushed before each call) and in a
loop where each call follows another kernel (``x.add_(1)`` on a 32 MB tensor, 50 pairs
between two CUDA events, median of 5): the forward's own boundary is with a kernel that
does not trigger it early, as in a model.  O compared bitwise.

    PYTHONPATH=. python3 benchmarks/probe_pdl.py --fwd --out probe_pdl_fwd.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

#: (batch, num_heads, num_kv_heads, seqlen, head_dim, causal).
SHAPES = [(32, 16, 16, 512, 128, False), (32, 16, 16, 512, 128, True), (16, 16, 16, 1024, 128, True),
          (4, 16, 16, 4096, 128, False), (32, 32, 32, 512, 64, True), (8, 32, 32, 2048, 64, False),
          (1, 32, 8, 2048, 128, True)]
#: (batch, num_heads, seqlen, head_dim, causal) of --fwd.
FWD_SHAPES = [(32, 16, 512, 128, True), (32, 16, 512, 128, False), (16, 16, 1024, 128, True),
              (32, 32, 512, 64, True), (4, 16, 4096, 128, False)]
#: The three Gluon kernels of one backward.
KERNELS = ("attn_bwd", "attn_bwd_preprocess", "attn_bwd_convert")
_GDC = '''

@gluon.jit
def _gdc():
    gl.inline_asm_elementwise("griddepcontrol.wait;\\ngriddepcontrol.launch_dependents;\\nmov.b32 $0, 0;", "=r", [],
                              dtype=gl.int32, is_pure=False, pack=1)
'''


def pdl_source(src: str) -> str:
    """``src`` (a rendered backward) with ``_gdc()`` (wait for the kernel before, then let
    the next one start) as the first statement of each of :data:`KERNELS`."""
    anchor = "\n\n@gluon.jit\ndef _query_blocks("
    if anchor not in src:
        raise ValueError("no _query_blocks to put _gdc before")
    src = src.replace(anchor, _GDC + anchor, 1)
    for name in KERNELS:
        i = src.index(f"def {name}(")
        end_doc = src.index('"""', src.index('"""', i) + 3) + 3
        src = src[:end_doc] + "\n    _gdc()" + src[end_doc:]
    return src


def fwd_pdl_source(src: str) -> str:
    """``src`` (a rendered forward) with ``_gdc()`` as the first statement of
    ``attn_fwd``."""
    i = src.rindex("@gluon.jit", 0, src.index("def attn_fwd("))
    src = src[:i] + _GDC.lstrip("\n") + "\n\n" + src[i:]
    i = src.index("def attn_fwd(")
    j = src.index("):\n", i) + 3
    return src[:j] + "    _gdc()\n" + src[j:]


def _import(src: str, tag: str):
    from flashgen import compile as _compile

    return _compile.import_generated(f"probe_pdl_{tag}", src)


def _main_fwd(out: str) -> int:
    import torch
    import triton.testing

    from flashgen import library
    from flashgen.families.gluon import config as C
    from flashgen.families.gluon import launch as L
    from flashgen.families.gluon import render as R
    from flashgen.families.gluon.family import fwd_config
    from flashgen.masks import mask_bounds

    launch = L.launch
    x = torch.randn(8 * 1024 * 1024, device="cuda")
    rows = []
    for (b, h, s, d, causal) in FWD_SHAPES:
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        mode, lo, hi = mask_bounds(s, s, causal=causal, window=(-1, -1))
        cfg, _ = library.kernel_for("fwd", q, k, v, mode)
        if cfg.family != "gluon":
            print("skipped (not a Gluon row):", (b, h, s, d, causal), cfg.id)
            continue
        g = fwd_config(cfg)
        src = R.render(C.GluonFwdVariant(C.GluonFwdSpec("bfloat16", d, d, mode), g))
        mods = {False: _import(src, "fwd0"), True: _import(fwd_pdl_source(src), "fwd1")}
        times, outs = {False: [], True: []}, {}
        try:
            for pdl in (False, True, False, True):
                L.launch = ((lambda fn, grid, args, **opts: launch(fn, grid, args, launch_pdl=True, **opts))
                            if pdl else launch)
                L._PLANS.clear()
                fn = lambda: L.fwd(q, k, v, softmax_scale=d ** -0.5, mask=mode, diag_lo=lo, diag_hi=hi,  # noqa: E731
                                   config=g, module=mods[pdl])
                o, _ = fn()
                torch.cuda.synchronize()
                outs.setdefault(pdl, o.clone())
                bench = float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))
                loops = []
                for _ in range(5):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    for _ in range(50):
                        x.add_(1.0)
                        fn()
                    end.record()
                    torch.cuda.synchronize()
                    loops.append(start.elapsed_time(end) / 50)
                times[pdl].append((bench, sorted(loops)[2]))
        finally:
            L.launch = launch
            L._PLANS.clear()
        rows.append({"shape": [b, h, s, d, causal], "config": cfg.id, "plain": times[False], "pdl": times[True],
                     "o_equal": bool(torch.equal(outs[False], outs[True]))})
        print(json.dumps(rows[-1]), flush=True)
        Path(out).write_text(json.dumps(rows, indent=1))
    print("\nshape (b, h, s, d, causal) | do_bench plain / pdl ms | after another kernel plain / pdl ms | O equal")
    for r in rows:
        pb, qb = min(t[0] for t in r["plain"]), min(t[0] for t in r["pdl"])
        pl, ql = min(t[1] for t in r["plain"]), min(t[1] for t in r["pdl"])
        print(r["shape"], f"| {pb:.4f} / {qb:.4f} ({pb / qb:.3f}x) | {pl:.4f} / {ql:.4f} ({pl / ql:.3f}x) |",
              r["o_equal"])
    return 0


def _kernel_name(fn) -> str:
    return getattr(fn, "__name__", None) or getattr(getattr(fn, "fn", None), "__name__", "")


def _pdl_launch(launch):
    """``launch`` with the ``launch_pdl`` attribute for the three Gluon kernels of
    :data:`KERNELS` only (a GQA split's Triton reduction, which does not wait, keeps the
    plain launch)."""
    def run(fn, grid, args, **opts):
        if _kernel_name(fn) in KERNELS:
            opts = {**opts, "launch_pdl": True}
        return launch(fn, grid, args, **opts)
    return run


def _module(cfg, d: int, mask: str, pdl: bool):
    from flashgen.families.gluon import bwd as B

    src = B.render(cfg, "bfloat16", d, mask)
    return _import(pdl_source(src) if pdl else src, f"bwd{int(pdl)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="probe_pdl.json")
    ap.add_argument("--fwd", action="store_true", help="the Gluon forward instead of the backward")
    a = ap.parse_args()
    if a.fwd:
        return _main_fwd(a.out)
    import torch
    import triton.testing

    from flashgen.families.gluon import bwd as B
    from flashgen.masks import mask_bounds

    load, launch = B.load, B.launch
    rows = []
    for (b, h, hk, s, d, causal) in SHAPES:
        dt = torch.bfloat16
        q, do, o = (torch.randn(b, h, s, d, device="cuda", dtype=dt) for _ in range(3))
        k, v = (torch.randn(b, hk, s, d, device="cuda", dtype=dt) for _ in range(2))
        lse = torch.randn(b, h, s, device="cuda", dtype=torch.float32).abs() + 5.0
        mode, lo, hi = mask_bounds(s, s, causal=causal, window=(-1, -1))
        cfg = B.default_config(d, "bfloat16", mode)
        if h != hk:  # the GQA rows' split over two programs, 16-bit partials, register stores
            cfg = dataclasses.replace(cfg, group_split=2, half_partials=True, kv_store="ptr")
        times, outs = {False: [], True: []}, {False: [], True: []}
        try:
            mods = {pdl: _module(cfg, d, mode, pdl) for pdl in (False, True)}
            for pdl in (False, True, False, True):
                B.load = lambda *args, _m=mods[pdl], **kw: _m
                B.launch = _pdl_launch(launch) if pdl else launch
                B._PLANS.clear()
                fn = lambda: B.attention_bwd(do, q, k, v, o, lse, softmax_scale=d ** -0.5, diag_lo=lo,  # noqa: E731
                                             diag_hi=hi, mask=mode, config=cfg)
                got = fn()
                torch.cuda.synchronize()
                outs[pdl].append([t.float() for t in got])
                times[pdl].append(float(triton.testing.do_bench(fn, warmup=10, rep=80, return_mode="median")))
        finally:
            B.load, B.launch = load, launch
            B._PLANS.clear()

        def diff(x, y):
            return {"dk_dv_equal": bool(torch.equal(x[1], y[1]) and torch.equal(x[2], y[2])),
                    "dq_rel": float((x[0] - y[0]).abs().max() / x[0].abs().max())}

        rows.append({"shape": [b, h, hk, s, d, causal], "config": cfg.id, "plain_ms": times[False],
                     "pdl_ms": times[True], "plain_vs_plain": diff(outs[False][0], outs[False][1]),
                     "plain_vs_pdl": diff(outs[False][0], outs[True][0])})
        print(json.dumps(rows[-1]), flush=True)
        Path(a.out).write_text(json.dumps(rows, indent=1))
    print("\nshape (b, h, hk, s, d, causal) | plain ms | pdl ms | plain / pdl | plain vs plain | plain vs pdl")
    for r in rows:
        p, q_ = min(r["plain_ms"]), min(r["pdl_ms"])
        print(r["shape"], f"| {p:.4f} | {q_:.4f} | {p / q_:.3f}x |", r["plain_vs_plain"], "|", r["plain_vs_pdl"])
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where the host time of one eager forward+backward goes, in the thread that spends it.

``launch_cost.py`` times whole paths from the calling thread; autograd runs a CUDA
backward node in its own device thread, which a profiler attached to the calling thread
does not see.  This script wraps flashgen's own functions on the path (the autograd
Function's forward and backward, the recipes of :mod:`flashgen.hot`,
``library.forward`` / ``backward``, each family's
launcher, the launch plans' replay, the kept kernels' launchers, Triton's tensor-map
encoder) with timers that add up per thread, runs forward+backward loops, and prints
per piece the microseconds per forward+backward and the thread it ran in.  The wrappers
cost about a microsecond each, so the totals are printed without them too.

Per shape (``B,H,HKV,S,D[,causal]``, bf16): wall time per forward+backward (host clock,
synchronized per loop, best of 5 loops) with the backward in autograd's device thread
and in the calling thread (``torch.autograd.set_multithreading_enabled(False)``), with
recipes (``flashgen.hot``) on and off and the plans' direct stages on and off
(``flashgen.plans.DIRECT``), SDPA cuDNN's, then the per-piece table.

Usage (repository root, on a CUDA GPU):
    python3 benchmarks/host_trace.py [--shape B,H,HKV,S,D[,causal]]... [--calls N] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPES = ("1,32,8,512,128,causal", "1,32,8,2048,128,causal", "4,16,16,1024,64,causal")

_TOTALS: dict = collections.defaultdict(float)
_COUNTS: dict = collections.defaultdict(int)


def _timed(name, fn):
    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            who = "main" if threading.current_thread() is threading.main_thread() else "autograd"
            _TOTALS[(name, who)] += time.perf_counter() - t0
            _COUNTS[(name, who)] += 1

    wrapper.__wrapped__ = fn
    return wrapper


def _install():
    """Wrap the pieces; returns a function that removes the wrappers."""
    import triton

    from flashgen import hot, library, plans
    from flashgen.families.gluon import bwd as gbwd
    from flashgen.families.gluon import family as gfam
    from flashgen.families.gluon import launch as gfwd
    from flashgen.families.triton import launch as tl

    undo = []

    def patch(obj, attr, name):
        old = getattr(obj, attr)
        setattr(obj, attr, _timed(name, old))
        undo.append((obj, attr, old))

    fwd_static, bwd_static = library.EagerAttention.forward, library.EagerAttention.backward
    library.EagerAttention.forward = staticmethod(_timed("EagerAttention.forward", fwd_static))
    library.EagerAttention.backward = staticmethod(_timed("EagerAttention.backward", bwd_static))
    undo += [(library.EagerAttention, "forward", staticmethod(fwd_static)),
             (library.EagerAttention, "backward", staticmethod(bwd_static))]
    patch(hot.Calls, "forward", "hot.Calls.forward")
    patch(hot.Calls, "backward", "hot.Calls.backward")
    patch(hot.Recipe, "run", "hot.Recipe.run")
    patch(library, "forward", "library.forward")
    patch(library, "backward", "library.backward")
    patch(library, "kernel_for", "library.kernel_for")
    patch(library, "backward_kernels", "library.backward_kernels")
    patch(plans, "key_of", "plans.key_of")
    patch(plans.Plan, "run", "plans.Plan.run")
    patch(gfam, "fwd", "gluon family fwd")
    patch(gfam, "bwd", "gluon family bwd")
    patch(gfwd, "fwd", "gluon fwd launcher")
    patch(gbwd, "attention_bwd", "gluon bwd launcher")
    for n in ("fwd", "bwd_dq", "bwd_dkdv"):
        patch(tl, n, f"triton {n} launcher")
    try:
        from triton.backends.nvidia import driver as drv

        patch(drv.CudaLauncher, "__call__", "CudaLauncher.__call__ (kernel.run)")
        patch(drv, "make_tensordesc_arg", "make_tensordesc_arg (tensor map)")
    except Exception:  # noqa: BLE001 - another Triton: those two pieces go unseen
        pass
    utils = triton.runtime.driver.active.utils
    if hasattr(utils, "fill_tma_descriptor"):
        patch(utils, "fill_tma_descriptor", "fill_tma_descriptor (encode)")

    def remove():
        for obj, attr, old in reversed(undo):
            setattr(obj, attr, old)

    return remove


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", action="append", help="B,H,HKV,S,D[,causal] (repeatable)")
    ap.add_argument("--calls", type=int, default=100, help="calls per timed loop")
    ap.add_argument("--out", help="JSON file for every number")
    args = ap.parse_args()
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    import flashgen
    from flashgen import dispatch, hot, plans
    from flashgen.families.gluon import bwd as gbwd
    from flashgen.families.gluon import launch as gfwd
    from flashgen.families.triton import launch as tl
    from host_cost import per_call_us
    from profile_call import inputs

    def clear_plans():  # and the recipes, which hold plans
        for t in (gbwd._PLANS, gfwd._PLANS, tl._FWD_PLANS, tl._DQ_PLANS, tl._DKDV_PLANS):
            t.clear()
        dispatch.default_dispatcher().fast.clear()

    out = {"shapes": {}}
    for spec in args.shape or SHAPES:
        q, k, v, do, causal, window = inputs(spec)
        hk, h = k.shape[1], q.shape[1]

        def fb():
            flashgen.attention(q, k, v, causal=causal, window=window).backward(do)

        def fb_thread():
            with torch.autograd.set_multithreading_enabled(False):
                flashgen.attention(q, k, v, causal=causal, window=window).backward(do)

        def fwd_grad():
            flashgen.attention(q, k, v, causal=causal, window=window)

        def cudnn():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                 enable_gqa=hk != h).backward(do)

        row = {}
        for direct, recipes in ((True, True), (True, False), (False, False), (True, True)):
            plans.DIRECT, hot.ENABLED = direct, recipes
            clear_plans()
            tag = ("recipes" if recipes else "plans") + (", direct" if direct else ", kernel.run")
            for label, fn in ((f"fwd+bwd, {tag}", fb), (f"fwd+bwd calling thread, {tag}", fb_thread),
                              (f"fwd with grad, {tag}", fwd_grad)):
                fn()
                fn()
                us = per_call_us(fn, n=args.calls)
                row[label] = min(us, row.get(label, us))
        hot.ENABLED = True
        plans.DIRECT = True
        row["SDPA cuDNN fwd+bwd"] = per_call_us(cudnn, n=args.calls)
        q.grad = k.grad = v.grad = None
        pieces = {}
        for mode, fn in (("device thread", fb), ("calling thread", fb_thread)):
            fn()
            torch.cuda.synchronize()
            remove = _install()
            _TOTALS.clear()
            _COUNTS.clear()
            n = args.calls
            try:
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                torch.cuda.synchronize()
                wall = (time.perf_counter() - t0) / n * 1e6
            finally:
                remove()
            pieces[mode] = {"wall us (wrapped)": round(wall, 1),
                            "pieces": {f"{name} [{who}]": {"us": round(_TOTALS[(name, who)] / n * 1e6, 2),
                                                           "calls": _COUNTS[(name, who)] / n}
                                       for name, who in sorted(_TOTALS, key=lambda x: -_TOTALS[x])}}
        q.grad = k.grad = v.grad = None
        out["shapes"][spec] = {"wall us per call": {k_: round(v_, 1) for k_, v_ in row.items()}, "pieces": pieces}
        print(f"== {spec}", flush=True)
        for k_, v_ in row.items():
            print(f"  {k_:<44} {v_:8.1f} us")
        for mode, p in pieces.items():
            print(f"  -- pieces per forward+backward, backward in the {mode} (wall with wrappers "
                  f"{p['wall us (wrapped)']} us)")
            for name, r in p["pieces"].items():
                print(f"    {name:<62} {r['us']:8.2f} us  x{r['calls']:.0f}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Host time per launch path, with flashgen's direct launch (``flashgen.fastlaunch``) on
and off (``FLASHGEN_FAST_LAUNCH=0``: Triton's ``fn[grid]`` on every call), in one
process.

Per shape (bf16, head_dim 128, causal) and path, the wall time per call: host clock,
synchronized once per loop, best of 5 loops of N back-to-back calls.  At the tiny shape
(1x1/1x128) the kernels take a few microseconds, so the wall time is the host time; at
the real shapes it is max(host, GPU).  Paths:

* ``gluon-fwd``, ``gluon-bwd``: the Gluon family's launchers with their default configs
  (``families.launcher("gluon", ...)``), no autograd;
* ``triton-fwd``, ``triton-bwd``: the same for the Triton family (bwd: dQ then dK/dV);
* ``attention-fwd``: ``flashgen.attention`` under no_grad; ``attention-fwd+bwd``: forward
  and ``backward(dO)`` through autograd (the dispatcher's choices, as ``explain`` says);
* ``attention-fwd+bwd-calling-thread``: the same under
  ``torch.autograd.set_multithreading_enabled(False)`` (the backward runs in the
  calling thread instead of autograd's device thread);
* ``library-bwd``: flashgen's backward (``library.backward``) called directly;
* ``sdpa-cudnn-fwd+bwd``: torch SDPA's cuDNN backend, the same forward and backward;
* ``autograd-identity``: a backward through an identity ``autograd.Function`` (autograd's
  own cost per backward on this host).

``--breakdown``: instead, the host time of each piece of one forward+backward at each
shape, with the configs the dispatcher picks (microseconds per call, best of 5 loops):
allocations, the Gluon backward's input checks, argument building, the launch signature,
one launch of the kept kernel, each launcher, flashgen's forward and backward, and
autograd's; and an empty Python call, as a yardstick of the host's speed.

Usage (repository root, on a CUDA GPU):
    python3 benchmarks/launch_cost.py [--shape B,H,HKV,S] ... [--breakdown] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from host_cost import per_call_us  # noqa: E402

SHAPES = ("1,1,1,128", "1,32,8,2048", "4,16,4,2048")


def _profile(name, spec, fn, calls):
    import cProfile
    import pstats

    import torch

    os.environ["FLASHGEN_FAST_LAUNCH"] = "1"
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    print(f"\n== cProfile {spec} {name}, {calls} calls ==")
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)
    if "bwd" in name and "-" in name and name.startswith(("attention", "sdpa")):
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            for _ in range(10):
                fn()
            torch.cuda.synchronize()
        print(f"\n== torch.profiler {spec} {name}, 10 calls ==")
        print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def _identity():
    """An autograd.Function that returns its input: autograd's own cost per call."""
    import torch

    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            return g

    return Identity


def _inputs(spec: str):
    """(b, h, hk, n, d, q, k, v, dO, q, k, v detached, mask mode, diag_lo, diag_hi) of one
    ``B,H,HKV,S`` shape: bf16, head_dim 128, causal, q/k/v requiring grad."""
    from profile_call import inputs

    from flashgen.masks import mask_bounds

    q, k, v, do, _, _ = inputs(f"{spec},128,causal")
    (b, h, n, d), hk = q.shape, k.shape[1]
    mode, lo, hi = mask_bounds(n, n, causal=True, window=(-1, -1))
    return b, h, hk, n, d, q, k, v, do, q.detach(), k.detach(), v.detach(), mode, lo, hi


def breakdown(args) -> int:
    """The ``--breakdown`` table (module docstring)."""

    import torch

    import flashgen
    from flashgen import fastlaunch, library
    from flashgen.families.gluon import bwd as B

    def us(fn, n=args.calls):
        return round(per_call_us(fn, n=n), 2)

    Identity = _identity()
    rows = []

    def put(spec, name, value):
        rows.append({"shape": spec, "piece": name, "us": value})
        print(json.dumps(rows[-1]), flush=True)

    put("-", "empty Python call", us(lambda: None, 10000))
    put("-", "dict.get", us(lambda d={1: 2}: d.get(1), 10000))
    for spec in args.shape or SHAPES:
        b, h, hk, n, d, q, k, v, do, qn, kn, vn, mode, lo, hi = _inputs(spec)
        scale = d ** -0.5
        o, lse = library.forward(qn, kn, vn, scale, mode, lo, hi)
        fcfg, fmod = library.kernel_for("fwd", qn, kn, vn, mode)
        plan = library.backward_kernels(qn, kn, vn, mode, "", False)
        put(spec, f"families: fwd {fcfg.family}, bwd {getattr(plan[0], 'family', 'two kernels')}", 0)
        put(spec, "torch.empty like q", us(lambda: torch.empty_like(qn)))
        put(spec, "torch.empty (b, h, s) float32", us(lambda: torch.empty((b, h, n), dtype=torch.float32,
                                                                           device="cuda")))
        put(spec, "library.kernel_for (memo hit)", us(lambda: library.kernel_for("fwd", qn, kn, vn, mode)))
        put(spec, "library.backward_kernels (memo hit)",
            us(lambda: library.backward_kernels(qn, kn, vn, mode, "", False)))
        put(spec, "library.forward", us(lambda: library.forward(qn, kn, vn, scale, mode, lo, hi)))
        put(spec, "library.backward", us(lambda: library.backward(do, qn, kn, vn, o, lse, scale, mode, lo, hi)))
        if getattr(plan[0], "family", "") == "gluon":
            from flashgen.families.gluon.family import bwd_config

            g = bwd_config(plan[0])
            put(spec, "gluon bwd: check_inputs", us(lambda: B.check_inputs(do, qn, kn, vn, o, lse)))
            put(spec, "gluon bwd: launch_args", us(lambda: B.launch_args(do, qn, kn, vn, o, lse, softmax_scale=scale,
                                                                          diag_lo=lo, diag_hi=hi, config=g)))
            a = B.launch_args(do, qn, kn, vn, o, lse, softmax_scale=scale, diag_lo=lo, diag_hi=hi, config=g)
            mod = B.load(g, "bfloat16", d, mode)
            fn = mod.attn_bwd
            constexpr = tuple(p.is_constexpr for p in fn.params)
            grid, margs = a["main"]
            put(spec, "gluon bwd: _signature(main)", us(lambda: fastlaunch._signature(margs, constexpr)))
            opts = {"num_warps": g.num_warps, "maxnreg": g.maxnreg}
            kern = fastlaunch.launch(fn, grid, margs, **opts)
            dev, stream = fastlaunch._device_and_stream()
            g1 = grid[1] if len(grid) > 1 else 1
            put(spec, "gluon bwd: _device_and_stream", us(fastlaunch._device_and_stream))
            put(spec, "gluon bwd main: kernel.run (prebuilt args; GPU time if larger)",
                us(lambda: kern.run(grid[0], g1, 1, stream, kern.function, kern.packed_metadata, None, None, None,
                                    *margs), 20))
            put(spec, "gluon bwd main: fastlaunch.launch", us(lambda: fastlaunch.launch(fn, grid, margs, **opts), 20))
        from flashgen.families.gluon.launch import _descriptor as gdesc

        def fill():
            import triton

            # bf16 (the host enum's 9), 128-byte swizzle, box (1, 1, 64, 128), as make_tensordesc_arg passes them
            return triton.runtime.driver.active.utils.fill_tma_descriptor(
                qn.data_ptr(), 128, 2, 9, [1, 1, 64, 128], list(qn.shape), list(qn.stride()), 0)
        try:
            fill()
            put(spec, "fill_tma_descriptor (one, direct)", us(fill))
        except Exception as e:  # noqa: BLE001 - the probe's own argument form may not fit this Triton
            put(spec, f"fill_tma_descriptor: {type(e).__name__}: {str(e)[:80]}", 0)
        put(spec, "gluon: one TensorDescriptor (shim)", us(lambda: gdesc(qn, 64, 128)))

        put(spec, "identity autograd.Function apply (forward only)", us(lambda: Identity.apply(q)))
        put(spec, "identity autograd.Function apply + backward",
            us(lambda: torch.autograd.grad(Identity.apply(q), (q,), do)))
        put(spec, "flashgen.attention forward with grad (no backward)", us(lambda: flashgen.attention(q, k, v, causal=True)))
        put(spec, "flashgen.attention no grad", us(lambda: flashgen.attention(qn, kn, vn, causal=True)))
        import cProfile
        import io
        import pstats

        for label, fn in (("library.backward", lambda: library.backward(do, qn, kn, vn, o, lse, scale, mode, lo, hi)),
                          ("attention forward with grad", lambda: flashgen.attention(q, k, v, causal=True))):
            prof = cProfile.Profile()
            torch.cuda.synchronize()
            prof.enable()
            for _ in range(100):
                fn()
            torch.cuda.synchronize()
            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(12)
            print(f"== cProfile {spec} {label}, 100 calls ==\n{buf.getvalue()}", file=sys.stderr)

        def fb():
            flashgen.attention(q, k, v, causal=True).backward(do)

        def fb_thread():
            with torch.autograd.set_multithreading_enabled(False):
                flashgen.attention(q, k, v, causal=True).backward(do)

        put(spec, "flashgen.attention forward+backward", us(fb))
        put(spec, "the same, backward in the calling thread", us(fb_thread))
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def cudnn():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                 enable_gqa=hk != h).backward(do)

        put(spec, "SDPA cuDNN forward+backward", us(cudnn))
        q.grad = k.grad = v.grad = None
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", action="append", help="B,H,HKV,S (head_dim 128, causal; repeatable)")
    ap.add_argument("--calls", type=int, default=100, help="calls per timed loop")
    ap.add_argument("--out", help="JSON file for every number")
    ap.add_argument("--profile", action="store_true",
                    help="also print, per path with the direct launch, the functions with the most own host time "
                         "(cProfile) and torch.profiler's CPU table of the autograd paths")
    ap.add_argument("--breakdown", action="store_true", help="time each piece of the host path (docstring)")
    args = ap.parse_args()
    if args.breakdown:
        return breakdown(args)
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flashgen
    import flashgen.arch
    from flashgen import families, library

    rows = []
    failed = False
    for spec in args.shape or SHAPES:
        b, h, hk, n, d, q, k, v, do, qn, kn, vn, mode, lo, hi = _inputs(spec)
        kw = dict(softmax_scale=d ** -0.5, mask=mode, diag_lo=lo, diag_hi=hi)
        paths = {}
        arch = flashgen.arch.current()
        cfg = {}
        for fam in ("gluon", "triton"):
            for kernel in ("fwd", "bwd") if fam == "gluon" else ("fwd", "bwd_dq", "bwd_dkdv"):
                key = library._dense_key(kernel, qn, kn, vn, mode, "")
                cfg[fam, kernel] = families.get(fam).default_config(key, arch)
            fwd, bwd = families.launcher(fam, "fwd"), families.launcher(fam, "bwd")
            o, lse = fwd(qn, kn, vn, config=cfg[fam, "fwd"], **kw)
            paths[f"{fam}-fwd"] = lambda fwd=fwd, c=cfg[fam, "fwd"]: fwd(qn, kn, vn, config=c, **kw)
            if fam == "gluon":
                paths["gluon-bwd"] = (lambda bwd=bwd, o=o, lse=lse, c=cfg[fam, "bwd"]:
                                      bwd(do, qn, kn, vn, o, lse, config=c, **kw))
            else:
                paths["triton-bwd"] = (lambda bwd=bwd, o=o, lse=lse: bwd(
                    do, qn, kn, vn, o, lse, config_dq=cfg["triton", "bwd_dq"], config_dkdv=cfg["triton", "bwd_dkdv"],
                    **kw))

        def att_fwd():
            with torch.no_grad():
                flashgen.attention(q, k, v, causal=True)

        def att_fwdbwd():
            flashgen.attention(q, k, v, causal=True).backward(do)

        def cudnn_fwdbwd():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                 enable_gqa=hk != h).backward(do)

        Identity = _identity()
        o_ref, lse_ref = library.forward(qn, kn, vn, d ** -0.5, mode, lo, hi)

        def library_bwd():
            library.backward(do, qn, kn, vn, o_ref, lse_ref, d ** -0.5, mode, lo, hi)

        def att_fwdbwd_calling_thread():
            with torch.autograd.set_multithreading_enabled(False):
                flashgen.attention(q, k, v, causal=True).backward(do)

        paths.update({"attention-fwd": att_fwd, "attention-fwd+bwd": att_fwdbwd,
                      "attention-fwd+bwd-calling-thread": att_fwdbwd_calling_thread,
                      "library-bwd": library_bwd, "sdpa-cudnn-fwd+bwd": cudnn_fwdbwd,
                      "autograd-identity": lambda: Identity.apply(q).backward(do)})
        for name, fn in paths.items():
            row = {"shape": spec, "path": name}
            for mode_name, env in (("triton_launch", "0"), ("direct_launch", "1")):
                os.environ["FLASHGEN_FAST_LAUNCH"] = env
                try:
                    fn()
                    fn()
                    row[mode_name] = round(per_call_us(fn, n=args.calls), 1)
                except Exception as e:  # noqa: BLE001 - reported in the table
                    row[mode_name] = f"{type(e).__name__}: {str(e)[:120]}"
                q.grad = k.grad = v.grad = None
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.profile:
                _profile(name, spec, fn, args.calls)
        # the same outputs both ways: forward bitwise, gradients to bf16 rounding (dQ's
        # reduce-add order is not fixed)
        outs = {}
        for env in ("0", "1"):
            os.environ["FLASHGEN_FAST_LAUNCH"] = env
            o = flashgen.attention(q, k, v, causal=True)
            o.backward(do)
            outs[env] = [o.detach().float()] + [t.grad.float() for t in (q, k, v)]
            q.grad = k.grad = v.grad = None
        same = {name: (torch.equal(a, b) if name == "o" else
                       float((a - b).norm() / b.norm().clamp_min(1e-30)))
                for name, a, b in zip(("o", "dq", "dk", "dv"), outs["1"], outs["0"])}
        print(json.dumps({"shape": spec, "direct_vs_triton_launch": same}), flush=True)
        rows.append({"shape": spec, "path": "check", "direct_vs_triton_launch": same})
        if not same["o"] or max(same[x] for x in ("dq", "dk", "dv")) > 1e-2:
            print(f"FAIL: direct launch differs at {spec}: {same}")
            failed = True
        print(str(flashgen.explain(q, k, v, causal=True)))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    print("\nshape | path | us per call, Triton's launch | us per call, direct launch")
    for r in rows:
        if r["path"] != "check":
            print(f"{r['shape']} | {r['path']} | {r['triton_launch']} | {r['direct_launch']}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

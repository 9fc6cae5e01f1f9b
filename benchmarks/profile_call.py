"""Where one attention call's time goes on the GPU: kernels, their GPU time, and the host
time around them.

For each shape: flashgen.attention forward, backward and forward+backward (bf16, random
inputs, warmed up), and the same through SDPA's cuDNN backend.  Prints, per shape and
backend, the wall time per call (host clock, synchronized, best of several loops), the
GPU time per call (CUDA events, ``triton.testing.do_bench`` median) and the kernels the
profiler saw in one call with their GPU time, so host-bound calls (wall >> GPU) and
extra kernels (copies, memsets, conversions) show.  ``--deterministic`` adds flashgen
with ``deterministic=True``.

Usage (repository root, on a CUDA GPU):
    python3 benchmarks/profile_call.py [--shape B,H,HKV,S,D[,causal][,window=L][,sinks]]... [--deterministic]
        [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from host_cost import per_call_us  # noqa: E402  (wall time per call, synchronized, best of reps)

SHAPES = ("32,16,16,512,128,causal", "8,16,16,2048,128,causal", "4,16,4,2048,128,causal",
          "1,32,8,2048,128,causal", "4,16,16,4096,128")


def parse(s: str):
    """(b, h, hk, n, d, causal, window_left, sinks) of ``B,H,HKV,S,D[,causal][,window=L][,sinks]``
    (window_left -1: no window)."""
    parts = s.split(",")
    b, h, hk, n, d = (int(x) for x in parts[:5])
    flags = parts[5:]
    left = next((int(f.split("=", 1)[1]) for f in flags if f.startswith("window=")), -1)
    return b, h, hk, n, d, "causal" in flags, left, "sinks" in flags


def inputs(spec: str):
    """(q, k, v, dO, causal, window) of one ``--shape`` spec: random bf16 CUDA tensors
    (seed 0), q, k and v requiring grad."""
    import torch

    b, h, hk, n, d, causal, left, _ = parse(spec)
    window = (left, 0 if causal else -1) if left >= 0 else (-1, -1)
    torch.manual_seed(0)

    def rand(*shape, grad=True):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=grad)

    return rand(b, h, n, d), rand(b, hk, n, d), rand(b, hk, n, d), rand(b, h, n, d, grad=False), causal, window


def kernels_of(fn) -> list[tuple[str, int, float]]:
    """(kernel name, count, GPU us) of one call of ``fn``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    out = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        if t > 0:
            out.append((e.key[:70], e.count, round(t, 1)))
    return sorted(out, key=lambda r: -r[2])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", action="append",
                    help="B,H,HKV,S,D[,causal][,window=L][,sinks] (repeatable); window=L: a window of L keys "
                         "to the left (with causal: to the diagonal); sinks: also flashgen with learnable "
                         "sinks (backend flashgen-sinks); a window has no SDPA cuDNN row")
    ap.add_argument("--out", help="JSON file for every number")
    ap.add_argument("--deterministic", action="store_true",
                    help="also flashgen with deterministic=True (backend flashgen-deterministic)")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="also run N flashgen forward+backward calls of each shape under cProfile and "
                         "print the functions with the most own host time")
    args = ap.parse_args()
    import torch
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flashgen

    results = []
    for spec in args.shape or SHAPES:
        b, h, hk, n, d, causal, left, with_sinks = parse(spec)
        q, k, v, do, causal, window = inputs(spec)

        sinks = torch.randn(h, device="cuda", dtype=torch.float32, requires_grad=True)

        def fg():
            return flashgen.attention(q, k, v, causal=causal, window=window)

        def fg_sinks():
            return flashgen.attention(q, k, v, causal=causal, window=window, sinks=sinks)

        def cudnn():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                        enable_gqa=hk != h)

        def fg_det():
            return flashgen.attention(q, k, v, causal=causal, window=window, deterministic=True)

        backends = [("flashgen", fg)] + ([("flashgen-deterministic", fg_det)] if args.deterministic else []) + (
            [("flashgen-sinks", fg_sinks)] if with_sinks else []) + (
            [("sdpa-cudnn", cudnn)] if left < 0 else [])
        for name, f in backends:
            o = f()
            ref = o.detach()

            def fwd(f=f):
                with torch.no_grad():
                    f()

            def fwdbwd(f=f):
                f().backward(do)

            def bwd(o=o):
                o.backward(do, retain_graph=True)

            row = {"shape": spec, "backend": name}
            for what, fn in (("fwd", fwd), ("bwd", bwd), ("fwdbwd", fwdbwd)):
                row[f"{what}_wall_us"] = round(per_call_us(fn, n=50), 1)
                row[f"{what}_gpu_us"] = round(triton.testing.do_bench(fn, warmup=25, rep=100,
                                                                      return_mode="median") * 1e3, 1)
                row[f"{what}_kernels"] = kernels_of(fn)
            if name in ("flashgen", "flashgen-deterministic"):
                row["explain"] = str(flashgen.explain(q, k, v, causal=causal, window=window,
                                                      deterministic=name == "flashgen-deterministic"))
            results.append(row)
            if name.startswith("flashgen") and args.cprofile:
                import cProfile
                import pstats

                for label, fn in (("fwd", fwd), ("fwd+bwd", fwdbwd)):
                    prof = cProfile.Profile()
                    torch.cuda.synchronize()
                    prof.enable()
                    for _ in range(args.cprofile):
                        fn()
                    torch.cuda.synchronize()
                    prof.disable()
                    print(f"\n== cProfile {spec} {name} {label}, {args.cprofile} calls ==")
                    pstats.Stats(prof).sort_stats("tottime").print_stats(22)
            del o, ref
            q.grad = k.grad = v.grad = sinks.grad = None
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    for r in results:
        print(f"\n{r['shape']}  {r['backend']}")
        if "explain" in r:
            print("  " + r["explain"].replace("\n", "\n  "))
        for what in ("fwd", "bwd", "fwdbwd"):
            ks = "; ".join(f"{k} x{c} {t}us" for k, c, t in r[f"{what}_kernels"][:6])
            print(f"  {what:6s} wall {r[f'{what}_wall_us']:8.1f} us  gpu {r[f'{what}_gpu_us']:8.1f} us  | {ks}")
    print("\nshape | backend | fwd wall/gpu us | bwd wall/gpu us | fwd+bwd wall/gpu us")
    for r in results:
        print(f"{r['shape']} | {r['backend']} | {r['fwd_wall_us']:.0f}/{r['fwd_gpu_us']:.0f} | "
              f"{r['bwd_wall_us']:.0f}/{r['bwd_gpu_us']:.0f} | {r['fwdbwd_wall_us']:.0f}/{r['fwdbwd_gpu_us']:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

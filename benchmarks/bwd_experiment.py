"""The backward experiment: store the probability matrix, or recompute it?

Batch 2, 16 heads, head_dim 64, seqlen 512, 1024, 2048, 4096 (defaults), the same
inputs and the same upstream gradient dO for both methods:

- ``stored-P``: a forward that saves P (batch, heads, N, N) and a backward that reads
  it (flashgen.peers.MaterializedP: dV = P^T dO, dP = dO V^T, dS = P∘(dP − rowsum(dO∘O)),
  dQ = scale·dS K, dK = scale·dS^T Q; torch ops).
- ``flashgen``: flashgen.attention, whose backward recomputes P from Q, K and the LSE.

For each: median ms of forward, backward and forward+backward (CUDA events), the peak
memory one forward+backward allocates beyond its inputs and what the forward leaves
allocated for the backward, and dQ/dK/dV against the float64 reference
(flashgen.reference) with FlashAttention's tolerance: max |error| <= 2 x the error of
the reference formula computed at the input dtype + 2e-3 (float16) / 1.6e-2 (bfloat16).
At one seqlen (default 4096): torch.profiler's FLOP counts (with_flops=True) and the
bytes its ops allocate (profile_memory=True), the analytic FLOPs of each method, and,
with --ncu, Nsight Compute's DRAM bytes.  Last, the measured seqlen from which
recomputation pays for itself (flashgen's forward+backward faster).

    PYTHONPATH=. python3 benchmarks/bwd_experiment.py --out bwd_experiment.json [--ncu]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ncu_io  # noqa: E402
from flashgen import attention, iomodel, peers, reference  # noqa: E402
from flashgen.bench import FLOOR, time_ms  # noqa: E402

METHODS = ("stored-P", "flashgen")


def method_fn(name):
    if name == "stored-P":
        return peers.materialized_p_attention
    return attention


def peak_and_saved(fn, q, k, v, do):
    """(peak bytes of one fwd+bwd beyond the inputs, bytes the forward leaves allocated)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    o = fn(q, k, v)
    torch.cuda.synchronize()
    saved = torch.cuda.memory_allocated() - base
    torch.autograd.grad(o, (q, k, v), do)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, saved


def errors(grads_by_method, q, k, v, do, heads_per_chunk=4):
    """{method: {dQ|dK|dV: max error}} against float64, and the baseline (the reference
    formula at the input dtype), chunked over (batch, heads) to bound memory."""
    names = ("dQ", "dK", "dV")
    err = {m: dict.fromkeys(names, 0.0) for m in grads_by_method}
    base = dict.fromkeys(names, 0.0)
    for b in range(q.shape[0]):
        for h0 in range(0, q.shape[1], heads_per_chunk):
            sl = (slice(b, b + 1), slice(h0, h0 + heads_per_chunk))
            qs, ks, vs, dos = (t.detach()[sl] for t in (q, k, v, do))
            ref = reference.backward(dos, qs, ks, vs)
            low = reference.backward(dos, qs, ks, vs, dtype=q.dtype)
            for n, r, lo in zip(names, ref, low):
                base[n] = max(base[n], reference.max_error(lo, r))
                for m, grads in grads_by_method.items():
                    got = grads[names.index(n)][sl]
                    err[m][n] = max(err[m][n], reference.max_error(got, r))
            del ref, low
    return err, base


def profile(fn, q, k, v, do) -> dict:
    """torch.profiler over one fwd+bwd: FLOPs by op (with_flops) and bytes allocated by
    ops (profile_memory: the sum of each op's own positive allocations)."""
    from torch.profiler import ProfilerActivity, profile as tprofile

    torch.cuda.synchronize()
    with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_flops=True,
                  profile_memory=True) as prof:
        torch.autograd.grad(fn(q, k, v), (q, k, v), do)
        torch.cuda.synchronize()
    by_op, alloc = {}, 0
    for e in prof.key_averages():
        if e.flops:
            by_op[e.key] = by_op.get(e.key, 0) + int(e.flops)
        mem = getattr(e, "self_device_memory_usage", None)
        if mem is None:
            mem = getattr(e, "self_cuda_memory_usage", 0)
        alloc += max(0, int(mem or 0))
    return {"flops_total": sum(by_op.values()), "flops_by_op": by_op, "allocated_bytes_by_ops": alloc}


def analytic_flops(b, h, n, d) -> dict:
    """Matmul FLOPs each method executes (2·b·h·N²·d per N x N x d matmul): forward 2
    (S, O); stored-P backward 4 (dV, dP, dQ, dK); flashgen backward 7 (the dQ kernel
    recomputes S and computes dP, dQ; the dK/dV kernel recomputes S^T and computes dV,
    dP^T, dK).  The FlashAttention convention counts 2 + 5 (backward 2.5x forward)."""
    mm = 2.0 * b * h * n * n * d
    return {"stored-P": {"fwd": 2 * mm, "bwd": 4 * mm}, "flashgen": {"fwd": 2 * mm, "bwd": 7 * mm},
            "convention": {"fwd": 2 * mm, "bwd": 5 * mm}}


def ncu_bytes(b, h, n, d, dtype) -> dict:
    """DRAM bytes of each method's forward and backward at this size (benchmarks/ncu_io.py)."""
    base = dict(batch=b, heads=h, seqlen=n, head_dim=d, dtype=dtype)
    cfgs = ncu_io.configs_for(base)
    cases = [{**base, "kind": "naive_fwd", "name": "stored-P fwd"},
             {**base, "kind": "naive_bwd", "name": "stored-P bwd"},
             {**base, "kind": "flashgen_fwd", "name": "flashgen fwd", "config": cfgs["config_fwd"]},
             {**base, "kind": "flashgen_bwd", "name": "flashgen bwd", **cfgs}]
    measured = ncu_io.run_ncu(cases)
    return {c["name"]: {"measured": m, "model_bytes": ncu_io.model_for(c).total_bytes}
            for c, m in zip(cases, measured)}


def payoff(results, seqlens) -> str:
    faster = [r["seqlen"] for r in results
              if r["flashgen"]["fwdbwd_ms"] < r["stored-P"]["fwdbwd_ms"]]
    if not faster:
        return "none"
    if faster == list(seqlens):
        return "all measured"
    first = faster[0]
    later = [n for n in seqlens if n >= first]
    return f"{first}" + ("" if faster[faster.index(first):] == later else " (not at every longer seqlen)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--seqlens", default="512,1024,2048,4096")
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    ap.add_argument("--profile-seqlen", type=int, default=4096)
    ap.add_argument("--ncu", action="store_true", help="also measure DRAM bytes with Nsight Compute")
    ap.add_argument("--rep-ms", type=int, default=25)
    ap.add_argument("--out", type=Path, default=Path("bwd_experiment.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: needs a CUDA GPU")
    t0 = time.time()
    dt = getattr(torch, args.dtype)
    b, h, d = args.batch, args.heads, args.head_dim
    seqlens = [int(x) for x in args.seqlens.split(",")]
    results = []
    for n in seqlens:
        g = torch.Generator(device="cuda").manual_seed(n)
        q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=dt, generator=g) for _ in range(4))
        q, k, v = (t.requires_grad_(True) for t in (q, k, v))
        row = {"seqlen": n}
        grads = {}
        for m in METHODS:
            fn = method_fn(m)
            torch.autograd.grad(fn(q, k, v), (q, k, v), do)  # compile / warm up outside the timings
            fwd = time_ms(lambda: fn(q, k, v), 5, args.rep_ms)
            o = fn(q, k, v)
            bwd = time_ms(lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True), 5, args.rep_ms)
            o = None
            fb = time_ms(lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), do), 5, args.rep_ms)
            peak, saved = peak_and_saved(fn, q, k, v, do)
            grads[m] = torch.autograd.grad(fn(q, k, v), (q, k, v), do)
            row[m] = {"fwd_ms": fwd, "bwd_ms": bwd, "fwdbwd_ms": fb, "peak_bytes": peak, "saved_by_fwd_bytes": saved}
        err, base = errors(grads, q, k, v, do)
        for m in METHODS:
            row[m]["max_error"] = err[m]
            row[m]["allowed"] = {x: 2 * base[x] + FLOOR[dt] for x in base}
            row[m]["ok"] = all(err[m][x] <= row[m]["allowed"][x] for x in base)
        row["baseline_error"] = base
        p = iomodel.Problem(n, n, d, batch=b, num_heads=h, dtype_bytes=q.element_size())
        cfg = ncu_io.configs_for(dict(batch=b, heads=h, seqlen=n, head_dim=d, dtype=args.dtype))
        cq, ckv = cfg["config_dq"], cfg["config_dkdv"]
        row["flashgen_configs"] = cfg
        row["model_hbm_bytes"] = {
            "stored-P bwd": iomodel.naive_backward(p).total_bytes,
            "flashgen bwd": iomodel.tiled_backward(p, cq["BLOCK_M"], cq["BLOCK_N"], ckv["BLOCK_M"],
                                                   ckv["BLOCK_N"]).total_bytes}
        results.append(row)
        q = k = v = do = grads = None
        torch.cuda.empty_cache()
        print(f"seqlen {n} done ({time.time() - t0:.0f} s)", flush=True)

    n = args.profile_seqlen
    g = torch.Generator(device="cuda").manual_seed(n)
    q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=dt, generator=g) for _ in range(4))
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    prof = {m: profile(method_fn(m), q, k, v, do) for m in METHODS}
    q = k = v = do = None
    torch.cuda.empty_cache()
    ncu = ncu_bytes(b, h, n, d, args.dtype) if args.ncu else None

    mib = 2 ** 20
    print(f"\nbackward experiment: batch {b}, heads {h}, head_dim {d}, {args.dtype}, "
          f"{torch.cuda.get_device_name()}; ms are medians (CUDA events)")
    print(f"{'seqlen':>6} {'method':>9} {'fwd ms':>8} {'bwd ms':>8} {'f+b ms':>8} {'peak MiB':>9} "
          f"{'saved MiB':>9} {'dQ err':>9} {'dK err':>9} {'dV err':>9}  within tolerance")
    for r in results:
        for m in METHODS:
            x = r[m]
            e = x["max_error"]
            print(f"{r['seqlen']:6d} {m:>9} {x['fwd_ms']:8.3f} {x['bwd_ms']:8.3f} {x['fwdbwd_ms']:8.3f} "
                  f"{x['peak_bytes'] / mib:9.0f} {x['saved_by_fwd_bytes'] / mib:9.0f} {e['dQ']:9.2e} "
                  f"{e['dK']:9.2e} {e['dV']:9.2e}  {'yes' if x['ok'] else 'NO'}")
        al = r["flashgen"]["allowed"]
        print(f"{'':6} {'allowed':>9} {'':53} {al['dQ']:9.2e} {al['dK']:9.2e} {al['dV']:9.2e}  "
              f"(2 x {args.dtype} reference error + {FLOOR[dt]:g})")
    fl = analytic_flops(b, h, n, d)
    print(f"\nat seqlen {n}: torch.profiler (with_flops) over one fwd+bwd, and the matmul FLOPs each method runs")
    for m in METHODS:
        pr = prof[m]
        print(f"  {m:9} profiler {pr['flops_total'] / 1e9:9.1f} GFLOP "
              f"({', '.join(f'{k} {v / 1e9:.1f}' for k, v in sorted(pr['flops_by_op'].items())) or 'no op it can count'}); "
              f"analytic fwd {fl[m]['fwd'] / 1e9:.1f} + bwd {fl[m]['bwd'] / 1e9:.1f} GFLOP; "
              f"ops allocated {pr['allocated_bytes_by_ops'] / mib:.0f} MiB")
    print("  (the profiler counts FLOPs of aten matmuls only: flashgen's Triton kernels show none)")
    if ncu:
        print(f"\nat seqlen {n}: DRAM bytes (Nsight Compute) vs the IO model")
        for name, x in ncu.items():
            print(f"  {name:14} measured {x['measured']['total_bytes'] / mib:9.1f} MiB   "
                  f"model {x['model_bytes'] / mib:9.1f} MiB")
    pay = payoff(results, seqlens)
    print(f"\nrecomputation pays for itself (flashgen fwd+bwd faster than stored-P) from seqlen: {pay}")
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": args.dtype,
           "batch": b, "heads": h, "head_dim": d, "results": results, "profile_seqlen": n, "profiler": prof,
           "analytic_flops": fl, "ncu": ncu, "payoff_seqlen": pay, "wall_s": time.time() - t0}
    args.out.write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()

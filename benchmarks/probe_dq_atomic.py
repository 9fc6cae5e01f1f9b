"""Probe (issue 4, backward): a single-pass backward whose dK/dV kernel also accumulates dQ
with float32 atomic adds (FlashAttention-2's schedule, Dao 2023, Algorithm 2; FA3 does the
same with TMA reduce-adds) against flashgen's two-pass backward (``bwd_dq`` recomputes P
and dP for its own dQ pass, then ``bwd_dkdv``).

Work per backward, in matmuls of 2 * seqlen_q * seqlen_k * head_dim FLOPs each: the two
passes do 7 (dQ pass: QK^T, dO V^T, dS K; dK/dV pass: QK^T, dO V^T, P^T dO, dS^T Q); the
single pass does 5, plus per (key block, query block) a float32 BLOCK_M x head_dim
reduce into L2, a zeroed float32 dQ buffer, a delta = rowsum(dO * O) pass and a
float32 -> dtype conversion (memory-bound, about 3-4 passes over a dQ-sized tensor).

For each shape it times (``bench.script_time_ms``: CUDA events, median, ms; the CPU
smoke's wall clock):
* ``two-pass``: ops.bwd with the tuned configs of tuning_db (dispatcher, as the op runs);
* ``atomic-<tma|ptr> <config>``: zero + delta + dK/dV-with-dQ + convert, for a list of
  dK/dV configs (``attn_bwd_dkdv.py.j2`` rendered with ``dq_atomic``).
Every variant's dQ, dK, dV are checked against a float64 reference on a slice of the
batch (FLOOR + 2x torch's bf16 error, as bench.py).  JSON to --out; table last.

    PYTHONPATH=$PWD python3 benchmarks/probe_dq_atomic.py --out probe.json      # GPU
    PYTHONPATH=$PWD python3 benchmarks/probe_dq_atomic.py --ptxas               # CPU: sm_90 registers/spills
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python3 benchmarks/probe_dq_atomic.py --smoke --out /tmp/p.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

CONFIGS = ("64:64:4:2:1", "32:64:4:2:1", "32:128:8:2:1", "64:128:8:2:1", "64:64:4:3:1", "32:64:4:3:1",
           "128:64:8:2:1", "64:64:4:1:1")
SHAPES = ("128:none:4:16:4096", "128:causal:4:16:4096", "128:none:8:16:2048", "64:none:4:32:4096",
          "64:causal:4:32:4096", "128:none:2:16:8192")


_DELTA = None


def _delta(o, do):
    """delta = rowsum(dO * O) in float32, shape (b, h, s): one pass over O and dO (the
    preprocessing kernel a single-pass backward needs; FlashAttention-2's
    ``_bwd_preprocess``)."""
    global _DELTA
    import torch
    import triton
    import triton.language as tl

    if _DELTA is None:
        @triton.jit
        def delta_kernel(O, DO, DELTA, n_rows, D: tl.constexpr, D_PAD: tl.constexpr, ROWS: tl.constexpr):
            r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
            c = tl.arange(0, D_PAD)
            m = (r < n_rows)[:, None] & (c < D)[None, :]
            x = tl.load(O + r[:, None] * D + c[None, :], mask=m, other=0.0).to(tl.float32)
            y = tl.load(DO + r[:, None] * D + c[None, :], mask=m, other=0.0).to(tl.float32)
            tl.store(DELTA + r, tl.sum(x * y, 1), mask=r < n_rows)
        _DELTA = delta_kernel
    b, h, s, d = o.shape
    out = torch.empty((b, h, s), dtype=torch.float32, device=o.device)
    n = b * h * s
    _DELTA[(triton.cdiv(n, 64),)](o.contiguous(), do.contiguous(), out, n, d, triton.next_power_of_2(d), 64)
    return out


def single_pass(mod, mode, do, q, k, v, o, lse, scale, mask, lo, hi, cfg):
    """dQ, dK, dV through the dK/dV kernel with dQ atomics."""
    import torch

    from flashgen import ops

    b, h, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    dpad = mod.D_PAD.value
    dqacc = torch.zeros((b * h, sq, dpad), dtype=torch.float32, device=q.device)
    delta = _delta(o, do)
    if mode == "tma":
        from triton.tools.tensor_descriptor import TensorDescriptor
        dq_arg = TensorDescriptor(dqacc, list(dqacc.shape), list(dqacc.stride()), [1, cfg.BLOCK_M, dpad])
    else:
        dq_arg = dqacc
    q_arg = ops._descriptor(q, cfg.BLOCK_M, dpad) if cfg.tma else q
    do_arg = ops._descriptor(do, cfg.BLOCK_M, mod.DV_PAD.value) if cfg.tma else do
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    nb = -(-sk // cfg.BLOCK_N)
    mod.attn_bwd_dkdv[(nb * b * hk,)](
        q_arg, k, v, do_arg, dk, dv, lse, delta, scale * ops.LOG2E, scale,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3], *dk.stride()[:3], *dv.stride()[:3],
        h, h // hk, sq, sk, nb, lo, hi, dq_arg,
        num_warps=mod.NUM_WARPS, num_stages=mod.NUM_STAGES)
    dq = (dqacc[..., :d] * scale).to(q.dtype).view(b, h, sq, d)
    return dq, dk, dv


def ptxas_table(configs, modes) -> int:
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from sm90_compile import _case, compile_sm90, ptxas_report

    print(f"{'d':>4} {'config':14} {'mode':5} {'regs':>5} {'spill B':>8} {'shared B':>9}")
    for c in configs:
        for d in (64, 128):
            for mode in ("", *modes):
                k = compile_sm90(_case(f"bwd_dkdv,bfloat16,{d},none,{c}"), launch_like=True,
                                 **({"dq_atomic": mode} if mode else {}))
                regs, spills = ptxas_report(k.asm["ptx"])
                print(f"{d:>4} {c:14} {mode or 'base':5} {regs!s:>5} {spills!s:>8} {k.metadata.shared:>9}", flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="JSON output path (required unless --ptxas)")
    ap.add_argument("--ptxas", action="store_true", help="no GPU: compile each config (base, tma, ptr) for sm_90 "
                    "and print ptxas registers / spill bytes / shared memory, d64 and d128")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes, float16")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="d:mask:batch:heads:seqlen, comma-separated")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="BLOCK_M:BLOCK_N:warps:stages:tma of dK/dV")
    ap.add_argument("--modes", default="tma,ptr")
    ap.add_argument("--budget-s", type=float, default=300.0)
    args = ap.parse_args(argv)
    if args.ptxas:
        return ptxas_table(args.configs.split(","), args.modes.split(","))
    if not args.out:
        ap.error("--out is required")
    import torch

    if not args.smoke and not torch.cuda.is_available():
        ap.error("no CUDA GPU: --smoke runs the CPU interpreter (tiny shapes), --ptxas the sm_90 compile")
    if args.smoke and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        ap.error("--smoke runs Triton's interpreter: set TRITON_INTERPRET=1")

    from flashgen import compile as _compile
    from flashgen import ops
    from flashgen.bench import compare, script_time_ms
    from flashgen.dispatch import default_dispatcher
    from flashgen.masks import mask_bounds
    from flashgen.spec import KernelSpec, ProblemKey, TileConfig, Variant

    t0 = time.time()
    dev = "cpu" if args.smoke else "cuda"
    dt = torch.float16 if args.smoke else torch.bfloat16
    dtn = "float16" if args.smoke else "bfloat16"
    shapes = ["64:none:1:2:80", "64:causal:1:2:80"] if args.smoke else args.shapes.split(",")
    configs = ["32:32:4:1:0", "32:32:4:1:1"] if args.smoke else args.configs.split(",")
    modes = args.modes.split(",")
    if args.smoke and "tma" in modes:
        # Triton's interpreter has no descriptor reduce-add (create_descriptor_reduce)
        modes.remove("tma")
        print("smoke: mode tma (TMA reduce-add) left out: Triton's interpreter cannot run it", flush=True)
    def bench(fn):
        return script_time_ms(fn, not args.smoke, 10, 40)
    rows = []
    out = dict(meta=dict(device=torch.cuda.get_device_name() if not args.smoke else "cpu",
                         torch=torch.__version__, argv=sys.argv[1:]), rows=rows)
    for sh in shapes:
        if time.time() - t0 > args.budget_s:
            print(f"budget: {sh} not run", flush=True)
            continue
        d, mask, b, h, s = sh.split(":")
        d, b, h, s = int(d), int(b), int(h), int(s)
        causal = mask == "causal"
        torch.manual_seed(0)
        q, k, v, do = (torch.randn(b, h, s, d, device=dev, dtype=dt) for _ in range(4))
        scale = 1.0 / math.sqrt(d)
        mode_m, lo, hi = mask_bounds(s, s, causal=causal, window=(-1, -1))
        key = lambda kern: ProblemKey.from_sizes(KernelSpec(kern, dtn, d, d, mode_m), batch=b, num_heads=h,
                                                num_kv_heads=h, seqlen_q=s, seqlen_k=s)
        disp = default_dispatcher()
        cf, cq, ck = (disp.config_for(key(kern)) for kern in ("fwd", "bwd_dq", "bwd_dkdv"))
        o, lse = ops.fwd(q, k, v, softmax_scale=scale, mask=mode_m, diag_lo=lo, diag_hi=hi, config=cf)
        # float64 reference on batch 0, heads 0..1 (bench.compare: FLOOR + 2x torch's error)
        sl = (slice(0, 1), slice(0, min(h, 2)))

        def check(dq, dk, dv):
            res = compare({"dQ": dq[sl], "dK": dk[sl], "dV": dv[sl]}, q[sl], k[sl], v[sl], do[sl],
                          mask=dict(causal=causal), softmax_scale=scale)
            return max(r[2] for r in res.values())

        fl = 2.5 * 4 * b * h * s * s * d * (0.5 if causal else 1.0)
        run2 = lambda: ops.bwd(do, q, k, v, o, lse, softmax_scale=scale, mask=mode_m, diag_lo=lo, diag_hi=hi,
                               config_dq=cq, config_dkdv=ck)
        ratio = check(*run2())
        ms = bench(run2)
        base = dict(shape=sh, method="two-pass", config=f"dq {cq.id} dkdv {ck.id}", ms=ms,
                    tflops=fl / ms / 1e9, ratio=ratio)
        rows.append(base)
        print(f"{sh:22} two-pass {base['config']:40} {ms:8.3f} ms {base['tflops']:6.1f} TF/s ratio {ratio:.3f}",
              flush=True)
        for c in configs:
            for mode in modes:
                cfg = TileConfig(*map(int, c.split(":")))
                var = Variant(KernelSpec("bwd_dkdv", dtn, d, d, mode_m), cfg)
                r = dict(shape=sh, method=f"atomic-{mode}", config=cfg.id)
                try:
                    mod = _compile.load_mode(var, f"_dqa_{mode}", dq_atomic=mode)
                    run1 = lambda: single_pass(mod, mode, do, q, k, v, o, lse, scale, mode_m, lo, hi, cfg)
                    r["ratio"] = check(*run1())
                    r["ms"] = bench(run1)
                    r["tflops"] = fl / r["ms"] / 1e9
                    r["speedup"] = base["ms"] / r["ms"]
                    print(f"{sh:22} atomic-{mode} {cfg.id:36} {r['ms']:8.3f} ms {r['tflops']:6.1f} TF/s "
                          f"ratio {r['ratio']:.3f} x{r['speedup']:.3f}", flush=True)
                except Exception as e:  # noqa: BLE001 - a failing variant is a result
                    r["error"] = f"{type(e).__name__}: {e}"[:400]
                    print(f"{sh:22} atomic-{mode} {cfg.id:36} FAIL {r['error'][:200]}", flush=True)
                    traceback.print_exc(limit=2)
                rows.append(r)
                with open(args.out, "w") as f:
                    json.dump(out, f, indent=1)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print("\nshape                  two-pass ms   best atomic (config)                      ms   speedup  ratio")
    for sh in shapes:
        b2 = [r for r in rows if r["shape"] == sh and r["method"] == "two-pass"]
        a = [r for r in rows if r["shape"] == sh and r["method"] != "two-pass" and "ms" in r]
        if not b2 or not a:
            continue
        best = min(a, key=lambda r: r["ms"])
        print(f"{sh:22} {b2[0]['ms']:10.3f}   {best['method'] + ' ' + best['config']:40} {best['ms']:8.3f}  "
              f"{best['speedup']:6.3f}  {best['ratio']:.3f}")
    bad = [r for r in rows if r.get("ratio", 0) > 1 or "error" in r]
    print(f"{len(rows)} rows, {len(bad)} failed or over tolerance")
    return 0


if __name__ == "__main__":
    sys.exit(main())

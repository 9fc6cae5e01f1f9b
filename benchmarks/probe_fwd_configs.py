"""Probe (issue 4, forward): forward tile configs outside the tuning domain (e.g. BLOCK_M
256 at 16 warps) against the tuned forward and SDPA's cuDNN backend, in one run.

Adding configs to ``space.configs("fwd")`` changes every forward row's code hash (the
hash covers the whole domain: ``render.probe_variants``) and so needs a re-tune; this
script measures whether they are worth it first.  For each shape (bf16 on the GPU) it
times (``bench.script_time_ms``: median ms, warmed up, L2 flushed) ``ops.fwd`` with the
dispatcher's tuned config, ``ops.fwd`` with each probed config, and SDPA cuDNN; every
flashgen config's O and LSE are first checked against the float64 reference on a slice
(batch 0, two heads; ``bench.compare``: FLOOR + 2x torch's error, ratio <= 1 passes).
Before any compile, each config's shared memory is checked against the device limit
(``resources.estimate``); an infeasible one is reported, not compiled.  JSON to --out
(rewritten after every shape); a short table last.

    PYTHONPATH=$PWD python3 benchmarks/probe_fwd_configs.py --out fwd_probe.json          # GPU
    PYTHONPATH=$PWD python3 benchmarks/probe_fwd_configs.py --configs "" --pipe-qk tuned,64:128:4:2:1 --out p.json
    PYTHONPATH=$PWD python3 benchmarks/probe_fwd_configs.py --smoke --out /tmp/f.json      # CPU interpreter
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

CONFIGS = ("256:64:16:2:1", "256:128:16:2:1", "256:32:16:3:1", "256:64:8:2:1", "128:128:8:2:1")
SHAPES = ("128:none:8:16:2048", "128:none:2:16:8192", "128:causal:4:16:4096", "64:none:8:32:2048",
          "64:none:2:32:8192", "64:causal:4:32:4096")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON output path")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes, float16, wall-clock timing")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="head_dim:mask:batch:heads:seqlen, comma-separated")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="BLOCK_M:BLOCK_N:num_warps:num_stages:tma, "
                    "comma-separated")
    ap.add_argument("--pipe-qk", default="", help="also run these BLOCK_M:BLOCK_N:num_warps:num_stages:tma configs "
                    "(tma) rendered with the template's pipe_qk probe mode (tile j+1's QK^T issued before tile "
                    "j's softmax), comma-separated; 'tuned' is the dispatcher's config")
    ap.add_argument("--budget-s", type=float, default=240.0, help="no shape starts after this many seconds")
    args = ap.parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported: the kernels run in its interpreter
    import torch

    if not args.smoke and not torch.cuda.is_available():
        ap.error("no CUDA GPU: --smoke runs Triton's CPU interpreter (tiny shapes)")

    from flashgen import compile as _compile
    from flashgen import ops, resources
    from flashgen.arch import current
    from flashgen.bench import compare, script_time_ms
    from flashgen.dispatch import default_dispatcher
    from flashgen.masks import mask_bounds
    from flashgen.spec import KernelSpec, ProblemKey, TileConfig, Variant, attention_flops

    t0 = time.time()
    dev = "cpu" if args.smoke else "cuda"
    dt, dtn = (torch.float16, "float16") if args.smoke else (torch.bfloat16, "bfloat16")
    shapes = ["32:none:1:2:64", "32:causal:1:2:80"] if args.smoke else args.shapes.split(",")
    configs = ["32:16:4:1:0", "64:32:4:1:0"] if args.smoke else [c for c in args.configs.split(",") if c]
    def bench(fn):
        return script_time_ms(fn, not args.smoke, 25, 100)
    arch = current()
    rows = []
    out = dict(meta=dict(device=arch.name, torch=torch.__version__, argv=sys.argv[1:]), rows=rows)
    for sh in shapes:
        if time.time() - t0 > args.budget_s:
            rows.append(dict(shape=sh, skipped=f"time budget ({args.budget_s:.0f} s)"))
            continue
        d, mask, b, h, s = sh.split(":")
        d, b, h, s = int(d), int(b), int(h), int(s)
        causal = mask == "causal"
        g = torch.Generator(device=dev).manual_seed(0)
        q, k, v = (torch.randn(b, h, s, d, device=dev, dtype=dt, generator=g) for _ in range(3))
        scale = 1.0 / math.sqrt(d)
        mode, lo, hi = mask_bounds(s, s, causal=causal, window=(-1, -1))
        spec = KernelSpec("fwd", dtn, d, d, mode)
        tuned = default_dispatcher().config_for(ProblemKey.from_sizes(spec, batch=b, num_heads=h, num_kv_heads=h,
                                                                      seqlen_q=s, seqlen_k=s))
        flops = attention_flops(b, h, s, s, d, causal=causal)
        sl = (slice(0, 1), slice(0, min(h, 2)))
        cands = [("tuned", tuned)] + [("probe", TileConfig(*map(int, c.split(":")))) for c in configs]
        pipe = ["32:16:4:1:1", "64:32:4:2:1"] if args.smoke and args.pipe_qk else \
            [c for c in args.pipe_qk.split(",") if c]
        cands += [("pipe_qk", tuned if c == "tuned" else TileConfig(*map(int, c.split(":")))) for c in pipe]
        for kind, cfg in cands:
            r = dict(shape=sh, kind=kind, config=cfg.id)
            try:
                est = resources.estimate(Variant(spec, cfg), arch)
                if not est.feasible:
                    r["infeasible"] = est.breakdown()
                    rows.append(r)
                    print(f"{sh:22} {kind:5} {cfg.id:24} infeasible: {r['infeasible']}", flush=True)
                    continue

                if kind == "pipe_qk":
                    if not cfg.tma:
                        raise ValueError(f"--pipe-qk {cfg.id}: the pipe_qk mode needs a tma config")
                    mod = _compile.load_mode(Variant(spec, cfg), "_pipe_qk", pipe_qk=True)

                    def run(cfg=cfg, mod=mod):
                        return ops.fwd(q, k, v, softmax_scale=scale, mask=mode, diag_lo=lo, diag_hi=hi, config=cfg,
                                       module=mod)
                else:
                    def run(cfg=cfg):
                        return ops.fwd(q, k, v, softmax_scale=scale, mask=mode, diag_lo=lo, diag_hi=hi, config=cfg)
                o, lse = run()
                res = compare({"O": o[sl], "LSE": lse[sl]}, q[sl], k[sl], v[sl], None, mask=dict(causal=causal),
                              softmax_scale=scale)
                r["ratio"] = max(x[2] for x in res.values())
                r["ms"] = bench(run)
                r["tflops"] = flops / r["ms"] / 1e9
                print(f"{sh:22} {kind:5} {cfg.id:24} {r['ms']:8.3f} ms {r['tflops']:6.1f} TF/s ratio {r['ratio']:.3f}",
                      flush=True)
            except Exception as e:  # noqa: BLE001 - a failing config is a result
                r["error"] = f"{type(e).__name__}: {e}"[:400]
                print(f"{sh:22} {kind:5} {cfg.id:24} FAIL {r['error'][:200]}", flush=True)
                traceback.print_exc(limit=2)
            rows.append(r)
        if not args.smoke:
            from flashgen import peers
            r = dict(shape=sh, kind="sdpa-cudnn", config="")
            try:
                fn = peers.sdpa("sdpa-cudnn", q, k, causal=causal)
                fn(q, k, v)
                r["ms"] = bench(lambda: fn(q, k, v))
                r["tflops"] = flops / r["ms"] / 1e9
            except Exception as e:  # noqa: BLE001
                r["error"] = f"{type(e).__name__}: {e}"[:400]
            rows.append(r)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print("\nshape                  tuned (config)                       probe best (config)                  "
          "cuDNN   best/tuned  best/cuDNN")
    for sh in shapes:
        rs = [r for r in rows if r.get("shape") == sh and "ms" in r]
        t = next((r for r in rs if r["kind"] == "tuned"), None)
        p = [r for r in rs if r["kind"] in ("probe", "pipe_qk")]
        c = next((r for r in rs if r["kind"] == "sdpa-cudnn"), None)
        if not t or not p:
            continue
        best = max(p, key=lambda r: r["tflops"])
        tag = ("pipe " if best["kind"] == "pipe_qk" else "") + best["config"]
        print(f"{sh:22} {t['tflops']:6.1f} ({t['config']:24}) {best['tflops']:6.1f} ({tag:24}) "
              f"{(c or {}).get('tflops', float('nan')):6.1f}   {best['tflops'] / t['tflops']:6.3f}     "
              f"{best['tflops'] / c['tflops'] if c else float('nan'):6.3f}")
    bad = [r for r in rows if r.get("ratio", 0) > 1 or ("error" in r and r.get("kind") != "sdpa-cudnn")]
    print(f"{len(rows)} rows; {len(bad)} flashgen configs failed or over tolerance")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

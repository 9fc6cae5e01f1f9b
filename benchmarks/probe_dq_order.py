"""Where the ordered dQ's time goes (the deterministic Gluon backward, dq_mode "ordered"):
the main kernel of each default tile timed four ways at the shapes of the deterministic
run (bf16, multi-head): dQ by the unordered TMA reduce-add on its 2-D grid ("tma"), by
the ordered adds ("ordered"), the ordered variant without the wait on its predecessor's
semaphore ("no_poll") and without the releases too ("no_sync": the ordered variant's 1-D
grid and its per-step wait for the previous reduce-add, nothing ordered).  The probes'
dQ is not ordered (no_poll's and no_sync's results are not checked: they are timings
only); the ordered and tma variants were checked against float64 by
``benchmarks/gluon_bwd.py --ordered``.  So: ordered - no_poll is the polling,
no_poll - no_sync the releases, no_sync - tma the 1-D grid and the per-step wait.

    PYTHONPATH=. python3 benchmarks/probe_dq_order.py --out probe_dq_order.json

Prints a table last (ms of the main kernel, CUDA events, median, semaphores zeroed
before each launch as the launcher does).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

#: (GluonBwdConfig fields without dq_mode, head_dim): the default tiles of the ordered run.
TILES = [((64, 64, 2, 2), (240, 24, "tma", 1, False), 128), ((64, 64, 2, 4), (240, 24, "tma", 1, True), 64)]
#: (batch, num_heads, seqlen, head_dim, causal).
SHAPES = [(4, 16, 4096, 128, False), (1, 16, 16384, 128, True), (4, 16, 4096, 128, True),
          (8, 32, 2048, 64, False), (4, 32, 4096, 64, True)]
WAYS = (("tma", ""), ("ordered", ""), ("ordered", "no_poll"), ("ordered", "no_sync"), ("ordered", "one_thread"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import torch
    import triton.testing

    from flashgen.families.gluon import bwd as B
    from flashgen.masks import mask_bounds

    rows = []
    for head, tail, d in TILES:
        for b, h, s, dd, causal in SHAPES:
            if dd != d:
                continue
            dt = torch.bfloat16
            q, k, v, do, o = (torch.randn(b, h, s, d, device="cuda", dtype=dt) for _ in range(5))
            lse = torch.randn(b, h, s, device="cuda", dtype=torch.float32).abs() + 5.0
            mode, lo, hi = mask_bounds(s, s, causal=causal, window=(-1, -1))
            row = {"shape": [b, h, s, d, causal]}
            for dq_mode, probe in WAYS:
                name = probe or dq_mode
                try:
                    cfg = B.GluonBwdConfig(*head, dq_mode, *tail)
                    mod = B.load(cfg, "bfloat16", d, mode, probe=probe)
                    args = B.launch_args(do, q, k, v, o, lse, softmax_scale=d ** -0.5, diag_lo=lo, diag_hi=hi,
                                         config=cfg)
                    grid, pargs = args["preprocess"]
                    mod.attn_bwd_preprocess[grid](*pargs, num_warps=4)
                    grid, margs = args["main"]
                    sem = args.get("sem")

                    def run():
                        if sem is not None:
                            sem.zero_()
                        mod.attn_bwd[grid](*margs, num_warps=cfg.num_warps, maxnreg=cfg.maxnreg)
                    run()
                    torch.cuda.synchronize()
                    row[name] = float(triton.testing.do_bench(run, warmup=10, rep=60, return_mode="median"))
                except Exception as e:  # noqa: BLE001 - a failure is reported in its cell
                    row[name] = None
                    row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(json.dumps(row), flush=True)
            rows.append(row)
            Path(a.out).write_text(json.dumps(rows, indent=1))
    print(f"\n{'b,h,s,d,causal':24s} " + " ".join(f"{(p or m):>9s}" for m, p in WAYS) + "   ordered/tma")
    for r in rows:
        cells = [r.get(p or m) for m, p in WAYS]
        ratio = f"{r['ordered'] / r['tma']:.3f}" if r.get("ordered") and r.get("tma") else "-"
        print(f"{str(r['shape']):24s} " + " ".join(f"{c:9.4f}" if c else f"{'-':>9s}" for c in cells)
              + f"   {ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How many (batch, kv head) pairs the ordered (deterministic) backward should interleave
(HEAD_GROUP, :func:`flashgen.families.gluon.bwd.ordered_head_group`).

For each shape, the dispatcher's ``deterministic=True`` row (a Gluon ordered backward;
shapes served by the Triton family's two kernels are skipped) is timed with HEAD_GROUP
set to every power of two up to the number of pairs, to the launcher's rule and to the
earlier rule (:func:`earlier_rule`: twice the SMs over the steps per program, rounded
up), through ``bwd.attention_bwd`` (launch plans cleared for each value; CUDA events,
median, L2 flushed).  The order of the adds into each dQ tile does not depend on the
interleave, so the gradients of every value are compared bitwise with the first one's.
Random inputs: timing and that comparison only.

    PYTHONPATH=. python3 benchmarks/probe_head_group.py --out hg_probe.json [--shape B,H,HKV,S,D[,causal]]...

``--shape`` (repeatable) replaces the default shapes.  Prints per shape the pairs, both rules' values and times, and the best value last.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

#: (batch, num_heads, num_kv_heads, seqlen, head_dim, causal): the dense grid's shapes
#: and the Llama-3-8B ones (GQA, causal).
SHAPES = ([(b, 16, 16, s, 128, c) for c in (True, False)
           for b, s in ((32, 512), (16, 1024), (8, 2048), (4, 4096), (2, 8192), (1, 16384))]
          + [(b, 32, 32, s, 64, c) for c in (True, False) for b, s in ((8, 2048), (4, 4096), (1, 16384))]
          + [(b, 32, 8, s, 128, True)
             for b, s in ((1, 2048), (8, 2048), (2, 4096), (4, 4096), (1, 8192), (4, 8192), (8, 8192), (4, 1024))])


def parse_shape(spec: str) -> tuple:
    """(batch, num_heads, num_kv_heads, seqlen, head_dim, causal) from "B,H,HKV,S,D[,causal]"."""
    parts = spec.split(",")
    if len(parts) not in (5, 6) or (len(parts) == 6 and parts[5] != "causal"):
        raise argparse.ArgumentTypeError(f"--shape {spec!r}: B,H,HKV,S,D or B,H,HKV,S,D,causal")
    try:
        b, h, hk, s, d = (int(x) for x in parts[:5])
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shape {spec!r}: B, H, HKV, S and D are integers") from None
    if min(b, h, hk, s, d) < 1 or h % hk:
        raise argparse.ArgumentTypeError(f"--shape {spec!r}: positive sizes, H a multiple of HKV")
    return b, h, hk, s, d, len(parts) == 6


def earlier_rule(config, pairs: int, seqlen_q: int, group: int, *, mask: bool, sm_count: int) -> int:
    """HEAD_GROUP as the launcher chose it before: 2 * parts * SMs / steps, rounded up,
    at most the pairs (not a divisor of them in general)."""
    from flashgen.families.gluon.bwd import ordered_steps

    steps = ordered_steps(config, seqlen_q, group, mask=mask)
    return max(1, min(pairs, math.ceil(2 * config.parts * sm_count / steps)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="hg_probe.json")
    ap.add_argument("--shape", action="append", type=parse_shape, default=None,
                    help="B,H,HKV,S,D[,causal] (repeatable; replaces the default shapes)")
    a = ap.parse_args()
    import torch
    import triton.testing

    from flashgen import library
    from flashgen.families.gluon import bwd as B
    from flashgen.families.gluon.family import bwd_config
    from flashgen.masks import mask_bounds

    rule = B.ordered_head_group
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for (b, h, hk, s, d, causal) in a.shape or SHAPES:
        q, do, o = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        k, v = (torch.randn(b, hk, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        lse = torch.randn(b, h, s, device="cuda", dtype=torch.float32).abs() + 5.0
        mode, lo, hi = mask_bounds(s, s, causal=causal, window=(-1, -1))
        cfg, _ = library.backward_kernels(q, k, v, mode, "", True)
        if getattr(cfg, "family", None) != "gluon":
            print("skipped (the two Triton kernels serve it):", (b, h, hk, s, d, causal))
            continue
        g = bwd_config(cfg)
        pairs, group = b * hk * g.group_split, h // hk // g.group_split
        now = rule(g, pairs, s, group, mask=causal, sm_count=sms, seqlen_k=s)
        before = earlier_rule(g, pairs, s, group, mask=causal, sm_count=sms)
        times, ref = {}, None
        try:
            for hg in sorted({now, before, pairs} | {1 << i for i in range(16) if (1 << i) <= pairs}):
                B.ordered_head_group = lambda *args, _hg=hg, **kw: _hg
                B._PLANS.clear()
                fn = lambda: B.attention_bwd(do, q, k, v, o, lse, softmax_scale=d ** -0.5,  # noqa: E731
                                             diag_lo=lo, diag_hi=hi, mask=mode, config=g)
                got = fn()
                torch.cuda.synchronize()
                same = None if ref is None else all(torch.equal(x, y) for x, y in zip(got, ref))
                ref = ref or [t.clone() for t in got]
                times[hg] = (float(triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median")), same)
        finally:
            B.ordered_head_group = rule
            B._PLANS.clear()
        rows.append({"shape": [b, h, hk, s, d, causal], "config": g.id, "pairs": pairs, "rule": now,
                     "earlier_rule": before, "ms": {str(x): t for x, t in times.items()}})
        print(json.dumps(rows[-1]), flush=True)
        Path(a.out).write_text(json.dumps(rows, indent=1))
    print("\nshape (b, h, hk, s, d, causal) | pairs | rule: HEAD_GROUP ms | earlier rule | best | gradients equal")
    for r in rows:
        ms = {int(x): t[0] for x, t in r["ms"].items()}
        best = min(ms, key=ms.get)
        print(r["shape"], f"| {r['pairs']} | {r['rule']}: {ms[r['rule']]:.4f} | {r['earlier_rule']}: "
              f"{ms[r['earlier_rule']]:.4f} | {best}: {ms[best]:.4f} |",
              all(t[1] in (None, True) for t in r["ms"].values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The deterministic backward, checked on the GPU: with ``deterministic=True`` (or
``torch.use_deterministic_algorithms(True)``) repeated backward passes give bitwise
identical dQ, dK and dV; the default backward (on sm_90 the Gluon whole backward where it
serves, dQ accumulated by reduce-add) is checked against the float64 reference and its
run-to-run difference reported.  Also times both backwards (CUDA events, median).

Usage (repository root, on a CUDA GPU):
    python3 benchmarks/determinism.py [--out FILE.json]
Exit status 1 when a deterministic backward differs between runs or a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = ((2, 16, 16, 2048, 128, False), (2, 16, 16, 2048, 128, True), (2, 32, 8, 1000, 128, True),
          (4, 32, 32, 2048, 64, True), (4, 32, 32, 1024, 64, False))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="JSON file for every number")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import torch
    import triton.testing

    import flashgen
    from flashgen import reference
    from flashgen.bench import FLOOR

    ok = True
    rows = []
    for b, h, hk, n, d, causal in SHAPES:
        torch.manual_seed(1)
        q, k, v = (torch.randn(b, x, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for x in (h, hk, hk))
        do = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)
        row = {"shape": [b, h, hk, n, d], "causal": causal}
        exp = flashgen.explain(q, k, v, causal=causal)
        row["default_backward"] = str(exp.backward).split(";")[0] if exp.backward is not None else ""
        gref = [g.double() for g in reference.backward(do, q.detach(), k.detach(), v.detach(), causal=causal)]
        # the same computation in bf16 through torch (the exactness rule's baseline)
        qb, kb, vb = (t.detach().clone().requires_grad_() for t in (q, k, v))
        torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=causal,
                                                         enable_gqa=hk != h).backward(do)
        base = [(t.grad.double() - g).abs().max().item() for t, g in zip((qb, kb, vb), gref)]
        for det in (True, False):
            grads = []
            for _ in range(args.repeats):
                for t in (q, k, v):
                    t.grad = None
                flashgen.attention(q, k, v, causal=causal, deterministic=det).backward(do)
                grads.append([t.grad.clone() for t in (q, k, v)])
            same = all(torch.equal(a, c) for g in grads[1:] for a, c in zip(grads[0], g))
            diff = max((a.double() - c.double()).abs().max().item() for g in grads[1:] for a, c in zip(grads[0], g))
            ratio = max((g.double() - r).abs().max().item() / (2 * e + FLOOR[torch.bfloat16])
                        for g, r, e in zip(grads[0], gref, base))
            o = flashgen.attention(q, k, v, causal=causal, deterministic=det)
            ms = triton.testing.do_bench(lambda: o.backward(do, retain_graph=True), warmup=25, rep=100,
                                         return_mode="median")
            tag = "det" if det else "default"
            row.update({f"{tag}_bitwise_repeatable": same, f"{tag}_max_run_diff": diff,
                        f"{tag}_err_ratio": round(ratio, 3), f"{tag}_bwd_ms": round(ms, 4)})
            if (det and not same) or ratio > 1:
                ok = False
        rows.append(row)
        del q, k, v
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    print("shape (b,h,hkv,n,d) causal | default backward | deterministic: repeatable, err ratio, bwd ms | "
          "default: repeatable, max run diff, err ratio, bwd ms")
    for r in rows:
        print(f"{tuple(r['shape'])} {r['causal']} | {r['default_backward']} | {r['det_bitwise_repeatable']}, "
              f"{r['det_err_ratio']}, {r['det_bwd_ms']} | {r['default_bitwise_repeatable']}, "
              f"{r['default_max_run_diff']:.3g}, {r['default_err_ratio']}, {r['default_bwd_ms']}")
    print("ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

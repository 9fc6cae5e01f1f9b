"""Probe (issue 19): where the T5 relative-position forward's time goes.  The example's
score function ``score + table[t5_bucket(kv_idx - q_idx), h]`` computes the bucket per
score element (integer and float arithmetic, a log; int64 where T5 writes ``.long()``)
and gathers the (32, heads) table per element.  This times the forward of score functions
that keep one part of it at a time, at the same sizes and default tiles (no tuned rows:
each function is its own variant), against the plain forward:

* ``plain``: no score function;
* ``t5``: the example;
* ``t5-int32``: the same bucket written with int32 casts instead of int64 (``.long()``);
* ``bucket-no-table``: the bucket's arithmetic, added as a float (no gather);
* ``table-cheap-index``: the gather at ``(kv_idx - q_idx) & 31`` (no bucket arithmetic);
* ``per-distance``: a (2 seqlen - 1, heads) table of the biases per distance, gathered at
  ``kv_idx - q_idx + seqlen - 1`` (what precomputing the bucket once per distance leaves
  in the kernel).

Every variant's output is checked against the float64 reference of its own function on
one batch entry (``bench`` rule: error <= 2x torch's error at the dtype + floor) before
it is timed (``triton.testing.do_bench``, median).  JSON to --out; table last.

    PYTHONPATH=$PWD python3 benchmarks/probe_user_costs.py --out probe_user_costs.json      # GPU
    PYTHONPATH=$PWD python3 benchmarks/probe_user_costs.py --smoke                          # CPU interpreter
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def variants(table, dist, seqlen: int) -> dict:
    """name -> score_mod (None: the plain forward)."""
    import torch

    from flashgen.user_examples import t5_bucket

    return {
        "plain": None,
        "t5": lambda score, b, h, q_idx, kv_idx: score + table[t5_bucket(kv_idx - q_idx), h],
        "t5-int32": lambda score, b, h, q_idx, kv_idx: score + table[t5_bucket(kv_idx - q_idx, dtype=torch.int32), h],
        "bucket-no-table": lambda score, b, h, q_idx, kv_idx: score + t5_bucket(kv_idx - q_idx).float() * 0.01,
        "table-cheap-index": lambda score, b, h, q_idx, kv_idx: score + table[(kv_idx - q_idx) & 31, h],
        "per-distance": lambda score, b, h, q_idx, kv_idx: score + dist[kv_idx - q_idx + (seqlen - 1), h],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter run at a tiny size")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    import flashgen
    from flashgen import bench, user_mods
    from flashgen.user_examples import t5_bucket

    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --smoke for the CPU (interpreter) run", file=sys.stderr)
        return 2
    dtype = torch.float16 if args.smoke else torch.bfloat16
    b, h, s, d = (1, 2, 48, 16) if args.smoke else (args.batch, args.heads, args.seqlen, args.head_dim)
    g = torch.Generator(device="cpu").manual_seed(0)
    table = (torch.randn(32, h, generator=g) * 0.5).to(device)
    rel = torch.arange(-(s - 1), s, device=device)
    dist = table[t5_bucket(rel)].contiguous()  # (2 s - 1, h): the bias per distance kv - q
    q, k, v = (torch.randn(b, h, s, d, generator=g).to(device=device, dtype=dtype) for _ in range(3))
    scale = d ** -0.5
    lo, hi = -(s - 1), s - 1
    rows, failed = {}, False
    out = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
           "torch": torch.__version__, "sizes": dict(batch=b, heads=h, seqlen=s, head_dim=d, dtype=str(dtype)),
           "rows": rows}
    for name, fn in variants(table, dist, s).items():
        row = rows[name] = {}
        try:
            with torch.no_grad():
                got = flashgen.attention(q[:1], k[:1], v[:1], score_mod=fn)
                ref = user_mods.reference(q[:1], k[:1], v[:1], scale, lo, hi, score_mod=fn)[0]
                base = user_mods.reference(q[:1], k[:1], v[:1], scale, lo, hi, score_mod=fn, dtype=dtype)[0]
                row["check_ratio"] = bench._ratios({"O": got}, {"O": (ref, base)}, dtype)["O"][2]
                if not row["check_ratio"] <= 1:
                    raise RuntimeError(f"float64 check failed: ratio {row['check_ratio']:.3g}")

                def fwd(fn=fn):
                    return flashgen.attention(q, k, v, score_mod=fn)

                if device == "cuda":
                    import triton.testing

                    fwd()
                    row["fwd_ms"] = float(triton.testing.do_bench(fwd, warmup=50, rep=200, return_mode="median"))
                else:
                    t0 = time.perf_counter()
                    fwd()
                    row["fwd_ms"] = (time.perf_counter() - t0) * 1e3
        except Exception as e:  # noqa: BLE001 (a failing variant is recorded, the run goes on)
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            failed = True
        if args.out:  # after every variant: a stopped run keeps what it measured
            with open(args.out, "w") as fh:
                json.dump(out, fh, indent=1)
    plain = rows.get("plain", {}).get("fwd_ms")
    print(f"{out['device']}; b{b} h{h} s{s} d{d} {dtype}, non-causal forward, default tiles")
    print(f"{'variant':20} {'check':>6} {'fwd ms':>9} {'- plain ms':>10}")
    for name, r in rows.items():
        if "error" in r:
            print(f"{name:20} error  {r['error'][:90]}")
            continue
        extra = "" if plain is None else f"{r['fwd_ms'] - plain:10.3f}"
        print(f"{name:20} {r['check_ratio']:6.2f} {r['fwd_ms']:9.3f} {extra}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

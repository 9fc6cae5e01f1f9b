"""The Gluon varlen forward's two program layouts on the H200 (one slot per query block
of the longest sequence, and the packed layout of ``GluonFwdSpec.varlen_packed``): the
same tiles timed on the same ragged batches, beside the Triton family's choice.

Problems: ``benchmarks/varlen_bench.py``'s (16k tokens; head_dim 128 and 64, 16 heads,
documents of mean 512, mean 2048, and the skewed ``mix``: one in ten long, the rest
short; causal and not), 290 documents of 16-96 tokens (head_dim 128, 16 heads) and the
``varlen-docs`` preset's (32/8 heads, head_dim 128).
Tiles: each head dim and mask's Gluon default and, at head_dim 128, the one-consumer
tile two to an SM (``x1n64x2``) that the tuned short-document rows take; ``triton``:
the dispatcher's choice with ``FLASHGEN_FAMILIES=triton``.  The kernels are launched
directly (``triton.testing.do_bench``, median ms, L2 flushed); the first launch of each
is checked against float64 (ratio <= 1 passes; documents of up to 4096 tokens).

    PYTHONPATH=. python3 benchmarks/probe_varlen_grid.py --layouts --out DIR      # GPU

``--layouts``: each Gluon tile in both layouts (``VARLEN_PACKED_FRACTION`` forced to
never and to always packed: :func:`flashgen.families.gluon.launch.varlen_slots`), back
to back in one process.  Without it each tile runs in the layout the launcher picks, and
``--label`` names the run; ``--compare A.json B.json`` prints two runs side by side (two
source trees, say: ``docs/results/h200/varlen-gluon/packed/`` compares the per-block
layout with the packed one, each run alone in its own process).  ``--only`` keeps the
problems whose names hold one of its comma-separated substrings.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _problems():
    import gluon_varlen as gv
    import varlen_bench as vb
    from flashgen import bench

    out = []
    for p in vb.problems(False):
        heads = p["num_heads"], p["num_kv_heads"]
        out.append((vb.label(p), p["head_dim"], "causal" if p["causal"] else "none", heads, vb.doc_lengths(p["dist"])))
    # many short documents: the programs' search for their sequence crosses chunks of 128
    import random

    rng = random.Random("short")
    short = [rng.randint(16, 96) for _ in range(290)]
    for mask in ("none", "causal"):
        out.append((f"short{len(short)} d128 h16{' causal' if mask == 'causal' else ''}", 128, mask, (16, 16), short))
    for tag, n_docs, longest, mask in gv.PROBLEMS:
        out.append((f"varlen-docs {tag} d128 32/8{' causal' if mask == 'causal' else ''}", 128, mask, (32, 8),
                    bench.varlen_lengths(n_docs, longest)))
    return out


def run(label: str, rep_ms: float, layouts: bool = False, only: list[str] | None = None) -> list[dict]:
    import torch
    import triton

    import gluon_varlen as gv
    import varlen_bench as vb
    from flashgen import bench, families, library
    from flashgen.families.gluon import launch as glaunch
    from flashgen.spec import KernelSpec

    x1n64x2 = next(kw for name, d, mask, kw in gv.VARIANTS if name == "x1n64x2")
    rows = []
    default_fraction = glaunch.VARLEN_PACKED_FRACTION
    for name, d, mask, (h, hk), lens in _problems():
        if only and not any(o in name for o in only):
            continue
        spec = KernelSpec("fwd_varlen", "bfloat16", d, d, mask)
        q, k, v, do, cu_q, cu_k, mq, mk = bench.make_varlen_inputs(spec, lens, lens, h, hk, seed=5)
        kw = bench._varlen_mask_kw(spec, dict(causal=mask == "causal", window=(-1, -1)))
        flops = vb.fwd_flops(lens, h, d, d, mask == "causal")
        tiles = [("default", gv._tile("default", d, mask, None))]
        if d == 128:
            tiles.append(("x1n64x2", gv._tile("x1n64x2", d, mask, x1n64x2)))
        os.environ["FLASHGEN_FAMILIES"] = "triton"
        cfg_t, _ = library.varlen_kernel_for("fwd_varlen", q, k, v, mask, len(lens), mq, mk)
        os.environ.pop("FLASHGEN_FAMILIES")
        tiles.append(("triton", cfg_t))
        if layouts:  # each Gluon tile in both grid layouts, timed back to back in this process
            tiles = [(f"{tag} {lay}", cfg, frac) for tag, cfg in tiles if cfg.family == "gluon"
                     for lay, frac in (("per-sequence", 0.0), ("packed", 1e9))] + [("triton", cfg_t, None)]
        else:
            tiles = [(tag, cfg, None) for tag, cfg in tiles]
        for tag, cfg, frac in tiles:
            launch = families.launcher(cfg.family, "fwd_varlen")
            if frac is not None:
                glaunch.VARLEN_PACKED_FRACTION = frac
            row = dict(label=label, problem=name, tile=tag, config=cfg.id, docs=len(lens), longest=max(lens))
            try:
                o, lse = launch(q, k, v, cu_q, cu_k, mq, mk, config=cfg, **kw)
                torch.cuda.synchronize()
                res = bench.compare_varlen({"O": o, "LSE": lse}, q, k, v, do, cu_q, cu_k, kw=kw) \
                    if max(lens) <= 4096 else {}
                row["ratio"] = max((r[2] for r in res.values()), default=None)
                row["ms"] = triton.testing.do_bench(
                    lambda: launch(q, k, v, cu_q, cu_k, mq, mk, config=cfg, out=o, lse=lse, **kw), rep=rep_ms)
                row["tflops"] = flops / row["ms"] * 1e-9
            except Exception as e:  # noqa: BLE001 - reported in the table
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            if frac is not None:
                glaunch.VARLEN_PACKED_FRACTION = default_fraction
            rows.append(row)
            r = row.get("ratio")
            print(f"| {label} | {name} | {tag} | {row.get('ms', float('nan')):.4f} | {row.get('tflops', 0):.0f} | "
                  f"{'-' if r is None else f'{r:.3f}'} | {row.get('error', '')} |", flush=True)
        del q, k, v, do
        torch.cuda.empty_cache()
    return rows


def compare(paths: list[str]) -> None:
    """One table: each (problem, tile) with each file's ms, and the first over the last."""
    runs = [json.load(open(p)) for p in paths]
    labels = [r[0]["label"] for r in runs]
    by = [{(x["problem"], x["tile"]): x for x in r} for r in runs]
    print("| problem | tile | " + " | ".join(f"{lb} ms" for lb in labels) + f" | {labels[0]} / {labels[-1]} |")
    print("|---|---|" + "---|" * (len(labels) + 1))
    for key in by[0]:
        ms = [b.get(key, {}).get("ms") for b in by]
        sp = f"{ms[0] / ms[-1]:.3f}x" if ms[0] and ms[-1] else "-"
        print(f"| {key[0]} | {key[1]} | " + " | ".join("-" if m is None else f"{m:.4f}" for m in ms) + f" | {sp} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--label", default="run")
    ap.add_argument("--out", default="bench_out/probe_varlen_grid")
    ap.add_argument("--rep-ms", type=float, default=60.0)
    ap.add_argument("--compare", nargs="+", default=None, metavar="JSON")
    ap.add_argument("--only", default=None, help="comma-separated substrings: the problems whose names hold one")
    ap.add_argument("--layouts", action="store_true",
                    help="each Gluon tile in both grid layouts (one slot per block of the longest sequence, "
                         "packed), back to back in one process")
    a = ap.parse_args(argv)
    if a.compare:
        compare(a.compare)
        return 0
    os.makedirs(a.out, exist_ok=True)
    rows = run(a.label, a.rep_ms, a.layouts, a.only.split(",") if a.only else None)
    with open(os.path.join(a.out, f"{a.label}.json"), "w") as f:
        json.dump(rows, f, indent=1)
    bad = [r for r in rows if "error" in r or (r.get("ratio") is not None and r["ratio"] > 1.0)]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())

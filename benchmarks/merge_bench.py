"""Join several ``flashgen bench`` runs (e.g. one run per (head_dim, mask) quarter of
the fa-grid) into one table and the geometric means of issue 4:
each backend's forward / backward / forward+backward TFLOP/s over SDPA cuDNN's and SDPA
flash's, per shape, over the whole set and per (head_dim, mask).

Inputs are ``bench.json`` files, or, for a run whose JSON did not come back, the
table ``flashgen bench`` printed (its log; the TFLOP/s there are rounded to integers,
so a ratio from a log carries up to 0.5 TFLOP/s of rounding in each cell: 0.3% at 169
TFLOP/s, the smallest cell of the fa-grid log in docs/results/h200).  A cell without a number (an error,
or a metric the backend did not run) is left out of the ratios that need it.

    R=docs/results/h200/fa-grid/five-backends
    python3 benchmarks/merge_bench.py $R/d64_none.log $R/d128_causal/bench.json \\
        $R/d128_none/bench.json $R/d64_causal/bench.json --markdown $R/merged.md
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys

METRICS = ("fwd", "bwd", "fwdbwd")


def number(x) -> float | None:
    """A JSON number (bools and anything else: None)."""
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def tflops_rows(rows: list[dict]) -> list[dict]:
    """Rows {d, mask, shape, backends: {name: {fwd, bwd, fwdbwd}}} of a bench.json's
    ``rows`` (each a ``case``: sizes, ``causal``, ``window``; and ``cells`` per backend)."""
    out = []
    for r in rows:
        c = r["case"]
        mask = "causal" if c["causal"] else "none" if tuple(c["window"]) == (-1, -1) else f"window{c['window']}"
        cells = {name: {m: number(cell.get(f"{m}_tflops")) for m in METRICS} for name, cell in r["cells"].items()
                 if not cell.get("error")}
        out.append(dict(d=c["head_dim"], mask=mask,
                        shape=f"{c['batch']}x{c['num_heads']}/{c['num_kv_heads']}x{c['seqlen_q']}", backends=cells))
    return out


def from_json(path: str) -> list[dict]:
    """:func:`tflops_rows` of the bench.json ``path``."""
    with open(path, encoding="utf-8") as f:
        return tflops_rows(json.load(f)["rows"])


def from_log(path: str) -> list[dict]:
    """The same rows from the TFLOP/s table a ``flashgen bench`` log printed (with or
    without ``--no-check``'s error-ratio column; a shape whose flashgen cell failed keeps
    its other backends' cells)."""
    lines = open(path, encoding="utf-8").read().splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith("┃") and "batch x heads" in ln), None)
    if start is None:
        raise ValueError(f"{path}: no flashgen bench TFLOP/s table")
    names = [h.strip() for h in lines[start].strip().strip("┃").split("┃")][3:]
    if names and names[-1] == "flashgen max err ratio":
        names = names[:-1]
    out = []
    for ln in lines[start + 1:]:
        if ln.startswith("└"):
            break  # the end of the TFLOP/s table (the peak-memory table follows)
        if not ln.startswith("│"):
            continue
        cols = [x.strip() for x in ln.strip().strip("│").split("│")]
        if len(cols) < 3 + len(names) or not cols[0].isdigit():
            continue
        cells = {}
        for name, col in zip(names, cols[3:]):
            parts = [p.strip() for p in col.split("/")]
            if len(parts) == 3 and all(re.fullmatch(r"[\d.]+", p) for p in parts):
                cells[name] = dict(zip(METRICS, map(float, parts)))
        out.append(dict(d=int(cols[0]), mask=cols[1], shape=cols[2], backends=cells))
    if not out:
        raise ValueError(f"{path}: no rows in its TFLOP/s table")
    return out


def geomean(xs):
    xs = [x for x in xs if x]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def ratios(rows, name, peer, metric):
    out = []
    for r in rows:
        a, b = (r["backends"].get(n, {}).get(metric) for n in (name, peer))
        if a and b:
            out.append(a / b)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("inputs", nargs="+", help="bench.json files or flashgen bench logs")
    ap.add_argument("--markdown", default=None, help="also write the tables here (markdown)")
    args = ap.parse_args(argv)
    rows = []
    for p in args.inputs:
        rows += from_json(p) if p.endswith(".json") else from_log(p)
    seen = set()
    for r in rows:
        k = (r["d"], r["mask"], r["shape"])
        if k in seen:
            ap.error(f"shape d{r['d']} {r['mask']} {r['shape']} appears in more than one input")
        seen.add(k)
    rows.sort(key=lambda r: (r["d"], r["mask"] != "none", int(r["shape"].split("x")[-1])))
    names = [n for n in ("flashgen", "flashgen-default", "flashgen-deterministic", "sdpa-cudnn", "sdpa-flash", "flex")
             if any(n in r["backends"] for r in rows)]
    md = [f"{len(rows)} shapes from {len(args.inputs)} runs: " + ", ".join(args.inputs), "",
          "TFLOP/s fwd / bwd / fwd+bwd", "",
          "| d | mask | batch x heads/kv x seqlen | " + " | ".join(names) + " | flashgen / cuDNN fwd, bwd |",
          "|---|---|---|" + "---|" * len(names) + "---|"]
    for r in rows:
        b = r["backends"]
        cells = [" / ".join(f"{b[n][m]:.0f}" if b[n].get(m) else "-" for m in METRICS) if n in b else "-"
                 for n in names]
        rc = ", ".join(f"{x[0]:.2f}" if x else "-" for x in (ratios([r], "flashgen", "sdpa-cudnn", m)
                                                           for m in ("fwd", "bwd")))
        md.append(f"| {r['d']} | {r['mask']} | {r['shape']} | " + " | ".join(cells) + f" | {rc} |")
    md += ["", "Geometric mean (worst shape) of each backend over SDPA cuDNN and SDPA flash:", "",
           "| backend | over | fwd | bwd | fwd+bwd |", "|---|---|---|---|---|"]
    for n in names:
        for peer in ("sdpa-cudnn", "sdpa-flash"):
            if n == peer or peer not in names:
                continue
            cols = []
            for m in METRICS:
                xs = ratios(rows, n, peer, m)
                cols.append(f"{geomean(xs):.3f}x ({min(xs):.3f}x)" if xs else "-")
            md.append(f"| {n} | {peer} | " + " | ".join(cols) + " |")
    groups = sorted({(r["d"], r["mask"]) for r in rows})
    if len(groups) > 1 and "flashgen" in names and "sdpa-cudnn" in names:
        md += ["", "flashgen over SDPA cuDNN by (head_dim, mask):", "", "| d | mask | fwd | bwd | fwd+bwd |",
               "|---|---|---|---|---|"]
        for d, mask in groups:
            g = [r for r in rows if (r["d"], r["mask"]) == (d, mask)]
            md.append(f"| {d} | {mask} | " + " | ".join(f"{geomean(ratios(g, 'flashgen', 'sdpa-cudnn', m)):.3f}x"
                                                         for m in METRICS) + " |")
    text = "\n".join(md) + "\n"
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

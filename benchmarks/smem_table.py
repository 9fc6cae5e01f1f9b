"""Issue 4's compiled-vs-modelled shared memory table, from a tuning DB.

Every ``ok`` row records what Triton reported for the compiled kernel
(``smem_bytes_compiled`` = ``kernel.metadata.shared``); the model (a sum of named
buffers, :mod:`flashgen.resources`) is recomputed for each variant as it is now.  Per kernel and TMA on/off:
variants compiled, the worst absolute error, the range of (model - compiled) and how
many the model underestimates (an underestimate could let an infeasible config
through; the model is meant to be exact or over).  Registers and spills as reported.

Usage:  python3 benchmarks/smem_table.py tuning_db/h200.sqlite [--out docs/...md]
"""

from __future__ import annotations

import argparse
import sqlite3
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def table(db: str) -> str:
    """The table for the *current* model (:func:`flashgen.resources.smem_buffers`,
    recomputed for each row's variant), against each variant's compiled bytes."""
    from flashgen import resources
    from flashgen.spec import ProblemKey, TileConfig, Variant

    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    con.row_factory = sqlite3.Row
    rows = []
    for r in con.execute("SELECT * FROM measurements WHERE status = 'ok' AND smem_bytes_compiled IS NOT NULL "
                         "GROUP BY variant_id"):
        r = dict(r)
        v = Variant(ProblemKey.from_row(r).spec, TileConfig.from_dict(r))
        model = sum(resources.smem_buffers(v).values())
        rows.append((r["kernel"], v.config.tma, v.id, model, r["smem_bytes_compiled"], r["n_regs"], r["n_spills"]))
    con.close()
    groups: dict[tuple[str, int], list] = {}
    for kernel, tma, vid, model, comp, regs, spills in rows:
        groups.setdefault((kernel, tma), []).append((vid, model, comp, regs, spills))
    out = ["| kernel | tma | variants compiled | worst abs error (B) | model - compiled (B) | under | max regs | variants that spill |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    worst_all = 0
    for (kernel, tma), vs in sorted(groups.items()):
        diffs = [m - c for _, m, c, _, _ in vs]
        worst = max(abs(d) for d in diffs)
        worst_all = max(worst_all, worst)
        regs = [r for *_, r, _ in vs if r is not None]
        spills = [s for *_, s in vs if s is not None]
        out.append(f"| {kernel} | {tma} | {len(vs)} | {worst} | {min(diffs)} .. {max(diffs)} | "
                   f"{sum(d < 0 for d in diffs)} | {max(regs) if regs else '-'} | "
                   f"{sum(s > 0 for s in spills) if spills else '-'} |")
    out.append(f"\n{len(rows)} distinct variants; worst absolute error {worst_all} B.")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("db")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    text = table(args.db)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

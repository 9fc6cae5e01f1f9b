"""Carry tuning rows of user-function variants across a rename that left their code alone.

A user function's variant name (``KernelSpec.mods``) hashes its lowered code together
with the lowering machinery, so a change to the machinery renames every user variant,
including those whose generated kernel did not change, and their tuned rows stop
serving.  This script renders, for each key of a user preset and each tile config that
OLD_DB measured for it, the kernel source under an older checkout (--old-code) and
under this one (variant names and hashes normalized away), and copies OLD_DB's rows of
the byte-identical ones into --db under the new names (every column else as measured:
time, GPU, versions, creation time).  Keys whose source differs for any config are
left out entirely, and nothing in --db is changed or removed; rows already there are
not copied again.

    git worktree add /tmp/old 71343c4
    git show 0521f87:tuning_db/h200.sqlite > /tmp/old.sqlite
    python3 benchmarks/carry_user_rows.py --old-code /tmp/old --old-db /tmp/old.sqlite --db tuning_db/h200.sqlite

CPU only (no GPU, no interpreter run): each checkout renders in a child process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_CHILD = r'''
import hashlib, json, re, sys
import sqlite_utils
from flashgen import render, user_tune
from flashgen.spec import TileConfig, Variant
presets, db = sys.argv[1].split(","), sys.argv[2]
rows = list(sqlite_utils.Database(db).query(
    "select distinct kernel, mask, BLOCK_M, BLOCK_N, num_warps, num_stages, tma, ws, num_splits from measurements "
    "where mods like 'u%' and (family is null or family = 'triton')"))
out = []
for p in user_tune.preset_problems(presets, device="cpu"):
    for key, _ in user_tune.items([p]):
        spec = key.spec
        for r in rows:
            if (r["kernel"], r["mask"]) != (spec.kernel, spec.mask):
                continue
            cfg = TileConfig(r["BLOCK_M"], r["BLOCK_N"], r["num_warps"], r["num_stages"], r["tma"] or 0,
                             r["ws"] or 0, r["num_splits"] or 0)
            try:
                src = render.render(Variant(spec, cfg))
            except Exception:  # a config this checkout does not render: not comparable
                src = None
            if src is not None:
                src = src.replace(spec.mods, "MODS")
                src = re.sub(r"template_hash: \w+", "", src)
                src = re.sub(r"(VARIANT_ID|TEMPLATE_HASH) = \"[^\"]*\"", "", src)
                src = hashlib.sha256(src.encode()).hexdigest()
            out.append([p.label, spec.kernel, spec.mask, [cfg.BLOCK_M, cfg.BLOCK_N, cfg.num_warps, cfg.num_stages,
                        cfg.tma], spec.mods, src])
print(json.dumps(out))
'''


def _render(code: Path, presets: str, db: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(code)
    r = subprocess.run([sys.executable, "-c", _CHILD, presets, str(db)], capture_output=True, text=True, env=env,
                       cwd=str(code), timeout=1800)
    if r.returncode:
        raise SystemExit(f"rendering under {code} failed:\n{r.stderr[-2000:]}")
    return {(lab, k, m, tuple(c)): (mods, h) for lab, k, m, c, mods, h in json.loads(r.stdout)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old-code", required=True, type=Path, help="an older checkout of flashgen (its root)")
    ap.add_argument("--old-db", required=True, type=Path, help="the tuning DB with that checkout's rows")
    ap.add_argument("--db", required=True, type=Path, help="the tuning DB to add the carried rows to")
    ap.add_argument("--preset", default="user-examples", help="user presets, comma-separated")
    a = ap.parse_args(argv)
    import sqlite_utils

    for name, path in (("--old-db", a.old_db), ("--db", a.db)):
        if not path.is_file():
            raise SystemExit(f"{name} {path}: no such file")
    old = _render(a.old_code.resolve(), a.preset, a.old_db.resolve())
    new = _render(ROOT, a.preset, a.old_db.resolve())
    keys = {k[:3] for k in new}
    same = {}  # (kernel, mask, old mods) -> new mods, for keys identical under every config
    for key in sorted(keys):
        cfgs = [k for k in new if k[:3] == key]
        if all(k in old and old[k][1] is not None and old[k][1] == new[k][1] for k in cfgs):
            same[(key[1], key[2], old[cfgs[0]][0])] = new[cfgs[0]][0]
            print(f"same code: {key[0]} {key[1]} {key[2]}: {old[cfgs[0]][0]} -> {new[cfgs[0]][0]} ({len(cfgs)} configs)")
        else:
            print(f"changed:   {key[0]} {key[1]} {key[2]}: not carried")
    src, dst = sqlite_utils.Database(a.old_db), sqlite_utils.Database(a.db)
    have = {(r["variant_id"], r["created_at"]) for r in dst.query("select variant_id, created_at from measurements")}
    copied = []
    for r in src.query("select * from measurements where mods like 'u%' and (family is null or family = 'triton')"):
        new_mods = same.get((r["kernel"], r["mask"], r["mods"]))
        if new_mods is None:
            continue
        row = {k: v for k, v in r.items() if k != "id"}
        for col in ("key", "variant_id", "mods"):
            row[col] = row[col].replace(r["mods"], new_mods)
        if (row["variant_id"], row["created_at"]) not in have:
            copied.append(row)
    if copied:
        dst["measurements"].insert_all(copied)
    print(f"{len(copied)} rows of {len(same)} unchanged (kernel, mask, function) keys copied into {a.db}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

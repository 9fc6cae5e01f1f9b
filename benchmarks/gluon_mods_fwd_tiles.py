"""Forward tiles of the Gluon family for the built-in softcap and ALiBi
(flashgen/families/gluon/builtin_mods.py) on the GPU: exactness, then each tile against
the Triton forward.

The Gluon forward computes a score function on every score between the score product's
wait and the softmax, in each copy of the softmax body (a tile's first key tile, its
masked and its unmasked tiles, once per consumer partition).  The untuned default tile
of a key with score mods is its plain key's (two consumers of 64 rows, BLOCK_N 128):
64 scores per thread and two copies of the code.  The tiles here hold fewer scores per
thread (BLOCK_N 64) and one copy (one consumer, two or three programs per SM), the
shape of the Triton family's tile for these keys, and the same in the persistent walk
with the next tile's Q loaded a tile ahead (``persistent`` 3).

Per (mods, head_dim), in a child process under a timeout (a deadlock kills the child,
not the run):

* checks: every tile of :data:`TILES` on the inputs of ``gluon_builtin_mods.CHECKS``
  (softcap 30, ALiBi slopes per head or per (batch, head), causal with seqlen_k -
  seqlen_q = 100 and GQA 4, float16, multi-query), O and LSE against the float64
  reference of the built-in mods (the exactness rule, <= 1 passes);
* timings: each passing tile on ``gluon_builtin_mods.TIMED`` (bf16, 16 heads, batch 8,
  seqlen 2048 and 4096, causal and not), beside the Triton forward the dispatcher serves
  with the Gluon family left out (``FLASHGEN_FAMILIES=triton``), median of
  triton.testing.do_bench.

Writes gluon_mods_fwd_tiles.json under --out and prints a short table last: each tile's
time and the Triton forward's time over it (above 1: the Gluon tile is faster).

Usage (repository root, on the GPU):  python3 benchmarks/gluon_mods_fwd_tiles.py --out $OUT
The table of a written JSON (no GPU):   python3 benchmarks/gluon_mods_fwd_tiles.py --table FILE.json
Each tile's code size for sm_90 (no GPU): python3 benchmarks/gluon_mods_fwd_tiles.py --sass
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.children import main_jobs  # noqa: E402
from benchmarks.gluon_builtin_mods import CHECKS, HEAD_DIMS, MODS, TIMED, _inputs  # noqa: E402


def tiles(d: int) -> list:
    """The forward tiles timed at head_dim ``d``: the default's shape first."""
    from flashgen.spec import TileConfig

    def t(nc, n, stages, ctas=0, pin=0, persistent=0, o_in_q=0):
        return TileConfig(BLOCK_M=64, BLOCK_N=n, num_warps=4 * nc, num_stages=stages, family="gluon",
                          ctas_per_sm=ctas, pin=pin, persistent=persistent, o_in_q=o_in_q)

    if d == 64:
        return [t(2, 128, 4), t(2, 64, 4), t(1, 64, 3, 2), t(1, 64, 3, 3), t(1, 128, 3, 2), t(1, 64, 3, 3, persistent=3)]
    return [t(2, 128, 2, pin=1), t(2, 128, 2), t(2, 64, 2), t(2, 64, 3), t(1, 64, 2, 2),
            t(1, 64, 2, 2, persistent=3, o_in_q=1)]


def _child(mods: str, d: int) -> dict:
    import torch
    import triton

    import flashgen
    from flashgen import bench, families
    from flashgen.masks import mask_bounds

    fwd = families.get("gluon").launcher("fwd")
    out = {"mods": mods, "d": d, "tiles": []}
    for cfg in tiles(d):
        row = {"tile": cfg.id, "checks": []}
        try:
            for b, h, hk, sq, sk, dtype, causal, per_batch in CHECKS:
                q, k, v, do, m = _inputs(mods, b, h, hk, sq, sk, d, dtype, per_batch, seed=sq + hk)
                mode, lo, hi = mask_bounds(sq, sk, causal=causal, window=(-1, -1))
                o, lse = fwd(q, k, v, config=cfg, softmax_scale=d ** -0.5, mask=mode, diag_lo=lo, diag_hi=hi, mods=m)
                torch.cuda.synchronize()
                res = bench.compare({"O": o, "LSE": lse}, q, k, v, do,
                                    mask=dict(causal=causal, window=(-1, -1), align="bottom_right"),
                                    softmax_scale=d ** -0.5, mods=dict(softcap=m.softcap, alibi=m.alibi, bias=None))
                row["checks"].append(max(r for _, _, r in res.values()))
        except Exception as e:  # noqa: BLE001 - a tile the rules refuse or that fails to build
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        row["ok"] = "error" not in row and all(r <= 1.0 for r in row["checks"])
        out["tiles"].append(row)
    out["timings"] = []
    for b, h, s, causal in TIMED:
        q, k, v, do, m = _inputs(mods, b, h, h, s, s, d, "bfloat16", False)
        mode, lo, hi = mask_bounds(s, s, causal=causal, window=(-1, -1))
        kw = dict(softmax_scale=d ** -0.5, mask=mode, diag_lo=lo, diag_hi=hi, mods=m)
        akw = dict(causal=causal, softcap=m.softcap, alibi_slopes=m.alibi)
        row = {"size": [b, h, s], "causal": causal, "gluon_ms": {}}
        os.environ["FLASHGEN_FAMILIES"] = "triton"
        flashgen.dispatch.default_dispatcher().clear()
        row["triton_config"] = [str(c) for c in flashgen.explain(q, k, v, **akw).kernels][:1]
        with torch.no_grad():
            row["triton_ms"] = triton.testing.do_bench(lambda: flashgen.attention(q, k, v, **akw), warmup=25, rep=100)
        os.environ.pop("FLASHGEN_FAMILIES", None)
        flashgen.dispatch.default_dispatcher().clear()
        for cfg, t in zip(tiles(d), out["tiles"]):
            if t["ok"]:
                row["gluon_ms"][cfg.id] = triton.testing.do_bench(lambda: fwd(q, k, v, config=cfg, **kw),
                                                                  warmup=25, rep=100)
        out["timings"].append(row)
        del q, k, v, do
    out["ok"] = all(t["ok"] for t in out["tiles"])
    return out


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--table":  # the table of a written JSON (a run cut short)
        rows = json.loads(Path(sys.argv[2]).read_text())
        table(rows)
        return 0
    if sys.argv[1:] == ["--sass"]:  # no GPU: each tile compiled for sm_90, its code size
        sass()
        return 0
    rows = main_jobs(__doc__, __file__, _child, "mods", MODS, HEAD_DIMS, ROOT, "gluon_mods_fwd_tiles.json", "mods",
                     timeout_s=420.0)
    if rows is None:  # a child process
        return 0
    table(rows)
    return 0 if all(r.get("ok") for r in rows) else 1


def sass() -> None:
    """Each tile (and the plain key's default) compiled for sm_90 at 8x16x4096 causal:
    SASS instructions, MUFU.EX2 and MUFU.RCP counts and ptxas spill bytes."""
    from flashgen import arch, families
    from flashgen.families.gluon import family as F
    from flashgen.families.gluon.config import GluonFwdVariant
    from flashgen.families.gluon.sm90 import compile_sm90, report
    from flashgen.spec import KernelSpec, Shape

    sm90 = arch.by_sm("sm_90")
    print("mods           d   tile                             instructions   EX2   RCP  spill B")
    for mods in ("",) + MODS:
        for d in HEAD_DIMS:
            key = Shape(8, 16, 16, 4096, 4096).key(KernelSpec("fwd", "bfloat16", d, d, "causal", mods))
            for cfg in [families.get("gluon").default_config(key, sm90)] if not mods else tiles(d):
                r = report(compile_sm90(GluonFwdVariant(F.fwd_spec(key), F.fwd_config(cfg))))
                print(f"{mods or 'none':14} {d:3}  {cfg.id:32} {r.instructions:12}  {r.sass.count('MUFU.EX2'):4}  "
                      f"{r.sass.count('MUFU.RCP'):4}  {r.spill_bytes:7}", flush=True)


def table(rows: list[dict]) -> None:
    print("\nmods           d   tile                             worst   Triton ms / tile ms (x) at each size (bf16)")
    for r in rows:
        if "tiles" not in r:
            print(f"{r['mods']:14} {r['d']:3}  {r.get('error', '')[:160]}")
            continue
        sizes = r.get("timings", [])
        for t in r["tiles"]:
            worst = max(t["checks"], default=float("nan"))
            cells = []
            for s in sizes:
                g = s["gluon_ms"].get(t["tile"])
                size = "x".join(map(str, s["size"])) + ("c" if s["causal"] else "")
                cells.append(f"{size} {s['triton_ms']:.3f}/{g:.3f} ({s['triton_ms'] / g:.2f}x)" if g else f"{size} -")
            err = "" if t["ok"] else " FAILED " + t.get("error", "")[:100]
            print(f"{r['mods']:14} {r['d']:3}  {t['tile']:32} {worst:6.3f}  " + "  ".join(cells) + err)


if __name__ == "__main__":
    sys.exit(main())

"""A learned table's gradient in the Gluon backward summed per key row, not per tile, as
a probe (never tuned or served).

With a captured tensor that takes a gradient and is gathered at a small extent (T5's
relative-position table, 32 buckets x heads), the Gluon backward adds each index value's
sum over the step's S^T tile with one atomic (:class:`flashgen.user_grads.ReducedContext`,
looped over the values present by :func:`flashgen.families.gluon.user_bwd._value_loops`).
The sum over the tile crosses the 8-warp partition's warps: a reduction through shared
memory with a barrier of 256 threads, per value present.  At head_dim 128 the learned
table costs the default backward about 12 ms over the frozen one at 8x16x2048 (the design
notes, "user score functions in the Gluon backward").

The variant (:func:`row_sums`) sums each value along the query rows only (within a warp)
and adds the per-key-row sums with one atomic per key row that holds the value, masked
where the sum is zero: no cross-warp reduction, up to PB same-address atomics per value
and step instead of one.

For each head dim, each variant in a child process under a timeout:
``benchmarks/gluon_user_bwd.py``'s checks of ``relpos-learned`` against float64 (dQ, dK,
dV and the table's gradient) and its timings against the Triton family's backward.

    PYTHONPATH=. python3 benchmarks/probe_t5_rowsum.py --out t5.json

Prints a table last: each variant's worst check ratio and its backward time.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks.children import main_jobs  # noqa: E402

VARIANTS = ("per-tile", "per-row")

_TILE_ADD = re.compile(r"^( *)gl\.atomic_add\((u_rp\d+) \+ u_v \* (\w+), gl\.sum\(gl\.sum\((gl\.where\(u_ri\d+ == u_v, "
                       r"u_rv\d+, 0\.0\)), 1\), 0\), sem=\"relaxed\"\)$", re.M)


def row_sums(code: str) -> str:
    """``code`` (the backward's USER_GRADS lines) with each per-tile sum of an index
    value's gradient replaced by per-key-row sums (along the query rows, axis 1 of S^T)
    added by one atomic per key row whose sum is not zero.  Raises ValueError when the
    code has no per-tile sum."""
    code, n = _TILE_ADD.subn(lambda m: (f"{m.group(1)}u_rs = gl.sum({m.group(4)}, 1)\n"
                                        f"{m.group(1)}gl.atomic_add({m.group(2)} + u_v * {m.group(3)} + "
                                        "gl.zeros([PB], gl.int64, ROW_ST), u_rs, mask=u_rs != 0.0, sem=\"relaxed\")"),
                             code)
    if n == 0:
        raise ValueError("no per-tile sum of an index value's gradient in the code")
    return code


def patch(variant: str) -> None:
    """Make this process render ``variant`` ("per-tile": as shipped)."""
    if variant == "per-row":
        from flashgen.families.gluon import user_bwd

        loops = user_bwd._value_loops
        user_bwd._value_loops = lambda code: row_sums(loops(code))


def _child(variant: str, d: int) -> dict:
    import gluon_user_bwd

    patch(variant)
    out = gluon_user_bwd._child("relpos-learned", d)
    out["variant"] = variant
    return out


def main() -> int:
    rows = main_jobs(__doc__, __file__, _child, "variants", VARIANTS, (64, 128), ROOT, "t5_rowsum.json", "variant",
                     timeout_s=400.0)
    if rows is None:  # a child process
        return 0
    print("\nvariant    d   ok   worst ratio  size (bf16)        gluon ms  triton ms")
    for r in rows:
        worst = max((c["ratio"] for c in r.get("checks", [])), default=float("nan"))
        head = f"{r['variant']:9} {r['d']:3}  {'yes' if r['ok'] else 'NO ':3}  {worst:11.3f}"
        if not r.get("timings"):
            print(f"{head}  {r.get('error', '')[:100]}")
        for t in r.get("timings", []):
            print(f"{head}  {'x'.join(map(str, t['size'])):17} {t['gluon_ms']:8.3f}  {t['triton_ms']:9.3f}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

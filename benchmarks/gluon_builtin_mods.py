"""The built-in softcap and ALiBi in the Gluon family (flashgen/families/gluon/builtin_mods.py)
on the GPU: exactness, then the Gluon kernels against the Triton family's.

Per (mods, head_dim), in a child process under a timeout (a deadlock kills the child,
not the run):

* checks: the Gluon forward and whole backward, each at the default tile of its key
  (``GluonFamily.default_config``), called through the family's launchers with
  ``flashgen.ops.ScoreMods`` (softcap 30, ALiBi slopes of flashgen.bench.alibi_slopes, per
  head or per (batch, head)), against the float64 reference of the built-in mods (O, LSE,
  dQ, dK, dV; the exactness rule, <= 1 passes): bf16 causal 2x16x1000, causal with
  seqlen_k - seqlen_q = 100 and GQA 4, no mask with per-batch slopes, float16, and
  multi-query at 777 rows;
* timings (bf16, 16 heads, batch 8 at seqlen 2048 and 4096, causal and not): the Gluon
  forward's default tile against the Triton forward the dispatcher serves with the
  Gluon family left out (``FLASHGEN_FAMILIES=triton``: the shipped rows where the
  databases have them), the Gluon whole backward's default tile (preprocess, main
  kernel, dQ convert) against the Triton family's backward through autograd, and
  ``flashgen.attention``'s forward+backward as the dispatcher serves it (its
  ``explain``) against the same with ``FLASHGEN_FAMILIES=triton``.

Writes gluon_builtin_mods.json under --out and prints a short table last.

Usage (repository root, on the GPU):  python3 benchmarks/gluon_builtin_mods.py --out $OUT
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.children import main_jobs  # noqa: E402

MODS = ("softcap", "alibi", "softcap_alibi")
HEAD_DIMS = (64, 128)
SOFTCAP = 30.0
#: (batch, heads, kv heads, seqlen_q, seqlen_k, dtype, causal, slopes per batch)
CHECKS = ((2, 16, 16, 1000, 1000, "bfloat16", True, False), (2, 16, 4, 1000, 1100, "bfloat16", True, False),
          (2, 16, 16, 1000, 1000, "bfloat16", False, True), (2, 16, 4, 1000, 1000, "float16", True, False),
          (1, 16, 1, 777, 777, "bfloat16", True, True))
#: (batch, heads, seqlen, causal) of the timings, bf16
TIMED = ((8, 16, 2048, True), (8, 16, 4096, True), (8, 16, 4096, False))


def _inputs(mods, b, h, hk, sq, sk, d, dtype, per_batch, seed=0):
    import torch

    from flashgen import bench, ops

    g = torch.Generator(device="cuda").manual_seed(seed)
    dt = getattr(torch, dtype)
    q, do = (torch.randn(b, h, sq, d, device="cuda", dtype=dt, generator=g) for _ in range(2))
    k, v = (torch.randn(b, hk, sk, d, device="cuda", dtype=dt, generator=g) for _ in range(2))
    slopes = None
    if "alibi" in mods:
        slopes = torch.tensor(bench.alibi_slopes(h), dtype=torch.float32, device="cuda")
        if per_batch:
            slopes = slopes[None, :] * (1 + torch.arange(b, device="cuda", dtype=torch.float32)[:, None] / 4)
    return q, k, v, do, ops.ScoreMods(softcap=SOFTCAP if "softcap" in mods else 0.0, alibi=slopes)


def _gluon(kernel, key):
    from flashgen import arch, families

    fam = families.get("gluon")
    return fam.launcher(kernel), fam.default_config(key, arch.current())


def _child(mods: str, d: int) -> dict:
    import torch

    from flashgen import bench
    from flashgen.masks import mask_bounds
    from flashgen.spec import KernelSpec, Shape

    out = {"mods": mods, "d": d, "checks": []}
    for b, h, hk, sq, sk, dtype, causal, per_batch in CHECKS:
        q, k, v, do, m = _inputs(mods, b, h, hk, sq, sk, d, dtype, per_batch, seed=sq + hk)
        mode, lo, hi = mask_bounds(sq, sk, causal=causal, window=(-1, -1))
        shape = Shape(b, h, hk, sq, sk)
        kw = dict(softmax_scale=d ** -0.5, mask=mode, diag_lo=lo, diag_hi=hi, mods=m)
        fwd, fcfg = _gluon("fwd", shape.key(KernelSpec("fwd", dtype, d, d, mode, mods)))
        bwd, bcfg = _gluon("bwd", shape.key(KernelSpec("bwd", dtype, d, d, mode, mods)))
        o, lse = fwd(q, k, v, config=fcfg, **kw)
        dq, dk, dv = bwd(do, q, k, v, o, lse, config=bcfg, **kw)
        torch.cuda.synchronize()
        res = bench.compare({"O": o, "LSE": lse, "dQ": dq, "dK": dk, "dV": dv}, q, k, v, do,
                            mask=dict(causal=causal, window=(-1, -1), align="bottom_right"),
                            softmax_scale=d ** -0.5, mods=dict(softcap=m.softcap, alibi=m.alibi, bias=None))
        out["checks"].append({"size": [b, h, hk, sq, sk], "dtype": dtype, "causal": causal, "per_batch": per_batch,
                              "fwd": fcfg.id, "bwd": bcfg.id, "ratio": max(r for _, _, r in res.values()),
                              "errors": {n: [e, be] for n, (e, be, _) in res.items()}})
    out["ok"] = all(c["ratio"] <= 1.0 for c in out["checks"])
    if not out["ok"]:
        return out
    out["timings"] = []
    try:
        _time(out, mods, d)
    except Exception as e:  # noqa: BLE001 - the checks above stay recorded
        out["ok"], out["error"] = False, f"timing: {type(e).__name__}: {e}"
    os.environ.pop("FLASHGEN_FAMILIES", None)
    return out


def _time(out: dict, mods: str, d: int) -> None:
    import torch
    import triton

    import flashgen
    from flashgen.masks import mask_bounds
    from flashgen.spec import KernelSpec, Shape

    for b, h, s, causal in TIMED:
        q, k, v, do, m = _inputs(mods, b, h, h, s, s, d, "bfloat16", False)
        mode, lo, hi = mask_bounds(s, s, causal=causal, window=(-1, -1))
        shape = Shape(b, h, h, s, s)
        kw = dict(softmax_scale=d ** -0.5, mask=mode, diag_lo=lo, diag_hi=hi, mods=m)
        fwd, fcfg = _gluon("fwd", shape.key(KernelSpec("fwd", "bfloat16", d, d, mode, mods)))
        bwd, bcfg = _gluon("bwd", shape.key(KernelSpec("bwd", "bfloat16", d, d, mode, mods)))
        akw = dict(causal=causal, softcap=m.softcap, alibi_slopes=m.alibi)
        row = {"size": [b, h, s], "causal": causal}
        o, lse = fwd(q, k, v, config=fcfg, **kw)
        row["gluon_fwd_ms"] = triton.testing.do_bench(lambda: fwd(q, k, v, config=fcfg, **kw), warmup=25, rep=100)
        row["gluon_bwd_ms"] = triton.testing.do_bench(lambda: bwd(do, q, k, v, o, lse, config=bcfg, **kw),
                                                      warmup=25, rep=100)
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        for label, fams in (("triton", "triton"), ("dispatcher", None)):
            if fams:
                os.environ["FLASHGEN_FAMILIES"] = fams
            else:
                os.environ.pop("FLASHGEN_FAMILIES", None)
            flashgen.dispatch.default_dispatcher().clear()
            ex = flashgen.explain(q, k, v, **akw)
            row[f"{label}_explain"] = {"kernels": [str(c) for c in ex.kernels], "backward": ex.backward}
            with torch.no_grad():
                row[f"{label}_fwd_ms"] = triton.testing.do_bench(lambda: flashgen.attention(q, k, v, **akw),
                                                                 warmup=25, rep=100)
            og = flashgen.attention(qg, kg, vg, **akw)
            row[f"{label}_bwd_ms"] = triton.testing.do_bench(
                lambda: torch.autograd.grad(og, (qg, kg, vg), do, retain_graph=True), warmup=25, rep=100)
            row[f"{label}_fwdbwd_ms"] = triton.testing.do_bench(
                lambda: torch.autograd.grad(flashgen.attention(qg, kg, vg, **akw), (qg, kg, vg), do),
                warmup=25, rep=100)
            del og
        out["timings"].append(row)
        del q, k, v, do, o, lse, qg, kg, vg


def main() -> int:
    rows = main_jobs(__doc__, __file__, _child, "mods", MODS, HEAD_DIMS, ROOT, "gluon_builtin_mods.json", "mods")
    if rows is None:  # a child process
        return 0
    print("\nmods           d   ok  worst   size (bf16)      fwd: gluon / triton ms (x)   bwd: gluon / triton ms (x)"
          "   fwd+bwd: flashgen / triton-only ms (x)")
    for r in rows:
        worst = max((c["ratio"] for c in r.get("checks", [])), default=float("nan"))
        head = f"{r['mods']:14} {r['d']:3}  {'yes' if r['ok'] else 'NO ':3} {worst:6.3f}"
        if not r.get("timings"):
            print(f"{head}  {r.get('error', '')[:100]}")
        for t in r.get("timings", []):
            size = "x".join(map(str, t["size"])) + (" causal" if t["causal"] else "")
            print(f"{head}  {size:16} {t['gluon_fwd_ms']:6.3f} / {t['triton_fwd_ms']:6.3f} "
                  f"({t['triton_fwd_ms'] / t['gluon_fwd_ms']:5.2f}x)   {t['gluon_bwd_ms']:6.3f} / "
                  f"{t['triton_bwd_ms']:6.3f} ({t['triton_bwd_ms'] / t['gluon_bwd_ms']:5.2f}x)   "
                  f"{t['dispatcher_fwdbwd_ms']:6.3f} / {t['triton_fwdbwd_ms']:6.3f} "
                  f"({t['triton_fwdbwd_ms'] / t['dispatcher_fwdbwd_ms']:5.2f}x)")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

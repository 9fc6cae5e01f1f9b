"""The Gluon backward's user score and mask functions (flashgen/families/gluon/user_bwd.py)
on the GPU, the measurement behind ``family.USER_BWD_DEFAULT_AHEAD`` and
``family.USER_SCORE_BWD_DEFAULT_AHEAD`` (the default tile the dispatcher takes for an
untuned key of mask functions alone, or with a score function): each example
first in a child process under a timeout (a deadlock kills the child, not the run),
checked against float64 (dQ, dK, dV of the head_dim's default tile; batch 2, 16 heads,
1000 queries and keys, bf16, GQA 4 in bf16 and float16, multi-query in bf16; the
exactness rule, <= 1 passes), then timed
(preprocess + main + convert, median of triton.testing.do_bench) against the Triton
family's backward of the same functions (flashgen.attention through autograd with
``FLASHGEN_FAMILIES=triton``, the shipped rows) at batch 8, 16 heads and seqlen 2048
(the ``user-examples`` preset's size) and 4096; each timing records which backward the
dispatcher itself picks there (``flashgen.explain``).  Writes gluon_user_bwd.json under
--out and prints a short table last.  ``relpos`` is T5's bias with its table frozen,
``relpos-learned`` with the table taking a gradient (checked too, and computed in the
timed backward of both families).

Usage (repository root, on the GPU):  python3 benchmarks/gluon_user_bwd.py --out $OUT
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.children import main_jobs  # noqa: E402

#: The examples of flashgen.user_examples the Gluon backward compiles: mask functions (a
#: band: window-causal), then score functions (their tensors without a gradient).
MASK_EXAMPLES = ("document", "document-causal", "prefix-lm", "window-causal")
SCORE_EXAMPLES = ("alibi", "softcap", "relpos", "relpos-learned")
EXAMPLES = MASK_EXAMPLES + SCORE_EXAMPLES
HEAD_DIMS = (64, 128)
#: (batch, heads, kv heads, seqlen, dtype) of the checks; (batch, heads, kv heads,
#: seqlen) of the timings (bf16): the ``user-examples`` preset's size, and one with enough
#: work for the dispatcher's untuned Gluon default at every example and head dim
#: (``family.DEFAULT_MIN_FLOPS``).
CHECKS = ((2, 16, 16, 1000, "bfloat16"), (2, 16, 4, 1000, "bfloat16"), (2, 16, 1, 1000, "bfloat16"),
          (2, 16, 4, 1000, "float16"))
TIMED = ((8, 16, 16, 2048), (8, 16, 16, 4096))


def _problem(name: str, d: int, b: int, h: int, hk: int, s: int, seed: int = 0, dtype: str = "bfloat16"):
    """Inputs (``dtype``, CUDA), the example, its score and mask functions, the mask mode
    its Gluon backward compiles, its bounds and the backward's UserArgs."""
    import torch

    from flashgen import user_examples, user_mods
    from flashgen.masks import mask_bounds

    ex = user_examples.make(name.removesuffix("-learned"), h, s, device="cuda", requires_grad=name.endswith("-learned"))
    score_mod, mask_mod = ex.functions(*ex.tensors)
    mode, lo, hi = mask_bounds(s, s, causal=ex.causal, window=tuple(ex.window))
    g = torch.Generator(device="cuda").manual_seed(seed)
    dt = getattr(torch, dtype)
    q, do = (torch.randn(b, h, s, d, device="cuda", dtype=dt, generator=g) for _ in range(2))
    k, v = (torch.randn(b, hk, s, d, device="cuda", dtype=dt, generator=g) for _ in range(2))
    score = user_mods.trace(score_mod, "score") if score_mod is not None else None
    mask = user_mods.trace(mask_mod, "mask") if mask_mod is not None else None
    ua = user_mods.kernel_args(score, mask, user_mods.score_grad_flags(score), None, (b, h, hk, s, s, lo, hi),
                               q.device, True)[1]
    mode = "window" if mask_mod is not None else mode
    return ex, (score_mod, mask_mod), mode, lo, hi, (q, k, v, do), ua


def _gluon_bwd(d, q, k, v, do, o, lse, mode, lo, hi, ua, stage_sync=False):
    from flashgen.families.gluon import bwd as B

    for g in ua.grads:  # the captured tensors' gradients, as flashgen.attention's backward zeroes them
        if g is not None:
            g.zero_()
    return B.attention_bwd(do, q, k, v, o, lse, softmax_scale=d ** -0.5, diag_lo=lo, diag_hi=hi, mask=mode,
                           config=B.default_config(d, str(q.dtype).removeprefix("torch."), mode), check=False,
                           user=ua, stage_sync=stage_sync)


def _child(name: str, d: int) -> dict:
    """Check (every CHECKS size) and time one example at one head dim."""
    import torch
    import triton

    import flashgen
    from flashgen import bench, user_mods

    out = {"name": name, "d": d, "checks": []}
    for b, h, hk, s, dtype in CHECKS:
        ex, (score_mod, mask_mod), mode, lo, hi, (q, k, v, do), ua = _problem(name, d, b, h, hk, s,
                                                                              seed=s + h + hk, dtype=dtype)
        with torch.no_grad():
            o, lse = flashgen.attention(q, k, v, causal=ex.causal, window=tuple(ex.window), score_mod=score_mod,
                                        mask_mod=mask_mod, return_lse=True)
        got = dict(zip(("dQ", "dK", "dV"), _gluon_bwd(d, q, k, v, do, o, lse, mode, lo, hi, ua, stage_sync=True)))
        names = ["dQ", "dK", "dV"]
        learned = [t for t in ex.tensors if t.requires_grad]
        for n, t in enumerate(learned):
            got[f"dT{n}"] = ua.grads[n].view(t.shape)
            names.append(f"dT{n}")
        refs = {}
        for dt in (torch.float64, q.dtype):
            qq, kk, vv = (t.detach().to(dt).requires_grad_() for t in (q, k, v))
            tt = [t.detach().to(torch.float64 if dt == torch.float64 else torch.float32).requires_grad_()
                  for t in learned]
            sm = ex.functions(*tt)[0] if learned else score_mod
            oo, _ = user_mods.reference(qq, kk, vv, d ** -0.5, lo, hi, score_mod=sm, mask_mod=mask_mod, dtype=dt)
            refs[dt] = torch.autograd.grad(oo, (qq, kk, vv, *tt), do.to(dt))
        res = bench._ratios(got, {n: (refs[torch.float64][i], refs[q.dtype][i]) for i, n in enumerate(names)},
                            q.dtype)
        out["checks"].append({"size": [b, h, hk, s], "dtype": dtype, "ratio": max(r for _, _, r in res.values()),
                              "errors": {n: [e, be] for n, (e, be, _) in res.items()}})
    out["ok"] = all(c["ratio"] <= 1.0 for c in out["checks"])
    if not out["ok"]:
        return out
    out["timings"] = []
    for b, h, hk, s in TIMED:
        ex, (score_mod, mask_mod), mode, lo, hi, (q, k, v, do), ua = _problem(name, d, b, h, hk, s)
        kw = dict(causal=ex.causal, window=tuple(ex.window), score_mod=score_mod, mask_mod=mask_mod)
        os.environ.pop("FLASHGEN_FAMILIES", None)
        flashgen.dispatch.default_dispatcher().clear()
        row = {"size": [b, h, hk, s], "dispatcher_backward": flashgen.explain(q, k, v, **kw).backward}
        with torch.no_grad():
            o, lse = flashgen.attention(q, k, v, return_lse=True, **kw)
        row["gluon_ms"] = triton.testing.do_bench(lambda: _gluon_bwd(d, q, k, v, do, o, lse, mode, lo, hi, ua),
                                                  warmup=25, rep=100)
        # the Triton family's backward of the same function, as the dispatcher runs it
        # with the Gluon family left out (its tuned rows where the databases have them)
        os.environ["FLASHGEN_FAMILIES"] = "triton"
        flashgen.dispatch.default_dispatcher().clear()
        row["triton_backward"] = flashgen.explain(q, k, v, **kw).backward
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        og = flashgen.attention(qg, kg, vg, **kw)
        row["triton_ms"] = triton.testing.do_bench(
            lambda: torch.autograd.grad(og, (qg, kg, vg), do, retain_graph=True), warmup=25, rep=100)
        row["speedup"] = row["triton_ms"] / row["gluon_ms"]
        out["timings"].append(row)
        del q, k, v, do, o, lse, qg, kg, vg, og
    os.environ.pop("FLASHGEN_FAMILIES", None)
    return out


def main() -> int:
    rows = main_jobs(__doc__, __file__, _child, "examples", EXAMPLES, HEAD_DIMS, ROOT, "gluon_user_bwd.json", "name")
    if rows is None:  # a child process
        return 0
    print("\nexample          d   ok   worst ratio  size (bf16)        gluon ms  triton ms  triton / gluon  "
          "the dispatcher's backward")
    for r in rows:
        worst = max((c["ratio"] for c in r.get("checks", [])), default=float("nan"))
        head = f"{r['name']:16} {r['d']:3}  {'yes' if r['ok'] else 'NO ':3}  {worst:11.3f}"
        if not r.get("timings"):
            print(f"{head}  {r.get('error', '')[:80]}")
        for t in r.get("timings", []):
            size = "x".join(map(str, t["size"]))
            print(f"{head}  {size:17} {t['gluon_ms']:8.3f}  {t['triton_ms']:9.3f}  {t['speedup']:14.3f}  "
                  f"{(t['dispatcher_backward'] or '')[:40]}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

"""User score/mask functions in the Gluon forward on the GPU: each example of
``flashgen.user_examples`` at the ``user-examples`` preset's size (batch 8, 16 heads,
seqlen 2048, head_dim 128, bf16), a few Gluon variants of its forward checked against
float64 first (``flashgen.user_tune.check``: awkward seqlens, NaN past seqlen_k, outputs
poisoned with NaN; ratio <= 1 passes), then the kernel alone timed (CUDA events, L2
flushed, median) beside the forward the dispatcher serves today for the same key
(``flashgen.attention``'s choice: a tuned row of either family, or the Triton default).
Each example runs in a child process with a timeout, so a kernel that never finishes is
reported instead of stopping the run.

    PYTHONPATH=. python3 benchmarks/gluon_user.py --out gluon_user.json [--cases a,b] [--timeout-s 150]

Prints one line per variant and a table last: example, variant, error ratio, ms, and the
served forward's ms.

``--walks``: beside those, the persistent walks (``persistent`` 2 and 3: one program per SM
slot taking its (query block, z * h) tiles longest first) of the one-consumer tile (BLOCK_N
64, two programs per SM) and of the two-consumer default.  ``user_tune.check`` checks a
walk at a seqlen that gives each program three tiles (``check_sizes``), so a mask
function's block-mask reads per tile of the walk run in the check.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing as mp
import sys
import time

#: Configs tried per example beside the Gluon default: (BLOCK_N, consumers, stages, pin).
CONFIGS = [(64, 2, 3, False), (64, 2, 2, True), (128, 2, 2, False)]


#: The walks ``--walks`` adds: (BLOCK_N, consumers, stages, programs per SM, persistent,
#: O staged in the Q buffers), and the one-consumer tile's program per tile beside them.
WALKS = [(64, 1, 2, 2, 2, False), (64, 1, 2, 2, 3, True), (64, 1, 2, 2, 0, False), (128, 2, 2, 1, 2, False),
         (128, 2, 2, 1, 3, False)]
def _run_example(name: str, walks: bool = False) -> list[dict]:
    import torch

    from flashgen import dispatch, families, user_tune
    from flashgen.bench import make_inputs, time_ms
    from flashgen.families.gluon import config as C
    from flashgen.families.gluon import family as F
    from flashgen.spec import Variant

    (p,) = [x for x in user_tune.preset_problems(["user-examples"]) if x.label == name]
    spec = p.spec("fwd")
    key = p.shape.key(spec)
    gluon = families.get("gluon")
    arch = dispatch.default_dispatcher().arch
    why = gluon.unsupported(key, arch)
    if why:
        return [dict(example=name, variant="-", error=f"not served: {why}")]
    gs = F.fwd_spec(key)
    cfgs = [C.default_config(gs)]
    for bn, nc, st, pin in CONFIGS:
        cr, pr = C.default_regs(nc)
        c = C.GluonFwdConfig(BLOCK_N=bn, num_consumers=nc, num_stages=st, pin_exps=pin, consumer_regs=cr,
                             producer_regs=pr)
        if c not in cfgs and C.valid(C.GluonFwdVariant(gs, c)):
            cfgs.append(c)
    if walks:
        for bn, nc, st, ctas, pers, oq in WALKS:
            cr, pr = C.default_regs(nc, ctas)
            c = C.GluonFwdConfig(BLOCK_N=bn, num_consumers=nc, num_stages=st, consumer_regs=cr, producer_regs=pr,
                                 ctas_per_sm=ctas, persistent=pers, o_in_q=oq)
            if c not in cfgs and C.valid(C.GluonFwdVariant(gs, c)):
                cfgs.append(c)
    # the forward served today, timed through the op (host time included, as a user sees it)
    q, k, v, _ = make_inputs(spec, p.shape, device="cuda", seed=3)
    ex_kw = dict(causal=p.causal, window=tuple(p.window), score_mod=p.score_mod, mask_mod=p.mask_mod, sinks=p.sinks)
    import flashgen

    with torch.no_grad():
        served_ms = time_ms(lambda: flashgen.attention(q, k, v, **ex_kw))
        choice = dispatch.default_dispatcher().choose(key, capturing=False)
    out = []
    for c in cfgs:
        variant = Variant(spec, F.tile_config(c))
        rec = dict(example=name, variant=C.GluonFwdVariant(gs, c).id, served_ms=served_ms,
                   served=f"{choice.config.family} {choice.source}")
        try:
            chk = user_tune.check(p, variant, arch)
            rec.update(ratio=chk["ratio"], ok=chk["ok"], message=chk["message"])
            if chk["ok"]:
                fwd, _ = p._args(p.shape.batch, p.shape.seqlen_q, p.shape.seqlen_k, p.lo, p.hi, backward=False)
                run = families.launcher("gluon", "fwd")
                kw = dict(softmax_scale=spec.head_dim ** -0.5, mask=p.mask, diag_lo=p.lo, diag_hi=p.hi,
                          config=variant.config, mods=fwd)
                rec["ms"] = time_ms(lambda: run(q, k, v, **kw))
        except Exception as e:  # reported per variant: a build or launch failure is a result here
            rec["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        print(json.dumps(rec), flush=True)
        out.append(rec)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="all")
    ap.add_argument("--timeout-s", type=float, default=150.0)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--walks", action="store_true",
                    help="also the persistent walks of 2 and 3, for mask functions too (module docstring)")
    a = ap.parse_args(argv)
    from flashgen.user_examples import NAMES

    names = list(NAMES) if a.cases == "all" else a.cases.split(",")
    t0 = time.time()
    rows = []
    ex = cf.ProcessPoolExecutor(max_workers=a.workers, mp_context=mp.get_context("spawn"))
    futs = {ex.submit(_run_example, n, a.walks): n for n in names}
    for f in futs:
        n = futs[f]
        try:
            rows += f.result(timeout=max(1.0, a.timeout_s - (time.time() - t0)))
        except cf.TimeoutError:
            rows.append(dict(example=n, variant="-", error=f"timed out after {a.timeout_s} s"))
        except Exception as e:
            rows.append(dict(example=n, variant="-", error=f"{type(e).__name__}: {str(e)[:400]}"))
    for proc in list(getattr(ex, "_processes", {}).values()):  # a hung child is killed, not waited for
        proc.kill()
    ex.shutdown(wait=False, cancel_futures=True)
    with open(a.out, "w") as fh:
        json.dump(rows, fh, indent=1)
    print(f"\n{'example':16s} {'variant':70s} {'ratio':>6s} {'ms':>8s} {'served ms':>9s}  served")
    for r in rows:
        print(f"{r['example']:16s} {r['variant'][:70]:70s} {r.get('ratio', float('nan')):6.3f} "
              f"{r.get('ms', float('nan')):8.4f} {r.get('served_ms', float('nan')):9.4f}  {r.get('served', '')}"
              + (f"  {r['error']}" if "error" in r else ""))
    bad = [r for r in rows if "error" in r or not r.get("ok", False)]
    print(f"{len(rows)} variants, {len(bad)} failed or not run")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

"""The Gluon backward on ragged batches (``bwd_varlen``) on the H200: every listed
variant checked against float64, then timed on packed documents beside the Triton
family's tuned ``bwd_dq_varlen`` + ``bwd_dkdv_varlen`` in the same run.

Each variant is checked in a child process with a timeout (a kernel that never
finishes is reported, not waited for) by :func:`flashgen.bench.check_variant_detail`:
lengths not multiples of any block, seqlen_q > seqlen_k and < on different sequences,
empty sequences on either side, outputs poisoned with NaN, and 200 skewed sequences;
bfloat16 and float16, GQA groups 1 and 4.  Then each variant that passed is timed
(``triton.testing.do_bench``, median ms, L2 flushed; every launch of the backward: the
Gluon family's three, the Triton family's two kernels and its dQ pass's preprocess) on
the ``varlen-docs`` preset's problems (32 query / 8 key-value heads, head_dim 128,
documents of :func:`flashgen.spec.varlen_lengths`, 22-26k tokens; causal and not) and
on ``benchmarks/varlen_bench.py``'s problems (and two sliding-window ones), beside the dispatcher's choice with
``FLASHGEN_FAMILIES=triton`` (the two kernels) and without (its choice between both
families).  TFLOP/s on useful FLOPs (visible pairs, 2.5x the forward's; windows
of ``bench.TIMING_WINDOW``).  The launchers
are called directly (no public-call host work); each timed output of documents of at
most 2048 tokens is checked against float64 too.

    PYTHONPATH=. python3 benchmarks/gluon_varlen_bwd.py --out bench_out/gluon-varlen-bwd    # GPU

``--time-only``: no variant checks; the two dispatcher choices only.
"""

from __future__ import annotations

import json
import os
import sys

#: (name, head_dim, mask, GluonBwdConfig fields over the varlen default) of the variants
#: checked and timed.
VARIANTS = [
    ("default", 128, "none", None),
    ("default", 128, "causal", None),
    ("default", 128, "window", None),
    ("default", 64, "none", None),
    ("default", 64, "causal", None),
    ("dqw", 128, "causal", dict(dq_writer=True)),
    ("dqw", 128, "none", dict(dq_writer=True)),
    ("s3", 128, "causal", dict(stages=3)),
    ("rows1", 128, "causal", dict(row_load="producer")),
    ("m128", 64, "none", dict(block_m=128, stages=2, split=False)),
    ("m128", 64, "causal", dict(block_m=128, stages=2, split=False)),
]


def _tile(d: int, mask: str, kw):
    import dataclasses

    from flashgen.families.gluon import bwd as B
    from flashgen.families.gluon.family import tile_config

    c = B.varlen_default_config(d, "bfloat16", mask)
    return tile_config(dataclasses.replace(c, **kw) if kw else c)


def _check(i: int) -> dict:
    from flashgen import bench
    from flashgen.spec import KernelSpec, Variant

    name, d, mask, kw = VARIANTS[i]
    out = []
    for dtype in ("bfloat16", "float16"):
        v = Variant(KernelSpec("bwd_varlen", dtype, d, d, mask), _tile(d, mask, kw))
        for group in (1, 4):
            det = bench.check_variant_detail(v, group=group, device="cuda")
            out.append(dict(variant=v.id, dtype=dtype, group=group, ok=det["ok"], ratio=det["ratio"],
                            message=det["message"]))
    return dict(name=name, d=d, mask=mask, checks=out)


def _problems():
    """(tag, lengths, num_heads, num_kv_heads, head_dim, mask): the varlen-docs preset's
    and varlen_bench.py's."""
    import varlen_bench as vb

    from flashgen import bench

    out = [(f"varlen-docs docs{n} 32/8", bench.varlen_lengths(16384 // n * 2, n), 32, 8, 128, mask)
           for mask in ("causal", "none") for n in (512, 1024, 2048, 4096, 8192)]
    # sliding windows (bench.TIMING_WINDOW, bottom-right per document), as the tuner times them
    out += [(f"varlen-docs docs{n} 32/8 window", bench.varlen_lengths(16384 // n * 2, n), 32, 8, 128, "window")
            for n in (2048, 8192)]
    # multi-query attention (one kv head: a program walks all 32 query heads)
    out += [(f"varlen-docs docs{n} 32/1", bench.varlen_lengths(16384 // n * 2, n), 32, 1, 128, mask)
            for mask in ("causal", "none") for n in (1024, 4096)]
    for p in vb.problems(False):
        out.append((vb.label(p), vb.doc_lengths(p["dist"]), p["num_heads"], p["num_kv_heads"], p["head_dim"],
                    "causal" if p["causal"] else "none"))
    return out


def _visible_pairs(seqlen_q: int, seqlen_k: int, left: int, right: int) -> int:
    """(query, key) pairs a sequence's mask lets through, bottom-right aligned; -1 unbounded."""
    off = seqlen_k - seqlen_q
    total = 0
    for i in range(seqlen_q):
        lo = 0 if left < 0 else max(0, i + off - left)
        hi = seqlen_k - 1 if right < 0 else min(seqlen_k - 1, i + off + right)
        total += max(0, hi - lo + 1)
    return total


def _time(rows_ok, reps_ms: float) -> list[dict]:
    import torch
    import triton

    from flashgen import bench, dispatch, families, library

    disp = dispatch.default_dispatcher()
    caller = os.environ.get("FLASHGEN_FAMILIES")
    out = []
    for tag, lens, h, hk, d, mask in _problems():
        from flashgen.spec import KernelSpec

        spec = KernelSpec("bwd_varlen", "bfloat16", d, d, mask)
        q, k, v, do, cu_q, cu_k, mq, mk = bench.make_varlen_inputs(spec, lens, lens, h, hk, seed=7)
        kw = bench._varlen_mask_kw(spec, None)
        pairs = sum(_visible_pairs(n, n, kw["win_left"], kw["win_right"]) for n in lens)
        flops = 2.5 * 4 * pairs * d * h
        o, lse = library.forward_varlen(q, k, v, cu_q, cu_k, mq, mk, kw["softmax_scale"], mask, kw["win_left"],
                                        kw["win_right"])
        cands = []
        for which, allowed in (("triton", "triton"), ("dispatcher", "")):
            os.environ["FLASHGEN_FAMILIES"] = allowed
            disp.clear()
            cands.append((which, library.varlen_backward_kernels(q, k, v, mask, len(lens), mq, mk, False)))
        if caller is None:
            os.environ.pop("FLASHGEN_FAMILIES", None)
        else:
            os.environ["FLASHGEN_FAMILIES"] = caller
        disp.clear()
        cands += [(r["name"], (_tile(d, mask, r["kw"]), None)) for r in rows_ok if r["d"] == d and r["mask"] == mask]
        row = dict(problem=tag, mask=mask, head_dim=d, heads=f"{h}/{hk}", docs=len(lens), longest=max(lens), runs=[])
        for name, plan in cands:
            if len(plan) == 2 and isinstance(plan[0], tuple):
                (cq, mq_), (ck, mk_) = plan
                launch = families.launcher(cq.family, "bwd_varlen")
                call = (lambda: launch(do, q, k, v, o, lse, cu_q, cu_k, mq, mk, config_dq=cq, config_dkdv=ck,  # noqa: E731
                                       module_dq=mq_, module_dkdv=mk_, **kw))
                label = f"{cq.family} {cq.id} + {ck.id}"
            else:
                cfg, mod = plan
                launch = families.launcher(cfg.family, "bwd_varlen")
                call = lambda: launch(do, q, k, v, o, lse, cu_q, cu_k, mq, mk, config=cfg, module=mod, **kw)  # noqa: E731
                label = f"{cfg.family} {cfg.id}"
            try:
                ms = triton.testing.do_bench(call, rep=reps_ms)
                dq, dk, dv = call()
            except Exception as e:  # noqa: BLE001 - reported in the table
                row["runs"].append(dict(name=name, config=label, error=f"{type(e).__name__}: {str(e)[:200]}"))
                continue
            res = bench.compare_varlen({"dQ": dq, "dK": dk, "dV": dv}, q, k, v, do, cu_q, cu_k, kw=kw) \
                if max(lens) <= 2048 else {}
            row["runs"].append(dict(name=name, config=label, ms=ms, tflops=flops / ms * 1e-9,
                                    ratio=max((r[2] for r in res.values()), default=None)))
            torch.cuda.synchronize()
        base = next((r["ms"] for r in row["runs"] if r["name"] == "triton" and "ms" in r), None)
        for r in row["runs"]:
            ratio = "" if r.get("ratio") is None else f"{r['ratio']:.3f}"
            speed = f"{base / r['ms']:.2f}x" if base and "ms" in r else ""
            print(f"| {tag} | {r['name']} | {r['config'][:60]} | "
                  + (f"{r['ms']:.4f} | {r['tflops']:.0f} | {speed} | {ratio} |" if "ms" in r else
                     f"error: {r['error'][:80]} | | | |"), flush=True)
        out.append(row)
    return out


def main(argv=None) -> int:
    from gluon_varlen import check_in_children, no_gpu, select_variants, variant_parser

    a = variant_parser(__doc__, "bench_out/gluon_varlen_bwd", 300.0, 40.0,
                       "the two dispatcher choices only (no variant checks)").parse_args(argv)
    if no_gpu("gluon_varlen_bwd.py"):
        return 2
    os.makedirs(a.out, exist_ok=True)
    select_variants(VARIANTS, a)
    checked = check_in_children(_check, VARIANTS, a.timeout_s, a.workers)
    with open(os.path.join(a.out, "checks.json"), "w") as f:
        json.dump(checked, f, indent=1)
    ok_rows = [r for r in checked if r["checks"] and all(c["ok"] for c in r["checks"])]
    print("\n| problem | run | config | ms | TFLOP/s | over triton | ratio |\n|---|---|---|---|---|---|---|",
          flush=True)
    timed = _time(ok_rows, a.rep_ms)
    with open(os.path.join(a.out, "timings.json"), "w") as f:
        json.dump(timed, f, indent=1)
    return 0 if len(ok_rows) == len(checked) else 1


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())

"""The Gluon forward on ragged batches (``fwd_varlen``) on the H200: every listed
variant checked against float64, then timed on packed documents beside the Triton
family's varlen forward in the same run.

Each variant is checked in a child process with a timeout (a kernel that never
finishes is reported, not waited for) by :func:`flashgen.bench.check_variant_detail`:
lengths not multiples of any block, seqlen_q > seqlen_k and < on different sequences,
empty sequences on either side, outputs poisoned with NaN, and 200 skewed sequences (the
packed program layout); bfloat16 and float16, GQA groups 1 and 4.  Then each variant that passed is timed (``triton.testing.do_bench``,
median ms, L2 flushed) on the ``varlen-docs`` preset's problems (Llama-3-8B heads, 32
query / 8 key-value heads, head_dim 128, documents drawn by
:func:`flashgen.spec.varlen_lengths`, 22-26k tokens; causal and not) beside the
dispatcher's choice and the fastest row of each kernel family in the databases it
reads.  TFLOP/s on useful FLOPs (visible pairs).  The kernels are launched directly
(no public-call host work: :func:`flashgen.attention_varlen` also copies cu_seqlens to
the host once per call).

    PYTHONPATH=. python3 benchmarks/gluon_varlen.py --out bench_out/gluon-varlen    # GPU

``--time-only``: no checks; the dispatcher's choice and each family's fastest row.
``--suite-kernels``: the forward kernels alone on ``benchmarks/varlen_bench.py``'s
head_dim 128 problems, the dispatcher's choice beside its choice under
``FLASHGEN_FAMILIES=triton`` (``suite_kernels.json``).  ``--api-profile``: the public
call's wall time, its time between CUDA events, do_bench of the call and of the
launcher alone, the kernels' device time (torch.profiler) and cProfile's top host
functions, on one problem.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing as mp
import os
import sys
import time

#: (name, head_dim, mask, TileConfig fields) of the variants checked and timed.
VARIANTS = [
    ("default", 128, "none", None),
    ("default", 128, "causal", None),
    ("default", 64, "none", None),
    ("default", 64, "causal", None),
    ("default", 96, "causal", None),
    ("default", 256, "none", None),
    ("default", 128, "window", None),
    ("nopin", 128, "none", dict(pin=0)),
    ("nopin", 128, "causal", dict(pin=0)),
    ("x1n64x2", 128, "causal", dict(BLOCK_N=64, num_warps=4, num_stages=2, ctas_per_sm=2)),
    ("x1n64x2", 128, "none", dict(BLOCK_N=64, num_warps=4, num_stages=2, ctas_per_sm=2)),
    ("n64mf", 128, "causal", dict(BLOCK_N=64, masked_first=1)),
    ("n64skip", 128, "causal", dict(BLOCK_N=64, masked_first=1, skip_masked=1)),
    ("sermask", 128, "causal", dict(pin=1, serial_masked=1)),
    ("x3", 64, "causal", dict(BLOCK_N=64, num_warps=4, num_stages=3, ctas_per_sm=3)),
    ("m128", 64, "none", dict(BLOCK_M=128, BLOCK_N=64, num_stages=4, pin=1)),
]

#: Timed problems: (tag, documents, longest document, mask); 16k tokens at the preset's.
PROBLEMS = [(f"docs{n}", 16384 // n * 2, n, mask) for mask in ("causal", "none") for n in (512, 1024, 2048, 4096, 8192)]


def _tile(name, d, mask, kw):
    from flashgen.families.gluon.family import FAMILY, tile_config
    from flashgen.families.gluon import config as C
    from flashgen.spec import TileConfig

    if kw is None:
        return tile_config(C.default_config(C.GluonFwdSpec("bfloat16", d, d, mask, varlen=True)))
    base = dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=2)
    base.update(kw)
    return TileConfig(base.pop("BLOCK_M"), base.pop("BLOCK_N"), base.pop("num_warps"), base.pop("num_stages"),
                      family="gluon", **base)


def _check(i: int) -> dict:
    from flashgen import bench
    from flashgen.spec import KernelSpec, Variant

    name, d, mask, kw = VARIANTS[i]
    out = []
    for dtype in ("bfloat16", "float16"):
        v = Variant(KernelSpec("fwd_varlen", dtype, d, d, mask), _tile(name, d, mask, kw))
        for group in (1, 4):
            det = bench.check_variant_detail(v, group=group, device="cuda")
            out.append(dict(variant=v.id, dtype=dtype, group=group, ok=det["ok"], ratio=det["ratio"],
                            message=det["message"]))
    return dict(name=name, d=d, mask=mask, checks=out)


def _time(rows_ok, reps_ms: float) -> list[dict]:
    import torch
    import triton

    from flashgen import bench, dispatch, families, library
    from flashgen.db import TuningDB
    from flashgen.spec import KernelSpec, ProblemKey, Variant

    disp = dispatch.default_dispatcher()
    # the fastest row of each family for each key, in the databases the dispatcher reads
    best_rows: dict = {}
    for path in reversed(disp.databases()):
        with TuningDB(path) as db:
            for key_id, rows in db.best_configs_by_family(disp.env).items():
                best = best_rows.setdefault(key_id, {})
                for cfg, row in rows:
                    if cfg.family not in best or row["median_ms"] < best[cfg.family][1]:
                        best[cfg.family] = (cfg, row["median_ms"])
    out = []
    for tag, n_docs, longest, mask in PROBLEMS:
        lens = bench.varlen_lengths(n_docs, longest)
        spec = KernelSpec("fwd_varlen", "bfloat16", 128, 128, mask)
        q, k, v, do, cu_q, cu_k, mq, mk = bench.make_varlen_inputs(spec, lens, lens, 32, 8, seed=7)
        kw = bench._varlen_mask_kw(spec, dict(causal=mask == "causal", window=(-1, -1)))
        pairs = sum(n * (n + 1) // 2 if mask == "causal" else n * n for n in lens)
        flops = 4 * pairs * 128 * 32
        cfg_t, _ = library.varlen_kernel_for("fwd_varlen", q, k, v, mask, len(lens), mq, mk)
        key = ProblemKey.from_varlen_sizes(spec, batch=len(lens), num_heads=32, num_kv_heads=8, max_seqlen_q=mq,
                                           max_seqlen_k=mk)
        best = best_rows.get(key.id, {})
        cands = [("dispatcher", cfg_t)] + [(f"best {f} row", c) for f, (c, _) in sorted(best.items())] + \
            [(r["name"], _tile(r["name"], 128, mask, r["kw"])) for r in rows_ok if r["d"] == 128 and r["mask"] == mask]
        for name, cfg in cands:
            launch = families.launcher(cfg.family, "fwd_varlen")
            try:
                ms = triton.testing.do_bench(lambda: launch(q, k, v, cu_q, cu_k, mq, mk, config=cfg, **kw),
                                             rep=reps_ms)
            except Exception as e:  # noqa: BLE001 - reported in the table
                out.append(dict(problem=tag, mask=mask, name=name, family=cfg.family, error=str(e)[:200]))
                continue
            o, lse = launch(q, k, v, cu_q, cu_k, mq, mk, config=cfg, **kw)
            res = bench.compare_varlen({"O": o, "LSE": lse}, q, k, v, do, cu_q, cu_k, kw=kw) if longest <= 2048 \
                else {}
            out.append(dict(problem=tag, mask=mask, name=name, family=cfg.family,
                            variant=Variant(spec, cfg).id, ms=ms, tflops=flops / ms * 1e-9,
                            ratio=max((r[2] for r in res.values()), default=None)))
            torch.cuda.synchronize()
    return out


def _api_profile(n: int = 200) -> None:
    """Host time of the public call: wall time per ``flashgen.attention_varlen`` forward
    (it synchronizes on cu_seqlens) on 9 documents of up to 2992 tokens, 16 / 4 heads,
    head_dim 128, and cProfile's top functions over ``n`` calls."""
    import cProfile
    import pstats

    import torch

    import flashgen
    from flashgen import bench, families
    from flashgen.spec import KernelSpec

    spec = KernelSpec("fwd_varlen", "bfloat16", 128, 128, "none")
    lens = [2328, 1442, 1323, 2430, 1629, 2992, 2675, 918, 647]
    q, k, v, do, cu_q, cu_k, mq, mk = bench.make_varlen_inputs(spec, lens, lens, 16, 4, seed=3)

    def call():
        return flashgen.attention_varlen(q, k, v, cu_q, cu_k, mq, mk)

    for _ in range(20):
        call()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        call()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / n * 1e6
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        call()
    end.record()
    torch.cuda.synchronize()
    print(f"api: {wall:.0f} us wall per call, {start.elapsed_time(end) / n * 1e3:.0f} us between events per call",
          flush=True)
    import triton

    from flashgen import library

    cfg, mod = library.varlen_kernel_for("fwd_varlen", q, k, v, "none", len(lens), mq, mk)
    launch = families.launcher(cfg.family, "fwd_varlen")
    kw = dict(softmax_scale=128 ** -0.5, mask="none", win_left=-1, win_right=-1)
    api = triton.testing.do_bench(call, rep=100)
    kern = triton.testing.do_bench(lambda: launch(q, k, v, cu_q, cu_k, mq, mk, config=cfg, module=mod, **kw),
                                   rep=100)
    print(f"{cfg.family} {cfg.id}: do_bench of attention_varlen: {api * 1e3:.0f} us; of the launcher alone: "
          f"{kern * 1e3:.0f} us", flush=True)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            call()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8), flush=True)
    cprof = cProfile.Profile()
    cprof.enable()
    for _ in range(n):
        call()
    torch.cuda.synchronize()
    cprof.disable()
    pstats.Stats(cprof).sort_stats("tottime").print_stats(6)


def _suite_kernels(rep_ms: float) -> list[dict]:
    """The forward kernels alone (the launcher, no public-call host work) on the head_dim
    128 problems of ``benchmarks/varlen_bench.py``: the dispatcher's choice beside the
    choice it makes with FLASHGEN_FAMILIES=triton, same inputs, same run."""
    import torch
    import triton

    import varlen_bench as vb
    from flashgen import bench, dispatch, families, library
    from flashgen.spec import KernelSpec

    disp = dispatch.default_dispatcher()
    caller = os.environ.get("FLASHGEN_FAMILIES")
    out = []
    for p in vb.problems(False):
        if p["head_dim"] != 128:
            continue
        lens = vb.doc_lengths(p["dist"])
        mask = "causal" if p["causal"] else "none"
        spec = KernelSpec("fwd_varlen", "bfloat16", 128, 128, mask)
        q, k, v, do, cu_q, cu_k, mq, mk = bench.make_varlen_inputs(spec, lens, lens, p["num_heads"],
                                                                   p["num_kv_heads"], seed=5)
        kw = bench._varlen_mask_kw(spec, dict(causal=p["causal"], window=(-1, -1)))
        flops = vb.fwd_flops(lens, p["num_heads"], 128, 128, p["causal"])
        row = dict(problem=vb.label(p))
        for tag, allowed in (("all", ""), ("triton", "triton")):
            os.environ["FLASHGEN_FAMILIES"] = allowed
            disp.clear()
            cfg, mod = library.varlen_kernel_for("fwd_varlen", q, k, v, mask, len(lens), mq, mk)
            launch = families.launcher(cfg.family, "fwd_varlen")
            ms = triton.testing.do_bench(lambda: launch(q, k, v, cu_q, cu_k, mq, mk, config=cfg, module=mod, **kw),
                                         rep=rep_ms)
            row[tag] = dict(config=f"{cfg.family} {cfg.id}", ms=ms, tflops=flops / ms * 1e-9)
        if caller is None:
            os.environ.pop("FLASHGEN_FAMILIES", None)
        else:
            os.environ["FLASHGEN_FAMILIES"] = caller
        disp.clear()
        out.append(row)
        print(f"| {row['problem']} | {row['all']['config']} | {row['all']['ms']:.4f} | {row['all']['tflops']:.0f} | "
              f"{row['triton']['config']} | {row['triton']['ms']:.4f} | {row['triton']['tflops']:.0f} | "
              f"{row['triton']['ms'] / row['all']['ms']:.2f}x |", flush=True)
        torch.cuda.synchronize()
    return out


def check_in_children(check, variants, timeout_s: float, workers: int) -> list[dict]:
    """``check(i)`` for each of ``variants`` ((name, head_dim, mask, knobs) tuples), each
    in a fresh spawned process (a kernel that faults leaves its process's CUDA context
    unusable) with ``timeout_s`` for all of them (a kernel that never finishes is
    reported, not waited for); prints one PASS / FAIL line per variant.  Returns the
    results, each with ``kw`` (the knobs) and, on a crash or timeout, ``error``."""
    t0 = time.time()
    ex = cf.ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn"), max_tasks_per_child=1)
    futs = [ex.submit(check, i) for i in range(len(variants))]
    checked = []
    for i, f in enumerate(futs):
        name, d, mask, kw = variants[i]
        try:
            r = f.result(timeout=max(1.0, timeout_s - (time.time() - t0)))
        except Exception as e:  # noqa: BLE001 - a hang or a crash is the finding
            r = dict(name=name, d=d, mask=mask, checks=[], error=f"{type(e).__name__}: {str(e)[:300]}")
        r["kw"] = kw
        checked.append(r)
        ok = bool(r["checks"]) and all(c["ok"] for c in r["checks"])
        worst = max((c["ratio"] for c in r["checks"]), default=float("nan"))
        print(f"check {name:10s} d{d:<4d}{mask:7s} {'PASS' if ok else 'FAIL'} worst ratio {worst:.3f} "
              f"{r.get('error', '') or ' '.join(c['message'] for c in r['checks'] if not c['ok'])[:300]}", flush=True)
    ex.shutdown(wait=False, cancel_futures=True)
    return checked


def variant_parser(doc: str, out: str, timeout_s: float, rep_ms: float, time_only: str) -> argparse.ArgumentParser:
    """The arguments of a script that checks variants in children, then times them:
    --out, --timeout-s, --workers, --rep-ms, --only, --time-only (``time_only``: its help)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--out", default=out)
    ap.add_argument("--timeout-s", type=float, default=timeout_s)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rep-ms", type=float, default=rep_ms)
    ap.add_argument("--only", default=None, help="comma-separated variant names to check and time (default: all)")
    ap.add_argument("--time-only", action="store_true", help=time_only)
    return ap


def no_gpu(script: str) -> bool:
    """True (after saying so on stderr) when no CUDA GPU is visible."""
    import torch

    if torch.cuda.is_available():
        return False
    print(f"{script}: needs a CUDA GPU (sm_90); none is visible", file=sys.stderr)
    return True


def select_variants(variants: list, a) -> None:
    """Keep in ``variants`` what --time-only (none) or --only (those names) asks for."""
    if a.time_only:
        variants[:] = []
    elif a.only:
        variants[:] = [v for v in variants if v[0] in a.only.split(",")]


def main(argv=None) -> int:
    ap = variant_parser(__doc__, "bench_out/gluon_varlen", 240.0, 60.0,
                        "time the dispatcher's choice and each family's best row only (no variant checks)")
    ap.add_argument("--api-profile", action="store_true", help="the public call's host time and profile only")
    ap.add_argument("--suite-kernels", action="store_true",
                    help="the forward kernels alone on varlen_bench.py's head_dim 128 problems, both families' "
                         "choices (no variant checks)")
    a = ap.parse_args(argv)
    if no_gpu("gluon_varlen.py"):
        return 2
    if a.api_profile:
        _api_profile()
        return 0
    if a.suite_kernels:
        os.makedirs(a.out, exist_ok=True)
        print("| problem | dispatcher | ms | TFLOP/s | FLASHGEN_FAMILIES=triton | ms | TFLOP/s | speedup |\n"
              "|---|---|---|---|---|---|---|---|", flush=True)
        rows = _suite_kernels(a.rep_ms)
        with open(os.path.join(a.out, "suite_kernels.json"), "w") as f:
            json.dump(rows, f, indent=1)
        return 0
    os.makedirs(a.out, exist_ok=True)
    select_variants(VARIANTS, a)
    checked = check_in_children(_check, VARIANTS, a.timeout_s, a.workers)
    ok_rows = [r for r in checked if r["checks"] and all(c["ok"] for c in r["checks"])]
    timed = _time(ok_rows, a.rep_ms) if ok_rows or a.time_only else []
    with open(os.path.join(a.out, "gluon_varlen.json"), "w") as f:
        json.dump(dict(checks=checked, timings=timed), f, indent=1)
    print("\n| problem | mask | variant | family | ms | TFLOP/s | ratio |\n|---|---|---|---|---|---|---|")
    for t in timed:
        if "error" in t:
            print(f"| {t['problem']} | {t['mask']} | {t['name']} | {t['family']} | error: {t['error'][:80]} | | |")
        else:
            r = "" if t["ratio"] is None else f"{t['ratio']:.3f}"
            print(f"| {t['problem']} | {t['mask']} | {t['name']} | {t['family']} | {t['ms']:.4f} | {t['tflops']:.0f} "
                  f"| {r} |")
    return 0 if len(ok_rows) == len(checked) else 1


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())

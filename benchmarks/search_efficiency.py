"""Issue 4's search-efficiency question, answered from an exhaustive run: how many Optuna
(TPE) trials does flashgen's tuner need to come within 2% of the exhaustive best?

Input: a tuning DB in which keys were tuned with ``--sampler grid`` (every valid,
feasible config measured once), e.g.
docs/results/h200/tuning/search-efficiency/grid_exhaustive_16keys.sqlite
from ``benchmarks/multi_gpu_tune.py`` on the H200.  For each chosen key the recorded
timings are replayed through the real tuner (``tuner.tune_key`` with a FakeBenchmarker:
same study, sampler, constraints and default-first enqueue as ``flashgen tune``), for
many seeds, and the number of distinct configs measured until the best-so-far first
comes within ``--within`` of the exhaustive best is counted (a config TPE suggests again
reuses its stored row and costs no measurement; the budget is 3x the space in measured
trials, as ``flashgen tune --trials`` counts them: a config the rules or the shared-memory
estimate reject is not counted; not reaching the target counts as the whole space).
Three starts are reported: ``shipped`` (the tuner's current heuristic default is
measured and enqueued first; on sm_90 that default was itself picked from this
exhaustive data, so it is a head start), ``unbiased`` (the pre-TMA default of the
previous templates is enqueued instead, then TPE alone) and ``transfer`` (that default,
then the winners of the nearest other keys of the exhaustive data, leave-one-out:
:func:`flashgen.tuner.transfer_configs`).

The replay searches only the kernel families the exhaustive rows measured (the Triton
family: a config of another family has no timing to replay), and its environment is a
synthetic GPU's (:data:`flashgen.env.SYNTHETIC_GPU_SUFFIXES`): a real GPU's name makes
the tuner measure and enqueue the shipped databases' rows of a sibling GPU
(:func:`flashgen.tuner.prior_configs`), which for these keys are the H200's tuned
winners, so every start would be within 2% by the second config.

No GPU needed.  The keys of docs/benchmarks.md:
    python3 benchmarks/search_efficiency.py \\
        docs/results/h200/tuning/search-efficiency/grid_exhaustive_16keys.sqlite \\
        --key attn_fwd_d128_bf16_none_g1_q1024_k1024_bh256 \\
        --key attn_fwd_d64_bf16_none_g1_q2048_k2048_bh256 \\
        --key attn_bwd_dq_d128_bf16_none_g1_q1024_k1024_bh256 \\
        --key attn_bwd_dkdv_d128_bf16_none_g1_q2048_k2048_bh128 \\
        --seeds 10 --out search_efficiency.json
(``--keys N`` instead takes the first key of each kernel in key-id order, then the
rest: another set.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("db", help="tuning DB with exhaustive (grid) rows")
    ap.add_argument("--keys", type=int, default=4, help="how many keys (one per kernel first)")
    ap.add_argument("--key", action="append", default=None, help="explicit key ids (instead of --keys)")
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--within", type=float, default=0.02)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import optuna

    from flashgen import heuristics, tuner
    from flashgen.arch import by_sm
    from flashgen.db import TuningDB
    from flashgen.env import SYNTHETIC_GPU_SUFFIXES, Environment
    from flashgen.spec import Measurement, ProblemKey, Shape, TileConfig, Variant

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    arch = by_sm("sm_90")
    with TuningDB(args.db, readonly=True) as src:
        rows = src.rows()
    by_key: dict[str, list[dict]] = {}
    for r in rows:
        by_key.setdefault(r["key"], []).append(r)
    # one key per kernel first, then the rest, in a stable order
    order, seen = [], set()
    for k in sorted(by_key):
        kern = by_key[k][0]["kernel"]
        if kern not in seen:
            order.append(k)
            seen.add(kern)
    order += [k for k in sorted(by_key) if k not in order]
    chosen = args.key or order[:args.keys]
    unknown = [k for k in chosen if k not in by_key]
    if unknown:
        ap.error(f"no rows of {', '.join(unknown)} in {args.db}")
    # The families the exhaustive rows measured: the only ones whose configs have a timing.
    measured_families = sorted({TileConfig.from_dict(r).family for r in rows})

    old_default = {"fwd": TileConfig(128, 64, 8, 3), "bwd_dkdv": TileConfig(64, 128, 8, 2),
                   "bwd_dq": TileConfig(128, 64, 8, 2)}
    results = []
    for kid in chosen:
        krows = by_key[kid]
        key = ProblemKey.from_row(krows[0])
        r0 = krows[0]
        shape = Shape(r0["batch"], r0["num_heads"], r0["num_kv_heads"], r0["seqlen_q"], r0["seqlen_k"])
        timings = {r["variant_id"]: (r["median_ms"] if r["status"] == "ok" else
                                     Measurement(r["status"], error=r["error"])) for r in krows
                   if r["status"] not in ("invalid", "infeasible")}
        ok = {v: t for v, t in timings.items() if isinstance(t, float)}
        best_ms = min(ok.values())
        space_size = len(krows)  # every config of the domain has a row (ok, invalid or infeasible)
        target = best_ms * (1 + args.within)
        res = {"key": kid, "space": space_size, "budget_trials": 3 * space_size, "measurable": len(timings), "best_ms": best_ms,
               "best_variant": min(ok, key=ok.get)}
        # leave-one-out: the best row of every other key of the exhaustive data
        others = []
        for okid, orows in by_key.items():
            ok_rows = [r for r in orows if r["status"] == "ok"]
            if okid != kid and ok_rows:
                others.append(min(ok_rows, key=lambda r: r["median_ms"]))
        for start in ("shipped", "unbiased", "transfer"):
            needed = []
            for seed in range(args.seeds):
                # A synthetic GPU: no shipped row of a sibling GPU is measured first.
                env = Environment("replay" + SYNTHETIC_GPU_SUFFIXES[0], "9.0", 132, "3.6.0", "replay", "0")
                with tempfile.TemporaryDirectory() as td, TuningDB(Path(td) / "r.sqlite") as db:
                    saved = heuristics.default_config
                    if start == "transfer":  # the other keys already tuned in this DB
                        for r in others:
                            okey = ProblemKey.from_row(r)
                            oshape = Shape(r["batch"], r["num_heads"], r["num_kv_heads"], r["seqlen_q"], r["seqlen_k"])
                            db.record(okey, oshape, Variant(okey.spec, TileConfig.from_dict(r)),
                                      Measurement("ok", median_ms=r["median_ms"]), env, r["smem_bytes_model"] or 0)
                    if start in ("unbiased", "transfer"):
                        heuristics.default_config = lambda spec, a, key=None: old_default[spec.kernel]
                    try:
                        seen_best, hit, distinct = float("inf"), None, set()

                        def on_trial(k, n_done, n_total, row):
                            # A config TPE suggests again reuses its stored row (no new
                            # measurement): count distinct configs measured.
                            nonlocal seen_best, hit
                            distinct.add(row["variant_id"])
                            if row["status"] == "ok":
                                seen_best = min(seen_best, row["median_ms"])
                            if hit is None and seen_best <= target:
                                hit = len(distinct)

                        tuner.tune_key(key, shape, benchmarker=tuner.FakeBenchmarker(timings), db=db, env=env,
                                       arch=arch, n_trials=3 * space_size, storage=optuna.storages.InMemoryStorage(),
                                       seed=seed, on_trial=on_trial, sampler="tpe",
                                       family_names=measured_families)
                    finally:
                        heuristics.default_config = saved
                needed.append(hit if hit is not None else space_size)
            needed.sort()
            res[start] = {"trials_to_within": needed, "median": statistics.median(needed),
                          "p90": needed[int(0.9 * (len(needed) - 1))], "max": needed[-1],
                          "median_fraction_of_space": statistics.median(needed) / space_size}
        results.append(res)
        print(f"{kid}: space {space_size} ({len(timings)} measurable), best {res['best_variant']} "
              f"{best_ms:.4f} ms; trials to within {args.within:.0%}: shipped median {res['shipped']['median']} "
              f"(p90 {res['shipped']['p90']}), unbiased median {res['unbiased']['median']} "
              f"(p90 {res['unbiased']['p90']}, max {res['unbiased']['max']}), transfer median "
              f"{res['transfer']['median']} (p90 {res['transfer']['p90']}, max {res['transfer']['max']})", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"within": args.within, "seeds": args.seeds, "keys": results}, indent=1))
    print(f"\n{'key':<52} {'space':>5} {'shipped med/p90':>16} {'unbiased med/p90/max':>21} "
          f"{'transfer med/p90/max':>21} {'quarter':>8}")
    for r in results:
        s, u, t = r["shipped"], r["unbiased"], r["transfer"]
        print(f"{r['key']:<52} {r['space']:5d} {s['median']:>8}/{s['p90']:<7} {u['median']:>8}/{u['p90']}/{u['max']:<6} "
              f"{t['median']:>8}/{t['p90']}/{t['max']:<6} {r['space'] / 4:8.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

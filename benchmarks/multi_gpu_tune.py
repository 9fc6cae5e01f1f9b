"""Issue 7 on a multi-GPU machine: the same keys tuned by 1 worker and by N workers.

Both runs use Optuna's exhaustive sampler (``grid``: every valid, feasible config of each
key once), so they measure the same configs and their chosen configs can be compared
key by key; each run has its own fresh tuning DB and journal storage.  Every variant is
compiled and checked once beforehand (``KernelBenchmarker.precompile``), so both runs
load binaries from Triton's cache and what is timed is the tuning itself: worker start
(spawn, CUDA init), per-worker correctness check of each variant it meets, and the
measurements.

Reports, per run: wall time of ``tune_parallel``, the span between the first and last
DB row, rows written, rows duplicated (must be 0), trials per study; and the speedup
(1-worker wall / N-worker wall), the keys whose best configs agree, and, where they
differ, how far apart the two configs measured (in the 1-worker DB), which is timing
noise when below a few percent.

Usage (repository root, a machine with N GPUs, optuna and sqlite-utils importable):
    python3 benchmarks/multi_gpu_tune.py --workers 2 --keys 16 --out multi_gpu_tune.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _span_s(rows) -> float:
    ts = sorted(datetime.datetime.fromisoformat(r["created_at"]) for r in rows)
    return (ts[-1] - ts[0]).total_seconds() if len(ts) > 1 else 0.0


def pick_keys(items, n):
    """n (key, shape) items spread over the three kernels and both masks."""
    by_kernel: dict[str, list] = {}
    for it in items:
        by_kernel.setdefault(it[0].spec.kernel, []).append(it)
    out = []
    while len(out) < n and any(by_kernel.values()):
        for k in sorted(by_kernel):
            if by_kernel[k] and len(out) < n:
                lst = by_kernel[k]
                out.append(lst.pop(len(lst) // 2 if len(out) % 2 else 0))
    return out


def run(items, *, workers: int, workdir: Path, env, arch, n_trials: int, gpus: int, fake=None):
    from flashgen import tuner
    from flashgen.db import TuningDB

    db_path = workdir / f"w{workers}.sqlite"
    storage = str(workdir / f"w{workers}.journal")
    cfgs = [tuner.WorkerConfig(i, str(db_path), storage, env, arch, n_trials, None, 0, "grid",
                               gpu=(i % gpus) if gpus else None, fake_timings=fake,
                               fake_delay_s=0.02 if fake else 0.0)
            for i in range(workers)]
    t0 = time.perf_counter()
    codes = tuner.tune_parallel(items, cfgs)
    wall = time.perf_counter() - t0
    with TuningDB(db_path) as db:
        rows = db.rows()
        best = {key.id: db.best(key, env) for key, _ in items}
        per_worker: dict[str, int] = {}
        st = tuner.open_storage(storage, None)
        n_trials_done = {}
        import optuna

        for key, _ in items:
            study = optuna.load_study(study_name=tuner.study_name(env, key), storage=st)
            done = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
            n_trials_done[key.id] = len(done)
            for t in done:
                w = t.user_attrs.get("worker", "?")
                per_worker[w] = per_worker.get(w, 0) + 1
    idents = [(r["key"], r["variant_id"]) for r in rows]
    return {
        "workers": workers, "exit_codes": codes, "wall_s": wall, "row_span_s": _span_s(rows),
        "rows": len(rows), "duplicate_rows": len(idents) - len(set(idents)),
        "ok_rows": sum(r["status"] == "ok" for r in rows),
        "trials_per_worker": per_worker, "trials_per_key": n_trials_done,
        "best": {k: (b["variant_id"], b["median_ms"]) if b else None for k, b in best.items()},
        "db": str(db_path),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", action="append", default=None, help="presets (default fa-grid)")
    ap.add_argument("--keys", type=int, default=16, help="how many keys of the presets to tune")
    ap.add_argument("--workers", type=int, default=None, help="N (default: the GPU count)")
    ap.add_argument("--trials", type=int, default=200, help="trial cap per key (grid stops when exhausted)")
    ap.add_argument("--out", required=True, help="JSON file of the results")
    ap.add_argument("--workdir", default=None, help="where the two DBs go (default: a temp dir)")
    ap.add_argument("--fake", action="store_true", help="CPU smoke run: recorded fake timings, no GPU")
    args = ap.parse_args()

    from flashgen import arch as arch_mod, presets, tuner
    from flashgen.env import Environment

    items = presets.expand(args.preset or ["fa-grid"])
    items = pick_keys(items, args.keys)
    if args.fake:
        import random

        arch = arch_mod.by_sm("sm_90")
        env = Environment("fake GPU", "9.0", 132, "3.6.0", "cpu", "0")
        rnd = random.Random(0)
        fake = {v.id: rnd.uniform(1.0, 2.0) for v in tuner.feasible_variants([k for k, _ in items], arch)}
        gpus = 0
    else:
        import torch

        from flashgen.bench import KernelBenchmarker

        arch = arch_mod.current()
        env = Environment.current()
        gpus = torch.cuda.device_count()
        fake = None
        variants = tuner.feasible_variants([k for k, _ in items], arch)
        t0 = time.perf_counter()
        failures = KernelBenchmarker().precompile(variants)
        print(f"precompiled and checked {len(variants)} variants in {time.perf_counter() - t0:.1f} s; "
              f"{sum(f is not None for f in failures.values())} failed", flush=True)
    n = args.workers or max(1, gpus)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="flashgen-mgpu-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"{len(items)} keys; {gpus} GPU(s); runs with 1 and {n} workers in {workdir}", flush=True)
    one = run(items, workers=1, workdir=workdir, env=env, arch=arch, n_trials=args.trials, gpus=gpus, fake=fake)
    print(f"1 worker: {one['wall_s']:.1f} s, {one['rows']} rows", flush=True)
    many = run(items, workers=n, workdir=workdir, env=env, arch=arch, n_trials=args.trials, gpus=gpus, fake=fake)
    print(f"{n} workers: {many['wall_s']:.1f} s, {many['rows']} rows", flush=True)

    # Agreement: same best variant, or the N-worker pick measured within x% in the 1-worker DB.
    from flashgen.db import TuningDB

    agree, gaps = 0, {}
    with TuningDB(one["db"]) as db1:
        ms1 = {(r["key"], r["variant_id"]): r["median_ms"] for r in db1.rows() if r["status"] == "ok"}
    for key, _ in items:
        a, b = one["best"][key.id], many["best"][key.id]
        if a and b and a[0] == b[0]:
            agree += 1
        elif a and b:
            other = ms1.get((key.id, b[0]))
            gaps[key.id] = {"one": a, "many": b, "many_pick_in_one_db_ms": other,
                            "gap": (other / a[1] - 1) if other else None}
    res = {"keys": [k.id for k, _ in items], "one": one, "many": many,
           "speedup": one["wall_s"] / many["wall_s"], "goal": 0.8 * n,
           "span_speedup": one["row_span_s"] / many["row_span_s"] if many["row_span_s"] else None,
           "agree": agree, "n_keys": len(items), "disagreements": gaps}
    Path(args.out).write_text(json.dumps(res, indent=1, default=str))
    print(f"\n{'run':<10} {'wall s':>8} {'row span s':>11} {'rows':>6} {'dup':>4} {'trials/worker'}")
    for r in (one, many):
        print(f"{str(r['workers']) + ' worker':<10} {r['wall_s']:8.1f} {r['row_span_s']:11.1f} {r['rows']:6d} "
              f"{r['duplicate_rows']:4d} {r['trials_per_worker']}")
    print(f"speedup {res['speedup']:.2f}x (goal >= {res['goal']:.1f}x); row-span speedup "
          f"{res['span_speedup'] or 0:.2f}x; best config agrees on {agree}/{len(items)} keys")
    for k, g in gaps.items():
        print(f"  differs: {k}: 1 worker {g['one'][0]} {g['one'][1]:.4f} ms; {n} workers {g['many'][0]} "
              f"(measured {g['many_pick_in_one_db_ms'] or float('nan'):.4f} ms in the 1-worker run, "
              f"gap {100 * (g['gap'] or float('nan')):.1f}%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

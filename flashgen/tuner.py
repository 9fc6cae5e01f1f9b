"""Offline tuning: one Optuna study per (environment, ProblemKey); the only optuna user.

Each trial picks a TileConfig from ``space.DOMAINS`` (categorical knobs).  A config that
breaks a ``space`` rule (``invalid``) or whose shared-memory estimate exceeds the
architecture's limit (``infeasible``) is recorded in the tuning DB and reported to
Optuna as a constraint violation with a penalty value; it never reaches the
benchmarker.  Everything else is measured by a :class:`Benchmarker`, and every result,
failures included, goes into the DB at once.  A config already measured for the key in
this environment is not measured again: its stored row is reused.  Studies live in an
Optuna journal file next to the DB, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import optuna
from optuna.storages.journal import JournalFileBackend, JournalStorage
from optuna.trial import TrialState

from . import heuristics, resources, space
from .arch import Arch
from .db import TuningDB
from .env import Environment
from .spec import Measurement, ProblemKey, Shape, TileConfig, Variant

#: Objective value (ms) reported to Optuna for anything that is not an ok measurement.
PENALTY_MS = 1e6

optuna.logging.set_verbosity(optuna.logging.WARNING)


class Benchmarker(Protocol):
    """Measures one variant on one shape.  Failures are returned as a Measurement with
    a non-ok status; an exception is recorded as ``launch_failed``."""

    def __call__(self, variant: Variant, shape: Shape) -> Measurement: ...


class FakeBenchmarker:
    """Replays recorded timings (KernelTuner's simulation runner).

    ``timings`` maps a variant id to its median time in ms (an ok Measurement) or to a
    Measurement; variants not in it get ``default`` (same forms), or raise KeyError when
    ``default`` is None.  ``calls`` lists the variant ids measured, in order.
    """

    def __init__(self, timings: Mapping[str, float | Measurement],
                 default: float | Measurement | None = None):
        self.timings = dict(timings)
        self.default = default
        self.calls: list[str] = []

    def __call__(self, variant: Variant, shape: Shape) -> Measurement:
        self.calls.append(variant.id)
        t = self.timings.get(variant.id, self.default)
        if t is None:
            raise KeyError(f"no recorded timing for {variant.id}")
        return t if isinstance(t, Measurement) else Measurement("ok", median_ms=float(t))


@dataclass(frozen=True)
class TuneResult:
    """The outcome of tuning one key.  Times in ms; ``speedup`` = default_median_ms /
    best_median_ms; None where there is no ok measurement.  ``n_trials`` counts the
    study's completed trials, earlier runs included."""

    key: ProblemKey
    best_config: TileConfig | None
    best_median_ms: float | None
    tflops: float | None
    default_config: TileConfig
    default_median_ms: float | None
    speedup: float | None
    n_trials: int
    wall_s: float


def study_name(env: Environment, key: ProblemKey) -> str:
    """``<gpu slug>/<key id>/triton<version>/<template hash>``: a new Triton or template
    starts a new study, as it invalidates the old rows."""
    slug = re.sub(r"[^a-z0-9]+", "-", env.gpu_name.lower()).strip("-")
    return f"{slug}/{key.id}/triton{env.triton_version}/{env.template_hash(key.spec.kernel)}"


def open_storage(storage: str | Path | optuna.storages.BaseStorage | None,
                 db: TuningDB) -> optuna.storages.BaseStorage | str:
    """None: a journal file at ``<db path>.optuna.journal``; a path: a journal file
    there; a URL (``sqlite:///...``) or a storage object: passed to Optuna as is."""
    if storage is None:
        storage = f"{db.path}.optuna.journal"
    if isinstance(storage, (str, Path)):
        if "://" in str(storage):
            return str(storage)
        return JournalStorage(JournalFileBackend(str(storage)))
    return storage


def feasible_variants(keys: Iterable[ProblemKey], arch: Arch) -> list[Variant]:
    """Every valid variant of the keys' specs whose shared-memory estimate fits ``arch``
    (what a benchmarker may precompile), without duplicates, in domain order."""
    out: dict[str, Variant] = {}
    for spec in dict.fromkeys(k.spec for k in keys):
        for cfg in space.valid_configs(spec):
            v = Variant(spec, cfg)
            if resources.estimate(v, arch).feasible:
                out.setdefault(v.id, v)
    return list(out.values())


def _measure(key: ProblemKey, shape: Shape, cfg: TileConfig, *, benchmarker: Benchmarker,
             db: TuningDB, env: Environment, arch: Arch) -> dict:
    """The DB row of ``cfg`` for ``key`` in ``env``: the stored one if any, else a new
    one (invalid / infeasible without benchmarking; an exception -> launch_failed)."""
    v = Variant(key.spec, cfg)
    row = db.lookup(key, v.id, env)
    if row is not None:
        return row
    est = resources.estimate(v, arch)
    broken = space.violated_rules(v)
    if broken:
        m = Measurement("invalid", error="; ".join(broken))
    elif not est.feasible:
        m = Measurement("infeasible", error=est.breakdown())
    else:
        try:
            m = benchmarker(v, shape)
        except Exception as e:  # a crash in one candidate never ends the run
            m = Measurement("launch_failed", error=f"{type(e).__name__}: {e}")
    return db.get(db.record(key, shape, v, m, env, est.total_bytes))


def tune_key(key: ProblemKey, shape: Shape, *, benchmarker: Benchmarker, db: TuningDB,
             env: Environment, arch: Arch, n_trials: int, timeout_s: float | None = None,
             storage: str | Path | optuna.storages.BaseStorage | None = None, seed: int = 0,
             on_trial: Callable[[ProblemKey, int, int, dict], None] | None = None) -> TuneResult:
    """Tune ``key`` by measuring ``shape`` until the study has ``n_trials`` completed
    trials (earlier runs count) or ``timeout_s`` seconds have passed.

    The heuristic default config is measured first and enqueued as the study's first
    trial.  ``on_trial(key, n_done, n_trials, row)`` is called after each trial with its
    DB row.  Never raises for a failing candidate.
    """
    t0 = time.perf_counter()
    dom = space.DOMAINS[key.spec.kernel]
    kw = dict(benchmarker=benchmarker, db=db, env=env, arch=arch)
    study = optuna.create_study(storage=open_storage(storage, db),
                                sampler=optuna.samplers.TPESampler(seed=seed),
                                study_name=study_name(env, key), direction="minimize",
                                load_if_exists=True)

    default = heuristics.default_config(key.spec, arch)
    default_row = _measure(key, shape, default, **kw)
    if not study.trials and all(getattr(default, n) in vals for n, vals in dom.items()):
        study.enqueue_trial(default.as_dict())

    def n_complete() -> int:
        return len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))

    done = n_complete()

    def objective(trial: optuna.Trial) -> float:
        nonlocal done
        cfg = TileConfig(**{n: trial.suggest_categorical(n, list(vals)) for n, vals in dom.items()})
        v = Variant(key.spec, cfg)
        row = _measure(key, shape, cfg, **kw)
        est = resources.estimate(v, arch)
        constraint = [float(len(space.violated_rules(v))),
                      float(max(0, est.total_bytes - est.limit_bytes))]
        trial.set_constraint("rules_violated", constraint[0])
        trial.set_constraint("smem_excess_bytes", constraint[1])
        for name, val in (("variant_id", v.id), ("status", row["status"]),
                          ("row_id", row["id"]), ("constraint", constraint)):
            trial.set_user_attr(name, val)
        done += 1
        if on_trial is not None:
            on_trial(key, done, n_trials, row)
        return row["median_ms"] if row["status"] == "ok" else PENALTY_MS

    if n_trials > done:
        study.optimize(objective, n_trials=n_trials - done, timeout=timeout_s)

    best = db.best(key, env)
    best_ms = best["median_ms"] if best else None
    default_ms = default_row["median_ms"] if default_row["status"] == "ok" else None
    return TuneResult(
        key=key, best_config=TileConfig.from_dict(best) if best else None,
        best_median_ms=best_ms, tflops=best["tflops"] if best else None,
        default_config=default, default_median_ms=default_ms,
        speedup=default_ms / best_ms if default_ms and best_ms else None,
        n_trials=n_complete(), wall_s=time.perf_counter() - t0)


def tune(items: Iterable[tuple[ProblemKey, Shape]], *, benchmarker: Benchmarker, db: TuningDB,
         env: Environment, arch: Arch, n_trials: int, timeout_per_key_s: float | None = None,
         storage: str | Path | optuna.storages.BaseStorage | None = None, seed: int = 0,
         on_key: Callable[[int, int, ProblemKey], None] | None = None,
         on_trial: Callable[[ProblemKey, int, int, dict], None] | None = None) -> list[TuneResult]:
    """:func:`tune_key` for each (key, shape) in order, sharing one storage.
    ``on_key(index, n_keys, key)`` is called before each key (e.g. to drive a progress
    bar)."""
    items = list(items)
    st = open_storage(storage, db)
    results = []
    for i, (key, shape) in enumerate(items):
        if on_key is not None:
            on_key(i, len(items), key)
        results.append(tune_key(key, shape, benchmarker=benchmarker, db=db, env=env, arch=arch,
                                n_trials=n_trials, timeout_s=timeout_per_key_s, storage=st,
                                seed=seed, on_trial=on_trial))
    return results

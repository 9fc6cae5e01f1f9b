"""Offline tuning: one Optuna study per (environment, ProblemKey); the only optuna user.

Each trial picks a TileConfig from the knob domains of the kernel families that serve the
key (:mod:`flashgen.families`; categorical knobs, and a ``family`` knob when more than
one family serves it, each other family's knobs named ``<family>.<knob>``).  A config
that breaks its family's rules (``invalid``) or whose shared-memory estimate exceeds the
architecture's limit (``infeasible``) is recorded in the tuning DB and reported to
Optuna as a constraint violation with a penalty value; it never reaches the
benchmarker.  Everything else is measured by a :class:`Benchmarker`, and every result,
failures included, goes into the DB at once.  A config already measured for the key in
this environment is not measured again: its stored row is reused.  Studies live in an
Optuna journal file next to the DB, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import optuna
from optuna.storages.journal import JournalFileBackend, JournalStorage
from optuna.trial import TrialState

from . import families, iomodel
from .arch import Arch
from .db import TuningDB
from .env import Environment
from .errors import InputError
from .spec import (DEFAULT_FAMILY, Measurement, ProblemKey, Shape, TileConfig, Variant, attention_flops,
                   base_kernel, is_decode)

#: Objective value (ms) reported to Optuna for anything that is not an ok measurement.
PENALTY_MS = 1e6
#: Heartbeat period (s) of trials in an RDB storage (``--storage URL``).
HEARTBEAT_S = 30

optuna.logging.set_verbosity(optuna.logging.WARNING)


class Benchmarker(Protocol):
    """Measures one variant on one shape.  Failures are returned as a Measurement with
    a non-ok status; an exception is recorded as ``launch_failed``."""

    def __call__(self, variant: Variant, shape: Shape) -> Measurement: ...


class MissingTiming(KeyError):
    """A simulated benchmarker has no timing for a variant: not a measurement and not a
    GPU failure, so the tuner records no row for it (the trial is pruned)."""


class FakeBenchmarker:
    """Replays recorded timings (KernelTuner's simulation runner).

    ``timings`` maps a variant id to its median time in ms (an ok Measurement) or to a
    Measurement; variants not in it get ``default`` (same forms), or raise
    :class:`MissingTiming` when ``default`` is None.  ``calls`` lists the variant ids
    measured, in order.
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
            raise MissingTiming(f"no recorded timing for {variant.id}")
        return t if isinstance(t, Measurement) else Measurement("ok", median_ms=float(t))


class ModelBenchmarker:
    """Synthesizes a median time (ms) per variant and shape from flashgen's models
    instead of a GPU: the whole tuning path on a CPU (``flashgen tune --fake-model``).
    Times are a model's, not measurements (the CLI labels the environment so).

    time = max(HBM bytes / ``hbm_bytes_per_s``, FLOPs / ``tensor_flops_per_s``) /
    occupancy + ``launch_s``, where the bytes are :mod:`flashgen.iomodel`'s tiled count
    for the kernel and tile (K/V re-read once per query tile, Q/dO once per key tile),
    the FLOPs :func:`flashgen.spec.attention_flops`, and occupancy the share of the
    last wave's program slots that are used: slots = SMs x programs per SM, where
    programs per SM is limited by the variant's shared memory (its family's estimate)
    and by 64 resident warps per SM.  Defaults: an H200's 4.8 TB/s of HBM and 989 TFLOP/s
    of dense 16-bit tensor-core math (its datasheet), 5 us per launch.  A window mask
    (sizes not in the key) is modelled as no mask; decode kernels read their K/V once
    and run batch x kv heads x num_splits programs.  Gluon variants: a forward program
    owns BLOCK_M x consumers query rows (consumers = num_warps / 4) and ``ctas_per_sm``
    programs (default 1) share an SM (setmaxnreg hands them the register file); the
    whole backward (``bwd``) is the dK/dV kernel's traffic over BLOCK_N x consumers key
    rows (BLOCK_N for the column-split program, ``dq_chunks`` > 0) plus a float32 dQ tile added per (key block, query block), and 3 launches
    (``group_split`` S > 1: S times the programs, each loading its K and V, the dK/dV
    partials, float32 or ``half_partials``, written and read back, and 4 launches).
    """

    def __init__(self, arch, hbm_bytes_per_s: float = 4.8e12, tensor_flops_per_s: float = 989e12,
                 launch_s: float = 5e-6):
        self.arch = arch
        self.hbm_bytes_per_s = hbm_bytes_per_s
        self.tensor_flops_per_s = tensor_flops_per_s
        self.launch_s = launch_s
        self.calls: list[str] = []

    def median_ms(self, variant: Variant, shape: Shape) -> float:
        s, c = variant.spec, variant.config
        kernel = base_kernel(s.kernel)
        causal = s.mask == "causal"
        p = iomodel.Problem(shape.seqlen_q, shape.seqlen_k, s.head_dim, s.head_dim_v, shape.batch,
                            shape.num_heads, shape.num_kv_heads, s.dtype_bytes, causal=causal)
        kv_heads = shape.batch * shape.num_kv_heads
        gluon = variant.family == "gluon"
        launches = 1
        if gluon and kernel == "bwd":
            # key rows per program (the head_dim 256 column-split program, dq_chunks: BLOCK_N)
            nt = c.BLOCK_N if c.dq_chunks else c.BLOCK_N * max(1, c.num_warps // 4)
            io = iomodel.tiled_bwd_dkdv(p, c.BLOCK_M, nt)
            io.add("dQ float32 reduce-add, one tile per (key block, query block)", "write",
                   -(-shape.seqlen_k // nt) * shape.batch * shape.num_heads * shape.seqlen_q * s.head_dim * 4)
            split = max(1, c.group_split)
            programs = kv_heads * split * -(-shape.seqlen_k // nt)
            launches = 3
            if split > 1:
                n = kv_heads * shape.seqlen_k * s.head_dim
                io.add("group_split: K, V loaded again by the other programs of a kv head", "read",
                       2 * n * s.dtype_bytes * (split - 1))
                part = s.dtype_bytes if c.half_partials else 4
                io.add("group_split: dK, dV partials", "write", 2 * n * part * split)
                io.add("group_split: the partials read by the reduction", "read", 2 * n * part * split)
                launches = 4
        elif gluon:
            rows = c.BLOCK_M * max(1, c.num_warps // 4)
            io = iomodel.tiled_forward(p, rows, c.BLOCK_N)
            programs = shape.batch * shape.num_heads * -(-shape.seqlen_q // rows)
        elif is_decode(s.kernel):
            io = iomodel.tiled_forward(iomodel.Problem(shape.seqlen_q, shape.seqlen_k, s.head_dim,
                                                       s.head_dim_v, shape.batch, shape.num_heads,
                                                       shape.num_kv_heads, s.dtype_bytes),
                                       block_m=max(shape.seqlen_q, 1), block_n=c.BLOCK_N)
            programs = kv_heads * max(1, c.num_splits)
        elif kernel == "bwd_dkdv":
            io = iomodel.tiled_bwd_dkdv(p, c.BLOCK_M, c.BLOCK_N)
            programs = kv_heads * -(-shape.seqlen_k // c.BLOCK_N)
        elif kernel == "bwd_dq":
            io = iomodel.tiled_bwd_dq(p, c.BLOCK_M, c.BLOCK_N)
            programs = shape.batch * shape.num_heads * -(-shape.seqlen_q // c.BLOCK_M)
        else:
            io = iomodel.tiled_forward(p, c.BLOCK_M, c.BLOCK_N)
            programs = shape.batch * shape.num_heads * -(-shape.seqlen_q // c.BLOCK_M)
        flops = attention_flops(shape.batch, shape.num_heads, shape.seqlen_q, shape.seqlen_k, s.head_dim,
                                s.head_dim_v, causal=causal, kernel=s.kernel)
        smem = max(1, families.get(variant.family).estimate(variant, self.arch).total_bytes)
        if gluon:
            per_sm = c.ctas_per_sm or 1
            if c.persistent:
                programs = min(programs, self.arch.sm_count * per_sm)
        else:
            per_sm = max(1, min(self.arch.smem_per_block_optin // smem, 64 // c.num_warps))
        slots = self.arch.sm_count * per_sm
        waves = -(-programs // slots)
        occupancy = programs / (waves * slots)
        busy_s = max(io.total_bytes / self.hbm_bytes_per_s, flops / self.tensor_flops_per_s)
        return (busy_s / occupancy + launches * self.launch_s) * 1e3

    def __call__(self, variant: Variant, shape: Shape) -> Measurement:
        self.calls.append(variant.id)
        return Measurement("ok", median_ms=self.median_ms(variant, shape))


@dataclass(frozen=True)
class TuneResult:
    """The outcome of tuning one key.  Times in ms; ``speedup`` = default_median_ms /
    best_median_ms; None where there is no ok measurement.  ``n_trials`` counts the
    study's measured trials (:func:`measured_trials`), earlier runs included, and at least
    the default's measurement."""

    key: ProblemKey
    best_config: TileConfig | None
    best_median_ms: float | None
    tflops: float | None
    default_config: TileConfig
    default_median_ms: float | None
    speedup: float | None
    n_trials: int
    wall_s: float


def study_name(env: Environment, key: ProblemKey, family_names: Iterable[str] | None = None) -> str:
    """``<gpu slug>-cc<compute capability>-<SM count>sm/<key id>/triton<version>/<template
    hash>``: another GPU (a simulated ``--arch`` of one GPU name included), a new Triton
    or template starts a new study, as its rows are another environment's.  The hash is the Triton family's
    where it is searched; each other searched family (``family_names``, default: every
    registered one that compiles the kernel) adds ``+<name>-<its hash>-<domain>``, with
    ``<domain>`` a digest of its knob domain for the key (:func:`_domain_digest`), so a
    study over other families, or over a family whose knobs took new values, is another
    study (Optuna refuses a categorical parameter whose choices changed; the rows of the
    old study stay in the DB and answer the new one's trials); the Triton-only names
    never change."""
    slug = re.sub(r"[^a-z0-9]+", "-", env.gpu_name.lower()).strip("-")
    kernel = key.spec.kernel
    names = [f.name for f in families.FAMILIES.values() if kernel in f.kernels
             and (family_names is None or f.name in set(family_names))]
    parts = [env.template_hash(kernel) if n == DEFAULT_FAMILY
             else f"+{n}-{env.template_hash(kernel, '', n)}-{_domain_digest(families.get(n), key)}" for n in names]
    gpu = f"{slug}-cc{env.compute_capability.replace('.', '')}-{env.sm_count}sm"
    return f"{gpu}/{key.id}/triton{env.triton_version}/{''.join(parts)}"


def _domain_digest(fam, key: ProblemKey) -> str:
    """sha256 (8 hex digits) of ``fam``'s knob domain for ``key`` (names and values in
    order): what the study's categorical parameters offer."""
    return hashlib.sha256(repr(sorted(fam.domain(key).items())).encode()).hexdigest()[:8]


def default_journal(db_path: str | Path) -> str:
    """The Optuna journal a tune of the database at ``db_path`` keeps its studies in
    when no ``--storage`` is given: ``<db path>.optuna.journal``."""
    return f"{db_path}.optuna.journal"


def open_storage(storage: str | Path | optuna.storages.BaseStorage | None,
                 db: TuningDB | None) -> optuna.storages.BaseStorage | str:
    """None: a journal file at ``<db path>.optuna.journal``; a path: a journal file
    there; a URL (``sqlite:///...``) or a storage object: passed to Optuna as is."""
    if storage is None:
        storage = default_journal(db.path)
        check_journal(storage, "the Optuna journal beside the database,")  # a file of the user's is never appended to
    if isinstance(storage, (str, Path)):
        if "://" in str(storage):
            # A database shared by workers on several machines: a worker that dies
            # mid-trial stops sending heartbeats; Optuna then fails its trial and the
            # callback enqueues it again (retried, not lost).
            return _rdb_storage(str(storage))
        return JournalStorage(JournalFileBackend(str(storage)))
    return storage


def check_journal(path: str | Path, what: str = "--storage") -> None:
    """Raise InputError (naming ``path`` and the rule) unless an Optuna journal file can
    be kept at ``path``: its directory exists and is writable, and the file, if there, is
    a writable regular file that is empty or an Optuna journal (JSON lines with an
    ``op_code``), so a file of the user's is never appended to, and every record is
    whole (a last one cut short stays so for a second: not one another run is
    appending).  Creates nothing."""
    from .db import check_writable

    path = Path(path)
    check_writable(path, what)
    if path.exists() and path.stat().st_size:
        with open(path, "rb") as f:
            first = f.readline(1 << 16)
        if _journal_record(first) is None:
            raise InputError(f"{what} {path} is not an Optuna journal (its first line is not a journal record); "
                             "it is left untouched: name a new file or an existing journal")
        # every record whole: Optuna appends after the last byte, so a record cut short
        # (a run killed while it wrote) would swallow the next run's first one
        bad = _bad_journal_line(path)
        if bad is not None and bad[1] == "is cut short":
            # the last record may be one another run is appending: Optuna writes a record
            # in one call, so a live one ends within moments, a cut one never
            for _ in range(20):
                time.sleep(0.05)
                again = _bad_journal_line(path)
                if again != bad:  # completed, or cut further on: a run is writing it
                    bad = again if again is not None and again[1] != "is cut short" else None
                    break
        if bad is not None:
            n, cut = bad
            raise InputError(
                f"{what} {path} is damaged: its record at line {n} {cut} (a run stopped while it wrote?); "
                "it is left untouched.  The tuning DB keeps every measurement: move the journal aside "
                "(a new one starts new studies) or name another with --storage")


def _bad_journal_line(path: Path) -> tuple[int, str] | None:
    """(line number, what is wrong) of the first line of the journal at ``path`` that is
    not a whole journal record, else None."""
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.endswith(b"\n"):
                return n, "is cut short"
            if _journal_record(line) is None:
                return n, "is not a journal record"
    return None


def _journal_record(line: bytes) -> dict | None:
    """The journal record one line of an Optuna journal holds (a JSON object with an
    ``op_code``), else None."""
    import json

    try:
        rec = json.loads(line)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) and "op_code" in rec else None


def storage_file(storage: str) -> Path | None:
    """The file an Optuna storage argument keeps its studies in: the journal path, or
    the database file of an SQLite URL (any driver, query string ignored); None for a
    server URL or an in-memory database."""
    if "://" not in storage:
        return Path(storage)
    import sqlalchemy

    try:
        url = sqlalchemy.engine.make_url(storage)
    except (sqlalchemy.exc.ArgumentError, ValueError):  # a malformed URL: check_rdb names it
        return None
    if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:"):
        return Path(url.database)
    return None


def check_rdb(url: str, what: str = "--storage") -> None:
    """Raise InputError (naming ``url`` and the rule) unless an Optuna RDB storage can be
    kept at ``url``: a URL SQLAlchemy reads whose database driver is installed; for an
    SQLite file, its directory exists and is writable and the file, if there, is empty or
    already an Optuna storage (a ``studies`` table), so Optuna's tables are never added to
    a file of the user's (a tuning database, another program's); for a server, a
    connection opens.  Creates and writes nothing."""
    import sqlite3

    import sqlalchemy

    from .db import _connect_readonly, check_writable

    try:
        parsed = sqlalchemy.engine.make_url(url)
    except (sqlalchemy.exc.ArgumentError, ValueError) as e:  # ValueError: e.g. a port that is no number
        raise InputError(f"{what} {url}: not a database URL ({e})") from None
    if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        path = Path(parsed.database)
        if path.exists() and not path.is_file():
            raise InputError(f"{what} {url}: {path} is not a file")
        check_writable(path, what)
        if path.exists() and path.stat().st_size:
            try:
                conn = _connect_readonly(path, immutable=True)  # creates no -wal/-shm file beside it
                try:
                    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
                finally:
                    conn.close()
            except sqlite3.DatabaseError as e:
                raise InputError(f"{what} {url}: {path} is not an SQLite database (SQLite says: {e}); it is left "
                                 "untouched") from None
            if tables and "studies" not in tables:
                raise InputError(f"{what} {url}: {path} is not an Optuna storage (tables: {sorted(tables)[:5]}); it "
                                 "is left untouched: name a new file or an existing Optuna storage")
        return
    try:
        engine = sqlalchemy.create_engine(url)  # imports the driver; connects on connect()
        try:
            with engine.connect():
                pass
        finally:
            engine.dispose()
    except (ImportError, sqlalchemy.exc.SQLAlchemyError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(f"{what} {url}: cannot open this Optuna storage ({type(e).__name__}: {reason})") from None


def _rdb_storage(url: str) -> optuna.storages.RDBStorage:
    import warnings

    kw = dict(heartbeat_interval=HEARTBEAT_S, grace_period=3 * HEARTBEAT_S)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        retry = getattr(optuna.storages, "RetryHeartbeatStaleTrialCallback", None)
        try:  # Optuna >= 4.9 names the callback for stale heartbeats
            return optuna.storages.RDBStorage(url, **kw, heartbeat_stale_trial_callback=retry(max_retry=1))
        except TypeError:
            return optuna.storages.RDBStorage(
                url, **kw, failed_trial_callback=optuna.storages.RetryFailedTrialCallback(max_retry=1))


def _sampler(name: str, space: dict[str, dict[str, tuple]], seed: int) -> optuna.samplers.BaseSampler:
    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed)
    if name == "grid":
        return ConfigGridSampler(space, seed)
    raise ValueError(f"sampler must be 'tpe' or 'grid', got {name!r}")


def grid_params(space: dict[str, dict[str, tuple]]) -> list[dict]:
    """The trial params of every config of ``space`` (family name -> knob domains, as
    :func:`search_space`): each family's knob domains' product in domain order, families
    in ``space``'s order; the ``family`` param where more than one family is searched."""
    out = []
    for family, dom in space.items():
        names = [_param(family, n) for n in dom]
        head = {"family": family} if len(space) > 1 else {}
        out += [{**head, **dict(zip(names, values))} for values in itertools.product(*dom.values())]
    return out


class ConfigGridSampler(optuna.samplers.BaseSampler):
    """The ``grid`` sampler: every config of ``space`` (:func:`search_space`) once, in an
    order shuffled by ``seed``; the study stops once every config is taken.

    Taken: the params of a trial of the study that is complete, pruned, failed or
    running, whichever worker ran it (waiting trials take nothing), as with Optuna's
    BruteForceSampler, so workers sharing a study split the grid and a resumed study
    goes on where it stopped (Optuna's GridSampler's grid ids can be claimed by a trial
    that then runs other params).  BruteForceSampler knows no search space beforehand
    and rebuilds a tree of every trial's params for each parameter of each trial: time
    quadratic in the trials, minutes over a few thousand configs.  This sampler knows
    the grid: a trial's first parameter picks its whole config (the first untaken one
    in the shuffled order that agrees with params already set, an enqueued trial's),
    and the taken configs are kept between trials, each finished trial read once."""

    def __init__(self, space: dict[str, dict[str, tuple]], seed: int = 0):
        import random

        params = grid_params(space)
        random.Random(seed).shuffle(params)
        self._order = [self._key(p) for p in params]
        self._params = dict(zip(self._order, params))
        self._taken: set[tuple] = set()
        self._read = 0  # the study's first trials, all finished, whose configs are in _taken
        self._next = 0  # every config before it in _order is taken
        self._picks: dict[int, dict | None] = {}  # trial number -> its config's params
        self._rng = random.Random(seed)

    @staticmethod
    def _key(params: Mapping) -> tuple:
        return tuple(sorted(params.items()))

    def infer_relative_search_space(self, study, trial) -> dict:
        return {}

    def sample_relative(self, study, trial, search_space) -> dict:
        return {}

    def _update(self, study: optuna.Study, current: int) -> None:
        """Add the configs of the study's trials other than trial ``current`` to the taken
        ones.  The first ``_read`` trials (creation order) are finished and added already;
        ``_read`` grows over the finished trials that follow them."""
        trials = study.get_trials(deepcopy=False)
        front = True
        for t in trials[self._read:]:
            if t.state != TrialState.WAITING and t.number != current:
                key = self._key(t.params)
                if key in self._params:
                    self._taken.add(key)
            front = front and t.state.is_finished()
            self._read += front
        while self._next < len(self._order) and self._order[self._next] in self._taken:
            self._next += 1

    def _pick(self, study: optuna.Study, trial, name: str) -> dict | None:
        """The config of ``trial``: the first untaken one that has ``name`` and agrees
        with the trial's params already set, else the first such config (a repeat),
        else None."""
        self._update(study, trial.number)
        fixed = trial.params

        def agrees(p: dict) -> bool:
            return name in p and all(n in p and p[n] == v for n, v in fixed.items())

        untaken = (self._params[k] for k in self._order[self._next:] if k not in self._taken)
        return next((p for p in untaken if agrees(p)), None) or next(filter(agrees, self._params.values()), None)

    def sample_independent(self, study, trial, param_name, param_distribution):
        pick = self._picks.get(trial.number)
        if pick is None or param_name not in pick or any(n not in pick or pick[n] != v
                                                         for n, v in trial.params.items()):
            pick = self._picks[trial.number] = self._pick(study, trial, param_name)
        if pick is None:  # params set outside the grid: any choice of the parameter
            return self._rng.choice(param_distribution.choices)
        return pick[param_name]

    def after_trial(self, study, trial, state, values) -> None:
        self._picks.pop(trial.number, None)
        key = self._key(trial.params)
        if key in self._params:
            self._taken.add(key)
        self._update(study, trial.number)
        if self._next == len(self._order):
            with contextlib.suppress(RuntimeError):  # raised outside optimize (ask and tell)
                study.stop()


def search_space(key: ProblemKey, arch: Arch, family_names: Iterable[str] | None = None
                 ) -> dict[str, dict[str, tuple]]:
    """family name -> its knob domains for ``key``, for each registered family that serves
    ``key`` on ``arch`` (registry order: the portable family first), only those of
    ``family_names`` when given (``flashgen tune --family``)."""
    names = None if family_names is None else set(family_names)
    return {f.name: f.domain(key) for f in families.serving(key, arch) if names is None or f.name in names}


def default_config(key: ProblemKey, arch: Arch, family_names: Iterable[str] | None = None) -> TileConfig | None:
    """The config a study measures first: the dispatcher's heuristic default among the
    families searched (a family whose measurements put its default ahead of the
    portable one's, ``prefers_default``, else the portable family's), else the first
    searched family's default; None when no searched family serves ``key``."""
    space = search_space(key, arch, family_names)
    fams = [families.get(n) for n in space]
    for fam in fams:
        prefer = getattr(fam, "prefers_default", None)
        if fam.name != DEFAULT_FAMILY and prefer is not None and prefer(key, arch):
            cfg = fam.default_config(key, arch)
            if cfg is not None:
                return cfg
    for fam in sorted(fams, key=lambda f: f.name != DEFAULT_FAMILY):
        cfg = fam.default_config(key, arch)
        if cfg is not None:
            return cfg
    return None


def _runs(cfg: TileConfig, key: ProblemKey, arch: Arch) -> bool:
    """Whether ``cfg`` can run ``key`` on ``arch``: its family is registered and serves
    the key there, and the variant breaks none of its rules and fits its shared memory
    (what a seed from another key, another GPU or a database must pass)."""
    fam = families.FAMILIES.get(cfg.family)
    if fam is None or fam.unsupported(key, arch) is not None:
        return False
    v = Variant(key.spec, cfg)
    return not fam.violated_rules(v) and fam.estimate(v, arch).feasible


def family_defaults(key: ProblemKey, arch: Arch, family_names: Iterable[str] | None = None) -> list[TileConfig]:
    """The heuristic default of each searched family that has one for ``key`` within its
    rules and shared memory on ``arch``, registry order.  A study measures each of them
    first (after :func:`default_config`), so every family is compared from the search's
    start: where one family's valid configs are a small part of the product of its knob
    domains (the Gluon forward at head_dim 256) the sampler alone may never propose one."""
    out = []
    for name in search_space(key, arch, family_names):
        fam = families.get(name)
        cfg = fam.default_config(key, arch)
        if cfg is None or cfg in out:
            continue
        if _runs(cfg, key, arch):
            out.append(cfg)
    return out


def _param(family: str, knob: str) -> str:
    """The Optuna parameter name of a family's knob (the default family's are bare)."""
    return knob if family == DEFAULT_FAMILY else f"{family}.{knob}"


def _params(cfg: TileConfig, space: dict[str, dict[str, tuple]]) -> dict | None:
    """The trial params that suggest ``cfg`` (None when ``cfg`` is outside the space)."""
    dom = space.get(cfg.family)
    if dom is None or any(getattr(cfg, n) not in vals for n, vals in dom.items()):
        return None
    params = {_param(cfg.family, n): getattr(cfg, n) for n in dom}
    return {"family": cfg.family, **params} if len(space) > 1 else params


def _suggestable(cfg: TileConfig, space: dict[str, dict[str, tuple]]) -> bool:
    """Whether the search suggests ``cfg`` itself (its params rebuild it: no knob outside
    the search differs from its default)."""
    if _params(cfg, space) is None:
        return False
    return _config(cfg.family, {n: getattr(cfg, n) for n in space[cfg.family]}) == cfg


def _config(family: str, knobs: dict) -> TileConfig:
    """The TileConfig of ``family`` with the searched ``knobs`` and every other knob at its default."""
    return TileConfig(**knobs, **({} if family == DEFAULT_FAMILY else {"family": family}))


def _suggest(trial: optuna.Trial, space: dict[str, dict[str, tuple]]) -> TileConfig:
    family = trial.suggest_categorical("family", list(space)) if len(space) > 1 else next(iter(space))
    return _config(family, {n: trial.suggest_categorical(_param(family, n), list(vals))
                            for n, vals in space[family].items()})


def feasible_variants(keys: Iterable[ProblemKey], arch: Arch, family_names: Iterable[str] | None = None
                      ) -> list[Variant]:
    """Every valid variant of the keys' specs whose shared-memory estimate fits ``arch``
    (what a benchmarker may precompile), over the families that serve each key (those of
    ``family_names`` when given), without duplicates, in registry and domain order."""
    out: dict[str, Variant] = {}
    names = None if family_names is None else set(family_names)
    for key in keys:
        for v in _feasible(key, arch, names):
            out.setdefault(v.id, v)
    return list(out.values())


def _feasible(key: ProblemKey, arch: Arch, names: set | None):
    """The valid variants of ``key`` whose shared-memory estimate fits ``arch``, over the
    families that serve it (those in ``names`` when given), lazily."""
    for fam in families.serving(key, arch):
        if names is not None and fam.name not in names:
            continue
        for cfg in families.configs(fam, key):
            v = Variant(key.spec, cfg)
            if not fam.violated_rules(v) and fam.estimate(v, arch).feasible:
                yield v


def has_feasible(key: ProblemKey, arch: Arch, family_names: Iterable[str] | None = None) -> bool:
    """Whether some family of ``family_names`` (default: any) that serves ``key`` on
    ``arch`` has a valid config whose shared-memory estimate fits (what
    :func:`feasible_variants` would list for it; stops at the first)."""
    names = None if family_names is None else set(family_names)
    return next(_feasible(key, arch, names), None) is not None


#: How many configs :func:`transfer_configs` seeds a new study with.
TRANSFER_SEEDS = 3


def transfer_configs(key: ProblemKey, db: TuningDB, env: Environment, arch: Arch,
                     limit: int = TRANSFER_SEEDS) -> list[TileConfig]:
    """The best configs of other keys already tuned in ``db`` for ``env`` with the same
    kernel spec (kernel, dtype, head dims, mask), nearest bucket first (distance: the
    sum of |log2| ratios of seqlen_q, seqlen_k and batch*heads, plus 1 for another GQA
    group), then those of the same kernel, dtype and head dims with another mask; valid
    and feasible on ``arch``, without repeats, at most ``limit``.

    A new study enqueues them right after the heuristic default: the configs that won
    for neighbouring sizes are the likeliest winners here (on the H200's exhaustive
    data they cut the configs TPE needs to come within 2% of the best; see
    benchmarks/search_efficiency.py)."""
    import math

    s = key.spec
    prefix = f"attn_{s.kernel}_"
    scored = []
    for r in db.best_rows(env, key_contains=prefix):
        try:
            other = ProblemKey.from_row(r)
        except (KeyError, ValueError):
            continue
        o = other.spec
        if other == key or (o.kernel, o.dtype, o.head_dim, o.head_dim_v) != (s.kernel, s.dtype, s.head_dim, s.head_dim_v):
            continue
        dist = (abs(math.log2(other.seqlen_q / key.seqlen_q)) + abs(math.log2(other.seqlen_k / key.seqlen_k))
                + abs(math.log2(other.batch_heads / key.batch_heads)) + (other.group != key.group)
                + (100 if o.mask != s.mask else 0))
        scored.append((dist, r["median_ms"], TileConfig.from_dict(r)))
    out: list[TileConfig] = []
    for _, _, cfg in sorted(scored, key=lambda t: (t[0], t[1])):
        if cfg not in out and _runs(cfg, key, arch):
            out.append(cfg)
        if len(out) == limit:
            break
    return out


#: How many of :func:`prior_configs` a new study measures.
PRIOR_SEEDS = 3


def prior_configs(key: ProblemKey, db: TuningDB, env: Environment, arch: Arch,
                  shipped: Iterable[Path] | None = None, limit: int = PRIOR_SEEDS) -> list[TileConfig]:
    """The configs the dispatcher served ``key`` on this GPU before any row of this
    environment: in its order, the key's best rows (per kernel family, fastest first) of
    this GPU under another Triton version, then of a *sibling* GPU (another GPU of its
    compute capability and SM count, :data:`flashgen.env.SIBLING_COLUMNS`) under this
    Triton version, then under others; and after them the key's best rows of a
    *relative* (a GPU of its compute capability and another SM count, e.g. an H100
    PCIe's relatives the H100 SXM and the H200) under this Triton version, then under
    others; from ``db`` and the shipped
    databases (``shipped``; default :func:`flashgen.dispatch.shipped_databases`), whole
    (a refined row's refinement knobs included), valid and feasible on ``arch``, without
    repeats, at most ``limit``.  None for an environment no GPU measures (the
    interpreter, a ``--fake`` or ``--fake-model`` run: :func:`flashgen.env.real_gpu`).

    A row of this environment replaces them in the dispatcher, so a new study measures
    them right after the default (:func:`tune_key`): the row a tune records is then at
    least as fast as what the dispatcher served before, as measured here.  On an H100
    the H200's rows ran 1.13-1.19x the heuristic defaults (docs/benchmarks.md).  A
    relative's configs are candidates only (its timings say nothing here); they bring
    the refinements of the shipped rows (``flashgen tune --refine``, knobs the search
    does not suggest) into the first tune of a GPU that has no shipped rows."""
    from .dispatch import shipped_databases
    from .env import real_gpu

    if not real_gpu(env.gpu_name):
        return []
    paths = [p for p in (shipped_databases() if shipped is None else shipped)
             if Path(p).resolve() != Path(db.path).resolve()]
    # this GPU, other Triton; sibling, this Triton; sibling, other; relative, this; relative, other
    kinds = ((False, False, False), (True, True, False), (False, True, False), (True, False, True),
             (False, False, True))
    tiers: list[list[dict]] = [[] for _ in kinds]

    def collect(d: TuningDB) -> None:
        for i, (versions, sibling, relative) in enumerate(kinds):
            tiers[i] += [r for r in d.best_rows(env, key_contains=key.id, versions=versions, sibling=sibling,
                                                relative=relative)
                         if r["key"] == key.id]

    collect(db)
    for path in paths:
        try:
            with TuningDB(path, readonly=True, immutable=True) as other:
                collect(other)
        except Exception:  # noqa: BLE001 - a seed is optional; an unreadable file gives none
            continue
    out: list[TileConfig] = []
    for rows in tiers:
        for r in sorted(rows, key=lambda r: r["median_ms"]):
            cfg = TileConfig.from_dict(r)
            if cfg not in out and _runs(cfg, key, arch):
                out.append(cfg)
            if len(out) == limit:
                return out
    return out


def _measure(key: ProblemKey, shape: Shape, cfg: TileConfig, *, benchmarker: Benchmarker,
             db: TuningDB, env: Environment, arch: Arch) -> dict:
    """The DB row of ``cfg`` for ``key`` in ``env``: the stored one if any, else a new
    one (invalid / infeasible without benchmarking; an exception -> launch_failed)."""
    v = Variant(key.spec, cfg)
    row = db.lookup(key, v.id, env)
    if row is not None:
        return row
    fam = families.get(cfg.family)
    est = fam.estimate(v, arch)
    why = fam.unsupported(key, arch)
    broken = fam.violated_rules(v) if why is None else [f"family {fam.name}: {why}"]
    if broken:
        m = Measurement("invalid", error="; ".join(broken))
    elif not est.feasible:
        m = Measurement("infeasible", error=est.breakdown())
    else:
        try:
            m = benchmarker(v, shape)
        except MissingTiming:  # a simulation without this variant: nothing measured, no row
            raise
        except Exception as e:  # a crash in one candidate never ends the run
            m = Measurement("launch_failed", error=f"{type(e).__name__}: {e}")
    return db.get(db.record(key, shape, v, m, env, est.total_bytes, dedupe=True))


#: Row statuses of configs rejected before compiling (the family's rules, the shared
#: memory estimate): such a trial does not count toward a study's trial budget.
REJECTED = ("invalid", "infeasible")
#: How many rejected trials a study may run per trial of its budget (so a space whose
#: configs the rules mostly reject still ends).
REJECTED_PER_TRIAL = 20


def measured_trials(study: optuna.Study) -> int:
    """The study's completed trials that measured a config (or reused its stored row),
    not counting those the rules rejected before compiling (:data:`REJECTED`)."""
    return sum(map(_measured, study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))))


def _measured(t) -> bool:
    """Whether trial ``t`` counts in :func:`measured_trials`."""
    return t.state == TrialState.COMPLETE and t.user_attrs.get("status") not in REJECTED


class _MaxMeasured:
    """Stops a study once it holds ``n`` measured trials (:func:`measured_trials`),
    whichever worker ran them.  The study's first trials, while each is finished, are
    read once (``_read`` of them, ``_done`` measured): a call reads those after them."""

    def __init__(self, n: int):
        self.n = n
        self._read = self._done = 0

    def __call__(self, study: optuna.Study, trial) -> None:
        front, later = True, 0
        for t in study.get_trials(deepcopy=False)[self._read:]:
            front = front and t.state.is_finished()
            if front:
                self._read += 1
                self._done += _measured(t)
            else:
                later += _measured(t)
        if self._done + later >= self.n:
            study.stop()


def tune_key(key: ProblemKey, shape: Shape, *, benchmarker: Benchmarker, db: TuningDB,
             env: Environment, arch: Arch, n_trials: int, timeout_s: float | None = None,
             storage: str | Path | optuna.storages.BaseStorage | None = None, seed: int = 0,
             on_trial: Callable[[ProblemKey, int, int, dict], None] | None = None,
             sampler: str = "tpe", worker: str | None = None,
             family_names: Iterable[str] | None = None, check_study: bool = True) -> TuneResult:
    """Tune ``key`` by measuring ``shape`` until the study has ``n_trials`` measured
    trials (:func:`measured_trials`: earlier runs and other workers sharing the storage
    count; configs the rules reject before compiling do not) or ``timeout_s`` seconds
    have passed.  ``sampler``: ``tpe`` (Optuna's TPE) or ``grid`` (every config
    of the domain once: the exhaustive baseline).  ``worker`` names this process in each
    trial's user attrs, so a supervisor can fail the trials of a worker that died.

    The heuristic default config is measured first and enqueued as the study's first
    trial, followed by each other searched family's default (:func:`family_defaults`)
    and :func:`transfer_configs` (the winners of the nearest keys already tuned in
    ``db``).  A new study (not the grid sampler's) also measures :func:`prior_configs`
    right after the default, whole, outside the trial budget (what the dispatcher
    served this GPU before: its rows of another Triton version, a sibling GPU's), and
    enqueues those the search can suggest after the family defaults.
    ``on_trial(key, n_done, n_trials, row)`` is called after each trial with its DB row.
    ``family_names``: search only these kernel families (default: every one that serves
    ``key`` on ``arch``); a key none of them serves raises InputError, as does a
    stored study whose trials name no row of ``db`` (``check_study`` False: the caller
    checked it, :func:`tune`).  Never raises for a failing candidate.
    """
    t0 = time.perf_counter()
    space = search_space(key, arch, family_names)
    if not space:
        raise InputError(f"no kernel family of {sorted(family_names or families.FAMILIES)} serves {key.id} on "
                         f"{arch.sm}: " + "; ".join(f"{n}: {why}" for n, why in families.reasons(key, arch)))
    held = _HeldSignals(benchmarker)
    kw = dict(benchmarker=held, db=db, env=env, arch=arch)
    place = db_place(db)  # what each trial records of where its row went
    with held.section():
        study = optuna.create_study(storage=open_storage(storage, db),
                                    sampler=_sampler(sampler, space, seed),
                                    study_name=study_name(env, key, space), direction="minimize",
                                    load_if_exists=True)
    # Before any measurement is written: a study whose finished trials name no row of
    # this key and variant in db (row ids restart at 1 in a new or another file) was
    # tuned into another database; its trials would count here and nothing be searched.
    if check_study:
        _check_study_rows(study, db, key)

    default = default_config(key, arch, space)
    try:
        default_row = _measure(key, shape, default, **kw)
    except MissingTiming:
        default_row = None
    # The grid sampler visits the default anyway (and an enqueued trial would take a
    # grid point it does not evaluate).
    if sampler != "grid" and not study.trials:
        # What the dispatcher served this GPU before (another Triton's rows, a sibling
        # GPU's), measured whole, as the default is: a refined row's refinement knobs
        # are outside the search, so only one that the search can suggest is enqueued
        prior = [c for c in prior_configs(key, db, env, arch) if c.family in space]
        for cfg in prior:
            try:
                _measure(key, shape, cfg, **kw)
            except MissingTiming:
                pass
        # The default first, each other family's default, the prior configs, then what
        # won for the nearest keys already tuned here.
        firsts = [default, *family_defaults(key, arch, space),
                  *(c for c in prior if _suggestable(c, space)),
                  *(c for c in transfer_configs(key, db, env, arch) if c.family in space)]
        seen = set()
        with held.section():
            for params in (_params(c, space) for c in firsts):
                # configs that differ only in knobs outside the search (a refined row's)
                # give the same params: enqueue them once
                if params is not None and tuple(sorted(params.items())) not in seen:
                    seen.add(tuple(sorted(params.items())))
                    study.enqueue_trial(params)

    def n_complete() -> int:
        return measured_trials(study)

    done = n_complete()

    def objective(trial: optuna.Trial) -> float:
        nonlocal done
        if worker is not None:
            trial.set_user_attr("worker", worker)
        cfg = _suggest(trial, space)
        v = Variant(key.spec, cfg)
        try:
            row = _measure(key, shape, cfg, **kw)
        except MissingTiming as e:
            trial.set_user_attr("variant_id", v.id)
            raise optuna.TrialPruned(str(e)) from None
        fam = families.get(cfg.family)
        est = fam.estimate(v, arch)
        constraint = [float(len(fam.violated_rules(v))),
                      float(max(0, est.total_bytes - est.limit_bytes))]
        trial.set_constraint("rules_violated", constraint[0])
        trial.set_constraint("smem_excess_bytes", constraint[1])
        for name, val in (("variant_id", v.id), ("status", row["status"]), ("row_id", row["id"]),
                          ("created_at", row.get("created_at")), ("constraint", constraint),
                          ("db", place)):
            trial.set_user_attr(name, val)
        done += row["status"] not in REJECTED
        if on_trial is not None:
            on_trial(key, done, n_trials, row)
        return row["median_ms"] if row["status"] == "ok" else PENALTY_MS

    if n_trials > done:
        # Other workers may be filling the same study: stop when it holds n_trials
        # measured trials, whoever ran them.  A trial the rules reject is not counted
        # (it compiles nothing), but at most REJECTED_PER_TRIAL of them per trial are run.
        with held.section():
            study.optimize(objective, n_trials=(n_trials - done) * (1 + REJECTED_PER_TRIAL), timeout=timeout_s,
                           callbacks=[_MaxMeasured(n_trials)])

    best = db.best(key, env)
    best_ms = best["median_ms"] if best else None
    default_ms = default_row["median_ms"] if default_row and default_row["status"] == "ok" else None
    return TuneResult(
        key=key, best_config=TileConfig.from_dict(best) if best else None,
        best_median_ms=best_ms, tflops=best["tflops"] if best else None,
        default_config=default, default_median_ms=default_ms,
        speedup=default_ms / best_ms if default_ms and best_ms else None,
        # the default is measured before the study (its first trial reads that row back):
        # with no time for trials (timeout_s 0) it is still the one measurement
        n_trials=max(n_complete(), int(default_row is not None and default_row.get("status") not in REJECTED)),
        wall_s=time.perf_counter() - t0)


def db_place(db: TuningDB) -> str:
    """Where ``db`` lies: this host's name and the file's real path (each trial records
    the database its row went to, :func:`_check_study_rows`)."""
    return f"{socket.gethostname()}:{os.path.realpath(db.path)}"


def _check_study_rows(study: optuna.Study, db: TuningDB, key: ProblemKey) -> None:
    """Raise InputError when any of ``study``'s finished trials that wrote their row to
    ``db``'s place (:func:`db_place`; a trial that records none is taken as this
    database's) names no row of ``key`` in ``db`` (a row is named by its id, key,
    variant and measurement time; row ids restart at 1 in a new or another file): the
    database was replaced or deleted, or ``import --replace`` replaced some of its rows,
    and those trials would count here while their configs are never measured again.
    Trials of workers that write another database (another machine, another ``--db``,
    sharing the storage) keep their rows there and are not checked."""
    finished = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    place = db_place(db)
    missing = [t for t in finished if t.user_attrs.get("db", place) == place
               and not db.has_row(t.user_attrs.get("row_id"), key=key.id, variant_id=t.user_attrs.get("variant_id"),
                                  created_at=t.user_attrs.get("created_at"))]
    if missing:
        raise InputError(
            f"the Optuna storage holds finished trials of study {study.study_name!r}, but "
            f"{len(missing)} of their measurements in {db.path} are not there (was the DB replaced?); delete the "
            "storage (by default <db>.optuna.journal) or pass another --storage")


def tune(items: Iterable[tuple[ProblemKey, Shape]], *, benchmarker: Benchmarker, db: TuningDB,
         env: Environment, arch: Arch, n_trials: int, timeout_per_key_s: float | None = None,
         storage: str | Path | optuna.storages.BaseStorage | None = None, seed: int = 0,
         on_key: Callable[[int, int, ProblemKey], None] | None = None,
         on_trial: Callable[[ProblemKey, int, int, dict], None] | None = None,
         sampler: str = "tpe", worker: str | None = None,
         family_names: Iterable[str] | None = None) -> list[TuneResult]:
    """:func:`tune_key` for each (key, shape) in order, sharing one storage.
    ``on_key(index, n_keys, key)`` is called before each key (e.g. to drive a progress
    bar).  ``family_names``: as :func:`tune_key`; keys none of them serves on ``arch``
    are left out (:func:`servable`)."""
    items = servable(items, arch, family_names)
    items = list(items)
    st = open_storage(storage, db)
    # every key's study checked against db before the first key writes a row
    existing = {s.study_name for s in st.get_all_studies()}
    for key, _ in items:
        name = study_name(env, key, search_space(key, arch, family_names))
        if name in existing:
            _check_study_rows(optuna.load_study(study_name=name, storage=st), db, key)
    results = []
    for i, (key, shape) in enumerate(items):
        if on_key is not None:
            on_key(i, len(items), key)
        results.append(tune_key(key, shape, benchmarker=benchmarker, db=db, env=env, arch=arch,
                                n_trials=n_trials, timeout_s=timeout_per_key_s, storage=st,
                                seed=seed, on_trial=on_trial, sampler=sampler, worker=worker,
                                family_names=family_names, check_study=False))
    return results


def refine_configs(key: ProblemKey, db: TuningDB, env: Environment, arch: Arch, knobs: Iterable[str],
                   family_names: Iterable[str] | None = None, by_family: dict | None = None
                   ) -> list[tuple[TileConfig, list[TileConfig]]]:
    """For each family of ``family_names`` that serves ``key`` on ``arch`` and has an ok
    row for it in ``db`` (``env``): (its best config, that config with every combination
    of the values the family's domain gives ``knobs`` for this key, other than itself,
    valid and feasible).  The domain is the search's (``domain``) and the knobs the
    family varies only around tuned rows (``refine_domain``, e.g. the Gluon backward's
    ``dq_ordered``).  Knobs the family's domain lacks for this key keep their value; a
    knob that is not refined but excludes a refined value is moved by the family's
    ``reconcile`` where it has one (the Gluon backward's TMA stores of dK and dV give way
    to a group split).
    ``by_family``: :meth:`TuningDB.best_configs_by_family` of ``env``, when the caller
    holds it."""
    import itertools

    knobs = tuple(knobs)
    space = search_space(key, arch, family_names)
    rows = (by_family if by_family is not None else db.best_configs_by_family(env)).get(key.id, ())
    out = []
    for best, _ in rows:
        fam = families.FAMILIES.get(best.family)
        if fam is None or best.family not in space:
            continue
        dom = {**fam.domain(key), **(fam.refine_domain(key) if hasattr(fam, "refine_domain") else {})}
        axes = [(k, dom[k]) for k in knobs if k in dom]
        cands = []
        for values in itertools.product(*(vals for _, vals in axes)):
            cfg = dataclasses.replace(best, **dict(zip((k for k, _ in axes), values)))
            if hasattr(fam, "reconcile"):
                cfg = fam.reconcile(key, cfg, best, knobs)
            v = Variant(key.spec, cfg)
            if cfg != best and cfg not in cands and not fam.violated_rules(v) and fam.estimate(v, arch).feasible:
                cands.append(cfg)
        out.append((best, cands))
    return out


def _best_of_families(db: TuningDB, key: ProblemKey, env: Environment, fams: set) -> dict | None:
    """The fastest ok row of ``key`` in ``env`` among the kernel families ``fams``."""
    portable = families.portable().name
    rows = [r for r in db.best_rows(env, key_contains=key.id)
            if r["key"] == key.id and (r.get("family") or portable) in fams]
    return min(rows, key=lambda r: (r["median_ms"], r["id"]), default=None)


def refine(items: Iterable[tuple[ProblemKey, Shape]], *, knobs: Iterable[str], benchmarker: Benchmarker,
           db: TuningDB, env: Environment, arch: Arch, family_names: Iterable[str] | None = None,
           on_key: Callable[[int, int, ProblemKey], None] | None = None,
           on_trial: Callable[[ProblemKey, int, int, dict], None] | None = None) -> list[TuneResult]:
    """Measure, for each (key, shape), the neighbours of each family's best row that
    differ in ``knobs`` only (:func:`refine_configs`), recording every measurement in
    ``db`` like :func:`tune_key` (float64 check first, through the benchmarker).  For a
    knob added to a family after its keys were tuned: the tuned winners with each value
    of the new knob, instead of a new search.  A key without an ok row of a family to
    start from is left out.  Each result's ``default_*`` fields hold the starting
    config (the best before among the refined families' rows), and its ``best_*`` fields
    the best of those families after, so ``speedup`` is what the refinement gained."""
    kw = dict(benchmarker=benchmarker, db=db, env=env, arch=arch)
    by_family = db.best_configs_by_family(env)
    results = []
    items = list(items)
    for i, (key, shape) in enumerate(items):
        t0 = time.perf_counter()
        starts = refine_configs(key, db, env, arch, knobs, family_names, by_family)
        if not starts:
            continue
        if on_key is not None:
            on_key(i, len(items), key)
        # the refined families' rows alone: another family's faster row is not what
        # this refinement started from or gained
        fams = {b.family for b, _ in starts}
        before = min((r for c, r in by_family.get(key.id, ()) if c.family in fams),
                     key=lambda r: (r["median_ms"], r["id"]), default=None)
        cands = [c for _, cs in starts for c in cs]
        for n, cfg in enumerate(cands, 1):
            row = _measure(key, shape, cfg, **kw)
            if on_trial is not None:
                on_trial(key, n, len(cands), row)
        best = _best_of_families(db, key, env, fams)
        before_ms = before["median_ms"] if before else None
        results.append(TuneResult(
            key=key, best_config=TileConfig.from_dict(best) if best else None,
            best_median_ms=best["median_ms"] if best else None, tflops=best["tflops"] if best else None,
            default_config=TileConfig.from_dict(before) if before else starts[0][0], default_median_ms=before_ms,
            speedup=before_ms / best["median_ms"] if before_ms and best else None,
            n_trials=len(cands), wall_s=time.perf_counter() - t0))
    return results


def servable(items: Iterable[tuple[ProblemKey, Shape]], arch: Arch, family_names: Iterable[str] | None = None
             ) -> list[tuple[ProblemKey, Shape]]:
    """The (key, shape) pairs that some family of ``family_names`` (default: any
    registered one) serves on ``arch``."""
    names = None if family_names is None else tuple(family_names)
    return [(k, s) for k, s in items if search_space(k, arch, names)]


# -- several worker processes sharing the studies (Optuna's distributed optimization) --

@dataclass(frozen=True)
class WorkerConfig:
    """What one tuning worker process needs (picklable: workers are spawned).

    ``storage`` is a journal-file path or an RDB URL shared by all workers; each worker
    opens ``db_path`` itself (SQLite in WAL mode, one transaction per record).
    ``fake_timings`` replaces the GPU benchmarker with a FakeBenchmarker, ``fake_model``
    with a :class:`ModelBenchmarker`; ``gpu`` pins
    the worker to one CUDA device (CUDA_VISIBLE_DEVICES) when not None.
    """

    index: int
    db_path: str
    storage: str
    env: Environment
    arch: Arch
    n_trials: int
    timeout_per_key_s: float | None = None
    seed: int = 0
    sampler: str = "tpe"
    gpu: int | None = None
    fake_timings: dict | None = None
    fake_delay_s: float = 0.0
    fake_model: bool = False
    family_names: tuple[str, ...] | None = None

    @property
    def name(self) -> str:
        return f"w{self.index}"


class _SlowFake(FakeBenchmarker):
    """A FakeBenchmarker whose measurements take ``delay_s`` (as a GPU's would)."""

    def __init__(self, timings, delay_s: float):
        super().__init__(timings)
        self.delay_s = delay_s

    def __call__(self, variant: Variant, shape: Shape) -> Measurement:
        time.sleep(self.delay_s)
        return super().__call__(variant, shape)


class Interrupted(KeyboardInterrupt):
    """Raised in a tuning process by a stop signal (SIGTERM, SIGHUP) as SIGINT raises
    KeyboardInterrupt, so both stop a run the same way; ``signum`` is the signal."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def stop_signal(e: KeyboardInterrupt) -> int:
    """The signal behind ``e``: its ``signum``, else SIGINT (Ctrl-C)."""
    return getattr(e, "signum", signal.SIGINT)


def _raise_interrupted(signum, frame):
    raise Interrupted(signum)


#: What stops a tuning process: SIGINT raises KeyboardInterrupt, these raise Interrupted.
_STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGHUP") if hasattr(signal, n))
#: Every signal that stops a tune or a tuning worker: Ctrl-C, SIGTERM and a terminal's hang-up.
_ALL_STOP_SIGNALS = (signal.SIGINT, *_STOP_SIGNALS)


@contextlib.contextmanager
def _signals_handled(signals: tuple[int, ...], handler):
    """While inside (main thread only; elsewhere Python cannot install handlers and
    nothing changes): ``signals`` go to ``handler``."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {s: signal.signal(s, handler) for s in signals}
    try:
        yield
    finally:
        for s, h in before.items():
            signal.signal(s, h)


def stop_signals_raise():
    """While inside: SIGTERM and SIGHUP raise :class:`Interrupted` (main thread only)."""
    return _signals_handled(_STOP_SIGNALS, _raise_interrupted)


def _signals_ignored(signals: tuple[int, ...] = _ALL_STOP_SIGNALS):
    """While inside (main thread only): ``signals`` are ignored."""
    return _signals_handled(signals, signal.SIG_IGN)


@contextlib.contextmanager
def _signals_blocked(signals: tuple[int, ...] = (signal.SIGTERM,)):
    """While inside (main thread, POSIX): ``signals`` are blocked, so they stay pending
    (a process started meanwhile inherits the mask across exec and unblocks them once it
    handles them: :func:`_worker_main`)."""
    if not hasattr(signal, "pthread_sigmask") or threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, set(signals))
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


class _NoInterruptTraceback:
    """A logging filter that keeps a record logged with a KeyboardInterrupt (Optuna's
    "Trial N failed ... KeyboardInterrupt()") to its one line: the traceback of a stop
    is noise; every other record, tracebacks included, passes unchanged."""

    def filter(self, record) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, KeyboardInterrupt):
            record.exc_info, record.exc_text = None, None
        return True


@contextlib.contextmanager
def interrupts_on_one_line():
    """While inside, Optuna's handlers log a trial stopped by a signal on its one line
    (:class:`_NoInterruptTraceback`); the filter is removed on exit."""
    import logging

    quiet = _NoInterruptTraceback()
    handlers = list(logging.getLogger("optuna").handlers)
    for h in handlers:
        h.addFilter(quiet)
    try:
        yield
    finally:
        for h in handlers:
            h.removeFilter(quiet)


#: Seconds a worker whose parent is gone gives its running trial to stop before it exits.
ORPHAN_GRACE_S = 10.0


def _stop_when_parent_dies(name: str, grace_s: float = ORPHAN_GRACE_S) -> None:
    """Start a daemon thread that stops this worker when the process that started it
    exits, however it ended (SIGKILL included).

    It blocks on :func:`multiprocessing.parent_process`'s sentinel (the parent's end of
    the spawn pipe on POSIX, the parent's process handle on Windows), which becomes
    ready when the parent exits: no polling, no platform-specific call (Linux's
    ``prctl(PR_SET_PDEATHSIG)`` follows the parent *thread* and exists on Linux only).
    It then interrupts the main thread with SIGTERM's handler (the running trial is
    marked FAIL, the DB closed); past ``grace_s`` seconds the process exits anyway."""
    import multiprocessing as mp

    parent = mp.parent_process()
    if parent is None:
        return

    def watch():
        parent.join()
        print(f"flashgen worker {name}: the tuning process {parent.pid} is gone; stopping",
              file=sys.stderr, flush=True)
        import _thread

        _thread.interrupt_main(signal.SIGTERM)
        time.sleep(grace_s)
        os._exit(128 + signal.SIGTERM)

    threading.Thread(target=watch, name=f"{name}-parent-watch", daemon=True).start()


class _StopAtMeasurement:
    """A worker's stop signals, acted on where stopping is safe.

    An exception raised at an arbitrary point can cut Optuna's own bookkeeping (a
    storage write, the telling of a trial) in half.  So a signal that arrives inside a
    measurement (the benchmarker, which Optuna calls inside the objective) raises
    :class:`Interrupted` at once: Optuna marks that trial FAIL.  One that arrives
    elsewhere is remembered and raised as the next measurement starts.  Further
    signals change nothing."""

    def __init__(self, benchmarker: Benchmarker):
        self.benchmarker = benchmarker
        self.signum: int | None = None
        self.inside = False

    def handler(self, signum, frame) -> None:
        if self.signum is not None:
            return
        self.signum = signum
        if self.inside:
            raise Interrupted(signum)

    def __call__(self, variant: Variant, shape: Shape) -> Measurement:
        if self.signum is not None:
            raise Interrupted(self.signum)
        self.inside = True
        try:
            return self.benchmarker(variant, shape)
        finally:
            self.inside = False

    def __getattr__(self, name):
        return getattr(self.benchmarker, name)


class _HeldSignals(_StopAtMeasurement):
    """A single-process tune's stop signals (SIGINT, SIGTERM, SIGHUP) while Optuna runs
    (:meth:`section`: the study's creation, its enqueued trials, ``optimize``): one that
    arrives inside a measurement (the wrapped benchmarker) raises :class:`Interrupted`
    at once, and Optuna marks that trial FAIL; one that arrives in Optuna's own
    bookkeeping is held and raised as the next measurement starts or as the section
    ends, so a storage write is never cut in half (a KeyboardInterrupt inside Optuna's
    journal write once left its trial RUNNING and ended in Optuna's UnboundLocalError).
    Outside the sections signals act as before.  In a worker (its benchmarker is a
    :class:`_StopAtMeasurement`, whose handlers hold signals the same way) and outside
    the main thread the sections change nothing."""

    def __init__(self, benchmarker: Benchmarker):
        super().__init__(benchmarker)
        self.holding = False
        # (outside the main thread _signals_handled installs nothing)
        self.active = not isinstance(benchmarker, _StopAtMeasurement)

    def handler(self, signum, frame) -> None:
        if self.inside or not self.holding:
            raise Interrupted(signum)
        if self.signum is None:
            self.signum = signum

    @contextlib.contextmanager
    def section(self):
        if not self.active or self.holding:
            yield
            return
        with _signals_handled(_ALL_STOP_SIGNALS, self.handler):
            self.holding = True
            try:
                yield
            finally:
                self.holding = False
        if self.signum is not None:
            raise Interrupted(self.signum)


def _worker_main(items: list[tuple[ProblemKey, Shape]], cfg: WorkerConfig) -> None:
    """One tuning worker (the target of the spawned process).  SIGINT, SIGTERM and
    SIGHUP stop it (:class:`_StopAtMeasurement`): its running trial is marked FAIL, the rows
    already recorded stay, and it exits with 128 + the signal's number, without a
    traceback.  It stops by itself when its parent exits (:func:`_stop_when_parent_dies`)."""
    if cfg.gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(cfg.gpu)
    if cfg.fake_timings is not None:
        bench: Benchmarker = _SlowFake(cfg.fake_timings, cfg.fake_delay_s)
    elif cfg.fake_model:
        bench = ModelBenchmarker(cfg.arch)
    else:
        from .bench import KernelBenchmarker

        bench = KernelBenchmarker(workers=1)
    stop = _StopAtMeasurement(bench)
    for s in _ALL_STOP_SIGNALS:
        signal.signal(s, stop.handler)
    if hasattr(signal, "pthread_sigmask"):
        # started with the stop signals blocked (_start_worker): one sent meanwhile is
        # handled now, and stops this worker at its first measurement
        signal.pthread_sigmask(signal.SIG_UNBLOCK, set(_ALL_STOP_SIGNALS))
    _stop_when_parent_dies(cfg.name)
    try:
        with interrupts_on_one_line(), TuningDB(cfg.db_path) as db:
            # Workers start their keys in different orders, so they spread over the keys
            # at first instead of all joining the first study.
            k = cfg.index
            order = items[k % len(items):] + items[:k % len(items)] if items else items
            tune(order, benchmarker=stop, db=db, env=cfg.env, arch=cfg.arch, n_trials=cfg.n_trials,
                 timeout_per_key_s=cfg.timeout_per_key_s, storage=cfg.storage, seed=cfg.seed + k,
                 sampler=cfg.sampler, worker=cfg.name, family_names=cfg.family_names)
        if stop.signum is not None:
            # a stop signal that no measurement met (what was left was already recorded
            # or refused): the run was still asked to stop, and says so
            sys.exit(128 + stop.signum)
    except KeyboardInterrupt as e:
        sys.exit(128 + stop_signal(e))
    finally:
        # The work is over, done or stopped.  A stop signal that comes now (the parent's
        # SIGTERM after a Ctrl-C this worker already acted on) is ignored: interpreter
        # shutdown puts a Python handler back to the default action, which would kill
        # the exiting worker (exit code -15) instead of letting it exit with its own
        # code; an ignored signal stays ignored through shutdown.
        for s in _ALL_STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)


def fail_trials_of(storage: str | optuna.storages.BaseStorage, worker: str) -> int:
    """Mark FAIL every RUNNING trial that ``worker`` started (it died mid-trial);
    returns how many.  Its study budget counts completed trials only, so the other
    workers run the trial again."""
    st = open_storage(storage, None) if isinstance(storage, str) else storage
    n = 0
    for study in st.get_all_studies():
        for t in st.get_all_trials(study._study_id, deepcopy=False, states=(TrialState.RUNNING,)):
            if t.user_attrs.get("worker") == worker:
                st.set_trial_state_values(t._trial_id, TrialState.FAIL)
                n += 1
    return n


def _start_worker(p, started: Callable[[], None] | None = None) -> None:
    """Start the spawned worker process ``p`` with its stop signals (SIGINT, SIGTERM,
    SIGHUP) blocked, then call ``started()`` (if given); a stop signal this process gets
    meanwhile is held and raised once ``started`` has run.

    The signal mask survives exec, so a stop signal that reaches the worker before
    _worker_main has set its handlers (it imports torch first: seconds) stays pending
    until then, instead of killing it outright (SIGTERM, SIGHUP) or raising
    KeyboardInterrupt with a traceback in the middle of an import (SIGINT); the handler
    then stops the worker at its first measurement.  (SIGINT was once ignored there
    instead: a Ctrl-C that reached a starting worker and not the tuning process was
    lost, and the run went on.  Where ``signal.pthread_sigmask`` is missing it still is.)
    In this process the mask holds the calling thread's signals only, and a signal sent
    to the process goes to any thread that does not block it (``import torch`` starts
    one), whose delivery Python then raises in the main thread; so Python-level handlers
    hold them too: the caller records the new worker in ``started``, and stopping stops
    it with the others.  multiprocessing's resource tracker is started first: its own
    start unblocks SIGINT and SIGTERM in the calling thread once it has spawned the
    tracker (CPython's bpo-33613 fix), which inside the block below would start the
    first worker unprotected."""
    if os.name == "posix":
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()
    held: list[int] = []

    def hold(signum, frame):
        if not held:
            held.append(signum)

    child = _signals_blocked(_ALL_STOP_SIGNALS) if hasattr(signal, "pthread_sigmask") \
        else _signals_ignored((signal.SIGINT,))
    with _signals_handled(_ALL_STOP_SIGNALS, hold), child:
        p.start()
        if started is not None:
            started()
    if held:
        # back under the caller's handlers: raised there as if it came now
        signal.raise_signal(held[0])


def tune_parallel(items: Iterable[tuple[ProblemKey, Shape]], configs: list[WorkerConfig],
                  on_exit: Callable[[str, int, int], None] | None = None,
                  on_start: Callable[[dict[str, int]], None] | None = None,
                  stop_grace_s: float = 10.0) -> dict[str, int]:
    """Run one spawned process per WorkerConfig over the same (key, shape) list, all
    sharing each key's study through the configs' storage, and wait for them.

    A worker that exits abnormally has its RUNNING trials failed (:func:`fail_trials_of`).
    ``on_start({name: pid})`` is called once all are started; ``on_exit(name,
    exitcode, n_failed_trials)`` as each worker ends.
    Returns {worker name: exit code}.

    Stopping: SIGINT (KeyboardInterrupt) or, while this runs in the main thread,
    SIGTERM or SIGHUP (:class:`Interrupted`) stops the workers: each gets SIGTERM, and
    one still running ``stop_grace_s`` seconds later is killed; their RUNNING trials
    are failed, ``on_exit`` is called for each, and the exception is raised again.
    Rows already recorded stay in the DB.  A worker whose parent dies (even by SIGKILL)
    stops by itself (:func:`_stop_when_parent_dies`).  When every worker ended by a stop
    signal (exit code 128 + SIGINT, SIGTERM or SIGHUP) the run was stopped even if this
    process missed the signal (a Ctrl-C that reached the workers alone, or a
    KeyboardInterrupt that Python dropped inside a finalizer): :class:`Interrupted` with
    the first worker's signal is raised after they ended.
    """
    import multiprocessing as mp
    from multiprocessing.connection import wait

    items = list(items)
    for storage in {c.storage for c in configs}:
        open_storage(storage, None)  # create the schema once, before workers race to
    for path in {c.db_path for c in configs}:
        TuningDB(path).close()  # likewise the tuning DB
    ctx = mp.get_context("spawn")
    procs = {c.name: (ctx.Process(target=_worker_main, args=(items, c), name=c.name), c) for c in configs}
    codes: dict[str, int] = {}
    running: dict = {}

    def ended(name, p, c):
        p.join()
        codes[name] = p.exitcode
        n_failed = fail_trials_of(c.storage, name) if p.exitcode != 0 else 0
        if on_exit is not None:
            on_exit(name, p.exitcode, n_failed)

    try:
        with stop_signals_raise():
            for name, (p, c) in procs.items():
                def track(name=name, p=p, c=c):
                    running[p.sentinel] = (name, p, c)

                _start_worker(p, track)
            if on_start is not None:
                on_start({name: p.pid for name, (p, _) in procs.items()})
            while running:
                # Handle each worker as it ends, so a dead worker's trial is failed (and so
                # offered to the others again) while they still run.
                for sentinel in wait(list(running)):
                    ended(*running[sentinel])
                    del running[sentinel]  # only now: a stop inside ended() sees it again
        stops = [code - 128 for code in codes.values() if code - 128 in _ALL_STOP_SIGNALS]
        if stops and len(stops) == len(codes):
            raise Interrupted(stops[0])
    except BaseException:
        with _signals_ignored():  # a second Ctrl-C cannot cut the stopping short
            for _, p, _ in running.values():
                p.terminate()
            deadline = time.monotonic() + stop_grace_s
            while running:
                ready = wait(list(running), timeout=max(0.0, deadline - time.monotonic()))
                if not ready:  # past the grace period: kill the rest
                    for _, p, _ in running.values():
                        p.kill()
                    ready = list(running)
                for sentinel in ready:
                    ended(*running[sentinel])
                    del running[sentinel]
        raise
    return codes


def summarize(items: Iterable[tuple[ProblemKey, Shape]], *, db: TuningDB, env: Environment,
              arch: Arch, storage: str | Path | optuna.storages.BaseStorage | None = None,
              family_names: Iterable[str] | None = None) -> list[TuneResult]:
    """TuneResults of keys already tuned (by any number of workers), from the DB and the
    studies, without measuring anything."""
    st = open_storage(storage, db)
    out = []
    for key, _ in items:
        names = list(search_space(key, arch, family_names))
        default = default_config(key, arch, names)
        drow = None if default is None else db.lookup(key, Variant(key.spec, default).id, env)
        best = db.best(key, env)
        try:
            study = optuna.load_study(study_name=study_name(env, key, names), storage=st)
            n = measured_trials(study)
        except KeyError:
            n = 0
        best_ms = best["median_ms"] if best else None
        default_ms = drow["median_ms"] if drow and drow["status"] == "ok" else None
        out.append(TuneResult(
            key=key, best_config=TileConfig.from_dict(best) if best else None,
            best_median_ms=best_ms, tflops=best["tflops"] if best else None,
            default_config=default, default_median_ms=default_ms,
            speedup=default_ms / best_ms if default_ms and best_ms else None,
            n_trials=n, wall_s=0.0))
    return out

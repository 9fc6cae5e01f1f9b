"""ProblemKey -> kernel family + TileConfig (``TileConfig.family``), memoized: in-memory
cache <- tuning databases <- nearest tuned bucket <- heuristic default.  A key with score
mods and no bucket of its own takes the same mods' nearest row at another head dim, else
the plain key's fastest tiles that serve it (a family that compiles its mods, a config
that fits its shared memory).

Kernel families are reached through :mod:`flashgen.families` only: a row counts when its
family serves the key on this arch (else the family's reason is kept for ``explain``),
its rules and shared-memory estimate are the family's, and the heuristic default is the
portable (Triton) family's.  Families compete by their measured rows.

Databases: every ``*.sqlite`` shipped in ``tuning_db/`` (package data), plus the user's
database named by ``$FLASHGEN_DB`` or :func:`add_database`.  A row counts when it was
measured on this GPU (name, compute capability) with this code (template hash).  The
key's rows, then its nearest bucket, are taken first from the rows of this Triton version
(exact), then from those of another Triton version: the same generated code on the same
GPU, flagged with the versions it was tuned under (``Choice.tuned_under``, shown by
``explain``); ``flashgen tune`` records rows for the installed versions.  The torch
version is recorded, never matched.  A key that none of this GPU's rows serves (exactly
or by its nearest bucket) takes a *sibling* GPU's rows the same way: another GPU of the
same compute capability and SM count (the H200's rows on an H100 SXM; H100, both tables
measured side by side: the shipped H200 rows 1.16x / 1.19x / 1.13x the heuristic defaults'
forward / backward / forward+backward over eight shapes of the FlashAttention grid, the
Llama-3-8B shapes and the training step's layer,
docs/benchmarks.md), flagged with its name.  Rows of other GPUs or other code are
ignored, with one warning per user database; a GPU that has shipped rows and still runs
a default gets one warning per process.  A database is read once and read again when its file
changes (checked on a cache miss only, so the hot path is one dict lookup).

Inside a CUDA graph capture (:func:`graph_capturing`) the dispatcher never tunes, never reads
a database and never synchronizes: it answers from its memory cache, else with the
heuristic default, which it does not memoize (so the first call outside a capture still
reads the databases).
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import math
import os
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

from . import families
from .arch import INTERPRETER
from .errors import InputError, UnsupportedError
from .spec import (
    WHOLE_BWD, WHOLE_BWD_VARLEN, ProblemKey, TileConfig, Variant, is_decode, is_user_mods, is_varlen, whole_bwd_mods,
)

#: Variants of a non-portable family that failed to build or launch in this process
#: (variant id -> the error): the dispatcher never picks them again, and each was warned
#: about once (:meth:`Dispatcher.mark_failed`).
_failed: dict[str, str] = {}


@dataclass(frozen=True)
class Choice:
    """What the dispatcher picked for a key, and why."""

    key: ProblemKey
    config: TileConfig
    source: str  # "tuned" | "nearest" | "default"
    tuned_key: str | None = None  # the key of the row used (nearest bucket)
    median_ms: float | None = None
    tflops: float | None = None
    database: str | None = None
    smem_bytes: int = 0
    smem_breakdown: str = ""
    #: (name, why not) of each registered kernel family that cannot serve the key on
    #: the dispatcher's arch (``explain`` prints them).
    unserved: tuple[tuple[str, str], ...] = ()
    #: The versions the row was measured under where they differ from the installed
    #: ones (e.g. "triton 3.6.0"), after the GPU's name for a sibling GPU's row; None
    #: for a default or a row of this GPU and these versions.
    tuned_under: str | None = None
    #: The GPU the row was measured on where it is not this one (a sibling GPU's row,
    #: :data:`flashgen.env.SIBLING_COLUMNS`); None otherwise.
    tuned_on: str | None = None
    #: Why a family other than the portable one serves an untuned key (the measurement
    #: its default rests on); None otherwise.
    note: str | None = None

    @property
    def family(self) -> str:
        """The kernel family of the chosen config."""
        return self.config.family


@dataclass(frozen=True)
class BackwardChoice:
    """How a dense backward runs (:meth:`Dispatcher.backward`): by one family's whole
    backward (``choices`` = its ``bwd`` Choice) or by the two kernels ``bwd_dq`` and
    ``bwd_dkdv`` (``choices`` = their Choices), and why."""

    family: str
    choices: tuple[Choice, ...]
    reason: str
    deterministic: bool

    @property
    def whole(self) -> bool:
        """Whether one family's whole-backward kernel runs (else bwd_dq + bwd_dkdv)."""
        return len(self.choices) == 1

    @property
    def repeatable(self) -> bool:
        """Whether the gradients are bitwise identical from run to run: the two kernels'
        always are, a whole backward's when its family says so of its config
        (``deterministic``: dQ added in a fixed order)."""
        if not self.whole:
            return True
        cfg = self.choices[0].config
        fam = families.FAMILIES.get(cfg.family)
        return bool(getattr(fam, "deterministic", None) and fam.deterministic(cfg))


#: The backward's kernel names by role (the dense ones; a ragged batch's).
_BWD_NAMES = {"bwd_dq": "bwd_dq", "bwd_dkdv": "bwd_dkdv", WHOLE_BWD: WHOLE_BWD}
_BWD_VARLEN_NAMES = {"bwd_dq": "bwd_dq_varlen", "bwd_dkdv": "bwd_dkdv_varlen", WHOLE_BWD: WHOLE_BWD_VARLEN}


def _any_size(key: ProblemKey) -> bool:
    """A family without a size rule serves keys of any size."""
    return True


def family_allowed(name: str) -> bool:
    """Whether the dispatcher may serve a call with family ``name``: the environment
    variable ``FLASHGEN_FAMILIES`` (comma-separated family names, e.g. ``triton``) limits
    the families whose rows and defaults it picks, for a side-by-side measurement of one
    family against the others; the portable family always serves.  Unset or empty: every
    registered family.  Read when a choice is made (choices are memoized: set it before
    the first call, or call ``default_dispatcher().clear()``)."""
    allowed = os.environ.get("FLASHGEN_FAMILIES", "").strip()
    if not allowed:
        return True
    names = {n.strip() for n in allowed.split(",") if n.strip()}
    unknown = sorted(names - set(families.FAMILIES))
    if (unknown or not names) and allowed not in _warned_families:
        _warned_families.add(allowed)
        what = f"names no registered kernel family {unknown}" if unknown else "names no kernel family"
        warnings.warn(f"flashgen: FLASHGEN_FAMILIES={allowed!r} {what}; registered: {sorted(families.FAMILIES)} "
                      f"(only {families.portable().name}, the portable family, serves)", stacklevel=2)
    return name == families.portable().name or name in names


def families_left_out() -> str | None:
    """``"FLASHGEN_FAMILIES=<value> leaves out <names>"`` where the variable keeps a
    registered family from serving (:func:`family_allowed`), else None."""
    out = sorted(n for n in families.FAMILIES if not family_allowed(n))
    if not out:
        return None
    return f"FLASHGEN_FAMILIES={os.environ.get('FLASHGEN_FAMILIES', '').strip()!r} leaves out {', '.join(out)}"


#: FLASHGEN_FAMILIES values already warned about (unknown family names).
_warned_families: set = set()


def graph_capturing() -> bool:
    """Whether the current CUDA stream is capturing a CUDA graph (False without CUDA)."""
    import torch

    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def shipped_databases() -> list[Path]:
    """The tuning databases shipped with flashgen (``tuning_db/*.sqlite``): the
    repository's ``tuning_db/`` beside this package in a source checkout (also one
    imported through PYTHONPATH while pip's editable install points at another
    checkout), else the installed package data."""
    here = Path(__file__).resolve().parent.parent / "tuning_db"
    if (here / "__init__.py").is_file() and any(here.glob("*.sqlite")):
        d = here
    else:
        try:
            d = Path(str(importlib.resources.files("flashgen.tuning_db")))
        except ModuleNotFoundError:
            d = here
    return sorted(d.glob("*.sqlite")) if d.is_dir() else []


class Dispatcher:
    def __init__(self, databases: list[Path] | None = None, env=None, arch=None):
        self._explicit = None if databases is None else [Path(p) for p in databases]
        self._env = env
        self._arch = arch
        self._cache: dict[ProblemKey, Choice] = {}
        self._capture_defaults: dict[ProblemKey, Choice] = {}
        #: Per-call memo of the op's hot path (exact sizes -> launch facts), owned by
        #: :mod:`flashgen.library` and :mod:`flashgen.api`; cleared with the rest.
        self.fast: dict = {}
        # path -> (file state, tables): tables = ({key_id: ((cfg, row) of each family,
        # fastest first)} of this Triton version, the same of another Triton version, ok
        # rows of this GPU in any environment)
        self._tables: dict[Path, tuple[tuple, tuple[dict, dict, int]]] = {}
        self._backward: dict[tuple[ProblemKey, bool], BackwardChoice] = {}
        self._warned: set[Path] = set()
        self._lock = threading.Lock()

    # -- environment -------------------------------------------------------------
    @property
    def env(self):
        if self._env is None:
            from .env import Environment

            self._env = Environment.current()
        return self._env

    @property
    def arch(self):
        if self._arch is None:
            from .arch import current

            self._arch = current()
        return self._arch

    def databases(self) -> list[Path]:
        if self._explicit is not None:
            return self._explicit
        dbs = shipped_databases()
        user = os.environ.get("FLASHGEN_DB")
        if user:
            dbs = [Path(user)] + dbs  # the user's rows win ties
        return dbs

    def add_database(self, path) -> None:
        """Also read ``path`` (first: its rows win over the shipped ones)."""
        self._explicit = [Path(path)] + self.databases()
        self.clear()

    def clear(self) -> None:
        self._cache.clear()
        self._capture_defaults.clear()
        self._tables.clear()
        self._backward.clear()
        self.fast.clear()

    def mark_failed(self, variant: Variant, error: BaseException | str) -> None:
        """``variant`` (of a non-portable family, or a user variant whose config ran out of
        resources: :func:`flashgen.library.fall_back`) failed to build or launch: warn once
        per variant per process, never pick it again (the family's other rows, then the
        portable family, serve its keys) and forget the choices made so far (the
        databases stay loaded)."""
        if variant.id not in _failed:
            why = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
            _failed[variant.id] = why
            # a family's typed build error (the Gluon family's GluonBuildError) has warned once already
            if getattr(error, "variant_id", None) is None:
                instead = (f"the {families.portable().name} family serves its calls instead"
                           if variant.family != families.portable().name else
                           "the dispatcher's next choice for its key (another row, else the default) serves its calls")
                warnings.warn(f"flashgen: the {variant.family} kernel {variant.id} failed to build or launch with "
                              f"the installed Triton ({why[:300]}); {instead} (warned once per variant)", stacklevel=3)
        self._cache.clear()
        self._capture_defaults.clear()
        self._backward.clear()
        self.fast.clear()

    # -- database reading --------------------------------------------------------
    @staticmethod
    def _file_state(path: Path):
        """(mtime, size) of the database file and of its -wal file: a writer that keeps
        the database open (WAL mode) appends to the -wal file and leaves the main file
        untouched until a checkpoint."""
        st = path.stat()
        try:
            wal = Path(f"{path}-wal").stat()
            wal_state = (wal.st_mtime_ns, wal.st_size)
        except FileNotFoundError:
            wal_state = None
        return (st.st_mtime_ns, st.st_size, wal_state)

    def _table(self, path: Path) -> tuple[dict, dict, dict, dict, int]:
        """(rows of this environment, rows of this GPU and code under another Triton
        version, the same two of its sibling GPUs (:data:`flashgen.env.SIBLING_COLUMNS`),
        ok rows of this GPU in any environment) of one database: the lookup's tiers in
        order, then the count.  Each tier holds the fastest row per key and family that
        the family's rules admit for the row's own key (:func:`flashgen.db.rules_admit`;
        a refused row's next fastest is taken)."""
        try:
            mtime = self._file_state(path)
        except FileNotFoundError:
            if path not in self._warned and str(path) == os.environ.get("FLASHGEN_DB"):
                self._warned.add(path)
                warnings.warn(f"flashgen: FLASHGEN_DB={path} does not exist; using the shipped "
                              "tuning databases only", stacklevel=4)
            return {}, {}, {}, {}, 0
        hit = self._tables.get(path)
        if hit is not None and hit[0] == mtime:
            return hit[1]
        from .db import NotATuningDB, TuningDB, rules_admit

        if not path.is_file():  # a directory, a device, a fifo: nothing SQLite can open read-only
            origin = "FLASHGEN_DB" if str(path) == os.environ.get("FLASHGEN_DB") else "tuning database"
            raise InputError(f"{origin} {path} is not a file: a tuning database is an SQLite file "
                             "(flashgen tune --db FILE writes one)")

        try:
            # never writes to a shipped file, nor beside it (immutable: no locks, no -shm)
            with TuningDB(path, readonly=True, immutable=path in shipped_databases()) as db:
                table, other, sib, sib_other = (db.best_configs_by_family(self.env, versions=v, sibling=sb,
                                                                          admit=rules_admit)
                                                for v, sb in ((True, False), (False, False), (True, True),
                                                              (False, True)))
                n_gpu = sum(db.ok_rows_of_gpu(self.env.gpu_name, self.env.compute_capability).values())
                n_ok = db.count_ok() if not (table or other or sib or sib_other) else 0
                refused = n_ok and db.count_ok(env=self.env) > 0
        except NotATuningDB as e:
            origin = "FLASHGEN_DB" if str(path) == os.environ.get("FLASHGEN_DB") else "tuning database"
            raise InputError(f"{origin} {path}: {e}") from None
        # Shipped databases hold other GPUs' rows by design: warn only about the user's.
        if (not (table or other or sib or sib_other) and path not in self._warned and n_ok > 0
                and path not in shipped_databases()):
            self._warned.add(path)
            if refused:
                warnings.warn(f"flashgen: tuning database {path}: every row for this environment "
                              f"({self.env.gpu_name}, cc {self.env.compute_capability}) names a config its "
                              "kernel family's rules refuse for its key (measured under other rules, or "
                              "edited); its rows are ignored", stacklevel=3)
            else:
                warnings.warn(f"flashgen: tuning database {path} has no rows for this environment "
                              f"({self.env.gpu_name}, cc {self.env.compute_capability}, flashgen's "
                              "generated code); its rows are ignored", stacklevel=3)
        self._tables[path] = (mtime, (table, other, sib, sib_other, n_gpu))
        return table, other, sib, sib_other, n_gpu

    def _lookup(self, key: ProblemKey, serve: ProblemKey | None = None, where=None) -> Choice | None:
        """The tuned or nearest row of ``key``; with ``serve``, only rows whose config
        also serves ``serve`` (its family serves it and the config fits its shared
        memory); with ``where`` (TileConfig -> bool), only rows whose config it accepts."""
        loaded = [(p, self._table(p)) for p in self.databases()]
        near = None
        # this GPU's rows (this Triton version, then others), then its siblings' the same way
        for group in ((0, 1), (2, 3)):
            best = self._exact(key.id, loaded, serve, where, tiers=group)
            if best is not None:
                return best
            near = next((c for i in group
                         if (c := self._nearest(key, [(p, t[i]) for p, t in loaded], serve, where)) is not None),
                        None)
            if near is not None:
                break
        if near is None and key.spec.mods:
            # Score mods nobody tuned: the fastest tiles tuned for the same problem without
            # them that serve it (a family of its own, e.g. Gluon's forward, may not).
            plain = dataclasses.replace(key, spec=dataclasses.replace(key.spec, mods=""))
            # score mods and user functions take another problem's tiles only in the
            # portable family: a variant of another family (the Gluon forward's sinks,
            # softcap, ALiBi) is served by its own rows, whose tuning checked it against
            # float64 first
            portable = families.portable().name
            base = self._lookup(plain, serve=key, where=lambda c: c.family == portable)
            if base is not None:
                near = dataclasses.replace(base, key=key, source="nearest", tuned_key=base.tuned_key)
        if near is not None:
            # Another bucket's tiles, made fit for this key by their family (e.g. pointer
            # loads for a strided layout, a decode tile's packed rows).
            near = dataclasses.replace(near, config=families.get(near.config.family).adapt(near.config, key))
        return near

    def _serves(self, cfg: TileConfig, serve: ProblemKey | None, where=None) -> bool:
        """Whether ``cfg`` can run ``serve`` (None: any key): its family serves it here, the
        config fits its shared memory (a score mod's buffers included) and breaks none of
        the family's rules for ``serve`` (another key's tiles, e.g. the plain problem's for
        a user function that compiles with one stage only); and ``where`` (None: any
        config) accepts it."""
        if where is not None and not where(cfg):
            return False
        if serve is None:
            return True
        fam = self._family(cfg, serve)
        if fam is None:
            return False
        v = Variant(serve.spec, cfg)
        # another key's tiles (the plain problem's, for score mods) may break a rule of
        # this one (e.g. a user function that compiles with one stage only)
        return fam.estimate(v, self.arch).feasible and not fam.violated_rules(v)

    def _family(self, cfg: TileConfig, key: ProblemKey):
        """The family of ``cfg`` when it is registered, allowed (:func:`family_allowed`)
        and serves ``key`` on this arch (and the variant has not failed in this process),
        else None."""
        fam = families.FAMILIES.get(cfg.family)
        if fam is None or not family_allowed(fam.name) or fam.unsupported(key, self.arch) is not None:
            return None
        if _failed and Variant(key.spec, cfg).id in _failed:
            return None
        return fam

    def _nearest(self, key: ProblemKey, tables, serve: ProblemKey | None = None, where=None) -> Choice | None:
        """The nearest tuned bucket of ``key``'s kernel spec and GQA group (log2 distance
        over the sizes; a row of the other layout counts one bucket further).  For a key
        with score mods and no such bucket: the nearest row of the same kernel, dtype,
        mask and mods at another head dim (four buckets per octave of head dim) whose
        tile fits this head dim's rules and shared memory.  Those tiles were tuned
        holding the mod's registers, the plain key's were not (H200, head_dim 64
        forward: the plain keys' tiles ran 1.0-2.25x slower than the mods-tuned m64
        n64 w4 and spilled with dropout; docs/design.md).  A decode key takes another
        seqlen_q bucket's row only where its packed rows (the group's heads x seqlen_q)
        keep that row's BLOCK_M (:meth:`adapt` sets BLOCK_M to them): a taller tile is
        another kernel (H200, 32 / 8 heads, 4096 keys: seqlen_q 4's rows taken at 16-64
        query rows per kv head ran 0.060-0.143 ms at batch 1, where the forward kernels
        took 0.090 and an H100's heuristic default 0.026-0.039; at batch 8 their
        BLOCK_N 256 did not fit shared memory once the tile was 64 rows, and the call
        raised).  Every candidate must fit ``key`` as adapted.  One pass over the rows."""
        s = key.spec
        decode = is_decode(s.kernel)
        best = {True: (None, math.inf), False: (None, math.inf)}  # same spec? -> (choice, distance)
        for path, table in tables:
            for key_id, cfg, row in ((k, c, r) for k, rows in table.items() for c, r in rows):
                other = ProblemKey.from_row(row)
                o = other.spec
                if other.group != key.group:
                    continue
                if o == s:
                    d = 0.0
                elif s.mods and (o.kernel, o.dtype, o.mask, o.mods) == (s.kernel, s.dtype, s.mask, s.mods):
                    d = 4 * (abs(math.log2(o.head_dim / s.head_dim)) + abs(math.log2(o.head_dim_v / s.head_dim_v)))
                else:
                    continue
                d += (abs(math.log2(other.seqlen_q / key.seqlen_q)) + abs(math.log2(other.seqlen_k / key.seqlen_k))
                      + 0.5 * abs(math.log2(other.batch_heads / key.batch_heads)) + (other.layout != key.layout))
                cur, cur_d = best[o == s]
                # a nearer bucket wins; at the same distance the first one found stays, but
                # the same bucket's faster row (another database's) replaces it, as in _exact
                if d > cur_d or (d == cur_d and (cur.tuned_key != key_id or row["median_ms"] >= cur.median_ms)):
                    continue
                fam = self._family(cfg, key)
                if fam is None or not self._serves(cfg, serve, where):
                    continue  # a family that cannot serve this key (arch, layout, mode)
                if not getattr(fam, "large_enough", _any_size)(key):
                    continue  # another bucket's row of a family whose host time this key would not hide
                # Another head dim's tile can break this one's rules (e.g. the float32
                # accumulators of d128's m64 n64 w4 dK/dV at d256) as well as its shared
                # memory; another bucket's tile, as its family adapts it to this key, too.
                fit = Variant(s, fam.adapt(cfg, key))
                if ((decode and fit.config.BLOCK_M != cfg.BLOCK_M) or fam.violated_rules(fit)
                        or not fam.estimate(fit, self.arch).feasible):
                    continue
                best[o == s] = Choice(key, cfg, "nearest", key_id, row["median_ms"], row.get("tflops"), str(path),
                                      tuned_under=self.env.version_note(row),
                                      tuned_on=self._other_gpu(row)), d
        return best[True][0] or best[False][0]

    # -- the hot path ------------------------------------------------------------
    def _with_smem(self, choice: Choice) -> Choice:
        est = families.get(choice.config.family).estimate(Variant(choice.key.spec, choice.config), self.arch)
        if not est.feasible and self.arch.name != INTERPRETER.name:
            s = choice.key.spec
            raise UnsupportedError(
                f"no tile config of flashgen's search space fits the shared memory of {self.arch.name} "
                f"({self.arch.smem_per_block_optin} B per block) for {s.kernel} with head_dim {s.head_dim}/"
                f"{s.head_dim_v} in {s.dtype}: the smallest needs {est.breakdown()}; use float16/bfloat16 "
                "or a smaller head_dim")
        return dataclasses.replace(choice, smem_bytes=est.total_bytes, smem_breakdown=est.breakdown(),
                                   unserved=families.reasons(choice.key, self.arch))

    def _default(self, key: ProblemKey) -> Choice:
        """The heuristic default: the default of the first other family (registry order)
        whose measurements put its default ahead of the portable family's for ``key``
        (``prefers_default``; e.g. the Gluon forward on sm_90), else the portable
        family's.  Other families' tuned rows compete by measurement as usual."""
        port = families.portable()
        for fam in families.FAMILIES.values():
            prefer = getattr(fam, "prefers_default", None)
            if fam is port or prefer is None:
                continue
            why = prefer(key, self.arch)
            if why:
                cfg = fam.default_config(key, self.arch)
                if cfg is not None and self._family(cfg, key) is not None:
                    return Choice(key, cfg, "default", note=f"{fam.name}'s default, measured ahead: {why}")
        return Choice(key, port.default_config(key, self.arch), "default")

    # -- the backward ------------------------------------------------------------
    def _exact(self, key_id: str, loaded: list | None = None, serve: ProblemKey | None = None,
               where=None, tiers: tuple[int, ...] = (0, 1, 2, 3)) -> Choice | None:
        """The fastest row of exactly ``key_id`` in the first of ``tiers`` that has one
        (:meth:`_table`'s order: this GPU under this Triton version, under others, then
        its sibling GPUs the same way; rows the rules refuse were left out there) whose
        family serves its key here and whose rules still admit it (some rules depend on
        the user functions traced since), and whose config serves ``serve``
        (:meth:`_serves`); None when there is none.  ``loaded``: the
        databases' tables, when the caller has them."""
        if loaded is None:
            loaded = [(p, self._table(p)) for p in self.databases()]
        for i in tiers:
            best = None
            for path, t in loaded:
                for cfg, row in t[i].get(key_id, ()):
                    key = ProblemKey.from_row(row)
                    fam = self._family(cfg, key)
                    # a user function's rules again: some depend on the functions traced
                    # since the database was loaded (a score function's captured-tensor
                    # index); every other rule was applied when it was loaded
                    if fam is None or (is_user_mods(key.spec.mods) and fam.violated_rules(Variant(key.spec, cfg))) \
                            or not self._serves(cfg, serve, where):
                        continue
                    if best is None or row["median_ms"] < best.median_ms:
                        best = Choice(key, cfg, "tuned", key_id, row["median_ms"], row.get("tflops"), str(path),
                                      tuned_under=self.env.version_note(row),
                                      tuned_on=self._other_gpu(row))
            if best is not None:
                return best
        return None

    def backward(self, key: ProblemKey, *, deterministic: bool = False,
                 capturing: bool | None = None) -> BackwardChoice:
        """How the backward of ``key`` (a ``bwd_dq``, ``bwd_dkdv`` or ``bwd`` key; or of a
        ragged batch, a ``bwd_dq_varlen``, ``bwd_dkdv_varlen`` or ``bwd_varlen`` key, whose
        whole backward is ``bwd_varlen``) runs, memoized.  The rule, in order:

        1. ``deterministic``: a whole-backward row whose config its family declares
           bitwise repeatable (``deterministic``: the Gluon backward with ``dq_ordered``,
           dQ added in a fixed order), the key's or its nearest bucket's, where it
           measured faster than the best ``bwd_dq`` + ``bwd_dkdv`` rows of its bucket;
           else those two kernels (the Triton family's separate dQ pass is bitwise
           repeatable; a reduce-add in arrival order is not).
        2. No family that compiles the whole backward (``bwd``) serves the key here: the
           two kernels (the families' reasons are kept).
        3. Its best ``bwd`` row (the key's, else its nearest bucket's) against the sum of
           the best ``bwd_dq`` and ``bwd_dkdv`` rows of the same bucket, all measured on
           this GPU: the faster.
        4. Otherwise (no such pair of measurements): that family's row or default where
           its measurements put its default ahead (``prefers_default``; the Gluon
           backward on sm_90 at the head dims and masks of ``BWD_DEFAULT_AHEAD``,
           ``BWD_VARLEN_DEFAULT_AHEAD`` and, for user mask functions,
           ``USER_BWD_DEFAULT_AHEAD`` in :mod:`flashgen.families.gluon.family`), else
           the two kernels.

        The two kernels' configs are :meth:`choose`'s for their own keys (``kernels`` below
        names them by their dense roles, ``bwd_dq``, ``bwd_dkdv`` and ``bwd``)."""
        names = _BWD_VARLEN_NAMES if is_varlen(key.spec.kernel) else _BWD_NAMES
        # with softcap, ALiBi or user functions a family's whole backward may serve a dense
        # key too (the Gluon one; with user functions unless an index is computed from the
        # score: its unsupported() says why not); bias and dropout: the two kernels alone
        whole = not key.spec.mods or (whole_bwd_mods(key.spec.mods) and not is_varlen(key.spec.kernel))
        roles = ("bwd_dq", "bwd_dkdv", WHOLE_BWD) if whole else ("bwd_dq", "bwd_dkdv")
        kernels = {r: dataclasses.replace(key, spec=dataclasses.replace(key.spec, kernel=names[r])) for r in roles}
        memo = (kernels["bwd_dq"], bool(deterministic))
        hit = self._backward.get(memo)
        if hit is not None:
            return hit
        if capturing is None:
            capturing = graph_capturing()
        choice = self._backward_uncached(kernels, bool(deterministic), capturing)
        if not capturing:
            self._backward[memo] = choice
        return choice

    def _backward_uncached(self, kernels: dict, deterministic: bool, capturing: bool) -> BackwardChoice:
        whole_key = kernels.get(WHOLE_BWD)

        def two(reason: str) -> BackwardChoice:
            cs = tuple(self.choose(kernels[k], capturing=capturing) for k in ("bwd_dq", "bwd_dkdv"))
            fam = cs[0].family if cs[0].family == cs[1].family else f"{cs[0].family}+{cs[1].family}"
            return BackwardChoice(fam, cs, reason, deterministic)

        def whole(choice: Choice, reason: str) -> BackwardChoice:
            choice = self._with_smem(choice)
            return BackwardChoice(choice.family, (choice,), reason, deterministic)

        if deterministic:
            why = "no whole-backward row measured bitwise repeatable for this key"
            if whole_key is not None and not capturing:
                for fam in families.FAMILIES.values():
                    repeatable = getattr(fam, "deterministic", None)
                    if whole_key.spec.kernel not in fam.kernels or repeatable is None:
                        continue
                    if fam.unsupported(whole_key, self.arch) is not None:
                        continue
                    measured = self._lookup(whole_key, where=lambda c, f=fam: c.family == f.name and f.deterministic(c))
                    if measured is None:
                        continue
                    versus = self._versus_two(measured, fam)
                    if versus is None:
                        why = (f"{fam.name} {measured.config.id} measured at {measured.tuned_key or whole_key.id} "
                               "without a two-kernel row of its bucket to compare")
                        continue
                    facts, ahead = versus
                    if ahead:
                        return whole(measured, f"deterministic: dQ added in a fixed order, bitwise repeatable; {facts}")
                    why = facts
            return two(f"deterministic: dQ by a separate pass (bwd_dq), bitwise repeatable ({why})")
        if whole_key is None:
            return two(f"score modifications ({kernels['bwd_dq'].spec.mods}): no family's whole backward (bwd) "
                       "serves them; bwd_dq and bwd_dkdv compile them in")
        fams = [f for f in families.FAMILIES.values() if whole_key.spec.kernel in f.kernels]
        serving = [f for f in fams if f.unsupported(whole_key, self.arch) is None and family_allowed(f.name)]
        if not serving:
            why = "; ".join(f"{f.name} does not serve the whole backward: "
                            + (f.unsupported(whole_key, self.arch) or families_left_out() or "")
                            for f in fams)
            return two(why or "no registered family compiles the whole backward")
        fam = serving[0]
        measured = None if capturing else self._lookup(whole_key)
        if measured is not None and measured.family != fam.name:
            measured = None
        if measured is not None:
            versus = self._versus_two(measured, fam)
            if versus is not None:
                facts, ahead = versus
                return whole(measured, facts) if ahead else two(facts)
        prefer = getattr(fam, "prefers_default", None)
        why = prefer(whole_key, self.arch) if prefer is not None else None
        wk, dqk, kvk = whole_key.spec.kernel, kernels["bwd_dq"].spec.kernel, kernels["bwd_dkdv"].spec.kernel
        if not why:
            # a row of the whole backward alone is not compared with anything: say so
            alone = "" if measured is None else (
                f"its {fam.name} {wk} row at {measured.tuned_key or whole_key.id} ({measured.median_ms:.4f} ms) has no "
                f"{dqk} + {kvk} rows of its bucket to be compared with (tune --kernels {dqk},{kvk},{wk}), and ")
            if not getattr(fam, "large_enough", _any_size)(whole_key):
                return two(f"{alone or 'untuned: '}too little work in this key's size buckets to hide the host "
                           f"time of the {fam.name} whole backward's launches")
            ws = whole_key.spec
            return two(f"{alone or 'untuned: '}no measurement puts the {fam.name} backward's default ahead for "
                       f"this key ({ws.dtype}, head_dim {ws.head_dim}, mask {ws.mask}"
                       + (", user functions" if is_user_mods(ws.mods) else f", score mods {ws.mods}" if ws.mods
                          else "")
                       + f", GQA group {whole_key.group}, seqlen_q / seqlen_k buckets {whole_key.seqlen_q} / "
                       f"{whole_key.seqlen_k})")
        if measured is not None:
            return whole(measured, f"{fam.name} row without a two-kernel row of its bucket to compare; its "
                                   f"backward measured ahead: {why}")
        cfg = fam.default_config(whole_key, self.arch)
        if cfg is None or self._family(cfg, whole_key) is None:
            return two(f"the {fam.name} default is not available here")
        return whole(Choice(whole_key, cfg, "default", note=why), f"untuned: the {fam.name} default measured "
                     f"ahead: {why}")

    def _other_gpu(self, row: dict) -> str | None:
        """The GPU of ``row`` where it is not this one (a sibling's), else None."""
        return row.get("gpu_name") if row.get("gpu_name") != self.env.gpu_name else None

    def _versus_two(self, measured: Choice, fam) -> tuple[str, bool] | None:
        """A whole-backward row against the best ``bwd_dq`` + ``bwd_dkdv`` rows of its
        bucket measured on the same GPU (this one, or the sibling ``measured`` came from):
        (the facts, whether the whole backward is at least as fast), or None when the
        bucket lacks either kernel's row on that GPU."""
        bucket = measured.tuned_key or measured.key.id
        names = _BWD_VARLEN_NAMES if is_varlen(measured.key.spec.kernel) else _BWD_NAMES
        prefix = f"attn_{names[WHOLE_BWD]}_"
        tiers = (0, 1) if measured.tuned_on is None else (2, 3)
        pair = [self._exact(bucket.replace(prefix, f"attn_{names[r]}_", 1), tiers=tiers)
                for r in ("bwd_dq", "bwd_dkdv")]
        if any(c is None or c.tuned_on != measured.tuned_on for c in pair):
            return None
        other_ms = pair[0].median_ms + pair[1].median_ms
        on = "" if measured.tuned_on is None else f" on {measured.tuned_on}"
        facts = (f"measured{on} at {bucket}: {fam.name} {names[WHOLE_BWD]} {measured.median_ms:.4f} ms vs "
                 f"{pair[0].family} {names['bwd_dq']} + {names['bwd_dkdv']} {pair[0].median_ms:.4f} + "
                 f"{pair[1].median_ms:.4f} = "
                 f"{other_ms:.4f} ms")
        return facts, measured.median_ms <= other_ms

    def choose(self, key: ProblemKey, *, capturing: bool | None = None) -> Choice:
        """The Choice for ``key`` (memoized).  ``capturing`` (default: ask CUDA whether
        the current stream is capturing a graph) makes a cache miss answer with the
        heuristic default without touching any database."""
        choice = self._cache.get(key)
        if choice is not None:
            return choice
        if capturing is None:
            capturing = graph_capturing()
        with self._lock:
            if capturing:
                choice = self._capture_defaults.get(key)
                if choice is None:
                    choice = self._with_smem(self._default(key))
                    self._capture_defaults[key] = choice
                return choice
            choice = self._lookup(key)
            if choice is None:
                choice = self._default(key)
                self._warn_shipped_gpu_default(key)
            elif choice.source == "nearest" and key.spec.mods:
                choice = self._default_over_nearest(key, choice)
            choice = self._with_smem(choice)
            self._cache[key] = choice
        return choice

    def _default_over_nearest(self, key: ProblemKey, near: Choice) -> Choice:
        """For score mods whose own bucket has no row: a family default measured ahead of
        what the portable family serves them (``prefers_default``, measured against the
        dispatcher's choice without that family: another bucket's rows, or the plain
        problem's tiles), rather than ``near`` when ``near`` is such a portable row; a
        nearest row of the other family itself stays."""
        if near.config.family != families.portable().name:
            return near  # another bucket's row of a family that measured itself: no comparison was made
        default = self._default(key)
        if default.note is None:
            return near
        where = f"{near.config.id} of {near.tuned_key}" if near.tuned_key else near.config.id
        return dataclasses.replace(default, note=f"{default.note}; instead of the nearest row ({where})")

    def _warn_shipped_gpu_default(self, key: ProblemKey) -> None:
        """Once per process: this GPU has rows in the shipped databases, yet ``key`` runs
        the heuristic default (says whether none of them applies to this code, or none
        is for the key's kernel spec)."""
        global _warned_shipped_default
        if _warned_shipped_default:
            return
        shipped = [p for p in self.databases() if p in shipped_databases()]
        tables = [self._table(p) for p in shipped]
        n_gpu = sum(t[4] for t in tables)
        if not n_gpu:
            return
        _warned_shipped_default = True
        env = self.env
        if not any(t[0] or t[1] for t in tables):
            why = ("none of them was measured with the generated code of this flashgen (their code "
                   "hashes differ; templates changed since they were tuned)")
        else:
            why = (f"none is for its kernel spec ({key.spec.id}, GQA group {key.group}) or a bucket "
                   "near it")
        warnings.warn(f"flashgen: {env.gpu_name} (cc {env.compute_capability}) has {n_gpu} tuned rows in "
                      f"the shipped tuning databases, but {key.id} runs the heuristic default config: "
                      f"{why}.  `flashgen tune` measures this GPU under triton {env.triton_version}; "
                      "`flashgen explain` shows each choice (warned once per process)", stacklevel=4)

    def config_for(self, key: ProblemKey, *, capturing: bool | None = None) -> TileConfig:
        return self.choose(key, capturing=capturing).config


def has_failed(variant: Variant) -> bool:
    """Whether ``variant`` failed to build or launch in this process (:meth:`Dispatcher.mark_failed`)."""
    return variant.id in _failed


_default: Dispatcher | None = None
#: Whether the once-per-process warning of a GPU with shipped rows running a default was given.
_warned_shipped_default = False


def default_dispatcher() -> Dispatcher:
    global _default
    if _default is None:
        _default = Dispatcher()
    return _default


def set_default_dispatcher(d: Dispatcher | None) -> None:
    """Replace the process-wide dispatcher (None: a fresh one on next use)."""
    global _default
    _default = d

"""The tuning database: one SQLite table of measurements (the only sqlite_utils user).

Each row is one (ProblemKey, exact shape, Variant) measured in one environment
(:class:`flashgen.env.Environment`), with its status (``spec.STATUSES``), median time
(ms), achieved TFLOP/s, error vs the reference, the modelled and compiled shared memory
(bytes) and the environment columns.  Rows are only ever appended: nothing here updates
or deletes a row.  Two processes may write one file at once: a new database runs in WAL
mode with a busy timeout, and each ``record`` is one transaction.  A file in rollback-journal
mode (what ships: :meth:`TuningDB.use_rollback_journal`) stays in it, so reading a shipped
file never creates -wal/-shm files beside it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
import os
import re
import sqlite3
import time
import urllib.parse
from pathlib import Path

import jinja2
import sqlite_utils

from . import families
from .env import (INTERPRETER_GPU, MATCH_COLUMNS, SIBLING_COLUMNS, SYNTHETIC_GPU_SUFFIXES, VERSION_COLUMNS,
                  Environment, real_gpu)
from .errors import InputError
from .spec import (ALL_KERNELS, KERNELS, STATUSES, TIMING_WINDOW, Measurement, kernel_mods, is_decode, is_varlen,
                   ProblemKey, Shape, TileConfig, Variant, shape_flops)

TABLE = "measurements"
#: TileConfig knobs of the Gluon family (:class:`flashgen.spec.TileConfig`): a row stores
#: NULL for a knob at its default 0, so the Triton family's rows hold exactly what they
#: held before the Gluon family existed.
GLUON_KNOBS = ("consumer_regs", "producer_regs", "pin", "persistent", "ctas_per_sm", "dq_atomic", "row_load",
               "producer_warps", "split", "group_split", "half_partials", "dq_ordered", "dq_stage",
               "kv_store", "snake", "serial_masked", "cross_tile", "o_in_q", "longest_first", "masked_first",
               "skip_masked", "dq_writer", "dq_chunks", "lookahead")
BUSY_TIMEOUT_S = 60.0

COLUMNS: dict[str, type] = {
    "id": int, "created_at": str,
    # ProblemKey.as_row()
    "key": str, "kernel": str, "dtype": str, "head_dim": int, "head_dim_v": int, "mask": str,
    "group_size": int, "seqlen_q_bucket": int, "seqlen_k_bucket": int, "batch_heads_bucket": int,
    "layout": str, "mods": str,  # OPTIONAL_COLUMNS
    # Variant
    "variant_id": str, "BLOCK_M": int, "BLOCK_N": int, "num_warps": int, "num_stages": int,
    "tma": int, "ws": int, "num_splits": int, "family": str,  # OPTIONAL_COLUMNS
    **{c: int for c in GLUON_KNOBS},  # OPTIONAL_COLUMNS (NULL in the Triton family's rows)
    # the exact shape measured
    "batch": int, "num_heads": int, "num_kv_heads": int, "seqlen_q": int, "seqlen_k": int,
    # Measurement
    "status": str, "median_ms": float, "tflops": float, "max_abs_err": float,
    "smem_bytes_model": int, "smem_bytes_compiled": int, "n_spills": int, "n_regs": int,
    "error": str,
    # Environment
    "gpu_name": str, "compute_capability": str, "sm_count": int, "triton_version": str,
    "torch_version": str, "flashgen_version": str, "template_hash": str,
}
#: Columns added after the first release: a file without them is still a tuning DB
#: (they read as NULL, i.e. the knob's default; the first write adds them).
OPTIONAL_COLUMNS = ("tma", "ws", "num_splits", "layout", "mods", "family", *GLUON_KNOBS)
ENV_COLUMNS = ("gpu_name", "compute_capability", "sm_count", "triton_version", "torch_version",
               "flashgen_version", "template_hash")
#: A row's identity across databases (``merge_from`` skips rows already present).
IDENTITY = ("key", "variant_id", *ENV_COLUMNS, "created_at")
#: The columns that group rows into one environment (what ``Environment.matches`` checks).
_ENV_GROUP = (*MATCH_COLUMNS, "template_hash")


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="microseconds")


def _key_id(key: ProblemKey | str) -> str:
    return key if isinstance(key, str) else key.id


def _connect_readonly(path: Path, immutable: bool = False) -> sqlite3.Connection:
    """A read-only connection; ``immutable`` (a file nothing writes while it is read,
    e.g. one shipped inside the package) takes no locks and creates no file beside it.
    Falls back to ``immutable=1`` for a WAL-mode file in a directory where SQLite cannot
    create the -shm file, and takes it for a file this process may not write
    (:func:`_may_write`) that has no -wal, -shm or -journal file beside it: every
    committed row is then in the file, and a WAL-mode read would leave its -wal and -shm
    files, which only a writer can remove, beside a file the user made read-only."""
    if not path.is_file():
        raise FileNotFoundError(f"no tuning database at {path}")
    uri = f"file:{urllib.parse.quote(str(path.resolve()))}?mode=ro"
    if not immutable and not _may_write(path) and not any(
            Path(f"{path}{sfx}").exists() for sfx in ("-wal", "-shm", "-journal")):
        immutable = True
    if immutable:
        return sqlite3.connect(uri + "&immutable=1", uri=True)
    conn = sqlite3.connect(uri, uri=True, timeout=BUSY_TIMEOUT_S)
    try:
        conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()
        return conn
    except sqlite3.OperationalError as e:
        conn.close()
        if "locked" in str(e) or "busy" in str(e):
            # a writer's lock: an immutable read would take its uncommitted pages
            raise InputError(f"tuning database {path} stayed locked by another process for {BUSY_TIMEOUT_S:g} s "
                             "(a tune, import or merge writing it; a rollback-journal file blocks readers "
                             "while it writes): run again when it is done, or read a copy") from None
        return sqlite3.connect(uri + "&immutable=1", uri=True)


class NotATuningDB(InputError):
    """A file that is not a flashgen tuning database (corrupt, or another program's
    SQLite file).  The file is left untouched."""


def validate(path: Path, pages: bool = True) -> None:
    """Raise NotATuningDB unless ``path`` is missing, empty, or an SQLite file whose
    ``measurements`` table has flashgen's columns (or that has no tables at all) and,
    with ``pages``, whose pages SQLite's ``quick_check`` finds sound (a file damaged
    past its schema page read as a flashgen database, and a tune wrote into it before
    a read of a damaged page failed; about 35 ms for the shipped 5 MB H200 file, which
    the dispatcher, reading it immutable, skips).  Reads only."""
    if not path.exists() or path.stat().st_size == 0:
        return
    side = [Path(f"{path}{sfx}") for sfx in ("-wal", "-shm")]
    before = {p for p in side if p.exists()}
    try:
        conn = _connect_readonly(path)
        try:
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            cols = {r[1] for r in conn.execute(f"PRAGMA table_info({TABLE})")} if TABLE in tables else set()
            damage = conn.execute("PRAGMA quick_check(1)").fetchone()[0] if pages and tables else "ok"
            if damage != "ok":
                first = damage.replace("*** in database main ***", "").strip().splitlines()
                raise sqlite3.DatabaseError(f"damaged: {first[0] if first else damage}")
        finally:
            conn.close()
    except sqlite3.DatabaseError as e:
        # a read of a corrupt WAL-mode file made an empty -wal and its -shm: removed, so
        # the file's directory is as it was ("left untouched")
        made = [p for p in side if p not in before and p.exists()]
        try:
            if made and all(p.stat().st_size == 0 for p in made if p.name.endswith("-wal")):
                for p in made:
                    p.unlink(missing_ok=True)
        except OSError:
            pass
        raise NotATuningDB(f"{path} is not a flashgen tuning database (SQLite says: {e}); "
                           "it was left untouched") from None
    if any(p not in before for p in side):
        # a read-only read of a WAL-mode file makes its -wal and -shm, which its close
        # cannot remove: SQLite removes them at the close of one writable connection if
        # it is the last one (another process's files stay theirs), so a run refused
        # after this check leaves the directory as it was
        tidy_side_files(path)
    if not tables:
        return
    missing = sorted(set(COLUMNS) - cols - set(OPTIONAL_COLUMNS))
    if TABLE not in tables or missing:
        what = f"no '{TABLE}' table" if TABLE not in tables else f"its '{TABLE}' table lacks {missing[:5]}"
        raise NotATuningDB(f"{path} is not a flashgen tuning database ({what}; tables: "
                           f"{sorted(tables)[:5]}); it was left untouched")


#: Files SQLite and the tuner may create beside a database at ``path`` (suffixes).
SIDE_FILES = ("-wal", "-shm", "-journal", ".optuna.journal")


def _may_write(path: Path) -> bool:
    """Whether ``path`` may be written: the process can (``os.access``), and, for root
    (whom ``os.access`` always allows), a write permission bit is set, so a file made
    read-only (``chmod a-w``) stays read-only in a container that runs as root."""
    if not os.access(path, os.W_OK):
        return False
    return os.geteuid() != 0 or bool(path.stat().st_mode & 0o222) if hasattr(os, "geteuid") else True


def _wal_files(path: Path) -> bool:
    """Whether a WAL-mode database's -wal or -shm file lies beside ``path``."""
    return any(Path(f"{path}{suffix}").exists() for suffix in ("-wal", "-shm"))


def check_writable(path: Path, what: str = "--db") -> None:
    """Raise InputError (naming ``path`` and the rule) unless a tuning database can be
    written at ``path``: its directory exists (never created here) and is writable
    (SQLite writes -wal/-shm/-journal files beside the database), and the path, if it
    exists, is a writable file.  Creates nothing."""
    path = Path(path)
    parent = path.parent
    export = path.suffix == ".json"  # flashgen export's JSON file, not a database
    if path.exists() and not path.is_file():
        raise InputError(f"{what} {path} is not a file (name a file, e.g. one inside that directory)")
    if not parent.is_dir():
        raise InputError(f"{what} {path}: directory {parent} does not exist (flashgen never creates "
                         f"directories for {'an export' if export else 'a database'}; create it first)")
    if path.exists() and not _may_write(path):
        raise InputError(f"{what} {path} is not writable: rows are appended to it (make it writable, "
                         "or name another file)")
    if not (os.access(parent, os.X_OK) and _may_write(parent)):
        raise InputError(f"{what} {path}: directory {parent} is not writable"
                         + ("" if export else " (SQLite creates the database's -wal/-shm/-journal files beside it)"))


def read_rows(path: str | Path) -> list[dict]:
    """Every row of the tuning DB at ``path``, oldest first, read-only: an empty file
    has none, and a WAL-mode file's -wal and -shm files that the read created are
    removed (:meth:`TuningDB.close`)."""
    with TuningDB(path, readonly=True) as src:
        return src.rows()


def write_copy(path: Path, rows: list[dict]) -> None:
    """A new tuning DB at ``path`` holding ``rows`` as they are (every column but ``id``;
    no checks: a copy of rows being replaced).  Never overwrites."""
    path = Path(path)
    if path.exists():
        raise FileExistsError(f"{path} exists; flashgen never overwrites it")
    with TuningDB(path, readonly=False) as out:
        out._add_missing_columns()
        with out._conn:
            out._insert(rows)


def remove_db_files(path: Path) -> None:
    """Remove the database file ``path`` and its side files (:data:`SIDE_FILES`)."""
    for p in (Path(path), *(Path(f"{path}{sfx}") for sfx in SIDE_FILES)):
        if p.exists():
            p.unlink()


def tidy_side_files(path: Path) -> None:
    """Where a WAL-mode database's -wal and -shm files lie beside ``path`` and the file
    and directory are writable: open and close it once, so SQLite checkpoints the WAL and
    removes both (nothing committed is lost); else leave them."""
    path = Path(path)
    if not (_wal_files(path) and path.is_file() and _may_write(path) and os.access(path.parent, os.W_OK)):
        return
    try:
        conn = sqlite3.connect(str(path), timeout=BUSY_TIMEOUT_S)
        try:
            conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()
        finally:
            conn.close()
    except sqlite3.Error:
        pass  # the files stay, as SQLite left them


def row_count(path: Path) -> int:
    """Rows of the measurements table at ``path``: 0 for a missing or empty file or one
    without the table, -1 when it cannot be read.  Reads only."""
    path = Path(path)
    if not path.is_file() or path.stat().st_size == 0:
        return 0
    tidy = not _wal_files(path)  # a read-only read of a WAL-mode file leaves its -wal and -shm
    try:
        conn = _connect_readonly(path)
        try:
            if not conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?",
                                (TABLE,)).fetchone():
                return 0
            return conn.execute(f"SELECT COUNT(*) FROM {TABLE}").fetchone()[0]
        finally:
            conn.close()
            if tidy:
                tidy_side_files(path)
    except sqlite3.DatabaseError:
        return -1


def _columns_variant_id(r: dict, key: ProblemKey | None = None, cfg: TileConfig | None = None) -> str:
    """The variant id of row ``r``'s kernel and config columns (those this version knows;
    ``key`` and ``cfg``: the row's, when the caller has built them)."""
    return Variant((key or ProblemKey.from_row(r)).spec, cfg or TileConfig.from_dict(r)).id


def _from_newer_version(r: dict) -> bool:
    """Whether row ``r`` names a config this version cannot rebuild from the columns it
    knows (its ``variant_id`` differs from the id of those columns): a flashgen with more
    knobs wrote it, and serving it would run another config under its timing."""
    try:
        return _columns_variant_id(r) != r["variant_id"]
    except (KeyError, TypeError, ValueError):
        return True


def _out_of_range(cfg: TileConfig) -> bool:
    """Whether a knob of ``cfg`` is outside what any family takes."""
    return min(cfg.BLOCK_M, cfg.BLOCK_N, cfg.num_warps, cfg.num_stages) < 1 or cfg.tma not in (0, 1) \
        or cfg.ws not in (0, 1) or cfg.num_splits < 0


#: The rows a lookup may serve: a time that is a finite positive number (``flashgen
#: import`` refuses the rest; a database read directly may hold an edited one).
_TIMED = "typeof([median_ms]) IN ('real', 'integer') AND [median_ms] > 0 AND [median_ms] < 1e300"


def rules_admit(r: dict) -> bool:
    """Whether the row ``r`` names a config its kernel family (registered here; NULL:
    the portable family) can run for its own key: knobs in range and none of the
    family's rules broken (``violated_rules``, and ``key_reasons`` where the family has
    rules that need the key's sizes).  A row measured under older rules, or
    edited or imported, may break them; a row that cannot be read as a key and a config
    is refused too.  What :meth:`TuningDB.best_rows` takes as ``admit`` for the
    dispatcher, ``flashgen show`` and ``flashgen export``."""
    fam = families.FAMILIES.get(r.get("family") or families.portable().name)
    if fam is None:
        return False
    try:
        key, cfg = ProblemKey.from_row(r), TileConfig.from_dict(r)
        if _bucket_problem(r, key) or _out_of_range(cfg) or fam.violated_rules(Variant(key.spec, cfg)):
            return False
        key_reasons = getattr(fam, "key_reasons", None)  # optional: rules that need the key's sizes
        return not (key_reasons is not None and key_reasons(key, cfg))
    except Exception:  # noqa: BLE001 - a hand-edited row (a zero, a wrong type) is not served
        return False


def shown(r: dict) -> bool:
    """What ``flashgen show`` and ``flashgen export`` take of the best rows: admitted by
    its family's rules (:func:`rules_admit`) and read as one of flashgen's measurements
    (what ``flashgen import`` checks, :func:`_row_problem`): a hand-edited database may
    hold a NULL key or GPU name or a text time, which the dispatcher never matches but
    show and export would print or write."""
    return rules_admit(r) and _row_problem(r) is None


#: The least ``median_ms`` an ok row may hold (1 ns): no GPU call is faster, and a
#: smaller time overflows the derived TFLOP/s to infinity, which no export can carry.
MIN_MEDIAN_MS = 1e-6


def _size_problem(r: dict, key: ProblemKey) -> str | None:
    """Why the shape columns of the row ``r`` (where it has them all) fall outside the
    buckets of its ``key`` (the TFLOP/s is derived from them), or None."""
    cols = ("batch", "num_heads", "num_kv_heads", "seqlen_q", "seqlen_k")
    if any(r.get(c) is None for c in cols):
        return None
    b, h, hk, sq, sk = (r[c] for c in cols)
    if hk < 1 or h % hk:
        return f"num_heads {h} is not a multiple of num_kv_heads {hk}"
    if is_varlen(key.spec.kernel):
        return None  # its sizes are the batch's totals and longest sequences, not one shape
    got = ProblemKey.from_sizes(key.spec, batch=b, num_heads=h, num_kv_heads=hk, seqlen_q=sq, seqlen_k=sk)
    if (got.group, got.seqlen_q, got.seqlen_k, got.batch_heads) != (key.group, key.seqlen_q, key.seqlen_k,
                                                                   key.batch_heads):
        return (f"its sizes (batch {b}, heads {h}/{hk}, seqlen_q {sq}, seqlen_k {sk}) fall in the buckets of "
                f"{got.id}, not of its key")
    return None


def _bucket_problem(r: dict, key: ProblemKey) -> str | None:
    """Why the size columns of the row ``r`` (of ``key``) are no bucket of flashgen's
    (the dispatcher and the tuner take their log2: nearest buckets, transfers), or None."""
    least_q = 1 if is_decode(key.spec.kernel) else 16
    for col, least in (("seqlen_q_bucket", least_q), ("seqlen_k_bucket", 16), ("batch_heads_bucket", 1)):
        val = r[col]
        if not (type(val) is int and val >= least and val & (val - 1) == 0):
            return f"{col} must be a power of two >= {least} (a bucket of flashgen's), got {val!r}"
    if not (type(r["group_size"]) is int and r["group_size"] >= 1):
        return f"group_size must be a whole number >= 1, got {r['group_size']!r}"
    return None


INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


def finite_real(v) -> bool:
    """A JSON number that is a finite float64: not a bool, not an integer past float64."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(float(v))
    except OverflowError:
        return False


def _row_problem(r) -> str | None:
    """Why ``r`` is not a measurement row of flashgen's (None: it is one)."""
    if not isinstance(r, dict):
        return f"not an object: {r!r:.60}"
    # rows exported before an optional column existed lack it (NULL: its default)
    missing = sorted(set(COLUMNS) - {"id"} - set(OPTIONAL_COLUMNS) - set(r))
    if missing:
        return f"lacks the columns {missing[:5]}"
    if r["status"] not in STATUSES:
        return f"status {r['status']!r} is not one of {', '.join(STATUSES)}"
    family = r.get("family")
    if family is not None and family not in families.FAMILIES:
        return f"family {family!r} is not a registered kernel family ({', '.join(families.FAMILIES)})"
    for f in dataclasses.fields(TileConfig):  # whole numbers, as their columns hold them
        val = r.get(f.name)
        if f.name != "family" and val is not None and type(val) is not int:
            return f"config field {f.name} must be a whole number, got {val!r}"
    if not (isinstance(r["created_at"], str) and r["created_at"]):
        return f"created_at must be the measurement's time, got {r['created_at']!r}"
    try:
        datetime.datetime.fromisoformat(r["created_at"])
    except ValueError:
        return f"created_at must be the measurement's time in ISO 8601 (as {_now()}), got {r['created_at']!r}"
    try:
        key = ProblemKey.from_row(r)
        cfg = TileConfig.from_dict(r)
    except (KeyError, TypeError, ValueError) as e:
        return f"bad kernel or config fields ({type(e).__name__}: {e})"
    if key.id != r["key"]:
        return f"key {r['key']!r} disagrees with its columns ({key.id})"
    bad = _bucket_problem(r, key)
    if bad:
        return bad
    if _out_of_range(cfg):
        return f"config {cfg.id} has a knob out of range"
    fam = families.FAMILIES[family or families.portable().name]
    odd = fam.config_reasons(cfg) if hasattr(fam, "config_reasons") else []
    if odd:
        return f"config {cfg.id} has a knob out of range ({odd[0]})"
    rebuilt = _columns_variant_id(r, key, cfg)
    if rebuilt != r["variant_id"]:
        return f"variant_id {r['variant_id']!r} disagrees with its columns ({rebuilt})"
    for col in ("gpu_name", "template_hash", "triton_version"):
        if not (isinstance(r[col], str) and r[col]):
            return f"{col} must name what the row was measured with, got {r[col]!r}"
    cc = r["compute_capability"]
    if not (isinstance(cc, str) and re.fullmatch(r"\d+\.\d+", cc)):
        return f"compute_capability must read like '9.0', got {cc!r}"
    for col in ("batch", "num_heads", "num_kv_heads", "seqlen_q", "seqlen_k", "sm_count"):
        if col in r and r[col] is not None and not (type(r[col]) is int and r[col] >= 0):
            return f"{col} must be a whole number >= 0, got {r[col]!r}"
    bad = _size_problem(r, key)
    if bad:
        return bad
    ms = r["median_ms"]
    if r["status"] == "ok" and not (finite_real(ms) and ms > 0):
        return f"an ok row needs a finite positive median_ms, got {ms!r:.60}"
    if r["status"] == "ok" and ms < MIN_MEDIAN_MS:
        return f"an ok row's median_ms must be >= {MIN_MEDIAN_MS} (1 ns), got {ms!r}"
    if ms is not None and not (finite_real(ms) and ms >= 0):
        return f"median_ms must be a finite number of ms or null, got {ms!r:.60}"
    tf = r.get("tflops")
    if tf is not None and not (finite_real(tf) and tf >= 0):
        return f"tflops must be a finite number >= 0 or null, got {tf!r:.60}"
    for col, typ in COLUMNS.items():  # what SQLite and the tools can hold: int64, a finite float64, text
        val = r.get(col)
        if val is None or col == "id":
            continue
        if typ is int and not (type(val) is int and INT64_MIN <= val <= INT64_MAX):
            return f"{col} must be a whole number within int64 or null, got {val!r:.60}"
        if typ is float and not finite_real(val):
            return f"{col} must be a finite number or null, got {val!r:.60}"
        if typ is str and not isinstance(val, str):
            return f"{col} must be text or null, got {val!r:.60}"
    return None


def _tflops(kernel: str, shape: Shape, head_dim: int, head_dim_v: int | None, mask: str, median_ms: float) -> float:
    """TFLOP/s of a measurement (:func:`flashgen.spec.shape_flops` over ``median_ms``); a
    ``window`` row's FLOPs are the scores :data:`flashgen.spec.TIMING_WINDOW` lets through."""
    flops = shape_flops(kernel, shape, head_dim, head_dim_v, causal=mask == "causal",
                        window=TIMING_WINDOW if mask == "window" else None)
    return flops / (median_ms * 1e-3) / 1e12


def derived_tflops(r: dict):
    """The ``tflops`` :meth:`TuningDB.record` derives for row ``r`` (a dict of its
    columns) from its shape and ``median_ms``; the stored value where the row lacks
    what that needs (not an ok row, no shape)."""
    need = ("kernel", "head_dim", "batch", "num_heads", "num_kv_heads", "seqlen_q", "seqlen_k", "median_ms")
    if r.get("status") != "ok" or any(r.get(c) is None for c in need) or not r["median_ms"] > 0:
        return r.get("tflops")
    shape = Shape(r["batch"], r["num_heads"], r["num_kv_heads"], r["seqlen_q"], r["seqlen_k"])
    return _tflops(r["kernel"], shape, r["head_dim"], r.get("head_dim_v"), r.get("mask"), r["median_ms"])


def check_rows(rows: list, source) -> None:
    """Raise NotATuningDB, naming ``source`` and the first bad rows, unless every row is
    a flashgen measurement: all columns (those of :data:`OPTIONAL_COLUMNS` may be missing:
    their defaults, e.g. no ``family`` is the Triton family), a status of
    ``spec.STATUSES``, a registered kernel family, known kernel, dtype, mask, mods and
    whole-number config fields that agree with ``key`` and ``variant_id``, a
    ``created_at`` time, whole-number sizes, a finite positive
    ``median_ms`` for ok rows, and a finite ``tflops`` >= 0 (or null)."""
    bad = [(i, why) for i, r in enumerate(rows) if (why := _row_problem(r)) is not None]
    if bad:
        more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
        raise NotATuningDB(f"{source}: {len(bad)} of {len(rows)} rows are not flashgen measurements, so "
                           "nothing was imported: " + "; ".join(f"{_row_name(rows[i], i)}: {w}" for i, w in bad[:3])
                           + more)


def _row_name(r, i: int) -> str:
    """How an error names row ``i`` of an import: its ``id`` where it has one (what
    sqlite3 finds), else its place in the export's list."""
    rid = r.get("id") if isinstance(r, dict) else None
    return f"row id {rid}" if type(rid) is int else f"row {i} (counting from 0)"


def _env_where(env: Environment, versions: bool = True, sibling: bool = False,
               relative: bool = False) -> tuple[str, list]:
    """SQL condition (and its parameters) selecting the rows that ``env`` matches
    (``versions``), or the rows of ``env``'s GPU, compute capability and code hash
    measured under another Triton version (``versions=False``); with ``sibling``, the
    same over the rows of the other GPUs of ``env``'s compute capability and SM count
    (:data:`flashgen.env.SIBLING_COLUMNS`) instead of ``env``'s GPU; with ``relative``,
    over the rows of the GPUs of ``env``'s compute capability and another SM count
    (their configs compile and fit here; their timings do not transfer)."""
    cols = MATCH_COLUMNS if versions else tuple(c for c in MATCH_COLUMNS if c not in VERSION_COLUMNS)
    if sibling or relative:
        cols = tuple(c for c in cols if c != "gpu_name")
    if sibling:
        cols = (*cols, *(c for c in SIBLING_COLUMNS if c not in cols))
    params: list = [getattr(env, c) for c in cols]
    cond = " AND ".join(f"[{c}] = ?" for c in cols)
    if relative:
        cond += " AND IFNULL([sm_count], -1) != ?"
        params.append(env.sm_count)
    if sibling or relative:
        # another GPU, measured on a GPU (not the interpreter's or a fake run's rows)
        cond += " AND [gpu_name] != ? AND [gpu_name] NOT LIKE ?" + " AND [gpu_name] NOT LIKE ?" * len(
            SYNTHETIC_GPU_SUFFIXES)
        params += [env.gpu_name, f"{INTERPRETER_GPU}%", *(f"%{s}" for s in SYNTHETIC_GPU_SUFFIXES)]
    if not versions:
        cond += " AND IFNULL([triton_version], '') != ?"
        params.append(env.triton_version)
    per_kernel = []
    for k in ALL_KERNELS:
        # one code hash per kernel family and score-modification set the kernel compiles
        hashes = families.hashes(k, kernel_mods(k))
        per_kernel.append(f"([kernel] = ? AND [template_hash] IN ({', '.join('?' * len(hashes))}))")
        params += [k, *hashes]
    return f"({cond} AND ({' OR '.join(per_kernel)}))", params


class TuningDB:
    """Append-only store of measurements at ``path``.

    Writable (the default when possible): the file and its parent directories are
    created if missing.  ``readonly=True``, or None with a file that exists but is not
    writable (a DB shipped inside an installed package), opens it for reading only;
    ``immutable=True`` (read-only) also promises that nothing writes the file meanwhile
    (SQLite's ``immutable=1``: no locks, nothing created beside it; for shipped files).
    """

    def __init__(self, path: str | Path, readonly: bool | None = None, immutable: bool = False):
        self.path = Path(path)
        self.last_conflicts = 0  # of the last import or merge (_insert_new)
        # A read-only connection to a WAL-mode file (validate()'s too) creates its -wal and
        # -shm files and, unable to checkpoint, leaves them at close (see close()).
        tidy = not immutable and not _wal_files(self.path)
        validate(self.path, pages=not immutable)
        if readonly is None:
            readonly = self.path.exists() and not (_may_write(self.path) and os.access(self.path.parent, os.W_OK))
        self.readonly = readonly
        self._tidy = readonly and tidy
        if readonly:
            self._conn = _connect_readonly(self.path, immutable)
            if not self._conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?",
                                      (TABLE,)).fetchone():
                # An empty SQLite file (validate() let it through): no rows.  A TEMP table
                # answers the queries; the file is not written.
                sql_type = {int: "INTEGER", str: "TEXT", float: "FLOAT"}
                cols = ", ".join(f"[{c}] {sql_type[t]}" + (" PRIMARY KEY" if c == "id" else "")
                                 for c, t in COLUMNS.items())
                self._conn.execute(f"CREATE TEMP TABLE {TABLE} ({cols})")
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._conn = sqlite3.connect(str(self.path), timeout=BUSY_TIMEOUT_S)
        self.db = sqlite_utils.Database(self._conn)
        self._t = self.db.table(TABLE)
        self._columns_added = False  # see _add_missing_columns
        if not readonly:
            # Several processes may open a new file at once; switching to WAL and
            # creating the table take locks that SQLite's busy handler does not always
            # wait for, so retry briefly.
            for attempt in range(50):
                try:
                    if not self._t.exists():
                        # A new database: WAL lets tuning workers write while others read.
                        # An existing one keeps its journal mode (a shipped file's
                        # rollback journal; see use_rollback_journal).
                        self.db.enable_wal()
                    self._t.create(COLUMNS, pk="id", if_not_exists=True)
                    self._t.create_index(["key"], if_not_exists=True)
                    break
                except sqlite3.OperationalError as e:
                    if "locked" not in str(e) or attempt == 49:
                        raise
                    time.sleep(0.1)

    def close(self) -> None:
        """Close the connection.  A read-only one that created a WAL-mode file's -wal and
        -shm files (absent when it opened) has a writable connection open and close the
        file once, where the file and its directory are writable: SQLite's last
        connection to close checkpoints an empty WAL (no change to the file) and removes
        both, and leaves them while another process has the file open."""
        self._conn.close()
        if self._tidy:
            self._tidy = False
            tidy_side_files(self.path)

    def _add_missing_columns(self) -> None:
        """Before the first write: a file written before a column existed gets it (NULL
        in its old rows, i.e. the default).  Opening and reading never change a file
        (e.g. a shipped database that a root process could write)."""
        if self._columns_added:
            return
        for attempt in range(50):
            try:
                have = set(self._t.columns_dict)
                for col, typ in COLUMNS.items():
                    if col not in have:
                        self._t.add_column(col, typ)
                break
            except sqlite3.OperationalError as e:
                if "duplicate column" in str(e):
                    continue  # another process added it meanwhile
                if "locked" not in str(e) or attempt == 49:
                    raise
                time.sleep(0.1)
        if self._conn.in_transaction:
            self._conn.commit()
        self._columns_added = True

    def use_rollback_journal(self) -> None:
        """Checkpoint the WAL into the file and switch it to rollback-journal mode
        (``PRAGMA journal_mode=DELETE``), which it keeps: readers of the file (a shipped
        database) then create no -wal/-shm files beside it.  Rows are unchanged.  Needs
        the only open connection to the file."""
        if self.readonly:
            raise InputError(f"{self.path} is open read-only")
        self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        mode = self._conn.execute("PRAGMA journal_mode=DELETE").fetchone()[0]
        if mode != "delete":
            raise InputError(f"{self.path}: could not leave WAL mode (journal_mode is {mode}; "
                             "another process has it open)")

    def __enter__(self) -> "TuningDB":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- writing ----------------------------------------------------------------------

    def record(self, key: ProblemKey, shape: Shape, variant: Variant, measurement: Measurement,
               env: Environment, smem_bytes_model: int, *, dedupe: bool = False) -> int:
        """Append one measurement (one transaction) and return its row id.

        With ``dedupe`` (what the tuner uses), a measurement of the same variant for the
        same key in the same environment that another process recorded first wins: the
        check and the insert are one ``BEGIN IMMEDIATE`` transaction, so concurrent
        tuning workers never store a (key, variant, environment) twice; the existing
        row's id is returned.

        ``tflops`` is derived from ``shape`` and ``measurement.median_ms`` (ok rows only)
        with :func:`flashgen.spec.shape_flops` for ``key.spec.kernel`` (a varlen key's
        documents summed, a ``window`` key's scores inside
        :data:`flashgen.spec.TIMING_WINDOW`, as the tuner times them).
        """
        if variant.spec != key.spec:
            raise ValueError(f"variant {variant.id} does not belong to key {key.id}")
        s, m = key.spec, measurement
        tflops = None
        if m.status == "ok" and m.median_ms:
            tflops = _tflops(s.kernel, shape, s.head_dim, s.head_dim_v, s.mask, m.median_ms)
        row = {
            "created_at": _now(), **key.as_row(), "variant_id": variant.id,
            **{c: val for c, val in variant.config.as_dict().items() if val or c not in GLUON_KNOBS},
            "batch": shape.batch, "num_heads": shape.num_heads, "num_kv_heads": shape.num_kv_heads,
            "seqlen_q": shape.seqlen_q, "seqlen_k": shape.seqlen_k,
            "status": m.status, "median_ms": m.median_ms, "tflops": tflops,
            "max_abs_err": m.max_abs_err, "smem_bytes_model": int(smem_bytes_model),
            "smem_bytes_compiled": m.smem_bytes_compiled, "n_spills": m.n_spills,
            "n_regs": m.n_regs, "error": m.error, **env.as_row(s.kernel, s.mods, variant.family),
        }
        self._add_missing_columns()
        if not dedupe:
            return self._t.insert(row).last_rowid
        where, params = self._filters(key=key, variant_id=variant.id, env=env)
        with self._immediate():
            hit = self._conn.execute(f"SELECT id FROM {TABLE} WHERE {' AND '.join(where)} "
                                     "ORDER BY [status] = 'ok' DESC, id LIMIT 1", params).fetchone()
            if hit is not None:
                return hit[0]
            return self._t.insert(row).last_rowid

    @contextlib.contextmanager
    def _immediate(self):
        """One ``BEGIN IMMEDIATE`` transaction (the write lock taken before the first
        read, so another process's writes cannot fall between what is read and what is
        written): committed on exit, rolled back on an exception."""
        if self._conn.in_transaction:  # an implicit one left open by a read
            self._conn.commit()
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            yield
            self._conn.execute("COMMIT")  # sqlite-utils leaves an outer transaction open
        except BaseException:
            if self._conn.in_transaction:
                self._conn.execute("ROLLBACK")
            raise

    def migrate_text_hashes(self, old_templates: str | Path) -> dict[str, int]:
        """Carry rows recorded under the old template identity (the text hash of the
        template files, flashgen before code hashes) over to the current code hash,
        for each kernel whose code is unchanged.

        ``old_templates``: a directory holding the templates those rows were measured
        with (e.g. ``git show <rev>:templates/...``).  For each kernel, a row whose
        ``template_hash`` is that directory's text hash is rewritten to the current
        :func:`flashgen.render.template_hash` only when every probe variant renders
        to the same source from both directories (``mods`` ""), i.e. the measured code
        is the code the dispatcher would run; rows of a kernel whose code changed, and
        rows with score mods (whose code those probes do not cover), are left as they
        are (and so stay unused).  Returns kernel -> rows rewritten
        (-1: code changed, or the old templates do not render it, e.g. they predate the
        kernel; none rewritten)."""
        from . import render

        if self.readonly:
            raise InputError(f"{self.path} is read-only; migrate a writable copy")
        old = str(old_templates)
        out = {}
        for k in KERNELS:
            try:
                same = render._code_hash(k, "", old) == render.template_hash(k, "")
            except jinja2.TemplateError:  # e.g. templates older than the kernel: nothing of it to carry
                same = False
            if not same:
                out[k] = -1
                continue
            # only rows without score mods: the probes compared are those of mods ""
            cur = self._conn.execute(f"UPDATE {TABLE} SET template_hash = ? WHERE kernel = ? AND template_hash = ? "
                                     "AND IFNULL(mods, '') = ''",
                                     (render.template_hash(k, ""), k, render.text_hash(k, old)))
            out[k] = cur.rowcount
        self._conn.commit()
        return out

    def merge_from(self, other_path: str | Path) -> int:
        """Append the rows of another tuning DB that this one lacks (identity:
        :data:`IDENTITY`); returns how many were added.  ``other_path`` is opened
        read-only and left unchanged (:func:`read_rows`).  ``tflops`` is derived again
        (:func:`derived_tflops`): an older flashgen counted a varlen row's FLOPs as batch
        x longest sequence, a window row's as unmasked."""
        rows = read_rows(other_path)
        return self._insert_new(rows, other_path)

    def import_rows(self, rows: list[dict]) -> int:
        """Append exported rows (:meth:`export_best`) that this DB lacks (identity:
        :data:`IDENTITY`); returns how many were added.  Nothing is overwritten; rows that
        are not measurements (:func:`check_rows`) refuse the whole import.  ``tflops`` is
        derived again, as :meth:`merge_from` does."""
        check_rows(rows, "rows to import")
        return self._insert_new(rows, "rows to import", checked=True)

    def _insert_new(self, rows: list[dict], source, drop: list[dict] = (), checked: bool = False) -> int:
        """Insert the rows this DB lacks (identity: :data:`IDENTITY`, among the rows that
        stay: ``drop`` is deleted in the same transaction), ``tflops`` derived again;
        those are checked (:func:`check_rows`) unless the caller ``checked`` all of
        ``rows``.  ``last_conflicts`` counts the rows left out that have a held row's
        identity but another status or median_ms (the held row, or the first such row of
        ``rows``, stays)."""
        cols = [c for c in COLUMNS if c != "id"]
        dropped = {r["id"] for r in drop}
        self._add_missing_columns()
        # what this DB has is read in the writing transaction: two merges of one source
        # at once each found every row missing and added it
        with self._immediate():
            have = {tuple(r[3:]): (r[1], r[2]) for r in self._conn.execute(
                f"SELECT id, status, median_ms, {', '.join(f'[{c}]' for c in IDENTITY)} FROM {TABLE}")
                if r[0] not in dropped}
            new = []
            self.last_conflicts = 0
            for r in rows:
                ident = tuple(r.get(c) for c in IDENTITY)
                if ident not in have:
                    have[ident] = (r.get("status"), r.get("median_ms"))
                    new.append({c: r.get(c) for c in cols})
                elif have[ident] != (r.get("status"), r.get("median_ms")):
                    self.last_conflicts += 1  # an edited copy of a row held: the held one stays
            if not checked:
                check_rows(new, source)
            for r in new:  # derived: counted as this version counts it
                r["tflops"] = derived_tflops(r)
            ids = sorted(dropped)
            for i in range(0, len(ids), 500):
                part = ids[i:i + 500]
                self._conn.execute(f"DELETE FROM {TABLE} WHERE id IN ({', '.join('?' * len(part))})", part)
            self._insert(new)
        return len(new)

    def _insert(self, rows: list[dict]) -> None:
        """INSERT ``rows`` (every column but ``id``; a missing one is NULL) inside the
        caller's transaction, unchecked."""
        cols = [c for c in COLUMNS if c != "id"]
        self._conn.executemany(f"INSERT INTO {TABLE} ({', '.join(f'[{c}]' for c in cols)}) "
                               f"VALUES ({', '.join('?' * len(cols))})", [tuple(r.get(c) for c in cols) for r in rows])

    def replaced_by(self, rows: list[dict]) -> list[dict]:
        """This DB's rows that ``rows`` replace (:meth:`replace_rows`): those of each
        problem key and environment (:data:`_ENV_GROUP`: GPU, compute capability, Triton
        version, generated code) in which ``rows`` hold an ok row, whatever their status,
        except a row equal to one of ``rows`` in every column but ``id`` and ``tflops``
        (which stays as it is)."""
        def group(r):
            return tuple(r.get(c) for c in ("key", *_ENV_GROUP))

        def content(r):
            return tuple(r.get(c) for c in COLUMNS if c not in ("id", "tflops"))

        groups = {group(r) for r in rows if r.get("status") == "ok"}
        same = {content(r) for r in rows}
        return [r for r in self.rows() if group(r) in groups and content(r) not in same]

    def replace_rows(self, rows: list[dict], source, keep: Path) -> tuple[int, list[dict]]:
        """Import ``rows`` (checked first, :func:`check_rows`) in place of this DB's rows
        of the same keys and environments (:meth:`replaced_by`): those are first copied to
        the new tuning DB ``keep`` (:func:`write_copy`; none is written when nothing is
        replaced), then deleted and ``rows`` inserted in one transaction; on any failure
        this DB is unchanged and ``keep`` is removed.  Returns (rows added, rows
        replaced)."""
        check_rows(rows, source)
        gone = self.replaced_by(rows)
        if gone:
            write_copy(keep, gone)
        try:
            return self._insert_new(rows, source, drop=gone, checked=True), gone
        except BaseException:
            if gone:
                remove_db_files(keep)
            raise

    def export_best(self, gpu_names: list[str] | None = None) -> list[dict]:
        """The best ok row per (key, environment) that its family's rules admit and that
        reads as a measurement (:func:`shown`) -- what a dispatcher can use --
        optionally only for the named GPUs, sorted by GPU then key, each with its
        provenance (``source_db``, ``source_row_id``) and without ``id``."""
        out = []
        for r in self.best_rows(admit=shown):
            if gpu_names and r["gpu_name"] not in gpu_names:
                continue
            r = dict(r)
            r["source_row_id"] = r.pop("id")
            r["source_db"] = str(self.path)
            out.append(r)
        return sorted(out, key=lambda r: (r["gpu_name"], r["key"], r["triton_version"], r["template_hash"]))

    # -- reading ----------------------------------------------------------------------

    def _select(self, where: list[str], params: list, order_by: str = "id",
                limit: int | None = None) -> list[dict]:
        return list(self._t.rows_where(" AND ".join(where) or None, params, order_by=order_by,
                                       limit=limit))

    def has_row(self, row_id, key: str | None = None, variant_id: str | None = None,
                created_at: str | None = None) -> bool:
        """Whether row ``row_id`` exists (and, where given, measured ``key`` and
        ``variant_id`` at ``created_at``: row ids restart at 1 in every file, and in one
        whose rows were all deleted, so an id alone may name another file's row)."""
        row = self._conn.execute(f"SELECT key, variant_id, created_at FROM {TABLE} WHERE id = ?",
                                 (row_id,)).fetchone()
        return (row is not None and (key is None or row[0] == key) and (variant_id is None or row[1] == variant_id)
                and (created_at is None or row[2] == created_at))

    def get(self, row_id: int) -> dict:
        return self._t.get(row_id)

    @staticmethod
    def _filters(key: ProblemKey | str | None = None, key_contains: str | None = None,
                 status: str | None = None, variant_id: str | None = None,
                 env: Environment | None = None, versions: bool = True,
                 sibling: bool = False, relative: bool = False) -> tuple[list[str], list]:
        where, params = [], []
        for col, val in (("key", key and _key_id(key)), ("status", status),
                         ("variant_id", variant_id)):
            if val is not None:
                where.append(f"[{col}] = ?")
                params.append(val)
        if key_contains:
            where.append("instr([key], ?) > 0")
            params.append(key_contains)
        if env is not None:
            cond, p = _env_where(env, versions, sibling, relative)
            where.append(cond)
            params += p
        return where, params

    def rows(self, *, key: ProblemKey | str | None = None, key_contains: str | None = None,
             status: str | None = None, variant_id: str | None = None,
             env: Environment | None = None) -> list[dict]:
        """Rows matching every given filter (``env``: :meth:`Environment.matches`), oldest
        first."""
        return self._select(*self._filters(key, key_contains, status, variant_id, env))

    def best(self, key: ProblemKey | str, env: Environment | None = None) -> dict | None:
        """The ok row of ``key`` with the lowest median_ms, among rows matching ``env``
        (any environment when None); None when there is none."""
        where, params = self._filters(key=key, status="ok", env=env)
        where.append(_TIMED)
        rows = self._select(where, params, order_by="median_ms, id", limit=1)
        return rows[0] if rows else None

    def best_rows(self, env: Environment | None = None, key_contains: str | None = None, versions: bool = True,
                  sibling: bool = False, admit=None, relative: bool = False) -> list[dict]:
        """The best ok row per key and environment (rows matching ``env`` only when
        given; with ``versions=False``, the rows of ``env``'s GPU and code measured under
        another Triton version; with ``sibling``, the same of the other GPUs of ``env``'s
        compute capability and SM count; with ``relative``, of the GPUs of its compute
        capability and another SM count), by key, in one query; and the best bitwise-repeatable
        one beside it where the key has rows of both (``dq_ordered``: what the
        deterministic backward runs).  A row whose ``variant_id`` this version cannot
        rebuild from its columns was written by a flashgen with more knobs
        (:func:`_from_newer_version`), or that ``admit`` (row -> bool; None: every row)
        refuses: the next fastest row of its group is taken."""
        if (sibling or relative) and (env is None or not real_gpu(env.gpu_name)):
            return []  # the interpreter and fake runs have no siblings
        where, params = self._filters(key_contains=key_contains, status="ok", env=env, versions=versions,
                                      sibling=sibling, relative=relative)
        where.append(_TIMED)
        cols = ("key", *_ENV_GROUP)
        part = ", ".join(f"[{c}]" for c in cols)
        ordered = "dq_ordered" in self._t.columns_dict
        if ordered:
            part += ", COALESCE([dq_ordered], 0)"
        ranked = (f"SELECT * FROM (SELECT *, ROW_NUMBER() OVER (PARTITION BY {part} "
                  f"ORDER BY [median_ms], [id]) AS _rank FROM {TABLE} WHERE {' AND '.join(where)})")

        def partition(r):
            return (*(r[c] for c in cols), (r.get("dq_ordered") or 0) if ordered else 0)

        def refused(r):
            return _from_newer_version(r) or (admit is not None and not admit(r))

        out, newer = [], set()
        for r in self.db.query(f"{ranked} WHERE _rank = 1 ORDER BY [key], [gpu_name], [id]", params):
            r.pop("_rank")
            if refused(r):
                newer.add(partition(r))
            else:
                out.append(r)
        if newer:
            # the fastest row of each such group that this version can read and admits
            for r in self.db.query(f"{ranked} WHERE _rank > 1 ORDER BY _rank", params):
                if partition(r) in newer and not refused(r):
                    newer.discard(partition(r))
                    r.pop("_rank")
                    out.append(r)
            out.sort(key=lambda r: (r["key"], r["gpu_name"], r["id"]))
        return out

    def best_configs(self, env: Environment, versions: bool = True) -> dict[str, tuple[TileConfig, dict]]:
        """key id -> (best TileConfig, its row) for every key with an ok row in ``env``
        (one query; what the dispatcher loads): the fastest over the kernel families
        (:meth:`best_rows` gives one row per family, as each has its own code hash).
        ``versions=False``: the same over the rows of ``env``'s GPU, compute capability
        and code hashes measured under another Triton version (what the dispatcher serves
        next, flagged)."""
        return {k: rows[0] for k, rows in self.best_configs_by_family(env, versions).items()}

    def best_configs_by_family(self, env: Environment, versions: bool = True, sibling: bool = False,
                               admit=None) -> dict[str, tuple[tuple[TileConfig, dict], ...]]:
        """key id -> the best (TileConfig, row) of each kernel family with an ok row in
        ``env`` (and its best bitwise-repeatable one, :meth:`best_rows`), fastest first
        (``versions`` as in :meth:`best_configs`, ``sibling`` as in :meth:`best_rows`:
        rows of several sibling GPUs compete by their times).  What the
        dispatcher loads: the fastest family's row may not serve the key on the arch at
        hand (the Gluon family on sm_80, or in the interpreter), and then the next
        family's row does.  ``admit``: as in :meth:`best_rows`."""
        out: dict[str, list[tuple[TileConfig, dict]]] = {}
        for r in self.best_rows(env, versions=versions, sibling=sibling, admit=admit):
            out.setdefault(r["key"], []).append((TileConfig.from_dict(r), r))
        return {k: tuple(sorted(v, key=lambda cr: (cr[1]["median_ms"], cr[1]["id"]))) for k, v in out.items()}

    def ok_rows_of_gpu(self, gpu_name: str, compute_capability: str) -> dict[str, int]:
        """Triton version -> number of ok rows measured on ``gpu_name`` with
        ``compute_capability`` (any code hash)."""
        return {r["triton_version"]: r["n"] for r in self.db.query(
            f"SELECT [triton_version], COUNT(*) AS n FROM {TABLE} WHERE [status] = 'ok' AND "
            "[gpu_name] = ? AND [compute_capability] = ? GROUP BY [triton_version]",
            [gpu_name, compute_capability])}

    def gpu_sm_counts(self, compute_capability: str) -> dict[tuple[str, int | None], int]:
        """(GPU name, SM count) -> number of ok rows measured on GPUs of
        ``compute_capability``."""
        return {(r["gpu_name"], r["sm_count"]): r["n"] for r in self.db.query(
            f"SELECT [gpu_name], [sm_count], COUNT(*) AS n FROM {TABLE} WHERE [status] = 'ok' AND "
            "[compute_capability] = ? GROUP BY [gpu_name], [sm_count]", [compute_capability])}

    def lookup(self, key: ProblemKey | str, variant_id: str, env: Environment) -> dict | None:
        """An existing measurement of ``variant_id`` for ``key`` in ``env`` (an ok row if
        there is one, else the latest), or None: the tuner reuses it instead of measuring
        again."""
        rows = self._select(*self._filters(key=key, variant_id=variant_id, env=env),
                            order_by="[status] = 'ok' DESC, id DESC", limit=1)
        return rows[0] if rows else None

    def count_ok(self, env: Environment | None = None) -> int:
        """Number of ok rows (in ``env``, or in any environment)."""
        return self.status_counts(env=env).get("ok", 0)

    def status_counts(self, env: Environment | None = None,
                      key_contains: str | None = None) -> dict[str, int]:
        """status -> number of rows (optionally filtered like :meth:`rows`)."""
        where, params = self._filters(key_contains=key_contains, env=env)
        sql = f"SELECT [status], COUNT(*) AS n FROM {TABLE}"
        if where:
            sql += " WHERE " + " AND ".join(where)
        return {r["status"]: r["n"] for r in self.db.query(sql + " GROUP BY [status]", params)}

"""What ships in tuning_db/: rollback-journal files that are read without writing
anything beside them, even from a read-only directory."""

import hashlib
import shutil
import sqlite3
import stat
import warnings
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flashgen import arch, dispatch
from flashgen.cli import app
from flashgen.db import TuningDB, derived_tflops
from flashgen.dispatch import Dispatcher
from flashgen.env import Environment
from flashgen.spec import KernelSpec, Shape, shape_flops

REPO_DBS = sorted((Path(__file__).resolve().parent.parent / "tuning_db").glob("*.sqlite"))


def _journal_mode_byte(path: Path) -> int:
    """Bytes 18-19 of an SQLite header: 1 = rollback journal, 2 = WAL."""
    head = path.read_bytes()[:20]
    assert head[:16] == b"SQLite format 3\x00"
    assert head[18] == head[19]
    return head[18]


def test_shipped_databases_are_in_rollback_journal_mode():
    assert REPO_DBS, "tuning_db/ ships at least one database"
    for p in REPO_DBS:
        assert _journal_mode_byte(p) == 1, f"{p} is in WAL mode: reading it would create -wal/-shm beside it"


@pytest.fixture
def read_only_copy(tmp_path, monkeypatch):
    """A copy of the shipped H200 database in a read-only directory, standing in for the
    shipped one."""
    d = tmp_path / "site-packages" / "tuning_db"
    d.mkdir(parents=True)
    copy = d / "h200.sqlite"
    shutil.copyfile(next(p for p in REPO_DBS if p.name == "h200.sqlite"), copy)
    d.chmod(stat.S_IRUSR | stat.S_IXUSR)
    copy.chmod(stat.S_IRUSR)
    monkeypatch.setattr(dispatch, "shipped_databases", lambda: [copy])
    yield copy
    d.chmod(stat.S_IRWXU)


def _snapshot(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in d.iterdir()}


def test_reading_a_shipped_copy_in_a_read_only_directory_creates_nothing(read_only_copy):
    before = _snapshot(read_only_copy.parent)
    env = Environment("NVIDIA H200", "9.0", 132, "3.6.0", "2.11.0", "0.1.0")
    key = Shape(1, 32, 8, 4096, 4096).key(KernelSpec("fwd", "bfloat16", 128, 128, "causal"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # this test reads; which rows apply is test_dispatch's
        Dispatcher(env=env, arch=arch.TABLE["sm_90"]).choose(key)
    with TuningDB(read_only_copy) as db:  # readonly=None: a file it may not write is opened read-only
        assert db.readonly or db.count_ok() > 0
        n = len(db.rows())
    with sqlite3.connect(f"file:{read_only_copy}?mode=ro", uri=True) as c:
        assert c.execute("SELECT COUNT(*) FROM measurements").fetchone()[0] == n > 0
    runner = CliRunner()
    r = runner.invoke(app, ["show", "--db", str(read_only_copy)])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["explain", "--batch", "1", "--heads", "32", "--kv-heads", "8", "--seqlen-q", "4096",
                            "--seqlen-k", "4096", "--head-dim", "128", "--causal", "--gpu", "NVIDIA H200"])
    assert r.exit_code == 0 and str(read_only_copy) in r.output, r.output
    assert _snapshot(read_only_copy.parent) == before  # no -wal, -shm or -journal; the file unchanged


def test_a_rollback_journal_database_keeps_its_mode_when_written(tmp_path):
    p = tmp_path / "ship.sqlite"
    with TuningDB(p) as db:
        assert db.db.journal_mode == "wal"  # a new database: concurrent tuning workers
        db.use_rollback_journal()
    with TuningDB(p) as db:  # a writable open of an existing file keeps its journal mode
        assert db.db.journal_mode == "delete" and not db.readonly
    assert sorted(x.name for x in tmp_path.iterdir()) == ["ship.sqlite"]
    with TuningDB(p, readonly=True) as db, pytest.raises(Exception, match="read-only"):
        db.use_rollback_journal()


@pytest.mark.parametrize("path", REPO_DBS, ids=lambda p: p.name)
def test_shipped_tflops_are_the_derived_ones(path):
    """Every shipped row's ``tflops`` is what this version derives from its shape and
    median_ms (:func:`flashgen.db.derived_tflops`); ``window`` rows count the scores
    TIMING_WINDOW lets through, so none claims the unmasked count's rate."""
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as c:
        c.row_factory = sqlite3.Row
        rows = [dict(r) for r in c.execute("SELECT * FROM measurements")]
    assert rows
    for r in rows:
        assert r["tflops"] == pytest.approx(derived_tflops(r), rel=1e-9), (r["id"], r["key"])
    window = [r for r in rows if r["mask"] == "window" and r["status"] == "ok"]
    for r in window:
        dense = shape_flops(r["kernel"], Shape(r["batch"], r["num_heads"], r["num_kv_heads"], r["seqlen_q"],
                                               r["seqlen_k"]), r["head_dim"], r["head_dim_v"])
        assert r["tflops"] < 0.5 * dense / (r["median_ms"] * 1e-3) / 1e12, (r["id"], r["key"])


def _keys_without_current_rows(path: Path) -> list[tuple[str, str, str]]:
    """(GPU, family, key) of every key of ``path`` whose ok rows were all measured on
    code other than today's (their ``template_hash`` is not the family's current code
    hash for the row's kernel and mods, so the dispatcher never serves them)."""
    from flashgen import families

    current: dict = {}
    seen, fresh = set(), set()
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as c:
        c.row_factory = sqlite3.Row
        for r in c.execute("SELECT key, kernel, mods, family, gpu_name, template_hash FROM measurements "
                           "WHERE status = 'ok'"):
            fam = r["family"] or "triton"
            code = (fam, r["kernel"], r["mods"] or "")
            if code not in current:
                current[code] = families.get(fam).template_hash(r["kernel"], r["mods"] or "")
            k = (r["gpu_name"], fam, r["key"])
            seen.add(k)
            if r["template_hash"] == current[code]:
                fresh.add(k)
    return sorted(seen - fresh)


@pytest.mark.parametrize("path", REPO_DBS, ids=lambda p: p.name)
def test_every_shipped_key_keeps_a_row_of_the_current_code(path):
    """A template edit that changes a family's generated code leaves that code's rows
    unserved (the dispatcher compares code hashes).  Every tuned key of a shipped
    database must keep at least one ok row of today's code per GPU and family: re-tune
    the keys this lists on their GPU (``flashgen tune --key``), or delete their rows
    deliberately, rather than let a shipped key fall back to a default unnoticed."""
    assert _keys_without_current_rows(path) == []


def test_a_key_whose_rows_are_all_of_older_code_is_listed(tmp_path):
    p = tmp_path / "ship.sqlite"
    shutil.copy(REPO_DBS[0], p)
    with sqlite3.connect(p) as c:
        key, fam, gpu = c.execute("SELECT key, family, gpu_name FROM measurements WHERE status = 'ok' "
                                  "ORDER BY id LIMIT 1").fetchone()
        c.execute("UPDATE measurements SET template_hash = 'g0000000000000000' WHERE key = ?", (key,))
    assert _keys_without_current_rows(p) == [(gpu, fam or "triton", key)]

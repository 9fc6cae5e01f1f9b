"""Shipping tuned configs: export (JSON / SQLite), import, merge; foreign or corrupt
files get a clear error and are left untouched."""

import hashlib
import json
import sqlite3

import pytest
from typer.testing import CliRunner

from flashgen.cli import app
from flashgen.db import NotATuningDB, TuningDB
from flashgen.env import Environment
from flashgen.spec import KernelSpec, Measurement, Shape, TileConfig, Variant

ENV_A = Environment("GPU-A", "9.0", 132, "3.6.0", "2.13.0", "0.1.0")
ENV_B = Environment("GPU-B", "8.0", 108, "3.6.0", "2.13.0", "0.1.0")
SPEC = KernelSpec("fwd", "bfloat16", 128, 128, "causal")
SHAPE = Shape(2, 16, 16, 1024, 1024)
KEY = SHAPE.key(SPEC)


def _fill(path, env, timings):
    with TuningDB(path) as db:
        for (m, n), ms in timings.items():
            db.record(KEY, SHAPE, Variant(SPEC, TileConfig(m, n, 4, 2)), Measurement("ok", median_ms=ms), env, 0)


def _digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_export_json_keeps_the_best_per_key_and_gpu_with_provenance(tmp_path):
    a, b = tmp_path / "a.sqlite", tmp_path / "b.sqlite"
    _fill(a, ENV_A, {(64, 64): 2.0, (128, 64): 1.5})
    _fill(b, ENV_A, {(128, 128): 1.2})
    _fill(b, ENV_B, {(64, 32): 3.0})
    before = (_digest(a), _digest(b))
    out = tmp_path / "best.json"
    res = run("export", out, a, b)
    assert res.exit_code == 0, res.output
    rows = json.loads(out.read_text())["rows"]
    assert [(r["gpu_name"], r["variant_id"].split("_m")[1], r["median_ms"]) for r in rows] == [
        ("GPU-A", "128_n128_w4_s2", 1.2), ("GPU-B", "64_n32_w4_s2", 3.0)]
    assert rows[0]["source_db"] == str(b) and rows[0]["source_row_id"] == 1
    assert (_digest(a), _digest(b)) == before  # inputs untouched
    only_b = tmp_path / "b_only.json"
    assert run("export", only_b, a, b, "--gpu", "GPU-B").exit_code == 0
    assert [r["gpu_name"] for r in json.loads(only_b.read_text())["rows"]] == ["GPU-B"]
    again = run("export", out, a)
    assert again.exit_code == 2 and "never overwrites" in again.output


def test_export_keeps_the_best_bitwise_repeatable_row_beside_the_best(tmp_path):
    """A key's ordered-dQ Gluon backward row (dq_ordered, what the deterministic backward
    takes) ships beside the key's faster row; a --gpu name that matches nothing is refused."""
    from flashgen.spec import WHOLE_BWD

    spec = KernelSpec(WHOLE_BWD, "bfloat16", 128, 128, "causal")
    key = SHAPE.key(spec)
    a = tmp_path / "a.sqlite"
    fast, ordered = TileConfig(64, 64, 8, 2, family="gluon"), TileConfig(64, 64, 8, 2, family="gluon", dq_ordered=1)
    with TuningDB(a) as db:
        for cfg, ms in ((fast, 1.0), (ordered, 1.1), (TileConfig(64, 64, 8, 3, family="gluon", dq_ordered=1), 1.3)):
            db.record(key, SHAPE, Variant(spec, cfg), Measurement("ok", median_ms=ms), ENV_A, 0)
    out = tmp_path / "ship.json"
    assert run("export", out, a).exit_code == 0
    rows = json.loads(out.read_text())["rows"]
    assert sorted((TileConfig.from_dict(r).id, r["median_ms"]) for r in rows) == [(fast.id, 1.0), (ordered.id, 1.1)]
    res = run("export", tmp_path / "none.json", a, "--gpu", "GPU-Z")  # a typo writes no empty export
    assert res.exit_code == 2 and "--gpu 'GPU-Z': no ok row measured on it" in res.output
    assert "'GPU-A'" in res.output and not (tmp_path / "none.json").exists()


def test_export_sqlite_is_a_db_the_dispatcher_reads(tmp_path):
    from flashgen.arch import TABLE
    from flashgen.dispatch import Dispatcher

    a = tmp_path / "a.sqlite"
    _fill(a, ENV_A, {(64, 64): 2.0, (128, 64): 1.5})
    out = tmp_path / "ship.sqlite"
    assert run("export", out, a).exit_code == 0
    with TuningDB(out) as db:
        assert [r["median_ms"] for r in db.rows()] == [1.5]
        assert db.db.journal_mode == "delete"  # what ships: reading it creates no -wal/-shm
    choice = Dispatcher([out], env=ENV_A, arch=TABLE["sm_90"]).choose(KEY)
    assert (choice.source, choice.config, choice.median_ms) == ("tuned", TileConfig(128, 64, 4, 2), 1.5)


def test_import_json_and_sqlite_never_lose_user_rows(tmp_path):
    mine = tmp_path / "mine.sqlite"
    _fill(mine, ENV_A, {(64, 64): 2.0})
    theirs = tmp_path / "theirs.sqlite"
    _fill(theirs, ENV_B, {(64, 32): 3.0, (128, 64): 2.5})
    exp = tmp_path / "theirs.json"
    assert run("export", exp, theirs).exit_code == 0
    res = run("import", exp, "--db", mine)
    assert res.exit_code == 0 and "1 rows added" in res.output
    again = run("import", exp, "--db", mine).output
    assert again.count("0 rows added") == 1 and "left out" not in again  # idempotent
    res = run("import", theirs, "--db", mine)
    assert res.exit_code == 0 and "1 rows added" in res.output  # the other, slower row
    with TuningDB(mine) as db:
        assert sorted(r["median_ms"] for r in db.rows()) == [2.0, 2.5, 3.0]
        assert db.best(KEY, ENV_B)["median_ms"] == 2.5



def _import_one_edited_row(tmp_path, col, val, rule, rekey=False):
    """Export a one-row database, set the row's ``col`` to ``val`` in the file (``rekey``:
    its key made to agree), import it: exit 2 naming ``rule``, no database made.
    Returns (the source database, the edited row)."""
    from flashgen.spec import ProblemKey

    src = tmp_path / "src.sqlite"
    _fill(src, ENV_A, {(64, 64): 2.0})
    exp = tmp_path / "src.json"
    assert run("export", exp, src).exit_code == 0
    data = json.loads(exp.read_text())
    row = dict(data["rows"][0], **{col: val})
    if rekey:
        row["key"] = ProblemKey.from_row(row).id
    data["rows"] = [row]
    exp.write_text(json.dumps(data))
    res = run("import", exp, "--db", tmp_path / "mine.sqlite")
    assert res.exit_code == 2 and rule in res.output and not (tmp_path / "mine.sqlite").exists(), res.output
    return src, row


@pytest.mark.parametrize("col, val, rule", [
    ("seqlen_q_bucket", 0, "seqlen_q_bucket must be a power of two >= 16"),
    ("seqlen_k_bucket", 100, "seqlen_k_bucket must be a power of two >= 16"),
    ("batch_heads_bucket", -4, "batch_heads_bucket must be a power of two >= 1"),
    ("group_size", 0, "group_size must be a whole number >= 1"),
])
def test_import_refuses_sizes_that_are_no_bucket_and_the_dispatcher_skips_them(tmp_path, col, val, rule):
    """A row whose size columns are no bucket (0, -4, 100; a group of 0), its key made to
    agree: import names the column and the rule (it took the row, and every later lookup
    of the spec raised a math domain error from the nearest-bucket search); a row edited
    so in the file is not served."""
    from flashgen import dispatch

    src, row = _import_one_edited_row(tmp_path, col, val, rule, rekey=True)
    with sqlite3.connect(src) as c:
        c.execute(f"UPDATE measurements SET [{col}] = ?, key = ?", (val, row["key"]))
    d = dispatch.Dispatcher([src], env=ENV_A)
    other = Shape(1, 16, 16, 300, 300).key(SPEC)
    assert d.choose(other).source == "default"


@pytest.mark.parametrize("col, val, rule", [
    ("seqlen_q", 100000, "fall in the buckets of attn_fwd_d128_bf16_causal_g1_q131072_k1024"),
    ("num_kv_heads", 3, "num_heads 16 is not a multiple of num_kv_heads 3"),
    ("median_ms", 1e-300, "median_ms must be >= 1e-06 (1 ns)"),
])
def test_import_refuses_sizes_off_the_key_and_times_below_a_nanosecond(tmp_path, col, val, rule):
    """A row whose shape columns fall outside its key's buckets (its TFLOP/s, derived from
    them, was off by 1000x), or whose median_ms is so small that the derived TFLOP/s is
    infinite (an export then wrote Infinity, which no import reads): import names the
    column and the rule and writes nothing."""
    _import_one_edited_row(tmp_path, col, val, rule)


def test_import_of_an_edited_copy_of_held_rows_says_what_it_left_out(tmp_path):
    """An export whose row was edited (another median_ms, the same key, config,
    environment and measurement time) imported into the database it came from: nothing is
    overwritten, and the output says how many such rows were left out (it said "0 rows
    added" alone)."""
    src = tmp_path / "src.sqlite"
    _fill(src, ENV_A, {(64, 64): 2.0, (128, 64): 3.0})
    exp = tmp_path / "src.json"
    assert run("export", exp, src).exit_code == 0
    data = json.loads(exp.read_text())
    data["rows"][0]["median_ms"] = 0.5
    exp.write_text(json.dumps(data))
    res = run("import", exp, "--db", src)
    assert res.exit_code == 0 and "0 rows added" in res.output, res.output
    assert "1 rows left out that have the identity of a row already held" in res.output, res.output
    with TuningDB(src) as db:
        assert sorted(r["median_ms"] for r in db.rows()) == [2.0, 3.0]


@pytest.mark.parametrize("kind", ["corrupt", "damaged", "foreign", "bad_json"])
def test_foreign_or_corrupt_files_get_a_clear_error_and_stay_untouched(tmp_path, kind):
    """Not SQLite, SQLite with damaged data pages behind a sound schema page (read as a
    flashgen database before: tracebacks, and a tune wrote a row into it), another
    program's tables, or not JSON: one line naming the file, exit 2, nothing changed."""
    from flashgen.dispatch import shipped_databases

    bad = tmp_path / ("bad.json" if kind == "bad_json" else "bad.sqlite")
    if kind == "corrupt":
        bad.write_bytes(b"this is not sqlite at all" * 100)
    elif kind == "damaged":
        data = bytearray(next(p for p in shipped_databases() if p.name == "h100.sqlite").read_bytes())
        for i in range(100_000, len(data) - 4096, 4096):
            data[i:i + 200] = b"\xff" * 200
        bad.write_bytes(bytes(data))
    elif kind == "foreign":
        c = sqlite3.connect(bad)
        c.execute("CREATE TABLE users (name TEXT)")
        c.execute("INSERT INTO users VALUES ('ada')")
        c.commit()
        c.close()
    else:
        bad.write_text('{"rows": [1, 2]}')
    before = _digest(bad)
    good = tmp_path / "good.sqlite"
    _fill(good, ENV_A, {(64, 64): 2.0})
    good_before = _digest(good)
    cmds = [("import", bad, "--db", good)]
    if kind != "bad_json":
        cmds += [("show", "--db", bad), ("merge", good, bad), ("merge", bad, good),
                 ("export", tmp_path / "x.json", bad),
                 ("tune", "--preset", "small", "--fake-model", "--trials", 1, "--db", bad)]
    for cmd in cmds:
        res = run(*cmd)
        assert res.exit_code == 2, (cmd, res.output)
        assert "error" in res.output and str(bad.name) in res.output, (cmd, res.output)
    assert _digest(bad) == before and _digest(good) == good_before
    if kind != "bad_json":
        with pytest.raises(NotATuningDB, match="left untouched"):
            TuningDB(bad)


def test_import_replace_swaps_a_keys_rows_of_one_environment_and_keeps_a_copy(tmp_path):
    """--replace: SOURCE's rows take the place of --db's rows of the same key and
    environment (the dispatcher would otherwise keep serving a faster, wrongly timed
    row); rows of other environments stay, the replaced ones go to a copy beside --db;
    without --replace nothing is deleted."""
    mine = tmp_path / "mine.sqlite"
    _fill(mine, ENV_A, {(64, 64): 0.5, (128, 64): 0.7})  # the stale, too fast timings
    _fill(mine, ENV_B, {(64, 32): 3.0})
    new = tmp_path / "new.sqlite"
    _fill(new, ENV_A, {(64, 64): 1.1, (64, 128): 1.0})
    res = run("import", new, "--db", mine)
    assert res.exit_code == 0 and "2 rows added" in res.output and "replaced" not in res.output
    with TuningDB(mine) as db:
        assert db.best(KEY, ENV_A)["median_ms"] == 0.5  # the stale row still wins
    res = run("import", new, "--db", mine, "--replace")
    assert res.exit_code == 0, res.output
    assert "0 rows added" in res.output and "2 rows of the same keys and environments replaced" in res.output
    with TuningDB(mine) as db:
        assert sorted((r["gpu_name"], r["median_ms"]) for r in db.rows()) == [
            ("GPU-A", 1.0), ("GPU-A", 1.1), ("GPU-B", 3.0)]
        assert db.best(KEY, ENV_A)["median_ms"] == 1.0
    kept = list(tmp_path.glob("mine.sqlite.replaced-*.db"))
    assert len(kept) == 1 and str(kept[0]) in res.output
    with TuningDB(kept[0]) as db:
        assert sorted(r["median_ms"] for r in db.rows()) == [0.5, 0.7]
    again = run("import", new, "--db", mine, "--replace")  # nothing left to replace: no copy
    assert again.exit_code == 0 and "0 rows added" in again.output and "replaced" not in again.output
    assert len(list(tmp_path.glob("mine.sqlite.replaced-*.db"))) == 1
    # a JSON export replaces the same way
    exp = tmp_path / "b.json"
    other = tmp_path / "other.sqlite"
    _fill(other, ENV_B, {(128, 128): 4.0})
    assert run("export", exp, other).exit_code == 0
    res = run("import", exp, "--db", mine, "--replace")
    assert res.exit_code == 0 and "1 rows added" in res.output and "1 rows of the same keys" in res.output
    with TuningDB(mine) as db:
        assert sorted((r["gpu_name"], r["median_ms"]) for r in db.rows()) == [
            ("GPU-A", 1.0), ("GPU-A", 1.1), ("GPU-B", 4.0)]


def test_import_replace_lands_corrected_rows_keeps_keys_without_an_ok_row_and_undoes_a_failure(tmp_path, monkeypatch):
    """--replace: a SOURCE row equal to a DB row in identity but not in content (an export
    whose timings were corrected) lands; a key whose SOURCE rows all failed keeps the
    DB's rows; when the transaction fails the DB is unchanged and no copy is left; the
    copy is not named *.sqlite (a copy beside a shipped DB is never loaded as one)."""
    from flashgen import db as dbmod

    mine = tmp_path / "mine.sqlite"
    _fill(mine, ENV_A, {(64, 64): 0.5, (128, 64): 0.7})
    exp = tmp_path / "mine.json"
    assert run("export", exp, mine).exit_code == 0
    data = json.loads(exp.read_text())
    data["rows"][0]["median_ms"] = 2.5  # the same row (identity), re-timed
    exp.write_text(json.dumps(data))
    res = run("import", exp, "--db", mine, "--replace")
    assert res.exit_code == 0 and "1 rows added" in res.output and "2 rows of the same keys" in res.output, \
        res.output
    with TuningDB(mine) as db:
        assert [r["median_ms"] for r in db.rows()] == [2.5]
    # a SOURCE with only failed rows for the key: nothing replaced, the failure appended
    failed = tmp_path / "failed.sqlite"
    with TuningDB(failed) as db:
        db.record(KEY, SHAPE, Variant(SPEC, TileConfig(64, 128, 4, 2)), Measurement("compile_failed"), ENV_A, 0)
    res = run("import", failed, "--db", mine, "--replace")
    assert res.exit_code == 0 and "1 rows added" in res.output and "replaced" not in res.output
    with TuningDB(mine) as db:
        assert db.best(KEY, ENV_A)["median_ms"] == 2.5
    # a failure inside the transaction: DB unchanged, the copy removed
    new = tmp_path / "new.sqlite"
    _fill(new, ENV_A, {(128, 128): 9.0})
    before = _digest(mine)

    def boom(self, *a, **kw):
        raise RuntimeError("disk gone")

    monkeypatch.setattr(dbmod.TuningDB, "_insert_new", boom)
    res = run("import", new, "--db", mine, "--replace")
    assert res.exit_code != 0 and _digest(mine) == before
    assert not list(tmp_path.glob("mine.sqlite.replaced-*.db-*"))
    kept = sorted(p.name for p in tmp_path.glob("mine.sqlite.replaced-*"))
    assert len(kept) == 1 and kept[0].endswith(".db")  # only the first, successful replace's copy


def _side(path):
    return sorted(p.name for p in path.parent.glob(path.name + "-*"))


def test_import_and_merge_leave_no_side_files_and_take_an_empty_source(tmp_path):
    """Reading SOURCE leaves no -wal / -shm beside it; a refused import leaves none beside
    an existing DB; an empty SOURCE file holds no rows (nothing added, no traceback)."""
    mine, theirs = tmp_path / "mine.sqlite", tmp_path / "theirs.sqlite"
    _fill(mine, ENV_A, {(64, 64): 2.0})
    _fill(theirs, ENV_B, {(64, 32): 3.0})
    for args in (("import", theirs, "--db", mine), ("import", theirs, "--db", mine, "--replace"),
                 ("merge", tmp_path / "out.sqlite", theirs, mine)):
        res = run(*args)
        assert res.exit_code == 0, res.output
        assert _side(theirs) == [] and _side(mine) == [], args
    bad = tmp_path / "bad.sqlite"
    _fill(bad, ENV_B, {(128, 32): 1.0})
    sqlite3.connect(bad).execute("UPDATE measurements SET median_ms = -1").connection.commit()
    res = run("import", bad, "--db", mine)
    assert res.exit_code == 2 and _side(mine) == [] and _side(bad) == []
    empty = tmp_path / "empty.sqlite"
    empty.write_bytes(b"")
    res = run("import", empty, "--db", mine)
    assert res.exit_code == 0 and "0 rows added" in res.output, res.output


def test_import_into_a_locked_db_is_one_line_and_leaves_no_copy(tmp_path, monkeypatch):
    from flashgen import db as dbmod

    mine, new = tmp_path / "mine.sqlite", tmp_path / "new.sqlite"
    _fill(mine, ENV_A, {(64, 64): 0.5})
    _fill(new, ENV_A, {(128, 64): 1.0})
    monkeypatch.setattr(dbmod, "BUSY_TIMEOUT_S", 0.1)
    holder = sqlite3.connect(mine)
    holder.execute("BEGIN IMMEDIATE")
    try:
        res = run("import", new, "--db", mine, "--replace")
    finally:
        holder.rollback()
        holder.close()
    assert res.exit_code == 2 and "is locked by another process" in res.output, res.output
    assert "Traceback" not in res.output
    assert not list(tmp_path.glob("mine.sqlite.replaced-*"))
    with TuningDB(mine) as db:
        assert [r["median_ms"] for r in db.rows()] == [0.5]


def test_reading_a_read_only_or_corrupt_wal_db_leaves_nothing_beside_it(tmp_path):
    """show / export read a WAL-mode file the user made read-only without leaving -wal /
    -shm beside it; a corrupt WAL-mode file is refused with its directory as it was; a
    directory without write permission is refused as OUT (root included)."""
    import os
    import stat

    src = tmp_path / "x.sqlite"
    _fill(src, ENV_A, {(64, 64): 2.0})
    assert sqlite3.connect(src).execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    ro = tmp_path / "ro.sqlite"
    ro.write_bytes(src.read_bytes())
    ro.chmod(stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
    assert run("show", "--db", ro).exit_code == 0
    assert run("export", tmp_path / "e.json", ro).exit_code == 0
    assert _side(ro) == []
    trunc = tmp_path / "trunc.sqlite"
    trunc.write_bytes(src.read_bytes()[:3000])
    res = run("show", "--db", trunc)
    assert res.exit_code == 2 and "left untouched" in res.output and _side(trunc) == []
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        res = run("merge", locked / "new.sqlite", src)
        assert res.exit_code == 2 and "is not writable" in res.output and not os.listdir(locked)
    finally:
        locked.chmod(0o755)


def test_explain_prints_no_python_warning_for_a_default(tmp_path):
    res = run("explain", "--batch", 1, "--heads", 4, "--kv-heads", 2, "--seqlen-q", 128, "--seqlen-k", 128,
              "--head-dim", 64, "--gpu", "NVIDIA H200")
    assert res.exit_code == 0 and "UserWarning" not in res.output and "default" in res.output, res.output

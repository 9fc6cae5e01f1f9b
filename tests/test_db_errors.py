"""tune / merge / import / export against a database they cannot write, a --db in a
missing directory, and rows that are not measurements: one line naming the path and
the rule, exit 2, nothing left behind."""

import json
import os
import sqlite3
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flashgen import db as fdb
from flashgen import presets, render, space
from flashgen.cli import app
from flashgen.db import TuningDB
from flashgen.env import Environment
from flashgen.spec import KernelSpec, Measurement, Shape, TileConfig, Variant

runner = CliRunner(env={"COLUMNS": "250"})
ENV = Environment("NVIDIA H200", "9.0", 132, "3.6.0", "2.11.0", "0.1.0")


@pytest.fixture(autouse=True)
def template_hashes(monkeypatch):
    monkeypatch.setattr(render, "template_hash", lambda k, mods="": f"tmpl-{k}-{mods}")


@pytest.fixture(autouse=True)
def permission_bits_as_a_user_sees_them(monkeypatch):
    """root may write anything whatever its mode bits say; the check must see what a
    user sees, so under root os.access reads the owner's write bit (as a non-root owner
    would get it)."""
    if os.geteuid() == 0:
        real = os.access

        def access(path, mode, **kw):
            if mode & os.W_OK and os.path.exists(path) and not os.stat(path).st_mode & stat.S_IWUSR:
                return False
            return real(path, mode, **kw)

        monkeypatch.setattr(fdb.os, "access", access)


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def listing(d):
    return sorted(p.name for p in d.iterdir())


@pytest.fixture
def timings(tmp_path):
    t = {Variant(key.spec, cfg).id: 1.0 + i / 100 for key, _ in presets.expand(["small"], "bfloat16", ["fwd"])
         for i, cfg in enumerate(space.configs("fwd"))}
    p = tmp_path / "timings.json"
    p.write_text(json.dumps(t))
    return p


def tune(timings, db, *extra):
    return invoke("tune", "--preset", "small", "--kernels", "fwd", "--fake", timings, "--db", db, "--trials", 2, *extra)


def one_error_line(res, *words):
    """Exit 2 with one line "error: ..." holding ``words`` (progress lines of a run that
    had started may precede it), no traceback."""
    errors = [x for x in res.output.splitlines() if x.startswith("error:")]
    assert res.exit_code == 2 and len(errors) == 1, res.output
    assert "Traceback" not in res.output and res.exception is None or isinstance(res.exception, SystemExit)
    for w in words:
        assert w in errors[0], (w, res.output)


def test_tune_into_a_read_only_directory(tmp_path, timings):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        one_error_line(tune(timings, ro / "t.sqlite"), str(ro), "not writable", "-wal")
        assert listing(ro) == []
    finally:
        ro.chmod(stat.S_IRWXU)


def test_tune_into_a_read_only_file(tmp_path, timings):
    db = tmp_path / "t.sqlite"
    assert tune(timings, db).exit_code == 0
    before = db.read_bytes()
    db.chmod(stat.S_IRUSR)
    names = listing(tmp_path)
    for cmd in (("tune", "--preset", "small", "--kernels", "fwd", "--fake", timings, "--db", db, "--trials", 4),
                ("merge", db, db), ("import", db, "--db", db)):
        one_error_line(invoke(*cmd), str(db), "is not writable")
        assert listing(tmp_path) == names and db.read_bytes() == before  # no -wal, -shm, .optuna.journal


@pytest.mark.parametrize("cmd", ["tune", "merge", "import", "export-json", "export-sqlite"])
def test_a_database_in_a_missing_directory_is_refused_naming_it(tmp_path, timings, cmd):
    src = tmp_path / "src.sqlite"
    assert tune(timings, src).exit_code == 0
    target = tmp_path / "no" / "such" / ("t.json" if cmd == "export-json" else "t.sqlite")
    args = {"tune": ("tune", "--preset", "small", "--kernels", "fwd", "--fake", timings, "--db", target),
            "merge": ("merge", target, src), "import": ("import", src, "--db", target),
            "export-json": ("export", target, src), "export-sqlite": ("export", target, src)}[cmd]
    one_error_line(invoke(*args), f"directory {tmp_path / 'no' / 'such'} does not exist", "create it first",
                   "for an export" if cmd == "export-json" else "for a database")
    assert not (tmp_path / "no").exists()


def test_a_failure_while_writing_is_one_line_and_leaves_nothing(tmp_path, timings, monkeypatch):
    """SQLite refusing a write mid-run (what a read-only mount gives root too)."""
    def refuse(*a, **kw):
        raise sqlite3.OperationalError("attempt to write a readonly database")

    monkeypatch.setattr(TuningDB, "record", refuse)
    names = listing(tmp_path)
    one_error_line(tune(timings, tmp_path / "t.sqlite"), "cannot write the tuning database",
                   "attempt to write a readonly database")
    assert listing(tmp_path) == names  # no t.sqlite, -wal, -shm or .optuna.journal


# -- import validates every row ----------------------------------------------------------

def _export(tmp_path):
    src = tmp_path / "src.sqlite"
    spec = KernelSpec("fwd", "bfloat16", 64, 64, "causal")
    shape = Shape(2, 8, 8, 1024, 1024)
    with TuningDB(src) as d:
        for cfg, ms in ((TileConfig(64, 64, 4, 2), 2.0), (TileConfig(128, 64, 4, 2), 1.5)):
            d.record(shape.key(spec), shape, Variant(spec, cfg), Measurement("ok", median_ms=ms), ENV, 1000)
    out = tmp_path / "e.json"
    assert invoke("export", out, src).exit_code == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("field, value, rule", [
    ("status", "bogus", "status 'bogus' is not one of ok, invalid"),
    ("median_ms", -5, "finite positive median_ms"),
    ("median_ms", None, "finite positive median_ms"),
    ("kernel", "fwd_turbo", "bad kernel or config fields"),
    ("BLOCK_M", "big", "config field BLOCK_M must be a whole number"),
    ("BLOCK_M", "128", "config field BLOCK_M must be a whole number"),
    ("num_warps", 4.5, "config field num_warps must be a whole number"),
    ("batch", True, "batch must be a whole number >= 0"),
    ("created_at", None, "created_at must be the measurement's time"),
    ("created_at", "yesterday", "created_at must be the measurement's time in ISO 8601"),
    ("BLOCK_N", 0, "knob out of range"),
    ("num_warps", 3, "powers of two"),
    ("BLOCK_M", 96, "powers of two"),
    ("variant_id", "attn_fwd_d64_bf16_causal_m1_n1_w1_s1", "disagrees with its columns"),
    ("family", "cuda", "family 'cuda' is not a registered kernel family"),
    ("template_hash", None, "template_hash must name what the row was measured with"),
    ("gpu_name", "", "gpu_name must name what the row was measured with"),
    ("compute_capability", "banana", "compute_capability must read like '9.0'"),
    ("seqlen_q", -3, "seqlen_q must be a whole number >= 0"),
    ("sm_count", -1, "sm_count must be a whole number >= 0"),
    ("tflops", -5.0, "tflops must be a finite number >= 0 or null"),
    ("tflops", float("inf"), "tflops must be a finite number >= 0 or null"),
    ("median_ms", 10 ** 400, "finite positive median_ms"),
    ("median_ms", True, "finite positive median_ms"),
    ("tflops", 10 ** 400, "tflops must be a finite number >= 0 or null"),
    ("sm_count", 10 ** 30, "sm_count must be a whole number within int64"),
    ("smem_bytes_model", 2 ** 63, "smem_bytes_model must be a whole number within int64"),
    ("n_regs", "lots", "n_regs must be a whole number within int64"),
    ("max_abs_err", "x", "max_abs_err must be a finite number or null"),
    ("error", 7, "error must be text or null"),
])
def test_import_refuses_rows_that_are_not_measurements_and_writes_nothing(tmp_path, field, value, rule):
    data = _export(tmp_path)
    data["rows"][0][field] = value
    bad = tmp_path / "edited.json"
    bad.write_text(json.dumps(data))
    names = listing(tmp_path)
    new_db = tmp_path / "mine.sqlite"
    one_error_line(invoke("import", bad, "--db", new_db), str(bad), "row 0", rule, "nothing was imported")
    assert listing(tmp_path) == names  # no empty mine.sqlite
    # into an existing database: refused whole, its rows unchanged
    good = tmp_path / "good.sqlite"
    assert invoke("import", tmp_path / "src.sqlite", "--db", good).exit_code == 0
    n = len(TuningDB(good, readonly=True).rows())
    one_error_line(invoke("import", bad, "--db", good), rule)
    assert len(TuningDB(good, readonly=True).rows()) == n


def test_an_export_whose_version_is_true_is_refused(tmp_path):
    data = _export(tmp_path)
    data["flashgen_export"] = True
    bad = tmp_path / "edited.json"
    bad.write_text(json.dumps(data))
    one_error_line(invoke("import", bad, "--db", tmp_path / "mine.sqlite"), "is not a flashgen export")
    assert not (tmp_path / "mine.sqlite").exists()


def test_a_fake_timing_past_float_range_is_one_line(tmp_path, timings):
    data = json.loads(timings.read_text())
    bad = tmp_path / "big.json"
    bad.write_text(json.dumps(data)[:-1] + ', "x": 1' + "0" * 400 + "}")
    res = invoke("tune", "--preset", "small", "--kernels", "fwd", "--fake", bad, "--db", tmp_path / "t.sqlite")
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert "Invalid value for '--fake'" in res.output and "finite milliseconds" in res.output
    assert not (tmp_path / "t.sqlite").exists()


@pytest.mark.parametrize("edit", ["UPDATE measurements SET key = NULL WHERE id = 1",
                                  "UPDATE measurements SET gpu_name = NULL",
                                  "UPDATE measurements SET median_ms = 'fast' WHERE status = 'ok'"])
def test_show_and_export_leave_out_rows_edited_past_reading(tmp_path, edit):
    """A database edited by hand (a NULL key or GPU name, a text time): show prints the
    rest and every row under --all, export writes only rows import takes back."""
    _export(tmp_path)
    src = tmp_path / "src.sqlite"
    with sqlite3.connect(src) as c:
        c.execute(edit)
    c.close()
    for args in (("show", "--db", src), ("show", "--db", src, "--all")):
        res = invoke(*args)
        assert res.exit_code == 0 and res.exception is None, res.output
    out = tmp_path / "e2.json"
    res = invoke("export", out, src)
    assert res.exit_code == 0, res.output
    rows = json.loads(out.read_text())["rows"]
    assert all(r["key"] and r["gpu_name"] and isinstance(r["median_ms"], float) for r in rows)
    if rows:
        assert invoke("import", out, "--db", tmp_path / "back.sqlite").exit_code == 0


def test_iomodel_tradeoff_n_is_bounded():
    res = invoke("iomodel", "--tradeoff-n", 99999999999)
    assert res.exit_code == 2 and "tradeoff-n" in res.output and "Traceback" not in res.output


def test_a_familys_config_reasons_refuse_its_rows_at_import(tmp_path, monkeypatch):
    """The row check asks the row's family what it never launches (its optional
    ``config_reasons``), not a list of one family's rules."""
    from flashgen import families

    data = _export(tmp_path)
    bad = tmp_path / "rows.json"
    bad.write_text(json.dumps(data))
    fam = type(families.FAMILIES[data["rows"][0].get("family") or "triton"])
    monkeypatch.setattr(fam, "config_reasons", lambda self, cfg: [f"no tile of {cfg.BLOCK_M} rows here"])
    one_error_line(invoke("import", bad, "--db", tmp_path / "mine.sqlite"), "row 0", f"no tile of "
                   f"{data['rows'][0]['BLOCK_M']} rows here", "nothing was imported")
    monkeypatch.delattr(fam, "config_reasons")  # a family without the hook: nothing refused for it
    assert invoke("import", bad, "--db", tmp_path / "mine.sqlite").exit_code == 0


def test_import_from_a_database_checks_its_rows_first(tmp_path):
    _export(tmp_path)
    src = tmp_path / "src.sqlite"
    with sqlite3.connect(src) as c:
        c.execute("UPDATE measurements SET median_ms = 'NaN' WHERE id = 1")
    c.close()
    one_error_line(invoke("import", src, "--db", tmp_path / "mine.sqlite"), "row id 1", "median_ms")
    assert not (tmp_path / "mine.sqlite").exists()


def test_the_shipped_rows_pass_the_import_check():
    from pathlib import Path

    for p in sorted((Path(__file__).resolve().parent.parent / "tuning_db").glob("*.sqlite")):
        with TuningDB(p, readonly=True) as d:
            fdb.check_rows(d.rows(), p)


def test_import_takes_rows_without_a_family_as_the_triton_family(tmp_path):
    data = _export(tmp_path)
    for r in data["rows"]:
        del r["family"]  # exported before kernel families existed
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    db = tmp_path / "mine.sqlite"
    assert invoke("import", old, "--db", db).exit_code == 0
    rows = TuningDB(db, readonly=True).rows()
    assert len(rows) == len(data["rows"]) and all(TileConfig.from_dict(r).family == "triton" for r in rows)


def test_a_storage_path_that_is_no_journal_is_refused_untouched(tmp_path, timings):
    """--storage names the Optuna journal: a user's file is never appended to, a
    directory or a missing directory is named; nothing is created."""
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    db = tmp_path / "t.sqlite"
    names = listing(tmp_path)
    one_error_line(tune(timings, db, "--storage", notes), str(notes), "not an Optuna journal", "untouched")
    assert notes.read_text() == "my notes\n" and listing(tmp_path) == names
    one_error_line(tune(timings, db, "--storage", tmp_path), str(tmp_path), "is not a file")
    one_error_line(tune(timings, db, "--storage", tmp_path / "no" / "j.journal"), "does not exist")
    assert listing(tmp_path) == names
    journal = tmp_path / "ok.journal"
    assert tune(timings, db, "--storage", journal).exit_code == 0 and journal.stat().st_size > 0
    assert tune(timings, db, "--storage", journal).exit_code == 0  # an existing journal resumes
    # the default journal beside --db too (a file of the user's there was appended to)
    mine = tmp_path / "m.sqlite"
    (tmp_path / "m.sqlite.optuna.journal").write_text("my notes\n")
    names = listing(tmp_path)
    one_error_line(tune(timings, mine), "m.sqlite.optuna.journal", "not an Optuna journal", "untouched")
    assert (tmp_path / "m.sqlite.optuna.journal").read_text() == "my notes\n" and listing(tmp_path) == names


def test_a_storage_that_is_the_db_itself_is_refused_before_anything_is_made(tmp_path, timings):
    """--storage naming the --db file (as a path or an sqlite:/// URL) is refused as a
    usage error: Optuna's storage and flashgen's rows are files of their own."""
    db = tmp_path / "z.sqlite"
    # any SQLAlchemy spelling of the same file: a driver, a query string
    for storage in (db, f"sqlite:///{db}", f"sqlite+pysqlite:///{db}", f"sqlite:///{db}?timeout=30"):
        res = tune(timings, db, "--storage", storage)
        assert res.exit_code == 2 and "is the --db file" in res.output and "Traceback" not in res.output, res.output
    assert listing(tmp_path) == ["timings.json"]


def test_a_refused_run_leaves_no_side_files_beside_an_existing_wal_database(tmp_path, timings):
    """Reading a WAL-mode --db to check it creates its -wal and -shm files, which a
    read-only close cannot remove: a run refused after that check (a bad --storage)
    leaves the directory as it found it."""
    db = tmp_path / "t.sqlite"
    assert tune(timings, db).exit_code == 0
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    conn.close()
    assert not any(Path(f"{db}{side}").exists() for side in ("-wal", "-shm"))
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    names = listing(tmp_path)
    one_error_line(tune(timings, db, "--storage", notes), "not an Optuna journal")
    assert listing(tmp_path) == names


def test_import_of_a_file_that_is_not_utf8_and_merge_into_a_json_name_are_refused(tmp_path):
    latin = tmp_path / "latin.json"
    latin.write_bytes(b'{"a": "\xff"}')
    names = listing(tmp_path)
    one_error_line(invoke("import", latin, "--db", tmp_path / "q.sqlite"), str(latin), "not UTF-8")
    res = invoke("merge", tmp_path / "m.json", latin)
    assert res.exit_code == 2 and "name it *.sqlite" in res.output, res.output
    assert listing(tmp_path) == names


def test_a_storage_url_to_a_file_that_is_no_optuna_storage_is_refused_untouched(tmp_path, timings):
    """--storage sqlite:///PATH names an Optuna RDB storage: Optuna's tables are never
    added to a file of the user's (another program's SQLite file, a tuning database, a
    file that is no SQLite database); a URL whose driver or dialect is missing is one
    line naming it; nothing is created."""
    other = tmp_path / "other.sqlite"
    conn = sqlite3.connect(other)
    conn.execute("CREATE TABLE notes (x)")
    conn.commit()
    conn.close()
    mine = tmp_path / "mine.sqlite"
    TuningDB(mine).close()
    text = tmp_path / "notes.txt"
    text.write_text("my notes\n")
    before = {p: p.read_bytes() for p in (other, mine, text)}
    db = tmp_path / "t.sqlite"
    names = listing(tmp_path)
    one_error_line(tune(timings, db, "--storage", f"sqlite:///{other}"), str(other), "not an Optuna storage",
                   "untouched")
    one_error_line(tune(timings, db, "--storage", f"sqlite:///{mine}"), str(mine), "not an Optuna storage")
    one_error_line(tune(timings, db, "--storage", f"sqlite:///{text}"), str(text), "not an SQLite database")
    one_error_line(tune(timings, db, "--storage", f"sqlite:///{tmp_path / 'no' / 's.db'}"), "does not exist")
    one_error_line(tune(timings, db, "--storage", "nosuchdialect://host/x"), "nosuchdialect", "cannot open")
    assert {p: p.read_bytes() for p in before} == before and listing(tmp_path) == names
    url = f"sqlite:///{tmp_path / 'studies.db'}"
    assert tune(timings, db, "--storage", url).exit_code == 0
    assert tune(timings, db, "--storage", url).exit_code == 0  # an existing Optuna storage resumes


def test_a_database_a_writer_keeps_locked_is_refused_naming_it(tmp_path, monkeypatch):
    """A rollback-journal database that another connection keeps locked past the busy
    timeout: reading it (the dispatcher's FLASHGEN_DB, explain --db) is refused with
    its name, rather than read as an immutable file, which would take the writer's
    uncommitted pages (SQLite then reported it malformed)."""
    from flashgen.errors import InputError

    path = tmp_path / "locked.sqlite"
    with TuningDB(path):
        pass
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA journal_mode=DELETE")
    conn.execute("BEGIN EXCLUSIVE")
    conn.execute("DELETE FROM measurements")
    monkeypatch.setattr(fdb, "BUSY_TIMEOUT_S", 0.2)
    try:
        for read in (lambda: fdb.validate(path), lambda: TuningDB(path, readonly=True)):
            with pytest.raises(InputError, match=r"locked\.sqlite stayed locked by another process"):
                read()
    finally:
        conn.rollback()
        conn.close()
    fdb.validate(path)  # unlocked: read as before
    with TuningDB(path, readonly=True) as d:
        assert d.path == path


_WRITER = r"""
import sqlite3, sys
c = sqlite3.connect(sys.argv[1], timeout=30)
c.execute("SELECT COUNT(*) FROM measurements").fetchone()
print("opened", flush=True)
sys.stdin.readline()
c.execute("INSERT INTO measurements (key, variant_id, status, created_at) "
          "SELECT key, variant_id || '_x', status, created_at FROM measurements WHERE id = 1")
c.commit()
print("wrote", flush=True)
sys.stdin.readline()
c.close()
"""


def test_validating_a_database_another_process_opens_meanwhile_loses_none_of_its_rows(tmp_path, timings,
                                                                                       monkeypatch):
    """The check of --db (fdb.validate, a read-only read) leaves the -wal and -shm files
    it made to SQLite: a process that opened the database meanwhile (a tune worker, the
    dispatcher) keeps writing through them, and its rows stay visible to others."""
    import subprocess
    import sys

    db = tmp_path / "t.sqlite"
    assert tune(timings, db).exit_code == 0
    assert not any(Path(f"{db}{side}").exists() for side in ("-wal", "-shm"))

    def count():
        c = sqlite3.connect(db)
        try:
            return c.execute("SELECT COUNT(*) FROM measurements").fetchone()[0]
        finally:
            c.close()

    n = count()
    writer = []
    real = fdb._connect_readonly

    def opened_meanwhile(path, immutable=False):
        conn = real(path, immutable)
        p = subprocess.Popen([sys.executable, "-c", _WRITER, str(db)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "opened"
        writer.append(p)
        return conn

    monkeypatch.setattr(fdb, "_connect_readonly", opened_meanwhile)
    try:
        fdb.validate(db)
    finally:
        monkeypatch.setattr(fdb, "_connect_readonly", real)
    p = writer[0]
    try:
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "wrote"
        assert count() == n + 1  # seen by another process while the writer is open
    finally:
        p.stdin.write("\n")
        p.stdin.flush()
        p.wait(timeout=30)
    assert count() == n + 1


def test_a_journal_with_a_record_cut_short_is_refused_untouched(tmp_path, timings):
    """A run stopped while it appended leaves a journal whose last record is cut short;
    Optuna appends after it, gluing the next record onto the cut one.  The next run is
    refused naming the journal and the line, and writes nothing to it."""
    db = tmp_path / "t.sqlite"
    assert tune(timings, db).exit_code == 0
    journal = tmp_path / "t.sqlite.optuna.journal"
    data = journal.read_bytes()
    journal.write_bytes(data[:-10])
    lines = data[:-10].count(b"\n") + 1
    res = tune(timings, db, "--trials", 3)
    one_error_line(res, str(journal.name), f"line {lines}", "cut short", "untouched", "--storage")
    assert journal.read_bytes() == data[:-10]
    # a record in the middle that is not one
    journal.write_bytes(data.replace(b"\n", b"\nnot json\n", 1))
    one_error_line(tune(timings, db, "--trials", 3), "line 2", "not a journal record")


@pytest.mark.parametrize("seed", [-1, 2**32])
def test_a_seed_outside_numpys_range_is_a_usage_error(tmp_path, timings, seed):
    res = tune(timings, tmp_path / "s.sqlite", "--seed", seed)
    assert res.exit_code == 2 and "'--seed'" in res.output and "Traceback" not in res.output, res.output
    res = tune(timings, tmp_path / "s.sqlite", "--seed", 2**32 - 1, "--workers", 2)
    assert res.exit_code == 2 and "2**32 - 1" in res.output, res.output
    assert listing(tmp_path) == ["timings.json"]
    # the grid sampler's random.Random takes any int
    assert tune(timings, tmp_path / "g.sqlite", "--seed", seed, "--sampler", "grid").exit_code == 0


def test_a_journal_another_run_is_appending_to_is_not_refused(tmp_path, timings):
    """A last record cut short that is completed within moments is a record another run
    is writing, not damage."""
    import threading

    db = tmp_path / "t.sqlite"
    assert tune(timings, db).exit_code == 0
    journal = tmp_path / "t.sqlite.optuna.journal"
    data = journal.read_bytes()
    journal.write_bytes(data[:-10])
    done = threading.Timer(0.2, lambda: journal.write_bytes(data))
    done.start()
    try:
        assert tune(timings, db, "--trials", 3).exit_code == 0
    finally:
        done.join()


def test_workers_stopped_by_a_signal_are_not_called_a_crash(tmp_path, timings, monkeypatch):
    from flashgen import tuner

    monkeypatch.setattr(tuner, "tune_parallel", lambda items, configs, on_exit=None, on_start=None:
                        {"w0": 143, "w1": 0})
    res = tune(timings, tmp_path / "w.sqlite", "--workers", 2)
    assert res.exit_code == 143 and "stopped by a signal" in res.output, res.output


def test_workers_that_fail_fail_the_run_and_leave_nothing(tmp_path, timings, monkeypatch):
    """A worker that crashes (not one stopped by a signal) makes the run exit 1, with the
    rows recorded kept; a DB that got no row is removed as for a run that failed."""
    from flashgen import tuner

    monkeypatch.setattr(tuner, "tune_parallel", lambda items, configs, on_exit=None, on_start=None:
                        {"w0": 1, "w1": 0})
    res = tune(timings, tmp_path / "w.sqlite", "--workers", 2)
    assert res.exit_code == 1 and "1 of 2 workers failed (exit codes 1" in res.output, res.output
    assert listing(tmp_path) == ["timings.json"]


def test_keys_no_config_fits_are_left_out_or_refused(tmp_path):
    """float32 at head_dim 256 fits no tile on an sm_86's shared memory: tuning only such
    keys is a usage error naming the rule (it recorded hundreds of rejected rows and
    reported success); beside keys that fit, they are left out with a note."""
    res = invoke("tune", "--preset", "head-dims", "--dtype", "float32", "--fake-model", "--arch", "sm_86",
                 "--trials", 1, "--db", tmp_path / "f.sqlite", "--key", "d256")
    assert res.exit_code == 2 and "no config of any family that fits" in res.output, res.output
    assert listing(tmp_path) == []
    res = invoke("tune", "--preset", "head-dims", "--dtype", "float32", "--fake-model", "--arch", "sm_86",
                 "--kernels", "fwd", "--trials", 1, "--db", tmp_path / "g.sqlite", "--key", "d256,d96")
    assert res.exit_code == 0 and "left out" in res.output, res.output
    with TuningDB(tmp_path / "g.sqlite") as tdb:
        assert not [r for r in tdb.rows() if "d256" in r["key"]]

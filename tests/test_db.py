"""TuningDB: recording, env filtering, best / lookup, merge, concurrent writers."""

import multiprocessing
import sqlite3

import pytest

from flashgen import render
from flashgen.db import TuningDB, derived_tflops, row_count
from flashgen.env import Environment
from flashgen.spec import (TIMING_WINDOW, KernelSpec, Measurement, Shape, TileConfig, Variant, attention_flops,
                           shape_flops, varlen_lengths)

ENV = Environment("NVIDIA H200", "9.0", 132, "3.6.0", "2.11.0", "0.1.0")
OTHER_GPU = Environment("NVIDIA A100", "8.0", 108, "3.6.0", "2.11.0", "0.1.0")
SPEC = KernelSpec("fwd", "bfloat16", 64, 64, "none")
SHAPE = Shape(2, 4, 4, 256, 256)
KEY = SHAPE.key(SPEC)
C1, C2, C3 = TileConfig(128, 64, 8, 3), TileConfig(64, 64, 4, 2), TileConfig(128, 128, 8, 2)


def _fake_hashes(kernel, mods=""):
    return f"tmpl-{kernel}"


@pytest.fixture(autouse=True)
def template_hashes(monkeypatch):
    monkeypatch.setattr(render, "template_hash", _fake_hashes)


@pytest.fixture
def db(tmp_path):
    with TuningDB(tmp_path / "sub" / "t.sqlite") as d:
        yield d


def rec(db, cfg, ms=None, status="ok", env=ENV, key=KEY, shape=SHAPE, **kw):
    m = Measurement(status, median_ms=ms, **kw)
    return db.record(key, shape, Variant(key.spec, cfg), m, env, smem_bytes_model=1234)


def test_record_round_trip_and_tflops(db):
    rid = rec(db, C1, 0.5, max_abs_err=1e-3, smem_bytes_compiled=1000, n_regs=128, n_spills=0)
    r = db.get(rid)
    assert r["key"] == KEY.id and r["variant_id"] == Variant(SPEC, C1).id
    assert {k: r[k] for k in ("batch", "num_heads", "num_kv_heads", "seqlen_q", "seqlen_k")} == \
        {"batch": 2, "num_heads": 4, "num_kv_heads": 4, "seqlen_q": 256, "seqlen_k": 256}
    assert TileConfig.from_dict(r) == C1
    assert _key_cols(r) == KEY.as_row()
    assert r["median_ms"] == 0.5 and r["smem_bytes_model"] == 1234 and r["n_regs"] == 128
    assert r["template_hash"] == "tmpl-fwd" and r["gpu_name"] == "NVIDIA H200"
    assert r["created_at"].endswith("+00:00")
    flops = 2.0 * 2 * 4 * 256 * 256 * (64 + 64)
    assert r["tflops"] == pytest.approx(flops / 0.5e-3 / 1e12)
    # causal halves the work; bwd_dq counts 1.5x the forward
    cspec = KernelSpec("bwd_dq", "bfloat16", 64, 64, "causal")
    ckey = SHAPE.key(cspec)
    r2 = db.get(rec(db, C2, 0.5, key=ckey))
    assert r2["tflops"] == pytest.approx(r["tflops"] / 2 * 1.5)
    assert r2["tflops"] == pytest.approx(
        attention_flops(2, 4, 256, 256, 64, causal=True, kernel="bwd_dq") / 0.5e-3 / 1e12)
    # a varlen key counts the documents the tuner times (varlen_lengths), not batch x seqlen
    vspec = KernelSpec("fwd_varlen", "bfloat16", 64, 64, "causal")
    vshape = Shape(4, 4, 4, 256, 256)
    lens = varlen_lengths(4, 256)
    assert lens[0] == 256 and all(128 <= n <= 256 for n in lens) and sum(lens) < 4 * 256
    r4 = db.get(rec(db, C2, 0.5, key=vshape.key(vspec), shape=vshape))
    assert r4["tflops"] == pytest.approx(
        sum(attention_flops(1, 4, n, n, 64, causal=True) for n in lens) / 0.5e-3 / 1e12)
    assert r4["tflops"] < attention_flops(4, 4, 256, 256, 64, causal=True) / 0.5e-3 / 1e12
    # failures carry no time and no tflops
    r3 = db.get(rec(db, C3, status="compile_failed", error="boom"))
    assert r3["median_ms"] is None and r3["tflops"] is None and r3["error"] == "boom"


def _band(seqlen_q, seqlen_k, left, right):
    """Brute force: the (i, j) with diag_lo <= j - i <= diag_hi, bottom-right aligned
    (offset seqlen_k - seqlen_q), -1 unbounded."""
    off = seqlen_k - seqlen_q
    return sum(1 for i in range(seqlen_q) for j in range(seqlen_k)
               if (left < 0 or j - i >= off - left) and (right < 0 or j - i <= off + right))


@pytest.mark.parametrize("kernel,factor", [("fwd", 1.0), ("bwd", 2.5), ("bwd_dkdv", 2.0), ("bwd_dq", 1.5)])
@pytest.mark.parametrize("sq,sk,window", [(97, 97, (16, 0)), (60, 130, (16, 0)), (130, 60, (16, 3)),
                                          (50, 50, (7, 11)), (40, 90, (-1, 5)), (90, 40, (200, 0))])
def test_shape_flops_of_a_window_counts_the_band(kernel, factor, sq, sk, window):
    """A window's FLOPs: the scores the band lets through x 2·b·h·(d + dv) x the kernel's
    factor, not the dense (or causal-halved) count."""
    shape, d, dv = Shape(3, 5, 5, sq, sk), 64, 32
    per_score = 2.0 * 3 * 5 * (d + dv) * factor
    band = _band(sq, sk, *window)
    assert band < sq * sk
    assert shape_flops(kernel, shape, d, dv, window=window) == pytest.approx(per_score * band)
    # causal closes the right side
    assert shape_flops(kernel, shape, d, dv, causal=True, window=window) == \
        pytest.approx(per_score * _band(sq, sk, window[0], 0))


def test_shape_flops_of_the_timing_window():
    """A ``window`` key as the tuner times it (TIMING_WINDOW = (1024, 0), bottom-right):
    at 2048 x 2048 query i sees min(i, 1024) + 1 keys, 1,574,400 pairs of 4,194,304."""
    assert TIMING_WINDOW == (1024, 0)
    shape = Shape(8, 16, 16, 2048, 2048)
    pairs = sum(min(i, 1024) + 1 for i in range(2048))
    assert pairs == 1_574_400
    assert shape_flops("fwd", shape, 128, window=TIMING_WINDOW) == 4.0 * 8 * 16 * 128 * pairs
    assert shape_flops("fwd", shape, 128, window=TIMING_WINDOW) < shape_flops("fwd", shape, 128, causal=True)
    # varlen: per document
    vshape = Shape(4, 4, 4, 3000, 3000)
    lens = varlen_lengths(4, 3000)
    assert shape_flops("fwd_varlen", vshape, 64, window=TIMING_WINDOW) == pytest.approx(
        4.0 * 4 * 64 * sum(sum(min(i, 1024) + 1 for i in range(n)) for n in lens))


@pytest.mark.parametrize("kernel", ["fwd", "bwd", "bwd_dq", "fwd_varlen", "bwd_dkdv_varlen", "decode"])
@pytest.mark.parametrize("causal", [False, True])
def test_shape_flops_without_a_window_is_unchanged(kernel, causal):
    shape = Shape(3, 4, 2, 300, 500)
    base = shape_flops(kernel, shape, 64, 128, causal=causal)
    assert shape_flops(kernel, shape, 64, 128, causal=causal, window=None) == base
    assert shape_flops(kernel, shape, 64, 128, causal=causal, window=(-1, -1)) == base
    if not kernel.endswith("_varlen"):
        assert base == attention_flops(3, 4, 300, 500, 64, 128, causal=causal, kernel=kernel)


def test_window_row_tflops_count_the_timing_window(db):
    """A ``window`` row's TFLOP/s (record, derived_tflops, merge) count the scores
    TIMING_WINDOW lets through, not the unmasked score matrix."""
    wspec = KernelSpec("fwd", "bfloat16", 64, 64, "window")
    shape = Shape(2, 4, 4, 2048, 2048)
    r = db.get(rec(db, C2, 0.5, key=shape.key(wspec), shape=shape))
    band = 2.0 * 2 * 4 * 128 * sum(min(i, 1024) + 1 for i in range(2048)) / 0.5e-3 / 1e12
    dense = attention_flops(2, 4, 2048, 2048, 64) / 0.5e-3 / 1e12
    assert r["tflops"] == pytest.approx(band) and r["tflops"] < 0.4 * dense
    assert derived_tflops({**r, "tflops": dense}) == pytest.approx(band)
    # the same row's shape under mask none / causal keeps the dense / halved count
    assert derived_tflops({**r, "mask": "none"}) == pytest.approx(dense)
    assert derived_tflops({**r, "mask": "causal"}) == pytest.approx(dense / 2)
    # varlen window: per document
    vspec = KernelSpec("fwd_varlen", "bfloat16", 64, 64, "window")
    vshape = Shape(4, 4, 4, 3000, 3000)
    rv = db.get(rec(db, C1, 0.5, key=vshape.key(vspec), shape=vshape))
    assert rv["tflops"] == pytest.approx(
        shape_flops("fwd_varlen", vshape, 64, window=TIMING_WINDOW) / 0.5e-3 / 1e12)
    assert rv["tflops"] < sum(attention_flops(1, 4, n, n, 64, causal=True) for n in varlen_lengths(4, 3000)) \
        / 0.5e-3 / 1e12


def _key_cols(r):
    return {k: r[k] for k in KEY.as_row()}


def test_record_rejects_variant_of_another_spec(db):
    other = Variant(KernelSpec("fwd", "bfloat16", 128, 128, "none"), C1)
    with pytest.raises(ValueError, match="does not belong"):
        db.record(KEY, SHAPE, other, Measurement("ok", median_ms=1.0), ENV, 0)


def test_best_filters_status_and_env(db, monkeypatch):
    rec(db, C1, 2.0)
    rec(db, C2, 1.0)
    rec(db, C3, status="launch_failed", error="x")
    rec(db, C3, 0.1, env=OTHER_GPU)  # faster, but on another GPU
    assert db.best(KEY, ENV)["variant_id"] == Variant(SPEC, C2).id
    assert db.best(KEY)["gpu_name"] == "NVIDIA A100"  # env None: any environment
    assert db.best(KEY.id, ENV)["median_ms"] == 1.0
    assert db.best("attn_fwd_nothing", ENV) is None
    assert all(ENV.matches(r) for r in db.rows(env=ENV))
    assert len(db.rows(env=ENV)) == 3 and len(db.rows()) == 4
    assert [r["status"] for r in db.rows(status="launch_failed")] == ["launch_failed"]
    # another Triton version, or a changed template, matches nothing
    assert db.best(KEY, Environment("NVIDIA H200", "9.0", 132, "3.5.1", "2.11.0", "0.1.0")) is None
    monkeypatch.setattr(render, "template_hash", lambda k, mods="": "edited")
    assert db.best(KEY, ENV) is None and not ENV.matches(db.get(1))
    assert db.best(KEY)["median_ms"] == 0.1


def test_best_configs_one_per_key(db):
    key2 = Shape(2, 4, 4, 1024, 1024).key(SPEC)
    rec(db, C1, 3.0)
    rec(db, C2, 2.0)
    rec(db, C3, 5.0)
    rec(db, C1, 7.0, key=key2, shape=Shape(2, 4, 4, 1024, 1024))
    rec(db, C2, 6.0, key=key2, shape=Shape(2, 4, 4, 1024, 1024))
    rec(db, C3, 0.5, env=OTHER_GPU)
    best = db.best_configs(ENV)
    assert set(best) == {KEY.id, key2.id}
    assert best[KEY.id][0] == C2 and best[KEY.id][1]["median_ms"] == 2.0
    assert best[key2.id][0] == C2 and best[key2.id][1]["median_ms"] == 6.0
    assert db.best_configs(OTHER_GPU) == {KEY.id: (C3, db.get(6))}
    # without env: best per key and environment
    assert sorted((r["key"], r["gpu_name"]) for r in db.best_rows()) == sorted(
        [(KEY.id, "NVIDIA H200"), (key2.id, "NVIDIA H200"), (KEY.id, "NVIDIA A100")])
    assert [r["key"] for r in db.best_rows(key_contains="q1024")] == [key2.id]


def test_a_row_a_newer_version_wrote_with_a_knob_this_one_lacks_is_not_served(tmp_path):
    """A newer flashgen adds a knob column and writes the fastest row with it set: this
    version cannot rebuild that row's variant_id from the columns it knows, so the best
    row it serves for the key is the fastest one it can read (not the newer row's
    timing under another config)."""
    path = tmp_path / "t.sqlite"
    with TuningDB(path) as d:
        rec(d, C1, 3.0)
        rec(d, C2, 2.0)
        newer = rec(d, C3, 1.0)
    con = sqlite3.connect(path)
    con.execute("ALTER TABLE measurements ADD COLUMN [future_knob] INTEGER")
    vid = con.execute("SELECT variant_id FROM measurements WHERE id = ?", (newer,)).fetchone()[0]
    con.execute("UPDATE measurements SET future_knob = 1, variant_id = ? WHERE id = ?", (vid + "_fut", newer))
    con.commit()
    con.close()
    with TuningDB(path) as d:
        best = d.best_configs(ENV)
        assert best[KEY.id][0] == C2 and best[KEY.id][1]["median_ms"] == 2.0
        assert [r["id"] for r in d.best_rows(ENV)] == [best[KEY.id][1]["id"]]


def test_lookup_prefers_ok_and_respects_env(db):
    vid = Variant(SPEC, C1).id
    assert db.lookup(KEY, vid, ENV) is None
    rec(db, C1, 1.5)
    rec(db, C1, status="launch_failed")
    assert db.lookup(KEY, vid, ENV)["status"] == "ok"
    assert db.lookup(KEY, vid, OTHER_GPU) is None
    rec(db, C2, status="wrong_result", max_abs_err=0.5)
    assert db.lookup(KEY, Variant(SPEC, C2).id, ENV)["status"] == "wrong_result"


def test_status_counts(db):
    rec(db, C1, 1.0)
    rec(db, C2, 2.0)
    rec(db, C3, status="infeasible")
    rec(db, C3, status="infeasible", env=OTHER_GPU)
    assert db.status_counts() == {"ok": 2, "infeasible": 2}
    assert db.status_counts(env=ENV) == {"ok": 2, "infeasible": 1}
    assert db.status_counts(key_contains="bwd") == {}


def test_merge_copies_missing_rows_only(tmp_path):
    a, b = TuningDB(tmp_path / "a.sqlite"), TuningDB(tmp_path / "b.sqlite")
    rec(a, C1, 1.0)
    rec(b, C2, 2.0)
    rec(b, C3, status="infeasible", env=OTHER_GPU)
    assert a.merge_from(b.path) == 2
    assert a.merge_from(b.path) == 0  # idempotent
    rows = a.rows()
    assert [r["variant_id"] for r in rows] == [Variant(SPEC, c).id for c in (C1, C2, C3)]
    src = {r["variant_id"]: r for r in b.rows()}
    for r in rows[1:]:  # copied verbatim apart from the id
        assert {k: v for k, v in r.items() if k != "id"} == \
            {k: v for k, v in src[r["variant_id"]].items() if k != "id"}
    assert len(b.rows()) == 2  # the input is untouched
    # merging back the other way brings a's original row (and nothing twice)
    assert b.merge_from(a.path) == 1 and len(b.rows()) == 3
    with pytest.raises(FileNotFoundError):
        a.merge_from(tmp_path / "missing.sqlite")


def test_merge_and_import_derive_tflops_again(tmp_path):
    """A varlen row from an older flashgen (its FLOPs counted as batch x longest sequence)
    arrives with the TFLOP/s this version derives from its shape and median_ms; its other
    columns as stored."""
    vspec = KernelSpec("fwd_varlen", "bfloat16", 64, 64, "causal")
    vshape = Shape(4, 4, 4, 256, 256)
    old = TuningDB(tmp_path / "old.sqlite")
    rid = rec(old, C2, 0.5, key=vshape.key(vspec), shape=vshape)
    right = old.get(rid)["tflops"]
    inflated = attention_flops(4, 4, 256, 256, 64, causal=True) / 0.5e-3 / 1e12
    old._conn.execute("UPDATE measurements SET tflops = ? WHERE id = ?", (inflated, rid))
    old._conn.commit()
    assert right < inflated
    a = TuningDB(tmp_path / "a.sqlite")
    assert a.merge_from(old.path) == 1
    (r,) = a.rows()
    assert r["tflops"] == pytest.approx(right) and r["median_ms"] == 0.5
    b = TuningDB(tmp_path / "b.sqlite")
    assert b.import_rows([{**dict(old.get(rid)), "tflops": inflated}]) == 1
    assert b.rows()[0]["tflops"] == pytest.approx(right)


def test_journal_mode_is_wal(db):
    assert db.db.journal_mode == "wal"


def _writer(path, tag, n):
    render.template_hash = _fake_hashes  # the child may be spawned: patch again
    with TuningDB(path) as d:
        for i in range(n):
            rec(d, (C1, C2, C3)[i % 3], 1.0 + i, error=f"{tag}-{i}")


def test_two_processes_writing_lose_nothing(tmp_path):
    path = tmp_path / "shared.sqlite"
    ctx = multiprocessing.get_context("spawn")
    n = 150
    procs = [ctx.Process(target=_writer, args=(path, tag, n)) for tag in ("a", "b")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    with TuningDB(path) as d:
        errors = [r["error"] for r in d.rows()]
    assert sorted(errors) == sorted(f"{t}-{i}" for t in "ab" for i in range(n))
    assert sqlite3.connect(path).execute("PRAGMA integrity_check").fetchone() == ("ok",)



def _merger(out, source):
    with TuningDB(out) as d:
        d.merge_from(source)


def test_concurrent_merges_of_one_source_add_each_row_once(tmp_path):
    """Three processes merging the shipped H200 database into one new file at once: each
    row once (each merge read what the file had before taking the write lock, found every
    row missing and added it: three copies)."""
    import shutil

    from flashgen.dispatch import shipped_databases

    source = tmp_path / "in.sqlite"
    shutil.copy(next(p for p in shipped_databases() if p.name == "h200.sqlite"), source)
    out = tmp_path / "out.sqlite"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_merger, args=(out, source)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
        assert p.exitcode == 0
    n = sqlite3.connect(source).execute("SELECT COUNT(*) FROM measurements").fetchone()[0]
    assert sqlite3.connect(out).execute("SELECT COUNT(*) FROM measurements").fetchone()[0] == n > 1000

def test_readonly_reads_and_refuses_writes(tmp_path):
    path = tmp_path / "odd dir #1?" / "shipped.sqlite"
    with TuningDB(path) as w:
        rec(w, C1, 1.0)
        rec(w, C2, status="infeasible")
    with TuningDB(path, readonly=True) as ro:
        assert ro.readonly and ro.count_ok(ENV) == 1 and ro.count_ok(OTHER_GPU) == 0
        assert ro.best_configs(ENV)[KEY.id][0] == C1
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            rec(ro, C3, 0.5)
    assert len(TuningDB(path).rows()) == 2
    with pytest.raises(FileNotFoundError):
        TuningDB(tmp_path / "absent.sqlite", readonly=True)


def test_a_file_without_a_later_column_is_changed_only_by_its_first_write(tmp_path):
    path = tmp_path / "old.sqlite"
    with TuningDB(path) as w:
        rec(w, C1, 1.0)
    with sqlite3.connect(path) as c:  # a file written before the family column existed
        c.execute("ALTER TABLE measurements DROP COLUMN family")
    c.close()
    before = path.read_bytes()
    with TuningDB(path) as w:  # a writable open that only reads leaves the file as it was
        assert not w.readonly and "family" not in w.rows()[0]
        assert w.best_configs(ENV)[KEY.id][0] == C1  # the row reads as the Triton family's
    assert path.read_bytes() == before
    with TuningDB(path) as w:
        rec(w, C2, 0.5)  # the first write adds the column (NULL in the old row)
        assert [r["family"] for r in w.rows()] == [None, "triton"]
        assert w.best_configs(ENV)[KEY.id][0] == C2


def test_a_read_only_file_stays_read_only_for_root(tmp_path, monkeypatch):
    """root passes os.access whatever the mode bits say; a database made read-only
    (chmod a-w) is still refused for writing and opened for reading only."""
    import stat

    from flashgen import db as fdb
    from flashgen.errors import InputError

    path = tmp_path / "t.sqlite"
    with fdb.TuningDB(path):
        pass
    path.chmod(stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
    monkeypatch.setattr(fdb.os, "geteuid", lambda: 0, raising=False)
    monkeypatch.setattr(fdb.os, "access", lambda p, mode, **kw: True)  # what root gets
    with pytest.raises(InputError, match="is not writable"):
        fdb.check_writable(path)
    with fdb.TuningDB(path) as db:
        assert db.readonly
    path.chmod(stat.S_IRUSR | stat.S_IWUSR)
    fdb.check_writable(path)  # a write bit: writable
    with fdb.TuningDB(path) as db:
        assert not db.readonly


def _side_files(path):
    return sorted(p.name[len(path.name):] for p in path.parent.iterdir() if p.name.startswith(path.name + "-"))


def test_reading_a_wal_file_leaves_no_files_beside_it(tmp_path):
    """A read-only open of a WAL-mode file (``flashgen show``, ``export``) creates its -wal
    and -shm files; closing removes them again when they were absent before and the file
    is writable, and leaves the file's bytes as they were.  While another connection has
    the file open they stay, and that connection reads and writes as before."""
    path = tmp_path / "t.sqlite"
    with TuningDB(path) as d:
        rec(d, C1, 1.0)
    before = path.read_bytes()
    assert _side_files(path) == []
    with TuningDB(path, readonly=True) as ro:
        assert len(ro.rows()) == 1
        assert _side_files(path) == ["-shm", "-wal"]
    assert _side_files(path) == [] and path.read_bytes() == before
    assert row_count(path) == 1 and _side_files(path) == []  # what a stopped tune reports counts alike
    ro = TuningDB(path, readonly=True)
    writer = sqlite3.connect(str(path))
    assert writer.execute("SELECT COUNT(*) FROM measurements").fetchone() == (1,)
    ro.close()  # another connection is open: the files stay
    assert _side_files(path) == ["-shm", "-wal"]
    writer.execute("DELETE FROM measurements")
    writer.commit()
    writer.close()
    assert _side_files(path) == []
    with TuningDB(path, readonly=True) as ro:
        assert ro.rows() == []
    path.chmod(0o444)  # a file it may not write, nothing beside it: read as immutable, nothing made
    try:
        with TuningDB(path, readonly=True) as ro:
            assert ro.rows() == [] and _side_files(path) == []
        assert _side_files(path) == []
    finally:
        path.chmod(0o644)

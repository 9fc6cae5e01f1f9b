"""The dispatcher: default / tuned / nearest, environment filtering, reloading, and the
end-to-end path from a tuning-DB row to the kernel flashgen.attention launches."""

import dataclasses
import os
import warnings

import pytest
import torch

import flashgen
from flashgen import arch as farch
from flashgen import compile as fcompile
from flashgen import dispatch, families, heuristics, ops, reference, resources
from flashgen.db import TuningDB
from flashgen.dispatch import Dispatcher
from flashgen.env import Environment
from flashgen.spec import KernelSpec, Measurement, Shape, TileConfig, Variant

ENV = Environment("NVIDIA H200", "9.0", 132, "3.6.0", "2.13.0", "0.1.0")
ARCH = farch.TABLE["sm_90"]
@pytest.fixture(autouse=True)
def _large_enough_for_gluon_defaults(monkeypatch):
    """The small keys of these tests stand for problems large enough for the Gluon
    defaults (the size threshold itself: tests/test_gluon_family.py)."""
    from flashgen.families.gluon import family

    monkeypatch.setattr(family, "DEFAULT_MIN_FLOPS", {"fwd": 0, "bwd": 0})


SPEC = KernelSpec("fwd", "bfloat16", 64, 64, "causal")
SHAPE = Shape(2, 8, 8, 1024, 1024)
KEY = SHAPE.key(SPEC)
OTHER_BUCKET = Shape(2, 8, 8, 4096, 4096).key(SPEC)
FAR_BUCKET = Shape(2, 8, 8, 16384, 16384).key(SPEC)
C1, C2, C3 = TileConfig(64, 64, 4, 2), TileConfig(128, 128, 8, 2), TileConfig(64, 32, 4, 1)
#: An untuned forward key on sm_90 runs the Gluon family's default (it measured ahead of
#: the Triton family's tuned forward on the H200, docs/results/h200/gluon_fwd).
DEFAULT = families.get("gluon").default_config(KEY, ARCH)


def rec(db, cfg, ms, key=KEY, env=ENV, status="ok"):
    return db.record(key, SHAPE, Variant(key.spec, cfg), Measurement(status, median_ms=ms), env,
                     smem_bytes_model=resources.estimate(Variant(key.spec, cfg), ARCH).total_bytes)


@pytest.fixture
def db_path(tmp_path):
    return tmp_path / "tune.sqlite"


def disp(*paths, env=ENV, arch=ARCH):
    return Dispatcher(list(paths), env=env, arch=arch)


def test_no_database_gives_the_heuristic_default(db_path):
    for d in (disp(), disp(db_path)):  # no databases / a path that does not exist
        ch = d.choose(KEY)
        assert ch.source == "default" and ch.tuned_key is None and ch.median_ms is None
        assert ch.config == DEFAULT and ch.family == "gluon" and "docs/results/h200/gluon_fwd" in ch.note
        est = families.get("gluon").estimate(Variant(SPEC, ch.config), ARCH)
        assert ch.smem_bytes == est.total_bytes and ch.smem_breakdown == est.breakdown()
        assert d.config_for(KEY) == ch.config
    # where the Gluon family does not serve (sm_80, the interpreter), the Triton heuristic
    for a in (farch.TABLE["sm_80"], farch.INTERPRETER):
        ch = disp(arch=a).choose(KEY)
        assert ch.config == heuristics.default_config(SPEC, a) and ch.family == "triton" and ch.note is None
        est = resources.estimate(Variant(SPEC, ch.config), a)
        assert ch.smem_bytes == est.total_bytes and ch.smem_breakdown == est.breakdown()
    # the default depends on the architecture
    big = KernelSpec("fwd", "bfloat16", 128, 128, "none")
    k = SHAPE.key(big)
    assert disp(arch=farch.TABLE["sm_86"]).config_for(k) != disp().config_for(k)
    assert not db_path.exists()  # a missing database is not created


def test_tuned_row_for_the_exact_key(db_path):
    with TuningDB(db_path) as db:
        rec(db, C1, 2.0)
        rec(db, C2, 0.5)  # the fastest ok row wins
        rec(db, C3, 0.1, status="wrong_result")  # not ok: ignored
        rec(db, C3, 0.2, key=OTHER_BUCKET)  # another key: not used for KEY
    ch = disp(db_path).choose(KEY)
    assert ch.source == "tuned" and ch.config == C2 and ch.config != heuristics.default_config(SPEC, ARCH)
    assert ch.tuned_key == KEY.id and ch.median_ms == 0.5 and ch.database == str(db_path)
    assert ch.tflops == pytest.approx(
        flashgen.spec.attention_flops(2, 8, 1024, 1024, 64, causal=True) / 0.5e-3 / 1e12)
    assert ch.smem_bytes == resources.estimate(Variant(SPEC, C2), ARCH).total_bytes


def test_fastest_row_across_databases(tmp_path):
    a, b = tmp_path / "a.sqlite", tmp_path / "b.sqlite"
    with TuningDB(a) as da, TuningDB(b) as dbb:
        rec(da, C1, 1.0)
        rec(dbb, C2, 0.7)
    for order in ((a, b), (b, a)):
        ch = disp(*order).choose(KEY)
        assert (ch.source, ch.config, ch.database) == ("tuned", C2, str(b))


def test_nearest_bucket_of_the_same_spec(db_path):
    other_spec = dataclasses.replace(SPEC, mask="none")
    with TuningDB(db_path) as db:
        rec(db, C1, 1.0, key=OTHER_BUCKET)  # q/k 4096 vs 1024: distance 4
        rec(db, C2, 0.1, key=FAR_BUCKET)  # 16384: distance 8, faster but farther
        rec(db, C3, 0.1, key=SHAPE.key(other_spec))  # exact sizes, another spec: never used
    ch = disp(db_path).choose(KEY)
    assert ch.source == "nearest" and ch.config == C1 and ch.tuned_key == OTHER_BUCKET.id
    assert ch.median_ms == 1.0
    # another GQA group is another family: no nearest row, the default
    gqa = Shape(2, 8, 2, 1024, 1024).key(SPEC)
    assert gqa.group == 4
    ch = disp(db_path).choose(gqa)
    assert ch.source == "default" and ch.config == DEFAULT


def test_the_nearest_buckets_fastest_row_wins_across_databases(tmp_path):
    """Two databases with rows of the same nearest bucket: the faster row serves whichever
    database comes first (the first database's slower row won at equal distance), and
    for the bucket itself (the exact row) too."""
    slow, fast = tmp_path / "slow.sqlite", tmp_path / "fast.sqlite"
    with TuningDB(slow) as db:
        rec(db, C1, 2.0, key=OTHER_BUCKET)
    with TuningDB(fast) as db:
        rec(db, C2, 1.0, key=OTHER_BUCKET)
    for order in ((slow, fast), (fast, slow)):
        ch = disp(*order).choose(KEY)
        assert (ch.source, ch.config, ch.median_ms) == ("nearest", C2, 1.0), order
        assert disp(*order).choose(OTHER_BUCKET).config == C2


@pytest.mark.parametrize("fields", [{"gpu_name": "NVIDIA H100 PCIe", "sm_count": 114},
                                    {"gpu_name": "NVIDIA A100", "compute_capability": "8.0"},
                                    {"compute_capability": "8.0"}])
def test_rows_of_another_environment_are_ignored_with_a_warning(db_path, fields):
    """Rows of a GPU that is not this one nor its sibling (another SM count or compute
    capability: test_a_sibling_gpus_rows_serve_the_keys_this_gpu_has_no_row_for)."""
    other = dataclasses.replace(ENV, **fields)
    with TuningDB(db_path) as db:
        rec(db, C2, 0.1, env=other)
        rec(db, C3, 0.1, env=other, key=OTHER_BUCKET)
    d = disp(db_path)
    with pytest.warns(UserWarning, match="no rows for this environment"):
        ch = d.choose(KEY)
    assert ch.source == "default" and ch.config == DEFAULT
    # one warning per database, not per call
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        d.clear()
        assert d.choose(OTHER_BUCKET).source == "default"
    # once a matching row exists, it is used and the faster foreign row still is not
    with TuningDB(db_path) as db:
        rec(db, C1, 5.0)
    d.clear()
    ch = d.choose(KEY)
    assert (ch.source, ch.config, ch.median_ms) == ("tuned", C1, 5.0)


def test_rows_of_another_triton_version_come_after_exact_rows_and_before_the_nearest_bucket(db_path):
    """The same GPU and generated code measured under another Triton: used, flagged with
    the versions it was tuned under, after this version's rows of the key and before
    any nearest bucket."""
    old = dataclasses.replace(ENV, triton_version="3.5.0", torch_version="2.11.0")
    with TuningDB(db_path) as db:
        rec(db, C2, 0.5, env=old)
        rec(db, C3, 0.4, env=dataclasses.replace(old, triton_version="3.4.0"))  # fastest of the other versions
        rec(db, C1, 1.0, key=OTHER_BUCKET)  # this version's rows: only a nearby bucket
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # rows that apply: no "no rows for this environment"
        ch = disp(db_path).choose(KEY)
    assert (ch.source, ch.config, ch.median_ms, ch.tuned_key) == ("tuned", C3, 0.4, KEY.id)
    assert ch.tuned_under == "triton 3.4.0, torch 2.11.0"
    # this version's row of the key wins, even when slower
    with TuningDB(db_path) as db:
        rec(db, C1, 3.0)
    ch = disp(db_path).choose(KEY)
    assert (ch.source, ch.config, ch.median_ms, ch.tuned_under) == ("tuned", C1, 3.0, None)
    # a bucket nobody tuned: this version's nearest bucket before another version's
    ch = disp(db_path).choose(FAR_BUCKET)
    assert (ch.source, ch.tuned_key, ch.tuned_under) == ("nearest", OTHER_BUCKET.id, None)
    # only other versions' rows: their nearest bucket, flagged
    only_old = db_path.with_name("old.sqlite")
    with TuningDB(only_old) as db:
        rec(db, C2, 0.5, env=old)
    ch = disp(only_old).choose(FAR_BUCKET)
    assert (ch.source, ch.config, ch.tuned_key, ch.tuned_under) == ("nearest", C2, KEY.id, "triton 3.5.0, torch 2.11.0")
    # a row of this Triton under another torch: an exact row, its torch named
    assert ENV.version_note({"triton_version": "3.6.0", "torch_version": "2.9.0"}) == "torch 2.9.0"


H100 = dataclasses.replace(ENV, gpu_name="NVIDIA H100 80GB HBM3")  # sm_90, 132 SMs: the H200's sibling


def test_a_sibling_gpus_rows_serve_the_keys_this_gpu_has_no_row_for(db_path):
    """Rows of another GPU of the same compute capability and SM count (the H200's on an
    H100 SXM) serve a key that none of this GPU's rows serves, exactly or by its nearest
    bucket, flagged with that GPU's name; this GPU's own rows come first, and a GPU of
    another SM count or compute capability takes none of them."""
    with TuningDB(db_path) as db:
        rec(db, C2, 0.5)  # the H200's row of KEY
        rec(db, C3, 0.7, key=FAR_BUCKET)
        # rows no GPU measured (a --fake-model or --fake run, the interpreter's): never a sibling's
        for name in ("NVIDIA H200 (model)", "NVIDIA H100 PCIe (fake)", "triton-interpreter"):
            rec(db, C1, 0.01, env=dataclasses.replace(ENV, gpu_name=name))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # rows that apply: no "no rows for this environment"
        ch = disp(db_path, env=H100).choose(KEY)
    assert (ch.source, ch.config, ch.median_ms, ch.tuned_key) == ("tuned", C2, 0.5, KEY.id)
    assert ch.tuned_under == "NVIDIA H200 (sm_90, 132 SMs, as this GPU)"
    ch = disp(db_path, env=H100).choose(OTHER_BUCKET)  # the sibling's nearest bucket
    assert (ch.source, ch.config, ch.tuned_key) == ("nearest", C2, KEY.id)
    # under another Triton the sibling's rows are flagged with both
    ch = disp(db_path, env=dataclasses.replace(H100, triton_version="3.9.0")).choose(KEY)
    assert (ch.config, ch.tuned_under) == (C2, "NVIDIA H200 (sm_90, 132 SMs, as this GPU), triton 3.6.0")
    # this GPU's own rows first: its exact row, even when slower, and its nearest bucket
    # before the sibling's exact row
    with TuningDB(db_path) as db:
        rec(db, C1, 3.0, key=OTHER_BUCKET, env=H100)
    ch = disp(db_path, env=H100).choose(KEY)
    assert (ch.source, ch.config, ch.tuned_key, ch.tuned_under) == ("nearest", C1, OTHER_BUCKET.id, None)
    ch = disp(db_path, env=H100).choose(OTHER_BUCKET)
    assert (ch.source, ch.config, ch.median_ms, ch.tuned_under) == ("tuned", C1, 3.0, None)
    # no sibling: another SM count (the H100 PCIe), another compute capability
    pcie = dataclasses.replace(ENV, gpu_name="NVIDIA H100 PCIe", sm_count=114)
    with pytest.warns(UserWarning, match="has no rows for this environment"):
        ch = disp(db_path, env=pcie, arch=dataclasses.replace(ARCH, sm_count=114)).choose(KEY)
    assert ch.source == "default"
    with pytest.warns(UserWarning, match="has no rows for this environment"):
        ch = disp(db_path, env=dataclasses.replace(H100, compute_capability="10.0")).choose(KEY)
    assert ch.source == "default"


@pytest.fixture
def shipped(db_path, monkeypatch):
    """db_path stands in for the shipped database; the once-per-process warning re-armed."""
    monkeypatch.setattr(dispatch, "shipped_databases", lambda: [db_path])
    monkeypatch.setattr(dispatch, "_warned_shipped_default", False)
    return db_path


def test_a_gpu_with_shipped_rows_running_defaults_warns_once_per_process(shipped, monkeypatch):
    from flashgen import render

    with TuningDB(shipped) as db:
        rec(db, C2, 0.5)
    real = render.template_hash
    monkeypatch.setattr(render, "template_hash", lambda k, mods="": "0" * 16 if k == "fwd" else real(k, mods))
    with pytest.warns(UserWarning, match=r"NVIDIA H200 \(cc 9.0\) has 1 tuned rows in the shipped .*code hashes differ"):
        assert disp(shipped).choose(KEY).source == "default"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process: not again, whichever dispatcher
        assert disp(shipped).choose(OTHER_BUCKET).source == "default"
    # another GPU has no shipped rows: no warning
    monkeypatch.setattr(dispatch, "_warned_shipped_default", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a100 = dataclasses.replace(ENV, gpu_name="NVIDIA A100-SXM4-80GB", compute_capability="8.0", sm_count=108)
        assert disp(shipped, env=a100, arch=farch.TABLE["sm_80"]).choose(KEY).source == "default"


def test_a_spec_without_shipped_rows_warns_naming_it(shipped):
    with TuningDB(shipped) as db:
        rec(db, C2, 0.5, env=dataclasses.replace(ENV, triton_version="3.5.0"))
    d = disp(shipped)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert d.choose(KEY).tuned_under == "triton 3.5.0"  # applies: no warning
    other = SHAPE.key(dataclasses.replace(SPEC, head_dim=128, head_dim_v=128))
    with pytest.warns(UserWarning, match="none is for its kernel spec .attn_fwd_d128_bf16_causal"):
        assert d.choose(other).source == "default"
    # a capture never reads databases, and never warns
    dispatch._warned_shipped_default = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert disp(shipped).choose(other, capturing=True).source == "default"


def test_rows_of_another_template_hash_are_ignored(db_path, monkeypatch):
    with TuningDB(db_path) as db:
        rec(db, C2, 0.5)
    assert disp(db_path).choose(KEY).source == "tuned"
    from flashgen import render

    real = render.template_hash
    monkeypatch.setattr(render, "template_hash", lambda k, mods="": "0" * 16 if k == "fwd" else real(k, mods))
    with pytest.warns(UserWarning, match="no rows for this environment"):
        assert disp(db_path).choose(KEY).source == "default"


def test_database_changes_are_picked_up(db_path):
    with TuningDB(db_path) as db:
        rec(db, C1, 2.0)
    d = disp(db_path)
    assert (d.choose(KEY).source, d.config_for(KEY)) == ("tuned", C1)
    assert d.choose(OTHER_BUCKET).config == C1  # nearest, from the same table
    with TuningDB(db_path) as db:
        rec(db, C2, 1.0)  # faster
    # choices are memoized: still C1 until cleared ...
    assert d.config_for(KEY) == C1
    d.clear()
    assert d.choose(KEY).config == C2 and d.choose(KEY).median_ms == 1.0

    # ... and a cache miss re-reads a database whose file changed on disk
    with TuningDB(db_path) as db:
        rec(db, C3, 0.5)
    st = db_path.stat()
    os.utime(db_path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a distinct mtime
    ch = d.choose(FAR_BUCKET)  # not memoized: nearest bucket, from the re-read table
    assert (ch.source, ch.config, ch.median_ms) == ("nearest", C3, 0.5)


def test_rows_written_by_an_open_writer_are_picked_up(db_path):
    """A tuner in another process keeps its database open (WAL mode): new rows are in
    the -wal file while the main file is unchanged; a cache miss must still see them."""
    with TuningDB(db_path) as writer:
        rec(writer, C1, 2.0)
        d = disp(db_path)
        assert d.choose(KEY).config == C1
        rec(writer, C2, 1.0)
        ch = d.choose(OTHER_BUCKET)
        assert (ch.source, ch.config) == ("nearest", C2)
        rec(writer, C3, 3.0, key=OTHER_BUCKET)
        assert (d.choose(FAR_BUCKET).source, d.choose(FAR_BUCKET).config) == ("nearest", C3)


def test_add_database_and_flashgen_db(db_path, monkeypatch):
    with TuningDB(db_path) as db:
        rec(db, C2, 0.5)
    d = disp()
    assert d.choose(KEY).source == "default"
    d.add_database(db_path)
    assert d.databases()[0] == db_path and d.choose(KEY).config == C2
    # without explicit databases: the shipped ones, and $FLASHGEN_DB first
    monkeypatch.setenv("FLASHGEN_DB", str(db_path))
    d2 = Dispatcher(env=ENV, arch=ARCH)
    assert d2.databases() == [db_path] + dispatch.shipped_databases()
    assert d2.choose(KEY).config == C2
    monkeypatch.delenv("FLASHGEN_DB")
    assert Dispatcher(env=ENV, arch=ARCH).databases() == dispatch.shipped_databases()


def test_environment_current_on_cpu():
    env = Environment.current()
    if not torch.cuda.is_available():
        assert farch.current() is farch.INTERPRETER
        assert env.gpu_name == farch.INTERPRETER.name and env.compute_capability == "9.0"
    import triton

    assert env.triton_version == triton.__version__ and env.flashgen_version == flashgen.__version__


# -- end to end --------------------------------------------------------------------

TUNED = TileConfig(16, 32, 1, 1)  # one the rules admit (the dispatcher skips a row they refuse)


@pytest.fixture
def restore_default_dispatcher():
    yield
    dispatch.set_default_dispatcher(None)


def test_attention_launches_the_tuned_config(db_path, monkeypatch, restore_default_dispatcher):
    assert os.environ.get("TRITON_INTERPRET") == "1"
    torch.manual_seed(0)
    b, h, s, d = 1, 2, 40, 32
    q, k, v = (torch.randn(b, h, s, d, dtype=torch.float16) for _ in range(3))
    env, arch = Environment.current(), farch.current()
    spec = KernelSpec("fwd", "float16", d, d, "causal")
    key = Shape(b, h, h, s, s).key(spec)
    default = heuristics.default_config(spec, arch)
    assert default != TUNED
    with TuningDB(db_path) as db:
        db.record(key, Shape(b, h, h, s, s), Variant(spec, TUNED), Measurement("ok", median_ms=0.01), env, 0)
        db.record(key, Shape(b, h, h, s, s), Variant(spec, default), Measurement("ok", median_ms=0.02), env, 0)
    dispatch.set_default_dispatcher(Dispatcher([db_path], env=env, arch=arch))
    assert dispatch.default_dispatcher().choose(key).source == "tuned"

    launched = []
    real_fwd = ops.fwd

    def spy_fwd(*args, config, **kw):
        launched.append(config)
        return real_fwd(*args, config=config, **kw)

    monkeypatch.setattr(ops, "fwd", spy_fwd)
    out, lse = flashgen.attention(q, k, v, causal=True, return_lse=True)
    assert launched == [TUNED]
    # the module of that variant was loaded (the interpreter returns no compiled
    # kernel, so ops.compiled stays empty on CPU)
    vid = Variant(spec, TUNED).id
    assert any(k.startswith(vid + "@") for k in fcompile._modules)
    ro, rlse, _ = reference.forward(q, k, v, causal=True)
    bo, _, _ = reference.forward(q, k, v, causal=True, dtype=torch.float16)
    err, base = (out.double() - ro).abs().max().item(), (bo.double() - ro).abs().max().item()
    assert err <= 2 * base + 2e-3, (err, base)
    assert (lse.double() - rlse).abs().max().item() <= 1e-3


def test_rows_the_rules_refuse_or_cannot_read_are_left_out(db_path):
    """A row whose config its family's rules refuse for its key (measured under other
    rules, or edited) is not loaded: the next fastest row of its key serves, `flashgen
    export` writes that one, a key whose rows are all refused falls back to the default,
    and a hand-edited row the rules cannot even evaluate (zero warps) is refused without
    breaking the other keys of its database."""
    import sqlite_utils

    from flashgen.db import rules_admit

    env, arch = Environment.current(), farch.current()
    spec, shape = KernelSpec("fwd", "float16", 32, 32, "causal"), Shape(1, 2, 2, 40, 40)
    key, other = shape.key(spec), Shape(1, 2, 2, 40, 40).key(dataclasses.replace(spec, mask="none"))
    good, bad = TileConfig(16, 32, 1, 1), TileConfig(16, 16, 4, 1)  # bad: tile_per_warp
    fam = families.get("triton")
    assert not fam.violated_rules(Variant(spec, good)) and fam.violated_rules(Variant(spec, bad))
    with TuningDB(db_path) as db:
        db.record(key, shape, Variant(spec, bad), Measurement("ok", median_ms=0.01), env, 0)
        db.record(key, shape, Variant(spec, good), Measurement("ok", median_ms=0.02), env, 0)
        db.record(other, shape, Variant(other.spec, good), Measurement("ok", median_ms=0.03), env, 0)
        exported = db.export_best()
    assert [(r["key"], r["num_warps"]) for r in exported if r["key"] == key.id] == [(key.id, 1)]
    choice = disp(db_path, env=env, arch=arch).choose(key)
    assert choice.source == "tuned" and choice.config == good and choice.median_ms == 0.02
    # the other key's only row edited by hand to zero warps: refused, no exception
    t = sqlite_utils.Database(db_path)["measurements"]
    t.update(next(t.rows_where("key = ?", [other.id]))["id"], {"num_warps": 0})
    row = next(t.rows_where("key = ?", [other.id]))
    assert rules_admit(row) is False and rules_admit({**row, "num_warps": 1, "family": "nonesuch"}) is False
    d = disp(db_path, env=env, arch=arch)
    assert d.choose(other).source == "default" and d.choose(key).config == good
    # faster rows with a time edited to a non-positive number, or with a warp count
    # Triton does not launch, are not served either (the database read directly, as
    # FLASHGEN_DB and --db read it; `flashgen import` refuses both)
    odd, timed = TileConfig(64, 32, 3, 1), TileConfig(32, 32, 2, 1)
    assert [r[:5] for r in fam.violated_rules(Variant(spec, odd))] == ["pow2:"]
    assert not fam.violated_rules(Variant(spec, timed))
    with TuningDB(db_path) as db:
        db.record(key, shape, Variant(spec, odd), Measurement("ok", median_ms=0.001), env, 0)
        db.record(key, shape, Variant(spec, timed), Measurement("ok", median_ms=0.002), env, 0)
    t.update(next(t.rows_where("key = ? AND num_warps = 2", [key.id]))["id"], {"median_ms": -1.0})
    assert disp(db_path, env=env, arch=arch).choose(key).config == good


_WRITE_SCORE_INDEX_ROWS = r'''
import sys, torch, flashgen
from flashgen import user_tune
from flashgen.db import TuningDB
from flashgen.env import Environment
from flashgen.spec import Measurement, Shape, TileConfig, Variant
H200 = Environment("NVIDIA H200", "9.0", 132, "3.6.0", "2.11.0", flashgen.__version__)
shape = Shape(batch=8, num_heads=16, num_kv_heads=16, seqlen_q=2048, seqlen_k=2048)
t = torch.zeros(8, 16)
def sm(s, b, h, q, kv):
    return s + t[(s.abs() * 2).long() % 8, h]
k = shape.key(user_tune.UserProblem(sm, None, None, True, (-1, -1), 128, 128, "bfloat16", shape,
                                    "scoreidx").spec("fwd"))
with TuningDB(sys.argv[1]) as db:
    for cfg, ms in ((TileConfig(128, 64, 8, 2), 0.1), (TileConfig(128, 64, 8, 1), 0.2)):
        db.record(k, shape, Variant(k.spec, cfg), Measurement("ok", median_ms=ms), H200, 0)
print(k.id)
'''


def test_a_rule_that_depends_on_a_traced_function_is_checked_at_lookup(tmp_path):
    """A database loaded before a score function was traced (a plain call first) holds
    its rows as admitted: the rule that needs the function (an index computed from the
    score takes one stage) is not known then.  At the lookup after the trace, the
    refused multi-stage row is not served."""
    import subprocess
    import sys

    from flashgen import user_tune

    db_path = tmp_path / "scoreidx.sqlite"
    r = subprocess.run([sys.executable, "-c", _WRITE_SCORE_INDEX_ROWS, str(db_path)], capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 0, r.stderr[-2000:]
    key_id = r.stdout.strip().splitlines()[-1]
    h200 = Environment("NVIDIA H200", "9.0", 132, "3.6.0", "2.11.0", flashgen.__version__)
    d = Dispatcher([db_path], env=h200, arch=farch.by_sm("sm_90"))
    d.choose(Shape(8, 16, 16, 2048, 2048).key(KernelSpec("fwd", "bfloat16", 128, 128, "causal")))  # loads it
    t = torch.zeros(8, 16)

    def sm(s, b, h, q, kv):
        return s + t[(s.abs() * 2).long() % 8, h]

    shape = Shape(batch=8, num_heads=16, num_kv_heads=16, seqlen_q=2048, seqlen_k=2048)
    key = shape.key(user_tune.UserProblem(sm, None, None, True, (-1, -1), 128, 128, "bfloat16", shape,
                                          "scoreidx").spec("fwd"))
    assert key.id == key_id
    refused = Variant(key.spec, TileConfig(128, 64, 8, 2))
    assert families.get("triton").violated_rules(refused)
    c = d.choose(key)
    assert c.config.num_stages == 1, c


def test_a_gluon_backward_row_whose_group_split_does_not_divide_the_group_is_not_loaded(tmp_path):
    """The Gluon backward's GQA group split must divide the key's group, a rule of the
    key's sizes (``key_reasons``) that the spec-only rules cannot see: an edited or
    imported row breaking it is left out, the next fastest row of its key serves."""
    import sqlite_utils

    from flashgen.arch import by_sm
    from flashgen.db import rules_admit

    h200 = Environment("NVIDIA H200", "9.0", 132, "3.6.0", "2.11.0", flashgen.__version__)
    sm90, gluon = by_sm("sm_90"), families.get("gluon")
    shape = Shape(4, 16, 4, 4096, 4096)  # GQA group 4
    key = shape.key(KernelSpec("bwd", "bfloat16", 128, 128, "causal"))
    base = gluon.default_config(key, sm90)
    split2, split3 = (dataclasses.replace(base, group_split=g, kv_store=0) for g in (2, 3))
    assert not gluon.violated_rules(Variant(key.spec, split3)) and gluon.key_reasons(key, split3)
    assert gluon.key_reasons(key, split2) == []
    db_path = tmp_path / "gqa.sqlite"
    with TuningDB(db_path) as db:
        for cfg, ms in ((split3, 1.0), (split2, 2.0)):
            db.record(key, shape, Variant(key.spec, cfg), Measurement("ok", median_ms=ms), h200, 0)
    rows = {r["group_split"]: r for r in sqlite_utils.Database(db_path)["measurements"].rows}
    assert not rules_admit(rows[3]) and rules_admit(rows[2])
    choice = Dispatcher([db_path], env=h200, arch=sm90).choose(key)
    assert choice.source == "tuned" and choice.config.group_split == 2, choice

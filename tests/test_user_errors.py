"""What a new user ran into (a CPU trial of the README): each now gets the right result
or a clear error naming the argument."""

import json
import warnings

import pytest
import torch
from typer.testing import CliRunner

import flashgen
from flashgen import InputError, UnsupportedError, dispatch, reference
from flashgen.arch import TABLE
from flashgen.cli import app
from flashgen.db import TuningDB
from flashgen.dispatch import Dispatcher
from flashgen.env import Environment
from flashgen.spec import KernelSpec, ProblemKey

pytestmark = pytest.mark.usefixtures("hermetic_dispatcher")


def test_bfloat16_in_the_interpreter_takes_the_reference_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 16, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    o = flashgen.attention(q, k, v)
    o.float().sum().backward()
    ro, _, _ = reference.forward(q, k, v)
    assert (o.double() - ro).abs().max() < 2e-2  # the interpreter's bf16 dot gave ~1e8
    rq, _, _ = reference.backward(torch.ones_like(o), q, k, v)
    assert (q.grad.double() - rq).abs().max() < 5e-2


@pytest.mark.parametrize("kw, needle", [
    (dict(softmax_scale=float("nan")), "softmax_scale must be finite"),
    (dict(softmax_scale=float("inf")), "softmax_scale must be finite"),
    (dict(softmax_scale=True), "softmax_scale must be a real number"),
    (dict(window="12"), "window must be a pair of ints"),
    (dict(window=(1.7, 0.2)), "window must be a pair of ints"),
    (dict(window=(True, 0)), "window must be a pair of ints"),
    (dict(window=(float("inf"), 0)), "window must be a pair of ints"),
    (dict(causal="no"), "causal must be a bool"),
])
def test_loose_arguments_are_refused(kw, needle):
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(InputError, match=needle):
        flashgen.attention(q, q, q, **kw)
    import numpy as np

    o = flashgen.attention(q, q, q, softmax_scale=np.float32(0.5))  # any real number works
    assert torch.isfinite(o).all()


def test_a_numpy_bool_is_refused_under_its_own_name():
    """NumPy's bool calls itself "bool": the message names numpy.bool, not "got bool"."""
    import numpy as np

    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(InputError, match=r"causal must be a bool, got numpy\.bool"):
        flashgen.attention(q, q, q, causal=np.bool_(True))


@pytest.mark.parametrize("seed", [-1, 2**63, 2**64, 1.0, True])
def test_a_dropout_seed_outside_int64_is_refused(seed):
    """A seed past 2**63 - 1 would wrap onto a smaller one's dropout masks."""
    with pytest.raises(InputError, match=r"seed must be None or an int in \[0, 2\*\*63 - 1\]"):
        flashgen.manual_seed(seed)
    flashgen.manual_seed(2**63 - 1)
    flashgen.manual_seed(0)


def test_a_bad_flashgen_db_is_named(tmp_path, monkeypatch):
    bad = tmp_path / "notadb.sqlite"
    bad.write_text("hello")
    monkeypatch.setenv("FLASHGEN_DB", str(bad))
    disp = Dispatcher(env=Environment.current(), arch=TABLE["sm_90"])
    key = ProblemKey(KernelSpec("fwd", "float16", 64, 64, "none"), 1, 64, 64, 2)
    with pytest.raises(InputError, match="FLASHGEN_DB .*notadb.sqlite.*left untouched"):
        disp.choose(key)
    assert bad.read_text() == "hello"
    monkeypatch.setenv("FLASHGEN_DB", str(tmp_path / "typo.sqlite"))
    disp = Dispatcher(env=Environment.current(), arch=TABLE["sm_90"])
    with pytest.warns(UserWarning, match="FLASHGEN_DB=.*typo.sqlite does not exist"):
        assert disp.choose(key).source == "default"
    # a directory: named, not a raw FileNotFoundError from SQLite's read-only open
    monkeypatch.setenv("FLASHGEN_DB", str(tmp_path))
    disp = Dispatcher(env=Environment.current(), arch=TABLE["sm_90"])
    with pytest.raises(InputError, match=f"FLASHGEN_DB {tmp_path} is not a file"):
        disp.choose(key)


def test_the_shipped_db_of_another_gpu_does_not_warn(monkeypatch):
    monkeypatch.delenv("FLASHGEN_DB", raising=False)
    assert dispatch.shipped_databases(), "tuning_db/h200.sqlite should ship"
    disp = Dispatcher(env=Environment.current(), arch=TABLE["sm_90"])  # a CPU environment
    key = ProblemKey(KernelSpec("fwd", "float16", 64, 64, "none"), 1, 64, 64, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert disp.choose(key).source == "default"


def test_no_config_fits_is_a_clear_error():
    disp = Dispatcher([], env=Environment.current(), arch=TABLE["sm_86"])
    key = ProblemKey(KernelSpec("fwd", "float32", 256, 256, "none"), 1, 128, 256, 4)
    with pytest.raises(UnsupportedError, match="shared memory of .*head_dim 256/256 in float32"):
        disp.choose(key)
    res = CliRunner().invoke(app, ["explain", "--batch", "1", "--heads", "4", "--kv-heads", "4", "--seqlen-q",
                                   "128", "--seqlen-k", "256", "--head-dim", "256", "--dtype", "float32",
                                   "--arch", "sm_86"])
    assert res.exit_code == 2 and "no tile config" in res.output


def test_fake_timings_must_name_real_variants(tmp_path):
    t = tmp_path / "t.json"
    t.write_text("{}")
    res = CliRunner().invoke(app, ["tune", "--preset", "small", "--fake", str(t), "--db", str(tmp_path / "u.sqlite")],
                             env={"COLUMNS": "400"})
    assert res.exit_code == 2 and "lacks timings for" in res.output and "attn_fwd_d64_bf16" in res.output
    assert "--fake-template" in res.output
    assert not (tmp_path / "u.sqlite").exists()


def test_a_stale_journal_is_reported_not_silently_reused(tmp_path):
    t = tmp_path / "t.json"
    from flashgen import presets, space
    from flashgen.spec import Variant

    items = presets.expand(["small"], "bfloat16", ["fwd"])
    t.write_text(json.dumps({Variant(k.spec, c).id: 1.0 + i * 0.01 for k, _ in items
                             for i, c in enumerate(space.configs("fwd"))}))
    db = tmp_path / "j.sqlite"
    args = ["tune", "--preset", "small", "--kernels", "fwd", "--fake", str(t), "--db", str(db), "--trials", "3"]
    assert CliRunner().invoke(app, args).exit_code == 0
    db.unlink()
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2 and "are not there (was the DB replaced?)" in res.output and "optuna.journal" in res.output


def test_show_defaults_to_the_shipped_db(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no flashgen_tuning.sqlite here
    res = CliRunner().invoke(app, ["show"])
    assert res.exit_code == 0 and "h200.sqlite" in res.output and "attn_fwd_d128_bf16" in res.output
    assert "h100.sqlite" in res.output and "attn_decode_d128_bf16" in res.output  # each shipped database


# -- a second new-user review ----------------------------------------------------------

@pytest.mark.parametrize("interpret", ["0", "1"])
def test_strided_cu_seqlens_give_the_contiguous_result(interpret, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, h, 40, generator=g).half() for n, h in ((23, 4), (32, 2), (32, 2)))
    cq = torch.tensor([0, 5, 5, 22, 23], dtype=torch.int32)
    ck = torch.tensor([0, 9, 12, 12, 32], dtype=torch.int32)
    strided = [torch.stack([c, torch.full_like(c, 999)], 1)[:, 0] for c in (cq, ck)]
    assert strided[0].stride() == (2,)
    o1 = flashgen.attention_varlen(q, k, v, cq, ck, 17, 20)
    o2 = flashgen.attention_varlen(q, k, v, *strided, 17, 20)
    assert torch.equal(o1, o2)


@pytest.mark.parametrize("scale", [1e-46, 1e-300, 5e-324, -1e-31, 1e31, -1e38])
def test_a_scale_float32_cannot_hold_is_refused(scale):
    q = torch.randn(1, 2, 9, 16)
    for _ in range(2):  # the checked path, then the fast path of a cached shape
        flashgen.attention(q, q, q, softmax_scale=0.5)
        with pytest.raises(InputError, match="softmax_scale must be 0 or have a magnitude"):
            flashgen.attention(q, q, q, softmax_scale=scale)
    cu = torch.tensor([0, 9], dtype=torch.int32)
    with pytest.raises(InputError, match="softmax_scale"):
        flashgen.attention_varlen(q[0].transpose(0, 1), q[0].transpose(0, 1), q[0].transpose(0, 1), cu, cu, 9, 9,
                                  softmax_scale=scale)


@pytest.mark.parametrize("kw", [dict(causal=1), dict(window=(1.0, 0)), dict(window=(True, False)),
                                dict(return_lse="no"), dict(return_lse=1)])
def test_the_fast_path_checks_argument_types_like_a_first_call(kw):
    q = torch.randn(1, 2, 9, 16)
    valid = {"causal": True, "window": (1, 0), "return_lse": True}
    name = next(iter(kw))
    flashgen.attention(q, q, q, **{name: valid[name]})  # cache the shape
    with pytest.raises(InputError, match=name):
        flashgen.attention(q, q, q, **kw)


def test_return_lse_of_varlen_must_be_a_bool():
    x = torch.randn(9, 2, 16)
    cu = torch.tensor([0, 9], dtype=torch.int32)
    with pytest.raises(InputError, match="return_lse must be a bool"):
        flashgen.attention_varlen(x, x, x, cu, cu, 9, 9, return_lse="no")


def test_an_empty_sqlite_file_reads_as_an_empty_db_and_stays_untouched(tmp_path, monkeypatch):
    import sqlite3

    empty, tableless = tmp_path / "empty.sqlite", tmp_path / "tableless.sqlite"
    empty.write_bytes(b"")
    con = sqlite3.connect(tableless)
    con.execute("PRAGMA user_version = 7")
    con.commit()
    con.close()
    before = {p: p.read_bytes() for p in (empty, tableless)}
    runner = CliRunner()
    for p in (empty, tableless):
        r = runner.invoke(app, ["show", "--db", str(p)])
        assert r.exit_code == 0, r.output
        r = runner.invoke(app, ["explain", "--batch", "1", "--heads", "2", "--kv-heads", "2", "--seqlen-q", "8",
                                "--seqlen-k", "8", "--head-dim", "16", "--db", str(p)])
        assert r.exit_code == 0 and "default" in r.output, r.output
        monkeypatch.setenv("FLASHGEN_DB", str(p))
        dispatch.set_default_dispatcher(None)
        q = torch.randn(1, 2, 8, 16)
        assert flashgen.attention(q, q, q).shape == q.shape
    assert {p: p.read_bytes() for p in (empty, tableless)} == before


def test_fake_timings_must_be_positive_and_finite(tmp_path):
    bad = tmp_path / "bad.json"
    for value in ("NaN", "-5.0", "0.0", "1e-300", "\"0.5\"", "true"):  # numbers only; 1e-300: TFLOP/s overflows
        bad.write_text('{"attn_fwd_d64_fp16_none_m64_n64_w4_s2": ' + value + "}")
        r = CliRunner().invoke(app, ["tune", "--preset", "small", "--fake", str(bad), "--db",
                                     str(tmp_path / "t.sqlite"), "--trials", "2"])
        assert r.exit_code != 0 and "finite milliseconds >= 1e-06 (1 ns)" in r.output, r.output
    assert not (tmp_path / "t.sqlite").exists()


def test_import_of_broken_json_names_the_file(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text('{"a":')
    r = CliRunner().invoke(app, ["import", str(broken), "--db", str(tmp_path / "x.sqlite")])
    assert r.exit_code != 0 and "broken.json is not a flashgen export" in r.output


@pytest.mark.parametrize("args, needle", [
    (["--head-dim", "12"], "--head-dim"),
    (["--head-dim", "64", "--head-dim-v", "300"], "--head-dim-v"),
    (["--head-dim", "64", "--heads", "3", "--kv-heads", "2"], "--kv-heads"),
])
def test_explain_cli_errors_name_the_flag(args, needle):
    base = {"--batch": "1", "--heads": "4", "--kv-heads": "2", "--seqlen-q": "8", "--seqlen-k": "8"}
    for i in range(0, len(args), 2):
        base[args[i]] = args[i + 1]
    r = CliRunner().invoke(app, ["explain", *[x for kv in base.items() for x in kv]])
    assert r.exit_code != 0 and needle in r.output, r.output


@pytest.mark.parametrize("interpret", ["1", "0"])
def test_a_captured_tensor_on_another_device_is_named_on_both_paths(interpret, monkeypatch):
    """A score_mod / mask_mod reading a tensor that is not on q's device is an InputError
    naming the function and both devices, on the kernel path and on the reference path
    (CPU without the interpreter) alike."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    q, k, v = (torch.randn(1, 2, 6, 16) for _ in range(3))
    table = torch.zeros(8, device="meta")
    doc = torch.zeros(6, dtype=torch.long, device="meta")
    with pytest.raises(InputError, match="score_mod reads a captured tensor on meta; q is on cpu"):
        flashgen.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + table[ki])
    with pytest.raises(InputError, match="mask_mod reads a captured tensor on meta; q is on cpu"):
        flashgen.attention(q, k, v, mask_mod=lambda b, h, qi, ki: doc[qi] == doc[ki])


@pytest.mark.parametrize("mask_mod, kind", [(lambda b, h, i, j: i - j, "an int"),
                                            (lambda b, h, i, j: (i - j).float(), "a float")])
def test_a_mask_mod_must_return_bool(mask_mod, kind):
    """An int result was taken as "nonzero attends"; the docs and the float case say a
    mask_mod returns a bool tensor."""
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(UnsupportedError, match=f"returns {kind} value: it must return a bool tensor"):
        flashgen.attention(q, q, q, mask_mod=mask_mod)


@pytest.mark.parametrize("command", [["tune", "--preset", "small", "--fake-model", "--arch", "sm_90", "--trials", "1"],
                                     ["import", "SOURCE"]])
def test_a_database_named_like_an_export_is_refused(tmp_path, command):
    """``--db out.json`` made a SQLite file that import and merge then read as an export
    (not UTF-8 text) by its name: tune and import refuse the name, and write nothing."""
    src = tmp_path / "src.sqlite"
    with TuningDB(src):
        pass
    args = [str(src) if a == "SOURCE" else a for a in command]
    r = CliRunner().invoke(app, [*args, "--db", str(tmp_path / "out.json")])
    assert r.exit_code == 2 and "a tuning database is SQLite; *.json names an export" in r.output, r.output
    assert not (tmp_path / "out.json").exists()

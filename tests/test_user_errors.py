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
    assert res.exit_code == 2 and "no timing for any variant" in res.output and "attn_fwd_d64_bf16" in res.output
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
    assert res.exit_code == 2 and "none of their measurements" in res.output and "optuna.journal" in res.output


def test_show_defaults_to_the_shipped_db(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no flashgen_tuning.sqlite here
    res = CliRunner().invoke(app, ["show"])
    assert res.exit_code == 0 and "h200.sqlite" in res.output and "attn_fwd_d128_bf16" in res.output

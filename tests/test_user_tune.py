"""Tuning user score/mask functions and sinks (flashgen.user_tune): the user presets'
keys, the benchmarker's float64 check and timing in the interpreter, the CLI with the
model benchmarker, and rows found by the dispatcher of another process that calls the
same functions."""

import dataclasses
import os
import sqlite3
import subprocess
import sys
import time

import pytest
import torch
from typer.testing import CliRunner

import flashgen
from flashgen import arch, families, heuristics, presets, tuner, user_examples, user_tune
from flashgen.cli import app
from flashgen.families.gluon import bwd as gluon_bwd_mod, family as gluon_family
from flashgen.env import Environment
from flashgen.spec import KernelSpec, Shape, Variant, is_user_mods

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
pytestmark = pytest.mark.usefixtures("hermetic_dispatcher")


def _wall_ms(fn):
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def test_the_user_presets_give_each_example_its_own_keys():
    problems = user_tune.preset_problems(["user-examples"], "bfloat16", "cpu")
    assert [p.label for p in problems] == list(user_examples.NAMES)
    keys = [k for k, _ in user_tune.items(problems)]
    # fwd for every example; bwd_dq and bwd_dkdv for those with a function (sinks alone: plain
    # backward); the whole backward (bwd) for those too (no captured tensor is read at an
    # index computed from the score)
    by = {p.label: p for p in problems}
    whole = {n for n, p in by.items() if p.bwd_mods is not None}
    assert whole == {"document", "document-causal", "prefix-lm", "window-causal", "alibi", "softcap", "relpos"}
    assert len(keys) == 3 * (len(problems) - 1) + 1 + len(whole)
    assert sorted(k.spec.mods for k in keys if k.spec.kernel == "bwd") == sorted(by[n].bwd_mods for n in whole)
    assert all(is_user_mods(k.spec.mods) for k in keys) and len({k.id for k in keys}) == len(keys)
    assert by["document-causal"].mask == "causal" and by["document"].mask == "none"
    assert by["sinks"].mask == "window" and by["sinks"].bwd_mods is None
    assert by["relpos"].bwd_mods != by["relpos"].fwd_mods  # the backward accumulates the table's gradient
    with pytest.raises(KeyError, match="user functions"):
        presets.expand(["user-small"])


def test_each_variant_is_checked_with_its_own_example_where_two_share_a_function():
    """document and document-causal compile the same mask function (one hash) under two
    masks: each key's variant goes to the example of its mask, whose check runs at that
    mask (a causal variant checked as the non-causal example is refused)."""
    problems = user_tune.preset_problems(["user-examples"], "bfloat16", "cpu")
    b = user_tune.UserBenchmarker(problems)
    by = {p.label: p for p in problems}
    assert by["document"].fwd_mods == by["document-causal"].fwd_mods
    gluon_bwd = gluon_family.tile_config(gluon_bwd_mod.default_config(128, "bfloat16", "window"))
    for p in problems:
        for key, _ in p.keys():
            # (the whole backward has no default on this CPU: the Gluon family's config)
            cfg = gluon_bwd if key.spec.kernel == "bwd" else heuristics.default_config(key.spec, arch.current())
            assert b.problem_of(Variant(key.spec, cfg)) is p


@pytest.mark.parametrize("dtype", ["float16"])
def test_the_benchmarker_checks_each_kernel_against_float64_then_times_it(dtype):
    problems = user_tune.preset_problems(["user-small"], dtype, "cpu")
    b = user_tune.UserBenchmarker(problems, timer=_wall_ms)
    a = arch.current()
    for key, shape in tuner.servable(user_tune.items(problems), a):  # (no whole backward here)
        v = Variant(key.spec, heuristics.default_config(key.spec, a))
        m = b(v, shape)
        assert m.status == "ok" and m.median_ms > 0, (v.id, m)
    ratios = b.check_ratios()
    assert len(ratios) == 7 and max(ratios.values()) <= 1.0, ratios


def test_a_wrong_captured_gradient_is_a_wrong_result_row(monkeypatch):
    """The check covers the gradients of the captured tensors (bwd_dq's atomics)."""
    (problem,) = [p for p in user_tune.preset_problems(["user-small"], "float16", "cpu") if p.label == "relpos"]
    real = families.launcher

    def launcher(family, name):
        fn = real(family, name)
        if name != "bwd_dq":
            return fn

        def off(*a, mods=None, **kw):
            out = fn(*a, mods=mods, **kw)
            mods.grads[0].add_(0.5)  # a table gradient that is off
            return out
        return off
    monkeypatch.setattr(families, "launcher", launcher)
    b = user_tune.UserBenchmarker([problem], timer=_wall_ms)
    key, shape = [(k, s) for k, s in problem.keys() if k.spec.kernel == "bwd_dq"][0]
    m = b(Variant(key.spec, heuristics.default_config(key.spec, arch.current())), shape)
    assert m.status == "wrong_result" and " d0 err" in m.error, m


@pytest.mark.parametrize("off", [None, "dK"])
def test_the_whole_backward_of_a_mask_function_is_checked_on_dq_dk_and_dv(monkeypatch, off):
    """A ``bwd`` variant (a family's whole backward: here of a mask function) is checked on
    dQ, dK and dV against float64, with the backward's user arguments passed to its
    launcher.  Here the "whole backward" is the Triton family's two kernels run by one
    launcher (no family compiles it on this CPU); one with dK off is a wrong_result row."""
    (problem,) = [p for p in user_tune.preset_problems(["user-small"], "float16", "cpu")
                  if p.label == "document-causal"]
    real = families.launcher
    seen = []

    def whole(do, q, k, v, o, lse, *, config, dq, dk, dv, mods, **kw):
        seen.append(mods.name)
        c = heuristics.default_config
        a = arch.current()
        spec = problem.spec("bwd_dq")
        _, delta = real("triton", "bwd_dq")(do, q, k, v, o, lse, config=c(spec, a), dq=dq, mods=mods, **kw)
        real("triton", "bwd_dkdv")(do, q, k, v, lse, delta, config=c(problem.spec("bwd_dkdv"), a), dk=dk, dv=dv,
                                   mods=mods, **kw)
        if off:
            dk.add_(0.05)
        return dq, dk, dv

    monkeypatch.setattr(families, "launcher", lambda family, name: whole if name == "bwd" else real(family, name))
    b = user_tune.UserBenchmarker([problem], timer=_wall_ms)
    (key, shape), = problem.keys(["bwd"])
    m = b(Variant(key.spec, gluon_family.tile_config(gluon_bwd_mod.default_config(64, "float16", "window"))), shape)
    assert seen and set(seen) == {problem.bwd_mods}
    if off:
        assert m.status == "wrong_result" and "dK err" in m.error, m
    else:
        ratios = b.check_ratios()
        assert m.status == "ok" and len(ratios) == 1 and max(ratios.values()) <= 1.0, (m, ratios)


def test_tune_mods_names_the_family_reason_when_none_serves_the_whole_backward(tmp_path):
    """kernels=("bwd",) for a mask function alone, or a score function, on this CPU: the
    key exists, no family serves it here, and the error says so (not that there is no
    such variant); a captured tensor read at an index computed from the score has no whole
    backward."""
    q = torch.randn(1, 2, 32, 16, dtype=torch.float16)
    for fns in (dict(mask_mod=lambda b, h, qi, ki: ki <= qi), dict(score_mod=lambda s, b, h, qi, ki: s * 2)):
        with pytest.raises(flashgen.InputError, match="no kernel family serves attn_bwd_.*gluon: its kernels do not"):
            flashgen.tune_mods(q, q, q, db=tmp_path / "x.sqlite", kernels=("bwd",), benchmarker=lambda v, s: None,
                               **fns)
    bias = torch.zeros(8)
    with pytest.raises(flashgen.InputError, match="no user variant among kernels"):
        flashgen.tune_mods(q, q, q, score_mod=lambda s, b, h, qi, ki: s + bias[(s.abs() * 2).long() % 8],
                           db=tmp_path / "x.sqlite", kernels=("bwd",), benchmarker=lambda v, s: None)


def test_tune_mods_refuses_what_attention_refuses(tmp_path):
    """tune_mods takes its sizes and dtype from q, k and v: inputs flashgen.attention
    refuses (mismatched dtypes, head dims, batches, seqlens, sinks of another length)
    are refused before anything is measured or written."""
    q = torch.randn(1, 2, 32, 16, dtype=torch.float16)
    sm = lambda s, b, h, qi, ki: s + (qi - ki) * 0.01  # noqa: E731
    bad = [(dict(k=q.float()), "k.dtype"), (dict(k=torch.randn(1, 2, 32, 32, dtype=torch.float16)), "head_dim"),
           (dict(k=torch.randn(3, 2, 32, 16, dtype=torch.float16)), "batch sizes differ"),
           (dict(v=torch.randn(1, 2, 40, 16, dtype=torch.float16)), "same seqlen_k"),
           (dict(sinks=torch.zeros(7)), "sinks must be a float32 tensor of shape"),
           (dict(causal="yes"), "causal"), (dict(window=5), "window")]
    for kw, msg in bad:
        args = {"k": q, "v": q, **kw}
        with pytest.raises(flashgen.InputError, match=msg):
            flashgen.tune_mods(q, args.pop("k"), args.pop("v"), score_mod=sm, db=tmp_path / "x.sqlite",
                               benchmarker=lambda v, s: None, trials=1, **args)
    assert not (tmp_path / "x.sqlite").exists()
    # and options of its own: db not a path or a directory, kernels a string or unknown,
    # the seed, env, benchmarker; no function at all; an index outside its table (the
    # kernels read before it: tune_mods recorded rows); a table off q's device; a file
    # of the user's where the journal goes (it was appended to)
    x = tmp_path / "x.sqlite"
    table = torch.randn(64, 2)
    for kw, msg in [(dict(db=None), "db must be the path of a tuning database"),
                    (dict(db=tmp_path), "is not a file"),
                    (dict(db=x, kernels="fwd"), "kernels must be a sequence"),
                    (dict(db=x, kernels=3), "kernels must be a sequence"),
                    (dict(db=x, kernels=("fwd", "bwd_dqq")), "unknown kernel 'bwd_dqq'"),
                    (dict(db=x, seed=-1), "seed must be an int"), (dict(db=x, seed="x"), "seed must be an int"),
                    (dict(db=x, env="H100"), "env must be"), (dict(db=x, benchmarker="fast"), "benchmarker must be"),
                    (dict(db=x, score_mod=None), "needs a score_mod, a mask_mod or sinks"),
                    (dict(db=x, score_mod=lambda s, b, h, qi, ki: s + table[ki - qi, h]), r"indices -31\.\.31"),
                    (dict(db=x, score_mod=lambda s, b, h, qi, ki: s + table.to("meta")[ki, h]), "on meta")]:
        with pytest.raises(flashgen.InputError, match=msg):
            flashgen.tune_mods(q, q, q, **{"score_mod": sm, "benchmarker": lambda v, s: None, "trials": 1, **kw})
    assert list(tmp_path.iterdir()) == []
    journal = tmp_path / "x.sqlite.optuna.journal"
    journal.write_text("my own notes\n")
    with pytest.raises(flashgen.InputError, match="is not an Optuna journal"):
        flashgen.tune_mods(q, q, q, score_mod=sm, benchmarker=lambda v, s: None, trials=1, db=x)
    assert sorted(p.name for p in tmp_path.iterdir()) == [journal.name] and journal.read_text() == "my own notes\n"


def _model_env():
    env = Environment.current()
    return dataclasses.replace(env, gpu_name=f"{env.gpu_name} (model)")


_OTHER_PROCESS = '''
import dataclasses, torch
import flashgen
from flashgen import arch, dispatch, user_examples
from flashgen.env import Environment
from flashgen.spec import is_user_mods
env = Environment.current()
env = dataclasses.replace(env, gpu_name=env.gpu_name + " (model)")
dispatch.set_default_dispatcher(dispatch.Dispatcher([DB], env=env, arch=arch.current()))
ex = user_examples.make("relpos", 2, 64)
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 2, 64, 16, generator=g).half().requires_grad_() for _ in range(3))
o = flashgen.attention(q, k, v, causal=ex.causal, window=ex.window, **dict(zip(("score_mod", "mask_mod"),
                       ex.functions(*ex.tensors))))
o.float().sum().backward()
assert ex.tensors[0].grad is not None
for key, choice in dispatch.default_dispatcher()._cache.items():
    if is_user_mods(key.spec.mods):
        print("CHOICE", key.id, choice.source, choice.config.BLOCK_M, choice.config.BLOCK_N)
'''


def test_cli_tunes_the_user_presets_and_another_process_finds_the_rows(tmp_path):
    """`flashgen tune --preset user-small --fake-model`: rows keyed by the user variants;
    a fresh process that calls flashgen.attention with the same example functions
    traces them to the same names and its dispatcher takes the tuned rows."""
    db = tmp_path / "u.sqlite"
    r = CliRunner(env={"COLUMNS": "250"}).invoke(app, ["tune", "--preset", "user-small", "--fake-model", "--db",
                                                       str(db), "--trials", "3", "--dtype", "float16"])
    assert r.exit_code == 0, r.output
    keys = {k for (k,) in sqlite3.connect(db).execute("SELECT DISTINCT key FROM measurements")}
    problems = user_tune.preset_problems(["user-small"], "float16", "cpu")
    # (the whole backward of each example: no family compiles it on this CPU)
    assert keys == {k.id for k, _ in tuner.servable(user_tune.items(problems), arch.current())}
    whole = [k for k, _ in user_tune.items(problems) if k.spec.kernel == "bwd"]
    assert len(whole) == 2 and len(keys) == len(user_tune.items(problems)) - len(whole)
    env = {**os.environ, "PYTHONPATH": ROOT, "TRITON_INTERPRET": "1"}
    p = subprocess.run([sys.executable, "-c", f"DB = {str(db)!r}\n" + _OTHER_PROCESS], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    chosen = {line.split()[1]: line.split()[2] for line in p.stdout.splitlines() if line.startswith("CHOICE")}
    relpos = {k.id for k, _ in problems[0].keys() if k.spec.kernel != "bwd"}  # (not compiled on this CPU)
    assert set(chosen) == relpos and set(chosen.values()) == {"tuned"}, p.stdout


def test_user_presets_are_tuned_in_one_process(tmp_path):
    r = CliRunner().invoke(app, ["tune", "--preset", "user-small", "--fake-model", "--db", str(tmp_path / "x.sqlite"),
                                 "--workers", "2"])
    assert r.exit_code == 2 and "--workers" in r.output, r.output


def test_tune_mods_records_rows_the_dispatcher_then_uses(tmp_path):
    """flashgen.tune_mods on a user's own functions (the model benchmarker in place of a
    GPU): rows for fwd, bwd_dq and bwd_dkdv of their variants; this process's dispatcher
    reads the database at once."""
    from flashgen import dispatch

    table = torch.randn(8, 2, requires_grad=True)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + table[torch.clamp(kv_idx - q_idx, 0, 7), h]

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx) < 40
    q, k, v = (torch.randn(1, 2, 50, 16, dtype=torch.float16) for _ in range(3))
    env = _model_env()
    results = flashgen.tune_mods(q, k, v, score_mod=score_mod, mask_mod=mask_mod, causal=True, db=tmp_path / "t.sqlite",
                                 trials=2, benchmarker=tuner.ModelBenchmarker(arch.current()), env=env)
    assert [r.key.spec.kernel for r in results] == ["fwd", "bwd_dq", "bwd_dkdv"]
    assert all(r.best_config is not None and is_user_mods(r.key.spec.mods) for r in results)
    d = dispatch.default_dispatcher()
    d._env = env
    for r in results:
        assert d.choose(r.key).source == "tuned"
    with pytest.raises(flashgen.InputError, match="CUDA"):
        flashgen.tune_mods(q, k, v, score_mod=score_mod, db=tmp_path / "u.sqlite")
    # a database in a directory that does not exist: refused, the directory not created;
    # trials below 1 refused (as the CLI's --trials), before anything is written
    bench = tuner.ModelBenchmarker(arch.current())
    missing = tmp_path / "no" / "dir" / "t.sqlite"
    with pytest.raises(flashgen.InputError, match=r"db .*directory .*does not exist"):
        flashgen.tune_mods(q, k, v, score_mod=score_mod, db=missing, trials=1, benchmarker=bench, env=env)
    assert not (tmp_path / "no").exists()
    for trials in (0, -1, 1.5, True):
        with pytest.raises(flashgen.InputError, match="trials must be an int >= 1"):
            flashgen.tune_mods(q, k, v, score_mod=score_mod, db=tmp_path / "w.sqlite", trials=trials,
                               benchmarker=bench, env=env)
    assert not (tmp_path / "w.sqlite").exists()


def test_a_problem_wide_at_its_size_is_checked_and_timed_in_its_widened_form():
    """At 512 x 512 q * k * 10**4 leaves int32, at the check's smaller sizes it does not:
    the check runs the problem's widened lowering too (it named the narrow one and
    every variant was recorded as compile_failed)."""
    from flashgen import user_mods
    from flashgen.spec import Shape, TileConfig, Variant

    sm = lambda s, b, h, q, k: s + ((q * k * 10_000) % 7).float()  # noqa: E731
    p = user_tune.UserProblem(sm, None, None, False, (-1, -1), 16, 16, "float32", Shape(1, 1, 1, 512, 512))
    assert p.wide and not user_mods.wide(p.score, None, 1, 1, 397, 397)
    var = Variant(p.spec("fwd"), TileConfig(16, 16, 4, 1))
    m = user_tune.UserBenchmarker([p], timer=lambda fn: 1.0)(var, p.shape)
    assert m.status == "ok", m


def test_a_walks_check_runs_several_tiles_per_program():
    """At the default check sizes (batch <= 2, seqlen <= 397) every program of a Gluon
    forward walk takes one tile (224 tiles of 64 rows for 264 programs at 16 heads), so
    its later tiles' reads never ran; a walk is checked at the problem's batch and a
    seqlen giving it at least three tiles per program."""
    from flashgen import user_examples
    from flashgen.families.gluon import config as C, family as F

    ex = user_examples.make("document-causal", 16, 2048)
    sm, mm = ex.functions(*ex.tensors)
    shape = Shape(batch=8, num_heads=16, num_kv_heads=16, seqlen_q=2048, seqlen_k=2048)
    p = user_tune.UserProblem(sm, mm, ex.sinks, ex.causal, ex.window, 128, 128, "bfloat16", shape, label="doc")
    spec = KernelSpec("fwd", "bfloat16", 128, 128, p.mask, p.fwd_mods)
    for persistent, ctas, consumers in ((0, 2, 1), (2, 2, 1), (3, 2, 1), (2, 1, 2)):
        cfg = F.tile_config(C.GluonFwdConfig(num_consumers=consumers, BLOCK_N=64, num_stages=2,
                                             persistent=persistent, ctas_per_sm=ctas))
        batch, cap = user_tune.check_sizes(p, Variant(spec, cfg), sm_count=132)
        seqlen = user_tune._awkward(2048, cap)
        rows = 64 * consumers
        tiles = batch * 16 * -(-seqlen // rows)
        if persistent:
            assert tiles >= 3 * 132 * ctas and seqlen <= 2048 and batch <= 8, (persistent, ctas, batch, seqlen)
        else:
            assert (batch, cap) == (2, 397)

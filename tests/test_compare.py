"""flashgen bench's runner (flashgen.compare) and the peer implementations
(flashgen.peers) on CPU: small shapes, a fake timer in place of CUDA events."""

import json

import pytest
import torch
from typer.testing import CliRunner

from flashgen import bench, compare, iomodel, peers, reference
from flashgen.cli import app
from flashgen.compare import Case, parse_shape

runner = CliRunner(env={"COLUMNS": "250"})


class FakeTimer:
    """Runs each timed function once (so it must work) and reports a fixed time."""

    def __init__(self, ms=2.0):
        self.ms, self.calls = ms, 0

    def __call__(self, fn, warmup_ms, rep_ms):
        fn()
        self.calls += 1
        return self.ms


# ---------------------------------------------------------------------------------
# Shapes and FLOPs

def test_parse_shape():
    assert parse_shape("2,16,4,1024,2048,128") == Case(2, 16, 4, 1024, 2048, 128)
    assert parse_shape(" 1,8,8,512,512,64,causal ") == Case(1, 8, 8, 512, 512, 64, causal=True)
    c = parse_shape("1,8,2,300,400,64,window=128:0")
    assert c.window == (128, 0) and not c.causal and c.mask == "window=128:0"
    assert parse_shape("1,8,2,300,400,64,causal,window=128:-1").mask == "window=128:-1,causal"
    for bad, why in (("1,8,8,512,512", "expected"), ("1,8,8,512,512,x", "integers"),
                     ("1,6,4,512,512,64", "multiple"), ("1,8,8,512,512,64,diagonal", "unknown option"),
                     ("1,8,8,512,512,64,window=3", "window"), ("0,8,8,512,512,64", ">= 1"),
                     ("1,8,8,512,512,64,window=-5:0", "window")):
        with pytest.raises(ValueError, match=why):
            parse_shape(bad)


def test_case_flops():
    c = Case(2, 4, 4, 1024, 1024, 64)
    assert c.flops("fwd") == 4 * 2 * 4 * 1024 * 1024 * 64
    assert c.flops("bwd") == 2.5 * c.flops("fwd") and c.flops("fwdbwd") == 3.5 * c.flops("fwd")
    assert Case(2, 4, 4, 1024, 1024, 64, causal=True).flops() == c.flops() / 2
    w = Case(1, 2, 1, 300, 500, 32, window=(64, 16))
    rel = torch.arange(500)[None, :] - torch.arange(300)[:, None] - 200  # bottom-right: off = 200
    pairs = int(((rel >= -64) & (rel <= 16)).sum())
    assert w.flops() == 4 * 1 * 2 * 32 * pairs and pairs == iomodel.visible_pairs(300, 500, window=(64, 16))


def test_presets():
    grid = compare.cases_from_presets(["fa-grid"])
    assert len(grid) == 24 and {c.batch * c.seqlen_q for c in grid} == {16384}
    assert {c.num_heads * c.head_dim for c in grid} == {2048} and {c.causal for c in grid} == {False, True}
    llama = compare.cases_from_presets(["llama3-8b"])
    assert {(c.num_heads, c.num_kv_heads, c.head_dim, c.causal) for c in llama} == {(32, 8, 128, True)}
    with pytest.raises(KeyError, match="known"):
        compare.cases_from_presets(["nope"])


def test_memory_hungry_backends_are_skipped_by_estimate():
    # the FlashAttention grid at head_dim 64: batch x heads x N^2 = 16384 x 32 x N
    def gb(name, n):
        return peers.matrix_bytes(name, 16384 // n, 32, n, n, 2) / 1e9
    assert gb("naive", 16384) > 40 > gb("naive", 8192) and gb("sdpa-math", 8192) > 40 > gb("sdpa-math", 4096)
    assert peers.matrix_bytes("flashgen", 1, 32, 16384, 16384, 2) is None


# ---------------------------------------------------------------------------------
# The peers against the float64 reference (CPU, float64 inputs)

def _inputs(case, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(case.batch, case.num_heads, case.seqlen_q, case.head_dim, dtype=dtype, generator=g)
    k = torch.randn(case.batch, case.num_kv_heads, case.seqlen_k, case.head_dim, dtype=dtype, generator=g)
    v = torch.randn(case.batch, case.num_kv_heads, case.seqlen_k, case.head_dim, dtype=dtype, generator=g)
    do = torch.randn(q.shape, dtype=dtype, generator=g)
    return q, k, v, do


@pytest.mark.parametrize("case", [Case(2, 4, 2, 24, 40, 16, causal=True), Case(1, 2, 2, 33, 33, 8),
                                  Case(1, 3, 1, 24, 40, 8, window=(5, 3)),
                                  Case(1, 2, 1, 24, 40, 16, causal=True, window=(7, -1))])
@pytest.mark.parametrize("impl", ["naive", "stored-P", "sdpa-math"])
def test_peers_match_the_reference(case, impl):
    q, k, v, do = _inputs(case)
    kw = dict(causal=case.causal, window=case.window)
    if impl == "naive":
        fn = lambda q, k, v: peers.naive_attention(q, k, v, **kw)  # noqa: E731
    elif impl == "stored-P":
        fn = lambda q, k, v: peers.materialized_p_attention(q, k, v, **kw)  # noqa: E731
    else:
        fn = peers.sdpa("sdpa-math", q, k, **kw)
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    o = fn(qg, kg, vg)
    grads = torch.autograd.grad(o, (qg, kg, vg), do)
    r_o, _, _ = reference.forward(q, k, v, **kw)
    r_g = reference.backward(do, q, k, v, **kw)
    # every query row of these cases sees a key (the naive softmax would give NaN otherwise)
    vis = peers.visible(case.seqlen_q, case.seqlen_k, device="cpu", **kw)
    assert vis is None or vis.any(1).all()
    torch.testing.assert_close(o, r_o, rtol=1e-9, atol=1e-9)
    for got, ref in zip(grads, r_g):
        torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-9)


def test_stored_p_keeps_p_for_the_backward():
    case = Case(1, 2, 2, 32, 48, 8)
    q, k, v, _ = (t.requires_grad_(True) for t in _inputs(case, torch.float32))
    o = peers.materialized_p_attention(q, k, v)
    saved = [t.shape for t in o.grad_fn.saved_tensors]
    assert torch.Size([1, 2, 32, 48]) in saved


# ---------------------------------------------------------------------------------
# The runner

def test_run_on_cpu_with_a_fake_timer():
    case = Case(1, 2, 1, 40, 56, 16, causal=True)  # GQA, seqlen_q != seqlen_k, bottom-right causal
    timer = FakeTimer(2.0)
    seen = []
    names = ("flashgen", "flashgen-default", "flashgen-deterministic", "sdpa-cudnn", "flex", "naive", "sdpa-math")
    rows = compare.run([case], dtype=torch.float32, device="cpu", backends=names, timer=timer,
                       progress=lambda c, name, cell: seen.append(name))
    assert seen == list(names)
    (row,) = rows
    for name in ("flashgen", "flashgen-default", "flashgen-deterministic", "naive", "sdpa-math"):
        cell = row.cells[name]
        assert cell["error"] is None, (name, cell["error"])
        assert cell["fwd_ms"] == cell["bwd_ms"] == cell["fwdbwd_ms"] == 2.0
        assert cell["fwd_tflops"] == pytest.approx(case.flops("fwd") / 2.0 / 1e9)
        assert cell["fwdbwd_tflops"] == pytest.approx(3.5 * cell["fwd_tflops"])
        assert cell["peak_mem_bytes"] is None  # measured on CUDA only
        # two backward calls compared bitwise for the deterministic backend only
        assert cell["repeatable"] is (True if name == "flashgen-deterministic" else None)
    # cuDNN does not run on CPU: the reason is in the cell, and the run went on
    assert row.cells["sdpa-cudnn"]["fwd_ms"] is None and "no kernel" in row.cells["sdpa-cudnn"]["error"]
    assert row.cells["flex"]["error"].startswith("unsupported: ")
    assert timer.calls == 5 * 3
    # the deterministic backward's gradients are checked too
    assert set(row.check) == {"O", "dQ", "dK", "dV", "dQ deterministic", "dK deterministic", "dV deterministic"}
    assert max(row.check.values()) <= 1.0


def test_a_failing_stage_is_recorded_and_the_run_goes_on(monkeypatch):
    real = compare._backend_fn

    def fake(name, case, q, k):
        if name == "naive":  # forward works, backward cannot (no graph)
            return lambda q, k, v: peers.naive_attention(q.detach(), k.detach(), v.detach())
        return real(name, case, q, k)
    monkeypatch.setattr(compare, "_backend_fn", fake)
    rows = compare.run([Case(1, 2, 2, 16, 16, 8)], dtype=torch.float32, device="cpu",
                       backends=("naive", "sdpa-math"), timer=FakeTimer(), check=False)
    naive, math_ = rows[0].cells["naive"], rows[0].cells["sdpa-math"]
    assert naive["fwd_ms"] == 2.0 and naive["bwd_ms"] is None and naive["error"].startswith("bwd: RuntimeError")
    assert naive["fwd_tflops"] is not None and naive["bwd_tflops"] is None
    assert math_["error"] is None and math_["fwdbwd_ms"] == 2.0
    assert rows[0].check == {}


def _with_backward(grad_fn):
    """An identity op whose backward returns ``grad_fn(gradient)`` (a backward made wrong,
    unrepeatable or failing)."""
    class Op(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return grad_fn(g)
    return Op.apply


def _raise(g):
    raise RuntimeError("this backward cannot run")


def _unrepeatable_deterministic(monkeypatch):
    real = compare._backend_fn

    def fake(name, case, q, k):
        fn = real(name, case, q, k)
        if name == "flashgen-deterministic":
            return lambda q, k, v: fn(_with_backward(lambda g: g + 1e-6 * torch.rand_like(g))(q), k, v)
        return fn
    monkeypatch.setattr(compare, "_backend_fn", fake)


def test_an_unrepeatable_deterministic_backward_is_recorded(monkeypatch):
    _unrepeatable_deterministic(monkeypatch)
    rows = compare.run([Case(1, 2, 2, 16, 16, 8)], dtype=torch.float32, device="cpu",
                       backends=("flashgen", "flashgen-deterministic"), timer=FakeTimer(), check=False)
    cells = rows[0].cells
    assert cells["flashgen-deterministic"]["repeatable"] is False and cells["flashgen"]["repeatable"] is None
    assert cells["flashgen-deterministic"]["error"] is None and cells["flashgen-deterministic"]["bwd_ms"] == 2.0
    assert "repeatable" in compare.to_csv(rows).splitlines()[0].split(",")


def _bench_on_cpu(monkeypatch):
    """flashgen bench's command with compare.run on CPU and a fake timer."""
    from flashgen import cli

    real_run = compare.run
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "cpu (test)")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # asked once CUDA "is available"
    monkeypatch.setattr(cli, "_precompile_for", lambda *a: None)
    monkeypatch.setattr(compare, "run", lambda cases, **kw: real_run(cases, **{**kw, "device": "cpu",
                                                                              "dtype": torch.float32,
                                                                              "timer": FakeTimer()}))


def test_bench_exits_1_on_an_unrepeatable_deterministic_backward(tmp_path, monkeypatch):
    _bench_on_cpu(monkeypatch)
    args = ["bench", "--shape", "1,2,2,16,16,8", "--backends", "flashgen,flashgen-deterministic", "--no-plots",
            "--out", str(tmp_path / "o")]
    ok = runner.invoke(app, args)
    assert ok.exit_code == 0, ok.output
    assert "flashgen-deterministic: dQ, dK, dV bitwise equal in two backward calls at 1 of 1 shapes" in ok.output
    _unrepeatable_deterministic(monkeypatch)
    bad = runner.invoke(app, args)
    assert bad.exit_code == 1
    assert "at 0 of 1 shapes" in bad.output
    assert "error: flashgen-deterministic gave different gradients in two calls at 1 shape(s): 1x2/2x16 d8 none" \
        in bad.output
    assert json.loads((tmp_path / "o" / "bench.json").read_text())["rows"][0]["cells"][
        "flashgen-deterministic"]["repeatable"] is False  # the results are written before the exit


def test_bench_exits_1_on_a_failed_check(tmp_path, monkeypatch):
    _bench_on_cpu(monkeypatch)
    monkeypatch.setattr(compare, "check_slice", lambda *a: {"O": 0.5, "dQ": 3.0, "dK": 0.1, "dV": 0.1})
    r = runner.invoke(app, ["bench", "--shape", "1,2,2,16,16,8,causal", "--backends", "flashgen", "--no-plots",
                            "--out", str(tmp_path / "o")])
    assert r.exit_code == 1 and "error: failed its float64 check at 1 shape(s): 1x2/2x16 d8 causal" in r.output


def test_bench_exits_1_on_wrong_deterministic_gradients_or_a_failed_backend(tmp_path, monkeypatch):
    _bench_on_cpu(monkeypatch)
    real = compare.attention

    def wrong_when_deterministic(q, k, v, deterministic=None, **kw):
        o = real(q, k, v, deterministic=deterministic, **kw)
        return _with_backward(lambda g: 3 * g)(o) if deterministic else o
    monkeypatch.setattr(compare, "attention", wrong_when_deterministic)
    args = ["bench", "--shape", "1,2,2,16,16,8", "--backends", "flashgen,flashgen-deterministic", "--no-plots",
            "--out", str(tmp_path / "o")]
    r = runner.invoke(app, args)
    assert r.exit_code == 1 and "error: failed its float64 check at 1 shape(s)" in r.output, r.output
    check = json.loads((tmp_path / "o" / "bench.json").read_text())["rows"][0]["check"]
    assert check["dQ deterministic"] > 1 and check["dQ"] <= 1  # the default backward is right
    monkeypatch.setattr(compare, "attention", real)
    real_fn = compare._backend_fn

    def broken(name, case, q, k):
        if name == "flashgen-deterministic":
            return lambda q, k, v: real_fn("flashgen", case, q, k)(_with_backward(_raise)(q), k, v)
        return real_fn(name, case, q, k)
    monkeypatch.setattr(compare, "_backend_fn", broken)
    r = runner.invoke(app, args)
    assert r.exit_code == 1 and "error: a flashgen backend failed" in r.output, r.output


def test_skip_over_the_memory_limit_runs_nothing():
    timer = FakeTimer()
    rows = compare.run([Case(1, 2, 2, 64, 64, 8)], dtype=torch.float32, device="cpu", backends=("naive",),
                       timer=timer, check=False, max_matrix_gb=1e-6)
    err = rows[0].cells["naive"]["error"]
    assert err.startswith("skipped: needs ~") and "64x64" in err and timer.calls == 0


def test_unknown_backend_and_oom_description():
    with pytest.raises(KeyError, match="unknown backend"):
        compare.run([], backends=("cudnn",), device="cpu")
    e = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB\nmore")
    assert compare._describe(e) == "OOM: CUDA out of memory. Tried to allocate 64.00 GiB"


# ---------------------------------------------------------------------------------
# Output

def _rows():
    cases = [Case(2, 4, 4, 32, 32, 8), Case(1, 4, 4, 64, 64, 8), Case(1, 4, 2, 32, 32, 8, causal=True),
             Case(2, 4, 2, 32, 32, 8, causal=True)]
    return compare.run(cases, dtype=torch.float32, device="cpu", backends=("naive", "sdpa-math", "sdpa-cudnn"),
                       timer=FakeTimer(1.5), check=False)


def test_json_csv_and_plots(tmp_path):
    rows = _rows()
    data = json.loads(compare.to_json(rows, {"device": "cpu"}))
    assert data["meta"] == {"device": "cpu"} and len(data["rows"]) == 4
    assert data["rows"][0]["cells"]["naive"]["fwd_ms"] == 1.5
    lines = compare.to_csv(rows).splitlines()
    assert lines[0].split(",") == list(compare.CSV_COLUMNS)
    assert len(lines) == 1 + 4 * 3
    first = dict(zip(compare.CSV_COLUMNS, lines[1].split(",")))
    assert (first["batch"], first["seqlen_q"], first["mask"], first["backend"], first["fwd_ms"]) == \
        ("2", "32", "none", "naive", "1.5")
    groups = compare.plot_groups(rows)
    # MHA none: one group over seqlen (tokens constant); GQA causal, one seqlen, two batches: split
    assert set(groups) == {"d8 none h4/4 (64 tokens)", "d8 causal h4/2 batch 1", "d8 causal h4/2 batch 2"}
    paths = compare.plots(rows, tmp_path / "plots", title="cpu test")
    assert sorted(p.name for p in paths) == ["memory.png", "tflops_bwd.png", "tflops_fwd.png", "tflops_fwdbwd.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


# ---------------------------------------------------------------------------------
# The command line

def test_bench_refuses_without_cuda(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    r = runner.invoke(app, ["bench", "--shape", "1,2,2,64,64,64", "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "needs a CUDA GPU" in r.output
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("args, name", [
    (["--shape", "1,2,2,64,64"], "--shape"),
    (["--shape", "1,3,2,64,64,64"], "--shape"),
    (["--backends", "flashgen,cudnn"], "--backends"),
    (["--preset", "nope"], "--preset"),
])
def test_bench_bad_arguments_are_named(monkeypatch, args, name):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # argument errors come first
    r = runner.invoke(app, ["bench", *args])
    assert r.exit_code == 2 and name in r.output, r.output


@pytest.mark.parametrize("call_ms, repeats", [(10.0, bench.MIN_REPEATS), (0.05, int(25 / 0.055))])
def test_time_ms_repeats_a_long_call_at_least_min_repeats_times(monkeypatch, call_ms, repeats):
    """time_ms sizes do_bench's milliseconds from one timed call, so a call as long as the
    grid's longest backwards (10 ms, where rep_ms 25 used to give two repetitions) is
    warmed up MIN_WARMUP_CALLS times and timed MIN_REPEATS times; a short call keeps the
    given milliseconds (25 ms of 0.05 ms calls, each 0.055 ms with its L2 flush)."""
    import triton.testing

    runs = []

    def do_bench(fn, warmup=25, rep=100, return_mode="mean"):
        estimate = call_ms + 0.1 * min(call_ms, 1.0)  # do_bench's estimate includes the L2 flush
        runs.append(((warmup, rep), max(1, int(warmup / estimate)), max(1, int(rep / estimate))))
        return call_ms

    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    assert bench.time_ms(lambda: None, warmup_ms=5, rep_ms=25) == call_ms
    (first, _, _), (_, warm, reps) = runs
    assert first == (1, 1)  # one millisecond: the sizing call
    assert warm >= bench.MIN_WARMUP_CALLS and reps >= repeats
    assert reps <= 1.25 * repeats


@pytest.mark.parametrize("preset", ["decode", "mods-bias", "varlen-docs", "user-examples"])
def test_bench_names_a_preset_it_does_not_run(preset):
    """A tune preset that ``flashgen bench`` has no runner for is a usage error naming
    --preset and the script that measures it (it was a KeyError traceback)."""
    r = runner.invoke(app, ["bench", "--preset", preset, "--no-plots"])
    assert r.exit_code == 2 and "'--preset'" in r.output and "benchmarks/" in r.output, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)

"""flashgen.explain and `flashgen explain`: the key, config, source (tuned / nearest /
default), measured time and TFLOP/s, shared-memory budget, per kernel; the path a call
takes (kernels, interpreter, reference, empty)."""

import pytest
import torch
from typer.testing import CliRunner

import flashgen
from flashgen import arch, heuristics, resources
from flashgen.cli import app
from flashgen.db import TuningDB
from flashgen.dispatch import Dispatcher
from flashgen.env import Environment
from flashgen.spec import KernelSpec, Measurement, Shape, TileConfig, Variant, attention_flops

SHAPE = Shape(2, 8, 2, 1024, 1024)  # GQA group 4
TUNED_FWD = TileConfig(64, 64, 4, 2)
NEAR_DQ = TileConfig(64, 32, 4, 1)


@pytest.fixture
def tuned_db(tmp_path):
    """fwd tuned for SHAPE's bucket; bwd_dq only for another bucket (nearest); bwd_dkdv
    not at all (default).  Rows in this process's environment."""
    env, a = Environment.current(), arch.current()
    path = tmp_path / "tuned.sqlite"
    fwd = KernelSpec("fwd", "bfloat16", 64, 64, "causal")
    dq = KernelSpec("bwd_dq", "bfloat16", 64, 64, "causal")
    other = Shape(2, 8, 2, 4096, 4096)
    with TuningDB(path) as db:
        for spec, shape, cfg, ms in ((fwd, SHAPE, TUNED_FWD, 0.25), (fwd, SHAPE, TileConfig(32, 32, 4, 1), 0.5),
                                     (dq, other, NEAR_DQ, 2.0)):
            db.record(shape.key(spec), shape, Variant(spec, cfg), Measurement("ok", median_ms=ms), env,
                      resources.estimate(Variant(spec, cfg), a).total_bytes)
    return path


def _meta(shape=SHAPE, d=64, dtype=torch.bfloat16):
    q = torch.empty(shape.batch, shape.num_heads, shape.seqlen_q, d, device="meta", dtype=dtype)
    k = torch.empty(shape.batch, shape.num_kv_heads, shape.seqlen_k, d, device="meta", dtype=dtype)
    return q, k, k.clone()


def test_explain_sources_per_kernel(tuned_db):
    env, a = Environment.current(), arch.current()
    disp = Dispatcher([tuned_db], env=env, arch=a)
    rep = flashgen.explain(*_meta(), causal=True, dispatcher=disp)
    assert rep.backend == "flashgen" and rep.path.startswith("sizes only") and rep.mask == "causal"
    assert (rep.diag_lo, rep.diag_hi) == (-1024, 0) and rep.softmax_scale == pytest.approx(64 ** -0.5)
    fwd, dq, dkdv = rep.kernels
    assert [c.kernel for c in rep.kernels] == ["fwd", "bwd_dq", "bwd_dkdv"]
    fwd_spec = KernelSpec("fwd", "bfloat16", 64, 64, "causal")
    assert fwd.key == SHAPE.key(fwd_spec).id == "attn_fwd_d64_bf16_causal_g4_q1024_k1024_bh16"
    assert (fwd.source, fwd.config, fwd.median_ms) == ("tuned", TUNED_FWD.id, 0.25)
    assert fwd.tflops == pytest.approx(attention_flops(2, 8, 1024, 1024, 64, causal=True) / 0.25e-3 / 1e12)
    assert fwd.database == str(tuned_db) and fwd.tuned_key == fwd.key
    est = resources.estimate(Variant(fwd_spec, TUNED_FWD), a)
    assert (fwd.smem_bytes, fwd.smem_breakdown) == (est.total_bytes, est.breakdown())
    assert (dq.source, dq.config, dq.median_ms) == ("nearest", NEAR_DQ.id, 2.0)
    assert dq.tuned_key == "attn_bwd_dq_d64_bf16_causal_g4_q4096_k4096_bh16" != dq.key
    dkdv_spec = KernelSpec("bwd_dkdv", "bfloat16", 64, 64, "causal")
    assert (dkdv.source, dkdv.config, dkdv.median_ms, dkdv.tflops) == (
        "default", heuristics.default_config(dkdv_spec, a).id, None, None)
    text = str(rep)
    for s in (fwd.key, TUNED_FWD.id, "tuned", "nearest", "default", "0.2500 ms", f"{fwd.tflops:.4g} TFLOP/s",
              est.breakdown(), "no tuned row"):
        assert s in text, s


def test_explain_paths(monkeypatch):
    disp = Dispatcher([], env=Environment.current(), arch=arch.current())
    q = torch.randn(1, 2, 8, 16)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    rep = flashgen.explain(q, q, q, dispatcher=disp)
    assert rep.path.startswith("reference") and rep.kernels == ()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rep = flashgen.explain(q, q, q, window=(2, 1), dispatcher=disp)
    assert rep.path.startswith("triton interpreter") and len(rep.kernels) == 3 and rep.mask == "window"
    assert all(c.source == "default" for c in rep.kernels)
    e = torch.randn(1, 2, 0, 16)
    rep = flashgen.explain(q, e, e, dispatcher=disp)
    assert rep.path.startswith("no launch") and rep.kernels == ()
    with pytest.raises(flashgen.InputError, match="multiple of 8"):
        flashgen.explain(torch.randn(1, 2, 8, 12), torch.randn(1, 2, 8, 12), torch.randn(1, 2, 8, 12))
    # dropout on the reference path: refused as attention refuses it; the interpreter runs it
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(flashgen.InputError, match="dropout_p > 0 runs in the Triton kernels only"):
        flashgen.explain(q, q, q, dropout_p=0.1, dispatcher=disp)
    with pytest.raises(flashgen.InputError, match="dropout_p > 0 runs in the Triton kernels only"):
        flashgen.attention(q, q, q, dropout_p=0.1)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert flashgen.explain(q, q, q, dropout_p=0.1, dispatcher=disp).path.startswith("triton interpreter")


def test_explain_reads_no_tensor_data():
    """Meta tensors (and the CLI) need no device and no data."""
    disp = Dispatcher([], env=Environment.current(), arch=arch.current())
    rep = flashgen.api.explain_sizes(batch=4, heads=32, kv_heads=8, seqlen_q=32, seqlen_k=4096, head_dim=128,
                                     dispatcher=disp)
    assert rep.kernels[0].key == "attn_fwd_d128_bf16_none_g4_q32_k4096_bh128"
    # one query per head: the forward's flash-decoding form (library.decode_form)
    rep = flashgen.api.explain_sizes(batch=1, heads=32, kv_heads=8, seqlen_q=1, seqlen_k=4096, head_dim=128,
                                     dispatcher=disp)
    assert rep.kernels[0].key == "attn_decode_d128_bf16_none_g4_q1_k4096_bh32"


runner = CliRunner(env={"COLUMNS": "250"})


def test_cli_explain(tuned_db):
    args = ["explain", "--batch", "2", "--heads", "8", "--kv-heads", "2", "--seqlen-q", "1024", "--seqlen-k",
            "1024", "--head-dim", "64", "--causal", "--db", str(tuned_db)]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "attn_fwd_d64_bf16_causal_g4_q1024_k1024_bh16" in r.output
    assert f"config {TUNED_FWD.id} (tuned;" in r.output and "(nearest;" in r.output and "(default;" in r.output
    assert str(tuned_db) in r.output and "shared memory" in r.output
    # the same sizes for another GPU: its rows are not this environment's
    r = runner.invoke(app, args + ["--arch", "sm_80", "--gpu", "NVIDIA A100"])
    assert r.exit_code == 0, r.output
    assert "NVIDIA A100 (cc 8.0" in r.output and "(tuned;" not in r.output and "(default;" in r.output
    assert "limit 166912 B" in r.output  # the A100's shared memory


@pytest.mark.parametrize("extra, message", [
    (["--head-dim", "12"], "multiple of 8"),
    (["--head-dim", "64", "--window", "x"], "LEFT,RIGHT"),
    (["--head-dim", "64", "--arch", "sm_1"], "unknown architecture"),
    (["--head-dim", "64", "--dtype", "int8"], "is not one of"),
    (["--head-dim", "64", "--window", "-2,0"], "'--window': '-2,0': each side must be >= 0"),
    (["--head-dim", "64", "--dropout-p", "1.5"], "'--dropout-p': 1.5: must be in [0, 1)"),
    (["--head-dim", "64", "--softcap", "-1"], "'--softcap': -1.0: must be a finite number >= 0"),
])
def test_cli_explain_errors(extra, message):
    r = runner.invoke(app, ["explain", "--batch", "1", "--heads", "4", "--kv-heads", "2", "--seqlen-q", "8",
                            "--seqlen-k", "8", *extra])
    assert r.exit_code == 2 and message in r.output, r.output


def test_cli_explain_serves_shipped_rows_under_another_triton(monkeypatch):
    """pip resolves a newer Triton than the shipped H200 rows were tuned under: explain
    still names the shipped tuned rows, flagged with the version they were tuned under."""
    from flashgen import dispatch, env as fenv

    (shipped,) = [p for p in dispatch.shipped_databases() if p.name == "h200.sqlite"]
    with TuningDB(shipped, readonly=True) as db:
        tuned_under = set(db.ok_rows_of_gpu("NVIDIA H200", "9.0"))
    assert "3.9.0" not in tuned_under and tuned_under  # the situation of triton 3.9.0 today
    real = fenv.installed_versions()
    monkeypatch.setattr(fenv, "installed_versions", lambda: {**real, "triton_version": "3.9.0"})
    r = runner.invoke(app, ["explain", "--batch", "1", "--heads", "32", "--kv-heads", "8", "--seqlen-q", "4096",
                            "--seqlen-k", "4096", "--head-dim", "128", "--causal", "--gpu", "NVIDIA H200"])
    assert r.exit_code == 0, r.output
    assert "NVIDIA H200 (cc 9.0, triton 3.9.0)" in r.output
    # the forward and the backward (the whole backward as one kernel, or bwd_dq + bwd_dkdv)
    n = 2 if "gluon whole backward" in r.output else 3
    assert r.output.count("(tuned; row attn_") == n and "(default;" not in r.output, r.output
    (version,) = tuned_under
    assert r.output.count(f"tuned under triton {version}") == n


def test_explain_says_when_a_head_dim_is_padded():
    args = ["explain", "--batch", "1", "--heads", "8", "--kv-heads", "8", "--seqlen-q", "1024", "--seqlen-k", "1024"]
    r = runner.invoke(app, args + ["--head-dim", "80"])
    assert r.exit_code == 0, r.output
    smem = [line for line in r.output.splitlines() if "shared memory (model)" in line]
    assert len(smem) == 3 and all(line.endswith("; head_dim 80 runs as d128 tiles (padded to a power of two)")
                                  for line in smem), r.output
    r = runner.invoke(app, args + ["--head-dim", "128"])
    assert "padded" not in r.output
    r = runner.invoke(app, args + ["--head-dim", "64", "--head-dim-v", "40"])
    assert "head_dim_v 40 runs as d64 tiles" in r.output and "head_dim 64 runs" not in r.output


def test_cli_explain_for_a_named_gpu_takes_its_architecture_without_a_gpu_here():
    """No GPU on this machine and no --arch: --gpu 'NVIDIA H200' explains for sm_90 (the
    Gluon family's rows count), not for the interpreter; an unknown name is refused with
    the names it knows unless --arch gives the architecture; a known name whose
    architecture is not --arch's is refused."""
    from flashgen import arch

    assert arch.by_gpu_name("NVIDIA H200").compute_capability == (9, 0)
    assert arch.by_gpu_name("NVIDIA A100-SXM4-80GB").compute_capability == (8, 0)
    assert arch.by_gpu_name("Some Future GPU") is None
    args = ["explain", "--batch", "2", "--heads", "32", "--kv-heads", "8", "--seqlen-q", "4096",
            "--seqlen-k", "4096", "--head-dim", "128", "--causal"]
    r = runner.invoke(app, args + ["--gpu", "NVIDIA H200"])
    assert r.exit_code == 0 and "kernel family gluon" in r.output and "interpreter" not in r.output, r.output
    r = runner.invoke(app, args + ["--gpu", "NVIDIA H200", "--arch", "sm_80"])
    assert r.exit_code == 2 and "compute capability 9.0, not --arch sm_80's 8.0" in r.output, r.output
    # with --arch, a named part keeps its own SM count: an H100 PCIe (114 SMs) is no
    # sibling of the H200, whose rows then do not serve it
    r = runner.invoke(app, args + ["--gpu", "NVIDIA H100 PCIe", "--arch", "sm_90"])
    assert r.exit_code == 0 and "kernel family gluon" in r.output and "tuned under NVIDIA H200" not in r.output, r.output
    r = runner.invoke(app, args + ["--gpu", "Tesla V100-SXM2-16GB"])
    assert r.exit_code == 2 and "no architecture known for this name" in r.output and "--arch" in r.output, r.output
    r = runner.invoke(app, args + ["--gpu", "Tesla V100-SXM2-16GB", "--arch", "sm_80"])
    assert r.exit_code == 0 and "Tesla V100-SXM2-16GB (cc 8.0" in r.output, r.output


def test_explain_takes_the_built_in_score_mods():
    """softcap, alibi_slopes, bias and dropout_p name the mods' keys (the two-kernel
    backward, where the Gluon family does not serve them); their bad values raise as in
    flashgen.attention; SDPA has none of them."""
    disp = Dispatcher([], env=Environment.current(), arch=arch.current())
    q, k, v = _meta()
    bias = torch.empty(1, 1, SHAPE.seqlen_q, SHAPE.seqlen_k, device="meta", dtype=torch.bfloat16)
    alibi = torch.empty(SHAPE.num_heads, device="meta", dtype=torch.float32)
    rep = flashgen.explain(q, k, v, causal=True, softcap=30.0, alibi_slopes=alibi, bias=bias, dropout_p=0.1,
                           dispatcher=disp)
    assert [c.key.split("_g4")[0] for c in rep.kernels] == [
        f"attn_{k}_d64_bf16_causal_softcap_alibi_bias_dropout" for k in ("fwd", "bwd_dq", "bwd_dkdv")]
    assert "score modifications (softcap_alibi_bias_dropout)" in rep.backward
    assert flashgen.explain(q, k, v, softcap=30.0, dispatcher=disp).kernels[0].key.startswith(
        "attn_fwd_d64_bf16_none_softcap_g4")
    with pytest.raises(flashgen.InputError, match="softcap must be a finite real"):
        flashgen.explain(q, k, v, softcap=float("nan"), dispatcher=disp)
    with pytest.raises(flashgen.InputError, match="are flashgen.attention's arguments"):
        flashgen.explain(q, k, v, softcap=30.0, sdpa=True, dispatcher=disp)


def test_cli_explain_with_arch_alone_points_at_the_rows_of_other_gpus():
    """--arch sm_90 explains for the architecture's reference GPU (an H100 with 132 SMs),
    whose rows the shipped H200 database lacks: the H200 (132 SMs) is its sibling, whose
    rows serve it, and a note says so and names the --gpu that takes them as its own;
    with --gpu there is no note.  A GPU of another SM count gets none of them."""
    from flashgen import dispatch

    (shipped,) = [p for p in dispatch.shipped_databases() if p.name == "h200.sqlite"]
    with TuningDB(shipped, readonly=True) as db:
        n = db.gpu_sm_counts("9.0")["NVIDIA H200", 132]
    args = ["explain", "--batch", "2", "--heads", "32", "--kv-heads", "8", "--seqlen-q", "4096", "--seqlen-k", "4096",
            "--head-dim", "128", "--causal", "--deterministic"]
    r = runner.invoke(app, args + ["--arch", "sm_90"])
    assert r.exit_code == 0, r.output
    assert (f"note: the databases hold {n} rows measured on 'NVIDIA H200' (cc 9.0, 132 SMs): a sibling of "
            "'NVIDIA H100' (the same compute capability and SM count), used where it has no row of its own "
            "(--arch sm_90 explains for 'NVIDIA H100'); --gpu 'NVIDIA H200' explains with them as that GPU's own"
            ) in r.output
    assert "tuned under NVIDIA H200 (sm_90, 132 SMs, as this GPU)" in r.output
    r = runner.invoke(app, args + ["--gpu", "NVIDIA H200"])
    assert r.exit_code == 0 and "note: the databases hold" not in r.output, r.output
    assert "bitwise repeatable (dQ added in a fixed order)" in r.output
    # named parts of other SM counts are no siblings of the H200 (an H100 PCIe: 114, an H20: 78)
    for gpu in ("NVIDIA H100 PCIe", "NVIDIA H20"):
        r = runner.invoke(app, args + ["--gpu", gpu])
        assert r.exit_code == 0 and "tuned under NVIDIA H200" not in r.output and "(tuned;" not in r.output, r.output
    r = runner.invoke(app, args + ["--gpu", "NVIDIA H100 80GB HBM3"])
    assert r.exit_code == 0 and "tuned under NVIDIA H200 (sm_90, 132 SMs, as this GPU)" in r.output, r.output


def test_the_interpreter_and_fake_runs_have_no_siblings():
    """The interpreter's environment (sm_90, 132 SMs, as modelled) takes no real GPU's
    rows, and rows of --fake / --fake-model runs and of the interpreter are no GPU's
    sibling rows."""
    import dataclasses

    from flashgen.arch import INTERPRETER
    from flashgen.env import INTERPRETER_GPU, Environment, real_gpu

    assert INTERPRETER.name == INTERPRETER_GPU
    assert not real_gpu(INTERPRETER_GPU) and not real_gpu("triton-interpreter (model)")
    assert not real_gpu("NVIDIA H100 80GB HBM3 (model)") and not real_gpu("NVIDIA H100 80GB HBM3 (fake)")
    assert real_gpu("NVIDIA H200")
    from flashgen.dispatch import Dispatcher
    from flashgen.spec import KernelSpec, Shape

    key = Shape(2, 32, 8, 4096, 4096).key(KernelSpec("fwd", "bfloat16", 128, 128, "causal"))
    env = Environment(INTERPRETER_GPU, "9.0", 132, "3.6.0", "2.13.0", "0.1.0")
    assert Dispatcher(env=env, arch=INTERPRETER).choose(key).source == "default"
    h100 = dataclasses.replace(env, gpu_name="NVIDIA H100 80GB HBM3")
    assert Dispatcher(env=h100, arch=INTERPRETER).choose(key).tuned_on == "NVIDIA H200"


@pytest.mark.parametrize("kw, message", [
    (dict(head_dim=-8), "head_dim must be a multiple of 8"),
    (dict(head_dim_v=12), "head_dim_v must be a multiple of 8"),
    (dict(batch=99999999999, heads=99999, seqlen_q=99999999), "too large for a tensor"),
    (dict(seqlen_q=2 ** 20, seqlen_k=2 ** 40, bias=True), "too large for a tensor"),
    (dict(seqlen_k=2 ** 60, head_dim=128), r"seqlen 1152921504606846976 x head_dim 128\) exceed int64"),
])
def test_explain_sizes_names_bad_sizes(kw, message):
    """explain_sizes refuses what no tensor can hold with an InputError naming it, as the
    CLI's options do, instead of torch's error from building the meta tensors."""
    args = {**dict(batch=1, heads=8, kv_heads=2, seqlen_q=128, seqlen_k=128, head_dim=64), **kw}
    with pytest.raises(flashgen.InputError, match=message):
        flashgen.api.explain_sizes(**args)


def test_explain_takes_user_functions_and_names_the_keys_the_call_dispatches(monkeypatch):
    """score_mod / mask_mod / sinks: the kernels' keys carry the lowerings' names, the
    ones a call with gradients dispatches (a mask function's backward its own lowering,
    a score function's with the captured table's gradient, sinks alone the plain
    backward); sizes only (meta tensors) needs no device; combinations attention refuses
    raise as it does."""
    from flashgen import dispatch

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    seen = []
    choose, backward = dispatch.Dispatcher.choose, dispatch.Dispatcher.backward

    def spy_choose(self, key, **kw):
        seen.append(key.id)
        return choose(self, key, **kw)

    def spy_backward(self, key, **kw):
        plan = backward(self, key, **kw)
        seen.extend(c.key.id for c in plan.choices)
        return plan
    monkeypatch.setattr(dispatch.Dispatcher, "choose", spy_choose)
    monkeypatch.setattr(dispatch.Dispatcher, "backward", spy_backward)
    doc = torch.arange(40) // 15
    table = torch.randn(8, 4, requires_grad=True)
    cases = {"mask": dict(causal=True, mask_mod=lambda b, h, qi, ki: doc[qi] == doc[ki]),
             "score": dict(score_mod=lambda s, b, h, qi, ki: s + table[(ki - qi).clamp(0, 7), h]),
             "sinks": dict(causal=True, sinks=torch.zeros(4, requires_grad=True))}
    for name, kw in cases.items():
        q, k, v = (torch.randn(1, n, 40, 16, dtype=torch.float16, requires_grad=True) for n in (4, 2, 2))
        rep = flashgen.explain(q, k, v, **kw)
        keys = [c.key for c in rep.kernels]
        seen.clear()
        flashgen.attention(q, k, v, **kw).sum().backward()
        assert keys == list(dict.fromkeys(seen)), (name, keys, seen)
        fwd_mods, bwd_mods = keys[0].split("_")[5], keys[1].split("_")[6]
        assert fwd_mods.startswith("u") and fwd_mods.endswith("m") == (name == "mask"), keys
        # the backward's lowering is its own (sinks alone: the plain backward, no mods)
        assert bwd_mods == "g2" if name == "sinks" else bwd_mods.startswith("u") and bwd_mods != fwd_mods, keys
    qm, km = torch.empty(1, 4, 4096, 128, device="meta"), torch.empty(1, 2, 4096, 128, device="meta")
    rep = flashgen.explain(qm.bfloat16(), km.bfloat16(), km.bfloat16(), mask_mod=lambda b, h, qi, ki: ki <= qi + 7)
    assert rep.path.startswith("sizes only") and len(rep.kernels) == 3
    with pytest.raises(flashgen.InputError, match="not combined with softcap"):
        flashgen.explain(q, k, v, softcap=30.0, mask_mod=lambda b, h, qi, ki: ki <= qi)
    with pytest.raises(flashgen.InputError, match="sinks must be a float32 tensor"):
        flashgen.explain(q, k, v, sinks=torch.zeros(3))
    with pytest.raises(flashgen.InputError, match="arguments, not scaled_dot_product_attention's"):
        flashgen.explain(q, k, v, sdpa=True, mask_mod=lambda b, h, qi, ki: ki <= qi)
    # what the call refuses before any kernel, explain refuses on every path: an index
    # past its tensor, bad sinks or an untraceable function with an empty input
    short = torch.randn(4, 4)
    with pytest.raises(flashgen.InputError, match="reads a captured tensor of shape"):
        flashgen.explain(q, k, v, score_mod=lambda s, b, h, qi, ki: s + short[qi, h])
    empty = torch.randn(1, 4, 0, 16, dtype=torch.float16)
    with pytest.raises(flashgen.InputError, match="sinks must be a float32 tensor"):
        flashgen.explain(empty, k, v, sinks=torch.zeros(3))
    with pytest.raises(flashgen.UnsupportedError):
        flashgen.explain(empty, k, v, mask_mod=lambda b, h, qi, ki: ki if qi > 3 else qi)
    # the captured tensors are not copied, no kernel buffer made (a float64 table: the
    # call's kernels read a float32 copy)
    wide = torch.randn(8, 4, dtype=torch.float64, requires_grad=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        flashgen.explain(q, k, v, score_mod=lambda s, b, h, qi, ki: s + wide[(ki - qi).clamp(0, 7), h])
    ops = {e.name for e in prof.events()}
    assert not ops & {"aten::_to_copy", "aten::zeros", "aten::clone"}, sorted(ops)


def test_explain_takes_the_path_and_layout_the_call_takes(monkeypatch):
    """bfloat16 in the interpreter runs the reference (the interpreter's tl.dot
    multiplies bfloat16 bit patterns), and a q whose last dim has stride != 1 is copied
    before the kernels: explain says so and names the copy's layout."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q = torch.randn(1, 2, 32, 16, dtype=torch.bfloat16)
    rep = flashgen.explain(q, q, q)
    assert rep.path.startswith("reference (no kernel: bfloat16 in Triton's interpreter") and rep.kernels == ()
    qt = torch.randn(1, 2, 16, 32, dtype=torch.float16).transpose(2, 3)  # stride(-1) == 32
    assert all(not c.key.endswith("_strided") for c in flashgen.explain(qt, qt, qt).kernels)
    assert flashgen.explain(qt, qt, qt).kernels[0].key == flashgen.explain(qt.contiguous(), qt.contiguous(),
                                                                            qt.contiguous()).kernels[0].key


def test_meta_tensors_explain_the_layout_their_strides_give(tuned_db):
    """An expanded (GQA heads broadcast) or sliced meta tensor gives the "strided" key its
    real counterpart gets (the explanation read the plain key for every meta tensor);
    contiguous meta tensors the plain key."""
    disp = Dispatcher([tuned_db], env=Environment.current(), arch=arch.current())
    for dev in ("meta", "cpu"):
        q = torch.empty(1, 2, 256, 64, device=dev, dtype=torch.float16)
        k = torch.empty(1, 1, 256, 64, device=dev, dtype=torch.float16).expand(1, 2, 256, 64)
        keys = [c.key for c in flashgen.explain(q, k, k, dispatcher=disp).kernels]
        assert keys and all(key.endswith("_strided") for key in keys), (dev, keys)
        wide = torch.empty(1, 2, 256, 68, device=dev, dtype=torch.float16)[..., :64]  # rows of 136 B
        keys = [c.key for c in flashgen.explain(q, wide, wide, dispatcher=disp).kernels]
        assert keys and all(key.endswith("_strided") for key in keys), (dev, keys)
        keys = [c.key for c in flashgen.explain(q, q, q, dispatcher=disp).kernels]
        assert keys and not any(key.endswith("_strided") for key in keys), (dev, keys)

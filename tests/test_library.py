"""The torch.library ops: schema, fake (meta) kernels whose shapes and strides match the
real outputs, autograd, torch.compile(fullgraph=True) on CPU (reference path and the
interpreter), the per-call fast path (checks kept, memo dropped with the dispatcher),
the dispatcher inside a CUDA graph capture, and the wheel's package data."""

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import flashgen
from flashgen import InputError, arch, dispatch, heuristics, library, ops, resources
from flashgen.db import TuningDB
from flashgen.dispatch import Dispatcher
from flashgen.env import Environment
from flashgen.masks import mask_bounds
from flashgen.spec import KernelSpec, Measurement, Shape, TileConfig, Variant

ROOT = Path(__file__).resolve().parent.parent
F16 = torch.float16


pytestmark = pytest.mark.usefixtures("hermetic_dispatcher")


@pytest.fixture
def no_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _qkv(b=1, h=4, hk=2, sq=9, sk=13, d=16, dv=24, dtype=torch.float32, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    ts = [torch.randn(b, h, sq, d, generator=g, dtype=dtype), torch.randn(b, hk, sk, d, generator=g, dtype=dtype),
          torch.randn(b, hk, sk, dv, generator=g, dtype=dtype)]
    return [t.requires_grad_(grad) for t in ts]


# -- registration, fake kernels ------------------------------------------------------

def test_ops_are_registered():
    assert torch.ops.flashgen.fwd.default is library.FWD and torch.ops.flashgen.bwd.default is library.BWD
    schema = str(library.FWD._schema)
    assert schema.startswith("flashgen::fwd(Tensor q, Tensor k, Tensor v, float scale, str mask, SymInt lo, SymInt hi, "
                             "bool? deterministic=None)")  # None: torch's flag when the backward runs
    assert str(library.BWD._schema).endswith("bool? deterministic=None) -> (Tensor, Tensor, Tensor)")


@pytest.mark.parametrize("interpret", ["0", "1"])
def test_opcheck(interpret, monkeypatch):
    """torch's own checker: schema, fake kernel vs real outputs, autograd registration,
    AOT dispatch with dynamic shapes."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    q, k, v = _qkv(dtype=F16, grad=True)
    mask, lo, hi = mask_bounds(9, 13, causal=True, window=(-1, -1))
    res = torch.library.opcheck(library.FWD, (q, k, v, 0.3, mask, lo, hi))
    assert set(res.values()) == {"SUCCESS"}, res
    o, lse = library.FWD(q, k, v, 0.3, mask, lo, hi)
    do = torch.randn_like(o)
    res = torch.library.opcheck(library.BWD, (do, q.detach(), k.detach(), v.detach(), o.detach(), lse, 0.3,
                                              mask, lo, hi))
    assert set(res.values()) == {"SUCCESS"}, res


@pytest.mark.parametrize("interpret", ["0", "1"])
@pytest.mark.parametrize("sizes", [(1, 4, 2, 9, 13, 16, 24), (2, 2, 2, 0, 5, 8, 8), (1, 2, 1, 7, 0, 16, 16)])
def test_fake_shapes_and_strides_match_the_real_outputs(sizes, interpret, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    b, h, hk, sq, sk, d, dv = sizes
    # q as a transposed view of (b, s, h, d) storage: dense but not contiguous
    q = torch.randn(b, sq, h, d, dtype=F16).transpose(1, 2)
    k, v = torch.randn(b, hk, sk, d, dtype=F16), torch.randn(b, hk, sk, dv, dtype=F16)
    mask, lo, hi = mask_bounds(sq, sk, causal=False, window=(3, 2))
    real = library.FWD(q, k, v, 0.5, mask, lo, hi)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        fake = library.FWD(fq, fk, fv, 0.5, mask, lo, hi)
        do = torch.empty(b, h, sq, dv, dtype=F16)
        fake_g = library.BWD(do, fq, fk, fv, fake[0], fake[1], 0.5, mask, lo, hi)
    # O is laid out like q (transformers' transpose(1, 2).contiguous() of it is then free)
    assert real[0].shape == (b, h, sq, dv) and real[0].transpose(1, 2).is_contiguous() and real[0].dtype == F16
    assert real[1].shape == (b, h, sq) and real[1].is_contiguous() and real[1].dtype == torch.float32
    for r, f in zip(real, fake):
        assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype)
    real_g = library.BWD(torch.randn(b, h, sq, dv, dtype=F16), q, k, v, *real, 0.5, mask, lo, hi)
    for r, f, t in zip(real_g, fake_g, (q, k, v)):
        assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype)
        assert (r.shape, r.dtype) == (t.shape, t.dtype)
        if t.numel():
            assert r.stride() == t.stride()


def test_lse_is_not_differentiable():
    q, k, v = _qkv(grad=True)
    o, lse = flashgen.attention(q, k, v, return_lse=True)
    assert o.requires_grad and not lse.requires_grad


# -- torch.compile -----------------------------------------------------------------

class _Block(torch.nn.Module):
    """A tiny attention block: projections around flashgen.attention."""

    def __init__(self, d=16, h=4, hk=2):
        super().__init__()
        self.h, self.hk, self.d = h, hk, d
        self.wq = torch.nn.Linear(d * h, d * h, bias=False)
        self.wkv = torch.nn.Linear(d * h, 2 * d * hk, bias=False)

    def forward(self, x, fn):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.h, self.d).transpose(1, 2)  # strided views, last dim 1
        k, v = self.wkv(x).view(b, s, 2, self.hk, self.d).permute(2, 0, 3, 1, 4)
        return fn(q, k, v).transpose(1, 2).reshape(b, s, -1)


def _compiled_vs_eager(fn, backend="aot_eager", dtype=torch.float32):
    torch.manual_seed(0)
    m = _Block().to(dtype)
    x = torch.randn(2, 11, 64, dtype=dtype)
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.backends.registry.lookup_backend(backend)(gm, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(lambda x: m(x, fn), fullgraph=True, backend=recording)
    results = []
    for f in (compiled, lambda x: m(x, fn)):
        m.zero_grad()
        xx = x.clone().requires_grad_()
        out = f(xx)
        (out.float() * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append((out.detach(), xx.grad, m.wq.weight.grad.clone(), m.wkv.weight.grad.clone()))
    targets = [n.target for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    return results, targets


@pytest.mark.parametrize("interpret", ["0", "1"])
def test_torch_compile_fullgraph_equals_eager(interpret, monkeypatch):
    """fullgraph=True raises on any graph break; the op is one node of the graph, and
    the compiled forward and backward give the eager result."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    (got, want), targets = _compiled_vs_eager(
        lambda q, k, v: flashgen.attention(q, k, v, causal=True, window=(4, -1)))
    assert targets.count(torch.ops.flashgen.fwd.default) == 1, targets
    for a, b in zip(got, want):
        assert a is not None and torch.allclose(a, b, atol=1e-5, rtol=1e-5), (a - b).abs().max()
    assert want[1].abs().sum() > 0  # gradients actually flowed back through the op



def test_a_scale_or_softcap_that_changes_between_compiled_calls_recompiles(monkeypatch):
    """A float argument that changes between calls is traced symbolically on the second
    compile: flashgen's value checks of it (math.isfinite) broke the graph, an error
    under fullgraph=True for every entry point; now each call equals eager."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v = (torch.randn(1, 2, 8, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    lens = torch.tensor([5], dtype=torch.int32)
    calls = {
        "attention": lambda s: flashgen.attention(q, k, v, softmax_scale=s),
        "softcap": lambda s: flashgen.attention(q, k, v, softcap=s * 8),
        "sdpa": lambda s: flashgen.scaled_dot_product_attention(q, k, v, scale=s),
        "varlen": lambda s: flashgen.attention_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1),
                                                      v[0].transpose(0, 1), cu, cu, 5, 5, softmax_scale=s),
        "kvcache": lambda s: flashgen.attention_with_kvcache(q[:, :, :1].transpose(1, 2), k.transpose(1, 2),
                                                             v.transpose(1, 2), lens, softmax_scale=s),
    }
    for name, f in calls.items():
        torch._dynamo.reset()
        compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
        for s in (0.5, 0.25, 0.125):
            torch.testing.assert_close(compiled(s), f(s), msg=f"{name} at {s}")

def test_torch_compile_sdpa_fullgraph(no_interpreter):
    (got, want), targets = _compiled_vs_eager(
        lambda q, k, v: flashgen.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    assert torch.ops.flashgen.fwd.default in targets
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)
    # and it is torch's SDPA
    (ref, _), _ = _compiled_vs_eager(
        lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    for a, b in zip(got, ref):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), (a - b).abs().max()


def test_torch_compile_sdpa_fullgraph_with_a_square_bool_mask(no_interpreter):
    """A (1, 1, n, n) bool attn_mask, the shape of a padding or causal mask, which eager
    calls check for packed documents: tracing skips that check (it reads values), so
    fullgraph=True holds and the compiled result is the eager one."""
    q, k, v = (torch.randn(1, 4, 12, 16) for _ in range(3))
    mask = torch.rand(1, 1, 12, 12, generator=torch.Generator().manual_seed(0)) > 0.3
    torch._dynamo.reset()
    f = torch.compile(lambda a, b, c, m: flashgen.scaled_dot_product_attention(a, b, c, attn_mask=m),
                      backend="eager", fullgraph=True)
    got = f(q, k, v, mask)
    want = flashgen.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()


def test_torch_compile_rejects_invalid_inputs_at_trace_time(no_interpreter):
    q, k, v = _qkv(d=12, dv=12)
    f = torch.compile(lambda q, k, v: flashgen.attention(q, k, v), fullgraph=True, backend="aot_eager")
    torch._dynamo.reset()
    with pytest.raises(Exception, match="multiple of 8"):
        f(q, k, v)


# -- the per-call fast path ------------------------------------------------------------

def test_fast_path_keeps_every_check(no_interpreter):
    q, k, v = _qkv()
    flashgen.attention(q, k, v)  # memoizes this call's tuple
    with pytest.raises(InputError, match="softmax_scale"):
        flashgen.attention(q, k, v, softmax_scale="0.1")
    with pytest.raises(InputError, match=r"k\.dtype"):
        flashgen.attention(q, k.double(), v)
    with pytest.raises(InputError, match=r"window"):
        flashgen.attention(q, k, v, window=(-3, 0))
    with pytest.raises(InputError, match=r"^v must be a torch\.Tensor"):
        flashgen.attention(q, k, v.numpy())
    with pytest.raises(InputError, match=r"num_heads"):
        flashgen.attention(q[:, :3], k, v)
    # an int scale and a list window take the checked path and still work
    assert torch.equal(flashgen.attention(q, k, v, softmax_scale=1), flashgen.attention(q, k, v, softmax_scale=1.0))
    assert torch.equal(flashgen.attention(q, k, v, window=[2, 1]), flashgen.attention(q, k, v, window=(2, 1)))


def test_fast_path_results_equal_the_op(no_interpreter):
    q, k, v = _qkv(grad=True)
    for kw in (dict(), dict(causal=True), dict(window=(3, 0), softmax_scale=-0.7)):
        with torch.no_grad():
            direct = [flashgen.attention(q, k, v, return_lse=True, **kw) for _ in range(2)]  # miss, then hit
        through_op = flashgen.attention(q, k, v, return_lse=True, **kw)
        assert through_op[0].grad_fn is not None and direct[1][0].grad_fn is None
        for a, b, c in zip(direct[0], direct[1], through_op):
            assert torch.equal(a, b) and torch.equal(a, c.detach())


def test_memo_is_dropped_with_the_dispatcher(monkeypatch):
    """A memoized call follows the dispatcher: clearing it (or a new default) drops the
    launch facts, so a new tuning row changes the launched config."""
    q, k, v = _qkv(b=1, h=2, hk=2, sq=20, sk=20, d=16, dv=16, dtype=F16)
    launched = []
    real_fwd = ops.fwd
    monkeypatch.setattr(ops, "fwd", lambda *a, config, **kw: launched.append(config) or real_fwd(*a, config=config, **kw))
    with torch.no_grad():
        flashgen.attention(q, k, v)
        flashgen.attention(q, k, v)
    disp = dispatch.default_dispatcher()
    default = heuristics.default_config(KernelSpec("fwd", "float16", 16, 16, "none"), disp.arch)
    assert launched == [default, default] and disp.fast
    tuned = TileConfig(16, 16, 4, 1)
    assert tuned != default
    key = Shape(1, 2, 2, 20, 20).key(KernelSpec("fwd", "float16", 16, 16, "none"))
    disp.choose(key)  # cached default ...
    disp._cache[key] = dispatch.Choice(key, tuned, "tuned")  # ... replaced as a re-read DB would
    with torch.no_grad():
        flashgen.attention(q, k, v)
    assert launched[-1] == default  # the memo still holds the old launch facts
    disp.fast.clear()
    with torch.no_grad():
        flashgen.attention(q, k, v)
    assert launched[-1] == tuned
    disp.clear()
    assert not disp.fast


def test_fast_table_is_bounded(no_interpreter, monkeypatch):
    monkeypatch.setattr(library, "FAST_TABLE_MAX", 8)
    disp = dispatch.default_dispatcher()
    for sk in range(1, 30):
        flashgen.attention(*_qkv(sk=sk))
        assert 0 < len(disp.fast) <= 8


# -- CUDA graph capture: the dispatcher reads no database -----------------------------

def test_dispatcher_inside_a_capture_reads_no_database(tmp_path, monkeypatch):
    env, a = Environment.current(), arch.current()
    spec = KernelSpec("fwd", "bfloat16", 64, 64, "causal")
    key, other = Shape(2, 8, 8, 1024, 1024).key(spec), Shape(2, 8, 8, 64, 64).key(spec)
    tuned = TileConfig(64, 64, 4, 2)
    db_path = tmp_path / "t.sqlite"
    with TuningDB(db_path) as db:
        for kk in (key, other):
            db.record(kk, Shape(2, 8, 8, 1024, 1024), Variant(spec, tuned), Measurement("ok", median_ms=0.1), env,
                      resources.estimate(Variant(spec, tuned), a).total_bytes)
    d = Dispatcher([db_path], env=env, arch=a)
    assert d.choose(other).source == "tuned"  # cached before the capture

    reads = []
    real_table = Dispatcher._table
    monkeypatch.setattr(Dispatcher, "_table", lambda self, p: reads.append(p) or real_table(self, p))
    monkeypatch.setattr(dispatch, "graph_capturing", lambda: True)
    ch = d.choose(key)  # a miss during the capture: the default, no read
    assert (ch.source, ch.config) == ("default", heuristics.default_config(spec, a)) and reads == []
    assert ch.smem_bytes == resources.estimate(Variant(spec, ch.config), a).total_bytes
    assert d.choose(other).source == "tuned" and reads == []  # a hit is served from memory
    monkeypatch.setattr(dispatch, "graph_capturing", lambda: False)
    ch = d.choose(key)  # after the capture: the default was not memoized, the DB is read
    assert (ch.source, ch.config) == ("tuned", tuned) and reads == [db_path]


def test_launch_facts_made_during_a_capture_are_not_memoized(monkeypatch):
    monkeypatch.setattr(dispatch, "graph_capturing", lambda: True)
    q, k, v = _qkv(dtype=F16)
    with torch.no_grad():
        flashgen.attention(q, k, v)
    disp = dispatch.default_dispatcher()
    assert not disp.fast and not disp._cache and disp._capture_defaults
    monkeypatch.setattr(dispatch, "graph_capturing", lambda: False)
    with torch.no_grad():
        flashgen.attention(q, k, v)
    assert disp.fast and disp._cache


def test_graph_capturing_is_false_without_a_capture():
    assert dispatch.graph_capturing() is False


def _bench_script(name: str):
    """The module of ``benchmarks/<name>.py`` (which import their siblings by name)."""
    import importlib

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


# -- the GPU check script's logic, on CPU -------------------------------------------------

def test_gpu_op_checks_logic_on_cpu(no_interpreter):
    gpu_op_checks = _bench_script("gpu_op_checks")
    rows = gpu_op_checks.run_checks(torch.device("cpu"), dtype=torch.float32, backend="aot_eager")
    names = [r.name for r in rows]
    assert {"torch.compile fwd+bwd", "sdpa vs torch"} <= {n.split(" [")[0] for n in names}, names
    assert sum(n.startswith("layouts: bshd views") for n in names) == 2, names
    assert any(n.startswith("new thread") for n in names), names
    assert sum(n.startswith("plans ") for n in names) == 2, names
    bad = [r for r in rows if r.status == "FAIL"]
    assert not bad, bad
    assert any(r.status == "PASS" for r in rows)
    # and a wrong result is reported as FAIL, not hidden
    row = gpu_op_checks.compare("planted", torch.zeros(3), torch.ones(3), atol=0.1)
    assert row.status == "FAIL" and "1" in row.detail


def test_gpu_op_checks_bias_tma_in_the_interpreter():
    """Triton's interpreter reports sm_90 and runs tma configs: check_bias_tma there
    expects descriptors like an sm_90 GPU (it expected none on every CPU and failed its
    8 descriptor cases under TRITON_INTERPRET=1)."""
    gpu_op_checks = _bench_script("gpu_op_checks")
    rows = gpu_op_checks.check_bias_tma(torch.device("cpu"), F16)
    assert len(rows) == 10 and all(r.status == "PASS" for r in rows), [(r.name, r.detail) for r in rows]


def _gpu_exactness():
    return _bench_script("gpu_exactness")


@pytest.mark.parametrize("case", ["unknown_kernel", "missing_file", "no_skipped_key", "not_json"])
def test_gpu_exactness_rejects_bad_space_arguments_before_running(case, tmp_path, monkeypatch, capsys):
    """--kernels naming no kernel of the search space, or a --resume-skipped file that is
    missing or holds no 'skipped' list, is an argument error before any part runs (not
    a traceback after the minutes-long 'big' part, nor a run that checks 0 variants and
    reports no failures)."""
    gx = _gpu_exactness()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ran = []
    monkeypatch.setattr(gx, "run_space", lambda vs, *a, **k: ran.append(vs) or ([], []))
    monkeypatch.setattr(gx, "_in_subprocess", lambda *a: ran.append(a) or {})
    out = tmp_path / "out.json"
    if case == "no_skipped_key":
        (tmp_path / "r.json").write_text('{"meta": {}}')
    elif case == "not_json":
        (tmp_path / "r.json").write_text("not json")
    extra = {"unknown_kernel": ["--kernels", "fwd,nonsense"],
             "missing_file": ["--resume-skipped", str(tmp_path / "missing.json")]}.get(
        case, ["--resume-skipped", str(tmp_path / "r.json")])
    with pytest.raises(SystemExit) as e:
        gx.main(["--smoke", "--skip", "matrix", "--out", str(out), *extra])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert {"unknown_kernel": "nonsense", "missing_file": "missing.json", "no_skipped_key": "skipped",
            "not_json": "r.json"}[case] in err, err
    assert ran == [] and not out.exists()


def test_gpu_exactness_resumes_from_its_own_output_file(tmp_path, monkeypatch):
    """--resume-skipped may name --out itself: the earlier run's skipped list is read
    before this run's first write replaces the file."""
    gx = _gpu_exactness()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ran = []
    monkeypatch.setattr(gx, "run_space", lambda vs, *a, **k: ran.append([v.id for v in vs]) or ([], []))
    monkeypatch.setattr(gx, "_in_subprocess", lambda fn, fargs, name: dict(name=name, ok=True, ratios={}, problems=[],
                                                                           error=None, kind="big"))
    vs = gx.space_variants("float16", (64,))
    want = next(v.id for v in vs if v.spec.kernel == "bwd_dq" and v.spec.mask == "causal")
    out = tmp_path / "gx.json"
    out.write_text(json.dumps(dict(meta={}, skipped=[f"space/{want}", "matrix/some-case"])))
    gx.main(["--smoke", "--skip", "matrix", "--out", str(out), "--resume-skipped", str(out)])
    assert ran == [[want]]


def test_probe_dq_atomic_without_a_gpu_says_so(tmp_path, capsys):
    """The GPU probe on a machine without CUDA: an error naming --smoke / --ptxas, not
    torch's 'not compiled with CUDA' traceback."""
    probe_dq_atomic = _bench_script("probe_dq_atomic")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(SystemExit) as e:
        probe_dq_atomic.main(["--out", str(tmp_path / "p.json")])
    assert e.value.code not in (0, None)
    err = capsys.readouterr().err + str(e.value.code)
    assert "--smoke" in err and "--ptxas" in err, err
    assert not (tmp_path / "p.json").exists()


def test_probe_dq_atomic_smoke_runs_only_what_the_interpreter_can(tmp_path, monkeypatch):
    """--smoke (CPU interpreter) checks the pointer red.add mode against float64; the
    TMA reduce-add mode (no create_descriptor_reduce in Triton's interpreter) is left
    out with a note instead of failing every smoke run."""
    probe_dq_atomic = _bench_script("probe_dq_atomic")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = tmp_path / "p.json"
    assert probe_dq_atomic.main(["--smoke", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["method"] for r in rows} == {"two-pass", "atomic-ptr"}, rows
    assert all("error" not in r and r["ratio"] <= 1 for r in rows), rows


# -- the wheel -------------------------------------------------------------------------

def test_wheel_contains_tuning_db_and_templates(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("flashgen", "templates", "tuning_db"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path / "wheels"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(out), str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = out.glob("flashgen-*.whl")
    names = set(zipfile.ZipFile(whl).namelist())
    assert {"flashgen/tuning_db/h200.sqlite", "flashgen/tuning_db/h100.sqlite"} <= names
    for t in ("_common.j2", "attn_fwd.py.j2", "attn_bwd_dq.py.j2", "attn_bwd_dkdv.py.j2"):
        assert f"flashgen/templates/{t}" in names
    assert "flashgen/library.py" in names and "flashgen/api.py" in names
    assert "flashgen/integrations/transformers.py" in names
    assert "flashgen/templates/_user_mods.j2" in names  # the user functions' overlay
    # the kernel families: their modules, and the Gluon templates (templates/gluon/)
    assert {"flashgen/families/__init__.py", "flashgen/families/triton/launch.py",
            "flashgen/families/gluon/render.py", "flashgen/families/gluon/bwd.py"} <= names
    for t in ("attn_fwd.py.j2", "attn_bwd.py.j2"):
        assert f"flashgen/templates/gluon/{t}" in names
    # the Gluon backward's code id (without it an installed package's id would not be the shipped rows')
    assert "flashgen/templates/gluon/attn_bwd.code_id.json" in names
    with zipfile.ZipFile(whl) as z:
        assert z.read("flashgen/tuning_db/h200.sqlite") == (ROOT / "tuning_db" / "h200.sqlite").read_bytes()


@pytest.mark.parametrize("interpret", ["0", "1"])
def test_eager_autograd_skips_the_op_dispatcher_and_equals_the_op(interpret, monkeypatch):
    """Plain eager tensors that need gradients go through EagerAttention (no
    torch.library dispatch); its outputs and gradients equal the op's."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    dtype = torch.float16 if interpret == "1" else torch.float32
    kw = dict(causal=True, softmax_scale=0.3)
    q, k, v = _qkv(dtype=dtype, grad=True)
    do = torch.randn(q.shape[:3] + (v.shape[3],), dtype=dtype, generator=torch.Generator().manual_seed(3))
    calls = []
    real = library.FWD
    monkeypatch.setattr(library, "FWD", lambda *a: calls.append(1) or real(*a))
    o = flashgen.attention(q, k, v, **kw)
    assert not calls and o.grad_fn is not None and "EagerAttention" in type(o.grad_fn).__name__
    eager = (o, *torch.autograd.grad(o, (q, k, v), do))
    sq, sk = q.shape[2], k.shape[2]
    mask, lo, hi = mask_bounds(sq, sk, causal=True, window=(-1, -1))
    o2, _ = real(q, k, v, 0.3, mask, lo, hi)
    via_op = (o2, *torch.autograd.grad(o2, (q, k, v), do))
    for a, b in zip(eager, via_op):
        assert torch.equal(a, b)
    # a TorchDispatchMode still sees the op
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Seen.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with Seen():
        flashgen.attention(q, k, v, **kw)
    assert any("flashgen.fwd" in s for s in Seen.ops)


def test_vmap_goes_through_the_op(no_interpreter):
    """functorch's wrappers have no storage: the per-call fast path must not touch them
    (it read data_ptr()); vmap runs the op through torch's batching fallback."""
    q, k, v = _qkv(b=3, h=2, hk=2, sq=5, sk=7, d=16, dv=16)
    want = flashgen.attention(q, k, v, causal=True)
    got = torch.vmap(lambda q, k, v: flashgen.attention(q[None], k[None], v[None], causal=True)[0])(q, k, v)
    assert torch.allclose(got, want, atol=1e-6)


def test_probe_fwd_configs_pipe_qk_mode_is_exact_and_leaves_the_tuned_code_alone(tmp_path, monkeypatch):
    """The forward's pipe_qk probe mode (tile j+1's QK^T issued before tile j's softmax;
    measured 0.25-0.59x of the tuned forward on the H200) computes the same
    attention: --smoke checks every config, with and without it, against float64 on
    shapes with several interior tiles and with none (causal row blocks at the
    diagonal).  Rendered without the mode, every variant is byte-identical, so no
    tuning row's code hash moves; with mods or pointer loads the mode does nothing."""
    import dataclasses

    from flashgen import render
    from flashgen.spec import KernelSpec, TileConfig, Variant

    probe_fwd_configs = _bench_script("probe_fwd_configs")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = tmp_path / "p.json"
    assert probe_fwd_configs.main(["--smoke", "--pipe-qk", "x", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["kind"] for r in rows} == {"tuned", "probe", "pipe_qk"}
    assert sum(r["kind"] == "pipe_qk" for r in rows) == 4
    assert all("error" not in r and r["ratio"] <= 1 for r in rows), rows

    v = Variant(KernelSpec("fwd", "bfloat16", 64, 64, "causal"), TileConfig(64, 64, 4, 3, tma=1))
    base = render._render(v, "-")
    assert render._render(v, "-", pipe_qk=False) == base
    assert "_softmax_pv" in render._render(v, "-", pipe_qk=True)
    for other in (dataclasses.replace(v, config=dataclasses.replace(v.config, tma=0)),
                  Variant(dataclasses.replace(v.spec, mods="softcap"), v.config)):
        assert render._render(other, "-", pipe_qk=True) == render._render(other, "-")


def test_host_cost_cpu_stubbed_counts_the_launches_of_a_call():
    """benchmarks/host_cost.py --cpu-stubbed (flashgen's own host path per call, kernel
    launches stubbed): one launch forward, three forward+backward (fwd, dQ, dK/dV), and
    the interpreter's launcher is restored afterwards."""
    import triton.runtime.interpreter as interp

    real = interp.GridExecutor.__call__
    r = _bench_script("host_cost").cpu_stubbed(n=5)
    assert interp.GridExecutor.__call__ is real
    assert r["forward (no grad)"]["launches"] == 1 and r["forward (no grad)"]["kernels"] == ["attn_fwd"]
    fb = r["forward+backward"]
    assert fb["launches"] == 3 and fb["kernels"] == ["attn_bwd_dkdv", "attn_bwd_dq", "attn_fwd"]
    assert all(x["us"] > 0 for x in r.values())


def test_host_cost_cpu_plans_replays_the_launches_of_a_call():
    """benchmarks/host_cost.py --cpu-plans (flashgen's own host path per call with plans
    and recipes as on a GPU, launches faked): the forward kernels' path replays one
    launch per call, the flash-decoding form two (split and combine kernels), through
    the transformers integration too; what it patched is restored."""
    from flashgen import library, plans

    usable, use_kernels = plans.usable, library.use_kernels
    r = _bench_script("host_cost").cpu_plans(n=5)
    assert plans.usable is usable and library.use_kernels is use_kernels
    assert all(x["us"] > 0 for x in r.values())
    assert {x["replays"] for name, x in r.items() if "forward kernels" in name} == {1}
    assert {x["replays"] for name, x in r.items() if "flash-decoding" in name} == {2}


def test_a_new_exact_size_of_a_known_key_asks_the_dispatcher_once(monkeypatch):
    """A generation loop's seqlen_k grows by one key per step: every step is a new exact
    size of the same ProblemKey, whose answer the fast table holds (per interpreter
    mode, since the module loaded depends on it)."""
    disp = dispatch.default_dispatcher()
    disp.clear()
    asked = []
    real = disp.choose
    monkeypatch.setattr(disp, "choose", lambda key, **kw: asked.append(key) or real(key, **kw))
    q = torch.randn(1, 4, 1, 16, dtype=F16)
    for sk in (40, 41, 42):
        k = torch.randn(1, 2, sk, 16, dtype=F16)
        library.kernel_for("fwd", q, k, k, "none")
    assert len(asked) == 1 and len(set(asked)) == 1
    monkeypatch.setenv("TRITON_INTERPRET", "0" if library.interpreting() else "1")
    library.kernel_for("fwd", q, torch.randn(1, 2, 43, 16, dtype=F16), torch.randn(1, 2, 43, 16, dtype=F16), "none")
    assert len(asked) == 2 and asked[1] == asked[0]
    disp.clear()

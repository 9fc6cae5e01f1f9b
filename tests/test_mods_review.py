"""Score mods, dropout, SDPA serving and tuning-row identity at their edges: a soft cap
far above the scores, a bias whose column offsets pass int32, dropout_mask's argument
checks, dropout where the kernels do not run (SDPA falls back, attention fails before
the state moves), the default dropout state under inference_mode and torch.compile,
attn_mask on another device, migrate_text_hashes with score-mod rows, and finite
scores past float32's base-2 range."""

import shutil
import sqlite3

import pytest
import torch
import torch.nn.functional as F

import flashgen
from flashgen import InputError, dropout, reference, render
from test_mods import _qkv as _mods_qkv

pytestmark = pytest.mark.usefixtures("hermetic_dispatcher")
F16, F32 = torch.float16, torch.float32


def _qkv(h=2, sq=20, sk=20, dtype=F32, **kw):
    return _mods_qkv(h=h, sq=sq, sk=sk, dtype=dtype, **kw)


@pytest.mark.parametrize("softcap", [1e4, 1e30])
def test_a_soft_cap_far_above_the_scores_is_exact(softcap):
    """tanh(s / softcap) for tiny arguments: 1 - 2 / (e^(2x) + 1) cancelled (softcap 1e4:
    errors of 5e-4 in float32; 1e30: every score 0, uniform attention)."""
    q, k, v = _qkv()
    o, lse = flashgen.attention(q, k, v, softcap=softcap, causal=True, return_lse=True)
    do = torch.randn_like(o)
    o.backward(do)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    ro, rlse, _ = reference.forward(qd, kd, vd, causal=True, softcap=softcap)
    grads = reference.backward(do, qd, kd, vd, causal=True, softcap=softcap)
    for got, want in zip((o.detach(), lse, q.grad, k.grad, v.grad), (ro, rlse, *grads)):
        assert reference.max_error(got, want) < 1e-5


def test_bias_column_offsets_past_int32():
    """A bias view whose column stride times the column index passes 2**31 (a permuted
    layout of a large bias): the kernel's address arithmetic wrapped in int32 and read
    elsewhere (here: the NaNs at the start of the storage; out of bounds in general)."""
    sq, sk = 4, 3
    try:
        store = torch.empty(2**32 + 64, dtype=F16)  # 8 GiB of address space, a few pages touched
    except RuntimeError:
        pytest.skip("cannot reserve 8 GiB of address space")
    store[:64] = float("nan")  # where a wrapped offset lands
    bias = store.as_strided((sq, sk), (1, 2**30), 2**31 + 16)
    vals = torch.randn(sq, sk).to(F16)
    bias.copy_(vals)
    q, k, v = _qkv(b=1, h=1, hk=1, sq=sq, sk=sk, dtype=F16, grad=False)
    o = flashgen.attention(q, k, v, bias=bias)
    ref, _, _ = reference.forward(q, k, v, bias=vals)
    assert reference.max_error(o, ref) < 2e-3


@pytest.fixture
def fresh_dropout_state(monkeypatch):
    """flashgen's own dropout stream (flashgen.manual_seed(9)) with no state made yet."""
    monkeypatch.setattr(dropout, "_states", {})
    monkeypatch.setattr(dropout, "_seed", [9])
    monkeypatch.setattr(dropout, "_own", [True])


def test_default_state_made_under_inference_mode_advances_outside_it(fresh_dropout_state):
    q, k, v = _qkv(sq=9, sk=13, grad=False)
    with torch.inference_mode():
        flashgen.attention(q, k, v, dropout_p=0.3)
        flashgen.scaled_dot_product_attention(q, k, v, dropout_p=0.3)
    # made as an inference tensor, the in-place advance outside inference_mode raised
    flashgen.attention(q, k, v, dropout_p=0.3)
    assert dropout.default_state(q.device).tolist() == [9, 3 * dropout.counters(1, 2, 9, 13)]
    flashgen.manual_seed(4)
    assert dropout.default_state(q.device).tolist() == [4, 0]


def test_compiled_first_use_of_the_default_dropout_state(fresh_dropout_state):
    """The state made inside a fullgraph trace (it read torch.initial_seed() there)."""
    q, k, v = _qkv(sq=9, sk=13)

    def f(q, k, v):
        return flashgen.attention(q, k, v, dropout_p=0.3)

    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    assert dropout.default_state(q.device).tolist() == [9, dropout.counters(1, 2, 9, 13)]
    want = flashgen.attention(q, k, v, dropout_p=0.3, rng_state=torch.tensor([9, 0]))
    assert torch.equal(got, want)
    got.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()



def test_reseeding_flashgens_stream_reuses_the_compiled_graph():
    """flashgen.manual_seed(seed) for ten seeds around a fullgraph-compiled dropout call:
    one graph (and one more once the state exists), each call equal to eager under the
    same seed (the seed's value was guarded on: a graph per seed, and the recompile
    limit raised at the eighth)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    q, k, v = _qkv(sq=9, sk=13)

    def f(q, k, v):
        return flashgen.attention(q, k, v, dropout_p=0.3)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(f, fullgraph=True, backend=counter)
    for seed in range(10):
        flashgen.manual_seed(seed)
        got = compiled(q, k, v)
        flashgen.manual_seed(seed)
        assert torch.equal(got, f(q, k, v)), seed
    assert counter.frame_count <= 2, counter.frame_count

def _dropout_grads(fn, seed, n=1):
    """Outputs and dQ, dK, dV of ``n`` calls of ``fn`` after torch.manual_seed(seed)."""
    torch.manual_seed(seed)
    q, k, v = (t.detach().requires_grad_() for t in _qkv(sq=24, sk=24, grad=False))
    outs = [fn(q, k, v) for _ in range(n)]
    sum(o.square().sum() for o in outs).backward()
    return [o.detach() for o in outs] + [q.grad, k.grad, v.grad]


def test_default_dropout_draws_from_torchs_generator():
    """Without rng_state= (and no flashgen.manual_seed) a call's (seed, offset) comes from
    torch's generator: torch.manual_seed reproduces it, consecutive calls differ, and
    it is the mask flashgen.dropout_mask gives for the state dropout.draw makes."""
    q, k, v = _qkv(sq=9, sk=13, grad=False)
    torch.manual_seed(5)
    a, b = (flashgen.attention(q, k, v, dropout_p=0.3) for _ in range(2))
    torch.manual_seed(5)
    assert torch.equal(flashgen.attention(q, k, v, dropout_p=0.3), a) and not torch.equal(a, b)
    torch.manual_seed(5)
    state = dropout.draw(q.device, dropout.counters(1, 2, 9, 13))
    assert torch.equal(flashgen.attention(q, k, v, dropout_p=0.3, rng_state=state.clone()), a)


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_dropout_recomputes_the_forwards_mask(reentrant):
    """torch.utils.checkpoint restores torch's generator for the recomputed forward, so
    the default dropout's gradients equal the uncheckpointed ones (flashgen's own stream
    drew the next mask there: gradients off by up to 5.9)."""
    from torch.utils.checkpoint import checkpoint

    def f(q, k, v):
        return flashgen.attention(q, k, v, dropout_p=0.3)

    plain = _dropout_grads(f, 11)
    ckpt = _dropout_grads(lambda *t: checkpoint(f, *t, use_reentrant=reentrant), 11)
    assert all(torch.equal(x, y) for x, y in zip(plain, ckpt))


def test_compiled_dropout_with_a_state_recomputes_the_forwards_mask():
    """Compiled by inductor, a clone and in-place advance of the state left the saved
    state the advanced one (dQ, dK off by 4-6; two calls before one backward raised
    torch's version-counter error): the advance is an op that declares its mutation."""
    def f(q, k, v, state):
        return flashgen.attention(q, k, v, dropout_p=0.3, rng_state=state)

    for n in (1, 2):
        st = torch.tensor([17, 0])
        eager = _dropout_grads(lambda q, k, v: f(q, k, v, st), 2, n)
        st2 = torch.tensor([17, 0])
        comp = torch.compile(f)
        got = _dropout_grads(lambda q, k, v: comp(q, k, v, st2), 2, n)
        assert all(torch.equal(x, y) for x, y in zip(eager, got))
        assert torch.equal(st, st2)


_ST = torch.tensor([1, 2])


@pytest.mark.parametrize("args, match", [
    ((torch.tensor([1, 0, 2])[::2], 1, 1, 4, 4, 0.5), "rng_state must be contiguous"),  # read [1, 0] before
    ((torch.tensor([1, 2], dtype=torch.int32), 1, 1, 4, 4, 0.5), "rng_state must be an int64"),
    ((torch.tensor([1, 2, 3]), 1, 1, 4, 4, 0.5), r"shape \(2,\)"),
    (([1, 2], 1, 1, 4, 4, 0.5), "rng_state must be an int64 tensor"),
    ((_ST, -1, 1, 4, 4, 0.5), "batch must be an int >= 0"),
    ((_ST, 1, 1, 4.0, 4, 0.5), "seqlen_q must be an int >= 0"),
    ((_ST, 1, 1, 4, 4, 1.5), r"dropout_p must be a real in \[0, 1\)"),
    ((_ST, 1, 1, 4, 4, -0.1), r"dropout_p must be a real in \[0, 1\)"),
])
def test_dropout_mask_checks_its_arguments(args, match):
    with pytest.raises(InputError, match=match):
        flashgen.dropout_mask(*args)


def test_dropout_mask_takes_the_integers_its_checks_accept():
    """numpy integers pass the size checks (numbers.Integral): they are sizes like any
    int, not a TypeError from the kernel launch."""
    import numpy as np

    want = flashgen.dropout_mask(_ST, 1, 2, 3, 5, 0.5)
    got = flashgen.dropout_mask(_ST, np.int64(1), np.int32(2), np.int64(3), np.int64(5), np.float32(0.5))
    assert got.shape == (1, 2, 3, 5) and torch.equal(got, want)


def test_dropout_mask_on_the_cpu_outside_the_interpreter_says_so(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(InputError, match="TRITON_INTERPRET=1"):
        flashgen.dropout_mask(torch.tensor([1, 2]), 1, 1, 4, 4, 0.5)
    assert flashgen.dropout_mask(torch.tensor([1, 2]), 0, 1, 4, 4, 0.5).shape == (0, 1, 4, 4)


@pytest.mark.parametrize("interpret, dtype", [("0", F32), ("1", torch.bfloat16)])
def test_sdpa_dropout_where_the_kernels_do_not_run_is_torchs(interpret, dtype, monkeypatch):
    """The reference path has no dropout: SDPA hands the call to torch (as its
    docstring promises for what flashgen cannot serve) instead of raising."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    q, k, v = _qkv(sq=9, sk=13, dtype=dtype, grad=False)
    torch.manual_seed(5)
    want = F.scaled_dot_product_attention(q, k, v, dropout_p=0.3, is_causal=True)
    torch.manual_seed(5)
    got = flashgen.scaled_dot_product_attention(q, k, v, dropout_p=0.3, is_causal=True)
    assert torch.equal(got, want)
    why = flashgen.explain(q, k, v, sdpa=True, dropout_p=0.3)
    assert why.backend == "torch-sdpa-fallback" and "dropout_p" in why.reason
    assert flashgen.explain(q, k, v, sdpa=True).backend == "flashgen"


def test_a_failed_dropout_call_leaves_the_state_alone():
    q, k, v = _qkv(dtype=torch.bfloat16, grad=False)  # bf16 in the interpreter: the reference path
    st = torch.tensor([1, 2])
    with pytest.raises(InputError, match="dropout_p > 0 runs in the Triton kernels only"):
        flashgen.attention(q, k, v, dropout_p=0.3, rng_state=st)
    assert st.tolist() == [1, 2]


def test_sdpa_attn_mask_on_another_device_is_torchs():
    q, k, v = _qkv(sq=4, sk=4, grad=False)
    mask = torch.randn(4, 4, device="meta")
    assert "attn_mask on meta" in flashgen.explain(q, k, v, sdpa=True, attn_mask=mask).reason
    try:
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    except RuntimeError as e:  # torch's own error, unchanged
        with pytest.raises(RuntimeError) as got:
            flashgen.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        assert str(got.value) == str(e)
    else:
        got = flashgen.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        assert (got.device, got.shape) == (want.device, want.shape)


def test_migrating_text_hashes_leaves_score_mod_rows(tmp_path):
    """migrate_text_hashes compares the probes of mods "" only: a row with score mods
    under the old text hash must not be relabelled with the plain code hash (the
    dispatcher would then serve it as current)."""
    from flashgen.db import TuningDB
    from flashgen.env import Environment
    from flashgen.spec import KernelSpec, Measurement, Shape, TileConfig, Variant

    env = Environment("NVIDIA H200", "9.0", 132, "3.6.0", "2.11", "0.1.0")
    shape, cfg = Shape(2, 16, 16, 2048, 2048), TileConfig(128, 64, 8, 2)
    path = tmp_path / "t.sqlite"
    keys = {}
    with TuningDB(path) as db:
        for mods in ("", "bias"):
            spec = KernelSpec("fwd", "bfloat16", 128, 128, "causal", mods)
            keys[mods] = shape.key(spec).id
            db.record(shape.key(spec), shape, Variant(spec, cfg), Measurement("ok", 1.0), env, 0)
    with sqlite3.connect(path) as con:  # rows as flashgen before code hashes wrote them
        con.execute("UPDATE measurements SET template_hash = ?", (render.text_hash("fwd"),))
    old = tmp_path / "old"
    shutil.copytree(render.templates_dir(), old)
    with TuningDB(path) as db:
        assert db.migrate_text_hashes(old)["fwd"] == 1
        served = db.best_configs(env)
        hashes = dict(db._conn.execute("SELECT mods, template_hash FROM measurements"))
    assert keys[""] in served and keys["bias"] not in served
    assert hashes == {"": render.template_hash("fwd"), "bias": render.text_hash("fwd")}


def test_migrating_from_templates_that_predate_a_kernel(tmp_path):
    """Templates from before the varlen and decode kernels (an old checkout): those
    kernels have nothing to carry (-1), the others still migrate (it raised
    TemplateNotFound)."""
    from flashgen.db import TuningDB

    old = tmp_path / "old"
    shutil.copytree(render.templates_dir(), old)
    for f in [*old.glob("*varlen*"), *old.glob("attn_decode*")]:
        f.unlink()
    with TuningDB(tmp_path / "t.sqlite") as db:
        out = db.migrate_text_hashes(old)
    assert out == {"fwd": 0, "bwd_dkdv": 0, "bwd_dq": 0, "fwd_varlen": -1, "bwd_dkdv_varlen": -1,
                   "bwd_dq_varlen": -1, "decode": -1, "decode_paged": -1}


@pytest.mark.filterwarnings("ignore:overflow encountered in exp2:RuntimeWarning")  # masked-out padding
def test_finite_scores_beyond_the_base_2_range_are_scores_not_masks():
    """A float32 bias of finfo.min (the usual additive padding mask) or above 2.36e38:
    s * log2(e) overflowed, a finfo.min row came out as fully masked (O = 0, LSE =
    -inf; torch and the docstring: a finite score takes part) and a huge positive
    entry made the row NaN.  The kernels now agree with torch's SDPA in float32."""
    q, k, v = _qkv(h=1, hk=1, sq=3, sk=5)
    bias = torch.zeros(3, 5)
    bias[0] = torch.finfo(F32).min  # every key equally, very unlikely
    bias[1, 2] = 3e38  # one key dominates
    o = flashgen.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    do = torch.randn_like(o)
    got = [o.detach(), *torch.autograd.grad(o, (q, k, v), do)]
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)  # float32 math
    want = [ref.detach(), *torch.autograd.grad(ref, (q, k, v), do)]
    for a, b in zip(got, want):
        assert torch.isfinite(a).all() and (a - b).abs().max() < 1e-5
    assert torch.allclose(got[0][0, 0, 0], v[0, 0].mean(0), atol=1e-5)
    assert torch.allclose(got[0][0, 0, 1], v[0, 0, 2], atol=1e-5)


@pytest.mark.parametrize("interpret", ["0", "1"])
@pytest.mark.parametrize("how", ["bias", "score_mod"])
def test_a_positive_infinite_score_is_the_highest_score_on_every_path(interpret, how, monkeypatch):
    """+inf in a bias (or from a score_mod) is a score clamped to 2.3e38, as the
    docstring says: the row puts all its weight on that key and LSE = 2.3e38.  The
    reference path (no GPU, no interpreter) took it as +inf: O inf / NaN, LSE +inf."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    q, k, v = _qkv(h=1, hk=1, sq=4, sk=4, dtype=F16)
    kw = dict(bias=torch.zeros(4, 4, dtype=F16).fill_diagonal_(float("inf"))) if how == "bias" else \
        dict(score_mod=lambda s, b, h, i, j: torch.where(i == j, float("inf"), s))
    o, lse = flashgen.attention(q, k, v, return_lse=True, **kw)
    assert torch.equal(o, v) and torch.equal(lse, torch.full_like(lse, 2.3e38))

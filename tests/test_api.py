"""flashgen.attention on CPU: input errors, empty inputs, the interpreter path against the
float64 reference (GQA, causal with seqlen_q > seqlen_k, odd strides, scale 0), the
reference path without the interpreter, and determinism."""

import os

import pytest
import torch

import flashgen
from flashgen import InputError, ops, reference

F16 = torch.float16


pytestmark = pytest.mark.usefixtures("hermetic_dispatcher")


_err = reference.max_error


def _close(name, got, ref64, base, floor=2e-3):
    """FlashAttention's rule: err <= 2 * err(torch at the input dtype) + floor."""
    assert got.shape == ref64.shape, (name, got.shape, ref64.shape)
    assert not torch.isnan(got).any(), f"{name}: NaN"
    err, base_err = _err(got, ref64), _err(base, ref64)
    assert err <= 2 * base_err + floor, f"{name}: err {err:.3g} > 2 x {base_err:.3g} + {floor}"


def _run(q, k, v, do, **kw):
    """O, LSE and (dQ, dK, dV) from flashgen.attention."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    o, lse = flashgen.attention(q, k, v, return_lse=True, **kw)
    o.backward(do)
    return o.detach(), lse, (q.grad, k.grad, v.grad)


def _check_against_reference(q, k, v, do, o, lse, grads, *, causal=False, window=(-1, -1), softmax_scale=None):
    rkw = dict(causal=causal, window=window, softmax_scale=softmax_scale)
    ro, rlse, _ = reference.forward(q, k, v, **rkw)
    bo, blse, _ = reference.forward(q, k, v, dtype=q.dtype, **rkw)
    _close("O", o, ro, bo)
    assert o.dtype == q.dtype and lse.dtype == torch.float32
    _close("LSE", lse, rlse, blse.float())
    rg = reference.backward(do, q, k, v, **rkw)
    bg = reference.backward(do, q, k, v, dtype=q.dtype, **rkw)
    for name, g, r, b in zip(("dQ", "dK", "dV"), grads, rg, bg):
        assert g.dtype == q.dtype
        _close(name, g, r, b)


def _rand(*shape, dtype=F16):
    return torch.randn(*shape, dtype=dtype)


# -- errors -------------------------------------------------------------------------

def _qkv(b=1, h=2, hk=2, sq=8, sk=8, d=16, dv=None, dtype=F16):
    return _rand(b, h, sq, d, dtype=dtype), _rand(b, hk, sk, d, dtype=dtype), _rand(b, hk, sk, dv or d, dtype=dtype)


@pytest.mark.parametrize("make, kw, pattern", [
    (lambda: (_rand(2, 8, 16), *_qkv()[1:]), {}, r"^q must have 4 dims"),
    (lambda: (_qkv()[0], _rand(1, 2, 8, 16, dtype=torch.float32), _qkv()[2]), {}, r"k\.dtype"),
    (lambda: (*_qkv()[:2], _rand(1, 2, 8, 16, dtype=torch.bfloat16)), {}, r"v\.dtype"),
    (lambda: _qkv(h=6, hk=4), {}, r"num_heads.*\b6\b.*num_kv_heads.*\b4\b"),
    (lambda: _qkv(h=0, hk=0), {}, r"num_kv_heads of k/v is 0: it must be at least 1"),
    (lambda: _qkv(d=12), {}, r"multiple of 8"),
    (lambda: _qkv(dv=300), {}, r"v head_dim.*multiple of 8.*300"),
    (lambda: _qkv(), {"window": (-2, 0)}, r"window"),
    (lambda: _qkv(), {"window": (1, 2, 3)}, r"window"),
    (lambda: _qkv(), {"softmax_scale": "0.1"}, r"softmax_scale"),
    (lambda: (_qkv()[0].int(), *_qkv()[1:]), {}, r"q\.dtype"),
    (lambda: (_qkv()[0], "k", _qkv()[2]), {}, r"^k must be a torch\.Tensor"),
], ids=["q_rank", "k_dtype", "v_dtype", "gqa_heads", "no_kv_heads", "head_dim_12", "head_dim_v_300", "window_neg",
        "window_triple", "scale_str", "q_int", "k_not_tensor"])
def test_errors_name_the_argument(make, kw, pattern):
    q, k, v = make()
    with pytest.raises(InputError, match=pattern) as exc:
        flashgen.attention(q, k, v, **kw)
    assert isinstance(exc.value, ValueError) and isinstance(exc.value, flashgen.FlashgenError)


def test_valid_inputs_raise_nothing(monkeypatch):
    # the same inputs as above with the offending argument fixed (reference path: fast)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for q, k, v in (_qkv(h=6, hk=3), _qkv(d=24), _qkv(dv=32)):
        assert flashgen.attention(q, k, v, window=(0, 0)).shape == (*q.shape[:3], v.shape[3])


# -- empty inputs ---------------------------------------------------------------------

@pytest.mark.parametrize("b, h, sq, sk", [(0, 2, 8, 8), (1, 2, 0, 8), (1, 2, 8, 0), (2, 0, 8, 8)])
@pytest.mark.parametrize("interpret", ["1", "0"])
def test_empty_inputs(b, h, sq, sk, interpret, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    monkeypatch.setattr(ops, "fwd", lambda *a, **k: pytest.fail("launched a kernel on an empty input"))
    hk = h // 2 if h else 1
    q = _rand(b, h, sq, 16).requires_grad_()
    k = _rand(b, hk, sk, 16).requires_grad_()
    v = _rand(b, hk, sk, 24).requires_grad_()
    o, lse = flashgen.attention(q, k, v, causal=True, return_lse=True)
    assert o.shape == (b, h, sq, 24) and o.dtype == F16 and lse.shape == (b, h, sq) and lse.dtype == torch.float32
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    assert torch.equal(o, torch.zeros_like(o))
    assert torch.equal(lse, torch.full_like(lse, float("-inf")))
    assert flashgen.attention(q, k, v).shape == o.shape  # without return_lse: O only
    (o.float().sum() + 1.0).backward()
    for t in (q, k, v):
        assert t.grad is not None and t.grad.shape == t.shape and t.grad.dtype == t.dtype
        assert torch.equal(t.grad, torch.zeros_like(t))


# -- the interpreter path (TRITON_INTERPRET=1, set by conftest) -----------------------

def test_interpreter_is_on():
    assert os.environ.get("TRITON_INTERPRET") == "1"


def test_gqa_matches_reference():
    torch.manual_seed(1)
    b, h, hk, sq, sk, d = 1, 4, 2, 29, 37, 32
    q, k, v, do = _rand(b, h, sq, d), _rand(b, hk, sk, d), _rand(b, hk, sk, d), _rand(b, h, sq, d)
    o, lse, grads = _run(q, k, v, do)
    assert grads[1].shape == k.shape and grads[2].shape == v.shape
    _check_against_reference(q, k, v, do, o, lse, grads)


def test_causal_seqlen_q_longer_than_seqlen_k():
    torch.manual_seed(2)
    b, h, sq, sk, d = 1, 2, 45, 21, 32
    q, k, v, do = _rand(b, h, sq, d), _rand(b, h, sk, d), _rand(b, h, sk, d), _rand(b, h, sq, d)
    o, lse, grads = _run(q, k, v, do, causal=True)
    blind = sq - sk  # rows 0..23 see no key (bottom-right alignment)
    assert torch.equal(o[:, :, :blind], torch.zeros_like(o[:, :, :blind]))
    assert torch.isneginf(lse[:, :, :blind]).all() and torch.isfinite(lse[:, :, blind:]).all()
    for g in grads:
        assert torch.isfinite(g).all()
    assert torch.equal(grads[0][:, :, :blind], torch.zeros_like(grads[0][:, :, :blind]))
    _check_against_reference(q, k, v, do, o, lse, grads, causal=True)


def test_transposed_view_input():
    torch.manual_seed(3)
    b, h, s, d = 2, 2, 23, 40  # (b, s, h, d) storage; head_dim 40 is padded to 64
    q, k, v = (_rand(b, s, h, d).transpose(1, 2) for _ in range(3))
    assert not q.is_contiguous() and q.stride(-1) == 1
    do = _rand(b, h, s, d)
    o, lse, grads = _run(q, k, v, do, window=(5, 3))
    _check_against_reference(q, k, v, do, o, lse, grads, window=(5, 3))
    o2 = flashgen.attention(q.contiguous(), k.contiguous(), v.contiguous(), window=(5, 3))
    assert torch.equal(o, o2)


def test_last_dim_strided_input():
    torch.manual_seed(4)
    b, h, sq, sk, d = 1, 2, 19, 27, 16
    q, k, v = _rand(b, h, sq, 2 * d)[..., ::2], _rand(b, h, sk, 2 * d)[..., ::2], _rand(b, h, sk, 2 * d)[..., ::2]
    assert q.stride(-1) == 2
    do = _rand(b, h, sq, 2 * d)[..., ::2]  # the incoming gradient strided as well
    o, lse, grads = _run(q, k, v, do, causal=True)
    _check_against_reference(q, k, v, do, o, lse, grads, causal=True)


def test_softmax_scale_zero_is_uniform():
    torch.manual_seed(5)
    b, h, s, d = 1, 2, 24, 16
    q, k, v, do = _rand(b, h, s, d), _rand(b, h, s, d), _rand(b, h, s, d), _rand(b, h, s, d)
    o, lse, grads = _run(q, k, v, do, causal=True, softmax_scale=0.0)
    # row i averages the first i + 1 values; its LSE is log(i + 1)
    avg = v.double().cumsum(2) / torch.arange(1, s + 1, dtype=torch.float64)[:, None]
    assert (o.double() - avg).abs().max().item() < 2e-3
    assert torch.allclose(lse.double(), torch.log(torch.arange(1, s + 1, dtype=torch.float64)).expand(b, h, s),
                          atol=1e-5)
    assert torch.equal(grads[0], torch.zeros_like(grads[0]))  # dQ = 0 * dS K
    _check_against_reference(q, k, v, do, o, lse, grads, causal=True, softmax_scale=0.0)


def test_negative_softmax_scale():
    torch.manual_seed(8)
    b, h, sq, sk, d = 1, 2, 21, 30, 16
    q, k, v, do = _rand(b, h, sq, d), _rand(b, h, sk, d), _rand(b, h, sk, d), _rand(b, h, sq, d)
    o, lse, grads = _run(q, k, v, do, window=(4, 1), softmax_scale=-0.4)
    _check_against_reference(q, k, v, do, o, lse, grads, window=(4, 1), softmax_scale=-0.4)


def test_deterministic():
    torch.manual_seed(6)
    b, h, hk, s, d = 1, 4, 1, 33, 16
    q, k, v, do = _rand(b, h, s, d), _rand(b, hk, s, d), _rand(b, hk, s, d), _rand(b, h, s, d)
    runs = [_run(q, k, v, do, causal=True) for _ in range(2)]
    (o1, l1, g1), (o2, l2, g2) = runs
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    for a, b_ in zip(g1, g2):
        assert torch.equal(a, b_)


# -- the reference path (no interpreter) ----------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_reference_path_without_interpreter(monkeypatch, dtype):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(ops, "fwd", lambda *a, **k: pytest.fail("kernel launched without the interpreter"))
    monkeypatch.setattr(ops, "bwd", lambda *a, **k: pytest.fail("kernel launched without the interpreter"))
    torch.manual_seed(7)
    b, h, hk, sq, sk, d, dv = 2, 4, 2, 45, 21, 24, 40
    q, k, v, do = (_rand(b, h, sq, d, dtype=dtype), _rand(b, hk, sk, d, dtype=dtype),
                   _rand(b, hk, sk, dv, dtype=dtype), _rand(b, h, sq, dv, dtype=dtype))
    for kw in (dict(causal=True), dict(window=(6, 2)), dict(softmax_scale=0.3)):
        o, lse, grads = _run(q, k, v, do, **kw)
        _check_against_reference(q, k, v, do, o, lse, grads, **kw)
        o2, lse2, grads2 = _run(q, k, v, do, **kw)
        assert torch.equal(o, o2) and all(torch.equal(x, y) for x, y in zip(grads, grads2))


def test_lse_in_the_loss_leaves_the_gradients_of_o_alone():
    """LSE is not differentiable and its incoming gradient is never materialized: a
    loss that also adds LSE gives the same gradients as the loss on O alone."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 16, dtype=torch.float16, requires_grad=True) for _ in range(3))
    w = torch.randn(1, 2, 16, 16, dtype=torch.float16)
    grads = []
    for with_lse in (False, True):
        o, lse = flashgen.attention(q, k, v, causal=True, return_lse=True)
        ((o * w).float().sum() + (lse.sum() if with_lse else 0)).backward()
        grads.append([t.grad.clone() for t in (q, k, v)])
        q.grad = k.grad = v.grad = None
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("interpret", ["1", "0"])
def test_a_window_side_wider_than_any_sequence_hides_nothing(interpret, monkeypatch):
    """A window side of sys.maxsize (or beyond int64) lets every key through on that
    side, as -1 does: the same output on the kernel and the reference path, dense and
    ragged, never an integer overflow in the kernels' bounds."""
    import sys

    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 16) for _ in range(3))
    for wide, same in (((0, sys.maxsize), (0, -1)), ((sys.maxsize, sys.maxsize), (-1, -1)),
                       ((2**64, 3), (-1, 3)), ((sys.maxsize, 0), (-1, 0))):
        torch.testing.assert_close(flashgen.attention(q, k, v, window=wide), flashgen.attention(q, k, v, window=same),
                                   rtol=0, atol=0, msg=f"window={wide}")
        cu = torch.tensor([0, 15, 40], dtype=torch.int32)
        packed = [t[0].transpose(0, 1) for t in (q, k, v)]
        torch.testing.assert_close(flashgen.attention_varlen(*packed, cu, cu, 25, 25, window=wide),
                                   flashgen.attention_varlen(*packed, cu, cu, 25, 25, window=same),
                                   rtol=0, atol=0, msg=f"varlen window={wide}")


def test_forward_mode_derivatives_raise_instead_of_a_zero_tangent():
    """flashgen's ops have no forward-mode formula: jvp, jacfwd and forward_ad dual
    tensors gave a tangent of exactly 0.  They raise; the SDPA entry hands them to torch."""
    import torch.autograd.forward_ad as fwad
    from torch.func import jacfwd, jvp

    q, k, v = (torch.randn(1, 2, 8, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    t = torch.randn_like(q)
    for fn in (lambda a: flashgen.attention(a, k, v), lambda a: flashgen.attention(a, k, v, softcap=5.0),
               lambda a: flashgen.attention_varlen(a[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
                                                   *(torch.tensor([0, 8], dtype=torch.int32),) * 2, 8, 8)):
        with pytest.raises(flashgen.UnsupportedError, match="no forward-mode derivative"):
            jvp(fn, (q,), (t,))
        with pytest.raises(flashgen.UnsupportedError, match="no forward-mode derivative"):
            jacfwd(fn)(q)
        with fwad.dual_level(), pytest.raises(flashgen.UnsupportedError, match="no forward-mode derivative"):
            fn(fwad.make_dual(q, t))
    # the SDPA entry: torch's SDPA, as called directly (torch's CPU flash kernel raises its own error here)
    sdpa = (flashgen.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention)
    outcome = []
    for f in sdpa:
        try:
            outcome.append(jvp(lambda a: f(a, k, v, is_causal=True), (q,), (t,))[1])
        except NotImplementedError as e:
            outcome.append(type(e))
    assert outcome[0] is outcome[1] if isinstance(outcome[1], type) else torch.allclose(outcome[0], outcome[1])
    tab = torch.randn(8)
    with fwad.dual_level(), pytest.raises(flashgen.UnsupportedError, match="no forward-mode derivative"):
        dual = fwad.make_dual(tab, torch.ones(8))  # a tangent on a tensor the score function reads
        flashgen.attention(q, k, v, score_mod=lambda s, b, h, i, j: s + dual[i])
    assert flashgen.attention(q, k, v).shape == q.shape  # no transform: runs


def test_reverse_mode_transforms_raise_flashgens_error_and_sdpa_hands_them_to_torch():
    """torch.func's grad, vjp and jacrev (and vmap over grad, grad over vmap) through
    flashgen's ops failed inside torch ("it must override the setup_context
    staticmethod"); they raise UnsupportedError naming the transform, the SDPA entry
    hands them to torch's SDPA, and a grad that does not track the inputs still runs."""
    from torch.func import grad, jacrev, vjp, vmap

    q, k, v = (torch.randn(1, 2, 8, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    qs = torch.randn(3, *q.shape)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    packed = [t[0].transpose(0, 1) for t in (k, v)]
    fns = (lambda a: flashgen.attention(a, k, v), lambda a: flashgen.attention(a, k, v, softcap=5.0),
           lambda a: flashgen.attention(a, k, v, score_mod=lambda s, b, h, i, j: s * 0.5),
           lambda a: flashgen.attention_varlen(a[0].transpose(0, 1), *packed, cu, cu, 8, 8))
    for fn in fns:
        for how in (lambda: grad(lambda a: fn(a).sum())(q), lambda: vjp(fn, q), lambda: jacrev(fn)(q),
                    lambda: vmap(grad(lambda a: fn(a).sum()))(qs),
                    lambda: grad(lambda a: vmap(lambda b: fn(b).sum())(a).sum())(qs)):
            with pytest.raises(flashgen.UnsupportedError, match="torch.func's grad, vjp or jacrev"):
                how()
    assert vmap(fns[0])(qs).shape == qs.shape  # vmap alone runs
    x = torch.randn(3)
    assert torch.equal(grad(lambda a: a.sum() + fns[0](q).sum())(x), torch.ones(3))  # untracked inputs run
    sdpa = (flashgen.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention)
    ours, torchs = (grad(lambda a, f=f: f(a, k, v, is_causal=True).sum())(q) for f in sdpa)
    torch.testing.assert_close(ours, torchs, rtol=0, atol=0)


def test_varlen_and_kvcache_take_meta_fake_and_vmapped_inputs():
    """Shapes from the ops' fake kernels for meta tensors and under FakeTensorMode (the
    value checks read fake offsets and lengths and raised), and vmap over the decode op
    equal to a loop (it reached the reference code and failed inside torch)."""
    from torch._subclasses import FakeTensorMode

    lens = torch.tensor([5, 9], dtype=torch.int32)
    kv = torch.randn(2, 64, 2, 32, device="meta")
    o = flashgen.attention_with_kvcache(torch.randn(2, 1, 4, 32, device="meta"), kv, kv, cache_seqlens=lens.to("meta"))
    assert o.shape == (2, 1, 4, 32) and o.is_meta
    with FakeTensorMode():
        kv = torch.randn(2, 64, 2, 32)
        o = flashgen.attention_with_kvcache(torch.randn(2, 1, 4, 32), kv, kv,
                                            cache_seqlens=torch.tensor([5, 9], dtype=torch.int32))
        assert o.shape == (2, 1, 4, 32)
        x, cu = torch.randn(20, 4, 32), torch.tensor([0, 8, 20], dtype=torch.int32)
        assert flashgen.attention_varlen(x, x, x, cu, cu, 12, 12).shape == (20, 4, 32)
    g = torch.Generator().manual_seed(0)
    kc, vc = torch.randn(2, 64, 2, 32, generator=g), torch.randn(2, 64, 2, 32, generator=g)
    qs = torch.randn(3, 2, 1, 4, 32, generator=g)
    got = torch.func.vmap(lambda q: flashgen.attention_with_kvcache(q, kc, vc, cache_seqlens=lens))(qs)
    want = torch.stack([flashgen.attention_with_kvcache(q, kc, vc, cache_seqlens=lens) for q in qs])
    torch.testing.assert_close(got, want)

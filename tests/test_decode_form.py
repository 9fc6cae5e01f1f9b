"""The dense forward's flash-decoding form (library.decode_form): flashgen.attention with
a few query rows per kv head over a long k, v (library.DECODE_FORM_RULES) runs
the decode kernel over k and v as a full cache, as FlashAttention's forward does for a
single query.  In Triton's interpreter (float16/float32, small shapes) against float64:
O, LSE and the gradients (the backward is the usual one), every call path (no autograd,
autograd, the op, explain); windows, top-left alignment and score modifications keep the
forward kernels.

Pass rule (FlashAttention's): max |kernel - ref64| <= 2 * max |torch at dtype - ref64|
+ floor.
"""

import pytest
import torch

import flashgen
from flashgen import arch, dispatch, library, reference
from flashgen.dispatch import Dispatcher
from flashgen.env import Environment
from flashgen.families.triton import launch as triton_launch
from flashgen.masks import mask_bounds

F16, F32 = torch.float16, torch.float32
FLOOR = {F16: 2e-3, F32: 2e-5}
SK = library.DECODE_FORM_RULES[0][1] + 13  # off the tiles


@pytest.fixture(autouse=True)
def hermetic_dispatcher():
    dispatch.set_default_dispatcher(Dispatcher([], env=Environment.current(), arch=arch.current()))
    yield
    dispatch.set_default_dispatcher(None)


@pytest.fixture
def up_to_64_rows(monkeypatch):
    """The decode form for up to 64 rows per kv head from SK keys on (the kernel's packed
    tiles up to their largest at the interpreter's sizes; which calls take the form in
    use is test_the_rules_follow_the_measured_crossovers')."""
    monkeypatch.setattr(library, "DECODE_FORM_RULES", ((64, SK, None),))


@pytest.fixture
def decode_calls(monkeypatch):
    """The decode-form launches of the test (one entry per call)."""
    calls = []
    real = triton_launch._fwd_decode_form

    def spy(*a, **kw):
        calls.append(a[0].shape)
        return real(*a, **kw)

    monkeypatch.setattr(triton_launch, "_fwd_decode_form", spy)
    return calls


def _inputs(b, h, hk, sq, sk, d, dtype, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, n, s, d, generator=g).to(dtype) for n, s in ((h, sq), (hk, sk), (hk, sk)))
    # a NaN past seqlen_k in the buffer k and v are sliced from: never read
    kb, vb = (torch.cat([t, torch.full((b, hk, 7, d), float("nan"), dtype=dtype)], 2) for t in (k, v))
    k, v = kb[:, :, :sk], vb[:, :, :sk]
    if grad:
        for t in (q, k, v):
            t.requires_grad_(True)
    return q, k, v


def _within(name, got, ref64, base, floor):
    err, berr = reference.max_error(got, ref64), reference.max_error(base, ref64)
    assert not torch.isnan(got).any(), name
    assert err <= 2 * berr + floor, f"{name}: err {err:.3g} > 2 x {berr:.3g} + {floor}"


@pytest.mark.parametrize("h,hk,sq,causal,dtype", [
    (8, 2, 1, False, F16),   # a decode step, GQA 4
    (8, 2, 1, True, F32),    # causal with one query: every key
    (4, 1, 5, True, F16),    # MQA, a speculative chunk: bottom-right causal rows
    (4, 4, 16, False, F32),  # MHA, 16 rows per kv head
])
def test_short_queries_run_the_decode_kernel_and_match_float64(h, hk, sq, causal, dtype, decode_calls,
                                                              up_to_64_rows):
    """Without autograd, forward-only: O and LSE of the decode form within the rule of
    float64, and the decode kernel ran."""
    q, k, v = _inputs(2, h, hk, sq, SK, 32, dtype)
    mode, lo, hi = mask_bounds(sq, SK, causal=causal, window=(-1, -1))
    assert library.decode_form(q, k, v, mode, lo, hi)
    o, lse = flashgen.attention(q, k, v, causal=causal, return_lse=True)
    assert len(decode_calls) == 1
    scale = 32 ** -0.5
    o64, lse64, _ = reference.forward_bounds(q, k, v, scale, lo, hi)
    ob, lseb, _ = reference.forward_bounds(q, k, v, scale, lo, hi, dtype=dtype)
    assert o.shape == (2, h, sq, 32) and o.is_contiguous() and lse.shape == (2, h, sq)
    _within("O", o, o64, ob, FLOOR[dtype])
    _within("LSE", lse, lse64, lseb.float(), FLOOR[F32])


def test_more_rows_than_one_packed_tile_at_few_heads_match_float64(decode_calls):
    """Up to 256 rows per kv head where batch x num_heads is small (the third rule): 8
    query heads on one kv head x 20 queries = 160 rows, more than one packed tile of the
    decode kernel, bottom-right causal over 4k keys."""
    sk = library.DECODE_FORM_RULES[2][1] + 13
    q, k, v = _inputs(1, 8, 1, 20, sk, 16, F16, seed=7)
    mode, lo, hi = mask_bounds(20, sk, causal=True, window=(-1, -1))
    assert library.decode_form_rule(q, k) == library.DECODE_FORM_RULES[2]
    o, lse = flashgen.attention(q, k, v, causal=True, return_lse=True)
    assert len(decode_calls) == 1
    o64, lse64, _ = reference.forward_bounds(q, k, v, 0.25, lo, hi)
    ob, lseb, _ = reference.forward_bounds(q, k, v, 0.25, lo, hi, dtype=F16)
    _within("O", o, o64, ob, FLOOR[F16])
    _within("LSE", lse, lse64, lseb.float(), FLOOR[F32])


def test_gradients_through_the_decode_form_match_float64(decode_calls):
    """With autograd the forward runs the decode form and saves its O and LSE; the
    backward (the usual kernels) gives dQ, dK, dV within the rule."""
    q, k, v = _inputs(1, 8, 2, 3, SK, 32, F32, grad=True, seed=1)
    do = torch.randn(1, 8, 3, 32, generator=torch.Generator().manual_seed(2))
    o = flashgen.attention(q, k, v, causal=True)
    o.backward(do)
    assert len(decode_calls) == 1
    mode, lo, hi = mask_bounds(3, SK, causal=True, window=(-1, -1))
    scale = 32 ** -0.5
    grads64 = reference.backward_bounds(do, q.detach(), k.detach(), v.detach(), scale, lo, hi)
    base = reference.backward_bounds(do, q.detach(), k.detach(), v.detach(), scale, lo, hi, dtype=F32)
    for name, got, r, b in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), grads64, base):
        _within(name, got, r, b, FLOOR[F32])


def test_the_op_writes_o_in_its_layout_through_the_decode_form(decode_calls):
    """The op (what torch.compile traces) allocates O like q (``out_like``): a q seen
    through transpose(1, 2) gets an O of that memory order, which the decode form writes
    through its strides."""
    q, k, v = _inputs(2, 8, 2, 4, SK, 32, F16, seed=3)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)
    mode, lo, hi = mask_bounds(4, SK, causal=False, window=(-1, -1))
    o, lse = library.FWD(qt, k, v, 32 ** -0.5, mode, lo, hi)
    assert len(decode_calls) == 1 and o.stride() == library.out_like(qt, 32).stride()
    o64, _, _ = reference.forward_bounds(q, k, v, 32 ** -0.5, lo, hi)
    ob, _, _ = reference.forward_bounds(q, k, v, 32 ** -0.5, lo, hi, dtype=F16)
    _within("O", o, o64, ob, FLOOR[F16])


@pytest.mark.parametrize("kw,sq,sk,why", [
    (dict(window=(100, 0)), 1, SK, "a window"),
    (dict(sdpa_causal=True), 4, SK, "top-left causal (scaled_dot_product_attention)"),
    (dict(softcap=30.0), 1, SK, "a score modification"),
    (dict(), 17, SK, "17 x 4 rows per kv head"),
    (dict(), 1, library.DECODE_FORM_RULES[0][1] - 1, "a short seqlen_k"),
])
def test_other_calls_keep_the_forward_kernels(kw, sq, sk, why, decode_calls):
    """Calls outside the decode form run the forward kernels, and stay exact: O within
    the rule of float64 (top-left causal for scaled_dot_product_attention, bottom-right
    for flashgen.attention)."""
    q, k, v = _inputs(1, 8, 2, sq, sk, 32, F32, seed=4)
    softcap = kw.get("softcap", 0.0)
    if kw.pop("sdpa_causal", False):
        o = flashgen.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        _, lo, hi = mask_bounds(sq, sk, causal=True, window=(-1, -1), align="top_left")
    else:
        o = flashgen.attention(q, k, v, **kw)
        _, lo, hi = mask_bounds(sq, sk, causal=False, window=kw.get("window", (-1, -1)))
    assert decode_calls == [], why
    assert o.shape == (1, 8, sq, 32)
    o64, _, _ = reference.forward_bounds(q, k, v, 32 ** -0.5, lo, hi, softcap=softcap)
    ob, _, _ = reference.forward_bounds(q, k, v, 32 ** -0.5, lo, hi, dtype=F32, softcap=softcap)
    _within("O", o, o64, ob, FLOOR[F32])


@pytest.mark.parametrize("b,h,hk,sq,sk,taken", [
    (1, 32, 8, 1, 512, True),       # a decode step: 4 rows per kv head
    (8, 32, 8, 16, 4096, True),     # 64 rows
    (1, 32, 8, 1, 511, False),      # too few keys
    (1, 32, 8, 64, 4096, True),     # 256 rows, batch x heads 32: the forward kernels fill a quarter of the SMs
    (2, 32, 8, 32, 32768, True),    # 128 rows, batch x heads 64
    (1, 32, 8, 64, 4095, False),    # 256 rows over fewer keys
    (8, 32, 8, 32, 32768, True),    # 128 rows at batch x heads 256 over 32k keys
    (8, 32, 8, 32, 4096, False),    # 128 rows at batch x heads 256 over 4k keys
    (8, 32, 8, 64, 32768, False),   # 256 rows at batch x heads 256
    (1, 32, 8, 65, 32768, False),   # 260 rows
])
def test_the_rules_follow_the_measured_crossovers(b, h, hk, sq, sk, taken):
    q = torch.empty(b, h, sq, 128, device="meta")
    k = torch.empty(b, hk, sk, 128, device="meta")
    mode, lo, hi = mask_bounds(sq, sk, causal=True, window=(-1, -1))
    assert library.decode_form(q, k, k, mode, lo, hi) is taken
    assert (library.decode_form_rule(q, k) is not None) is taken


def test_explain_names_the_decode_form():
    q, k, v = (torch.empty(s, device="meta", dtype=torch.bfloat16) for s in ((4, 32, 1, 128), (4, 8, 4096, 128),
                                                                            (4, 8, 4096, 128)))
    e = flashgen.explain(q, k, v, causal=True)
    assert "flash-decoding" in str(e) and e.kernels[0].key.startswith("attn_decode_")
    e = flashgen.explain(q, k, v, window=(128, 0))
    assert "runs as flash-decoding" not in str(e) and e.kernels[0].key.startswith("attn_fwd_")
    assert "not as flash-decoding, which these sizes would take (library.DECODE_FORM_RULES): a window" in str(e)
    e = flashgen.explain(q, k, v, causal=True, softcap=30.0)
    assert "not as flash-decoding" in str(e) and "score modifications (softcap)" in str(e)
    e = flashgen.explain(q, k[:, :, :100], v[:, :, :100], causal=True)  # too few keys: no word of the form
    assert "flash-decoding" not in str(e)


def _softmax_ref64(q, k, v, scale, causal):
    """O and LSE of softmax(q k^T * scale) v in float64, bottom-right causal, each query
    head on its kv head h // group."""
    q, k, v = (t.detach().double() for t in (q, k, v))
    sq, sk = q.shape[2], k.shape[2]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("bhid,bhjd->bhij", q, k) * scale
    if causal:
        i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
        s = s.masked_fill(j - i > sk - sq, float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def _close64(o, lse, q, k, v, scale, causal, tol):
    o64, lse64 = _softmax_ref64(q, k, v, scale, causal)
    assert o.shape == o64.shape and lse.shape == lse64.shape
    assert (o.double() - o64).abs().max().item() < tol
    assert (lse.double() - lse64).abs().max().item() < tol


@pytest.mark.parametrize("b,h,hk,sq,d,dv,causal,dtype", [
    (2, 8, 2, 5, 32, 16, True, F32),    # head_dim_v < head_dim, causal rows of a GQA tile
    (1, 6, 2, 7, 40, 24, True, F32),    # head dims off the powers of two
    (3, 4, 1, 16, 8, 8, False, F16),    # MQA, the smallest head dim
    (1, 64, 1, 1, 16, 16, True, F32),   # 64 query heads on one kv head: a full tile
])
def test_decode_form_head_dims_and_groups_against_float64(b, h, hk, sq, d, dv, causal, dtype, decode_calls,
                                                          up_to_64_rows):
    g = torch.Generator().manual_seed(5)
    q = torch.randn(b, h, sq, d, generator=g).to(dtype)
    k = torch.randn(b, hk, SK, d, generator=g).to(dtype)
    v = torch.randn(b, hk, SK, dv, generator=g).to(dtype)
    o, lse = flashgen.attention(q, k, v, causal=causal, return_lse=True)
    assert len(decode_calls) == 1
    _close64(o, lse, q, k, v, d ** -0.5, causal, 2e-3 if dtype == F16 else 1e-4)


def test_decode_form_reads_transposed_expanded_and_sliced_inputs(decode_calls):
    """q in (batch, seqlen, heads, head_dim) memory, k one kv head expanded to two (stride
    0), v a column slice of a wider buffer, then k and v expanded over the batch."""
    g = torch.Generator().manual_seed(6)
    b, h, hk, sq, d = 2, 8, 2, 3, 32
    q = torch.randn(b, sq, h, d, generator=g).transpose(1, 2)
    k = torch.randn(b, SK, 1, d, generator=g).transpose(1, 2).expand(b, hk, SK, d)
    v = torch.randn(b, hk, SK + 5, 2 * d, generator=g)[:, :, 3:3 + SK, d:]
    o, lse = flashgen.attention(q, k, v, causal=True, return_lse=True)
    _close64(o, lse, q, k, v, d ** -0.5, True, 1e-4)
    kb = torch.randn(1, hk, SK, d, generator=g).expand(b, hk, SK, d)
    o, lse = flashgen.attention(q, kb, kb, return_lse=True)
    _close64(o, lse, q, kb, kb, d ** -0.5, False, 1e-4)
    assert len(decode_calls) == 2


@pytest.mark.parametrize("scale", [-0.3, 0.0, 0.7])
def test_decode_form_any_scale_on_every_path(scale, decode_calls):
    """A negative, zero and positive softmax_scale: the first call, the memoized second
    one (no autograd) and a call through autograd, with its gradients."""
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, n, s, 32, generator=g) for n, s in ((8, 2), (2, SK), (2, SK)))
    for _ in range(2):
        o, lse = flashgen.attention(q, k, v, causal=True, softmax_scale=scale, return_lse=True)
        _close64(o, lse, q, k, v, scale, True, 1e-4)
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    o, lse = flashgen.attention(qg, kg, vg, causal=True, softmax_scale=scale, return_lse=True)
    _close64(o.detach(), lse, q, k, v, scale, True, 1e-4)
    o.sum().backward()
    q64, k64, v64 = (t.double().requires_grad_(True) for t in (q, k, v))
    s = torch.einsum("bhid,bhjd->bhij", q64, k64.repeat_interleave(4, 1)) * scale
    i, j = torch.arange(2)[:, None], torch.arange(SK)[None, :]
    (torch.softmax(s.masked_fill(j - i > SK - 2, float("-inf")), -1) @ v64.repeat_interleave(4, 1)).sum().backward()
    for got, r in ((qg.grad, q64.grad), (kg.grad, k64.grad), (vg.grad, v64.grad)):
        assert (got.double() - r).abs().max().item() < 1e-4
    assert len(decode_calls) == 3

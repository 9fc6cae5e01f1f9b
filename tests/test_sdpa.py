"""flashgen.scaled_dot_product_attention: torch's signature and semantics (top-left
causal, enable_gqa, scale), on the reference path and the interpreter, and the
fallbacks to torch's SDPA (with torch's errors)."""

import pytest
import torch
import torch.nn.functional as F

import flashgen
from flashgen import arch, dispatch, library, ops, reference
from flashgen.dispatch import Dispatcher
from flashgen.env import Environment


@pytest.fixture(autouse=True)
def hermetic_dispatcher():
    dispatch.set_default_dispatcher(Dispatcher([], env=Environment.current(), arch=arch.current()))
    yield
    dispatch.set_default_dispatcher(None)


def _inputs(b, hq, hk, sq, sk, d, dv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g).to(dtype) for s in
            ((b, hq, sq, d), (b, hk, sk, d), (b, hk, sk, dv), (b, hq, sq, dv))]


def _run(fn, ts, dtype, **kw):
    q, k, v, do = (t.to(dtype).requires_grad_(i < 3) for i, t in enumerate(ts))
    o = fn(q, k, v, **kw)
    return [o.detach(), *torch.autograd.grad(o, (q, k, v), do)]


CASES = [
    # b, hq, hk, sq, sk, d, dv, kwargs
    (1, 2, 2, 13, 29, 16, 16, dict(is_causal=True)),  # sq < sk: top-left, row i sees keys 0..i
    (1, 2, 2, 29, 13, 16, 16, dict(is_causal=True)),  # sq > sk: no row is blind (unlike bottom-right)
    (2, 4, 2, 17, 17, 32, 32, dict(is_causal=True, enable_gqa=True)),
    (1, 4, 1, 9, 21, 16, 24, dict(scale=0.37, enable_gqa=True)),
    (1, 2, 2, 11, 19, 24, 16, dict(scale=0.0)),
]


@pytest.mark.parametrize("interpret", ["0", "1"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c[-1].items()) + f"-sq{c[3]}sk{c[4]}")
def test_matches_torch_sdpa(case, interpret, monkeypatch):
    """Against torch's SDPA in float64 on the same (fp16-rounded) inputs: flashgen's
    error at most 2x torch's own fp16 error plus a floor."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    b, hq, hk, sq, sk, d, dv, kw = case
    dtype = torch.float16 if interpret == "1" else torch.float32
    ts = _inputs(b, hq, hk, sq, sk, d, dv, dtype)
    ref = _run(F.scaled_dot_product_attention, ts, torch.float64, **kw)
    base = _run(F.scaled_dot_product_attention, ts, dtype if dtype != torch.float16 else torch.float32, **kw)
    got = _run(flashgen.scaled_dot_product_attention, ts, dtype, **kw)
    floor = 2e-3 if dtype == torch.float16 else 1e-5
    for name, a, bb, r in zip(("O", "dQ", "dK", "dV"), got, base, ref):
        assert a.dtype == dtype and a.shape == r.shape
        e = (a.double() - r).abs().max().item()
        eb = (bb.double() - r).abs().max().item()
        assert e <= 2 * eb + floor, f"{name}: {e:.3g} vs torch {eb:.3g}"
    explained = flashgen.explain(*ts[:3], causal=kw.get("is_causal", False), softmax_scale=kw.get("scale"),
                                 sdpa=True, enable_gqa=kw.get("enable_gqa", False))
    assert explained.backend == "flashgen" and explained.diag_lo == -sq  # top-left: j - i >= -sq (unbounded)
    assert explained.diag_hi == (0 if kw.get("is_causal") else sk)


def test_top_left_differs_from_attention_bottom_right(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v, _ = _inputs(1, 2, 2, 5, 9, 16, 16, torch.float32)
    top_left = flashgen.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.allclose(top_left[:, :, 0], v[:, :, 0])  # query 0 sees key 0 only
    bottom_right = flashgen.attention(q, k, v, causal=True)
    assert not torch.allclose(top_left, bottom_right, atol=1e-3)


@pytest.mark.parametrize("interpret", ["0", "1"])
def test_flashgen_runs_it(interpret, monkeypatch):
    """A supported call runs flashgen's implementation, not torch's SDPA."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: pytest.fail("fell back to torch"))
    calls = []
    real_forward, real_fwd = library.forward, ops.fwd
    monkeypatch.setattr(library, "forward", lambda *a: calls.append(a[3:]) or real_forward(*a))
    monkeypatch.setattr(ops, "fwd", lambda *a, **kw: calls.append(
        tuple(kw[n] for n in ("softmax_scale", "mask", "diag_lo", "diag_hi"))) or real_fwd(*a, **kw))
    q, k, v, _ = _inputs(1, 4, 2, 6, 10, 16, 16, torch.float16)
    flashgen.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=0.5)
    assert calls == [(0.5, "causal", -6, 0)]  # the interpreter launches the kernel directly


@pytest.mark.parametrize("kw, reason", [
    (dict(attn_mask="float64"), "attn_mask dtype torch.float64"),
    (dict(attn_mask="mask", is_causal=True), "attn_mask with is_causal=True"),
    (dict(attn_mask="grad"), "attn_mask requires grad"),
    (dict(dropout_p=1.0), "dropout_p = 1.0"),
    (dict(scale=float("nan")), "scale = nan"),
    (dict(scale=1e-31), "scale = 1e-31"),
    (dict(attn_mask="1-D"), "attn_mask has 1 dims"),
    (dict(attn_mask="0-D"), "attn_mask has 0 dims"),
])
def test_fallbacks_are_torch_sdpa(kw, reason, monkeypatch):
    """What flashgen cannot serve goes to torch's SDPA with torch's result or error (a
    scale flashgen refuses and a mask of fewer than two dims raised flashgen's error or
    ran where torch returns or raises)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v, _ = _inputs(1, 2, 2, 8, 8, 16, 16, torch.float32)
    m = kw.get("attn_mask")
    if isinstance(m, str):
        mask = torch.rand(8, 8) > 0.5
        mask[:, 0] = True
        kw = {**kw, "attn_mask": {"mask": mask, "float64": mask.double(), "grad": mask.float().requires_grad_(),
                                  "1-D": mask[0], "0-D": mask[0, 0]}[m]}
    calls = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k_: calls.append(k_) or real(*a, **k_))
    monkeypatch.setattr(library, "forward_mods", lambda *a: pytest.fail("flashgen ran a call it cannot serve"))
    try:
        want = real(q, k, v, **kw)
    except (RuntimeError, IndexError) as e:
        with pytest.raises(type(e)) as got:
            flashgen.scaled_dot_product_attention(q, k, v, **kw)
        assert str(got.value) == str(e)
    else:
        got = flashgen.scaled_dot_product_attention(q, k, v, **kw)
        assert torch.equal(got, want)
    assert len(calls) == 1 and all(calls[0][n] is kw[n] or calls[0][n] == kw[n] for n in kw)
    why = flashgen.explain(q, k, v, sdpa=True, causal=kw.get("is_causal", False), softmax_scale=kw.get("scale"),
                           **{n: kw[n] for n in ("attn_mask", "dropout_p") if n in kw})
    assert why.backend == "torch-sdpa-fallback" and reason in why.reason and not why.kernels
    assert str(why).startswith("torch-sdpa-fallback: ") and reason in str(why)


@pytest.mark.parametrize("mask_kind", ["bool", "float", "bool-broadcast"])
def test_attn_mask_is_served_as_a_bias(mask_kind, monkeypatch):
    """attn_mask (bool or the query's dtype, broadcast) runs in flashgen's kernels and
    equals torch's SDPA with the same mask (top-left semantics, GQA)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: pytest.fail("fell back to torch"))
    q, k, v, do = _inputs(2, 4, 2, 13, 21, 16, 16, torch.float32)
    g = torch.Generator().manual_seed(3)
    if mask_kind == "float":
        mask = torch.randn(2, 1, 13, 21, generator=g)
    else:
        mask = torch.rand((1, 21) if mask_kind == "bool-broadcast" else (2, 4, 13, 21), generator=g) > 0.3
        mask[..., 0] = True
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    got = flashgen.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    got.backward(do)
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    monkeypatch.undo()  # torch's own SDPA for the reference
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask)
    ref.backward(do)
    assert (got - ref).abs().max() < 1e-5
    for a, t in zip(grads, (q, k, v)):
        assert (a - t.grad).abs().max() < 1e-4
    why = flashgen.explain(q.detach(), k.detach(), v.detach(), sdpa=True, attn_mask=mask, enable_gqa=True)
    assert why.backend == "flashgen" and all(c.key.startswith(f"attn_{c.kernel}_d16_fp32_none_bias_")
                                             for c in why.kernels)


def _doc_mask(rows, causal):
    out = []
    for row in rows:
        doc = torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row))
        i = torch.arange(len(doc))
        m = doc[:, None] == doc[None, :]
        out.append(m & (i[None, :] <= i[:, None]) if causal else m)
    return torch.stack(out)[:, None]


@pytest.mark.parametrize("form", ["block-causal 2-D", "per-entry 4-D", "bidirectional 3-D", "gqa"])
def test_a_packed_documents_mask_runs_as_a_ragged_batch(form, monkeypatch):
    """A bool attn_mask of packed documents (block-causal, as packed-dataset training
    builds it, or bidirectional within each) runs through attention_varlen, not as a
    bias: equal to torch's SDPA with the mask, forward and gradients; explain says so.
    A mask one element off the pattern, or with dropout, stays a bias."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    b, hk = (2, 2) if form == "gqa" else (2, 4)
    q, k, v, do = _inputs(b, 4, hk, 12, 12, 16, 16, torch.float32)
    rows = [[3, 1, 8], [7, 5]]
    mask = {"block-causal 2-D": lambda: _doc_mask([rows[0]], True)[0, 0],
            "per-entry 4-D": lambda: _doc_mask(rows, True),
            "bidirectional 3-D": lambda: _doc_mask([rows[1]], False)[0],
            "gqa": lambda: _doc_mask(rows, True)}[form]()
    kw = {"enable_gqa": True} if form == "gqa" else {}
    seen = []
    real = flashgen.api.attention_varlen
    monkeypatch.setattr(flashgen.api, "attention_varlen", lambda *a, **k: seen.append(a[3].tolist()) or real(*a, **k))
    monkeypatch.setattr(flashgen.api, "_attention_mods", lambda *a, **k: pytest.fail("read the mask as a bias"))
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    got = flashgen.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)
    got.backward(do)
    assert len(seen) == 1 and seen[0][-1] == 24
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    rep = 4 // hk
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask)
    ref.backward(do)
    assert (got - ref).abs().max() < 1e-5
    for a, t in zip(grads, (q, k, v)):
        assert (a - t.grad).abs().max() < 1e-4
    why = flashgen.explain(q.detach(), k.detach(), v.detach(), sdpa=True, attn_mask=mask, **kw)
    assert why.backend == "flashgen" and why.path.startswith("packed documents") and why.kernels == ()
    # the same mask object again: read once per pattern, whatever its rank (the 2-D and
    # 3-D masks are viewed as 4-D per call)
    from flashgen import documents

    scans = []
    real_find = documents.torch.Tensor.diagonal
    monkeypatch.setattr(documents.torch.Tensor, "diagonal", lambda *a, **k: scans.append(1) or real_find(*a, **k))
    flashgen.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), attn_mask=mask, **kw)
    assert scans == []
    monkeypatch.undo()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    odd = mask.clone()
    odd[..., 11, 0] = ~odd[..., 11, 0]
    assert flashgen.explain(q.detach(), k.detach(), v.detach(), sdpa=True, attn_mask=odd, **kw).kernels != ()


def test_dropout_p_is_served_by_flashgen(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: pytest.fail("fell back to torch"))
    q, k, v, _ = _inputs(1, 2, 2, 9, 11, 16, 16, torch.float32)
    from flashgen import dropout

    flashgen.manual_seed(21)  # flashgen's own stream, whose state the test reads
    st = dropout.default_state(q.device)
    before = st.clone()
    got = flashgen.scaled_dot_product_attention(q, k, v, dropout_p=0.5, is_causal=True)
    keep = flashgen.dropout_mask(before, 1, 2, 9, 11, 0.5)
    ref, _, _ = reference.forward(q, k, v, causal=True, align="top_left", keep=keep, dropout_p=0.5)
    assert (got.double() - ref).abs().max() < 1e-5
    assert st[1].item() == before[1].item() + dropout.counters(1, 2, 9, 11)  # 2 * 9 * ceil(11 / 4)


@pytest.mark.parametrize("shapes, kw, reason", [
    (((1, 4, 8, 16), (1, 2, 8, 16), (1, 2, 8, 16)), {}, "enable_gqa=False"),
    (((1, 4, 8, 16), (1, 3, 8, 16), (1, 3, 8, 16)), dict(enable_gqa=True), "not a multiple"),
    (((1, 2, 8, 12), (1, 2, 8, 12), (1, 2, 8, 12)), {}, "head_dim 12"),
    (((2, 8, 16), (2, 8, 16), (2, 8, 16)), {}, "3 dims"),
])
def test_unsupported_shapes_go_to_torch(shapes, kw, reason, monkeypatch):
    """Mismatched head counts without enable_gqa raise torch's own error; other
    shapes flashgen cannot serve give torch's result."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v = (torch.randn(*s) for s in shapes)
    why = flashgen.explain(q, k, v, sdpa=True, **kw)
    assert why.backend == "torch-sdpa-fallback" and reason in why.reason, why.reason
    try:
        want = F.scaled_dot_product_attention(q, k, v, **kw)
    except RuntimeError as e:
        with pytest.raises(RuntimeError) as got:
            flashgen.scaled_dot_product_attention(q, k, v, **kw)
        assert str(got.value) == str(e)
    else:
        assert torch.equal(flashgen.scaled_dot_product_attention(q, k, v, **kw), want)


@pytest.mark.parametrize("interpret", ["0", "1"])
@pytest.mark.parametrize("b, h, sq, sk", [(0, 2, 8, 8), (1, 2, 0, 8), (1, 2, 8, 0), (2, 0, 8, 8)])
def test_empty_inputs_are_served_by_flashgen(b, h, sq, sk, interpret, monkeypatch):
    """Empty inputs never reach torch (whose CUDA path can return None for them): the
    empty output, zeros where seqlen_k is 0 (torch's CPU result), zero gradients; with
    a mask and GQA too."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: pytest.fail("fell back to torch"))
    hk = max(h // 2, 1) if h else 0
    q = torch.randn(b, h, sq, 16, requires_grad=True)
    k = torch.randn(b, hk if h else h, sk, 16, requires_grad=True)
    v = torch.randn(b, hk if h else h, sk, 24, requires_grad=True)
    gqa = dict(enable_gqa=True) if h else {}
    if h == 0:  # no heads on either side: no GQA group to speak of
        k = torch.randn(b, 0, sk, 16, requires_grad=True)
        v = torch.randn(b, 0, sk, 24, requires_grad=True)
    for kw in (dict(is_causal=True), dict(attn_mask=torch.ones(sq, sk, dtype=torch.bool))):
        why = flashgen.explain(q.detach(), k.detach(), v.detach(), sdpa=True, **gqa,
                               **({"causal": True} if "is_causal" in kw else {"attn_mask": kw["attn_mask"]}))
        assert why.backend == "flashgen" and why.path.startswith("no launch"), why
        o = flashgen.scaled_dot_product_attention(q, k, v, **gqa, **kw)
        assert o is not None and o.shape == (b, h, sq, 24) and o.dtype == q.dtype
        assert torch.equal(o, torch.zeros_like(o))
        o.sum().backward()
        for t in (q, k, v):
            assert torch.equal(t.grad, torch.zeros_like(t))
            t.grad = None


def test_float64_goes_to_torch():
    q = torch.randn(1, 2, 8, 16, dtype=torch.float64)
    assert "dtype torch.float64" in flashgen.explain(q, q, q, sdpa=True).reason
    assert torch.equal(flashgen.scaled_dot_product_attention(q, q, q), F.scaled_dot_product_attention(q, q, q))


def test_explain_rejects_sdpa_arguments_without_sdpa():
    """attn_mask and enable_gqa are SDPA's alone; dropout_p is both SDPA's and
    flashgen.attention's (checked as attention checks it)."""
    q = torch.randn(1, 2, 8, 16)
    for kw in (dict(attn_mask=torch.ones(8, 8, dtype=torch.bool)), dict(enable_gqa=True)):
        with pytest.raises(flashgen.InputError, match="sdpa=True"):
            flashgen.explain(q, q, q, **kw)
    with pytest.raises(flashgen.InputError, match="dropout_p"):
        flashgen.explain(q, q, q, dropout_p=1.5)

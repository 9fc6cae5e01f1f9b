"""Ragged batches (attention_varlen, issue 8): the varlen kernels in Triton's
interpreter (float16/float32, small shapes) against a per-sequence float64 reference,
against the dense op on each sequence, the CPU reference path, the input errors, and
a real sm_90 compile of each new kernel (no GPU needed: Triton's bundled ptxas).

Pass rule (FlashAttention's): max |kernel - ref64| <= 2 * max |torch at dtype - ref64|
+ floor; outputs (and delta) poisoned with NaN first, so an unwritten element fails.
"""


import pytest
import torch

import flashgen
from flashgen import InputError, arch, dispatch, library, ops, reference, render
from flashgen.dispatch import Dispatcher
from flashgen.env import Environment
from flashgen.spec import KERNELS, VARLEN_KERNELS, KernelSpec, ProblemKey, TileConfig

F16, F32 = torch.float16, torch.float32
NAN = float("nan")
FLOOR = {F16: 2e-3, F32: 2e-5}
NAMES = ("O", "LSE", "dQ", "dK", "dV")


@pytest.fixture(autouse=True)
def hermetic_dispatcher():
    dispatch.set_default_dispatcher(Dispatcher([], env=Environment.current(), arch=arch.current()))
    yield
    dispatch.set_default_dispatcher(None)


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def _inputs(lens_q, lens_k, h, hk, d, dv, dtype, seed=0):
    torch.manual_seed(seed)
    tq, tk = sum(lens_q), sum(lens_k)
    return (torch.randn(tq, h, d, dtype=dtype), torch.randn(tk, hk, d, dtype=dtype),
            torch.randn(tk, hk, dv, dtype=dtype), torch.randn(tq, h, dv, dtype=dtype))


def _left_right(causal, window):
    return window[0], (0 if causal else window[1])


def _reference(q, k, v, do, cq, ck, scale, left, right, dtype):
    o, lse = library.reference_forward_varlen(q, k, v, cq, ck, scale, left, right, dtype)
    return (o, lse) + library.reference_backward_varlen(do, q, k, v, cq, ck, scale, left, right, dtype)


def _check(got, q, k, v, do, cq, ck, scale, left, right):
    r64 = _reference(q, k, v, do, cq, ck, scale, left, right, torch.float64)
    base = _reference(q, k, v, do, cq, ck, scale, left, right, q.dtype)
    for name, r, b in zip(NAMES, r64, base):
        t = got[name]
        assert not torch.isnan(t).any(), f"{name}: NaN (an element never written)"
        floor = FLOOR[F32 if name == "LSE" else q.dtype]
        err, berr = reference.max_error(t, r), reference.max_error(b.float() if name == "LSE" else b, r)
        assert err <= 2 * berr + floor, f"{name}: err {err:.3g} > 2 x {berr:.3g} + {floor}"
    # Rows that see no key: exactly O = 0, LSE = -inf, dQ = 0.
    empty = torch.isneginf(r64[1])  # (h, total_q)
    assert torch.equal(torch.isneginf(got["LSE"]), empty)
    rows = empty.T[..., None].expand_as(got["O"])
    assert (got["O"][rows] == 0).all() and (got["dQ"][empty.T[..., None].expand_as(got["dQ"])] == 0).all()
    return empty


# (lens_q, lens_k, h, hk, d, dv, causal, window, dtype, fwd cfg, dq cfg, dkdv cfg, has empty rows)
CASES = [
    # lengths 0 and 1, not multiples of the blocks, sq > sk and sq < sk per sequence
    ([5, 0, 37, 1, 20], [9, 3, 21, 1, 0], 2, 2, 32, 32, False, (-1, -1), F16, (16, 16), (16, 16), (16, 16), True),
    ([5, 0, 37, 1, 20], [9, 3, 21, 1, 17], 4, 2, 32, 32, True, (-1, -1), F32, (32, 16), (16, 32), (16, 32), True),
    ([33, 7, 0, 18], [17, 40, 5, 18], 4, 1, 40, 24, False, (5, 3), F16, (16, 32), (32, 16), (32, 16), True),
    ([1, 26, 19], [1, 31, 12], 2, 2, 16, 16, True, (7, -1), F16, (32, 32), (16, 16), (16, 16), True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{'c' if c[6] else ''}w{c[7][0]}_{c[7][1]}_h{c[2]}kv{c[3]}"
                         f"d{c[4]}v{c[5]}{str(c[8])[-7:]}")
def test_kernels_match_per_sequence_reference(case):
    lq, lk, h, hk, d, dv, causal, window, dtype, cf, cq_, ckv, has_empty = case
    q, k, v, do = _inputs(lq, lk, h, hk, d, dv, dtype, seed=len(lq) * 7 + d)
    cq, ck = _cu(lq), _cu(lk)
    left, right = _left_right(causal, window)
    mode, _, _ = flashgen.masks.mask_bounds(0, 0, causal=causal, window=window)
    kw = dict(softmax_scale=d ** -0.5, mask=mode, win_left=left, win_right=right)
    seqs = (cq, ck, max(lq), max(lk))
    o, lse = ops.fwd_varlen(q, k, v, *seqs, config=TileConfig(*cf, 4, 1), out=torch.full((q.shape[0], h, dv), NAN,
                            dtype=dtype), lse=torch.full((h, q.shape[0]), NAN), **kw)
    dq, dk, dv_ = ops.bwd_varlen(do, q, k, v, o, lse, *seqs, config_dq=TileConfig(*cq_, 4, 1),
                                 config_dkdv=TileConfig(*ckv, 4, 1), dq=torch.full_like(q, NAN),
                                 dk=torch.full_like(k, NAN), dv=torch.full_like(v, NAN),
                                 delta=torch.full_like(lse, NAN), **kw)
    empty = _check(dict(O=o, LSE=lse, dQ=dq, dK=dk, dV=dv_), q, k, v, do, cq, ck, d ** -0.5, left, right)
    assert bool(empty.any()) == has_empty, "the case does not test rows that see no key"


def test_op_autograd_equals_dense_op_on_each_sequence():
    """attention_varlen (forward and autograd backward) equals flashgen.attention run on
    each sequence alone, with GQA, causal, a length-0 and a length-1 sequence."""
    lq, lk = [13, 0, 1, 30], [20, 4, 1, 22]
    q, k, v, do = _inputs(lq, lk, 4, 2, 32, 32, F32, seed=3)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    cq, ck = _cu(lq), _cu(lk)
    o, lse = flashgen.attention_varlen(q, k, v, cq, ck, max(lq), max(lk), causal=True, return_lse=True)
    assert o.shape == (sum(lq), 4, 32) and lse.shape == (4, sum(lq)) and lse.dtype == F32
    o.backward(do)
    for i in range(len(lq)):
        a, b, c, e = cq[i].item(), cq[i + 1].item(), ck[i].item(), ck[i + 1].item()
        if b == a:
            continue
        qi, ki, vi = (t.detach()[s].transpose(0, 1)[None].clone().requires_grad_() for t, s in
                      ((q, slice(a, b)), (k, slice(c, e)), (v, slice(c, e))))
        oi, li = flashgen.attention(qi, ki, vi, causal=True, return_lse=True)
        oi.backward(do[a:b].transpose(0, 1)[None])
        tol = dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(o.detach()[a:b], oi.detach()[0].transpose(0, 1), **tol)
        torch.testing.assert_close(lse[:, a:b], li[0], **tol)
        for g, gi in ((q.grad[a:b], qi.grad), (k.grad[c:e], ki.grad), (v.grad[c:e], vi.grad)):
            torch.testing.assert_close(g, gi[0].transpose(0, 1), **tol)
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()


def test_a_max_seqlen_above_the_packed_tokens_sizes_no_larger_grid(monkeypatch):
    """max_seqlen_q / max_seqlen_k are upper bounds: one far above the packed tokens (a
    model's whole context) gives the same result as the true maxima, without a launch
    grid sized by it (at 2**40 the grid would not fit a CUDA launch, and the interpreter
    would run its programs for hours)."""
    lq, lk = [5, 3], [4, 7]
    q, k, v, do = _inputs(lq, lk, 2, 1, 16, 16, F32, seed=7)
    cq, ck = _cu(lq), _cu(lk)
    grids = []
    real = library.forward_varlen

    def spy(q, k, v, cu_q, cu_k, max_q, max_k, *rest):
        grids.append((max_q, max_k))
        assert max_q <= q.shape[0] and max_k <= k.shape[0], f"a grid sized by max_seqlen {max_q}, {max_k}"
        return real(q, k, v, cu_q, cu_k, max_q, max_k, *rest)

    want = flashgen.attention_varlen(q, k, v, cq, ck, max(lq), max(lk), causal=True)
    monkeypatch.setattr(library, "forward_varlen", spy)
    got = flashgen.attention_varlen(q, k, v, cq, ck, 2**40, 2**40, causal=True)
    assert grids == [(sum(lq), sum(lk))]
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_reference_path_without_interpreter(monkeypatch):
    """CPU without the interpreter: the per-sequence float32 reference, same results as
    the kernels (window, GQA, sq != sk both ways)."""
    lq, lk = [9, 0, 21], [14, 6, 11]
    q, k, v, do = _inputs(lq, lk, 2, 1, 16, 16, F32, seed=5)
    cq, ck = _cu(lq), _cu(lk)
    args = (cq, ck, max(lq), max(lk))

    def run():
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        o, lse = flashgen.attention_varlen(qq, kk, vv, *args, window=(4, 2), return_lse=True)
        o.backward(do)
        return o.detach(), lse, qq.grad, kk.grad, vv.grad

    kernels = run()
    calls = []
    real = library.reference_forward_varlen
    monkeypatch.setattr(library, "reference_forward_varlen", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ref = run()
    assert calls, "the reference path did not run"
    for a, b in zip(kernels, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_all_empty_and_fake_shapes():
    q, k, v, _ = _inputs([0, 0], [3, 0], 2, 2, 16, 16, F16)
    o, lse = flashgen.attention_varlen(q, k, v, _cu([0, 0]), _cu([3, 0]), 0, 3, return_lse=True)
    assert o.shape == (0, 2, 16) and lse.shape == (2, 0)
    # sequences with keys 0 only: every row sees no key
    q, k, v, _ = _inputs([4], [0], 2, 2, 16, 16, F16)
    o, lse = flashgen.attention_varlen(q, k, v, _cu([4]), _cu([0]), 4, 0, return_lse=True)
    assert torch.equal(o, torch.zeros_like(o)) and torch.isneginf(lse).all()
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fq, fk, fv = torch.empty(10, 4, 32), torch.empty(7, 2, 32), torch.empty(7, 2, 24)
        fo, fl = library.FWD_VARLEN(fq, fk, fv, torch.empty(3, dtype=torch.int32), torch.empty(3, dtype=torch.int32),
                                    6, 5, 0.1, "none", -1, -1)
        assert fo.shape == (10, 4, 24) and fl.shape == (4, 10) and fl.dtype == F32


def _good():
    q, k, v, _ = _inputs([3, 5], [4, 2], 4, 2, 16, 16, F16)
    return dict(q=q, k=k, v=v, cu_seqlens_q=_cu([3, 5]), cu_seqlens_k=_cu([4, 2]), max_seqlen_q=5, max_seqlen_k=4)


ERRORS = [
    ("cu_seqlens_q", lambda a: a["cu_seqlens_q"].long(), "cu_seqlens_q must be int32"),
    ("cu_seqlens_k", lambda a: a["cu_seqlens_k"].to(torch.int32).reshape(1, 3), r"cu_seqlens_k must have shape \(batch \+ 1,\)"),
    ("cu_seqlens_k", lambda a: torch.tensor([0, 6], dtype=torch.int32), "same length"),
    ("cu_seqlens_q", lambda a: torch.tensor([1, 3, 8], dtype=torch.int32), r"cu_seqlens_q\[0\] must be 0"),
    ("cu_seqlens_k", lambda a: torch.tensor([0, 7, 6], dtype=torch.int32),
     r"cu_seqlens_k must be non-decreasing, but cu_seqlens_k\[2\] = 6 < cu_seqlens_k\[1\] = 7"),
    ("cu_seqlens_q", lambda a: torch.tensor([0, 3, 7], dtype=torch.int32), r"cu_seqlens_q\[-1\] \(7\) must equal .*q.shape\[0\] = 8"),
    ("max_seqlen_q", lambda a: 4, r"max_seqlen_q \(4\) is smaller than the length of sequence 1 \(5\)"),
    ("max_seqlen_k", lambda a: -1, "max_seqlen_k must be an int >= 0"),
    ("max_seqlen_k", lambda a: 4.0, "max_seqlen_k must be an int"),
    ("q", lambda a: a["q"][None], "q must have 3 dims"),
    ("q", lambda a: torch.randn(8, 5, 16, dtype=F16), r"num_heads of q \(5\) must be a multiple of num_kv_heads"),
    ("v", lambda a: a["v"].float(), "v.dtype"),
    ("v", lambda a: a["v"][:5], "same total_k"),
]


@pytest.mark.parametrize("arg,bad,match", ERRORS, ids=[f"{e[0]}-{i}" for i, e in enumerate(ERRORS)])
def test_errors_name_the_argument_and_rule(arg, bad, match):
    a = _good()
    flashgen.attention_varlen(**a)  # the good call passes
    a[arg] = bad(a)
    with pytest.raises(InputError, match=match):
        flashgen.attention_varlen(**a)


def test_cu_seqlens_device_and_other_errors():
    a = _good()
    with pytest.raises(InputError, match="cu_seqlens_q must be on q's device"):
        flashgen.attention_varlen(**{**a, "cu_seqlens_q": a["cu_seqlens_q"].to("meta")})
    with pytest.raises(InputError, match="window must be a pair"):
        flashgen.attention_varlen(**a, window=(1, 2, 3))
    with pytest.raises(InputError, match="causal must be a bool"):
        flashgen.attention_varlen(**a, causal=1)


def test_keys_templates_and_dispatch():
    spec = KernelSpec("fwd_varlen", "float16", 64, 64, "causal")
    key = ProblemKey.from_varlen_sizes(spec, batch=3, num_heads=8, num_kv_heads=2, max_seqlen_q=100,
                                       max_seqlen_k=1000)
    assert (key.group, key.seqlen_q, key.seqlen_k, key.batch_heads) == (4, 128, 1024, 32)
    assert key.id.startswith("attn_fwd_varlen_d64_fp16_causal_")
    assert set(VARLEN_KERNELS) <= set(KERNELS)
    assert render.macros_name("fwd_varlen") == render.macros_name("fwd") == "_common.j2"
    choice = dispatch.default_dispatcher().choose(key, capturing=False)
    assert choice.source == "default" and choice.smem_bytes > 0


def test_varlen_kernels_compile_for_sm90():
    """The real compiler (not the interpreter) accepts each varlen kernel: constexpr
    globals, the early exit, tl.range's literal num_stages."""
    from sm90 import compile_for_sm90

    compile_for_sm90([("fwd_varlen", "bfloat16", 128, 128, "window", (128, 64, 8, 3)),
                      ("bwd_dq_varlen", "float16", 64, 64, "causal", (64, 32, 4, 2)),
                      ("bwd_dkdv_varlen", "bfloat16", 40, 72, "window", (32, 64, 4, 2))], timeout=300)


def test_benchmarker_checks_and_runs_varlen_variants():
    """The tuner's check (bench.check_variant) and timing callable serve the varlen
    kernels; a wrong kernel is caught (the check can fail)."""
    from flashgen import bench, presets
    from flashgen.spec import Variant

    for kernel in VARLEN_KERNELS:
        v = Variant(KernelSpec(kernel, "float32", 16, 16, "window"), TileConfig(32, 32, 4, 1))
        ok, ratio, msg = bench.check_variant(v, device="cpu")
        assert ok and ratio <= 1.0 and "varlenw" in msg, msg
    v = Variant(KernelSpec("fwd_varlen", "float16", 16, 16, "causal"), TileConfig(32, 32, 4, 1))
    inputs = bench.make_varlen_inputs(v.spec, [5, 9], [9, 5], 2, 1, device="cpu")
    fn, outs = bench.run_variant(v, *inputs)
    fn()
    assert torch.isfinite(outs["O"]).all()
    # a broken launch (LSE never written, O off by a factor) fails the check
    v32 = Variant(KernelSpec("fwd_varlen", "float32", 16, 16, "none"), TileConfig(32, 32, 4, 1))
    real = ops.fwd_varlen

    def broken(*a, **kw):
        o, lse = real(*a, **kw)
        o.mul_(1.01)
        return o, lse
    try:
        ops.fwd_varlen = broken
        ok, ratio, _ = bench.check_variant(v32, device="cpu")
    finally:
        ops.fwd_varlen = real
    assert not ok and ratio > 1.0
    items = presets.expand(["varlen-small"], "float16")
    assert sorted(k.spec.kernel for k, _ in items) == sorted(VARLEN_KERNELS)
    assert {k.spec.kernel for k, _ in presets.expand(["small"], "float16", KERNELS)} == {"fwd", "bwd_dq", "bwd_dkdv"}
    assert bench.varlen_lengths(4, 100)[0] == 100 and all(50 <= n <= 100 for n in bench.varlen_lengths(4, 100))


def test_the_offsets_are_read_once_per_unchanged_pair(monkeypatch):
    """A model's layers pass one step's cu_seqlens to every call: their values are copied
    to the host (a synchronization on CUDA) by the first call only, and again once the
    tensors change in place or other sizes come with them."""
    from flashgen import api

    reads = []
    real_stack = torch.stack
    monkeypatch.setattr(api.torch, "stack", lambda ts, *a, **kw: reads.append(1) or real_stack(ts, *a, **kw))
    a = _good()
    for _ in range(3):
        flashgen.attention_varlen(**a)
    assert len(reads) == 1
    flashgen.attention_varlen(**{**a, "max_seqlen_q": 6})  # other sizes: checked again
    assert len(reads) == 2
    a["cu_seqlens_k"][1] = 7  # in place (the version counter moves): checked again, and refused
    with pytest.raises(InputError, match="cu_seqlens_k must be non-decreasing"):
        flashgen.attention_varlen(**a)
    assert len(reads) == 3
    with torch.inference_mode():  # inference tensors keep no version: read every call
        b = _good()
        flashgen.attention_varlen(**b)
        flashgen.attention_varlen(**b)
    assert len(reads) == 5

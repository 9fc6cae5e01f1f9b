"""Exactness matrix (issue 3) in Triton's interpreter: float16 / float32, small shapes.

Every output (O, LSE, dQ, dK, dV) against the float64 reference with FlashAttention's
rule: max |kernel - ref64| <= 2 * max |torch at the input dtype - ref64| + floor.  Every
output buffer (including delta) is poisoned with NaN first, so an element the kernels
never write fails.  On top of the error rule, rows that see no key must give exactly
O = 0, LSE = -inf and dQ = 0, and keys that no query sees exactly dK = dV = 0.

Mostly ops-level calls with explicit small TileConfigs (the interpreter's cost is per
tile), a few through flashgen.attention.  Not repeated here (tests/test_api.py and
tests/test_kernels.py have them): input errors, batch/seqlen 0, last-dim stride != 1,
softmax_scale 0 with causal, negative scales.  GPU-only items (bfloat16, int64 offsets
past 2^31 elements, batch*heads > 65535, every config of the search space) are in
benchmarks/gpu_exactness.py.
"""

import pytest
import torch

import flashgen
from flashgen import arch, bench, dispatch, masks, ops, reference
from flashgen.api import _attention
from flashgen.dispatch import Dispatcher
from flashgen.env import Environment
from flashgen.masks import mask_bounds
from flashgen.spec import KernelSpec, TileConfig, Variant

F16, F32 = torch.float16, torch.float32
NAN = float("nan")
FLOOR = {F16: 2e-3, F32: 2e-5}
NAMES = ("O", "LSE", "dQ", "dK", "dV")


@pytest.fixture(autouse=True)
def hermetic_dispatcher():
    """flashgen.attention uses the heuristic configs only (no tuning database)."""
    dispatch.set_default_dispatcher(Dispatcher([], env=Environment.current(), arch=arch.current()))
    yield
    dispatch.set_default_dispatcher(None)


def _cfg(m, n):
    return TileConfig(m, n, 4, 1)


def _rand(*shape, dtype=F16):
    return torch.randn(*shape, dtype=dtype)


def _inputs(b, h, hk, sq, sk, d, dv=None, dtype=F16, seed=0):
    torch.manual_seed(seed)
    dv = dv or d
    return (_rand(b, h, sq, d, dtype=dtype), _rand(b, hk, sk, d, dtype=dtype),
            _rand(b, hk, sk, dv, dtype=dtype), _rand(b, h, sq, dv, dtype=dtype))


def _scale(q, scale):
    return q.shape[-1] ** -0.5 if scale is None else scale


def _run_ops(q, k, v, do, *, causal=False, window=(-1, -1), align="bottom_right", scale=None,
             fwd=(32, 32), dq=(32, 32), dkdv=(32, 32), outs=None):
    """O, LSE, dQ, dK, dV from ops.fwd + ops.bwd into NaN-poisoned buffers (``outs``
    may supply some of them, e.g. strided views)."""
    b, h, sq, _ = q.shape
    mode, lo, hi = mask_bounds(sq, k.shape[2], causal=causal, window=window, align=align)
    kw = dict(softmax_scale=_scale(q, scale), mask=mode, diag_lo=lo, diag_hi=hi)
    bufs = dict(O=torch.full((b, h, sq, v.shape[3]), NAN, dtype=q.dtype), LSE=torch.full((b, h, sq), NAN),
                dQ=torch.full_like(q, NAN), dK=torch.full_like(k, NAN), dV=torch.full_like(v, NAN))
    bufs.update(outs or {})
    for t in bufs.values():
        t.fill_(NAN)
    o, lse = ops.fwd(q, k, v, config=_cfg(*fwd), out=bufs["O"], lse=bufs["LSE"], **kw)
    g = ops.bwd(do, q, k, v, o, lse, config_dq=_cfg(*dq), config_dkdv=_cfg(*dkdv), dq=bufs["dQ"], dk=bufs["dK"],
                dv=bufs["dV"], delta=torch.full_like(lse, NAN), **kw)
    return dict(zip(NAMES, (o, lse, *g)))


def _visible(sq, sk, causal, window, align):
    _, lo, hi = mask_bounds(sq, sk, causal=causal, window=window, align=align)
    rel = torch.arange(sk)[None, :] - torch.arange(sq)[:, None]
    return (rel >= lo) & (rel <= hi)


def _check(got, q, k, v, do, *, causal=False, window=(-1, -1), align="bottom_right", scale=None,
           empty_rows=None):
    """Compare ``got`` {name: tensor} with the float64 reference; ``empty_rows``: whether
    the case must have rows that see no key (True) / must not (False) / either (None)."""
    rkw = dict(causal=causal, window=window, align=align, softmax_scale=_scale(q, scale))
    r64 = reference.forward(q, k, v, **rkw)[:2] + reference.backward(do, q, k, v, **rkw)
    rdt = reference.forward(q, k, v, dtype=q.dtype, **rkw)[:2] + reference.backward(do, q, k, v, dtype=q.dtype, **rkw)
    refs = {"O": q, "LSE": q[..., 0], "dQ": q, "dK": k, "dV": v}
    for name, r, base in zip(NAMES, r64, rdt):
        if name not in got:
            continue
        t = got[name]
        want_dtype = F32 if name == "LSE" else q.dtype
        want_shape = (*q.shape[:3], v.shape[3]) if name == "O" else refs[name].shape
        assert t.dtype == want_dtype and tuple(t.shape) == tuple(want_shape), (name, t.dtype, t.shape)
        assert not torch.isnan(t).any(), f"{name}: NaN (an element never written, or a NaN leaked in)"
        floor = FLOOR[F32 if name == "LSE" else q.dtype]
        err, base_err = reference.max_error(t, r), reference.max_error(base.float() if name == "LSE" else base, r)
        assert err <= 2 * base_err + floor, f"{name}: err {err:.3g} > 2 x {base_err:.3g} (torch {q.dtype}) + {floor}"
    vis = _visible(q.shape[2], k.shape[2], causal, window, align)
    row_empty, col_empty = ~vis.any(1), ~vis.any(0)
    if empty_rows is not None:
        assert bool(row_empty.any()) == empty_rows, "the case does not test what it claims (rows seeing no key)"
    zero = lambda t, idx: torch.equal(t[:, :, idx], torch.zeros_like(t[:, :, idx]))  # noqa: E731
    if "O" in got:
        assert zero(got["O"], row_empty), "O of a row that sees no key is not exactly 0"
        assert torch.isneginf(got["LSE"][:, :, row_empty]).all() and torch.isfinite(got["LSE"][:, :, ~row_empty]).all()
    if "dQ" in got:
        assert zero(got["dQ"], row_empty), "dQ of a row that sees no key is not exactly 0"
    for name in ("dK", "dV"):
        if name in got:
            assert zero(got[name], col_empty), f"{name} of a key that no query sees is not exactly 0"
    for name in ("dQ", "dK", "dV"):
        if name in got:
            assert torch.isfinite(got[name]).all(), f"{name}: not finite"
    return row_empty, col_empty


# -- mask modes x seqlens (ops level) ---------------------------------------------------

MASKS = {
    "none": dict(),
    "causal": dict(causal=True),
    "causal_tl": dict(causal=True, align="top_left"),
    "window": dict(window=(9, 4)),
    "window_left": dict(window=(13, -1)),
    "window_right": dict(window=(-1, 5)),
    "causal_window": dict(causal=True, window=(11, -1)),
    "window_tl": dict(window=(6, 3), align="top_left"),
    "window_0_0": dict(window=(0, 0)),
}
# (seqlen_q, seqlen_k) pairs per mask: 1, 17, 97, 113, 255 with seqlen_q != seqlen_k both ways.
SEQLENS = {
    "none": [(1, 97), (97, 1), (113, 97), (17, 255)],
    "causal": [(1, 17), (113, 17), (97, 113), (113, 113)],
    "causal_tl": [(17, 1), (113, 97), (17, 113)],
    "window": [(97, 17), (17, 97), (113, 113), (255, 17)],
    "window_left": [(113, 97), (1, 113)],
    "window_right": [(97, 113), (113, 17)],
    "causal_window": [(97, 113), (113, 17), (1, 1)],
    "window_tl": [(113, 17), (17, 113)],
    "window_0_0": [(113, 97)],
}
# Tile shapes cycle through equal and unequal BLOCK_M / BLOCK_N (fwd, dq, dkdv).
BLOCKS = [((32, 32), (32, 32), (32, 32)), ((16, 32), (32, 16), (16, 32)), ((32, 16), (16, 32), (32, 16))]
MATRIX = [(m, sq, sk, BLOCKS[i % len(BLOCKS)]) for m in MASKS for i, (sq, sk) in enumerate(SEQLENS[m])]


@pytest.mark.parametrize("mask, sq, sk, blocks", MATRIX, ids=[f"{m}-q{sq}k{sk}" for m, sq, sk, _ in MATRIX])
def test_mask_seqlen_matrix(mask, sq, sk, blocks):
    dtype = F32 if (sq + sk) % 3 == 0 else F16
    q, k, v, do = _inputs(1, 2, 2, sq, sk, 16, dtype=dtype, seed=sq * 7 + sk)
    got = _run_ops(q, k, v, do, **MASKS[mask], fwd=blocks[0], dq=blocks[1], dkdv=blocks[2])
    _check(got, q, k, v, do, **MASKS[mask])


# Rows (and keys) that see nothing, in every mask mode that can produce them, both at the
# top (bottom-right alignment, seqlen_q > seqlen_k) and at the bottom (top-left window).
EMPTY = [
    ("causal_br", 113, 17, dict(causal=True)),
    ("window_br", 97, 17, dict(window=(2, 1))),       # rows 0..78 see nothing
    ("window_tl_tail", 113, 17, dict(window=(3, 0), align="top_left")),  # rows 20.. see nothing
    ("causal_via_window", 97, 97, dict(window=(-1, 0), align="top_left")),  # none empty
    ("causal_window_br", 113, 40, dict(causal=True, window=(5, -1))),
]


@pytest.mark.parametrize("case", EMPTY, ids=[c[0] for c in EMPTY])
def test_rows_that_see_no_key(case):
    name, sq, sk, mk = case
    q, k, v, do = _inputs(1, 2, 1, sq, sk, 24, dtype=F16, seed=sq + sk)
    got = _run_ops(q, k, v, do, **mk, fwd=(32, 16), dq=(16, 32), dkdv=(16, 32))
    row_empty, col_empty = _check(got, q, k, v, do, **mk, empty_rows=name != "causal_via_window")
    if name == "window_tl_tail":
        assert row_empty[20:].all() and not row_empty[:20].any()


# Every residue of the mask diagonals modulo the tile size: the kernels split key (and
# query) ranges into masked / interior / masked tiles with floor and ceil divisions by
# BLOCK_N (BLOCK_M), and an off-by-one there loses or adds one key only for one residue.
# seqlen_k = seqlen_q - 8 .. seqlen_q + 7 moves both diagonals through all 16 residues of
# the 16-wide tiles.  The narrow window has no interior tiles, the wide one has them.
SWEEP_MASKS = {"window_narrow": (40, dict(window=(6, 3))), "window_wide": (72, dict(window=(24, 20))),
               "causal": (40, dict(causal=True))}
SWEEP = [(m, off) for m in SWEEP_MASKS for off in range(-8, 8)]


@pytest.mark.parametrize("mask, off", SWEEP, ids=[f"{m}-off{off}" for m, off in SWEEP])
def test_diagonal_residue_sweep(mask, off):
    sq, mk = SWEEP_MASKS[mask]
    sk = sq + off
    q, k, v, do = _inputs(1, 1, 1, sq, sk, 16, dtype=F32 if off % 2 else F16, seed=sk)
    got = _run_ops(q, k, v, do, **mk, fwd=(16, 16), dq=(16, 16), dkdv=(16, 16))
    _check(got, q, k, v, do, **mk)


# -- head dims (padded to a power of two, masked) -----------------------------------------

HEAD_DIMS = [(8, 8), (40, 40), (72, 72), (80, 80), (96, 96), (160, 160), (192, 192), (256, 256), (192, 128),
             (64, 40)]
HD_MASKS = [dict(), dict(causal=True), dict(window=(7, 2)), dict(causal=True, align="top_left")]


@pytest.mark.parametrize("d, dv", HEAD_DIMS, ids=[f"d{d}v{dv}" for d, dv in HEAD_DIMS])
def test_head_dims(d, dv):
    i = HEAD_DIMS.index((d, dv))
    mk = HD_MASKS[i % len(HD_MASKS)]
    sq, sk = ((33, 47), (47, 33))[i % 2]
    dtype = F32 if i % 3 == 2 else F16
    q, k, v, do = _inputs(1, 2, 1, sq, sk, d, dv, dtype=dtype, seed=d + dv)
    got = _run_ops(q, k, v, do, **mk)
    _check(got, q, k, v, do, **mk)


# -- GQA / MQA ------------------------------------------------------------------------------

GROUPS = [(8, 8, dict(causal=True)), (8, 4, dict(window=(6, 6))), (8, 2, dict()), (8, 1, dict(causal=True)),
          (3, 1, dict(window=(-1, 3))), (4, 1, dict(causal=True, window=(9, -1), align="top_left"))]


@pytest.mark.parametrize("h, hk, mk", GROUPS, ids=[f"h{h}kv{hk}" for h, hk, _ in GROUPS])
def test_group_sizes(h, hk, mk):
    q, k, v, do = _inputs(2 if hk == 4 else 1, h, hk, 37, 29, 16, dtype=F16, seed=h * 10 + hk)
    got = _run_ops(q, k, v, do, **mk)
    assert got["dK"].shape == k.shape and got["dV"].shape == v.shape
    _check(got, q, k, v, do, **mk)


# -- memory the kernels must never read --------------------------------------------------

def _in_poisoned(t, rows=0, cols=0, fill=NAN):
    """A view of ``t``'s values inside a larger buffer whose extra seqlen rows / head-dim
    columns hold ``fill``."""
    b, h, s, d = t.shape
    buf = torch.full((b, h, s + rows, d + cols), fill, dtype=t.dtype)
    buf[:, :, :s, :d] = t
    return buf[:, :, :s, :d]


PAST = [("none", dict(), 41, 77, 40), ("causal", dict(causal=True), 77, 41, 40),
        ("window", dict(window=(20, 3)), 61, 61, 24), ("causal_tl", dict(causal=True, align="top_left"), 50, 75, 72)]


@pytest.mark.parametrize("name, mk, sq, sk, d", PAST, ids=[p[0] for p in PAST])
def test_nan_and_inf_past_seqlen_and_head_dim(name, mk, sq, sk, d):
    """k, v (and q, dO) are slices of buffers holding NaN / Inf past seqlen and in the
    head-dim columns the kernel pads to (40 -> 64, 24 -> 32, 72 -> 128)."""
    q, k, v, do = _inputs(1, 2, 2, sq, sk, d, dtype=F16, seed=sq + sk + d)
    fill_k, fill_v = (NAN, NAN) if name != "window" else (float("inf"), float("-inf"))
    kp, vp = _in_poisoned(k, 40, 16, fill_k), _in_poisoned(v, 40, 16, fill_v)
    qp, dop = _in_poisoned(q, 40, 16), _in_poisoned(do, 40, 16)
    assert not torch.isfinite(kp.as_strided((1, 2, sk + 40, d + 16), kp.stride())).all()  # the poison is there
    got = _run_ops(qp, kp, vp, dop, **mk, fwd=(32, 16), dq=(32, 16), dkdv=(16, 32))
    _check(got, q, k, v, do, **mk)


# -- layouts -------------------------------------------------------------------------------

@pytest.mark.parametrize("mk", [dict(), dict(causal=True, align="top_left")], ids=["none", "causal_tl"])
def test_packed_qkv_and_strided_outputs(mk):
    """q, k, v are slices of one packed (b, s, h + 2 hk, d) tensor; dQ, dK, dV go into
    slices of one packed gradient buffer and O into a (b, s, h, d) view, all NaN first."""
    b, s, h, hk, d = 2, 45, 4, 2, 32
    torch.manual_seed(11)
    qkv = _rand(b, s, h + 2 * hk, d)
    q, k, v = (qkv[:, :, a:z].transpose(1, 2) for a, z in ((0, h), (h, h + hk), (h + hk, h + 2 * hk)))
    assert q.stride() == ((h + 2 * hk) * s * d, d, (h + 2 * hk) * d, 1)
    do = _rand(b, s, h, d).transpose(1, 2)
    dqkv = torch.full_like(qkv, NAN)
    o_buf = torch.full((b, s, h, d), NAN, dtype=F16)
    outs = dict(O=o_buf.transpose(1, 2), dQ=dqkv[:, :, :h].transpose(1, 2), dK=dqkv[:, :, h:h + hk].transpose(1, 2),
                dV=dqkv[:, :, h + hk:].transpose(1, 2))
    got = _run_ops(q, k, v, do, **mk, outs=outs)
    assert got["O"].data_ptr() == o_buf.data_ptr() and got["dQ"].data_ptr() == dqkv.data_ptr()
    assert not torch.isnan(dqkv).any() and not torch.isnan(o_buf).any()  # every element written
    _check(got, q.contiguous(), k.contiguous(), v.contiguous(), do.contiguous(), **mk)


def test_expanded_kv_heads_and_broadcast_grad_output():
    """k, v expanded to all heads with stride 0 (and batch stride 0) through
    flashgen.attention; dO from (O * w).sum() has strides (0, 0, 0, 1); the gradients
    of the expanded bases are the sums over heads and batch."""
    b, h, sq, sk, d, dv = 2, 2, 29, 41, 16, 24
    torch.manual_seed(12)
    q = _rand(b, h, sq, d).requires_grad_()
    kb, vb = _rand(1, 1, sk, d).requires_grad_(), _rand(1, 1, sk, dv).requires_grad_()
    k, v = kb.expand(b, h, sk, d), vb.expand(b, h, sk, dv)
    assert k.stride()[:2] == (0, 0)
    w = _rand(dv)
    o, lse = flashgen.attention(q, k, v, window=(8, 2), return_lse=True)
    (o * w).sum().backward()
    kk, vv = k.detach().contiguous(), v.detach().contiguous()
    do = w.expand(b, h, sq, dv)
    rkw = dict(window=(8, 2))
    got = dict(O=o.detach(), LSE=lse, dQ=q.grad)
    _check(got, q.detach(), kk, vv, do, **rkw)
    r_dk, r_dv = reference.backward(do, q.detach(), kk, vv, **rkw)[1:]
    b_dk, b_dv = reference.backward(do, q.detach(), kk, vv, dtype=F16, **rkw)[1:]
    for name, g, r, bb in (("dK", kb.grad, r_dk, b_dk), ("dV", vb.grad, r_dv, b_dv)):
        assert g.shape == (1, 1, sk, r.shape[-1])
        rs, bs = r.sum((0, 1), keepdim=True), bb.float().sum((0, 1), keepdim=True)
        # the sum over b * h = 4 heads runs in autograd (float16): 4x the floor
        err, base_err = reference.max_error(g, rs), reference.max_error(bs, rs)
        assert err <= 2 * base_err + 4 * 2e-3, f"{name}: err {err:.3g} > 2 x {base_err:.3g} + floor"


@pytest.mark.parametrize("dtype", [F16, F32])
def test_sum_backward_with_transposed_views_and_lse(dtype):
    """o.sum().backward(): dO is ones with every stride 0; q a (b, s, h, d) view; GQA 2;
    return_lse gives (b, h, sq) float32."""
    b, h, hk, sq, sk, d = 1, 4, 2, 33, 20, 40
    torch.manual_seed(13)
    q = _rand(b, sq, h, d, dtype=dtype).transpose(1, 2).requires_grad_()
    k = _rand(b, sk, hk, d, dtype=dtype).transpose(1, 2).requires_grad_()
    v = _rand(b, hk, sk, d, dtype=dtype).requires_grad_()
    o, lse = flashgen.attention(q, k, v, causal=True, return_lse=True)
    assert o.dtype == dtype and o.shape == (b, h, sq, d)
    assert lse.dtype == torch.float32 and lse.shape == (b, h, sq) and not lse.requires_grad
    o.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
    do = torch.ones(b, h, sq, d, dtype=dtype)
    got = dict(O=o.detach(), LSE=lse, dQ=q.grad, dK=k.grad, dV=v.grad)
    _check(got, q.detach(), k.detach(), v.detach(), do, causal=True, empty_rows=True)


# -- through flashgen.api._attention: top-left alignment, softmax_scale -------------------

@pytest.mark.parametrize("sq, sk, mk", [(45, 21, dict(causal=True)), (21, 45, dict(causal=True)),
                                        (45, 21, dict(causal=True, window=(4, -1))), (30, 30, dict(window=(3, 5)))],
                         ids=["causal_q>k", "causal_q<k", "causal_window", "window_square"])
def test_top_left_through_the_api(sq, sk, mk):
    q, k, v, do = _inputs(1, 2, 1, sq, sk, 32, dtype=F32, seed=sq * sk)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o, lse = _attention(q, k, v, causal=mk.get("causal", False), window=mk.get("window", (-1, -1)),
                        softmax_scale=None, return_lse=True, align="top_left")
    o.backward(do)
    got = dict(O=o.detach(), LSE=lse, dQ=q.grad, dK=k.grad, dV=v.grad)
    _check(got, q.detach(), k.detach(), v.detach(), do, **mk, align="top_left")
    if sq != sk:  # the two alignments differ here, so this would fail with bottom-right bounds
        bo = reference.forward(q.detach(), k.detach(), v.detach(), **mk)[0]
        assert reference.max_error(o, bo) > 0.1


def test_softmax_scale_none_and_explicit():
    """None means 1/sqrt(head_dim of q/k), also when head_dim_v differs (192 / 128);
    an explicit scale is used as given."""
    q, k, v, do = _inputs(1, 2, 2, 19, 26, 192, 128, dtype=F16, seed=14)
    o_none = flashgen.attention(q, k, v, causal=True)
    o_expl = flashgen.attention(q, k, v, causal=True, softmax_scale=192 ** -0.5)
    assert torch.equal(o_none, o_expl)
    o_v = flashgen.attention(q, k, v, causal=True, softmax_scale=128 ** -0.5)
    assert not torch.equal(o_none, o_v)
    for scale in (None, 0.02, 2.0):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        o, lse = flashgen.attention(qq, kk, vv, causal=True, softmax_scale=scale, return_lse=True)
        o.backward(do)
        got = dict(O=o.detach(), LSE=lse, dQ=qq.grad, dK=kk.grad, dV=vv.grad)
        _check(got, q, k, v, do, causal=True, scale=scale)


def test_softmax_scale_zero_with_empty_rows():
    """scale 0: each row averages the values it sees; rows that see none give 0 / -inf."""
    b, h, sq, sk, d = 1, 2, 40, 23, 16
    q, k, v, do = _inputs(b, h, h, sq, sk, d, dtype=F16, seed=15)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o, lse = flashgen.attention(q, k, v, window=(4, 1), softmax_scale=0.0, return_lse=True)
    o.backward(do)
    vis = _visible(sq, sk, False, (4, 1), "bottom_right")
    cnt = vis.sum(1).double()
    avg = (vis.double() @ v.detach().double()) / cnt.clamp(min=1)[:, None]
    assert (o.detach().double() - avg).abs().max().item() < 2e-3
    assert torch.equal(torch.isneginf(lse[0, 0]), cnt == 0) and (cnt == 0).any()
    assert torch.allclose(lse[:, :, cnt > 0].double(), cnt[cnt > 0].log().expand(b, h, -1), atol=1e-5)
    got = dict(O=o.detach(), LSE=lse, dQ=q.grad, dK=k.grad, dV=v.grad)
    _check(got, q.detach(), k.detach(), v.detach(), do, window=(4, 1), scale=0.0, empty_rows=True)
    assert torch.equal(q.grad, torch.zeros_like(q.grad))


# -- determinism ---------------------------------------------------------------------------

def test_bit_identical_repeats():
    """The dK/dV kernel loops over the GQA group in a fixed order (no atomics): repeated
    calls agree bit for bit, at ops level and through flashgen.attention (default configs)."""
    q, k, v, do = _inputs(1, 4, 1, 37, 45, 24, dtype=F32, seed=16)
    mk = dict(window=(19, 7))
    a = _run_ops(q, k, v, do, **mk, fwd=(16, 32), dq=(16, 32), dkdv=(16, 32))
    b = _run_ops(q, k, v, do, **mk, fwd=(16, 32), dq=(16, 32), dkdv=(16, 32))
    for name in NAMES:
        assert torch.equal(a[name], b[name]), name
    _check(a, q, k, v, do, **mk)

    def api():
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        o, lse = flashgen.attention(qq, kk, vv, **mk, return_lse=True)
        o.backward(do)
        return o, lse, qq.grad, kk.grad, vv.grad
    for x, y in zip(api(), api()):
        assert torch.equal(x, y)


# -- the checks themselves can fail ----------------------------------------------------------

def test_the_check_rejects_a_wrong_mask_and_an_unwritten_element():
    q, k, v, do = _inputs(1, 2, 2, 45, 21, 16, dtype=F16, seed=17)
    got = _run_ops(q, k, v, do, causal=True)
    _check(got, q, k, v, do, causal=True)
    with pytest.raises(AssertionError):
        _check(got, q, k, v, do, causal=True, align="top_left")
    bad = dict(got, dK=got["dK"].clone())
    bad["dK"][0, 1, 20, 3] = NAN
    with pytest.raises(AssertionError, match="dK: NaN"):
        _check(bad, q, k, v, do, causal=True)
    bad = dict(got, O=got["O"].clone())
    bad["O"][0, 0, 30, 0] += 0.01
    with pytest.raises(AssertionError, match="O: err"):
        _check(bad, q, k, v, do, causal=True)


# -- the tuner's per-variant check (flashgen.bench.check_variant) ---------------------------

def test_bench_check_variant_covers_windows_and_top_left(monkeypatch):
    """check_variant runs window variants (a window, causal + window, top-left) and both
    causal alignments, and fails a kernel that gets the wrong diagonal."""
    monkeypatch.setattr(bench, "CHECK_SEQLENS", (37, 45))  # the interpreter's cost is per tile
    cases = {m: bench.mask_cases(KernelSpec("fwd", "float16", 16, 16, m), group=2) for m in ("none", "causal", "window")}
    assert {m["align"] for _, m in cases["causal"]} == {"bottom_right", "top_left"}
    assert {(m["causal"], m["align"]) for _, m in cases["window"]} == {
        (False, "bottom_right"), (True, "bottom_right"), (False, "top_left")}
    assert all(s.num_heads == 2 * s.num_kv_heads == 4 for c in cases.values() for s, _ in c)
    ok, ratio, msg = bench.check_variant(Variant(KernelSpec("bwd_dkdv", "float16", 16, 16, "window"),
                                                 TileConfig(32, 64, 4, 1)), 2, device="cpu")
    assert ok and 0 < ratio <= 1 and msg.count("dK err") == 3, msg
    # the kernel gets top-left bounds whatever the case asks for: the bottom-right case fails
    monkeypatch.setattr(bench, "mask_bounds",
                        lambda sq, sk, **m: masks.mask_bounds(sq, sk, **{**m, "align": "top_left"}))
    ok, ratio, msg = bench.check_variant(Variant(KernelSpec("fwd", "float16", 16, 16, "causal"),
                                                 TileConfig(32, 32, 4, 1)), 1, device="cpu")
    assert not ok and ratio > 1, msg


def test_bench_check_variant_demands_bitwise_repeats_of_a_deterministic_config(monkeypatch):
    """A config its family declares bitwise repeatable (``deterministic``) runs three times
    per case; outputs that differ between runs in the last bit fail the check, although
    each run is within the float64 rule."""
    monkeypatch.setattr(bench, "CHECK_SEQLENS", (37, 45))
    fam = bench.families.FAMILIES["triton"]
    monkeypatch.setattr(fam, "deterministic", lambda cfg: True, raising=False)
    variant = Variant(KernelSpec("bwd_dkdv", "float16", 16, 16, "none"), TileConfig(32, 64, 4, 1))
    ok, ratio, msg = bench.check_variant(variant, 1, device="cpu")
    assert ok and ratio <= 1 and "not bitwise repeatable" not in msg, msg
    real = bench.run_variant
    calls = []

    def drifting(*a, **kw):
        fn, outs = real(*a, **kw)

        def run():
            fn()
            calls.append(1)
            if len(calls) % 3 == 2:  # the second of each case's three runs moves dV by one ulp
                dv = outs["dV"]
                dv.view(torch.int16)[0, 0, 0, 0] += 1
        return run, outs

    monkeypatch.setattr(bench, "run_variant", drifting)
    ok, ratio, msg = bench.check_variant(variant, 1, device="cpu")
    assert not ok and ratio <= 1 and msg.startswith("not bitwise repeatable:") and "dV" in msg, msg
    assert len(calls) == 3 * len(bench.mask_cases(variant.spec, 1))

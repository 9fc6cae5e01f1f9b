"""User score and mask functions (score_mod / mask_mod, FlexAttention's signatures) and
learnable sinks, through the Triton interpreter: forward and backward (captured
tensors' and sinks' gradients included) against a float64 materialized reference with
the exactness rule of the dense path; functions equal to built-in mods or masks give
the built-in's output; block ranges; variant identity; clear errors."""

import json
import math
import re
import subprocess
import sys
import types

import pytest
import torch

import flashgen
from flashgen import InputError, UnsupportedError, bench, heuristics, user_examples, user_grads, user_mods, user_render
from flashgen.masks import mask_bounds
from flashgen.spec import KernelSpec, TileConfig, Variant, compiled_variant, is_user_mods

pytestmark = pytest.mark.usefixtures("hermetic_dispatcher")
F16, F32 = torch.float16, torch.float32


@pytest.fixture(params=[(16, 16)], ids=lambda t: f"m{t[0]}n{t[1]}")
def tiles(request, monkeypatch):
    """Small tiles for every dense kernel, so that the test sizes span several blocks
    (block ranges with skipped, partial and interior tiles)."""
    bm, bn = request.param
    base = heuristics.default_config

    def small(spec, arch, key=None):
        if spec.kernel in ("fwd", "bwd_dq", "bwd_dkdv"):
            return TileConfig(bm, bn, 4, 1)
        return base(spec, arch, key)
    monkeypatch.setattr(heuristics, "default_config", small)
    return bm, bn


def _qkv(b=2, h=4, hk=2, sq=37, sk=45, d=16, dtype=F16, seed=0, positive=False):
    """Random q, k, v; ``positive``: q and k of positive entries (every score > 0)."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(b, h, sq, d, generator=g), torch.randn(b, hk, sk, d, generator=g)
    if positive:
        q, k = q.abs(), k.abs()
    return [q.to(dtype), k.to(dtype), torch.randn(b, hk, sk, d, generator=g).to(dtype)]


def _run(make, tensors=(), *, causal=False, window=(-1, -1), sinks=None, dtype=F16, check=True, **sizes):
    """flashgen vs the float64 reference (and torch at the input dtype as the error
    baseline): O, LSE, dQ, dK, dV, the gradients of ``tensors`` (captured by the
    functions ``make(*tensors)`` returns as (score_mod, mask_mod)) and of ``sinks``."""
    q, k, v = _qkv(dtype=dtype, **sizes)
    sq, sk, d = q.shape[2], k.shape[2], q.shape[3]
    do = torch.randn(q.shape[0], q.shape[1], sq, v.shape[3], generator=torch.Generator().manual_seed(7)).to(dtype)
    _, lo, hi = mask_bounds(sq, sk, causal=causal, window=window)

    def run(kind, qkv, caps, snk):
        qkv = [t.detach().clone().requires_grad_() for t in qkv]
        caps = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in caps]
        snk = None if snk is None else snk.detach().clone().requires_grad_()
        sm, mm = make(*caps)
        if kind == "flashgen":
            o, lse = flashgen.attention(*qkv, causal=causal, window=window, score_mod=sm, mask_mod=mm, sinks=snk,
                                        return_lse=True)
        else:
            o, lse = user_mods.reference(*qkv, d ** -0.5, lo, hi, sm, mm, snk, kind)
        o.backward(do.to(o.dtype))
        # a reference whose result ignores q and k (a score function of positions only) leaves their grad None
        grad = [torch.zeros_like(t) if t.grad is None else t.grad for t in qkv]
        out = {"O": o.detach(), "LSE": lse.detach(), "dQ": grad[0], "dK": grad[1], "dV": grad[2]}
        out.update({f"d{n}": t.grad for n, t in enumerate(caps) if t.is_floating_point()})
        if snk is not None:
            out["dsinks"] = snk.grad
        return out

    got = run("flashgen", (q, k, v), tensors, sinks)
    ref = run(torch.float64, (q, k, v), [t.double() if t.is_floating_point() else t for t in tensors],
              None if sinks is None else sinks.double())
    base = run(dtype, (q, k, v), tensors, sinks)
    res = bench._ratios(got, {n: (ref[n], base[n]) for n in got}, dtype)
    if check:
        assert all(r <= 1.0 for _, _, r in res.values()), res
    return got, res


# -- the examples ------------------------------------------------------------------------

def t5_bucket(rel, num_buckets=16, max_distance=100):
    """T5's bidirectional relative-position bucket (transformers' _relative_position_bucket)."""
    num_buckets //= 2
    buckets = (rel > 0).to(torch.long) * num_buckets
    rel = torch.abs(rel)
    max_exact = num_buckets // 2
    is_small = rel < max_exact
    large = max_exact + (torch.log(rel.float() / max_exact) / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).to(torch.long)
    large = torch.min(large, torch.full_like(large, num_buckets - 1))
    return buckets + torch.where(is_small, rel, large)


def t5_bias(table):
    def score_mod(score, b, h, q_idx, kv_idx):
        return score + table[t5_bucket(kv_idx - q_idx), h]
    return score_mod, None


def _bwd_lowering(make, tensors):
    st = user_mods.trace(make(*[t.detach().clone().requires_grad_() for t in tensors])[0], "score")
    return user_mods._lowered("bwd", st, None, [True] * len(st.bufs), False)


@pytest.mark.parametrize("path", ["reduced", "per-element"])
@pytest.mark.parametrize("causal", [False, True])
def test_relative_position_bias_with_a_learned_table(tiles, causal, path, monkeypatch):
    """The table's gradient summed per bucket inside the dQ tile (its 16 buckets <=
    MAX_EXTENT) and, with MAX_EXTENT 0, by one atomic per score element."""
    if path == "per-element":
        monkeypatch.setattr(user_grads, "MAX_EXTENT", 0)
    table = torch.randn(16, 4, generator=torch.Generator().manual_seed(3))
    assert isinstance(_bwd_lowering(t5_bias, [table]), user_grads.Reduced) == (path == "reduced")
    got, _ = _run(t5_bias, [table], causal=causal)
    assert got["d0"].abs().max() > 0.1  # the table's gradient is there (and checked above)


def test_reduced_and_per_element_gradients_in_one_function(tiles):
    """A table reduced in the tile (bucket, head), one whose second index depends on the
    query row (per-element atomics: the reduction needs the other components constant
    over the tile), one too large to reduce (extent 80 > MAX_EXTENT) and a per-key
    vector (summed over the tile's rows), all with their gradients vs float64."""
    g = torch.Generator().manual_seed(4)
    tensors = [torch.randn(16, 4, generator=g), torch.randn(16, 3, generator=g), torch.randn(80, generator=g),
               torch.randn(45, generator=g)]

    def make(t1, t2, t3, kb):
        def score_mod(score, b, h, q_idx, kv_idx):
            bucket = t5_bucket(kv_idx - q_idx)
            return score + t1[bucket, h] + t2[bucket, q_idx % 3] * 0.5 + t3[bucket * 5] - kb[kv_idx]
        return score_mod, None
    low = _bwd_lowering(make, tensors)
    assert [(r.buf, r.dim, r.extent) for r in low.reductions] == [(0, 0, 16)]
    got, _ = _run(make, tensors, causal=True)
    assert all(got[f"d{n}"].abs().max() > 0.05 for n in range(4))


def _same_as_builtin(q, k, v, user_kw, builtin_kw, causal):
    """O, LSE, dQ, dK, dV of a user function equal the built-in's (both flashgen)."""
    outs = []
    for kw in (user_kw, builtin_kw):
        qkv = [t.clone().requires_grad_() for t in (q, k, v)]
        o, lse = flashgen.attention(*qkv, causal=causal, return_lse=True, **kw)
        o.float().sum().backward()
        outs.append([o, lse] + [t.grad for t in qkv])
    for a, b in zip(*outs):
        assert (a.float() - b.float()).abs().max() <= 2e-3


def test_alibi_written_as_a_score_mod_equals_alibi_slopes(tiles):
    q, k, v = _qkv()
    slopes = torch.rand(4, generator=torch.Generator().manual_seed(1))
    sq, sk = q.shape[2], k.shape[2]

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * torch.abs(q_idx + (sk - sq) - kv_idx)
    for causal in (False, True):
        _same_as_builtin(q, k, v, dict(score_mod=alibi), dict(alibi_slopes=slopes), causal)


def test_tanh_soft_cap_written_as_a_score_mod_equals_softcap(tiles):
    q, k, v = _qkv()

    def cap(score, b, h, q_idx, kv_idx):
        return 1.5 * torch.tanh(score / 1.5)
    _same_as_builtin(q * 2, k, v, dict(score_mod=cap), dict(softcap=1.5), True)
    _run(lambda: (cap, None), causal=True)


def test_prefix_lm_mask(tiles):
    prefix = torch.tensor([13, 29])  # per batch entry

    def make(prefix):
        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) | (kv_idx < prefix[b])
        return None, mask_mod
    _run(make, [prefix], sq=45, sk=45)


@pytest.mark.parametrize("causal", [False, True])
def test_document_mask_from_a_document_id_tensor(tiles, causal):
    doc = torch.tensor([0] * 10 + [1] * 20 + [2] * 15)  # 45 tokens, boundaries inside tiles

    def make(doc):
        def mask_mod(b, h, q_idx, kv_idx):
            return doc[q_idx] == doc[kv_idx]
        return None, mask_mod
    got, _ = _run(make, [doc], causal=causal, sq=45, sk=45)


def test_a_captured_bool_mask_is_read_in_place(tiles):
    """A mask_mod reading a bool tensor (a padding mask, as the transformers integration
    passes gpt-oss's): the kernels read the tensor's own bytes as int8, so a call keeps no
    copy of it for the backward (one per layer call before), and the result is exact."""
    g = torch.Generator().manual_seed(3)
    mask = torch.rand(2, 1, 45, 45, generator=g) > 0.3
    mask[1, 0, :5] = False  # rows that see no key

    def make(mask):
        def mask_mod(b, h, q_idx, kv_idx):
            return mask[b, 0, q_idx, kv_idx]
        return None, mask_mod
    _run(make, [mask], sq=45, sk=45)
    q, k, v = (t.requires_grad_() for t in _qkv(sq=45, sk=45))
    o = flashgen.attention(q, k, v, mask_mod=make(mask)[1])
    bufs = o.grad_fn.call.fwd.bufs
    assert len(bufs) == 1 and bufs[0].dtype == torch.int8 and bufs[0].data_ptr() == mask.data_ptr()
    # a non-contiguous mask (a transposed view) is still copied into the layout the kernels read
    mask_t = mask.transpose(-1, -2).contiguous().transpose(-1, -2)
    o = flashgen.attention(q, k, v, mask_mod=make(mask_t)[1])
    assert o.grad_fn.call.fwd.bufs[0].is_contiguous()


@pytest.mark.parametrize("expr", ["not", "and", "int", "mul", "add", "max", "score"])
def test_a_captured_bool_tensor_follows_torchs_bool_semantics(tiles, expr):
    """A captured bool tensor's value is a bool, as in torch: ``~`` is the logical not
    (the kernels read its bytes as int8, whose bitwise not, -1 or -2, was never 0, so every
    key attended), ``.int()`` makes it 0 or 1 (whose ~ is -1 or -2), and bool * bool,
    bool + bool and the maximum of bools are bools (and, or, or)."""
    g = torch.Generator().manual_seed(5)
    mask, other = (torch.rand(2, 1, 40, 40, generator=g) > 0.5 for _ in range(2))

    def make(mask, other):
        def pick(b, q, kv):
            m, o = mask[b, 0, q, kv], other[b, 0, q, kv]
            return {"not": ~m | ~(o & (q >= kv)), "and": m & o | (q == kv), "int": (~m.int()) != -1,
                    "mul": ~(m * o) | (q == kv), "add": ~(m + o) | (q == kv),
                    "max": ~torch.maximum(m, o) | (q == kv), "score": ~(m * o)}[expr]

        if expr == "score":
            return (lambda s, b, h, q, kv: torch.where(pick(b, q, kv), s, s - 3.0)), None
        return None, (lambda b, h, q, kv: pick(b, q, kv))
    _run(make, [mask, other], sq=40, sk=40)


@pytest.mark.parametrize("value", ["finfo-min-row", "huge-positive"])
def test_a_captured_bias_past_the_clamp_is_clamped_as_bias_is(tiles, value):
    """A captured float32 tensor added to the score is a bias: its values past +-2.3e38 are
    clamped as ``bias=`` scores are (the kernels scale scores by log2(e) into base 2,
    where finfo.min overflowed to -inf: a row of finfo.min gave O = 0, LSE = -inf
    instead of the mean of V, and 3e38 gave NaN).  A slope's product is not clamped (the
    built-in ALiBi is not either): that function keeps its variant name."""
    q, k, v = _qkv(b=1, h=2, hk=2, sq=20, sk=24, dtype=F32)
    t = torch.zeros(1, 2, 20, 24)
    if value == "finfo-min-row":
        t[0, 1, 3, :] = torch.finfo(torch.float32).min
        t[0, 0, 5, ::2] = torch.finfo(torch.float32).min
    else:
        t[0, :, :, 7] = 3e38
    o, lse = flashgen.attention(q, k, v, score_mod=lambda s, b, h, i, j: s + t[b, h, i, j], return_lse=True)
    ob, lseb = flashgen.attention(q, k, v, bias=t, return_lse=True)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    assert torch.allclose(o, ob, atol=1e-5) and torch.allclose(lse, lseb, rtol=1e-6)
    if value == "finfo-min-row":
        assert torch.allclose(o[0, 1, 3], v[0, 1].mean(0), atol=1e-5)
    else:
        assert torch.allclose(o[0], v[0, :, 7:8].expand(2, 20, 16), atol=1e-5)
    slopes, half = torch.rand(2), torch.zeros(24, dtype=torch.float16)
    guarded = [lambda s, b, h, i, j: s + t[b, h, i, j], lambda s, b, h, i, j: (s + t[b, h, i, j]) / 3.0,
               lambda s, b, h, i, j: s - t[b, h, i, j].abs(), lambda s, b, h, i, j: s + 1.0 * t[b, h, i, j],
               lambda s, b, h, i, j: torch.where(i > j, s, t[b, h, i, j]),
               lambda s, b, h, i, j: torch.where(i > j, s, -3.4e38)]
    unguarded = [lambda s, b, h, i, j: s - slopes[h] * (i - j).abs().float(), lambda s, b, h, i, j: s + half[j],
                 lambda s, b, h, i, j: s * 2.0,
                 lambda s, b, h, i, j: torch.where(t[b, h, i, j] != torch.finfo(torch.float32).min, s, -1e4)]
    assert all(user_mods.trace(f, "score").guard for f in guarded)
    assert not any(user_mods.trace(f, "score").guard for f in unguarded)


def test_the_reference_path_normalizes_at_any_magnitude():
    """The CPU reference path (no interpreter): a row whose scores are all near -3.4e38
    (a fully padded row of an additive finfo.min mask) or all tied at a huge scale is
    the mean of its values; exp(s - LSE) in float32 summed to seqlen_k there (LSE loses
    log(seqlen_k) at that magnitude)."""
    import os

    env = dict(os.environ, TRITON_INTERPRET="0")
    code = """
import torch, flashgen, torch.nn.functional as F
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 1, n, 16, generator=g) for n in (4, 6, 6))
m = torch.zeros(1, 1, 4, 6); m[..., 3, :] = torch.finfo(torch.float32).min
o, lse = flashgen.attention(q, k, v, bias=m, return_lse=True)
assert (o[0, 0, 3] - v[0, 0].mean(0)).abs().max() < 1e-5, o
ref = lambda q, k, v, **kw: F.scaled_dot_product_attention(q.double(), k.double(), v.double(), **kw).float()
assert torch.allclose(o[0, 0, :3], ref(q, k, v)[0, 0, :3], atol=1e-5)
k2 = k.clone(); k2[..., 1:, :] = k2[..., :1, :]
o2 = flashgen.attention(q, k2, v, softmax_scale=1e9)
assert (o2 - ref(q, k2, v, scale=1e9)).abs().max() < 1e-5, o2  # float32 SDPA on some CPUs is off by 0.6 here
t = torch.zeros(1, 1, 4, 6); t[0, 0, 3, :] = torch.finfo(torch.float32).min
o3 = flashgen.attention(q, k, v, score_mod=lambda s, b, h, i, j: s + t[b, h, i, j])
assert (o3[0, 0, 3] - v[0, 0].mean(0)).abs().max() < 1e-5, o3
o4, lse4 = flashgen.attention(q, k, v, score_mod=lambda s, b, h, i, j: torch.log(s), return_lse=True)
assert lse4.isnan().any() and not (lse4 == float("-inf")).any()  # a NaN row is NaN, not "no key"
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


def test_a_mask_mod_written_as_causal_equals_causal(tiles):
    q, k, v = _qkv(sq=37, sk=45)
    off = 45 - 37

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + off
    a = flashgen.attention(q, k, v, mask_mod=causal, return_lse=True)
    b = flashgen.attention(q, k, v, causal=True, return_lse=True)
    for x, y in zip(a, b):
        assert (x.float() - y.float()).abs().max() <= 1e-3


def test_a_mask_mod_written_as_a_window_equals_window(tiles):
    q, k, v = _qkv(sq=45, sk=45)

    def window(b, h, q_idx, kv_idx):
        return (kv_idx >= q_idx - 7) & (kv_idx <= q_idx + 3)
    a = flashgen.attention(q, k, v, mask_mod=window, return_lse=True)
    b = flashgen.attention(q, k, v, window=(7, 3), return_lse=True)
    for x, y in zip(a, b):
        assert (x.float() - y.float()).abs().max() <= 1e-3


def test_sliding_window_plus_causal(tiles):
    def make():
        def mask_mod(b, h, q_idx, kv_idx):
            return q_idx - kv_idx <= 9
        return None, mask_mod
    _run(make, causal=True, sq=45, sk=45)


@pytest.mark.parametrize("window", [(-1, -1), (11, -1)], ids=["causal", "causal-window"])
def test_sinks_with_causal_and_a_window(tiles, window):
    sinks = torch.tensor([0.5, -1.0, 2.0, 4.0])
    got, _ = _run(lambda: (None, None), causal=True, window=window, sinks=sinks, sq=45, sk=45)
    assert got["dsinks"].abs().min() > 0



@pytest.mark.parametrize("view", ["strided", "expanded"])
def test_sinks_of_any_stride_are_read_per_head(tiles, view):
    """A strided or expanded (num_heads,) sinks tensor: the kernel read it as contiguous
    (head h at data_ptr + h: O off by 0.2 and the sinks' gradient by 0.02)."""
    base = torch.nn.Parameter(torch.tensor([0.5, 9.0, -1.0, 9.0, 2.0, 9.0, 4.0, 9.0]))
    q, k, v = _qkv(b=1, h=4, hk=2, sq=9, sk=11, dtype=F32)
    sinks = base[::2] if view == "strided" else base[:1].expand(4)
    do = torch.randn(1, 4, 9, 16, generator=torch.Generator().manual_seed(1))
    o, lse = flashgen.attention(q, k, v, sinks=sinks, return_lse=True)
    (o * do).sum().backward()
    ref = base.detach().double().requires_grad_()
    _, lo, hi = mask_bounds(9, 11, causal=False, window=(-1, -1))
    ro, rl = user_mods.reference(q.double(), k.double(), v.double(), 0.25, lo, hi, None, None,
                                 ref[::2] if view == "strided" else ref[:1].expand(4), torch.float64)
    (ro * do.double()).sum().backward()
    assert (o.double() - ro).abs().max() < 1e-5 and (lse.double() - rl).abs().max() < 1e-5
    assert (base.grad.double() - ref.grad).abs().max() < 1e-5

def test_sinks_take_the_backward_the_dispatcher_picks_and_its_delta(tiles, monkeypatch):
    """Sinks alone run the plain backward: the dispatcher's plan, a whole-backward
    family's too (the Gluon one on sm_90; here a stand-in running the Triton kernels),
    not forced onto the two deterministic kernels; the whole backward writes delta, from
    which d(sinks) comes (checked against float64)."""
    import dataclasses

    from flashgen import families, library

    real_kernels, real_launcher = library.backward_kernels, families.launcher
    whole = []

    def plan(q, k, v, mask, mods, deterministic):
        two = real_kernels(q, k, v, mask, mods, deterministic)
        if deterministic or mods:
            return two
        return dataclasses.replace(two[0][0], family="gluon"), two  # a whole backward's (cfg, module)

    def launcher(family, name):
        if (family, name) != ("gluon", "bwd"):
            return real_launcher(family, name)

        def bwd(do, q, k, v, o, lse, *, config, module, delta=None, **kw):
            whole.append(delta is not None)
            (cfg_dq, mod_dq), (cfg_kv, mod_kv) = module
            return real_launcher("triton", "bwd")(do, q, k, v, o, lse, config_dq=cfg_dq, config_dkdv=cfg_kv,
                                                  module_dq=mod_dq, module_dkdv=mod_kv, delta=delta, **kw)
        return bwd
    monkeypatch.setattr(library, "backward_kernels", plan)
    monkeypatch.setattr(families, "launcher", launcher)
    sinks = torch.tensor([0.5, -1.0, 2.0, 4.0])
    got, _ = _run(lambda: (None, None), causal=True, sinks=sinks, sq=45, sk=45)
    assert whole == [True] and got["dsinks"].abs().min() > 0


def test_sinks_with_a_score_and_mask_function_in_float32(tiles):
    doc = torch.tensor([0] * 20 + [1] * 25)

    def make(table, doc):
        def score_mod(score, b, h, q_idx, kv_idx):
            return score + table[h] * (q_idx - kv_idx).float() / 16
        def mask_mod(b, h, q_idx, kv_idx):
            return doc[q_idx] == doc[kv_idx]
        return score_mod, mask_mod
    _run(make, [torch.randn(4), doc], causal=True, sinks=torch.randn(4), dtype=F32, sq=45, sk=45)


def test_lse_includes_the_sink_and_an_empty_row_gets_the_sink(tiles):
    """seqlen_q > seqlen_k with bottom-right causal: the first rows see no key."""
    q, k, v = _qkv(sq=40, sk=20)
    sinks = torch.tensor([0.5, -1.0, 2.0, 4.0])
    o, lse = flashgen.attention(q, k, v, causal=True, sinks=sinks, return_lse=True)
    assert torch.equal(lse[:, :, :20], sinks[None, :, None].expand(2, 4, 20))
    assert (o[:, :, :20] == 0).all()
    _, plain = flashgen.attention(q, k, v, causal=True, return_lse=True)
    want = torch.logaddexp(plain[:, :, 20:], sinks[None, :, None])
    assert (lse[:, :, 20:] - want).abs().max() < 1e-3


@pytest.mark.parametrize("tiles", [(32, 16), (16, 32)], indirect=True, ids=["m32n16", "m16n32"])
def test_block_mask_follows_the_tile_config(tiles):
    doc = torch.tensor([0] * 10 + [1] * 20 + [2] * 15)

    def make(doc):
        return None, lambda b, h, q_idx, kv_idx: doc[q_idx] == doc[kv_idx]
    _run(make, [doc], causal=True, sq=45, sk=45)


# -- block ranges ---------------------------------------------------------------------

def _brute(vis, bm, bn, sq, sk):
    nm, nn = -(-sq // bm), -(-sk // bn)
    status = torch.zeros(nm, nn, dtype=torch.int64)
    for i in range(nm):
        for j in range(nn):
            t = vis[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn]
            status[i, j] = 2 if (t.all() and (j + 1) * bn <= sk) else int(t.any())
    return status


def test_block_ranges_skip_empty_tiles_and_run_full_ones_unmasked():
    doc = torch.tensor([0] * 10 + [1] * 40 + [2] * 30)
    mt = user_mods.trace(lambda b, h, q_idx, kv_idx: doc[q_idx] == doc[kv_idx], "mask")
    sq = sk = 80
    _, lo, hi = mask_bounds(sq, sk, causal=True, window=(-1, -1))
    r = user_mods.block_ranges(mt, "q", 1, 2, 1, sq, sk, lo, hi, 16, 16, "cpu")
    assert r.shape == (1, 1, 5, 4)  # no dependence on batch or head: one row of ranges
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    vis = (doc[i] == doc[j]) & (j <= i)
    status = _brute(vis, 16, 16, sq, sk)
    for m in range(5):
        start, flo, fhi, end = r[0, 0, m].tolist()
        for n in range(5):
            inside = start <= n * 16 < end
            assert inside or status[m, n] == 0, (m, n)  # only empty tiles are skipped
            if flo <= n * 16 < fhi:
                assert status[m, n] == 2, (m, n)  # the interior run is entirely visible
    # rows 64..79 (document 2, keys 50..79): key blocks 0..2 are skipped
    assert r[0, 0, 4].tolist()[0] == 48
    # the key-block view (dK/dV) covers the same tiles
    rk = user_mods.block_ranges(mt, "k", 1, 2, 1, sq, sk, lo, hi, 16, 16, "cpu")
    for n in range(5):
        start, flo, fhi, end = rk[0, 0, n].tolist()
        for m in range(5):
            assert start <= m * 16 < end or status[m, n] == 0


def test_block_ranges_are_cached_and_follow_in_place_updates():
    doc = torch.tensor([0] * 24 + [1] * 24)
    mt = user_mods.trace(lambda b, h, q_idx, kv_idx: doc[q_idx] == doc[kv_idx], "mask")
    args = ("q", 1, 1, 1, 48, 48, -48, 48, 16, 16, "cpu")
    a = user_mods.block_ranges(mt, *args)
    assert user_mods.block_ranges(mt, *args) is a
    doc.fill_(0)  # one document: every tile visible
    b = user_mods.block_ranges(mt, *args)
    assert b is not a and b[0, 0, :, 1:3].tolist() == [[0, 48]] * 3


def test_a_mask_depending_on_the_head_is_united_over_each_gqa_group():
    mt = user_mods.trace(lambda b, h, q_idx, kv_idx: kv_idx < 16 * (h + 1), "mask")
    r = user_mods.block_ranges(mt, "k", 1, 4, 2, 64, 64, -64, 64, 16, 16, "cpu")
    assert r.shape == (1, 2, 4, 4)
    # kv head 0 serves query heads 0 (keys < 16) and 1 (keys < 32)
    assert r[0, 0, :, 3].tolist() == [64, 64, 0, 0]
    assert r[0, 0, :, 1:3].tolist() == [[0, 64], [64, 64], [0, 0], [0, 0]]


# -- identity ----------------------------------------------------------------------------

def _name(fn, kind="score"):
    t = user_mods.trace(fn, kind)
    low = user_mods._lowered("fwd", t if kind == "score" else None, t if kind == "mask" else None,
                             [False] * len(t.bufs), False)
    return low.name


def test_each_function_gets_its_own_stable_variant_name():
    a = _name(lambda s, b, h, q, k: s * 0.5)
    assert is_user_mods(a) and a == _name(lambda s, b, h, q, k: s * 0.5)
    assert a != _name(lambda s, b, h, q, k: s * 0.25)
    m = _name(lambda b, h, q, k: q >= k, "mask")
    assert m.endswith("m") and m != a
    spec = KernelSpec("fwd", "float16", 64, 64, "causal", m)
    assert spec.id.endswith("_causal_" + m)
    assert compiled_variant(Variant(spec, TileConfig(64, 32, 4, 1))).spec.mask == "window"
    # the same name in another process (what keys the tuner's and the database's rows)
    code = ("from flashgen import user_mods\n"
            "t = user_mods.trace(lambda s, b, h, q, k: s * 0.5, 'score')\n"
            "print(user_mods._lowered('fwd', t, None, [], False).name)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == a


def test_plain_variants_render_as_before():
    """The user-function machinery leaves the built-in variants' sources alone."""
    from flashgen import render

    v = Variant(KernelSpec("fwd", "float16", 64, 64, "causal"), TileConfig(64, 32, 4, 1))
    src = render.render(v)
    assert "user" not in src and "UBM" not in src
    assert render._code_hash("fwd", "") == render.template_hash("fwd", "")


def test_user_source_has_the_hooks():
    mt = user_mods.trace(lambda b, h, q, k: (q >= k) | (k < 4), "mask")
    st = user_mods.trace(t5_bias(torch.zeros(16, 4, requires_grad=True))[0], "score")
    low = user_mods._lowered("bwd", st, mt, [True], False)
    user_render.register(low)
    from flashgen import render

    dq = render.render(Variant(KernelSpec("bwd_dq", "float16", 64, 64, "none", low.name), TileConfig(64, 32, 4, 1)))
    assert "tl.atomic_add(u_rp" in dq and "u_keep" in dq and "UBM" in dq and "ds = ds * u_g" not in dq
    kv = render.render(Variant(KernelSpec("bwd_dkdv", "float16", 64, 64, "none", low.name), TileConfig(32, 64, 4, 1)))
    assert "atomic_add" not in kv and "m_start = tl.load(u_bm)" in kv


def test_a_mask_function_alone_leaves_the_built_in_score_scaling():
    """Without a score function the kernels scale the scores as the built-in ones do
    (qk_scale folded into the exp2 argument): no separate multiply per score element in
    any tile, the interior tiles' code is the built-in window's; a score function still
    hands the softmax base-2 scores."""
    from flashgen import render

    mt = user_mods.trace(lambda b, h, q, k: (q - k <= 8) | (k < 4), "mask")  # not a band: a predicate
    st = user_mods.trace(lambda s, b, h, q, k: s * 0.5, "score")
    exp2 = {"fwd": "exp2(qk * qk_scale - m_sub", "bwd_dq": "exp2(qk * qk_scale - lse", "bwd_dkdv": "exp2(qkt * qk_scale - lse"}
    for kernel, direction in (("fwd", "fwd"), ("bwd_dq", "bwd"), ("bwd_dkdv", "bwd")):
        cfg = TileConfig(64, 32, 4, 1)
        low = user_mods.lowering(direction, None, mt, [], False)
        src = render.render(Variant(KernelSpec(kernel, "float16", 64, 64, "causal", low.name), cfg))
        plain = render.render(Variant(KernelSpec(kernel, "float16", 64, 64, "window"), cfg))
        assert exp2[kernel] in src and exp2[kernel] in plain and "u_keep" in src
        assert "qk = qk * qk_scale" not in src and "qkt = qkt * qk_scale" not in src
        both = user_mods.lowering(direction, st, mt, [], False)
        src = render.render(Variant(KernelSpec(kernel, "float16", 64, 64, "causal", both.name), cfg))
        assert exp2[kernel] not in src and "* 1.4426950408889634" in src and "u_keep" in src


def test_a_load_indexed_by_the_head_is_made_once_per_program():
    """slopes[h] (ALiBi written as a score function) is read once per program, before the
    key loop, as the built-in alibi_slopes reads its slope, in every dense kernel (bwd_dkdv:
    once per query head of its group), and passed to the tiles; q - k is formed as
    -(k - q), the built-in bounds' form."""
    from flashgen import render

    slopes = torch.rand(4)
    st = user_mods.trace(lambda s, b, h, q, k: s - slopes[h] * torch.abs(q - k), "score")
    cfg = TileConfig(64, 32, 4, 1)
    for kernel, direction in (("fwd", "fwd"), ("bwd_dq", "bwd"), ("bwd_dkdv", "bwd")):
        low = user_mods.lowering(direction, st, None, [False], False)
        src = render.render(Variant(KernelSpec(kernel, "float16", 64, 64, "causal", low.name), cfg))
        tile, kern = src.split(f"def attn_{kernel}(")
        assert "tl.load(UT0" not in tile and kern.count("tl.load(UT0 + off_h.to(tl.int64) * ut0_s0)") == 1
        assert re.search(r"u\d+ = -\(\w+\[(:, None|None, :)\] - \w+\[", tile), tile


def test_a_head_indexed_table_and_its_gradient_stay_exact(tiles):
    """A learned per-head table read at [h] (hoisted in fwd/bwd_dkdv; in bwd_dq the load
    whose gradient the tile sums stays in the tile) against float64, GQA included."""
    def make(t):
        return (lambda s, b, h, q, k: s - t[h] * torch.abs(q - k) + t[(h + 1) % 4]), None
    _run(make, [torch.rand(4)], causal=True)


@pytest.mark.parametrize("fn, want", [
    (lambda b, h, q, k: q - k <= 256, (-256, None)),
    (lambda b, h, q, k: k <= q, (None, 0)),
    (lambda b, h, q, k: (k >= q - 7) & (k <= q + 3), (-7, 3)),
    (lambda b, h, q, k: torch.logical_and(k - q < 4, 2 * (q - k) <= 9), (-4, 3)),
    (lambda b, h, q, k: (q + 5) - (k + 2) > -2, (None, 4)),
    (lambda b, h, q, k: k - q == 2, (2, 2)),
    (lambda b, h, q, k: (q - k <= 8) | (k < 4), None),
    (lambda b, h, q, k: q <= 8, None),
    (lambda b, h, q, k: (k <= q) & (h > 0), None),
    (lambda b, h, q, k: (k > q + 3) & (k < q), None),  # empty: left to the predicate
    (lambda b, h, q, k: 2 * k - 2 * q == 3, None),
])
def test_a_mask_that_is_a_band_on_kv_minus_q_is_recognized(fn, want):
    assert user_render.band(*(lambda t: (t.graph, t.out))(user_mods.trace(fn, "mask"))) == want


def test_a_band_mask_runs_the_window_kernels_code():
    """A mask function that is a band on kv - q (a window written as mask_mod) tightens the
    kernels' bounds on j - i and evaluates nothing else: no predicate, no block mask;
    the forward's tiles are the built-in window's."""
    from flashgen import render

    mt = user_mods.trace(lambda b, h, q, k: q - k <= 8, "mask")
    cfg = TileConfig(64, 32, 4, 1)
    for kernel, direction in (("fwd", "fwd"), ("bwd_dq", "bwd"), ("bwd_dkdv", "bwd")):
        low = user_mods.lowering(direction, None, mt, [], False)
        assert low.band == (-8, None)
        src = render.render(Variant(KernelSpec(kernel, "float16", 64, 64, "causal", low.name), cfg))
        assert "u_keep" not in src and "UBM" not in src and "diag_lo = tl.maximum(diag_lo, -8)" in src
        plain = render.render(Variant(KernelSpec(kernel, "float16", 64, 64, "window"), cfg))
        def tile(text):  # the _tile function, blank lines aside
            return [x for x in text.split("@triton.jit")[1].splitlines() if x.strip()]
        assert tile(src) == tile(plain)
    args = user_mods.UserArgs(user_mods.lowering("fwd", None, mt, [], False), [], [], mt,
                              (1, 2, 1, 40, 40, -40, 0), None, torch.device("cpu"))
    assert args.kernel_args(0.1, True, types.SimpleNamespace(VARIANT_ID="attn_fwd_x"), cfg) == []  # no block mask


def test_a_band_mask_equals_the_built_in_window_and_a_bigger_or_empty_band(tiles):
    for sq, sk in ((45, 45), (37, 45), (45, 37)):
        q, k, v = _qkv(sq=sq, sk=sk)
        a = flashgen.attention(q, k, v, causal=True, mask_mod=lambda b, h, q_idx, kv_idx: q_idx - kv_idx <= 9,
                               return_lse=True)
        c = flashgen.attention(q, k, v, window=(9 + sk - sq, 0), return_lse=True)  # lo = -9, hi = sk - sq
        for x, y in zip(a, c):
            assert torch.equal(x, y)
    _run(lambda: (None, lambda b, h, q_idx, kv_idx: (kv_idx - q_idx >= -3) & (kv_idx - q_idx <= 5)), sq=45, sk=37)
    _run(lambda: (None, lambda b, h, q_idx, kv_idx: q_idx - kv_idx <= 100), causal=True, sq=45, sk=45)


# -- errors ------------------------------------------------------------------------------

def _call(**kw):
    q, k, v = _qkv(b=1, h=2, hk=1, sq=8, sk=8)
    return flashgen.attention(q, k, v, **kw)


def test_data_dependent_control_flow_is_a_clear_error():
    def bad(score, b, h, q_idx, kv_idx):
        if score > 0:
            return score
        return -score
    with pytest.raises(UnsupportedError, match="control flow.*torch.where"):
        _call(score_mod=bad)


@pytest.mark.parametrize("fn, op", [
    (lambda s, b, h, q, k: torch.softmax(s, -1), "softmax"),
    (lambda s, b, h, q, k: s.cumsum(0), "cumsum"),
    (lambda s, b, h, q, k: torch.erf(s), "erf"),
])
def test_an_unsupported_operation_is_named(fn, op):
    with pytest.raises(UnsupportedError, match=op):
        _call(score_mod=fn)


def test_other_bad_functions():
    table = torch.randn(8)
    with pytest.raises(UnsupportedError, match="float value"):
        _call(score_mod=lambda s, b, h, q, k: s + table[(q - k).float()])
    # torch reads a bool index as a mask (t[q > k] is not t[(q > k).long()])
    with pytest.raises(UnsupportedError, match="indexed by a bool value.*long"):
        _call(score_mod=lambda s, b, h, q, k: s + table[q > k])
    assert _call(score_mod=lambda s, b, h, q, k: s + table[(q > k).long()]) is not None
    with pytest.raises(UnsupportedError, match="used whole"):
        _call(score_mod=lambda s, b, h, q, k: s + table)
    with pytest.raises(UnsupportedError, match="indexing a traced value"):
        _call(score_mod=lambda s, b, h, q, k: s[0])
    with pytest.raises(UnsupportedError, match="bool"):
        _call(mask_mod=lambda b, h, q, k: (q - k) * 0.5)
    with pytest.raises(InputError, match="score_mod must take 5"):
        _call(score_mod=lambda s, q, k: s)
    with pytest.raises(InputError, match="sinks must be a float32 tensor of shape"):
        _call(sinks=torch.zeros(3))
    with pytest.raises(InputError, match="not combined with softcap"):
        _call(score_mod=lambda s, b, h, q, k: s, softcap=2.0)
    with pytest.raises(UnsupportedError, match="mask_mod .* returns a float value"):
        _call(mask_mod=lambda b, h, q, k: 1.0)
    with pytest.raises(UnsupportedError, match="score_mod must return one tensor, got None"):
        _call(score_mod=lambda s, b, h, q, k: None)


# -- captured tensors read outside their size ------------------------------------------

def test_an_index_past_a_captured_tensor_is_an_input_error():
    """torch raises IndexError at tab[8] of an (8,) tensor; the kernels would read past
    it: the check names the function, the tensor, the dim and the range found."""
    tab = torch.randn(8)
    q, k, v = _qkv(b=1, h=2, hk=1, sq=12, sk=16)
    with pytest.raises(InputError, match=r"score_mod reads a captured tensor of shape \(8,\) .*at indices 0\.\.15 "
                                         r"along dim 0: indices must lie in \[0, 8\).*index 8 at kv_idx=8"):
        flashgen.attention(q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: s + tab[kv_idx])
    doc = torch.zeros(12, dtype=torch.int64)  # fits the queries, not the keys
    with pytest.raises(InputError, match=r"mask_mod reads a captured tensor of shape \(12,\) .*at indices 0\.\.15 "
                                         r"along dim 0: indices must lie in \[0, 12\)"):
        flashgen.attention(q, k, v, mask_mod=lambda b, h, q_idx, kv_idx: doc[q_idx] == doc[kv_idx])
    table = torch.randn(4, 1)  # one column for two heads
    with pytest.raises(InputError, match=r"shape \(4, 1\) .*indices 0\.\.1 along dim 1: .*\[0, 1\).*index 1 at h=1"):
        flashgen.attention(q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: s + table[q_idx % 4, h])


def test_a_negative_index_is_an_input_error_not_wrapped():
    """torch wraps tab[-1] to the last element; the kernels would read before the tensor."""
    tab = torch.randn(8)
    with pytest.raises(InputError, match=r"score_mod .*indices -8\.\.-1 along dim 0: indices must lie in \[0, 8\) "
                                         r"\(flashgen does not wrap negative indices\); index -8 at kv_idx=0"):
        _call(score_mod=lambda s, b, h, q_idx, kv_idx: s + tab[kv_idx - 8])
    # floor division as the kernels round: (kv - q) // 4 reaches -2 (truncation: -1)
    three = torch.randn(3)
    with pytest.raises(InputError, match=r"indices -1\.\.2 along dim 0"):
        _call(score_mod=lambda s, b, h, q_idx, kv_idx: s + three[(kv_idx - q_idx) // 4 + 1])
    doc = torch.zeros(8, dtype=torch.int64)
    with pytest.raises(InputError, match=r"mask_mod .*indices -1\.\.6 .*index -1 at q_idx=0"):
        _call(mask_mod=lambda b, h, q_idx, kv_idx: doc[q_idx - 1] == doc[kv_idx])


def test_the_reference_path_checks_the_indices_as_the_kernels_do(monkeypatch):
    """CPU tensors off the kernels (no interpreter, or bfloat16) run the float32
    reference, which calls the functions with torch: it raises the same InputError for
    an index outside a captured tensor, rather than wrapping a negative one (or raising
    torch's IndexError past the end)."""
    monkeypatch.setattr(flashgen.library, "use_kernels", lambda q: False)
    tab = torch.randn(32)
    with pytest.raises(InputError, match=r"indices -7\.\.7 along dim 0: indices must lie in \[0, 32\)"):
        _call(score_mod=lambda s, b, h, q_idx, kv_idx: s + tab[q_idx - kv_idx])
    with pytest.raises(InputError, match=r"indices 25\.\.32 along dim 0"):
        _call(score_mod=lambda s, b, h, q_idx, kv_idx: s + tab[kv_idx + 25])
    o = _call(score_mod=lambda s, b, h, q_idx, kv_idx: s + tab[kv_idx + 24])  # in range: runs
    assert torch.isfinite(o).all()


def test_a_nested_gather_is_checked_with_its_inner_read_first(tiles):
    """tab2[idx[q_idx]]: the outer index is read from a captured tensor, evaluated from
    its values; an inner read past its own tensor is reported before the outer."""
    idx = torch.tensor([0, 1, 2, 3, 4, 5, 6, 9])
    tab2 = torch.randn(8)
    with pytest.raises(InputError, match=r"score_mod reads a captured tensor of shape \(8,\) \(#1 .*at indices 0\.\.9 "
                                         r"along dim 0: .*\[0, 8\).*index 9 at q_idx=7"):
        _call(score_mod=lambda s, b, h, q_idx, kv_idx: s + tab2[idx[q_idx]])
    short = torch.tensor([0, 1, 2, 30])
    with pytest.raises(InputError, match=r"shape \(4,\) \(#0 .*at indices 0\.\.7 along dim 0: .*\[0, 4\)"):
        _call(score_mod=lambda s, b, h, q_idx, kv_idx: s + tab2[short[q_idx]])
    idx[7] = 7  # in range: runs and matches the reference
    _run(lambda t: (lambda s, b, h, q_idx, kv_idx: s + t[idx[q_idx]], None), [tab2], sq=8, sk=8)


def test_the_index_check_runs_once_per_function_and_sizes(monkeypatch):
    """Evaluated once per (function, sizes); again when an index read from a captured
    tensor changes in place (its version), not when a table's values do."""
    from flashgen import user_bounds

    evals = []
    read_ranges = user_bounds.read_ranges
    monkeypatch.setattr(user_bounds, "read_ranges", lambda *a: evals.append(a[3:7]) or read_ranges(*a))
    tab = torch.randn(16)
    idx = torch.arange(16)

    def make():  # a closure made again on every call, as a model's forward makes it
        return lambda s, b, h, q_idx, kv_idx: s + tab[idx[kv_idx]]
    q, k, v = _qkv(b=1, h=2, hk=1, sq=8, sk=16)
    for _ in range(3):
        flashgen.attention(q, k, v, score_mod=make())
    assert evals == [(1, 2, 8, 16)]
    flashgen.attention(q[:, :, :4], k, v, score_mod=make())  # another seqlen_q
    assert evals == [(1, 2, 8, 16), (1, 2, 4, 16)]
    tab.mul_(2)  # values only: no index changes
    flashgen.attention(q, k, v, score_mod=make())
    assert len(evals) == 2
    idx[3] = 16  # an index read from a captured tensor, changed in place
    with pytest.raises(InputError, match=r"indices 0\.\.16 along dim 0.*index 16 at kv_idx=3"):
        flashgen.attention(q, k, v, score_mod=make())
    assert len(evals) == 3
    with pytest.raises(InputError, match=r"indices 0\.\.16"):  # a failed check is not memoized
        flashgen.attention(q, k, v, score_mod=make())
    assert len(evals) == 4


@pytest.mark.parametrize("seqlen", [64, 2048])
def test_the_examples_read_inside_their_tensors(seqlen, monkeypatch):
    """Every example of flashgen.user_examples passes the check at its sizes (T5's
    buckets stay in its 32-row table over the whole 2048 x 2048 grid), each evaluated
    once however often it is called."""
    from flashgen import user_bounds, user_examples

    evals = []
    read_ranges = user_bounds.read_ranges
    monkeypatch.setattr(user_bounds, "read_ranges", lambda *a: evals.append(a) or read_ranges(*a))
    checked = 0
    for name in user_examples.NAMES:
        ex = user_examples.make(name, 16, seqlen)
        for fn, kind in zip(ex.functions(*ex.tensors), ("score", "mask")):
            if fn is not None:
                tr = user_mods.trace(fn, kind)
                for _ in range(2):
                    user_mods.check_reads(tr, 2, 16, seqlen, seqlen, "cpu")
                checked += bool(tr.reads.loads)
    assert checked == 4 and len(evals) == 4  # relpos, alibi, document, document-causal read tensors


def _t5(rel):
    return t5_bucket(rel, 32, 128)


@pytest.mark.parametrize("chunk", [1 << 24, 64])
@pytest.mark.parametrize("index", [
    lambda b, h, q, k: _t5(k - q),
    lambda b, h, q, k: (k - q) // 3,
    lambda b, h, q, k: (q - 2 * k) % 5 - b,
    lambda b, h, q, k: torch.div(k - q, 3, rounding_mode="trunc"),
    lambda b, h, q, k: torch.where(q > k, q * h, -k).clamp(-20, 20),
    lambda b, h, q, k: ((q.float() + 0.5) * 1.7).long() - torch.minimum(k, 2 * h),
    lambda b, h, q, k: torch.maximum(q - k, b) ^ h,
    lambda b, h, q, k: (q >= k).to(torch.int8) * 3 + (k >> 2) - (~b),
], ids=["t5", "floordiv", "mod", "trunc-div", "where-clamp", "float-cast", "max-xor", "bool-shift-not"])
def test_the_index_ranges_are_those_torch_computes(index, chunk, monkeypatch):
    """The check evaluates the lowered index expressions as the kernels compute them
    (integer floor division and modulo, casts truncating toward zero, float math in
    float32), chunked over batch and rows: the same min and max as torch's own
    evaluation of the index over the (b, h, q_idx, kv_idx) grid.  An index that depends
    on the score is not checked."""
    from flashgen import user_bounds

    monkeypatch.setattr(user_bounds, "CHUNK", chunk)
    tab, sel = torch.zeros(1000), torch.zeros(2)
    st = user_mods.trace(lambda s, b, h, q_idx, kv_idx: s + tab[index(b, h, q_idx, kv_idx) + 500]
                         + sel[(s > 0).long()], "score")
    assert len(st.reads.loads) == 1  # sel's index depends on the score
    sizes = (2, 3, 37, 45)
    B, H, I, J = (torch.arange(n).view([-1 if d == i else 1 for d in range(4)]) for i, n in enumerate(sizes))
    want = index(B, H, I, J) + 500
    got = user_bounds.read_ranges(st.graph, st.reads, st.captured, *sizes, "cpu")
    assert list(got.values()) == [(want.min().item(), want.max().item())]


# -- integer widths ------------------------------------------------------------------

@pytest.mark.parametrize("expr, sizes, wide", [
    (lambda b, h, q, k: q * k * 10_000_000, (1, 1, 17, 23), True),  # 3.5e9 past int32
    (lambda b, h, q, k: q * k * 10_000_000, (1, 1, 4, 4), False),   # 9e7 fits
    (lambda b, h, q, k: (q * 2 ** 20) // (k + 1), (1, 1, 4096, 16), True),
    (lambda b, h, q, k: (q * 2 ** 20) // (k + 1), (1, 1, 2048, 2 ** 20), True),  # |a| + |b|: the remainder's bound
    (lambda b, h, q, k: (q * 2 ** 20) // (k + 1), (1, 1, 1024, 1), False),
    (lambda b, h, q, k: q * 2 ** 40, (1, 1, 8, 8), False),          # an int64 constant: int64 in both
    (lambda b, h, q, k: (q - k).abs() + b * h, (64, 64, 131072, 131072), False),
    (lambda b, h, q, k: q << 30, (1, 1, 4, 4), True),
    (lambda b, h, q, k: (q & 7) | (k ^ 3), (1, 1, 131072, 131072), False),
    (lambda b, h, q, k: (q.float() * 1e10).int() + k, (1, 1, 4, 4), True),   # unbounded in int32
    (lambda b, h, q, k: (q.float() * 1e10).long() + k, (1, 1, 4, 4), False),  # int64 in both
    (lambda b, h, q, k: (q >= 0) * 2 ** 30 * 4, (1, 1, 4, 4), True),   # a bool: int64 in torch
    (lambda b, h, q, k: (q * k * 10 ** 9).long(), (1, 1, 4, 4), True),   # the product before the cast
    (lambda b, h, q, k: q.long() * k * 10 ** 9, (1, 1, 4, 4), False),   # int64 from the cast on
], ids=["product", "product-fits", "shift-div", "floor-operands", "floor-fits", "int64-constant", "abs",
        "lshift", "bits", "int32-cast", "int64-cast", "bool", "cast-after", "cast-before"])
def test_index_arithmetic_that_can_leave_int32_is_computed_in_int64(expr, sizes, wide):
    """The kernels' index inputs (and bools in integer arithmetic) are int32, torch's
    int64: where a value computed from them can leave int32 at the call's sizes the call
    runs the function's widened graph (inputs cast to int64, a name of its own),
    elsewhere its own graph and name."""
    fn = lambda s, b, h, q_idx, kv_idx: s + torch.where(expr(b, h, q_idx, kv_idx) % 3 == 0, 1.0, 0.0)  # noqa: E731
    st = user_mods.trace(fn, "score")
    assert user_mods.wide(st, None, *sizes) is wide
    low = user_mods._lowered("fwd", *user_mods._as_run(st, None, wide), [], False)
    assert (low.name != user_mods._lowered("fwd", st, None, [], False).name) is wide
    code = user_render.Context(low, "fwd").score_block("s", "offs_m", "offs_n", False)
    assert "offs_m[:, None].to(tl.int64)" in code or not wide


def test_integer_arithmetic_gives_torchs_values(tiles):
    """q_idx * kv_idx * 10**7 // 10**9 stays in [0, 4) in torch (int64); in int32 it
    wrapped to -3..-1 at 17 x 23 and read before the table.  Products of bools and
    constants and an explicit int32 cast (wraps in both) run as the float64 reference
    computes them."""
    tab = torch.tensor([0.0, 0.1, 0.2, 0.3])
    _run(lambda t: (lambda s, b, h, q_idx, kv_idx: s + t[(q_idx * kv_idx * 10_000_000) // 1_000_000_000], None),
         [tab], b=1, h=1, hk=1, sq=17, sk=23, dtype=F32)
    _run(lambda: (lambda s, b, h, q_idx, kv_idx: torch.where((q_idx * kv_idx * 10_000_000) % 7 == 0, s, s - 2.0),
                  lambda b, h, q_idx, kv_idx: (q_idx * kv_idx * 10_000_000) % 3 != 0),
         b=1, h=1, hk=1, sq=17, sk=23, dtype=F32)
    _run(lambda: (None, lambda b, h, q_idx, kv_idx: (q_idx >= 0) * 2 ** 30 * 4 > 0), b=1, h=1, hk=1, sq=8, sk=8,
         dtype=F32)
    _run(lambda: (None, lambda b, h, q_idx, kv_idx: ((q_idx + 1) * (kv_idx + 1) * 100_000_000).to(torch.int32) > 0),
         b=1, h=1, hk=1, sq=8, sk=8, dtype=F32)


@pytest.mark.parametrize("name", ["float-int", "int5", "neg-int", "half", "tensor-exp", "neg-tensor-exp", "int12"])
def test_powers_give_torchs_values(tiles, name):
    """a ** b as torch computes it, forward and gradients against float64: negative
    scores to integral powers keep their sign (exp2(b log2 a) gave NaN), integers to a
    constant power stay integers (a float power lost the int64 products before the
    remainder), a float tensor exponent takes the parity's sign of a negative base and
    gives 1 at exponent 0."""
    fns = {
        "float-int": lambda s, b, h, q, k: s ** 2.0 * 0.5,
        "int5": lambda s, b, h, q, k: torch.pow(s, 5) * 0.1,
        "neg-int": lambda s, b, h, q, k: (s + 4.0) ** -3 + s,
        "half": lambda s, b, h, q, k: (s.abs() + 0.5) ** 2.5 * 0.2,
        "tensor-exp": lambda s, b, h, q, k: s + 0.2 * s ** (k % 4).float(),
        "neg-tensor-exp": lambda s, b, h, q, k: s + (-1.0) ** (k - q) + 2.0 ** (-q.float()),
        "int12": lambda s, b, h, q, k: s + ((q + 2) ** 12 % 101).float() * 0.05,
    }
    _run(lambda: (fns[name], None), b=1, h=2, hk=1, sq=17, sk=23, dtype=F32)


def _lse_kernel_and_torch(fn, sq=6, sk=6):
    """LSE of flashgen.attention with score function ``fn`` on the kernel path, and
    torch's logsumexp of fn over the scores (float64), per query row."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, n, 16, generator=g) for n in (sq, sk, sk))
    i, j = torch.arange(sq).view(1, 1, -1, 1), torch.arange(sk).view(1, 1, 1, -1)
    z = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    s = (q @ k.transpose(-1, -2)) * 0.25
    want = torch.logsumexp((fn(s, z, z, i, j) + torch.zeros_like(s)).double(), -1).flatten()
    return flashgen.attention(q, k, v, score_mod=fn, return_lse=True)[1].flatten().double(), want


@pytest.mark.parametrize("name", ["max-nan-first", "min-nan-first", "max-nan-second",
                                  "sign-bool", "divide-tiny"])
def test_operations_give_torchs_values_at_their_edges(name):
    """NaN in either argument of maximum / minimum is the result (where(a > b, a, b) lost
    a NaN a); sign of a bool is the bool (it was an int, so bool + bool added to 2); a
    division by a constant whose float32 reciprocal overflows stays a division."""
    fns = {
        "max-nan-first": lambda s, b, h, q, k: torch.maximum(torch.log(s), s),
        "min-nan-first": lambda s, b, h, q, k: torch.minimum(torch.log(s), s),
        "max-nan-second": lambda s, b, h, q, k: torch.maximum(s, torch.log(s)),
        "sign-bool": lambda s, b, h, q, k: s + (torch.sign(q > 2) + torch.sign(k > 2)).float(),
        "divide-tiny": lambda s, b, h, q, k: (s * 1e-36 / 1e-45) * 1e-9,
    }
    got, want = _lse_kernel_and_torch(fns[name])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_a_captured_zero_dim_bool_tensor_is_a_bool():
    """torch.tensor(True) captured whole is a bool as an indexed bool table is: bool + bool
    is a logical or and ~ a logical not in the score function (they were int arithmetic:
    1 + 1 = 2, ~1 = -2), and a mask function that returns it is a bool mask (it was refused
    as returning an int)."""
    T, F = torch.tensor(True), torch.tensor(False)
    fns = [lambda s, b, h, q, k: s + (torch.where(k > q, T, F) + torch.where(k > q + 2, T, F)).float(),
           lambda s, b, h, q, k: s + (~torch.where(k > q, T, F)).float()]
    for fn in fns:
        got, want = _lse_kernel_and_torch(fn, sq=8, sk=8)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 8, 16, generator=g) for _ in range(3))
    for mm in (lambda b, h, qi, ki: torch.where(qi > 3, T, ki <= qi), lambda b, h, qi, ki: (ki <= qi) | F):
        vis = mm(0, 0, torch.arange(8).view(-1, 1), torch.arange(8).view(1, -1))
        want = torch.softmax(((q @ k.transpose(-1, -2)) * 0.25).masked_fill(~vis, float("-inf")), -1) @ v
        torch.testing.assert_close(flashgen.attention(q, k, v, mask_mod=mm), want, rtol=1e-5, atol=1e-5)


def _grads_against_torch(fn, table, q, k, v, do, scale):
    """(flashgen, torch float64 autograd) of (dQ, dK, dV, the table's gradient) for score
    function ``fn(s, b, h, i, j, table)`` on the full score matrix."""
    def run(dtype, attention):
        t = table.detach().to(dtype).requires_grad_()
        x = [a.detach().to(dtype).requires_grad_() for a in (q, k, v)]
        attention(*x, lambda s, b, h, i, j: fn(s, b, h, i, j, t)).backward(do.to(dtype))
        return [a.grad for a in x] + [t.grad]

    def torch_attention(q, k, v, f):
        i, j = torch.arange(q.shape[2]).view(1, 1, -1, 1), torch.arange(k.shape[2]).view(1, 1, 1, -1)
        h = torch.arange(q.shape[1]).view(1, -1, 1, 1)
        return torch.softmax(f((q @ k.transpose(-1, -2)) * scale, 0, h, i, j), -1) @ v

    got = run(torch.float32, lambda q, k, v, f: flashgen.attention(q, k, v, softmax_scale=scale, score_mod=f))
    return got, run(torch.float64, torch_attention)


@pytest.mark.parametrize("name", ["sqrt-relu", "log-maximum", "pow-relu", "reciprocal-relu", "pow-learned",
                                  "pow-zero-base", "clamp-tensor-tie", "clamp-min-function", "hoisted-bool-or"])
def test_gradients_at_cut_offs_and_ties_are_torchs(name):
    """Where a clamp, maximum or where cuts the gradient off before an operation whose
    slope is infinite at 0 (sqrt, log, a power below 1, a reciprocal), torch's backward
    selects 0 and flashgen's forward-mode derivative formed 0 * inf = NaN in every row;
    pow's gradient is torch's at base 0 (none to the base where the exponent is 0, none
    to the exponent where the base is 0 and the exponent >= 0); torch.clamp with a tensor
    bound passes the whole gradient to the input at a tie (maximum's 0.5 / 0.5 split
    before); a per-head bool from a float comparison combined with | ran into Triton's
    interpreter refusing the NumPy bool.  The clamps' scores are exact integers (integer
    q and k, scale 1), so ties occur; the powers' have a row of zeros."""
    fns = {
        "sqrt-relu": lambda s, b, h, i, j, t: torch.sqrt((s + t[h]).clamp(min=0)),
        "log-maximum": lambda s, b, h, i, j, t: torch.log(torch.maximum(s, torch.zeros_like(s))) + t[h],
        "pow-relu": lambda s, b, h, i, j, t: s.clamp(min=0) ** 0.3 + t[h],
        "reciprocal-relu": lambda s, b, h, i, j, t: s - 1 / (1 + 1 / s.clamp(min=0)) + t[h],
        "pow-learned": lambda s, b, h, i, j, t: s.clamp(min=0) ** t[h],
        "pow-zero-base": lambda s, b, h, i, j, t: s.abs() ** (s.abs() + t[h]),
        "clamp-tensor-tie": lambda s, b, h, i, j, t: torch.clamp(s, min=t[h]),
        "clamp-min-function": lambda s, b, h, i, j, t: torch.clamp_min(s, t[h]) + torch.clamp_max(s, (j - i).float()),
        "hoisted-bool-or": lambda s, b, h, i, j, t: torch.where((t[h] != t[h]) | (s < 0), s * t[h], 2 * s),
    }
    g = torch.Generator().manual_seed(0)
    if not name.startswith(("clamp", "hoisted")):
        # continuous scores: the slopes are infinite only where the cut-off holds (no
        # score is exactly 0, where torch's gradient is infinite too), but for a row of
        # zero scores at the powers
        q, k = (torch.randn(1, 2, 16, 16, generator=g) for _ in range(2))
        if name in ("pow-learned", "pow-zero-base"):
            q[:, :, 3] = 0
    else:
        q, k = (torch.randint(-1, 2, (1, 2, 16, 16), generator=g).float() for _ in range(2))
        q[:, :, 3] = 0  # a row of zero scores
    v, do = (torch.randn(1, 2, 16, 16, generator=g) for _ in range(2))
    table = torch.tensor([0.0, 1.5]) if name != "pow-learned" else torch.tensor([2.0, 1.5])
    scale = 1.0 if name.startswith(("clamp", "hoisted")) else 0.1 if name == "pow-zero-base" else 0.25
    got, want = _grads_against_torch(fns[name], table, q, k, v, do, scale)
    for gr, w, what in zip(got, want, ("dQ", "dK", "dV", "table")):
        assert torch.isfinite(w).all() and w.abs().max() > 0, what
        torch.testing.assert_close(gr.double(), w, rtol=1e-4, atol=1e-4, msg=what)


def test_a_mask_function_dividing_by_a_variable_that_is_0_somewhere():
    """j // (i - 5) in a mask function: the kernels divide by 1 where the divisor is 0
    (as in a score function), but the block mask ran the function in torch, which raised
    ZeroDivisionError on the CPU (and computes its own quotient on CUDA): the tiles are
    now all partial, so the kernels' predicate decides."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 64, 16, generator=g) for _ in range(3))
    i, j = torch.arange(64).view(-1, 1), torch.arange(64).view(1, -1)
    d = torch.where(i - 5 == 0, 1, i - 5)
    for mm, vis, causal in ((lambda b, h, qi, ki: (ki // (qi - 5)) >= 0, (j // d) >= 0, False),
                            (lambda b, h, qi, ki: (ki % (qi - 5)) != 1, ((j % d) != 1) & (j <= i), True)):
        want = torch.softmax(((q @ k.transpose(-1, -2)) * 0.25).masked_fill(~vis, float("-inf")), -1) @ v
        torch.testing.assert_close(flashgen.attention(q, k, v, mask_mod=mm, causal=causal), want, rtol=1e-5, atol=1e-5)


def test_a_constant_from_an_inference_tensor_is_read_again():
    """Under inference_mode a tensor has no version counter: a trace that took int(n.max())
    as a constant was cached and an in-place n[0] = 8 went unseen (the old mask ran)."""
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        q, k, v = (torch.randn(1, 1, 64, 16, generator=g) for _ in range(3))
        n = torch.tensor([48])
        mm = lambda b, h, qi, ki: ki < int(n.max())  # noqa: E731
        for limit in (48, 8):
            n[0] = limit
            want = torch.softmax(((q @ k.transpose(-1, -2)) * 0.25).masked_fill(torch.arange(64) >= limit,
                                                                                   float("-inf")), -1) @ v
            torch.testing.assert_close(flashgen.attention(q, k, v, mask_mod=mm), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("target", ["int16", "int8", "uint8"])
def test_a_float_to_a_narrow_integer_passes_through_a_wider_one_as_torch(target):
    """torch converts a float to int16 and int8 through int32 and to uint8 through int64
    (40000.0 -> -25536 as int16, -1.5 -> 255 as uint8; on the GPU 3e9 -> -1 as int8, 0 as
    uint8); a direct conversion saturates on the GPU (32767, 0), so the kernels convert
    through the same wider integer (the interpreter's conversion is numpy's and agrees
    either way: the rendered code is checked besides the values)."""
    dt = getattr(torch, target)
    tab = torch.tensor([40000.0, -40000.0, 300.0, -300.0, 255.5, -1.5, 128.0, -129.0])
    fn = lambda s, b, h, qi, ki: s + 0.01 * tab[ki % 8].to(dt).float()  # noqa: E731
    low = user_mods._lowered("fwd", user_mods.trace(fn, "score"), None, [], False)
    wider = "int64" if target == "uint8" else "int32"
    assert f".to(tl.{wider}).to(tl.{target})" in user_render.Context(low, "fwd").score_block("s", "offs_m", "offs_n", False)
    got, want = _lse_kernel_and_torch(fn, sq=7, sk=19)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bounds", [dict(min=float("nan")), dict(max=float("nan")), dict(min=-1.0, max=float("nan"))])
def test_a_nan_clamp_bound_is_refused(bounds):
    """torch.clamp(s, min=nan) is NaN in torch's CPU kernel and s in its CUDA kernel
    ((s < nan) ? nan : s), so there is no one result to compile: refused, naming the bound."""
    q, k, v = _qkv(b=1, h=1, hk=1, sq=8, sk=8, dtype=F32)
    name = "min" if "min" in bounds and bounds["min"] != bounds["min"] else "max"
    with pytest.raises(UnsupportedError, match=f"torch.clamp with {name}=nan"):
        flashgen.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s.clamp(**bounds))


@pytest.mark.parametrize("mask", ["int32-wrap", "int64-wrap"])
def test_a_mask_that_wraps_is_not_read_as_a_band(mask):
    """((kv - q) * 2**32).int() == 0 wraps to 0 in torch (every key visible) and
    (kv - q) * 2**62 <= 0 wraps in int64: neither is the band kv - q == 0 or <= 0."""
    fn = {"int32-wrap": lambda b, h, q, k: ((k - q) * 2 ** 32).int() == 0,
          "int64-wrap": lambda b, h, q, k: (k - q) * 2 ** 62 <= 0}[mask]
    t = user_mods.trace(fn, "mask")
    assert user_render.band(t.graph, t.out) is None
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 6, 16, generator=g) for _ in range(3))
    vis = fn(0, 0, torch.arange(6).view(-1, 1), torch.arange(6).view(1, -1))
    s = (q @ k.transpose(-1, -2)) * 0.25
    want = torch.softmax(s.masked_fill(~vis, float("-inf")), -1) @ v
    torch.testing.assert_close(flashgen.attention(q, k, v, mask_mod=fn), want, rtol=1e-5, atol=1e-5)


def test_full_like_of_a_narrow_dtype_is_refused():
    """torch.zeros_like(q_idx, dtype=torch.int8) + 300 wraps in int8; the kernels' constant
    would not: refused, naming the dtype."""
    q, k, v = _qkv(b=1, h=1, hk=1, sq=8, sk=8, dtype=F32)
    for dt in (torch.int8, torch.int32, torch.float16):
        with pytest.raises(UnsupportedError, match="dtype"):
            flashgen.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + (torch.zeros_like(qi, dtype=dt) + 300))


def test_user_functions_and_sinks_under_vmap_and_fake_tensors():
    """vmap's batched tensors and FakeTensorMode's tensors have no storage: a call with
    a score function, a mask function or sinks read q.data_ptr() and raised a
    RuntimeError; it now runs the reference's torch ops, which both handle (vmap equal to
    a loop over the batch, fake tensors of O's shape)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v = (torch.randn(3, 1, 2, n, 16, generator=torch.Generator().manual_seed(n)) for n in (9, 11, 11))
    calls = {
        "score_mod": lambda a, b, c: flashgen.attention(a, b, c, score_mod=lambda s, B, H, i, j: s * 2),
        "mask_mod": lambda a, b, c: flashgen.attention(a, b, c, mask_mod=lambda B, H, i, j: j <= i + 2),
        "sinks": lambda a, b, c: flashgen.attention(a, b, c, sinks=torch.linspace(-1.0, 1.0, 2)),
    }
    for name, fn in calls.items():
        want = torch.stack([fn(q[i], k[i], v[i]) for i in range(3)])
        torch.testing.assert_close(torch.func.vmap(fn)(q, k, v), want, atol=2e-6, rtol=0, msg=name)
        with FakeTensorMode():
            o = fn(torch.empty(1, 2, 9, 16), torch.empty(1, 2, 11, 16), torch.empty(1, 2, 11, 16))
        assert tuple(o.shape) == (1, 2, 9, 16), name
    # a Parameter (sinks usually are) and a dispatch mode over plain tensors keep the kernels
    from torch.utils.flop_counter import FlopCounterMode

    ran = []
    real = user_mods.reference
    try:
        user_mods.reference = lambda *a, **kw: ran.append(1) or real(*a, **kw)
        sinks = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 2))
        with FlopCounterMode(display=False):
            flashgen.attention(q[0], k[0], v[0], sinks=sinks).sum().backward()
    finally:
        user_mods.reference = real
    assert not ran and sinks.grad is not None


def test_powers_the_kernels_would_not_compute_as_torch_are_refused():
    """An integer to an integer tensor power (torch's integer pow; the kernels' would be
    a float's) and an integer to a negative constant power (torch refuses it) raise
    UnsupportedError naming the rule; so do the same constants folded."""
    q, k, v = _qkv(b=1, h=1, hk=1, sq=8, sk=8, dtype=F32)
    for fn, match in ((lambda s, b, h, qi, ki: s + 0 ** ki, "integer tensor power"),
                      (lambda s, b, h, qi, ki: s + (qi + 1) ** -2, "negative integer power")):
        with pytest.raises(UnsupportedError, match=match):
            flashgen.attention(q, k, v, score_mod=fn)
    assert user_render._fold_pow(-8.0, 1 / 3) != user_render._fold_pow(-8.0, 1 / 3)  # NaN, as torch; not complex
    assert user_render._fold_pow(0.0, -1) == math.inf and user_render._fold_pow(-2, 3) == -8
    with pytest.raises(UnsupportedError, match="negative integer power"):
        user_render._fold_pow(2, -1)


def test_bool_arithmetic_and_exponents_torch_refuses_are_refused():
    """What torch raises for, the tracer refuses with the rule named: subtraction with a
    bool (a Python bool beside a tensor included, and torch.sub with alpha), abs of a
    bool, //, %, a rounded division and ** of two bools, and an 8-bit tensor raised to a
    constant its dtype cannot hold; the neighbours torch computes stay accepted and
    exact (bool ** 2, bool % 2, bool / bool, uint8 ** 255)."""
    q, k, v = _qkv(b=1, h=1, hk=1, sq=8, sk=8, dtype=F32)
    tab = torch.tensor([2, 3, 1, 0], dtype=torch.uint8)
    t0 = torch.tensor(True)
    refused = (
        (lambda s, b, h, qi, ki: s + ((qi >= ki) - (ki > 3)), "subtraction with a bool"),
        (lambda s, b, h, qi, ki: s + (1 - (qi >= ki)), "subtraction with a bool"),
        (lambda s, b, h, qi, ki: s - True, "subtraction with a bool"),
        (lambda s, b, h, qi, ki: s - t0, "subtraction with a bool"),
        (lambda s, b, h, qi, ki: torch.sub(s, qi >= ki, alpha=2), "subtraction with a bool"),
        (lambda s, b, h, qi, ki: s + torch.abs(qi >= ki), "abs of a bool"),
        (lambda s, b, h, qi, ki: s + (qi >= ki) // (ki >= 0), "// of two bool"),
        (lambda s, b, h, qi, ki: s + (qi >= ki) % (ki >= 0), "% of two bool"),
        (lambda s, b, h, qi, ki: s + (qi >= ki) ** (ki >= 2), r"\*\* of two bool"),
        (lambda s, b, h, qi, ki: s + torch.div(qi >= ki, ki >= 0, rounding_mode="trunc"), "two bool"),
        (lambda s, b, h, qi, ki: s + tab[ki % 4] ** 300, "pow: the constant 300 cannot be converted to uint8"),
    )
    ii, jj = torch.arange(8).view(-1, 1), torch.arange(8).view(1, -1)
    for fn, match in refused:
        with pytest.raises((RuntimeError, NotImplementedError)):
            fn(torch.zeros(8, 8), 0, 0, ii, jj)  # torch refuses it too
        with pytest.raises(UnsupportedError, match=match):
            flashgen.attention(q, k, v, score_mod=fn)
    for fn in ((lambda s, b, h, qi, ki: s + (qi >= ki) ** 2), (lambda s, b, h, qi, ki: s + (qi >= ki) % 2),
               (lambda s, b, h, qi, ki: s + (qi >= ki) / (ki >= 0)),
               (lambda s, b, h, qi, ki: s + tab[ki % 4] ** 255 * 0.01)):
        scores = (q[0, 0].double() @ k[0, 0].double().T) * 16 ** -0.5
        ref = torch.softmax(fn(scores, 0, 0, ii, jj), -1) @ v[0, 0].double()
        got = flashgen.attention(q, k, v, score_mod=fn)[0, 0].double()
        assert (got - ref).abs().max().item() < 1e-5


def test_widened_functions_keep_their_table_gradients_and_torchs_int32(tiles):
    """A widened graph whose casts make two loads one node sums their derivatives (the
    second one's replaced the first's: d tab off by 6/5); a bool added to an int32
    tensor stays int32 and wraps as in torch (a bool is int64 in torch only beside
    Python integers)."""
    t2 = torch.tensor([0.0, 0.1, 0.2, 0.3])
    tab = torch.randn(8)
    _run(lambda t: (lambda s, b, h, q_idx, kv_idx: s + t[(kv_idx >= 5) * 3] * 2.0 + t[(kv_idx >= 5).long() * 3] * 3.0
                    + t2[(q_idx * kv_idx * 10_000_000) // 1_000_000_000], None),
         [tab], b=1, h=1, hk=1, sq=17, sk=23, dtype=F32)
    idx = torch.tensor([2 ** 31 - 1, 0] * 11 + [0], dtype=torch.int32)
    fn = lambda s, b, h, q_idx, kv_idx: s + torch.where((idx[kv_idx] + (q_idx >= 0)) < 0, 3.0, 0.0)  # noqa: E731
    assert not user_mods.wide(user_mods.trace(fn, "score"), None, 1, 1, 17, 23)
    _run(lambda: (fn, None), b=1, h=1, hk=1, sq=17, sk=23, dtype=F32)


def test_an_integer_division_by_zero_reads_as_division_by_one(tiles):
    """tab[q_idx // kv_idx] at kv_idx = 0: the kernels divide by 1 there, as the index
    check evaluates it (an undefined quotient went unchecked); torch raises there, so
    the reference is the function with that divisor written out."""
    from flashgen import user_bounds

    tab = torch.randn(64)
    st = user_mods.trace(lambda s, b, h, q_idx, kv_idx: s + tab[q_idx // kv_idx], "score")
    got = user_bounds.read_ranges(st.graph, st.reads, st.captured, 1, 1, 8, 8, "cpu")
    assert list(got.values()) == [(0, 7)]
    q, k, v = _qkv(b=1, h=2, hk=1, sq=8, sk=8, dtype=F32)
    o = flashgen.attention(q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: s + tab[q_idx // kv_idx])
    want, _ = user_mods.reference(q.double(), k.double(), v.double(), 0.25, -8, 8, lambda s, b, h, q_idx, kv_idx: s + tab[
        q_idx // torch.where(kv_idx == 0, 1, kv_idx)], None, None, torch.float64)
    assert (o.double() - want).abs().max() < 1e-5



@pytest.mark.parametrize("term", [
    lambda q, k: (q * 0 - 2 ** 31).int() % 5,
    lambda q, k: ((q + 1).int() * 2 ** 30) % 5,
    lambda q, k: (q.int() + 2147483645 + q.int()) % 7,
    lambda q, k: ((q + 1).int() * 2 ** 30) // 2 ** 28,
    lambda q, k: ((q + 1).int() * 2 ** 30) // (k.int() * 2 - 7),
    lambda q, k: ((q + 1).int() * 2 ** 30) % (k.int() * 2 - 7),
    lambda q, k: (q - 3) // -2 + (q - 3) % -2 * 10,
], ids=["min-mod", "wrapped-mod", "near-min-mod", "wrapped-div", "tensor-div", "tensor-mod", "negative-divisor"])
def test_integer_floor_division_near_the_int32_minimum_gives_torchs_values(term):
    """Floor division and remainder of int32 values within |divisor| of -2**31 (after
    torch's int32 wrap): an intermediate of the kernels' floor (-a + b - 1, |a|)
    overflowed there (x % 5 gave 8, x // 2**28 the other sign).  The score is the term
    alone, so the LSE is its log-sum-exp over the keys (the term itself where it depends
    on the query row only); torch computes the reference."""
    q, k, v = _qkv(b=1, h=1, hk=1, sq=6, sk=8, dtype=F32)
    qi, ki = torch.arange(6).view(6, 1), torch.arange(8).view(1, 8)
    want = torch.logsumexp(term(qi, ki).float().expand(6, 8).double(), -1)
    fn = lambda s, b, h, q_idx, kv_idx: s * 0 + term(q_idx, kv_idx).float()  # noqa: E731
    _, lse = flashgen.attention(q, k, v, score_mod=fn, return_lse=True)
    torch.testing.assert_close(lse[0, 0].double(), want, rtol=1e-6, atol=1e-4)

def test_a_where_of_integer_constants_that_leaves_int32_is_refused():
    st = user_mods.trace(lambda s, b, h, q_idx, kv_idx: s + (torch.where(q_idx > 0, 2 ** 30, 0) * 4).float(), "score")
    with pytest.raises(UnsupportedError, match="torch.where .* of Python integer constants alone"):
        user_mods.wide(st, None, 1, 1, 8, 8)


def test_the_index_check_keeps_a_captured_integer_tensors_dtype():
    """int8 + int8 wraps in int8 in torch and in the kernels alike: the check evaluates
    the index with the tensor's dtype (it read int64 and refused an index the kernels
    compute in range, 260 for 4)."""
    from flashgen import user_bounds

    x = torch.tensor([100], dtype=torch.int8)
    tab = torch.zeros(8)
    st = user_mods.trace(lambda s, b, h, q_idx, kv_idx: s + tab[x[q_idx * 0] + x[kv_idx * 0] + 60], "score")
    got = user_bounds.read_ranges(st.graph, st.reads, st.captured, 1, 1, 4, 4, "cpu")
    assert list(got.values())[-1] == (4, 4)



def test_8_and_16_bit_integer_arithmetic_gives_torchs_values(tiles):
    """A Python integer beside a uint8, int8 or int16 tensor is converted to its dtype
    modulo 2**bits, as torch converts it (Triton refused 300 or -1 beside uint8 and 200
    beside int8: an InterpreterError, and a CompilationError for sm_90; ``> 300`` gave
    another mask than torch's); uint8 with int8 computes in int16 and a bool beside
    uint8 in uint8, as in torch (the kernels' promotion gave uint8 and int32)."""
    u = torch.tensor([200, 3, 250, 1, 0, 255, 44, 128] * 3, dtype=torch.uint8)
    i8 = torch.tensor([100, -3, 120, -128], dtype=torch.int8)
    i16 = torch.tensor([30000, -3, 120, -32768] * 6, dtype=torch.int16)
    flag = torch.tensor([True, False, True, False] * 6)

    def make(t):
        return (lambda s, b, h, q_idx, kv_idx: s * t[h] + 0.01 * (u[kv_idx] + 300).float()
                - 0.01 * (u[kv_idx] * -1).float() + (u[kv_idx] > 300).float() + 0.001 * (u[kv_idx] * i8[h]).float()
                + 0.001 * (i16[kv_idx] + 40000).float() + 0.01 * (u[kv_idx] * flag[kv_idx] + 255).float()
                + 0.1 * (u[kv_idx] % 300).float() + 0.01 * torch.where(flag[kv_idx], u[kv_idx], -1).float()
                + 0.01 * u[kv_idx].clamp(min=-200).float() + 0.01 * (u[kv_idx] ^ -1).float(),
                lambda b, h, q_idx, kv_idx: ((u[kv_idx] + 300) % 7 != 0) | (kv_idx == 0))
    _run(make, [torch.tensor([1.0, 0.5, -0.5, 2.0])], b=1, h=4, hk=2, sq=17, sk=24, dtype=F32)


def test_int32_tables_with_python_integers_and_inverted_uint8_give_torchs_values():
    """An int32 tensor beside a Python integer or a 0-dim int64 tensor stays int32 in
    torch, the constant wrapped (2**32 + 1 -> 1, 2**31 -> -2**31) and products wrapping
    (the kernels computed them in int64); ~ of a uint8 is 255 - x (an InterpreterError:
    -1 out of bounds for uint8); a NumPy scalar is a Python scalar (it was refused)."""
    import numpy as np

    i32 = torch.arange(24, dtype=torch.int32) * 100_003
    z64 = torch.tensor(2 ** 32 + 1)
    u8 = torch.arange(24, dtype=torch.uint8) * 17
    fns = [lambda s, b, h, q, k: s + ((i32[k] + 2 ** 32 + 1) % 7).float() + ((i32[k] + z64) % 5).float(),
           lambda s, b, h, q, k: s + ((i32[k] * 100_000) % 11).float() + (i32[k] < 2 ** 31).float(),
           lambda s, b, h, q, k: s + 0.01 * (~u8[k]).float() + 0.01 * torch.bitwise_not(u8[q]).float(),
           lambda s, b, h, q, k: s * np.float32(0.5) + (k % np.int64(3)) * np.float64(0.25)]
    for fn in fns:
        got, want = _lse_kernel_and_torch(fn, sq=7, sk=24)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(UnsupportedError, match="8589934592 cannot be converted to int32"):
        user_mods.trace(lambda s, b, h, q, k: s + torch.where(k > 3, i32[k], 2 ** 33).float(), "score")


@pytest.mark.parametrize("fn, match", [
    (lambda s, b, h, q_idx, kv_idx: s + torch.where(q_idx > kv_idx, _U8[kv_idx], 300).float(),
     "300 cannot be converted to uint8 without overflow"),
    (lambda s, b, h, q_idx, kv_idx: s + _U8[kv_idx].clamp(max=300).float(), "300 cannot be converted to uint8"),
    (lambda s, b, h, q_idx, kv_idx: s + (_U8[kv_idx] << 9).float(), "shift of a uint8 value by 9"),
    (lambda s, b, h, q_idx, kv_idx: s + (_U8[kv_idx] // 256).float(), "division .* by the constant 0"),
], ids=["where", "clamp", "shift", "divisor-wraps-to-0"])
def test_what_torch_refuses_of_8_bit_integers_is_refused(fn, match):
    """torch raises for torch.where and torch.clamp with a constant outside the dtype
    and for a division by a constant that converts to 0; a constant shift past the
    dtype's width is undefined in the kernels."""
    with pytest.raises(UnsupportedError, match=match):
        user_mods.trace(fn, "score")




_U8K = torch.tensor([200, 3, 250, 1, 0, 255, 44, 128], dtype=torch.uint8)
_I8H = torch.tensor([100, -3, 120, -128], dtype=torch.int8)


@pytest.mark.parametrize("term", [
    lambda q, k: (_U8K[k] << k) + 300,
    lambda q, k: (_U8K[k] >> (k % 3)) * -1,
    lambda q, k: _U8K[k] << _I8H[q % 4].clamp(0, 3),
    lambda q, k: _U8K[k] * torch.tensor(-3, dtype=torch.int8),
    lambda q, k: _I8H[q % 4] * _U8K[2],
    lambda q, k: _U8K[k] + torch.tensor(300),
    lambda q, k: (_U8K[k] > torch.tensor(300)).long() * 7,
], ids=["shift-by-index", "shift-then-neg", "shift-by-int8", "0-dim-int8", "0-dim-uint8", "0-dim-int64",
        "0-dim-compare"])
def test_8_bit_promotion_follows_torch_for_shifts_and_0_dim_tensors(term):
    """A shift takes its amount's dtype into the promotion (u8 << kv_idx is int64: + 300
    is not wrapped; u8 << int8 is int16), and a 0-dim tensor (a captured scalar, t[0])
    beside a tensor that varies with the inputs takes that tensor's dtype, as in torch
    (u8 * an int8 scalar is uint8; u8 + tensor(300) wraps 300 to 44).  The score is the
    term alone: the LSE is its log-sum-exp over the keys."""
    q, k, v = _qkv(b=1, h=1, hk=1, sq=6, sk=8, dtype=F32)
    qi, ki = torch.arange(6).view(6, 1), torch.arange(8).view(1, 8)
    want = torch.logsumexp(0.01 * term(qi, ki).float().expand(6, 8).double(), -1)
    fn = lambda s, b, h, q_idx, kv_idx: s * 0 + 0.01 * term(q_idx, kv_idx).float()  # noqa: E731
    _, lse = flashgen.attention(q, k, v, score_mod=fn, return_lse=True)
    torch.testing.assert_close(lse[0, 0].double(), want, rtol=1e-6, atol=1e-4)

_SM90_NARROW = '''
import json, sys
sys.path.insert(0, BENCHMARKS)
import torch
from sm90_compile import compile_sm90
from flashgen import heuristics, user_mods, user_render
from flashgen.arch import by_sm
from flashgen.spec import KernelSpec, Variant
u, i8 = torch.zeros(2048, dtype=torch.uint8), torch.zeros(16, dtype=torch.int8)
i16, flag, t = torch.zeros(2048, dtype=torch.int16), torch.zeros(2048, dtype=torch.bool), torch.zeros(16, requires_grad=True)
st = user_mods.trace(lambda s, b, h, q, kv: s * t[h] + (u[kv] + 300).float() + (u[kv] > 300).float()
                     + (u[kv] * i8[h]).float() + (i16[kv] + 40000).float() + (u[kv] * flag[kv] - 1).float(), "score")
for kernel in ("fwd", "bwd_dq", "bwd_dkdv"):
    low = user_mods._lowered("fwd" if kernel == "fwd" else "bwd", st, None, [b.dtype == "float32" for b in st.bufs], False)
    user_render.register(low)
    spec = KernelSpec(kernel, "bfloat16", 128, 128, "causal", low.name)
    compile_sm90(Variant(spec, heuristics.default_config(spec, by_sm("sm_90"))))
    print(json.dumps([kernel]))
'''


def test_8_bit_integer_constants_compile_for_sm90():
    """The converted constants and the casts of the row above compile for sm_90 in the
    three kernels (Triton refused 300 beside uint8 there)."""
    assert [r[0] for r in _sm90_rows(_SM90_NARROW)] == ["fwd", "bwd_dq", "bwd_dkdv"]

_U8 = torch.arange(24, dtype=torch.uint8)

@pytest.mark.parametrize("sm", [
    lambda s, b, h, q_idx, kv_idx: -0.25 * torch.abs(q_idx - kv_idx).float(),
    lambda s, b, h, q_idx, kv_idx: torch.floor(s * 4),
    lambda s, b, h, q_idx, kv_idx: torch.where(s > 0, 1.0, -1.0),
    lambda s, b, h, q_idx, kv_idx: 1.5,
], ids=["positions-only", "floor", "where-constants", "constant"])
def test_a_score_function_with_a_zero_derivative_gives_zero_dq_dk(tiles, sm):
    """A result that does not depend on the score (positions only, a constant) or
    whose derivative in it is zero (floor, a comparison) passes no gradient to q and
    k (it was read as a derivative of 1)."""
    got, _ = _run(lambda: (sm, None), causal=True)
    assert not got["dQ"].any() and not got["dK"].any()


@pytest.mark.parametrize("extent, path", [(8, "reduced"), (80, "per-element")])
def test_a_table_read_at_an_index_computed_from_the_score_gets_its_gradient(tiles, extent, path):
    """An index that depends on the score is a per-element (row, column) value: the
    table's gradient is added per element (or summed per index value in the tile), not
    once per tile at one element's offset (the (8, heads) table's gradient was off by 4)."""
    def make(t):
        return (lambda s, b, h, q_idx, kv_idx: s + t[(s.abs() * 2).long() % extent, h]), None
    table = torch.randn(extent, 4, generator=torch.Generator().manual_seed(3))
    assert isinstance(_bwd_lowering(make, [table]), user_grads.Reduced) == (path == "reduced")
    _run(make, [table], dtype=F32, sq=17, sk=100)


@pytest.mark.parametrize("sm", [
    lambda s, b, h, q_idx, kv_idx: torch.sqrt(s.abs()),
    lambda s, b, h, q_idx, kv_idx: s + 0.25 * torch.log(s.abs()),
    lambda s, b, h, q_idx, kv_idx: s - 0.001 / s,
], ids=["sqrt-abs", "log-abs", "reciprocal"])
@pytest.mark.parametrize("causal", [False, True])
def test_a_derivative_infinite_at_zero_gives_no_nan_on_the_padded_tiles(tiles, sm, causal):
    """Padded rows and columns (seqlen 17 and 100 in 16-wide tiles) have s = q.k = 0,
    where these derivatives are infinite: dS there is 0 and must stay 0 (0 * inf made
    every dQ and dK entry NaN); the forward's -inf / inf there never reaches O.  q and k
    are positive, so that every real score is away from 0 (where these functions are
    ill-conditioned and no two summation orders agree)."""
    got, _ = _run(lambda: (sm, None), causal=causal, dtype=F32, sq=17, sk=100, positive=True)
    assert all(torch.isfinite(t).all() for n, t in got.items() if n != "LSE"), {n: t.isnan().sum() for n, t in got.items()}
    # a derivative finite everywhere (softcap's 1 - tanh^2) keeps the plain product
    for fn, zeroed in ((sm, True), (lambda s, b, h, q_idx, kv_idx: 30 * torch.tanh(s / 30), False)):
        st = user_mods.trace(fn, "score")
        assert user_render.may_be_infinite(st.graph, st.dscore) == zeroed


def test_an_index_from_the_score_outside_its_tensor_reads_nothing_and_gives_nan(tiles):
    """The host cannot check an index computed from the score: the kernels check it and
    make that score NaN, so exactly the query rows that read outside the table come out
    NaN (O, LSE, dQ), and the others are finite; the table's gradient gets nothing from
    the reads outside it."""
    from flashgen import render

    def make(t):
        # (s * 0).long() ties the index to the score; its value is q_idx - 4
        return (lambda s, b, h, q_idx, kv_idx: s + t[(s * 0).long() + q_idx - 4, h]), None
    table = torch.randn(8, 4, requires_grad=True)
    q, k, v = (x.float().requires_grad_() for x in _qkv(sq=17, sk=100))
    o, lse = flashgen.attention(q, k, v, score_mod=make(table)[0], return_lse=True)
    o.sum().backward()
    bad = (torch.arange(17) < 4) | (torch.arange(17) >= 12)  # q_idx - 4 outside [0, 8)
    assert o[:, :, bad].isnan().all() and torch.isfinite(o[:, :, ~bad]).all()
    assert lse[:, :, bad].isnan().all() and torch.isfinite(lse[:, :, ~bad]).all()
    assert q.grad[:, :, bad].isnan().all() and torch.isfinite(q.grad[:, :, ~bad]).all()
    assert torch.isfinite(table.grad).all()
    # the rows inside the table are the float64 reference's
    _, lo, hi = mask_bounds(17, 100, causal=False, window=(-1, -1))
    ro, _ = user_mods.reference(q.detach()[:, :, 4:12].double(), k.detach().double(), v.detach().double(),
                                16 ** -0.5, lo, hi, lambda s, b, h, i, j: s + table.detach().double()[i, h])
    assert (o[:, :, 4:12].double() - ro).abs().max() < 1e-5
    st = user_mods.trace(make(table)[0], "score")
    for kernel, direction in (("fwd", "fwd"), ("bwd_dq", "bwd"), ("bwd_dkdv", "bwd")):
        low = user_mods.lowering(direction, st, None, [True], False)
        src = render.render(Variant(KernelSpec(kernel, "float16", 64, 64, "none", low.name), TileConfig(64, 32, 4, 1)))
        assert re.search(r"tl\.load\(UT0 \+ [^\n]*, mask=u_ok\d+, other=0\)", src), kernel
        assert "ut0_n0, ut0_n1" in src and 'float("nan")' in src


def test_integer_constants_past_int32_compute_in_int64_as_torch_does(tiles):
    """q_idx * 2**31 overflowed Triton's int32 (an InterpreterError); a constant past
    int32 makes the arithmetic int64, a band past int32 binds nothing, and a constant past
    int64 is an UnsupportedError naming it."""
    _run(lambda: ((lambda s, b, h, q_idx, kv_idx: s + ((q_idx * 2 ** 31) // 2 ** 31) * 0.25
                   - (kv_idx + 2 ** 40 > q_idx + 2 ** 40).float()), None), dtype=F32, sq=17, sk=100)
    _run(lambda: (None, lambda b, h, q_idx, kv_idx: (q_idx - kv_idx <= 2 ** 40) & (kv_idx <= q_idx)),
         dtype=F32, sq=17, sk=100)
    q = torch.randn(1, 2, 17, 16)
    with pytest.raises(UnsupportedError, match=r"integer constant 1267650600228229401496703205376 .*int64"):
        flashgen.attention(q, q, q, score_mod=lambda s, b, h, q_idx, kv_idx: s + (q_idx * 2 ** 100 > 0))


def test_a_mask_function_returning_a_constant(tiles):
    _run(lambda: (None, lambda b, h, q_idx, kv_idx: True), causal=True)
    got, _ = _run(lambda: (None, lambda b, h, q_idx, kv_idx: False))
    assert not got["O"].any() and torch.isneginf(got["LSE"]).all()


def test_a_closure_made_again_over_the_same_objects_is_not_traced_again():
    def make(table):
        def score_mod(score, b, h, q_idx, kv_idx):
            return score + table[h]
        return score_mod
    t1, t2 = torch.zeros(4), torch.zeros(4)
    a = user_mods.trace(make(t1), "score")
    assert user_mods.trace(make(t1), "score") is a
    b = user_mods.trace(make(t2), "score")
    assert b is not a and b.captured[0] is t2


def test_the_caches_keep_no_tensor_of_a_dropped_function_alive():
    """flashgen's caches of traced functions, lowerings, block masks and index checks hold
    a user function and the tensors it names by weak reference: once the caller drops
    them (and the autograd graph of the call), they are freed, and a closure made again
    over live objects still hits the cache; a call holds its own until its backward."""
    import gc
    import weakref

    q, k, v = _qkv(b=1, h=2, hk=1, sq=20, sk=24)
    doc = torch.arange(24) // 10
    table = torch.randn(2, requires_grad=True)

    def make(doc, table):
        def score_mod(s, b, h, q_idx, kv_idx):
            return s + table[h]

        def mask_mod(b, h, q_idx, kv_idx):
            return doc[q_idx] == doc[kv_idx]
        return score_mod, mask_mod

    sm, mm = make(doc, table)
    assert user_mods.trace(make(doc, table)[1], "mask") is user_mods.trace(mm, "mask")
    qg = q.clone().requires_grad_()
    o = flashgen.attention(qg, k, v, score_mod=sm, mask_mod=mm)
    refs = [weakref.ref(x) for x in (doc, table, sm, mm)]
    del sm, mm, doc  # the graph still needs the mask function and ids: the call holds them
    gc.collect()
    o.float().sum().backward()
    assert table.grad is not None and qg.grad is not None and torch.isfinite(qg.grad).all()
    del o, qg, table
    gc.collect()
    assert [r() is None for r in refs] == [True] * 4


def test_a_function_whose_global_tensor_is_rebound_is_traced_again():
    """A module-level function reading a module-level tensor (the README's T5 example):
    rebinding the global (a re-run notebook cell, a loaded checkpoint), or a global a
    helper it calls reads, gives a new trace reading the new tensor; an unchanged one
    hits."""
    ns = {"torch": torch, "table": torch.zeros(4), "offsets": torch.zeros(4, dtype=torch.long)}
    exec("def bucket(x):\n    return x % 4 + offsets[x % 4]\n"
         "def score_mod(score, b, h, q_idx, kv_idx):\n    return score + table[bucket(kv_idx)]\n", ns)
    a = user_mods.trace(ns["score_mod"], "score")
    assert user_mods.trace(ns["score_mod"], "score") is a
    ns["table"] = torch.ones(4)
    b = user_mods.trace(ns["score_mod"], "score")
    assert b is not a and any(t is ns["table"] for t in b.captured)
    ns["offsets"] = torch.ones(4, dtype=torch.long)
    c = user_mods.trace(ns["score_mod"], "score")
    assert c is not b and any(t is ns["offsets"] for t in c.captured)


class _RelBias(torch.nn.Module):
    def __init__(self, seed):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(45, generator=torch.Generator().manual_seed(seed)) * 3)

    def score_mod(self, score, b, h, q_idx, kv_idx):
        return score + self.table[kv_idx]


def test_bound_methods_of_two_modules_read_their_own_tensors(tiles):
    """``self.score_mod`` of two instances (a new bound method on every access): each
    call reads its own instance's table (forward and the table's gradient against
    float64), a repeated access hits the cache, and a rebound attribute is traced
    again."""
    m1, m2 = _RelBias(1), _RelBias(2)
    q, k, v = _qkv()
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(7)).to(F16)
    for m in (m1, m2):
        o = flashgen.attention(q, k, v, score_mod=m.score_mod)
        o.backward(do)
        got = {"O": o.detach(), "dtable": m.table.grad}
        refs = {}
        for dt in (torch.float64, F16):
            mr = _RelBias(0)
            mr.table = torch.nn.Parameter(m.table.detach().to(dt))
            r, _ = user_mods.reference(q, k, v, 16 ** -0.5, -10**9, 10**9, mr.score_mod, dtype=dt)
            r.backward(do.to(dt))
            refs[dt] = {"O": r.detach(), "dtable": mr.table.grad}
        res = bench._ratios(got, {n: (refs[torch.float64][n], refs[F16][n]) for n in got}, F16)
        assert all(r <= 1.0 for _, _, r in res.values()), res
    a = user_mods.trace(m1.score_mod, "score")
    assert user_mods.trace(m1.score_mod, "score") is a
    assert user_mods.trace(m2.score_mod, "score") is not a
    m1.table = torch.nn.Parameter(torch.zeros(45))
    assert user_mods.trace(m1.score_mod, "score").captured[0] is m1.table



class _Temperature:
    """A callable object with a number the trace takes as a constant."""

    def __init__(self, c):
        self.c = c

    def __call__(self, score, b, h, q_idx, kv_idx):
        return score * self.c


class _Cfg:
    def __init__(self, temp):
        self.temp = temp


class _Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.cfg = _Cfg(3.0)
        self.register_buffer("table", torch.tensor([1.0, 2.0, 0.5, -1.0]))

    def score_mod(self, score, b, h, q_idx, kv_idx):
        return score / self.cfg.temp + self.table[h]


def test_a_constant_computed_from_a_captured_buffer_is_read_again_after_an_in_place_change(tiles):
    """A tensor the function both indexes (a buffer the kernels read at each call) and
    computes with outside the trace (``int(doc.max())``, a constant in the trace): an
    in-place change traces again, so the kernel runs the new constant (against
    float64); a buffer only indexed is not traced again."""
    q, k, v = _qkv(b=1, sq=20, sk=24)
    doc = torch.tensor([0] * 8 + [1] * 8 + [2] * 8)

    def last_docs_hidden(b, h, q_idx, kv_idx):
        return doc[kv_idx] <= int(doc.max()) - 1

    def check():
        o = flashgen.attention(q, k, v, mask_mod=last_docs_hidden)
        ref, _ = user_mods.reference(q, k, v, 16 ** -0.5, -24, 24, None, last_docs_hidden, None, torch.float64)
        torch.testing.assert_close(o.double(), ref, rtol=0, atol=3e-3)

    check()
    a = user_mods.trace(last_docs_hidden, "mask")
    doc.add_(5)
    check()
    assert user_mods.trace(last_docs_hidden, "mask") is not a
    ids = torch.tensor([0] * 12 + [1] * 12)

    def same_doc(b, h, q_idx, kv_idx):
        return ids[kv_idx] == 0

    t = user_mods.trace(same_doc, "mask")
    ids[:] = 0
    assert user_mods.trace(same_doc, "mask") is t


def test_a_value_the_trace_took_as_a_constant_is_read_again_when_it_changes(tiles):
    """A number an object holds (a callable object's attribute, a module's nested config
    through a bound method, a global object's tensor
    attribute, a global list's item) is part of the trace's key: changed, the next call
    traces again and runs the new value (against float64); unchanged, the trace is
    reused."""
    q, k, v = _qkv(b=1, sq=20, sk=24)
    sk = k.shape[2]

    def check(fn, want):
        o = flashgen.attention(q, k, v, score_mod=fn)
        s = (q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2)) * 16 ** -0.5
        ref = torch.softmax(want(s), -1) @ v.double().repeat_interleave(2, 1)
        torch.testing.assert_close(o.double(), ref, rtol=0, atol=3e-3)

    heads = torch.arange(4).view(1, 4, 1, 1)
    sc = _Temperature(2.0)
    check(sc, lambda s: s * 2.0)
    a = user_mods.trace(sc, "score")
    assert user_mods.trace(sc, "score") is a
    sc.c = 0.5
    check(sc, lambda s: s * 0.5)
    assert user_mods.trace(sc, "score") is not a

    m = _Scaled()
    check(m.score_mod, lambda s: s / 3.0 + m.table.double()[heads])
    b = user_mods.trace(m.score_mod, "score")
    assert user_mods.trace(m.score_mod, "score") is b
    m.cfg.temp = 0.25
    check(m.score_mod, lambda s: s / 0.25 + m.table.double()[heads])
    m.table = torch.tensor([0.0, -2.0, 1.0, 3.0])  # a buffer rebound
    check(m.score_mod, lambda s: s / 0.25 + m.table.double()[heads])

    # a tensor behind a property (weight-normed tables), a __slots__ attribute, a class attribute
    class Normed:
        __slots__ = ("raw", "c")
        shift = 0.0

        def __init__(self):
            self.raw, self.c = torch.tensor([1.0, 2.0, 3.0, 4.0]), 2.0

        @property
        def table(self):
            return self.raw / self.raw.norm()

        def __call__(self, score, b, h, q_idx, kv_idx):
            return score * self.c + self.table[h] + self.shift

    nm = Normed()
    check(nm, lambda s: s * 2.0 + nm.table.double()[heads])
    nm.raw = torch.tensor([4.0, -1.0, 0.0, 2.0])
    check(nm, lambda s: s * 2.0 + nm.table.double()[heads])
    nm.c = 5.0
    check(nm, lambda s: s * 5.0 + nm.table.double()[heads])
    Normed.shift = 1.5
    check(nm, lambda s: s * 5.0 + nm.table.double()[heads] + 1.5)

    holder = types.SimpleNamespace(table=torch.tensor([1.0, 2.0, 3.0, 4.0]), scales=[1.0, 2.0])
    ns = {"holder": holder}
    exec("def by_head(score, b, h, q_idx, kv_idx):\n"
         "    return score * holder.scales[1] + holder.table[h]\n", ns)
    fn = ns["by_head"]
    check(fn, lambda s: s * 2.0 + holder.table.double()[heads])
    c = user_mods.trace(fn, "score")
    assert user_mods.trace(fn, "score") is c
    holder.table = torch.tensor([-3.0, 0.5, 0.0, 1.0])
    check(fn, lambda s: s * 2.0 + holder.table.double()[heads])
    holder.scales[1] = -1.0
    check(fn, lambda s: -s + holder.table.double()[heads])
    assert sk == 24


def test_a_module_as_the_score_function_runs_its_forward(tiles):
    """An nn.Module passed as score_mod (FlexAttention takes any callable) runs as its
    forward, the table's gradient included, and its state is read as a bound method's."""
    class RelBias(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Parameter(torch.randn(4))

        def forward(self, score, b, h, q_idx, kv_idx):
            return score + self.table[h]

    class Docs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("doc", torch.arange(24) // 7)

        def forward(self, b, h, q_idx, kv_idx):
            return self.doc[q_idx] >= self.doc[kv_idx]

    import gc

    m, dm = RelBias(), Docs()
    q, k, v = _qkv(b=1, sq=20, sk=24)
    outs = []
    for _ in range(3):  # repeated calls: the trace holds the module, not a freed bound forward
        gc.collect()
        outs.append(flashgen.attention(q, k, v, mask_mod=dm))
    want = flashgen.attention(q, k, v, mask_mod=dm.forward)
    assert all(torch.equal(o, want) for o in outs)
    want = flashgen.attention(q, k, v, score_mod=m.forward, mask_mod=dm.forward)
    for _ in range(2):
        gc.collect()
        o = flashgen.attention(q, k, v, score_mod=m, mask_mod=dm)
        torch.testing.assert_close(o, want, rtol=0, atol=0)
    o.float().sum().backward()
    assert m.table.grad is not None and torch.isfinite(m.table.grad).all()
    assert user_mods.trace(m, "score") is user_mods.trace(m.forward, "score")


def test_the_trace_cache_keeps_one_entry_per_function_and_runs_no_unrelated_code(tiles, monkeypatch):
    """A property that returns a new tensor on every call traces again each call, but
    the cache keeps one entry for the function, so the earlier traces' tensors are
    freed; attributes of other objects than the function's own are not run (a global
    object's property) nor keyed by C-level descriptors (a numpy array's ``data``):
    such a function traces once; a tensor the function turns into a number
    (``.item()``) and that is then changed in place traces again."""
    import gc
    import weakref

    import numpy as np

    q, k, v = _qkv(b=1, sq=20, sk=24, dtype=F32)
    inits = []
    real = user_mods.Traced.__init__
    monkeypatch.setattr(user_mods.Traced, "__init__", lambda self, *a, **kw: inits.append(1) or real(self, *a, **kw))

    class Fresh:
        def __init__(self):
            self.raw = torch.randn(4)

        @property
        def table(self):
            return self.raw * 2.0

        def __call__(self, score, b, h, q_idx, kv_idx):
            return score + self.table[h]

    fresh, made = Fresh(), []
    for _ in range(4):
        o = flashgen.attention(q, k, v, score_mod=fresh)
        made.append(weakref.ref(fresh.table))  # a new tensor each read, as each call's
    gc.collect()
    assert len(inits) == 4 and sum(1 for key in user_mods._traces if key[0][0] == "obj") >= 1
    # Plain CPU tensors only: torch.compile's caches from other tests in this process
    # keep FakeTensors alive, and torch.equal refuses to mix them with real ones.
    alive = sum(1 for t in gc.get_objects() if type(t) is torch.Tensor and t.device.type == "cpu"
                and t.shape == (4,) and torch.equal(t, fresh.raw * 2.0))
    assert alive <= 2, alive  # the last trace's tensor (and at most one being collected)

    runs = []

    class Noisy:
        @property
        def rel(self):
            runs.append(1)
            return 0

    ns = {"torch": torch, "table": torch.randn(24), "noisy": Noisy(), "data": np.zeros(3),
          "holder": types.SimpleNamespace(rel=torch.randn(4))}
    exec("def sm(score, b, h, q_idx, kv_idx):\n"
         "    return score + holder.rel.data[h] + table[kv_idx] * (noisy is not None)\n", ns)
    inits.clear()
    for _ in range(3):
        flashgen.attention(q, k, v, score_mod=ns["sm"])
    assert len(inits) == 1 and runs == []

    temp = torch.tensor(2.0)
    fn = lambda score, b, h, q_idx, kv_idx: score * temp.item()  # noqa: E731
    s_ = (q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2)) * 16 ** -0.5
    for t in (2.0, 0.5):
        temp.fill_(t)
        o = flashgen.attention(q, k, v, score_mod=fn)
        ref = torch.softmax(s_ * t, -1) @ v.double().repeat_interleave(2, 1)
        torch.testing.assert_close(o.double(), ref, rtol=0, atol=1e-4)


def test_constants_reached_through_containers_helpers_and_partials_are_read_again(tiles, monkeypatch):
    """Values a trace takes as constants through a mutable default list, a helper
    method reading ``self.alpha``, a ``functools.partial``'s bound config and a
    ``__slots__`` config object are part of its key (a change traces again, against
    float64); equal values made again per call (a closure over a computed float, a
    tuple holding a new tensor) do not trace again, and the cache keeps none of the
    per-call tensors alive."""
    import dataclasses
    import functools
    import gc
    import weakref

    q, k, v = _qkv(b=1, sq=20, sk=24, dtype=F32)
    s_ = (q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2)) * 16 ** -0.5
    vv = v.double().repeat_interleave(2, 1)

    def check(fn, scale):
        o = flashgen.attention(q, k, v, score_mod=fn)
        torch.testing.assert_close(o.double(), torch.softmax(s_ * scale, -1) @ vv, rtol=0, atol=1e-4)

    def with_default(score, b, h, q_idx, kv_idx, cfg=[2.0]):  # noqa: B006 (the case itself)
        return score * cfg[0]
    check(with_default, 2.0)
    with_default.__defaults__[0][0] = 0.5
    check(with_default, 0.5)

    class Layer:
        def __init__(self):
            self.alpha = 2.0

        def _scale(self):
            return self.alpha

        def score(self, score, b, h, q_idx, kv_idx):
            return score * self._scale()
    layer = Layer()
    check(layer.score, 2.0)
    layer.alpha = -1.0
    check(layer.score, -1.0)

    @dataclasses.dataclass(slots=True)
    class Cfg:
        w: float

    def scaled(score, b, h, q_idx, kv_idx, cfg=None):
        return score * cfg.w
    cfg = Cfg(3.0)
    part = functools.partial(scaled, cfg=cfg)
    check(part, 3.0)
    cfg.w = 0.25
    check(part, 0.25)
    check(functools.partial(scaled, cfg=Cfg(1.5)), 1.5)

    inits = []
    real = user_mods.Traced.__init__
    monkeypatch.setattr(user_mods.Traced, "__init__", lambda self, *a, **kw: inits.append(1) or real(self, *a, **kw))
    refs = []
    for i in range(4):
        c = 1.0 / math.sqrt(4.0)  # a new float object, equal each call
        bias = torch.zeros(4)
        refs.append(weakref.ref(bias))
        held = (bias,)
        flashgen.attention(q, k, v, score_mod=lambda score, b, h, q_idx, kv_idx: score * c + held[0][h])
        del bias, held
    gc.collect()
    assert len(inits) == 4  # the tuple's tensor is new each call: traced again ...
    assert sum(r() is not None for r in refs) == 0  # ... and none of them kept alive
    inits.clear()
    for _ in range(3):
        c = 1.0 / math.sqrt(4.0)
        flashgen.attention(q, k, v, score_mod=lambda score, b, h, q_idx, kv_idx: score * c)
    assert len(inits) == 1


@pytest.mark.parametrize("path", ["kernels", "reference"])
def test_a_tensor_the_functions_read_modified_before_the_backward_is_refused(tiles, monkeypatch, path):
    """The backward re-reads what the functions read: a captured tensor (or the sinks)
    modified in place between the forward and the backward stops autograd with its
    version error, as for q, k and v, instead of giving gradients of another
    function.  On the CPU's reference path too (its graph held float32 copies and
    indexed values, so no change was seen), for k as well."""
    if path == "reference":
        monkeypatch.setattr(flashgen.library, "use_kernels", lambda q: False)
    q, k, v = _qkv(b=1, sq=20, sk=24)
    q.requires_grad_()
    table = torch.randn(4)
    doc = torch.arange(24) // 7
    o = flashgen.attention(q, k, v, score_mod=lambda s, b, h, i, j: s + table[h],
                           mask_mod=lambda b, h, i, j: doc[i] >= doc[j])
    table.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        o.float().sum().backward()
    o = flashgen.attention(q, k, v, mask_mod=lambda b, h, i, j: doc[i] >= doc[j])
    doc.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        o.float().sum().backward()
    sinks = torch.zeros(4, requires_grad=True)
    o = flashgen.attention(q, k, v, sinks=sinks)
    with torch.no_grad():
        sinks.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        o.float().sum().backward()
    o = flashgen.attention(q, k, v, sinks=torch.zeros(4))
    k.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        o.float().sum().backward()


def test_inference_tensors_and_meta_inputs_run_with_user_functions(tiles):
    """A table made under torch.inference_mode (no version counter, not savable) read by
    a score function still trains (the version check leaves it out); meta inputs give
    the output's sizes without reading the captured tensors."""
    q, k, v = _qkv(b=1, sq=20, sk=24)
    with torch.inference_mode():
        table = torch.randn(4)
    qg = q.clone().requires_grad_()
    o = flashgen.attention(qg, k, v, score_mod=lambda s, b, h, i, j: s + table[h])
    o.float().sum().backward()
    assert qg.grad is not None and torch.isfinite(qg.grad).all()
    qm, km, vm = (t.to("meta") for t in (q, k, v))
    doc = torch.arange(24, device="meta")
    out = flashgen.attention(qm, km, vm, score_mod=lambda s, b, h, i, j: s + table.to("meta")[h],
                             mask_mod=lambda b, h, i, j: doc[i] >= doc[j])
    assert out.is_meta and out.shape == q.shape


def test_a_double_backward_through_user_functions_is_refused(tiles):
    """create_graph=True: the first-order gradients are those of a plain backward, and
    differentiating them again raises (no silent zero second-order term)."""
    q, k, v = _qkv(b=1, sq=20, sk=24, dtype=F32)
    table = torch.randn(4, requires_grad=True)
    qg = q.clone().requires_grad_()
    w = torch.randn(1, 4, 20, 16, generator=torch.Generator().manual_seed(3))

    def run(create_graph):
        o = flashgen.attention(qg, k, v, score_mod=lambda s, b, h, i, j: s + table[h])
        return torch.autograd.grad((o * w).sum(), (qg, table), create_graph=create_graph)

    plain = run(False)
    gq, gt = run(True)
    torch.testing.assert_close(gq, plain[0], rtol=0, atol=0)
    torch.testing.assert_close(gt, plain[1], rtol=0, atol=0)
    assert gq.requires_grad
    with pytest.raises(RuntimeError, match="no double backward"):
        (gq ** 2).sum().backward()



def test_attributes_of_an_imported_module_are_state(tiles, monkeypatch):
    """``cfg.temperature`` of an ``import cfg`` (a configuration module): rebinding it
    traces again (the module was keyed by identity alone, and the first value served
    every later call: O off by 1.85), as does swapping a helper function of the module
    or changing a global that helper reads; an unchanged module traces once."""
    cfg = types.ModuleType("flashgen_test_cfg")
    exec("temperature = 1.0\nscale = 1.0\ndef shape(s):\n    return s * scale\n", vars(cfg))
    ns = {"cfg": cfg}
    exec("def sm(score, b, h, q_idx, kv_idx):\n    return cfg.shape(score) * cfg.temperature\n", ns)
    inits = []
    real = user_mods.Traced.__init__
    monkeypatch.setattr(user_mods.Traced, "__init__", lambda self, *a, **kw: inits.append(1) or real(self, *a, **kw))
    q, k, v = _qkv(b=1, h=2, hk=2, sq=9, sk=11, dtype=F32)

    def check(factor):
        o = flashgen.attention(q, k, v, score_mod=ns["sm"])
        ref = torch.softmax(q.double() @ k.double().transpose(-1, -2) * 0.25 * factor, -1) @ v.double()
        assert (o.double() - ref).abs().max() < 1e-5, factor

    check(1.0)
    check(1.0)
    assert len(inits) == 1
    cfg.temperature = 3.0
    check(3.0)
    cfg.scale = 0.5
    check(1.5)
    exec("def shape(s):\n    return s * 2.0\n", vars(cfg))
    check(6.0)
    assert len(inits) == 4
    exec("def sm(score, b, h, q_idx, kv_idx):\n    return score * getattr(cfg, 'temperature')\n", ns)
    check(3.0)
    cfg.temperature = 0.5  # a name given as a string is state too
    check(0.5)

def test_attributes_of_a_module_of_a_module_subclass_are_state(tiles):
    """A configuration module whose class derives from ``types.ModuleType`` (a lazy
    module, a module with properties) is state as a plain module is: rebinding its
    attribute traces again (it was taken as code and keyed by identity, and the first
    value served the next call: O off by 1.85)."""

    class Config(types.ModuleType):
        pass

    cfg = Config("flashgen_test_cfg_subclass")
    cfg.temperature = 1.0
    ns = {"cfg": cfg}
    exec("def sm(score, b, h, q_idx, kv_idx):\n    return score * cfg.temperature\n", ns)
    q, k, v = _qkv(b=1, h=2, hk=2, sq=9, sk=11, dtype=F32)
    for factor in (1.0, 3.0, 0.5):
        cfg.temperature = factor
        o = flashgen.attention(q, k, v, score_mod=ns["sm"])
        ref = torch.softmax(q.double() @ k.double().transpose(-1, -2) * 0.25 * factor, -1) @ v.double()
        assert (o.double() - ref).abs().max() < 1e-5, factor


def test_constants_read_from_arrays_are_read_again_when_the_array_changes(tiles, monkeypatch):
    """A NumPy array or an ``array.array`` that a score or mask function reads a constant
    from (``float(arr[1])``) is keyed by its contents: changed in place, the function is
    traced again (against float64), as the reference path reads it; an equal copy made
    again per call is not a new trace."""
    import array

    import numpy as np

    q, k, v = _qkv(b=1, sq=20, sk=24, dtype=F32)
    s_ = (q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2)) * 16 ** -0.5
    vv = v.double().repeat_interleave(2, 1)

    def check(o, scale, keep=None):
        s = s_ * scale
        if keep is not None:
            s = s.masked_fill(~keep, float("-inf"))
        torch.testing.assert_close(o.double(), torch.softmax(s, -1) @ vv, rtol=0, atol=1e-4)

    for arr in (np.array([1.0, 2.0]), array.array("d", [1.0, 2.0])):
        def scaled(score, b, h, q_idx, kv_idx, arr=arr):
            return score * float(arr[1])
        check(flashgen.attention(q, k, v, score_mod=scaled), 2.0)
        arr[1] = 0.5
        check(flashgen.attention(q, k, v, score_mod=scaled), 0.5)
    limit = np.array([20])

    def below(b, h, q_idx, kv_idx):
        return kv_idx < int(limit[0])
    cols = torch.arange(24)[None, :] < 20
    check(flashgen.attention(q, k, v, mask_mod=below), 1.0, cols)
    limit[0] = 7
    check(flashgen.attention(q, k, v, mask_mod=below), 1.0, torch.arange(24)[None, :] < 7)
    inits = []
    real = user_mods.Traced.__init__
    monkeypatch.setattr(user_mods.Traced, "__init__", lambda self, *a, **kw: inits.append(1) or real(self, *a, **kw))
    for _ in range(3):
        limit = np.array([7])  # an equal array made again: the same trace
        check(flashgen.attention(q, k, v, mask_mod=below), 1.0, torch.arange(24)[None, :] < 7)
    assert inits == []


def test_a_repeated_call_neither_lowers_nor_checks_its_functions_again(tiles, monkeypatch):
    """A call repeated with the same sizes and a closure made again over the same objects
    (as a model's forward makes its functions) names no lowering again (hashing the
    lowered code; it was done twice per forward+backward call) and runs no input checks
    again (host time the built-in masks never spent); its outputs equal the first's."""
    from flashgen import api

    doc = torch.tensor([0] * 20 + [1] * 25)

    def make():
        def mask_mod(b, h, q_idx, kv_idx):
            return (doc[q_idx] == doc[kv_idx]) & (q_idx - kv_idx <= 20)
        return mask_mod
    q, k, v = _qkv(sq=45, sk=45)
    do = torch.randn(q.shape[:3] + (v.shape[3],), generator=torch.Generator().manual_seed(3)).to(F16)

    def call():
        qkv = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        o = flashgen.attention(*qkv, causal=True, mask_mod=make(), sinks=torch.zeros(4))
        o.backward(do)
        return [o.detach()] + [t.grad for t in qkv]
    first = call()
    described, checked = [], []
    describe, check = user_render.Lowered.describe, api._check
    monkeypatch.setattr(user_render.Lowered, "describe", lambda self: described.append(self) or describe(self))
    monkeypatch.setattr(api, "_check", lambda *a, **kw: checked.append(a) or check(*a, **kw))
    second = call()
    assert described == [] and checked == []
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_the_memoized_checks_of_user_calls_keep_every_check(tiles):
    q, k, v = _qkv(sq=20, sk=20)

    def mm(b, h, q_idx, kv_idx):
        return q_idx - kv_idx <= 4
    flashgen.attention(q, k, v, mask_mod=mm)  # memoizes this call's checks
    with pytest.raises(InputError, match="softmax_scale"):
        flashgen.attention(q, k, v, mask_mod=mm, softmax_scale="0.1")
    with pytest.raises(InputError, match=r"k\.dtype"):
        flashgen.attention(q, k.float(), v, mask_mod=mm)
    with pytest.raises(InputError, match="window must be a pair"):
        flashgen.attention(q, k, v, mask_mod=mm, window=3)
    with pytest.raises(InputError, match="num_heads"):
        flashgen.attention(q[:, :3], k, v, mask_mod=mm)
    # an int scale and a list window take the checked path and give the same output
    assert torch.equal(flashgen.attention(q, k, v, mask_mod=mm, softmax_scale=1),
                       flashgen.attention(q, k, v, mask_mod=mm, softmax_scale=1.0))
    assert torch.equal(flashgen.attention(q, k, v, mask_mod=mm, window=[3, 0]),
                       flashgen.attention(q, k, v, mask_mod=mm, window=(3, 0)))


def test_a_lowering_is_made_once_per_functions_direction_and_gradient_flags():
    table = torch.zeros(8, 2)
    st = user_mods.trace(lambda s, b, h, q_idx, kv_idx: s + table[q_idx % 8, h], "score")
    mt = user_mods.trace(lambda b, h, q_idx, kv_idx: kv_idx <= q_idx, "mask")
    fwd = user_mods.lowering("fwd", st, mt, [True], True)
    assert user_mods.lowering("fwd", st, mt, [False], True) is fwd  # the forward takes no gradients
    assert user_mods.lowering("fwd", st, mt, [True], False) is not fwd  # sinks are compiled in
    bwd = user_mods.lowering("bwd", st, mt, [True], False)
    assert user_mods.lowering("bwd", st, mt, [True], True) is bwd  # the backward has no sinks
    other = user_mods.lowering("bwd", st, mt, [False], False)
    assert other is not bwd and other.name != bwd.name and not other.grads
    assert user_render.registered(bwd.name) is bwd and user_render.registered(fwd.name) is fwd

# -- shared memory of user variants --------------------------------------------------------

def _sm90_rows(script: str) -> list:
    """The JSON lines a script printed that compiles user variants for sm_90 with Triton's
    bundled ptxas in a child process (no TRITON_INTERPRET; ``BENCHMARKS`` is set for it
    to import benchmarks/sm90_compile.py).  Skips where that ptxas is missing."""
    import json
    import os

    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("triton's bundled ptxas is missing")
    bench_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", f"BENCHMARKS = {bench_dir!r}\n" + script], capture_output=True,
                       text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("[")]


_SM90_USER = '''
import json, sys
sys.path.insert(0, BENCHMARKS)
import torch
from sm90_compile import compile_sm90
from flashgen import resources, user_examples, user_mods, user_render
from flashgen.arch import by_sm
from flashgen.spec import KernelSpec, TileConfig, Variant
qb = torch.zeros(2048, requires_grad=True)
fns = {"relpos": user_examples.make("relpos", 16, 2048).functions(*[torch.zeros(32, 16, requires_grad=True)]),
       "document": user_examples.make("document", 16, 2048).functions(),
       "kbias": (lambda s, b, h, q, kv: s + qb[kv], None),
       "relpos-wide": user_examples.make("relpos", 16, 2048).functions(*[torch.zeros(128, 16, requires_grad=True)])}
for name, kernel, cfg in CASES:
    sm, mm = fns[name]
    st = user_mods.trace(sm, "score") if sm else None
    mt = user_mods.trace(mm, "mask") if mm else None
    low = user_mods._lowered("fwd" if kernel == "fwd" else "bwd", st, mt, [True] * len(st.bufs if st else ()), False)
    user_render.register(low)
    v = Variant(KernelSpec(kernel, "bfloat16", 128, 128, "causal", low.name), TileConfig(*cfg))
    est = resources.estimate(v, by_sm("sm_90"))
    print(json.dumps([name, kernel, cfg, compile_sm90(v).metadata.shared, est.total_bytes, est.feasible]))
'''


def test_the_shared_memory_model_of_user_variants_bounds_what_sm90_compiles():
    """Triton compiles user variants for sm_90 (its bundled ptxas, no GPU): the model's
    estimate is never below metadata.shared, and equals it on TMA configs.  The
    relative-position table's bwd_dq at the plain d128 causal key's tuned config
    (m128 n64 w8 s3 tma) needs 230400 bytes with its gradient summed per bucket in the
    tile (flashgen.user_grads), and 295936 with one atomic per score element (the same
    function on a 128-row table, over MAX_EXTENT: the atomics' int64 pointer tile goes
    through a layout-conversion scratch), which the model says and refuses on the H200
    (232448)."""
    cases = [("relpos", "bwd_dq", (128, 64, 8, 3, 1)), ("relpos", "fwd", (128, 64, 8, 3, 1)),
             ("relpos", "bwd_dkdv", (64, 128, 8, 3, 1)), ("document", "bwd_dkdv", (64, 128, 8, 3, 1)),
             ("kbias", "bwd_dq", (128, 64, 8, 3, 1)), ("relpos-wide", "bwd_dq", (128, 64, 8, 3, 1))]
    rows = _sm90_rows(f"CASES = {cases!r}\n" + _SM90_USER)
    assert len(rows) == len(cases), rows
    for name, kernel, cfg, compiled, model, feasible in rows:
        assert model == compiled, (name, kernel, cfg, compiled, model)  # TMA configs: exact
    assert rows[0][3] == 230400 and rows[0][5]
    assert rows[-1][3] == 295936 and not rows[-1][5]


_SM90_SCORE_INDEX = '''
import json, sys
sys.path.insert(0, BENCHMARKS)
import torch
from sm90_compile import compile_sm90
from flashgen import heuristics, user_mods, user_render
from flashgen.arch import by_sm
from flashgen.spec import KernelSpec, TileConfig, Variant
t = torch.zeros(8, 16, requires_grad=True)
st = user_mods.trace(lambda s, b, h, q, kv: s + t[(s.abs() * 2).long() % 8, h], "score")
for kernel in ("fwd", "bwd_dq", "bwd_dkdv"):
    low = user_mods._lowered("fwd" if kernel == "fwd" else "bwd", st, None, [True], False)
    user_render.register(low)
    spec = KernelSpec(kernel, "bfloat16", 128, 128, "causal", low.name)
    for cfg in (heuristics.default_config(spec, by_sm("sm_90")), TileConfig(64, 64, 4, 2, tma=1)):
        try:
            compile_sm90(Variant(spec, cfg))
            ok = True
        except Exception:
            ok = False
        print(json.dumps([kernel, cfg.id, cfg.num_stages, ok]))
'''


def test_a_score_dependent_index_compiles_with_one_stage_which_the_rules_require(tmp_path):
    """Triton's pipeliner cannot predicate the dot around a load at an index computed
    from the score: such variants compile for sm_90 with num_stages 1 only.  The rules
    refuse the others (space.RULES "score_index_stages"), so the heuristic default, the
    tuner's space and a dispatcher serving another key's tiles keep to one stage."""
    from flashgen import space
    from flashgen.arch import by_sm
    from flashgen.db import TuningDB
    from flashgen.dispatch import Dispatcher
    from flashgen.env import Environment
    from flashgen.spec import Measurement, Shape

    t = torch.zeros(8, 2, requires_grad=True)
    st = user_mods.trace(lambda s, b, h, q, kv: s + t[(s.abs() * 2).long() % 8, h], "score")
    low = user_mods._lowered("fwd", st, None, [True], False)
    user_render.register(low)
    assert low.sized_bufs
    spec = KernelSpec("fwd", "bfloat16", 128, 128, "causal", low.name)
    assert any("score_index_stages" in r for r in space.violated_rules(Variant(spec, TileConfig(64, 64, 4, 2))))
    assert not space.violated_rules(Variant(spec, TileConfig(64, 64, 4, 1)))
    assert all(c.num_stages == 1 for c in space.valid_configs(spec))
    assert heuristics.default_config(spec, by_sm("sm_90")).num_stages == 1
    # a function without a score-dependent index keeps every stage count
    plain_low = user_mods._lowered("fwd", user_mods.trace(lambda s, b, h, q, kv: s + t[0, h], "score"), None,
                                   [True], False)
    user_render.register(plain_low)
    assert not space.violated_rules(Variant(KernelSpec("fwd", "bfloat16", 128, 128, "causal", plain_low.name),
                                            TileConfig(64, 64, 4, 3)))
    # the plain problem's tuned tiles serve an untuned user function only where they keep the rule
    env, sm90 = Environment("NVIDIA H200", "9.0", 132, "3.6.0", "2.11.0", "0.1.0"), by_sm("sm_90")
    shape = Shape(2, 4, 4, 512, 512)
    plain = KernelSpec("fwd", "bfloat16", 128, 128, "causal")
    key = shape.key(spec)
    with TuningDB(tmp_path / "rows.sqlite") as db:
        db.record(shape.key(plain), shape, Variant(plain, TileConfig(64, 64, 4, 3)), Measurement("ok", median_ms=1.0),
                  env, 0)
    d = Dispatcher([tmp_path / "rows.sqlite"], env=env, arch=sm90)
    c = d.choose(key, capturing=False)
    assert c.config.num_stages == 1 and c.source == "default", c
    with TuningDB(tmp_path / "one_stage.sqlite") as db:
        db.record(shape.key(plain), shape, Variant(plain, TileConfig(64, 64, 4, 1)), Measurement("ok", median_ms=1.5),
                  env, 0)
    c = Dispatcher([tmp_path / "one_stage.sqlite"], env=env, arch=sm90).choose(key, capturing=False)
    assert (c.config, c.source) == (TileConfig(64, 64, 4, 1), "nearest"), c
    rows = _sm90_rows(_SM90_SCORE_INDEX)
    assert [(k, st, ok) for k, _, st, ok in rows] == [(k, st, st == 1) for k in ("fwd", "bwd_dq", "bwd_dkdv")
                                                       for st in (1, 2)], rows


def _relpos_bwd_key(h=16, s=2048):
    """The bwd_dq key of the relative-position example (its table with a gradient),
    its lowering registered."""
    from flashgen import user_examples
    from flashgen.spec import ProblemKey

    ex = user_examples.make("relpos", h, s)
    st = user_mods.trace(ex.functions(*ex.tensors)[0], "score")
    low = user_mods._lowered("bwd", st, None, [True], False)
    user_render.register(low)
    return ProblemKey.from_sizes(KernelSpec("bwd_dq", "bfloat16", 128, 128, "none", low.name), batch=8,
                                 num_heads=h, num_kv_heads=h, seqlen_q=s, seqlen_k=s)


def test_the_dispatcher_gives_a_user_variant_no_config_that_overflows_shared_memory(monkeypatch):
    """The H200 rows of the plain key (bwd_dq m128 n64 w8 s3 tma: 164864 bytes plain,
    230400 with the table's gather and its gradient summed per bucket in the tile,
    295936 with one atomic per score element) are borrowed for the user variant only
    where its config fits by the model."""
    import dataclasses

    from flashgen import arch, dispatch
    from flashgen.env import Environment

    key = _relpos_bwd_key()
    plain = dataclasses.replace(key, spec=dataclasses.replace(key.spec, mods=""))
    env = dataclasses.replace(Environment.current(), gpu_name="NVIDIA H200", compute_capability="9.0", sm_count=132)
    d = dispatch.Dispatcher(None, env=env, arch=arch.by_sm("sm_90"))
    borrowed = d.choose(plain).config
    assert (borrowed.BLOCK_M, borrowed.BLOCK_N, borrowed.num_stages) == (128, 64, 3)  # the plain row
    reduced = d.choose(key)
    assert reduced.config == borrowed and reduced.smem_bytes == 230400
    assert "user_grad_cvt" not in reduced.smem_breakdown
    monkeypatch.setattr(user_grads, "MAX_EXTENT", 0)  # the per-element atomics
    key = _relpos_bwd_key()
    choice = d.choose(key)
    assert choice.config != borrowed and choice.smem_bytes <= arch.by_sm("sm_90").smem_per_block_optin
    assert "user_grad_cvt" in choice.smem_breakdown and "user_gather_tiles" in choice.smem_breakdown


def test_a_user_variant_out_of_resources_at_launch_falls_back_once_with_a_warning(tiles, monkeypatch):
    """A config the model let through but Triton refuses (OutOfResources at its first
    launch) is marked failed with one warning, and the dispatcher's next choice runs:
    the results still pass the float64 check."""
    from triton.runtime.errors import OutOfResources

    from flashgen import dispatch, families

    refused = TileConfig(32, 16, 4, 1)  # the default (the tiles fixture) is m16 n16
    real = families.launcher
    seen = []

    def launcher(family, name):
        fn = real(family, name)
        if name != "bwd_dq":
            return fn

        def wrapped(*a, config, mods=None, **kw):
            seen.append(config)
            if config == refused and mods is not None:
                raise OutOfResources(295936, 232448, "shared memory")
            return fn(*a, config=config, mods=mods, **kw)
        return wrapped
    monkeypatch.setattr(families, "launcher", launcher)
    monkeypatch.setattr(dispatch.Dispatcher, "_lookup", lambda self, key: (
        dispatch.Choice(key, refused, "tuned") if key.spec.kernel == "bwd_dq" and is_user_mods(key.spec.mods)
        and not dispatch.has_failed(Variant(key.spec, refused)) else None))
    monkeypatch.setattr(dispatch, "_failed", {})
    table = torch.randn(16, 4, generator=torch.Generator().manual_seed(3))
    with pytest.warns(UserWarning, match="OutOfResources.*next choice") as w:
        _run(t5_bias, [table], causal=True)
    assert sum("OutOfResources" in str(x.message) for x in w) == 1
    assert seen[0] == refused and seen[-1] != refused


def test_an_untuned_user_forward_takes_the_plain_keys_fastest_triton_row():
    """The plain d128 causal forward's fastest H200 row is the Gluon family's, which does
    not compile user functions: an untuned user forward takes the fastest row of the
    Triton family (m64 n64 w4 s3 tma, 0.319 ms), not the heuristic default."""
    import dataclasses

    from flashgen import arch, dispatch
    from flashgen.env import Environment
    from flashgen.spec import ProblemKey

    # a soft cap of 20 (the shipped database tunes the example's 30, whose key is tuned)
    low = user_mods.lowering("fwd", user_mods.trace(lambda score, b, h, q_idx, kv_idx: 20 * torch.tanh(score / 20),
                                                    "score"), None, [], False)
    key = ProblemKey.from_sizes(KernelSpec("fwd", "bfloat16", 128, 128, "causal", low.name), batch=8, num_heads=16,
                                num_kv_heads=16, seqlen_q=2048, seqlen_k=2048)
    env = dataclasses.replace(Environment.current(), gpu_name="NVIDIA H200", compute_capability="9.0", sm_count=132)
    d = dispatch.Dispatcher(None, env=env, arch=arch.by_sm("sm_90"))
    plain = d.choose(dataclasses.replace(key, spec=dataclasses.replace(key.spec, mods="")))
    assert plain.family == "gluon"
    choice = d.choose(key)
    assert choice.source == "nearest" and choice.family == "triton" and choice.tuned_key == plain.key.id
    c = choice.config
    assert (c.BLOCK_M, c.BLOCK_N, c.num_warps, c.num_stages, c.tma) == (64, 64, 4, 3, 1)


def test_the_relpos_example_sums_its_table_gradient_per_bucket_in_the_tile():
    """The relative-position example's backward reduces its (32, heads) table's gradient
    in the dQ tile: one atomic per bucket present, none per score element; its forward
    and the dK/dV kernel's code are the per-element lowering's."""
    from flashgen import render, user_examples

    ex = user_examples.make("relpos", 16, 2048)
    st = user_mods.trace(ex.functions(*ex.tensors)[0], "score")
    low = user_mods._lowered("bwd", st, None, [True], False)
    assert isinstance(low, user_grads.Reduced) and [(r.dim, r.extent) for r in low.reductions] == [(0, 32)]
    assert type(user_mods._lowered("fwd", st, None, [True], False)) is user_render.Lowered
    user_render.register(low)
    dq = render.render(Variant(KernelSpec("bwd_dq", "bfloat16", 128, 128, "none", low.name),
                               TileConfig(128, 64, 8, 3, 1)))
    assert "tl.static_range(32)" in dq and dq.count("tl.atomic_add(") == 1 and "broadcast_to(u_off" not in dq
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(user_grads, "MAX_EXTENT", 0)
        elem = user_mods._lowered("bwd", st, None, [True], False)
    assert type(elem) is user_render.Lowered and elem.name != low.name
    user_render.register(elem)
    kv = [render.render(Variant(KernelSpec("bwd_dkdv", "bfloat16", 128, 128, "none", x.name),
                                TileConfig(64, 128, 8, 3, 1))) for x in (low, elem)]
    assert kv[0].replace(low.name, elem.name) == kv[1]


def _ops(traced):
    g = traced.graph
    return [g.nodes[i] for i in g.uses([traced.out])]


def test_division_by_a_constant_becomes_a_multiplication_where_the_quotient_stays_continuous():
    """softcap written as 30 * tanh(s / 30): the division becomes s * (1/30) (as the
    built-in softcap scales), and with no division, log or exp left the score needs no
    clamp (the built-in's code); T5's bucket keeps its division by log(16), whose
    quotient is cast to an integer, and loses the exact one by 8."""
    from flashgen.user_examples import t5_bucket

    soft = user_mods.trace(lambda score, b, h, q_idx, kv_idx: 30.0 * torch.tanh(score / 30.0), "score")
    ops = _ops(soft)
    assert not any(n.op == "truediv" for n in ops)
    assert any(n.op == "mul" and n.args[1] == 1.0 / 30.0 for n in ops)
    assert not soft.guard
    table = torch.randn(32, 4)
    rel = user_mods.trace(lambda score, b, h, q_idx, kv_idx: score + table[t5_bucket(kv_idx - q_idx), h], "score")
    divs = [n for n in _ops(rel) if n.op == "truediv"]
    assert len(divs) == 1 and divs[0].args[1] == pytest.approx(math.log(16)), divs
    assert any(n.op == "mul" and n.args[1] == 0.125 for n in _ops(rel))


def test_division_by_a_constant_in_a_mask_is_kept_unless_exact():
    """A mask's result is a bool: a quotient compared there keeps its division unless the
    constant is a power of two (exact either way)."""
    by3 = user_mods.trace(lambda b, h, q_idx, kv_idx: kv_idx / 3 <= q_idx / 3.0, "mask")
    assert sum(n.op == "truediv" for n in _ops(by3)) == 2
    by4 = user_mods.trace(lambda b, h, q_idx, kv_idx: kv_idx / 4 <= q_idx, "mask")
    assert not any(n.op == "truediv" for n in _ops(by4))
    assert any(n.op == "mul" and n.args[1] == 0.25 for n in _ops(by4))


def test_reciprocal_divisions_keeps_quotients_that_reach_floor_or_an_index():
    from flashgen.user_mods import reciprocal_divisions
    from flashgen.user_render import Graph

    g = Graph()
    s = g.input("s", "float")
    q = g.input("q", "int")
    qf = g.cast(q, "float32")
    cont = g.binary("truediv", s, 7.0)
    floored = g.unary("floor", g.binary("truediv", qf, 7.0))
    cond = g.binary("lt", g.binary("truediv", qf, 5.0), 2.0)
    out = g.binary("add", cont, g.where(cond, floored, 0.0))
    assert reciprocal_divisions(g, out) == 1
    need = [g.nodes[i] for i in g.uses([out])]
    assert sorted(n.args[1] for n in need if n.op == "truediv") == [5.0, 7.0]
    assert [n.args[1] for n in need if n.op == "mul"] == [1.0 / 7.0]


@pytest.mark.parametrize("divisor", [30.0, 7.0, 0.3])
def test_score_divided_by_a_constant_matches_float64(divisor):
    """The multiplication by the reciprocal stays within the exactness rule (forward and
    backward through the interpreter, against the float64 reference)."""
    q, k, v = (torch.randn(1, 2, 37, 16, dtype=torch.float32) for _ in range(3))
    do = torch.randn(1, 2, 37, 16)

    def mod(score, b, h, q_idx, kv_idx):
        return divisor * torch.tanh(score / divisor) + kv_idx / divisor

    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    o = flashgen.attention(qg, kg, vg, causal=True, score_mod=mod)
    got = [o.detach(), *torch.autograd.grad(o, (qg, kg, vg), do)]
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    _, lo, hi = mask_bounds(37, 37, causal=True, window=(-1, -1))
    ref = user_mods.reference(qd, kd, vd, 16 ** -0.5, lo, hi, score_mod=mod)[0]
    want = [ref.detach(), *torch.autograd.grad(ref, (qd, kd, vd), do.double())]
    for a, b in zip(got, want):
        assert (a.double() - b).abs().max().item() < 2e-4


# -- the machinery id ------------------------------------------------------------------------

def test_the_user_machinery_record_is_current():
    """templates/user_machinery_id.json names the machinery as it is: run ``python3 -m
    flashgen.user_machinery`` after an edit of user_render.py, the overlay or a dense
    template when this fails (the id stays where the user examples' code is unchanged)."""
    from flashgen import user_machinery

    rec = user_render.read_machinery_record()
    assert rec["text"] == user_render.machinery_text_hash()
    assert rec["probes"] == user_machinery.probe_digest()
    assert user_render.machinery_hash() == rec["code"]


def test_the_machinery_id_stays_while_the_probes_render_alike(tmp_path, monkeypatch):
    """An edit whose probe sources are the recorded ones keeps the id (so every user
    variant's name and rows); one that changes them gives the new text hash; a record
    left stale gives the text hash (an unrecorded edit renames every user variant, as
    before the record)."""
    from flashgen import user_machinery

    digest = user_machinery.probe_digest()
    monkeypatch.setattr(user_machinery, "probe_digest", lambda: digest)
    path = tmp_path / "rec.json"
    path.write_text(json.dumps({"text": "0" * 16, "probes": digest, "code": "c0de" * 4}))
    assert user_machinery.write_record(path) == {"text": user_render.machinery_text_hash(), "probes": digest,
                                                 "code": "c0de" * 4}
    path.write_text(json.dumps({"text": "0" * 16, "probes": "1" * 16, "code": "c0de" * 4}))
    assert user_machinery.write_record(path)["code"] == user_render.machinery_text_hash()
    monkeypatch.setattr(user_render, "read_machinery_record", lambda: {"text": "0" * 16, "code": "c0de" * 4})
    user_render.machinery_hash.cache_clear()
    try:
        assert user_render.machinery_hash() == user_render.machinery_text_hash()
    finally:
        monkeypatch.undo()
        user_render.machinery_hash.cache_clear()
    assert user_render.machinery_hash() == user_render.read_machinery_record()["code"]


def test_the_probe_sources_are_the_user_examples_code():
    """The probe sources are rendered kernels, most with an example's captured tensor
    read in them, and the fixed probe names are not left registered."""
    from flashgen import user_machinery

    srcs = list(user_machinery.probe_sources())
    assert len(srcs) > 1000 and all(s.lstrip().startswith(("#", "import", '"""')) for s in srcs[:50])
    assert sum("UT0" in s for s in srcs) > len(srcs) // 2
    assert user_render.registered("u000000000000") is None  # the fixed probe names are not left registered


def test_the_user_examples_names_are_the_shipped_rows_names():
    """Every user example's forward and backward variant name at 16 heads and seqlen 2048
    (the user-examples preset's size) names rows of the shipped H200 database: an edit
    that renames them (of user_render.py or the overlay without a kept machinery id, or
    of user_grads.py, whose bytes a reduced gradient's name hashes) would leave those
    rows unused."""
    import sqlite3

    from flashgen.dispatch import shipped_databases

    db = next(p for p in shipped_databases() if p.name == "h200.sqlite")
    shipped = {m for (m,) in sqlite3.connect(f"file:{db}?immutable=1", uri=True).execute(
        "SELECT DISTINCT mods FROM measurements WHERE mods LIKE 'u%'")}
    names = set()
    for name in user_examples.NAMES:
        ex = user_examples.make(name, 16, 2048)
        sm, mm = ex.functions(*ex.tensors)
        q = torch.empty(1, 16, 2048, 64, dtype=torch.bfloat16)
        names |= {n for n in user_mods.variant_names(q, q, score_mod=sm, mask_mod=mm, sinks=ex.sinks) if n}
    assert len(names) == 13 and names <= shipped, sorted(names - shipped)


def test_a_write_that_bypasses_the_version_counter_is_seen_after_an_in_place_op():
    """The block mask is cached per captured tensors' versions (README): a NumPy write
    into a captured tensor's memory leaves it stale, as documented, and any in-place
    torch op on the tensor (the README's ``t.add_(0)``) makes the next call see it."""
    import numpy as np

    torch.manual_seed(0)
    n = 150
    q, k, v = (torch.randn(1, 1, n, 16) for _ in range(3))
    ids = np.zeros(n, dtype=np.int64)
    doc = torch.from_numpy(ids)

    def mask(b, h, i, j):
        return doc[i] == doc[j]

    flashgen.attention(q, k, v, mask_mod=mask)
    ids[:] = np.arange(n) // 8
    s = ((q @ k.transpose(-1, -2)).double() / 4).masked_fill(doc[:, None] != doc[None, :], float("-inf"))
    ref = (torch.softmax(s, -1) @ v.double()).float()
    doc.add_(0)
    assert (flashgen.attention(q, k, v, mask_mod=mask) - ref).abs().max() < 1e-4

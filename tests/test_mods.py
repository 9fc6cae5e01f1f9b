"""Score modifications (softcap, ALiBi, bias, dropout): exact against the float64
reference with the same mods, forward and backward, through the Triton interpreter;
dropout's mask (tile-independent, reproducible, advancing, exposed); the bias's
broadcasting and boolean masks; errors that name the argument; ids, keys, DB rows and
the dispatcher's fallback; the ops under opcheck and torch.compile."""

import pytest
import torch

import flashgen
from flashgen import InputError, arch, bench, dropout, library, ops, reference, resources
from flashgen.masks import mask_bounds
from flashgen.spec import KernelSpec, ProblemKey, Shape, TileConfig, Variant, all_mods, mods_name

SM90 = arch.by_sm("sm_90")
pytestmark = pytest.mark.usefixtures("hermetic_dispatcher")
F16, F32 = torch.float16, torch.float32


def _qkv(b=1, h=4, hk=2, sq=19, sk=27, d=16, dv=16, dtype=F16, seed=0, grad=True):
    g = torch.Generator().manual_seed(seed)
    ts = [torch.randn(b, h, sq, d, generator=g, dtype=dtype), torch.randn(b, hk, sk, d, generator=g, dtype=dtype),
          torch.randn(b, hk, sk, dv, generator=g, dtype=dtype)]
    return [t.requires_grad_(grad) for t in ts]


def _mods_kw(mods, q, k, seed=0):
    b, h, sq, _ = q.shape
    sk = k.shape[2]
    g = torch.Generator().manual_seed(seed + 9)
    kw = {}
    if "softcap" in mods:
        kw["softcap"] = 1.5  # small: most scores are in tanh's curved part
    if "alibi" in mods:
        kw["alibi_slopes"] = torch.rand(b, h, generator=g) * 0.5
    if "bias" in mods:
        kw["bias"] = torch.randn(1, h, sq, sk, generator=g, dtype=q.dtype)
    if "dropout" in mods:
        kw["dropout_p"] = 0.25
        kw["rng_state"] = torch.tensor([1234 + seed, 99], dtype=torch.int64)
    return kw


def _ref_kw(kw, shape, rng_before):
    out = dict(softcap=kw.get("softcap", 0.0), alibi=kw.get("alibi_slopes"), bias=kw.get("bias"))
    if "dropout_p" in kw:
        out.update(keep=flashgen.dropout_mask(rng_before, *shape, kw["dropout_p"]), dropout_p=kw["dropout_p"])
    return out


def _check(mods, causal=False, window=(-1, -1), dtype=F16, **sizes):
    q, k, v = _qkv(dtype=dtype, **sizes)
    kw = _mods_kw(mods, q, k)
    rng_before = kw["rng_state"].clone() if "rng_state" in kw else None
    o, lse = flashgen.attention(q, k, v, causal=causal, window=window, return_lse=True, **kw)
    do = torch.randn_like(o)
    o.backward(do)
    shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    outs = {"O": o.detach(), "LSE": lse, "dQ": q.grad, "dK": k.grad, "dV": v.grad}
    res = bench.compare(outs, q.detach(), k.detach(), v.detach(), do,
                        mask=dict(causal=causal, window=window, align="bottom_right"),
                        softmax_scale=q.shape[-1] ** -0.5, mods=_ref_kw(kw, shape, rng_before))
    assert all(r <= 1.0 for _, _, r in res.values()), (mods, res)
    return o, res


@pytest.mark.parametrize("mods", ["softcap", "alibi", "bias", "dropout", "softcap_alibi_bias_dropout"])
@pytest.mark.parametrize("mask", [dict(causal=False), dict(causal=True), dict(causal=False, window=(5, 3))])
def test_exact_against_the_float64_reference(mods, mask):
    _check(mods, **mask)


def test_exact_with_head_dim_padding_mqa_and_seqlen_q_longer():
    _check("softcap_alibi_bias", causal=True, h=4, hk=1, sq=33, sk=17, d=24, dv=40)


def test_float32_inputs():
    _check("alibi_bias", dtype=F32, causal=True)


def test_mods_actually_change_the_result():
    q, k, v = _qkv(grad=False)
    plain = flashgen.attention(q, k, v)
    for mods in ("softcap", "alibi", "bias", "dropout"):
        kw = _mods_kw(mods, q, k)
        assert (flashgen.attention(q, k, v, **kw) - plain).abs().max() > 1e-2, mods


# -- dropout ----------------------------------------------------------------------------

def test_dropout_mask_keep_rate_and_reproducibility():
    st = torch.tensor([7, 0], dtype=torch.int64)
    m = flashgen.dropout_mask(st, 2, 3, 64, 96, 0.3)
    assert m.shape == (2, 3, 64, 96) and m.dtype == torch.bool
    assert abs(m.float().mean().item() - 0.7) < 0.01  # 36864 draws: std 0.0024
    assert torch.equal(m, flashgen.dropout_mask(st, 2, 3, 64, 96, 0.3))
    assert not torch.equal(m, flashgen.dropout_mask(torch.tensor([8, 0]), 2, 3, 64, 96, 0.3))
    # counters are indexed by element (4 columns a counter): shifting the offset by one
    # head plane's counters shifts the mask by one plane
    shifted = flashgen.dropout_mask(torch.tensor([7, dropout.counters(1, 1, 64, 96)]), 1, 1, 64, 96, 0.3)
    assert torch.equal(shifted[0, 0], m[0, 1])
    assert flashgen.dropout_mask(st, 1, 1, 8, 8, 0.0).all()


def test_dropout_mask_does_not_depend_on_the_tile_config():
    """Two configs with different BLOCK_M/BLOCK_N/warps draw the same mask: each
    matches the reference built from dropout_mask."""
    q, k, v = _qkv(grad=False, sq=37, sk=45)
    rng = torch.tensor([5, 3], dtype=torch.int64)
    m = ops.ScoreMods(dropout_p=0.4, rng=rng)
    _, lo, hi = mask_bounds(37, 45, causal=True, window=(-1, -1))
    ref, _, _ = reference.forward_bounds(q, k, v, 0.25, lo, hi, keep=flashgen.dropout_mask(rng, 1, 4, 37, 45, 0.4),
                                         dropout_p=0.4)
    outs = []
    for cfg in (TileConfig(16, 16, 1, 1), TileConfig(32, 64, 4, 2)):
        o, _ = ops.fwd(q, k, v, softmax_scale=0.25, mask="causal", diag_lo=lo, diag_hi=hi, config=cfg, mods=m)
        assert (o.double() - ref).abs().max() < 5e-3
        outs.append(o)
    assert (outs[0] - outs[1]).abs().max() < 5e-3


def test_dropout_state_advances_and_reseeding_reproduces():
    q, k, v = _qkv(grad=False, b=2)
    st = torch.tensor([11, 0], dtype=torch.int64)
    a = flashgen.attention(q, k, v, dropout_p=0.2, rng_state=st)
    assert st.tolist() == [11, dropout.counters(2, 4, 19, 27)]
    b = flashgen.attention(q, k, v, dropout_p=0.2, rng_state=st)
    assert not torch.equal(a, b)
    st.copy_(torch.tensor([11, 0]))
    assert torch.equal(flashgen.attention(q, k, v, dropout_p=0.2, rng_state=st), a)
    # the device's default state, reset by manual_seed
    flashgen.manual_seed(3)
    c = flashgen.attention(q, k, v, dropout_p=0.2)
    flashgen.manual_seed(3)
    assert torch.equal(flashgen.attention(q, k, v, dropout_p=0.2), c)
    assert dropout.default_state(q.device).tolist() == [3, dropout.counters(2, 4, 19, 27)]


def test_dropout_backward_uses_the_forward_mask_even_after_the_state_moved():
    q, k, v = _qkv()
    st = torch.tensor([21, 5], dtype=torch.int64)
    o = flashgen.attention(q, k, v, dropout_p=0.3, rng_state=st)
    flashgen.attention(q.detach(), k.detach(), v.detach(), dropout_p=0.3, rng_state=st)  # moves the state
    do = torch.randn_like(o)
    o.backward(do)
    keep = flashgen.dropout_mask(torch.tensor([21, 5]), 1, 4, 19, 27, 0.3)
    g = reference.backward(do, q.detach(), k.detach(), v.detach(), keep=keep, dropout_p=0.3)
    for got, want in zip((q.grad, k.grad, v.grad), g):
        assert (got.double() - want).abs().max() < 2e-2


# -- bias --------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(19, 27), (1, 1, 19, 27), (1, 4, 1, 27), (1, 1, 19, 1)])
def test_bias_broadcasts(shape):
    q, k, v = _qkv(grad=False)
    bias = torch.randn(*shape, dtype=F16)
    o = flashgen.attention(q, k, v, bias=bias)
    ref, _, _ = reference.forward_bounds(q, k, v, 0.25, -19, 27, bias=bias.expand(1, 4, 19, 27))
    assert (o.double() - ref).abs().max() < 5e-3


def test_boolean_bias_is_a_mask_and_fully_masked_rows_are_zero():
    q, k, v = _qkv()
    allowed = torch.rand(19, 27) > 0.5
    allowed[3] = False  # row 3 sees nothing
    o, lse = flashgen.attention(q, k, v, bias=allowed, return_lse=True)
    o.sum().backward()
    add = torch.zeros(19, 27, dtype=F16).masked_fill(~allowed, float("-inf"))
    ref, rlse, _ = reference.forward_bounds(q.detach(), k.detach(), v.detach(), 0.25, -19, 27,
                                            bias=add.expand(1, 4, 19, 27))
    assert (o.detach().double() - ref).abs().max() < 5e-3
    assert torch.all(o[:, :, 3] == 0) and torch.all(lse[:, :, 3] == float("-inf"))
    for t in (o, lse, q.grad, k.grad, v.grad):
        assert not torch.isnan(t).any()
    assert torch.all(q.grad[:, :, 3] == 0)


# -- errors ------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, match", [
    (dict(softcap=-1.0), "softcap must be"),
    (dict(softcap=float("inf")), "softcap must be"),
    (dict(softcap=1e39), "softcap must be at most 1e"),  # finite, but float32's inf in the kernels: NaN output
    (dict(softcap=1e-39), "softcap must be 0 .off. or at least 1e-30"),  # 1 / softcap is float32's inf: NaN at s = 0
    (dict(dropout_p=1.0), "dropout_p must be"),
    (dict(dropout_p=True), "dropout_p must be"),
    (dict(alibi_slopes=torch.ones(4, dtype=torch.float64)), "alibi_slopes must be a float32"),
    (dict(alibi_slopes=torch.ones(3)), r"alibi_slopes must have shape \(4,\) or \(1, 4\)"),
    (dict(alibi_slopes=torch.ones(4, requires_grad=True)), "alibi_slopes must not require grad"),
    (dict(bias=torch.ones(19, 27)), "bias.dtype must be q.dtype"),
    (dict(bias=torch.ones(19, 26, dtype=F16)), "does not broadcast"),
    (dict(bias=torch.ones(1, 1, 1, 19, 27, dtype=F16)), "at most 4 dims"),
    (dict(bias=torch.ones(19, 27, dtype=F16, requires_grad=True)), "bias must not require grad"),
    (dict(dropout_p=0.1, rng_state=torch.tensor([1, 2], dtype=torch.int32)), "rng_state must be an int64"),
    (dict(dropout_p=0.1, rng_state=torch.tensor([1, 2, 3])), r"shape \(2,\)"),
])
def test_bad_mod_arguments_name_the_argument(kw, match):
    q, k, v = _qkv(grad=False)
    with pytest.raises(InputError, match=match):
        flashgen.attention(q, k, v, **kw)


def test_dropout_off_the_kernels_is_an_error():
    q, k, v = _qkv(grad=False, dtype=torch.bfloat16)  # bf16 on CPU: the reference path
    with pytest.raises(InputError, match="dropout_p > 0 runs in the Triton kernels only"):
        flashgen.attention(q, k, v, dropout_p=0.1)
    # the other mods have a reference path
    o = flashgen.attention(q, k, v, softcap=2.0, bias=torch.zeros(19, 27, dtype=torch.bfloat16))
    ref, _, _ = reference.forward_bounds(q, k, v, 0.25, -19, 27, softcap=2.0)
    assert (o.double() - ref).abs().max() < 2e-2


# -- identity, keys, dispatch ------------------------------------------------------------

def test_mods_names_ids_and_rows():
    assert all_mods()[0] == "" and len(all_mods()) == 16
    assert mods_name(dropout=True, softcap=True) == "softcap_dropout"
    s = KernelSpec("fwd", "bfloat16", 128, 128, "causal", "softcap_alibi")
    assert s.id == "attn_fwd_d128_bf16_causal_softcap_alibi"
    assert KernelSpec("fwd", "bfloat16", 128, 128, "causal").id == "attn_fwd_d128_bf16_causal"
    key = Shape(2, 16, 16, 1024, 1024).key(s)
    assert ProblemKey.from_row(key.as_row()) == key and key.as_row()["mods"] == "softcap_alibi"
    with pytest.raises(ValueError, match="mods must be"):
        KernelSpec("fwd", "bfloat16", 128, 128, "none", "alibi_softcap")
    with pytest.raises(ValueError, match="compiled into"):
        KernelSpec("fwd_varlen", "bfloat16", 128, 128, "none", "alibi")


def test_bias_tiles_count_in_the_shared_memory_model():
    cfg = TileConfig(128, 128, 8, 3, tma=1)
    plain = resources.estimate(Variant(KernelSpec("fwd", "bfloat16", 128, 128, "none"), cfg), SM90)
    biased = resources.estimate(Variant(KernelSpec("fwd", "bfloat16", 128, 128, "none", "bias"), cfg), SM90)
    assert biased.total_bytes - plain.total_bytes == 128 * 128 * 2 * 3
    assert not biased.feasible  # 3 stages of K, V and bias tiles exceed 227 KiB


def test_dispatcher_serves_an_untuned_mods_key_with_the_plain_keys_tuned_tiles(tmp_path):
    from flashgen.db import TuningDB
    from flashgen.dispatch import Dispatcher
    from flashgen.env import Environment
    from flashgen.spec import Measurement

    env = Environment("NVIDIA H200", "9.0", 132, "3.6.0", "2.11", "0.1.0")
    plain = KernelSpec("fwd", "bfloat16", 128, 128, "causal")
    shape = Shape(2, 16, 16, 2048, 2048)
    cfg = TileConfig(128, 64, 8, 2, tma=1)
    path = tmp_path / "t.sqlite"
    with TuningDB(path) as db:
        db.record(shape.key(plain), shape, Variant(plain, cfg), Measurement("ok", 1.0), env, 0)
    d = Dispatcher([path], env=env, arch=SM90)
    soft = shape.key(KernelSpec("fwd", "bfloat16", 128, 128, "causal", "softcap"))
    ch = d.choose(soft)
    assert (ch.source, ch.config, ch.tuned_key) == ("nearest", cfg, shape.key(plain).id)
    # a config the mods do not fit (bias tiles) is not reused
    big = TileConfig(128, 128, 8, 3, tma=1)
    with TuningDB(path) as db:
        db.record(shape.key(plain), shape, Variant(plain, big), Measurement("ok", 0.5), env, 0)
    d = Dispatcher([path], env=env, arch=SM90)
    biased = d.choose(shape.key(KernelSpec("fwd", "bfloat16", 128, 128, "causal", "bias")))
    assert biased.source == "default" and resources.estimate(Variant(biased.key.spec, biased.config),
                                                             SM90).feasible


def test_tuner_checks_mods_variants_against_the_reference():
    v = Variant(KernelSpec("bwd_dkdv", "float16", 16, 16, "window", "alibi_bias"), TileConfig(32, 64, 4, 1))
    d = bench.check_variant_detail(v, group=2, device="cpu")
    assert d["ok"] and set(d["ratios"]) == {"dK", "dV"}, d["message"]


# -- ops --------------------------------------------------------------------------------

def test_opcheck_and_compile():
    q, k, v = _qkv(dtype=F16)
    mask, lo, hi = mask_bounds(19, 27, causal=True, window=(-1, -1))
    bias = torch.randn(1, 4, 19, 27, dtype=F16).expand(1, 4, 19, 27)
    args = (q, k, v, 0.3, mask, lo, hi, 2.0, torch.rand(4), bias, 0.0, None)
    res = torch.library.opcheck(library.FWD_MODS, args)
    assert set(res.values()) == {"SUCCESS"}, res

    def f(q, k, v):
        return flashgen.attention(q, k, v, causal=True, softcap=2.0, bias=bias)

    want = f(q, k, v)
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    assert torch.allclose(got, want, atol=1e-3)


def test_mods_presets_tune_with_fake_timings_and_rows_carry_the_mods(tmp_path):
    import json
    import sqlite3

    from typer.testing import CliRunner

    from flashgen import presets, space
    from flashgen.cli import app

    grid = presets.expand(["mods-bench"])
    assert len(grid) == 4 * 2 * 3 * 3 and {k.spec.mods for k, _ in grid} == {"softcap", "alibi", "bias", "dropout"}
    items = presets.expand(["mods-small"])
    t = {Variant(k.spec, c).id: 1.0 + (i * 7919 % 97) / 10
         for k, _ in items for i, c in enumerate(space.configs(k.spec.kernel))}
    (tmp_path / "t.json").write_text(json.dumps(t))
    db = tmp_path / "m.sqlite"
    r = CliRunner().invoke(app, ["tune", "--preset", "mods-small", "--fake", str(tmp_path / "t.json"), "--db", str(db),
                                 "--trials", "3"])
    assert r.exit_code == 0, r.output
    rows = sqlite3.connect(db).execute("SELECT DISTINCT key, mods FROM measurements").fetchall()
    assert {m for _, m in rows} == {"softcap_alibi", "bias"}
    assert all(key.split("_d32_bf16_")[1].split("_g")[0].endswith(m) for key, m in rows)
    with pytest.raises(KeyError, match="mods_bench.py"):
        from flashgen import compare

        compare.cases_from_presets(["mods-bench"])


def test_mods_kernels_compile_for_sm90_with_wgmma():
    """Triton's real compiler (sm_90, no GPU): every mod at once, TMA and pointer loads,
    every kernel; the matrix instructions stay wgmma."""
    from sm90 import compile_for_sm90

    full = "softcap_alibi_bias_dropout"
    cases = [("fwd", "bfloat16", 128, 128, "causal", (128, 64, 8, 2, 1), full),
             ("bwd_dq", "bfloat16", 128, 128, "window", (64, 64, 4, 2, 1), full),
             ("bwd_dkdv", "bfloat16", 128, 128, "causal", (64, 128, 8, 2, 1), full),
             ("fwd", "float16", 64, 64, "none", (128, 64, 4, 3, 0), "bias"),
             ("bwd_dkdv", "bfloat16", 64, 64, "none", (64, 128, 4, 2, 0), "dropout")]
    out = compile_for_sm90(cases)
    for kernel, dtype, d, dv, mask, cfg, mods in cases:
        v = Variant(KernelSpec(kernel, dtype, d, dv, mask, mods), TileConfig(*cfg))
        shared, bulk, wgmma = out[v.id]
        assert wgmma and bulk == bool(cfg[4]), v.id
        assert shared <= resources.estimate(v, SM90).total_bytes, (v.id, shared)


def test_causal_with_a_bias_runs_the_window_kernel():
    from flashgen.spec import compiled_variant

    cfg = TileConfig(64, 64, 4, 2)
    for kernel in ("fwd", "bwd_dq", "bwd_dkdv"):
        for mods, mask in (("bias", "causal"), ("alibi_bias", "causal"), ("bias", "none"), ("alibi", "causal"),
                           ("", "causal")):
            v = Variant(KernelSpec(kernel, "float16", 64, 64, mask, mods), cfg)
            routed = kernel != "bwd_dkdv" and mask == "causal" and "bias" in mods
            assert compiled_variant(v).spec.mask == ("window" if routed else mask), v.id
    # and stays exact (window kernel, causal bounds), both alignments
    q, k, v = _qkv(sq=40, sk=29)
    bias = torch.randn(4, 40, 29, dtype=F16)
    for align in ("bottom_right", "top_left"):
        mode, lo, hi = mask_bounds(40, 29, causal=True, window=(-1, -1), align=align)
        m = ops.ScoreMods(bias=bias.expand(1, 4, 40, 29))
        o, lse = ops.fwd(q.detach(), k.detach(), v.detach(), softmax_scale=0.25, mask=mode, diag_lo=lo, diag_hi=hi,
                         config=cfg, mods=m)
        ref, rlse, _ = reference.forward_bounds(q.detach(), k.detach(), v.detach(), 0.25, lo, hi,
                                                bias=bias.expand(1, 4, 40, 29))
        assert (o.double() - ref).abs().max() < 5e-3 and torch.equal(torch.isinf(lse), torch.isinf(rlse))


def test_an_untuned_mods_key_prefers_the_same_mods_at_another_head_dim(tmp_path):
    """On the H200 at head_dim 64, dropout and bias ran 2.3x / 1.6x slower on the
    plain key's m128 n128 w4 (register spills) than on the m64 n64 w4 tuned for the
    same mods at head_dim 128, which the d64 tune then confirmed best.  An untuned mods
    key takes the same mods' tiles from another head dim first; a config that does not
    fit its shared memory there is skipped for the plain key's."""
    from flashgen.db import TuningDB
    from flashgen.dispatch import Dispatcher
    from flashgen.env import Environment
    from flashgen.spec import Measurement

    env = Environment("NVIDIA H200", "9.0", 132, "3.6.0", "2.11", "0.1.0")
    shape = Shape(8, 16, 16, 2048, 2048)
    plain64 = KernelSpec("fwd", "bfloat16", 64, 64, "none")
    drop128 = KernelSpec("fwd", "bfloat16", 128, 128, "none", "dropout")
    drop256 = KernelSpec("fwd", "bfloat16", 256, 256, "none", "dropout")
    bias128 = KernelSpec("fwd", "bfloat16", 128, 128, "none", "bias")
    plain_cfg, drop_cfg, far_cfg = TileConfig(128, 128, 4, 3, tma=1), TileConfig(64, 64, 4, 3, tma=1), \
        TileConfig(64, 32, 4, 2, tma=1)
    path = tmp_path / "t.sqlite"
    with TuningDB(path) as db:
        db.record(shape.key(plain64), shape, Variant(plain64, plain_cfg), Measurement("ok", 1.0), env, 0)
        db.record(shape.key(drop128), shape, Variant(drop128, drop_cfg), Measurement("ok", 1.5), env, 0)
        db.record(shape.key(drop256), shape, Variant(drop256, far_cfg), Measurement("ok", 3.0), env, 0)
    d = Dispatcher([path], env=env, arch=SM90)
    ch = d.choose(shape.key(KernelSpec("fwd", "bfloat16", 64, 64, "none", "dropout")))
    assert (ch.source, ch.config, ch.tuned_key) == ("nearest", drop_cfg, shape.key(drop128).id)
    # other masks, kernels or mods are not the same mods' rows: the plain key's tiles
    ch = d.choose(shape.key(KernelSpec("fwd", "bfloat16", 64, 64, "none", "softcap")))
    assert (ch.config, ch.tuned_key) == (plain_cfg, shape.key(plain64).id)
    # a row whose config does not fit this head dim's shared memory is passed over
    huge = TileConfig(128, 128, 8, 3, tma=1)
    assert not resources.estimate(Variant(KernelSpec("fwd", "bfloat16", 256, 256, "none", "bias"), huge), SM90).feasible
    with TuningDB(path) as db:
        db.record(shape.key(bias128), shape, Variant(bias128, huge), Measurement("ok", 1.0), env, 0)
    d = Dispatcher([path], env=env, arch=SM90)
    ch = d.choose(shape.key(KernelSpec("fwd", "bfloat16", 256, 256, "none", "bias")))
    assert ch.config != huge and resources.estimate(Variant(ch.key.spec, ch.config), SM90).feasible


def test_another_head_dims_mods_row_must_satisfy_this_head_dims_rules(tmp_path):
    """Review 5: d128 score-mod rows (dK/dV m64 n64 w4, fwd m128 n64 w4) fit d256's
    shared memory but break space's acc_regs rule there (256 accumulator registers per
    thread); the fallback must pass them over, as the tuner and the heuristic do."""
    from flashgen import space
    from flashgen.db import TuningDB
    from flashgen.dispatch import Dispatcher
    from flashgen.env import Environment
    from flashgen.spec import Measurement

    env = Environment("NVIDIA H200", "9.0", 132, "3.6.0", "2.11", "0.1.0")
    shape = Shape(8, 16, 16, 2048, 2048)
    path = tmp_path / "t.sqlite"
    rows = [(KernelSpec("bwd_dkdv", "bfloat16", 128, 128, "none", "softcap"), TileConfig(64, 64, 4, 2, tma=1)),
            (KernelSpec("fwd", "bfloat16", 64, 64, "none", "dropout"), TileConfig(128, 64, 4, 1, tma=1))]
    with TuningDB(path) as db:
        for spec, cfg in rows:
            db.record(shape.key(spec), shape, Variant(spec, cfg), Measurement("ok", 1.0), env, 0)
    d = Dispatcher([path], env=env, arch=SM90)
    for kernel, mods in (("bwd_dkdv", "softcap"), ("fwd", "dropout")):
        spec = KernelSpec(kernel, "bfloat16", 256, 256, "none", mods)
        row_cfg = next(c for s, c in rows if s.kernel == kernel)
        assert resources.estimate(Variant(spec, row_cfg), SM90).feasible and space.violated_rules(Variant(spec, row_cfg))
        ch = d.choose(shape.key(spec))
        assert not space.violated_rules(Variant(spec, ch.config)), (kernel, ch)


@pytest.mark.parametrize("which", ["bias", "alibi_slopes", "bias-via-sdpa"])
def test_a_bias_or_slopes_modified_before_the_backward_is_refused(which):
    """The backward re-reads the bias and the ALiBi slopes: modified in place between the
    forward and the backward (a reused mask buffer), autograd stops with its version
    error, as for q, k and v, instead of giving the gradients of another function."""
    q, k, v = _qkv()
    g = torch.Generator().manual_seed(4)
    if which == "alibi_slopes":
        t = torch.rand(q.shape[1], generator=g)
        o = flashgen.attention(q, k, v, alibi_slopes=t)
    elif which == "bias":
        t = torch.randn(q.shape[2], k.shape[2], generator=g, dtype=F16)
        o = flashgen.attention(q, k, v, bias=t)
    else:
        t = torch.randn(q.shape[2], k.shape[2], generator=g, dtype=F16)
        o = flashgen.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                  attn_mask=t)
    t.mul_(-3.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        o.float().sum().backward()


def test_a_bias_and_slopes_made_under_inference_mode_still_train():
    """Inference tensors have no version counter and cannot be saved for a backward:
    the version check leaves them out (outside inference mode they cannot be modified
    in place anyway) and the call trains as before."""
    q, k, v = _qkv()
    with torch.inference_mode():
        bias = torch.randn(q.shape[2], k.shape[2], dtype=F16)
        slopes = torch.rand(q.shape[1])
    o = flashgen.attention(q, k, v, bias=bias, alibi_slopes=slopes)
    o.float().sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("mods", [None, "bias"])
def test_a_double_backward_is_refused_not_silently_zero(mods):
    """create_graph=True through the eager path: the first-order gradients equal a plain
    backward's and carry a graph; differentiating them again raises, as through the
    ops (whose backward has no autograd formula), instead of leaving attention's
    second-order terms out."""
    q, k, v = _qkv(dtype=F32)
    kw = _mods_kw(mods, q, k) if mods else {}
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))
    plain = torch.autograd.grad((flashgen.attention(q, k, v, **kw) * w).sum(), (q, k, v))
    got = torch.autograd.grad((flashgen.attention(q, k, v, **kw) * w).sum(), (q, k, v), create_graph=True)
    for a, b in zip(got, plain):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert all(t.requires_grad for t in got)
    with pytest.raises(RuntimeError, match="no double backward"):
        (got[0] ** 2).sum().backward()

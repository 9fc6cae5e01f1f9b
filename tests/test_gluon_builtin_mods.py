"""The built-in softcap and ALiBi in the Gluon family (flashgen.families.gluon.builtin_mods):
the fixed score functions compute the built-in mods (run through the Triton family's user
kernels in the interpreter, against the float64 reference of the built-in mods, forward
and backward, with seqlen_q != seqlen_k, per-batch slopes and GQA); the Gluon backward's
own statements of a step on the CPU; the family's keys, rules, defaults and the
dispatcher's choice; the variants compile for sm_90."""

import math

import pytest
import torch

from flashgen import arch, bench, families, library, ops
from flashgen.families.gluon import builtin_mods as BM
from flashgen.families.gluon import bwd as B
from flashgen.families.gluon import family as F
from flashgen.families.gluon import user_bwd as UB
from flashgen.masks import mask_bounds
from flashgen.spec import KernelSpec, Measurement, ProblemKey, Shape, TileConfig, Variant

SM90 = arch.by_sm("sm_90")
pytestmark = pytest.mark.usefixtures("hermetic_dispatcher")


def _inputs(b, h, hk, sq, sk, d, mods, slopes_per_batch, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, sq, d, generator=g, dtype=torch.float16)
    k = torch.randn(b, hk, sk, d, generator=g, dtype=torch.float16)
    v = torch.randn(b, hk, sk, d, generator=g, dtype=torch.float16)
    do = torch.randn(b, h, sq, d, generator=g, dtype=torch.float16)
    slopes = None
    if "alibi" in mods:
        slopes = torch.rand(b, h, generator=g) * 0.5 if slopes_per_batch else torch.rand(h, generator=g) * 0.5
    return q, k, v, do, ops.ScoreMods(softcap=1.5 if "softcap" in mods else 0.0, alibi=slopes)


@pytest.mark.parametrize("mods,causal,sizes,per_batch", [
    ("softcap", True, (1, 4, 2, 19, 27), False),
    ("alibi", False, (2, 4, 2, 33, 17), True),
    ("alibi", True, (1, 4, 1, 19, 27), False),
    ("softcap_alibi", True, (2, 2, 2, 27, 19), True),
    ("softcap_alibi", False, (1, 4, 2, 21, 21), False),
])
def test_the_fixed_functions_compute_the_builtin_mods(mods, causal, sizes, per_batch):
    """The fixed score function of ``mods`` with the call's values in its tensors, run by
    the Triton family's user-function kernels (the interpreter), gives what float64
    gives for the built-in mods: O, LSE, dQ, dK, dV within the project's rule; with
    seqlen_q above and below seqlen_k (the bottom-right offset), slopes per head and per
    (batch, head), and GQA."""
    b, h, hk, sq, sk = sizes
    q, k, v, do, mods_obj = _inputs(b, h, hk, sq, sk, 16, mods, per_batch)
    assert mods_obj.name == mods
    scale = 16 ** -0.5
    mode, lo, hi = mask_bounds(sq, sk, causal=causal, window=(-1, -1))
    fwd = BM.user_args(mods_obj, q, k, lo, hi, "fwd")
    bwd = BM.user_args(mods_obj, q, k, lo, hi, "bwd")
    assert fwd.name == BM.name(mods, "fwd") and bwd.name == BM.name(mods, "bwd") and fwd.name != bwd.name
    o, lse = library.forward(q, k, v, scale, mode, lo, hi, fwd)
    dq, dk, dv = library.backward(do, q, k, v, o, lse, scale, mode, lo, hi, bwd, deterministic=True)
    res = bench.compare({"O": o, "LSE": lse, "dQ": dq, "dK": dk, "dV": dv}, q, k, v, do,
                        mask=dict(causal=causal, window=(-1, -1), align="bottom_right"), softmax_scale=scale,
                        mods=dict(softcap=mods_obj.softcap, alibi=mods_obj.alibi, bias=None))
    assert all(r <= 1.0 for _, _, r in res.values()), res
    # and the mods matter here: without them the same call is far from the reference
    plain, _ = library.forward(q, k, v, scale, mode, lo, hi)
    assert (plain.float() - o.float()).abs().max() > 1e-2


def test_one_variant_serves_every_value():
    """The values ride in tensors: another softcap, other slopes and another seqlen_k -
    seqlen_q give the same lowering; the (3,) values are kept per (softcap, offset,
    device) and a slope vector is read through a batch stride of 0."""
    q, k, _, _, m1 = _inputs(2, 4, 2, 19, 27, 16, "softcap_alibi", False)
    a1 = BM.user_args(m1, q, k, -19, 8, "fwd")
    m2 = ops.ScoreMods(softcap=30.0, alibi=torch.rand(2, 4))
    a2 = BM.user_args(m2, q, k[:, :, :19], -19, 0, "fwd")
    assert a1.name == a2.name
    vals = {r: t for r, t in zip(BM._traced("softcap_alibi")[1], a1.bufs)}
    assert (float(vals["cap"]), float(vals["off"])) == (1.5, 8.0) and math.isclose(float(vals["inv"]), 1 / 1.5,
                                                                                 rel_tol=1e-7)
    assert vals["slopes"].shape == (2, 4) and vals["slopes"].stride() == (0, 1)
    assert BM.user_args(m1, q, k, -19, 8, "fwd").bufs[0] is a1.bufs[0]  # kept, not made again
    # softcap alone does not read the offset: one kept tensor for every seqlen_k - seqlen_q
    m3 = ops.ScoreMods(softcap=1.5)
    assert BM.user_args(m3, q, k, -19, 8, "fwd").bufs[0] is BM.user_args(m3, q, k[:, :, :5], -19, 0, "fwd").bufs[0]
    vals2 = {r: t for r, t in zip(BM._traced("softcap_alibi")[1], a2.bufs)}
    assert float(vals2["cap"]) == 30.0 and float(vals2["off"]) == 0.0 and vals2["slopes"].stride() == (4, 1)


def _key(kernel, mods, d=128, mask="causal", shape=Shape(8, 16, 16, 4096, 4096)):
    return shape.key(KernelSpec(kernel, "bfloat16", d, d, mask, mods))


def test_the_family_serves_softcap_and_alibi_not_bias_or_dropout():
    """softcap, alibi and both: the Gluon forward and whole backward serve their keys on
    sm_90 (the fixed functions' ``user`` variants, the key's own mask mode, the user
    code id); bias and dropout are refused with a reason, as is sm_80 and the
    column-split backward of head_dim 256."""
    gluon = families.get("gluon")
    for mods in ("softcap", "alibi", "softcap_alibi"):
        for kernel in ("fwd", "bwd"):
            key = _key(kernel, mods)
            assert gluon.unsupported(key, SM90) is None, (mods, kernel)
            cfg = gluon.default_config(key, SM90)
            assert gluon.violated_rules(Variant(key.spec, cfg)) == []
            src = gluon.render(Variant(key.spec, cfg))
            name = BM.name(mods, kernel)
            assert name in src, (mods, kernel)
            assert ("2.8853900817779268" in src) == ("softcap" in mods), (mods, kernel)
            user_id = gluon.template_hash(kernel, "u" + "0" * 12)
            assert len(gluon.template_hash(kernel, mods)) == len(user_id) and gluon.template_hash(kernel, mods) \
                not in (user_id, gluon.template_hash(kernel, ""))
        assert F.fwd_spec(_key("fwd", mods)).mask == "causal" and F.bwd_mask(_key("bwd", mods).spec) == "causal"
        assert "Gluon" not in (gluon.unsupported(_key("fwd", mods), arch.by_sm("sm_80")) or "Gluon")
    for mods in ("bias", "dropout", "softcap_bias"):
        why = gluon.unsupported(_key("fwd", mods), SM90)
        assert why is not None and "bias or dropout" in why, why
    assert "column-split" in gluon.unsupported(_key("bwd", "softcap", d=256), SM90)
    with pytest.raises(ValueError, match="bwd_dq and bwd_dkdv only|compiled into"):
        KernelSpec("bwd", "bfloat16", 128, 128, "none", "bias")


def test_the_dispatcher_chooses_by_measurement(tmp_path):
    """Untuned: the Gluon whole backward where a measurement puts its default ahead
    (BUILTIN_BWD_DEFAULT_AHEAD, per mods, head_dim and mask), the Gluon forward where one
    puts its default ahead by BUILTIN_FWD_MIN_LEAD in both runs (softcap at head_dim 128
    causal, not ALiBi there: 1.01x and 1.02x), else the Triton forward; a ``deterministic`` backward takes the
    two kernels; tuned rows decide both ways."""
    from flashgen.db import TuningDB
    from flashgen.dispatch import Dispatcher
    from flashgen.env import Environment

    gluon = families.get("gluon")
    h200 = Environment("NVIDIA H200", "9.0", 132, "3.6.0", "2.11.0", "0.1.0")
    shape = Shape(8, 16, 16, 4096, 4096)
    assert gluon.prefers_default(_key("bwd", "softcap_alibi"), SM90) is None  # measured behind
    assert gluon.prefers_default(_key("bwd", "softcap_alibi", mask="none"), SM90) is not None
    assert gluon.prefers_default(_key("bwd", "softcap", mask="window"), SM90) is None  # not timed
    assert gluon.prefers_default(_key("fwd", "softcap"), SM90) == F.BUILTIN_FWD_DEFAULT_AHEAD[("softcap", 128, "causal")]
    assert gluon.prefers_default(_key("fwd", "alibi"), SM90) is None  # 1.01x and 1.02x: a run's spread
    assert gluon.prefers_default(_key("fwd", "softcap_alibi"), SM90) is not None
    assert gluon.prefers_default(_key("fwd", "softcap", d=64, mask="none"), SM90) is None  # 1.04x, then 1.01x
    assert gluon.prefers_default(_key("fwd", "softcap", mask="window"), SM90) is None  # not timed
    for mods in ("softcap", "alibi"):
        assert gluon.prefers_default(_key("bwd", mods), SM90) == F.BUILTIN_BWD_DEFAULT_AHEAD[(mods, 128, "causal")]
        disp = Dispatcher([], env=h200, arch=SM90)
        plan = disp.backward(_key("bwd_dq", mods), capturing=False)
        assert plan.whole and plan.family == "gluon", plan.reason
        assert not disp.backward(_key("bwd_dq", mods), deterministic=True, capturing=False).whole
        assert disp.choose(_key("fwd", mods), capturing=False).family == ("gluon" if mods == "softcap" else "triton")
        assert not disp.backward(_key("bwd_dq", "bias"), capturing=False).whole
        for gluon_ms, whole in ((1.5, True), (2.5, False)):
            db_path = tmp_path / f"{mods}{gluon_ms}.sqlite"
            gcfg = gluon.default_config(_key("bwd", mods), SM90)
            fcfg = gluon.default_config(_key("fwd", mods), SM90)
            with TuningDB(db_path) as db:
                for kernel, c, ms in (("bwd_dq", TileConfig(64, 64, 4, 2), 1.0),
                                      ("bwd_dkdv", TileConfig(64, 32, 4, 1), 1.0), ("bwd", gcfg, gluon_ms),
                                      ("fwd", TileConfig(128, 64, 8, 2), 1.0), ("fwd", fcfg, gluon_ms - 1.0)):
                    k = _key(kernel, mods)
                    db.record(k, shape, Variant(k.spec, c), Measurement("ok", median_ms=ms), h200, 0)
            disp = Dispatcher([db_path], env=h200, arch=SM90)
            plan = disp.backward(_key("bwd_dq", mods), capturing=False)
            assert plan.whole is whole and plan.family == ("gluon" if whole else "triton"), (mods, plan.reason)
            assert disp.choose(_key("fwd", mods), capturing=False).family == ("gluon" if whole else "triton")


def test_a_forward_default_measured_ahead_beats_another_buckets_row(tmp_path):
    """A built-in mods forward key without a row of its own bucket: the Gluon default where
    its measurement (against what the dispatcher served without it: other buckets' rows)
    puts it ahead, else the nearest row; a row of the key's own bucket still decides."""
    from flashgen.db import TuningDB
    from flashgen.dispatch import Dispatcher
    from flashgen.env import Environment

    h200 = Environment("NVIDIA H200", "9.0", 132, "3.6.0", "2.11.0", "0.1.0")
    near = Shape(8, 16, 16, 2048, 2048)
    db_path = tmp_path / "near.sqlite"
    with TuningDB(db_path) as db:
        for mods in ("softcap", "alibi"):
            k = _key("fwd", mods, shape=near)
            db.record(k, near, Variant(k.spec, TileConfig(64, 64, 4, 3)), Measurement("ok", median_ms=1.0), h200, 0)
    disp = Dispatcher([db_path], env=h200, arch=SM90)
    soft = disp.choose(_key("fwd", "softcap"), capturing=False)
    assert soft.family == "gluon" and soft.source == "default" and "instead of the nearest row" in soft.note
    alibi = disp.choose(_key("fwd", "alibi"), capturing=False)
    assert alibi.family == "triton" and alibi.source == "nearest"
    own = disp.choose(_key("fwd", "softcap", shape=near), capturing=False)
    assert own.family == "triton" and own.source == "tuned"
    # a Gluon row of another bucket is not displaced by the Gluon default
    k = _key("fwd", "softcap", shape=near)
    other = TileConfig(64, 64, 4, 2, family="gluon", ctas_per_sm=2, persistent=3, o_in_q=1)
    with TuningDB(tmp_path / "gluon_near.sqlite") as db:
        db.record(k, near, Variant(k.spec, other), Measurement("ok", median_ms=1.0), h200, 0)
    row = Dispatcher([tmp_path / "gluon_near.sqlite"], env=h200, arch=SM90).choose(_key("fwd", "softcap"),
                                                                                   capturing=False)
    assert row.config == other and row.source == "nearest"


def test_the_forward_default_is_one_consumer_at_block_n_64():
    """The built-in mods' Gluon forward default: one consumer of 64 rows, BLOCK_N 64, three
    programs per SM at head_dim 64 (3 stages) and two at 128 (2 stages: a third does not
    fit two programs' shared memory); the plain keys keep theirs."""
    gluon = families.get("gluon")
    for mods in ("softcap", "alibi", "softcap_alibi"):
        for d, want in ((64, "gluon_m64_n64_w4_s3_x3"), (128, "gluon_m64_n64_w4_s2_x2")):
            for mask in ("causal", "none", "window"):
                cfg = gluon.default_config(_key("fwd", mods, d=d, mask=mask), SM90)
                assert cfg.id == want and gluon.violated_rules(Variant(_key("fwd", mods, d=d).spec, cfg)) == []
    assert gluon.default_config(_key("fwd", ""), SM90).id.startswith("gluon_m64_n128_w8")


def test_presets_tune_the_whole_backward_of_softcap_and_alibi():
    """The mods presets give ``bwd`` keys to softcap and alibi, not to bias or dropout."""
    from flashgen import presets

    keys = [k for k, _ in presets.expand(["mods-bench"], kernels=("fwd", "bwd"))]
    whole = {k.spec.mods for k in keys if k.spec.kernel == "bwd"}
    assert whole == {"softcap", "alibi"}
    assert {k.spec.mods for k in keys if k.spec.kernel == "fwd"} == {"softcap", "alibi", "bias", "dropout"}


@pytest.mark.parametrize("mods", ["softcap", "alibi", "softcap_alibi"])
def test_the_gluon_backward_step_computes_p_and_ds(mods):
    """The Gluon backward's own statements of an unmasked step with the fixed function
    (run on the CPU in float32, tests/test_gluon_user_bwd.py's harness): P^T and dS^T =
    P^T (dP^T - delta) f'(s) against float64 autograd of the built-in mods' formula, for
    query head 3 of batch entry 1, seqlen_k - seqlen_q = 200."""
    from test_gluon_user_bwd import _score_step

    b, h, hk, sq, sk, d = 2, 4, 2, 500, 700, 128
    g = torch.Generator().manual_seed(3)
    slopes = torch.rand(b, h, generator=g)
    m = ops.ScoreMods(softcap=20.0 if "softcap" in mods else 0.0, alibi=slopes if "alibi" in mods else None)
    q = torch.empty(b, h, sq, d)
    k = torch.empty(b, hk, sk, d)
    ua = BM.user_args(m, q, k, -sq, sk, "bwd")
    cfg = B.default_config(d, "bfloat16", "none")
    src = B.render(cfg, "bfloat16", d, "none", user=ua.name)
    pb, bm = cfg.part_rows, cfg.block_m
    scale = d ** -0.5
    m0, nc = 192, 320
    st = torch.randn(pb, bm, generator=g) * 40.0
    dpt = torch.randn(pb, bm, generator=g)
    delta = torch.randn(bm, generator=g)
    rows_q = (m0 + torch.arange(bm)).view(1, -1).double()
    rows_k = (nc + torch.arange(pb)).view(-1, 1).double()
    s64 = (scale * st.double()).requires_grad_()
    f = s64
    if "softcap" in mods:
        f = 20.0 * torch.tanh(f / 20.0)
    if "alibi" in mods:
        f = f - slopes[1, 3].double() * (rows_q + (sk - sq) - rows_k).abs()
    (df,) = torch.autograd.grad(f.sum(), [s64])
    lse = f.detach().amax(0) + 0.5
    p_ref = torch.exp(f.detach() - lse)
    ds_ref = p_ref * (dpt.double() - delta.double()) * df
    pt, ds = _score_step(src, ua.gluon_bwd_args(cfg.block_m, cfg.block_nt), st, (lse / math.log(2)).float(),
                         dpt, delta, 1, 3, m0, nc, scale, sq, sk)
    assert p_ref.max() > 0.5 and p_ref.min() < 1e-3
    torch.testing.assert_close(pt.double(), p_ref, rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(ds.double(), ds_ref, rtol=2e-5, atol=2e-6 * float(ds_ref.abs().max()))
    assert UB.unsupported(BM.lowering(mods, "bwd")) is None


_SCRIPT = r'''
import json
import torch
from flashgen import ops
from flashgen.arch import by_sm
from flashgen.masks import mask_bounds
from flashgen.spec import KernelSpec, Shape
from flashgen.families import get
from flashgen.families.gluon import builtin_mods as BM, bwd as B, family as F
from flashgen.families.gluon.config import GluonFwdVariant
from flashgen.families.gluon.sm90 import SERIALIZED, compile_sm90, report
shape = Shape(batch=2, num_heads=16, num_kv_heads=16, seqlen_q=2048, seqlen_k=2048)
gluon = get("gluon")
for kernel, mods, d, mask in CASES:
    key = shape.key(KernelSpec(kernel, "bfloat16", d, d, mask, mods))
    cfg = gluon.default_config(key, by_sm("sm_90"))
    if kernel == "fwd":
        v = GluonFwdVariant(F.fwd_spec(key), F.fwd_config(cfg))
        r, vid = report(compile_sm90(v)), v.id
    else:
        m = ops.ScoreMods(softcap=30.0 if "softcap" in mods else 0.0,
                          alibi=torch.ones(16) if "alibi" in mods else None)
        _, lo, hi = mask_bounds(2048, 2048, causal=mask == "causal", window=(-1, -1))
        ua = BM.user_args(m, torch.empty(2, 16, 2048, d), torch.empty(2, 16, 2048, d), lo, hi, "bwd")
        g = F.bwd_config(cfg)
        r, vid = report(B.compile_sm90(g, "bfloat16", d, mask, check=False, user=ua)), B.variant_id(
            g, "bfloat16", d, mask, user=ua.name)
    print("OK " + json.dumps(dict(kernel=kernel, mods=mods, d=d, mask=mask, id=vid, spill=r.spill_bytes,
                                  hgmma=r.hgmma, setmaxnreg=r.setmaxnreg,
                                  serialized=[c for c in SERIALIZED if c in r.ptxas_log])))
'''

#: (kernel, mods, head_dim, mask): the default tiles of both head dims with both
#: functions (the forward's and the backward's), and each function alone.
COMPILE_CASES = [("fwd", "softcap_alibi", 64, "causal"), ("fwd", "softcap_alibi", 128, "causal"),
                 ("bwd", "softcap_alibi", 64, "causal"), ("bwd", "softcap_alibi", 128, "causal"),
                 ("bwd", "softcap", 128, "none"), ("bwd", "alibi", 128, "causal")]
#: ptxas spill-store bytes per (kernel, mods, head_dim, mask) and Triton minor version;
#: any other spill fails.  The head_dim 128 backward's lock-step partition holds dK and dV
#: of 128 key rows: a score function spills there (as the user examples do,
#: tests/test_gluon_user_bwd.py), both functions in a causal tile most, 788 B, which is
#: why its untuned default is the Triton family's (family.BUILTIN_BWD_DEFAULT_AHEAD).
SPILL_BYTES = {"3.6": {("bwd", "softcap_alibi", 64, "causal"): 20,
                       ("bwd", "softcap_alibi", 128, "causal"): 788, ("bwd", "softcap", 128, "none"): 116,
                       ("bwd", "alibi", 128, "causal"): 148},
               "3.9": {("bwd", "softcap_alibi", 64, "causal"): 84,
                       ("bwd", "softcap_alibi", 128, "causal"): 844, ("bwd", "softcap", 128, "none"): 116,
                       ("bwd", "alibi", 128, "causal"): 212}}


def test_builtin_variants_compile_for_sm90():
    """The default tiles with softcap and ALiBi compile for sm_90: HGMMA, setmaxnreg, no
    serialized wgmma, and no spill but those recorded."""
    import triton

    from sm90 import json_rows

    rows = json_rows(_SCRIPT, COMPILE_CASES)
    spills = SPILL_BYTES.get(".".join(triton.__version__.split(".")[:2]), {})
    for row in rows:
        assert row["hgmma"] > 0 and row["setmaxnreg"] and row["serialized"] == [], row
        assert row["spill"] == spills.get((row["kernel"], row["mods"], row["d"], row["mask"]), 0), row
    assert len({row["id"] for row in rows}) == len(rows)


def test_the_tuner_searches_the_gluon_family_for_softcap_and_alibi(tmp_path):
    """``flashgen tune --preset mods-bench --kernels fwd,bwd --family gluon``: the tuner
    measures Gluon variants for the built-in keys' forward and whole backward (here timed
    by the byte model, no GPU) and records rows under the keys' own ids."""
    from flashgen import presets, tuner
    from flashgen.db import TuningDB
    from flashgen.env import Environment

    env = Environment("NVIDIA H200 (model)", "9.0", 132, "3.6.0", "2.11.0", "0.1.0")
    items = [(k, s) for k, s in presets.expand(["mods-bench"], kernels=("fwd", "bwd"))
             if k.spec.mods == "alibi" and k.spec.head_dim == 64 and k.spec.mask == "causal"]
    assert {k.spec.kernel for k, _ in items} == {"fwd", "bwd"}
    with TuningDB(tmp_path / "t.sqlite") as db:
        res = tuner.tune(items, benchmarker=tuner.ModelBenchmarker(SM90), db=db, env=env, arch=SM90, n_trials=2,
                         family_names=("gluon",))
        rows = db.rows()
    assert len(res) == 2
    ok = {(r["key"], "_gluon_" in r["variant_id"]) for r in rows if r["status"] == "ok"}
    assert ok == {(k.id, True) for k, _ in items}, rows

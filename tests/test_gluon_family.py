"""The Gluon kernel family through the registry, without a GPU: what it serves and why
not, its search space, the dispatcher's choice between families (forward rows, the
whole backward against bwd_dq + bwd_dkdv, untuned defaults), the deterministic
backward, the fallback to the Triton family on a build failure, the tuner's Gluon rows
through the DB and explain, and the launchers with the arguments bench and the library
pass (kernels replaced by recorders: shapes and grids only)."""

import dataclasses
import tomllib
import warnings
from pathlib import Path

import pytest
import torch

import flashgen
from flashgen import bench, dispatch, families, library, reference, tuner
from flashgen.api import explain
from flashgen.arch import INTERPRETER, by_sm
from flashgen.db import TuningDB
from flashgen.dispatch import Dispatcher
from flashgen.env import Environment
from flashgen.families.gluon import bwd as B
from flashgen.families.gluon import config as C
from flashgen.families.gluon import family as F
from flashgen.families.gluon import launch as L
from flashgen.spec import KernelSpec, Measurement, ProblemKey, Shape, TileConfig, Variant

GLUON = families.get("gluon")
SM90 = by_sm("sm_90")
H200 = Environment("NVIDIA H200", "9.0", 132, "3.6.0", "2.11.0", "0.1.0")
SHAPE = Shape(1, 2, 2, 64, 64)


def key(kernel="fwd", dtype="float16", d=64, dv=None, mask="causal", mods="", layout="", shape=SHAPE):
    k = shape.key(KernelSpec(kernel, dtype, d, d if dv is None else dv, mask, mods))
    return dataclasses.replace(k, layout=layout)


# -- what it serves ---------------------------------------------------------------------

def test_unsupported_reasons():
    assert GLUON.unsupported(key(), SM90) is None
    assert GLUON.unsupported(key("bwd", "bfloat16", 128, mask="window"), SM90) is None
    assert GLUON.unsupported(key(d=96, dv=192, mask="none"), SM90) is None  # d != dv in the forward
    cases = {
        "compiles fwd and the whole backward": (key("bwd_dq"), SM90),
        "Triton's interpreter": (key(), INTERPRETER),
        "this is sm_80": (key(), by_sm("sm_80")),
        "this is sm_89": (key(), by_sm("sm_89")),
        "this is sm_100": (key(), by_sm("sm_100")),
        "this is sm_120": (key(), by_sm("sm_120")),
        "float16 or bfloat16 only": (key(dtype="float32"), SM90),
        "tensor descriptor can address (layout strided)": (key(layout="strided"), SM90),
        "not bias or dropout, which are the Triton family's": (key(mods="bias"), SM90),
        "the Gluon forward is built for": (key(d=80), SM90),
        "head_dim = head_dim_v in (64, 96, 128, 256)": (key("bwd", d=80), SM90),
    }
    for words, (k, arch) in cases.items():
        why = GLUON.unsupported(k, arch)
        assert why is not None and words in why, (words, why)
    assert "bwd_dq and bwd_dkdv" in families.portable().unsupported(key("bwd"), SM90)
    assert families.portable().unsupported(key("bwd_dq"), SM90) is None


def test_search_space_is_the_gluon_space_and_ids_round_trip():
    for k, space in ((key("fwd", d=128, mask="none"), set(C.space(F.fwd_spec(key("fwd", d=128, mask="none"))))),
                     (key("bwd", d=64, mask="causal"), set(B.search_space(64, "float16", "causal")))):
        ok = [c for c in families.configs(GLUON, k) if not GLUON.violated_rules(Variant(k.spec, c))]
        conv = F.fwd_config if k.spec.kernel == "fwd" else F.bwd_config
        assert {conv(c) for c in ok} == space and len(ok) == len(space) > 10
        assert all(c.family == "gluon" and c.id.startswith("gluon_m") for c in ok)
        assert all(F.tile_config(conv(c)) == c for c in ok)
        # infeasible or invalid configs are rejected by the rules, never compiled
        assert len(list(families.configs(GLUON, k))) > len(ok)
    assert TileConfig(64, 64, 4, 2).id == "m64_n64_w4_s2"  # Triton ids unchanged
    c = F.tile_config(C.default_config(C.GluonFwdSpec("bfloat16", 128, 128, "causal")))
    assert c.id == "gluon_m64_n128_w8_s2_pin" and TileConfig.from_dict(c.as_dict()) == c


# -- the dispatcher ---------------------------------------------------------------------

def _record(db, k, cfg, ms, env=H200):
    db.record(k, SHAPE, Variant(k.spec, cfg), Measurement("ok", median_ms=ms), env, 0)


def _assert_refined_into(path, k, best, twin, knob):
    """Around a tuned row ``best`` of ``k``, ``flashgen tune --refine knob`` measures the
    one ``twin``, whose faster row then serves the key."""
    with TuningDB(path) as db:
        _record(db, k, best, 0.5)
        assert tuner.refine_configs(k, db, H200, SM90, [knob], ["gluon"]) == [(best, [twin])]
        _record(db, k, twin, 0.4)
        assert db.best_configs(H200)[k.id][0] == twin


GFWD = F.tile_config(C.GluonFwdConfig(num_consumers=1, BLOCK_N=64, num_stages=2, consumer_regs=240,
                                      producer_regs=24))
GBWD = GLUON.default_config(key("bwd"), SM90)
T1, T2 = TileConfig(64, 64, 4, 2), TileConfig(64, 32, 4, 1)


@pytest.mark.parametrize("gluon_ms, winner", [(0.5, GFWD), (2.0, T1)])
def test_dispatch_forward_by_measurement(tmp_path, gluon_ms, winner):
    with TuningDB(tmp_path / "t.sqlite") as db:
        _record(db, key(), T1, 1.0)
        _record(db, key(), GFWD, gluon_ms)
    c = Dispatcher([tmp_path / "t.sqlite"], env=H200, arch=SM90).choose(key(), capturing=False)
    assert (c.config, c.source) == (winner, "tuned")


@pytest.mark.parametrize("arch", [by_sm("sm_80"), INTERPRETER])
def test_a_faster_row_of_a_family_that_cannot_serve_does_not_hide_the_others(tmp_path, arch):
    """The Gluon row is the key's fastest, but Gluon does not run on this arch: the Triton
    row of the same key serves as a tuned row (not a nearest bucket, not the default)."""
    with TuningDB(tmp_path / "t.sqlite") as db:
        _record(db, key(), T1, 1.0)
        _record(db, key(), GFWD, 0.5)
        _record(db, key(shape=Shape(1, 2, 2, 256, 256)), T2, 0.7)  # a nearer-looking bucket
    c = Dispatcher([tmp_path / "t.sqlite"], env=H200, arch=arch).choose(key(), capturing=False)
    assert (c.config, c.source, c.tuned_key) == (T1, "tuned", key().id)


@pytest.mark.parametrize("gluon_ms, whole", [(1.5, True), (2.5, False)])
def test_dispatch_backward_compares_the_whole_backward_with_the_two_kernels(tmp_path, gluon_ms, whole):
    with TuningDB(tmp_path / "t.sqlite") as db:
        _record(db, key("bwd_dq"), T1, 1.0)
        _record(db, key("bwd_dkdv"), T2, 1.0)
        _record(db, key("bwd"), GBWD, gluon_ms)
    d = Dispatcher([tmp_path / "t.sqlite"], env=H200, arch=SM90)
    plan = d.backward(key("bwd_dq"), capturing=False)
    assert plan.whole is whole and "measured at attn_bwd_d64_fp16_causal" in plan.reason
    if whole:
        assert plan.family == "gluon" and plan.choices[0].config == GBWD
    else:
        assert plan.family == "triton" and [c.config for c in plan.choices] == [T1, T2]
    det = d.backward(key("bwd_dq"), deterministic=True, capturing=False)
    assert not det.whole and det.reason.startswith("deterministic") and det.family == "triton"


def test_the_backward_compares_rows_of_one_gpu_only(tmp_path):
    """A sibling GPU's whole-backward row is compared with that GPU's two-kernel rows,
    never with this GPU's (nor this GPU's with a sibling's): the H200's rows are faster
    than an H100's, so a mixed comparison would favour whichever side the H200 holds."""
    h100 = dataclasses.replace(H200, gpu_name="NVIDIA H100 80GB HBM3")
    with TuningDB(tmp_path / "t.sqlite") as db:
        _record(db, key("bwd"), GBWD, 1.5)  # the H200's whole backward
        _record(db, key("bwd_dq"), T1, 1.0, env=h100)  # the H100's two kernels: 2.0 in all
        _record(db, key("bwd_dkdv"), T2, 1.0, env=h100)
    plan = Dispatcher([tmp_path / "t.sqlite"], env=h100, arch=SM90).backward(key("bwd_dq"), capturing=False)
    assert "1.5000 ms vs" not in plan.reason, plan.reason  # no H200-vs-H100 comparison
    with TuningDB(tmp_path / "t.sqlite") as db:
        _record(db, key("bwd_dq"), T1, 0.6)  # the H200's two kernels: 1.2, ahead of its 1.5
        _record(db, key("bwd_dkdv"), T2, 0.6)
    plan = Dispatcher([tmp_path / "t.sqlite"], env=h100, arch=SM90).backward(key("bwd_dq"), capturing=False)
    assert not plan.whole and "measured on NVIDIA H200 at attn_bwd_d64_fp16_causal" in plan.reason, plan.reason
    assert "0.6000 + 0.6000" in plan.reason and [c.config for c in plan.choices] == [T1, T2]
    # the H100's own whole backward against its own two kernels only
    with TuningDB(tmp_path / "t.sqlite") as db:
        _record(db, key("bwd"), GBWD, 1.8, env=h100)
    plan = Dispatcher([tmp_path / "t.sqlite"], env=h100, arch=SM90).backward(key("bwd_dq"), capturing=False)
    assert plan.whole and "measured at attn_bwd" in plan.reason and "1.8000 ms vs" in plan.reason, plan.reason
    assert "1.0000 + 1.0000" in plan.reason


GBWD_ORD = dataclasses.replace(GBWD, dq_ordered=1)


def test_dq_ordered_is_a_knob_of_the_gluon_backward():
    # the default stages dQ in fragment order (_dqf) and stores dK, dV by TMA (_kvt); the
    # flags' tags in TileConfig's order
    assert GBWD.id.endswith("_split_dqf_kvt") and GBWD_ORD.id == GBWD.id.removesuffix("_dqf_kvt") + "_dqord_dqf_kvt"
    assert TileConfig.from_dict(GBWD_ORD.as_dict()) == GBWD_ORD
    assert F.bwd_config(GBWD_ORD).dq_mode == "ordered" and F.tile_config(F.bwd_config(GBWD_ORD)) == GBWD_ORD
    assert GLUON.deterministic(GBWD_ORD) and not GLUON.deterministic(GBWD)
    v = Variant(key("bwd").spec, GBWD_ORD)
    assert GLUON.violated_rules(v) == [] and GLUON.estimate(v, SM90).total_bytes == \
        GLUON.estimate(Variant(v.spec, GBWD), SM90).total_bytes
    both = dataclasses.replace(GBWD_ORD, dq_atomic=1)
    assert any("needs dq_atomic=0" in r for r in GLUON.violated_rules(Variant(v.spec, both)))
    # outside the search; `flashgen tune --refine dq_ordered` measures it beside a tuned row
    assert "dq_ordered" not in GLUON.domain(key("bwd")) and \
        GLUON.refine_domain(key("bwd", mask="none")) == {"dq_ordered": (0, 1), "dq_writer": (0, 1)}
    assert GLUON.refine_domain(key("fwd")) == {"cross_tile": (0, 1), "o_in_q": (0, 1), "longest_first": (0, 1),
                                               "masked_first": (0, 1), "skip_masked": (0, 1)}


def test_refine_measures_the_longest_first_twin_of_a_forward_tile(tmp_path):
    """The forward's longest_first: one program per tile, under a mask, a row of its own
    (``_lpt``); the walks (persistent 2, 3) are longest first already."""
    k = key("fwd", "bfloat16", 128)
    best = F.tile_config(C.GluonFwdConfig(num_stages=2, pin_exps=True))
    twin = dataclasses.replace(best, longest_first=1)
    assert twin.id == best.id + "_lpt" and TileConfig.from_dict(twin.as_dict()) == twin
    assert F.fwd_config(twin).longest_first and F.tile_config(F.fwd_config(twin)) == twin
    assert GLUON.violated_rules(Variant(k.spec, twin)) == []
    walk = dataclasses.replace(twin, persistent=2)
    assert any("walks take their tiles longest first" in r for r in GLUON.violated_rules(Variant(k.spec, walk)))
    with TuningDB(tmp_path / "t.sqlite") as db:
        _record(db, k, best, 0.5)
        assert tuner.refine_configs(k, db, H200, SM90, ["longest_first"], ["gluon"]) == [(best, [twin])]
        _record(db, k, dataclasses.replace(best, persistent=2), 0.4)  # a walk: no twin
        assert tuner.refine_configs(k, db, H200, SM90, ["longest_first"], ["gluon"])[0][1] == []


def test_refine_measures_the_masked_first_twin_of_a_forward_tile(tmp_path):
    """The forward's masked_first: under a causal or window mask, the tile's key tiles
    last to first, a row of its own (``_mf``) that round-trips; every program layout
    (one per tile and the walks), not without a mask and not with cross_tile."""
    k = key("fwd", "bfloat16", 128)
    best = F.tile_config(C.GluonFwdConfig(num_consumers=1, BLOCK_N=64, consumer_regs=232, ctas_per_sm=2, persistent=3,
                                          o_in_q=True))
    twin = dataclasses.replace(best, masked_first=1)
    assert twin.id == best.id.replace("_oq", "_oq_mf") and TileConfig.from_dict(twin.as_dict()) == twin
    assert F.fwd_config(twin).masked_first and F.tile_config(F.fwd_config(twin)) == twin
    assert GLUON.violated_rules(Variant(k.spec, twin)) == []
    assert any("masked_first with mask 'none'" in r for r in GLUON.violated_rules(
        Variant(key("fwd", "bfloat16", 128, mask="none").spec, twin)))
    assert any("0 (off) or 1" in r for r in GLUON.violated_rules(Variant(k.spec, dataclasses.replace(twin,
                                                                                                       masked_first=2))))
    xtile = F.tile_config(C.GluonFwdConfig(persistent=3, cross_tile=True, masked_first=True))
    assert any("cross_tile" in r for r in GLUON.violated_rules(Variant(k.spec, xtile)))
    _assert_refined_into(tmp_path / "t.sqlite", k, best, twin, "masked_first")


def test_refine_measures_the_skip_masked_twin_of_a_forward_tile(tmp_path):
    """The forward's skip_masked (``_skip``): a mode of masked_first with two or three
    consumers, measured beside a tuned masked_first row, and reached from a one-consumer
    row when the consumer count and programs per SM are refined with it."""
    k = key("fwd", "bfloat16", 128)
    best = F.tile_config(C.GluonFwdConfig(BLOCK_N=64, persistent=2, masked_first=True))
    twin = dataclasses.replace(best, skip_masked=1)
    assert twin.id == best.id + "_skip" and TileConfig.from_dict(twin.as_dict()) == twin
    assert F.fwd_config(twin).skip_masked and F.tile_config(F.fwd_config(twin)) == twin
    assert GLUON.violated_rules(Variant(k.spec, twin)) == []
    assert any("skip_masked with masked_first=False" in r for r in GLUON.violated_rules(
        Variant(k.spec, dataclasses.replace(twin, masked_first=0))))
    _assert_refined_into(tmp_path / "t.sqlite", k, best, twin, "skip_masked")
    one = F.tile_config(C.GluonFwdConfig(num_consumers=1, BLOCK_N=64, consumer_regs=232, ctas_per_sm=2, persistent=2,
                                         masked_first=True))
    with TuningDB(tmp_path / "t2.sqlite") as db:
        _record(db, k, one, 0.5)
        (start, cands), = tuner.refine_configs(k, db, H200, SM90, ["skip_masked", "num_warps", "ctas_per_sm"],
                                               ["gluon"])
        assert start == one and twin in cands and all(c.num_warps > 4 for c in cands if c.skip_masked)


def test_refine_measures_the_longest_first_twin_of_a_masked_backward(tmp_path):
    """longest_first: a refinement knob of the masked backward (its grid's order), a row
    of its own (``_lpt``) that round-trips; not without a mask, not with the ordered dQ."""
    k = key("bwd", "bfloat16", 128)
    best = F.tile_config(B.default_config(128, "bfloat16", "causal"))
    twin = dataclasses.replace(best, longest_first=1)
    assert twin.id == best.id + "_lpt" and TileConfig.from_dict(twin.as_dict()) == twin
    assert F.bwd_config(twin).longest_first and F.tile_config(F.bwd_config(twin)) == twin
    assert GLUON.refine_domain(k) == {"dq_ordered": (0, 1), "dq_writer": (0, 1), "longest_first": (0, 1)}
    assert "longest_first" not in GLUON.domain(k)
    assert GLUON.violated_rules(Variant(k.spec, twin)) == []
    assert any("without a mask" in r for r in GLUON.violated_rules(Variant(key("bwd", "bfloat16", 128, mask="none").spec,
                                                                             twin)))
    assert any("0 (off) or 1" in r for r in GLUON.violated_rules(Variant(k.spec, dataclasses.replace(twin,
                                                                                                       longest_first=2))))
    _assert_refined_into(tmp_path / "t.sqlite", k, best, twin, "longest_first")


def test_refine_measures_the_dq_writer_twins_of_a_backward(tmp_path):
    """dq_writer (``_dqw``): a refinement knob of the backward, a row of its own that
    round-trips; refined with dq_ordered around a tuned row it gives the writer twin of
    the tile and of its ordered twin (a deterministic backward)."""
    k = key("bwd", "bfloat16", 128)
    best = F.tile_config(B.default_config(128, "bfloat16", "causal"))
    twin = dataclasses.replace(best, dq_writer=1)
    assert twin.id == best.id + "_dqw" and TileConfig.from_dict(twin.as_dict()) == twin
    assert F.bwd_config(twin).dq_writer and F.tile_config(F.bwd_config(twin)) == twin
    assert GLUON.violated_rules(Variant(k.spec, twin)) == []
    assert "dq_writer" not in GLUON.domain(k)
    assert any("0 (off) or 1" in r for r in GLUON.violated_rules(Variant(k.spec, dataclasses.replace(twin,
                                                                                                       dq_writer=2))))
    assert any("dq_writer issues TMA reduce-adds" in r for r in GLUON.violated_rules(
        Variant(k.spec, dataclasses.replace(twin, dq_atomic=1, kv_store=0))))
    _assert_refined_into(tmp_path / "t.sqlite", k, best, twin, "dq_writer")
    ordered = dataclasses.replace(best, dq_ordered=1)
    with TuningDB(tmp_path / "t2.sqlite") as db:
        _record(db, k, best, 0.5)
        (start, cands), = tuner.refine_configs(k, db, H200, SM90, ["dq_ordered", "dq_writer"], ["gluon"])
        assert start == best and set(cands) == {twin, ordered, dataclasses.replace(ordered, dq_writer=1)}
    # the ordered writer twin is a bitwise-repeatable backward, the unordered one is not
    assert GLUON.deterministic(dataclasses.replace(ordered, dq_writer=1)) and not GLUON.deterministic(twin)


def test_refine_measures_the_cross_tile_twin_of_a_walk_of_3(tmp_path):
    walk3 = F.tile_config(C.GluonFwdConfig(num_consumers=1, BLOCK_N=64, num_stages=3, consumer_regs=136,
                                           producer_regs=24, persistent=3, ctas_per_sm=3))
    twin = dataclasses.replace(walk3, cross_tile=1)
    assert twin.id == walk3.id.replace("_x3", "_xtile_x3") and TileConfig.from_dict(twin.as_dict()) == twin
    assert F.fwd_config(twin).cross_tile and F.tile_config(F.fwd_config(twin)) == twin
    assert GLUON.violated_rules(Variant(key().spec, twin)) == []
    assert "cross_tile" not in GLUON.domain(key())  # outside the search
    with TuningDB(tmp_path / "t.sqlite") as db:
        _record(db, key(), walk3, 0.2)
        assert tuner.refine_configs(key(), db, H200, SM90, ["cross_tile"], ["gluon"]) == [(walk3, [twin])]
        # a row that is not a walk of 3 has no twin
        _record(db, key(), GFWD, 0.1)
        assert tuner.refine_configs(key(), db, H200, SM90, ["cross_tile"], ["gluon"]) == [(GFWD, [])]


def test_reconcile_moves_the_dk_dv_stores_only_where_they_alone_block_a_neighbour():
    """Refining knobs around a tuned backward row: a neighbour that the TMA stores of dK
    and dV alone make invalid takes the register stores, the unsplit neighbour of a
    group-split row takes the TMA stores where they are valid, and nothing moves when
    kv_store is refined itself or the config is a forward's."""
    k128 = key("bwd", "bfloat16", 128, shape=Shape(1, 8, 2, 64, 64))
    kvt = F.tile_config(B.default_config(128, "bfloat16", "causal"))
    assert kvt.kv_store == 1 and not GLUON.violated_rules(Variant(k128.spec, kvt))

    def rec(cfg, best, knobs, k=k128):
        return GLUON.reconcile(k, cfg, best, knobs)

    split = dataclasses.replace(kvt, group_split=2)
    assert rec(split, kvt, ("group_split",)) == dataclasses.replace(split, kv_store=0)
    atomic = dataclasses.replace(kvt, dq_atomic=1, dq_stage=0)
    assert rec(atomic, kvt, ("dq_atomic", "dq_stage")) == dataclasses.replace(atomic, kv_store=0)
    # refined itself: left to the rules
    assert rec(split, kvt, ("group_split", "kv_store")) == split
    # the unsplit neighbour of a split row: the TMA stores where valid, else as it was
    split_ptr = dataclasses.replace(kvt, group_split=2, kv_store=0)
    unsplit = dataclasses.replace(split_ptr, group_split=0)
    assert rec(unsplit, split_ptr, ("group_split",)) == kvt
    split_atomic = dataclasses.replace(split_ptr, dq_atomic=1, dq_stage=0)
    unsplit_atomic = dataclasses.replace(split_atomic, group_split=0)
    assert rec(unsplit_atomic, split_atomic, ("group_split",)) == unsplit_atomic
    assert not GLUON.violated_rules(Variant(k128.spec, unsplit_atomic))
    # a forward config is never touched
    fwd = F.tile_config(C.default_config(F.fwd_spec(key("fwd", "bfloat16", 64))))
    assert rec(fwd, fwd, ("ctas_per_sm",), key("fwd", "bfloat16", 64)) == fwd


def _admitted(k) -> set:
    """Every knob combination of the family's domain for ``k`` that its rules admit."""
    import itertools

    dom = GLUON.domain(k)
    admitted = set()
    for values in itertools.product(*dom.values()):
        cfg = TileConfig(**dict(zip(dom, values)), family="gluon")
        if not GLUON.violated_rules(Variant(k.spec, cfg)):
            admitted.add(cfg)
    return admitted


@pytest.mark.parametrize("d,mask", [(256, "causal"), (256, "none"), (128, "window")])
def test_backward_domain_filtered_by_the_rules_is_the_search_space(d, mask):
    """Every knob combination of the backward's domain that the rules admit is a config of
    :func:`.bwd.search_space` and back; at head_dim 256 that is the column-split program
    (``dq_chunks`` > 0), whose TileConfig round-trips."""
    k = key("bwd", "bfloat16", d, mask=mask)
    admitted = _admitted(k)
    assert admitted == {F.tile_config(c) for c in B.search_space(d, "bfloat16", mask)}
    assert all((c.dq_chunks > 0) == (d == 256) for c in admitted)
    for c in admitted:
        assert F.tile_config(F.bwd_config(c)) == c
    if d == 256:
        assert F.tile_config(B.default_config(256)).id == "gluon_m64_n64_w8_s2_kvt_cs4"
        assert GLUON.refine_domain(k) == {}  # no dq_ordered, dq_writer or longest_first there
        # dQ by atomics takes the register stores of dK and dV here (the TMA stores unchecked on the GPU)
        assert not any(c.dq_atomic and c.kv_store for c in admitted)
        # lookahead: the domain holds the values checked on the GPU, and a TileConfig of
        # every value round-trips (the database's column)
        assert GLUON.domain(k)["lookahead"] == B.CHECKED_LOOKAHEADS
        assert {c.lookahead for c in admitted} == set(B.CHECKED_LOOKAHEADS)
        for c in B.col_split_space(d, "bfloat16", mask, unchecked=True):
            tc = F.tile_config(c)
            assert F.bwd_config(tc) == c and tc.lookahead == c.lookahead
            assert (f"_la{c.lookahead}" in tc.id) == bool(c.lookahead)


@pytest.mark.parametrize("d,mask", [(64, "causal"), (128, "none")])
def test_forward_domain_filtered_by_the_rules_is_the_search_space(d, mask):
    """Every knob combination of the forward's domain that the rules admit is a config of
    :func:`.config.space` and back (three programs per SM included: their register
    budget is the family's default split, as the TileConfig stores 0)."""
    k = key("fwd", "bfloat16", d, mask=mask)
    admitted = _admitted(k)
    assert admitted == {F.tile_config(c) for c in C.space(F.fwd_spec(k))}
    assert any(c.ctas_per_sm == 3 for c in admitted) == (d == 64)


@pytest.mark.parametrize("ordered_ms, whole", [(1.8, True), (2.2, False)])
def test_deterministic_backward_takes_an_ordered_row_measured_ahead_of_the_two_kernels(tmp_path, ordered_ms, whole):
    with TuningDB(tmp_path / "t.sqlite") as db:
        _record(db, key("bwd_dq"), T1, 1.0)
        _record(db, key("bwd_dkdv"), T2, 1.0)
        _record(db, key("bwd"), GBWD, 1.5)
        _record(db, key("bwd"), GBWD_ORD, ordered_ms)
        assert {TileConfig.from_dict(r).id for r in db.best_rows(key_contains="attn_bwd_d")} == {
            T1.id, T2.id, GBWD.id, GBWD_ORD.id}  # the best row and the best repeatable one
    d = Dispatcher([tmp_path / "t.sqlite"], env=H200, arch=SM90)
    plan = d.backward(key("bwd_dq"), capturing=False)
    assert plan.whole and plan.choices[0].config == GBWD and not plan.repeatable
    det = d.backward(key("bwd_dq"), deterministic=True, capturing=False)
    assert det.repeatable and det.whole is whole and "measured at attn_bwd_d64_fp16_causal" in det.reason
    if whole:
        assert det.choices[0].config == GBWD_ORD and det.reason.startswith("deterministic: dQ added in a fixed order")
    else:
        assert [c.config for c in det.choices] == [T1, T2] and det.family == "triton"
        assert det.reason.startswith("deterministic: dQ by a separate pass") and f"{ordered_ms:.4f}" in det.reason
    # a CUDA graph capture that misses the memo reads no database: the two kernels
    fresh = Dispatcher([tmp_path / "t.sqlite"], env=H200, arch=SM90)
    assert not fresh.backward(key("bwd_dq"), deterministic=True, capturing=True).whole


def test_deterministic_backward_needs_a_measured_repeatable_row(tmp_path, monkeypatch):
    """Without an ordered row, or without the two kernels' rows to compare it with, the
    deterministic backward is the two kernels; an ordered row of the nearest bucket
    counts like the key's own."""
    with TuningDB(tmp_path / "a.sqlite") as db:
        _record(db, key("bwd_dq"), T1, 1.0)
        _record(db, key("bwd_dkdv"), T2, 1.0)
        _record(db, key("bwd"), GBWD, 1.5)
    det = Dispatcher([tmp_path / "a.sqlite"], env=H200, arch=SM90).backward(
        key("bwd_dq"), deterministic=True, capturing=False)
    assert not det.whole and "no whole-backward row measured bitwise repeatable" in det.reason
    with TuningDB(tmp_path / "b.sqlite") as db:
        _record(db, key("bwd"), GBWD_ORD, 0.5)
    det = Dispatcher([tmp_path / "b.sqlite"], env=H200, arch=SM90).backward(
        key("bwd_dq"), deterministic=True, capturing=False)
    assert not det.whole and "without a two-kernel row of its bucket" in det.reason
    monkeypatch.setattr(F, "DEFAULT_MIN_FLOPS", {"fwd": 0, "bwd": 0})  # rows of another bucket count
    near = Shape(2, 4, 4, 1024, 1024)
    with TuningDB(tmp_path / "c.sqlite") as db:
        for kernel, cfg, ms in (("bwd_dq", T1, 1.0), ("bwd_dkdv", T2, 1.0), ("bwd", GBWD_ORD, 1.2)):
            _record(db, key(kernel, shape=near), cfg, ms)
    det = Dispatcher([tmp_path / "c.sqlite"], env=H200, arch=SM90).backward(
        key("bwd_dq", shape=Shape(2, 4, 4, 1500, 1500)), deterministic=True, capturing=False)
    assert det.whole and det.choices[0].config == GBWD_ORD and det.choices[0].source == "nearest"


def test_refine_measures_the_ordered_dq_beside_the_tuned_row(tmp_path):
    env = H200
    with TuningDB(tmp_path / "t.sqlite") as db:
        _record(db, key("bwd"), GBWD, 1.5)
        starts = tuner.refine_configs(key("bwd"), db, env, SM90, ["dq_ordered"], ["gluon"])
    assert starts == [(GBWD, [GBWD_ORD])]


BIG = Shape(4, 32, 32, 8192, 8192)  # enough work to hide a Gluon launch's host time


def test_untuned_defaults_follow_the_measurements():
    d = Dispatcher([], env=H200, arch=SM90)
    # too little work to hide the Gluon launch's host time: the Triton defaults
    assert d.choose(key(), capturing=False).family == "triton"
    assert not d.backward(key("bwd_dq", d=128, mask="none"), capturing=False).whole
    assert not d.backward(key("bwd_dq", d=128, shape=Shape(2, 16, 16, 2048, 2048)), capturing=False).whole
    fwd = d.choose(key(shape=BIG), capturing=False)
    assert fwd.family == "gluon" and fwd.source == "default" and "gluon_fwd" in fwd.note
    # head dims whose Gluon default was timed against the Triton family's tuned forward
    # (the head-dims preset) take it; those checked for but never timed keep the portable one
    for d_ in (96, 256):
        assert d.choose(key(d=d_, shape=BIG), capturing=False).family == "gluon", d_
    for d_, dv_ in ((192, 192), (128, 64)):
        assert d.choose(key(d=d_, dv=dv_, shape=BIG), capturing=False).family == "triton", (d_, dv_)
    for k, whole in ((key("bwd_dq", d=128, mask="none", shape=BIG), True),
                     (key("bwd_dq", d=64, mask="causal", shape=BIG), True),
                     (key("bwd_dq", d=96, mask="causal", shape=BIG), True),
                     (key("bwd_dq", d=64, mask="none", shape=BIG), False),
                     (key("bwd_dq", d=128, mask="window", shape=BIG), False)):
        plan = d.backward(k, capturing=False)
        assert plan.whole is whole, (k.id, plan.reason)
        assert (("gluon_bwd" if k.spec.head_dim != 96 else "tuning/head-dims") in plan.reason) if whole \
            else ("no measurement puts the gluon backward" in plan.reason)
    # where Gluon does not serve: the Triton family, with its reason
    for arch in (by_sm("sm_80"), INTERPRETER):
        d = Dispatcher([], env=H200, arch=arch)
        assert d.choose(key(), capturing=False).family == "triton"
        plan = d.backward(key("bwd_dq", d=128, mask="none"), capturing=False)
        assert not plan.whole and "gluon does not serve the whole backward" in plan.reason
    plan = Dispatcher([], env=H200, arch=SM90).backward(key("bwd_dq", mods="bias"), capturing=False)
    assert not plan.whole and "score modifications" in plan.reason


# -- the runtime path: deterministic backward, fallback --------------------------------

class Recorder:
    """The Gluon family's launchers replaced by the float32 reference (and a log)."""

    def __init__(self, fail=False):
        self.calls, self.fail = [], fail

    def launcher(self, name):
        def fwd(q, k, v, *, softmax_scale, mask, diag_lo, diag_hi, config, module=None, addressable=False,
                mods=None, out=None, lse=None):
            self.calls.append(("fwd", config))
            if self.fail:
                raise RuntimeError("simulated Gluon build failure")
            return library.reference_forward(q, k, v, softmax_scale, diag_lo, diag_hi)

        def bwd(do, q, k, v, o, lse, *, softmax_scale, mask, diag_lo, diag_hi, config, module=None,
                addressable=False, mods=None, **out):
            self.calls.append(("bwd", config))
            if self.fail:
                raise RuntimeError("simulated Gluon build failure")
            dq, dk, dv = library.reference_backward(do, q, k, v, softmax_scale, diag_lo, diag_hi)
            return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

        return {"fwd": fwd, "bwd": bwd}[name]


@pytest.fixture
def sm90(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(GLUON, "launcher", rec.launcher)
    monkeypatch.setattr(GLUON, "load", lambda v: f"module of {v.id}")
    monkeypatch.setattr(dispatch, "_failed", {})
    # the interpreter's tiny inputs stand for a problem large enough for the Gluon defaults
    monkeypatch.setattr(F, "DEFAULT_MIN_FLOPS", {"fwd": 0, "bwd": 0})
    dispatch.set_default_dispatcher(Dispatcher([], env=H200, arch=SM90))
    yield rec
    dispatch.set_default_dispatcher(None)


def _inputs(d=64):
    torch.manual_seed(0)
    return [torch.randn(1, 2, 64, d, dtype=torch.float16, requires_grad=True) for _ in range(3)]


def _run(deterministic=None, d=64):
    q, k, v = _inputs(d)
    flashgen.attention(q, k, v, causal=True, deterministic=deterministic).float().square().sum().backward()
    return q.grad, k.grad, v.grad


def test_deterministic_selects_the_two_kernels(sm90):
    _run()  # default: Gluon forward and (d64 causal: measured ahead) Gluon backward
    assert [c[0] for c in sm90.calls] == ["fwd", "bwd"]
    sm90.calls.clear()
    g = _run(deterministic=True)  # forward Gluon, backward the Triton kernels (interpreter)
    assert [c[0] for c in sm90.calls] == ["fwd"]
    assert all(torch.equal(a, b) for a, b in zip(g, _run(deterministic=True)))  # bitwise repeatable
    sm90.calls.clear()
    torch.use_deterministic_algorithms(True)
    try:
        assert library.deterministic_backward(None) is True
        _run()
        assert [c[0] for c in sm90.calls] == ["fwd"]
        sm90.calls.clear()
        _run(deterministic=False)  # an explicit False wins over torch's flag
        assert [c[0] for c in sm90.calls] == ["fwd", "bwd"]
    finally:
        torch.use_deterministic_algorithms(False)
    assert library.deterministic_backward(None) is False
    q, k, v = _inputs()
    e = str(explain(q, k, v, causal=True, dispatcher=dispatch.default_dispatcher(), deterministic=True))
    assert "backward: triton bwd_dq + bwd_dkdv, bitwise repeatable; deterministic=True" in e
    e = str(explain(q, k, v, causal=True, dispatcher=dispatch.default_dispatcher()))
    assert "backward: gluon whole backward (bwd), not bitwise repeatable" in e and "kernel family gluon" in e
    with pytest.raises(flashgen.InputError, match="deterministic must be None or a bool"):
        flashgen.attention(q, k, v, deterministic=1)


def test_build_failure_falls_back_with_one_warning(sm90):
    sm90.fail = True
    q, k, v = _inputs()
    ref = reference.forward(q.detach(), k.detach(), v.detach(), causal=True)[0]
    with pytest.warns(UserWarning, match="failed to build or launch.*simulated Gluon build failure") as w:
        q2, k2, v2 = _inputs()
        flashgen.attention(q2, k2, v2, causal=True).float().sum().backward()
    assert len([x for x in w if "failed to build" in str(x.message)]) == 2  # the fwd and the bwd variant
    assert {c[0] for c in sm90.calls} == {"fwd", "bwd"} and len(dispatch._failed) == 2
    sm90.calls.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # once per variant per process
        with torch.no_grad():
            out = flashgen.attention(q, k, v, causal=True)
    assert sm90.calls == [] and (out.double() - ref).abs().max().item() < 2e-3
    assert dispatch.default_dispatcher().choose(key(), capturing=False).family == "triton"


def test_a_launch_limit_sends_that_call_to_the_two_kernels_only(sm90, monkeypatch):
    """A whole backward whose grid these sizes exceed (LaunchLimitError, e.g. batch *
    num_kv_heads over CUDA's 65535 programs on the grid's second axis): that call runs
    the Triton family's bwd_dq + bwd_dkdv, exact, without a warning, and the variant is
    not marked failed, so the next call takes it again."""
    from flashgen.errors import LaunchLimitError

    wide = {"on": True}
    bwd = sm90.launcher("bwd")

    def launcher(name):
        if name != "bwd":
            return sm90.launcher(name)

        def limited(*a, **kw):
            if wide["on"]:
                sm90.calls.append(("bwd", kw["config"]))
                raise LaunchLimitError("simulated: programs per key block over CUDA's grid limit 65535")
            return bwd(*a, **kw)
        return limited

    monkeypatch.setattr(GLUON, "launcher", launcher)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        g = _run()
    want = _run(deterministic=True)  # the two kernels
    assert [c[0] for c in sm90.calls] == ["fwd", "bwd", "fwd"] and dispatch._failed == {}
    assert all(torch.equal(a, b) for a, b in zip(g, want))
    wide["on"] = False
    sm90.calls.clear()
    _run()
    assert [c[0] for c in sm90.calls] == ["fwd", "bwd"]


def test_load_failure_falls_back(sm90, monkeypatch):
    def broken(v):
        raise ImportError("gluon kernel does not build here")

    monkeypatch.setattr(GLUON, "load", broken)
    q, k, v = _inputs()
    with pytest.warns(UserWarning, match="does not build here"):
        with torch.no_grad():
            flashgen.attention(q, k, v, causal=True)
    assert sm90.calls == []


# -- the tuner, the DB and explain ------------------------------------------------------

def test_tuner_writes_gluon_rows_that_round_trip(tmp_path):
    items = [(key(k, d=128, mask="none", shape=Shape(1, 2, 2, 128, 128)), Shape(1, 2, 2, 128, 128))
             for k in ("fwd", "bwd", "bwd_dq", "bwd_dkdv")]
    fast_bwd = F.tile_config(B.GluonBwdConfig(64, 64, 2, 3, "atomic", 240, 24, "producer", 1, False))
    timings = {Variant(items[1][0].spec, fast_bwd).id: 0.5}
    bench_ = tuner.FakeBenchmarker(timings, default=1.0)
    with TuningDB(tmp_path / "t.sqlite") as db:
        assert list(tuner.search_space(items[0][0], SM90)) == ["triton", "gluon"]
        assert list(tuner.search_space(items[0][0], SM90, ("gluon",))) == ["gluon"]
        assert tuner.servable(items, SM90, ("gluon",)) == items[:2]
        grid = len(families.configs(GLUON, items[0][0]))  # the larger of the two grids
        res = tuner.tune(items[:2], benchmarker=bench_, db=db, env=H200, arch=SM90, n_trials=grid,
                         sampler="grid", family_names=("gluon",))
        assert all(v.startswith("attn_fwd_d128_fp16_none_gluon_") or v.startswith("attn_bwd_d128_fp16_none_gluon_")
                   for v in bench_.calls)
        assert res[1].best_config == fast_bwd and res[1].best_median_ms == 0.5
        best = db.best_configs(H200)
        assert best[items[1][0].id][0] == fast_bwd and best[items[1][0].id][1]["family"] == "gluon"
        assert best[items[1][0].id][1]["dq_atomic"] == 1 and best[items[1][0].id][1]["row_load"] == 1
        n_fwd = len([c for c in families.configs(GLUON, items[0][0])
                     if not GLUON.violated_rules(Variant(items[0][0].spec, c))])
        assert len({v for v in bench_.calls if "_fwd_" in v}) == n_fwd  # every valid config once, no invalid one
        # the Triton family's two backward kernels, slower in sum than the Gluon row
        _record(db, items[2][0], T1, 0.4)
        _record(db, items[3][0], T2, 0.3)
        row = db.lookup(items[2][0], Variant(items[2][0].spec, T1).id, H200)
        assert row["consumer_regs"] is None and row["family"] == "triton"  # Triton rows: no Gluon knobs
    d = Dispatcher([tmp_path / "t.sqlite"], env=H200, arch=SM90)
    q, k, v = (torch.empty(1, 2, 128, 128, dtype=torch.float16, device="meta") for _ in range(3))
    e = explain(q, k, v, dispatcher=d)
    assert [c.kernel for c in e.kernels] == ["fwd", "bwd"] and e.kernels[1].config == fast_bwd.id
    assert "gluon bwd 0.5000 ms vs triton bwd_dq + bwd_dkdv 0.4000 + 0.3000 = 0.7000 ms" in e.backward
    assert "kernel family gluon" in str(e) and "triton does not serve it: its backward is two kernels" in str(e)


def test_a_study_measures_each_familys_default_first(tmp_path):
    """At head_dim 192 (tiles of 256) the portable family's default is the study's
    default, and few of the Gluon forward's knob combinations are valid (one consumer's
    registers hold a 64 x 256 float32 O): the Gluon default is measured right after it,
    before any sampled config, so the family is compared at every key (at head_dim 256
    and 96 the search without it had measured no Gluon config in 10 trials)."""
    shape = Shape(4, 8, 4, 4096, 4096)
    k = key("fwd", dtype="bfloat16", d=192, mask="none", shape=shape)
    triton_default, gluon_default = (families.get(n).default_config(k, SM90) for n in ("triton", "gluon"))
    assert tuner.default_config(k, SM90) == triton_default and gluon_default.family == "gluon"
    assert tuner.family_defaults(k, SM90) == [triton_default, gluon_default]
    assert not GLUON.violated_rules(Variant(k.spec, gluon_default))
    bench_ = tuner.FakeBenchmarker({}, default=1.0)
    with TuningDB(tmp_path / "t.sqlite") as db:
        tuner.tune_key(k, shape, benchmarker=bench_, db=db, env=H200, arch=SM90, n_trials=3)
    assert bench_.calls[:2] == [Variant(k.spec, c).id for c in (triton_default, gluon_default)]
    # a family searched alone: its own default, once
    assert tuner.family_defaults(k, SM90, ("gluon",)) == [gluon_default]


def test_configs_that_differ_only_outside_the_search_are_enqueued_once(tmp_path, monkeypatch):
    """A transferred row that is the Gluon default plus a refinement knob (masked_first,
    outside the search) gives the default's params: the study enqueues them once."""
    import optuna

    shape = Shape(4, 8, 4, 4096, 4096)
    k = key("fwd", dtype="bfloat16", d=192, mask="causal", shape=shape)
    gluon_default = families.get("gluon").default_config(k, SM90)
    twin = dataclasses.replace(gluon_default, masked_first=1)
    assert twin != gluon_default
    monkeypatch.setattr(tuner, "transfer_configs", lambda *a, **kw: [twin])
    enqueued = []
    real = optuna.Study.enqueue_trial
    monkeypatch.setattr(optuna.Study, "enqueue_trial",
                        lambda self, params, *a, **kw: (enqueued.append(dict(params)), real(self, params, *a, **kw)))
    with TuningDB(tmp_path / "t.sqlite") as db:
        tuner.tune_key(k, shape, benchmarker=tuner.FakeBenchmarker({}, default=1.0), db=db, env=H200, arch=SM90,
                       n_trials=2)
    assert len(enqueued) == 2 and enqueued[0] != enqueued[1]


# -- the launchers with the arguments bench and the library pass ----------------------

class _Kernel:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def __getitem__(self, grid):
        return lambda *args, **kw: self.log.append((self.name, grid, args, kw))


class _Module:
    NUM_WARPS, MAXNREG = 8, 168

    def __init__(self):
        self.log = []
        for n in ("attn_fwd", "attn_bwd_preprocess", "attn_bwd", "attn_bwd_convert"):
            setattr(self, n, _Kernel(self.log, n))


def test_launchers_take_the_bench_arguments(monkeypatch):
    mod = _Module()
    spec = KernelSpec("fwd", "float16", 128, 128, "causal")
    cfg = GLUON.default_config(key("fwd", d=128), SM90)
    q, k, v, do = bench.make_inputs(spec, Shape(2, 4, 2, 200, 300), device="cpu")
    fn, outs = bench.run_variant(Variant(spec, cfg), q, k, v, do, arch=SM90)
    monkeypatch.setattr("flashgen.families.gluon.render.load", lambda variant: mod)
    checked = []  # the input checks run (their "q is not on a CUDA device" is this machine's)
    monkeypatch.setattr("flashgen.families.gluon.launch.unsupported", lambda *a, **kw: checked.append(kw) or None)
    fn()
    assert checked and checked[0]["mask"] == "causal" and checked[0]["out"] is outs["O"]
    (name, grid, args, kw), = mod.log
    assert name == "attn_fwd" and grid == (-(-200 // 128) * 2 * 4,) and kw == {"num_warps": 8, "maxnreg": 168}
    assert outs["O"].shape == (2, 4, 200, 128) and outs["LSE"].shape == (2, 4, 200)
    assert args[4] is outs["LSE"] and args[6:10] == (-(-200 // 128) * 2 * 4, -(-200 // 128), 4, 2)
    # the whole backward: preprocess, main kernel (one program per 128 key rows and kv head), convert
    bspec = KernelSpec("bwd", "float16", 128, 128, "causal")
    bcfg = GLUON.default_config(key("bwd", d=128), SM90)
    monkeypatch.setattr(B, "load", lambda *a, **kw: mod)
    mod.log.clear()
    fn, outs = bench.run_variant(Variant(bspec, bcfg), q, k, v, do, arch=SM90)
    fn()
    assert [e[0] for e in mod.log] == ["attn_bwd_preprocess", "attn_bwd", "attn_bwd_convert"]
    assert mod.log[1][1] == (-(-300 // 128), 2 * 2)
    assert [outs[n].shape for n in ("dQ", "dK", "dV")] == [q.shape, k.shape, v.shape]


def test_wheel_carries_the_gluon_family_and_templates():
    root = Path(__file__).resolve().parent.parent
    pyproject = tomllib.loads((root / "pyproject.toml").read_text())
    assert "flashgen.families.gluon" in pyproject["tool"]["setuptools"]["packages"]
    assert {"gluon/*.j2", "gluon/*.json"} <= set(pyproject["tool"]["setuptools"]["package-data"]["flashgen.templates"])
    assert {"attn_fwd.py.j2", "attn_bwd.py.j2"} <= {p.name for p in (root / "templates" / "gluon").glob("*.j2")}


def test_a_gluon_build_error_warns_once_through_the_family(monkeypatch):
    """The family's launcher turns a build failure into GluonBuildError (flashgen's
    Gluon build module warns once); the dispatcher then skips the variant without a
    second warning."""
    from flashgen.families.gluon import build

    monkeypatch.setattr(build, "_failed", {})
    monkeypatch.setattr(dispatch, "_failed", {})
    monkeypatch.setattr(GLUON, "load", lambda v: f"module of {v.id}")
    monkeypatch.setattr(F, "DEFAULT_MIN_FLOPS", {"fwd": 0, "bwd": 0})  # tiny inputs take the Gluon default

    def renamed(*a, **kw):
        raise ImportError("cannot import name 'async_copy_global_to_shared'")

    monkeypatch.setattr("flashgen.families.gluon.launch.fwd", renamed)
    dispatch.set_default_dispatcher(Dispatcher([], env=H200, arch=SM90))
    try:
        q, k, v = (t.detach() for t in _inputs())
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            out = flashgen.attention(q, k, v, causal=True)
            out2 = flashgen.attention(q, k, v, causal=True)
        mine = [x for x in w if issubclass(x.category, UserWarning) and "build" in str(x.message)]
        assert len(mine) == 1 and issubclass(mine[0].category, build.GluonFallbackWarning)
        assert "async_copy_global_to_shared" in str(mine[0].message) and len(dispatch._failed) == 1
        ref = reference.forward(q, k, v, causal=True)[0]
        assert (out.double() - ref).abs().max().item() < 2e-3 and torch.equal(out, out2)
    finally:
        dispatch.set_default_dispatcher(None)


def test_the_backward_launcher_takes_an_expanded_do(monkeypatch):
    """autograd hands a sum's gradient as an expanded (stride 0) view: the launcher
    passes the kernels a descriptor-addressable copy instead of failing."""
    seen = {}

    def attention_bwd(do, q, k, v, o, lse, **kw):
        B.check_inputs(do, q, k, v, o, lse)
        seen["do"] = do
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    monkeypatch.setattr(B, "attention_bwd", attention_bwd)
    q, k, v = (torch.randn(1, 2, 64, 64, dtype=torch.float16) for _ in range(3))
    o, lse = torch.randn_like(q), torch.zeros(1, 2, 64)
    do = torch.ones((), dtype=torch.float16).expand_as(q)
    dq, dk, dv = GLUON.launcher("bwd")(do, q, k, v, o, lse, softmax_scale=0.125, mask="none", diag_lo=-64,
                                       diag_hi=64, config=GBWD)
    assert seen["do"].is_contiguous() and torch.equal(seen["do"], do) and dq.shape == q.shape


def test_the_backward_returns_the_layout_of_q_k_v(monkeypatch):
    """For (batch, seqlen, heads, d) inputs seen through .transpose(1, 2) the gradients
    come in q's, k's and v's layout, which is what the op's fake kernel promises
    torch.compile (torch.empty_like): .bwd.launch_args allocates them so
    (test_gluon_bwd.py) and the family returns them as they are, without a copy."""
    made = []

    def attention_bwd(do, q, k, v, o, lse, **kw):
        made.extend(torch.full_like(t, float(i + 1)) for i, t in enumerate((q, k, v)))
        return tuple(made)

    monkeypatch.setattr(B, "attention_bwd", attention_bwd)
    q, k, v = (torch.randn(1, 64, 2, 64, dtype=torch.float16).transpose(1, 2) for _ in range(3))
    o, lse, do = torch.randn(1, 2, 64, 64, dtype=torch.float16), torch.zeros(1, 2, 64), torch.randn_like(q)
    grads = GLUON.launcher("bwd")(do, q, k, v, o, lse, softmax_scale=0.125, mask="none", diag_lo=-64,
                                  diag_hi=64, config=GBWD)
    for g, m, like in zip(grads, made, (q, k, v)):
        assert g is m and g.stride() == torch.empty_like(like).stride() != torch.empty(like.shape).stride()


def test_a_small_key_takes_no_gluon_row_of_another_bucket(tmp_path):
    """Below the work threshold the Gluon launch's host time is not hidden: another
    bucket's Gluon row does not serve a small key (the Triton row of that bucket does),
    and the backward says why; a tuned row of the key itself still counts."""
    with TuningDB(tmp_path / "t.sqlite") as db:
        for kernel, cfg, ms in (("fwd", GFWD, 0.5), ("fwd", T1, 1.0), ("bwd", GBWD, 1.0),
                                ("bwd_dq", T1, 1.0), ("bwd_dkdv", T2, 1.0)):
            _record(db, key(kernel, shape=BIG), cfg, ms)
    d = Dispatcher([tmp_path / "t.sqlite"], env=H200, arch=SM90)
    small = key(shape=Shape(2, 16, 16, 2048, 2048))
    assert not GLUON.large_enough(small) and GLUON.large_enough(key(shape=BIG))
    c = d.choose(small, capturing=False)
    assert (c.config, c.source, c.tuned_key) == (T1, "nearest", key(shape=BIG).id)
    plan = d.backward(key("bwd_dq", shape=Shape(2, 16, 16, 2048, 2048)), capturing=False)
    assert not plan.whole and "too little work" in plan.reason
    assert d.choose(key(shape=BIG), capturing=False).config == GFWD
    assert d.backward(key("bwd_dq", shape=BIG), capturing=False).whole


# -- group_split: the tuner searches it for GQA keys only --------------------------------

GQA = Shape(4, 16, 4, 2048, 2048)


def test_group_split_is_searched_for_gqa_keys_only():
    mha = key("bwd", "bfloat16", 128, shape=Shape(2, 16, 16, 2048, 2048))
    assert "group_split" not in GLUON.domain(mha) and "half_partials" not in GLUON.domain(mha)
    for group, splits in ((4, (0, 2, 4)), (6, (0, 2, 3, 6)), (2, (0, 2))):
        k = key("bwd", "bfloat16", 128, shape=Shape(1, 6 * group if group == 6 else 4 * group, 6 if group == 6
                                                     else 4, 2048, 2048))
        assert k.group == group and GLUON.domain(k)["group_split"] == splits
        assert GLUON.domain(k)["half_partials"] == (0, 1)
        ok = [c for c in families.configs(GLUON, k) if not GLUON.violated_rules(Variant(k.spec, c))]
        assert {F.bwd_config(c) for c in ok} == set(B.search_space(128, "bfloat16", "causal", group))
        assert all(F.tile_config(F.bwd_config(c)) == c for c in ok)
        assert {c.group_split for c in ok} == set(splits)
        assert {c.half_partials for c in ok if c.group_split} == {0, 1}
        assert not any(c.half_partials for c in ok if not c.group_split)  # a rule: no partials without a split
    c = F.tile_config(B.GluonBwdConfig(row_load="tma", group_split=4))
    assert c.group_split == 4 and c.id == "gluon_m64_n64_w8_s2_gs4" and TileConfig.from_dict(c.as_dict()) == c
    assert F.tile_config(B.GluonBwdConfig(row_load="tma")).group_split == 0
    assert "group_split 0 must be a whole number" not in " ".join(GLUON.violated_rules(Variant(key("bwd").spec, c)))
    # a row of another GQA group runs with a split that divides this key's group
    k6 = key("bwd", "bfloat16", 128, shape=Shape(1, 12, 2, 2048, 2048))
    assert GLUON.adapt(c, k6).group_split == 2 and GLUON.adapt(c, key("bwd", shape=GQA)) == c
    assert GLUON.adapt(c, key("bwd", shape=Shape(1, 3, 1, 64, 64))).group_split == 0
    hp = F.tile_config(B.GluonBwdConfig(row_load="tma", group_split=4, half_partials=True))
    assert hp.id == "gluon_m64_n64_w8_s2_hp_gs4" and F.bwd_config(hp).half_partials
    assert GLUON.adapt(hp, k6) == dataclasses.replace(hp, group_split=2)
    assert GLUON.adapt(hp, key("bwd", shape=Shape(1, 3, 1, 64, 64))) == dataclasses.replace(hp, group_split=0,
                                                                                             half_partials=0)


def test_group_split_rows_round_trip_and_explain_says_so(tmp_path):
    k = key("bwd", "bfloat16", 128, shape=GQA)
    gs = F.tile_config(B.GluonBwdConfig(row_load="tma", group_split=2))
    with TuningDB(tmp_path / "t.sqlite") as db:
        db.record(k, GQA, Variant(k.spec, gs), Measurement("ok", median_ms=0.5), H200, 0)
        row = db.lookup(k, Variant(k.spec, gs).id, H200)
        assert row["group_split"] == 2 and row["variant_id"].endswith("_gs2")
        plain = F.tile_config(B.GluonBwdConfig(row_load="tma"))
        db.record(k, GQA, Variant(k.spec, plain), Measurement("ok", median_ms=0.6), H200, 0)
        assert db.lookup(k, Variant(k.spec, plain).id, H200)["group_split"] is None  # NULL at its default
        assert db.best_configs(H200)[k.id][0] == gs
        for kernel, cfg in (("bwd_dq", T1), ("bwd_dkdv", T2)):
            kk = key(kernel, "bfloat16", 128, shape=GQA)
            db.record(kk, GQA, Variant(kk.spec, cfg), Measurement("ok", median_ms=0.4), H200, 0)
    d = Dispatcher([tmp_path / "t.sqlite"], env=H200, arch=SM90)
    q = torch.empty(4, 16, 2048, 128, dtype=torch.bfloat16, device="meta")
    kv = torch.empty(4, 4, 2048, 128, dtype=torch.bfloat16, device="meta")
    e = explain(q, kv, kv, causal=True, dispatcher=d)
    assert e.kernels[1].config == gs.id and "_gs2" in str(e)
    assert "float32 partials of the 2 programs (group_split)" in e.backward
    hp = dataclasses.replace(gs, group_split=4, half_partials=1)
    with TuningDB(tmp_path / "t.sqlite") as db:
        db.record(k, GQA, Variant(k.spec, hp), Measurement("ok", median_ms=0.3), H200, 0)
        row = db.lookup(k, Variant(k.spec, hp).id, H200)
        assert (row["group_split"], row["half_partials"]) == (4, 1) and TileConfig.from_dict(row) == hp
    e = explain(q, kv, kv, causal=True, dispatcher=Dispatcher([tmp_path / "t.sqlite"], env=H200, arch=SM90))
    assert e.kernels[1].config == hp.id and "16-bit partials of the 4 programs" in e.backward


def test_a_database_without_a_group_split_column_reads_as_before(tmp_path):
    """A database written before group_split existed (the shipped one without its split
    rows and columns) reads as it did (the knob at its default), and its first write
    adds the column."""
    import shutil
    import sqlite3

    src = Path(__file__).resolve().parent.parent / "tuning_db" / "h200.sqlite"
    old = tmp_path / "src.sqlite"
    shutil.copy(src, old)
    con = sqlite3.connect(old)
    try:
        cols = {r[1] for r in con.execute("PRAGMA table_info(measurements)")}
        if "group_split" in cols:
            con.execute("DELETE FROM measurements WHERE group_split IS NOT NULL OR half_partials IS NOT NULL")
            con.execute("ALTER TABLE measurements DROP COLUMN group_split")
            con.execute("ALTER TABLE measurements DROP COLUMN half_partials")
            con.commit()
        assert not {"group_split", "half_partials"} & {r[1] for r in con.execute("PRAGMA table_info(measurements)")}
    finally:
        con.close()
    src = old
    dst = tmp_path / "old.sqlite"
    shutil.copy(src, dst)
    with TuningDB(dst) as db:
        before = {k: c for k, (c, _) in db.best_configs(H200).items()}
        k = key("bwd", "bfloat16", 128, shape=GQA)
        gs = F.tile_config(B.GluonBwdConfig(row_load="tma", group_split=4))
        db.record(k, GQA, Variant(k.spec, gs), Measurement("ok", median_ms=0.01), H200, 0)
        assert db.lookup(k, Variant(k.spec, gs).id, H200)["group_split"] == 4
    con = sqlite3.connect(dst)
    try:
        assert {"group_split", "half_partials"} <= {r[1] for r in con.execute("PRAGMA table_info(measurements)")}
    finally:
        con.close()
    with TuningDB(dst, readonly=True) as db:
        after = {kk: c for kk, (c, _) in db.best_configs(H200).items()}
    assert after[k.id] == gs and after[k.id] != before.get(k.id)
    assert {kk: c for kk, c in after.items() if kk != k.id} == {kk: c for kk, c in before.items() if kk != k.id}


def test_the_backward_launches_the_reduction_for_a_split(monkeypatch):
    mod = _Module()
    log = mod.log
    monkeypatch.setattr(B, "load", lambda *a, **kw: mod)
    from flashgen.families.gluon import reduce as R

    monkeypatch.setattr(R, "group_reduce", _Kernel(log, "group_reduce"))
    spec = KernelSpec("bwd", "bfloat16", 128, 128, "causal")
    shape = Shape(2, 8, 2, 200, 300)
    q, k, v, do = bench.make_inputs(spec, shape, device="cpu")
    # run_variant runs the Triton forward (in the interpreter) for the backward's O and
    # LSE: the same inputs for every config below, so the same forward, run once
    real_fwd, fwd_runs = bench.ops.fwd, {}

    def fwd_once(*args, **kw):
        key = (tuple(map(id, args)), repr(kw))
        if key not in fwd_runs:
            fwd_runs[key] = real_fwd(*args, **kw)
        return fwd_runs[key]
    monkeypatch.setattr(bench.ops, "fwd", fwd_once)
    for gs, half, launches in ((1, False, 3), (2, False, 4), (4, False, 4), (4, True, 4)):
        log.clear()
        cfg = F.tile_config(B.GluonBwdConfig(row_load="tma", group_split=gs, half_partials=half))
        fn, outs = bench.run_variant(Variant(spec, cfg), q, k, v, do, arch=SM90)
        fn()
        names = [e[0] for e in log]
        assert names == ["attn_bwd_preprocess", "attn_bwd", "attn_bwd_convert", "group_reduce"][:launches]
        assert log[1][1] == (-(-300 // 128), 2 * 2 * gs) and log[1][2][15] == 2 * gs
        if gs > 1:
            (_, grid, args, kw) = log[3]
            assert grid == R.grid(2, 2, 300, 128) and kw == {"num_warps": R.NUM_WARPS}
            assert args[2] is outs["dK"] and args[3] is outs["dV"] and args[-3] == gs
            assert args[0].shape == (2, 2, gs, 300, 128)
            assert args[0].dtype == (torch.bfloat16 if half else torch.float32)
            assert log[1][2][10] is args[0] and log[1][2][11] is args[1]


def test_checks_of_a_split_variant_take_a_group_it_divides():
    """The float64 checks (``bench.check_variant``, what ``flashgen tune`` precompiles)
    run GQA group 2: a split variant whose group_split does not divide it is checked on
    the least multiple of that group it divides, so its check runs instead of failing on
    the launcher's rule; other variants keep their shapes."""
    spec = KernelSpec("bwd", "bfloat16", 128, 128, "causal")
    for gs, want in ((1, 2), (2, 2), (4, 4), (8, 8), (3, 6)):
        v = Variant(spec, F.tile_config(B.GluonBwdConfig(row_load="tma", group_split=gs)))
        for kv in (1, 2):
            for shape, _ in bench.mask_cases(spec, kv):
                got = bench.check_shape(v, shape)
                assert got == dataclasses.replace(shape, num_heads=want * shape.num_kv_heads)
                q, k, _, _ = bench.make_inputs(spec, got, device="cpu")
                B.launch_args(q, q, k, k, q, torch.zeros(q.shape[:3]), softmax_scale=0.1, diag_lo=-1, diag_hi=1,
                              config=F.bwd_config(v.config))
    shape = Shape(2, 6, 2, 17, 17)
    assert bench.check_shape(Variant(KernelSpec("fwd", "bfloat16", 64, 64, "none"), T1), shape) is shape


def test_checks_of_a_forward_walk_run_several_tiles_per_program():
    """At the checks' small sizes (batch 2, 2 heads per GQA group, seqlen <= 397) every
    program of a Gluon forward walk took one tile, so its later tiles never ran in a
    check; a walk is checked with its heads multiplied to three tiles per program."""
    for mask in ("none", "causal", "window"):
        spec = KernelSpec("fwd", "bfloat16", 128, 128, mask)
        for persistent, consumers, ctas in ((0, 2, 1), (1, 2, 1), (2, 1, 2), (3, 1, 2), (3, 2, 1)):
            if persistent == 1 and mask != "none":
                continue
            cfg = F.tile_config(C.GluonFwdConfig(num_consumers=consumers, persistent=persistent, ctas_per_sm=ctas,
                                                 BLOCK_N=64, num_stages=2))
            v = Variant(spec, cfg)
            for group in (1, 4):
                for shape, _ in bench.mask_cases(spec, group):
                    got = bench.check_shape(v, shape, sm_count=132)
                    if not persistent:
                        assert got == shape
                        continue
                    tiles = got.batch * got.num_heads * -(-got.seqlen_q // (64 * consumers))
                    assert tiles >= 3 * 132 * ctas, (mask, persistent, got)
                    assert got.num_heads * shape.num_kv_heads == shape.num_heads * got.num_kv_heads
                    assert got.seqlen_q == shape.seqlen_q


# -- attention sinks in the Gluon forward ---------------------------------------------------

def test_the_gluon_forward_serves_sinks_alone(monkeypatch):
    """A call with sinks and no score/mask function: the Gluon forward's sinks variant
    serves its fwd key (untuned: no default, no measurement yet), with a code id of its
    own; user score/mask functions go to the ``user`` variant (tests/test_gluon_user.py),
    bias and dropout stay the Triton family's (the sinks' backward is the plain
    backward, either family's)."""
    from types import SimpleNamespace

    from flashgen import user_mods
    from flashgen.families.gluon import launch as L
    from flashgen.families.gluon import render as R

    sinks_low = user_mods.lowering("fwd", None, None, [], True)
    score_low = user_mods.lowering("fwd", user_mods.trace(lambda s, b, h, q, kv: s * 2, "score"), None, [], True)
    k_sinks = key("fwd", d=128, mods=sinks_low.name, shape=BIG)
    assert F.sinks_only(sinks_low.name) and not F.sinks_only(score_low.name) and not F.sinks_only("softcap")
    assert GLUON.unsupported(k_sinks, SM90) is None and F.fwd_spec(k_sinks).sinks
    assert "Triton family's" in GLUON.unsupported(key("fwd", d=128, mods="bias"), SM90)
    assert GLUON.unsupported(key("fwd", d=128, mods=score_low.name), SM90) is None
    assert GLUON.prefers_default(k_sinks, SM90) is None and GLUON.prefers_default(key("fwd", d=128, shape=BIG), SM90)
    assert Dispatcher([], env=H200, arch=SM90).choose(k_sinks, capturing=False).family == "triton"
    # untuned, it takes the plain problem's tiles of the portable family only (the Gluon
    # row of the plain key is faster, but the sinks variant was never checked there)
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        with TuningDB(Path(tmp) / "t.sqlite") as db:
            plain = key("fwd", d=128, shape=BIG)
            _record(db, plain, T1, 1.0)
            _record(db, plain, GFWD, 0.5)
        d = Dispatcher([Path(tmp) / "t.sqlite"], env=H200, arch=SM90)
        assert d.choose(plain, capturing=False).config == GFWD
        c = d.choose(k_sinks, capturing=False)
        assert (c.config, c.source) == (T1, "nearest"), c
    assert GLUON.template_hash("fwd", sinks_low.name) == "g" + R.user_code_id()[1:] != GLUON.template_hash("fwd")
    cfg = GLUON.default_config(k_sinks, SM90)
    assert "_sinks_" in GLUON.render(Variant(k_sinks.spec, cfg)).split("VARIANT_ID = ")[1].split("\n")[0]
    seen = {}
    monkeypatch.setattr(L, "fwd", lambda *a, **kw: seen.update(kw) or ("O", "LSE"))
    q = torch.zeros(1, 2, 16, 128, dtype=torch.bfloat16)
    sinks = torch.tensor([0.5, 1.0, 2.0, 3.0])[::2]  # a strided (num_heads,) view: made contiguous
    args = SimpleNamespace(name=sinks_low.name, sinks=sinks)
    assert F.fwd(q, q, q, softmax_scale=0.1, mask="none", diag_lo=-16, diag_hi=16, config=cfg, mods=args) == \
        ("O", "LSE")
    assert seen["sinks"].is_contiguous() and torch.equal(seen["sinks"], torch.tensor([0.5, 2.0]))
    with pytest.raises(ValueError, match="Triton family's"):
        F.fwd(q, q, q, softmax_scale=0.1, mask="none", diag_lo=-16, diag_hi=16, config=cfg,
              mods=SimpleNamespace(name="bias", sinks=None))


def test_a_whole_backward_row_alone_is_named_in_the_reason(tmp_path):
    """A Gluon bwd row with no bwd_dq / bwd_dkdv rows of its bucket is not compared with
    anything; the reason names the row instead of calling the key untuned."""
    with TuningDB(tmp_path / "t.sqlite") as db:
        _record(db, key("bwd"), GBWD, 1.5)
    plan = Dispatcher([tmp_path / "t.sqlite"], env=H200, arch=SM90).backward(key("bwd_dq"), capturing=False)
    assert not plan.whole and "has no bwd_dq + bwd_dkdv rows of its bucket" in plan.reason, plan.reason
    assert "untuned" not in plan.reason


def test_the_forward_switches_take_0_or_1_only():
    # pin and snake are switches: another value would give a second id for one kernel
    base = TileConfig(64, 128, 8, 2, family="gluon", persistent=2)
    k = key("fwd", "bfloat16", 128, mask="causal")
    assert GLUON.violated_rules(Variant(k.spec, dataclasses.replace(base, snake=1))) == []
    assert GLUON.violated_rules(Variant(k.spec, dataclasses.replace(base, serial_masked=1))) == []
    for name in ("pin", "snake", "serial_masked"):
        bad = dataclasses.replace(base, **{name: 2})
        assert f"{name}=2: 0 (off) or 1 (on)" in GLUON.violated_rules(Variant(k.spec, bad))


def test_refining_consumers_leaves_programs_per_sm_that_only_one_consumer_fits(tmp_path):
    """A one-consumer row of three programs per SM refined in num_warps, BLOCK_N and
    serial_masked reaches FlashAttention-3's head_dim 64 causal tile (three consumers,
    BLOCK_N 128, one program per SM), which only the serial masked tiles fit."""
    k = key("fwd", "bfloat16", 64, mask="causal")
    x3 = TileConfig(64, 64, 4, 3, family="gluon", persistent=3, ctas_per_sm=3)
    with TuningDB(tmp_path / "t.sqlite") as db:
        _record(db, k, x3, 0.15)
        [(best, cands)] = tuner.refine_configs(k, db, H200, SM90, ["serial_masked", "num_warps", "BLOCK_N"], ["gluon"])
    assert best == x3
    fa3 = TileConfig(64, 128, 12, 3, family="gluon", persistent=3, serial_masked=1)
    assert fa3 in cands and dataclasses.replace(fa3, serial_masked=0) not in cands
    assert dataclasses.replace(x3, serial_masked=1) in cands  # the row's own serial twin, still three per SM
    assert all(not GLUON.violated_rules(Variant(k.spec, c)) for c in cands)
    # refined in ctas_per_sm too, the knob is not moved
    with TuningDB(tmp_path / "t.sqlite") as db:
        [(_, both)] = tuner.refine_configs(k, db, H200, SM90, ["num_warps", "ctas_per_sm"], ["gluon"])
    assert all(c.num_warps == 4 for c in both if c.ctas_per_sm)


# -- ragged batches (fwd_varlen) ------------------------------------------------------------

def test_the_gluon_forward_serves_ragged_batches_on_sm90_only():
    k = key("fwd_varlen", "bfloat16", 128, mask="causal")
    assert GLUON.unsupported(k, SM90) is None and "fwd_varlen" in GLUON.kernels
    assert "Triton's interpreter" in GLUON.unsupported(k, INTERPRETER)
    assert "this is sm_80" in GLUON.unsupported(k, by_sm("sm_80"))
    assert "the Gluon forward is built for" in GLUON.unsupported(key("fwd_varlen", d=80), SM90)
    # its rows carry their own code id; untuned keys take its default where it measured ahead
    assert GLUON.template_hash("fwd_varlen") not in (GLUON.template_hash("fwd"), GLUON.template_hash("bwd"))
    for mask, n, ahead in (("causal", 4096, True), ("causal", 1024, False), ("none", 1024, True),
                           ("none", 512, False), ("window", 4096, False)):
        k = key("fwd_varlen", "bfloat16", 128, mask=mask, shape=Shape(16384 // n * 4, 32, 8, n, n))
        assert GLUON.large_enough(k) and (GLUON.prefers_default(k, SM90) is not None) == ahead, (mask, n)
    d64 = key("fwd_varlen", "bfloat16", 64, mask="none", shape=Shape(16, 32, 8, 4096, 4096))
    assert GLUON.prefers_default(d64, SM90) is None  # not timed
    assert F.fwd_spec(d64).varlen and not F.fwd_spec(key("fwd")).varlen


@pytest.mark.parametrize("d,mask", [(64, "causal"), (128, "none")])
def test_the_varlen_domain_filtered_by_the_rules_is_the_one_program_per_tile_space(d, mask):
    import itertools

    k = key("fwd_varlen", "bfloat16", d, mask=mask)
    dom = GLUON.domain(k)
    admitted = {cfg for values in itertools.product(*dom.values())
                for cfg in [TileConfig(**dict(zip(dom, values)), family="gluon")]
                if not GLUON.violated_rules(Variant(k.spec, cfg))}
    spec = F.fwd_spec(k)
    assert spec.varlen and admitted == {F.tile_config(c) for c in C.space(spec)} and len(admitted) > 10
    # the dense forward's walks are not built for ragged batches, nor the longest-first order
    walk = dataclasses.replace(GLUON.default_config(k, SM90), persistent=2)
    assert any("ragged batches (varlen) with persistent=2" in w for w in GLUON.violated_rules(Variant(k.spec, walk)))
    assert set(GLUON.refine_domain(k)) == set(F.VARLEN_REFINE_KNOBS)


@pytest.mark.parametrize("gluon_ms, winner", [(0.5, "gluon"), (2.0, "triton")])
def test_dispatch_varlen_forward_by_measurement(tmp_path, gluon_ms, winner):
    k = key("fwd_varlen", "bfloat16", 128, mask="causal", shape=Shape(8, 4, 2, 1024, 1024))
    g = GLUON.default_config(k, SM90)
    with TuningDB(tmp_path / "t.sqlite") as db:
        for cfg, ms in ((T1, 1.0), (g, gluon_ms)):
            db.record(k, Shape(8, 4, 2, 1024, 1024), Variant(k.spec, cfg), Measurement("ok", median_ms=ms), H200, 0)
    c = Dispatcher([tmp_path / "t.sqlite"], env=H200, arch=SM90).choose(k, capturing=False)
    assert (c.config.family, c.source) == (winner, "tuned")
    assert families.launcher(c.config.family, "fwd_varlen") is (F.fwd_varlen if winner == "gluon"
                                                               else families.portable().launcher("fwd_varlen"))


def test_the_varlen_launcher_addresses_the_packed_rows(monkeypatch):
    """One program per (query block of the longest sequence, sequence, head) here (the
    packed layout would not halve the programs); the descriptors view the packed tensors
    as (1, heads, total, head_dim); the sequences' offsets, O's strides and total_q
    (LSE's row stride) follow; masks as window sizes."""
    mod = _Module()
    spec = KernelSpec("fwd_varlen", "float16", 128, 128, "causal")
    cfg = GLUON.default_config(key("fwd_varlen", d=128), SM90)
    lens_q, lens_k = [150, 0, 61, 1, 37], [61, 13, 150, 1, 0]
    q, k, v, do, cu_q, cu_k, mq, mk = bench.make_varlen_inputs(spec, lens_q, lens_k, 4, 2, device="cpu")
    fn, outs = bench.run_variant_varlen(Variant(spec, cfg), q, k, v, do, cu_q, cu_k, mq, mk)
    monkeypatch.setattr("flashgen.families.gluon.render.load", lambda variant: mod)
    monkeypatch.setattr("flashgen.families.gluon.launch.unsupported", lambda *a, **kw: None)
    fn()
    (name, grid, args, kw), = mod.log
    m_blocks = -(-150 // 128)
    assert name == "attn_fwd" and grid == (m_blocks * 5 * 4,) and kw == {"num_warps": 8, "maxnreg": 168}
    assert L.varlen_slots(249, 5, 150, 128) == (m_blocks * 5, False)
    assert [list(d.shape) for d in args[:4]] == [[1, 4, 249, 128], [1, 2, 225, 128], [1, 2, 225, 128],
                                                 [1, 4, 249, 128]]
    assert [list(d.strides) for d in args[:2]] == [[128 * 4, 128, 128 * 4, 1], [128 * 2, 128, 128 * 2, 1]]
    assert args[4] is outs["LSE"] and outs["LSE"].shape == (4, 249) and outs["O"].shape == (249, 4, 128)
    assert args[6:14] == (m_blocks * 5 * 4, m_blocks, 4, 2, 150, 150, -1, 0)  # causal: right 0, left unbounded
    assert args[14] is cu_q and args[15] is cu_k and args[16] is outs["O"] and args[17:] == (4 * 128, 128, 249)


def test_a_skewed_batch_runs_the_packed_twin(monkeypatch, request):
    """Lengths whose longest sequence would leave most programs idle: the launcher loads
    the config's packed twin (``varlen_packed``), launches total_q // BLOCK_MT + batch
    slots per head and passes the sequences' count after the offsets."""
    loaded = []
    mod = _Module()
    spec = KernelSpec("fwd_varlen", "float16", 128, 128, "causal")
    cfg = GLUON.default_config(key("fwd_varlen", d=128), SM90)
    lens = [700] + [5, 30, 0, 17] * 10
    q, k, v, do, cu_q, cu_k, mq, mk = bench.make_varlen_inputs(spec, lens, lens, 4, 2, device="cpu")
    fn, outs = bench.run_variant_varlen(Variant(spec, cfg), q, k, v, do, cu_q, cu_k, mq, mk)
    monkeypatch.setattr("flashgen.families.gluon.render.load", lambda variant: loaded.append(variant) or mod)
    monkeypatch.setattr("flashgen.families.gluon.launch.unsupported", lambda *a, **kw: None)
    L._packed_module.cache_clear()
    request.addfinalizer(L._packed_module.cache_clear)  # the fake module must not outlive the test
    fn()
    (name, grid, args, kw), = mod.log
    slots = sum(lens) // 128 + len(lens)
    assert L.varlen_slots(sum(lens), len(lens), 700, 128) == (slots, True) and slots <= 6 * len(lens) / 2
    twin = C.GluonFwdVariant(dataclasses.replace(loaded[0].spec, varlen_packed=False), loaded[0].config)
    assert [v.spec.varlen_packed for v in loaded] == [True]
    assert loaded[0].id == twin.id.replace("_varlen", "_varlen_packed") and twin.spec.varlen
    assert grid == (slots * 4,) and args[6:8] == (slots * 4, slots)
    assert args[14] is cu_q and args[15] is cu_k and args[16] == len(lens) and args[17] is outs["O"]


def _varlen_program(slot: int, cu_q: list[int], seq_blocks: int, block_rows: int, masked: bool):
    """The kernel's program coordinates for one head, in Python: (sequence, first query
    row within it, live).  seq_blocks > 0: the grid's slots per sequence (_tile_coords:
    masked modes reverse the blocks of the longest sequence); 0: packed
    (_varlen_coords)."""
    num_seqs = len(cu_q) - 1
    if seq_blocks:
        z, idx = divmod(slot, seq_blocks)
        m0 = (seq_blocks - 1 - idx if masked else idx) * block_rows
        return z, m0, m0 < cu_q[z + 1] - cu_q[z]
    else:  # the last sequence whose first slot is <= slot (the count of those, minus 1)
        z = sum(cu_q[i] // block_rows + i <= slot for i in range(num_seqs)) - 1
        idx = slot - (cu_q[z] // block_rows + z)
    n_blk = -(-(cu_q[z + 1] - cu_q[z]) // block_rows)
    live = idx < n_blk
    return z, (n_blk - 1 - idx if masked else idx) * block_rows, live


@pytest.mark.parametrize("lens", [
    [150, 0, 61, 1, 37],  # one slot per block of the longest sequence
    [5000] + [17, 200, 0, 96] * 8 + [128, 129],  # skewed: packed
    [(i * 37) % 41 for i in range(150)] + [700] + [(i * 23) % 43 for i in range(49)],  # 200 sequences: packed
    [0, 0, 0],
])
@pytest.mark.parametrize("block_rows", [64, 128, 192])
def test_the_varlen_grid_runs_each_query_block_of_each_sequence_once(lens, block_rows):
    """Either layout of :func:`varlen_slots`, read as the kernel reads it: every query
    block of every sequence has exactly one live slot, in masked modes the blocks that
    see the most keys first; the packed layout idles at most one slot per sequence and
    is taken only where it launches at most VARLEN_PACKED_FRACTION of the programs."""
    cu_q = [0]
    for n in lens:
        cu_q.append(cu_q[-1] + n)
    total, batch = cu_q[-1], len(lens)
    slots, packed = L.varlen_slots(total, batch, max(lens), block_rows)
    if max(lens) == 0:  # no query rows: nothing is launched
        assert (slots, packed) == (0, False)
        return
    per_seq = -(-max(lens) // block_rows) * batch
    if packed:
        seq_blocks = 0
        assert slots == total // block_rows + batch <= L.VARLEN_PACKED_FRACTION * per_seq
    else:
        seq_blocks = per_seq // batch
        assert slots == per_seq and slots < (total // block_rows + batch) / L.VARLEN_PACKED_FRACTION
    for masked in (False, True):
        seen = {}
        for slot in range(slots):
            z, m0, live = _varlen_program(slot, cu_q, seq_blocks, block_rows, masked)
            if live:
                assert 0 <= m0 < lens[z] and (z, m0) not in seen
                seen[(z, m0)] = slot
        assert set(seen) == {(z, m) for z, n in enumerate(lens) for m in range(0, n, block_rows)}
        if packed:
            assert slots - len(seen) <= batch
        if masked:  # within a sequence, later blocks (more keys) take earlier slots
            for (z, m0), slot in seen.items():
                assert (z, m0 + block_rows) not in seen or seen[(z, m0 + block_rows)] < slot


def test_flashgen_families_limits_the_dispatchers_families(tmp_path, monkeypatch):
    """FLASHGEN_FAMILIES=triton: the faster Gluon row and the Gluon default give way to the
    Triton family (a side-by-side measurement of one family against the other)."""
    k = key("fwd_varlen", "bfloat16", 128, mask="causal", shape=Shape(8, 4, 2, 1024, 1024))
    with TuningDB(tmp_path / "t.sqlite") as db:
        for cfg, ms in ((T1, 1.0), (GLUON.default_config(k, SM90), 0.5)):
            db.record(k, Shape(8, 4, 2, 1024, 1024), Variant(k.spec, cfg), Measurement("ok", median_ms=ms), H200, 0)
    big = key("fwd", "bfloat16", 128, mask="causal", shape=Shape(4, 16, 16, 4096, 4096))
    for allowed, family in (("", "gluon"), ("triton", "triton"), ("gluon, triton", "gluon")):
        monkeypatch.setenv("FLASHGEN_FAMILIES", allowed)
        d = Dispatcher([tmp_path / "t.sqlite"], env=H200, arch=SM90)
        assert d.choose(k, capturing=False).config.family == family, allowed
        assert d.choose(big, capturing=False).config.family == family, allowed  # the untuned default


def test_the_varlen_launcher_names_the_argument_it_refuses():
    from flashgen.families.gluon import launch as L

    t = lambda *shape, dtype=torch.bfloat16: torch.zeros(shape, dtype=dtype)  # noqa: E731
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    kw = dict(softmax_scale=0.1, mask="none", win_left=-1, win_right=-1)
    cases = {
        "q, k, v must be 3-D": (t(5, 4, 64)[None], t(5, 2, 64), t(5, 2, 64), cu, cu),
        "must share (total_k, num_kv_heads)": (t(5, 4, 64), t(5, 2, 64), t(5, 1, 64), cu, cu),
        "num_heads 4 is not a multiple of num_kv_heads 3": (t(5, 4, 64), t(5, 3, 64), t(5, 3, 64), cu, cu),
        "cu_seqlens_k must be a 1-D int32 tensor": (t(5, 4, 64), t(5, 2, 64), t(5, 2, 64), cu, cu.long()),
        "must both be (batch + 1,)": (t(5, 4, 64), t(5, 2, 64), t(5, 2, 64), cu, cu[:2]),
        "q is not on a CUDA device": (t(5, 4, 64), t(5, 2, 64), t(5, 2, 64), cu, cu),  # then the GPU's checks
    }
    for words, (q, k, v, cq, ck) in cases.items():
        with pytest.raises(ValueError, match="gluon fwd_varlen: .*" + words.replace("(", r"\(").replace(")", r"\)")
                           .replace("+", r"\+")):
            L.fwd_varlen(q, k, v, cq, ck, 3, 3, **kw)
    # a float32 input reaches the launcher's ValueError through the family, not a KeyError
    with pytest.raises(ValueError, match="gluon fwd_varlen"):
        F.fwd_varlen(t(5, 4, 64, dtype=torch.float32), t(5, 2, 64, dtype=torch.float32),
                     t(5, 2, 64, dtype=torch.float32), cu, cu, 3, 3, config=GLUON.default_config(
                         key("fwd_varlen", "bfloat16", 64, mask="none"), SM90), **kw)


def test_an_unknown_family_in_flashgen_families_is_warned_about(monkeypatch):
    monkeypatch.setenv("FLASHGEN_FAMILIES", "glun")
    with pytest.warns(UserWarning, match=r"names no registered kernel family \['glun'\]"):
        assert not dispatch.family_allowed("gluon")
    assert dispatch.family_allowed("triton")  # the portable family always serves


def test_a_flashgen_families_value_naming_no_family_is_warned_about(monkeypatch):
    monkeypatch.setenv("FLASHGEN_FAMILIES", " , ")
    with pytest.warns(UserWarning, match="names no kernel family.*only triton"):
        assert not dispatch.family_allowed("gluon")
    assert "leaves out gluon" in dispatch.families_left_out()


def test_the_backward_reason_names_flashgen_families(tmp_path, monkeypatch):
    """With the Gluon family left out by FLASHGEN_FAMILIES, the backward's reason says
    so (it read "untuned: too little work ..." beside a tuned, faster Gluon row)."""
    monkeypatch.setenv("FLASHGEN_FAMILIES", "triton")
    d = Dispatcher([tmp_path / "none.sqlite"], env=H200, arch=SM90)
    ks = {n: key(n, "bfloat16", 128, mask="causal", shape=Shape(4, 16, 16, 4096, 4096))
          for n in ("bwd", "bwd_dq", "bwd_dkdv")}
    choice = d._backward_uncached(ks, deterministic=False, capturing=False)
    assert choice.family == "triton" and "FLASHGEN_FAMILIES='triton' leaves out gluon" in choice.reason


def test_model_benchmarker_counts_the_column_split_programs_key_rows():
    """``flashgen tune --fake-model``'s byte model: the head_dim 256 column-split backward
    (``dq_chunks`` > 0) owns BLOCK_N key rows, not BLOCK_N x consumers, so it runs twice
    the programs of a 128-row program, each streaming Q and dO and adding its dQ tiles."""
    model = tuner.ModelBenchmarker(SM90)
    wide = Variant(KernelSpec("bwd", "bfloat16", 256, 256, "none"), F.tile_config(B.default_config(256)))
    rows128 = dataclasses.replace(wide.config, dq_chunks=0)
    big = Shape(4, 8, 4, 4096, 4096)
    assert model.median_ms(wide, big) > model.median_ms(Variant(wide.spec, rows128), big)


def test_refine_of_one_family_reports_that_familys_rows(tmp_path):
    """``tune --family triton --refine num_warps`` at a key whose Gluon row is faster: the
    summary's starting and best configs are the Triton family's, so its speedup is what
    refining that family gained (it showed the Gluon row for both, 1.00x)."""
    k = key("fwd", "float16", 64)
    tri = TileConfig(64, 64, 4, 2)
    with TuningDB(tmp_path / "t.sqlite") as db:
        _record(db, k, F.tile_config(C.default_config(F.fwd_spec(k))), 0.3)
        _record(db, k, tri, 0.5)
        (res,) = tuner.refine([(k, SHAPE)], knobs=["num_warps"], benchmarker=tuner.FakeBenchmarker({}, default=0.4),
                              db=db, env=H200, arch=SM90, family_names=["triton"])
    assert res.default_config == tri and res.default_median_ms == 0.5
    assert res.best_config.family == tri.family and res.best_config.num_warps != 4
    assert res.best_median_ms == 0.4 and res.speedup == pytest.approx(1.25)

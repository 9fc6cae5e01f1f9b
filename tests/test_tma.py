"""The ``tma`` knob: tensor-descriptor loads (interpreter), the pointer fallback for
tensors a descriptor cannot address, and tuning DBs written before the knob existed."""

import dataclasses
import sqlite3

import pytest
import torch

from flashgen import bench, compile as _compile, ops, resources
from flashgen.arch import by_sm
from flashgen.db import TuningDB
from flashgen.env import Environment
from flashgen.spec import KernelSpec, Measurement, Shape, TileConfig, Variant

SM90 = by_sm("sm_90")
_DB_CASE = (Environment("NVIDIA H200", "9.0", 132, "3.6.0", "2.11.0", "0.1.0"),
            KernelSpec("fwd", "bfloat16", 64, 64, "none"), Shape(1, 2, 2, 128, 128),
            Shape(1, 2, 2, 128, 128).key(KernelSpec("fwd", "bfloat16", 64, 64, "none")))


@pytest.mark.parametrize("kernel", ["fwd", "bwd_dq", "bwd_dkdv"])
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
@pytest.mark.parametrize("dims", [(64, 64), (72, 40)])
def test_tma_variants_are_exact(kernel, mask, dims, monkeypatch):
    """check_variant: awkward seqlens, GQA group 2, memory past seqlen_k poisoned, padded
    head dims; the TMA module itself runs (no silent fallback).  The seqlens are the
    checks' shape at a third of its size (the interpreter's cost is per tile pair): 101
    and 141 still span two and three 64-row boxes and four and five 32-row boxes, each
    ending in a partial one, and leave rows that see no key at the top and at the bottom
    under the windows."""
    monkeypatch.setattr(bench, "CHECK_SEQLENS", (101, 141))
    loaded = []
    real = _compile.load
    monkeypatch.setattr(_compile, "load", lambda v: loaded.append(v.id) or real(v))
    v = Variant(KernelSpec(kernel, "float16", *dims, mask), TileConfig(64, 32, 4, 2, tma=1))
    ok, ratio, msg = bench.check_variant(v, group=2, device="cpu")
    assert ok, msg
    assert v.id in loaded


def _qkv(b=1, h=2, s=40, d=32, dtype=torch.float16):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(b, h, s, d, generator=g).to(dtype) for _ in range(3)]


def test_tma_ok_rules():
    q, k, v = _qkv()
    assert ops.tma_ok(q)
    assert not ops.tma_ok(q.expand(1, 2, 40, 32)[:, :1].expand(1, 4, 40, 32))  # stride-0 heads
    big = torch.randn(1, 2, 40, 33).to(torch.float16)
    assert not ops.tma_ok(big[..., 1:])  # base not 16-byte aligned, rows of 66 bytes
    assert not ops.tma_ok(q.transpose(-1, -2))  # last stride != 1


def test_unaddressable_inputs_fall_back_to_pointer_loads(monkeypatch):
    q, k, v = _qkv(h=4)
    k1, v1 = k[:, :1].expand(1, 4, 40, 32), v[:, :1].expand(1, 4, 40, 32)  # expanded kv heads
    loaded = []
    real = _compile.load
    monkeypatch.setattr(_compile, "load", lambda var: loaded.append(var.config) or real(var))
    kw = dict(softmax_scale=32 ** -0.5, mask="none", diag_lo=-40, diag_hi=40)
    o_tma, lse_tma = ops.fwd(q, k1, v1, config=TileConfig(32, 16, 4, 1, tma=1), **kw)
    assert loaded == [TileConfig(32, 16, 4, 1, tma=0)]
    o, lse = ops.fwd(q, k1.contiguous(), v1.contiguous(), config=TileConfig(32, 16, 4, 1, tma=1), **kw)
    assert loaded[-1].tma == 1
    torch.testing.assert_close(o_tma, o, rtol=0, atol=2e-3)


def test_tma_smem_model_adds_barriers():
    spec = KernelSpec("fwd", "bfloat16", 128, 128, "none")
    plain = resources.estimate(Variant(spec, TileConfig(128, 64, 8, 3)), SM90).total_bytes
    tma = resources.estimate(Variant(spec, TileConfig(128, 64, 8, 3, tma=1)), SM90)
    assert tma.total_bytes == plain + resources.TMA_BARRIER_BYTES
    # compiled for sm_90 by Triton 3.6 (this config: 132096 bytes); never under
    assert 0 <= tma.total_bytes - 132096 <= 1024


def test_config_ids_and_db_rows_round_trip(tmp_path):
    assert TileConfig(128, 64, 8, 3).id == "m128_n64_w8_s3"
    assert TileConfig(128, 64, 8, 3, tma=1, ws=1).id == "m128_n64_w8_s3_tma_ws"
    assert TileConfig(64, 64, 4, 2, num_splits=8).id == "m64_n64_w4_s2_sp8"
    env, spec, shape, key = _DB_CASE
    path = tmp_path / "t.sqlite"
    with TuningDB(path) as db:
        db.record(key, shape, Variant(spec, TileConfig(64, 64, 4, 2, tma=1)), Measurement("ok", 1.0), env, 1)
        assert TileConfig.from_dict(db.best(key, env)) == TileConfig(64, 64, 4, 2, tma=1)


def test_db_written_before_the_knobs_opens_and_upgrades(tmp_path):
    """A file without the tma/ws/num_splits columns is still a tuning DB: read-only it
    reads them as defaults; opened for writing it gains the columns, rows intact."""
    env, spec, shape, key = _DB_CASE
    path = tmp_path / "old.sqlite"
    with TuningDB(path) as db:
        db.record(key, shape, Variant(spec, TileConfig(64, 64, 4, 2)), Measurement("ok", 1.0), env, 1)
    con = sqlite3.connect(path)
    for col in ("tma", "ws", "num_splits"):
        con.execute(f"ALTER TABLE measurements DROP COLUMN {col}")
    con.commit()
    con.close()
    with TuningDB(path, readonly=True) as db:
        assert TileConfig.from_dict(db.best(key, env)) == TileConfig(64, 64, 4, 2)
    with TuningDB(path) as db:
        db.record(key, shape, Variant(spec, TileConfig(64, 64, 4, 2, tma=1)), Measurement("ok", 0.5), env, 1)
        assert TileConfig.from_dict(db.best(key, env)) == TileConfig(64, 64, 4, 2, tma=1)
        assert len(db.rows()) == 2


def test_tma_configs_are_infeasible_before_sm90_and_preferred_after():
    from flashgen import heuristics

    spec = KernelSpec("fwd", "bfloat16", 128, 128, "causal")
    v = Variant(spec, TileConfig(64, 64, 4, 3, tma=1))
    for sm in ("sm_80", "sm_86", "sm_89"):
        est = resources.estimate(v, by_sm(sm))
        assert not est.feasible and "no TMA" in est.breakdown()
        assert not heuristics.default_config(spec, by_sm(sm)).tma
    assert resources.estimate(v, SM90).feasible and resources.estimate(v, by_sm("sm_100")).feasible
    for kernel in ("fwd", "bwd_dq", "bwd_dkdv"):
        for d in (64, 128):
            assert heuristics.default_config(KernelSpec(kernel, "bfloat16", d, d, "none"), SM90).tma == 1
    # the varlen kernels have no tma knob
    assert not heuristics.default_config(KernelSpec("fwd_varlen", "bfloat16", 128, 128, "none"), SM90).tma


def test_shipped_db_is_keyed_on_the_current_templates():
    """A template edit without a re-tune would leave the shipped H200 rows unused (the
    dispatcher ignores rows of another template hash): re-tune when this fails.  Each
    row's hash is its kernel family's (the Triton templates, or the Gluon ones)."""
    from pathlib import Path

    from flashgen import families
    from flashgen.spec import kernel_mods

    path = Path(__file__).resolve().parent.parent / "tuning_db" / "h200.sqlite"
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        rows = set(con.execute("SELECT DISTINCT COALESCE(family, 'triton'), kernel, template_hash FROM measurements"))
        gluon_mods = set(con.execute("SELECT DISTINCT kernel, COALESCE(mods, '') FROM measurements "
                                     "WHERE family = 'gluon'"))
    finally:
        con.close()
    fams = {f for f, _, _ in rows}
    assert fams == {"triton", "gluon"}
    for fam in fams:
        F = families.get(fam)
        pairs = {(k, h) for f, k, h in rows if f == fam}
        kernels = {k for k, _ in pairs}
        if fam == "triton":
            assert {"fwd", "bwd_dq", "bwd_dkdv", "fwd_varlen", "bwd_dq_varlen", "bwd_dkdv_varlen"} <= kernels
            current = {(k, F.template_hash(k, m)) for k in kernels for m in kernel_mods(k)}
        else:
            assert kernels == {"fwd", "bwd", "fwd_varlen", "bwd_varlen"}
            # the Gluon forward's user variants (sinks, user functions) have one code id of their own
            current = {(k, F.template_hash(k, m)) for k, m in gluon_mods}
        assert pairs <= current, fam
        assert {(k, F.template_hash(k)) for k in kernels} <= pairs, fam


def test_tma_kernels_compile_for_sm90_with_bulk_copies_and_wgmma():
    """The real compiler accepts the TMA variants of every kernel and mask mode (window
    included), and the PTX has the bulk tensor copies and the Hopper MMA we meant."""
    from sm90 import compile_for_sm90

    got = compile_for_sm90([("fwd", "bfloat16", 128, 128, "window", (64, 64, 4, 3, 1)),
                            ("fwd", "float16", 72, 40, "causal", (128, 64, 8, 2, 1)),
                            ("bwd_dq", "bfloat16", 64, 64, "window", (64, 64, 4, 3, 1)),
                            ("bwd_dkdv", "bfloat16", 128, 128, "window", (64, 64, 4, 2, 1))])
    for vid, (shared, bulk, wgmma) in got.items():
        assert vid.endswith("_tma") and bulk and wgmma and shared > 0, vid


def test_layout_signature_is_part_of_the_key_and_keeps_old_ids(monkeypatch):
    """Inputs a tensor descriptor cannot address get their own key ("strided"); the
    common layout's key ids are those the shipped rows were recorded under."""
    from flashgen import dispatch, library
    from flashgen.spec import ProblemKey

    spec = KernelSpec("fwd", "bfloat16", 128, 128, "causal")
    plain = ProblemKey.from_sizes(spec, batch=1, num_heads=32, num_kv_heads=8, seqlen_q=4096, seqlen_k=4096)
    strided = ProblemKey.from_sizes(spec, batch=1, num_heads=32, num_kv_heads=8, seqlen_q=4096, seqlen_k=4096,
                                    layout="strided")
    assert plain.id == "attn_fwd_d128_bf16_causal_g4_q4096_k4096_bh32"
    assert strided.id == plain.id + "_strided"
    assert ProblemKey.from_row(strided.as_row()) == strided
    assert ProblemKey.from_row({**plain.as_row(), "layout": None}) == plain  # rows written before the column
    with pytest.raises(ValueError, match="layout"):
        ProblemKey(spec, 1, 16, 16, 1, "weird")
    q, k, v = _qkv(h=4)
    assert library.layout_signature(q, k, v) == ""
    assert library.layout_signature(q.transpose(1, 2).contiguous().transpose(1, 2), k, v) == ""  # (b, s, h, d) view
    assert library.layout_signature(q, k[:, :1].expand(1, 4, 40, 32), v) == "strided"
    # the dispatcher: a strided key never gets a TMA config, tuned neighbour or default
    disp = dispatch.Dispatcher(databases=[p for p in dispatch.shipped_databases() if p.name == "h200.sqlite"], arch=SM90)
    for key in (strided, dataclasses.replace(strided, seqlen_q=512, seqlen_k=512)):
        assert disp.choose(key, capturing=False).config.tma == 0
    assert resources.supports_tma(SM90) and heuristics_default(spec, strided).tma == 0


def heuristics_default(spec, key):
    from flashgen import heuristics

    return heuristics.default_config(spec, SM90, key)


def test_strided_inputs_run_under_their_own_key(monkeypatch):
    from flashgen import dispatch
    import flashgen

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    seen = []
    real = dispatch.Dispatcher.choose

    def spy(self, key, **kw):
        seen.append(key.id)
        return real(self, key, **kw)

    monkeypatch.setattr(dispatch.Dispatcher, "choose", spy)
    q, k, v = _qkv(h=4)
    k1, v1 = k[:, :1].expand(1, 4, 40, 32), v[:, :1].expand(1, 4, 40, 32)
    o_strided = flashgen.attention(q, k1, v1)
    o_plain = flashgen.attention(q, k1.contiguous(), v1.contiguous())
    assert any(s.endswith("_strided") for s in seen) and any(not s.endswith("_strided") for s in seen)
    torch.testing.assert_close(o_strided, o_plain, rtol=0, atol=2e-3)

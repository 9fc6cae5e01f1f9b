"""The Gluon backward of ragged batches (``bwd_varlen``) without a GPU: its rules, its
place in the family (what it serves, its search space, its code id), the dispatcher's
choice between it and the Triton family's two varlen kernels, the launcher's arguments
(kernels replaced by a recorder) and the library's use of the choice; and, compiled for
sm_90 with Triton's bundled ptxas, each default variant against its dense twin."""

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from flashgen import bench, families, library
from flashgen.arch import by_sm
from flashgen.db import TuningDB
from flashgen.dispatch import Dispatcher
from flashgen.env import Environment
from flashgen.families.gluon import bwd as B
from flashgen.families.gluon import family as F
from flashgen.spec import KernelSpec, Measurement, Shape, TileConfig, Variant

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
GLUON = families.get("gluon")
SM90 = by_sm("sm_90")
H200 = Environment("NVIDIA H200", "9.0", 132, "3.6.0", "2.11.0", "0.1.0")
SHAPE = Shape(8, 4, 2, 1024, 1024)


def key(kernel="bwd_varlen", d=128, mask="causal", dtype="bfloat16", shape=SHAPE):
    return shape.key(KernelSpec(kernel, dtype, d, d, mask))


# -- rules and the family ----------------------------------------------------------------

def test_the_rules_leave_out_what_addresses_the_dense_layout():
    base = B.varlen_default_config(128, "bfloat16", "causal")
    assert B.varlen_reasons(base, 128) == [] and base.row_load == "tma"
    assert (base.dq_stage, base.kv_store, base.dq_mode) == ("swizzled", "ptr", "tma")
    cases = {
        "not at the block_m-aligned tiles": dict(dq_stage="fragment"),
        "would write the next sequence's rows": dict(kv_store="tma"),
        "adds dQ by TMA reduce-add": dict(dq_mode="ordered"),
        "sums each GQA group in its program": dict(group_split=2),
        "one program per (key block, sequence, kv head)": dict(longest_first=True),
    }
    for words, kw in cases.items():
        why = B.varlen_reasons(dataclasses.replace(base, **kw), 128)
        assert len(why) == 1 and words in why[0], (words, why)
    assert "(64, 128)" in B.varlen_reasons(base, 96)[0]
    with pytest.raises(ValueError, match="would write the next sequence's rows"):
        B.render(dataclasses.replace(base, kv_store="tma"), "bfloat16", 128, "causal", varlen=True)


def test_the_family_serves_the_varlen_backward_on_sm90_only():
    assert "bwd_varlen" in GLUON.kernels and GLUON.unsupported(key(), SM90) is None
    assert "this is sm_80" in GLUON.unsupported(key(), by_sm("sm_80"))
    assert "ragged-batch backward is built for head_dim = head_dim_v in (64, 128)" in GLUON.unsupported(key(d=96),
                                                                                                         SM90)
    assert "two kernels, bwd_dq and bwd_dkdv" in families.portable().unsupported(key(), SM90)
    hashes = {GLUON.template_hash(k) for k in ("fwd", "bwd", "fwd_varlen", "bwd_varlen")}
    assert len(hashes) == 4 and GLUON.template_hash("bwd_varlen") == "g" + B.varlen_code_id()[1:]
    assert GLUON.launcher("bwd_varlen") is F.bwd_varlen
    cfg = GLUON.default_config(key(), SM90)
    assert F.bwd_config(cfg) == B.varlen_default_config(128, "bfloat16", "causal")
    # an untuned key too small for the family's host cost (large_enough) keeps the two kernels;
    # one with enough work takes the default where BWD_VARLEN_DEFAULT_AHEAD has a measurement
    assert GLUON.prefers_default(key(), SM90) is None
    assert "1.28-1.34x" in GLUON.prefers_default(key(shape=Shape(16, 32, 8, 2048, 2048)), SM90)
    assert GLUON.prefers_default(key(d=64, mask="window", shape=Shape(16, 32, 8, 2048, 2048)), SM90) is None


@pytest.mark.parametrize("d, mask", [(128, "causal"), (128, "none"), (64, "causal"), (64, "window")])
def test_the_domain_filtered_by_the_rules_is_the_varlen_space(d, mask):
    k = key(d=d, mask=mask)
    ok = {c for c in families.configs(GLUON, k) if not GLUON.violated_rules(Variant(k.spec, c))}
    space = B.varlen_search_space(d, "bfloat16", mask)
    assert {F.bwd_config(c) for c in ok} == set(space) and len(space) >= 5
    assert all(not B.varlen_reasons(c, d) and B.is_valid(c, d, "bfloat16", mask) for c in space)
    kvt = dataclasses.replace(F.tile_config(space[0]), kv_store=1)
    assert any("would write the next sequence's rows" in w for w in GLUON.violated_rules(Variant(k.spec, kvt)))
    assert GLUON.refine_domain(k) == {"dq_writer": (0, 1)}


def test_dense_variants_render_as_before_and_the_varlen_one_reads_its_sequence():
    c = B.varlen_default_config(128, "bfloat16", "causal")
    dense, varlen = (B.render(c, "bfloat16", 128, "causal", varlen=v) for v in (False, True))
    assert "_sequence" not in dense and "CU_Q" not in dense and "q_start" not in dense
    assert B.variant_id(c, "bfloat16", 128, "causal", True) == B.variant_id(c, "bfloat16", 128, "causal") + "_varlen"
    # every partition reads its sequence, and the coordinates are the packed rows
    assert varlen.count("= _sequence(CU_Q, CU_K, off_z, win_left, win_right)") == 2  # producer, consumer
    assert "[0, off_hk, k_start + n0, 0]" in varlen and "[0, off_h, q_start + m0, 0]" in varlen
    assert "mbarrier.arrive(kv_bar)" in varlen  # a key block past its sequence's end loads nothing
    assert "tma_load(lse_desc, [bh, p_start + m0]" in varlen
    assert "(k_start + rows).to(gl.int64) * (num_kv_heads * D)" in varlen
    w = B.render(dataclasses.replace(c, dq_writer=True), "bfloat16", 128, "causal", varlen=True)
    assert w.count("= _sequence(CU_Q, CU_K") == 3  # and the dQ writer


def test_the_varlen_code_id_record_is_current_and_follows_varlen_code_only(tmp_path):
    """The ragged-batch variants' own code id: its record names the sources of every
    variant the tuner can record (``python3 -m flashgen.families.gluon`` rewrites it); an
    edit of varlen-only code (here the dQ writer's reduce-add coordinate) changes it and
    leaves the dense backward's id."""
    import shutil

    rec = B._VARLEN_CODE_ID.record()
    assert rec["probes"] == B._VARLEN_CODE_ID.probe_digest() and rec["code"] == B.varlen_code_id()
    kinds = {(c.row_load, c.split, c.block_m, c.dq_writer) for c, *_ in B.varlen_probe_variants()}
    assert {("tma", False, 64, True), ("producer", True, 64, False), ("tma", False, 128, False)} <= kinds
    shutil.copytree(B._templates_dir() / "gluon", tmp_path / "gluon")
    t = tmp_path / "gluon" / "attn_bwd.py.j2"
    text = t.read_text()
    edit = "            tma_reduce_add(dq_desc, [{{ VZ }}, off_h, {{ QS }}m0, 0],"
    assert text.count(edit) == 1
    t.write_text(text.replace(edit, "            tma_reduce_add(dq_desc, [{{ VZ }}, off_h, {{ PS }}m0, 0],"))
    assert B._VARLEN_CODE_ID.code_id(str(tmp_path)) != B.varlen_code_id()
    assert B.code_id(str(tmp_path)) == B.code_id()


def test_the_launcher_names_the_argument_it_refuses():
    t = lambda *shape, dtype=torch.bfloat16: torch.zeros(shape, dtype=dtype)  # noqa: E731
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    q, k, lse = t(5, 4, 64), t(5, 2, 64), torch.zeros(4, 5)
    cases = {
        "q, k, v must be 3-D": (q[None], k, k, q, q, lse, cu, cu),
        "num_heads 4 must be a multiple of num_kv_heads 3": (q, t(5, 3, 64), t(5, 3, 64), q, q, lse, cu, cu),
        r"lse must be float32 \(num_heads, total_q\) = \(4, 5\)": (q, k, k, q, q, lse.T, cu, cu),
        "cu_seqlens_k must be int32": (q, k, k, q, q, lse, cu, cu.long()),
        "do must be float16 or bfloat16 like q": (q, k, k, q.half(), q, lse, cu, cu),
    }
    for words, (q_, k_, v_, do_, o_, lse_, cq, ck) in cases.items():
        with pytest.raises(ValueError, match=words):
            B.attention_bwd_varlen(do_, q_, k_, v_, o_, lse_, cq, ck, 3, 3, softmax_scale=0.1, win_left=-1,
                                   win_right=-1, mask="none")


# -- the dispatcher -----------------------------------------------------------------------

def _record(db, k, cfg, ms):
    db.record(k, SHAPE, Variant(k.spec, cfg), Measurement("ok", median_ms=ms), H200, 0)


T1, T2 = TileConfig(64, 64, 4, 2), TileConfig(64, 32, 4, 1)


@pytest.mark.parametrize("gluon_ms, whole", [(1.5, True), (2.5, False)])
def test_dispatch_compares_the_whole_varlen_backward_with_the_two_kernels(tmp_path, gluon_ms, whole):
    gcfg = GLUON.default_config(key(), SM90)
    with TuningDB(tmp_path / "t.sqlite") as db:
        _record(db, key("bwd_dq_varlen"), T1, 1.0)
        _record(db, key("bwd_dkdv_varlen"), T2, 1.0)
        _record(db, key(), gcfg, gluon_ms)
    d = Dispatcher([tmp_path / "t.sqlite"], env=H200, arch=SM90)
    plan = d.backward(key("bwd_dq_varlen"), capturing=False)
    assert plan.whole is whole
    assert f"measured at {key().id}: gluon bwd_varlen {gluon_ms:.4f} ms vs triton bwd_dq_varlen + " \
           "bwd_dkdv_varlen 1.0000 + 1.0000" in plan.reason
    if whole:
        assert plan.family == "gluon" and plan.choices[0].config == gcfg and plan.choices[0].key == key()
    else:
        assert [(c.key.spec.kernel, c.config) for c in plan.choices] == [("bwd_dq_varlen", T1),
                                                                         ("bwd_dkdv_varlen", T2)]
    det = d.backward(key("bwd_dq_varlen"), deterministic=True, capturing=False)
    assert not det.whole and det.reason.startswith("deterministic")


def test_an_untuned_varlen_key_runs_the_gluon_default_where_it_measured_ahead(tmp_path):
    """No rows: the Gluon default where BWD_VARLEN_DEFAULT_AHEAD holds a measurement for
    (head_dim, mask), the reason citing it; the two Triton kernels elsewhere (head_dim 64
    windows)."""
    from flashgen.families.gluon.family import BWD_VARLEN_DEFAULT_AHEAD

    d = Dispatcher([tmp_path / "none.sqlite"], env=H200, arch=SM90)
    shape = Shape(16, 32, 8, 2048, 2048)
    for head_dim, mask in ((128, "causal"), (128, "none"), (128, "window"), (64, "causal"), (64, "none")):
        plan = d.backward(key("bwd_dkdv_varlen", d=head_dim, mask=mask, shape=shape), capturing=False)
        assert plan.whole and plan.family == "gluon", (head_dim, mask, plan.reason)
        assert plan.choices[0].key.spec.kernel == "bwd_varlen"
        assert BWD_VARLEN_DEFAULT_AHEAD[(head_dim, mask)] in plan.reason
    plan = d.backward(key("bwd_dkdv_varlen", d=64, mask="window", shape=shape), capturing=False)
    assert not plan.whole and plan.family == "triton" and "no measurement puts the gluon backward's default ahead" in plan.reason
    assert [c.key.spec.kernel for c in plan.choices] == ["bwd_dq_varlen", "bwd_dkdv_varlen"]


# -- the launcher and the library -----------------------------------------------------------

class _Kernel:
    def __init__(self, log, name):
        self.log, self.name = log, name


def test_the_launcher_addresses_the_packed_rows(monkeypatch):
    """Three launches: the strided preprocess over (1, h, total_q, d) views, the main
    kernel on (cdiv(max_seqlen_k, BLOCK_NT), batch * hk) with the packed descriptors,
    contiguous dK/dV, LSE2/delta one block past total_q, the window sizes and the
    offsets, then the strided convert into dQ's packed rows."""
    log = []
    mod = type("M", (), {"attn_bwd": _Kernel(log, "attn_bwd")})()
    monkeypatch.setattr(B, "launch", lambda fn, grid, args, **kw: log.append((getattr(fn, "name", fn), grid, args, kw)))
    spec = KernelSpec("bwd_varlen", "float16", 128, 128, "causal")
    lens_q, lens_k = [150, 0, 61, 1, 37], [61, 13, 150, 1, 0]
    q, k, v, do, cu_q, cu_k, mq, mk = bench.make_varlen_inputs(spec, lens_q, lens_k, 4, 2, device="cpu")
    o, lse = torch.randn_like(q), torch.randn(4, 249)
    cfg = GLUON.default_config(key(), SM90)
    dq, dk, dv = F.bwd_varlen(do, q, k, v, o, lse, cu_q, cu_k, mq, mk, softmax_scale=0.1, mask="causal", win_left=-1,
                              win_right=0, config=cfg, module=mod)
    (pre, pre_grid, pre_args, _), (name, grid, args, kw), (cv, cv_grid, cv_args, _) = log
    assert pre_grid == (-(-150 // 64), 5, 4) and pre_args[0] is o and pre_args[6] is cu_q
    assert name == "attn_bwd" and grid == (2, 5 * 2) and kw == {"num_warps": 8, "maxnreg": 168}
    assert [list(t.shape) for t in args[:4]] == [[1, 4, 249, 128], [1, 2, 225, 128], [1, 2, 225, 128],
                                                [1, 4, 249, 128]]
    assert [list(t.strides) for t in args[:2]] == [[128 * 4, 128, 128 * 4, 1], [128 * 2, 128, 128 * 2, 1]]
    lse2, delta, dqacc, dk_, dv_ = args[7:12]
    m_pad = 512  # 4 * (249 // 4 + 5) + 128 = 396 rows, rounded up to a multiple of 128
    assert lse2.shape == delta.shape == (4, m_pad) and dqacc.shape == (1, 4, 249, 128)
    assert not lse2.any() and not delta.any()  # zero between the sequences' rows
    assert dk_ is dk and dv_ is dv and dk.is_contiguous() and dk.shape == (225, 2, 128)
    assert args[14:21] == (4, 2, 150, 150, -1, 0, m_pad) and args[21] is cu_q and args[22] is cu_k
    assert cv_args[1].shape == (1, 4, 249, 128) and cv_args[1].data_ptr() == dq.data_ptr()


def test_the_library_runs_the_whole_backward_the_dispatcher_picks(monkeypatch):
    calls = []
    cfg = GLUON.default_config(key(), SM90)

    def whole(do, q, k, v, o, lse, cu_q, cu_k, mq, mk, **kw):
        calls.append(kw)
        return torch.ones_like(q), torch.zeros_like(k), torch.zeros_like(v)

    monkeypatch.setattr(library, "use_kernels", lambda q: True)
    monkeypatch.setattr(library, "varlen_backward_kernels", lambda *a: (cfg, "module"))
    monkeypatch.setattr(families, "launcher", lambda fam, name: whole if (fam, name) == ("gluon", "bwd_varlen")
                        else pytest.fail(f"{fam} {name}"))
    spec = KernelSpec("bwd_varlen", "float16", 64, 64, "none")
    q, k, v, do, cu_q, cu_k, mq, mk = bench.make_varlen_inputs(spec, [5, 7], [5, 7], 2, 1, device="cpu")
    dq, dk, dv = library.backward_varlen(do, q, k, v, q, torch.zeros(2, 12), cu_q, cu_k, mq, mk, 0.1, "none", -1, -1)
    assert torch.equal(dq, torch.ones_like(q)) and calls[0]["config"] is cfg and calls[0]["module"] == "module"
    assert (calls[0]["win_left"], calls[0]["win_right"], calls[0]["mask"]) == (-1, -1, "none")


def test_a_launch_limit_sends_that_call_to_the_two_kernels(monkeypatch):
    """batch * num_kv_heads over the grid's 65535: that call runs bwd_dq_varlen +
    bwd_dkdv_varlen, and the Gluon variant is not marked failed."""
    from flashgen import dispatch
    from flashgen.errors import LaunchLimitError

    cfg = GLUON.default_config(key(), SM90)
    calls = []

    def whole(*a, **kw):
        calls.append("gluon")
        raise LaunchLimitError("simulated: over CUDA's grid limit 65535")

    def two(do, q, k, v, o, lse, cu_q, cu_k, mq, mk, *, config_dq, config_dkdv, **kw):
        calls.append(("triton", config_dq, config_dkdv))
        return torch.ones_like(q), torch.zeros_like(k), torch.zeros_like(v)

    monkeypatch.setattr(library, "use_kernels", lambda q: True)
    monkeypatch.setattr(library, "varlen_backward_kernels", lambda *a: (cfg, "module"))
    monkeypatch.setattr(library, "varlen_kernel_for", lambda kernel, *a: (T1 if "dq" in kernel else T2, kernel))
    monkeypatch.setattr(families, "launcher", lambda fam, name: {("gluon", "bwd_varlen"): whole,
                                                                 ("triton", "bwd_varlen"): two}[(fam, name)])
    monkeypatch.setattr(dispatch, "_failed", {})
    spec = KernelSpec("bwd_varlen", "float16", 64, 64, "none")
    q, k, v, do, cu_q, cu_k, mq, mk = bench.make_varlen_inputs(spec, [5, 7], [5, 7], 2, 1, device="cpu")
    dq, _, _ = library.backward_varlen(do, q, k, v, q, torch.zeros(2, 12), cu_q, cu_k, mq, mk, 0.1, "none", -1, -1)
    assert calls == ["gluon", ("triton", T1, T2)] and torch.equal(dq, torch.ones_like(q)) and dispatch._failed == {}
    with pytest.raises(LaunchLimitError, match="grid limit 65535"):
        B.varlen_launch_args(q, q, k, k, q, torch.zeros(2, 12), torch.zeros(70001, dtype=torch.int32),
                             torch.zeros(70001, dtype=torch.int32), 5, 5, softmax_scale=0.1, win_left=-1,
                             win_right=-1, config=F.bwd_config(cfg))


# -- sm_90 compile ------------------------------------------------------------------------

#: (config fields over the varlen default, head_dim, mask): each default, the dQ writer twin
CASES = [(None, 128, "causal"), (None, 128, "none"), (None, 64, "causal"), (None, 64, "none"),
         ({"dq_writer": True}, 128, "causal"), ({"block_m": 128, "stages": 2, "split": False}, 64, "none")]

#: ptxas spill-store bytes of the varlen variants by Triton minor version (any other
#: spill fails), keyed by (CASES index, head_dim, mask).  BLOCK_M 128 at head_dim 64
#: spills by design (bwd.LOCKSTEP_SPILL_SLACK_REGS; its dense twin 36 B under 3.6, 40 B
#: under 3.9); under 3.9 the sequence's rows and bounds beside the head_dim 128 tiles
#: (their dense twins 8 B causal, none otherwise).
SPILLS = {"3.6": {(5, 64, "none"): 64},
          "3.9": {(0, 128, "causal"): 8, (1, 128, "none"): 32, (4, 128, "causal"): 12, (5, 64, "none"): 36}}

_SCRIPT = r'''
import dataclasses, json, re, sys
sys.path.insert(0, ROOT)
from flashgen.families.gluon import bwd as B, sm90
for i, (kw, d, mask) in enumerate(CASES):
    cfg = B.varlen_default_config(d, "bfloat16", mask)
    cfg = dataclasses.replace(cfg, **kw) if kw else cfg
    for varlen in (True, False):
        k = B.compile_sm90(cfg, "bfloat16", d, mask, varlen=varlen)
        rep = sm90.report(k)
        print("CASE", json.dumps({"i": i, "varlen": varlen, "spill": rep.spill_bytes,
                                  "c751x": re.findall(r"C751[245]", rep.ptxas_log), "hgmma": rep.hgmma,
                                  "setmaxreg": rep.setmaxnreg,
                                  "tma2d": k.asm["ptx"].count("cp.async.bulk.tensor.2d"),
                                  "reduce4d": k.asm["ptx"].count("cp.reduce.async.bulk.tensor.4d"),
                                  "smem": k.metadata.shared}))
'''


def test_each_varlen_variant_compiles_as_its_dense_twin():
    """The same HGMMA count, setmaxnreg budgets and 2-D TMA copies (LSE2, delta) as the
    dense variant of the same config, dQ by 4-D reduce-adds, no serialized wgmma (ptxas
    C7512-C7515) and the spills of SPILLS."""
    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("triton's bundled ptxas is missing")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", f"ROOT = {ROOT!r}\nCASES = {CASES!r}\n" + _SCRIPT], capture_output=True,
                       text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line[5:]) for line in r.stdout.splitlines() if line.startswith("CASE ")]
    assert len(rows) == 2 * len(CASES)
    pinned = SPILLS.get(".".join(triton.__version__.split(".")[:2]), {})
    for i, (_, d, mask) in enumerate(CASES):
        vl, dense = (next(x for x in rows if x["i"] == i and x["varlen"] is v) for v in (True, False))
        assert vl["hgmma"] == dense["hgmma"] > 0 and vl["setmaxreg"] == dense["setmaxreg"] != [], (vl, dense)
        assert vl["tma2d"] == dense["tma2d"] and vl["reduce4d"] >= 1 and vl["c751x"] == [], vl
        assert vl["spill"] == pinned.get((i, d, mask), 0), (vl, dense)


@pytest.mark.parametrize("lens", [[150, 0, 61, 1, 37], [3, 5, 0, 0, 9, 1], [0, 4, 4]])
def test_the_row_starts_are_aligned_and_disjoint(lens):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    p = B.varlen_row_starts(cu)
    assert all(x % 4 == 0 for x in p)
    assert all(p[z] + lens[z] <= p[z + 1] for z in range(len(lens) - 1))
    assert p[-1] + lens[-1] <= 4 * (cu[-1] // 4 + len(lens))  # within the launcher's m_pad less ROW_PAD


def test_the_varlen_preprocess_places_each_sequence_at_its_row_start(monkeypatch):
    """In Triton's interpreter: delta = rowsum(dO * O) and LSE2 = LSE * log2(e) (0 for
    -inf) at the rows of varlen_row_starts, 0 between the sequences; the float32 dQ
    accumulator zeroed; O and dO with row strides of a packed QKV-like layout."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from flashgen.families.gluon import strided

    torch.manual_seed(0)
    lens, h, d = [7, 0, 5, 1, 9], 3, 64
    cu = torch.tensor([0, 7, 7, 12, 13, 22], dtype=torch.int32)
    tq = 22
    o = torch.randn(tq, h, 2 * d, dtype=torch.float16)[:, :, :d]  # row stride 2 * h * d
    do = torch.randn(tq, h, d, dtype=torch.float16)
    lse = torch.randn(h, tq)
    lse[1, 3] = float("-inf")
    m_pad = 128
    lse2, delta = torch.zeros(h, m_pad), torch.zeros(h, m_pad)
    dqacc = torch.full((1, h, tq, d), 7.0)
    grid, args = strided.varlen_preprocess_launch(o, do, lse, lse2, delta, dqacc, cu, max(lens), m_pad)
    strided.varlen_preprocess[grid](*args, num_warps=strided.NUM_WARPS)
    want_delta, want_lse2 = torch.zeros(h, m_pad), torch.zeros(h, m_pad)
    for z, p in enumerate(B.varlen_row_starts(cu.tolist())):
        a, n = int(cu[z]), lens[z]
        want_delta[:, p:p + n] = (o[a:a + n].float() * do[a:a + n].float()).sum(-1).T
        want_lse2[:, p:p + n] = lse[:, a:a + n] * 1.4426950408889634
    want_lse2[1, 3 + B.varlen_row_starts(cu.tolist())[0]] = 0.0
    torch.testing.assert_close(delta, want_delta, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse2, want_lse2)
    assert not dqacc.any()

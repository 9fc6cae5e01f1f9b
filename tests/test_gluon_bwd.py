"""The Gluon backward (flashgen/families/gluon/bwd.py) without a GPU: validity rules, the
shared-memory model, and representative variants compiled for sm_90 with Triton's
bundled ptxas (no spills but those recorded, no wgmma serialization info C7512/C7514/C7515)
and cuobjdump (HGMMA,
USETMAXREG: warp-specialized with register budgets)."""

import ast
import dataclasses
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from flashgen.families.gluon import bwd as B  # noqa: E402

#: (config fields, head_dim, mask): compiled and checked for sm_90; the defaults of both
#: head dims (lock-step partition at 128, split partitions at 64; LSE2/delta by 2-D TMA)
#: first, the group-split variants (float32, then 16-bit dK/dV partials) last.  Fields in
#: GluonBwdConfig's order (block_m, block_n, consumers, stages, dq_mode, consumer_regs,
#: producer_regs, row_load, producer_warps, split, group_split, half_partials).
CASES = [
    ((64, 64, 2, 2, "tma", 240, 24, "tma"), 128, "causal"),
    ((64, 64, 2, 2, "tma", 240, 24, "tma"), 128, "none"),
    ((64, 64, 2, 4, "tma", 240, 24, "tma", 1, True), 64, "none"),
    ((64, 64, 2, 4, "tma", 240, 24, "tma", 1, True), 64, "causal"),
    ((64, 64, 2, 3, "tma", 240, 24, "tma"), 128, "window"),
    ((64, 64, 2, 2, "atomic", 240, 24, "producer"), 128, "causal"),
    ((64, 64, 2, 4, "tma", 240, 24, "producer", 1, True), 64, "window"),
    ((64, 64, 2, 2, "tma", 240, 24, "tma", 1, False, 4), 128, "causal"),
    ((64, 64, 2, 2, "tma", 240, 24, "tma", 1, False, 2), 128, "none"),
    ((64, 64, 2, 4, "tma", 240, 24, "tma", 1, True, 2), 64, "causal"),
    ((64, 64, 2, 3, "tma", 240, 24, "tma", 1, False, 8), 128, "window"),
    ((64, 64, 2, 2, "tma", 240, 24, "tma", 1, False, 4, True), 128, "causal"),
    ((64, 64, 2, 4, "tma", 240, 24, "tma", 1, True, 2, True), 64, "causal"),
    # BLOCK_M 128 at head_dim 64: admitted over the register model by the lock-step slack
    ((128, 64, 2, 2, "tma", 240, 24, "tma"), 64, "none"),
    # the dQ tile staged in the accumulator's fragment order (the defaults of both head dims)
    ((64, 64, 2, 2, "tma", 240, 24, "tma", 1, False, 1, False, "fragment"), 128, "causal"),
    ((64, 64, 2, 4, "tma", 240, 24, "tma", 1, True, 1, False, "fragment"), 64, "none"),
    # dK and dV out by TMA stores (the defaults of both head dims), and the searched tiles
    # whose registers or partitions differ: one consumer, BLOCK_M 128 in lock-step, atomic
    # and ordered dQ
    ((64, 64, 2, 2, "tma", 240, 24, "tma", 1, False, 1, False, "fragment", "tma"), 128, "causal"),
    ((64, 64, 2, 4, "tma", 240, 24, "tma", 1, True, 1, False, "fragment", "tma"), 64, "none"),
    ((64, 64, 1, 2, "tma", 248, 24, "tma", 1, False, 1, False, "fragment", "tma"), 64, "window"),
    ((128, 64, 2, 2, "tma", 240, 24, "tma", 1, False, 1, False, "fragment", "tma"), 64, "causal"),
    ((64, 64, 2, 2, "atomic", 240, 24, "producer", 1, False, 1, False, "swizzled", "tma"), 64, "causal"),
    ((64, 64, 2, 2, "ordered", 240, 24, "tma", 1, False, 1, False, "fragment", "tma"), 128, "causal"),
    # the deterministic backward's shipped row at head_dim 128 causal 4096 (spills: below)
    ((64, 64, 2, 3, "ordered", 240, 24, "producer", 1, False, 1, False, "fragment", "tma"), 128, "causal"),
    # the longest-first grid: the head_dim 128 default and a GQA split (its coordinates
    # recomputed for the register stores of the partials)
    ((64, 64, 2, 2, "tma", 240, 24, "tma", 1, False, 1, False, "fragment", "tma", True), 128, "causal"),
    ((64, 64, 2, 2, "tma", 240, 24, "producer", 1, False, 4, False, "fragment", "ptr", True), 128, "causal"),
    # the dQ writer warp: the deterministic rows' ordered tile at head_dim 128, the
    # BLOCK_M 128 tile at head_dim 64, a longest-first GQA split with 16-bit partials
    ((64, 64, 2, 2, "ordered", 240, 24, "tma", 1, False, 1, False, "fragment", "tma", False, True), 128, "causal"),
    ((128, 64, 2, 2, "tma", 240, 24, "tma", 1, False, 1, False, "fragment", "tma", False, True), 64, "none"),
    ((64, 64, 2, 2, "tma", 240, 24, "tma", 1, False, 4, True, "fragment", "ptr", True, True), 128, "causal"),
    # head_dim 96 on the head_dim 128 tiles (bwd.tile_dim): the default, and a GQA split
    # whose register stores of the partials mask the padding columns
    ((64, 64, 2, 2, "tma", 240, 24, "tma", 1, False, 1, False, "fragment", "tma"), 96, "causal"),
    ((64, 64, 2, 2, "tma", 240, 24, "tma", 1, False, 2, False, "fragment", "ptr"), 96, "none"),
    # head_dim 256 on the column-split program: the default (dQ in four chunks by TMA
    # reduce-adds, dK and dV by TMA stores), dQ by atomics in two chunks with the register
    # stores, and one ring stage with two chunks under a window
    ((64, 64, 2, 2, "tma", 240, 24, "tma", 1, False, 1, False, "swizzled", "tma", False, False, 4), 256, "causal"),
    ((64, 64, 2, 2, "atomic", 240, 24, "tma", 1, False, 1, False, "swizzled", "ptr", False, False, 2), 256,
     "none"),
    ((64, 64, 2, 1, "tma", 240, 24, "producer", 1, False, 1, False, "swizzled", "tma", False, False, 2), 256,
     "window"),
    # the column-split program issuing the next step's S^T and dP^T ahead (lookahead 1:
    # after dK; 2: interleaved with the dQ chunks) on the default, and with atomic dQ and
    # the register stores (refused as measured slower, bwd.MEASURED_SLOWER)
    ((64, 64, 2, 2, "tma", 240, 24, "tma", 1, False, 1, False, "swizzled", "tma", False, False, 4, 1), 256,
     "causal"),
    ((64, 64, 2, 2, "tma", 240, 24, "tma", 1, False, 1, False, "swizzled", "tma", False, False, 4, 2), 256,
     "causal"),
    ((64, 64, 2, 2, "atomic", 240, 24, "producer", 1, False, 1, False, "swizzled", "ptr", False, False, 4, 1),
     256, "window"),
    # its role split (two 4-warp partitions: S^T and P^T, dP^T and dS^T; refused as
    # measured slower, bwd.ROLE_SPLIT_SLOWER): two stages under a mask, one without
    ((64, 64, 2, 2, "atomic", 240, 24, "tma", 1, True, 1, False, "swizzled", "ptr", False, False, 4), 256, "causal"),
    ((64, 64, 2, 1, "atomic", 240, 24, "producer", 1, True, 1, False, "swizzled", "ptr", False, False, 4), 256,
     "none"),
]

#: ptxas spill-store bytes of CASES (by config id, head_dim, mask) under a Triton other
#: than 3.6 (3.6: none but the BLOCK_M 128 tiles at head_dim 64, which the rules admit
#: over the register model; with dK and dV stored by TMA and a causal mask 80 B, 60 B
#: under 3.9).  Triton 3.9 assembles sm_90 with ptxas 13.x and
#: ``--regAllocOptLevel=2`` (shim.ptxas_sm90); the d128 causal default spills 8 B only
#: with that flag; the three-stage window variant (24 B) and the atomic dQ variant
#: (8 B, 28 B with the flag) spill from 3.9's own PTX (the same with ptxas 12.8).
#: Any other spill fails.  A group split (``_gs``) changes only the epilogue's stores, so
#: its variants may spill no more than their unsplit variant (under 3.9 the window
#: variant split 8 ways spills 20 B against its unsplit variant's 24).
SPILL_BYTES = {
    # BLOCK_M 128 at head_dim 64 spills by design (bwd.LOCKSTEP_SPILL_SLACK_REGS)
    "3.6": {("m128_n64_c2_s2_tma_r240-24_rows-tma", 64, "none"): 36,
            ("m128_n64_c2_s2_tma_r240-24_rows-tma_dqf_kvt", 64, "causal"): 80,
            # 4 B with the TMA stores (0 B with the register stores): measured fastest
            ("m64_n64_c2_s3_ordered_r240-24_rows-producer_dqf_kvt", 128, "causal"): 4,
            ("m128_n64_c2_s2_tma_r240-24_rows-tma_dqf_kvt_dqw", 64, "none"): 32},
    "3.9": {("m128_n64_c2_s2_tma_r240-24_rows-tma", 64, "none"): 40, ("m64_n64_c2_s2_tma_r240-24_rows-tma", 128, "causal"): 8,
            ("m64_n64_c2_s3_tma_r240-24_rows-tma", 128, "window"): 24,
            ("m64_n64_c2_s2_atomic_r240-24_rows-producer", 128, "causal"): 28,
            ("m128_n64_c2_s2_tma_r240-24_rows-tma_dqf_kvt", 64, "causal"): 60,
            ("m64_n64_c2_s2_ordered_r240-24_rows-tma_dqf_kvt_dqw", 128, "causal"): 8,
            ("m128_n64_c2_s2_tma_r240-24_rows-tma_dqf_kvt_dqw", 64, "none"): 44,
            # head_dim 256's one-stage column-split program with two dQ chunks under a
            # window (3.6: none; its default and atomic variants spill nothing under 3.9)
            ("m64_n64_c2_s1_tma_r240-24_rows-producer_kvt_cs2", 256, "window"): 96,
            # its one-stage role split (3.6: none; two stages: none under 3.9)
            ("m64_n64_c2_s1_atomic_r240-24_rows-producer_split_cs4", 256, "none"): 72},
}

_SCRIPT = r'''
import json, os, re, subprocess, sys, tempfile
sys.path.insert(0, ROOT)
from flashgen.families.gluon import bwd as B
from flashgen.families.gluon.shim import cuobjdump, ptxas_sm90
for fields, d, mask in CASES:
    cfg = B.GluonBwdConfig(*fields)
    # a variant refused only until its float64 checks have run on the GPU, or for its
    # measured speed, compiles as it would run
    reasons = B.invalid_reasons(cfg, d, "bfloat16", mask)
    k = B.compile_sm90(cfg, "bfloat16", d, mask,
                       check=not reasons or not all(B.NOT_CHECKED in r or r in B.MEASURED_SLOWER for r in reasons))
    with tempfile.TemporaryDirectory() as t:
        ptx, cubin = os.path.join(t, "k.ptx"), os.path.join(t, "k.cubin")
        open(ptx, "w").write(k.asm["ptx"])
        info = subprocess.run([*ptxas_sm90(), "-v", "--gpu-name", "sm_90a", ptx, "-o", cubin],
                              capture_output=True, text=True).stderr
        open(cubin, "wb").write(k.asm["cubin"])
        sass = subprocess.run([cuobjdump(), "-sass", cubin], capture_output=True, text=True).stdout
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", info)]
    print("CASE", json.dumps({"id": cfg.id, "d": d, "mask": mask, "smem": k.metadata.shared,
                              "model": B.smem_bytes(cfg, B.tile_dim(d)), "spill": max(spills) if spills else None,
                              "c751x": re.findall(r"C751[245]", info), "hgmma": sass.count("HGMMA"),
                              "usetmaxreg": sass.count("USETMAXREG"), "num_warps": k.metadata.num_warps,
                              "split": cfg.split, "row_load": cfg.row_load, "tma1d": "cp.async.bulk.tensor.1d" in k.asm["ptx"],
                              "tma2d": k.asm["ptx"].count("cp.async.bulk.tensor.2d"),
                              "reduce2d": k.asm["ptx"].count("cp.reduce.async.bulk.tensor.2d"),
                              "sts128": sass.count("STS.128"), "sts64": sass.count("STS.64"),
                              "parts": cfg.parts, "block_m": cfg.block_m, "stage": cfg.dq_stage,
                              "kv_store": cfg.kv_store, "stg": len(re.findall(r"\bSTG\.E", sass)),
                              "tma_stores": sass.count("UTMASTG"),
                              "waits": re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x[0-9a-f]+)", sass)}))
for kern in ("attn_bwd_preprocess", "attn_bwd_convert"):
    B.compile_sm90(B.default_config(128), "float16", 128, "none", kern)
    print("AUX", kern)
for gs in (2, 4):
    r = B.compile_sm90(B.GluonBwdConfig(group_split=gs, row_load="tma"), "bfloat16", 128, "causal", "group_reduce")
    print("AUX", "group_reduce", gs, int("ld.global.v4" in r.asm["ptx"]))
r = B.compile_sm90(B.default_config(64), "bfloat16", 64, "none", "attn_bwd_convert")
print("AUX", "fragment_convert", int("ld.global.v4" in r.asm["ptx"] and "st.shared.v4" in r.asm["ptx"]))
'''


def _have_ptxas():
    import triton

    return os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas"))


def compile_features(case) -> set:
    """The (knob, value) pairs of a CASES entry: every field of its config, its head dim
    and mask (tests/sm90.py: covering)."""
    fields, d, mask = case
    return {(f"config.{k}", x) for k, x in dataclasses.asdict(B.GluonBwdConfig(*fields)).items()} | \
        {("head_dim", d), ("mask", mask)}


def _compile(cases):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", f"ROOT = {ROOT!r}\nCASES = {cases!r}\n" + _SCRIPT], capture_output=True,
                       text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


@pytest.fixture(scope="module")
def compiled(request, once_per_run):
    """CASES (or their covering subset, tests/sm90.py) compiled once per test run, the
    workers' shared."""
    from sm90 import chosen

    if not _have_ptxas():
        pytest.skip("triton's bundled ptxas is missing")
    cases = chosen(request.config, CASES, compile_features)
    out = once_per_run("gluon-bwd-compiled", lambda: _compile(cases)).splitlines()
    rows = [json.loads(line[5:]) for line in out if line.startswith("CASE ")]
    aux = [line for line in out if line.startswith("AUX ")]
    assert len(rows) == len(cases) and len(aux) == 5, out
    # the reduction's loads are 16-byte vectors, and the fragment-order convert's loads
    # and shared-memory stores
    assert all(line.endswith(" 1") for line in aux if "group_reduce" in line or "fragment" in line), aux
    return rows


def test_variants_compile_without_spills_or_serialized_wgmma(compiled):
    import triton

    spills = SPILL_BYTES.get(".".join(triton.__version__.split(".")[:2]), {})
    for c in compiled:
        unsplit = re.sub(r"_gs\d+h?$", "", c["id"])
        known = spills.get((unsplit, c["d"], c["mask"]), 0)
        if unsplit == c["id"]:
            assert c["spill"] == known, c
        else:  # a group split changes only the stores: no more spilling than its unsplit variant
            assert c["spill"] <= known, c
        assert c["c751x"] == [], c


def test_sass_is_warp_specialized_hgmma(compiled):
    for c in compiled:
        assert c["hgmma"] > 0, c
        assert c["usetmaxreg"] > 0, c
        # consumers' warps plus the producer's warpgroup
        assert c["num_warps"] in (4, 8, 12), c


def test_rows_come_by_2d_tma_never_1d(compiled):
    # The 1-D TMA copy of LSE2/delta faulted on the H200; "tma" rows are 2-D copies.
    for c in compiled:
        assert not c["tma1d"], c
        assert (c["tma2d"] >= 2) == (c["row_load"] == "tma"), c


def test_fragment_staged_dq_is_stored_by_16_byte_stores(compiled):
    """dq_stage "fragment": each thread stores its block_m x head_dim / threads float32 dQ
    values by 16-byte stores (four per store) and the tile leaves by one 2-D reduce-add
    per partition; the swizzled tile by 8-byte stores."""
    for c in compiled:
        if c["stage"] == "fragment":
            threads = 128 * (2 // c["parts"])  # of one partition: lock-step 2 warpgroups, split 1
            assert c["sts128"] >= c["parts"] * c["block_m"] * c["d"] // threads // 4, c
            # (a few 8-byte stores elsewhere: the swizzled tile takes 16 or more)
            assert c["sts64"] < 8 and c["reduce2d"] == c["parts"], c
        elif c["id"].split("_")[4] == "tma":  # dq_mode
            assert c["sts128"] <= 1 and c["sts64"] >= 16 and c["reduce2d"] == 0, c


def test_kv_store_tma_leaves_no_global_store_to_the_warps(compiled):
    """kv_store "tma": dK and dV leave by two TMA stores per partition and no consumer
    stores to global memory; the register epilogue stores them with STG."""
    for c in compiled:
        if c["kv_store"] == "tma":
            # (the ordered dQ's semaphore releases are its only global stores: two in the
            # consumers, in the loop and after it, or one in the dQ writer's loop)
            releases = (1 if c["id"].endswith("_dqw") else 2) if "_ordered_" in c["id"] else 0
            assert c["stg"] == releases and c["tma_stores"] == 2 * c["parts"], c
        else:
            assert c["stg"] > 0 and c["tma_stores"] == 0, c


def test_kv_store_rules_launch_and_search():
    """Searched beside the register stores, never with a group split; the default of both
    head dims; the launch passes (z, hk, N, D) descriptors for dK and dV with one
    partition's rows as the box."""
    for d in B.HEAD_DIMS:
        space = B.search_space(d, "bfloat16", "causal", group=4)
        d = B.tile_dim(d)  # the rules are the tiles' (96: 128)
        assert {c.kv_store for c in space} == set(B.KV_STORES)
        assert all(c.group_split == 1 for c in space if c.kv_store == "tma")
        # every register-store config has its TMA-store twin unless it splits the group, or
        # at head_dim 128 adds dQ by atomics or splits the partitions
        assert {dataclasses.replace(c, kv_store="tma") for c in space
                if c.group_split == 1 and (d < 128 or (c.dq_mode != "atomic" and not c.split))} <= set(space)
        assert B.default_config(d).kv_store == "tma"
    cfg = B.default_config(64)
    assert cfg.id.endswith("_dqf_kvt") and B.is_valid(cfg, 64)
    assert any("group split" in r for r in B.invalid_reasons(dataclasses.replace(cfg, group_split=2), 64))
    atomic = dataclasses.replace(cfg, dq_mode="atomic", dq_stage="swizzled", split=False, stages=2)
    assert B.is_valid(atomic, 64) and any("spills" in r for r in B.invalid_reasons(atomic, 128))
    # a split partition's rows of a 256-byte-row tile are two 8 KB pieces, not one box
    split = dataclasses.replace(cfg, dq_stage="swizzled", stages=2)
    assert split.split and B.is_valid(split, 64)
    assert any("not contiguous" in r for r in B.invalid_reasons(split, 128))
    assert B.is_valid(dataclasses.replace(split, split=False), 128)
    assert any("kv_store 'smem'" in r for r in B.invalid_reasons(dataclasses.replace(cfg, kv_store="smem"), 64))
    q = torch.empty(2, 4, 300, 64, dtype=torch.bfloat16)
    k = torch.empty(2, 2, 200, 64, dtype=torch.bfloat16)
    a = B.launch_args(q, q, k, k, q, torch.empty(2, 4, 300), softmax_scale=0.1, diag_lo=-300, diag_hi=200,
                      config=cfg)
    dk_desc, dv_desc = a["main"][1][10:12]
    assert dk_desc.base is a["dk"] and dv_desc.base is a["dv"] and dk_desc.block_shape == [1, 1, 64, 64]
    assert dk_desc.shape == [2, 2, 200, 64] and dk_desc.strides == list(a["dk"].stride())
    src = B.render(cfg, "bfloat16", 64, "none")
    assert "tma_store(DK, [off_z, off_hk, nc, 0]" in src and "gl.store(DK" not in src
    assert "tma_store" not in B.render(dataclasses.replace(cfg, kv_store="ptr"), "bfloat16", 64, "none")


def test_dq_writer_rules_model_and_render():
    """dq_writer: the reduce-add modes only, not the column halves of split partitions at
    head_dim 128; two staging tiles per partition and the writer's barriers in the shared
    memory model; a one-warp writer partition in the producer's warpgroup that alone
    waits on, adds and (ordered) releases, while the consumers only stage and signal."""
    base = B.default_config(128)
    cfg = dataclasses.replace(base, dq_writer=True)
    assert cfg.id == base.id + "_dqw" and B.is_valid(cfg, 128, "bfloat16", "causal")
    assert any("dq_writer issues TMA reduce-adds" in r
               for r in B.invalid_reasons(dataclasses.replace(cfg, dq_mode="atomic", kv_store="ptr"), 128))
    assert any("column halves" in r for r in B.invalid_reasons(dataclasses.replace(cfg, split=True, kv_store="ptr"),
                                                                 128))
    assert any("producer_warps 1" in r for r in B.invalid_reasons(dataclasses.replace(cfg, producer_warps=4), 128))
    split64 = dataclasses.replace(B.default_config(64), dq_writer=True)
    assert B.is_valid(split64, 64, "bfloat16", "none")
    for c, d in ((cfg, 128), (split64, 64)):
        t, t0 = B.smem_terms(c, d), B.smem_terms(dataclasses.replace(c, dq_writer=False), d)
        assert t["dq_tile"] == 2 * t0["dq_tile"] == 2 * c.parts * 64 * d * 4 and t["barriers"] == t0["barriers"] + 256
    # three ring stages and two staging tiles do not fit at head_dim 128
    assert any("shared memory" in r for r in B.invalid_reasons(dataclasses.replace(cfg, stages=3), 128))
    assert cfg.maxnreg == base.maxnreg  # the writer's warp shares the producer's warpgroup
    for mode in ("tma", "ordered"):
        src = B.render(dataclasses.replace(cfg, dq_mode=mode), "bfloat16", 128, "causal")
        writer = src[src.index("def _dq_writer("):src.index("def _consumer_0(")]
        consumer = src[src.index("def _consumer("):src.index("def _dq_writer(")]
        consumer = consumer[:consumer.index("mbarrier.arrive(empty.index(s))")]  # through the step's end
        assert "(_dq_writer, writer_args)," in src and "], [1, 1], [24, 24])" in src
        assert writer.count("tma_reduce_add(") == 1 and "tma_reduce_add(" not in consumer
        assert "mbarrier.arrive(dq_full.index(slot))" in consumer and "mbarrier.wait(dq_empty.index(slot)" in consumer
        for call in ("_sem_wait(", "_sem_release(", "_bulk_done(", "store_wait("):
            assert call not in consumer, (mode, call)
        assert ("_sem_wait(SEM + tile, u)" in writer) == ("_sem_release(SEM + tile, u + 1)" in writer) == \
            (mode == "ordered")
    assert "_dq_writer" not in B.render(base, "bfloat16", 128, "causal")


def test_longest_first_rules_and_launch():
    """Under a causal or window mask only, never with the ordered dQ (its own 1-D grid);
    a 1-D grid of every (key block, pair) with the section as the last argument."""
    cfg = dataclasses.replace(B.default_config(128), longest_first=True)
    assert cfg.id.endswith("_dqf_kvt_lpt")
    assert B.is_valid(cfg, 128, "bfloat16", "causal") and B.is_valid(cfg, 128, "bfloat16", "window")
    assert any("without a mask" in r for r in B.invalid_reasons(cfg, 128, "bfloat16", "none"))
    assert any("ordered" in r for r in B.invalid_reasons(dataclasses.replace(cfg, dq_mode="ordered"), 128,
                                                           "bfloat16", "causal"))
    q = torch.empty(2, 8, 300, 128, dtype=torch.bfloat16)
    k = torch.empty(2, 2, 1000, 128, dtype=torch.bfloat16)
    for c, pairs in ((cfg, 4), (dataclasses.replace(cfg, group_split=2, kv_store="ptr"), 8)):
        a = B.launch_args(q, q, k, k, q, torch.empty(2, 8, 300), softmax_scale=0.1, diag_lo=-300, diag_hi=700,
                          config=c)
        grid, args = a["main"]
        assert grid == (8 * pairs,)  # cdiv(1000, 128) key blocks
        assert args[-1] == B.longest_first_section(pairs, 4 // c.group_split, 300, 128) == pairs
    src = B.render(cfg, "bfloat16", 128, "causal")
    assert "_longest_first_program(gl.program_id(0), gl.num_programs(0), seqlen_k, section)" in src
    assert "_longest_first_program" not in B.render(B.default_config(128), "bfloat16", 128, "causal")


@pytest.mark.parametrize("pairs, n_kb, section", [(1, 1, 1), (7, 3, 7), (16, 8, 4), (12, 5, 6), (64, 32, 4)])
def test_longest_first_program_covers_the_grid_in_sections(pairs, n_kb, section):
    """Every (key block, pair) once; the pairs in sections of ``section``, within a
    section key block major (the first key block of every pair of the section first)."""
    # the template's _longest_first_program is _ordered_program's arithmetic (section = head_group)
    got = [B.ordered_program(pid, n_kb * pairs, n_kb, section) for pid in range(n_kb * pairs)]
    assert sorted(got) == sorted((kb, p) for kb in range(n_kb) for p in range(pairs))
    want = [(kb, base + p) for base in range(0, pairs, section) for kb in range(n_kb)
            for p in range(min(section, pairs - base))]
    assert got == want


def test_longest_first_section_is_a_divisor_within_the_l2_share():
    """The largest divisor of the pairs whose Q and dO fit the L2 share; all pairs when
    they fit; one pair when even one does not."""
    per_pair = 4 * 4096 * 128 * 4  # group 4, seqlen 4096, head_dim 128: Q and dO, 2 B each
    assert B.L2_SECTION_BYTES // per_pair == 4
    assert B.longest_first_section(64, 4, 4096, 128) == 4
    assert B.longest_first_section(30, 4, 4096, 128) == 3
    assert B.longest_first_section(7, 4, 4096, 128) == 1
    assert B.longest_first_section(16, 2, 2048, 128) == 16
    assert B.longest_first_section(5, 16, 65536, 128) == 1


def test_fragment_order_is_the_accumulator_fragment():
    """fragment_bases (the staging tile's shared layout) and the offset rule the template's
    comment and convert use agree, and lay the wgmma accumulator out as the PTX ISA gives
    its m64nNk16 D fragment: thread t of a warp holds (t / 4, 2 (t % 4)) and its neighbours
    (+0, +1), (+8, +0), (+8, +1) in four consecutive registers, stored at 16 t + 0..3."""
    for block_m in (64, 128):
        for d in sorted({B.tile_dim(d) for d in B.HEAD_DIMS}):
            bases = B.fragment_bases(block_m, d)
            assert len(bases) == (block_m * d).bit_length() - 1

            def offset(r, c):
                return ((c % 2) | (r // 8 % 2) << 1 | (c // 2 % 4) << 2 | (r % 8) << 4 | (c // 8) << 7
                        | (r // 16) << (7 + (d // 8).bit_length() - 1))

            seen = set()
            for r in range(block_m):
                for c in range(d):
                    off = offset(r, c)
                    rr = cc = 0
                    for i, (br, bc) in enumerate(bases):
                        if off >> i & 1:
                            rr, cc = rr ^ br, cc ^ bc
                    assert (rr, cc) == (r, c), (block_m, d, r, c)
                    seen.add(off)
            assert seen == set(range(block_m * d))
            for t in range(32):
                r, c = t // 4, 2 * (t % 4)
                assert [offset(r, c), offset(r, c + 1), offset(r + 8, c), offset(r + 8, c + 1)] == \
                    [4 * t, 4 * t + 1, 4 * t + 2, 4 * t + 3]


def test_fragment_stage_rules_launch_and_search():
    """The search space holds both staging orders (the TMA reduce-add's only); the
    fragment order's accumulator is padded to m_pad rows, read by a 2-D unswizzled
    descriptor and converted by the template's own kernel into dQ of any layout."""
    for d in B.HEAD_DIMS:
        space = B.search_space(d, "bfloat16", "causal")
        assert {c.dq_stage for c in space} == set(B.DQ_STAGES)
        assert all(c.dq_mode == "tma" for c in space if c.dq_stage == "fragment")
    frag = B.default_config(128)
    assert frag.dq_stage == "fragment" and frag.id.endswith("_dqf_kvt") and B.default_config(64).dq_stage == "fragment"
    assert any("dq_mode 'atomic'" in r for r in B.invalid_reasons(dataclasses.replace(frag, dq_mode="atomic"), 128))
    assert any("column halves" in r for r in B.invalid_reasons(dataclasses.replace(frag, split=True), 128))
    assert any("dq_stage 'rows'" in r for r in B.invalid_reasons(dataclasses.replace(frag, dq_stage="rows"), 128))
    assert B.smem_terms(frag, 128) == B.smem_terms(dataclasses.replace(frag, dq_stage="swizzled"), 128)
    b, h, hk, s, d = 2, 4, 2, 300, 128
    q = torch.empty(b, s, h, d, dtype=torch.bfloat16).transpose(1, 2)
    k = torch.empty(b, hk, s, d, dtype=torch.bfloat16)
    a = B.launch_args(q, q, k, k, q, torch.empty(b, h, s), softmax_scale=0.1, diag_lo=-s, diag_hi=0, config=frag)
    m_pad = 384
    assert a["dqacc"].shape == (b * h, m_pad, d) and a["dqacc"].dtype == torch.float32
    desc = a["main"][1][6]
    assert desc.shape == [b * h * m_pad, d] and desc.strides == [d, 1] and desc.block_shape == [64, d]
    assert desc.layout.swizzle_byte_width == 0
    # the template's convert, with dQ's strides (here transformers' layout); O and dO by strides
    assert "convert_strided" not in a and "preprocess_strided" in a
    grid, args = a["convert"]
    assert grid == (b * h * 5,) and args[:5] == (a["dqacc"], a["dq"], h, s, m_pad)
    assert args[5:8] == a["dq"].stride()[:3] == q.stride()[:3]
    assert a["preprocess_strided"][1][-2:] == (True, d)  # zero the whole padded accumulator; DG = head_dim


def test_shared_memory_model_matches_the_compiler(compiled):
    for c in compiled:
        assert abs(c["model"] - c["smem"]) <= 256, c
        assert c["smem"] <= B.SMEM_LIMIT_BYTES


def test_rules_reject_what_the_kernels_cannot_take():
    ok = B.default_config(128)
    assert B.is_valid(ok, 128) and B.is_valid(B.default_config(64), 64)
    assert B.is_valid(B.GluonBwdConfig(row_load="tma"), 128) and B.is_valid(B.GluonBwdConfig(row_load="producer"), 128)
    assert any("row_load" in r for r in B.invalid_reasons(B.GluonBwdConfig(row_load="1d"), 128))
    assert any("split needs 2 consumers" in r for r in B.invalid_reasons(B.GluonBwdConfig(consumers=1, split=True), 64))
    # a whole BLOCK_M 128 dQ tile per split partition does not fit the register budget at d64
    assert any("registers per thread" in r for r in B.invalid_reasons(B.GluonBwdConfig(block_m=128, split=True), 64))
    assert any("shared memory" in r for r in B.invalid_reasons(B.GluonBwdConfig(block_m=128, stages=4), 128))
    # one lock-step partition of BLOCK_M 128 at d64: over the model by no more than the slack
    m128 = B.GluonBwdConfig(block_m=128)
    assert B.consumer_regs_estimate(m128, 64) == m128.consumer_regs + B.LOCKSTEP_SPILL_SLACK_REGS
    assert B.is_valid(m128, 64) and not B.is_valid(B.GluonBwdConfig(block_m=128, consumer_regs=232), 64)
    assert any("head_dim" in r for r in B.invalid_reasons(ok, 80))
    assert any("dq_mode" in r for r in B.invalid_reasons(B.GluonBwdConfig(dq_mode="x"), 128))
    assert any("setmaxnreg" in r for r in B.invalid_reasons(B.GluonBwdConfig(consumer_regs=244), 128))
    with pytest.raises(ValueError, match="invalid Gluon backward config"):
        B.render(B.GluonBwdConfig(block_m=128, stages=4), "bfloat16", 128, "none")
    for d in B.HEAD_DIMS:
        for c in B.search_space(d):
            assert B.smem_bytes(c, d) <= B.SMEM_LIMIT_BYTES


def test_render_names_the_knobs():
    src = B.render(B.default_config(64), "float16", 64, "causal")
    vid = B.variant_id(B.default_config(64), "float16", 64, "causal")
    assert f'VARIANT_ID = "{vid}"' in src and "SPLIT=True" in src and "DQ_MODE=tma" in src
    assert "tma_load(lse_desc, [bh, m0]" in src and "def _consumer_1(" in src
    assert re.search(r"mask=causal", src)


def test_input_errors_name_the_argument():
    import torch

    q = torch.zeros(1, 2, 8, 64, dtype=torch.bfloat16)
    k = torch.zeros(1, 1, 8, 64, dtype=torch.bfloat16)
    lse = torch.zeros(1, 2, 8)
    with pytest.raises(ValueError, match="lse"):
        B.check_inputs(q, q, k, k, q, lse.double())
    with pytest.raises(ValueError, match="num_heads"):
        B.check_inputs(q, q, torch.zeros(1, 3, 8, 64, dtype=torch.bfloat16), torch.zeros(1, 3, 8, 64, dtype=torch.bfloat16), q, lse)
    with pytest.raises(ValueError, match="do"):
        B.check_inputs(q[:, :, :4], q, k, k, q, lse)


def test_default_rows_buffer_meets_the_tma_rules():
    """LSE2 / delta: (batch * heads, m_pad) float32 with m_pad a multiple of ROW_PAD (every
    query block's box inside the buffer), a 16-byte-aligned row stride and a (1, block_m)
    box of a multiple of 16 bytes; the defaults: 2-D TMA rows, split partitions at d64."""
    import torch

    assert B.default_config(128).row_load == "tma" and not B.default_config(128).split
    assert B.default_config(64).row_load == "tma" and B.default_config(64).split
    for sq in (17, 1000, 4097):
        cfg = B.default_config(128)
        q = torch.empty(2, 3, sq, 128, dtype=torch.bfloat16)
        k = torch.empty(2, 1, 300, 128, dtype=torch.bfloat16)
        lse = torch.empty(2, 3, sq)
        a = B.launch_args(q, q, k, k, q, lse, softmax_scale=0.1, diag_lo=-sq, diag_hi=300, config=cfg)
        m_pad = a["lse2"].shape[1]
        assert a["lse2"].shape == a["delta"].shape == (6, m_pad)
        assert m_pad >= sq and m_pad % B.ROW_PAD == 0 and B.ROW_PAD % cfg.block_m == 0
        desc = a["main"][1][4]
        assert list(desc.block_shape) == [1, cfg.block_m] and (cfg.block_m * 4) % 16 == 0
        assert (desc.strides[0] * 4) % 16 == 0
        pre_args = a["preprocess"][1]
        assert pre_args[6:9] == (6 * m_pad, sq, m_pad)


def test_code_id_record_is_current():
    """templates/gluon/attn_bwd.code_id.json matches the template: run ``python3 -m
    flashgen.families.gluon`` after a template edit when this fails (the id stays
    while the probe variants' code is unchanged)."""
    rec = json.loads((B._templates_dir() / B.CODE_ID_RECORD).read_text())
    assert rec["text"] == B.text_hash() and rec["probes"] == B.probe_digest()
    # the variants admitted later (the lock-step register slack) as recorded too
    assert rec.get("extensions", {}) == B._CODE_ID.extension_digests()
    assert {"lockstep_spill_slack", "dq_fragment", "dq_ordered", "group_split", "kv_tma"} <= set(rec["extensions"])
    # every variant the tuner can record is a probe: the search spaces of GQA groups (the
    # group splits) and the ordered dQ of every TMA-mode config (flashgen tune --refine dq_ordered)
    probes = {(c, dtype, d, mask) for ext in (None, *B.EXTENSIONS) for c, dtype, d, mask in B.probe_variants(ext)}
    for d in B.HEAD_DIMS:
        for c in B.search_space(d, "bfloat16", "causal", group=16):
            assert (dataclasses.replace(c, group_split=1, half_partials=False), "bfloat16", d, "causal") in probes
            base = dataclasses.replace(B.default_config(d, "bfloat16", "causal"), dq_stage=c.dq_stage,
                                       group_split=c.group_split, half_partials=c.half_partials,
                                       kv_store=c.kv_store)
            assert (base, "bfloat16", d, "causal") in probes, c
            ordered = dataclasses.replace(c, group_split=1, half_partials=False, dq_mode="ordered")
            if c.dq_mode == "tma" and B.is_valid(ordered, d, "bfloat16", "causal"):
                assert (ordered, "bfloat16", d, "causal") in probes, ordered
    assert B.template_hash() == rec["code"] == B.code_id()
    src = B.render(B.default_config(128), "bfloat16", 128, "causal")
    assert f"template_hash: {rec['code']}" in src and f'TEMPLATE_HASH = "{rec["code"]}"' in src


def test_code_id_follows_the_generated_code_not_the_template_text(tmp_path):
    """A Jinja comment or a branch no recorded variant renders keeps the id (and the
    tuned rows); a change to the code of a recorded variant gives a new one."""
    import shutil

    def edited(name, old, new):
        d = tmp_path / name
        shutil.copytree(B._templates_dir(), d)
        t = d / B.TEMPLATE
        t.write_text(t.read_text().replace(old, new, 1))
        return str(d)

    anchor = "VARIANT_ID = "
    same = edited("same", anchor, "{# a comment #}\n{% if DQ_MODE == 'nothing' %}x = 1\n{% endif %}" + anchor)
    assert B.text_hash(same) != B.text_hash() and B.code_id(same) == B.template_hash()
    other = edited("other", anchor, "# changed\n" + anchor)
    assert B.code_id(other) not in (B.template_hash(), B.text_hash(other))
    assert B.write_code_id(other)["code"] == B.code_id(other) != B.template_hash()
    # the ordered dQ's wait on its predecessor (only ordered variants render it) and the
    # group split's partial stores (only split variants) are recorded code too
    for name, old, new in (("ordered", "_sem_wait(SEM + tile, _chain_u(nc, seqlen_k, C))", "pass"),
                           ("split", "gl.store(DV + base + offs, dv, mask=keep)", "pass")):
        assert old in (B._templates_dir() / B.TEMPLATE).read_text(), old
        assert B.code_id(edited(name, old, new)) != B.template_hash(), name
    B.template_hash.cache_clear()
    assert B.template_hash() == json.loads((B._templates_dir() / B.CODE_ID_RECORD).read_text())["code"]


# -- group_split: programs sharing one kv head's GQA group ----------------------------------

def test_group_split_rules_and_search_space():
    assert B.group_splits(1) == (1,) and B.group_splits(4) == (1, 2, 4) and B.group_splits(6) == (1, 2, 3, 6)
    assert B.group_splits(32) == (1, 2, 4, 8, 16)
    for bad in (0, -2, B.MAX_GROUP_SPLIT + 1, 2.0):
        assert any("group_split" in r for r in B.invalid_reasons(B.GluonBwdConfig(group_split=bad), 128)), bad
    gs4 = B.GluonBwdConfig(row_load="tma", group_split=4)
    assert B.is_valid(gs4, 128, "bfloat16", "causal") and gs4.id.endswith("_rows-tma_gs4")
    assert B.GluonBwdConfig(row_load="tma", dq_stage="fragment", kv_store="tma").id == B.default_config(128).id  # no tag at 1
    assert B.group_reasons(gs4, 8) == [] and "must divide the GQA group" in B.group_reasons(gs4, 6)[0]
    # the shared memory and registers of a split variant are its unsplit one's
    assert B.smem_terms(gs4, 128) == B.smem_terms(B.GluonBwdConfig(row_load="tma"), 128)
    for d in B.HEAD_DIMS:
        mha = B.search_space(d, "bfloat16", "causal")
        assert all(c.group_split == 1 for c in mha)
        assert B.search_space(d, "bfloat16", "causal", group=1) == mha
        gqa = B.search_space(d, "bfloat16", "causal", group=4)
        # group_split 1, and 2 and 4 with float32 or 16-bit partials (register stores only)
        assert len(gqa) == len(mha) + 4 * sum(c.kv_store == "ptr" for c in mha)
        assert {(c.group_split, c.half_partials) for c in gqa} == {(1, False), (2, False), (2, True), (4, False),
                                                                    (4, True)}
        assert {dataclasses.replace(c, group_split=1, half_partials=False) for c in gqa} == set(mha)
    half = B.GluonBwdConfig(row_load="tma", group_split=2, half_partials=True)
    assert half.id.endswith("_gs2h") and B.is_valid(half, 128)
    assert any("half_partials needs group_split > 1" in r
               for r in B.invalid_reasons(dataclasses.replace(half, group_split=1), 128))


def test_group_split_renders_only_in_its_variants():
    base = B.GluonBwdConfig(row_load="tma")
    plain = B.render(base, "bfloat16", 128, "causal")
    assert "GROUP_SPLIT" not in plain and "off_kv" not in plain
    assert "(dk * softmax_scale).to(DTYPE)" in plain
    src = B.render(dataclasses.replace(base, group_split=4), "bfloat16", 128, "causal")
    assert "GROUP_SPLIT=4" in src and "off_kv = off_hk // 4" in src
    assert "tma_load(k_desc, [off_z, off_kv, n0, 0]" in src and "tma_load(v_desc, [off_z, off_kv, n0, 0]" in src
    assert "gl.store(DK + base + offs, dk, mask=keep)" in src and "(dk * softmax_scale)" not in src
    half = B.render(dataclasses.replace(base, group_split=4, half_partials=True), "bfloat16", 128, "causal")
    assert "HALF_PARTIALS" in half and "off_kv = off_hk // 4" in half
    assert "gl.store(DK + base + offs, (dk * softmax_scale).to(DTYPE), mask=keep)" in half
    assert src.count("\n") - plain.count("\n") < 20


def _launch(gs, b=2, h=8, hk=2, sq=300, sk=200, d=128, dtype=torch.bfloat16, half=False):
    q = torch.empty(b, h, sq, d, dtype=dtype)
    k = torch.empty(b, hk, sk, d, dtype=dtype)
    lse = torch.empty(b, h, sq)
    cfg = B.GluonBwdConfig(row_load="tma", group_split=gs, half_partials=half)
    return cfg, B.launch_args(q, q, k, k, q, lse, softmax_scale=0.125, diag_lo=-sq, diag_hi=sk, config=cfg)


def test_group_split_launch_sizes_the_scratch_and_the_reduction():
    from flashgen.families.gluon import reduce as R

    b, h, hk, sq, sk, d = 2, 8, 2, 300, 200, 128
    _, one = _launch(1)
    assert "reduce" not in one and "dk_partial" not in one
    assert one["main"][0] == (2, b * hk) and one["main"][1][15] == hk and one["main"][1][10] is one["dk"]
    for gs, half in ((2, False), (4, False), (4, True)):
        cfg, a = _launch(gs, half=half)
        grid, args = a["main"]
        # batch * num_kv_heads * gs programs per key block, told hk * gs kv heads
        assert grid == (-(-sk // cfg.block_nt), b * hk * gs) and args[15] == hk * gs and args[14] == h
        dkp, dvp = a["dk_partial"], a["dv_partial"]
        assert args[10] is dkp and args[11] is dvp
        part = torch.bfloat16 if half else torch.float32
        for p in (dkp, dvp):
            assert p.shape == (b, hk, gs, sk, d) and p.dtype == part and p.is_contiguous()
        assert dvp.data_ptr() - dkp.data_ptr() == dkp.numel() * dkp.element_size()  # one allocation
        assert a["dk"].shape == (b, hk, sk, d) and a["dk"].dtype == torch.bfloat16
        rgrid, rargs = a["reduce"]
        assert rgrid == R.grid(b, hk, sk, d) == (-(-(sk * d) // R.BLOCK), b * hk, 2)
        # 16-bit partials carry dK already scaled (rounded once, after the scaling)
        dk = a["dk"]
        assert rargs[:4] == (dkp, dvp, dk, a["dv"]) and rargs[4:] == (
            sk * d, 1.0 if half else 0.125, hk, *dk.stride()[:3], *a["dv"].stride()[:3], gs, d, R.BLOCK)
        # The kernel's arithmetic (attn_bwd, _producer, the epilogue) over this grid: every
        # (batch, kv head)'s query heads once, K/V of that kv head, partial slab pid_zh.
        nkv = args[15]
        seen = {}
        for pid_zh in range(grid[1]):
            off_z, off_hk = pid_zh // nkv, pid_zh % nkv
            group = h // nkv
            kv, sp = off_hk // gs, off_hk % gs
            seen.setdefault((off_z, kv), []).extend(off_hk * group + g for g in range(group))
            assert pid_zh == (off_z * hk + kv) * gs + sp  # slab (off_z, kv, sp) of (b, hk, gs, sk, d)
        assert all(sorted(v) == list(range(kv * (h // hk), (kv + 1) * (h // hk))) for (_, kv), v in seen.items())
        assert len(seen) == b * hk
    with pytest.raises(ValueError, match="group_split 3 must divide the GQA group"):
        _launch(3)
    with pytest.raises(ValueError, match="grid limit"):
        _launch(16, b=4097, h=16, hk=1, sq=1, sk=1, d=64)


@pytest.mark.parametrize("gs, sk, d, dtype, part", [(2, 200, 128, torch.bfloat16, torch.float32),
                                                    (4, 17, 64, torch.float16, torch.float32),
                                                    (3, 33, 64, torch.float32, torch.float32),
                                                    (4, 200, 128, torch.float32, torch.float32),
                                                    (4, 200, 128, torch.float32, torch.bfloat16),
                                                    (2, 17, 64, torch.float32, torch.float16)])
def test_group_reduce_sums_the_partials_in_order(gs, sk, d, dtype, part):
    """The reduction (Triton's interpreter on CPU): dK = (P0 + P1 + ...) * softmax_scale and
    dV = P0 + P1 + ... in float32, in split order, cast once: into float32 outputs bit for
    bit the sequential float32 sum; into 16-bit ones within one rounding of it (the
    interpreter's float32 -> 16-bit cast need not round as the GPU's does); 16-bit
    partials (``half_partials``) are read into float32 first."""
    from flashgen.families.gluon import reduce as R

    b, hk, scale = 2, 3, 0.0883883
    g = torch.Generator().manual_seed(gs * 1000 + sk)
    partials = (torch.randn(2, b, hk, gs, sk, d, generator=g) * 4).to(part)
    dk = torch.full((b, hk, sk, d), float("nan"), dtype=dtype)
    dv = torch.full((b, hk, sk, d), float("nan"), dtype=dtype)
    R.group_reduce[R.grid(b, hk, sk, d)](*R.args(partials[0], partials[1], dk, dv, scale, gs),
                                          num_warps=R.NUM_WARPS)
    for out, p, s in ((dk, partials[0].float(), scale), (dv, partials[1].float(), 1.0)):
        acc = p[:, :, 0].clone()
        for i in range(1, gs):
            acc = acc + p[:, :, i]
        want = acc * torch.tensor(s, dtype=torch.float32)
        if dtype == torch.float32:
            assert torch.equal(out, want)
        else:
            ulp = 2.0 ** -(7 if dtype == torch.bfloat16 else 10)
            torch.testing.assert_close(out.float(), want, rtol=ulp, atol=0)
        torch.testing.assert_close(out.float(), p.sum(2) * s, rtol=1e-2, atol=1e-5)


def test_delta_out_receives_the_preprocess_rows(monkeypatch):
    """attention_bwd(delta_out=) copies delta = rowsum(dO * O) out of the padded (z * h,
    m_pad) buffer the preprocess launch writes (the kernels stand in by torch: the copy's
    indexing is what is checked; the sinks' gradient reads it)."""
    import types

    import torch

    class Launch:
        def __init__(self, fn=None):
            self.fn = fn

        def __getitem__(self, grid):
            return lambda *args, **opts: self.fn(*args) if self.fn else None

    def preprocess(o, do, lse, lse2, delta, dqacc, total_rows, sq, m_pad, zero):
        z, h = o.shape[:2]
        delta.fill_(float("nan")).view(z * h, m_pad)[:, :sq] = (o.float() * do.float()).sum(-1).view(z * h, sq)
    fake = types.SimpleNamespace(attn_bwd_preprocess=Launch(preprocess), attn_bwd=Launch(), attn_bwd_convert=Launch())
    monkeypatch.setattr(B, "load", lambda *a, **k: fake)
    g = torch.Generator().manual_seed(0)
    q, k, v, o, do = (torch.randn(2, 3, 77, 64, generator=g).to(torch.bfloat16) for _ in range(5))
    lse = torch.zeros(2, 3, 77)
    delta = torch.full((2, 3, 77), float("nan"))
    B.attention_bwd(do, q, k[:, :1], v[:, :1], o, lse, softmax_scale=0.125, diag_lo=-77, diag_hi=0, mask="causal",
                    delta_out=delta)
    assert torch.allclose(delta, (o.float() * do.float()).sum(-1))


@pytest.mark.parametrize("d, dtype", [(64, torch.float16), (128, torch.bfloat16), (96, torch.bfloat16)])
def test_strided_preprocess_and_convert_match_the_contiguous_rule(d, dtype):
    """.strided (Triton's interpreter on CPU): O and dO as transformers hands them,
    (batch, seqlen, heads, head_dim) memory seen through transpose(1, 2), give the delta,
    LSE2 and zeroed dQ accumulator of the rule in the module docstring, and dQ is written
    into a tensor of that layout, equal to the contiguous result.  Head_dim 96: the
    accumulator is 128 wide (the tiles'), O, dO and dQ 96 (no column past it read or
    written: dQ's rows are adjacent heads' rows in this layout)."""
    from flashgen.families.gluon import strided as S

    b, h, sq, m_pad = 2, 3, 37, 128
    g = torch.Generator().manual_seed(d)
    o = torch.randn(b, sq, h, d, generator=g).to(dtype).transpose(1, 2)
    do = torch.randn(b, sq, h, d, generator=g).to(dtype).transpose(1, 2)
    lse = torch.randn(b, h, sq, generator=g)
    lse[0, 1, 5] = float("-inf")
    lse2 = torch.full((b * h, m_pad), float("nan"))
    delta = torch.full((b * h, m_pad), float("nan"))
    dt = B.tile_dim(d)
    dqacc = torch.full((b, h, sq, dt), float("nan"))
    grid, args = S.preprocess_launch(o, do, lse, lse2, delta, dqacc, m_pad)
    S.preprocess[grid](*args, num_warps=S.NUM_WARPS)
    want_delta = (o.float() * do.float()).sum(-1).reshape(b * h, sq)
    torch.testing.assert_close(delta[:, :sq], want_delta, rtol=1e-5, atol=1e-5)
    assert not delta[:, sq:].any() and not lse2[:, sq:].any() and not dqacc.any()
    # a fragment-order accumulator: (b * h, m_pad, d), every row zeroed, the padding too
    padded = torch.full((b * h, m_pad, dt), float("nan"))
    grid, args = S.preprocess_launch(o, do, lse, lse2, delta, padded, m_pad, padded=True)
    S.preprocess[grid](*args, num_warps=S.NUM_WARPS)
    assert not padded.any()
    want_lse2 = torch.where(lse == float("-inf"), 0.0, lse * 1.4426950408889634).reshape(b * h, sq)
    torch.testing.assert_close(lse2[:, :sq], want_lse2)
    acc = torch.randn(b, h, sq, dt, generator=g)
    dq = torch.empty(b, sq, h, d, dtype=dtype).transpose(1, 2)
    grid, args = S.convert_launch(acc, dq, 0.125)
    S.convert[grid](*args, num_warps=S.NUM_WARPS)
    assert dq.stride() == (sq * h * d, d, h * d, 1)
    ulp = 2.0 ** -(7 if dtype == torch.bfloat16 else 10)
    want = acc[..., :d] * 0.125
    assert ((dq.float() - want).abs() <= want.abs() * ulp + 1e-30).all()


def test_group_reduce_writes_outputs_of_any_layout():
    from flashgen.families.gluon import reduce as R

    b, hk, gs, sk, d = 2, 2, 2, 40, 64
    g = torch.Generator().manual_seed(3)
    partials = torch.randn(2, b, hk, gs, sk, d, generator=g)
    dk = torch.full((b, sk, hk, d), float("nan")).transpose(1, 2)
    dv = torch.full((b, hk, sk, d), float("nan"))
    R.group_reduce[R.grid(b, hk, sk, d)](*R.args(partials[0], partials[1], dk, dv, 0.5, gs), num_warps=R.NUM_WARPS)
    assert torch.equal(dk, (partials[0, :, :, 0] + partials[0, :, :, 1]) * 0.5)
    assert torch.equal(dv, partials[1, :, :, 0] + partials[1, :, :, 1])


def test_launch_args_keep_the_layouts_of_q_k_v_and_read_o_do_by_strides():
    """Transposed (batch, seqlen, heads, head_dim) inputs: the gradients are allocated in
    that layout; preprocess and convert are the strided ones; a group_split 1 config
    stores dK, dV contiguous and copies them, a split one reduces into them."""
    b, h, hk, s, d = 1, 4, 2, 256, 128
    q = torch.empty(b, s, h, d, dtype=torch.bfloat16).transpose(1, 2)
    k = torch.empty(b, s, hk, d, dtype=torch.bfloat16).transpose(1, 2)
    lse = torch.empty(b, h, s)
    for gs, copies in ((1, True), (2, False)):
        cfg = B.GluonBwdConfig(row_load="tma", group_split=gs)
        a = B.launch_args(q, q, k, k, q, lse, softmax_scale=0.1, diag_lo=-s, diag_hi=s, config=cfg)
        assert a["dq"].stride() == q.stride() and a["dk"].stride() == k.stride() and a["dv"].stride() == k.stride()
        assert "preprocess_strided" in a and "convert_strided" in a and "preprocess" not in a and "convert" not in a
        assert ("copy" in a) is copies and ("reduce" in a) is (gs > 1)
    qc, kc = q.contiguous(), k.contiguous()
    a = B.launch_args(qc, qc, kc, kc, qc, lse, softmax_scale=0.1, diag_lo=-s, diag_hi=s,
                      config=B.GluonBwdConfig(row_load="tma"))
    assert "preprocess" in a and "convert" in a and "copy" not in a


# -- dq_mode "ordered": the bitwise-repeatable dQ -----------------------------------------

#: (config fields, head_dim, mask) of ordered variants compiled for sm_90 (the lock-step
#: d128 default, the split d64 default, and the d128 default with its GQA group split).
ORDERED = [((64, 64, 2, 2, "ordered", 240, 24, "tma"), 128, "causal"),
           ((64, 64, 2, 4, "ordered", 240, 24, "tma", 1, True), 64, "none"),
           ((64, 64, 2, 2, "ordered", 240, 24, "tma", 1, False, 4), 128, "window")]

_ORDERED_SCRIPT = r'''
import json, os, re, subprocess, sys, tempfile
sys.path.insert(0, ROOT)
from flashgen.families.gluon import bwd as B
from flashgen.families.gluon.shim import ptxas_sm90
for fields, d, mask in ORDERED:
    out = {}
    for mode in ("ordered", "tma"):
        cfg = B.GluonBwdConfig(*fields)
        cfg = B.GluonBwdConfig(**{**cfg.__dict__, "dq_mode": mode})
        ptx = B.compile_sm90(cfg, "bfloat16", d, mask).asm["ptx"]
        with tempfile.TemporaryDirectory() as t:
            p = os.path.join(t, "k.ptx")
            open(p, "w").write(ptx)
            info = subprocess.run([*ptxas_sm90(), "-v", "--gpu-name", "sm_90a", p, "-o", os.path.join(t, "k.cubin")],
                                  capture_output=True, text=True).stderr
        spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", info)]
        out[mode] = {"parts": cfg.parts, "acquire": len(re.findall(r"ld\.acquire\.gpu\.global\.b32", ptx)),
                     "wait_all": len(re.findall(r"cp\.async\.bulk\.wait_group 0;", ptx)),
                     "release": len(re.findall(r"st\.release\.gpu\.global\.b32", ptx)),
                     "proxy": ptx.count("fence.proxy.async.global"),
                     "reduce": ptx.count("cp.reduce.async.bulk.tensor"),
                     "spill": max(spills) if spills else None, "c751x": re.findall(r"C751[245]", info)}
    print("CASE", json.dumps({"id": B.GluonBwdConfig(*fields).id, "d": d, "mask": mask, **out}))
'''


def test_ordered_dq_compiles_to_a_semaphore_chain():
    """Each consumer partition of an ordered variant spins on its dQ tile's semaphore
    (acquire) before the TMA reduce-add, waits for the add to complete (the bulk group's
    full wait, not only the read of its shared-memory source) and releases the semaphore,
    with proxy fences between the generic and the async accesses; the same tile with
    dq_mode "tma" has none of it.  No spills beyond the unordered tile's, no serialized
    wgmma."""
    if not _have_ptxas():
        pytest.skip("triton's bundled ptxas is missing")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", f"ROOT = {ROOT!r}\nORDERED = {ORDERED!r}\n" + _ORDERED_SCRIPT],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    cases = [json.loads(line[5:]) for line in r.stdout.splitlines() if line.startswith("CASE ")]
    assert len(cases) == len(ORDERED), r.stdout
    for c in cases:
        o, t = c["ordered"], c["tma"]
        n = o["parts"]
        # the spin once per partition; the full wait and the release in the loop and after it
        assert (o["acquire"], o["wait_all"], o["release"]) == (n, 2 * n, 2 * n), c
        assert o["proxy"] >= 3 * n and o["reduce"] == t["reduce"] > 0, c
        assert (t["acquire"], t["wait_all"], t["release"]) == (0, 0, 0), c
        assert o["c751x"] == [] and (o["spill"] or 0) <= (t["spill"] or 0), c


def test_ordered_is_outside_the_search_and_sizes_its_semaphores():
    """"ordered" serves the deterministic backward (measured by ``flashgen tune --refine
    dq_ordered``), not the search; its launch zeroes one int32 per (batch * head, query
    block) and passes it after DV; its shared memory and registers are the tma mode's."""
    assert "ordered" in B.DQ_MODES and "ordered" not in B.SEARCH_DQ_MODES
    assert all(c.dq_mode != "ordered" for c in B.search_space(128, "bfloat16", "causal", group=4))
    cfg = dataclasses.replace(B.default_config(128), dq_mode="ordered")
    assert B.is_valid(cfg, 128, "bfloat16", "causal") and cfg.id.endswith("_ordered_r240-24_rows-tma_dqf_kvt")
    assert B.smem_terms(cfg, 128) == B.smem_terms(B.default_config(128), 128)
    split = dataclasses.replace(cfg, split=True)  # spills and serializes its wgmmas under ptxas
    assert any("lock-step" in r for r in B.invalid_reasons(split, 128))
    one_slot = dataclasses.replace(split, stages=1)  # would deadlock: the ring's one slot
    assert any("stages >= 2" in r for r in B.invalid_reasons(one_slot, 64)) and B.is_valid(split, 64)
    assert B.is_valid(dataclasses.replace(cfg, stages=1), 128)  # one lock-step partition: no such wait
    assert B.consumer_regs_estimate(cfg, 128) == B.consumer_regs_estimate(B.default_config(128), 128)
    src = B.render(cfg, "bfloat16", 128, "causal")
    assert "DK, DV, SEM, HEAD_GROUP, qk_scale" in src and "_sem_wait(SEM + tile, _chain_u(nc, seqlen_k, C))" in src
    assert "SEM" not in B.render(B.default_config(128), "bfloat16", 128, "causal")
    # the schedule _ordered_model mirrors: masked, key blocks last to first and the
    # predecessor's query blocks from the next key block's; without a mask, ascending
    assert "pid_n = gl.cdiv(seqlen_k, BLOCK_NT) - 1 - rank" in src
    assert "_query_blocks(n0 + BLOCK_NT, seqlen_q, diag_lo, diag_hi)" in src and "if mb >= pred_from:" in src
    plain = B.render(cfg, "bfloat16", 128, "none")
    assert "pid_n = rank" in plain and "pred_from = 0" in plain and "_query_blocks(n0 + BLOCK_NT" not in plain
    q = torch.empty(2, 8, 1000, 128, dtype=torch.bfloat16)
    k = torch.empty(2, 2, 1000, 128, dtype=torch.bfloat16)
    a = B.launch_args(q, q, k, k, q, torch.empty(2, 8, 1000), softmax_scale=0.1, diag_lo=-1000, diag_hi=0,
                      config=cfg)
    assert a["sem"].dtype == torch.int32 and a["sem"].shape == (16, 1024 // 64) and not a["sem"].any()
    plain_args = B.launch_args(q, q, k, k, q, torch.empty(2, 8, 1000), softmax_scale=0.1, diag_lo=-1000, diag_hi=0,
                               config=B.default_config(128))["main"]
    assert a["main"][1][12] is a["sem"] and a["main"][1][13] == a["head_group"] and len(a["main"][1]) == len(
        plain_args[1]) + 2
    # a 1-D grid of every (key block, batch * kv head) program, the 2-D one's count
    assert a["main"][0] == (plain_args[0][0] * plain_args[0][1],) and len(plain_args[0]) == 2


def _ordered_code(mode: str):
    """The ordered variant's own schedule code, rendered for ``mask`` mode and compiled to
    run on Python ints: (``_query_blocks`` and ``_rank`` as functions, the consumer's
    statements from ``rank = _rank(n0, seqlen_k)`` through ``if C > 0: pred_from = 0``)."""
    import types

    src = B.render(B.GluonBwdConfig(64, 64, 2, 2, "ordered", 240, 24, "tma", 1, False, 1, False, "fragment", "tma"),
                   "bfloat16", 128, mode)
    fns = {n.name: n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef)}
    helpers = []
    for name in ("_query_blocks", "_rank"):
        fns[name].decorator_list = []
        helpers.append(fns[name])
    body = fns["_consumer"].body
    first = next(i for i, st in enumerate(body) if ast.unparse(st).startswith("rank = _rank(n0, seqlen_k)"))
    last = next(i for i, st in enumerate(body) if i > first and ast.unparse(st).startswith("if C > 0:"))
    assert ast.unparse(body[last]) == "if C > 0:\n    pred_from = 0", ast.unparse(body[last])
    gl = types.SimpleNamespace(minimum=min, maximum=max, cdiv=lambda a, b: -(-a // b),
                               where=lambda c, a, b: a if c else b)
    return (compile(ast.Module(body=helpers, type_ignores=[]), "<schedule helpers>", "exec"), gl,
            compile(ast.Module(body=body[first:last + 1], type_ignores=[]), "<pred_from>", "exec"))


def _ordered_model(sq, sk, mode, lo, hi, block_m=64, block_nt=128, parts=1, code=None):
    """The ordered variant's schedule, run from the rendered template's own statements
    (:func:`_ordered_code`; the grid's programs take the key blocks in ``_rank``'s order):
    for each (query block mb) the indices u = program_id(0) * parts + partition that add
    into it, and for each (u, mb) whether u waits (mb >= pred_from)."""
    helpers, gl, pred = code or _ordered_code(mode)
    m_pad = -(-sq // B.ROW_PAD) * B.ROW_PAD
    ns = {"gl": gl, "BLOCK_M": block_m, "BLOCK_NT": block_nt}
    exec(helpers, ns)
    n_prog = -(-sk // block_nt)
    adds, waits = {}, {}
    for n in range(n_prog):
        p = ns["_rank"](n * block_nt, sk)
        first, count = ns["_query_blocks"](n * block_nt, sq, lo, hi)
        for c in range(parts):
            u = p * parts + c
            local = dict(ns, n0=n * block_nt, seqlen_q=sq, seqlen_k=sk, diag_lo=lo, diag_hi=hi, m_pad=m_pad, C=c)
            exec(pred, local)
            for mb in range(first, first + count):
                adds.setdefault(mb, []).append(u)
                waits[(u, mb)] = mb >= local["pred_from"]
    for us in adds.values():
        us.sort()
    return adds, waits


def test_ordered_grid_interleaves_pairs_and_waits_only_on_earlier_programs():
    """The ordered backward's 1-D grid (ordered_program, the template's _ordered_program):
    every (rank, pair) exactly once; the previous rank of a pair is an earlier program,
    HEAD_GROUP launches before (fewer in the last, smaller group); HEAD_GROUP, a divisor of
    the pairs, grows as programs get shorter, never past the pairs."""
    for n_kb, pairs, hg in ((1, 1, 1), (7, 5, 2), (32, 64, 5), (16, 3, 8), (9, 17, 4), (4, 6, 6)):
        seen = {}
        for pid in range(n_kb * pairs):
            seen[B.ordered_program(pid, n_kb * pairs, n_kb, hg)] = pid
        assert sorted(seen) == [(r, zh) for r in range(n_kb) for zh in range(pairs)]
        for (r, zh), pid in seen.items():
            if r > 0:
                gap = pid - seen[(r - 1, zh)]
                assert 0 < gap <= hg and (gap == hg or zh >= pairs // hg * hg), (n_kb, pairs, hg, r, zh)
    cfg = dataclasses.replace(B.default_config(128), dq_mode="ordered")
    # the largest divisor of the pairs not above 132 / (seqlen_q / 64 steps); half the
    # steps under a mask; at least 1, at most the pairs
    assert [B.ordered_head_group(cfg, 64, s, 1, mask=False, sm_count=132) for s in (16384, 4096, 1024, 128)] == \
        [1, 2, 8, 64]
    assert B.ordered_head_group(cfg, 64, 4096, 1, mask=True, sm_count=132) == 4
    assert B.ordered_head_group(cfg, 48, 4096, 1, mask=True, sm_count=132) == 4  # 4.1: a divisor of 48
    assert B.ordered_head_group(cfg, 40, 4096, 1, mask=True, sm_count=132) == 4  # not 5: 40 / 5 is whole, 5 > 4.1
    assert B.ordered_head_group(cfg, 64, 4096, 4, mask=False, sm_count=132) == 1  # 4 query heads per program
    assert B.ordered_head_group(cfg, 7, 1024, 1, mask=False, sm_count=132) == 7
    assert B.ordered_head_group(cfg, 24, 512, 1, mask=False, sm_count=132) == 12  # a divisor: not the cap 16
    # few divisors (17 is prime, cap 16): the fewest groups of at most the cap, as equal as they come
    assert B.ordered_head_group(cfg, 17, 512, 1, mask=False, sm_count=132) == 9
    assert B.ordered_head_group(cfg, 1, 512, 1, mask=False, sm_count=132) == 1
    assert B.ordered_head_group(cfg, 0, 512, 1, mask=False, sm_count=132) == 1
    for pairs in range(1, 70):
        for sq in (128, 512, 2048, 16384):
            for sms in (78, 114, 132):
                hg = B.ordered_head_group(cfg, pairs, sq, 1, mask=True, sm_count=sms)
                cap = max(1, min(pairs, int(sms / (math.ceil(sq / 64) * 0.5))))
                assert 1 <= hg <= cap, (pairs, sq, sms, hg)
                # whole groups, or groups no more than one pair apart
                groups = -(-pairs // hg)
                assert pairs % hg == 0 or pairs - (groups - 1) * hg >= hg - groups, (pairs, sq, sms, hg)
    split = dataclasses.replace(B.default_config(64), dq_mode="ordered", split=True, stages=4)
    assert B.ordered_head_group(split, 256, 2048, 1, mask=False, sm_count=132) == 8  # two partitions: 2 * 132 / 32
    # a grid of at most two waves (pairs x key blocks of 128 rows <= 2 x SMs) interleaves every pair
    assert cfg.block_nt == 128
    assert B.ordered_head_group(cfg, 16, 2048, 2, mask=True, sm_count=132) == 4  # without seqlen_k: the cap
    assert B.ordered_head_group(cfg, 16, 2048, 2, mask=True, sm_count=132, seqlen_k=2048) == 16  # 256 programs
    assert B.ordered_head_group(cfg, 32, 1024, 1, mask=True, sm_count=132, seqlen_k=1024) == 32  # 256
    assert B.ordered_head_group(cfg, 33, 1024, 1, mask=True, sm_count=132, seqlen_k=1024) == 33  # 264: two waves
    assert B.ordered_head_group(cfg, 34, 1024, 1, mask=True, sm_count=132, seqlen_k=1024) == \
        B.ordered_head_group(cfg, 34, 1024, 1, mask=True, sm_count=132) == 12  # 272 programs: the cap's rule
    assert B.ordered_head_group(cfg, 16, 2048, 2, mask=True, sm_count=114, seqlen_k=2048) == 2  # 256 > 228: the cap's
    assert B.ordered_head_group(cfg, 3, 2048, 1, mask=True, sm_count=132, seqlen_k=100) == 3  # a partial key block
    assert B.ordered_head_group(cfg, 128, 1024, 1, mask=True, sm_count=132, seqlen_k=1024) == 16  # 1024 programs


def test_the_launcher_gives_the_rule_seqlen_k(monkeypatch):
    """launch_args passes seqlen_k to ordered_head_group (the two-wave case needs it)."""
    seen = {}

    def rule(*args, **kw):
        seen.update(kw)
        return 1

    monkeypatch.setattr(B, "ordered_head_group", rule)
    cfg = dataclasses.replace(B.default_config(128), dq_mode="ordered")
    q = torch.empty(1, 4, 300, 128, dtype=torch.bfloat16)
    k = torch.empty(1, 2, 500, 128, dtype=torch.bfloat16)
    lse = torch.empty(1, 4, 300, dtype=torch.float32)
    a = B.launch_args(q, q, k, k, q, lse, softmax_scale=0.1, diag_lo=-500, diag_hi=200, config=cfg)
    assert seen["seqlen_k"] == 500 and a["head_group"] == 1


def test_head_group_probe_keeps_the_earlier_rule():
    """benchmarks/probe_head_group.py times the launcher's HEAD_GROUP against the earlier
    rule (2 * parts * SMs / steps, rounded up, at most the pairs), which it keeps."""
    P = _benchmark("probe_head_group")

    cfg = dataclasses.replace(B.default_config(128), dq_mode="ordered")
    assert [P.earlier_rule(cfg, 64, s, 1, mask=False, sm_count=132) for s in (16384, 4096, 1024, 128)] == \
        [2, 5, 17, 64]
    assert P.earlier_rule(cfg, 64, 4096, 1, mask=True, sm_count=132) == 9
    split = dataclasses.replace(B.default_config(64), dq_mode="ordered", split=True, stages=4)
    assert P.earlier_rule(split, 256, 2048, 1, mask=False, sm_count=132) == 17


@pytest.mark.parametrize("parts", [1, 2])
def test_ordered_schedule_waits_exactly_on_the_previous_adder(parts):
    """Over masks (none, causal both alignments, windows) and sizes: the partitions that
    add into a query block have consecutive indices, and each waits exactly when the
    index below it adds there too, so the adds form one chain per dQ tile, in a fixed
    order, each waiting only on a lower program_id(0)."""
    from flashgen.masks import mask_bounds

    cases, codes = 0, {}
    for sq, sk in ((1, 1), (64, 64), (100, 300), (300, 100), (1000, 1000), (1000, 4097), (4097, 1000), (129, 130)):
        for causal, window, align in ((False, (-1, -1), "bottom_right"), (True, (-1, -1), "bottom_right"),
                                      (True, (-1, -1), "top_left"), (False, (200, 64), "bottom_right"),
                                      (True, (300, -1), "bottom_right"), (False, (0, 0), "top_left"),
                                      (False, (50, 500), "top_left")):
            mode, lo, hi = mask_bounds(sq, sk, causal=causal, window=window, align=align)
            if mode not in codes:
                codes[mode] = _ordered_code(mode)
            for block_m in (64, 128):
                adds, waits = _ordered_model(sq, sk, mode, lo, hi, block_m=block_m, parts=parts, code=codes[mode])
                for mb, us in adds.items():
                    assert us == list(range(us[0], us[0] + len(us))), (sq, sk, mode, lo, hi, mb, us)
                    for u in us:
                        assert waits[(u, mb)] == (u - 1 in us), (sq, sk, mode, lo, hi, block_m, mb, u)
                cases += 1
    assert cases == 8 * 7 * 2


def _benchmark(name: str):
    """The script ``benchmarks/<name>.py`` as a module."""
    import importlib

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    return importlib.import_module(name)


def _first_statements(src: str, name: str):
    import ast

    fn = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == name)
    return fn.body


@pytest.mark.parametrize("d,mask,gs", [(128, "causal", 1), (64, "causal", 1), (128, "causal", 2)])
def test_pdl_probe_puts_the_grid_dependency_control_first_in_each_kernel(d, mask, gs):
    """benchmarks/probe_pdl.py's text edit, on the configs it times (the defaults of both
    head dims, the GQA split by 2): one _gdc() definition, and in each of the three Gluon
    kernels a _gdc() call as the first statement after the docstring; the rest of the
    source as rendered.  The launcher gives launch_pdl to those three kernels only."""
    import ast

    probe_pdl = _benchmark("probe_pdl")
    cfg = B.default_config(d, "bfloat16", mask)
    if gs > 1:
        cfg = dataclasses.replace(cfg, group_split=gs, half_partials=True, kv_store="ptr")
    src = B.render(cfg, "bfloat16", d, mask)
    out = probe_pdl.pdl_source(src)
    assert out.count("def _gdc():") == 1
    for name in probe_pdl.KERNELS:
        body = _first_statements(out, name)
        assert isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant), name  # the docstring
        call = body[1].value
        assert isinstance(call, ast.Call) and call.func.id == "_gdc" and not call.args, name
    assert out.replace("\n    _gdc()", "").replace(probe_pdl._GDC, "") == src
    seen = []
    run = probe_pdl._pdl_launch(lambda fn, grid, args, **opts: seen.append((fn.__name__, opts)))
    from flashgen.families.gluon import reduce as R

    mod = B.load(cfg, "bfloat16", d, mask)
    for fn in (mod.attn_bwd_preprocess, mod.attn_bwd, mod.attn_bwd_convert, R.group_reduce):
        run(fn, (1,), (), num_warps=4)
    assert [("launch_pdl" in o) for _, o in seen] == [True, True, True, False]


def test_pdl_probe_forward_edit_and_sm90_compile():
    """The forward's edit (--fwd): _gdc() first in attn_fwd; and the backward's edited
    kernels compile for sm_90 with griddepcontrol.wait and launch_dependents in their PTX."""
    import ast

    from flashgen.families.gluon import config as C
    from flashgen.families.gluon import render as R

    probe_pdl = _benchmark("probe_pdl")
    spec = C.GluonFwdSpec("bfloat16", 128, 128, "causal")
    fsrc = R.render(C.GluonFwdVariant(spec, C.default_config(spec)))
    fout = probe_pdl.fwd_pdl_source(fsrc)
    call = _first_statements(fout, "attn_fwd")[0].value
    assert fout.count("def _gdc():") == 1 and isinstance(call, ast.Call) and call.func.id == "_gdc"
    # compiled without Triton's interpreter (as the sm_90 compile cases: a child process)
    script = (f"import sys\nsys.path[:0] = [{ROOT!r}, {os.path.join(ROOT, 'benchmarks')!r}]\n"
              "import probe_pdl\nfrom flashgen.families.gluon import bwd as B\n"
              "cfg = B.default_config(128, 'bfloat16', 'none')\n"
              "mod = probe_pdl._import(probe_pdl.pdl_source(B.render(cfg, 'bfloat16', 128, 'none')), 'test')\n"
              "B.load = lambda *a, **kw: mod\n"
              "for name in probe_pdl.KERNELS:\n"
              "    ptx = B.compile_sm90(cfg, 'bfloat16', 128, 'none', name).asm['ptx']\n"
              "    print(name, 'griddepcontrol.wait' in ptx, 'griddepcontrol.launch_dependents' in ptx)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split("\n")[:3] == [f"{name} True True" for name in probe_pdl.KERNELS], r.stdout


def test_dq_count_probe_counts_in_the_writer_only():
    """benchmarks/probe_dq_count.py's text edit of the writer tiles of both head dims: the
    counter argument reaches the writer, which counts (one release atomic per add, the
    last after its loop); the consumers are as rendered."""
    probe_dq_count = _benchmark("probe_dq_count")

    for d in (128, 64):
        cfg = dataclasses.replace(B.default_config(d, "bfloat16", "none"), dq_writer=True)
        src = B.render(cfg, "bfloat16", d, "none")
        out = probe_dq_count.count_source(src)
        writer = out[out.index("def _dq_writer("):out.index("def _consumer_0(")]
        assert "CNT, qk_scale," in out and writer.count("_count_add(CNT + prev)") == 2
        assert out[out.index("def _consumer("):out.index("def _dq_writer(")] == \
            src[src.index("def _consumer("):src.index("def _dq_writer(")]
        compile(out, "count", "exec")


def test_ordered_dq_probes_render_only_what_they_leave_out():
    """benchmarks/probe_dq_order.py's probes of the ordered dQ: no_poll has no semaphore
    wait, no_sync no release either, one_thread waits and releases from one thread per
    warpgroup; the variant itself renders as without a probe, and a probe of another dQ
    mode is refused."""
    import pytest

    from flashgen.families.gluon import bwd as B

    cfg = B.GluonBwdConfig(64, 64, 2, 2, "ordered", 240, 24, "tma", 1, False)
    plain = B.render(cfg, "bfloat16", 128, "causal")
    assert plain == B.render(cfg, "bfloat16", 128, "causal", probe="")
    counts = {p: (src.count("_sem_wait(SEM"), src.count("_sem_release(SEM"), src.count("_sem_wait1(SEM"),
                  src.count("_sem_release1(SEM"))
              for p in B.DQ_PROBES for src in (B.render(cfg, "bfloat16", 128, "causal", probe=p),)}
    assert counts == {"": (1, 2, 0, 0), "no_poll": (0, 2, 0, 0), "no_sync": (0, 0, 0, 0), "one_thread": (0, 0, 1, 2)}
    with pytest.raises(ValueError, match="probe"):
        B.render(B.GluonBwdConfig(64, 64, 2, 2, "tma", 240, 24, "tma", 1, False), "bfloat16", 128, "causal",
                 probe="no_poll")


def test_pingpong_probe_puts_the_turns_around_the_issues():
    """benchmarks/probe_pingpong.py's text edit of the forward tiles it times (two and
    three consumers; masked, walks, serial masked tiles, O in the Q buffers): one turn
    (sync before, arrive after) around the first score product and around each step's two
    issues, the first turn given by the last consumer, and nothing else changed; tiles
    whose consumers walk different key tiles are refused."""
    import dataclasses as dc

    from flashgen.families.gluon import config as C
    from flashgen.families.gluon import render as R

    P = _benchmark("probe_pingpong")
    tiles = [(128, "none", C.GluonFwdConfig(num_consumers=2, BLOCK_N=128, num_stages=2, pin_exps=True)),
             (128, "causal", C.GluonFwdConfig(num_consumers=2, BLOCK_N=128, num_stages=2, persistent=2, snake=True,
                                              masked_first=True, serial_masked=True)),
             (128, "causal", C.GluonFwdConfig(num_consumers=2, BLOCK_N=64, num_stages=2, persistent=3, o_in_q=True)),
             (64, "none", C.GluonFwdConfig(num_consumers=3, BLOCK_N=128, num_stages=4, consumer_regs=160,
                                           producer_regs=32))]
    for d, mask, g in tiles:
        if not g.consumer_regs:
            g = dc.replace(g, consumer_regs=240, producer_regs=24)
        v = C.GluonFwdVariant(C.GluonFwdSpec("bfloat16", d, d, mask), g)
        assert not C.check(v) and P.eligible(g) is None
        src = R.render(v)
        out = P.pingpong_source(src)
        sync, arrive = P._SYNC.format(b=P.BAR0), P._ARRIVE.format(b=P.BAR0)
        assert out.count(sync) == 2 and out.count(arrive) == 2  # _step, and the first score product
        step = out[out.index("def _step("):]
        step = step[:step.index("\n\n@gluon.jit")]
        assert step.index(sync) < step.index("s_tok = warpgroup_mma(") < step.index("o_tok = warpgroup_mma(") \
            < step.index(arrive) < step.index("warpgroup_mma_wait(")
        assert f"if C == NC - 1:\n        _pp_bar({P.BAR0}, False)" in out
        back = (out.replace(P._HELPER, "").replace(f"            {sync}\n", "").replace(f"            {arrive}\n", "")
                .replace(f"    {sync}\n", "").replace(f"    {arrive}\n", "")
                .replace(f"    if C == NC - 1:\n        _pp_bar({P.BAR0}, False)\n", "")
                .replace("_step(C: gl.constexpr, acc,", "_step(acc,").replace("_step(C, acc,", "_step(acc,"))
        assert back == src
    one = C.GluonFwdConfig(num_consumers=1, BLOCK_N=64, num_stages=2)
    assert "one consumer" in P.eligible(one)
    assert "skip_masked" in P.eligible(C.GluonFwdConfig(BLOCK_N=64, persistent=2, masked_first=True,
                                                        skip_masked=True))
    assert "cross_tile" in P.eligible(C.GluonFwdConfig(persistent=3, cross_tile=True))



def test_wide_consumer_probe_edits_only_the_warps_and_the_register_cap():
    """benchmarks/probe_wide_consumer.py's two text edits of the forward: the wide
    variant (one BLOCK_M 128 consumer spread over 8 warps) changes the two layouts'
    warps, NUM_WARPS and MAXNREG and nothing else, and refuses a source that is not a
    one-consumer BLOCK_M 128 render; the non-inlined consumer of a two-consumer render
    makes the consumer index a runtime argument of one function both partitions call."""
    import dataclasses as dc
    import re

    from flashgen.families.gluon import config as C
    from flashgen.families.gluon import render as R

    P = _benchmark("probe_wide_consumer")
    wide = [c for d, causal in ((128, True), (64, False)) for c in P.wide_configs(d, causal)]
    assert {(c.BLOCK_M, c.num_consumers, c.persistent, c.o_in_q) for c in wide} == {(128, 1, 3, True)}
    # the 64-wide tile of one warpgroup passes the rules, so its render is the template's
    g = next(c for c in P.wide_configs(64, False) if c.BLOCK_N == 64)
    v = C.GluonFwdVariant(C.GluonFwdSpec("bfloat16", 64, 64, "none"), g)
    assert not C.check(v)
    src = R.render(v)
    out = P.wide_source(src)
    assert out.count("warps_per_cta=[8, 1]") == 2 and "warps_per_cta=[4, 1]" not in out
    assert re.search(r"^NUM_WARPS = 8$", out, re.M) and re.search(rf"^MAXNREG = {P.WIDE_MAXNREG}$", out, re.M)
    assert P.WIDE_MAXNREG == C.REGS_PER_SM // (3 * C.WARPGROUP_THREADS) // 8 * 8
    back = re.sub(r"^MAXNREG = \d+$", f"MAXNREG = {C.maxnreg(g)}", out.replace("warps_per_cta=[8, 1]",
                  "warps_per_cta=[4, 1]").replace("NUM_WARPS = 8", "NUM_WARPS = 4"), flags=re.M)
    assert back == src
    twin = P.twin(g)
    assert (twin.BLOCK_M, twin.num_consumers, twin.BLOCK_N, twin.num_stages) == (64, 2, g.BLOCK_N, g.num_stages)
    two = R.render(C.GluonFwdVariant(C.GluonFwdSpec("bfloat16", 64, 64, "none"), twin))
    with pytest.raises(ValueError, match="one-consumer"):
        P.wide_source(two)
    ni = P.noinline_source(two)
    assert "@gluon.jit(noinline=True)\ndef _consumer(C," in ni and "C: gl.constexpr" not in ni.split("def _consumer(")[1][:5]
    assert ni.count("_consumer(_opaque(gl.program_id(0)) * 0") == 2
    with pytest.raises(ValueError, match="expected one"):
        P.noinline_source(src)
    assert dc.replace(twin, BLOCK_M=128, num_consumers=1, consumer_regs=240, producer_regs=24) == g
    # the named-barrier release: every K/V slot release an arrive on its slot's barrier,
    # the producer's two slot waits a sync on them from each slot's second use on
    nb = P.named_release_source(out)
    assert "mbarrier.arrive(k_empty" not in nb and "mbarrier.arrive(v_empty" not in nb
    assert nb.count(f"_nb_arrive({P.NB0} + s_slot)") >= 1 and nb.count(f"_nb_arrive({P.NB0} + STAGES + p_slot)") >= 1
    assert nb.count("if kv >= STAGES:\n                _nb_sync(") == 2
    assert out.count("mbarrier.arrive(k_empty") + out.count("mbarrier.arrive(v_empty") == nb.count("_nb_arrive(") - 1
    assert set(P.EDITS) == {"wide", "wide-nb"}
    with pytest.raises(ValueError, match="named barriers"):
        P.named_release_source(out.replace("STAGES = gl.constexpr(4)", "STAGES = gl.constexpr(5)"))

def test_head_dim_96_runs_on_the_head_dim_128_tiles():
    """Head_dim 96: the rules, models and code of the 128-wide tiles (tile_dim), the
    variant named by its own head dim; the launch's descriptors take 128-column boxes over
    the 96-column tensors (the copy engine zero-fills past them and clips the stores), the
    dQ accumulator is 128 wide, and a group split's partials are the tensors' width (the
    template's register stores mask the padding columns); the padded source differs from
    the head_dim 128 one only where it addresses the tensors by pointer."""
    assert [B.tile_dim(d) for d in B.HEAD_DIMS] == [64, 128, 128]
    for mask in B.MASKS:
        assert B.search_space(96, "bfloat16", mask) == B.search_space(128, "bfloat16", mask)
    c = B.default_config(96, "bfloat16", "causal")
    assert c == B.default_config(128, "bfloat16", "causal") and B.variant_id(c, "bfloat16", 96, "causal").startswith(
        "gluon_bwd_d96_bf16_causal_")
    src96, src128 = (B.render(c, "bfloat16", d, "causal", header_hash="-") for d in (96, 128))
    assert "DG = gl.constexpr(96)" in src96 and "D = gl.constexpr(128)" in src96 and "DG" not in src128
    import difflib

    changed = [ln for ln in difflib.unified_diff(src128.splitlines(), src96.splitlines(), lineterm="", n=0)
               if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]
    assert all("DG" in ln or "d96" in ln or "d128" in ln or "gl.load(O" in ln
               or "gl.load(DO" in ln or "gl.store(DQ" in ln or ln.strip() in "+-" or ln.lstrip("+-").startswith("#") for ln in changed), changed
    # a rule of the tiles names both head dims
    why = B.invalid_reasons(dataclasses.replace(c, dq_mode="atomic"), 96)
    assert why and all(r.endswith("(head_dim 96 runs on the head_dim 128 tiles)") for r in why), why
    gs = dataclasses.replace(c, kv_store="ptr", group_split=2)
    b, h, hk, s, d = 1, 4, 2, 200, 96
    q, o, do = (torch.empty(b, h, s, d, dtype=torch.bfloat16) for _ in range(3))
    k, v = (torch.empty(b, hk, s, d, dtype=torch.bfloat16) for _ in range(2))
    for cfg in (c, gs):
        a = B.launch_args(do, q, k, v, o, torch.empty(b, h, s), softmax_scale=96 ** -0.5, diag_lo=0, diag_hi=0,
                          config=cfg)
        descs = a["main"][1][:4]
        assert [x.block_shape[-1] for x in descs] == [128] * 4 and [x.shape[-1] for x in descs] == [96] * 4
        assert a["dqacc"].shape[-1] == 128 and a["dq"].shape == q.shape
        if cfg.group_split > 1:
            assert a["dk_partial"].shape == (b, hk, 2, s, 96)
        else:
            assert [x.block_shape[-1] for x in a["main"][1][10:12]] == [128, 128]  # dK, dV by TMA, clipped


def test_lookahead_is_served_with_the_tma_dq_and_probed_under_its_own_extension():
    """``lookahead`` (the column-split program issuing the next step's S^T and dP^T during
    its dQ chunks: 1 after dK, 2 interleaved with the chunks) is built for that program
    alone, with a ring of two or more stages and four dQ chunks (two chunks: the register
    model is over the budget).  Its float64 checks have run on the GPU with dQ by TMA
    reduce-add, so the search space holds those variants and the code id probes them
    under the "lookahead" extension (listed before "col_split": the shipped rows' id
    stays); with atomic dQ its checks pass too but it measured slower, so the rules refuse
    it (bwd.ATOMIC_LOOKAHEAD_SLOWER) and ``col_split_space(unchecked=True)`` lists those
    for measuring again."""
    cs = B.default_config(256)
    la, lai = dataclasses.replace(cs, lookahead=1), dataclasses.replace(cs, lookahead=2)
    assert (la.id, lai.id) == (cs.id + "_la1", cs.id + "_la2")
    for c in (la, lai):
        assert B.invalid_reasons(c, 256) == []
        atomic = dataclasses.replace(c, dq_mode="atomic", kv_store="ptr")
        assert B.invalid_reasons(atomic, 256) == [B.ATOMIC_LOOKAHEAD_SLOWER]
        assert any("stages >= 2" in r for r in B.invalid_reasons(dataclasses.replace(c, stages=1), 256))
    assert any("column-split program only" in r
               for r in B.invalid_reasons(dataclasses.replace(B.default_config(128), lookahead=1), 128))
    assert any("lookahead 3" in r for r in B.invalid_reasons(dataclasses.replace(cs, lookahead=3), 256))
    assert any("dq_chunks 4" in r for r in B.invalid_reasons(dataclasses.replace(lai, dq_chunks=2), 256))
    two = dataclasses.replace(la, dq_chunks=2, dq_mode="atomic")
    assert B.consumer_regs_estimate(two, 256) > two.consumer_regs + B.LOCKSTEP_SPILL_SLACK_REGS
    assert B.consumer_regs_estimate(la, 256) == B.consumer_regs_estimate(lai, 256) <= la.consumer_regs
    for mask in B.MASKS:
        ahead = [c for c in B.search_space(256, "bfloat16", mask) if c.lookahead]
        assert la in ahead and lai in ahead and {(c.stages, c.dq_chunks, c.dq_mode) for c in ahead} == {(2, 4, "tma")}
        unchecked = [c for c in B.col_split_space(256, "bfloat16", mask, unchecked=True) if c.lookahead]
        assert unchecked and all(c.dq_mode == "atomic" for c in unchecked)
    probed = {c for c, *_ in B.probe_variants("lookahead")}
    assert la in probed and lai in probed and not any(c.lookahead for c, *_ in B.probe_variants("col_split"))
    assert B.EXTENSIONS["lookahead"](la, 256) and list(B.EXTENSIONS).index("lookahead") < \
        list(B.EXTENSIONS).index("col_split")
    # the render: the first step's products before the loop, the next step's after dK,
    # retired with the first dQ chunk; without the knob the source has none of it
    src, base = B.render(la, "bfloat16", 256, "causal", check=False), B.render(cs, "bfloat16", 256, "causal")
    body = src[src.index("def _consumer("):]
    assert body.index("dk = warpgroup_mma(ds_c, q_s, dk") < body.index("st_next = warpgroup_mma(k_o")
    assert "dv, dq = warpgroup_mma_wait(3, deps=[dv, dq])" in body
    assert "dq, st_next, dpt_next = warpgroup_mma_wait(0, deps=[dq_next, st_next, dpt_next])" in body
    assert "st_next" not in base and "_opaque(s * 0)" not in base
    body = B.render(lai, "bfloat16", 256, "causal", check=False)
    body = body[body.index("def _consumer("):]
    steps = [body.index(s) for s in ("k_o.slice(64, DQC", "st_next = warpgroup_mma(k_o", "k_o.slice(128, DQC",
                                     "dpt_next = warpgroup_mma(v_o", "k_o.slice(192, DQC")]
    assert steps == sorted(steps) and "dq, dpt_next = warpgroup_mma_wait(0, deps=[dq_next, dpt_next])" in body


def test_wide_unchecked_timing_builds_the_variants_the_rules_refuse_until_checked(monkeypatch):
    """benchmarks/gluon_bwd.py --wide --unchecked times the variants that passed its float64
    checks in a child of their own (_time_gqa): it builds a config the rules refuse only
    until those checks have run (bwd.NOT_CHECKED) or as measured slower
    (bwd.MEASURED_SLOWER: lookahead with atomic dQ, the atomic dQ with the TMA stores)
    with the rules off, as the checks did, and every other one with them on."""
    import types

    import triton.testing

    G = _benchmark("gluon_bwd")
    built = []

    class _Kernel:
        def __getitem__(self, grid):
            return lambda *a, **kw: None

    def load(cfg, dtype, d, mask, check=True, probe="", varlen=False):
        B.render(cfg, dtype, d, mask, check)  # ValueError for a config the rules refuse
        built.append((cfg, check))
        return types.SimpleNamespace(attn_bwd_preprocess=_Kernel(), attn_bwd=_Kernel())

    def attention_bwd(do, q, k, v, o, lse, *, mask, config, check=True, **kw):
        load(config, "bfloat16", q.shape[-1], mask, check)

    real_randn = torch.randn
    monkeypatch.setattr(B, "load", load)
    monkeypatch.setattr(B, "attention_bwd", attention_bwd)
    monkeypatch.setattr(B, "launch_args", lambda do, q, k, v, o, lse, *, softmax_scale, diag_lo, diag_hi, config:
                        {"preprocess": ((1,), ()), "main": ((1,), ())})
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: (fn(), 1.0)[1])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch, "randn", lambda *size, device=None, **kw: real_randn(*size, **kw))
    configs = [B.GluonBwdConfig(*fields) for fields, _, _ in G.wide_configs(unchecked=True)]
    assert any(c.lookahead for c in configs)
    for cfg in configs:
        G._time_gqa(cfg, 1, 2, 1, 64, 256, True)
    for cfg in configs:
        valid = not B.invalid_reasons(cfg, 256, "bfloat16", "causal")
        assert {check for c, check in built if c == cfg} == {valid}, cfg.id


def test_lookahead_sass_issues_the_next_products_behind_dk(compiled):
    """The column-split program's HGMMA: S^T and dP^T 16 each over head_dim 256, dV and dK
    4 each over BLOCK_M 64, 4 per dQ chunk; the lookahead variants 32 more (the first
    step's S^T and dP^T before the loop) and the partial wait that leaves dK and the next
    step's two products in flight (3) while the first dQ chunk goes out, or (interleaved,
    ``_la2``) the two waits that leave one of them in flight (1) while chunks 1 and 2 go
    out."""
    for c in compiled:
        chunks = re.search(r"_cs(\d)", c["id"])
        if chunks and "_split" in c["id"]:
            # the role split: each partition its S^T or dP^T at N 64 (16), its halves of dV
            # and dK (4 each) and its half of the dQ chunks (4 each)
            assert c["hgmma"] == 2 * (16 + 4 + 4 + 4 * int(chunks.group(1)) // 2), c
            assert c["parts"] == 2 and c["num_warps"] == 12 and "0x1" in c["waits"], c
        elif chunks:
            base = 2 * 16 + 2 * 4 + 4 * int(chunks.group(1))
            n = int(chunks.group(1))
            ahead = re.search(r"_la([12])$", c["id"])
            assert c["hgmma"] == base + (32 if ahead else 0), c
            # the wgmma waits in program order: without lookahead S^T, dP^T, dV with chunk
            # 0 (1 left in flight each), then the chunks and dK; the lookahead variants
            # start with the first step's products (0)
            waits = (["0x1"] * 3 + ["0x0"] * n if not ahead else ["0x0", "0x3"] + ["0x0"] * n
                     if ahead.group(1) == "1" else ["0x0"] + ["0x1"] * 3 + ["0x0"] * (n - 2))
            assert c["waits"] == waits, c


def test_role_split_is_refused_as_measured_slower():
    """The column-split program's role split (``split``: partition 0 makes S^T and P^T,
    partition 1 dP^T and dS^T, each over all of head_dim at wgmma N 64; both their half
    of dV's, dK's and dQ's columns): built with atomic dQ, register stores and four dQ
    chunks (two: over the register budget); its float64 checks pass on the GPU but it
    measured slower than the lock-step program at every shape, so the rules refuse it
    (bwd.ROLE_SPLIT_SLOWER) and neither the search space, the GPU check's list nor the
    code id's probes hold it; its render has the role-split consumer and the hand-off
    barriers, which no other variant's has."""
    rs = dataclasses.replace(B.default_config(256), dq_mode="atomic", kv_store="ptr", split=True)
    assert rs.role_split and rs.parts == 2 and rs.part_rows == 64 and rs.num_warps == 4
    assert rs.id.endswith("_split_cs4")
    assert B.invalid_reasons(rs, 256) == [B.ROLE_SPLIT_SLOWER] and B.NOT_CHECKED not in B.ROLE_SPLIT_SLOWER
    for bad, words in ((dict(dq_mode="tma"), "dq_mode 'tma'"), (dict(kv_store="tma"), "kv_store 'tma'"),
                       (dict(lookahead=1), "and lookahead"), (dict(dq_chunks=2), "registers")):
        assert any(words in r for r in B.invalid_reasons(dataclasses.replace(rs, **bad), 256)), bad
    assert B.consumer_regs_estimate(rs, 256) <= rs.consumer_regs and B.smem_bytes(rs, 256) <= B.SMEM_LIMIT_BYTES
    for mask in B.MASKS:
        assert not any(c.split for c in B.search_space(256, "bfloat16", mask))
        assert rs not in B.col_split_space(256, "bfloat16", mask, unchecked=True)
    assert not any(c.split for c, *_ in B.probe_variants("col_split"))
    src = B.render(rs, "bfloat16", 256, "causal", check=False)
    assert src.count("_consumer_rs(") == 3 and "hs = gl.allocate_shared_memory(gl.int64, [4, 1]" in src
    assert "warps_per_cta=[4, 1], instr_shape=[16, 64, 16]" in src  # S^T, dP^T whole: N 64
    assert "_consumer_rs" not in B.render(B.default_config(256), "bfloat16", 256, "causal")


def test_column_split_program_serves_head_dim_256_alone():
    """head_dim 256 takes the column-split program (its two warpgroups share 64 key rows,
    each holding half of dK's, dV's and dQ's columns) and no other tile; the program's
    knobs are refused elsewhere; its space is what fits the shared memory, the default
    first among them, and the render puts the warpgroups side by side along N with P^T
    through shared memory and dQ in column chunks."""
    cs = B.default_config(256)
    assert cs.col_split and cs.block_nt == 64 and cs.num_warps == 8 and cs.dq_chunks == 4
    assert B.is_valid(cs, 256) and not B.is_valid(cs, 128)
    assert any("col_split" in r for r in B.invalid_reasons(dataclasses.replace(cs, dq_chunks=1), 256))
    assert any("dq_chunks" in r for r in B.invalid_reasons(dataclasses.replace(B.default_config(128), dq_chunks=4), 128))
    for bad, words in ((dict(dq_mode="ordered"), "deterministic backward at head_dim 256"),
                       (dict(dq_writer=True), "dq_writer"), (dict(group_split=2), "group_split"),
                       (dict(dq_stage="fragment"), "fragment"), (dict(split=True), "lock-step"),
                       (dict(dq_chunks=8), "dq_chunks 8"), (dict(block_m=128), "block_m 64")):
        assert any(words in r for r in B.invalid_reasons(dataclasses.replace(cs, **bad), 256)), bad
    # two ring stages fit with four dQ chunks (16 KB staging), not with two (32 KB)
    assert B.smem_bytes(cs, 256) <= B.SMEM_LIMIT_BYTES
    assert any("shared memory" in r for r in B.invalid_reasons(dataclasses.replace(cs, dq_chunks=2), 256))
    for mask in B.MASKS:
        space = B.search_space(256, "bfloat16", mask)
        assert cs in space and all(c.col_split and c.block_nt == 64 for c in space)
        assert {(c.stages, c.dq_mode, c.dq_chunks) for c in space} == {
            (1, "tma", 2), (1, "tma", 4), (1, "atomic", 2), (1, "atomic", 4), (2, "tma", 4), (2, "atomic", 2),
            (2, "atomic", 4)}
    assert B.consumer_regs_estimate(cs, 256) <= cs.consumer_regs
    src = B.render(cs, "bfloat16", 256, "causal")
    assert "warps_per_cta=[4, 2], instr_shape=[16, 32, 16]" in src  # S^T, dP^T: half the query columns each
    assert "warps_per_cta=[4, 2], instr_shape=[16, 128, 16]" in src  # dK, dV: half of head_dim each
    assert "p_smem.store(pt.to(DTYPE))" in src and src.count("tma_reduce_add(dq_desc") == 4
    assert "dk = warpgroup_mma(ds_c, q_s, dk, is_async=True)" in src
    assert "BLOCK_NT = gl.constexpr(64)" in src and "p_smem" not in B.render(B.default_config(128), "bfloat16", 128,
                                                                           "causal")
    # the launcher's dQ boxes are the chunks' width; K and V boxes the program's 64 rows
    q = torch.empty(1, 2, 256, 256, dtype=torch.bfloat16)
    lse = torch.empty(1, 2, 256, dtype=torch.float32)
    a = B.launch_args(q, q, q, q, q, lse, softmax_scale=0.1, diag_lo=-256, diag_hi=256, config=cs)
    assert a["main"][0] == (4, 2)
    assert list(a["main"][1][6].block_shape) == [1, 1, 64, 64] and list(a["main"][1][1].block_shape) == [1, 1, 64, 256]


"""The Gluon forward family (flashgen/families/gluon) on CPU: every variant of the
search space renders; the validity rules and the shared-memory model; and a
representative handful compiles for sm_90 (Triton's real compiler and bundled ptxas,
in a subprocess without TRITON_INTERPRET) with what each variant is for in its binary:
HGMMA, setmaxnreg (USETMAXREG), a partial wgmma wait, no spills, no serialized wgmma
(ptxas C7514/C7515) or ignored setmaxnreg (C7508), the exponentials between the two
waits where the variant pins them, and shared memory within the model."""

import ast
import dataclasses
import json
import os
import re

import pytest

from flashgen.families.gluon import config as C
from flashgen.families.gluon import shim
from flashgen.families.gluon.config import (
    CONSUMER_OVERHEAD_REGS, HEAD_DIMS, SMEM_LIMIT_BYTES, GluonFwdConfig, GluonFwdSpec, GluonFwdVariant, check,
    consumer_regs_needed, default_config, maxnreg, refinement_space, smem_bytes, smem_terms, space,
)
from flashgen.families.gluon.render import render
from pysource import assert_parses

SPECS = [GluonFwdSpec(dt, d, dv, m) for dt in ("bfloat16", "float16") for d, dv in
         [(d, d) for d in HEAD_DIMS] + [(128, 64), (64, 128), (192, 128)] for m in ("none", "causal", "window")]


def test_every_space_variant_renders():
    n = 0
    for s in SPECS:
        cfgs = list(space(s))
        assert cfgs, s
        assert not check(GluonFwdVariant(s, default_config(s)))
        for c in cfgs:
            v = GluonFwdVariant(s, c)
            src = render(v)
            assert_parses(src)  # ast.parse's verdict, each distinct top-level statement parsed once
            assert f'VARIANT_ID = "{v.id}"' in src
            assert f"MAXNREG = {maxnreg(c)}" in src
            assert ("pin = _pin(" in src) == c.pin_exps
            assert ("num_tiles, gl.num_programs(0)" in src) == bool(c.persistent)
            # the persistent walk's own O staging buffer, and its longest-first order with a mask
            assert ("o_buf = q_smem" in src) == (c.persistent < 2 and s.head_dim_v == s.head_dim)
            # the walk with two Q buffers loads the next tile's Q a tile ahead
            assert ("_load_q(q_desc" in src) == (c.persistent == 3)
            assert ("_tile_coords_lpt(tile" in src) == (c.persistent >= 2 and s.mask != "none")
            # the masked tiles retire both products before their softmax only with serial_masked
            assert ("s, acc, p16 = warpgroup_mma_wait(0, deps=[s_tok, o_tok, p16])" in src) == c.serial_masked
            n += 1
    assert n > 500


def test_validity_rules_say_why():
    s = GluonFwdSpec("bfloat16", 256, 256, "none")
    why = check(GluonFwdVariant(s, GluonFwdConfig(BLOCK_N=128, num_stages=3)))
    assert any("shared memory" in w and "k_ring" in w for w in why)
    assert any("registers" in w for w in why)
    s = GluonFwdSpec("bfloat16", 64, 64, "none")
    assert any("pool" in w for w in check(GluonFwdVariant(s, GluonFwdConfig(num_consumers=3, consumer_regs=240))))
    assert any("BLOCK_N" in w for w in check(GluonFwdVariant(s, GluonFwdConfig(BLOCK_N=96))))
    assert any("BLOCK_N" in w for w in check(GluonFwdVariant(s, GluonFwdConfig(BLOCK_N=16))))
    # 128 query rows a consumer at head_dim 128 fit the registers over key tiles of 32
    # (224 of 232), not of 64
    d128 = GluonFwdSpec("bfloat16", 128, 128, "causal")
    m128 = GluonFwdConfig(BLOCK_M=128, BLOCK_N=32, num_stages=4, num_consumers=1, consumer_regs=232, ctas_per_sm=2)
    assert check(GluonFwdVariant(d128, m128)) == []
    assert any("registers" in w for w in check(GluonFwdVariant(d128, dataclasses.replace(m128, BLOCK_N=64))))
    assert any("multiple of 8" in w for w in check(GluonFwdVariant(s, GluonFwdConfig(consumer_regs=236))))
    assert any("head_dim=80" in w for w in check(GluonFwdVariant(GluonFwdSpec(head_dim=80, head_dim_v=80),
                                                                  GluonFwdConfig())))
    # the pinned d64 three-consumer tile spills (1.7 KB at 160 registers): the model rejects it
    assert any("registers" in w for w in check(GluonFwdVariant(s, GluonFwdConfig(
        num_consumers=3, consumer_regs=160, producer_regs=32, num_stages=4, pin_exps=True))))
    # with a mask the same tile spills (184 B, ptxas of Triton 3.6) unless its masked tiles
    # run without the overlap (serial_masked: no spills), which the model admits
    x3 = GluonFwdConfig(num_consumers=3, consumer_regs=160, producer_regs=32, num_stages=3)
    causal = GluonFwdSpec("bfloat16", 64, 64, "causal")
    assert any("registers" in w for w in check(GluonFwdVariant(causal, x3)))
    assert check(GluonFwdVariant(causal, dataclasses.replace(x3, serial_masked=True))) == []
    # serial_masked is a mode of the masked tiles of a mask, not of the seqlen_k tail alone
    assert any("serial_masked with mask 'none'" in w
               for w in check(GluonFwdVariant(s, dataclasses.replace(x3, serial_masked=True))))
    assert any("serial_masked with attention sinks" in w for w in check(GluonFwdVariant(
        GluonFwdSpec("bfloat16", 64, 64, "causal", sinks=True), dataclasses.replace(x3, serial_masked=True))))
    # persistent programs only without a mask (measured: unbalanced longest-first tiles)
    assert any("persistent" in w for w in check(GluonFwdVariant(GluonFwdSpec(mask="causal"),
                                                                 GluonFwdConfig(persistent=True))))
    # two programs per SM share its registers and shared memory
    assert any("2 program(s) per SM" in w for w in check(GluonFwdVariant(GluonFwdSpec(), GluonFwdConfig(
        num_consumers=1, consumer_regs=232, ctas_per_sm=2))))
    # a consumer owns one or two m64 row blocks; two double its O and score registers,
    # which fit at head_dim 64 only
    assert any("BLOCK_M=96" in w for w in check(GluonFwdVariant(s, GluonFwdConfig(BLOCK_M=96))))
    m128 = GluonFwdConfig(BLOCK_M=128, num_consumers=1, BLOCK_N=64, consumer_regs=232, ctas_per_sm=2, num_stages=3)
    assert check(GluonFwdVariant(causal, m128)) == []
    assert any("registers" in w for w in check(GluonFwdVariant(GluonFwdSpec("bfloat16", 128, 128, "causal"), m128)))
    assert any("registers" in w for w in check(GluonFwdVariant(causal, dataclasses.replace(m128, BLOCK_N=128))))
    assert consumer_regs_needed(causal, m128) == 2 * consumer_regs_needed(causal, dataclasses.replace(
        m128, BLOCK_M=64)) - CONSUMER_OVERHEAD_REGS
    assert {c.BLOCK_M for c in space(causal)} == {64, 128}
    assert {c.BLOCK_M for c in space(GluonFwdSpec("bfloat16", 128, 128, "causal"))} == {64}
    # cross_tile is a mode of the walk of 3, outside the search space (a refinement knob)
    walk3 = GluonFwdConfig(BLOCK_N=64, num_stages=3, num_consumers=1, consumer_regs=136, ctas_per_sm=3,
                           persistent=3)
    assert check(GluonFwdVariant(causal, dataclasses.replace(walk3, cross_tile=True))) == []
    assert any("cross_tile with persistent=2" in w
               for w in check(GluonFwdVariant(causal, dataclasses.replace(walk3, persistent=2, cross_tile=True))))
    assert any("cross_tile with serial_masked" in w for w in check(GluonFwdVariant(causal, dataclasses.replace(
        walk3, serial_masked=True, cross_tile=True))))
    assert not any(c.cross_tile for c in space(causal))
    twins = refinement_space(causal, "cross_tile")
    assert twins and {dataclasses.replace(c, cross_tile=False) for c in twins} == {
        c for c in space(causal) if c.persistent == 3 and not c.serial_masked}
    # o_in_q stages O in the walk's Q buffers: the O staging buffer leaves the model, which
    # admits the one-consumer head_dim 128 walk of 3 at two programs per SM
    one = GluonFwdConfig(BLOCK_N=64, num_stages=2, num_consumers=1, consumer_regs=232, ctas_per_sm=2, persistent=3)
    d128 = GluonFwdSpec("bfloat16", 128, 128, "causal")
    assert any("shared memory" in w for w in check(GluonFwdVariant(d128, one)))
    oq = dataclasses.replace(one, o_in_q=True)
    assert check(GluonFwdVariant(d128, oq)) == [] and "o_staging" not in smem_terms(d128, oq)
    assert oq in refinement_space(d128, "o_in_q") and not any(c.o_in_q for c in space(d128))
    assert any("o_in_q with persistent=2" in w for w in check(GluonFwdVariant(d128, dataclasses.replace(
        oq, persistent=2))))
    assert any("o_in_q with persistent=3 and head dims (128, 64)" in w for w in check(GluonFwdVariant(
        GluonFwdSpec("bfloat16", 128, 64, "causal"), oq)))
    assert any("o_in_q with cross_tile" in w for w in check(GluonFwdVariant(d128, dataclasses.replace(
        oq, cross_tile=True))))
    with pytest.raises(ValueError, match="cannot be built"):
        render(GluonFwdVariant(s, GluonFwdConfig(BLOCK_N=96)))
    for s in SPECS:
        for c in space(s):
            assert smem_bytes(s, c) <= SMEM_LIMIT_BYTES


def test_shim_maps_the_installed_names():
    assert shim.available(), shim.IMPORT_ERROR
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language._core import shared_memory_descriptor
    from triton.experimental.gluon.language.nvidia.hopper import tma

    # the later names where they exist (3.9 keeps the 3.6 TMA names as stubs that raise)
    later = hasattr(tma, "async_load")
    assert shim.tma_load is (tma.async_load if later else tma.async_copy_global_to_shared)
    assert shim.tma_store is (tma.async_store if later else tma.async_copy_shared_to_global)
    assert shim.thread_barrier is (gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier)
    if hasattr(tma, "async_atomic_add"):
        assert shim.tma_reduce_add is tma.async_atomic_add
    assert hasattr(shared_memory_descriptor, "_reinterpret")
    ptxas = shim.ptxas_sm90()
    assert os.path.exists(ptxas[0]) and set(ptxas[1:]) <= {"--regAllocOptLevel=2"}, ptxas
    assert os.path.exists(shim.cuobjdump())


def test_generated_kernels_import_only_the_shim():
    from flashgen.families.gluon import bwd

    for src in (render(GluonFwdVariant(GluonFwdSpec(), GluonFwdConfig())),
                bwd.render(bwd.default_config(128), "bfloat16", 128, "causal")):
        imports = [n for n in ast.walk(ast.parse(src)) if isinstance(n, (ast.Import, ast.ImportFrom))]
        assert imports and all(isinstance(n, ast.ImportFrom) and n.module == "flashgen.families.gluon.shim"
                               for n in imports), [ast.unparse(n) for n in imports]


def test_launcher_refuses_what_it_cannot_serve():
    import torch

    from flashgen.families.gluon.launch import unsupported

    q = torch.zeros(1, 2, 16, 64, dtype=torch.bfloat16)
    assert "CUDA" in unsupported(q, q, q, mask="none")


# Each: (dtype, head_dim, head_dim_v, mask, config kwargs[, sinks]).  Pinned and unpinned,
# 1/2/3 consumers, BLOCK_N 64/128, persistent, padded and unequal head dims, every mask,
# and the attention-sinks variant (its fold after the key loop: the loop's code is the
# plain variant's).
COMPILE_CASES = [
    ("bfloat16", 128, 128, "causal", dict(pin_exps=True)),
    ("float16", 64, 64, "none", dict(num_consumers=3, consumer_regs=160, producer_regs=32, BLOCK_N=64, num_stages=6)),
    ("bfloat16", 128, 128, "window", dict(BLOCK_N=64, num_stages=2, num_consumers=1, consumer_regs=232, ctas_per_sm=2)),
    ("bfloat16", 96, 96, "causal", dict(num_consumers=1, num_stages=3)),
    ("bfloat16", 128, 64, "none", dict(persistent=True, pin_exps=True)),
    ("bfloat16", 128, 128, "causal", dict(pin_exps=True), True),
    ("bfloat16", 64, 64, "window", dict(), True),
    # the persistent walk with its own O staging buffer, and its longest-first order
    ("bfloat16", 128, 128, "none", dict(pin_exps=True, persistent=2)),
    ("bfloat16", 64, 64, "causal", dict(num_stages=4, persistent=2)),
    # the walk's pinned causal tile, which serves a Llama-3-8B key in the shipped rows
    ("bfloat16", 128, 128, "causal", dict(pin_exps=True, persistent=2)),
    # the walk with two Q buffers: the tiles the shipped rows take at seqlen 512-4096
    ("bfloat16", 128, 128, "none", dict(pin_exps=True, persistent=3)),
    ("bfloat16", 128, 128, "causal", dict(BLOCK_N=64, num_stages=3, pin_exps=True, persistent=3)),
    ("bfloat16", 64, 64, "causal", dict(BLOCK_N=64, num_consumers=1, consumer_regs=232, ctas_per_sm=2,
                                        persistent=3)),
    # three programs per SM: one consumer at 136 registers (head_dim 64, BLOCK_N 64)
    ("bfloat16", 64, 64, "causal", dict(BLOCK_N=64, num_stages=3, num_consumers=1, consumer_regs=136,
                                        ctas_per_sm=3, persistent=3)),
    ("bfloat16", 64, 64, "none", dict(BLOCK_N=64, num_stages=4, num_consumers=1, consumer_regs=136,
                                      ctas_per_sm=3)),
    # the walk dealt in alternating directions (snake), beside its one-direction twins
    ("bfloat16", 64, 64, "causal", dict(BLOCK_N=64, num_stages=3, num_consumers=1, consumer_regs=136,
                                        ctas_per_sm=3, persistent=3, snake=True)),
    ("bfloat16", 128, 128, "causal", dict(BLOCK_N=64, num_consumers=1, consumer_regs=232, ctas_per_sm=2,
                                          persistent=2)),
    ("bfloat16", 128, 128, "causal", dict(BLOCK_N=64, num_consumers=1, consumer_regs=232, ctas_per_sm=2,
                                          persistent=2, snake=True)),
    # the masked tiles without the intra-warpgroup overlap (serial_masked): FlashAttention-3's
    # head_dim 64 causal tile (three consumers, BLOCK_N 128), which spills without it and is
    # outside the register rule, and the walk's pinned causal head_dim 128 tile beside its
    # overlapped twin above
    ("bfloat16", 64, 64, "causal", dict(num_consumers=3, consumer_regs=160, producer_regs=32, num_stages=3,
                                        persistent=3, serial_masked=True)),
    ("bfloat16", 64, 64, "window", dict(num_consumers=3, consumer_regs=160, producer_regs=32, num_stages=2,
                                        serial_masked=True)),
    ("bfloat16", 128, 128, "causal", dict(pin_exps=True, persistent=2, serial_masked=True)),
    # consumers of 128 query rows (BLOCK_M 128): two m64 row blocks per wgmma, head_dim 64
    ("bfloat16", 64, 64, "causal", dict(BLOCK_M=128, BLOCK_N=64, num_stages=3, num_consumers=1, consumer_regs=232,
                                        ctas_per_sm=2, persistent=3)),
    ("bfloat16", 64, 64, "none", dict(BLOCK_M=128, BLOCK_N=64, num_stages=4, pin_exps=True)),
    # and at head_dim 128 over key tiles of 32, two programs per SM (outside the search:
    # measured 0.69-0.94x the shipped rows, the design notes' "what was tried")
    ("bfloat16", 128, 128, "causal", dict(BLOCK_M=128, BLOCK_N=32, num_stages=4, num_consumers=1, consumer_regs=232,
                                          ctas_per_sm=2)),
    # the walk of 3 with a tile's last P V product carried into the next tile (cross_tile),
    # beside its twin above (three programs per SM, head_dim 64 causal)
    ("bfloat16", 64, 64, "causal", dict(BLOCK_N=64, num_stages=3, num_consumers=1, consumer_regs=136,
                                        ctas_per_sm=3, persistent=3, cross_tile=True)),
    # the walk of 3 with O staged in its Q buffers (o_in_q): the one-consumer head_dim 128
    # tile two to an SM, which does not fit with an O buffer of its own
    ("bfloat16", 128, 128, "causal", dict(BLOCK_N=64, num_consumers=1, consumer_regs=232, ctas_per_sm=2,
                                          persistent=3, o_in_q=True)),
    # one program per tile in the walk's longest-first order (longest_first): the pinned
    # head_dim 128 causal tile of the long keys, and three one-consumer programs per SM
    ("bfloat16", 128, 128, "causal", dict(pin_exps=True, longest_first=True)),
    ("bfloat16", 64, 64, "causal", dict(BLOCK_N=64, num_stages=3, num_consumers=1, consumer_regs=136,
                                        ctas_per_sm=3, longest_first=True)),
    # each tile's key tiles last to first (masked_first): the o_in_q tile above, which
    # serves the short head_dim 128 causal keys in this order
    ("bfloat16", 128, 128, "causal", dict(BLOCK_N=64, num_consumers=1, consumer_regs=232, ctas_per_sm=2,
                                          persistent=3, o_in_q=True, masked_first=True)),
    # and with each consumer releasing unread the tiles past its rows (skip_masked): two
    # consumers at BLOCK_N 64 in the walk of 2, beside its key-order twin
    ("bfloat16", 128, 128, "causal", dict(BLOCK_N=64, persistent=2)),
    ("bfloat16", 128, 128, "causal", dict(BLOCK_N=64, persistent=2, masked_first=True, skip_masked=True)),
    # ragged batches (varlen), each beside its dense twin above: the one-consumer tile two
    # to an SM (the short documents' tile), a padded head dim, three consumers at float16
    ("bfloat16", 128, 128, "window", dict(BLOCK_N=64, num_stages=2, num_consumers=1, consumer_regs=232, ctas_per_sm=2),
     dict(varlen=True)),
    ("bfloat16", 96, 96, "causal", dict(num_consumers=1, num_stages=3), dict(varlen=True)),
    ("float16", 64, 64, "none", dict(num_consumers=3, consumer_regs=160, producer_regs=32, BLOCK_N=64, num_stages=6),
     dict(varlen=True)),
    # the untuned head_dim 128 causal varlen default (and a tuned row), beside the first case
    ("bfloat16", 128, 128, "causal", dict(pin_exps=True), dict(varlen=True)),
    # the packed twins (skewed batches) of the varlen cases above
    ("bfloat16", 128, 128, "causal", dict(pin_exps=True), dict(varlen=True, varlen_packed=True)),
    ("bfloat16", 128, 128, "window", dict(BLOCK_N=64, num_stages=2, num_consumers=1, consumer_regs=232, ctas_per_sm=2),
     dict(varlen=True, varlen_packed=True)),
    ("float16", 64, 64, "none", dict(num_consumers=3, consumer_regs=160, producer_regs=32, BLOCK_N=64, num_stages=6),
     dict(varlen=True, varlen_packed=True)),
]

#: ptxas spill-store bytes of COMPILE_CASES (none for the dense defaults, which were
#: measured on 3.6).  The persistent walk's pinned causal head_dim 128 tile spills 108 B under 3.6
#: (8 B under 3.9; 24 B unpinned under 3.6, 0 under 3.9) and measured fastest for some
#: keys all the same (docs/design.md, the Gluon forward).  Triton 3.9 assembles sm_90 with ptxas 13.x and
#: ``--regAllocOptLevel=2`` (shim.ptxas_sm90): with that flag the pinned d128 tile
#: spills one register (the same 4 B from 3.6's PTX; 0 B without the flag), reloaded
#: outside the key loop; the persistent pinned tile also spills from 3.9's own PTX
#: (12 B with ptxas 12.8 too), one reload inside the key loop; the d64 window tile of
#: two consumers and two stages spills 4 B (8 B of stack), its sinks variant the same (0 B
#: under 3.6); the pinned persistent walk without a mask spills 16 B like the
#: pinned persistent tile (0 B under 3.6), and 20 B with two Q buffers (0 B under 3.6).
#: With ``serial_masked`` the walk's pinned causal d128 tile spills 4 B under 3.6 (its
#: overlapped twin 108 B) and 8 B under 3.9 (as its twin); FlashAttention-3's
#: three-consumer head_dim 64 tile spills nothing under 3.6 and 204-376 B under 3.9, as
#: the unmasked tile does there (312 B: 3.9's ptxas, not the mask).  The pinned
#: two-consumer tile of 128-row consumers (BLOCK_M 128) spills 4 B under 3.9 (0 under 3.6).
#: The walk of 3 with ``cross_tile`` at three programs per SM (136 registers) spills 108 B
#: under 3.9 (0 under 3.6, as its twin under both).  The pinned d128 tile in the
#: longest-first order spills the same 4 B under 3.9 as its grid-order twin (0 under 3.6).
#: The varlen variant of the pinned d128 causal tile (the untuned varlen default there)
#: keeps a sequence's bounds in registers through the key loop, which the dense tile reads
#: from its parameters: 16 B under 3.6 (measured on the H200 as tuned, docs/design.md) and
#: 108 B under 3.9.  Its packed twin (``varlen_packed``, skewed batches) keeps the
#: sequence's first query row, loaded by the search, where the grid's twin recomputes it
#: from the program id: 88 B under 3.6 (measured on the H200 in that form,
#: benchmarks/probe_varlen_grid.py) and 56 B under 3.9.  Any other spill fails.
SPILL_BYTES = {
    "3.6": {"gluon_fwd_d128_bf16_causal_m64x2_n128_s2_r240-24_pin_pers2": 108,
            "gluon_fwd_d128_bf16_causal_m64x2_n128_s2_r240-24_pin_pers2_sermask": 4,
            "gluon_fwd_d128_bf16_causal_varlen_m64x2_n128_s2_r240-24_pin": 16,
            "gluon_fwd_d128_bf16_causal_varlen_packed_m64x2_n128_s2_r240-24_pin": 88},
    "3.9": {"gluon_fwd_d128_bf16_causal_m64x2_n128_s2_r240-24_pin_pers2": 8,
            "gluon_fwd_d128_bf16_causal_m64x2_n128_s2_r240-24_pin": 4,
            "gluon_fwd_d128_bf16_causal_m64x2_n128_s2_r240-24_pin_lpt": 4,
            "gluon_fwd_d64_bf16_window_m64x2_n128_s2_r240-24": 4,
            "gluon_fwd_d128_dv64_bf16_none_m64x2_n128_s2_r240-24_pin_pers": 16,
            "gluon_fwd_d128_bf16_none_m64x2_n128_s2_r240-24_pin_pers2": 16,
            "gluon_fwd_d128_bf16_none_m64x2_n128_s2_r240-24_pin_pers3": 20,
            "gluon_fwd_d128_bf16_causal_m64x2_n128_s2_r240-24_pin_pers2_sermask": 8,
            "gluon_fwd_d64_bf16_causal_m64x3_n128_s3_r160-32_pers3_sermask": 376,
            "gluon_fwd_d64_bf16_window_m64x3_n128_s2_r160-32_sermask": 204,
            "gluon_fwd_d64_bf16_none_m128x2_n64_s4_r240-24_pin": 4,
            "gluon_fwd_d64_bf16_causal_m64x1_n64_s3_r136-24_pers3_xtile_x3": 108,
            "gluon_fwd_d128_bf16_causal_varlen_m64x2_n128_s2_r240-24_pin": 108,
            "gluon_fwd_d128_bf16_causal_varlen_packed_m64x2_n128_s2_r240-24_pin": 56},
}

_SCRIPT = r'''
import json, sys
from flashgen.families.gluon.config import GluonFwdConfig, GluonFwdSpec, GluonFwdVariant, smem_bytes
from flashgen.families.gluon.sm90 import compile_sm90, report
for dt, d, dv, mask, kw, *extra in CASES:
    sk = extra[0] if extra and isinstance(extra[0], dict) else dict(sinks=bool(extra))
    v = GluonFwdVariant(GluonFwdSpec(dt, d, dv, mask, **sk), GluonFwdConfig(**kw))
    r = report(compile_sm90(v))
    print("OK " + json.dumps(dict(id=v.id, problems=r.problems(v), spill=r.spill_bytes, shared=r.shared_bytes,
                                  model=smem_bytes(v.spec, v.config), setmaxnreg=r.setmaxnreg, hgmma=r.hgmma,
                                  exps=r.exps_between_waits, pin=v.config.pin_exps, block_n=v.config.BLOCK_N,
                                  waits=r.partial_waits, consumers=v.config.num_consumers,
                                  regs=[v.config.consumer_regs, v.config.producer_regs])))
'''


def compile_features(case) -> set:
    """The (knob, value) pairs of a COMPILE_CASES entry: every field of its spec and
    config (tests/sm90.py: covering)."""
    dt, d, dv, mask, kw, *extra = case
    sk = extra[0] if extra and isinstance(extra[0], dict) else dict(sinks=bool(extra))
    v = GluonFwdVariant(GluonFwdSpec(dt, d, dv, mask, **sk), GluonFwdConfig(**kw))
    return {(f"spec.{k}", x) for k, x in dataclasses.asdict(v.spec).items()} | \
        {(f"config.{k}", x) for k, x in dataclasses.asdict(v.config).items()}


def test_sass_instructions_counts_instruction_lines_of_any_address_width():
    """Code size from cuobjdump's text: instruction lines (predicated or not, addresses of
    four or more hex digits), not the encoding comments between them."""
    from flashgen.families.gluon.sm90 import sass_instructions

    sass = """        Function : attn_fwd
        /*0000*/                   LDC R1, c[0x0][0x28] ;                  /* 0x00000a00ff017b82 */
                                                                             /* 0x000fe40000000f00 */
        /*fff0*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT ;
        /*10000*/              @!P0 BRA 0x10 ;
        /*1a2b0*/                   EXIT ;
"""
    assert sass_instructions(sass) == 4


def test_serialized_wgmma_is_a_problem_though_ptxas_prints_it_as_info():
    """ptxas reports serialized wgmma (C7512/C7514/C7515) on info lines, not warnings:
    Report.problems reads its whole log for them (and for the warning C7508)."""
    from flashgen.families.gluon.sm90 import Report

    v = GluonFwdVariant(GluonFwdSpec(), GluonFwdConfig())
    base = dict(registers=168, spill_bytes=0, stack_bytes=0, warnings=[], shared_bytes=1, hgmma=8, setmaxnreg=[24, 240],
                partial_waits=1, exps_between_waits=0)
    assert Report(**base, ptxas_log="ptxas info    : Used 168 registers").problems(v) == []
    for code in ("C7512", "C7514", "C7515"):
        log = (f"ptxas info    : ({code}) Potential Performance Loss: wgmma.mma_async instructions are serialized "
               "due to ...\nptxas info    : Used 168 registers")
        assert [p for p in Report(**base, ptxas_log=log).problems(v) if code in p], code
    warn = "ptxas warning : (C7508) Potential Performance Loss: setmaxnreg ignored"
    assert Report(**base, ptxas_log=warn).problems(v)


def test_compiles_for_sm90_with_what_each_variant_is_for(request):
    import triton

    from sm90 import chosen, json_rows

    rows = json_rows(_SCRIPT, chosen(request.config, COMPILE_CASES, compile_features))
    spills = SPILL_BYTES.get(".".join(triton.__version__.split(".")[:2]), {})
    by_id = {row["id"]: row for row in rows}
    for row in rows:
        # a sinks variant spills as its plain one unless recorded
        known = spills.get(row["id"], spills.get(row["id"].replace("_sinks", ""), 0))
        assert row["spill"] == known, row
        assert [p for p in row["problems"] if not (known and p.startswith("spills "))] == [], row
        assert row["hgmma"] > 0 and row["setmaxnreg"], row
        # the consumers' and the producer's budgets are set (setmaxnreg in the SASS)
        assert set(row["regs"]) <= set(row["setmaxnreg"]), row
        assert row["shared"] <= row["model"] <= row["shared"] + 2048, row
        if row["pin"]:
            # one tile's P (64 x BLOCK_N / 128 threads) between the waits
            assert row["exps"] >= row["block_n"] // 2, row
        if "_snake" in row["id"]:  # the deal is index arithmetic before the tile's loads
            twin = by_id.get(row["id"].replace("_snake", ""))
            assert twin is not None, f"{row['id']}: its one-way twin is not among COMPILE_CASES"
            assert (row["hgmma"], row["setmaxnreg"]) == (twin["hgmma"], twin["setmaxnreg"]), (row, twin)
            assert row["spill"] <= twin["spill"], (row, twin)
        if "_sermask" in row["id"]:  # fewer registers live in the masked tiles: no more spills
            twin = by_id.get(row["id"].replace("_sermask", ""))
            if twin is not None:
                assert row["spill"] <= twin["spill"], (row, twin)
        if "_xtile" in row["id"]:  # each consumer's first key tile waits partially, with the P V in flight
            twin = by_id.get(row["id"].replace("_xtile", ""))
            assert twin is not None, f"{row['id']}: its twin is not among COMPILE_CASES"
            assert row["waits"] == twin["waits"] + row["consumers"] and row["hgmma"] > twin["hgmma"], (row, twin)
        if "_mf" in row["id"]:  # the same products and budgets in another key order (a skipped tile runs none)
            twin = by_id.get(row["id"].replace("_mf", "").replace("_skip", ""))
            assert twin is not None, f"{row['id']}: its key-order twin is not among COMPILE_CASES"
            assert (row["hgmma"], row["setmaxnreg"]) == (twin["hgmma"], twin["setmaxnreg"]), (row, twin)
            assert row["spill"] <= twin["spill"], (row, twin)
        if "_varlen_packed" in row["id"]:  # the grid-layout twin's products and budgets; its search
            twin = by_id.get(row["id"].replace("_packed", ""))
            assert twin is not None, f"{row['id']}: its varlen twin is not among COMPILE_CASES"
            assert (row["hgmma"], row["setmaxnreg"]) == (twin["hgmma"], twin["setmaxnreg"]), (row, twin)
            assert row["spill"] <= twin["spill"] or row["id"] in spills, (row, twin)
        elif "_varlen" in row["id"]:  # the dense twin's products and budgets; its store of a sequence's tail
            twin = by_id.get(row["id"].replace("_varlen", ""))
            assert twin is not None, f"{row['id']}: its dense twin is not among COMPILE_CASES"
            assert (row["hgmma"], row["setmaxnreg"]) == (twin["hgmma"], twin["setmaxnreg"]), (row, twin)
            assert row["spill"] <= twin["spill"] or row["id"] in spills, (row, twin)
        plain = by_id.get(row["id"].replace("_sinks", ""))
        if "_sinks" in row["id"] and plain is not None:  # the key loop as the plain variant's
            assert (row["hgmma"], row["setmaxnreg"], row["exps"]) == (plain["hgmma"], plain["setmaxnreg"],
                                                                      plain["exps"]), (row, plain)



def test_code_id_record_is_current(gluon_fwd_probes_once):
    """templates/gluon/attn_fwd.code_id.json matches the template: run ``python3 -m
    flashgen.families.gluon`` after a template edit when this fails (the id stays while
    the recorded variants' code is unchanged, so the tuned rows keep serving)."""
    from flashgen.families.gluon import render as R
    from flashgen.render import templates_dir

    rec = json.loads((templates_dir() / R.CODE_ID_RECORD).read_text())
    assert rec["text"] == R._CODE_ID.text_hash() and rec["probes"] == R._CODE_ID.probe_digest()
    # the variants of knob values added later (persistent 2 and 3) as recorded too
    assert rec.get("extensions", {}) == R._CODE_ID.extension_digests()
    assert {"persistent2", "persistent3"} <= set(rec["extensions"])
    assert R.template_hash() == rec["code"] == R.code_id()
    spec = GluonFwdSpec("bfloat16", 128, 128, "causal")
    assert f"template_hash: {rec['code']}" in render(GluonFwdVariant(spec, default_config(spec)))
    assert len(R.probe_variants()) > 1000


def test_user_code_id_record_is_current():
    """templates/gluon/attn_fwd.user_code_id.json matches the template, user.py and the
    sinks code id, and the user examples' variants render as recorded: run ``python3 -m
    flashgen.families.gluon`` after an edit when this fails.  The shipped user rows carry
    this id (tests/test_tma.py)."""
    from flashgen.families.gluon import render as R
    from flashgen.families.gluon.user_probe import user_probe_digest
    from flashgen.render import templates_dir

    rec = json.loads((templates_dir() / R.USER_CODE_ID_RECORD).read_text())
    assert {k: rec[k] for k in ("text", "user", "sinks")} == R._user_inputs()
    assert rec["probes"] == user_probe_digest() and R.user_code_id() == rec["code"]


def test_code_id_follows_the_generated_code_not_the_template_text(tmp_path, gluon_fwd_probes_once):
    """A Jinja comment or a branch no recorded variant renders keeps the forward's id
    (and its tuned rows); a change to the code of a recorded variant gives a new one."""
    import shutil

    from flashgen.families.gluon import render as R
    from flashgen.render import templates_dir

    def edited(name, old, new):
        d = tmp_path / name
        shutil.copytree(templates_dir(), d)
        t = d / "gluon" / R.TEMPLATE
        assert old in t.read_text()
        t.write_text(t.read_text().replace(old, new, 1))
        return str(d)

    anchor = "VARIANT_ID = "
    same = edited("same", anchor, "{# a comment #}\n{% if mask == 'nothing' %}x = 1\n{% endif %}" + anchor)
    assert R._CODE_ID.text_hash(same) != R._CODE_ID.text_hash() and R.code_id(same) == R.template_hash()
    other = edited("other", anchor, "# changed\n" + anchor)
    assert R.code_id(other) not in (R.template_hash(), R._CODE_ID.text_hash(other))
    # code that only an extension's variants render (persistent 2) is code like any other
    ext = edited("ext", "        # Every score product of this tile is done", "        # changed\n"
                 "        # Every score product of this tile is done")
    assert R._CODE_ID.probe_digest(ext) == R._CODE_ID.probe_digest() and R.code_id(ext) != R.template_hash()
    assert R.write_code_id(other)["code"] == R.code_id(other) != R.template_hash()
    R.template_hash.cache_clear()
    assert R.template_hash() == json.loads((templates_dir() / R.CODE_ID_RECORD).read_text())["code"]


def _sinks_fold(src: str):
    """The rendered sinks variant ``src``'s epilogue, its own statements from ``sink = ...``
    through ``lse = ...`` in ``_consumer``, as a function (m_i, l_i, acc, sinks, off_h) ->
    (O, LSE) on float64 torch tensors of one head's rows."""
    import types

    import torch

    fns = {n.name: n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef)}
    stmts = [st for st in ast.walk(fns["_consumer"]) if isinstance(st, ast.Assign)]
    first = next(i for i, st in enumerate(stmts) if ast.unparse(st.targets[0]) == "sink")
    last = next(i for i, st in enumerate(stmts) if i > first and ast.unparse(st.targets[0]) == "lse")
    fold = compile(ast.Module(body=stmts[first:last + 1], type_ignores=[]), "<sinks fold>", "exec")

    class Ptr:  # SINKS + off_h
        def __init__(self, t, i=0):
            self.t, self.i = t, i

        def __add__(self, n):
            return Ptr(self.t, self.i + n)

    gl = types.SimpleNamespace(load=lambda p: p.t[p.i], maximum=torch.maximum, exp2=torch.exp2, log2=torch.log2,
                               expand_dims=lambda x, axis: x.unsqueeze(axis), convert_layout=lambda x, layout: x)

    def run(m_i, l_i, acc, sinks, off_h):
        ns = {"gl": gl, "SINKS": Ptr(sinks), "off_h": off_h, "m_i": m_i, "l_i": l_i, "acc": acc, "ROW_O": None}
        exec(fold, ns)
        return ns["acc"], ns["lse"]
    return run


def test_the_sinks_fold_after_the_key_loop_is_the_sinks_softmax():
    """The sinks variant's epilogue (the rendered kernel's own statements, base 2: m_f =
    max(m_i, sink), l_f = l_i 2^(m_i - m_f) + 2^(sink - m_f), O = acc 2^(m_i - m_f) /
    l_f, LSE = (m_f + log2 l_f) ln 2), applied to the online softmax of the key tiles,
    equals the float64 reference with sinks, a row that sees no key included (O = 0,
    LSE = the sink)."""
    import math

    import torch

    from flashgen import user_mods

    g = torch.Generator().manual_seed(0)
    b, h, sq, sk, d, block_n = 1, 3, 37, 150, 16, 64
    q, k, v = (torch.randn(b, h, n, d, generator=g, dtype=torch.float64) for n in (sq, sk, sk))
    sinks = torch.tensor([0.5, -3.0, 8.0], dtype=torch.float64)
    scale = d ** -0.5
    lo, hi = -1, 140  # a window: query rows 0..36 see keys i-1..i+140, and row 36 is masked off below
    qk_scale = scale / math.log(2)
    s = q @ k.transpose(-1, -2)
    ii, jj = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
    keep = (jj - ii >= lo) & (jj - ii <= hi) & (ii < sq - 1)  # the last row sees no key
    m = torch.full((b, h, sq), -math.inf, dtype=torch.float64)
    l = torch.zeros((b, h, sq), dtype=torch.float64)
    acc = torch.zeros((b, h, sq, d), dtype=torch.float64)
    for n0 in range(0, sk, block_n):  # the kernel's online softmax, base 2
        st = torch.where(keep[:, n0:n0 + block_n], s[..., n0:n0 + block_n], -math.inf)
        m_new = torch.maximum(m, st.max(-1).values * qk_scale)
        m_sub = torch.where(m_new == -math.inf, 0.0, m_new)
        p = torch.exp2(st * qk_scale - m_sub[..., None])
        alpha = torch.exp2(m - m_sub)
        l = l * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + p @ v[..., n0:n0 + block_n, :]
        m = m_new
    fold = _sinks_fold(render(GluonFwdVariant(GluonFwdSpec("bfloat16", 128, 128, "window", sinks=True),
                                              GluonFwdConfig())))
    outs = [fold(m[0, hh], l[0, hh], acc[0, hh], sinks, hh) for hh in range(h)]
    o = torch.stack([x for x, _ in outs])[None]
    lse = torch.stack([y for _, y in outs])[None]
    ref_o, ref_lse = user_mods.reference(q, k, v, scale, lo, hi, mask_mod=lambda b_, h_, i, j: i < sq - 1,
                                         sinks=sinks)
    assert torch.allclose(o, ref_o, atol=1e-12) and torch.allclose(lse, ref_lse, atol=1e-12)
    assert torch.equal(o[:, :, -1], torch.zeros_like(o[:, :, -1])) and torch.allclose(lse[0, :, -1], sinks)


def test_the_key_tile_model_is_the_kernels_key_range():
    """config.key_tiles (the walk's balance model) is the template's ``_key_tiles`` run on
    Python ints, for every mask mode, both causal alignments, windows and ragged ends."""
    import types

    from flashgen.families.gluon.config import key_tiles
    from flashgen.masks import mask_bounds

    for mode, causal, window in (("none", False, (-1, -1)), ("causal", True, (-1, -1)), ("window", False, (100, 3)),
                                 ("window", True, (257, -1))):
        bmt, bn = 128, 64
        src = render(GluonFwdVariant(GluonFwdSpec("bfloat16", 128, 128, mode), GluonFwdConfig(num_consumers=2,
                                                                                               BLOCK_N=bn)))
        fn = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == "_key_tiles")
        fn.decorator_list = []
        ns = {"gl": types.SimpleNamespace(minimum=min, maximum=max, cdiv=lambda a, b: -(-a // b)),
              "BLOCK_MT": bmt, "BLOCK_N": bn}
        exec(compile(ast.Module(body=[fn], type_ignores=[]), "<key_tiles>", "exec"), ns)
        for sq, sk in ((512, 512), (1000, 3000), (3000, 1000), (1, 77)):
            for align in ("bottom_right", "top_left"):
                m, lo, hi = mask_bounds(sq, sk, causal=causal, window=window, align=align)
                assert m == mode
                for m0 in range(0, sq, bmt):
                    assert key_tiles(m0, bmt, bn, sq, sk, mode, lo, hi) == ns["_key_tiles"](m0, sq, sk, lo, hi)[1]


def test_the_walk_balance_model_counts_every_programs_tiles():
    """config.walk_balance (its run-length form) equals the largest over mean work of
    the programs that take the tiles of persistent_order round-robin, counted tile by
    tile, dealt in one direction or alternating (snake, config.dealt_tile: a
    permutation that reverses odd rounds only)."""
    import random

    from flashgen.families.gluon.config import dealt_tile, persistent_order, walk_balance

    rng = random.Random(0)
    for i in range(600):
        num_m, num_hz = rng.randint(1, 20), rng.randint(1, 80)
        section, programs = rng.randint(1, num_hz), rng.randint(1, 300)
        snake = bool(i % 2)
        work = tuple(rng.random() * 10 for _ in range(num_m))
        order = persistent_order(num_m, num_hz, section)
        n = min(programs, len(order))
        dealt = [dealt_tile(t, len(order), n, snake) for t in range(len(order))]
        assert sorted(dealt) == list(range(len(order)))
        assert all(d // n == t // n for t, d in enumerate(dealt)) and (snake or dealt == sorted(dealt))
        per = [0.0] * n
        for t, d in enumerate(dealt):
            per[t % n] += work[order[d][1]]
        want = max(per) / (sum(per) / n)
        assert walk_balance(work, num_hz, section, programs, snake) == pytest.approx(want, rel=1e-12)


def test_the_launcher_picks_the_best_balanced_section_under_the_l2_cap():
    """walk_section: at most the L2 cap, a multiple of the GQA group (or the cap), never
    worse balanced than the cap, and at 32x16x512 head_dim 128 causal with one-consumer
    tiles at two programs per SM (264 programs) and at 8x16x2048 with two-consumer
    tiles (132) it moves off the cap, whose largest program has 12.5% and 14% more work
    than the mean (the measured keys of ``docs/design.md``); with the balance off it is
    the cap."""
    from flashgen.families.gluon import config

    cases = [(32 * 16, 1, 512, 64, 64, 264), (8 * 16, 1, 2048, 128, 128, 132), (8 * 32, 4, 1024, 64, 64, 264),
             (4 * 16, 4, 2048, 128, 128, 132), (2 * 32, 1, 8192, 128, 128, 132), (1 * 32, 4, 1024, 128, 64, 132),
             (7 * 5, 5, 3000, 64, 128, 396)]
    for num_hz, group, n, bmt, bn, programs in cases:
        cap = config.section_planes(num_hz, group, n, 128, 128)
        sec = config.walk_section(num_hz, group, n, n, 128, 128, "causal", 0, 0, bmt, bn, programs)
        work = tuple(config.key_tiles(m * bmt, bmt, bn, n, n, "causal", 0, 0) + config.TILE_OVERHEAD
                     for m in range(-(-n // bmt)))
        assert 1 <= sec <= cap and (sec % group == 0 or sec == cap)
        assert config.walk_balance(work, num_hz, sec, programs) <= config.walk_balance(work, num_hz, cap, programs)
        if (num_hz, n) in ((512, 512), (128, 2048)):
            assert config.walk_balance(work, num_hz, cap, programs) > 1.12
            assert sec != cap and config.walk_balance(work, num_hz, sec, programs) < 1.03
        snake = config.walk_section(num_hz, group, n, n, 128, 128, "causal", 0, 0, bmt, bn, programs, True)
        assert 1 <= snake <= cap and (snake % group == 0 or snake == cap)
        assert config.walk_balance(work, num_hz, snake, programs, True) <= \
            config.walk_balance(work, num_hz, cap, programs, True)
        if (num_hz, n) in ((32, 1024), (64, 2048)):
            # few rounds, or one section of every plane: no section balances the one-way
            # deal (1.34 and 1.09), the alternating one does
            assert sec == cap and config.walk_balance(work, num_hz, cap, programs) > 1.08
            assert config.walk_balance(work, num_hz, snake, programs, True) < 1.035
    old = config.BALANCE_SECTIONS
    try:
        config.BALANCE_SECTIONS = False
        assert config.walk_section(512, 1, 512, 512, 128, 128, "causal", 0, 0, 64, 64, 264) == 128
    finally:
        config.BALANCE_SECTIONS = old


def test_the_persistent_walk_takes_every_tile_once_longest_first():
    """``persistent`` 2 with a mask: the kernel's tile order (its ``_tile_coords_lpt``,
    run here on Python ints) is :func:`.config.persistent_order`, a permutation of the
    (z * h, query block) tiles; within each section of planes the query blocks come
    last block first, every plane of the section before the next block; a section's K
    and V fit L2_SECTION_BYTES unless a single kv head does not."""
    import types

    from flashgen.families.gluon.config import L2_SECTION_BYTES, dealt_tile, persistent_order, section_planes

    src = render(GluonFwdVariant(GluonFwdSpec("bfloat16", 128, 128, "causal"), GluonFwdConfig(persistent=2)))
    fn = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == "_tile_coords_lpt")
    fn.decorator_list = []
    ns = {"gl": types.SimpleNamespace(minimum=min, maximum=max), "BLOCK_MT": 128}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "<lpt>", "exec"), ns)
    # the same walk dealt in alternating directions: the kernel's tile at loop index t is
    # persistent_order's at config.dealt_tile(t)
    snake = render(GluonFwdVariant(GluonFwdSpec("bfloat16", 128, 128, "causal"),
                                   GluonFwdConfig(persistent=2, snake=True)))
    fn = next(n for n in ast.parse(snake).body if isinstance(n, ast.FunctionDef) and n.name == "_tile_coords_lpt")
    fn.decorator_list = []
    programs = [132]
    sns = {"gl": types.SimpleNamespace(minimum=min, maximum=max, num_programs=lambda axis: programs[0]),
           "BLOCK_MT": 128}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "<lpt_snake>", "exec"), sns)
    for num_m, b, h, group, sk in ((4, 2, 16, 1, 512), (33, 2, 24, 1, 4097), (8, 3, 32, 4, 1000), (5, 1, 7, 7, 300000)):
        num_hz = b * h
        sec = section_planes(num_hz, group, sk, 128, 128)
        assert sec == num_hz or (sec // group) * sk * 256 * 2 <= L2_SECTION_BYTES or sec == group
        order = persistent_order(num_m, num_hz, sec)
        assert sorted(order) == [(hz, m) for hz in range(num_hz) for m in range(num_m)]
        for tile, (hz, m) in enumerate(order):
            z, hh, kvh, off_hz, m0 = ns["_tile_coords_lpt"](tile, num_m * num_hz, num_m, h, group, sec)
            assert (off_hz, m0, z * h + hh, kvh) == (hz, m * 128, hz, hh // group)
        for programs[0] in (132, 7, 1, len(order) + 5):
            n = min(programs[0], len(order))
            for tile in range(len(order)):
                hz, m = order[dealt_tile(tile, len(order), n, True)]
                z, hh, kvh, off_hz, m0 = sns["_tile_coords_lpt"](tile, num_m * num_hz, num_m, h, group, sec)
                assert (off_hz, m0, z * h + hh, kvh) == (hz, m * 128, hz, hh // group)
        for start in range(0, num_hz, sec):  # one section: blocks longest first
            blocks = [m for hz, m in order if start <= hz < start + sec]
            assert blocks == sorted(blocks, reverse=True)


def test_longest_first_is_one_program_per_tile_in_the_walks_order():
    """longest_first: persistent 0 under a causal or window mask only (not with sinks or
    user functions); the kernel takes the walk's section argument, the launcher the
    largest whole section of kv heads' planes within the L2 cap."""
    s = C.GluonFwdSpec("bfloat16", 128, 128, "causal")
    c = C.GluonFwdConfig(pin_exps=True, longest_first=True)
    v = C.GluonFwdVariant(s, c)
    assert C.check(v) == [] and v.id.endswith("_pin_lpt")
    for bad in (C.GluonFwdVariant(C.GluonFwdSpec("bfloat16", 128, 128, "none"), c),
                C.GluonFwdVariant(s, C.replace(c, persistent=3)),
                C.GluonFwdVariant(C.GluonFwdSpec("bfloat16", 128, 128, "causal", sinks=True), c)):
        assert any("longest_first" in r for r in C.check(bad))
    src = render(v)
    assert "section)" in src and "_tile_coords_lpt(tile" in src
    assert "_tile_coords_lpt" not in render(C.GluonFwdVariant(s, C.replace(c, longest_first=False)))
    assert set(C.refinement_space(s, "longest_first")) <= {x for x in C.space(s, longest_first=True)}
    assert all(x.persistent == 0 for x in C.refinement_space(s, "longest_first"))
    # 8 kv heads' K and V (8192 x 256 x 2 B each) fit 32 MB: 32 planes of group 4
    assert C.longest_first_section(256, 4, 8192, 128, 128) == 32
    assert C.longest_first_section(48, 4, 8192, 128, 128) == 24  # a whole number of sections
    assert C.longest_first_section(4, 4, 65536, 128, 128) == 4  # at least one kv head's group
    assert C.longest_first_section(32, 1, 16384, 128, 128) == 4


def test_masked_first_is_a_mode_of_the_masked_tiles():
    """masked_first: a causal or window mask only, not with sinks, user functions or
    cross_tile; outside the search, refined around tuned rows."""
    s = C.GluonFwdSpec("bfloat16", 128, 128, "causal")
    c = C.GluonFwdConfig(pin_exps=True, persistent=3, masked_first=True)
    v = C.GluonFwdVariant(s, c)
    assert C.check(v) == [] and v.id.endswith("_pin_pers3_mf")
    for bad in (C.GluonFwdVariant(C.GluonFwdSpec("bfloat16", 128, 128, "none"), c),
                C.GluonFwdVariant(s, C.replace(c, cross_tile=True)),
                C.GluonFwdVariant(C.GluonFwdSpec("bfloat16", 128, 128, "causal", sinks=True), C.replace(c, persistent=2))):
        assert any("masked_first" in r for r in C.check(bad))
    assert "r_run" in render(v) and "r_run" not in render(C.GluonFwdVariant(s, C.replace(c, masked_first=False)))
    assert "masked_first" in C.REFINE_KNOBS and all(x.masked_first for x in C.refinement_space(s, "masked_first"))
    assert not any(x.masked_first for x in C.space(s))


def test_skip_masked_is_a_mode_of_masked_first_with_several_consumers():
    """skip_masked: with masked_first and two or three consumers only; outside the
    search, refined around tuned rows (its refinement variants all in masked_first's
    order)."""
    s = C.GluonFwdSpec("bfloat16", 128, 128, "causal")
    c = C.GluonFwdConfig(BLOCK_N=64, persistent=2, masked_first=True, skip_masked=True)
    v = C.GluonFwdVariant(s, c)
    assert C.check(v) == [] and v.id.endswith("_n64_s2_r240-24_pers2_mf_skip")
    for bad in (C.replace(c, masked_first=False),
                C.replace(c, num_consumers=1, consumer_regs=232, ctas_per_sm=2)):
        assert any("skip_masked" in r for r in C.check(C.GluonFwdVariant(s, bad)))
    assert "r_skip" in render(v) and "r_skip" not in render(C.GluonFwdVariant(s, C.replace(c, skip_masked=False)))
    twins = C.refinement_space(s, "skip_masked")
    assert twins and all(x.skip_masked and x.masked_first and x.num_consumers > 1 for x in twins)
    assert not any(x.skip_masked for x in C.space(s))


def _key_schedule(src: str):
    """The key tiles a consumer of the rendered forward ``src`` visits, as the kernel's
    own statements compute them (run on Python ints): a function (m0, C, seqlen_q,
    seqlen_k, diag_lo, diag_hi) -> [(start_n, masked)] in visiting order, and the
    producer's load order (m0, ...) -> [start_n]."""
    import types

    body = ast.parse(src).body
    fns = {n.name: n for n in body if isinstance(n, ast.FunctionDef)}
    ns = {"gl": types.SimpleNamespace(minimum=min, maximum=max, cdiv=lambda a, b: -(-a // b))}
    for name in ("BLOCK_M", "BLOCK_N", "BLOCK_MT"):  # gl.constexpr(...) module constants
        node = next(n for n in body if isinstance(n, ast.Assign) and n.targets[0].id == name)
        ns[name] = ast.literal_eval(node.value.args[0])
    key_tiles = fns["_key_tiles"]
    key_tiles.decorator_list = []
    exec(compile(ast.Module(body=[key_tiles], type_ignores=[]), "<key_tiles>", "exec"), ns)
    wanted = {"n_start", "n_tiles", "r0", "n_full_hi", "n_full_lo", "t_lo", "t_hi", "r_run", "r_low", "n_last",
              "n_own", "n_run", "r_skip"}
    code = lambda node: compile(ast.Expression(node), "<expr>", "eval")  # noqa: E731
    # The consumer's tile loop, compiled once: ("set", stmt) / ("first", test, start_n,
    # masked) / ("loop", target, range args, start_n or None, masked).
    plan = []
    for st in next(n for n in fns["_consumer"].body if isinstance(n, ast.For)).body:
        if isinstance(st, ast.Assign):
            if {t.id for t in ast.walk(st.targets[0]) if isinstance(t, ast.Name)} <= wanted:
                plan.append(("set", compile(ast.Module(body=[st], type_ignores=[]), "<stmt>", "exec")))
        elif isinstance(st, ast.If) and ast.unparse(st.test) in ("n_tiles > 0", "n_run > 0"):
            first = next((c for c in ast.walk(st) if isinstance(c, ast.Call) and ast.unparse(c.func) == "_softmax"),
                         None)
            if first is not None:  # the tile's first key tile, its scores alone
                plan.append(("first", code(st.test), code(first.args[4]), first.args[-1].value))
        elif isinstance(st, ast.For):
            step = next((c for c in ast.walk(st) if isinstance(c, ast.Call) and ast.unparse(c.func) == "_step"), None)
            # (a loop without a step releases its ring slots unread: skip_masked)
            plan.append(("loop", st.target.id, [code(a) for a in st.iter.args],
                         None if step is None else code(step.args[14]), "skip" if step is None else step.args[-1].value))

    def consumer(m0, C, seqlen_q, seqlen_k, diag_lo, diag_hi):
        env = dict(m0=m0, C=C, seqlen_q=seqlen_q, seqlen_k=seqlen_k, diag_lo=diag_lo, diag_hi=diag_hi)
        out = []
        for op in plan:
            if op[0] == "set":
                exec(op[1], ns, env)
            elif op[0] == "first":
                if eval(op[1], ns, env):
                    out.append((eval(op[2], ns, env), op[3]))
            else:
                _, target, args, start, masked = op
                for i in range(*(eval(a, ns, env) for a in args)):
                    env[target] = i
                    out.append((None if start is None else eval(start, ns, env), masked))
        return out

    loop = next(n for n in ast.walk(fns["_producer"]) if isinstance(n, ast.For) and n.target.id == "j")
    load_start = code(next(n for n in loop.body if isinstance(n, ast.Assign) and n.targets[0].id == "start_n").value)

    def producer(m0, seqlen_q, seqlen_k, diag_lo, diag_hi):
        env = dict(m0=m0, seqlen_q=seqlen_q, seqlen_k=seqlen_k, diag_lo=diag_lo, diag_hi=diag_hi)
        env["n_start"], env["n_tiles"] = ns["_key_tiles"](m0, seqlen_q, seqlen_k, diag_lo, diag_hi)
        return [eval(load_start, ns, {**env, "j": j}) for j in range(env["n_tiles"])]

    return consumer, producer


@pytest.mark.parametrize("masked_first, skip", [(False, False), (True, False), (True, True)])
def test_each_consumer_visits_every_key_tile_once_and_masks_the_tiles_that_cross(masked_first, skip):
    """The forward's key schedule, run from the rendered kernel's own statements: each
    consumer visits the program's key tiles in the producer's load order, each once, and
    every tile it runs unmasked lies inside the mask and seqlen_k for all its rows;
    ``masked_first`` visits them last to first, so under an aligned causal mask a
    consumer's masked tiles (its diagonal's, and any past it) all come first; with
    ``skip_masked`` a consumer releases unread exactly the tiles that hold none of its
    rows' keys, first (none with one consumer; with two at BLOCK_N 64 under an aligned
    causal mask, one for the first consumer of every 128-row tile)."""
    from flashgen.masks import mask_bounds

    for mode, causal, window in (("causal", True, (-1, -1)), ("window", False, (100, 3)), ("window", True, (257, -1)),
                                 ("window", False, (0, 0))):
        for nc, bn in ((1, 64), (2, 64), (2, 128), (3, 128)):
            cfg = GluonFwdConfig(num_consumers=nc, BLOCK_N=bn, consumer_regs=160 if nc == 3 else 240,
                                 producer_regs=32 if nc == 3 else 24, serial_masked=True, masked_first=masked_first,
                                 skip_masked=skip and nc > 1)
            v = GluonFwdVariant(GluonFwdSpec("bfloat16", 64, 64, mode), cfg)
            assert C.check(v) == []
            consumer, producer = _key_schedule(render(v))
            skipped = 0
            for sq, sk in ((512, 512), (1000, 3000), (3000, 1000), (1, 77), (129, 129)):
                for align in ("bottom_right", "top_left"):
                    m, lo, hi = mask_bounds(sq, sk, causal=causal, window=window, align=align)
                    if m != mode:
                        continue
                    for m0 in range(0, sq, 64 * nc):
                        loads = producer(m0, sq, sk, lo, hi)
                        assert loads == sorted(loads, reverse=masked_first) and len(set(loads)) == len(loads)
                        for c in range(nc):
                            visits = consumer(m0, c, sq, sk, lo, hi)
                            rows = range(m0 + 64 * c, min(m0 + 64 * c + 64, sq))
                            # The keys its rows see: [seen_lo, seen_hi] (empty when seen_lo > seen_hi).
                            seen_lo, seen_hi = (max(0, rows[0] + lo), min(sk - 1, rows[-1] + hi)) if rows else (0, -1)
                            n_skip = sum(mk == "skip" for _, mk in visits)
                            assert all(mk == "skip" for _, mk in visits[:n_skip]), visits  # first
                            assert not any(s <= seen_hi and s + bn > seen_lo for s in loads[:n_skip])  # unseen
                            if skip and nc > 1 and rows:  # and every tile wholly past its last row's keys
                                assert n_skip == sum(s > rows[-1] + hi for s in loads), (loads, rows, hi)
                            elif not skip:
                                assert n_skip == 0
                            skipped += n_skip if sq == sk else 0
                            visits = list(zip(loads[:n_skip], ["skip"] * n_skip)) + visits[n_skip:]
                            assert [s for s, _ in visits] == loads, (mode, nc, bn, sq, sk, align, m0, c)
                            for s, masked in visits:
                                if masked is False and rows:  # (rows past seqlen_q are clipped on the store)
                                    assert s + bn <= sk and all(lo <= j - i <= hi for i in (rows[0], rows[-1])
                                                                for j in (s, s + bn - 1)), (s, rows, lo, hi)
                            assert all(s2 - s1 == bn for s1, s2 in zip(sorted(loads), sorted(loads)[1:]))
                            assert seen_lo > seen_hi or all(any(s <= j < s + bn for s in loads)
                                                            for j in (seen_lo, seen_hi))
                            if masked_first and mode == "causal" and sq == sk and align == "bottom_right" and rows:
                                flags = [mk is not False for _, mk in visits]  # the masked tiles first, then none
                                assert flags == sorted(flags, reverse=True), visits
            if mode == "causal":  # square: where a consumer's rows stop a whole tile before the program's
                assert (skipped > 0) == (skip and bn <= 64 * (nc - 1)), (nc, bn, skipped)


def test_an_edited_package_template_warns_once_before_its_code_id_is_recomputed(monkeypatch):
    """A package template that no longer matches its code-id record costs a render of every
    probe variant (about a minute) in each process: the warning names that cost and the
    command that records the edit.  An edited copy in another directory (the tests' own
    edits) computes silently."""
    import warnings

    from flashgen.families.gluon import render as R
    from flashgen.families.gluon.code_id import CodeId

    cid = CodeId("gluon/attn_fwd.py.j2", R.CODE_ID_RECORD, lambda d: iter(()), {})
    monkeypatch.setattr(CodeId, "text_hash", lambda self, directory=None: "edited")
    with pytest.warns(UserWarning, match="python3 -m flashgen.families.gluon"):
        cid.code_id()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cid.code_id(str(R.gluon_templates_dir().parent))


_MC_SCRIPT = r'''
import json, re, sys
sys.path.insert(0, "benchmarks")
import probe_multicast_fwd as P
from flashgen.families.gluon.sm90 import report
for d, causal, stages, ctas in CASES:
    mod, off = P.build(d, causal, True, stages, ctas)
    rep = report(P.compile_sm90(mod, d))
    tw, _ = P.build(d, causal, False, stages, ctas)
    trep = report(P.compile_sm90(tw, d))
    src = open(mod.__file__).read()
    print("OK " + json.dumps(dict(d=d, causal=causal, off=off, spill=rep.spill_bytes, shared=rep.shared_bytes,
                                  twin_shared=trep.shared_bytes, hgmma=rep.hgmma, twin_hgmma=trep.hgmma,
                                  multicast=len(re.findall(r"UTMALDG[^;]*MULTICAST", rep.sass)),
                                  twin_multicast=len(re.findall(r"UTMALDG[^;]*MULTICAST", trep.sass)),
                                  cluster_bars=rep.sass.count("UCGABAR_ARV"), src=src)))
'''


def test_multicast_probe_compiles_for_sm90_with_the_allocators_offsets(tmp_path):
    """benchmarks/probe_multicast_fwd.py: the multicast kernel, rendered with the shared
    memory offsets its first compile's allocator gave (global_smem + offset in its inline
    PTX), compiles for sm_90 with each K and V copy a multicast per 64-column box, the
    twin's shared memory and wgmmas, no spills, and a cluster barrier in each partition
    at its start and end; its twin has no multicast."""
    from sm90 import json_rows

    os.environ["FLASHGEN_PROBE_MC_DIR"] = str(tmp_path)
    try:
        rows = json_rows(_MC_SCRIPT, [(128, True, 2, 2)])
    finally:
        del os.environ["FLASHGEN_PROBE_MC_DIR"]
    for row in rows:
        # two multicast copies (K by one program, V by the other) of d / 64 boxes each
        assert row["multicast"] == 2 * row["d"] // 64 and row["twin_multicast"] == 0, row
        assert row["spill"] == 0 and row["hgmma"] == row["twin_hgmma"] > 0, row
        assert row["shared"] == row["twin_shared"], row
        assert row["cluster_bars"] == 4, row
        off = row["off"]
        assert f"K_READY_OFF = gl.constexpr({off['k_ready']})" in row["src"], row["off"]
        assert f"V_OFF = gl.constexpr({off['v_smem']})" in row["src"]
        assert re.search(r"mov\.b64 d, attn_fwd_param_\d+;", row["src"])

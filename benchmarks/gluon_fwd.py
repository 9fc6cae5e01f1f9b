"""The Gluon forward (flashgen/families/gluon) on the H200: build, check against float64,
time against its peers.

Every variant first runs in a child process under a timeout (a warp-specialized kernel
that deadlocks on an mbarrier kills the child, not the run), on awkward inputs per mask
mode: seqlens 1, 17, 1000, 4097 and seqlen_q != seqlen_k both ways, GQA and MQA,
bottom-right and top-left causal, windows, q/k/v read from slices of NaN-filled buffers
and O written into a slice of a sentinel-filled buffer (every O and LSE element
NaN-poisoned first; nothing outside the slice may change).  A case passes when
max |out - float64 reference| <= 2 x the error of torch at the input dtype + a floor
(flashgen.bench.compare) and rows that see no key give exactly O = 0, LSE = -inf.

The passing variants are then timed (triton.testing.do_bench, median) against SDPA
cuDNN, SDPA flash and flashgen's current path (flashgen.attention: the dispatcher and
tuning_db/h200.sqlite) on the FA-grid shapes of issue 15 and the Llama-3-8B layer
(1 x 32/8 heads x 4096 x 128, causal).  Writes gluon_fwd.json under --out; prints the
table last: TFLOP/s (4 * b * h * sq * sk * d, halved for causal) and the ratio to SDPA
cuDNN, with the geometric mean over the shapes.

    PYTHONUNBUFFERED=1 python3 benchmarks/gluon_fwd.py --out $OUT [--set quick|full] [--workers 8]
    python3 benchmarks/gluon_fwd.py --list [--set full]     # the variants, no GPU needed

``--set x3c`` holds variants outside the rules (:data:`RULES_OFF`: three consumers at
BLOCK_N 128 with the causal mask, which the register model rejects): they are built and
checked with the rules off, in this process and its children only, to measure what the
rule costs.  ``--set sermask`` times the masked tiles without the intra-warpgroup overlap
(``serial_masked``), which admits that tile within the rules.  ``--set m128`` times
consumers of 128 query rows (BLOCK_M 128) on the head_dim 64 grid shapes, ``--set n32``
the same over key tiles of 32 at head_dim 128.  ``--set xtile``
times the walks of 3 beside their ``cross_tile`` twins (a tile's last P V product kept in
flight into the next tile) on the short grid keys and the Llama batch-1 keys.  ``--set oq``
times the walk of 3 with O staged in the Q buffers (``o_in_q``), which fits the
one-consumer head_dim 128 tile two to an SM, beside the shipped short head_dim 128 tiles.
``--set mf`` times the shipped causal tiles with their key tiles last to first
(``masked_first``) beside the same tiles in key order, and prints each pair's ratio.
``--set skip`` times two- and three-consumer tiles in that order with each consumer
releasing unread the key tiles past its rows (``skip_masked``) beside their
``masked_first`` twins and the shipped one-consumer tiles, on the short causal keys.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flashgen.families.gluon.config import (  # noqa: E402
    GluonFwdConfig, GluonFwdSpec, GluonFwdVariant, check, default_regs,
)

#: (batch, num_heads, num_kv_heads, seqlen, head_dim, causal)
SHAPES = [
    (4, 16, 16, 4096, 128, False), (4, 16, 16, 4096, 128, True),
    (1, 16, 16, 16384, 128, False), (1, 16, 16, 16384, 128, True),
    (8, 32, 32, 2048, 64, False), (8, 32, 32, 2048, 64, True),
    (4, 32, 32, 4096, 64, False), (4, 32, 32, 4096, 64, True),
    (1, 32, 8, 4096, 128, True),  # Llama-3-8B layer
]


#: The set "sched" times the persistent walk (persistent 2) where one program per tile
#: loses most: the FA-grid shapes up to seqlen 2048-4096 and the Llama training step's
#: layer (4 x 16/4 heads x 2048, head_dim 128, causal).
SCHED_SHAPES = [
    (32, 16, 16, 512, 128, True), (16, 16, 16, 1024, 128, True), (8, 16, 16, 2048, 128, True),
    (4, 16, 16, 4096, 128, True), (4, 16, 4, 2048, 128, True),
    (32, 16, 16, 512, 128, False), (16, 16, 16, 1024, 128, False), (8, 16, 16, 2048, 128, False),
    (32, 32, 32, 512, 64, True), (16, 32, 32, 1024, 64, True), (8, 32, 32, 2048, 64, True),
    (4, 32, 32, 4096, 64, True), (32, 32, 32, 512, 64, False), (16, 32, 32, 1024, 64, False),
]


#: The set "short" times one-consumer and two-programs-per-SM tiles of the persistent walk
#: on the short causal grid shapes, where the Triton family's rows still serve.
SHORT_SHAPES = [(32, 16, 16, 512, 128, True), (16, 16, 16, 1024, 128, True), (8, 16, 16, 2048, 128, True),
                (32, 32, 32, 512, 64, True), (16, 32, 32, 1024, 64, True), (8, 32, 32, 2048, 64, True)]


#: The set "x3" times three one-consumer programs per SM (ctas_per_sm 3, head_dim 64,
#: BLOCK_N 64) beside the two-program tiles the shipped rows take, on the head_dim 64 grid
#: shapes up to seqlen 4096 (causal) and 1024 (no mask).
X3_SHAPES = [(32, 32, 32, 512, 64, True), (16, 32, 32, 1024, 64, True), (8, 32, 32, 2048, 64, True),
             (4, 32, 32, 4096, 64, True), (32, 32, 32, 512, 64, False), (16, 32, 32, 1024, 64, False)]


#: The set "snake" times the persistent causal walk dealt in alternating directions
#: (``snake``) beside the same tiles dealt one way, on the keys whose one-way deal the
#: section size cannot balance (few rounds: Llama batch 1-2; one section of every plane:
#: the training step's layer 4 x 16/4 x 2048) and on short grid keys.
#: The grid's head_dim 64 causal shapes (the probe of three consumers with the mask).
X3C_SHAPES = [(32, 32, 32, 512, 64, True), (16, 32, 32, 1024, 64, True), (8, 32, 32, 2048, 64, True),
              (4, 32, 32, 4096, 64, True), (2, 32, 32, 8192, 64, True), (1, 32, 32, 16384, 64, True)]
#: The set "sermask" times the masked tiles run without the intra-warpgroup overlap
#: (``serial_masked``): FlashAttention-3's head_dim 64 causal tile (three consumers, BLOCK_N
#: 128), which that leaves without spills, and the shipped causal rows' tiles with it, on
#: the grid's causal shapes, the Llama batch-1 keys and the training step's layer.
SERMASK_SHAPES = X3C_SHAPES + [
    (32, 16, 16, 512, 128, True), (16, 16, 16, 1024, 128, True), (8, 16, 16, 2048, 128, True),
    (4, 16, 16, 4096, 128, True), (1, 16, 16, 16384, 128, True), (1, 32, 8, 1024, 128, True),
    (1, 32, 8, 2048, 128, True), (1, 32, 8, 4096, 128, True), (4, 16, 4, 2048, 128, True)]
#: The set "m128" times consumers of 128 query rows (BLOCK_M 128: two m64 row blocks per
#: wgmma, each K/V tile loaded once per 128 rows of a consumer) beside the shipped head_dim
#: 64 tiles, on the grid's twelve head_dim 64 shapes.
M128_SHAPES = [(32 // (n // 512), 32, 32, n, 64, causal) for causal in (True, False)
               for n in (512, 1024, 2048, 4096, 8192, 16384)]
#: The set "xtile" times the walks of 3 that the shipped rows use beside their cross_tile
#: twins, on the grid shapes up to seqlen 4096 both masks and the Llama batch-1 and
#: training-layer keys.
XTILE_SHAPES = [(16384 // n, 32 // (d // 64), 32 // (d // 64), n, d, causal) for d in (64, 128)
                for causal in (True, False) for n in (512, 1024, 2048, 4096)] + [
    (1, 32, 8, 1024, 128, True), (1, 32, 8, 2048, 128, True), (4, 16, 4, 2048, 128, True)]
#: The set "lpt" times the causal tiles the shipped rows run one program per tile
#: (seqlen 1024 at head_dim 64, 8192-16384) in grid order and longest first across
#: sections (longest_first).
LPT_SHAPES = [(16, 32, 32, 1024, 64, True), (1, 32, 32, 16384, 64, True), (2, 16, 16, 8192, 128, True),
              (1, 16, 16, 16384, 128, True), (1, 32, 8, 8192, 128, True), (2, 32, 8, 8192, 128, True),
              (4, 32, 8, 8192, 128, True), (8, 32, 8, 8192, 128, True)]
#: The set "oq" times the walk of 3 with O staged in its Q buffers (o_in_q) on the head_dim
#: 128 keys whose shipped rows are one-consumer tiles at two programs per SM, and the
#: head_dim 64 causal keys of the three-per-SM walk.
OQ_SHAPES = [(32, 16, 16, 512, 128, True), (16, 16, 16, 1024, 128, True), (8, 16, 16, 2048, 128, True),
             (32, 16, 16, 512, 128, False), (16, 16, 16, 1024, 128, False), (1, 32, 8, 1024, 128, True),
             (2, 32, 8, 1024, 128, True), (4, 32, 8, 1024, 128, True), (8, 32, 8, 1024, 128, True),
             (1, 32, 8, 2048, 128, True), (32, 32, 32, 512, 64, True), (16, 32, 32, 1024, 64, True)]
#: The set "mf" times the shipped causal tiles in key order and last to first
#: (masked_first) on the grid's causal shapes and the Llama-3-8B keys.
MF_SHAPES = [(16384 // n, 32 // (d // 64), 32 // (d // 64), n, d, True) for d in (128, 64)
             for n in (512, 1024, 2048, 4096, 8192, 16384)] + [
    (1, 32, 8, 1024, 128, True), (1, 32, 8, 2048, 128, True), (4, 32, 8, 1024, 128, True), (4, 16, 4, 2048, 128, True)]
#: The set "skip": the causal keys up to seqlen 2048 (grid and Llama-3-8B), where a
#: consumer's skipped tiles are the largest share of its work.
SKIP_SHAPES = [(16384 // n, 32 // (d // 64), 32 // (d // 64), n, d, True) for d in (128, 64) for n in (512, 1024, 2048)] + [
    (1, 32, 8, 1024, 128, True), (1, 32, 8, 2048, 128, True), (4, 32, 8, 1024, 128, True), (4, 16, 4, 2048, 128, True)]
#: The set "deep": the short causal keys, where the consumers of the shipped tiles wait
#: on K/V tiles that their two-stage rings have not yet received.
DEEP_SHAPES = [(32, 16, 16, 512, 128, True), (16, 16, 16, 1024, 128, True), (8, 16, 16, 2048, 128, True),
               (4, 32, 8, 1024, 128, True), (32, 32, 32, 512, 64, True), (16, 32, 32, 1024, 64, True)]
#: The set "n32": consumers of 128 query rows over key tiles of 32 at head_dim 128
#: (BLOCK_M 128, BLOCK_N 32: the score and P registers of the one-consumer BLOCK_N 64
#: tile, O's doubled; each K/V tile serves 128 rows of a warpgroup, half the K/V bytes per
#: FLOP of the 64-row tiles at two programs per SM) on the head_dim 128 grid shapes and
#: the Llama-3-8B causal keys.
N32_SHAPES = [(16384 // n, 16, 16, n, 128, causal) for causal in (True, False) for n in (512, 1024, 2048, 4096, 16384)] + [
    (1, 32, 8, 4096, 128, True), (4, 16, 4, 2048, 128, True), (4, 32, 8, 1024, 128, True)]
RING3_SHAPES = [(32, 16, 16, 512, 128, True), (16, 16, 16, 1024, 128, True), (8, 16, 16, 2048, 128, True),
                (32, 16, 16, 512, 128, False), (4, 32, 8, 1024, 128, True)]
SNAKE_SHAPES = [(1, 32, 8, 1024, 128, True), (1, 32, 8, 2048, 128, True), (2, 32, 8, 1024, 128, True),
                (1, 32, 8, 4096, 128, True), (4, 16, 4, 2048, 128, True), (4, 32, 8, 1024, 128, True),
                (32, 16, 16, 512, 128, True), (8, 16, 16, 2048, 128, True), (32, 32, 32, 512, 64, True),
                (16, 32, 32, 1024, 64, True)]


def _cfg(nc=2, bn=128, stages=2, pin=False, pers=False, ctas=1, regs=None, snake=False, serial=False, bm=64,
         xtile=False, oq=False, lpt=False, mf=False, skip=False):
    cr, pr = regs or default_regs(nc, ctas)
    return GluonFwdConfig(BLOCK_M=bm, num_consumers=nc, BLOCK_N=bn, num_stages=stages, consumer_regs=cr,
                          producer_regs=pr, pin_exps=pin, persistent=pers, ctas_per_sm=ctas, snake=snake,
                          serial_masked=serial, cross_tile=xtile, o_in_q=oq, longest_first=lpt,
                          masked_first=mf, skip_masked=skip)


def _cfg_with(c: GluonFwdConfig, mf: bool, skip: bool) -> GluonFwdConfig:
    return dataclasses.replace(c, masked_first=mf, skip_masked=skip)


def variant_set(name: str) -> list[GluonFwdVariant]:
    """The variants to build: per head dim, the configs to time (masks none and causal,
    bf16) and, for correctness only, window / fp16 / other head dims."""
    timed = {
        128: [_cfg(), _cfg(pin=True), _cfg(pers=True), _cfg(bn=64, stages=4), _cfg(nc=1, stages=3)],
        64: [_cfg(stages=4), _cfg(stages=4, pin=True), _cfg(stages=4, pers=True), _cfg(nc=3, stages=4),
             _cfg(nc=3, bn=64, stages=6)],
    }
    if name == "sched":
        timed = {
            128: [_cfg(pin=True), _cfg(pin=True, pers=2), _cfg(), _cfg(pers=2)],
            64: [_cfg(stages=4), _cfg(stages=4, pers=2), _cfg(nc=3, stages=4), _cfg(nc=3, stages=4, pers=1),
                 _cfg(nc=3, stages=4, pers=2)],
        }
        out = []
        for d, cfgs in timed.items():
            for mask in ("none", "causal", "window"):
                out += [GluonFwdVariant(GluonFwdSpec("bfloat16", d, d, mask), c) for c in cfgs]
            out.append(GluonFwdVariant(GluonFwdSpec("float16", d, d, "causal"), cfgs[1]))
        return [v for v in out if not check(v)]
    if name == "short":
        timed = {
            128: [_cfg(pers=2), _cfg(nc=1, bn=64, ctas=2, pers=2), _cfg(nc=1, bn=64, ctas=2), _cfg(nc=1, pers=2),
                  _cfg(nc=1, stages=3, pers=2), _cfg(bn=64, stages=4, pers=2)],
            64: [_cfg(stages=4, pers=2), _cfg(nc=1, stages=3, ctas=2, pers=2), _cfg(nc=1, bn=64, stages=4, ctas=2, pers=2),
                 _cfg(nc=1, stages=3, ctas=2), _cfg(nc=1, stages=4, pers=2), _cfg(bn=64, stages=6, pers=2)],
        }
        out = [GluonFwdVariant(GluonFwdSpec("bfloat16", d, d, "causal"), c) for d, cfgs in timed.items() for c in cfgs]
        return [v for v in out if not check(v)]
    if name == "snake":
        # the shipped rows' tiles of the masked walks, each dealt one way and alternating
        base = {128: [_cfg(pers=2), _cfg(pers=3), _cfg(bn=64, pers=2), _cfg(nc=1, bn=64, ctas=2, pers=2)],
                64: [_cfg(nc=1, bn=64, stages=3, ctas=3, pers=3), _cfg(pers=3)]}
        out = [GluonFwdVariant(GluonFwdSpec("bfloat16", d, d, "causal"), dataclasses.replace(c, snake=sn))
               for d, cfgs in base.items() for c in cfgs for sn in (False, True)]
        out += [GluonFwdVariant(GluonFwdSpec(dt, d, d, mask), dataclasses.replace(cfgs[-1], snake=True))
                for d, cfgs in base.items() for dt, mask in (("bfloat16", "window"), ("float16", "causal"))]
        return [v for v in out if not check(v)]
    if name == "x3c":
        # outside the rules: three consumers at BLOCK_N 128 with the causal mask, which the
        # register model rejects (about 168 needed, 160 given) and ptxas spills; timed
        # beside the shipped head_dim 64 causal tiles to see what the spills cost
        probe = [_cfg(nc=3, stages=4), _cfg(nc=3, stages=2, pers=2),
                 _cfg(nc=3, stages=3, pers=3), _cfg(nc=3, stages=3, pers=3, snake=True)]
        ref = [_cfg(nc=1, bn=64, stages=3, ctas=3, pers=3), _cfg(stages=3, pers=3), _cfg(nc=2, stages=4),
               _cfg(nc=3, bn=64, stages=6)]
        out = [GluonFwdVariant(GluonFwdSpec("bfloat16", 64, 64, "causal"), c) for c in probe]
        out += [GluonFwdVariant(GluonFwdSpec("bfloat16", 64, 64, "window"), probe[0]),
                GluonFwdVariant(GluonFwdSpec("float16", 64, 64, "causal"), probe[2])]
        return out + [GluonFwdVariant(GluonFwdSpec("bfloat16", 64, 64, "causal"), c) for c in ref
                      if not check(GluonFwdVariant(GluonFwdSpec("bfloat16", 64, 64, "causal"), c))]
    if name == "sermask":
        # each shipped causal tile and its serial twin; the three-consumer head_dim 64 tile
        # of BLOCK_N 128, which the rule admits only serial
        base = {64: [_cfg(nc=1, bn=64, stages=3, ctas=3, pers=3), _cfg(nc=1, bn=64, stages=3, ctas=3, pers=3, snake=True),
                     _cfg(stages=2, pers=3), _cfg(stages=4)],
                128: [_cfg(nc=1, bn=64, ctas=2, pers=2), _cfg(bn=64, pers=2, snake=True),
                      _cfg(pin=True, pers=3), _cfg(pin=True, pers=3, snake=True), _cfg(pers=2, snake=True),
                      _cfg(pin=True), _cfg(stages=3)]}
        x3 = [_cfg(nc=3, stages=s, pers=p, serial=True) for s, p in ((2, 0), (3, 0), (4, 0), (2, 2), (3, 3))]
        x3 += [_cfg(nc=3, stages=3, pers=3, snake=True, serial=True), _cfg(nc=3, stages=2, pers=3, serial=True)]
        out = [GluonFwdVariant(GluonFwdSpec("bfloat16", d, d, "causal"), dataclasses.replace(c, serial_masked=sm))
               for d, cfgs in base.items() for c in cfgs for sm in (False, True)]
        out += [GluonFwdVariant(GluonFwdSpec("bfloat16", 64, 64, "causal"), c) for c in x3]
        out += [GluonFwdVariant(GluonFwdSpec(dt, 64, 64, mask), c) for c in (x3[0], x3[4])
                for dt, mask in (("bfloat16", "window"), ("float16", "causal"))]
        out += [GluonFwdVariant(GluonFwdSpec("bfloat16", 128, 128, "window"), dataclasses.replace(base[128][2],
                                                                                                  serial_masked=True))]
        return [v for v in out if not check(v)]
    if name == "oq":
        one = dict(nc=1, bn=64, ctas=2)
        base = {(128, "causal"): [_cfg(pers=2, serial=True, **one), _cfg(**one), _cfg(pers=2, **one),
                                  _cfg(pers=3, oq=True, **one), _cfg(pers=3, oq=True, serial=True, **one),
                                  _cfg(pers=3, oq=True, snake=True, **one), _cfg(pers=3, stages=3, oq=True, **one)],
                (128, "none"): [_cfg(pers=3), _cfg(pers=2, **one), _cfg(pers=3, oq=True, **one),
                                _cfg(pers=3, oq=True), _cfg(pers=3, pin=True, oq=True)],
                (64, "causal"): [_cfg(nc=1, bn=64, stages=3, ctas=3, pers=3),
                                 _cfg(nc=1, bn=64, stages=3, ctas=3, pers=3, oq=True),
                                 _cfg(nc=1, bn=64, stages=4, ctas=3, pers=3, oq=True)]}
        out = [GluonFwdVariant(GluonFwdSpec("bfloat16", d, d, mask), c) for (d, mask), cfgs in base.items() for c in cfgs]
        out += [GluonFwdVariant(GluonFwdSpec(dt, d, d, mask), base[(d, "causal")][i]) for d, i in ((128, 3), (64, 1))
                for dt, mask in (("bfloat16", "window"), ("float16", "causal"))]
        return [v for v in out if not check(v)]
    if name == "lpt":
        # the shipped rows' one-program-per-tile causal tiles, each in grid order (a plane's
        # query blocks after the previous plane's) and longest first across sections
        # (longest_first)
        base = {128: [_cfg(pin=True), _cfg(pin=True, stages=3), _cfg(stages=3)],
                64: [_cfg(nc=1, bn=64, stages=3, ctas=3), _cfg(nc=3, bn=128, stages=4, regs=(160, 32), serial=True)]}
        out = [GluonFwdVariant(GluonFwdSpec("bfloat16", d, d, "causal"), dataclasses.replace(c, longest_first=lpt))
               for d, cfgs in base.items() for c in cfgs for lpt in (False, True)]
        out += [GluonFwdVariant(GluonFwdSpec(dt, d, d, mask), dataclasses.replace(base[d][0], longest_first=True))
                for d in (128, 64) for dt, mask in (("bfloat16", "window"), ("float16", "causal"))]
        return [v for v in out if not check(v)]
    if name == "mf":
        # the shipped rows' causal Gluon tiles, each in key order and last to first
        # (masked_first)
        one = dict(nc=1, bn=64, ctas=2)
        three = dict(nc=1, bn=64, stages=3, ctas=3)
        base = {128: [_cfg(pers=3, oq=True, **one), _cfg(pers=3, oq=True, serial=True, **one), _cfg(pers=2, **one),
                      _cfg(pers=2, snake=True, **one), _cfg(pin=True, pers=2, snake=True, serial=True, **one),
                      _cfg(pers=2, snake=True), _cfg(pin=True, pers=3, oq=True), _cfg(pin=True),
                      _cfg(pin=True, pers=2, snake=True, serial=True)],
                64: [_cfg(**three), _cfg(pers=3, oq=True, **three), _cfg(pers=3, snake=True, serial=True, **three),
                     _cfg(pers=3, serial=True), _cfg(nc=3, stages=4, regs=(160, 32), serial=True)]}
        out = [GluonFwdVariant(GluonFwdSpec("bfloat16", d, d, "causal"), dataclasses.replace(c, masked_first=mf))
               for d, cfgs in base.items() for c in cfgs for mf in (False, True)]
        out += [GluonFwdVariant(GluonFwdSpec(dt, d, d, mask), dataclasses.replace(base[d][i], masked_first=True))
                for d, i in ((128, 0), (128, 7), (64, 1)) for dt, mask in (("bfloat16", "window"), ("float16", "causal"))]
        return [v for v in out if not check(v)]
    if name == "deep":
        # the two-consumer tiles that share each K/V tile between 128 query rows, with
        # K/V rings of 2 to 5 stages at head_dim 128 and 2 to 8 at 64 (BLOCK_N 64), beside
        # the shipped one-consumer tiles
        mf = dict(mf=True, skip=True)
        base = {128: [_cfg(bn=64, stages=s, pers=3, oq=True, **mf) for s in (2, 3, 4, 5)]
                + [_cfg(bn=64, stages=s, pers=2, **mf) for s in (3, 5)]
                + [_cfg(bn=64, stages=s, pers=2, snake=True, **mf) for s in (5,)]
                + [_cfg(bn=64, stages=4, pers=3, **mf), _cfg(bn=128, stages=3, mf=True)]
                + [_cfg(nc=1, bn=64, stages=s, pers=3, oq=True, mf=True) for s in (4, 6)]
                + [_cfg(nc=1, bn=64, ctas=2, pers=3, oq=True, mf=True)],
                64: [_cfg(bn=64, stages=s, pers=3, oq=True, **mf) for s in (2, 4, 6, 8)]
                + [_cfg(nc=3, bn=64, stages=s, regs=(160, 32), pers=3, oq=True, **mf) for s in (4, 8)]
                + [_cfg(nc=1, bn=64, stages=3, ctas=3, mf=True)]}
        out = [GluonFwdVariant(GluonFwdSpec("bfloat16", d, d, "causal"), c) for d, cfgs in base.items() for c in cfgs]
        out += [GluonFwdVariant(GluonFwdSpec(dt, d, d, mask), base[d][i])
                for d, i in ((128, 3), (128, 5), (64, 3)) for dt, mask in (("bfloat16", "window"), ("float16", "causal"))]
        return [v for v in out if not check(v)]
    if name == "skip":
        # two- and three-consumer tiles last to first, each with its skip_masked twin, and
        # the shipped one-consumer tiles of these keys for comparison
        one = dict(nc=1, bn=64, ctas=2)
        base = {128: [_cfg(bn=64), _cfg(bn=64, pin=True), _cfg(bn=64, pers=2), _cfg(bn=64, pers=2, snake=True),
                      _cfg(bn=64, pin=True, pers=2, snake=True, serial=True), _cfg(bn=64, pers=3),
                      _cfg(bn=64, stages=3, pin=True, pers=3), _cfg(bn=64, pers=3, oq=True)],
                64: [_cfg(bn=64, pers=2), _cfg(bn=64, pers=3), _cfg(bn=64, stages=3, pers=3, serial=True),
                     _cfg(nc=3, stages=4, regs=(160, 32), serial=True), _cfg(nc=3, bn=64, stages=4, regs=(160, 32), pers=3)]}
        out = [GluonFwdVariant(GluonFwdSpec("bfloat16", d, d, "causal"), _cfg_with(c, mf=True, skip=sk))
               for d, cfgs in base.items() for c in cfgs for sk in (False, True)]
        out += [GluonFwdVariant(GluonFwdSpec("bfloat16", 128, 128, "causal"), c) for c in (
            _cfg(pers=3, oq=True, mf=True, **one), _cfg(pers=2, mf=True, **one),
            _cfg(pin=True, pers=2, snake=True, serial=True, mf=True), _cfg(pers=2, snake=True, mf=True))]
        out += [GluonFwdVariant(GluonFwdSpec("bfloat16", 64, 64, "causal"), _cfg(nc=1, bn=64, stages=3, ctas=3, mf=True))]
        out += [GluonFwdVariant(GluonFwdSpec(dt, d, d, mask), _cfg_with(base[d][i], mf=True, skip=True))
                for d, i in ((128, 2), (128, 5), (64, 1), (64, 3)) for dt, mask in (("bfloat16", "window"),
                                                                                 ("float16", "causal"))]
        return [v for v in out if not check(v)]
    if name == "xtile":
        # the walks of 3 of the shipped rows (and near them), each with its cross_tile twin
        base = {(64, "causal"): [_cfg(nc=1, bn=64, stages=3, ctas=3, pers=3), _cfg(nc=1, bn=64, stages=3, ctas=3, pers=3,
                                                                                   snake=True),
                                 _cfg(stages=2, pers=3), _cfg(nc=1, bn=64, stages=3, ctas=2, pers=3)],
                (64, "none"): [_cfg(stages=3, pers=3), _cfg(nc=3, stages=2, pers=3),
                               _cfg(nc=1, bn=64, stages=3, ctas=3, pers=3)],
                (128, "causal"): [_cfg(pin=True, pers=3), _cfg(pers=3), _cfg(bn=64, stages=3, pers=3),
                                  _cfg(pin=True, pers=3, snake=True)],
                (128, "none"): [_cfg(pers=3), _cfg(pin=True, pers=3), _cfg(nc=1, stages=3, pers=3)]}
        out = [GluonFwdVariant(GluonFwdSpec("bfloat16", d, d, mask), dataclasses.replace(c, cross_tile=xt))
               for (d, mask), cfgs in base.items() for c in cfgs for xt in (False, True)]
        out += [GluonFwdVariant(GluonFwdSpec(dt, d, d, mask), dataclasses.replace(base[(d, "causal")][i], cross_tile=True))
                for d, i in ((64, 0), (128, 0)) for dt, mask in (("bfloat16", "window"), ("float16", "causal"))]
        return [v for v in out if not check(v)]
    if name == "m128":
        ref = {"causal": [_cfg(nc=1, bn=64, stages=3, ctas=3, pers=3), _cfg(nc=1, bn=64, stages=3, ctas=3, pers=3,
                                                                           snake=True, serial=True),
                          _cfg(stages=2, pers=3, serial=True), _cfg(nc=3, stages=4, serial=True)],
               "none": [_cfg(stages=3, pers=3), _cfg(nc=3, stages=2, pers=3), _cfg(nc=3, stages=4)]}
        one = dict(nc=1, bn=64, ctas=2, bm=128)
        two = dict(nc=2, bn=64, bm=128)
        probe = {"causal": [_cfg(stages=3, pers=3, **one), _cfg(stages=3, pers=3, serial=True, **one),
                            _cfg(stages=3, pers=3, pin=True, serial=True, **one), _cfg(stages=2, pers=3, **one),
                            _cfg(stages=4, pers=3, **one), _cfg(stages=3, pers=2, **one),
                            _cfg(stages=3, pers=3, snake=True, **one), _cfg(stages=3, pers=3, snake=True, serial=True,
                                                                             **one),
                            _cfg(stages=3, **one), _cfg(stages=4, **two), _cfg(stages=4, pers=3, **two),
                            _cfg(stages=4, pers=3, serial=True, **two), _cfg(stages=4, pin=True, **two),
                            _cfg(nc=1, bn=64, bm=128, stages=4, pers=3)],
                 "none": [_cfg(stages=3, pers=3, **one), _cfg(stages=3, pers=3, pin=True, **one),
                          _cfg(stages=4, pers=1, **one), _cfg(stages=3, **one), _cfg(stages=2, pers=3, **one),
                          _cfg(stages=4, pers=3, **two), _cfg(stages=4, pin=True, **two),
                          _cfg(nc=1, bn=64, bm=128, stages=4, pin=True)]}
        out = [GluonFwdVariant(GluonFwdSpec("bfloat16", 64, 64, mask), c) for mask in ("causal", "none")
               for c in ref[mask] + probe[mask]]
        out += [GluonFwdVariant(GluonFwdSpec(dt, 64, 64, mask), c) for dt, mask, c in (
            ("bfloat16", "window", probe["causal"][0]), ("bfloat16", "window", probe["causal"][10]),
            ("float16", "causal", probe["causal"][1]), ("float16", "none", probe["none"][5]))]
        return [v for v in out if not check(v)]
    if name == "ring3":
        # outside the rules: the shipped seqlen-512 tile (one consumer, BLOCK_N 64, two
        # programs per SM) with three-deep K and V rings, one program per tile: 115052 B
        # compiled (Triton 3.6) against the 115712 B a program may take, 115824 B by the
        # model, whose 1024 B slack exceeds what Triton adds to the named buffers and
        # barriers (212-252 B in this set's variants); beside the shipped walk
        # and the two-deep tile it would replace (measured 0.99-1.02x that tile, below
        # the walk: docs/design.md, what was tried)
        one = dict(nc=1, bn=64, ctas=2)
        probe = [_cfg(stages=3, **one), _cfg(stages=3, mf=True, **one)]
        ref = {"causal": [_cfg(pers=3, oq=True, mf=True, **one), _cfg(**one), _cfg(mf=True, **one)],
               "none": [_cfg(pers=3, oq=True, **one), _cfg(**one)]}
        out = [GluonFwdVariant(GluonFwdSpec("bfloat16", 128, 128, "causal"), c) for c in probe + ref["causal"]]
        out += [GluonFwdVariant(GluonFwdSpec("bfloat16", 128, 128, "none"), c) for c in probe[:1] + ref["none"]]
        out += [GluonFwdVariant(GluonFwdSpec("bfloat16", 128, 128, "window"), probe[1]),
                GluonFwdVariant(GluonFwdSpec("float16", 128, 128, "causal"), probe[0])]
        return out
    if name == "n32":
        one = dict(nc=1, bn=32, bm=128, ctas=2)
        two = dict(nc=2, bn=32, bm=128)
        probe = {"causal": [_cfg(stages=4, mf=True, **one), _cfg(stages=4, mf=True, serial=True, **one),
                            _cfg(stages=2, pers=2, mf=True, **one), _cfg(stages=2, pers=2, snake=True, mf=True, **one),
                            _cfg(stages=6, mf=True, **two), _cfg(stages=4, pers=2, snake=True, mf=True, **two)],
                 "none": [_cfg(stages=4, **one), _cfg(stages=2, pers=2, **one), _cfg(stages=6, **two),
                          _cfg(stages=4, pers=2, **two)]}
        ref = {"causal": [_cfg(nc=1, bn=64, ctas=2, pers=3, oq=True, mf=True), _cfg(pin=True, mf=True)],
               "none": [_cfg(pers=3), _cfg(nc=1, bn=64, ctas=2, pers=3, oq=True)]}
        out = [GluonFwdVariant(GluonFwdSpec("bfloat16", 128, 128, mask), c) for mask in ("causal", "none")
               for c in probe[mask] + ref[mask]]
        out += [GluonFwdVariant(GluonFwdSpec(dt, 128, 128, mask), probe["causal"][i]) for i in (0, 2, 4)
                for dt, mask in (("bfloat16", "window"), ("float16", "causal"))]
        return [v for v in out if not check(v)]
    if name == "x3":
        cfgs = [_cfg(nc=1, bn=64, stages=3, ctas=2, pers=3), _cfg(nc=1, bn=64, stages=3, ctas=2),
                _cfg(stages=4, pers=2), _cfg(nc=1, bn=64, stages=3, ctas=3, pers=3),
                _cfg(nc=1, bn=64, stages=2, ctas=3, pers=2), _cfg(nc=1, bn=64, stages=3, ctas=3),
                _cfg(nc=1, bn=64, stages=4, ctas=3)]
        out = [GluonFwdVariant(GluonFwdSpec("bfloat16", 64, 64, mask), c) for mask in ("causal", "none")
               for c in cfgs]
        out += [GluonFwdVariant(GluonFwdSpec(dt, 64, 64, mask), c) for c in cfgs[3:] if c.ctas_per_sm == 3
                for dt, mask in (("bfloat16", "window"), ("float16", "causal"))]
        return [v for v in out if not check(v)]
    if name == "walk3":
        # the persistent walk with two Q buffers (persistent 3) beside the walk it extends
        timed = {
            128: [_cfg(pin=True, pers=3), _cfg(pin=True, pers=2), _cfg(bn=64, stages=3, pin=True),
                  _cfg(bn=64, stages=3, pin=True, pers=3), _cfg(pers=3)],
            64: [_cfg(stages=3, pers=3), _cfg(stages=3, pers=2), _cfg(nc=3, stages=4, pers=3),
                 _cfg(nc=1, bn=64, ctas=2, pers=3)],
        }
    if name == "full":
        timed = {
            128: [_cfg(), _cfg(pin=True), _cfg(pers=True), _cfg(pin=True, pers=True), _cfg(bn=64, stages=4, pin=True),
                  _cfg(nc=1, bn=64, ctas=2), _cfg(nc=1, bn=64, ctas=2, pin=True), _cfg(nc=1, bn=64, ctas=2, pers=True)],
            64: [_cfg(stages=4), _cfg(stages=4, pin=True), _cfg(stages=4, pers=True), _cfg(stages=4, pin=True, pers=True),
                 _cfg(nc=3, bn=64, stages=6), _cfg(nc=1, stages=3, ctas=2), _cfg(nc=1, stages=3, ctas=2, pin=True),
                 _cfg(nc=1, stages=3, ctas=2, pers=True), _cfg(nc=1, bn=64, stages=4, ctas=2),
                 _cfg(nc=3, stages=4), _cfg(nc=3, stages=4, pers=True)],
        }
    out = []
    for d, cfgs in timed.items():
        for mask in ("none", "causal"):
            out += [GluonFwdVariant(GluonFwdSpec("bfloat16", d, d, mask), c) for c in cfgs]
        out.append(GluonFwdVariant(GluonFwdSpec("bfloat16", d, d, "window"), cfgs[0]))
        out.append(GluonFwdVariant(GluonFwdSpec("bfloat16", d, d, "window"), cfgs[-1]))
        out.append(GluonFwdVariant(GluonFwdSpec("float16", d, d, "causal"), cfgs[0]))
    for d, dv in ((128, 64), (64, 128), (96, 96), (192, 192), (256, 256), (192, 128)):
        s = GluonFwdSpec("bfloat16", d, dv, "causal")
        from flashgen.families.gluon.config import default_config
        out.append(GluonFwdVariant(s, default_config(s)))
    return [v for v in out if not check(v)]


# ---------------------------------------------------------------------------- checks

def _check_cases(mask: str):
    """(batch, heads, kv_heads, seqlen_q, seqlen_k, causal, window, align) per mask mode."""
    if mask == "none":
        return [(2, 4, 2, 1, 1, False, (-1, -1), "bottom_right"), (1, 2, 1, 17, 17, False, (-1, -1), "bottom_right"),
                (2, 4, 4, 1000, 1000, False, (-1, -1), "bottom_right"),
                (1, 2, 2, 4097, 4097, False, (-1, -1), "bottom_right"),
                (1, 4, 1, 17, 1000, False, (-1, -1), "bottom_right"),
                (1, 2, 2, 1000, 17, False, (-1, -1), "bottom_right"),
                (3, 6, 2, 129, 257, False, (-1, -1), "bottom_right"),
                (8, 16, 4, 1000, 1000, False, (-1, -1), "bottom_right")]  # several tiles per persistent program
    if mask == "causal":
        return [(2, 4, 2, 1, 1, True, (-1, -1), "bottom_right"), (1, 2, 1, 17, 17, True, (-1, -1), "bottom_right"),
                (2, 4, 4, 1000, 1000, True, (-1, -1), "bottom_right"),
                (1, 2, 2, 4097, 4097, True, (-1, -1), "bottom_right"),
                (1, 4, 1, 17, 1000, True, (-1, -1), "bottom_right"),
                (1, 2, 2, 1000, 17, True, (-1, -1), "bottom_right"),  # rows that see no key
                (1, 2, 2, 1000, 17, True, (-1, -1), "top_left"),
                (2, 4, 2, 300, 1000, True, (-1, -1), "top_left"),
                (1, 2, 2, 257, 4097, False, (-1, 5), "bottom_right"),  # right-bounded only: causal mode
                # several tiles per persistent program, in sections of (z, h) planes
                (2, 24, 24, 3000, 3000, True, (-1, -1), "bottom_right"),
                (4, 16, 4, 1000, 1100, True, (-1, -1), "top_left")]
    return [(2, 4, 2, 1000, 1000, False, (37, 11), "bottom_right"), (1, 2, 1, 4097, 4097, True, (256, -1), "bottom_right"),
            (1, 2, 2, 17, 1000, False, (0, 0), "bottom_right"), (1, 4, 2, 1000, 300, False, (100, 30), "top_left"),
            (2, 2, 2, 4097, 4097, False, (1000, 1000), "bottom_right"),
            (2, 24, 8, 3000, 3000, False, (300, 0), "bottom_right")]  # several tiles per persistent program


def _in_buffer(t, fill, rows=64, cols=16):
    import torch

    b, h, s, d = t.shape
    buf = torch.full((b, h, s + rows, d + cols), fill, dtype=t.dtype, device=t.device)
    buf[:, :, :s, :d] = t
    return buf[:, :, :s, :d], buf


def check_variant(v: GluonFwdVariant, seed: int = 0) -> dict:
    """Run ``v`` on its mask mode's cases; {"ok", "worst", "cases": [...]}."""
    import torch

    from flashgen import bench
    from flashgen.families.gluon import launch
    from flashgen.masks import mask_bounds

    s = v.spec
    dt = getattr(torch, s.dtype)
    g = torch.Generator(device="cuda").manual_seed(seed)
    cases, ok, worst = [], True, 0.0
    for i, (b, h, hk, sq, sk, causal, window, align) in enumerate(_check_cases(s.mask)):
        mode, lo, hi = mask_bounds(sq, sk, causal=causal, window=window, align=align)
        assert mode == s.mask, (mode, s.mask)
        q = torch.randn(b, h, sq, s.head_dim, generator=g, device="cuda").to(dt)
        k = torch.randn(b, hk, sk, s.head_dim, generator=g, device="cuda").to(dt)
        vv = torch.randn(b, hk, sk, s.head_dim_v, generator=g, device="cuda").to(dt)
        qb, _ = _in_buffer(q, float("nan"))
        kb, _ = _in_buffer(k, float("nan"))
        vb, _ = _in_buffer(vv, float("nan"))
        out, obuf = _in_buffer(torch.full((b, h, sq, s.head_dim_v), float("nan"), dtype=dt, device="cuda"), 7.0)
        lse = torch.full((b, h, sq), float("nan"), dtype=torch.float32, device="cuda")
        scale = s.head_dim ** -0.5
        launch.fwd(qb, kb, vb, softmax_scale=scale, mask=mode, diag_lo=lo, diag_hi=hi, config=v.config, out=out,
                   lse=lse)
        torch.cuda.synchronize()
        msgs = []
        outside = obuf.clone()
        outside[:, :, :sq, :s.head_dim_v] = 7.0
        if not bool((outside == 7.0).all()):
            msgs.append("wrote outside O")
        res = bench.compare({"O": out, "LSE": lse}, q, k, vv, None,
                            mask=dict(causal=causal, window=window, align=align), softmax_scale=scale)
        i_ = torch.arange(sq, device="cuda")[:, None]
        j_ = torch.arange(sk, device="cuda")[None, :]
        empty = ~(((j_ - i_) >= lo) & ((j_ - i_) <= hi)).any(1)
        if bool(empty.any()):
            if not bool((out[:, :, empty] == 0).all()) or not bool((lse[:, :, empty] == float("-inf")).all()):
                msgs.append("rows that see no key: O != 0 or LSE != -inf")
        r = max(x[2] for x in res.values())
        worst = max(worst, r)
        good = r <= 1.0 and not msgs
        ok &= good
        cases.append({"shape": [b, h, hk, sq, sk], "causal": causal, "window": list(window), "align": align,
                      "ok": good, "ratio": r, "errors": {n: [x[0], x[1]] for n, x in res.items()}, "msgs": msgs})
    return {"ok": ok, "worst": worst, "cases": cases}


#: Sets that hold variants outside the rules (``config.check``): built and run with the
#: rules off, to measure what a rule costs.
RULES_OFF = {"x3c", "ring3"}


def rules_off() -> None:
    """Build and launch variants whatever ``config.check`` says (this process only)."""
    from flashgen.families.gluon import launch, render

    render.check = launch.check = lambda v: []


def _child(arg: str) -> int:
    d = json.loads(arg)
    if d.pop("rules_off", False):
        rules_off()
    v = GluonFwdVariant(GluonFwdSpec(**d["spec"]), GluonFwdConfig(**d["config"]))
    t = time.time()
    try:
        r = check_variant(v)
    except Exception as e:  # a compile or launch failure is a result, not the end of the run
        r = {"ok": False, "worst": math.inf, "error": f"{type(e).__name__}: {str(e)[-1500:]}", "cases": []}
    r["seconds"] = round(time.time() - t, 1)
    print("RESULT " + json.dumps(r), flush=True)
    return 0


def run_checks(variants, workers: int, timeout: float, rules: bool = True) -> dict:
    def one(v):
        arg = json.dumps({"spec": dataclasses.asdict(v.spec), "config": dataclasses.asdict(v.config),
                          **({} if rules else {"rules_off": True})})
        try:
            p = subprocess.run([sys.executable, __file__, "--child", arg], capture_output=True, text=True,
                               timeout=timeout, cwd=ROOT)
        except subprocess.TimeoutExpired:
            return v, {"ok": False, "worst": math.inf, "error": f"timeout after {timeout} s (deadlock?)", "cases": []}
        for line in p.stdout.splitlines():
            if line.startswith("RESULT "):
                return v, json.loads(line[7:])
        return v, {"ok": False, "worst": math.inf, "error": f"rc {p.returncode}: {p.stderr[-1500:]}", "cases": []}

    results = {}
    with cf.ThreadPoolExecutor(workers) as ex:
        for v, r in ex.map(one, variants):
            results[v.id] = r
            bad = [c for c in r["cases"] if not c["ok"]]
            print(f"check {v.id:64} {'ok ' if r['ok'] else 'FAIL'} worst {r['worst']:.3g} {r['seconds'] if 'seconds' in r else ''}s"
                  + (f" {r.get('error', '')[:300]}" if "error" in r else "")
                  + "".join(f"\n    {c['shape']} causal={c['causal']} window={c['window']} {c['align']}: "
                            f"ratio {c['ratio']:.3g} {c['msgs']}" for c in bad[:4]), flush=True)
    return results


# ---------------------------------------------------------------------------- timing

def _flops(b, h, sq, sk, d, causal):
    return 4.0 * b * h * sq * sk * d * (0.5 if causal else 1.0)


def run_config(q, k, v, config: GluonFwdConfig, causal: bool, out=None, lse=None):
    """One Gluon forward of ``config`` (``launch.fwd``, inputs not checked) on
    (batch, heads, seqlen, head_dim) q, k, v with seqlen_q = seqlen_k, causal or without a
    mask, softmax_scale head_dim ** -0.5; O into ``out`` and the LSE into ``lse``
    (float32 (batch, heads, seqlen)), each allocated when None.  Returns O."""
    import torch

    from flashgen.families.gluon import launch

    n = q.shape[2]
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32) if lse is None else lse
    launch.fwd(q, k, v, softmax_scale=q.shape[-1] ** -0.5, mask="causal" if causal else "none",
               diag_lo=0 if causal else -n, diag_hi=0 if causal else n, config=config, out=out, lse=lse,
               check_inputs=False)
    return out


def time_all(variants, rep_ms: int, shapes=None) -> list[dict]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    import flashgen
    from flashgen.families.gluon import launch

    rows = []
    for (b, h, hk, n, d, causal) in shapes or SHAPES:
        dt = torch.bfloat16
        q = torch.randn(b, h, n, d, device="cuda", dtype=dt)
        k = torch.randn(b, hk, n, d, device="cuda", dtype=dt)
        v = torch.randn(b, hk, n, d, device="cuda", dtype=dt)
        fl = _flops(b, h, n, n, d, causal)
        row = {"shape": [b, h, hk, n, d], "causal": causal, "tflops": {}}

        def bench(name, fn):
            try:
                with torch.no_grad():
                    fn()
                    torch.cuda.synchronize()
                    ms = do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")
                row["tflops"][name] = fl / ms / 1e9
            except Exception as e:  # a peer that does not run this shape is left out
                row.setdefault("errors", {})[name] = f"{type(e).__name__}: {str(e)[:200]}"

        gqa = hk != h
        for name, backend in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
            def peer(backend=backend):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
            bench(name, peer)
        bench("flashgen", lambda: flashgen.attention(q, k, v, causal=causal))
        mask = "causal" if causal else "none"
        for var in variants:
            if var.spec.head_dim != d or var.spec.mask != mask or var.spec.dtype != "bfloat16" or var.spec.head_dim_v != d:
                continue
            out = torch.empty_like(q)
            lse = torch.empty((b, h, n), device="cuda", dtype=torch.float32)
            bench(var.id, lambda var=var, out=out, lse=lse: run_config(q, k, v, var.config, causal, out, lse))
        rows.append(row)
        print(f"time {row['shape']} causal={causal}: " + ", ".join(f"{k} {x:.0f}" for k, x in row["tflops"].items()),
              flush=True)
    return rows


def twin_table(rows, tag: str) -> str:
    """Each ``tag`` variant against its twin (the same id without the tag) per shape:
    TFLOP/s and the ratio, with the geometric mean per twin pair."""
    lines = [f"| variant ({tag} / twin) | " + " | ".join(",".join(map(str, r["shape"])) for r in rows) + " | geomean |",
             "|---|" + "---|" * (len(rows) + 1)]
    ids = sorted({k for r in rows for k in r["tflops"] if tag in k})
    for vid in ids:
        twin = vid.replace(tag, "")
        cells, logs = [], []
        for r in rows:
            t = r["tflops"]
            if vid in t and twin in t:
                cells.append(f"{t[vid]:.0f}/{t[twin]:.0f} {t[vid] / t[twin]:.2f}")
                logs.append(math.log(t[vid] / t[twin]))
            else:
                cells.append("-")
        gm = f"{math.exp(sum(logs) / len(logs)):.3f}" if logs else "-"
        lines.append(f"| {vid} | " + " | ".join(cells) + f" | {gm} |")
    return "\n".join(lines)


def table(rows) -> str:
    lines = ["| B,H,Hkv,N,D | causal | SDPA cuDNN | SDPA flash | flashgen | best Gluon (TFLOP/s) | / cuDNN | best variant |",
             "|---|---|---|---|---|---|---|---|"]
    ratios = []
    for r in rows:
        t = r["tflops"]
        gl = {k: x for k, x in t.items() if k.startswith("gluon_")}
        best = max(gl, key=gl.get) if gl else None
        cud = t.get("sdpa_cudnn")
        ratio = gl[best] / cud if best and cud else None
        if ratio:
            ratios.append(ratio)
        f = lambda k: f"{t[k]:.0f}" if k in t else "-"  # noqa: E731
        lines.append(f"| {','.join(map(str, r['shape']))} | {'yes' if r['causal'] else 'no'} | {f('sdpa_cudnn')} | "
                     f"{f('sdpa_flash')} | {f('flashgen')} | {gl[best]:.0f} | "
                     f"{ratio:.2f}x | {best} |" if best else f"| {r['shape']} | - |")
    if ratios:
        lines.append(f"geomean best Gluon / SDPA cuDNN: {math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f}x "
                     f"(min {min(ratios):.2f}x)")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=".")
    p.add_argument("--set", default="quick", choices=("quick", "full", "sched", "short", "walk3", "x3", "snake", "x3c",
                                                             "sermask", "m128", "xtile", "oq", "lpt", "mf", "skip", "deep",
                                                             "n32", "ring3"))
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--timeout", type=float, default=180.0, help="seconds per variant's child (compile + checks)")
    p.add_argument("--rep-ms", type=int, default=100)
    p.add_argument("--no-time", action="store_true")
    p.add_argument("--list", action="store_true")
    p.add_argument("--sass", action="store_true",
                   help="no GPU: compile each variant for sm_90 (Triton's ptxas, cuobjdump) and print its registers, "
                        "spills, SASS instructions, MUFU.EX2 and HGMMA counts")
    p.add_argument("--only", default="", help="comma-separated substrings of variant ids to keep")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return _child(args.child)
    variants = variant_set(args.set)
    if args.only:
        variants = [v for v in variants if any(s in v.id for s in args.only.split(","))]
    if args.list:
        for v in variants:
            print(v.id)
        print(len(variants), "variants")
        return 0
    if args.sass:
        from flashgen.families.gluon.sm90 import compile_sm90, report

        if args.set in RULES_OFF:
            rules_off()
        failed = 0
        for v in variants:
            try:
                r = report(compile_sm90(v))
            except Exception as e:  # noqa: BLE001 - one variant's compile error, the others still compile
                failed += 1
                print(f"{v.id} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            print(f"{v.id} regs {r.registers} spill {r.spill_bytes} shared {r.shared_bytes} instructions {r.instructions} "
                  f"ex2 {r.sass.count('MUFU.EX2')} hgmma {r.hgmma}", flush=True)
        return 1 if failed else 0
    t0 = time.time()
    out = {"variants": [v.id for v in variants], "argv": sys.argv[1:]}
    path = Path(args.out) / "gluon_fwd.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    if args.set in RULES_OFF:
        rules_off()
    checks = run_checks(variants, args.workers, args.timeout, rules=args.set not in RULES_OFF)
    out["checks"] = checks
    out["check_seconds"] = round(time.time() - t0, 1)
    path.write_text(json.dumps(out, indent=1))
    passing = [v for v in variants if checks[v.id]["ok"]]
    print(f"{len(passing)}/{len(variants)} variants pass the float64 checks "
          f"(worst ratio among passing {max([checks[v.id]['worst'] for v in passing], default=0):.3g}); "
          f"{out['check_seconds']} s", flush=True)
    if not args.no_time:
        import torch

        out["device"] = torch.cuda.get_device_name()
        out["versions"] = {"torch": torch.__version__, "triton": __import__("triton").__version__}
        shapes = {"sched": SCHED_SHAPES, "short": SHORT_SHAPES, "walk3": SCHED_SHAPES, "x3": X3_SHAPES,
                  "snake": SNAKE_SHAPES, "x3c": X3C_SHAPES, "sermask": SERMASK_SHAPES,
                  "m128": M128_SHAPES, "xtile": XTILE_SHAPES, "oq": OQ_SHAPES,
                  "lpt": LPT_SHAPES, "mf": MF_SHAPES, "skip": SKIP_SHAPES, "deep": DEEP_SHAPES,
                  "n32": N32_SHAPES, "ring3": RING3_SHAPES}.get(args.set)
        out["timing"] = time_all(passing, args.rep_ms, shapes)
        path.write_text(json.dumps(out, indent=1))
        if args.set in ("mf", "skip"):
            print(twin_table(out["timing"], "_" + args.set))
        print(table(out["timing"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

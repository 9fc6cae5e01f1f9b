"""The Gluon backward (flashgen/families/gluon/bwd.py) on the H200: every variant is
first run in a child process under a timeout (a deadlock kills the child, not the
run), checked against float64 (dQ, dK, dV; NaN-poisoned outputs; seqlens 17, 1000,
4097; seqlen_q != seqlen_k both ways; causal, window and none; GQA; K and V read from
slices of NaN-filled buffers, O, dO and dQ then in (batch, seqlen, heads, head_dim)
order), then timed (preprocess + main + convert, median of
triton.testing.do_bench) against SDPA cuDNN's and SDPA flash's backward and flashgen's
current backward (flashgen.attention + autograd, tuned rows of tuning_db/h200.sqlite)
on the FA-grid shapes of issue 16.  Writes gluon_bwd.json under --out and prints a
short table last.

``--gqa``: the GQA run instead: the head_dim 128 default with group_split 1, 2 and 4,
float32 or 16-bit partials (GQA_CONFIGS), checked against float64 on GQA cases (GQA_CHECKS: groups 4 and 8, odd
sizes, both causal alignments, a window, NaN past seqlen_k), then timed on GQA_SHAPES
(bf16, causal) against SDPA cuDNN (enable_gqa): the whole backward, its main kernel
alone and the dK/dV reduction alone; writes gluon_bwd_gqa.json.

``--ordered``: the deterministic run instead: the defaults with dQ added in a fixed order
(dq_mode "ordered") beside the same tiles with the unordered TMA reduce-add
(ORDERED_CONFIGS), each checked against float64 on CHECKS (GQA_CHECKS for a group split)
and for bitwise-identical dQ, dK and dV over three backwards, then timed on
ORDERED_SHAPES against SDPA cuDNN's backward and flashgen's backward through autograd,
default and ``deterministic=True``; writes gluon_bwd_ordered.json.  ``--ordered-set writer``:
the tuned tiles instead, each without and with the dQ writer warp (WRITER_CONFIGS).

``--wide``: head_dim 256 instead: the column-split programs (``col_split``: the two
consumer warpgroups share 64 key rows and split the columns; every valid config,
``wide_configs``), checked against float64 on CHECKS at head_dim 256, then timed on
WIDE_SHAPES (the ``head-dims`` preset's head_dim 256 shapes: Gemma's 8 query and 4 kv
heads) against SDPA cuDNN's backward and flashgen's current one through autograd; writes
gluon_bwd_wide.json (``--match REGEX``, ``--limit N``: fewer variants).  ``--wide --unchecked``:
the default beside the configs the rules refuse only until their float64 checks have run
here (``bwd.NOT_CHECKED``) or as measured slower (``bwd.MEASURED_SLOWER``: ``lookahead``
1 and 2, the next step's S^T and dP^T issued during the dQ chunks, with atomic dQ; dQ by
atomics with dK and dV stored by TMA), to check and measure them again.

Usage (repository root, on the GPU):  python3 benchmarks/gluon_bwd.py --out $OUT [--gqa | --ordered | --wide]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import select
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

#: (batch, num_heads, seqlen, head_dim, causal): issue 16's table.
SHAPES = [(4, 16, 4096, 128, False), (1, 16, 16384, 128, True), (8, 32, 2048, 64, False), (4, 32, 4096, 64, True),
          (4, 16, 4096, 128, True), (8, 32, 2048, 64, True),
          # the dense grid's seqlen-512 shapes, where a program's fixed costs show most
          (32, 16, 512, 128, False), (32, 16, 512, 128, True), (32, 32, 512, 64, True)]
#: (config fields, head_dim, full): the variants one run compiles, checks and times; the
#: fields are GluonBwdConfig's in order (block_m, block_n, consumers, stages, dq_mode,
#: consumer_regs, producer_regs, row_load, producer_warps, split, group_split,
#: half_partials, dq_stage, kv_store, longest_first); "full" adds the window and float16 checks.  The first two:
#: the defaults of both head dims (the dQ tile in fragment order, dK and dV by TMA stores).
CONFIGS = [((64, 64, 2, 2, "tma", 240, 24, "tma", 1, False, 1, False, "fragment", "tma"), 128, True),
           ((64, 64, 2, 4, "tma", 240, 24, "tma", 1, True, 1, False, "fragment", "tma"), 64, True),
           ((64, 64, 2, 2, "tma", 240, 24, "tma", 1, True), 128, True),
           ((64, 64, 2, 2, "tma", 240, 24, "tma"), 128, True),
           ((64, 64, 2, 2, "tma", 240, 24, "producer", 1, True), 128, False),
           ((64, 64, 2, 2, "tma", 240, 24, "producer"), 128, False),
           ((64, 64, 2, 3, "tma", 240, 24, "tma"), 128, False),
           ((64, 64, 2, 2, "tma", 240, 24, "ptr"), 128, False),
           ((64, 64, 2, 4, "tma", 240, 24, "tma", 1, True), 64, True),
           ((64, 64, 2, 4, "tma", 240, 24, "tma", 4), 64, True),
           ((64, 64, 2, 4, "tma", 240, 24, "producer", 1, True), 64, False),
           ((64, 64, 2, 4, "tma", 240, 24, "ptr", 4), 64, False)]
#: ``--tiles d64``: BLOCK_M 128 at head_dim 64 (one lock-step partition of two consumers,
#: FlashAttention-3's 128 x 128 tile of that head dim) beside the default; the register
#: rule rejects it (ptxas: 36 B of spills without a mask, 76 B causal), so it is built
#: with the rules off (``attention_bwd(check=False)``) to measure what the rule costs.
TILE_PROBES = {"d64": [((64, 64, 2, 4, "tma", 240, 24, "tma", 1, True), 64, False),
                       ((128, 64, 2, 2, "tma", 240, 24, "tma", 1, False), 64, False),
                       ((128, 64, 2, 3, "tma", 240, 24, "tma", 1, False), 64, False)],
               # ``--tiles dq-stage``: the dQ tile staged row-major with the 128-byte swizzle
               # beside staged in the accumulator's fragment order (dq_stage), on the defaults
               # of both head dims, the producer's row loads, a 3-stage ring, BLOCK_M 128 at
               # head_dim 64 and the ordered dQ
               "dq-stage": [((bm, 64, 2, st, mode, 240, 24, rows, 1, split, 1, False, stage), d, full)
                            for (bm, d, st, mode, rows, split) in ((64, 128, 2, "tma", "tma", False),
                                                                   (64, 128, 2, "tma", "producer", False),
                                                                   (64, 128, 3, "tma", "tma", False),
                                                                   (64, 64, 4, "tma", "tma", True),
                                                                   (128, 64, 2, "tma", "tma", False),
                                                                   (64, 128, 2, "ordered", "tma", False))
                            for stage, full in (("swizzled", False),
                                                ("fragment", st != 3 and bm == 64 and mode == rows == "tma"))],
               # ``--tiles kv-store``: dK and dV stored from registers beside through shared
               # memory by TMA stores (kv_store), on the tuned tiles' shapes
               "kv-store": [((bm, 64, 2, st, "tma", 240, 24, "tma", 1, split, 1, False, "fragment", kv), d, full)
                            for (bm, d, st, split) in ((64, 128, 2, False), (64, 128, 3, False), (64, 64, 4, True),
                                                       (128, 64, 2, False))
                            for kv, full in (("ptr", False), ("tma", bm == 64 and st != 3))],
               # ``--tiles lpt``: the masked backward's programs in grid order (each (batch,
               # kv head)'s key blocks after the previous one's) beside longest first across
               # sections of pairs (longest_first), on the tuned tiles: head_dim 128 lock-step
               # with TMA or register stores and 3 stages, head_dim 64 split and BLOCK_M 128;
               # the GQA tiles (group splits 2 and 4, 16-bit partials) are checked on
               # GQA_CHECKS, not timed (SHAPES are multi-head)
               "lpt": [((bm, 64, 2, st, "tma", 240, 24, rows, 1, split, gs, half, "fragment", kv, lpt), d,
                        lpt and full)
                       for (bm, d, st, rows, split, gs, half, kv, full) in (
                           (64, 128, 2, "tma", False, 1, False, "tma", True),
                           (64, 128, 3, "tma", False, 1, False, "ptr", False),
                           (64, 64, 4, "tma", True, 1, False, "tma", True),
                           (128, 64, 2, "producer", False, 1, False, "tma", False),
                           (64, 128, 2, "producer", False, 2, True, "ptr", True),
                           (64, 128, 2, "producer", False, 4, False, "ptr", False))
                       for lpt in ((False, True) if gs == 1 else (True,))],
               # ``--tiles d96``: head_dim 96 on the head_dim 128 tiles (bwd.tile_dim): the
               # default (window and float16 too), the dQ by atomics with the register stores,
               # the swizzled dQ tile, the ordered dQ, and a GQA split whose register stores of
               # the partials mask the padding columns (GQA_CHECKS); checked only (SHAPES hold
               # no head_dim 96: the tuner times them)
               "d96": [((64, 64, 2, 2, "tma", 240, 24, "tma", 1, False, 1, False, "fragment", "tma"), 96, True),
                       ((64, 64, 2, 2, "atomic", 240, 24, "producer", 1, False, 1, False, "swizzled", "ptr"), 96, False),
                       ((64, 64, 2, 3, "tma", 240, 24, "tma", 1, False, 1, False, "swizzled", "tma"), 96, False),
                       ((64, 64, 2, 2, "ordered", 240, 24, "tma", 1, False, 1, False, "fragment", "tma"), 96, False),
                       ((64, 64, 2, 2, "tma", 240, 24, "tma", 1, False, 2, False, "fragment", "ptr"), 96, True)]}

#: (batch, num_heads, num_kv_heads, seqlen_q, seqlen_k, causal, window, align, nan_kv)
CHECKS = [(1, 2, 2, 17, 17, False, (-1, -1), "bottom_right", False),
          (2, 4, 2, 1000, 1000, False, (-1, -1), "bottom_right", True),
          (1, 2, 1, 4097, 4097, False, (-1, -1), "bottom_right", False),
          (1, 2, 2, 17, 17, True, (-1, -1), "bottom_right", False),
          (2, 4, 2, 1000, 1000, True, (-1, -1), "bottom_right", True),
          (1, 2, 1, 4097, 4097, True, (-1, -1), "bottom_right", False),
          (1, 2, 2, 300, 1000, True, (-1, -1), "bottom_right", False),
          (1, 2, 2, 1000, 300, True, (-1, -1), "bottom_right", False),
          (1, 2, 2, 1000, 300, True, (-1, -1), "top_left", False),
          (1, 4, 2, 1000, 1000, False, (200, 64), "bottom_right", True),
          (1, 2, 2, 1000, 1000, True, (300, -1), "bottom_right", False)]
#: The GQA run (--gqa).  (batch, num_heads, num_kv_heads, seqlen, head_dim, causal).
GQA_SHAPES = [(4, 16, 4, 2048, 128, True), (1, 32, 8, 2048, 128, True), (2, 32, 8, 4096, 128, True)]
#: The head_dim 128 default (lock-step consumers, LSE2/delta by 2-D TMA) at group_split
#: 1, 2, 4 with float32 partials, and 2, 4 with 16-bit ones (half_partials); "full" adds
#: the window and float16 checks.
GQA_CONFIGS = [((64, 64, 2, 2, "tma", 240, 24, "tma", 1, False, gs, half), 128, True)
               for gs, half in ((1, False), (2, False), (4, False), (2, True), (4, True))]
#: Groups 4 and 8 (every group_split of GQA_CONFIGS divides them); fields as CHECKS.
GQA_CHECKS = [(1, 8, 2, 17, 17, False, (-1, -1), "bottom_right", False),
              (2, 8, 2, 1000, 1000, False, (-1, -1), "bottom_right", True),
              (1, 8, 1, 4097, 4097, True, (-1, -1), "bottom_right", False),
              (2, 16, 4, 1000, 1000, True, (-1, -1), "bottom_right", True),
              (1, 8, 2, 300, 1000, True, (-1, -1), "bottom_right", False),
              (1, 8, 2, 1000, 300, True, (-1, -1), "top_left", False),
              (1, 8, 2, 1000, 1000, False, (200, 64), "bottom_right", True)]
#: The deterministic run (--ordered): each default tile with dQ by the unordered TMA
#: reduce-add and by the ordered one; "full" as CONFIGS.
ORDERED_CONFIGS = [((64, 64, 2, 2, mode, 240, 24, "tma", 1, False, gs), 128, gs == 1)
                   for gs in (1, 4) for mode in ("tma", "ordered")] + \
                  [((64, 64, 2, 4, mode, 240, 24, "tma", 1, True), 64, True) for mode in ("tma", "ordered")]
#: ``--ordered --ordered-set writer``: the tuned tiles with dQ by the unordered and the
#: ordered reduce-add, each without and with the dQ writer warp (dq_writer): head_dim 128
#: lock-step (and its GQA group split by 4, register stores), head_dim 64 split; fields
#: as CONFIGS, then dq_writer.
WRITER_CONFIGS = [((64, 64, 2, st, mode, 240, 24, "tma", 1, split, gs, False, "fragment", kv, False, w), d,
                   full)
                  for (d, st, split, gs, kv, full) in ((128, 2, False, 1, "tma", True), (128, 2, False, 4, "ptr", False),
                                                       (64, 4, True, 1, "tma", True))
                  for mode in ("tma", "ordered") for w in (False, True)
                  if not (gs > 1 and mode == "tma")]
ORDERED_SETS = {"defaults": ORDERED_CONFIGS, "writer": WRITER_CONFIGS}
#: (batch, num_heads, num_kv_heads, seqlen, head_dim, causal): issue 16's grid shapes and
#: the GQA shapes of the Llama training step and the Llama-3-8B suite.
ORDERED_SHAPES = [(4, 16, 16, 4096, 128, False), (1, 16, 16, 16384, 128, True), (4, 16, 16, 4096, 128, True),
                  (8, 32, 32, 2048, 64, False), (4, 32, 32, 4096, 64, True), (4, 16, 4, 2048, 128, True),
                  (2, 32, 8, 4096, 128, True)]
#: ``--wide``: (batch, num_heads, num_kv_heads, seqlen, head_dim, causal), the head-dims
#: preset's head_dim 256 shapes (16k tokens per batch).
WIDE_SHAPES = [(16 * 1024 // s, 8, 4, s, 256, causal) for causal in (False, True) for s in (1024, 2048, 4096, 8192)]


def wide_configs(unchecked: bool = False):
    """``--wide``'s variants: every config of the head_dim 256 search space (the default
    first), each "full" (window and float16 checks too), as (fields, head_dim, full).
    ``unchecked``: the default, then the configs the rules refuse only because their
    float64 checks have not run on the GPU or as measured slower
    (``bwd.col_split_space(unchecked=True)``)."""
    import dataclasses

    from flashgen.families.gluon import bwd as B

    default = B.default_config(256)
    if unchecked:
        # the default's neighbours first, the lookahead variants before the rest
        rest = sorted(B.col_split_space(256, "bfloat16", "causal", unchecked=True),
                      key=lambda c: (not c.lookahead, c.dq_mode != default.dq_mode, c.kv_store != default.kv_store,
                                     c.row_load != default.row_load, -c.stages, -c.dq_chunks))
        return [(dataclasses.astuple(c), 256, True) for c in [default, *rest]]
    # the default, then the other ring depth and dQ modes before the load and store choices
    space = sorted(B.search_space(256, "bfloat16", "causal"),
                   key=lambda c: (c != default, c.row_load != default.row_load, c.kv_store != default.kv_store,
                                  -c.stages, c.dq_mode, -c.dq_chunks))
    return [(dataclasses.astuple(c), 256, True) for c in space]


#: HBM bandwidth the reduction's prediction divides its bytes by (bytes/s).
HBM_BYTES_PER_S = 3.3e12
FLOOR = {"float16": 2e-3, "bfloat16": 1.6e-2}


def tflops(b, h, s, d, causal, ms):
    return 2.5 * 4 * b * h * s * s * d * (0.5 if causal else 1.0) / (ms * 1e-3) / 1e12


# ------------------------------------------------------------------------------- child side

def _child_variants(specs: list[str], timing: bool, gqa: bool = False, ordered: bool = False,
                    wide: bool = False) -> None:
    """Per variant: the float64 checks (``timing`` False) or the timings (True); ``gqa``:
    GQA_CHECKS and GQA_SHAPES (with the main kernel and the reduction also timed alone);
    ``ordered``: CHECKS (GQA_CHECKS for a group split) with the repeatability check, and
    ORDERED_SHAPES."""
    import torch
    import triton.testing

    from flashgen import reference
    from flashgen.families.gluon import bwd as B
    from flashgen.masks import mask_bounds

    dev = "cuda"

    def run_check(cfg, d, dtype_name, case):
        b, h, hk, sq, sk, causal, window, align, nan_kv = case
        mode, lo, hi = mask_bounds(sq, sk, causal=causal, window=window, align=align)
        dt = getattr(torch, dtype_name)
        g = torch.Generator(device=dev).manual_seed(hash((sq, sk, h, hk, d)) % 2**31)
        q = torch.randn(b, h, sq, d, device=dev, dtype=dt, generator=g)
        if nan_kv:  # K, V: slices of buffers holding NaN past seqlen_k
            kb = torch.full((b, hk, sk + 77, d), float("nan"), device=dev, dtype=dt)
            vb = kb.clone()
            kb[:, :, :sk] = torch.randn(b, hk, sk, d, device=dev, dtype=dt, generator=g)
            vb[:, :, :sk] = torch.randn(b, hk, sk, d, device=dev, dtype=dt, generator=g)
            k, v = kb[:, :, :sk], vb[:, :, :sk]
        else:
            k = torch.randn(b, hk, sk, d, device=dev, dtype=dt, generator=g)
            v = torch.randn(b, hk, sk, d, device=dev, dtype=dt, generator=g)
        do = torch.randn(b, h, sq, d, device=dev, dtype=dt, generator=g)
        scale = d ** -0.5
        o64, lse64, _ = reference.forward_bounds(q, k, v, scale, lo, hi)
        o, lse = o64.to(dt), lse64.float()
        ref = reference.backward_bounds(do, q, k, v, scale, lo, hi)
        base = reference.backward_bounds(do, q, k, v, scale, lo, hi, dtype=dt)
        outs = [torch.full((b, h, sq, d), float("nan"), device=dev, dtype=dt),
                torch.full((b, hk, sk, d), float("nan"), device=dev, dtype=dt),
                torch.full((b, hk, sk, d), float("nan"), device=dev, dtype=dt)]
        if nan_kv:  # and O, dO, dQ in transformers' (batch, seqlen, heads, head_dim) order
            o, do, outs[0] = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (o, do, outs[0]))
        got = B.attention_bwd(do, q, k, v, o, lse, softmax_scale=scale, diag_lo=lo, diag_hi=hi, mask=mode,
                              config=cfg, dq=outs[0], dk=outs[1], dv=outs[2], stage_sync=True,
                              check=False)
        torch.cuda.synchronize()
        res = {}
        if ordered:  # two more backwards: bitwise the same dQ, dK, dV?
            again = [B.attention_bwd(do, q, k, v, o, lse, softmax_scale=scale, diag_lo=lo, diag_hi=hi, mask=mode,
                                     config=cfg, check=False) for _ in range(2)]
            torch.cuda.synchronize()
            res["repeatable"] = all(torch.equal(x, y) for a in again for x, y in zip(got, a))
        for name, gt, r, bs in zip(("dq", "dk", "dv"), got, ref, base):
            err, berr = reference.max_error(gt, r), reference.max_error(bs, r)
            res[name] = [err, berr, err / (2 * berr + FLOOR[dtype_name])]
        return mode, res

    for spec in specs:
        fields, d, full = json.loads(spec)
        cfg = B.GluonBwdConfig(*fields)
        print("START", spec, flush=True)
        row = {"config": cfg.id, "head_dim": d, "checks": [], "times": []}
        try:
            worst = 0.0
            # Every config is checked in the modes it is timed in (none, causal); a "full"
            # one also in window mode and in float16.
            checks = GQA_CHECKS if gqa or cfg.group_split > 1 else CHECKS
            cases = [] if timing else [c for c in checks if full or c[6] == (-1, -1)]
            for case in cases:
                for dtype_name in (("bfloat16", "float16") if full and case[3] == 1000 and not case[5]
                                   else ("bfloat16",)):
                    mode, res = run_check(cfg, d, dtype_name, case)
                    rep = res.pop("repeatable", None)
                    r = max(v[2] for v in res.values())
                    worst = max(worst, r)
                    row["checks"].append({"case": case, "dtype": dtype_name, "mode": mode, "res": res,
                                          "ok": bool(r <= 1.0), "repeatable": rep})
            row["check_ok"] = all(c["ok"] for c in row["checks"])
            row["check_worst"] = worst
            if timing and wide:
                row["times"] = [_time_gqa(cfg, *shape) for shape in WIDE_SHAPES]
            elif timing and ordered:
                row["times"] = [_time_gqa(cfg, *shape) for shape in ORDERED_SHAPES
                                if shape[4] == d and (shape[1] // shape[2]) % cfg.group_split == 0
                                and (cfg.group_split == 1 or shape[1] != shape[2])]
            elif timing and gqa:
                row["times"] = [_time_gqa(cfg, *shape) for shape in GQA_SHAPES if shape[4] == d]
            elif timing:
                for (b, h, s, dd, causal) in SHAPES:
                    if dd != d or cfg.group_split > 1 or (cfg.longest_first and not causal):
                        continue
                    dt = torch.bfloat16
                    q, k, v, do, o = (torch.randn(b, h, s, d, device=dev, dtype=dt) for _ in range(5))
                    lse = torch.randn(b, h, s, device=dev, dtype=torch.float32).abs() + 5.0
                    mode, lo, hi = mask_bounds(s, s, causal=causal, window=(-1, -1))
                    fn = lambda: B.attention_bwd(do, q, k, v, o, lse, softmax_scale=d ** -0.5, diag_lo=lo,  # noqa: E731
                                                 diag_hi=hi, mask=mode, config=cfg, check=False)
                    fn()
                    torch.cuda.synchronize()
                    ms = float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))
                    row["times"].append({"shape": [b, h, s, d, causal], "ms": ms,
                                         "tflops": tflops(b, h, s, d, causal, ms)})
                    del q, k, v, do, o, lse
        except Exception as e:  # noqa: BLE001 - a failure is the finding
            row["error"] = f"{type(e).__name__}: {str(e)[-600:]}"
            print("RESULT", json.dumps(row), flush=True)
            sys.exit(3)  # a CUDA error poisons the context: the parent starts a new child
        print("RESULT", json.dumps(row), flush=True)


def _time_gqa(cfg, b, h, hk, s, d, causal) -> dict:
    """Median ms of the whole backward, of its main kernel alone and of the dK/dV
    reduction alone (group_split > 1), bf16, at one GQA shape."""
    import torch
    import triton.testing

    from flashgen.families.gluon import bwd as B
    from flashgen.masks import mask_bounds

    dt = torch.bfloat16
    q, do, o = (torch.randn(b, h, s, d, device="cuda", dtype=dt) for _ in range(3))
    k, v = (torch.randn(b, hk, s, d, device="cuda", dtype=dt) for _ in range(2))
    lse = torch.randn(b, h, s, device="cuda", dtype=torch.float32).abs() + 5.0
    mode, lo, hi = mask_bounds(s, s, causal=causal, window=(-1, -1))
    # the rules on for a config they admit (its launch plans, as the dispatcher runs it);
    # off for one they refuse only until its float64 checks have run here or as measured
    # slower (--unchecked: bwd.NOT_CHECKED, bwd.MEASURED_SLOWER), as _child_variants'
    # checks built it
    check = not B.invalid_reasons(cfg, d, "bfloat16", mode)
    kw = dict(softmax_scale=d ** -0.5, diag_lo=lo, diag_hi=hi)
    whole = lambda: B.attention_bwd(do, q, k, v, o, lse, mask=mode, config=cfg, check=check, **kw)  # noqa: E731
    whole()
    mod = B.load(cfg, "bfloat16", d, mode, check)
    a = B.launch_args(do, q, k, v, o, lse, config=cfg, **kw)
    grid, args = a["preprocess"]
    mod.attn_bwd_preprocess[grid](*args, num_warps=4)
    grid, args = a["main"]
    sem = a.get("sem")  # dq_mode "ordered": the semaphores start at zero on every launch

    def main():
        if sem is not None:
            sem.zero_()
        mod.attn_bwd[grid](*args, num_warps=cfg.num_warps, maxnreg=cfg.maxnreg)
    torch.cuda.synchronize()
    bench = lambda fn: float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))  # noqa: E731
    out = {"shape": [b, h, hk, s, d, causal], "ms": bench(whole), "main_ms": bench(main)}
    if "reduce" in a:
        from flashgen.families.gluon import reduce as R

        rgrid, rargs = a["reduce"]
        out["reduce_ms"] = bench(lambda: R.group_reduce[rgrid](*rargs, num_warps=R.NUM_WARPS))
    nbytes = B.group_split_bytes(b, hk, s, d, cfg.group_split, half_partials=cfg.half_partials)
    out["reduce_pred_ms"] = (nbytes["partials_read"] + nbytes["outputs_written"]) / HBM_BYTES_PER_S * 1e3
    out["tflops"] = tflops(b, h, s, d, causal, out["ms"])
    return out


def _child_baselines_gqa(shapes=None, names=("cudnn",)) -> None:
    """Per GQA shape (``shapes``: (batch, num_heads, num_kv_heads, seqlen, head_dim,
    causal), default GQA_SHAPES), the median backward ms through autograd of each of
    ``names``: "cudnn" (SDPA cuDNN, enable_gqa), "flashgen" and
    "flashgen_deterministic" (flashgen.attention, deterministic=True)."""
    import torch
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    import flashgen

    for (b, h, hk, s, d, causal) in (GQA_SHAPES if shapes is None else shapes):
        dt = torch.bfloat16
        q = torch.randn(b, h, s, d, device="cuda", dtype=dt, requires_grad=True)
        k, v = (torch.randn(b, hk, s, d, device="cuda", dtype=dt, requires_grad=True) for _ in range(2))
        do = torch.randn(b, h, s, d, device="cuda", dtype=dt)
        row = {"shape": [b, h, hk, s, d, causal]}
        for name in names:
            try:
                if name == "cudnn":
                    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                        out = sdpa(q, k, v, is_causal=causal, enable_gqa=True)
                else:
                    out = flashgen.attention(q, k, v, causal=causal,
                                             deterministic=True if name.endswith("deterministic") else None)
                fn = lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)  # noqa: E731
                fn()
                torch.cuda.synchronize()
                ms = float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))
                row[name] = {"ms": ms, "tflops": tflops(b, h, s, d, causal, ms)}
            except Exception as e:  # noqa: BLE001
                row[name] = {"error": f"{type(e).__name__}: {str(e)[-300:]}"}
            out = None
        if "flashgen_deterministic" in names:
            try:
                row["explain"] = str(flashgen.explain(q, k, v, causal=causal, deterministic=True))[-600:]
            except Exception as e:  # noqa: BLE001
                row["explain"] = f"{type(e).__name__}: {e}"
        print("RESULT", json.dumps(row), flush=True)


def _child_baselines(warm_only: bool) -> None:
    """SDPA cuDNN, SDPA flash and flashgen's backward per shape (``warm_only``: one call
    each, which compiles flashgen's kernels, no timing)."""
    import torch
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    import flashgen

    for (b, h, s, d, causal) in SHAPES:
        dt = torch.bfloat16
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=dt, requires_grad=True) for _ in range(3))
        do = torch.randn(b, h, s, d, device="cuda", dtype=dt)
        row = {"shape": [b, h, s, d, causal]}
        for name in ("cudnn", "flash", "flashgen"):
            try:
                if name == "flashgen":
                    out = flashgen.attention(q, k, v, causal=causal)
                else:
                    be = SDPBackend.CUDNN_ATTENTION if name == "cudnn" else SDPBackend.FLASH_ATTENTION
                    with sdpa_kernel([be]):
                        out = sdpa(q, k, v, is_causal=causal)
                fn = lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)  # noqa: E731
                fn()
                torch.cuda.synchronize()
                if warm_only:
                    continue
                ms = float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))
                row[name] = {"ms": ms, "tflops": tflops(b, h, s, d, causal, ms)}
            except Exception as e:  # noqa: BLE001
                row[name] = {"error": f"{type(e).__name__}: {str(e)[-300:]}"}
            out = None
        print("RESULT", json.dumps(row), flush=True)


# ------------------------------------------------------------------------------ parent side

def _failed_cases(checks: list[dict]) -> list[str]:
    """The first three failed float64 checks of a variant, as mode, sizes and worst ratio."""
    return [f"{c['mode']}{c['case'][3]}x{c['case'][4]}:{max(x[2] for x in c['res'].values()):.2f}"
            for c in checks if not c["ok"]][:3]


def _run_child(args: list[str], items: list[str], per_item_s: float, deadline: float, log) -> list[dict]:
    """Run a child over ``items``; a child silent for ``per_item_s`` after an item's START
    is killed, the item recorded as hung, and a new child takes the rest."""
    results, todo = [], list(items)
    while todo and time.time() < deadline:
        p = subprocess.Popen([sys.executable, __file__, *args, *todo], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, cwd=str(ROOT), bufsize=1)
        current, started, progressed = None, time.time(), False
        while True:
            limit = min(started + per_item_s, deadline) - time.time()
            r, _, _ = select.select([p.stdout], [], [], max(limit, 0.0))
            if not r:
                p.kill()
                p.wait()
                if current is not None:
                    results.append({"item": current, "error": f"hung: no result within {per_item_s:.0f} s (killed)"})
                    todo.remove(current)
                else:
                    todo = []
                break
            line = p.stdout.readline()
            if not line:
                p.wait()
                if current is not None:
                    results.append({"item": current, "error": f"child exited rc={p.returncode}"})
                    todo.remove(current)
                elif p.returncode == 0 or not progressed:
                    todo = []
                break
            log.write(line)
            if line.startswith("START "):
                current, started = line[6:].strip(), time.time()
            elif line.startswith("RESULT "):
                progressed = True
                results.append(json.loads(line[7:]))
                if current in todo:
                    todo.remove(current)
                current, started = None, time.time()
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget-s", type=float, default=200.0, help="stop starting work after this many seconds")
    ap.add_argument("--child-variants", action="store_true")
    ap.add_argument("--child-baselines", action="store_true")
    ap.add_argument("--timing", action="store_true", help="child: time instead of check")
    ap.add_argument("--warm-only", action="store_true", help="child: baselines run once, untimed")
    ap.add_argument("--gqa", action="store_true", help="the GQA run (group_split 1, 2, 4 against cuDNN)")
    ap.add_argument("--ordered", action="store_true", help="the deterministic run (dQ added in a fixed order)")
    ap.add_argument("--ordered-set", choices=sorted(ORDERED_SETS), default="defaults",
                    help="--ordered: its variants (ORDERED_SETS: the defaults, or the tiles with and without the "
                         "dQ writer warp)")
    ap.add_argument("--wide", action="store_true", help="head_dim 256: the column-split programs against cuDNN")
    ap.add_argument("--limit", type=int, default=0, help="--wide: the first N of its variants only (0: all)")
    ap.add_argument("--match", default="", help="--wide: only the variants whose id matches this regular expression")
    ap.add_argument("--unchecked", action="store_true",
                    help="--wide: the default and the configs refused only until checked on the GPU or as "
                         "measured slower")
    ap.add_argument("--tiles", choices=sorted(TILE_PROBES), default=None,
                    help="time TILE_PROBES[...] (configs outside the rules among them) instead of CONFIGS")
    ap.add_argument("items", nargs="*")
    a = ap.parse_args()
    if a.child_variants:
        _child_variants(a.items, a.timing, a.gqa, a.ordered, a.wide)
        return 0
    if a.child_baselines:
        if a.wide:
            _child_baselines_gqa(WIDE_SHAPES, ("cudnn", "flashgen"))
        elif a.ordered:
            _child_baselines_gqa(ORDERED_SHAPES, ("cudnn", "flashgen", "flashgen_deterministic"))
        else:
            _child_baselines_gqa() if a.gqa else _child_baselines(a.warm_only)
        return 0
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.gqa:
        return _main_gqa(out, min(a.budget_s, 170.0))
    if a.ordered:
        return _main_ordered(out, a.budget_s, ORDERED_SETS[a.ordered_set])
    if a.wide:
        import re

        from flashgen.families.gluon import bwd as B

        chosen = [w for w in wide_configs(a.unchecked) if re.search(a.match, B.GluonBwdConfig(*w[0]).id)]
        return _main_ordered(out, a.budget_s, chosen[:a.limit or None], wide=True)
    t0 = time.time()
    deadline = t0 + a.budget_s
    with open(out / "gluon_bwd.log", "w") as log, open(out / "baseline_warm.log", "w") as wlog:
        # flashgen's Triton kernels compile (one untimed call per shape) while the Gluon
        # variants compile and run their checks.
        warm = subprocess.Popen([sys.executable, __file__, "--child-baselines", "--warm-only"], stdout=wlog,
                                stderr=subprocess.STDOUT, cwd=str(ROOT))
        specs = [json.dumps([list(f), d, full]) for f, d, full in (TILE_PROBES[a.tiles] if a.tiles else CONFIGS)]
        checked = _run_child(["--child-variants"], specs, 90.0, deadline - 60.0, log)
        try:
            warm.wait(timeout=max(deadline - 50.0 - time.time(), 1.0))
        except subprocess.TimeoutExpired:
            warm.kill()
            warm.wait()
        passed = [sp for sp, r in zip(specs, checked) if r.get("check_ok")]
        timed = _run_child(["--child-variants", "--timing"], passed, 40.0, deadline - 25.0, log)
        base = _run_child(["--child-baselines"], ["all"], 60.0, deadline + 20.0, log)
    by_id = {(r["config"], r["head_dim"]): r for r in timed if "config" in r}
    variants = []
    for r in checked:
        if "config" in r:
            r["times"] = by_id.get((r["config"], r["head_dim"]), {}).get("times", [])
            t_err = by_id.get((r["config"], r["head_dim"]), {}).get("error")
            if t_err:
                r["error"] = t_err
        variants.append(r)
    res = {"variants": variants, "baselines": base, "wall_s": time.time() - t0}
    (out / "gluon_bwd.json").write_text(json.dumps(res, indent=1))
    # table
    bl = {tuple(r["shape"]): r for r in base if "shape" in r}
    print(f"\n{'variant':<30} {'d':>3} {'check':>6} {'worst':>6}  TFLOP/s per shape (b,h,s,causal) [ratio to cuDNN]")
    for v in variants:
        if "config" not in v:
            print(f"{v.get('item', '?'):<30} ERROR {v.get('error', '')[:80]}")
            continue
        cells = []
        for t in v["times"]:
            b, h, s, d, c = t["shape"]
            ref = bl.get((b, h, s, d, c), {}).get("cudnn", {}).get("tflops")
            cells.append(f"{b},{h},{s},{'c' if c else 'n'}:{t['tflops']:.0f}" + (f"[{t['tflops'] / ref:.2f}]" if ref else ""))
        err = v.get("error", "")[:60]
        bad = _failed_cases(v["checks"])
        print(f"{v['config']:<30} {v['head_dim']:>3} {str(v.get('check_ok', '-')):>6} {v.get('check_worst', 0):6.3f}  "
              + " ".join(cells) + (" ERR " + err if err else "") + (" FAIL " + " ".join(bad) if bad else ""))
    for r in base:
        if "shape" in r:
            print("baseline", r["shape"], " ".join(f"{n}:{r[n].get('tflops', 0):.0f}" if "tflops" in r[n]
                                                   else f"{n}:ERR" for n in ("cudnn", "flash", "flashgen")))
        else:
            print("baseline", r)
    print(f"wall {time.time() - t0:.0f} s")
    return 0


def _main_gqa(out: Path, budget_s: float) -> int:
    """The GQA run: checks, then timings of the variants that passed, then cuDNN; writes
    gluon_bwd_gqa.json and prints the table last."""
    t0 = time.time()
    deadline = t0 + budget_s
    with open(out / "gluon_bwd_gqa.log", "w") as log:
        specs = [json.dumps([list(f), d, full]) for f, d, full in GQA_CONFIGS]
        checked = _run_child(["--child-variants", "--gqa"], specs, 90.0, deadline - 50.0, log)
        passed = [sp for sp, r in zip(specs, checked) if r.get("check_ok")]
        timed = _run_child(["--child-variants", "--timing", "--gqa"], passed, 60.0, deadline - 20.0, log)
        base = _run_child(["--child-baselines", "--gqa"], ["all"], 60.0, deadline + 20.0, log)
    res = {"checked": checked, "timed": timed, "baselines": base, "wall_s": time.time() - t0}
    (out / "gluon_bwd_gqa.json").write_text(json.dumps(res, indent=1))
    cudnn = {tuple(r["shape"]): r["cudnn"].get("ms") for r in base if "shape" in r}
    print("\nchecks against float64 (worst error / (2 x PyTorch's + floor), <= 1 passes)")
    for r in checked:
        if "config" not in r:
            print(f"  {r.get('item', '?')[:60]} ERROR {r.get('error', '')[:100]}")
            continue
        bad = _failed_cases(r["checks"])
        print(f"  {r['config']:<46} ok {r.get('check_ok')} worst {r.get('check_worst', 0):.3f} "
              f"({len(r['checks'])} cases)" + (" FAIL " + " ".join(bad) if bad else "")
              + (" ERR " + r["error"][:80] if "error" in r else ""))
    print(f"\nGQA backward, bf16, ms: whole (preprocess + main + convert [+ reduce]) [cuDNN / whole], main "
          f"kernel, dK/dV reduction (predicted: its bytes / {HBM_BYTES_PER_S / 1e12:.1f} TB/s)")
    for shape in GQA_SHAPES:
        b, h, hk, s, d, causal = shape
        name = f"{b}x{h}/{hk}x{s} d{d}{' causal' if causal else ''}"
        ref = cudnn.get(tuple(shape))
        print(f"  {name}: cuDNN {ref:.3f}" if ref else f"  {name}: cuDNN ERR "
              + str([r.get("cudnn") for r in base if r.get("shape") == list(shape)])[:100])
        for r in timed:
            if "config" not in r:
                print(f"    {r.get('item', '?')[:60]} ERROR {r.get('error', '')[:100]}")
                continue
            for t in r["times"]:
                if t["shape"] != list(shape):
                    continue
                red = (f" reduce {t['reduce_ms']:.3f} (pred {t['reduce_pred_ms']:.3f})" if "reduce_ms" in t else "")
                ratio = f" [{ref / t['ms']:.2f}]" if ref else ""
                print(f"    {r['config']:<46} whole {t['ms']:.3f}{ratio} main {t['main_ms']:.3f}{red}")
    print(f"wall {time.time() - t0:.0f} s")
    return 0


def _main_ordered(out: Path, budget_s: float, configs=ORDERED_CONFIGS, wide: bool = False) -> int:
    """The deterministic run: checks (float64 and repeatability), timings of the variants
    that passed, then the baselines; writes gluon_bwd_ordered.json and prints the table
    last.  ``wide``: the head_dim 256 run (``--wide``: no repeatability check, WIDE_SHAPES,
    gluon_bwd_wide.json)."""
    t0 = time.time()
    deadline = t0 + budget_s
    flag, name = ("--wide", "gluon_bwd_wide") if wide else ("--ordered", "gluon_bwd_ordered")
    shapes = WIDE_SHAPES if wide else ORDERED_SHAPES
    names = ("cudnn", "flashgen") if wide else ("cudnn", "flashgen", "flashgen_deterministic")
    with open(out / f"{name}.log", "w") as log:
        specs = [json.dumps([list(f), d, full]) for f, d, full in configs]
        checked = _run_child(["--child-variants", flag], specs, 120.0, deadline - 60.0, log)
        (out / f"{name}.json").write_text(json.dumps({"checked": checked}, indent=1))
        passed = [sp for sp, r in zip(specs, checked) if r.get("check_ok")]
        timed = _run_child(["--child-variants", "--timing", flag], passed, 60.0, deadline - 30.0, log)
        (out / f"{name}.json").write_text(json.dumps({"checked": checked, "timed": timed}, indent=1))
        base = _run_child(["--child-baselines", flag], ["all"], 90.0, deadline + 30.0, log)
    res = {"checked": checked, "timed": timed, "baselines": base, "wall_s": time.time() - t0}
    (out / f"{name}.json").write_text(json.dumps(res, indent=1))
    print("\nchecks against float64 (worst error / (2 x PyTorch's + floor), <= 1 passes); repeatable: dQ, dK, dV "
          "bitwise equal over three backwards, cases that were / all")
    for r in checked:
        if "config" not in r:
            print(f"  {r.get('item', '?')[:60]} ERROR {r.get('error', '')[:100]}")
            continue
        reps = [c["repeatable"] for c in r["checks"]]
        bad = _failed_cases(r["checks"])
        print(f"  d{r['head_dim']} {r['config']:<44} ok {r.get('check_ok')} worst {r.get('check_worst', 0):.3f} "
              + ("" if wide else f"repeatable {sum(bool(x) for x in reps)}/{len(reps)}")
              + (" FAIL " + " ".join(bad) if bad else "") + (" ERR " + r["error"][:80] if "error" in r else ""))
    bl = {tuple(r["shape"]): r for r in base if "shape" in r}
    print("\nbackward ms, bf16 (whole Gluon backward; baselines through autograd) [cuDNN ms / ms]")
    for shape in shapes:
        b, h, hk, s, d, causal = shape
        row = bl.get(tuple(shape), {})
        ref = row.get("cudnn", {}).get("ms")
        cells = [f"{n} " + (f"{row[n]['ms']:.3f}" + (f" [{ref / row[n]['ms']:.2f}]" if ref else "")
                            if "ms" in row.get(n, {}) else "ERR") for n in names]
        print(f"  {b}x{h}/{hk}x{s} d{d}{' causal' if causal else ''}: " + ", ".join(cells))
        for r in timed:
            for t in r.get("times", []):
                if t["shape"] == list(shape):
                    print(f"    {r['config']:<46} {t['ms']:.3f}" + (f" [{ref / t['ms']:.2f}]" if ref else "")
                          + f" main {t['main_ms']:.3f}")
    for r in timed:
        if "config" not in r or "error" in r:
            print(f"  {r.get('config', r.get('item', '?'))[:60]} ERROR {r.get('error', '')[:100]}")
    print(f"wall {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The Gluon family behind :class:`flashgen.families.Family`: what the tuner, the
dispatcher and ``explain`` see of the Gluon forward (:mod:`.config`, :mod:`.render`,
:mod:`.launch`) and backward (:mod:`.bwd`).

Kernels: ``fwd``, ``bwd``, the whole backward (:data:`flashgen.spec.WHOLE_BWD`:
preprocess, main kernel and dQ convert, one row timing all three), ``fwd_varlen``,
the forward of ragged batches (one program per tile), and ``bwd_varlen``
(:data:`flashgen.spec.WHOLE_BWD_VARLEN`), their whole backward (its strided first and
last passes and the main kernel, one row timing all three).  Served on sm_90
only (compute capability 9.0 exactly: wgmma, setmaxnreg and TMA as these kernels use
them; not sm_100+, sm_80/89/120, nor Triton's interpreter), float16/bfloat16, the head
dims the configs allow, inputs a tensor descriptor can address (layout ""), of the
built-in score mods softcap and ALiBi (:mod:`.builtin_mods`, as fixed score functions;
not bias or dropout); masks none, causal and window; user score/mask functions and sinks
(:mod:`flashgen.user_mods`) in the forward (:mod:`.user`), and in the whole backward
(:mod:`.user_bwd`) unless a captured tensor is read at an index computed from the
score (checked against
float64 on the GPU, ``python -m benchmarks gluon-user-bwd``).  Everything else is the Triton family's,
and :meth:`GluonFamily.unsupported` says why.

The knobs live in :class:`flashgen.spec.TileConfig` (its Gluon fields, 0 unless set):
:func:`fwd_config` / :func:`bwd_config` turn one into the kernels' own config and
:func:`tile_config` back.  ``num_warps`` is 4 per consumer warpgroup; a register budget
of 0 is the default split for the consumer count (:func:`.config.default_regs`, and the
backward's 240/24 for two consumers, 248/24 for one, as :func:`.bwd.search_space`).

This module imports neither torch nor triton (the launchers import them when called).
"""

from __future__ import annotations

import dataclasses
import functools
import math

from ...arch import INTERPRETER
from ...resources import SmemEstimate
from ...spec import (
    DEFAULT_FAMILY, WHOLE_BWD, WHOLE_BWD_MODS, WHOLE_BWD_VARLEN, ProblemKey, TileConfig, Variant, attention_flops,
    is_user_mods,
)
from . import bwd as B
from . import config as C

NAME = "gluon"
#: The ragged-batch forward (the Gluon forward's ``varlen`` variants, :mod:`.launch`).
VARLEN_FWD = "fwd_varlen"
#: The ragged-batch whole backward (the Gluon backward's ``varlen`` variants, :mod:`.bwd`).
VARLEN_BWD = WHOLE_BWD_VARLEN
#: The kernels the Gluon forward compiles, and the backward.
FWD_KERNELS = ("fwd", VARLEN_FWD)
BWD_KERNELS = (WHOLE_BWD, VARLEN_BWD)
#: The refinement knobs of the varlen forward (one program per tile in the grid's order:
#: no walk, no longest-first order).
VARLEN_REFINE_KNOBS = ("masked_first", "skip_masked")
_ROW_LOADS = ("tma", "producer", "ptr")  # TileConfig.row_load 0, 1, 2
#: The TileConfig knobs each Gluon kernel reads (the others must stay 0).
_FWD_KNOBS = {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "consumer_regs", "producer_regs", "pin",
              "persistent", "ctas_per_sm", "snake", "serial_masked", "cross_tile", "o_in_q", "longest_first",
              "masked_first", "skip_masked", "family"}
_BWD_KNOBS = {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "consumer_regs", "producer_regs", "dq_atomic",
              "row_load", "producer_warps", "split", "group_split", "half_partials", "dq_ordered", "dq_stage",
              "kv_store", "longest_first", "dq_writer", "dq_chunks", "lookahead", "family"}

#: Where the Gluon backward's default measured ahead of the Triton family's backward on
#: the H200 (docs/results/h200/gluon_bwd/README.md, rows2d_split run, bf16, TFLOP/s of
#: the whole backward, both families in one run): (head_dim, mask) -> the measurement.
#: d64 non-causal measured a tie (359 vs 359 at 8,32,2048,64) and windows were not
#: timed, so those keys keep the Triton backward until a tuned row says otherwise.
BWD_DEFAULT_AHEAD = {
    (128, "none"): "514 vs 411 TFLOP/s at 4,16,4096,128 (docs/results/h200/gluon_bwd)",
    (128, "causal"): "530 vs 421 at 1,16,16384,128; 431 vs 367 at 4,16,4096,128 (docs/results/h200/gluon_bwd)",
    (64, "causal"): "367 vs 319 at 4,32,4096,64; 307 vs 272 at 8,32,2048,64 (docs/results/h200/gluon_bwd)",
    # the head-dims preset's tuning: the Gluon default against the Triton family's tuned
    # bwd_dq + bwd_dkdv, each key's rows of one day
    (96, "none"): "436 vs 314 at 4,32,4096,96 (docs/results/h200/tuning/head-dims)",
    (96, "causal"): "384 vs 293 at 4,32,4096,96 (docs/results/h200/tuning/head-dims)",
    # the column-split program against the Triton family's tuned rows through the public
    # call, the head-dims preset's head_dim 256 shapes (8 / 4 heads), one run
    (256, "none"): "1.10-1.15x the Triton family's tuned rows at 16x8/4x1024 to 2x8/4x8192, 268-310 TFLOP/s "
                   "(docs/results/h200/gluon_bwd/d256)",
    (256, "causal"): "1.08-1.12x the Triton family's tuned rows at 16x8/4x1024 to 2x8/4x8192, 206-307 TFLOP/s "
                     "(docs/results/h200/gluon_bwd/d256)",
}
#: Where the Gluon backward's default (the window kernel with the block mask) measured
#: ahead of the Triton family's backward for user mask functions alone: head_dim -> the
#: measurement (``python -m benchmarks gluon-user-bwd``: the four mask examples of
#: :mod:`flashgen.user_examples`, document, document-causal, prefix-lm and window-causal,
#: at 8x16x2048 and 8x16x4096 bf16, the Triton side through ``flashgen.attention`` with
#: the shipped rows and the Triton family alone; each checked against float64 first).
#: With a score function: :data:`USER_SCORE_BWD_DEFAULT_AHEAD`.
USER_BWD_DEFAULT_AHEAD = {
    128: "H100, 1.06-1.30x the Triton family's backward over the four mask examples at 8x16x2048 and "
         "8x16x4096 (docs/results/h100/gluon_user_bwd/full)",
    64: "H100, 1.08-1.46x the Triton family's backward over the four mask examples at 8x16x2048 and "
        "8x16x4096 (docs/results/h100/gluon_user_bwd/full)",
}
#: The dtypes, GQA group sizes (up to) and sizes (seqlen_q and seqlen_k in one size
#: bucket) of the default's GPU checks against float64 (the same run: bf16 at groups 1,
#: 4 and 16, the last multi-query at 16 heads, float16 at group 4); the default extends
#: them to the other pairs within these bounds (the kernels take the group as a size and
#: the dtype as the element type), the rest take tuned rows alone (the tuner checks
#: each variant first).
USER_BWD_DEFAULT_DTYPES = ("bfloat16", "float16")
#: As :data:`USER_BWD_DEFAULT_AHEAD`, for user functions with a score function (and no
#: captured tensor read at an index computed from the score: :func:`user_bwd`): head_dim
#: -> the measurement (``python -m benchmarks gluon-user-bwd -- --examples
#: alibi,softcap,relpos``: ALiBi and
#: softcap causal, T5's relative bias with its table frozen, at 8x16x2048 and 8x16x4096
#: bf16, each checked against float64 first at the sizes of the mask examples' checks).
USER_SCORE_BWD_DEFAULT_AHEAD = {
    128: "H100, 1.12-3.87x the Triton family's backward over three score examples (ALiBi 1.12-1.19x, softcap "
         "1.35-1.43x, T5 bias 3.72-3.87x) at 8x16x2048 and 8x16x4096 (docs/results/h100/gluon_user_bwd/score)",
    64: "H100, 1.16-4.12x the Triton family's backward over three score examples (ALiBi 1.30-1.43x, softcap "
        "1.16-1.75x, T5 bias 3.92-4.12x) at 8x16x2048 and 8x16x4096 (docs/results/h100/gluon_user_bwd/score)",
}
#: As :data:`USER_SCORE_BWD_DEFAULT_AHEAD`, for the built-in score mods the Gluon family
#: serves (:data:`BUILTIN_MODS`): (mods, head_dim, mask) -> the measurement (``python3
#: benchmarks/gluon_builtin_mods.py``: the default tile's backward against the Triton
#: family's, bf16, 8x16x4096 causal and without a mask; each checked against float64 first,
#: 30 of 30 checks within the rule, worst ratio 0.378): the pairs of
#: ``_BUILTIN_BWD_TIMED`` where the Gluon backward was the faster.  softcap with ALiBi at
#: head_dim 128 causal measured 0.59x (ptxas spills 788 B there) and is left to tuned rows.
#: (mods, head_dim, mask) -> (Gluon, Triton) backward ms at 8x16x4096 bf16 on an H100.
_BUILTIN_BWD_TIMED = {
    ("softcap", 64, "causal"): (2.609, 4.361), ("softcap", 64, "none"): (4.645, 8.110),
    ("softcap", 128, "causal"): (4.330, 5.908), ("softcap", 128, "none"): (7.117, 10.986),
    ("alibi", 64, "causal"): (1.959, 2.668), ("alibi", 64, "none"): (3.838, 4.867),
    ("alibi", 128, "causal"): (3.479, 3.900), ("alibi", 128, "none"): (5.384, 6.950),
    ("softcap_alibi", 64, "causal"): (3.429, 4.982), ("softcap_alibi", 64, "none"): (6.108, 8.134),
    ("softcap_alibi", 128, "causal"): (10.470, 6.192), ("softcap_alibi", 128, "none"): (8.698, 11.389),
}
BUILTIN_BWD_DEFAULT_AHEAD = {
    k: f"H100, {t / g:.2f}x the Triton family's backward at 8x16x4096 ({g:.3f} against {t:.3f} ms; "
       "docs/results/h100/gluon_builtin_mods)" for k, (g, t) in _BUILTIN_BWD_TIMED.items() if g < t}
#: The Gluon forward's measurements for the built-in score mods: its default tile
#: (:func:`builtin_fwd_default`) against the Triton family's forward as the dispatcher
#: serves it without the Gluon family, bf16 8x16x4096 on an H100, in two runs: ``python3
#: benchmarks/gluon_mods_fwd_tiles.py`` (docs/results/h100/gluon_builtin_mods/fwd-tiles,
#: every tile checked against float64 first, worst ratio 0.141) and ``python3
#: benchmarks/gluon_builtin_mods.py`` (docs/results/h100/gluon_builtin_mods/fwd-default,
#: 30 of 30 checks, worst ratio 0.378).  (mods, head_dim, mask) -> ((Gluon, Triton) ms of
#: each run).
_BUILTIN_FWD_TIMED = {
    ("softcap", 64, "causal"): ((1.416, 1.436), (1.421, 1.427)),
    ("softcap", 64, "none"): ((2.589, 2.694), (2.668, 2.702)),
    ("softcap", 128, "causal"): ((1.828, 2.153), (1.817, 2.148)),
    ("softcap", 128, "none"): ((3.415, 3.731), (3.337, 3.725)),
    ("alibi", 64, "causal"): ((0.842, 0.841), (0.839, 0.848)),
    ("alibi", 64, "none"): ((1.518, 1.419), (1.559, 1.420)),
    ("alibi", 128, "causal"): ((1.299, 1.313), (1.306, 1.326)),
    ("alibi", 128, "none"): ((2.313, 2.362), (2.372, 2.353)),
    ("softcap_alibi", 64, "causal"): ((1.501, 1.604), (1.500, 1.618)),
    ("softcap_alibi", 64, "none"): ((2.723, 3.404), (2.732, 3.406)),
    ("softcap_alibi", 128, "causal"): ((1.892, 2.220), (1.883, 2.178)),
    ("softcap_alibi", 128, "none"): ((3.456, 4.097), (3.464, 4.085)),
}
#: The lead over the Triton forward every run must show before an untuned key takes the
#: Gluon default: one tile's forward moves by 1-3% between runs (ALiBi at head_dim 128
#: without a mask: 1.02x, then 0.99x).
BUILTIN_FWD_MIN_LEAD = 1.02
#: The dtypes of ``benchmarks/gluon_builtin_mods.py``'s float64 checks of the built-in mods'
#: Gluon forward (bf16, and float16 causal with GQA 4); the untuned forward default extends
#: to both (the kernels take the dtype as the element type).
BUILTIN_FWD_DEFAULT_DTYPES = ("bfloat16", "float16")
BUILTIN_FWD_DEFAULT_AHEAD = {
    k: "H100, " + " and ".join(f"{t / g:.2f}x" for g, t in runs) + " the Triton family's forward at 8x16x4096 in "
       f"two runs ({runs[0][0]:.3f} against {runs[0][1]:.3f} ms; docs/results/h100/gluon_builtin_mods/fwd-tiles)"
    for k, runs in _BUILTIN_FWD_TIMED.items() if all(t >= BUILTIN_FWD_MIN_LEAD * g for g, t in runs)}


def builtin_fwd_default(s: C.GluonFwdSpec) -> C.GluonFwdConfig:
    """The Gluon forward's default tile for the built-in softcap and ALiBi: one consumer
    of 64 rows at BLOCK_N 64, three programs per SM at head_dim 64 and two above, the
    deepest ring that fits.  The score function runs on every score in each copy of the
    softmax body; the plain keys' default (two consumer partitions, BLOCK_N 128) holds 64
    scores a thread in two copies of that code, and measured 0.36-0.66x of the Triton
    forward with softcap at head_dim 64, this tile 1.00-1.04x (and 0.50-0.90x against
    1.09-1.23x at head_dim 128; docs/results/h100/gluon_builtin_mods/fwd-tiles)."""
    ctas = 3 if max(C.pad(s.head_dim), C.pad(s.head_dim_v)) <= 64 else 2
    cr, pr = C.default_regs(1, ctas)
    for stages in (3, 2):
        cfg = C.GluonFwdConfig(num_consumers=1, BLOCK_N=64, num_stages=stages, consumer_regs=cr, producer_regs=pr,
                               ctas_per_sm=ctas)
        if C.valid(C.GluonFwdVariant(s, cfg)):
            return cfg
    return C.default_config(s)


#: As :data:`USER_SCORE_BWD_DEFAULT_AHEAD`, for score functions with a captured tensor that
#: takes a gradient (added per step by the consumers: :mod:`.user_bwd`): head_dim -> the
#: measurement (``relpos-learned``, T5's bias with its table learned, the same run).  At
#: head_dim 128 the default tile measured 0.98x (8x16x2048) and 1.21x (8x16x4096): tuned
#: rows alone decide there.
USER_GRAD_BWD_DEFAULT_AHEAD = {
    64: "H100, 2.41-2.49x the Triton family's backward for T5's bias with its table learned, the table's "
        "gradient included, at 8x16x2048 and 8x16x4096 (docs/results/h100/gluon_user_bwd/score)",
}
USER_BWD_DEFAULT_MAX_GROUP = 16
#: Where the Gluon ragged-batch backward's default measured ahead of the Triton family's
#: choice (its tuned bwd_dq_varlen + bwd_dkdv_varlen rows where the shipped database has
#: them, its heuristic defaults elsewhere) on the H200, bf16, GQA groups 1 and 4
#: (docs/results/h200/varlen-gluon/bwd/aligned-rows): (head_dim, mask) -> the
#: measurement; a second run (window-mqa/) measured the same ranges within 0.03x, and
#: head_dim 64 causal at documents of up to 512 tokens 1.49x (1.04x in the first).
#: Keys not listed keep the Triton kernels until a tuned row says otherwise.  float16
#: (checked exact, not timed) takes the same choice, as the dense table's keys do;
#: multi-query (32 query heads on one kv head) measured 1.37-1.48x (window-mqa/).
BWD_VARLEN_DEFAULT_AHEAD: dict[tuple[int, str], str] = {
    (128, "none"): "1.30-1.48x the Triton family's tuned rows over 6 problems (varlen-docs, 16/4 heads), "
                   "294-511 vs 227-374 TFLOP/s; 1.43-1.54x its defaults over 3 "
                   "(docs/results/h200/varlen-gluon/bwd/aligned-rows)",
    (128, "causal"): "1.28-1.34x the Triton family's tuned rows over 6 problems (varlen-docs, 16/4 heads), "
                     "184-459 vs 140-343 TFLOP/s; 1.36-1.58x its defaults over 3 "
                     "(docs/results/h200/varlen-gluon/bwd/aligned-rows)",
    (128, "window"): "1.58-1.65x the Triton family's defaults over 2 varlen-docs problems with "
                     "bench.TIMING_WINDOW (docs/results/h200/varlen-gluon/bwd/window-mqa)",
    (64, "none"): "1.53-1.75x the Triton family's defaults over 3 problems of varlen_bench.py "
                  "(docs/results/h200/varlen-gluon/bwd/aligned-rows)",
    (64, "causal"): "1.04-1.64x the Triton family's defaults over 3 problems of varlen_bench.py "
                    "(docs/results/h200/varlen-gluon/bwd/aligned-rows)",
}
#: The Gluon forward's default against the Triton family's tuned forward on the H200
#: (docs/results/h200/gluon_fwd/table.md: 0.85-1.10x SDPA cuDNN vs 0.73-0.94x in the
#: same run): the default of the forward keys it serves at FWD_DEFAULT_HEAD_DIMS with
#: enough work (DEFAULT_MIN_FLOPS).
FWD_DEFAULT_AHEAD = ("0.85-1.10x SDPA cuDNN vs the Triton family's tuned 0.73-0.94x (docs/results/h200/gluon_fwd); "
                     "head_dim 96 and 256: 0.96-1.41x the Triton family's tuned rows, ahead at 15 of the head-dims "
                     "preset's 16 keys (docs/results/h200/tuning/head-dims)")
#: Where the Gluon forward's varlen default measured ahead of the Triton family's tuned
#: varlen forward on the H200 (docs/results/h200/varlen-gluon/gluon_varlen.json: the
#: varlen-docs preset, head_dim 128, 32 / 8 heads, bf16, both in one run): mask -> the
#: least max_seqlen_q (the key's bucket) from which the default serves an untuned key.
#: Below it (documents of at most 512 tokens, and causal 1024) the Triton rows were ahead.
FWD_VARLEN_DEFAULT_AHEAD = {
    "causal": (2048, "1.15-1.24x the Triton family's tuned rows at documents of up to 2048-8192 tokens"),
    "none": (1024, "1.18-1.36x the Triton family's tuned rows at documents of up to 1024-8192 tokens"),
}
#: The head dims (head_dim == head_dim_v) whose Gluon forward default was timed against
#: the Triton family's tuned forward (bf16, no mask and causal; 96 at GQA group 1, 256 at
#: group 2: the default extends those timings to windows, float16 and other groups); the
#: others are exact (checked against float64 on the H200) but untimed, so their untuned
#: default stays the portable family's.
FWD_DEFAULT_HEAD_DIMS = (64, 96, 128, 256)
#: The least work (FLOPs of the key's size buckets, FlashAttention's count) at which an
#: untuned key takes the Gluon default.  A Gluon launch costs more host time than the
#: Triton family's (H200, benchmarks/profile_call.py, docs/results/h200/probes/call-profile:
#: about 250 us per forward and 600-900 us per whole backward, against 100-115 us for a
#: Triton forward), so below about twice that in kernel time a synchronizing caller waits
#: on the host: at 2x16x2048 d128 and 4x32x2048 d64 causal the Gluon backward took
#: 0.59-0.93 ms against the Triton backward's 0.50-0.72 ms
#: (docs/results/h200/exactness/determinism/determinism.log).  Tuned rows decide by
#: their own measurements.
DEFAULT_MIN_FLOPS = {"fwd": 2.5e11, "bwd": 6e11}


#: The built-in score mods (:func:`flashgen.spec.mods_name`) the Gluon forward and whole
#: backward serve, as the fixed score functions of :mod:`.builtin_mods`.
BUILTIN_MODS = WHOLE_BWD_MODS


def code_name(mods: str, direction: str) -> str:
    """The ``user`` of the Gluon variant that computes ``mods`` in ``direction`` ("fwd",
    "bwd"): a built-in set's lowering name (:mod:`.builtin_mods`), else ``mods``."""
    if mods in BUILTIN_MODS:
        from .builtin_mods import name

        return name(mods, direction)
    return mods


def sinks_only(mods: str) -> bool:
    """Whether ``mods`` names user functions that are attention sinks alone (no score or
    mask function): the forward the Gluon family's ``sinks`` variant computes.  Known
    only where the functions are registered in this process (``flashgen.attention`` or
    the tuner traced them)."""
    if not is_user_mods(mods):
        return False
    from ... import user_render

    low = user_render.registered(mods)
    return low is not None and bool(low.sinks) and low.score is None and low.mask is None


def user_functions(mods: str) -> bool:
    """Whether ``mods`` names a forward lowering of user score/mask functions registered
    in this process (with or without sinks): the Gluon forward's ``user`` variants."""
    if not is_user_mods(mods):
        return False
    from ... import user_render

    low = user_render.registered(mods)
    return low is not None and low.direction == "fwd" and (low.score is not None or low.mask is not None)


def user_bwd_lowering(mods: str):
    """The backward lowering of user score/mask functions (a
    :class:`flashgen.user_render.Lowered`) that ``mods`` names, registered in this process,
    when the Gluon backward compiles it (its ``user`` variants, :mod:`.user_bwd`: none read
    at an index computed from the score, :func:`.user_bwd.unsupported`); for the built-in
    mods of :data:`BUILTIN_MODS` their fixed functions' lowering; else None."""
    if mods in BUILTIN_MODS:
        from .builtin_mods import lowering

        return lowering(mods, "bwd")
    if not is_user_mods(mods):
        return None
    from ... import user_render
    from .user_bwd import unsupported

    low = user_render.registered(mods)
    return low if low is not None and low.direction == "bwd" and unsupported(low) is None else None


def user_bwd(mods: str) -> bool:
    """Whether the Gluon backward compiles the user functions ``mods`` names
    (:func:`user_bwd_lowering`)."""
    return user_bwd_lowering(mods) is not None


def user_bwd_default_ahead(low) -> dict[int, str]:
    """The measurements (head_dim -> where) that put the Gluon backward's untuned default
    ahead for backward lowering ``low``: mask functions alone, a score function, or a
    score function with a captured tensor that takes a gradient."""
    if low.score is None:
        return USER_BWD_DEFAULT_AHEAD
    return USER_GRAD_BWD_DEFAULT_AHEAD if low.grads else USER_SCORE_BWD_DEFAULT_AHEAD


def bwd_mask(s) -> str:
    """The mask mode a Gluon backward variant of KernelSpec ``s`` compiles: "window" for
    user mask functions (their block mask's ranges and the window kernel's loops serve
    every built-in mode, as in the forward), else the key's (a score function alone
    keeps it)."""
    return "window" if user_bwd(s.mods) and s.mods.endswith("m") else s.mask


def fwd_spec(key_or_spec) -> C.GluonFwdSpec:
    """The Gluon forward spec of a ProblemKey or KernelSpec: sinks alone are the
    ``sinks`` variant, user functions the ``user`` variant (mask mode "window" with a
    mask function, :func:`.user.compiled_mask`)."""
    s = getattr(key_or_spec, "spec", key_or_spec)
    if s.mods in BUILTIN_MODS and s.kernel != VARLEN_FWD:
        return C.GluonFwdSpec(s.dtype, s.head_dim, s.head_dim_v, s.mask, user=code_name(s.mods, "fwd"))
    if user_functions(s.mods):
        from ... import user_render
        from .user import compiled_mask

        return C.GluonFwdSpec(s.dtype, s.head_dim, s.head_dim_v, compiled_mask(s.mask, s.mods),
                              sinks=user_render.lowered(s.mods).sinks, user=s.mods)
    return C.GluonFwdSpec(s.dtype, s.head_dim, s.head_dim_v, s.mask, sinks=sinks_only(s.mods),
                          varlen=s.kernel == VARLEN_FWD)


@functools.lru_cache(maxsize=4096)
def fwd_config(c: TileConfig) -> C.GluonFwdConfig:
    """The Gluon forward config a TileConfig names (memoized: the launcher's hot path)."""
    nc, ctas = c.num_warps // 4, c.ctas_per_sm or 1
    cr, pr = (c.consumer_regs, c.producer_regs) if c.consumer_regs or c.producer_regs else \
        C.default_regs(nc, ctas) if nc in (1, 2, 3) and ctas in C.CTAS_PER_SM else (0, 0)
    return C.GluonFwdConfig(BLOCK_M=c.BLOCK_M, num_consumers=nc, BLOCK_N=c.BLOCK_N, num_stages=c.num_stages,
                            consumer_regs=cr, producer_regs=pr, pin_exps=bool(c.pin),
                            persistent=int(c.persistent), ctas_per_sm=ctas, snake=bool(c.snake),
                            serial_masked=bool(c.serial_masked), cross_tile=bool(c.cross_tile),
                            o_in_q=bool(c.o_in_q), longest_first=bool(c.longest_first),
                            masked_first=bool(c.masked_first), skip_masked=bool(c.skip_masked))


def _bwd_default_regs(consumers: int) -> tuple[int, int]:
    return (240 if consumers == 2 else B.MAX_REGS), 24


@functools.lru_cache(maxsize=4096)
def bwd_config(c: TileConfig) -> B.GluonBwdConfig:
    """The Gluon backward config a TileConfig names."""
    n = c.num_warps // 4
    cr, pr = (c.consumer_regs, c.producer_regs) if c.consumer_regs or c.producer_regs else _bwd_default_regs(n)
    row_load = _ROW_LOADS[c.row_load] if 0 <= c.row_load < len(_ROW_LOADS) else f"code {c.row_load}"
    return B.GluonBwdConfig(block_m=c.BLOCK_M, block_n=c.BLOCK_N, consumers=n, stages=c.num_stages,
                            dq_mode=_dq_mode(c), consumer_regs=cr, producer_regs=pr,
                            row_load=row_load, producer_warps=c.producer_warps or 1, split=bool(c.split),
                            group_split=c.group_split or 1, half_partials=bool(c.half_partials),
                            dq_stage=B.DQ_STAGES[c.dq_stage] if 0 <= c.dq_stage < len(B.DQ_STAGES)
                            else f"code {c.dq_stage}",
                            kv_store=B.KV_STORES[c.kv_store] if 0 <= c.kv_store < len(B.KV_STORES)
                            else f"code {c.kv_store}", longest_first=bool(c.longest_first),
                            dq_writer=bool(c.dq_writer), dq_chunks=c.dq_chunks or 1, lookahead=c.lookahead)


def _dq_mode(c: TileConfig) -> str:
    """GluonBwdConfig.dq_mode of a TileConfig (dq_ordered with dq_atomic breaks a rule of
    :meth:`GluonFamily.violated_rules`)."""
    return "ordered" if c.dq_ordered else "atomic" if c.dq_atomic else "tma"


def tile_config(g) -> TileConfig:
    """The TileConfig of a GluonFwdConfig or a GluonBwdConfig (register budgets at their
    default split, and other knobs at their default, are stored as 0)."""
    if isinstance(g, C.GluonFwdConfig):
        regs = (g.consumer_regs, g.producer_regs)
        default = C.default_regs(g.num_consumers, g.ctas_per_sm)
        return TileConfig(g.BLOCK_M, g.BLOCK_N, 4 * g.num_consumers, g.num_stages, family=NAME,
                          consumer_regs=0 if regs == default else regs[0],
                          producer_regs=0 if regs == default else regs[1], pin=int(g.pin_exps),
                          persistent=int(g.persistent), ctas_per_sm=0 if g.ctas_per_sm == 1 else g.ctas_per_sm,
                          snake=int(g.snake), serial_masked=int(g.serial_masked), cross_tile=int(g.cross_tile),
                          o_in_q=int(g.o_in_q), longest_first=int(g.longest_first),
                          masked_first=int(g.masked_first), skip_masked=int(g.skip_masked))
    regs = (g.consumer_regs, g.producer_regs)
    default = _bwd_default_regs(g.consumers)
    return TileConfig(g.block_m, g.block_n, 4 * g.consumers, g.stages, family=NAME,
                      consumer_regs=0 if regs == default else regs[0],
                      producer_regs=0 if regs == default else regs[1], dq_atomic=int(g.dq_mode == "atomic"),
                      row_load=_ROW_LOADS.index(g.row_load), producer_warps=0 if g.producer_warps == 1 else
                      g.producer_warps, split=int(g.split), group_split=0 if g.group_split == 1 else g.group_split,
                      half_partials=int(g.half_partials), dq_ordered=int(g.dq_mode == "ordered"),
                      dq_stage=B.DQ_STAGES.index(g.dq_stage),
                      kv_store=B.KV_STORES.index(g.kv_store), longest_first=int(g.longest_first),
                      dq_writer=int(g.dq_writer), dq_chunks=0 if g.dq_chunks == 1 else g.dq_chunks,
                      lookahead=g.lookahead)


def _foreign_knobs(c: TileConfig, allowed: set[str]) -> list[str]:
    return [f"{f.name}={getattr(c, f.name)}: not a knob of this Gluon kernel (must be 0)"
            for f in dataclasses.fields(c) if f.name not in allowed and getattr(c, f.name) != f.default]


class GluonFamily:
    name = NAME
    kernels = ("fwd", WHOLE_BWD, VARLEN_FWD, VARLEN_BWD)
    _launch = None

    # -- what it serves ---------------------------------------------------------------
    def unsupported(self, key: ProblemKey, arch) -> str | None:
        """Why the Gluon family cannot serve ``key`` on ``arch`` (None when it can)."""
        s = key.spec
        if s.kernel not in self.kernels:
            return (f"compiles fwd and the whole backward (bwd: dQ, dK, dV in one launch sequence), not "
                    f"{s.kernel}")
        if arch.name == INTERPRETER.name:
            return "its kernels do not run in Triton's interpreter (CPU)"
        if tuple(arch.compute_capability) != (9, 0):
            return f"built for sm_90 (wgmma, setmaxnreg, TMA as Hopper has them); this is {arch.sm}"
        if s.dtype not in C.DTYPES:
            return f"dtype {s.dtype}: float16 or bfloat16 only"
        if key.layout == "strided":
            return "needs inputs a tensor descriptor can address (layout strided)"
        if s.mods and not (s.kernel == "fwd" and (sinks_only(s.mods) or user_functions(s.mods)
                                                  or s.mods in BUILTIN_MODS)
                           or s.kernel == WHOLE_BWD and user_bwd(s.mods)):
            if is_user_mods(s.mods):
                from ... import user_render
                from .user_bwd import unsupported

                low = user_render.registered(s.mods)
                if low is not None and s.kernel == WHOLE_BWD and unsupported(low) is not None:
                    return (f"user functions {s.mods}: the Gluon whole backward does not take {unsupported(low)}; "
                            "the Triton family's backward serves them")
                return (f"user functions {s.mods}: the Gluon family serves them once registered in this process "
                        "(flashgen.attention or the tuner traced them), in the forward and the whole backward "
                        "(bwd)")
            return (f"score modifications ({s.mods}): the Gluon family's kernels take softcap and alibi (not in a "
                    "ragged batch), not bias or dropout, which are the Triton family's")
        if s.kernel == WHOLE_BWD and s.mods and B.col_split_dim(s.head_dim):
            return (f"score functions ({s.mods}) at head_dim {s.head_dim}: the column-split backward "
                    "program is not built with them")
        if s.mask not in C.MASKS:
            return f"mask {s.mask}: one of {C.MASKS}"
        if s.kernel in FWD_KERNELS:
            if s.head_dim not in C.HEAD_DIMS or s.head_dim_v not in C.HEAD_DIMS:
                return f"head dims ({s.head_dim}, {s.head_dim_v}): the Gluon forward is built for {C.HEAD_DIMS}"
            try:
                C.default_config(fwd_spec(key))
            except ValueError as e:
                return str(e)
        else:
            dims = B.VARLEN_HEAD_DIMS if s.kernel == VARLEN_BWD else B.ALL_HEAD_DIMS
            if s.head_dim not in dims or s.head_dim_v != s.head_dim:
                return (f"head dims ({s.head_dim}, {s.head_dim_v}): the Gluon "
                        f"{'ragged-batch ' if s.kernel == VARLEN_BWD else ''}backward is built for "
                        f"head_dim = head_dim_v in {dims}")
        return _gluon_missing()

    def domain(self, key: ProblemKey) -> dict[str, tuple]:
        """The knob domains; their product filtered by :meth:`violated_rules` is exactly
        :func:`.config.space` (forward) / :func:`.bwd.search_space` (backward, for the
        key's GQA group: ``group_split`` and ``half_partials`` only for a group > 1, the
        split over the group's divisors, so the domain of multi-head keys is what it
        was; at head_dim 256 the column-split program's knobs alone, ``dq_chunks`` among
        them; the forward's BLOCK_M 128 only where its registers can fit, head_dim_v
        64)."""
        if key.spec.kernel in FWD_KERNELS:
            dom = {"BLOCK_M": C.block_ms(key.spec.head_dim_v), "BLOCK_N": (64, 128), "num_warps": (4, 8, 12),
                   "num_stages": (2, 3, 4, 5, 6), "pin": (0, 1), "persistent": (0, 1, 2, 3),
                   "ctas_per_sm": tuple(0 if n == 1 else n for n in C.CTAS_PER_SM), "snake": (0, 1),
                   "serial_masked": (0, 1)}
            if key.spec.kernel == VARLEN_FWD:  # one program per tile: no walk
                del dom["persistent"], dom["snake"]
            return dom
        if key.spec.kernel == VARLEN_BWD:  # the knobs bwd.varlen_reasons leaves (GQA group 1's space)
            return {"BLOCK_M": (64, 128), "BLOCK_N": (64,), "num_warps": (4, 8), "num_stages": (1, 2, 3, 4),
                    "row_load": (0, 1), "split": (0, 1)}
        if B.col_split_dim(key.spec.head_dim):  # the column-split program (bwd.col_split_space)
            return {"BLOCK_M": (64,), "BLOCK_N": (64,), "num_warps": (8,), "num_stages": (1, 2), "dq_atomic": (0, 1),
                    "row_load": (0, 1), "kv_store": (0, 1), "dq_chunks": B.DQ_CHUNK_COUNTS,
                    "lookahead": B.CHECKED_LOOKAHEADS, "split": (0,)}  # the role split: bwd.ROLE_SPLIT_SLOWER
        dom = {"BLOCK_M": (64, 128), "BLOCK_N": (64,), "num_warps": (4, 8), "num_stages": (1, 2, 3, 4),
               "dq_atomic": (0, 1), "row_load": (0, 1), "split": (0, 1), "dq_stage": (0, 1),
               "kv_store": (0, 1)}
        splits = B.group_splits(key.group)
        if len(splits) > 1:
            dom["group_split"] = tuple(0 if s == 1 else s for s in splits)
            dom["half_partials"] = (0, 1)
        return dom

    def refine_domain(self, key: ProblemKey) -> dict[str, tuple]:
        """Knobs outside the search (:meth:`domain`) that ``flashgen tune --refine`` may
        vary around a tuned row: the backward's ``dq_ordered`` (the deterministic
        backward's dQ, measured beside the tuned tile it orders), ``dq_writer`` (its dQ
        writer warp) and, under a mask, ``longest_first`` (its grid's order), and the
        forward's ``cross_tile`` and
        ``o_in_q`` (modes of the walk of 3, :func:`.config.refinement_space`),
        ``longest_first``, ``masked_first`` and its ``skip_masked`` (under a mask)."""
        if key.spec.kernel == "fwd":
            return {k: (0, 1) for k in C.REFINE_KNOBS}
        if key.spec.kernel == VARLEN_FWD:
            return {k: (0, 1) for k in VARLEN_REFINE_KNOBS}
        if key.spec.kernel == VARLEN_BWD:
            return {"dq_writer": (0, 1)}
        if key.spec.kernel != WHOLE_BWD or B.col_split_dim(key.spec.head_dim):
            return {}  # (the column-split program takes none of these)
        return {"dq_ordered": (0, 1), "dq_writer": (0, 1),
                **({"longest_first": (0, 1)} if key.spec.mask != "none" else {})}

    def reconcile(self, key: ProblemKey, config: TileConfig, best: TileConfig, knobs) -> TileConfig:
        """``config``, a neighbour of the tuned row ``best`` of ``key`` in ``knobs`` (those a
        refinement varies), with the backward's ``kv_store`` (when not among ``knobs``)
        moved where it alone keeps the neighbour from being measured: a group split, atomic
        dQ at head_dim 128 or split partitions there take the register stores of dK and
        dV, so refining ``group_split`` or ``dq_atomic`` around a ``_kvt`` row measures
        them; and the unsplit neighbour of a split row, whose register stores the split
        forced, takes the TMA stores (the default) where the rules admit them.

        In the forward, ``ctas_per_sm`` (when not among ``knobs``) goes back to one program
        per SM where it alone keeps the neighbour out: a one-consumer row of two or three
        programs per SM refined in ``num_warps`` reaches the two- and three-consumer tiles
        (whose registers need the whole SM)."""
        if config.family != NAME:
            return config
        if key.spec.kernel in FWD_KERNELS:
            if "ctas_per_sm" in knobs or not config.ctas_per_sm or not self.violated_rules(Variant(key.spec, config)):
                return config
            one = dataclasses.replace(config, ctas_per_sm=0)
            return one if not self.violated_rules(Variant(key.spec, one)) else config
        if "kv_store" in knobs or key.spec.kernel != WHOLE_BWD:
            return config
        if config.group_split <= 1 < best.group_split and not config.kv_store:
            tma = dataclasses.replace(config, kv_store=1)
            return tma if not self.violated_rules(Variant(key.spec, tma)) else config
        if config.kv_store and self.violated_rules(Variant(key.spec, config)):
            ptr = dataclasses.replace(config, kv_store=0)
            return ptr if not self.violated_rules(Variant(key.spec, ptr)) else config
        return config

    def deterministic(self, config: TileConfig) -> bool:
        """Whether ``config``'s whole backward gives bitwise-identical gradients from run
        to run (dK and dV always do; dQ when its adds are ordered)."""
        return bool(config.dq_ordered) and not config.dq_atomic

    def key_reasons(self, key: ProblemKey, config: TileConfig) -> list[str]:
        """Why ``config`` cannot serve ``key``'s sizes, beyond :meth:`violated_rules` (which
        sees the kernel spec alone): a GQA group split that does not divide the key's
        group (:func:`.bwd.group_reasons`; the tuner never writes one, an edited or
        imported row may hold one)."""
        if key.spec.kernel in (WHOLE_BWD, VARLEN_BWD) and config.group_split > 1:
            return B.group_reasons(bwd_config(config), key.group)
        return []

    def violated_rules(self, v: Variant) -> list[str]:
        s, c = v.spec, v.config
        if s.kernel in FWD_KERNELS:
            why = _foreign_knobs(c, _FWD_KNOBS)
            if c.num_warps % 4:
                why.append(f"num_warps={c.num_warps}: 4 per consumer warpgroup")
            for name in ("pin", "snake", "serial_masked", "cross_tile", "o_in_q", "longest_first", "masked_first",
                         "skip_masked"):  # switches: another value would name the same kernel twice
                if getattr(c, name) not in (0, 1):
                    why.append(f"{name}={getattr(c, name)}: 0 (off) or 1 (on)")
            return why + C.check(C.GluonFwdVariant(fwd_spec(s), fwd_config(c)))
        if s.kernel in BWD_KERNELS:
            why = _foreign_knobs(c, _BWD_KNOBS)
            if c.num_warps % 4:
                why.append(f"num_warps={c.num_warps}: 4 per consumer warpgroup")
            if s.head_dim_v != s.head_dim:
                why.append(f"head_dim_v {s.head_dim_v} != head_dim {s.head_dim}")
            if c.dq_ordered and c.dq_atomic:
                why.append("dq_ordered=1 orders the TMA reduce-adds of dQ: it needs dq_atomic=0")
            for name in ("longest_first", "dq_writer"):
                if getattr(c, name) not in (0, 1):
                    why.append(f"{name}={getattr(c, name)}: 0 (off) or 1 (on)")
            if not 0 <= c.row_load < len(_ROW_LOADS):
                why.append(f"row_load={c.row_load}: 0 (TMA), 1 (producer) or 2 (pointer loads)")
                return why
            mask = bwd_mask(s)
            why += B.invalid_reasons(bwd_config(c), s.head_dim, s.dtype, mask)
            if s.mods:
                why += B.user_reasons(bwd_config(c), mask)
            return why + (B.varlen_reasons(bwd_config(c), s.head_dim) if s.kernel == VARLEN_BWD else [])
        return [f"kernel {s.kernel}: the Gluon family compiles {self.kernels}"]

    def estimate(self, v: Variant, arch) -> SmemEstimate:
        s = v.spec
        if s.kernel in FWD_KERNELS:
            g = fwd_config(v.config)
            limit = min(arch.smem_per_block_optin, C.smem_limit(g)) if g.ctas_per_sm in C.CTAS_PER_SM else \
                arch.smem_per_block_optin
            note = f"{g.ctas_per_sm} programs per SM" if g.ctas_per_sm in (2, 3) else ""
            return SmemEstimate(C.smem_terms(fwd_spec(s), g), limit, note)
        return SmemEstimate(B.smem_terms(bwd_config(v.config), B.tile_dim(s.head_dim)), arch.smem_per_block_optin)

    def adapt(self, config: TileConfig, key: ProblemKey) -> TileConfig:
        """A Gluon row of another bucket runs as tuned (its tiles do not depend on the
        sizes), its group_split cut to one that divides ``key``'s GQA group (the largest
        common divisor; the dispatcher's nearest buckets share the group, so only a row
        of another group is changed)."""
        if config.group_split and key.group % config.group_split:
            g = math.gcd(config.group_split, key.group)
            config = dataclasses.replace(config, group_split=0 if g == 1 else g,
                                         half_partials=config.half_partials if g > 1 else 0)
        return config

    def default_config(self, key: ProblemKey, arch) -> TileConfig | None:
        """The Gluon default (:func:`.config.default_config`, :func:`.bwd.default_config`)
        where the family serves ``key``, else None."""
        if self.unsupported(key, arch) is not None:
            return None
        s = key.spec
        if s.kernel == "fwd" and s.mods in BUILTIN_MODS:
            return tile_config(builtin_fwd_default(fwd_spec(s)))
        if s.kernel in FWD_KERNELS:
            return tile_config(C.default_config(fwd_spec(s)))
        if s.kernel == VARLEN_BWD:
            return tile_config(B.varlen_default_config(s.head_dim, s.dtype, s.mask))
        return tile_config(B.default_config(s.head_dim, s.dtype, bwd_mask(s)))

    def large_enough(self, key: ProblemKey) -> bool:
        """Whether ``key``'s size buckets hold enough work (:data:`DEFAULT_MIN_FLOPS`) to
        hide a Gluon launch's host time: below it an untuned key takes neither this
        family's default nor its rows of another (nearest) bucket."""
        s = key.spec
        which = "fwd" if s.kernel in FWD_KERNELS else "bwd"
        return attention_flops(1, key.batch_heads, key.seqlen_q, key.seqlen_k, s.head_dim, s.head_dim_v,
                               causal=s.mask != "none", kernel=which) >= DEFAULT_MIN_FLOPS[which]

    def prefers_default(self, key: ProblemKey, arch) -> str | None:
        """The measurement that puts this family's default ahead of the portable family's
        for an untuned ``key`` (None: the portable default serves it)."""
        if self.unsupported(key, arch) is not None:
            return None
        s = key.spec
        if not self.large_enough(key):
            return None
        if s.kernel == VARLEN_FWD:
            least, seen = FWD_VARLEN_DEFAULT_AHEAD.get(s.mask, (None, None))
            timed = s.head_dim == s.head_dim_v == 128 and least is not None and key.seqlen_q >= least
            return f"H200, {seen} (docs/results/h200/varlen-gluon)" if timed else None
        if s.kernel == "fwd" and s.mods in BUILTIN_MODS:
            checked = s.dtype in BUILTIN_FWD_DEFAULT_DTYPES and s.head_dim == s.head_dim_v
            return BUILTIN_FWD_DEFAULT_AHEAD.get((s.mods, s.head_dim, s.mask)) if checked else None
        if s.kernel == "fwd":
            # the sinks variant has no measurement yet: tuned rows alone pick it
            timed = s.head_dim == s.head_dim_v and s.head_dim in FWD_DEFAULT_HEAD_DIMS and not s.mods
            return FWD_DEFAULT_AHEAD if timed else None
        if s.kernel == VARLEN_BWD:
            seen = BWD_VARLEN_DEFAULT_AHEAD.get((s.head_dim, s.mask))
            return None if seen is None else f"H200, {seen}"
        if s.mods:  # user score/mask functions (user_bwd), softcap, ALiBi: unsupported() refuses the rest
            checked = (s.dtype in USER_BWD_DEFAULT_DTYPES and key.group <= USER_BWD_DEFAULT_MAX_GROUP
                       and key.seqlen_q == key.seqlen_k)
            if s.mods in BUILTIN_MODS:
                return BUILTIN_BWD_DEFAULT_AHEAD.get((s.mods, s.head_dim, s.mask)) if checked else None
            ahead = user_bwd_default_ahead(user_bwd_lowering(s.mods))
            return ahead.get(s.head_dim) if checked and s.head_dim == s.head_dim_v else None
        seen = BWD_DEFAULT_AHEAD.get((s.head_dim, s.mask))
        return None if seen is None else f"H200, {seen}"

    # -- code ---------------------------------------------------------------------------
    def template_hash(self, kernel: str, mods: str = "") -> str:
        """The code id of ``kernel``'s Gluon template (templates/gluon/, :mod:`.code_id`): an
        edit that changes the code of a variant the tuner can record invalidates exactly
        the rows of that kernel's Gluon variants; one that only adds a mode keeps them
        (``fwd_varlen``: :func:`.render.varlen_code_id`)."""
        if kernel == VARLEN_FWD:
            from .render import varlen_code_id

            return "g" + varlen_code_id()[1:]
        if kernel == "fwd":
            from .render import template_hash, user_code_id

            # user variants (sinks alone, or score/mask functions): one id for every
            # lowering, whose own name hashes its code; softcap and ALiBi: their fixed
            # functions' lowering hashed in (the key does not name it)
            if mods in BUILTIN_MODS:
                return _with_lowering(user_code_id(), mods, "fwd")
            return "g" + (user_code_id() if is_user_mods(mods) else template_hash())[1:]
        if kernel == WHOLE_BWD:
            if mods in BUILTIN_MODS:
                return _with_lowering(B.user_code_id(), mods, "bwd")
            return "g" + (B.user_code_id() if is_user_mods(mods) else B.template_hash())[1:]
        if kernel == VARLEN_BWD:
            return "g" + B.varlen_code_id()[1:]
        raise KeyError(f"the Gluon family compiles {self.kernels}, not {kernel!r}")

    def render(self, v: Variant) -> str:
        s = v.spec
        if s.kernel in FWD_KERNELS:
            from .render import render

            return render(C.GluonFwdVariant(fwd_spec(s), fwd_config(v.config)))
        return B.render(bwd_config(v.config), s.dtype, s.head_dim, bwd_mask(s), varlen=s.kernel == VARLEN_BWD,
                        user=code_name(s.mods, "bwd"))

    def load(self, v: Variant):
        """The imported module; :class:`.build.GluonBuildError` (warned once per variant)
        when it does not build on the installed Triton."""
        from . import build

        s = v.spec
        if s.kernel in FWD_KERNELS:
            return build.load_fwd(C.GluonFwdVariant(fwd_spec(s), fwd_config(v.config)))
        return build.load_bwd(bwd_config(v.config), s.dtype, s.head_dim, bwd_mask(s), varlen=s.kernel == VARLEN_BWD,
                              user=code_name(s.mods, "bwd"))

    def launcher(self, name: str):
        """``fwd`` (:func:`fwd`), ``bwd`` (:func:`bwd`, the whole backward),
        ``fwd_varlen`` (:func:`fwd_varlen`) or ``bwd_varlen`` (:func:`bwd_varlen`, the
        whole ragged-batch backward)."""
        if name == "fwd":
            return fwd
        if name == VARLEN_FWD:
            return fwd_varlen
        if name == WHOLE_BWD:
            return bwd
        if name == VARLEN_BWD:
            return bwd_varlen
        raise KeyError(f"the Gluon family launches {self.kernels}, not {name!r}")


def _with_lowering(code_id: str, mods: str, direction: str) -> str:
    """The code id of a built-in ``mods`` variant: ``code_id`` (the user templates') and
    its fixed functions' lowering name (:func:`code_name`) hashed together, so an edit
    of either invalidates the rows of exactly these keys."""
    import hashlib

    return "g" + hashlib.sha256(f"{code_id}/{code_name(mods, direction)}".encode()).hexdigest()[1:len(code_id)]


@functools.lru_cache(maxsize=1)
def _gluon_missing() -> str | None:
    """Why the installed Triton's Gluon cannot build these kernels (None: it can)."""
    from .shim import IMPORT_ERROR

    return None if IMPORT_ERROR is None else f"the installed Triton's Gluon is not usable: {IMPORT_ERROR}"


@functools.cache
def _launch_modules():
    """(build.building, the .launch module), imported on the first launch (this module
    imports neither torch nor triton) and kept: an import statement in the launchers
    costs about a microsecond per call."""
    from . import launch
    from .build import building

    return building, launch


@functools.lru_cache(maxsize=4096)
def _fwd_id(dtype: str, d: int, dv: int, mask: str, g: C.GluonFwdConfig, sinks: bool = False, user: str = "",
            varlen: bool = False, varlen_packed: bool = False) -> str:
    return C.GluonFwdVariant(C.GluonFwdSpec(dtype, d, dv, mask, sinks=sinks, user=user, varlen=varlen,
                                            varlen_packed=varlen_packed), g).id


@functools.lru_cache(maxsize=4096)
def _bwd_id(g: B.GluonBwdConfig, dtype: str, d: int, mask: str, varlen: bool = False, user: str = "") -> str:
    return B.variant_id(g, dtype, d, mask, varlen, user)


def _as_user(mods, q, k, diag_lo: int, diag_hi: int, direction: str):
    """``mods`` as the launchers take them: a :class:`flashgen.ops.ScoreMods` of
    :data:`BUILTIN_MODS` becomes its fixed functions' UserArgs for ``direction`` ("fwd",
    "bwd"; :func:`.builtin_mods.user_args`); anything else is returned as it is."""
    if mods.name in BUILTIN_MODS and not hasattr(mods, "low"):  # UserArgs have a lowering
        from .builtin_mods import user_args

        return user_args(mods, q, k, diag_lo, diag_hi, direction)
    return mods


def fwd(q, k, v, *, softmax_scale: float, mask: str, diag_lo: int, diag_hi: int, config: TileConfig,
        module=None, addressable: bool = False, mods=None, out=None, lse=None):
    """The family's forward launcher, in :func:`flashgen.ops.fwd`'s form: (O, LSE).
    ``addressable=True`` (the dispatcher's key has layout "") skips the input checks of
    :func:`.launch.unsupported`.  ``mods``: None, or the runtime arguments
    (:class:`flashgen.user_mods.UserArgs`) of user functions: sinks alone go to the
    ``sinks`` variant (:func:`sinks_only`), score/mask functions (and their sinks) to the
    ``user`` variant (:func:`user_functions`; ``mask`` is then the built-in mode, the
    variant's own is "window" with a mask function); or a
    :class:`flashgen.ops.ScoreMods` of :data:`BUILTIN_MODS` (their fixed functions'
    ``user`` variant, :mod:`.builtin_mods`).  Raises ValueError for the other built-in
    score mods (the Triton family's)."""
    sinks, user = None, None
    if mods is not None:
        mods = _as_user(mods, q, k, diag_lo, diag_hi, "fwd")
        if user_functions(mods.name):
            from .user import compiled_mask

            user, mask = mods, compiled_mask(mask, mods.name)
            sinks = mods.sinks.contiguous() if mods.low.sinks else None
        elif not sinks_only(mods.name) or getattr(mods, "sinks", None) is None:
            raise ValueError(f"gluon fwd: score modifications ({mods.name}) are the Triton family's")
        else:
            sinks = mods.sinks.contiguous()
    building, launch_mod = _launch_modules()
    g = fwd_config(config)
    # the first launch compiles: a build failure is a GluonBuildError (warned once per variant)
    with building(_fwd_id(launch_mod._DTYPES[q.dtype], q.shape[3], v.shape[3], mask, g, sinks is not None,
                          user.name if user is not None else "")):
        return launch_mod.fwd(q, k, v, softmax_scale=softmax_scale, mask=mask, diag_lo=diag_lo, diag_hi=diag_hi,
                              config=g, out=out, lse=lse, check_inputs=not addressable, module=module, sinks=sinks,
                              user=user)


def bwd(do, q, k, v, o, lse, *, softmax_scale: float, mask: str, diag_lo: int, diag_hi: int, config: TileConfig,
        module=None, addressable: bool = False, mods=None, dq=None, dk=None, dv=None, delta=None):
    """The family's whole backward: (dQ, dK, dV) with the shapes and dtypes of q, k, v
    (:func:`.bwd.attention_bwd`: preprocess, main kernel, dQ convert; dQ accumulated in
    float32 by reduce-add, not bitwise repeatable).  ``delta``, when given (a float32
    tensor like lse), receives rowsum(dO * O) from the preprocess launch (the sinks'
    gradient reads it).  ``mods``: None, or the backward's runtime arguments
    (:class:`flashgen.user_mods.UserArgs`) of user score/mask functions (:func:`user_bwd`;
    ``mask`` is the built-in mode, the variant's own is "window" with a mask function;
    the gradients of captured tensors that take one are added into its zeroed float32
    buffers), or a :class:`flashgen.ops.ScoreMods` of :data:`BUILTIN_MODS` (their fixed
    functions, :mod:`.builtin_mods`); ValueError for the user functions :func:`user_bwd`
    refuses and the other built-in score mods (the Triton family's)."""
    user = None
    if mods is not None:
        mods = _as_user(mods, q, k, diag_lo, diag_hi, "bwd")
        if not user_bwd(mods.name):
            raise ValueError(f"gluon bwd: score modifications ({mods.name}) are the Triton family's (the Gluon "
                             "backward takes no captured tensor read at an index computed from the score)")
        user = mods
        if mods.name.endswith("m"):
            mask = "window"
    building, launch_mod = _launch_modules()
    # dO from autograd may be an expanded view (a sum's gradient); O a slice: the
    # descriptors need 16-byte aligned strides
    do = do if launch_mod._tma_ok(do) else do.contiguous()
    o = o if launch_mod._tma_ok(o) else o.contiguous()
    g = bwd_config(config)
    with building(_bwd_id(g, launch_mod._DTYPES[q.dtype], q.shape[3], mask, user=user.name if user else "")):
        grads = B.attention_bwd(do, q, k, v, o, lse, softmax_scale=softmax_scale, diag_lo=diag_lo,
                                diag_hi=diag_hi, mask=mask, config=g, dq=dq, dk=dk, dv=dv, delta_out=delta,
                                user=user)
    # In the layout of q, k, v (torch.empty_like): the op's contract and its fake kernel
    # under torch.compile, as the Triton family's
    return grads


FAMILY = GluonFamily()
assert FAMILY.name != DEFAULT_FAMILY


def fwd_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *, softmax_scale: float,
               mask: str, win_left: int, win_right: int, config: TileConfig, out=None, lse=None, module=None):
    """The family's ragged-batch forward, in :func:`flashgen.ops.fwd_varlen`'s form: (O,
    LSE) (:func:`.launch.fwd_varlen`).  With ``module`` (the library's call: the
    dispatcher chose this family for the key) the launcher skips its input checks."""
    building, launch_mod = _launch_modules()
    g = fwd_config(config)
    # (a dtype or rank the launcher refuses is named by its ValueError, not a KeyError here);
    # a skewed batch builds the config's packed twin (launch.varlen_slots)
    layout = launch_mod.varlen_slots(q.shape[0], cu_seqlens_q.shape[0] - 1, max_seqlen_q,
                                     g.BLOCK_M * g.num_consumers) if q.dim() == 3 else None
    with building(_fwd_id(launch_mod._DTYPES.get(q.dtype, str(q.dtype)), q.shape[-1], v.shape[-1], mask, g,
                          varlen=True, varlen_packed=bool(layout and layout[1]))):
        return launch_mod.fwd_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                     softmax_scale=softmax_scale, mask=mask, win_left=win_left, win_right=win_right,
                                     config=g, out=out, lse=lse, module=module, check_inputs=module is None,
                                     layout=layout)


def bwd_varlen(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
               softmax_scale: float, mask: str, win_left: int, win_right: int, config: TileConfig, module=None,
               dq=None, dk=None, dv=None):
    """The family's whole ragged-batch backward, in :func:`flashgen.ops.bwd_varlen`'s form:
    (dQ, dK, dV) like q, k, v (:func:`.bwd.attention_bwd_varlen`; dQ accumulated in
    float32 by reduce-add, not bitwise repeatable).  Tensors a descriptor cannot address
    (dO from autograd may be an expanded view) are copied.  With ``module`` (the
    library's call: the dispatcher chose this variant for the key) the config's rules are
    not checked again."""
    building, launch_mod = _launch_modules()
    ok = launch_mod._tma_ok
    do, q, k, v, o = (t if ok(B._packed4(t)) else t.contiguous() for t in (do, q, k, v, o))
    g = bwd_config(config)
    with building(_bwd_id(g, launch_mod._DTYPES.get(q.dtype, str(q.dtype)), q.shape[-1], mask, True)):
        return B.attention_bwd_varlen(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      softmax_scale=softmax_scale, win_left=win_left, win_right=win_right,
                                      mask=mask, config=g, dq=dq, dk=dk, dv=dv, module=module,
                                      check=module is None)

"""Gluon attention backward for Hopper (sm_90): knobs, validity rules, the shared-memory
and register model, rendering, loading and the launcher.

Three launches make one backward (``attention_bwd``):

1. ``attn_bwd_preprocess``: delta = rowsum(dO * O) and LSE2 = LSE * log2(e) (float32,
   (z * h, m_pad) with m_pad = seqlen_q rounded up to ROW_PAD, 0 in the padding), and a
   zeroed float32 dQ accumulator;
2. ``attn_bwd``: one program per ``block_n * consumers`` key rows of one (batch, kv
   head), warp-specialized (a TMA producer warp, ``consumers`` warpgroups, in one
   lock-step partition or, ``split``, one partition each; at head_dim 256, ``col_split``,
   one program per ``block_n`` key rows whose two warpgroups split the head_dim
   columns); writes dK and dV (summed over the GQA group) and adds each step's dQ
   tile into the accumulator (``dq_mode`` "tma": TMA reduce-add; "atomic": atomics);
3. ``attn_bwd_convert``: dQ = accumulator * softmax_scale in the inputs' dtype.

dQ is accumulated in float32 in an order that varies from run to run (not bit-wise
deterministic); dK and dV are deterministic.

Layout contract (as :func:`flashgen.ops.bwd`): q, do, o (batch, num_heads, seqlen_q,
head_dim); k, v (batch, num_kv_heads, seqlen_k, head_dim); float16 or bfloat16, last
stride 1; lse float32 (batch, num_heads, seqlen_q), natural log, -inf for a row that
sees no key.  Query i sees key j iff diag_lo <= j - i <= diag_hi (flashgen.masks).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import math
from pathlib import Path

import jinja2

from ... import plans
from ...fastlaunch import launch
from .code_id import CodeId, extension_of
from .config import L2_SECTION_BYTES, largest_divisor, pad

TEMPLATE = "gluon/attn_bwd.py.j2"
DTYPES = ("float16", "bfloat16")
MASKS = ("none", "causal", "window")
DQ_MODES = ("tma", "atomic", "ordered")
#: The dQ modes the tuner searches; "ordered" (bitwise repeatable) serves the
#: deterministic backward (:func:`ordered`).
SEARCH_DQ_MODES = ("tma", "atomic")
ROW_LOADS = ("tma", "producer", "ptr")
#: How the dQ tile is staged in shared memory for its TMA reduce-add.
DQ_STAGES = ("swizzled", "fragment")
#: How dK and dV leave the main kernel: the consumers' stores from registers ("ptr"), or
#: through their rows of K and V in shared memory by TMA stores ("tma").
KV_STORES = ("ptr", "tma")
#: LSE2 / delta rows are padded to a multiple of this (the largest block_m): every
#: (1, block_m) box and every pointer load of a query block stays in the buffer, and the
#: 2-D descriptor's row stride (ROW_PAD * 4 bytes) is 16-byte aligned as TMA requires.
ROW_PAD = 128
HEAD_DIMS = (64, 96, 128)
#: The head dims whose dK and dV accumulators fit a warpgroup only split over the
#: columns (``col_split``; 2 x 64 x 256 float32 per warpgroup would be 256 registers a
#: thread).
COL_SPLIT_HEAD_DIMS = (256,)
#: Every head dim the Gluon backward serves: HEAD_DIMS on the tiles of one or two
#: warpgroups of key rows each, COL_SPLIT_HEAD_DIMS on the column-split program.
ALL_HEAD_DIMS = HEAD_DIMS + COL_SPLIT_HEAD_DIMS
#: dQ column chunks of a ``col_split`` program.
DQ_CHUNK_COUNTS = (2, 4)


def tile_dim(head_dim: int) -> int:
    """The tiles' width for ``head_dim``: the next power of two (96 -> 128).  A padded
    variant computes on zero columns past head_dim: the copy engine fills them on each
    load and clips each store, and the pointer accesses (O and dO in the preprocess, dQ in
    the convert, the register stores of dK and dV) mask them; the dQ accumulator is
    tile_dim wide.  The forward's padding rule (:func:`.config.pad`)."""
    return pad(head_dim)


def col_split_dim(head_dim: int) -> bool:
    """Whether ``head_dim`` runs on the column-split program (its tiles' width is one of
    :data:`COL_SPLIT_HEAD_DIMS`)."""
    return tile_dim(head_dim) in COL_SPLIT_HEAD_DIMS


#: Shared memory per block (opt-in) and registers per SM on sm_90.
SMEM_LIMIT_BYTES = 232448
REGS_PER_SM = 65536
#: The most registers per thread a launch or setmaxnreg gives (ptxas allocates at most
#: 255; setmaxnreg takes multiples of 8).
MAX_REGS = 248
#: Rows per program of the preprocess and convert kernels.
PRE_ROWS = 64
#: The most programs that may share one kv head's GQA group (group_split).
MAX_GROUP_SPLIT = 16
#: CUDA's limit on grid axis 1 (batch * num_kv_heads * group_split programs).
MAX_GRID_Y = 65535
_SHORT = {"float16": "fp16", "bfloat16": "bf16"}


@dataclasses.dataclass(frozen=True)
class GluonBwdConfig:
    """Knobs of the Gluon backward.

    block_m:        query rows per step (the streamed Q / dO tile), 64 or 128.
    block_n:        key rows per consumer warpgroup (64; with ``col_split``, of the program,
                    shared by its two warpgroups).
    consumers:      warpgroups in the consumer partition (1 or 2); the program owns
                    block_n * consumers key rows, resident in shared memory.
    stages:         depth of the Q / dO / LSE2 / delta ring (1 to 4).
    dq_mode:        "tma" (TMA reduce-add of each dQ tile from shared memory),
                    "atomic" (float32 atomics from registers) or "ordered" (as "tma", the
                    adds into each dQ tile made in the order of the key blocks, through
                    int32 semaphores: dQ bitwise repeatable).
    consumer_regs:  setmaxnreg budget of each consumer thread (multiple of 8, 24..248).
    producer_regs:  setmaxnreg budget of each producer thread.
    row_load:       how LSE2 and delta reach the consumers: "tma" (the producer's 2-D TMA
                    copies, box (1, block_m), into the ring; a 1-D copy faulted on the
                    H200), "producer" (the producer's pointer loads, stored into the ring
                    before its second arrival on the slot's ready barrier) or "ptr" (the
                    consumers load them from global memory).
    producer_warps: warps of the producer partition (1 or 4; it occupies a warpgroup
                    either way).
    split:          each consumer warpgroup is a partition of its own (they drift apart;
                    each has its own dS^T tile and dQ reduce-add), instead of one
                    lock-step partition of 4 * consumers warps.
    group_split:    programs that share one kv head's GQA group (1 to MAX_GROUP_SPLIT,
                    dividing num_heads // num_kv_heads): each takes group // group_split
                    query heads and writes float32 partial sums of dK and dV (dK not
                    yet scaled) into a (batch, num_kv_heads, group_split, seqlen_k,
                    head_dim) scratch that a reduction kernel sums in split order,
                    scales and casts (:mod:`.reduce`); 1: one program per kv head
                    writes dK and dV itself.
    half_partials:  with group_split > 1, the partials in the inputs' 16-bit dtype, dK
                    scaled (each rounded once, as PyTorch's own GQA backward rounds each
                    query head's dK and dV before summing them): half the scratch bytes.
    dq_stage:       how the dQ tile of a TMA reduce-add ("tma", "ordered") is staged in
                    shared memory: "swizzled" (row-major with the 128-byte swizzle, the
                    descriptor's default; 8-byte stores, two shared-memory wavefronts per
                    half-warp) or "fragment" (the wgmma accumulator's own order,
                    FlashAttention-3's: 16-byte stores without bank conflicts, copied
                    as it is into a float32 accumulator whose block_m-row tiles are in
                    that order, (batch * num_heads, m_pad, head_dim); the convert kernel
                    reads them back in that order).
    kv_store:       how dK and dV leave (:data:`KV_STORES`; "tma" only without a group
                    split, whose partials take the register stores).
    longest_first:  under a causal or window mask, a 1-D grid that starts the key blocks
                    that see the most query blocks first across a section of (batch, kv
                    head) pairs (:func:`ordered_program`'s arithmetic with the section as its
                    group of pairs, :func:`longest_first_section`)
                    instead of one pair's key blocks after another's, so the hardware
                    scheduler's last programs are short ones; not with the ordered dQ (its
                    own 1-D grid orders the adds).
    dq_chunks:      1, or one of :data:`DQ_CHUNK_COUNTS` for the column-split program
                    (the ``col_split`` property; head_dim 256, :data:`COL_SPLIT_HEAD_DIMS`):
                    the one consumer partition's two warpgroups share ``block_n`` key rows
                    and split the columns, each holding half of the head_dim columns of dK,
                    dV and dQ and half of the query columns of S^T and dP^T; P^T and dS^T
                    pass between them through shared memory as the A operands of the dV
                    and dK products; the program owns ``block_n`` key rows (not
                    ``block_n * consumers``), and dQ is made and added in ``dq_chunks``
                    column chunks, each staged in one float32 tile of ``block_m`` x
                    head_dim / dq_chunks for its TMA reduce-add (or added by atomics).
    dq_writer:      the dQ tiles leave through a one-warp writer partition
                    (FlashAttention-3's dQ writer warp): each consumer partition stores
                    its step's tile into one of two staging buffers, taken in turn, and
                    signals an mbarrier; the writer (in the ordered mode: waits on the
                    tile's semaphore,) issues the reduce-add, waits for it (ordered:
                    until it has completed, then releases the semaphore) and frees the
                    buffer.  The consumers' steps then hold no wait on a reduce-add and
                    no semaphore; twice the dQ staging memory.  With dq_mode "tma" or
                    "ordered" and a one-warp producer (whose warpgroup the writer's warp
                    shares), not with the column halves of split partitions at
                    head_dim 128.
    lookahead:      0; with ``col_split``, each step issues the next step's S^T and
                    dP^T (waiting on its ring slot, so ``stages`` >= 2) during its dQ
                    chunks, so the tensor cores run them while the chunks go out; they are
                    retired within the step and carried into the next one, which starts
                    at its softmax.  1 (``_la1``): both right after dK, retired with the
                    first chunk's wait; 2 (``_la2``): S^T behind dQ chunk 1 and dP^T
                    behind chunk 2 (``dq_chunks`` 4), interleaved with the chunks.
                    Searched with dQ by TMA reduce-add; with atomic dQ refused as
                    measured slower (:data:`ATOMIC_LOOKAHEAD_SLOWER`).
    """

    block_m: int = 64
    block_n: int = 64
    consumers: int = 2
    stages: int = 2
    dq_mode: str = "tma"
    consumer_regs: int = 240
    producer_regs: int = 24
    row_load: str = "ptr"
    producer_warps: int = 1
    split: bool = False
    group_split: int = 1
    half_partials: bool = False
    dq_stage: str = "swizzled"
    kv_store: str = "ptr"
    longest_first: bool = False
    dq_writer: bool = False
    dq_chunks: int = 1
    lookahead: int = 0

    @property
    def col_split(self) -> bool:
        """The column-split program (``dq_chunks`` > 1)."""
        return self.dq_chunks > 1

    @property
    def block_nt(self) -> int:
        """Key rows per program."""
        return self.block_n if self.col_split else self.block_n * self.consumers

    @property
    def parts(self) -> int:
        """Consumer partitions."""
        return self.consumers if self.split else 1

    @property
    def role_split(self) -> bool:
        """The column-split program in two role-split partitions (``col_split`` and
        ``split``): partition 0 makes S^T and P^T, partition 1 dP^T and dS^T."""
        return self.col_split and self.split

    @property
    def part_rows(self) -> int:
        """Key rows of one consumer partition (the column-split program's partitions
        share all of the program's)."""
        return self.block_nt if self.col_split else self.block_nt // self.parts

    @property
    def num_warps(self) -> int:
        """Warps of the default partition (the first consumer partition); the other
        consumer partitions and the producer's warpgroup add theirs."""
        return 4 * self.consumers // self.parts

    @property
    def maxnreg(self) -> int:
        """Launch register cap: the register file split evenly over every warpgroup of
        the block (the producer's warp occupies a warpgroup of its own), rounded down to
        a multiple of 8; setmaxnreg then moves registers from the producer to the
        consumers."""
        warps = 4 * self.consumers + 4
        return min(MAX_REGS, REGS_PER_SM // (32 * warps) // 8 * 8)

    @property
    def id(self) -> str:
        return (f"m{self.block_m}_n{self.block_n}_c{self.consumers}_s{self.stages}_{self.dq_mode}"
                f"_r{self.consumer_regs}-{self.producer_regs}"
                + ("" if self.row_load == "ptr" else f"_rows-{self.row_load}")
                + ("" if self.producer_warps == 1 else f"_p{self.producer_warps}")
                + ("_split" if self.split else "")
                + ("" if self.group_split == 1 else f"_gs{self.group_split}")
                + ("h" if self.half_partials else "")
                + {"swizzled": "", "fragment": "_dqf"}.get(self.dq_stage, f"_dq-{self.dq_stage}")
                + {"ptr": "", "tma": "_kvt"}.get(self.kv_store, f"_kv-{self.kv_store}")
                + ("_lpt" if self.longest_first else "")
                + ("_dqw" if self.dq_writer else "")
                + (f"_cs{self.dq_chunks}" if self.col_split else "")
                + (f"_la{self.lookahead}" if self.lookahead else ""))


def variant_id(config: GluonBwdConfig, dtype: str, head_dim: int, mask: str, varlen: bool = False,
               user: str = "") -> str:
    """One identity string: the generated file, the module cache entry and the log line
    (``varlen``: the ragged-batch variant, ``_varlen`` at the end; ``user``: a user mask
    function's lowering, after the mask as in the forward's ids)."""
    mask = f"{mask}_{user}" if user else mask
    return f"gluon_bwd_d{head_dim}_{_SHORT.get(dtype, dtype)}_{mask}_{config.id}" + ("_varlen" if varlen else "")


def smem_terms(config: GluonBwdConfig, head_dim: int, elem_bytes: int = 2) -> dict[str, int]:
    """Shared memory of the main kernel, bytes per named buffer (the barriers included)."""
    c = config
    terms = {
        "k": c.block_nt * head_dim * elem_bytes,
        "v": c.block_nt * head_dim * elem_bytes,
        "q_ring": c.stages * c.block_m * head_dim * elem_bytes,
        "do_ring": c.stages * c.block_m * head_dim * elem_bytes,
        "lse_delta_ring": 2 * c.stages * c.block_m * 4 if c.row_load != "ptr" else 0,
        "ds": c.block_nt * c.block_m * elem_bytes,
        "p": c.block_nt * c.block_m * elem_bytes if c.col_split else 0,
        "dq_tile": (2 if c.dq_writer else 1) * c.parts * c.block_m * head_dim * 4 // max(1, c.dq_chunks)
        if c.dq_mode in ("tma", "ordered") else 0,
        # the writer's full/empty barrier pairs: two arrays, each 128-byte aligned (ptxas:
        # 112-120 B above its 8 B per barrier with one or two consumer partitions)
        # (role_split: its four hand-off barriers, 32 B, ptxas allocating 168 B for them)
        "barriers": 8 * (1 + 2 * c.stages) + (256 if c.dq_writer else 0) + (168 if c.role_split else 0),
        # (col_split: 16 more, ptxas allocating 4 B over the rest at one stage)
        "alignment": 256 + (16 if c.col_split else 0),
    }
    return terms


def smem_bytes(config: GluonBwdConfig, head_dim: int) -> int:
    return sum(smem_terms(config, head_dim).values())


#: Why the column-split program's role split (``col_split`` with ``split``) is refused:
#: it passed its float64 checks on the GPU (worst 0.30 of the rule, bf16 and float16,
#: every mask) and measured 0.75-0.92x the speed of the lock-step column-split program
#: at every head_dim 256 shape (H100, ``benchmarks/gluon_bwd.py --wide --unchecked``;
#: docs/design.md, the Gluon backward), so no tuner trial is spent on it.
ROLE_SPLIT_SLOWER = ("col_split with split (the role split) measured slower than the lock-step column-split "
                     "program at every head_dim 256 shape (0.75-0.92x; its float64 checks pass); not served")
#: ``lookahead`` values: off; the next step's S^T and dP^T after dK; interleaved with
#: the dQ chunks.
LOOKAHEADS = (0, 1, 2)
#: The ``lookahead`` values whose variants have passed their float64 checks on the GPU,
#: with dQ by TMA reduce-add (with atomic dQ: :data:`ATOMIC_LOOKAHEAD_SLOWER`); the family's domain
#: searches these.  Measured 0.97-1.03x the default causal, 0.93-0.96x without a mask
#: (H100; the tuner picks per key).
CHECKED_LOOKAHEADS = (0, 1, 2)


#: The words of the rules that refuse a variant only because its float64 checks have not
#: run on the GPU yet (it compiles for sm_90 cleanly); ``col_split_space(unchecked=True)``
#: lists them for ``benchmarks/gluon_bwd.py --wide --unchecked``, which runs those checks.
#: Admitting one adds a code-id extension (:data:`EXTENSIONS`) listed before
#: "col_split", so the shipped rows' code id stays.
NOT_CHECKED = "has not been checked on the GPU"
#: Column-split variants whose float64 checks pass on the GPU but which measured slower
#: than the default, or level with it at best, at the head_dim 256 shapes (H200, ``python
#: -m benchmarks gluon-unchecked``, docs/results/h200/gluon_bwd/unchecked/): the rules
#: refuse them, so
#: no tuner trial is spent on them; ``col_split_space(unchecked=True)`` still lists them
#: for that benchmark to measure again.
ATOMIC_LOOKAHEAD_SLOWER = ("lookahead with dq_mode 'atomic' measured 0.92-0.96x the default at every head_dim 256 "
                           "shape (its float64 checks pass); use dq_mode 'tma'")
ATOMIC_KV_TMA_SLOWER = ("kv_store 'tma' with dq_mode 'atomic' at head_dim 256 measured 0.75-1.02x the default "
                        "(its float64 checks pass; level at best); use the register stores or the TMA reduce-add")
#: The refusals that name a measurement, not a rule of the hardware or the kernel.
MEASURED_SLOWER = (ROLE_SPLIT_SLOWER, ATOMIC_LOOKAHEAD_SLOWER, ATOMIC_KV_TMA_SLOWER)


#: Registers over its budget a lock-step partition's modeled demand may be: BLOCK_M 128
#: at head_dim 64 (model 256 against 240) spills 36 B without a mask and 76 B causal
#: under Triton 3.6's ptxas, and on the H200 measured 1.11x the default tile without a
#: mask and 1.02-1.03x causal (docs/results/h200/gluon_bwd/d64-tiles/).  Split
#: partitions get none: the same tile split serializes its wgmmas (ptxas C7512).
LOCKSTEP_SPILL_SLACK_REGS = 16


def consumer_regs_estimate(config: GluonBwdConfig, head_dim: int) -> int:
    """Registers per consumer thread the kernel needs at its peak (a model, checked
    against ptxas by tests/test_gluon_bwd.py): the dK and dV accumulators (float32,
    block_n x head_dim per warpgroup) live throughout; S^T and dP^T (float32) with
    P^T (16-bit) at the dS^T step, or the dQ tile (float32, split over the
    consumers of a lock-step partition, whole in each split partition) with the 16-bit
    P^T and dS^T operands of the in-flight wgmmas; plus about 32 for addresses, indices
    and the loop state.  ``col_split``: every tile spread over both warpgroups (256
    threads): dK and dV, then the larger of (S^T, dP^T and the 16-bit P^T before its
    store) and (two dQ chunks in flight with S^T's share; ``lookahead``: and the next
    step's S^T and dP^T), + 32."""
    c = config
    per_wg = 128  # threads of one warpgroup
    if c.role_split:
        # a partition of one warpgroup: its halves of dK and dV; S^T with the 16-bit P^T
        # (partition 0), or dP^T with P^T read back and the 16-bit dS^T (partition 1: the
        # larger); or two dQ chunks of its columns in flight
        st = c.block_n * c.block_m // per_wg
        dq = c.block_m * head_dim // max(1, c.dq_chunks) // per_wg
        return 2 * c.block_n * (head_dim // 2) // per_wg + max(2 * st + st // 2, 2 * dq) + 32
    if c.col_split:
        # every tile over both warpgroups (256 threads): dK, dV; S^T, dP^T, the 16-bit P^T
        # before its store; two dQ chunks in flight
        threads = 2 * per_wg
        st = c.block_n * c.block_m // threads
        dq = c.block_m * head_dim // max(1, c.dq_chunks) // threads
        ahead = 2 * st if c.lookahead else 0
        return 2 * c.block_n * head_dim // threads + max(2 * st + st // 2, 2 * dq + st + ahead) + 32
    acc = 2 * c.block_n * head_dim // per_wg
    st = c.block_n * c.block_m // per_wg
    op16 = st // 2
    dq = c.block_m * head_dim // (per_wg * c.consumers // c.parts)
    if c.split and c.dq_mode in ("tma", "ordered") and head_dim >= 128:
        dq //= 2  # two column halves
    return acc + max(2 * st + op16, dq + 2 * op16) + 32


def invalid_reasons(config: GluonBwdConfig, head_dim: int, dtype: str = "bfloat16", mask: str = "none") -> list[str]:
    """Why ``config`` cannot serve (head_dim, dtype, mask); empty when it can.  Each rule
    mirrors a constraint of the template or of the hardware."""
    c, out = config, []
    if dtype not in DTYPES:
        out.append(f"dtype {dtype!r} is not one of {DTYPES}")
    if mask not in MASKS:
        out.append(f"mask {mask!r} is not one of {MASKS}")
    if head_dim not in ALL_HEAD_DIMS:
        out.append(f"head_dim {head_dim} is not one of {ALL_HEAD_DIMS} (gl.arange needs a power of two, 96 is "
                   "padded to 128; wgmma n = head_dim)")
    elif (head_dim in COL_SPLIT_HEAD_DIMS) != bool(c.col_split):
        out.append(f"col_split {c.col_split} (dq_chunks {c.dq_chunks}) at head_dim {head_dim}: the column split "
                   f"is for head_dim {COL_SPLIT_HEAD_DIMS} (a warpgroup's dK and dV of 64 x 256 float32 need 256 "
                   "registers a thread unsplit), and only there")
    if c.col_split:
        if c.consumers != 2:
            out.append("col_split needs 2 consumers: its two warpgroups split the columns")
        if c.split:
            # the role split: built with atomic dQ and register stores of dK and dV
            for knob, on in (("dq_mode 'tma'", c.dq_mode != "atomic"), ("kv_store 'tma'", c.kv_store != "ptr"),
                             ("lookahead", bool(c.lookahead))):
                if on:
                    out.append(f"col_split with split (the role split) and {knob}: not built (its partitions add "
                               "their dQ columns by atomics and store dK and dV from registers)")
            out.append(ROLE_SPLIT_SLOWER)
        if c.block_m != 64:
            out.append(f"col_split needs block_m 64 (got {c.block_m}): the Q and dO ring of 256-wide tiles")
        if c.dq_mode not in ("tma", "atomic"):
            out.append(f"col_split adds dQ by TMA reduce-add or atomics (dq_mode 'tma' or 'atomic', got "
                       f"{c.dq_mode!r}); the deterministic backward at head_dim 256 is the Triton family's")
        for knob, on in (("dq_writer", c.dq_writer), ("longest_first", c.longest_first),
                         ("group_split > 1", c.group_split > 1), ("dq_stage 'fragment'", c.dq_stage != "swizzled")):
            if on:
                out.append(f"col_split with {knob}: not built (the column-split program stages its dQ chunks "
                           "itself, sums the GQA group in the program and takes the 2-D grid)")
    if c.lookahead not in LOOKAHEADS:
        out.append(f"lookahead {c.lookahead!r} is not one of {LOOKAHEADS}")
    elif c.lookahead == 2 and c.dq_chunks != 4:
        out.append(f"lookahead 2 issues the next step's dP^T behind dQ chunk 2 of 4 (dq_chunks 4, got "
                   f"{c.dq_chunks})")
    if c.lookahead and not c.col_split:
        out.append("lookahead is built for the column-split program only (dq_chunks 2 or 4, head_dim 256)")
    if c.lookahead and c.stages < 2:
        out.append(f"lookahead needs stages >= 2 (got {c.stages}): the next step's tile is read while this "
                   "step's slot is still in use")
    if c.lookahead and c.col_split and c.lookahead not in CHECKED_LOOKAHEADS:
        out.append(f"lookahead {NOT_CHECKED}")
    elif c.lookahead and c.col_split and c.dq_mode == "atomic" and c.kv_store == "ptr":
        # compiled without spills or C751x under Triton 3.6 and 3.9 (tests/test_gluon_bwd.py)
        out.append(ATOMIC_LOOKAHEAD_SLOWER)
    if c.dq_chunks not in (1, *DQ_CHUNK_COUNTS):
        out.append(f"dq_chunks {c.dq_chunks} must be 1 (dQ whole or in halves) or one of {DQ_CHUNK_COUNTS} (the "
                   "column-split program)")
    requested, head_dim = head_dim, tile_dim(head_dim) if head_dim in ALL_HEAD_DIMS else head_dim
    first_tile_rule = len(out)  # the rules below are the tiles' (head_dim 96: 128)
    if c.block_m not in (64, 128):
        out.append(f"block_m {c.block_m} must be 64 or 128 (the dQ wgmma's M is at least one warpgroup's 64 rows)")
    if c.block_n != 64:
        out.append(f"block_n {c.block_n} must be 64 (one wgmma M tile per consumer warpgroup)")
    if c.consumers not in (1, 2):
        out.append(f"consumers {c.consumers} must be 1 or 2 (the partition's warp count is a power of two)")
    if not 1 <= c.stages <= 4:
        out.append(f"stages {c.stages} must be 1 to 4")
    if c.row_load not in ROW_LOADS:
        out.append(f"row_load {c.row_load!r} is not one of {ROW_LOADS}")
    if c.producer_warps not in (1, 4):
        out.append(f"producer_warps {c.producer_warps} must be 1 or 4")
    if c.split and c.consumers != 2:
        out.append(f"split needs 2 consumers (got {c.consumers}): one 4-warp partition each")
    if c.dq_mode not in DQ_MODES:
        out.append(f"dq_mode {c.dq_mode!r} is not one of {DQ_MODES}")
    if not (isinstance(c.group_split, int) and 1 <= c.group_split <= MAX_GROUP_SPLIT):
        out.append(f"group_split {c.group_split!r} must be a whole number in 1..{MAX_GROUP_SPLIT} (programs per kv "
                   "head's GQA group)")
    if c.dq_mode == "ordered" and c.split and head_dim >= 128:
        # the semaphore state on top of the split d128 tile's 240 registers: ptxas (Triton
        # 3.6) spills 56 B and serializes the wgmmas (C7512); the lock-step tile does not
        out.append("dq_mode 'ordered' with split partitions at head_dim 128 runs out of registers (ptxas spills "
                   "and serializes the wgmmas); use the lock-step partition")
    if c.dq_mode == "ordered" and c.split and c.stages < 2:
        # partition 1 waits (inside its step) for partition 0's release of the same step's
        # tile, made at partition 0's next step, whose ring slot partition 1 holds
        out.append("dq_mode 'ordered' with split partitions needs stages >= 2 (with one ring slot the second "
                   "partition's wait and the first one's next step wait on each other)")
    if c.dq_stage not in DQ_STAGES:
        out.append(f"dq_stage {c.dq_stage!r} is not one of {DQ_STAGES}")
    elif c.dq_stage != "swizzled" and c.dq_mode == "atomic":
        out.append(f"dq_stage {c.dq_stage!r} stages dQ for a TMA reduce-add; dq_mode 'atomic' adds from registers")
    elif c.dq_stage == "fragment" and c.split and head_dim >= 128:
        # the two column halves' stores into the fragment-ordered tile: ptxas (Triton 3.6)
        # spills 20 B against 4 B for the swizzled tile
        out.append(f"dq_stage {c.dq_stage!r} with split partitions at head_dim 128 (dQ in two column halves) "
                   "spills; use the lock-step partition or dq_stage 'swizzled'")
    if c.kv_store not in KV_STORES:
        out.append(f"kv_store {c.kv_store!r} is not one of {KV_STORES}")
    elif c.kv_store == "tma" and c.group_split > 1:
        out.append("kv_store 'tma' stores dK and dV themselves; a group split's partials take the register stores")
    elif c.kv_store == "tma" and c.parts > 1 and head_dim * 2 > 128:
        # a split partition's rows are a slice of the K/V tile, whose 128-byte swizzle
        # stores rows wider than 128 bytes as column blocks: the slice is not contiguous
        # (Triton 3.9 refuses the reinterpret; 3.6 compiles it without that check)
        out.append(f"kv_store 'tma' with split partitions at head_dim {head_dim}: a partition's rows of K and V "
                   "are not contiguous in shared memory (column blocks of the 128-byte swizzle); use the "
                   "lock-step partition or the register stores")
    elif c.kv_store == "tma" and c.dq_mode == "atomic" and c.col_split:
        # ptxas (Triton 3.6) compiles these without spills; the column-split program's
        # atomic dQ is served with the register stores
        out.append(ATOMIC_KV_TMA_SLOWER)
    elif c.kv_store == "tma" and c.dq_mode == "atomic" and head_dim >= 128:
        # the atomic dQ's epilogue with the TMA stores: ptxas (Triton 3.6) spills 40 B
        # (causal, rows by the producer), against none with the register stores
        out.append("kv_store 'tma' with dq_mode 'atomic' at head_dim 128 spills; use the register stores or the "
                   "TMA reduce-add")
    if c.longest_first and mask == "none":
        out.append("longest_first orders key blocks by the query blocks that see them: without a mask every key "
                   "block sees all of them")
    if c.longest_first and c.dq_mode == "ordered":
        out.append("longest_first with dq_mode 'ordered': the ordered dQ's own 1-D grid orders the programs (the "
                   "order of its adds)")
    if c.dq_writer and c.dq_mode not in ("tma", "ordered"):
        out.append(f"dq_writer issues TMA reduce-adds: dq_mode 'tma' or 'ordered' (got {c.dq_mode!r})")
    elif c.dq_writer and c.producer_warps != 1:
        # the writer's warp shares the one-warp producer's warpgroup; beside a 4-warp
        # producer it takes a warpgroup of its own (16 warps at two consumers), which the
        # launch cap (maxnreg, 12 warps) and the register budgets do not count
        out.append(f"dq_writer needs producer_warps 1 (got {c.producer_warps}): the writer's warp shares the "
                   "producer's warpgroup")
    elif c.dq_writer and c.split and head_dim >= 128:
        out.append("dq_writer with split partitions at head_dim 128: their dQ is computed and staged in two column "
                   "halves around the dK product; use the lock-step partition")
    if c.half_partials and c.group_split == 1:
        out.append("half_partials needs group_split > 1 (without a split there are no partials)")
    for name, r in (("consumer_regs", c.consumer_regs), ("producer_regs", c.producer_regs)):
        if r % 8 or not 24 <= r <= MAX_REGS:
            out.append(f"{name} {r} must be a multiple of 8 in 24..{MAX_REGS} (setmaxnreg)")
    if c.consumers in (1, 2):
        total = 32 * (4 * c.consumers * c.consumer_regs + 4 * c.producer_regs)
        if total > REGS_PER_SM:
            out.append(f"register budgets need {total} registers per block, more than the SM's {REGS_PER_SM}")
        if c.consumer_regs < c.maxnreg or c.producer_regs > c.maxnreg:
            out.append(f"setmaxnreg moves registers from the producer to the consumers: producer_regs "
                       f"{c.producer_regs} <= maxnreg {c.maxnreg} <= consumer_regs {c.consumer_regs}")
    if head_dim in ALL_HEAD_DIMS and c.block_n == 64 and c.consumers in (1, 2):
        if not c.split and not c.col_split and head_dim % (8 * c.consumers):
            out.append(f"head_dim {head_dim} must split over {c.consumers} consumers in multiples of 8 (dQ wgmma)")
        need = consumer_regs_estimate(c, head_dim)
        slack = LOCKSTEP_SPILL_SLACK_REGS if c.consumers == 2 and not c.split else 0
        if need > c.consumer_regs + slack:
            out.append(f"the consumer needs about {need} registers per thread, over its budget {c.consumer_regs}"
                       + (f" + {slack} (the spills a lock-step partition measured faster with)" if slack else ""))
        smem = smem_bytes(c, head_dim)
        if smem > SMEM_LIMIT_BYTES:
            terms = ", ".join(f"{k} {v}" for k, v in smem_terms(c, head_dim).items())
            out.append(f"shared memory {smem} bytes over the limit {SMEM_LIMIT_BYTES} ({terms})")
    if requested != head_dim:
        out[first_tile_rule:] = [f"{r} (head_dim {requested} runs on the head_dim {head_dim} tiles)"
                                 for r in out[first_tile_rule:]]
    return out


def is_valid(config: GluonBwdConfig, head_dim: int, dtype: str = "bfloat16", mask: str = "none") -> bool:
    return not invalid_reasons(config, head_dim, dtype, mask)


#: The head dims of the ragged-batch backward (no padded head dim: its strided first and
#: last passes and register stores take the tiles' width).
VARLEN_HEAD_DIMS = (64, 128)


def varlen_row_starts(cu_seqlens_q: list[int]) -> list[int]:
    """The first row of each sequence in the ragged-batch backward's LSE2 and delta
    buffers, 4 * (cu_seqlens_q[z] // 4 + z): a multiple of 4 float32 values, since a TMA
    copy's innermost coordinate must be 16-byte aligned (the H200 raised an illegal
    instruction for a copy of rows starting at the packed row itself), and past the
    previous sequence's rows (4 * floor(a / 4) + n <= 4 * floor((a + n) / 4) + 3)."""
    return [4 * (a // 4 + z) for z, a in enumerate(cu_seqlens_q[:-1])]


def varlen_reasons(config: GluonBwdConfig, head_dim: int) -> list[str]:
    """Why ``config`` cannot serve the ragged-batch backward (``varlen``), beyond
    :func:`invalid_reasons`: its program's rows start anywhere in the packed tensors, so
    the knobs that address the dense layout's aligned, per-batch tiles are out."""
    c, out = config, []
    if head_dim not in VARLEN_HEAD_DIMS:
        out.append(f"head_dim {head_dim}: the ragged-batch backward is built for {VARLEN_HEAD_DIMS}")
    if c.dq_mode != "tma":
        out.append(f"dq_mode {c.dq_mode!r}: the ragged-batch backward adds dQ by TMA reduce-add ('tma'); its "
                   "tiles past a sequence's end add zeros into the next sequence's rows, which only an atomic "
                   "add leaves intact (the ordered dQ serves the dense backward)")
    if c.dq_stage != "swizzled":
        out.append(f"dq_stage {c.dq_stage!r}: a sequence's query blocks start at any packed row, not at the "
                   "block_m-aligned tiles the fragment-ordered accumulator is made of")
    if c.kv_store != "ptr":
        out.append(f"kv_store {c.kv_store!r}: a TMA store clips at the tensor's end only and would write the next "
                   "sequence's rows of dK and dV; the register stores mask them")
    if c.group_split != 1:
        out.append(f"group_split {c.group_split}: the ragged-batch backward sums each GQA group in its program")
    if c.longest_first:
        out.append("longest_first: the ragged-batch grid is one program per (key block, sequence, kv head)")
    return out


def user_reasons(config: GluonBwdConfig, mask: str) -> list[str]:
    """Why ``config`` cannot compile user score/mask functions (:func:`.user_bwd.bwd_template_vars`),
    beyond :func:`invalid_reasons`: the knobs whose key and query ranges are their own
    (the ordered dQ's chain, the longest-first grid's sections, a GQA group split over
    programs, the head_dim 256 column and role splits and their lookahead) are not built
    with its block mask; the mask mode is "window" whenever there is a predicate (the
    forward's rule, :func:`.user.compiled_mask`); a score function's code is written into
    the one consumer step those knobs leave (not the column split's or the lookahead's).
    The head dims' default tiles passed their float64 checks on the GPU (``python -m
    benchmarks gluon-user-bwd``, docs/results/h100/gluon_user_bwd/); the tuner checks any
    other before timing it."""
    c, out = config, []
    for knob, on in (("dq_mode 'ordered'", c.dq_mode == "ordered"), ("longest_first", c.longest_first),
                     (f"group_split {c.group_split}", c.group_split != 1), ("col_split", c.col_split),
                     ("role split", c.col_split and c.split), (f"lookahead {c.lookahead}", bool(c.lookahead))):
        if on:
            out.append(f"{knob} with user score/mask functions: not built")
    return out


def group_splits(group: int) -> tuple[int, ...]:
    """The group_split values a GQA group of ``group`` query heads per kv head takes: its
    divisors up to MAX_GROUP_SPLIT (1 alone for multi-head attention)."""
    return tuple(s for s in range(1, min(group, MAX_GROUP_SPLIT) + 1) if group % s == 0)


def group_reasons(config: GluonBwdConfig, group: int) -> list[str]:
    """Why ``config`` cannot serve a GQA group of ``group`` query heads per kv head (the
    rule :func:`invalid_reasons` cannot see: the group is a size, not compiled in)."""
    if group % config.group_split:
        return [f"group_split {config.group_split} must divide the GQA group num_heads // num_kv_heads = {group}"]
    return []


def group_split_bytes(batch: int, num_kv_heads: int, seqlen_k: int, head_dim: int, group_split: int,
                      elem_bytes: int = 2, half_partials: bool = False) -> dict[str, int]:
    """Bytes of memory traffic a group split adds to the backward, by named term (a model;
    dK and dV ``elem_bytes`` each, the partials float32 or, ``half_partials``, that size):

    ``kv_reloaded``        K and V loaded by the other group_split - 1 programs of a kv head
                           (an upper bound: those programs run side by side, mostly from L2);
    ``partials_written``   the main kernel's partials of dK and dV, less the dK and dV it
                           writes itself when unsplit;
    ``partials_read``      the reduction reading them;
    ``outputs_written``    the reduction writing dK and dV.

    All 0 for group_split 1."""
    n = batch * num_kv_heads * seqlen_k * head_dim
    if group_split == 1:
        return dict.fromkeys(("kv_reloaded", "partials_written", "partials_read", "outputs_written"), 0)
    part = elem_bytes if half_partials else 4
    return {"kv_reloaded": 2 * n * elem_bytes * (group_split - 1),
            "partials_written": 2 * n * (part * group_split - elem_bytes), "partials_read": 2 * n * part * group_split,
            "outputs_written": 2 * n * elem_bytes}


def search_space(head_dim: int, dtype: str = "bfloat16", mask: str = "none", group: int = 1) -> list[GluonBwdConfig]:
    """Every valid config for (head_dim, dtype, mask) and a GQA group of ``group`` query
    heads per kv head (group_split: :func:`group_splits`).  LSE2 / delta come through the
    ring ("tma" or "producer"); the consumers' own pointer loads ("ptr") cost registers and
    spill at head_dim 128 (0.67x the "tma" variant on the H200), so they are left out."""
    if col_split_dim(head_dim):
        return col_split_space(head_dim, dtype, mask)
    out = []
    for block_m in (64, 128):
        for consumers in (1, 2):
            for split in ((False, True) if consumers == 2 else (False,)):
                for stages in (1, 2, 3, 4):
                    for dq_mode in SEARCH_DQ_MODES:
                        for row_load in ("tma", "producer"):
                            for gs in group_splits(group):
                                for half in ((False, True) if gs > 1 else (False,)):
                                    for stage in DQ_STAGES:
                                        for kv in KV_STORES:
                                            c = GluonBwdConfig(block_m, 64, consumers, stages, dq_mode,
                                                               240 if consumers == 2 else MAX_REGS, 24, row_load, 1,
                                                               split, gs, half, stage, kv)
                                            if is_valid(c, head_dim, dtype, mask):
                                                out.append(c)
    return out


def col_split_space(head_dim: int, dtype: str = "bfloat16", mask: str = "none",
                    unchecked: bool = False) -> list[GluonBwdConfig]:
    """The valid ``col_split`` configs (head_dim 256): ring depth, dQ by TMA reduce-add or
    atomics in 2 or 4 column chunks, LSE2 / delta by the producer's TMA or loads, dK and dV
    by register or TMA stores, the next step's S^T and dP^T issued ahead or not; the
    shared-memory and register rules keep those that fit.  ``unchecked``: instead, the
    configs refused only for not having run their float64 checks on the GPU
    (:data:`NOT_CHECKED`) or for a measurement (:data:`MEASURED_SLOWER`), the role split
    (``split``) excepted."""
    out = []
    for stages, dq_mode, chunks, row_load, kv, ahead, split in itertools.product(
            (1, 2), SEARCH_DQ_MODES, DQ_CHUNK_COUNTS, ("tma", "producer"), KV_STORES, LOOKAHEADS, (False, True)):
        c = GluonBwdConfig(64, 64, 2, stages, dq_mode, 240, 24, row_load, 1, split, kv_store=kv, dq_chunks=chunks,
                           lookahead=ahead)
        reasons = invalid_reasons(c, head_dim, dtype, mask)
        refused = reasons and not split and all(NOT_CHECKED in r or r in MEASURED_SLOWER for r in reasons)
        if refused if unchecked else not reasons:
            out.append(c)
    return out


def default_config(head_dim: int, dtype: str = "bfloat16", mask: str = "none") -> GluonBwdConfig:
    """The untuned choice, the fastest config measured on the H200 that passed the float64
    checks (docs/results/h200/gluon_bwd/rows2d_split_gluon_bwd.json): two consumers,
    BLOCK_M 64, dQ by TMA reduce-add, LSE2/delta by the producer's 2-D TMA; at head_dim 128
    one lock-step consumer partition and a 2-stage ring (the split partitions measured
    0.92x of it: twice the dQ reduce-add bytes, dQ in two halves), at 64 split consumer
    partitions and 4 stages (1.02-1.07x the lock-step one); the dQ tile staged in the
    accumulator's fragment order (1.02-1.08x the swizzled tile at head_dim 128, 1.03-1.13x
    at 64: docs/results/h200/gluon_bwd/dq-stage/fragment.log); dK and dV stored through
    shared memory by TMA (1.00-1.11x the register stores at both head dims:
    docs/results/h200/gluon_bwd/kv-store/)."""
    if col_split_dim(head_dim):
        c = GluonBwdConfig(block_m=64, block_n=64, consumers=2, stages=2, dq_mode="tma", row_load="tma",
                           kv_store="tma", dq_chunks=4)
        reasons = invalid_reasons(c, head_dim, dtype, mask)
        if reasons:
            raise ValueError(f"no Gluon backward for head_dim={head_dim} dtype={dtype} mask={mask}: {reasons[0]}")
        return c
    wide = tile_dim(head_dim) >= 128
    c = GluonBwdConfig(block_m=64, block_n=64, consumers=2, stages=2 if wide else 4, dq_mode="tma",
                       row_load="tma", producer_warps=1, split=not wide, dq_stage="fragment", kv_store="tma")
    reasons = invalid_reasons(c, head_dim, dtype, mask)
    if reasons:
        raise ValueError(f"no Gluon backward for head_dim={head_dim} dtype={dtype} mask={mask}: {reasons[0]}")
    return c


# --------------------------------------------------------------------------- render / load

def _templates_dir() -> Path:
    """Where the templates are, in a checkout and in an installed wheel alike."""
    from ...render import templates_dir

    return templates_dir()


@functools.lru_cache(maxsize=None)
def _env(directory: str | None = None) -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(directory or str(_templates_dir())),
                              undefined=jinja2.StrictUndefined, keep_trailing_newline=True, trim_blocks=True,
                              lstrip_blocks=True)


#: The record of the backward's code id, beside the template (:mod:`.code_id`).
CODE_ID_RECORD = "gluon/attn_bwd.code_id.json"


#: Variants admitted after the backward's code id was first recorded, each an extension
#: of the id (:class:`.code_id.CodeId`): name -> whether (config, head_dim) is one.
#: A variant of two extensions belongs to the first one listed.  "dq_ordered" and
#: "group_split" name variants the tuner records outside the GQA-group-1 search space
#: (``flashgen tune --refine dq_ordered``; the group splits of GQA keys), which the id
#: did not cover when it was first recorded.  "head_dim_pad" (listed first, so it holds
#: every variant of a padded head dim) names the head dims that :func:`tile_dim` pads.
EXTENSIONS = {"head_dim_pad": lambda c, d: tile_dim(d) != d,
              "lookahead": lambda c, d: bool(c.lookahead),
              "col_split": lambda c, d: c.col_split,
              "dq_writer": lambda c, d: c.dq_writer,
              "longest_first": lambda c, d: c.longest_first,
              "kv_tma": lambda c, d: c.kv_store == "tma",
              "dq_ordered": lambda c, d: c.dq_mode == "ordered",
              "group_split": lambda c, d: c.group_split > 1,
              "dq_fragment": lambda c, d: c.dq_stage == "fragment",
              "lockstep_spill_slack": lambda c, d: consumer_regs_estimate(c, tile_dim(d)) > c.consumer_regs}


def probe_variants(extension: str | None = None) -> list[tuple[GluonBwdConfig, str, int, str]]:
    """(config, dtype, head_dim, mask) of every variant the tuner can record (the search
    space of each head dim, dtype and mask, GQA group 1, and each of its TMA-mode
    variants with the ordered dQ; the default tile with each group split), and one variant
    of each LSE2 / delta load and producer width outside it: the sources whose code
    defines the code id; those of an :data:`EXTENSIONS` entry are that extension's probes
    (``extension``)."""
    out = []
    for d in ALL_HEAD_DIMS:
        for dtype in DTYPES:
            for mask in MASKS:
                space = list(search_space(d, dtype, mask))
                if d in COL_SPLIT_HEAD_DIMS:  # its own program: the space alone
                    out += [(c, dtype, d, mask) for c in space if extension_of(EXTENSIONS, c, d) == extension]
                    continue
                # the probes outside the space on the default tile as first recorded
                base = dataclasses.replace(default_config(d, dtype, mask), dq_stage="swizzled", kv_store="ptr")
                cands = space + [dataclasses.replace(base, row_load="ptr"), dataclasses.replace(base, producer_warps=4)]
                cands += [o for c in space if c.dq_mode == "tma"
                          for o in [dataclasses.replace(c, dq_mode="ordered")] if is_valid(o, d, dtype, mask)]
                if mask != "none" and dtype == "bfloat16":
                    # the longest-first grid: one dtype covers its code (the program's
                    # coordinates), on every tile of the search space
                    cands += [dataclasses.replace(c, longest_first=True) for c in space]
                if dtype == "bfloat16":
                    # the dQ writer warp: one dtype covers its code, on every reduce-add
                    # tile of the space and its ordered twin
                    # (and, under a mask, its longest-first grid)
                    twins = space + [dataclasses.replace(c, dq_mode="ordered") for c in space]
                    twins += [dataclasses.replace(c, longest_first=True) for c in space] if mask != "none" else []
                    cands += [o for c in twins
                              for o in [dataclasses.replace(c, dq_writer=True)] if is_valid(o, d, dtype, mask)]
                cands += [o for stage in DQ_STAGES for mode in ("tma", "ordered")
                          for gs in range(2, MAX_GROUP_SPLIT + 1) for half in (False, True)
                          for o in [dataclasses.replace(base, dq_stage=stage, dq_mode=mode, group_split=gs,
                                                        half_partials=half)] if is_valid(o, d, dtype, mask)]
                for c in cands:
                    if extension_of(EXTENSIONS, c, d) == extension:
                        out.append((c, dtype, d, mask))
    return out


def _probe_sources(directory: str | None, extension: str | None = None):
    for c, dtype, d, mask in probe_variants(extension):
        yield render(c, dtype, d, mask, check=False, header_hash="-", directory=directory)


_CODE_ID = CodeId(TEMPLATE, CODE_ID_RECORD, _probe_sources,
                  {name: functools.partial(_probe_sources, extension=name) for name in EXTENSIONS})


def text_hash(directory: str | None = None) -> str:
    """sha256 (16 hex digits) of the template file."""
    return _CODE_ID.text_hash(directory)


def probe_digest(directory: str | None = None) -> str:
    """sha256 (16 hex digits) of the sources of :func:`probe_variants`, rendered from the
    template in ``directory`` (default: the package's) with the header hash left out."""
    return _CODE_ID.probe_digest(directory)


def _record(directory: str | None = None) -> dict:
    return _CODE_ID.record(directory)


def code_id(directory: str | None = None) -> str:
    """The code id of the template in ``directory`` (:meth:`.code_id.CodeId.code_id`)."""
    return _CODE_ID.code_id(directory)


@functools.lru_cache(maxsize=None)
def template_hash() -> str:
    """The code id of the backward's template (:func:`code_id`): generated sources carry it
    in their header, and tuning rows (the family's ``template_hash``) carry it, so an edit
    that changes the code of a variant the tuner can record invalidates the rows, while
    one that adds code only new variants render keeps them.  It began as the template's
    text hash at the time (3e9b5b10c914d761, what the H200 rows carry); ``python3 -m
    flashgen.families.gluon`` rewrites the record after an edit."""
    return code_id()


@functools.lru_cache(maxsize=1)
def user_code_id() -> str:
    """The code id the user mask-function variants of the backward carry (their tuning
    rows'): sha256 (16 hex digits) of the backward's code id, the template's text,
    :mod:`.user_bwd` and :mod:`.user` (whose Gluon spelling of the Triton code it
    uses).  The variants' names (``KernelSpec.mods``) already hash the
    lowered functions and the code that writes them (:func:`flashgen.user_render.machinery_hash`);
    any edit of the template's text gives these variants a new id (so no row measured
    with other code is reused), the dense backward's rows keep theirs."""
    h = hashlib.sha256(template_hash().encode())
    h.update(text_hash().encode())
    for name in ("user_bwd.py", "user.py"):
        h.update(Path(__file__).with_name(name).read_bytes())
    return h.hexdigest()[:16]


def write_code_id(directory: str | None = None) -> dict:
    """Rewrite the record (:data:`CODE_ID_RECORD`) for the template as it is, and the
    ragged-batch variants' (:data:`VARLEN_CODE_ID_RECORD`)."""
    new = _CODE_ID.write(directory)
    _VARLEN_CODE_ID.write(directory)
    template_hash.cache_clear()
    varlen_code_id.cache_clear()
    user_code_id.cache_clear()
    return new


#: Measurement probes of the ordered dQ (never tuned or served): "no_poll" leaves out
#: the wait on the predecessor's semaphore and "no_sync" the releases too (the ordered
#: variant's 1-D grid and its per-step wait for the previous reduce-add, with nothing
#: ordered: their dQ is not repeatable); "one_thread" waits and releases from the first
#: thread of each warpgroup alone, the partition's barrier ordering the others (ordered;
#: not checked against float64).  benchmarks/probe_dq_order.py.
DQ_PROBES = ("", "no_poll", "no_sync", "one_thread")


def render(config: GluonBwdConfig, dtype: str, head_dim: int, mask: str, check: bool = True, *,
           header_hash: str | None = None, directory: str | None = None, probe: str = "", varlen: bool = False,
           user: str = "") -> str:
    """The Gluon source of one variant (pure text).  Raises ValueError for an invalid one
    (``check=False``: probes render a config the rules reject, e.g. row_load "tma").
    ``header_hash``: the hash the header names (default :func:`template_hash`);
    ``directory``: another templates directory (the code-id checks); ``probe``: one of
    :data:`DQ_PROBES` (dq_mode "ordered" only); ``varlen``: the ragged-batch main kernel
    (:func:`varlen_reasons`; every other variant renders as without it); ``user``: the
    ``KernelSpec.mods`` of user score/mask functions registered in this process
    (:func:`.user_bwd.unsupported`: UnsupportedError; :func:`user_reasons`: the knobs not
    built with them raise ValueError; with a mask function the mask mode is "window")."""
    from .user_bwd import bwd_template_vars

    if user and varlen:
        raise ValueError("user functions and varlen: the ragged-batch backward takes none")
    uvars = bwd_template_vars(user)
    if user and user.endswith("m") and mask != "window":
        raise ValueError(f"user mask function {user}: compiled into the window kernel (mask 'window': the "
                         f"bounds a band tightens are tested there), not {mask!r}")
    unbuilt = user_reasons(config, mask) if user else []
    if unbuilt:  # with or without the rules' checks: these would read the block mask wrongly or hang
        raise ValueError(f"Gluon backward config {config.id} with user functions {user}: " + "; ".join(unbuilt))
    if probe not in DQ_PROBES or (probe and (config.dq_mode != "ordered" or config.dq_writer)):
        raise ValueError(f"probe {probe!r}: one of {DQ_PROBES[1:]} with dq_mode 'ordered'")
    reasons = invalid_reasons(config, head_dim, dtype, mask) if check else []
    if check and varlen:
        reasons += varlen_reasons(config, head_dim)
    if reasons:
        raise ValueError(f"invalid Gluon backward config {config.id} for d{head_dim} {dtype} {mask}: "
                         + "; ".join(reasons))
    c = config
    head_dim_g, head_dim = head_dim, tile_dim(head_dim)  # the tensors' and the tiles'
    # dQ (block_m x head_dim): split along M when block_m covers every warpgroup's 64 rows,
    # else along head_dim.
    # Split partitions at head_dim 128 compute dQ (TMA mode) in two column halves.
    dq_halves = c.split and c.dq_mode == "tma" and head_dim >= 128  # ordered: refused there
    dq_cols = head_dim // max(1, c.dq_chunks)
    mma_warps, st_n, kv_n = [c.num_warps, 1], c.block_m, head_dim
    if c.role_split:
        # each partition's wgmmas over its own warpgroup: S^T or dP^T whole, half of dK, dV
        mma_warps, st_n, kv_n = [4, 1], c.block_m, head_dim // 2
        dq_warps, dq_n = [4, 1], dq_cols
    elif c.col_split:
        # every wgmma over both warpgroups side by side along N
        mma_warps, st_n, kv_n = [4, 2], c.block_m // 2, head_dim // 2
        dq_warps, dq_n = [4, 2], dq_cols // 2
    elif dq_halves:
        dq_warps, dq_n = [c.num_warps, 1], head_dim // 2
    elif c.split or c.block_m >= 64 * c.consumers:
        dq_warps, dq_n = [c.num_warps, 1], head_dim
    else:
        dq_warps, dq_n = [4, c.consumers], head_dim // c.consumers
    return _env(directory).get_template(TEMPLATE).render(
        template_hash=template_hash() if header_hash is None else header_hash,
        variant_id=variant_id(c, dtype, head_dim_g, mask, varlen, user), dtype=dtype, head_dim=head_dim,
        head_dim_g=head_dim_g, PAD=head_dim_g != head_dim, mask=mask,
        BLOCK_M=c.block_m, BLOCK_N=c.block_n, NUM_CONSUMERS=c.consumers,
        NUM_STAGES=c.stages, DQ_MODE=c.dq_mode, CONSUMER_REGS=c.consumer_regs, PRODUCER_REGS=c.producer_regs,
        MAXNREG=c.maxnreg, DQ_WARPS=dq_warps, DQ_INSTR_N=dq_n, PRE_ROWS=PRE_ROWS, ROW_LOAD=c.row_load,
        PRODUCER_WARPS=c.producer_warps, SPLIT=c.split, PART_WARPS=c.num_warps, PART_ROWS=c.part_rows,
        NUM_PARTS=c.parts, ROW_PAD=ROW_PAD, DQ_HALVES=dq_halves, GROUP_SPLIT=c.group_split,
        HALF_PARTIALS=c.half_partials, DQ_PROBE=probe, DQ_STAGE=c.dq_stage,
        DQ_BASES=fragment_bases(c.block_m, head_dim) if c.dq_stage == "fragment" else None, KV_STORE=c.kv_store,
        LONGEST_FIRST=c.longest_first, DQ_WRITER=c.dq_writer, VARLEN=varlen, BLOCK_NT=c.block_nt,
        MMA_WARPS=mma_warps, ST_N=st_n, KV_N=kv_n, COL_SPLIT=c.col_split, DQ_CHUNKS=c.dq_chunks, DQ_COLS=dq_cols,
        LOOKAHEAD=c.lookahead, ROLE_SPLIT=c.role_split, **uvars)


def fragment_bases(block_m: int, head_dim: int) -> list[list[int]]:
    """Offset bases (element offset bit -> (row, column)) of a block_m x head_dim float32
    dQ tile in the wgmma accumulator's fragment order (dq_stage "fragment"): offset =
    c % 2 | (r / 8 % 2) << 1 | (c / 2 % 4) << 2 | (r % 8) << 4 | (c / 8) << 7 |
    (r / 16) << (7 + log2(head_dim / 8)), the order in which a warp's threads hold four
    consecutive accumulator registers (PTX ISA, wgmma's m64nNk16 D fragment)."""
    bits = lambda n: [1 << i for i in range(n.bit_length() - 1)]  # noqa: E731
    return ([[0, 1], [8, 0], [0, 2], [0, 4], [1, 0], [2, 0], [4, 0]] + [[0, 8 * b] for b in bits(head_dim // 8)]
            + [[16 * b, 0] for b in bits(block_m // 16)])


_modules: dict = {}


def load(config: GluonBwdConfig, dtype: str, head_dim: int, mask: str, check: bool = True, probe: str = "",
         varlen: bool = False, user: str = ""):
    """The imported module of one variant (written under its content hash, memoized);
    ``probe``, ``varlen``, ``user``: :func:`render`'s."""
    key = (config, dtype, head_dim, mask, probe, varlen, user)
    mod = _modules.get(key)
    if mod is None:
        from flashgen import compile as _compile

        src = render(config, dtype, head_dim, mask, check, probe=probe, varlen=varlen, user=user)
        vid = variant_id(config, dtype, head_dim, mask, varlen, user) + (f"_{probe}" if probe else "")
        mod = _modules[key] = _compile.import_generated(vid, src)
    return mod


# --------------------------------------------------------------------------- launcher

def _layout(block, dtype_name):
    from .shim import nvmma_layout

    return nvmma_layout(block, dtype_name)


def _desc4(t, rows: int, dtype_name: str, cols: int | None = None):
    """4-D descriptor over ``t``, box (1, 1, rows, cols) (cols: t's last dim when None; a
    wider box is zero-filled past it on loads and clipped there on stores)."""
    from .shim import descriptor

    block = [1, 1, rows, cols or t.shape[-1]]
    return descriptor(t, list(t.shape), list(t.stride()), block, _layout(block, dtype_name))


@functools.lru_cache(maxsize=None)
def _rows_layout():
    from .shim import gl

    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


def _desc_dq(dqacc, block_m: int, stage: str, cols: int | None = None):
    """The reduce-add's descriptor over the float32 dQ accumulator: (z, h, M, D), box (1,
    1, block_m, cols) (cols: D unless the dQ comes in column chunks, ``col_split``),
    swizzled as the default layout; "fragment": (z * h * m_pad, D), box (block_m, D), no
    swizzle (the tile is copied in its fragment order as it is)."""
    if stage != "fragment":
        return _desc4(dqacc, block_m, "float32", cols)
    from .shim import descriptor

    rows, d = dqacc.shape[0] * dqacc.shape[1], dqacc.shape[2]
    return descriptor(dqacc, [rows, d], [d, 1], [block_m, d], _rows_layout())


def _desc_rows(t, rows: int):
    """2-D descriptor over a (z * h, m_pad) float32 buffer, box (1, rows)."""
    from .shim import descriptor

    return descriptor(t, list(t.shape), list(t.stride()), [1, rows], _rows_layout())


def launch_args(do, q, k, v, o, lse, *, softmax_scale: float, diag_lo: int, diag_hi: int, config: GluonBwdConfig,
                dq=None, dk=None, dv=None, user=None, user_args: tuple | None = None):
    """Everything the launches take, without launching (also used to compile on a
    machine without a GPU): a dict with the outputs (dq, dk, dv), the scratch buffers,
    and for each kernel its grid and argument tuple ("preprocess", "main", "convert",
    and with ``config.group_split`` S > 1 "reduce": the main kernel then runs
    batch * num_kv_heads * S programs per key block, told num_kv_heads * S kv heads, and
    writes partials ``dk_partial`` / ``dv_partial`` of shape (batch, num_kv_heads, S,
    seqlen_k, head_dim), float32 (dK unscaled) or with ``half_partials`` the inputs'
    dtype (dK scaled), that :func:`.reduce.group_reduce` sums into dk, dv).  Raises ValueError when S does not divide the GQA group, and
    :class:`flashgen.errors.LaunchLimitError` (a ValueError) when batch * num_kv_heads *
    S is over CUDA's 65535 (the limit of the 2-D grid's second axis; the 1-D grids of the
    ordered and longest-first variants are held to it too: not run beyond it).  ``user``:
    the runtime arguments (:class:`flashgen.user_mods.UserArgs`) of user score/mask
    functions, after the main kernel's m_pad (their captured tensors, then a mask
    function's block mask in tiles of block_m query rows by block_nt key rows, per kv
    head)."""
    import torch

    b, h, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    dt = tile_dim(d)  # the tiles' width: the dQ accumulator's and the descriptors' boxes
    c = config
    gs = c.group_split
    why = group_reasons(c, h // hk)
    if why:
        raise ValueError(f"Gluon backward config {c.id}: {why[0]}")
    if b * hk * gs > MAX_GRID_Y:
        from ...errors import LaunchLimitError

        raise LaunchLimitError(f"Gluon backward config {c.id}: batch * num_kv_heads * group_split = {b * hk * gs} "
                               f"programs per key block, over CUDA's grid limit {MAX_GRID_Y}")
    dtype_name = str(q.dtype).removeprefix("torch.")
    dev = q.device
    lse = lse if lse.is_contiguous() else lse.contiguous()
    # the gradients in the layout of q, k, v (the op's contract); the template's
    # preprocess and convert take contiguous O, dO and dQ, .strided's any layout
    dq = torch.empty_like(q) if dq is None else dq
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    rows = b * h * sq
    m_pad = -(-sq // ROW_PAD) * ROW_PAD
    lse2 = torch.empty((b * h, m_pad), dtype=torch.float32, device=dev)
    delta = torch.empty((b * h, m_pad), dtype=torch.float32, device=dev)
    # "fragment": block_m-row tiles in the accumulator's fragment order, padded to m_pad rows
    fragment = c.dq_stage == "fragment"
    dqacc = torch.empty((b * h, m_pad, dt) if fragment else (b, h, sq, dt), dtype=torch.float32, device=dev)
    pre_grid = (math.ceil(b * h * m_pad / PRE_ROWS),)
    out = {"dq": dq, "dk": dk, "dv": dv, "lse2": lse2, "delta": delta, "dqacc": dqacc}
    main_dk, main_dv = dk, dv
    if c.dq_mode == "ordered":
        # one int32 semaphore per (batch * head, query block), zeroed: a launch of the main
        # kernel needs them zero again
        out["sem"] = torch.zeros((b * h, m_pad // c.block_m), dtype=torch.int32, device=dev)
        out["head_group"] = ordered_head_group(c, b * hk * gs, sq, h // hk // gs, mask=diag_lo > -sq or diag_hi < sk,
                                               sm_count=_sm_count(dev), seqlen_k=sk)
    if gs == 1 and not (dk.is_contiguous() and dv.is_contiguous()):
        # the main kernel stores contiguous dK, dV: into these, then copied ("copy")
        main_dk, main_dv = torch.empty((b, hk, sk, d), dtype=k.dtype, device=dev), \
            torch.empty((b, hk, sk, d), dtype=v.dtype, device=dev)
        out["copy"] = ((main_dk, dk), (main_dv, dv))
    if gs > 1:
        # one allocation for both scratches; every element is written by the main kernel
        partials = torch.empty((2, b, hk, gs, sk, d), dtype=q.dtype if c.half_partials else torch.float32,
                               device=dev)
        main_dk, main_dv = out["dk_partial"], out["dv_partial"] = partials[0], partials[1]
    main = (_desc4(q, c.block_m, dtype_name, dt), _desc4(k, c.block_nt, dtype_name, dt),
            _desc4(v, c.block_nt, dtype_name, dt), _desc4(do, c.block_m, dtype_name, dt),
            _desc_rows(lse2, c.block_m), _desc_rows(delta, c.block_m),
            _desc_dq(dqacc, c.block_m, c.dq_stage, dt // c.dq_chunks), lse2, delta, dqacc,
            *((_desc4(main_dk, c.part_rows, dtype_name, dt), _desc4(main_dv, c.part_rows, dtype_name, dt))
              if c.kv_store == "tma" else (main_dk, main_dv))) + (
            (out["sem"], out["head_group"]) if c.dq_mode == "ordered" else ()) + (float(softmax_scale) * 1.4426950408889634, float(softmax_scale), h, hk * gs, sq, sk, int(diag_lo),
            int(diag_hi), m_pad)
    if o.is_contiguous() and do.is_contiguous():
        out["preprocess"] = (pre_grid, (o, do, lse, lse2, delta, dqacc, b * h * m_pad, sq, m_pad, True))
    else:
        from . import strided

        out["preprocess_strided"] = strided.preprocess_launch(o, do, lse, lse2, delta, dqacc, m_pad,
                                                              padded=fragment)
    n_kb = math.ceil(sk / c.block_nt)
    if c.longest_first:
        main += (longest_first_section(b * hk * gs, h // hk // gs, sq, d),)
    if user is not None:
        if tuple(user.sizes) != (b, h, hk, sq, sk, int(diag_lo), int(diag_hi)):
            raise ValueError(f"user functions {user.name}: made for sizes and bounds {tuple(user.sizes)}, "
                             f"called with {(b, h, hk, sq, sk, int(diag_lo), int(diag_hi))}")
        # user_args: the caller's user.gluon_bwd_args for this config, built once per call
        main += tuple(user.gluon_bwd_args(c.block_m, c.block_nt) if user_args is None else user_args)
    # ordered: a 1-D grid, HEAD_GROUP (z, kv head) pairs interleaved (ordered_program);
    # longest_first: a 1-D grid in sections (ordered_program with head_group = section)
    out["main"] = (((n_kb * b * hk * gs,) if c.dq_mode == "ordered" or c.longest_first else (n_kb, b * hk * gs)),
                   main)
    if fragment:
        out["convert"] = ((b * h * math.ceil(sq / c.block_m),), (dqacc, dq, h, sq, m_pad, *dq.stride()[:3],
                                                                 float(softmax_scale)))
    elif dq.is_contiguous():
        out["convert"] = ((math.ceil(rows / PRE_ROWS),), (dqacc, dq, rows, float(softmax_scale)))
    else:
        from . import strided

        out["convert_strided"] = strided.convert_launch(dqacc, dq, softmax_scale)
    if gs > 1:
        from . import reduce

        # half partials: dK was scaled before its rounding
        dk_scale = 1.0 if c.half_partials else float(softmax_scale)
        out["reduce"] = (reduce.grid(b, hk, sk, d), reduce.args(main_dk, main_dv, dk, dv, dk_scale, gs))
    return out


def _sm_count(device) -> int:
    """Streaming multiprocessors of ``device``; for a CPU tensor (the compile-only path)
    those of sm_90 in :mod:`flashgen.arch`."""
    import torch

    if getattr(device, "type", "cpu") != "cuda":
        from ...arch import by_sm

        return by_sm("sm_90").sm_count
    from .launch import _sm_count as sm

    return sm(torch.device(device))


def ordered_head_group(config: GluonBwdConfig, pairs: int, seqlen_q: int, group: int, *, mask: bool,
                       sm_count: int, seqlen_k: int | None = None) -> int:
    """How many (batch, kv head) pairs the ordered backward's 1-D grid interleaves
    (HEAD_GROUP).  The adds into one dQ tile are a chain, so one pair starts at most one
    program per step of its chain (a step: one (query head, query block) tile; a program
    waits on the previous one's partition ``parts`` steps behind), and a pair's chain
    keeps about ``steps`` / ``parts`` programs running (steps per program: query blocks
    times the query heads of its group, half the query blocks on average under a mask).
    Enough pairs to cover the ``sm_count`` SMs, and no more: the largest divisor of
    ``pairs`` not above ``cap = parts * sm_count / steps`` (at least 1), so every group
    is whole.  More pairs at once end the kernel with every pair's longest programs side
    by side; a smaller last group starts its chains late.  On the H200 this measured
    1.037x the earlier rule (twice that ratio, rounded up: 0.99-1.21x over 26 shapes,
    whose pair counts are powers of two, within 1.2% of the best interleave on average;
    docs/design.md, the ordered dQ).  Where that divisor is at most half the cap (a pair
    count with few divisors, e.g. a prime), the pairs are split into the fewest groups
    of at most ``cap`` instead, as equal as they come (the last smaller by at most one
    pair per group): not measured.

    With ``seqlen_k`` given, a grid of at most two waves (pairs x key blocks <= 2 x
    ``sm_count`` programs) interleaves all the pairs: with so few programs every chain
    should start at once, and a later group's chains, whose longest programs come last,
    end the kernel.  Measured on the H200 at the one such shape of the probe above
    (1x32/8x2048 causal, group split 2: 16 pairs, 256 programs): 0.2939 ms with all 16
    pairs against 0.3157 at the cap's 4 (docs/results/h200/gluon_bwd/head-group/
    hg_probe.json); the list-schedule model (benchmarks/ordered_schedule_model.py, no
    memory effects) predicts 1.15x at 1x32/8x1024 (group split 4), not measured.  Past
    two waves the model, which favours the most pairs everywhere, disagrees with the
    measurements (the caches, suspected), so the cap stays."""
    if pairs <= 1:
        return 1
    if seqlen_k is not None and pairs * -(-seqlen_k // config.block_nt) <= 2 * sm_count:
        return pairs
    steps = ordered_steps(config, seqlen_q, group, mask=mask)
    cap = max(1, min(pairs, int(config.parts * sm_count / steps)))
    whole = largest_divisor(pairs, cap)
    if 2 * whole > cap:
        return whole
    groups = -(-pairs // cap)
    return -(-pairs // groups)


def ordered_steps(config: GluonBwdConfig, seqlen_q: int, group: int, *, mask: bool) -> float:
    """Steps of one program of the ordered backward (at least 1): its query blocks times
    the query heads of its group, half the query blocks on average under a mask."""
    return max(1.0, math.ceil(seqlen_q / config.block_m) * group * (0.5 if mask else 1.0))


def ordered_program(pid: int, num_programs: int, n_kb: int, head_group: int) -> tuple[int, int]:
    """Python mirror of the template's ``_ordered_program``: (rank, pair) of program
    ``pid`` of the ordered backward's 1-D grid of ``num_programs`` = ``n_kb`` * pairs.
    Also the longest-first grid's (key block, pair), with ``head_group`` its section:
    the template's ``_longest_first_program`` is the same arithmetic."""
    pairs = num_programs // n_kb
    span = head_group * n_kb
    g, r = divmod(pid, span)
    gg = min(head_group, pairs - g * head_group)
    rank = r // gg
    return rank, g * head_group + r - rank * gg


@functools.lru_cache(maxsize=1024)
def longest_first_section(pairs: int, group: int, seqlen_q: int, head_dim: int) -> int:
    """The section of the longest-first grid (``longest_first``): how many of the
    ``pairs`` (batch, kv head) pairs share one, each program taking ``group`` query
    heads.  The largest divisor of ``pairs`` whose pairs' Q and dO (group x seqlen_q x
    head_dim x 2 x 2 B each) fit the forward walk's L2 share (:data:`.config.L2_SECTION_BYTES`,
    about two thirds of the H200's 50 MB L2), so the programs running at
    once read them from L2 as the pair-after-pair grid's do, and every section is whole:
    a smaller last section would start its longest programs last (in a model of the
    hardware scheduler that starts programs in grid order on the first free SM, a
    partial last section cost up to 10% against whole ones)."""
    per_pair = max(1, group * seqlen_q * head_dim * 4)
    return largest_divisor(pairs, max(1, L2_SECTION_BYTES // per_pair))


def check_inputs(do, q, k, v, o, lse) -> None:
    """Raise ValueError naming the argument and the rule it breaks."""
    import torch

    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be 4-D (batch, heads, seqlen, head_dim)")
    b, h, sq, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be (batch, num_kv_heads, seqlen_k, {d})")
    if h % k.shape[1]:
        raise ValueError(f"num_heads {h} must be a multiple of num_kv_heads {k.shape[1]}")
    for name, t in (("do", do), ("o", o)):
        if t.shape != q.shape:
            raise ValueError(f"{name} {tuple(t.shape)} must have q's shape {tuple(q.shape)}")
    if lse.shape != (b, h, sq) or lse.dtype != torch.float32:
        raise ValueError(f"lse must be float32 ({b}, {h}, {sq}), got {lse.dtype} {tuple(lse.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v), ("do", do), ("o", o)):
        if t.dtype != q.dtype or str(t.dtype).removeprefix("torch.") not in DTYPES:
            raise ValueError(f"{name} must be float16 or bfloat16 like q, got {t.dtype}")
        if t.stride(-1) != 1 or any((s * t.element_size()) % 16 for s in t.stride()[:-1]) or t.data_ptr() % 16:
            raise ValueError(f"{name} needs last stride 1 and 16-byte aligned strides and base (TMA)")


def attention_bwd(do, q, k, v, o, lse, *, softmax_scale: float, diag_lo: int, diag_hi: int, mask: str,
                  config: GluonBwdConfig | None = None, dq=None, dk=None, dv=None, stage_sync: bool = False,
                  delta_out=None, check: bool = True, user=None):
    """dQ, dK, dV of softmax(Q K^T * softmax_scale) V on sm_90.

    Shapes as :func:`flashgen.ops.bwd`; ``mask`` ("none" | "causal" | "window") names
    which bounds the kernel tests (diag_lo/diag_hi are tested in every masked mode).
    Returns (dq, dk, dv) in the inputs' dtype and in the layouts of q, k, v
    (``torch.empty_like``; O, dO and dQ of any layout go through :mod:`.strided`).  dK/dV summed over each GQA
    group (``config.group_split`` > 1: over partials by a fourth launch, :mod:`.reduce`).  Raises ValueError for inputs or a config the kernels cannot take.
    ``stage_sync``: synchronize after each launch and raise RuntimeError naming the
    launch that failed (for the GPU checks).  ``delta_out``: a float32 (z, h, seqlen_q)
    tensor that receives delta = rowsum(dO * O) as the preprocess launch computed it.
    ``check=False`` builds a config the rules reject (:func:`invalid_reasons`; a
    benchmark's probe of one, never the dispatcher's).  ``user``: the runtime arguments
    (:class:`flashgen.user_mods.UserArgs`) of user score/mask functions (``mask`` "window"
    with a mask function; their captured tensors and block mask are a launch plan's
    inputs too, their sizes and other arguments part of the plan's key;
    :func:`user_reasons` names the knobs not built with them)."""
    key, inputs, uargs = None, (do, q, k, v, o, lse, dq, dk, dv), None
    dtype = str(q.dtype).removeprefix("torch.")
    d = q.shape[-1]
    if check and not stage_sync and (user is None or plans.usable()):
        tail = ()
        if user is not None:  # its tensors are inputs too, its name, sizes and other values in the key
            config = config or default_config(d, dtype, mask)
            uargs = tuple(user.gluon_bwd_args(config.block_m, config.block_nt))  # once per call
            inputs, tail = plans.extend(inputs, uargs, user.name, tuple(user.sizes))
        key, bufs = plans.replay(_PLANS, inputs, config, mask, float(softmax_scale), diag_lo, diag_hi,
                                 delta_out is not None, *tail)
        if bufs is not None:
            return _finish(bufs, q, dq, dk, dv, delta_out)
    check_inputs(do, q, k, v, o, lse)
    config = config or default_config(d, dtype, mask)
    mod = load(config, dtype, d, mask, check, user=user.name if user is not None else "")
    a = launch_args(do, q, k, v, o, lse, softmax_scale=softmax_scale, diag_lo=diag_lo, diag_hi=diag_hi,
                    config=config, dq=dq, dk=dk, dv=dv, user=user, user_args=uargs)
    if "preprocess" in a:
        stages = [("preprocess", mod.attn_bwd_preprocess, {"num_warps": 4})]
    else:
        from . import strided

        stages = [("preprocess_strided", strided.preprocess, {"num_warps": strided.NUM_WARPS})]
    stages.append(("main", mod.attn_bwd, {"num_warps": config.num_warps, "maxnreg": config.maxnreg}))
    if "convert" in a:
        stages.append(("convert", mod.attn_bwd_convert, {"num_warps": 4}))
    else:
        from . import strided

        stages.append(("convert_strided", strided.convert, {"num_warps": strided.NUM_WARPS}))
    if "reduce" in a:
        from . import reduce

        stages.append(("reduce", reduce.group_reduce, {"num_warps": reduce.NUM_WARPS}))
    rec = plans.Recorder() if key is not None else None
    for stage, fn, opts in stages:
        grid, args = a[stage]
        kernel = launch(fn, grid, args, **opts)
        if rec is not None:
            rec.add(kernel, grid, args)
        if stage_sync:
            import torch

            try:
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - re-raised with the launch named
                raise RuntimeError(f"attn_bwd {stage} launch failed: {e}") from e
    bufs = {name: a[name] for name in _PLANNED if name in a}
    for name, given in (("dq", dq), ("dk", dk), ("dv", dv)):
        if given is None:
            bufs[name] = a[name]
        else:
            bufs.pop(name, None)
    for i, (src, _) in enumerate(a.get("copy", ())):
        bufs[f"copy{i}"] = src
    if rec is not None:
        plans.record(_PLANS, key, rec, inputs, bufs, zeroed=("sem",))
    return _finish(bufs, q, dq, dk, dv, delta_out)


#: The scratch buffers of :func:`launch_args` a launch plan allocates again on each call
#: (with the outputs not given, and the contiguous dK/dV of a "copy").
_PLANNED = ("lse2", "delta", "dqacc", "sem", "dk_partial", "dv_partial")
#: Launch plans of :func:`attention_bwd` (:mod:`flashgen.plans`), by config, scalars,
#: sizes, strides, dtypes, alignments, tensor identity and device.
_PLANS: dict = {}


def _finish(bufs: dict, q, dq, dk, dv, delta_out):
    """(dQ, dK, dV) of one backward from its buffers: the outputs given or allocated, the
    contiguous dK/dV copied into strided ones ("copy"), delta copied out."""
    dq = bufs["dq"] if dq is None else dq
    dk = bufs["dk"] if dk is None else dk
    dv = bufs["dv"] if dv is None else dv
    if "copy0" in bufs:
        plans.taint()
        dk.copy_(bufs["copy0"])
        dv.copy_(bufs["copy1"])
    if delta_out is not None:
        plans.taint()
        b, h, sq = q.shape[0], q.shape[1], q.shape[2]
        delta_out.copy_(bufs["delta"].view(b, h, -1)[:, :, :sq])
    return dq, dk, dv


# --------------------------------------------------------------------------- ragged batches

def _packed4(t):
    """A packed (total, heads, head_dim) tensor as (1, heads, total, head_dim), the view
    the 4-D descriptors and the strided passes address (rows of one head are
    ``t.stride(0)`` apart)."""
    return t.permute(1, 0, 2).unsqueeze(0)


def varlen_launch_args(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
                       softmax_scale: float, win_left: int, win_right: int, config: GluonBwdConfig, dq=None, dk=None,
                       dv=None):
    """Everything the ragged-batch backward's launches take (:func:`attention_bwd_varlen`),
    without launching: a dict with the outputs, the scratch buffers and (grid, args) of
    "preprocess_varlen" (:func:`.strided.varlen_preprocess`: LSE2 and delta at the rows
    of :func:`varlen_row_starts`), "main" (the template's ``attn_bwd`` rendered with
    ``varlen``) and "convert_strided" (:mod:`.strided` on dQ viewed as (1, h, total_q,
    d)).  dk and dv are written contiguous (total_k, hk, d): a given dk/dv of
    other strides receives a copy ("copy").  Raises :class:`flashgen.errors.LaunchLimitError`
    (a ValueError) when the grid is too tall (batch * num_kv_heads over 65535)."""
    import torch

    from . import strided

    tq, h, d = q.shape
    tk, hk = k.shape[0], k.shape[1]
    batch = cu_seqlens_q.shape[0] - 1
    c = config
    if batch * hk > MAX_GRID_Y:
        from ...errors import LaunchLimitError

        raise LaunchLimitError(f"Gluon backward config {c.id}: batch * num_kv_heads = {batch * hk} programs per "
                               f"key block, over CUDA's grid limit {MAX_GRID_Y}")
    dtype_name = str(q.dtype).removeprefix("torch.")
    dev = q.device
    dq = torch.empty_like(q) if dq is None else dq
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    out = {"dq": dq, "dk": dk, "dv": dv}
    main_dk, main_dv = dk, dv
    if not (dk.is_contiguous() and dv.is_contiguous()):
        main_dk, main_dv = torch.empty((tk, hk, d), dtype=k.dtype, device=dev), \
            torch.empty((tk, hk, d), dtype=v.dtype, device=dev)
        out["copy"] = ((main_dk, dk), (main_dv, dv))
    # LSE2 / delta: sequence z's rows from varlen_row_starts (16-byte aligned for the TMA
    # copies), 0 between them, ROW_PAD past the last so that a tile's pointer loads at a
    # sequence's end stay in the buffer
    m_pad = -(-(4 * (tq // 4 + batch) + ROW_PAD) // ROW_PAD) * ROW_PAD
    lse2 = torch.zeros((h, m_pad), dtype=torch.float32, device=dev)
    delta = torch.zeros((h, m_pad), dtype=torch.float32, device=dev)
    dqacc = torch.empty((1, h, tq, d), dtype=torch.float32, device=dev)
    out.update(lse2=lse2, delta=delta, dqacc=dqacc)
    lse = lse if lse.is_contiguous() else lse.contiguous()
    cu_q = cu_seqlens_q if cu_seqlens_q.is_contiguous() else cu_seqlens_q.contiguous()
    cu_k = cu_seqlens_k if cu_seqlens_k.is_contiguous() else cu_seqlens_k.contiguous()
    q4, k4, v4, do4 = (_packed4(t) for t in (q, k, v, do))
    out["preprocess_varlen"] = strided.varlen_preprocess_launch(o, do, lse, lse2, delta, dqacc, cu_q,
                                                                int(max_seqlen_q), m_pad)
    main = (_desc4(q4, c.block_m, dtype_name), _desc4(k4, c.block_nt, dtype_name),
            _desc4(v4, c.block_nt, dtype_name), _desc4(do4, c.block_m, dtype_name),
            _desc_rows(lse2, c.block_m), _desc_rows(delta, c.block_m), _desc_dq(dqacc, c.block_m, c.dq_stage),
            lse2, delta, dqacc, main_dk, main_dv, float(softmax_scale) * 1.4426950408889634, float(softmax_scale),
            h, hk, int(max_seqlen_q), int(max_seqlen_k), int(win_left), int(win_right), m_pad, cu_q, cu_k)
    out["main"] = ((math.ceil(int(max_seqlen_k) / c.block_nt), batch * hk), main)
    out["convert_strided"] = strided.convert_launch(dqacc, _packed4(dq), softmax_scale)
    return out


def attention_bwd_varlen(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
                         softmax_scale: float, win_left: int, win_right: int, mask: str,
                         config: GluonBwdConfig | None = None, dq=None, dk=None, dv=None, module=None,
                         stage_sync: bool = False, check: bool = True):
    """dQ, dK, dV of a ragged batch on sm_90, :func:`flashgen.ops.bwd_varlen`'s contract:
    do, q, o (total_q, num_heads, head_dim), k, v (total_k, num_kv_heads, head_dim),
    float16 or bfloat16, strides a tensor descriptor can address (last stride 1, the
    others 16-byte multiples); lse (num_heads, total_q) float32, natural log, -inf for a
    row that sees no key; cu_seqlens_q / cu_seqlens_k int32 (batch + 1,), checked
    offsets (:func:`flashgen.api.attention_varlen`); max_seqlen_q / max_seqlen_k the
    longest sequences (> 0; they size the grid); ``win_left`` / ``win_right`` the window
    per sequence, bottom-right aligned, -1 unbounded (causal: right 0), the mode
    ``mask``.  Three launches: the ragged-batch preprocess, the main kernel (one program
    per key block of the longest sequence, sequence and kv head), the strided convert.
    Returns (dq, dk, dv) like q, k, v (``torch.empty_like``); dK and dV summed over each
    GQA group; dQ accumulated in float32 by reduce-adds in arrival order (not bitwise
    repeatable).  ``module``: the loaded variant (else :func:`load`); ``stage_sync``:
    synchronize after each launch and raise RuntimeError naming the one that failed.
    Raises ValueError naming the argument and the rule for inputs the kernels cannot take
    (:func:`check_varlen_inputs`) and for a config the ragged-batch backward cannot take."""
    import torch

    from . import strided

    check_varlen_inputs(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k)
    dtype = str(q.dtype).removeprefix("torch.")
    d = q.shape[-1]
    config = config or varlen_default_config(d, dtype, mask)
    if check:
        why = invalid_reasons(config, d, dtype, mask) + varlen_reasons(config, d)
        if why:
            raise ValueError(f"gluon bwd_varlen: config {config.id}: {'; '.join(why)}")
    mod = module if module is not None else load(config, dtype, d, mask, check, varlen=True)
    a = varlen_launch_args(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           softmax_scale=softmax_scale, win_left=win_left, win_right=win_right, config=config,
                           dq=dq, dk=dk, dv=dv)
    stages = (("preprocess_varlen", strided.varlen_preprocess, {"num_warps": strided.NUM_WARPS}),
              ("main", mod.attn_bwd, {"num_warps": config.num_warps, "maxnreg": config.maxnreg}),
              ("convert_strided", strided.convert, {"num_warps": strided.NUM_WARPS}))
    for stage, fn, opts in stages:
        grid, args = a[stage]
        if 0 in grid:
            continue
        launch(fn, grid, args, **opts)
        if stage_sync:
            try:
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - re-raised with the launch named
                raise RuntimeError(f"attn_bwd varlen {stage} launch failed: {e}") from e
    for src, dst in a.get("copy", ()):
        dst.copy_(src)
    return a["dq"], a["dk"], a["dv"]


def check_varlen_inputs(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k) -> None:
    """Raise ValueError naming the argument and the rule it breaks (the ragged batch's
    layout contract of :func:`attention_bwd_varlen`; the offsets' values are the
    caller's, :func:`flashgen.api.attention_varlen` checks them)."""
    import torch

    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError("q, k, v must be 3-D packed (total, heads, head_dim)")
    tq, h, d = q.shape
    if k.shape != v.shape or k.shape[2] != d:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be (total_k, num_kv_heads, {d})")
    if h % k.shape[1]:
        raise ValueError(f"num_heads {h} must be a multiple of num_kv_heads {k.shape[1]}")
    for name, t in (("do", do), ("o", o)):
        if t.shape != q.shape:
            raise ValueError(f"{name} {tuple(t.shape)} must have q's shape {tuple(q.shape)}")
    if lse.shape != (h, tq) or lse.dtype != torch.float32:
        raise ValueError(f"lse must be float32 (num_heads, total_q) = ({h}, {tq}), got {lse.dtype} "
                         f"{tuple(lse.shape)}")
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if t.dim() != 1 or t.dtype != torch.int32 or t.shape != cu_seqlens_q.shape:
            raise ValueError(f"{name} must be int32 (batch + 1,) like cu_seqlens_q, got {t.dtype} {tuple(t.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v), ("do", do), ("o", o)):
        if t.dtype != q.dtype or str(t.dtype).removeprefix("torch.") not in DTYPES:
            raise ValueError(f"{name} must be float16 or bfloat16 like q, got {t.dtype}")


def varlen_default_config(head_dim: int, dtype: str = "bfloat16", mask: str = "none") -> GluonBwdConfig:
    """The untuned ragged-batch choice: :func:`default_config` with the knobs the
    ragged-batch backward takes (:func:`varlen_reasons`): the dQ tile swizzled and dK,
    dV stored from registers."""
    c = dataclasses.replace(default_config(head_dim, dtype, mask), dq_stage="swizzled", kv_store="ptr")
    reasons = varlen_reasons(c, head_dim) + invalid_reasons(c, head_dim, dtype, mask)
    if reasons:
        raise ValueError(f"no Gluon ragged-batch backward for head_dim={head_dim} dtype={dtype} mask={mask}: "
                         f"{reasons[0]}")
    return c


def varlen_search_space(head_dim: int, dtype: str = "bfloat16", mask: str = "none") -> list[GluonBwdConfig]:
    """Every valid ragged-batch config: :func:`search_space` (GQA group 1) less the knobs
    :func:`varlen_reasons` rules out."""
    return [c for c in search_space(head_dim, dtype, mask) if not varlen_reasons(c, head_dim)]


def varlen_probe_variants() -> list[tuple[GluonBwdConfig, str, int, str]]:
    """(config, dtype, head_dim, mask) of every ragged-batch variant the tuner can record:
    :func:`varlen_search_space` of each head dim and mask and its dQ writer twins (the
    ``--refine dq_writer`` knob) in bfloat16 (the dtype only names the tiles' element
    type), and the default of each (head dim, mask) in float16."""
    out = []
    for d in VARLEN_HEAD_DIMS:
        for mask in MASKS:
            space = varlen_search_space(d, "bfloat16", mask)
            twins = [o for c in space for o in [dataclasses.replace(c, dq_writer=True)]
                     if is_valid(o, d, "bfloat16", mask) and not varlen_reasons(o, d)]
            out += [(c, "bfloat16", d, mask) for c in space + twins]
            out.append((varlen_default_config(d, "float16", mask), "float16", d, mask))
    return out


def _varlen_sources(directory: str | None = None):
    for c, dtype, d, mask in varlen_probe_variants():
        yield render(c, dtype, d, mask, check=False, header_hash="-", directory=directory, varlen=True)


#: The record of the ragged-batch variants' code id, beside the template (:mod:`.code_id`).
VARLEN_CODE_ID_RECORD = "gluon/attn_bwd.varlen_code_id.json"
_VARLEN_CODE_ID = CodeId(TEMPLATE, VARLEN_CODE_ID_RECORD, _varlen_sources)


@functools.lru_cache(maxsize=None)
def varlen_code_id(directory: str | None = None) -> str:
    """The code id of the ragged-batch backward (``bwd_varlen`` rows), a code id of its
    own (:class:`.code_id.CodeId`) over the sources of :func:`varlen_probe_variants`,
    every ragged-batch variant the tuner can record: an edit of the code of any of them
    changes it, an edit of no ragged-batch code keeps it (and the rows), and the dense
    rows keep theirs either way.  ``python3 -m flashgen.families.gluon`` rewrites its
    record with the backward's."""
    return _VARLEN_CODE_ID.code_id(directory)


# --------------------------------------------------------------------------- sm_90 compile (no GPU needed)

def compile_sm90(config: GluonBwdConfig, dtype: str, head_dim: int, mask: str, kernel: str = "attn_bwd",
                 check: bool = True, probe: str = "", varlen: bool = False, user=None):
    """Triton's compiled ``kernel`` of one variant for sm_90 ("attn_bwd", "attn_bwd_preprocess",
    "attn_bwd_convert", or "group_reduce", the Triton kernel of a group_split > 1 variant),
    from CPU tensors' argument types (no GPU needed; run without TRITON_INTERPRET);
    ``probe``, ``varlen``: :func:`render`'s (``varlen``: "attn_bwd" only); ``user``: a
    user score/mask functions' :class:`flashgen.user_mods.UserArgs` (their captured tensors
    on the CPU; the sizes and bounds they were made for)."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    mod = load(config, dtype, head_dim, mask, check, probe, varlen=varlen,
               user=user.name if user is not None else "")
    tdt = getattr(torch, dtype)
    b, h, hk, s = 1, 2 * config.group_split, 1, 256
    if varlen:
        if kernel != "attn_bwd":
            raise ValueError("varlen: the main kernel only (the first and last passes are .strided's)")
        qp = torch.empty(s, h, head_dim, dtype=tdt)
        kp = torch.empty(s, hk, head_dim, dtype=tdt)
        cu = torch.tensor([0, s], dtype=torch.int32)
        a = varlen_launch_args(qp, qp, kp, kp, qp, torch.empty(h, s, dtype=torch.float32), cu, cu, s, s,
                               softmax_scale=0.1, win_left=-1, win_right=-1, config=config)
    else:
        sq, sk, lo, hi = s, s, -s, s
        if user is not None:  # the sizes and bounds its block mask was made for
            b, h, hk, sq, sk, lo, hi = user.sizes
        q = torch.empty(b, h, sq, head_dim, dtype=tdt)
        k = torch.empty(b, hk, sk, head_dim, dtype=tdt)
        lse = torch.empty(b, h, sq, dtype=torch.float32)
        a = launch_args(q, q, k, k, q, lse, softmax_scale=0.1, diag_lo=lo, diag_hi=hi, config=config, user=user)
    if kernel == "group_reduce":
        from . import reduce

        fn, stage, source = reduce.group_reduce, "reduce", ASTSource
    else:
        fn, stage, source = getattr(mod, kernel), "main" if kernel == "attn_bwd" else kernel.removeprefix("attn_bwd_"), \
            GluonASTSource
    args = a[stage][1]
    sig, consts, attrs = {}, {}, {}
    for i, (name, arg) in enumerate(zip(fn.arg_names, args)):
        if fn.params[i].is_constexpr:
            sig[name], consts[(i,)] = "constexpr", arg
            continue
        sig[name] = mangle_type(arg)
        # the reduction's sizes are specialized as a launch does (a multiple of 16 is known to be one)
        if isinstance(arg, torch.Tensor) or (source is ASTSource and isinstance(arg, int) and arg % 16 == 0):
            attrs[(i,)] = [["tt.divisibility", 16]]
    opts = {"num_warps": config.num_warps if kernel == "attn_bwd" else 4}
    if kernel == "attn_bwd":
        opts["maxnreg"] = config.maxnreg
    return triton.compile(source(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32), options=opts)

"""The Gluon forward's knobs, their validity rules, and its shared-memory and register
models.  Pure: imports neither torch nor triton.

A :class:`GluonFwdVariant` is a :class:`GluonFwdSpec` (what is compiled in: dtype, head
dims, mask mode) plus a :class:`GluonFwdConfig` (what is tuned).  :func:`check` returns
the reasons a variant cannot be built (empty when it can); nothing infeasible is
rendered or compiled.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass

DTYPES = ("float16", "bfloat16")
MASKS = ("none", "causal", "window")
#: Head dims the kernel is built and checked for.  Tiles are padded to a power of two
#: (D_PAD, DV_PAD; Gluon's tensor shapes are powers of two): TMA boxes of at most 256
#: columns, a wgmma K multiple of 16 and an O accumulator whose N is at most 256.
HEAD_DIMS = (64, 96, 128, 192, 256)


def pad(d: int) -> int:
    """A head dim's tile width: the next power of two, at least 16."""
    return max(16, 1 << (d - 1).bit_length())

#: Hopper: registers per SM, the most one thread may hold, the opt-in shared memory of
#: one block (227 KB) and threads per warpgroup.
REGS_PER_SM = 65536
MAX_REGS_PER_THREAD = 255
SMEM_LIMIT_BYTES = 232448
#: Shared memory of one SM, and what the driver reserves per resident block.
SMEM_PER_SM_BYTES = 233472
SMEM_RESERVED_PER_CTA_BYTES = 1024
#: Programs resident per SM a config may ask for (``ctas_per_sm``).
CTAS_PER_SM = (1, 2, 3)
#: query rows per consumer warpgroup (one or two m64 wgmma row blocks)
BLOCK_MS = (64, 128)
WARPGROUP_THREADS = 128
#: Registers a consumer thread needs beyond its tiles (indices, row vectors, barriers,
#: addresses), and more for the mask arithmetic of masked modes; calibrated against
#: ptxas on compiled variants (d64 BLOCK_N 128 with 3 consumers at 160 registers: no
#: spill unmasked, 184 B of spills causal, 1.7 KB pinned).
CONSUMER_OVERHEAD_REGS = 32
MASK_OVERHEAD_REGS = 8
#: More for a user score function and for a user mask function's predicate (a band
#: has none), BLOCK_N / 4 registers per 32-bit word of each value read from a captured
#: tensor along the key axis (a thread holds BLOCK_N / 4 columns of the scores' layout)
#: or cast to int64 there, and USER_LOAD_REGS per such read: calibrated against ptxas
#: on the user examples (tests/test_gluon_user.py compiles them).
USER_SCORE_REGS = 8
USER_MASK_REGS = 8
USER_LOAD_REGS = 8
#: Shared memory Triton adds beyond the named buffers (alignment of the allocations).
SMEM_SLACK_BYTES = 1024


@dataclass(frozen=True)
class GluonFwdSpec:
    """What a Gluon forward binary is compiled for."""

    dtype: str = "bfloat16"
    head_dim: int = 128
    head_dim_v: int = 128
    mask: str = "none"
    #: attention sinks (float32 (num_heads,)), folded into each row's softmax after the
    #: key loop: the forward of a call with ``sinks`` and no score/mask function
    sinks: bool = False
    #: user score/mask functions: the ``KernelSpec.mods`` naming their lowering
    #: (:mod:`flashgen.user_render`, registered in this process), "" for none; with a
    #: mask function the mask mode is "window" (:func:`.user.compiled_mask`)
    user: str = ""
    #: ragged batches (``attention_varlen``): packed q (total_q, h, d), k and v
    #: (total_k, hk, d / dv) and cu_seqlens; one program per (query block, z * h) of the
    #: longest sequence, bottom-right masks per sequence (:mod:`.launch`, ``fwd_varlen``)
    varlen: bool = False
    #: the packed program layout of a varlen variant: total_q // BLOCK_MT + batch query
    #: block slots per head, each program searching cu_seqlens_q for its sequence; the
    #: launcher takes this twin of a tuned varlen variant where it launches at most
    #: :data:`.launch.VARLEN_PACKED_FRACTION` of the programs (skewed lengths;
    #: :func:`.launch.varlen_slots`)
    varlen_packed: bool = False


@dataclass(frozen=True)
class GluonFwdConfig:
    """The tuned knobs of the Gluon forward.

    BLOCK_M        query rows per consumer warpgroup: 64 (one m64 wgmma row block) or
                   128 (two row blocks per wgmma; each K/V tile serves twice the rows
                   for the same shared-memory load, and each thread holds two rows'
                   independent softmax chains; registers double, so head_dim_v 64
                   with BLOCK_N 64 fits, and head_dim_v 128 only with BLOCK_N 32).
    num_consumers  consumer warpgroups per program (1-3); a program owns
                   BLOCK_M * num_consumers query rows and they share each K/V tile.
    BLOCK_N        key rows per K/V tile: 64 or 128 in the search; 32 is built (BLOCK_M
                   128 at head_dim 128 fits the registers only with it) and measured
                   0.69-0.94x the searched tiles, so the search leaves it out.
    num_stages     depth of the K and V shared-memory rings.
    consumer_regs, producer_regs  setmaxnreg budgets (registers per thread) of each
                   consumer warpgroup and of the producer's warpgroup.
    pin_exps       keep the exponentials between the two wgmma waits in the SASS (a
                   never-taken predicated shared store; measure on vs off).
    persistent     0: one program per tile; 1: one program per SM slot walks the
                   (query block, z * h) tiles round-robin (mask none only); 2: the
                   same walk with O staged in its own buffer, so the next tile's Q
                   loads during a tile's last P V product and epilogue, and masked
                   modes take the tiles longest first within L2-sized sections of
                   (z, h) planes (:func:`persistent_order`); 3: as 2, with two Q
                   buffers per consumer, so the producer loads the next tile's Q
                   right after the current tile's first K/V tile (a whole tile ahead
                   instead of during its last P V product).
    snake          with ``persistent`` 2 or 3 and a mask: the walk deals the tiles in
                   alternating directions, program p taking the p-th tile of even
                   rounds and the p-th from the end of odd ones, so the programs that
                   get a round's longest tiles get the next round's shortest
                   (:func:`dealt_tile`; a boustrophedon order).
    serial_masked  with a mask: the key tiles that cross it retire the previous
                   tile's P V product before their softmax (no intra-warpgroup overlap
                   there), so the previous P is dead while the mask and the
                   exponentials run and the masked tiles need fewer registers than the
                   unmasked ones (the mask's own registers leave the model); the other
                   consumers' matrix work still overlaps them.
    cross_tile     with ``persistent`` 3: a tile's last P V product stays in flight
                   into the consumer's next tile (issued after that tile's first
                   score product, retired after its first softmax), then the finished
                   tile's O and LSE are stored; the tile boundary gets the
                   intra-warpgroup overlap the key loop has.  Searched only around
                   tuned rows (``flashgen tune --refine cross_tile``).
    o_in_q         with ``persistent`` 3 and head_dim_v padded as head_dim: O is
                   staged for its TMA store in the tile's own Q buffer instead of a
                   buffer of its own (BLOCK_M x head_dim_v x 2 B less shared memory per
                   consumer); a Q buffer is freed once that store has read it, after
                   the next tile's first softmax, so the producer still loads Q a tile
                   ahead.  Searched only around tuned rows (``--refine o_in_q``).
    longest_first  with one program per tile (``persistent`` 0) and a mask: the tiles
                   in sections of (z, h) planes whose K and V fit L2
                   (:func:`longest_first_section`), query block major within a
                   section, the blocks that see the most keys first (the walk's order,
                   ``_tile_coords_lpt``), so the hardware scheduler's last programs are
                   short ones, not a plane's longest after another plane's shortest.
                   Searched only around tuned rows (``--refine longest_first``).
    masked_first   with a causal or window mask: each tile's key tiles last to first
                   (FlashAttention-3's order).  The tile that crosses the diagonal is
                   then the tile's first, whose softmax has no P V product in flight to
                   overlap anyway, and a causal tile's loop after it is unmasked; in key
                   order it is the last step of the loop, masked (and with
                   ``serial_masked`` without the overlap).  Searched only around tuned
                   rows (``--refine masked_first``).
    skip_masked    with ``masked_first`` and two or three consumers: a consumer
                   releases unread the key tiles that lie wholly past its own last
                   row's diagonal (or past seqlen_q), which the producer loads for the
                   consumers of later rows and which come first in that order, and starts
                   with its own diagonal's tile.  Without it every consumer runs each
                   of the program's key tiles, its masked tail all -inf (at BLOCK_N 64
                   under an aligned causal mask the first consumer of a 128-row tile,
                   its first 64 query rows, runs one key tile more than they see: 10%
                   of the consumer steps at seqlen 512).  Searched only around tuned
                   rows (``--refine skip_masked``).
    ctas_per_sm    programs resident on one SM (1, 2 or 3): the launch register cap
                   and the shared memory of a program are the SM's divided by it (two
                   or three one-consumer programs overlap one's prologue and epilogue
                   with the others' matrix work; three leave a consumer 136 registers,
                   which only BLOCK_N 64 with head_dim_v 64 fits).
    """

    BLOCK_M: int = 64
    num_consumers: int = 2
    BLOCK_N: int = 128
    num_stages: int = 2
    consumer_regs: int = 240
    producer_regs: int = 24
    pin_exps: bool = False
    persistent: int = 0
    ctas_per_sm: int = 1
    snake: bool = False
    serial_masked: bool = False
    cross_tile: bool = False
    o_in_q: bool = False
    longest_first: bool = False
    masked_first: bool = False
    skip_masked: bool = False


@dataclass(frozen=True)
class GluonFwdVariant:
    spec: GluonFwdSpec
    config: GluonFwdConfig

    @property
    def id(self) -> str:
        """The identity string: generated file, module cache entry, log line."""
        s, c = self.spec, self.config
        dv = "" if s.head_dim_v == s.head_dim else f"_dv{s.head_dim_v}"
        dt = {"float16": "fp16", "bfloat16": "bf16"}.get(s.dtype, s.dtype)
        pers = {0: "", 1: "_pers"}.get(int(c.persistent), f"_pers{int(c.persistent)}")
        tail = ("_pin" if c.pin_exps else "") + pers + ("_snake" if c.snake else "") + \
            ("_sermask" if c.serial_masked else "") + ("_xtile" if c.cross_tile else "") + \
            ("_oq" if c.o_in_q else "") + ("_lpt" if c.longest_first else "") + ("_mf" if c.masked_first else "") + \
            ("_skip" if c.skip_masked else "") + (f"_x{c.ctas_per_sm}" if c.ctas_per_sm != 1 else "")
        mask = (f"{s.mask}_sinks" if s.sinks else s.mask) + (f"_{s.user}" if s.user else "") + \
            ("_varlen" if s.varlen else "") + ("_packed" if s.varlen_packed else "")
        return (f"gluon_fwd_d{s.head_dim}{dv}_{dt}_{mask}_m{c.BLOCK_M}x{c.num_consumers}_n{c.BLOCK_N}"
                f"_s{c.num_stages}_r{c.consumer_regs}-{c.producer_regs}{tail}")


def warpgroups(c: GluonFwdConfig) -> int:
    """Warpgroups of a program: the consumers plus the producer's (its one warp is
    padded to a warpgroup for setmaxnreg)."""
    return c.num_consumers + 1


def maxnreg(c: GluonFwdConfig) -> int:
    """The launch register cap (a multiple of 8) that lets one program hold the whole
    register file: setmaxnreg moves registers between warpgroups only when the kernel
    starts with a cap."""
    return min(MAX_REGS_PER_THREAD, REGS_PER_SM // (c.ctas_per_sm * warpgroups(c) * WARPGROUP_THREADS)) // 8 * 8


def smem_limit(c: GluonFwdConfig) -> int:
    """Shared memory one program may use: the block limit, or the SM's share per
    resident program when several are."""
    if c.ctas_per_sm == 1:
        return SMEM_LIMIT_BYTES
    return SMEM_PER_SM_BYTES // c.ctas_per_sm - SMEM_RESERVED_PER_CTA_BYTES


def consumer_regs_needed(s: GluonFwdSpec, c: GluonFwdConfig) -> int:
    """A consumer thread's register demand: the O accumulator (BLOCK_M x DV_PAD
    float32), one score tile (BLOCK_M x BLOCK_N float32), P of the previous tile in 16
    bits while its P V product is in flight, a fixed overhead, with a mask the mask's
    terms (not with ``serial_masked``: there the masked tiles hold no previous P, which
    frees more than the mask takes), and with pin_exps half a score tile more (every
    exponential is live before the wait)."""
    per = c.BLOCK_M // 64  # a warpgroup holds 64 rows per register set
    o = per * pad(s.head_dim_v) // 2
    sc = per * c.BLOCK_N // 2
    p16 = per * c.BLOCK_N // 4
    user = user_regs(s.user, c.BLOCK_N)
    mask = per * MASK_OVERHEAD_REGS if s.mask != "none" and not c.serial_masked else 0
    return o + sc + p16 + CONSUMER_OVERHEAD_REGS + mask + per * user + (sc // 2 if c.pin_exps else 0)


@functools.lru_cache(maxsize=1024)
def user_regs(mods: str, block_n: int) -> int:
    """Registers per consumer thread that user functions ``mods`` add (0 for none): a
    fixed part for a score function and for a mask function's predicate, and for each
    captured-tensor read along the key axis and each int64 value computed there
    (:data:`USER_SCORE_REGS`).  Memoized: the name hashes the lowered code, and the
    rules run it for every config the tuner enumerates."""
    if not mods:
        return 0
    from ... import user_render
    from ...user_render import tile_axes

    low = user_render.lowered(mods)
    words = loads = 0
    for g, out, base in ((low.score, low.score_out, 0), (low.mask, low.mask_out, low.mask_base)):
        if g is None:
            continue
        for i in g.uses([out]):
            n = g.nodes[i]
            if "k" not in tile_axes(n.deps):
                continue
            if n.op == "load":
                loads += 1
                words += 2 if low.bufs[base + n.args[0]].dtype == "int64" else 1
            elif n.op == "cast" and n.args[1] == "int64":
                words += 1
    predicate = low.mask is not None and low.band is None
    return ((USER_SCORE_REGS if low.score is not None else 0) + (USER_MASK_REGS if predicate else 0)
            + words * block_n // 4 + loads * USER_LOAD_REGS)


#: K/V bytes of the (z, h) planes that share a section of the persistent walk of masked
#: modes (``persistent`` 2 and 3): about two thirds of the H200's 50 MB L2, so a section's K and
#: V stay in L2 while its query blocks pass over them.
L2_SECTION_BYTES = 32 * 1024 * 1024


def section_planes(num_hz: int, group: int, seqlen_k: int, d_pad: int, dv_pad: int) -> int:
    """The most (z, h) planes a section of the persistent walk of a masked mode may hold:
    as many kv heads as fit :data:`L2_SECTION_BYTES` (seqlen_k x (d_pad + dv_pad) x 2 B
    each, at least one) times the GQA ``group``, at most num_hz."""
    kv_bytes = max(1, seqlen_k * (d_pad + dv_pad) * 2)
    return max(1, min(max(L2_SECTION_BYTES // kv_bytes, 1) * group, num_hz))


@functools.lru_cache(maxsize=1024)
def longest_first_section(num_hz: int, group: int, seqlen_k: int, d_pad: int, dv_pad: int) -> int:
    """The ``section`` argument of one program per tile in the longest-first order
    (``longest_first``): the largest multiple of the GQA ``group`` that divides num_hz and
    is at most :func:`section_planes`' L2 cap (at least ``group``), so a kv head's query
    heads share a section and every section is whole (the hardware scheduler starts
    programs in grid order: a smaller last section would start its longest tiles
    last)."""
    cap = section_planes(num_hz, group, seqlen_k, d_pad, dv_pad)
    return largest_divisor(num_hz, cap, group)


def largest_divisor(n: int, cap: int, step: int = 1) -> int:
    """The largest multiple of ``step`` that divides ``n`` and is at most ``cap``
    (``step`` when there is none): a whole number of sections of the longest-first
    orders (:func:`longest_first_section`, and the backward's)."""
    return next((s for s in range(cap - cap % step, 0, -step) if n % s == 0), step)


#: What one tile of the persistent walk costs beyond its key tiles, in key tiles (its Q
#: block, the normalisation and store of O): the constant of :func:`walk_balance`'s model.
TILE_OVERHEAD = 1.0

#: Section sizes :func:`balanced_section` compares at most (multiples of the GQA group,
#: spread evenly up to the L2 cap).
MAX_SECTION_CANDIDATES = 128

#: Whether :func:`walk_section` balances the walk (False: every section holds the L2 cap
#: of :func:`section_planes`, the rule before the balance; ``benchmarks/l2_sections.py``
#: compares the two).
BALANCE_SECTIONS = True


def key_tiles(m0: int, block_mt: int, block_n: int, seqlen_q: int, seqlen_k: int, mask: str, diag_lo: int,
              diag_hi: int) -> int:
    """BLOCK_N key tiles of the query block of ``block_mt`` rows from row ``m0``: the
    forward template's ``_key_tiles`` on Python ints (``mask``: "none", "causal" or
    "window"; ``diag_lo``/``diag_hi`` as :func:`flashgen.masks.mask_bounds` gives them)."""
    if mask == "none":
        n_start, n_end = 0, seqlen_k
    else:
        m_last = min(m0 + block_mt, seqlen_q) - 1
        n_end = max(min(seqlen_k, m_last + diag_hi + 1), 0)
        n_start = (max(m0 + diag_lo, 0) // block_n) * block_n if mask == "window" else 0
    return -(-max(n_end - n_start, 0) // block_n)


def dealt_tile(tile: int, num_tiles: int, programs: int, snake: bool) -> int:
    """The index into :func:`persistent_order` of the tile a program takes at loop index
    ``tile`` (program p's loop runs p, p + programs, ...): the same index, or with
    ``snake`` reversed within every odd round of ``programs`` tiles (the last round may
    be shorter), as the template's ``_tile_coords_lpt`` deals them."""
    if not snake:
        return tile
    rnd, pos = divmod(tile, programs)
    width = min(programs, num_tiles - rnd * programs)
    return rnd * programs + (width - 1 - pos if rnd % 2 else pos)


def walk_balance(block_work: tuple[float, ...], num_hz: int, section: int, programs: int,
                 snake: bool = False) -> float:
    """Largest over mean work of the ``programs`` programs of the static walk
    (:func:`persistent_order` dealt by :func:`dealt_tile`), where the tile of query block
    m costs ``block_work[m]``.  1.0 is a perfect balance; the kernel's time grows with
    it (the last program to finish ends the kernel).

    The tiles of one section come in runs of n_hz equal tiles (one query block over the
    section's planes); a run's whole rounds add its work to every program, and its
    pieces of a round to one range of programs (reversed in odd rounds with ``snake``):
    O(runs + programs)."""
    num_m = len(block_work)
    num_tiles = num_m * num_hz
    programs = max(1, min(programs, num_tiles))
    diff = [0.0] * (programs + 1)
    flat = 0.0
    u = 0
    for base in range(0, num_hz, section):
        n_hz = min(section, num_hz - base)
        for m in range(num_m - 1, -1, -1):
            w, end = block_work[m], u + n_hz
            while u < end:
                start = u - u % programs
                width = min(programs, num_tiles - start)
                if u == start and end - u >= programs:  # whole rounds (a round of the full width)
                    k = (end - u) // programs
                    flat += w * k
                    u += k * programs
                    continue
                e = min(end, start + width)
                lo, hi = u - start, e - start
                if snake and (start // programs) % 2:
                    lo, hi = width - hi, width - lo
                diff[lo] += w
                diff[hi] -= w
                u = e
    run, most = 0.0, 0.0
    for p in range(programs):
        run += diff[p]
        most = max(most, run)
    total = sum(block_work) * num_hz
    return (most + flat) / (total / programs) if total else 1.0


@functools.lru_cache(maxsize=1024)
def balanced_section(num_hz: int, group: int, cap: int, block_work: tuple[float, ...], programs: int,
                     snake: bool = False) -> int:
    """The section (planes per section, at most ``cap``) whose static walk is best
    balanced (:func:`walk_balance`), among multiples of the GQA ``group`` (a kv head's
    query heads stay in one section and share its K and V in L2) and ``cap`` itself; the
    cap wins unless another size is better balanced by more than half a percent, and a
    tie goes to the larger section.

    The walk deals the tiles out round-robin, so a section whose tile count is not a
    whole number of rounds shifts which programs get the long tiles of the next section;
    the cap of 32 MB gave some short causal keys a largest program 12-14% over the mean
    (``docs/design.md``, the persistent walk's balance)."""
    ks = range(1, max(1, cap // group) + 1)
    if len(ks) > MAX_SECTION_CANDIDATES:
        step = len(ks) / MAX_SECTION_CANDIDATES
        ks = sorted({ks[int(i * step)] for i in range(MAX_SECTION_CANDIDATES)} | {ks[-1]})
    cands = sorted({min(k * group, cap) for k in ks} | {cap})
    at_cap = walk_balance(block_work, num_hz, cap, programs, snake)
    best, best_b = cap, at_cap
    for sec in reversed(cands):
        b = walk_balance(block_work, num_hz, sec, programs, snake)
        if b < best_b - 1e-9:
            best, best_b = sec, b
    return best if best_b < at_cap - 0.005 else cap


def walk_section(num_hz: int, group: int, seqlen_q: int, seqlen_k: int, d_pad: int, dv_pad: int, mask: str,
                 diag_lo: int, diag_hi: int, block_mt: int, block_n: int, programs: int, snake: bool = False) -> int:
    """The launcher's ``section`` argument for the persistent walk of a masked mode:
    :func:`balanced_section` under the L2 cap of :func:`section_planes`, with each query
    block's work its key tiles (:func:`key_tiles`) plus :data:`TILE_OVERHEAD`.
    ``block_mt``: query rows per tile (BLOCK_M x num_consumers); ``programs``: the grid;
    ``snake``: the config's alternating deal."""
    cap = section_planes(num_hz, group, seqlen_k, d_pad, dv_pad)
    if not BALANCE_SECTIONS:
        return cap
    return balanced_section(num_hz, group, cap, block_work(seqlen_q, seqlen_k, mask, diag_lo, diag_hi, block_mt,
                                                           block_n), programs, snake)


@functools.lru_cache(maxsize=1024)
def block_work(seqlen_q: int, seqlen_k: int, mask: str, diag_lo: int, diag_hi: int, block_mt: int,
               block_n: int) -> tuple[float, ...]:
    """Each query block's work in the walk's model: its key tiles (:func:`key_tiles`) plus
    :data:`TILE_OVERHEAD` (memoized: the launcher asks on every call without a plan)."""
    return tuple(key_tiles(m * block_mt, block_mt, block_n, seqlen_q, seqlen_k, mask, diag_lo, diag_hi)
                 + TILE_OVERHEAD for m in range(-(-seqlen_q // block_mt)))


def persistent_order(num_m_blocks: int, num_hz: int, section: int) -> list[tuple[int, int]]:
    """(z * h, query block) of each tile index of the persistent walk of a masked mode
    (``persistent`` 2 and 3), as the template's ``_tile_coords_lpt`` computes it: sections of
    ``section`` (z, h) planes (:func:`section_planes`), and within a section query block
    major, the last block (the one that sees the most keys) first.  Program p of P
    takes tiles p, p + P, ..."""
    out = []
    for tile in range(num_m_blocks * num_hz):
        base = (tile // (section * num_m_blocks)) * section
        n_hz = min(section, num_hz - base)
        idx = tile - base * num_m_blocks
        out.append((base + idx % n_hz, num_m_blocks - 1 - idx // n_hz))
    return out


def smem_terms(s: GluonFwdSpec, c: GluonFwdConfig) -> dict[str, int]:
    """Shared memory in bytes, as named buffers."""
    es = 2
    d, dv = pad(s.head_dim), pad(s.head_dim_v)
    terms = {
        "q": (2 if c.persistent == 3 else 1) * c.num_consumers * c.BLOCK_M * d * es,
        "k_ring": c.num_stages * c.BLOCK_N * d * es,
        "v_ring": c.num_stages * c.BLOCK_N * dv * es,
        "barriers": 8 * ((4 if c.persistent == 3 else 2) * c.num_consumers + 4 * c.num_stages),
        "slack": SMEM_SLACK_BYTES,
    }
    # O is staged in Q's buffer when the shapes agree, except in the walk (unless o_in_q)
    if dv != d or (c.persistent >= 2 and not c.o_in_q):
        terms["o_staging"] = c.num_consumers * c.BLOCK_M * dv * es
    return terms


def smem_bytes(s: GluonFwdSpec, c: GluonFwdConfig) -> int:
    return sum(smem_terms(s, c).values())


def check(v: GluonFwdVariant) -> list[str]:
    """Why ``v`` cannot be built (an empty list when it can).  Each rule mirrors what
    the kernel, wgmma, TMA or setmaxnreg requires."""
    s, c = v.spec, v.config
    why = []
    if s.dtype not in DTYPES:
        why.append(f"dtype {s.dtype!r}: the Gluon forward takes {DTYPES}")
    if s.mask not in MASKS:
        why.append(f"mask {s.mask!r}: one of {MASKS}")
    for name, d in (("head_dim", s.head_dim), ("head_dim_v", s.head_dim_v)):
        if d not in HEAD_DIMS:
            why.append(f"{name}={d}: the Gluon forward is built for {HEAD_DIMS}")
    if s.user and s.user.endswith("m") and s.mask != "window":
        why.append(f"user mask function ({s.user}): compiled into the window kernel (mask 'window'), not {s.mask!r}")
    if c.BLOCK_M not in BLOCK_MS:
        why.append(f"BLOCK_M={c.BLOCK_M}: a consumer warpgroup owns 64 or 128 query rows (one or two m64 wgmma "
                   "row blocks)")
    if c.num_consumers not in (1, 2, 3):
        why.append(f"num_consumers={c.num_consumers}: 1, 2 or 3 consumer warpgroups")
    if c.BLOCK_N not in (32, 64, 128):
        why.append(f"BLOCK_N={c.BLOCK_N}: 32, 64 or 128 (a power of two, the scores' wgmma N <= 256)")
    if c.persistent not in (0, 1, 2, 3):
        why.append(f"persistent={c.persistent}: 0 (one program per tile), 1, 2 or 3 (one program per SM slot)")
    if c.persistent == 3 and s.sinks:
        why.append("persistent=3 with attention sinks: not built (the sinks variant's code id covers the walk "
                   "of persistent 2 only)")
    if c.snake and (c.persistent < 2 or s.mask == "none"):
        why.append(f"snake with persistent={c.persistent} and mask {s.mask!r}: the alternating deal is a mode of "
                   "the walks of 2 and 3 with a mask (longest-first tiles)")
    if c.snake and s.sinks:
        why.append("snake with attention sinks: not built (the sinks variant's code id covers the walk of "
                   "persistent 2 only)")
    if c.serial_masked and s.mask == "none":
        why.append("serial_masked with mask 'none': a mode of the masked key tiles of a causal or window mask "
                   "(without one only the seqlen_k tail is masked)")
    if c.serial_masked and (s.sinks or s.user):
        why.append("serial_masked with attention sinks or user score/mask functions: not built (their code id "
                   "covers the overlapped masked tiles only)")
    if c.cross_tile and c.persistent != 3:
        why.append(f"cross_tile with persistent={c.persistent}: a mode of the walk of 3 (the next tile's Q is "
                   "loaded a tile ahead, so the finishing tile's last P V product can wait for it)")
    if c.o_in_q and (c.persistent != 3 or pad(s.head_dim_v) != pad(s.head_dim)):
        why.append(f"o_in_q with persistent={c.persistent} and head dims ({s.head_dim}, {s.head_dim_v}): a mode of "
                   "the walk of 3 (its two Q buffers per consumer) where an O tile fits a Q tile (head_dim_v "
                   "padded as head_dim)")
    if c.o_in_q and c.cross_tile:
        why.append("o_in_q with cross_tile: not built (the carried tile's O is stored during the next tile)")
    if c.cross_tile and c.serial_masked:
        why.append("cross_tile with serial_masked: the next tile's first key tile is masked, and serial_masked "
                   "retires the previous P V product before a masked tile's softmax")
    if c.longest_first and (c.persistent or s.mask == "none" or s.sinks or s.user):
        why.append(f"longest_first with persistent={c.persistent}, mask {s.mask!r}"
                   + (", sinks" if s.sinks else "") + (", user functions" if s.user else "")
                   + ": the order of one program per tile under a causal or window mask (the walks take their tiles "
                   "longest first already; without a mask every query block sees every key); not built with sinks "
                   "or user functions")
    if c.masked_first and (s.mask == "none" or s.sinks or s.user or c.cross_tile):
        why.append(f"masked_first with mask {s.mask!r}" + (", sinks" if s.sinks else "")
                   + (", user functions" if s.user else "") + (", cross_tile" if c.cross_tile else "")
                   + ": the key order of a causal or window mask's tiles (without one only the seqlen_k tail is "
                   "masked); not built with sinks, user functions or cross_tile (their key loops are their own)")
    if c.skip_masked and (not c.masked_first or c.num_consumers < 2):
        why.append(f"skip_masked with masked_first={c.masked_first} and {c.num_consumers} consumer(s): the tiles "
                   "a consumer skips are those past its own rows that the producer loads first for the consumers "
                   "below it (a mode of masked_first's order with two or three consumers)")
    if s.varlen_packed and not s.varlen:
        why.append("varlen_packed without varlen: the packed program layout is one of ragged batches")
    if s.varlen and (c.persistent or c.longest_first or s.sinks or s.user):
        found = [f"persistent={c.persistent}"] * bool(c.persistent) + ["longest_first"] * bool(c.longest_first) + \
            ["sinks"] * bool(s.sinks) + ["user functions"] * bool(s.user)
        why.append(f"ragged batches (varlen) with {', '.join(found)}: the varlen forward runs one program per "
                   "(query block, z * h) of the longest sequence, in the grid's order, without sinks or user "
                   "functions")
    if c.persistent == 1 and s.mask != "none":
        why.append("persistent with a mask: programs that take the longest-first tiles round-robin are unbalanced "
                   "(H200, causal d128: 0.66-0.79x of one program per tile, which the block scheduler balances)")
    if c.ctas_per_sm not in CTAS_PER_SM:
        why.append(f"ctas_per_sm={c.ctas_per_sm}: 1, 2 or 3 programs per SM")
    if not 2 <= c.num_stages <= 8:
        why.append(f"num_stages={c.num_stages}: 2..8 ring slots")
    for name, r in (("consumer_regs", c.consumer_regs), ("producer_regs", c.producer_regs)):
        if r % 8 or not 24 <= r <= 256:
            why.append(f"{name}={r}: setmaxnreg takes a multiple of 8 in [24, 256]")
    if why:
        return why
    cap = maxnreg(c)
    pool = cap * warpgroups(c)
    if c.num_consumers * c.consumer_regs + c.producer_regs > pool:
        why.append(f"registers: {c.num_consumers} x {c.consumer_regs} + {c.producer_regs} per thread exceeds the "
                   f"pool of {warpgroups(c)} warpgroups x maxnreg {cap} = {pool}")
    need = consumer_regs_needed(s, c)
    if need > c.consumer_regs:
        why.append(f"registers: a consumer needs about {need} (O {s.head_dim_v} cols, S/P {c.BLOCK_N} cols) "
                   f"> consumer_regs {c.consumer_regs}")
    if c.producer_regs < 24:
        why.append("producer_regs < 24")
    total = smem_bytes(s, c)
    if total > smem_limit(c):
        terms = ", ".join(f"{k} {b}" for k, b in smem_terms(s, c).items())
        why.append(f"shared memory {total} B > {smem_limit(c)} B for {c.ctas_per_sm} program(s) per SM ({terms})")
    return why


def valid(v: GluonFwdVariant) -> bool:
    return not check(v)


def default_regs(num_consumers: int, ctas_per_sm: int = 1) -> tuple[int, int]:
    """(consumer_regs, producer_regs) that fill the register pool of
    ``num_consumers`` consumers: 1 -> (240, 24), 2 -> (240, 24), 3 -> (160, 32); two
    one-consumer programs per SM -> (232, 24), three -> (136, 24)."""
    c = GluonFwdConfig(num_consumers=num_consumers, ctas_per_sm=ctas_per_sm)
    pool = maxnreg(c) * warpgroups(c)
    producer = 24 if num_consumers < 3 else 32
    return min(240, (pool - producer) // num_consumers // 8 * 8), producer


def default_config(s: GluonFwdSpec) -> GluonFwdConfig:
    """The heuristic default, from the H200 measurements (docs/results/h200/gluon_fwd):
    head_dim < 128 unmasked: three consumers, BLOCK_N 128, 4 stages (FlashAttention-3's
    d64 tile; 0.98-1.00x SDPA cuDNN); otherwise two consumers (ping-pong), BLOCK_N 128
    where it fits (else 64), as many stages as fit up to 2 at head_dim >= 128 and 4
    below, exponentials pinned between the waits at head_dim 128 (+1-14% there; not
    measured at other head dims)."""
    first = []
    if pad(s.head_dim) < 128 and s.mask == "none":
        cr, pr = default_regs(3)
        first.append(GluonFwdConfig(num_consumers=3, BLOCK_N=128, num_stages=4, consumer_regs=cr, producer_regs=pr))
    cr, pr = default_regs(2)
    pin = s.head_dim == 128 and s.head_dim_v == 128
    for bn in (128, 64):
        top = 2 if s.head_dim >= 128 else 4
        for stages in range(top, 1, -1):
            for p in ((True, False) if pin else (False,)):
                first.append(GluonFwdConfig(num_consumers=2, BLOCK_N=bn, num_stages=stages, consumer_regs=cr,
                                            producer_regs=pr, pin_exps=p))
    for cfg in first:
        if valid(GluonFwdVariant(s, cfg)):
            return cfg
    raise ValueError(f"no Gluon forward config fits {s}: " + "; ".join(check(GluonFwdVariant(s, GluonFwdConfig()))))


def block_ms(head_dim_v: int) -> tuple[int, ...]:
    """The BLOCK_M values worth searching at ``head_dim_v``: 128 doubles a consumer's O
    and score registers, which fit only with head_dim_v padded to 64 (the register
    model rejects it above)."""
    return BLOCK_MS if pad(head_dim_v) <= 64 else BLOCK_MS[:1]


def space(s: GluonFwdSpec, **fixed):
    """Every valid config of the search space for ``s`` (the knob domains, filtered by
    :func:`check`); ``fixed``: knobs outside the search (``cross_tile``, ``o_in_q``) set on
    every config before the check, for the variants of a refinement knob."""
    for bm, nc, bn, stages, pin, pers, ctas, snake, serial in itertools.product(
            block_ms(s.head_dim_v), (1, 2, 3), (64, 128), (2, 3, 4, 5, 6), (False, True), (0, 1, 2, 3), CTAS_PER_SM,
            (False, True), (False, True)):
        cr, pr = default_regs(nc, ctas)
        cfg = GluonFwdConfig(BLOCK_M=bm, num_consumers=nc, BLOCK_N=bn, num_stages=stages, consumer_regs=cr,
                             producer_regs=pr, pin_exps=pin, persistent=pers, ctas_per_sm=ctas, snake=snake,
                             serial_masked=serial, **fixed)
        if valid(GluonFwdVariant(s, cfg)):
            yield cfg


#: Knobs outside the search that ``flashgen tune --refine`` varies around tuned rows.
REFINE_KNOBS = ("cross_tile", "o_in_q", "longest_first", "masked_first", "skip_masked")


def refinement_space(s: GluonFwdSpec, knob: str, max_stages: int | None = None) -> list[GluonFwdConfig]:
    """Every valid config of the search's knob domains with the refinement knob ``knob``
    (one of :data:`REFINE_KNOBS`) on (``skip_masked`` with ``masked_first``); ``max_stages``: only those of at most that many ring
    slots (the stage count is a compile-time constant of the same source)."""
    if knob not in REFINE_KNOBS:
        raise ValueError(f"knob {knob!r}: one of {REFINE_KNOBS}")
    fixed = {knob: True, **({"masked_first": True} if knob == "skip_masked" else {})}  # a mode of masked_first
    return [c for c in space(s, **fixed) if max_stages is None or c.num_stages <= max_stages]


def template_vars(v: GluonFwdVariant) -> dict:
    """The Jinja variables of the template (besides variant_id and template_hash), the
    user functions' from :func:`.user.template_vars`."""
    from .user import template_vars as user_vars

    s, c = v.spec, v.config
    return dict(dtype=s.dtype, head_dim=s.head_dim, head_dim_v=s.head_dim_v, head_dim_pad=pad(s.head_dim),
                head_dim_v_pad=pad(s.head_dim_v), mask=s.mask, BLOCK_M=c.BLOCK_M,
                NUM_CONSUMERS=c.num_consumers, BLOCK_N=c.BLOCK_N, NUM_STAGES=c.num_stages,
                CONSUMER_REGS=c.consumer_regs, PRODUCER_REGS=c.producer_regs, MAXNREG=maxnreg(c),
                # 0/1 render as False/True, as before the walk existed (the code ids follow the source)
                PIN_EXPS=c.pin_exps, PERSISTENT=c.persistent if c.persistent >= 2 else bool(c.persistent),
                CTAS_PER_SM=c.ctas_per_sm, SINKS=s.sinks, SNAKE=c.snake,
                SERIAL_MASKED=c.serial_masked, CROSS_TILE=c.cross_tile, O_IN_Q=c.o_in_q,
                LONGEST_FIRST=c.longest_first, MASKED_FIRST=c.masked_first, SKIP_MASKED=c.skip_masked,
                VARLEN=s.varlen, VARLEN_PACKED=s.varlen_packed, **user_vars(s.user))


def replace(c: GluonFwdConfig, **kw) -> GluonFwdConfig:
    return dataclasses.replace(c, **kw)

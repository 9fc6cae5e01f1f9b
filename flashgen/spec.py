"""The value types everything else passes around.

A *variant* is what flashgen compiles: a :class:`KernelSpec` (what is compiled in:
kernel, dtype, head dims, mask mode) plus a :class:`TileConfig` (what is tuned:
BLOCK_M, BLOCK_N, num_warps, num_stages).  ``Variant.id`` is the one identity string
that names the generated source file, the compiled-module cache entry, the tuning
database row and the log line (FlashInfer's "URI").

A :class:`ProblemKey` is what a call *is*: the spec plus bucketed sizes.  The tuner runs
one Optuna study per (GPU, ProblemKey); the dispatcher maps a ProblemKey to a
TileConfig.

This module imports neither torch nor triton.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from .iomodel import visible_pairs

#: The kernels flashgen generates.  ``fwd`` is the forward pass (O and LSE).  The
#: backward is two kernels with their own tile sizes, tuned independently:
#: ``bwd_dkdv`` (one program per key block, loops over query blocks, writes dK and dV)
#: and ``bwd_dq`` (one program per query block, loops over key blocks, writes dQ).
#: The ragged-batch (varlen) kernels are the same three on packed sequences
#: (``attention_varlen``): one program per (block, sequence, head), offsets from
#: cu_seqlens; their ProblemKey buckets max_seqlen_q/k and batch * heads.
#: The decode kernels (``attention_with_kvcache``, flash-decoding): ``decode`` reads a
#: contiguous cache (batch, seqlen_cache, kv_heads, d), ``decode_paged`` a paged one
#: through a block table; one program per (batch, kv head, row block, split), the GQA
#: group's query heads x seqlen_q packed into the rows of one tile, the splits merged by
#: their LSEs.  Masks ``none`` and ``causal`` only; TileConfig.num_splits >= 1.
DENSE_KERNELS = ("fwd", "bwd_dkdv", "bwd_dq")
VARLEN_KERNELS = ("fwd_varlen", "bwd_dkdv_varlen", "bwd_dq_varlen")
DECODE_KERNELS = ("decode", "decode_paged")
KERNELS = DENSE_KERNELS + VARLEN_KERNELS + DECODE_KERNELS
#: The whole dense backward as one kernel name (dQ, dK and dV of one call): what a
#: family whose backward is one launch sequence tunes (the Gluon family: preprocess,
#: main kernel, dQ convert, timed together).  Not in :data:`KERNELS`, the Triton
#: family's, whose backward is ``bwd_dq`` + ``bwd_dkdv`` under their own keys; the
#: dispatcher compares a ``bwd`` row against the sum of those two
#: (:meth:`flashgen.dispatch.Dispatcher.backward`).
WHOLE_BWD = "bwd"
#: The whole backward of a ragged batch (the Gluon family's), beside the Triton family's
#: ``bwd_dq_varlen`` + ``bwd_dkdv_varlen``, compared with their sum as ``bwd`` is.
WHOLE_BWD_VARLEN = "bwd_varlen"
#: Every kernel name a KernelSpec, a ProblemKey or a DB row may carry.
ALL_KERNELS = KERNELS + (WHOLE_BWD, WHOLE_BWD_VARLEN)
#: The kernels user score/mask functions compile into: the dense ones, and a family's
#: whole backward (unless a captured tensor is read at an index computed from the score).
USER_KERNELS = ("fwd", "bwd_dq", "bwd_dkdv", WHOLE_BWD)
#: The built-in score mods a family's whole backward may compile (the Gluon family's, as
#: fixed score functions); bias and dropout are compiled into bwd_dq and bwd_dkdv only.
WHOLE_BWD_MODS = ("softcap", "alibi", "softcap_alibi")


def whole_bwd_mods(mods: str) -> bool:
    """Whether a family's whole backward (:data:`WHOLE_BWD`) may compile ``mods``: none,
    :data:`WHOLE_BWD_MODS`, or user functions (:func:`is_user_mods`)."""
    return not mods or mods in WHOLE_BWD_MODS or is_user_mods(mods)
#: The mask modes the decode kernels compile (a sliding window is not served).
DECODE_MASKS = ("none", "causal")


def base_kernel(kernel: str) -> str:
    """The kernel whose tiling a kernel shares (``fwd_varlen`` -> ``fwd``,
    ``decode_paged`` -> ``decode``): same knob domains, shared-memory model and
    heuristic preferences."""
    if kernel == "decode_paged":
        return "decode"
    return kernel[:-len("_varlen")] if kernel.endswith("_varlen") else kernel


def is_varlen(kernel: str) -> bool:
    return kernel in VARLEN_KERNELS or kernel == WHOLE_BWD_VARLEN


def is_decode(kernel: str) -> bool:
    return kernel in DECODE_KERNELS


def supports(kernel: str, mask: str) -> bool:
    """Whether ``kernel`` is compiled for mask mode ``mask``."""
    return mask in (DECODE_MASKS if is_decode(kernel) else MASKS)

#: Mask modes compiled into a kernel.  ``none``: every query sees every key.
#: ``causal``: query i sees key j iff j - i <= diag, where diag is a runtime value
#: (seqlen_k - seqlen_q for FlashAttention's bottom-right alignment, 0 for torch SDPA's
#: top-left alignment).  ``window``: query i sees key j iff lo <= j - i <= hi, both
#: runtime values (a sliding window, optionally causal).
MASKS = ("none", "causal", "window")
#: The window (left, right) ``window`` keys are timed with, bottom-right aligned (the
#: tuner's problem keys carry no window size): a local causal window.  Their FLOPs
#: count the scores it lets through (:func:`shape_flops`).
TIMING_WINDOW = (1024, 0)

#: Score modifications compiled into the dense kernels (``KernelSpec.mods``), applied
#: in this order to s = softmax_scale * q·k (FlashAttention-2's ``softcap`` and
#: ``alibi_slopes``, Gemma 2's logit soft-capping, Press et al. 2022's ALiBi):
#: ``softcap``  s <- softcap * tanh(s / softcap)
#: ``alibi``    s <- s - slope[head] * |i + seqlen_k - seqlen_q - j|
#: ``bias``     s <- s + bias[b, h, i, j]   (an additive tensor, read tile by tile)
#: then the mask, the softmax, and ``dropout`` of the normalized probabilities
#: (P <- P * keep / (1 - dropout_p), keep drawn from Philox keyed by (seed, offset,
#: batch, head, row, column)).  A spec's ``mods`` is "" or a subset joined by "_" in
#: this order (:func:`mods_name`).
MODS = ("softcap", "alibi", "bias", "dropout")


def mods_name(*, softcap: bool = False, alibi: bool = False, bias: bool = False, dropout: bool = False) -> str:
    """The canonical ``KernelSpec.mods`` string of a set of score modifications."""
    on = dict(softcap=softcap, alibi=alibi, bias=bias, dropout=dropout)
    return "_".join(m for m in MODS if on[m])


#: A ``mods`` value naming user score/mask functions (:mod:`flashgen.user_mods`): "u",
#: 12 hex digits of the sha256 of their lowered code (:mod:`flashgen.user_render`),
#: and "m" when a mask function (block-sparse ranges) is compiled in.  Not combined with
#: the built-in mods.
_USER_MODS = re.compile(r"u[0-9a-f]{12}m?")


def is_user_mods(mods: str) -> bool:
    """Whether ``mods`` names user score/mask functions (see :data:`_USER_MODS`)."""
    return bool(mods) and mods[0] == "u" and _USER_MODS.fullmatch(mods) is not None


def mods_set(mods: str) -> frozenset[str]:
    """The modifications named by a ``mods`` string ("" -> none)."""
    return frozenset(mods.split("_")) if mods else frozenset()


def all_mods() -> list[str]:
    """Every canonical ``mods`` string, "" first."""
    import itertools

    return [mods_name(**dict(zip(MODS, bits))) for bits in itertools.product((False, True), repeat=len(MODS))]


def compiled_variant(v: "Variant") -> "Variant":
    """The variant whose code runs for ``v``: itself, except that a causal ``fwd`` or
    ``bwd_dq`` spec with a ``bias`` runs the window kernel (the same mask: a causal problem's lower bound on
    j - i is -seqlen_q, which the window kernel reads as unbounded).  On sm_90 with
    Triton 3.6 the causal kernel with a bias tile spills (fwd 1368-1376 bytes per thread,
    dQ 104; ``python3 benchmarks/sm90_compile.py --launch-like ...``, ptxas -v) where the
    window kernel, whose loops differ only in a masked prologue that is empty here,
    spills none (docs/design.md, "The templates"); dK/dV spills either way, less as causal
    (336 vs 508 bytes), and stays.  A tma variant launched with a descriptor-addressable
    bias (BIAS_TMA, the bias tile through TMA) compiles the causal forward without spills
    (d128 m64 n64 w4 s3: 166 registers, 0 bytes), but the same variant's pointer fallback
    (BIAS_TMA False) still spills as above, so the routing stays.  The tuner's and the
    dispatcher's keys stay causal; :func:`flashgen.compile.load` applies this."""
    s = v.spec
    if s.kernel in ("fwd", "bwd_dq") and s.mask == "causal" and "bias" in mods_set(s.mods):
        return Variant(dataclasses.replace(s, mask="window"), v.config)
    if s.mask != "window" and is_user_mods(s.mods) and s.mods.endswith("m"):
        # A user mask function: the block mask's ranges and the window kernel's loops
        # serve every mask mode (the built-in mask enters the ranges and the predicate).
        return Variant(dataclasses.replace(s, mask="window"), v.config)
    return v


def kernel_mods(kernel: str) -> list[str]:
    """The ``mods`` strings ``kernel`` compiles: every set for the dense kernels, ""
    and :data:`WHOLE_BWD_MODS` for a family's whole backward, "" for the others."""
    if kernel == WHOLE_BWD:
        return ["", *WHOLE_BWD_MODS]
    return all_mods() if kernel in DENSE_KERNELS else [""]


#: The kernel family of a TileConfig that names none (rows and ids written before
#: families existed): plain Triton, the portable family (:mod:`flashgen.families`).
DEFAULT_FAMILY = "triton"

DTYPES = ("float16", "bfloat16", "float32")
_DTYPE_SHORT = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


def next_pow2(x: int) -> int:
    """Smallest power of two >= x (1 for x <= 1)."""
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


@dataclass(frozen=True)
class KernelSpec:
    """What is compiled into a kernel (a change here is a different program).

    head_dim is the query/key head dim, head_dim_v the value (and output) head dim;
    both are padded to a power of two inside the kernel (``head_dim_pad``).
    """

    kernel: str
    dtype: str
    head_dim: int
    head_dim_v: int
    mask: str
    mods: str = ""

    def __post_init__(self):
        if self.mods:
            if is_user_mods(self.mods):
                if self.kernel not in USER_KERNELS:
                    raise ValueError(f"user score/mask functions ({self.mods}) are compiled into {USER_KERNELS} "
                                     f"only, not {self.kernel!r}")
            elif self.mods not in all_mods():
                raise ValueError(f"mods must be '' or a '_'-joined subset of {MODS} in that order, got {self.mods!r}")
            elif self.kernel not in DENSE_KERNELS and not (self.kernel == WHOLE_BWD and whole_bwd_mods(self.mods)):
                raise ValueError(f"score modifications ({self.mods}) are compiled into {DENSE_KERNELS} only (and "
                                 f"{WHOLE_BWD!r} for {WHOLE_BWD_MODS}), not {self.kernel!r}")
        if self.kernel not in ALL_KERNELS:
            raise ValueError(f"kernel must be one of {ALL_KERNELS}, got {self.kernel!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.mask not in MASKS:
            raise ValueError(f"mask must be one of {MASKS}, got {self.mask!r}")
        if not supports(self.kernel, self.mask):
            raise ValueError(f"kernel {self.kernel!r} serves masks {DECODE_MASKS}, got {self.mask!r}")
        for name in ("head_dim", "head_dim_v"):
            d = getattr(self, name)
            if not (isinstance(d, int) and 8 <= d <= 256 and d % 8 == 0):
                raise ValueError(f"{name} must be a multiple of 8 in [8, 256], got {d!r}")

    @property
    def head_dim_pad(self) -> int:
        return max(16, next_pow2(self.head_dim))

    @property
    def head_dim_v_pad(self) -> int:
        return max(16, next_pow2(self.head_dim_v))

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def id(self) -> str:
        d = f"d{self.head_dim}" if self.head_dim == self.head_dim_v else f"d{self.head_dim}v{self.head_dim_v}"
        base = f"attn_{self.kernel}_{d}_{_DTYPE_SHORT[self.dtype]}_{self.mask}"
        return f"{base}_{self.mods}" if self.mods else base


#: TileConfig knobs shown in ``id`` as a bare tag when set, and those shown as tag + value.
_FLAG_TAGS = (("pin", "_pin"), ("persistent", "_pers"), ("dq_atomic", "_dqat"), ("split", "_split"),
              ("half_partials", "_hp"), ("dq_ordered", "_dqord"), ("dq_stage", "_dqf"),
              ("kv_store", "_kvt"), ("snake", "_snake"), ("serial_masked", "_sermask"), ("cross_tile", "_xtile"),
              ("o_in_q", "_oq"), ("longest_first", "_lpt"), ("masked_first", "_mf"), ("skip_masked", "_skip"),
              ("dq_writer", "_dqw"))
_INT_TAGS = (("ctas_per_sm", "x"), ("row_load", "rows"), ("producer_warps", "p"), ("group_split", "gs"),
              ("dq_chunks", "cs"), ("lookahead", "la"))


@dataclass(frozen=True)
class TileConfig:
    """What the tuner searches: tile sizes, warps per program, software-pipeline depth,
    and the Hopper-era switches.

    For ``fwd`` and ``bwd_dq`` BLOCK_M is the query tile each program owns and BLOCK_N
    the key tile streamed through it; for ``bwd_dkdv`` BLOCK_N is the key tile each
    program owns and BLOCK_M the query tile streamed through it.

    The knobs after num_stages default to 0 ("off" / "not used by this kernel") and
    appear in ``id`` only when set, so ids of configs without them never change:
    ``tma`` 1 loads the streamed tiles through tensor descriptors (the Tensor Memory
    Accelerator, sm_90+); ``ws`` 1 warp-specializes the main loop
    (``tl.range(..., warp_specialize=True)``); ``num_splits`` is the number of programs
    a decode problem's key sequence is split across (flash-decoding), 0 elsewhere.

    ``family`` names the kernel family that writes the kernel (:mod:`flashgen.families`;
    the dispatcher picks between families by measured rows like any other knob).  It
    defaults to :data:`DEFAULT_FAMILY` and is a prefix of ``id`` only when it is not the
    default, so the ids (and the DB rows, generated files and code hashes) of the plain
    Triton family never change: ``m128_n64_w8_s3`` vs ``gluon_m64_n128_w8_s2``.

    The Gluon family's knobs (:mod:`flashgen.families.gluon`) follow, each 0 unless set
    and in ``id`` only when set, so no Triton id changes.  For that family BLOCK_M is the
    query rows per consumer warpgroup (forward) or per step (backward), BLOCK_N the key
    rows per K/V tile (forward) or per consumer (backward), ``num_warps`` the consumer
    warps (4 per consumer warpgroup; the producer's warpgroup comes on top) and
    ``num_stages`` the depth of the shared-memory ring.  ``consumer_regs`` /
    ``producer_regs``: setmaxnreg budgets (0: the family's default split for the consumer
    count; ``_r240-24``); ``pin`` 1 keeps the forward's exponentials between its two
    wgmma waits (``_pin``); ``persistent`` 1: one forward program per SM slot (``_pers``), 2: the same with the next tile's
    Q loaded during a tile's epilogue and masked tiles walked longest first (``_pers2``), 3: as 2
    with two Q buffers, the next tile's Q loaded a whole tile ahead (``_pers3``);
    ``ctas_per_sm``: forward programs resident per SM (0 = 1; ``_x2``); ``dq_atomic`` 1:
    the backward adds dQ by float32 atomics instead of TMA reduce-add (``_dqat``);
    ``row_load``: how the backward's consumers get LSE and delta (0 TMA through the ring,
    1 the producer's loads, 2 their own pointer loads; ``_rows1``); ``producer_warps``
    (0 = 1; ``_p4``); ``split`` 1: one partition per backward consumer warpgroup
    (``_split``); ``group_split``: backward programs sharing one kv head's GQA group,
    dK/dV summed from float32 partials afterwards (0 = 1; ``_gs4``; a divisor of the
    key's group); ``half_partials`` 1: those partials in the inputs' 16-bit dtype
    (``_hp``); ``dq_ordered`` 1: the backward's TMA reduce-adds into each dQ tile are made
    in the order of the key blocks (int32 semaphores), so dQ is bitwise repeatable: what
    the deterministic backward runs (``_dqord``); ``dq_stage`` 1: the backward's dQ tile
    is staged for its reduce-add in the wgmma accumulator's fragment order instead of
    row-major with the 128-byte swizzle (``_dqf``); ``kv_store`` 1: the backward's dK
    and dV leave through the program's K and V tiles in shared memory by TMA stores
    instead of register stores (``_kvt``); ``snake`` 1: the forward's walk of 2 or 3 with a
    mask deals its tiles in alternating directions, odd rounds from the last program
    (``_snake``); ``serial_masked`` 1: the forward's key tiles that cross a causal or
    window mask retire the previous P V product before their softmax (``_sermask``);
    ``cross_tile`` 1: the forward's walk of 3 keeps a tile's last P V product in flight
    into the next tile (``_xtile``); ``o_in_q`` 1: the forward's walk of 3 stages O in
    the tile's Q buffer (``_oq``); ``longest_first`` 1: the backward's masked modes start
    the key blocks that see the most query blocks first, across sections of (batch, kv
    head) pairs (``_lpt``), and the forward's one program per tile under a mask takes
    its tiles in the persistent walk's longest-first order (``_lpt``); ``masked_first`` 1:
    the forward's key tiles of each query tile run last to first under a causal or
    window mask, the diagonal's masked tile first (``_mf``); ``skip_masked`` 1: with
    ``masked_first``, each consumer warpgroup releases unread the key tiles past its own
    rows (``_skip``); ``dq_writer`` 1: the backward's dQ tiles leave through a one-warp
    writer partition that issues their reduce-adds (and, ordered, waits on and releases
    the tiles' semaphores) from two staging buffers per consumer partition (``_dqw``);
    ``dq_chunks`` n > 0: the head_dim 256 backward's column-split program (its two
    consumer warpgroups share the key rows and split the head_dim columns), dQ made and
    added in n column chunks (``_cs4``); ``lookahead`` 1 or 2: that program issues the
    next step's S^T and dP^T during its dQ chunks, after dK (``_la1``) or interleaved
    with the chunks (``_la2``).
    """

    BLOCK_M: int
    BLOCK_N: int
    num_warps: int
    num_stages: int
    tma: int = 0
    ws: int = 0
    num_splits: int = 0
    family: str = DEFAULT_FAMILY
    consumer_regs: int = 0
    producer_regs: int = 0
    pin: int = 0
    persistent: int = 0
    ctas_per_sm: int = 0
    dq_atomic: int = 0
    row_load: int = 0
    producer_warps: int = 0
    split: int = 0
    group_split: int = 0
    half_partials: int = 0
    dq_ordered: int = 0
    dq_stage: int = 0
    kv_store: int = 0
    snake: int = 0
    serial_masked: int = 0
    cross_tile: int = 0
    o_in_q: int = 0
    longest_first: int = 0
    masked_first: int = 0
    skip_masked: int = 0
    dq_writer: int = 0
    dq_chunks: int = 0
    lookahead: int = 0

    @property
    def id(self) -> str:
        s = f"m{self.BLOCK_M}_n{self.BLOCK_N}_w{self.num_warps}_s{self.num_stages}"
        if self.family != DEFAULT_FAMILY:
            s = f"{self.family}_{s}"
        if self.tma:
            s += "_tma"
        if self.ws:
            s += "_ws"
        if self.num_splits:
            s += f"_sp{self.num_splits}"
        if self.consumer_regs or self.producer_regs:
            s += f"_r{self.consumer_regs}-{self.producer_regs}"
        for name, tag in _FLAG_TAGS:
            val = getattr(self, name)
            if val:
                s += tag if val == 1 else f"{tag}{val}"
        for name, tag in _INT_TAGS:
            val = getattr(self, name)
            if val:
                s += f"_{tag}{val}"
        return s

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TileConfig":
        """From a dict or DB row; optional knobs that are missing or NULL (rows written
        before they existed) take their defaults (a row without ``family`` is the
        Triton family's)."""
        kw = {}
        for f in dataclasses.fields(cls):
            val = d.get(f.name) if hasattr(d, "get") else d[f.name]
            if val is None:
                if f.default is dataclasses.MISSING:
                    raise KeyError(f.name)
                continue
            kw[f.name] = str(val) if f.name == "family" else int(val)
        return cls(**kw)


@dataclass(frozen=True)
class Variant:
    spec: KernelSpec
    config: TileConfig

    @property
    def family(self) -> str:
        """The kernel family that renders, compiles and launches this variant."""
        return self.config.family

    @property
    def id(self) -> str:
        """e.g. ``attn_fwd_d128_bf16_causal_m128_n64_w8_s3`` (another family than the
        default: ``attn_fwd_d128_bf16_causal_gluon_m128_n128_w4_s2``)."""
        return f"{self.spec.id}_{self.config.id}"


# ---------------------------------------------------------------------------------
# Problem keys and bucketing

def seqlen_bucket(n: int) -> int:
    """Bucket a sequence length: the next power of two, at least 16."""
    return max(16, next_pow2(n))


def decode_seqlen_q_bucket(n: int) -> int:
    """Bucket a decode call's seqlen_q: the next power of two, at least 1."""
    return next_pow2(max(1, n))


def batch_heads_bucket(n: int) -> int:
    """Bucket batch * num_heads: the next power of two, at least 1."""
    return next_pow2(max(1, n))


#: Layout signatures of a ProblemKey: "" (every input addressable by a tensor
#: descriptor) and "strided" (pointer loads only).
LAYOUTS = ("", "strided")


@dataclass(frozen=True)
class ProblemKey:
    """What a call is, for tuning and dispatch.

    ``group`` is the GQA group size num_heads // num_kv_heads (1 for MHA).  The sizes
    are buckets (:func:`seqlen_bucket`, :func:`batch_heads_bucket`), not exact sizes.
    ``layout`` is the inputs' layout signature (:data:`LAYOUTS`): ``""`` when a tensor
    descriptor can address every input (16-byte aligned base and strides, last stride
    1: contiguous tensors, their transposed views, most slices; what ``flashgen tune``
    measures), ``"strided"`` otherwise (an unaligned slice, expanded heads), where only
    pointer loads serve.  It appears in ``id`` only when set, so the ids of the common
    layout never change.
    """

    spec: KernelSpec
    group: int
    seqlen_q: int
    seqlen_k: int
    batch_heads: int
    layout: str = ""

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")

    @classmethod
    def from_sizes(cls, spec: KernelSpec, *, batch: int, num_heads: int, num_kv_heads: int,
                   seqlen_q: int, seqlen_k: int, layout: str = "") -> "ProblemKey":
        """The key of a call (``layout``: see the class docstring).  For the decode kernels seqlen_q is bucketed by
        :func:`decode_seqlen_q_bucket` (1, 2, 4, 8, 16, ...: decode steps and short
        speculative chunks stay apart) and seqlen_k is the cache's capacity (its
        seqlen_cache, or max_pages * page_size), not the per-batch lengths."""
        sq = decode_seqlen_q_bucket(seqlen_q) if is_decode(spec.kernel) else seqlen_bucket(seqlen_q)
        return cls(spec, num_heads // num_kv_heads, sq, seqlen_bucket(seqlen_k),
                   batch_heads_bucket(batch * num_heads), layout)

    @classmethod
    def from_varlen_sizes(cls, spec: KernelSpec, *, batch: int, num_heads: int, num_kv_heads: int,
                          max_seqlen_q: int, max_seqlen_k: int) -> "ProblemKey":
        """The key of a varlen call: buckets of max_seqlen_q/k and batch * num_heads
        (``batch`` = number of sequences)."""
        return cls.from_sizes(spec, batch=batch, num_heads=num_heads, num_kv_heads=num_kv_heads,
                              seqlen_q=max_seqlen_q, seqlen_k=max_seqlen_k)

    @property
    def id(self) -> str:
        base = f"{self.spec.id}_g{self.group}_q{self.seqlen_q}_k{self.seqlen_k}_bh{self.batch_heads}"
        return f"{base}_{self.layout}" if self.layout else base

    def as_row(self) -> dict:
        """Flat columns for the tuning database."""
        return {
            "key": self.id, "kernel": self.spec.kernel, "dtype": self.spec.dtype,
            "head_dim": self.spec.head_dim, "head_dim_v": self.spec.head_dim_v,
            "mask": self.spec.mask, "group_size": self.group,
            "seqlen_q_bucket": self.seqlen_q, "seqlen_k_bucket": self.seqlen_k,
            "batch_heads_bucket": self.batch_heads, "layout": self.layout, "mods": self.spec.mods,
        }

    @classmethod
    def from_row(cls, row: dict) -> "ProblemKey":
        spec = KernelSpec(row["kernel"], row["dtype"], int(row["head_dim"]),
                          int(row["head_dim_v"]), row["mask"], row.get("mods") or "")
        return cls(spec, int(row["group_size"]), int(row["seqlen_q_bucket"]),
                   int(row["seqlen_k_bucket"]), int(row["batch_heads_bucket"]), row.get("layout") or "")


@dataclass(frozen=True)
class Shape:
    """A concrete problem size that a tuner measures (and the flop count it implies)."""

    batch: int
    num_heads: int
    num_kv_heads: int
    seqlen_q: int
    seqlen_k: int

    def key(self, spec: KernelSpec) -> ProblemKey:
        return ProblemKey.from_sizes(spec, batch=self.batch, num_heads=self.num_heads,
                                     num_kv_heads=self.num_kv_heads, seqlen_q=self.seqlen_q,
                                     seqlen_k=self.seqlen_k)


def attention_flops(batch: int, num_heads: int, seqlen_q: int, seqlen_k: int, head_dim: int,
                    head_dim_v: int | None = None, *, causal: bool = False,
                    kernel: str = "fwd") -> float:
    """FLOPs by the FlashAttention papers' convention.

    ``fwd``: 2·b·h·sq·sk·(d + dv) (= 4·b·h·sq·sk·d when d == dv), halved for causal
    (a sliding window's count is the scores it lets through: :func:`shape_flops`).
    ``bwd`` (the whole backward) is 2.5x the forward: five matmuls, the recomputation
    of S not counted.
    For the two backward kernels separately we count the matmuls each executes:
    ``bwd_dkdv`` four (S^T, dV, dP^T, dK: 2.0x fwd), ``bwd_dq`` three (S, dP, dQ: 1.5x).
    A varlen kernel counts as its dense one on the given sizes (sum over the sequences:
    :func:`shape_flops`).  A decode kernel counts as the forward with seqlen_k = the
    cache length, not halved for causal (seqlen_q << seqlen_k: the masked triangle is
    negligible); decode is bandwidth-bound, so its figure of merit is bytes / s.
    """
    dv = head_dim if head_dim_v is None else head_dim_v
    f = 2.0 * batch * num_heads * seqlen_q * seqlen_k * (head_dim + dv)
    if causal and not is_decode(kernel):
        f /= 2
    return f * {"fwd": 1.0, "bwd": 2.5, "bwd_dkdv": 2.0, "bwd_dq": 1.5, "decode": 1.0}[base_kernel(kernel)]


def varlen_lengths(n_seqs: int, max_len: int) -> list[int]:
    """Deterministic document lengths for a varlen Shape: ``n_seqs`` documents, the
    first ``max_len`` long, the others spread over [max_len / 2, max_len].  The tuner
    and the benchmarks time a varlen key on these lengths."""
    return [max_len if i == 0 else max(1, max_len - (i * 7919) % (max_len // 2 + 1)) for i in range(n_seqs)]


def shape_flops(kernel: str, shape, head_dim: int, head_dim_v: int | None = None, *, causal: bool = False,
                window: tuple[int, int] | None = None) -> float:
    """FLOPs (a count, not a rate) of ``kernel`` on ``shape`` as the tuner times it, by
    :func:`attention_flops`' convention (the FlashAttention papers'): a dense or decode
    shape (batch, heads, seqlen_q, seqlen_k) as given; a varlen shape as its documents
    (:func:`varlen_lengths` of Shape.batch documents of up to Shape.seqlen_q / seqlen_k
    tokens, batch 1 each), summed over them.

    ``window``: (left, right) in tokens, -1 unbounded, as
    :func:`flashgen.masks.mask_bounds` takes it (``window`` keys are timed with
    :data:`TIMING_WINDOW`).  None or (-1, -1): :func:`attention_flops`' count (causal
    halves it).  Otherwise the count of the scores the window lets through: the
    (query i, key j) pairs with diag_lo <= j - i <= diag_hi, bottom-right aligned,
    ``causal`` closing the right side (:func:`flashgen.iomodel.visible_pairs`, per
    document for a varlen shape), times a score's FLOPs: 2·b·h·(d + dv) for ``fwd``
    (4·b·h·d when d == dv), 2.5x that for ``bwd``, 2.0x for ``bwd_dkdv``, 1.5x for
    ``bwd_dq``."""
    if is_varlen(kernel):
        lens_q = varlen_lengths(shape.batch, shape.seqlen_q)
        lens_k = lens_q if shape.seqlen_k == shape.seqlen_q else varlen_lengths(shape.batch, shape.seqlen_k)
        batch, seqs = 1, list(zip(lens_q, lens_k))
    else:
        batch, seqs = shape.batch, [(shape.seqlen_q, shape.seqlen_k)]
    if window is None or tuple(window) == (-1, -1):
        return sum(attention_flops(batch, shape.num_heads, lq, lk, head_dim, head_dim_v, causal=causal, kernel=kernel)
                   for lq, lk in seqs)
    per_score = attention_flops(batch, shape.num_heads, 1, 1, head_dim, head_dim_v, kernel=kernel)
    return per_score * sum(visible_pairs(lq, lk, causal=causal, window=tuple(window)) for lq, lk in seqs)


#: Outcomes of one measurement (KernelTuner's "failures are values").
STATUSES = ("ok", "invalid", "infeasible", "compile_failed", "launch_failed", "wrong_result", "timeout")


@dataclass(frozen=True)
class Measurement:
    """What a benchmarker returns for one (variant, shape).

    median_ms is the median of CUDA-event timings after warm-up (None unless ok);
    max_abs_err is the worst error against the float64 reference (when checked);
    smem_bytes_compiled / n_spills are what the compiler reported (None if unknown).
    """

    status: str
    median_ms: float | None = None
    max_abs_err: float | None = None
    smem_bytes_compiled: int | None = None
    n_spills: int | None = None
    n_regs: int | None = None
    error: str | None = None

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")

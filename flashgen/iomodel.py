"""How many bytes attention moves to and from HBM: a model, as pure arithmetic.

The FlashAttention paper's argument (Dao et al. 2022, Section 3.2) in numbers: the
standard implementation writes the seqlen_q x seqlen_k score matrix S and probability
matrix P to HBM and reads them back, Theta(N^2) bytes; the tiled kernel keeps them in
SRAM and pays instead for re-reading K and V once per query tile, Theta(N^2 d / BLOCK_M).

Every count here is a list of named :class:`Term` (a tensor, read or written, how many
times), so a table can show where the bytes go and a test can check each term by hand.
The model counts what each kernel asks of global memory, with no cache: the L2 (60 MB
on an H200, as torch reports it) can serve a re-read of K and V, which is why measured DRAM bytes
(``benchmarks/ncu_io.py``) can fall below the tiled model.

Conventions (flashgen's, :mod:`flashgen.masks`): ``causal`` is bottom-right aligned;
``window=(left, right)``, -1 unbounded.  Sizes are per tensor: batch b, query heads h,
key/value heads h_kv (GQA), seqlen_q, seqlen_k, head_dim d, head_dim_v dv, element size
``dtype_bytes``; LSE and delta are float32.

Naive forward (the paper's Algorithm 0): read Q, K; write S; read S, write P; read P,
V; write O.  Naive backward (Algorithm 3, with delta = rowsum(dO * O) as
FlashAttention-2 computes it): dV = P^T dO; dP = dO V^T; delta; dS = P * (dP - delta);
dQ = dS K; dK = dS^T Q; each step reads its operands from HBM and writes its result.

Tiled forward (flashgen's ``attn_fwd``, one program per query block of BLOCK_M rows):
reads its Q tile once, streams the K and V rows of the key blocks it visits (all of
them without a mask; fully masked blocks are skipped, as the kernels do), writes O and
the LSE once.  Tiled backward (``attn_bwd_dq`` then ``attn_bwd_dkdv``): the dQ kernel
reads Q, dO, O and the LSE once per query block and the visited K, V rows once per
query block, and writes dQ and delta; the dK/dV kernel reads K and V once per key
block and the visited Q, dO rows and their LSE and delta once per key block (for every
query head of its GQA group), and writes dK and dV.

Also here: :func:`visible_pairs`, the exact number of (query, key) pairs a mask lets
through, for exact FLOP counts of windowed attention.

This module imports neither torch nor triton.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .masks import mask_bounds

LSE_BYTES = 4  # LSE and delta are float32
MIB = 1 << 20
GIB = 1 << 30


@dataclass(frozen=True)
class Term:
    """One tensor's traffic: ``what`` (e.g. "K, V per query block"), ``kind`` "read" or
    "write", and its size in bytes (all repetitions included)."""

    what: str
    kind: str
    bytes: int


@dataclass
class IOCount:
    """A named sum of :class:`Term`."""

    name: str
    terms: list[Term] = field(default_factory=list)

    def add(self, what: str, kind: str, nbytes: int) -> "IOCount":
        assert kind in ("read", "write"), kind
        self.terms.append(Term(what, kind, int(nbytes)))
        return self

    @property
    def read_bytes(self) -> int:
        return sum(t.bytes for t in self.terms if t.kind == "read")

    @property
    def write_bytes(self) -> int:
        return sum(t.bytes for t in self.terms if t.kind == "write")

    @property
    def total_bytes(self) -> int:
        return self.read_bytes + self.write_bytes

    def as_dict(self) -> dict:
        return {"name": self.name, "read_bytes": self.read_bytes, "write_bytes": self.write_bytes,
                "total_bytes": self.total_bytes,
                "terms": [{"what": t.what, "kind": t.kind, "bytes": t.bytes} for t in self.terms]}


@dataclass(frozen=True)
class Problem:
    """The sizes of one attention call."""

    seqlen_q: int
    seqlen_k: int
    head_dim: int
    head_dim_v: int | None = None
    batch: int = 1
    num_heads: int = 1
    num_kv_heads: int | None = None
    dtype_bytes: int = 2
    causal: bool = False
    window: tuple[int, int] = (-1, -1)

    @property
    def dv(self) -> int:
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def hkv(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def bh(self) -> int:
        """batch x query heads."""
        return self.batch * self.num_heads

    def bounds(self) -> tuple[str, int, int]:
        return mask_bounds(self.seqlen_q, self.seqlen_k, causal=self.causal, window=self.window)


# ---------------------------------------------------------------------------------
# Visible pairs (exact FLOP counts)

def visible_pairs(seqlen_q: int, seqlen_k: int, *, causal: bool = False,
                  window: tuple[int, int] = (-1, -1), align: str = "bottom_right") -> int:
    """The exact number of (i, j), 0 <= i < seqlen_q, 0 <= j < seqlen_k, that the mask
    lets through (flashgen's conventions, any seqlen_q and seqlen_k).

    Sums the length of each diagonal j - i = t in [diag_lo, diag_hi] inside the
    rectangle: O(seqlen_q + seqlen_k) integer work."""
    _, lo, hi = mask_bounds(seqlen_q, seqlen_k, causal=causal, window=window, align=align)
    lo, hi = max(lo, -(seqlen_q - 1)), min(hi, seqlen_k - 1)
    total = 0
    for t in range(lo, hi + 1):
        # i from max(0, -t) to min(seqlen_q - 1, seqlen_k - 1 - t)
        n = min(seqlen_q - 1, seqlen_k - 1 - t) - max(0, -t) + 1
        total += max(0, n)
    return total


def forward_flops(batch: int, num_heads: int, seqlen_q: int, seqlen_k: int, head_dim: int,
                  head_dim_v: int | None = None, *, causal: bool = False,
                  window: tuple[int, int] = (-1, -1)) -> float:
    """Forward FLOPs as benchmarks report them: 2·b·h·sq·sk·(d + dv) (4·b·h·sq·sk·d),
    halved for causal (the FlashAttention papers' convention); for a sliding window
    (left or right bound given) the exact count, 2·b·h·(d + dv) per visible pair."""
    dv = head_dim if head_dim_v is None else head_dim_v
    per_pair = 2.0 * batch * num_heads * (head_dim + dv)
    if tuple(window) != (-1, -1):
        return per_pair * visible_pairs(seqlen_q, seqlen_k, causal=causal, window=window)
    f = per_pair * seqlen_q * seqlen_k
    return f / 2 if causal else f


# ---------------------------------------------------------------------------------
# Block ranges, as the kernels compute them (templates/_common.j2)

def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def key_rows_per_query_block(p: Problem, block_m: int, block_n: int) -> list[int]:
    """Key rows each query block of the forward / dQ kernel loads (key_ranges: fully
    masked key blocks are skipped; a started block loads up to BLOCK_N rows, clipped at
    seqlen_k)."""
    mode, lo, hi = p.bounds()
    sk = p.seqlen_k
    out = []
    for m0 in range(0, p.seqlen_q, block_m):
        m_last = m0 + block_m - 1
        if mode == "none":
            n_start, n_end = 0, sk
        else:
            n_start = (max(m0 + lo, 0) // block_n) * block_n if mode == "window" else 0
            n_end = max(min(sk, m_last + hi + 1), 0)
        if n_end <= n_start:
            out.append(0)
        else:
            out.append(min(sk, n_start + _cdiv(n_end - n_start, block_n) * block_n) - n_start)
    return out


def query_rows_per_key_block(p: Problem, block_m: int, block_n: int) -> list[int]:
    """Query rows each key block of the dK/dV kernel loads (query_ranges)."""
    mode, lo, hi = p.bounds()
    sq = p.seqlen_q
    out = []
    for n0 in range(0, p.seqlen_k, block_n):
        n_last = n0 + block_n - 1
        if mode == "none":
            m_start, m_end = 0, sq
        else:
            m_start = (max(n0 - hi, 0) // block_m) * block_m
            m_end = max(min(sq, n_last - lo + 1), 0) if mode == "window" else sq
        if m_end <= m_start:
            out.append(0)
        else:
            out.append(min(sq, m_start + _cdiv(m_end - m_start, block_m) * block_m) - m_start)
    return out


# ---------------------------------------------------------------------------------
# The four counts

def naive_forward(p: Problem) -> IOCount:
    """Standard attention (Algorithm 0): S = QK^T, P = softmax(S), O = PV, each step
    through HBM.  With GQA the naive matmuls read K and V once per query head."""
    e, bh = p.dtype_bytes, p.bh
    sq, sk, d, dv = p.seqlen_q, p.seqlen_k, p.head_dim, p.dv
    nn = bh * sq * sk * e
    c = IOCount("naive forward")
    c.add("Q", "read", bh * sq * d * e).add("K", "read", bh * sk * d * e)
    c.add("S", "write", nn).add("S", "read", nn)
    c.add("P", "write", nn).add("P", "read", nn)
    c.add("V", "read", bh * sk * dv * e).add("O", "write", bh * sq * dv * e)
    return c


def tiled_forward(p: Problem, block_m: int, block_n: int = 64) -> IOCount:
    """flashgen's forward kernel with query tiles of ``block_m`` rows (``block_n`` only
    matters where a mask lets key blocks be skipped)."""
    e, bh = p.dtype_bytes, p.bh
    sq, d, dv = p.seqlen_q, p.head_dim, p.dv
    rows = sum(key_rows_per_query_block(p, block_m, block_n))
    c = IOCount(f"tiled forward (BLOCK_M {block_m})")
    c.add("Q", "read", bh * sq * d * e)
    c.add("K per query block", "read", bh * rows * d * e)
    c.add("V per query block", "read", bh * rows * dv * e)
    c.add("O", "write", bh * sq * dv * e).add("LSE", "write", bh * sq * LSE_BYTES)
    return c


def naive_backward(p: Problem) -> IOCount:
    """Standard attention backward from a stored P (Algorithm 3; delta = rowsum(dO*O))."""
    e, bh = p.dtype_bytes, p.bh
    sq, sk, d, dv = p.seqlen_q, p.seqlen_k, p.head_dim, p.dv
    nn = bh * sq * sk * e
    q, k, v = bh * sq * d * e, bh * sk * d * e, bh * sk * dv * e
    o = bh * sq * dv * e
    dkv_heads = p.batch * p.hkv
    c = IOCount("naive backward")
    # dV = P^T dO
    c.add("P (dV = P^T dO)", "read", nn).add("dO (dV)", "read", o)
    c.add("dV", "write", dkv_heads * sk * dv * e)
    # dP = dO V^T
    c.add("dO (dP = dO V^T)", "read", o).add("V (dP)", "read", v).add("dP", "write", nn)
    # delta = rowsum(dO * O)
    c.add("dO (delta)", "read", o).add("O (delta)", "read", o)
    c.add("delta", "write", bh * sq * LSE_BYTES)
    # dS = P * (dP - delta)
    c.add("P (dS)", "read", nn).add("dP (dS)", "read", nn)
    c.add("delta (dS)", "read", bh * sq * LSE_BYTES).add("dS", "write", nn)
    # dQ = dS K, dK = dS^T Q
    c.add("dS (dQ = dS K)", "read", nn).add("K (dQ)", "read", k).add("dQ", "write", q)
    c.add("dS (dK = dS^T Q)", "read", nn).add("Q (dK)", "read", q)
    c.add("dK", "write", dkv_heads * sk * d * e)
    return c


def tiled_bwd_dq(p: Problem, block_m: int, block_n: int) -> IOCount:
    """flashgen's ``attn_bwd_dq``: one program per query block of ``block_m`` rows; reads
    its Q, dO, O tiles and LSE rows once and the visited K, V rows once per query block;
    writes dQ and delta = rowsum(dO * O)."""
    e, bh = p.dtype_bytes, p.bh
    sq, d, dv = p.seqlen_q, p.head_dim, p.dv
    krows = sum(key_rows_per_query_block(p, block_m, block_n))
    c = IOCount(f"attn_bwd_dq (BLOCK_M {block_m})")
    c.add("Q, dO, O", "read", bh * sq * (d + 2 * dv) * e).add("LSE", "read", bh * sq * LSE_BYTES)
    c.add("K, V per query block", "read", bh * krows * (d + dv) * e)
    c.add("dQ", "write", bh * sq * d * e).add("delta", "write", bh * sq * LSE_BYTES)
    return c


def tiled_bwd_dkdv(p: Problem, block_m: int, block_n: int) -> IOCount:
    """flashgen's ``attn_bwd_dkdv``: one program per key block of ``block_n`` rows and kv
    head; reads its K, V tiles once and, for every query head of its GQA group, the
    visited Q, dO rows and their LSE and delta once per key block; writes dK, dV."""
    e, bh = p.dtype_bytes, p.bh
    sk, d, dv = p.seqlen_k, p.head_dim, p.dv
    kv_heads = p.batch * p.hkv
    qrows = sum(query_rows_per_key_block(p, block_m, block_n))
    c = IOCount(f"attn_bwd_dkdv (BLOCK_N {block_n})")
    c.add("K, V", "read", kv_heads * sk * (d + dv) * e)
    c.add("Q, dO per key block", "read", bh * qrows * (d + dv) * e)
    c.add("LSE, delta per key block", "read", bh * qrows * 2 * LSE_BYTES)
    c.add("dK, dV", "write", kv_heads * sk * (d + dv) * e)
    return c


def tiled_backward(p: Problem, block_m_dq: int, block_n_dq: int, block_m_dkdv: int,
                   block_n_dkdv: int) -> IOCount:
    """flashgen's backward: :func:`tiled_bwd_dq` then :func:`tiled_bwd_dkdv`."""
    c = IOCount(f"tiled backward (dQ BLOCK_M {block_m_dq}, dK/dV BLOCK_N {block_n_dkdv})")
    for part in (tiled_bwd_dq(p, block_m_dq, block_n_dq), tiled_bwd_dkdv(p, block_m_dkdv, block_n_dkdv)):
        kernel = part.name.split()[0]
        c.terms += [Term(f"{t.what} ({kernel})", t.kind, t.bytes) for t in part.terms]
    return c


def minimum_forward(p: Problem) -> IOCount:
    """The least any forward can move: Q, K, V read once, O and the LSE written once
    (what an L2 that holds every re-read would leave)."""
    e, bh, kvh = p.dtype_bytes, p.bh, p.batch * p.hkv
    c = IOCount("minimum forward")
    c.add("Q", "read", bh * p.seqlen_q * p.head_dim * e)
    c.add("K, V", "read", kvh * p.seqlen_k * (p.head_dim + p.dv) * e)
    c.add("O", "write", bh * p.seqlen_q * p.dv * e).add("LSE", "write", bh * p.seqlen_q * LSE_BYTES)
    return c


def minimum_backward(p: Problem) -> IOCount:
    """The least flashgen's backward can move: Q, K, V, O, dO and the LSE read once;
    dQ, dK, dV and delta written once (delta is not read back)."""
    e, bh, kvh = p.dtype_bytes, p.bh, p.batch * p.hkv
    sq, sk, d, dv = p.seqlen_q, p.seqlen_k, p.head_dim, p.dv
    c = IOCount("minimum backward")
    c.add("Q, O, dO", "read", bh * sq * (d + 2 * dv) * e).add("LSE", "read", bh * sq * LSE_BYTES)
    c.add("K, V", "read", kvh * sk * (d + dv) * e)
    c.add("dQ", "write", bh * sq * d * e).add("delta", "write", bh * sq * LSE_BYTES)
    c.add("dK, dV", "write", kvh * sk * (d + dv) * e)
    return c


def tile_smem_bytes(block_m: int, block_n: int, head_dim: int, dtype_bytes: int = 2,
                    head_dim_v: int | None = None) -> int:
    """SRAM the forward's operand tiles take, one pipeline stage: the Q tile plus one K
    and one V tile (the real kernel multi-buffers K and V: :mod:`flashgen.resources`)."""
    dv = head_dim if head_dim_v is None else head_dim_v
    return (block_m * head_dim + block_n * (head_dim + dv)) * dtype_bytes


# ---------------------------------------------------------------------------------
# Printing

def fmt_bytes(n: float) -> str:
    """Binary units, two significant figures below 10 and whole numbers above:
    8.5 MiB, 2.3 MiB, 130 MiB, 33 MiB, 2 GiB, 516 MiB."""
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", 1 << 10)):
        if n >= size:
            x = n / size
            break
    else:
        unit, x = "B", float(n)
    s = f"{x:.1f}" if x < 10 else f"{x:.0f}"
    if s.endswith(".0"):
        s = s[:-2]
    return f"{s} {unit}"


def forward_table(seqlens, head_dim: int, block_m: int, block_n: int = 64, dtype_bytes: int = 2,
                  **problem) -> list[dict]:
    """One row per N (seqlen_q = seqlen_k = N): naive and tiled forward and backward
    bytes.  The backward uses ``block_m`` for the dQ kernel's query tiles and the
    dK/dV kernel's key tiles alike, ``block_n`` for the tiles streamed through them."""
    rows = []
    for n in seqlens:
        p = Problem(n, n, head_dim, dtype_bytes=dtype_bytes, **problem)
        nf, tf = naive_forward(p), tiled_forward(p, block_m, block_n)
        nb, tb = naive_backward(p), tiled_backward(p, block_m, block_n, block_n, block_m)
        rows.append({"N": n, "naive_fwd_bytes": nf.total_bytes, "tiled_fwd_bytes": tf.total_bytes,
                     "naive_bwd_bytes": nb.total_bytes, "tiled_bwd_bytes": tb.total_bytes})
    return rows


def block_m_tradeoff(n: int, head_dim: int, block_ms, block_n: int = 64, dtype_bytes: int = 2,
                     **problem) -> list[dict]:
    """Forward bytes as BLOCK_M varies at one N, with the SRAM its tiles take."""
    p = Problem(n, n, head_dim, dtype_bytes=dtype_bytes, **problem)
    naive = naive_forward(p).total_bytes
    out = []
    for bm in block_ms:
        t = tiled_forward(p, bm, block_n).total_bytes
        out.append({"BLOCK_M": bm, "BLOCK_N": block_n, "tiled_fwd_bytes": t, "naive_fwd_bytes": naive,
                    "tile_smem_bytes": tile_smem_bytes(bm, block_n, head_dim, dtype_bytes)})
    return out

"""K/V tiles multicast to two programs of a thread-block cluster, in the Gluon forward, as
a probe.

At seqlen 512 the forward's one-consumer tiles (64 query rows a program) read each K/V
tile once per 64 rows: twice cuDNN's L2 bytes, near the L2's peak (the design notes'
"where the gap to cuDNN is").  Two programs of a cluster that take adjacent query tiles
of one (batch, head) read the same key tiles; one TMA copy with ``.multicast::cluster``
writes a tile into both programs' shared memory and completes on both programs'
barriers, halving the L2 reads.  Triton 3.6's Gluon copy has no multicast argument, so
this probe issues the copy as inline PTX:

- the destination and barrier addresses are ``global_smem`` plus the allocation offsets
  that Triton's shared-memory allocator gave the rings and barriers, read from a first
  compile (``MLIR_ENABLE_DUMP``, :func:`alloc_offsets`) and rendered into the second;
  the allocator sees the same buffers in both, and the check compares them;
- the descriptor is the kernel parameter (``cvta.param`` of its PTX name, read from the
  first compile's PTX);
- program 0 of a pair copies each shared K tile to both programs, program 1 each V tile;
  each program arms its own "ready" barrier with the tile's bytes (the peer's copy may
  complete before the arming: the phase needs the arming's arrival too);
- a slot is refilled after both programs' consumers released it: each consumer arrives
  on its own "empty" barrier and on its peer's (``mapa``,
  ``mbarrier.arrive.release.cluster.shared::cluster``), count 2; a key tile that only
  the later query tile needs (causal) is copied by that program alone with Gluon's copy
  and released by two local arrivals;
- the producer partition has 4 warps (no parked padding warps), so both partitions can
  meet at a cluster barrier (``barrier.cluster``, which waits for every thread of the
  cluster that has not exited) after the barriers' initialization and before exit;
- the kernel is compiled for one CTA and launched with a cluster of 2 along grid axis 0
  (Triton's launcher with ``num_ctas`` 2 in the packed metadata): program ids 2p and
  2p + 1 are one cluster.

Its twin is the same kernel with Gluon's own copies (each program reads every tile),
launched without clusters and with them; the shipped rows (``flashgen.attention``) and
SDPA's cuDNN backend run in the same process.  Non-persistent, one consumer of 64 rows,
BLOCK_N 64, bf16, seqlen_q = seqlen_k a multiple of 128, no GQA: a probe of the bytes,
not a served kernel.

    PYTHONPATH=. python3 benchmarks/probe_multicast_fwd.py --out mc.json
    python3 benchmarks/probe_multicast_fwd.py --compile     # on a machine without a GPU

``--only`` keeps some of the variants (``mc-s2-x2,twin-s2-x2,...``: role, ring stages,
programs per SM), ``--arrive release-cluster`` releases slots with a cluster-scope
release (a ``MEMBAR.ALL.GPU`` before each arrive), ``--launch B,H,S,D,causal`` only
launches the multicast kernel and its twin (for Nsight Compute).  The measurements and
what they mean: docs/design.md, "what was tried".

Each variant is checked against float64 in a child process with a timeout before it is
timed (a pairing that does not hold hangs).  Prints a table last: TFLOP/s per shape.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import jinja2

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

#: (batch, num_heads, seqlen, head_dim, causal): the grid's short shapes.
SHAPES = [(32, 16, 512, 128, True), (16, 16, 1024, 128, True), (32, 16, 512, 128, False),
          (32, 32, 512, 64, True), (16, 32, 1024, 64, True), (8, 16, 2048, 128, True)]

#: (name, multicast, cluster launch)
ROLES = [("mc", True, True), ("twin", False, False), ("twin-cluster", False, True)]

_SOURCE = jinja2.Template('''
# Probe kernel (benchmarks/probe_multicast_fwd.py): K/V multicast to a pair of programs.
from flashgen.families.gluon.shim import (
    fence_async_shared, gl, gluon, mbarrier, store_wait, tma_load, tma_store, warpgroup_mma, warpgroup_mma_wait,
)

NUM_WARPS = 4
MAXNREG = {{ maxnreg }}
BLOCK_M = gl.constexpr(64)
BLOCK_N = gl.constexpr(64)
D = gl.constexpr({{ d }})
STAGES = gl.constexpr({{ stages }})
CAUSAL = gl.constexpr({{ causal }})
MC = gl.constexpr({{ mc }})
DTYPE = gl.constexpr(gl.bfloat16)
ES = gl.constexpr(2)
TILE_BYTES = gl.constexpr(64 * {{ d }} * 2)
# Shared-memory offsets from global_smem (the allocator's, read from a first compile).
K_OFF = gl.constexpr({{ off.k_smem }})
V_OFF = gl.constexpr({{ off.v_smem }})
K_READY_OFF = gl.constexpr({{ off.k_ready }})
V_READY_OFF = gl.constexpr({{ off.v_ready }})
K_EMPTY_OFF = gl.constexpr({{ off.k_empty }})
V_EMPTY_OFF = gl.constexpr({{ off.v_empty }})
S_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16]))
O_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, {{ d }}, 16]))
P_LAYOUT = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT.value, k_width=2))
ROW_S = gl.constexpr(gl.SliceLayout(1, S_LAYOUT.value))
COL_S = gl.constexpr(gl.SliceLayout(0, S_LAYOUT.value))
ROW_O = gl.constexpr(gl.SliceLayout(1, O_LAYOUT.value))
T_SMEM = gl.constexpr(gl.NVMMASharedLayout.get_default_for([64, {{ d }}], gl.bfloat16))


@gluon.jit
def _cluster_sync(x):
    """Every thread of both programs of the pair meets here (release / acquire)."""
    return gl.inline_asm_elementwise(
        "barrier.cluster.arrive.release.aligned;\\nbarrier.cluster.wait.acquire.aligned;\\nmov.b32 $0, 0;",
        "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _init_fence(x):
    return gl.inline_asm_elementwise("fence.mbarrier_init.release.cluster;\\nmov.b32 $0, 0;", "=r,r", [x],
                                     dtype=gl.int32, is_pure=False, pack=1)

{% for name, param in (("k", k_param), ("v", v_param)) %}

@gluon.jit
def _mc_copy_{{ name }}(issue, dst_off, bar_off, c_n, c_h, c_z):
    """Thread 0 of the partition of the issuing program copies the tile at (c_z, c_h,
    c_n) into both programs' shared memory at dst_off, completing on each one's barrier
    at bar_off: one box of 64 columns (the 128-byte swizzle's width) per copy, each
    64 x 64 box 8192 bytes further on, as Triton splits its own copies."""
    return gl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 t, a, b, z; .reg .b64 d; .reg .b16 m;\\n"
        "mov.u32 t, %tid.x; and.b32 t, t, 127; setp.eq.u32 p, t, 0; setp.ne.and.b32 p, $1, 0, p;\\n"
        "mov.u32 a, global_smem; add.u32 b, a, $3; add.u32 a, a, $2; mov.b16 m, 3;\\n"
        "mov.b64 d, {{ param }}; cvta.param.u64 d, d;\\n"
{% for box in range(d // 64) %}
        "mov.b32 z, {{ box * 64 }};\\n"
        "@p cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
        " [a+{{ box * 8192 }}], [d, {z, $4, $5, $6}], [b], m;\\n"
{% endfor %}
        "mov.b32 $0, 0; }",
        "=r,r,r,r,r,r,r", [issue, dst_off, bar_off, c_n, c_h, c_z], dtype=gl.int32, is_pure=False, pack=1)
{% endfor %}


@gluon.jit
def _arrive_at(bar_off, rank):
    """Thread 0 of the partition arrives on the barrier at bar_off of program ``rank``
    of the pair (release, cluster scope)."""
    return gl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 t, a, r;\\n"
        "mov.u32 t, %tid.x; and.b32 t, t, 127; setp.eq.u32 p, t, 0;\\n"
        "mov.u32 a, global_smem; add.u32 a, a, $1; mapa.shared::cluster.u32 r, a, $2;\\n"
        "@p {{ arrive }} _, [r];\\n"
        "mov.b32 $0, 0; }",
        "=r,r,r", [bar_off, rank], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _coords(num_m_pairs, num_heads):
    """(z, h, z * h, first query row, rank in the pair): pair p takes query tiles 2q and
    2q + 1 of one (z, h), the pairs that see the most keys first."""
    pid = gl.program_id(0)
    pair = pid // 2
    rank = pid % 2
    off_hz = pair // num_m_pairs
    mq = num_m_pairs - 1 - pair % num_m_pairs
    return off_hz // num_heads, off_hz % num_heads, off_hz, (2 * mq + rank) * BLOCK_M, rank


@gluon.jit
def _n_tiles(m0, seqlen_k):
    if CAUSAL:
        return gl.cdiv(gl.minimum(seqlen_k, m0 + BLOCK_M), BLOCK_N)
    else:
        return gl.cdiv(seqlen_k, BLOCK_N)


@gluon.jit
def _load_tile(desc, bufs, ready, empty, j, n_shared, issuer, buf_off, bar_off, off_z, off_h, IS_K: gl.constexpr):
    """Key tile j into its ring slot once both programs freed it: multicast by the
    issuing program of the pair when both read it, else this program's own copy."""
    s = j % STAGES
    start_n = j * BLOCK_N
    mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1)
    mbarrier.expect(ready.index(s), BLOCK_N * D * ES)
    if MC:
        if j < n_shared:
            if IS_K:
                _mc_copy_k(issuer.to(gl.int32), buf_off + s * TILE_BYTES, bar_off + 8 * s, start_n, off_h, off_z)
            else:
                _mc_copy_v(issuer.to(gl.int32), buf_off + s * TILE_BYTES, bar_off + 8 * s, start_n, off_h, off_z)
        else:
            tma_load(desc, [off_z, off_h, start_n, 0], ready.index(s),
                     bufs.index(s)._reinterpret(DTYPE, [1, 1, BLOCK_N, D], desc.layout))
    else:
        tma_load(desc, [off_z, off_h, start_n, 0], ready.index(s),
                 bufs.index(s)._reinterpret(DTYPE, [1, 1, BLOCK_N, D], desc.layout))


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, k_empty, v_empty,
              num_m_pairs, num_heads, seqlen_k):
    if MC:
        _cluster_sync(0)
    off_z, off_h, off_hz, m0, rank = _coords(num_m_pairs, num_heads)
    n_tiles = _n_tiles(m0, seqlen_k)
    n_shared = _n_tiles(m0 - rank * BLOCK_M, seqlen_k)
    mbarrier.expect(q_ready.index(0), BLOCK_M * D * ES)
    tma_load(q_desc, [off_z, off_h, m0, 0], q_ready.index(0),
             q_smem.index(0)._reinterpret(DTYPE, [1, 1, BLOCK_M, D], q_desc.layout))
    for j in range(n_tiles):
        _load_tile(k_desc, k_smem, k_ready, k_empty, j, n_shared, rank == 0, K_OFF, K_READY_OFF, off_z, off_h, True)
        _load_tile(v_desc, v_smem, v_ready, v_empty, j, n_shared, rank == 1, V_OFF, V_READY_OFF, off_z, off_h, False)
    if MC:
        _cluster_sync(0)


@gluon.jit
def _release(bars, off, s, j, n_shared, rank):
    mbarrier.arrive(bars.index(s))
    if MC:
        # The peer's barrier for a tile both programs read; this program's again for
        # one only it reads (its barriers count two arrivals).
        peer = rank + (1 - 2 * rank) * (j < n_shared).to(gl.int32)
        _arrive_at(off + 8 * s, peer)


@gluon.jit
def _softmax(s, m_i, l_i, r0, start_n, qk_scale, seqlen_k, MASKED: gl.constexpr):
    if MASKED:
        cols = start_n + gl.arange(0, BLOCK_N, layout=COL_S)
        keep = gl.expand_dims(cols < seqlen_k, 0)
        if CAUSAL:
            rows = r0 + gl.arange(0, BLOCK_M, layout=ROW_S)
            keep = keep & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1))
        s = gl.where(keep, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        m_sub = m_new
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_sub, 1))
    alpha = gl.exp2(m_i - m_sub)
    l_i = l_i * alpha + gl.sum(p, 1)
    p16 = gl.convert_layout(p.to(DTYPE), P_LAYOUT)
    return p16, m_new, l_i, alpha


@gluon.jit
def _step(acc, p16, m_i, l_i, alpha, q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, j, n_shared, rank, r0,
          qk_scale, seqlen_k, MASKED: gl.constexpr):
    s_slot = j % STAGES
    mbarrier.wait(k_ready.index(s_slot), (j // STAGES) & 1)
    s_tok = warpgroup_mma(q, k_smem.index(s_slot).permute((1, 0)),
                          gl.zeros([BLOCK_M, BLOCK_N], gl.float32, S_LAYOUT), use_acc=False, is_async=True)
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, ROW_O), 1)
    p_slot = (j - 1) % STAGES
    mbarrier.wait(v_ready.index(p_slot), ((j - 1) // STAGES) & 1)
    o_tok = warpgroup_mma(p16, v_smem.index(p_slot), acc, is_async=True)
    s = warpgroup_mma_wait(1, deps=[s_tok])
    _release(k_empty, K_EMPTY_OFF, s_slot, j, n_shared, rank)
    p16_new, m_i, l_i, alpha = _softmax(s, m_i, l_i, r0, j * BLOCK_N, qk_scale, seqlen_k, MASKED)
    acc, p16 = warpgroup_mma_wait(0, deps=[o_tok, p16])
    _release(v_empty, V_EMPTY_OFF, p_slot, j - 1, n_shared, rank)
    return acc, p16_new, m_i, l_i, alpha


@gluon.jit
def _consumer(o_desc, LSE, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, k_empty, v_empty, qk_scale,
              num_m_pairs, num_heads, seqlen_q, seqlen_k):
    if MC:
        _cluster_sync(0)
    off_z, off_h, off_hz, r0, rank = _coords(num_m_pairs, num_heads)
    n_tiles = _n_tiles(r0, seqlen_k)
    n_shared = _n_tiles(r0 - rank * BLOCK_M, seqlen_k)
    # Unmasked key tiles [1, t_hi): below the diagonal and inside seqlen_k.
    if CAUSAL:
        t_hi = gl.minimum(gl.minimum(seqlen_k, r0 + 1) // BLOCK_N, n_tiles)
    else:
        t_hi = gl.minimum(seqlen_k // BLOCK_N, n_tiles)
    t_hi = gl.maximum(t_hi, 1)
    q = q_smem.index(0)
    acc = gl.zeros([BLOCK_M, D], gl.float32, O_LAYOUT)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, ROW_S)
    l_i = gl.zeros([BLOCK_M], gl.float32, ROW_S)
    mbarrier.wait(q_ready.index(0), 0)
    # Tile 0 alone, masked.
    mbarrier.wait(k_ready.index(0), 0)
    s_tok = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), gl.zeros([BLOCK_M, BLOCK_N], gl.float32, S_LAYOUT),
                          use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=[s_tok])
    _release(k_empty, K_EMPTY_OFF, 0, 0, n_shared, rank)
    p16, m_i, l_i, alpha = _softmax(s, m_i, l_i, r0, 0, qk_scale, seqlen_k, True)
    for j in range(1, t_hi):
        acc, p16, m_i, l_i, alpha = _step(acc, p16, m_i, l_i, alpha, q, k_smem, v_smem, k_ready, v_ready, k_empty,
                                          v_empty, j, n_shared, rank, r0, qk_scale, seqlen_k, False)
    for j in range(t_hi, n_tiles):
        acc, p16, m_i, l_i, alpha = _step(acc, p16, m_i, l_i, alpha, q, k_smem, v_smem, k_ready, v_ready, k_empty,
                                          v_empty, j, n_shared, rank, r0, qk_scale, seqlen_k, True)
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, ROW_O), 1)
    p_slot = (n_tiles - 1) % STAGES
    mbarrier.wait(v_ready.index(p_slot), ((n_tiles - 1) // STAGES) & 1)
    o_tok = warpgroup_mma(p16, v_smem.index(p_slot), acc, is_async=True)
    acc, p16 = warpgroup_mma_wait(0, deps=[o_tok, p16])
    _release(v_empty, V_EMPTY_OFF, p_slot, n_tiles - 1, n_shared, rank)
    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    acc = acc * gl.expand_dims(gl.convert_layout(1.0 / l_safe, ROW_O), 1)
    lse = gl.where(empty, float("-inf"), (m_i + gl.log2(l_safe)) * 0.6931471805599453)
    rows = r0 + gl.arange(0, BLOCK_M, layout=ROW_S)
    gl.store(LSE + off_hz.to(gl.int64) * seqlen_q + rows, lse, mask=rows < seqlen_q)
    q.store(acc.to(DTYPE))
    fence_async_shared()
    tma_store(o_desc, [off_z, off_h, r0, 0], q._reinterpret(DTYPE, [1, 1, BLOCK_M, D], o_desc.layout))
    store_wait(0)
    if MC:
        _cluster_sync(0)


@gluon.jit(do_not_specialize=["num_m_pairs", "num_heads", "seqlen_q", "seqlen_k"])
def attn_fwd(q_desc, k_desc, v_desc, o_desc, LSE, qk_scale, num_m_pairs, num_heads, seqlen_q, seqlen_k):
    q_smem = gl.allocate_shared_memory(DTYPE, [1, BLOCK_M, D], T_SMEM)
    k_smem = gl.allocate_shared_memory(DTYPE, [STAGES, BLOCK_N, D], T_SMEM)
    v_smem = gl.allocate_shared_memory(DTYPE, [STAGES, BLOCK_N, D], T_SMEM)
    q_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready.index(0), count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(k_empty.index(s), count=2 if MC else 1)
        mbarrier.init(v_empty.index(s), count=2 if MC else 1)
    if MC:
        _init_fence(0)
    gl.warp_specialize([
        (_consumer, (o_desc, LSE, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, k_empty, v_empty, qk_scale,
                     num_m_pairs, num_heads, seqlen_q, seqlen_k)),
        (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, k_empty, v_empty,
                     num_m_pairs, num_heads, seqlen_k)),
    ], [4], [{{ producer_regs }}])
''')

_BUFFERS = ("k_smem", "v_smem", "k_ready", "v_ready", "k_empty", "v_empty")


#: The remote release's instruction: ``plain`` is CUTLASS's (release semantics at CTA
#: scope), ``release-cluster`` compiles to MEMBAR.ALL.GPU before each arrive.
ARRIVES = {"plain": "mbarrier.arrive.shared::cluster.b64",
           "release-cluster": "mbarrier.arrive.release.cluster.shared::cluster.b64"}


def render(d: int, causal: bool, mc: bool, stages: int, ctas: int, off=None, params=("", ""),
           arrive: str = "plain") -> str:
    """The probe kernel's source.  ``ctas`` programs per SM set the launch register cap
    (two warpgroups a program) and the consumer's setmaxnreg budget."""
    from flashgen.families.gluon.config import GluonFwdConfig, maxnreg

    off = off or {n: 0 for n in _BUFFERS}
    return _SOURCE.render(d=d, causal=causal, mc=mc, stages=stages, producer_regs=24,
                          maxnreg=maxnreg(GluonFwdConfig(num_consumers=1, ctas_per_sm=ctas)),
                          off=off, k_param=params[0] or "0", v_param=params[1] or "0", arrive=ARRIVES[arrive])


_TMP: list[Path] = []


def _module(src: str, tag: str):
    if not _TMP:
        _TMP.append(Path(tempfile.mkdtemp(prefix="flashgen_probe_mc_")))
    d = _TMP[0]
    path = d / f"probe_mc_{tag}.py"
    path.write_text(src)
    return _import(path, f"probe_mc_{tag}"), path


def _import(path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def compile_sm90(mod, d: int):
    """Triton's compiled kernel of the probe module for sm_90 (no GPU needed)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from flashgen.families.gluon.shim import nvmma_layout
    from flashgen.families.gluon.sm90 import descriptor_signature

    sig = {}
    for name in mod.attn_fwd.arg_names:
        if name.endswith("_desc"):
            sig[name] = descriptor_signature("bfloat16", [1, 1, 64, d], nvmma_layout([1, 1, 64, d], "bfloat16"))
        elif name == "LSE":
            sig[name] = "*fp32"
        elif name == "qk_scale":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return triton.compile(GluonASTSource(fn=mod.attn_fwd, signature=sig, attrs={(4,): [["tt.divisibility", 16]]}),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": mod.MAXNREG})


def _offsets_child(path: str, d: int) -> int:
    k = compile_sm90(_import(path, "probe_mc_child"), d)
    params = re.findall(r"\.param \.align 64 \.b8 (attn_fwd_param_\d+)\[128\]", k.asm["ptx"])
    print("PARAMS " + json.dumps(params), flush=True)
    return 0


def alloc_offsets(path: Path, d: int) -> tuple[dict, list[str]]:
    """({buffer: offset from global_smem}, the descriptors' PTX parameter names) of the
    module at ``path``, from a compile in a child process whose MLIR passes print the
    IR (the allocator's ``allocation.offset`` attributes)."""
    env = dict(os.environ, MLIR_ENABLE_DUMP="1", TRITON_ALWAYS_COMPILE="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run([sys.executable, __file__, "--offsets-child", str(path), str(d)], env=env,
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"compile of {path.name} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    off = {}
    for name, value in re.findall(r"%(\w+) = ttg\.local_alloc \{allocation\.offset = (\d+) : i32\}", r.stderr):
        off[name] = int(value)  # the last dump is the allocator's final word
    missing = [n for n in _BUFFERS if n not in off]
    if missing:
        raise RuntimeError(f"no allocation offsets for {missing} in the compile's IR dump")
    params = json.loads(r.stdout.split("PARAMS ", 1)[1].splitlines()[0])
    return {n: off[n] for n in _BUFFERS}, params


@functools.lru_cache(maxsize=None)
def build(d: int, causal: bool, mc: bool, stages: int, ctas: int, arrive: str = "plain"):
    """(module, offsets): the probe kernel rendered with the allocator's offsets; for a
    multicast kernel, compiled twice and the offsets compared."""
    tag = f"d{d}_{'c' if causal else 'n'}_s{stages}_x{ctas}"
    if not mc:
        return _module(render(d, causal, mc, stages, ctas), tag + "_tw")[0], None
    # The offsets found by one process serve the others (the checks run in children).
    known = Path(os.environ.get("FLASHGEN_PROBE_MC_DIR", tempfile.gettempdir())) / f"flashgen_probe_mc_{tag}.json"
    if known.exists():
        off, params = json.loads(known.read_text())
        return _module(render(d, causal, mc, stages, ctas, off, params, arrive), tag + "_mc_" + arrive)[0], off
    _, path = _module(render(d, causal, mc, stages, ctas), tag + "_mc0")
    off, params = alloc_offsets(path, d)
    params = params[1:3]  # k_desc, v_desc (q_desc, k_desc, v_desc, o_desc in argument order)
    mod, path2 = _module(render(d, causal, mc, stages, ctas, off, params, arrive), tag + "_mc_" + arrive)
    off2, _ = alloc_offsets(path2, d)
    if off2 != off:
        raise RuntimeError(f"the allocator moved the buffers between compiles: {off} -> {off2}")
    known.write_text(json.dumps([off, params]))
    return mod, off


def launch(mod, q, k, v, o, lse, causal: bool, cluster: bool, cache: dict):
    """Run the probe kernel once on (batch, heads, seqlen, head_dim) tensors."""
    import torch

    from flashgen.families.gluon.shim import descriptor, nvmma_layout

    b, h, s, d = q.shape
    block = [1, 1, 64, d]
    lay = nvmma_layout(block, "bfloat16")
    descs = [descriptor(t, list(t.shape), list(t.stride()), block, lay) for t in (q, k, v, o)]
    num_m_pairs = s // 128
    args = (*descs, lse, d ** -0.5 * 1.4426950408889634, num_m_pairs, h, s, s)
    kern = cache.get(id(mod))
    if kern is None:
        kern = mod.attn_fwd.warmup(*args, grid=(1,), num_warps=4, maxnreg=mod.MAXNREG)
        if mod.MC.value:
            # The rendered offsets are this binary's: its own barrier and ring addresses
            # are these constants from global_smem.
            seen = {int(x) for x in re.findall(r"@global_smem, i(?:32|64) (\d+)", kern.asm["llir"])}
            want = {mod.V_OFF.value} | {getattr(mod, n).value + 8 * i for n in
                                         ("K_READY_OFF", "V_READY_OFF", "K_EMPTY_OFF", "V_EMPTY_OFF")
                                         for i in range(mod.STAGES.value)}
            if not want <= seen:
                raise RuntimeError(f"offsets {sorted(want - seen)} are not this binary's")
        kern._init_handles()
        cache[id(mod)] = kern
    pairs = b * h * num_m_pairs
    stream = torch.cuda.current_stream().cuda_stream
    meta = kern.packed_metadata
    if cluster:
        meta = (meta[0], 2) + tuple(meta[2:])
        kern.run(pairs, 1, 1, stream, kern.function, meta, None, None, None, *args)
    else:
        kern.run(2 * pairs, 1, 1, stream, kern.function, meta, None, None, None, *args)


def _check_child(arg: str) -> int:
    import torch

    from flashgen import reference

    a = json.loads(arg)
    mod, _ = build(a["d"], a["causal"], a["mc"], a["stages"], a["ctas"], a.get("arrive", "plain"))
    cache: dict = {}
    worst = 0.0
    for (b, h, s) in ((2, 3, 256), (1, 2, 512)):
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, h, s, a["d"], device="cuda", dtype=torch.bfloat16) for _ in range(3))
        o = torch.empty_like(q)
        lse = torch.empty(b, h, s, device="cuda", dtype=torch.float32)
        launch(mod, q, k, v, o, lse, a["causal"], a["cluster"], cache)
        torch.cuda.synchronize()
        ro, rl, _ = reference.forward(q, k, v, causal=a["causal"])
        lo, ll, _ = reference.forward(q, k, v, causal=a["causal"], dtype=torch.bfloat16)
        err = (o.double() - ro).abs().max().item()
        tol = 2 * (lo.double() - ro).abs().max().item() + 1e-3
        lerr = (lse.double() - rl).abs().max().item()
        worst = max(worst, err / tol)
        if not (err <= tol and lerr <= 1e-3):
            print("RESULT " + json.dumps({"ok": False, "shape": [b, h, s], "err": err, "tol": tol, "lse": lerr}))
            return 0
    print("RESULT " + json.dumps({"ok": True, "worst": worst}))
    return 0


def check(jobs: list[dict], timeout: float, workers: int) -> list[dict]:
    """Each job's float64 check in its own process (a pairing that does not hold hangs)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from probe_pingpong import run_checks

    return run_checks(jobs, timeout, workers, script=__file__, hang=" (a hang)")


def _time(jobs, rep: int) -> list[dict]:
    import torch
    import triton.testing

    import flashgen

    rows = []
    for (b, h, s, d, causal) in SHAPES:
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        o = torch.empty_like(q)
        lse = torch.empty(b, h, s, device="cuda", dtype=torch.float32)
        flops = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)
        fns = {}
        cache: dict = {}
        for job in jobs:
            if job["d"] != d or job["causal"] != causal or not job["check"].get("ok"):
                continue
            mod, _ = build(d, causal, job["mc"], job["stages"], job["ctas"], job.get("arrive", "plain"))
            fns[job["name"]] = (lambda m=mod, c=job["cluster"]: launch(m, q, k, v, o, lse, causal, c, cache))
        fns["shipped"] = lambda: flashgen.attention(q, k, v, causal=causal)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def cudnn():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        fns["cudnn"] = cudnn
        for fn in fns.values():
            fn()
        torch.cuda.synchronize()
        ms = {n: [] for n in fns}
        for _ in range(2):
            for n, fn in fns.items():
                ms[n].append(float(triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median")))
        row = {"shape": [b, h, s, d, causal], "tflops": {n: round(flops / min(t) * 1e-9, 1) for n, t in ms.items()},
               "ms": ms}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _jobs(arrive: str = "plain"):
    jobs = []
    for d in (128, 64):
        for causal in (True, False):
            for stages, ctas in ((2, 2), (3, 2)) if d == 128 else ((2, 3), (4, 2)):
                if True:
                    for role, mc, cluster in ROLES:
                        jobs.append({"name": f"{role}-s{stages}-x{ctas}", "d": d, "causal": causal, "mc": mc,
                                     "cluster": cluster, "stages": stages, "ctas": ctas, "arrive": arrive})
    return jobs


def _smem_ok(job) -> bool:
    """Q and the K and V rings fit one program's share of shared memory (with 1 KB for
    the barriers and Triton's own)."""
    from flashgen.families.gluon.config import GluonFwdConfig, smem_limit

    need = 64 * job["d"] * 2 * (1 + 2 * job["stages"]) + 1024
    return need <= smem_limit(GluonFwdConfig(ctas_per_sm=job["ctas"]))


def _compile_report(arrive: str, only: str) -> int:
    """Compile every multicast kernel for sm_90 here and print registers, spills, the
    multicast copies and the GPU-scope memory barriers in its SASS."""
    from flashgen.families.gluon.sm90 import report

    for job in _jobs():
        if job["name"].startswith("mc") and _smem_ok(job) and (not only or job["name"] in only.split(",")):
            mod, off = build(job["d"], job["causal"], True, job["stages"], job["ctas"], arrive)
            rep = report(compile_sm90(mod, job["d"]))
            sass = rep.sass
            print(f"d{job['d']} {'causal' if job['causal'] else 'none'} {job['name']}: regs {rep.registers} "
                  f"spills {rep.spill_bytes} smem {rep.shared_bytes} hgmma {rep.hgmma} "
                  f"UTMALDG.MULTICAST {len(re.findall(r'UTMALDG[^;]*MULTICAST', sass))} "
                  f"UTMALDG {len(re.findall(r'UTMALDG', sass))} MEMBAR.ALL.GPU {sass.count('MEMBAR.ALL.GPU')} "
                  f"offsets {off}")
    return 0


def _launch_once(shape: str) -> int:
    """Launch the multicast kernel and its twin twice each at ``shape``
    (batch,heads,seqlen,head_dim,causal|none), for a profiler: the multicast kernel's
    launches come first."""
    import torch

    b, h, s, d, mode = shape.split(",")
    b, h, s, d, causal = int(b), int(h), int(s), int(d), mode == "causal"
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    o = torch.empty_like(q)
    lse = torch.empty(b, h, s, device="cuda", dtype=torch.float32)
    ctas = 2 if d == 128 else 3
    for mc in (True, False):
        mod, _ = build(d, causal, mc, 2, ctas)
        cache: dict = {}
        for _ in range(2):
            launch(mod, q, k, v, o, lse, causal, mc, cache)
    torch.cuda.synchronize()
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="probe_mc.json")
    p.add_argument("--rep", type=int, default=100, help="do_bench rep, ms")
    p.add_argument("--timeout", type=float, default=240.0)
    p.add_argument("--compile", action="store_true", help="compile for sm_90 here (no GPU) and report")
    p.add_argument("--only", default="", help="comma-separated job names to keep")
    p.add_argument("--workers", type=int, default=8, help="checks run at once, each in its own process")
    p.add_argument("--arrive", choices=sorted(ARRIVES), default="plain", help="the remote release's instruction")
    p.add_argument("--launch", metavar="B,H,S,D,causal|none", default="",
                   help="only launch the multicast kernel and its twin twice each (for a profiler)")
    a = p.parse_args(argv)
    if a.compile:
        return _compile_report(a.arrive, a.only)
    if a.launch:
        return _launch_once(a.launch)
    jobs = [j for j in _jobs(a.arrive) if _smem_ok(j) and (not a.only or j["name"] in a.only.split(","))]
    for job, res in zip(jobs, check(jobs, a.timeout, a.workers)):
        job["check"] = res
        print(json.dumps({k: job[k] for k in ("name", "d", "causal", "check")}), flush=True)
    rows = _time(jobs, a.rep)
    Path(a.out).write_text(json.dumps({"jobs": jobs, "rows": rows}, indent=1))
    names = sorted({n for r in rows for n in r["tflops"]})
    print("\nTFLOP/s (bf16, best of two medians)")
    print("| shape | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for r in rows:
        b, h, s, d, causal = r["shape"]
        cells = [str(r["tflops"].get(n, "-")) for n in names]
        print(f"| {b}x{h}x{s} d{d} {'causal' if causal else 'none'} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--offsets-child":
        sys.exit(_offsets_child(sys.argv[2], int(sys.argv[3])))
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        sys.exit(_check_child(sys.argv[2]))
    sys.exit(main())

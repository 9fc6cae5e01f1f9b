"""Shared-memory estimate of a variant, as a sum of named buffers.

Pure arithmetic, no compiler: the tuner calls it on every candidate before anything is
compiled, and a config whose estimate exceeds the architecture's per-block limit is
recorded as ``infeasible`` and never compiled (FlashAttention's sm90 tile search does
the same with its own kernels).

The model follows what Triton's software pipeliner allocates for these kernels: each
tile that is streamed through the loop gets ``num_stages`` buffers (``max(1, ...)``);
tiles that stay resident for the whole program and feed a ``tl.dot`` from shared memory
get one; operands that ``tl.dot`` reads from registers (P in P·V, dS in dS·K) get none.  It is checked against the shared memory Triton
reports for compiled kernels (``kernel.metadata.shared``) in tests/test_resources.py
and on the GPU (docs/design.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from .arch import Arch
from .spec import Variant, base_kernel, is_user_mods, mods_set


@dataclass(frozen=True)
class SmemEstimate:
    buffers: dict[str, int]  # name -> bytes
    limit_bytes: int
    note: str = ""  # why the limit is not the architecture's (e.g. no TMA)
    padding: str = ""  # a head dim the kernel pads to a power of two (its tiles are the padded size)

    @property
    def total_bytes(self) -> int:
        return sum(self.buffers.values())

    @property
    def feasible(self) -> bool:
        return self.total_bytes <= self.limit_bytes

    def breakdown(self) -> str:
        parts = " + ".join(f"{k} {v}" for k, v in self.buffers.items())
        verdict = "<=" if self.feasible else ">"
        note = f" ({self.note})" if self.note else ""
        padding = f"; {self.padding}" if self.padding else ""
        return f"{parts} = {self.total_bytes} B {verdict} limit {self.limit_bytes} B{note}{padding}"


def padding_note(variant: Variant) -> str:
    """e.g. ``head_dim 80 runs as d128 tiles (padded to a power of two)``; "" when no
    head dim is padded."""
    s = variant.spec
    dims = [(name, d, pad) for name, d, pad in (("head_dim", s.head_dim, s.head_dim_pad),
                                                 ("head_dim_v", s.head_dim_v, s.head_dim_v_pad)) if d != pad]
    if s.head_dim_v == s.head_dim and dims:
        dims = dims[:1]
    if not dims:
        return ""
    return ", ".join(f"{n} {d} runs as d{pad} tiles" for n, d, pad in dims) + " (padded to a power of two)"


#: The mbarriers of a TMA pipeline (8 bytes per stage and buffer) sit between
#: 1 KiB-aligned tile buffers: 8 to 1024 bytes in what Triton 3.6 allocates for sm_90
#: (tests/test_resources.py); the model takes the upper bound, so it is never under.
TMA_BARRIER_BYTES = 1024


def smem_buffers(variant: Variant) -> dict[str, int]:
    """Named shared-memory buffers (bytes) of a variant."""
    bufs = _tile_buffers(variant)
    if "bias" in mods_set(variant.spec.mods):
        # The bias tile, num_stages buffers (an upper bound of both binaries of a
        # variant).  Through a descriptor (a tma variant launched with an addressable
        # bias, BIAS_TMA) Triton 3.6 streams it through num_stages - 1 pipelined shared
        # buffers (none at num_stages 1) plus their barriers; through pointers it stays
        # in registers, with a staging/conversion scratch of up to ~9 KiB (sm_90
        # compiles, tests/test_bias_tma.py).
        c = variant.config
        bufs["bias_tiles"] = c.BLOCK_M * c.BLOCK_N * variant.spec.dtype_bytes * max(1, c.num_stages)
    if "dropout" in mods_set(variant.spec.mods):
        # The keep mask is drawn 4 columns per thread (one Philox call, its 4 outputs
        # joined into consecutive columns) and moved to the dot's accumulator layout
        # through a BLOCK_M x BLOCK_N byte scratch buffer (Triton 3.6, sm_90: exactly
        # this much more than without dropout in every variant compiled).
        c = variant.config
        bufs["dropout_mask_cvt"] = c.BLOCK_M * c.BLOCK_N
    if is_user_mods(variant.spec.mods):
        bufs.update(_user_buffers(variant))
    if variant.config.tma:
        bufs["tma_barriers"] = TMA_BARRIER_BYTES
    return bufs


def _user_buffers(variant: Variant) -> dict[str, int]:
    """What user score/mask functions add (:func:`flashgen.user_grads.smem_buffers`):
    their captured tensors' tiles and gradient scratch.  Known only in a process where
    the functions are registered (``flashgen.attention`` or the tuner traced them);
    elsewhere (e.g. ``flashgen explain``) nothing is added."""
    from . import user_grads, user_render

    low = user_render.registered(variant.spec.mods)
    if low is None or base_kernel(variant.spec.kernel) not in ("fwd", "bwd_dq", "bwd_dkdv"):
        return {}
    c = variant.config
    return user_grads.smem_buffers(low, base_kernel(variant.spec.kernel), c.BLOCK_M, c.BLOCK_N, c.num_stages)


def _tile_buffers(variant: Variant) -> dict[str, int]:
    s, c = variant.spec, variant.config
    b = s.dtype_bytes
    d, dv = s.head_dim_pad, s.head_dim_v_pad
    stages = max(1, c.num_stages)
    # A varlen kernel holds the same tiles as its dense counterpart (its per-sequence
    # offsets and lengths are scalars in registers).
    kernel = base_kernel(s.kernel)
    if kernel == "decode":
        return _decode_buffers(variant)
    if kernel == "fwd":
        # Q resident (A operand of Q·K^T); K and V streamed; P·V takes P from registers.
        return {
            "q_tile": c.BLOCK_M * d * b,
            "k_tiles": c.BLOCK_N * d * b * stages,
            "v_tiles": c.BLOCK_N * dv * b * stages,
        }
    if kernel == "bwd_dkdv":
        # K, V resident; Q, dO (and their LSE/delta rows) streamed; P^T and dS^T feed
        # the dots from registers.
        return {
            "k_tile": c.BLOCK_N * d * b,
            "v_tile": c.BLOCK_N * dv * b,
            "q_tiles": c.BLOCK_M * d * b * stages,
            "do_tiles": c.BLOCK_M * dv * b * stages,
            # LSE and delta rows of the tiles in flight, in 1 KiB-aligned buffers
            # (none when the loop is not pipelined, except that the one unpipelined
            # 128-row, 4-warp tile compiled on the H200 kept one such 1 KiB buffer:
            # attn_bwd_dkdv_d64_bf16_causal_m128_n64_w4_s1, 50176 B compiled).
            "lse_delta_rows": -(-2 * c.BLOCK_M * 4 * (stages - 1) // 1024) * 1024
            if stages > 1 else (1024 if c.BLOCK_M >= 128 and c.num_warps == 4 else 0),
        }
    # bwd_dq: Q, dO resident; K, V streamed; dS feeds dS·K from registers.
    return {
        "q_tile": c.BLOCK_M * d * b,
        "do_tile": c.BLOCK_M * dv * b,
        "k_tiles": c.BLOCK_N * d * b * stages,
        "v_tiles": c.BLOCK_N * dv * b * stages,
    }


def _decode_buffers(variant: Variant) -> dict[str, int]:
    """The decode split kernel (its combine kernel, launched separately, takes ~2 KiB).

    The packed query rows stay resident and K, V are streamed, as in ``fwd``, but its
    tiles are short (BLOCK_M < 64 runs on mma.sync, not wgmma), and Triton 3.6 for
    sm_90 then keeps num_stages - 1 buffers of the streamed tiles (num_stages with
    BLOCK_M >= 64) plus a BLOCK_M x BLOCK_N staging buffer of P.  The paged kernel's
    gathered tiles are buffered the same way (it loads each tile's page ids one
    iteration ahead; without that they got one buffer).  ``pipeline_scratch`` rounds up
    the compiler's small extra allocations (<= 1 KiB) of a pipelined loop.  Fitted to
    ``metadata.shared`` of compiled variants (tests/test_decode.py)."""
    s, c = variant.spec, variant.config
    b, stages = s.dtype_bytes, max(1, c.num_stages)
    wide = c.BLOCK_M >= 64
    bufs = stages if wide else max(1, stages - 1)
    piped = stages >= 2
    return {
        "q_tile": c.BLOCK_M * s.head_dim_pad * b,
        "k_tiles": c.BLOCK_N * s.head_dim_pad * b * bufs,
        "v_tiles": c.BLOCK_N * s.head_dim_v_pad * b * bufs,
        "p_stage": c.BLOCK_M * c.BLOCK_N * b if piped and not wide else 0,
        "pipeline_scratch": 1024 if piped else 0,
    }


def supports_tma(arch: Arch) -> bool:
    """Tensor descriptors (the Tensor Memory Accelerator) exist from sm_90 on; the
    interpreter emulates them."""
    return arch.compute_capability >= (9, 0)


def estimate(variant: Variant, arch: Arch) -> SmemEstimate:
    """The shared-memory estimate of ``variant`` against ``arch``'s per-block limit.  A
    ``tma`` config on a GPU without the Tensor Memory Accelerator is infeasible there
    (limit 0), so it is never compiled or replayed on it."""
    pad = padding_note(variant)
    if variant.config.tma and not supports_tma(arch):
        return SmemEstimate(smem_buffers(variant), 0, f"tma needs sm_90 or newer, {arch.sm} has no TMA", pad)
    return SmemEstimate(smem_buffers(variant), arch.smem_per_block_optin, padding=pad)

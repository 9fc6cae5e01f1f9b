"""Dropout's random stream: the device-side state and the kernels' keep mask, exposed.

The kernels (``mods`` containing ``dropout``, see ``templates/_common.j2``) keep
element (i, j) of head plane ``z * num_heads + h`` iff

    tl.rand(seed, offset + ((z * num_heads + h) * seqlen_q + i) * seqlen_k + j) >= dropout_p

with ``seed, offset = rng_state[0], rng_state[1]`` read on the device (Philox 4x32-10,
Salmon et al. 2011, "Parallel random numbers: as easy as 1, 2, 3", Triton's
``tl.rand``).  The counter is the element's index, so the kept set depends on no tile
size, warp count or program order: every variant the tuner can pick drops the same
elements, the backward recomputes exactly the forward's mask, and a fixed
(seed, offset) reproduces.

Each dropout call reads its (seed, offset) from a state tensor and then advances the
state's offset on the device by batch * num_heads * seqlen_q * seqlen_k (an in-place
add, so a CUDA graph replay draws a fresh mask).  :func:`default_state` holds one
state per device, seeded from ``torch.initial_seed()``; :func:`manual_seed` resets
them; callers may pass their own state tensor instead.
"""

from __future__ import annotations

import functools
import numbers
import os

import torch

_states: dict[torch.device, torch.Tensor] = {}
_seed: list[int | None] = [None]


def _check_state(rng_state: torch.Tensor, device: torch.device) -> None:
    from .errors import InputError

    if not isinstance(rng_state, torch.Tensor) or rng_state.dtype != torch.int64 or tuple(rng_state.shape) != (2,):
        raise InputError("rng_state must be an int64 tensor of shape (2,) holding [seed, offset], got "
                         + (f"{rng_state.dtype} {tuple(rng_state.shape)}" if isinstance(rng_state, torch.Tensor)
                            else type(rng_state).__name__))
    if rng_state.device != device:
        raise InputError(f"rng_state.device ({rng_state.device}) must equal q.device ({device})")
    if rng_state.stride(0) != 1:
        raise InputError("rng_state must be contiguous")


@torch.compiler.assume_constant_result
def _first_seed() -> int:
    # torch.initial_seed() is no graph op: a first use inside torch.compile reads it at
    # trace time (the state is made once; later calls guard on its existence).
    return (_seed[0] if _seed[0] is not None else torch.initial_seed()) & (2**63 - 1)


def default_state(device: torch.device) -> torch.Tensor:
    """The device's dropout state, int64 (2,) [seed, offset]: created on first use with
    seed = the :func:`manual_seed` value, else ``torch.initial_seed()`` (63 bits), and
    offset 0.  A normal tensor even when the first use is under
    ``torch.inference_mode()`` (it is advanced in place by later calls outside it)."""
    st = _states.get(device)
    if st is None:
        with torch.inference_mode(False):
            st = torch.tensor([_first_seed(), 0], dtype=torch.int64, device=device)
        _states[device] = st
    return st


def manual_seed(seed: int) -> None:
    """Reset every device's dropout state to [seed, 0] (and seed states made later)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        from .errors import InputError

        raise InputError(f"seed must be a non-negative int, got {seed!r}")
    _seed[0] = seed & (2**63 - 1)
    for st in _states.values():
        st.copy_(torch.tensor([_seed[0], 0], dtype=torch.int64))


def counters(batch: int, num_heads: int, seqlen_q: int, seqlen_k: int) -> int:
    """How far one call advances the offset: one Philox counter per score element."""
    return batch * num_heads * seqlen_q * seqlen_k


def take(rng_state: torch.Tensor, n: int) -> torch.Tensor:
    """A copy of the state for this call, then the state's offset advanced by ``n`` in
    place (both device operations, captured by CUDA graphs)."""
    used = rng_state.clone()
    rng_state[1:].add_(n)
    return used


@functools.lru_cache(maxsize=None)
def _mask_kernel(interp: bool):
    # Built on first use so that TRITON_INTERPRET, read when @triton.jit decorates,
    # is the caller's.
    import triton
    import triton.language as tl

    @triton.jit
    def dropout_mask_kernel(RNG, OUT, n_cols, total, dropout_p, BLOCK: tl.constexpr):
        idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        seed = tl.load(RNG)
        offset = tl.load(RNG + 1)
        keep = tl.rand(seed, offset + idx) >= dropout_p
        tl.store(OUT + idx, keep.to(tl.int8), mask=idx < total)

    return dropout_mask_kernel


def check_p(dropout_p) -> float:
    """``dropout_p`` as a float, or InputError unless it is a real in [0, 1)."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real) or not 0 <= dropout_p < 1:
        from .errors import InputError

        raise InputError(f"dropout_p must be a real in [0, 1), got {dropout_p!r}")
    return float(dropout_p)


def dropout_mask(rng_state: torch.Tensor, batch: int, num_heads: int, seqlen_q: int, seqlen_k: int,
                 dropout_p: float) -> torch.Tensor:
    """The keep mask the kernels draw for ``rng_state`` = [seed, offset] (as passed to
    the call, i.e. before it advanced): bool (batch, num_heads, seqlen_q, seqlen_k),
    True where the element is kept.  The state is not advanced.  Runs on CUDA, or on
    the CPU in Triton's interpreter (``TRITON_INTERPRET=1``).

    Raises InputError for arguments :func:`flashgen.attention` would reject (an
    ``rng_state`` that is not a contiguous int64 (2,) tensor, ``dropout_p`` outside
    [0, 1)), negative sizes, or a CPU state outside the interpreter."""
    from .errors import InputError

    _check_state(rng_state, getattr(rng_state, "device", None))
    for name, n in (("batch", batch), ("num_heads", num_heads), ("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k)):
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
            raise InputError(f"{name} must be an int >= 0, got {n!r}")
    dropout_p = check_p(dropout_p)
    out = torch.empty((batch, num_heads, seqlen_q, seqlen_k), dtype=torch.int8, device=rng_state.device)
    total = out.numel()
    if total:
        interp = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
        if not (rng_state.is_cuda or interp):
            raise InputError(f"dropout_mask runs a Triton kernel: rng_state must be on a CUDA device, or "
                             f"TRITON_INTERPRET=1 set for the CPU (got {rng_state.device})")
        block = 1024
        kern = _mask_kernel(interp)
        if rng_state.is_cuda:
            with torch.cuda.device(rng_state.device):
                kern[(-(-total // block),)](rng_state, out, seqlen_k, total, dropout_p, BLOCK=block)
        else:
            kern[(-(-total // block),)](rng_state, out, seqlen_k, total, dropout_p, BLOCK=block)
    return out.bool()

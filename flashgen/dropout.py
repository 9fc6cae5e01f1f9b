"""Dropout's random stream: the device-side state and the kernels' keep mask, exposed.

The kernels (``mods`` containing ``dropout``, see ``templates/_common.j2``) draw one
Philox4x32-10 call (Salmon et al. 2011, "Parallel random numbers: as easy as 1, 2, 3";
Triton's ``tl.randint4x``: counter words (c0, c1) the counter's low and high 32 bits,
c2 = c3 = 0, key (seed low, seed high), 10 rounds) per 4 consecutive key columns of a
row, and use all four 32-bit outputs.  Element (i, j) of head plane
``bh = z * num_heads + h`` takes output ``j % 4`` of counter

    offset + (bh * seqlen_q + i) * ceil(seqlen_k / 4) + j // 4

and is kept iff that output's uniform (``uint_to_uniform_float``, as in ``tl.rand``)
is >= dropout_p, with ``seed, offset = rng_state[0], rng_state[1]`` read on the device.
The counter is fixed by (seed, offset, batch, head, row, column), so the kept set
depends on no tile size, warp count or program order: every variant the tuner can
pick drops the same elements, the backward recomputes exactly the forward's mask, and
a fixed (seed, offset) reproduces.  (Rows are padded to a multiple of 4 columns: the
last counter of a row whose seqlen_k is not a multiple of 4 has unused outputs.)

A call's (seed, offset) (:func:`draw`) is by default drawn from torch's generator of
the device, as torch's own dropout draws: ``torch.manual_seed`` reproduces it and
``torch.utils.checkpoint`` restores it for the recomputed forward.  A caller's state
tensor (``rng_state=``), or after :func:`manual_seed` flashgen's own state per device
(:func:`default_state`), is read and then advanced on the device by :func:`counters` =
batch * num_heads * seqlen_q * ceil(seqlen_k / 4) (an in-place add, so a CUDA graph
replay draws a fresh mask).
"""

from __future__ import annotations

import contextlib
import functools
import numbers
import os

import torch

_states: dict[torch.device, torch.Tensor] = {}
_seed: list[int | None] = [None]
#: Whether calls draw from flashgen's own stream (_seed[0] is not None): a bool of its
#: own, so that torch.compile guards on the mode, not on the seed's value (a graph per
#: seed, and the recompile limit after eight).
_own: list[bool] = [False]


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


def manual_seed(seed: int | None) -> None:
    """Make dropout calls without ``rng_state=`` draw from flashgen's own per-device
    states, each reset to [seed, 0] (and states made later seeded so): a stream
    independent of torch's generator, advanced per call (:func:`take`).  ``None``: back
    to the default, torch's generator (:func:`draw`).  Calls in a region that
    ``torch.utils.checkpoint`` recomputes need torch's generator (or an ``rng_state=``
    restored by the caller): the recomputed forward draws the next mask of flashgen's
    own stream, so its gradients would not be the first forward's.

    Raises InputError unless ``seed`` is None or an int in [0, 2**63 - 1] (the state
    holds it as an int64; a larger seed would have to wrap onto a smaller one's masks)."""
    if seed is None:
        _seed[0], _own[0] = None, False
        _states.clear()
        return
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        from .errors import InputError

        raise InputError(f"seed must be None or an int in [0, 2**63 - 1] (the dropout state is int64), "
                         f"got {seed!r}")
    _seed[0], _own[0] = seed, True
    for st in _states.values():
        st.copy_(torch.tensor([_seed[0], 0], dtype=torch.int64))


#: Score elements (consecutive key columns of one row) per Philox counter: the four
#: 32-bit outputs of one Philox4x32 call.
COLS_PER_COUNTER = 4


def counters_per_row(seqlen_k: int) -> int:
    """Philox counters of one score row: ceil(seqlen_k / 4)."""
    return -(-seqlen_k // COLS_PER_COUNTER)


def counters(batch: int, num_heads: int, seqlen_q: int, seqlen_k: int) -> int:
    """How far one call advances the offset: one Philox counter per 4 key columns of
    each score row, batch * num_heads * seqlen_q * ceil(seqlen_k / 4)."""
    return batch * num_heads * seqlen_q * counters_per_row(seqlen_k)


def take(rng_state: torch.Tensor, n: int) -> torch.Tensor:
    """A copy of the state for this call, then the state's offset advanced by ``n`` in
    place (both device operations, captured by CUDA graphs; traced as the op
    ``flashgen::dropout_take``, which declares the mutation)."""
    if torch.compiler.is_compiling():
        from .library import dropout_take_op

        return dropout_take_op(rng_state, n)
    used = rng_state.clone()
    rng_state[1:].add_(n)
    return used


#: The (seed, offset) range of a call drawn from torch's generator: below 2**62, so that
#: offset + the call's counters stays inside int64.
_DRAW_HIGH = 2 ** 62


def draw(device: torch.device, n: int, rng_state: torch.Tensor | None = None) -> torch.Tensor:
    """The int64 (2,) [seed, offset] one dropout call of ``n`` counters uses: from
    ``rng_state`` (advanced, :func:`take`); else, after :func:`manual_seed`, from the
    device's own state (:func:`default_state`, advanced); else drawn from torch's
    generator of ``device`` (``torch.randint``, both in [0, 2**62)), as torch's own
    dropout draws: ``torch.manual_seed`` reproduces it, ``torch.utils.checkpoint``
    restores it for the recomputed forward, and a CUDA graph replay draws anew."""
    if rng_state is not None:
        return take(rng_state, n)
    if _own[0]:
        return take(default_state(device), n)
    return torch.randint(0, _DRAW_HIGH, (2,), dtype=torch.int64, device=device)


@functools.lru_cache(maxsize=None)
def _mask_kernel(interp: bool):
    # Built on first use so that TRITON_INTERPRET, read when @triton.jit decorates,
    # is the caller's.
    import triton
    import triton.language as tl

    @triton.jit
    def dropout_mask_kernel(RNG, OUT, n_rows, seqlen_k, n_groups, dropout_p,
                            BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr):
        # Rows are the flattened (batch, head, query) rows; each program covers BLOCK_R
        # rows and BLOCK_G groups of 4 columns, and stores each of randint4x's outputs
        # at its own column (4g + lane), independently of the kernels' join/reshape.
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        groups = tl.program_id(1).to(tl.int64) * BLOCK_G + tl.arange(0, BLOCK_G)
        seed = tl.load(RNG)
        offset = tl.load(RNG + 1)
        r0, r1, r2, r3 = tl.randint4x(seed, offset + rows[:, None] * n_groups + groups[None, :])
        base = OUT + rows[:, None] * seqlen_k + 4 * groups[None, :]
        row_ok = rows[:, None] < n_rows
        cols = 4 * groups[None, :]
        tl.store(base, (tl.random.uint_to_uniform_float(r0) >= dropout_p).to(tl.int8),
                 mask=row_ok & (cols < seqlen_k))
        tl.store(base + 1, (tl.random.uint_to_uniform_float(r1) >= dropout_p).to(tl.int8),
                 mask=row_ok & (cols + 1 < seqlen_k))
        tl.store(base + 2, (tl.random.uint_to_uniform_float(r2) >= dropout_p).to(tl.int8),
                 mask=row_ok & (cols + 2 < seqlen_k))
        tl.store(base + 3, (tl.random.uint_to_uniform_float(r3) >= dropout_p).to(tl.int8),
                 mask=row_ok & (cols + 3 < seqlen_k))

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
    # numbers.Integral admits numpy integers, which Triton's launcher does not take
    batch, num_heads, seqlen_q, seqlen_k = (int(n) for n in (batch, num_heads, seqlen_q, seqlen_k))
    dropout_p = check_p(dropout_p)
    out = torch.empty((batch, num_heads, seqlen_q, seqlen_k), dtype=torch.int8, device=rng_state.device)
    total = out.numel()
    if total:
        interp = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
        if not (rng_state.is_cuda or interp):
            raise InputError(f"dropout_mask runs a Triton kernel: rng_state must be on a CUDA device, or "
                             f"TRITON_INTERPRET=1 set for the CPU (got {rng_state.device})")
        n_rows, n_groups = batch * num_heads * seqlen_q, counters_per_row(seqlen_k)
        block_r, block_g = 16, 64
        grid = (-(-n_rows // block_r), -(-n_groups // block_g))
        kern = _mask_kernel(interp)
        args = (rng_state, out, n_rows, seqlen_k, n_groups, dropout_p)
        with torch.cuda.device(rng_state.device) if rng_state.is_cuda else contextlib.nullcontext():
            kern[grid](*args, BLOCK_R=block_r, BLOCK_G=block_g)
    return out.bool()

"""The tuning search space: knob domains per kernel, and the validity rules.

Readable on one screen.  ``DOMAINS`` lists the values each knob may take;
``RULES`` are predicates that exclude combinations the kernels cannot run (or that
cannot be fast), each with the reason.  The shared-memory limit is not a rule here: it
depends on the GPU and is checked by :mod:`flashgen.resources` (a config that fails it
is *infeasible*, a different status from *invalid*).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

from .spec import KernelSpec, ProblemKey, TileConfig, Variant, base_kernel, is_decode, is_user_mods, next_pow2

DOMAINS: dict[str, dict[str, tuple[int, ...]]] = {
    "fwd": {"BLOCK_M": (64, 128), "BLOCK_N": (32, 64, 128),
            "num_warps": (4, 8), "num_stages": (1, 2, 3, 4), "tma": (0, 1)},
    "bwd_dkdv": {"BLOCK_M": (32, 64, 128), "BLOCK_N": (64, 128),
                 "num_warps": (4, 8), "num_stages": (1, 2, 3), "tma": (0, 1)},
    "bwd_dq": {"BLOCK_M": (64, 128), "BLOCK_N": (32, 64, 128),
               "num_warps": (4, 8), "num_stages": (1, 2, 3), "tma": (0, 1)},
}
# The varlen kernels tile like their dense counterparts, with pointer loads only (a
# sequence's rows are a runtime slice, which a host-built descriptor cannot bound).
# ``ws`` (warp specialization) is in no domain: on sm_90 with Triton 3.6 it either
# leaves the kernel unchanged (num_warps 8) or fails to compile (num_warps 4); see
# docs/design.md.  The templates keep the switch for the GPUs where it works.
for _k in ("fwd", "bwd_dkdv", "bwd_dq"):
    DOMAINS[f"{_k}_varlen"] = {n: vals for n, vals in DOMAINS[_k].items() if n != "tma"}
# Decode (flash-decoding): BLOCK_M holds group x seqlen_q packed rows, so a key fixes it
# (see domain()); num_splits is how many programs share one (batch, kv head)'s keys.
DOMAINS["decode"] = {"BLOCK_M": (16, 32, 64, 128), "BLOCK_N": (32, 64, 128),
                     "num_warps": (4, 8), "num_stages": (1, 2, 3, 4),
                     "num_splits": (1, 2, 4, 8, 16, 32, 64)}
DOMAINS["decode_paged"] = DOMAINS["decode"]


def decode_block_m(group: int, seqlen_q: int) -> int:
    """The BLOCK_M of a decode problem: its group x seqlen_q packed rows, padded to a
    power of two in [16, 128] (16: tl.dot's smallest M; more rows take several row
    blocks)."""
    return min(128, max(16, next_pow2(group * seqlen_q)))


def domain(key: ProblemKey) -> dict[str, tuple[int, ...]]:
    """The knob domains the tuner searches for ``key``: DOMAINS[kernel], except that a
    decode key's BLOCK_M is the one its packed rows need (:func:`decode_block_m`)."""
    dom = DOMAINS[key.spec.kernel]
    if is_decode(key.spec.kernel):
        dom = {**dom, "BLOCK_M": (decode_block_m(key.group, key.seqlen_q),)}
    return dom


def _acc_regs_per_thread(v: Variant) -> float:
    """float32 accumulator elements each thread holds for the whole program."""
    s, c = v.spec, v.config
    threads = 32 * c.num_warps
    kernel = base_kernel(s.kernel)
    if kernel in ("fwd", "decode"):
        return c.BLOCK_M * s.head_dim_v_pad / threads
    if kernel == "bwd_dkdv":
        return c.BLOCK_N * (s.head_dim_pad + s.head_dim_v_pad) / threads
    return c.BLOCK_M * s.head_dim_pad / threads


def _score_index_stages(v: Variant) -> bool:
    """A user score function that reads a captured tensor at an index computed from the
    score (:attr:`flashgen.user_render.Lowered.sized_bufs`) compiles only with one stage:
    Triton 3.6's software pipeliner cannot predicate the tile's dot around that load
    ("doesn't know how to predicate this op"; fwd, bwd_dq and bwd_dkdv for sm_90 at
    num_stages 2 and 3, tests/test_user_mods.py).  Unknown functions (not registered in
    this process) pass."""
    if v.config.num_stages <= 1 or not is_user_mods(v.spec.mods):
        return True
    from . import user_render

    low = user_render.registered(v.spec.mods)
    return low is None or not low.sized_bufs


#: (name, predicate that must hold, why).
RULES: list[tuple[str, Callable[[Variant], bool], str]] = [
    ("score_index_stages", _score_index_stages,
     "a user score function reading a captured tensor at an index computed from the score compiles with "
     "num_stages 1 only (Triton's pipeliner cannot predicate the dot around that load)"),
    ("acc_regs", lambda v: _acc_regs_per_thread(v) <= 128,
     "the float32 accumulators alone would take more than 128 of a thread's 255 "
     "registers, so the kernel spills"),
    ("tile_per_warp", lambda v: is_decode(v.spec.kernel)
     or v.config.BLOCK_M * v.config.BLOCK_N >= 32 * 16 * v.config.num_warps,
     "each warp needs at least a 16x32 slab of the score tile"),
    ("decode_cols_per_warp", lambda v: not is_decode(v.spec.kernel) or v.config.BLOCK_N >= 8 * v.config.num_warps,
     "decode: the warps split the score tile's BLOCK_N columns (its rows are few); each "
     "needs at least 8"),
]


def violated_rules(v: Variant) -> list[str]:
    """Names and reasons of the rules ``v`` breaks (empty when valid)."""
    return [f"{name}: {why}" for name, ok, why in RULES if not ok(v)]


def configs(kernel: str) -> Iterator[TileConfig]:
    """Every TileConfig in the kernel's domain (valid or not)."""
    dom = DOMAINS[kernel]
    names = list(dom)
    for values in itertools.product(*(dom[n] for n in names)):
        yield TileConfig(**dict(zip(names, values)))


def valid_configs(spec: KernelSpec) -> list[TileConfig]:
    """The configs of spec's domain that satisfy every rule (not yet checked for
    shared memory)."""
    return [c for c in configs(spec.kernel) if not violated_rules(Variant(spec, c))]

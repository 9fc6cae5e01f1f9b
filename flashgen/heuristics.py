"""A default TileConfig for any problem on any architecture: always answers.

This is the untuned path (FlashInfer's "tactic -1"): the dispatcher uses it when the
tuning database has nothing for a key, and the tuner enqueues it first in every study
so every tuned result is compared with it.  Preferences follow the FlashAttention-2 and
Triton tutorial choices (BLOCK_M 128 / BLOCK_N 64 forward, smaller tiles for the
backward, smaller tiles as head_dim grows); the first preference that is valid and fits
the architecture's shared memory wins.
"""

from __future__ import annotations

from . import resources, space
from .arch import Arch
from .spec import KernelSpec, TileConfig, Variant

_PREFERENCES: dict[str, list[tuple[int, int, int, int]]] = {
    # (BLOCK_M, BLOCK_N, num_warps, num_stages), best first
    "fwd": [(128, 64, 8, 3), (128, 64, 4, 3), (128, 32, 4, 2), (64, 64, 4, 2), (64, 32, 4, 1)],
    "bwd_dkdv": [(64, 128, 8, 2), (32, 128, 8, 2), (64, 64, 4, 2), (32, 64, 4, 1)],
    "bwd_dq": [(128, 64, 8, 2), (64, 64, 4, 2), (64, 32, 4, 1)],
}

FALLBACK = {"fwd": TileConfig(64, 32, 4, 1), "bwd_dkdv": TileConfig(32, 64, 4, 1),
            "bwd_dq": TileConfig(64, 32, 4, 1)}
# The varlen kernels start from their dense counterparts' preferences (untuned: the
# H200 tuning of the "varlen-docs" preset is still to be run).
for _k in ("fwd", "bwd_dkdv", "bwd_dq"):
    _PREFERENCES[f"{_k}_varlen"] = _PREFERENCES[_k]
    FALLBACK[f"{_k}_varlen"] = FALLBACK[_k]


def default_config(spec: KernelSpec, arch: Arch) -> TileConfig:
    """The heuristic TileConfig for ``spec`` on ``arch``."""
    for m, n, w, st in _PREFERENCES[spec.kernel]:
        cfg = TileConfig(m, n, w, st)
        v = Variant(spec, cfg)
        if not space.violated_rules(v) and resources.estimate(v, arch).feasible:
            return cfg
    for cfg in sorted(space.valid_configs(spec), key=lambda c: resources.estimate(Variant(spec, c), arch).total_bytes):
        if resources.estimate(Variant(spec, cfg), arch).feasible:
            return cfg
    return FALLBACK[spec.kernel]

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
from .spec import KernelSpec, ProblemKey, TileConfig, Variant, is_decode

_PREFERENCES: dict[str, list[tuple[int, int, int, int]]] = {
    # (BLOCK_M, BLOCK_N, num_warps, num_stages), best first
    "fwd": [(128, 64, 8, 3), (128, 64, 4, 3), (128, 32, 4, 2), (64, 64, 4, 2), (64, 32, 4, 1)],
    "bwd_dkdv": [(64, 128, 8, 2), (32, 128, 8, 2), (64, 64, 4, 2), (32, 64, 4, 1)],
    "bwd_dq": [(128, 64, 8, 2), (64, 64, 4, 2), (64, 32, 4, 1)],
}

#: On GPUs with the Tensor Memory Accelerator (sm_90+), the dense kernels' first choice
#: loads the streamed tiles through tensor descriptors: (head_dim <= 64, <= 128, larger),
#: the first two the fastest configs of the exhaustive search on the H200
#: (benchmarks/multi_gpu_tune.py grid run, docs/design.md), where TMA freed about 100
#: registers per thread; the third the head-dims preset's tuned rows at head_dim 256
#: (docs/results/h200/tuning/head-dims/tune.log: bwd_dkdv 2.1-2.8x and bwd_dq 1.4-1.6x
#: the configs the first two tiers gave there at all 8 of its keys; head_dim 192, which
#: pads to the same tiles, was not timed).
_TMA_PREFERENCES: dict[str, tuple[tuple[int, int, int, int], ...]] = {
    "fwd": ((128, 128, 4, 3), (64, 64, 4, 3), (64, 64, 4, 3)),
    "bwd_dkdv": ((32, 128, 4, 3), (64, 64, 4, 2), (64, 64, 8, 2)),
    "bwd_dq": ((64, 64, 4, 3), (128, 32, 4, 3), (128, 32, 8, 3)),
}

FALLBACK = {"fwd": TileConfig(64, 32, 4, 1), "bwd_dkdv": TileConfig(32, 64, 4, 1),
            "bwd_dq": TileConfig(64, 32, 4, 1)}
# The varlen kernels start from their dense counterparts' preferences (untuned: the
# H200 tuning of the "varlen-docs" preset is still to be run).
for _k in ("fwd", "bwd_dkdv", "bwd_dq"):
    _PREFERENCES[f"{_k}_varlen"] = _PREFERENCES[_k]
    FALLBACK[f"{_k}_varlen"] = FALLBACK[_k]


# Decode: (BLOCK_N, num_warps, num_stages) best first; BLOCK_M and num_splits follow
# from the problem key (decode_default).
_DECODE_PREFERENCES = [(64, 4, 2), (64, 4, 1), (32, 4, 2), (32, 4, 1)]
#: Programs per SM the decode default aims at (its small tiles let several share an SM).
DECODE_PROGRAMS_PER_SM = 2
#: The fewest key tiles a decode split is given (fewer makes the merge cost more than
#: the parallelism gains).
DECODE_MIN_TILES_PER_SPLIT = 4


def decode_splits(key: ProblemKey, arch: Arch, block_m: int, block_n: int) -> int:
    """Flash-decoding's split count: the smallest power of two that gives the GPU about
    DECODE_PROGRAMS_PER_SM programs per SM over (batch * kv_heads * row blocks), while
    each split keeps at least DECODE_MIN_TILES_PER_SPLIT key tiles of the cache's
    capacity bucket; at most the domain's largest."""
    batch_kv = max(1, key.batch_heads // max(1, key.group))
    row_blocks = -(-key.group * key.seqlen_q // block_m)
    programs = batch_kv * row_blocks
    tiles = max(1, key.seqlen_k // block_n)
    cap = space.DOMAINS["decode"]["num_splits"][-1]
    splits = 1
    while (programs * splits < DECODE_PROGRAMS_PER_SM * arch.sm_count and splits * 2 <= cap
           and tiles // (splits * 2) >= DECODE_MIN_TILES_PER_SPLIT):
        splits *= 2
    return splits


def _decode_default(spec: KernelSpec, arch: Arch, key: ProblemKey | None) -> TileConfig:
    m = space.decode_block_m(key.group, key.seqlen_q) if key is not None else 16
    for n, w, st in _DECODE_PREFERENCES:
        splits = decode_splits(key, arch, m, n) if key is not None else 1
        cfg = TileConfig(m, n, w, st, num_splits=splits)
        v = Variant(spec, cfg)
        if not space.violated_rules(v) and resources.estimate(v, arch).feasible:
            return cfg
    return TileConfig(16, 32, 4, 1, num_splits=1)


def default_config(spec: KernelSpec, arch: Arch, key: ProblemKey | None = None) -> TileConfig:
    """The heuristic TileConfig for ``spec`` on ``arch``.  ``key`` is the problem being
    served (a "strided" layout gets no TMA config; the decode kernels take BLOCK_M
    from its packed rows and num_splits from the batch and the cache length); without
    it a decode default has BLOCK_M 16 and one split."""
    if is_decode(spec.kernel):
        return _decode_default(spec, arch, key)
    prefs = [(m, n, w, st, 0) for m, n, w, st in _PREFERENCES[spec.kernel]]
    strided = key is not None and key.layout == "strided"
    if spec.kernel in _TMA_PREFERENCES and resources.supports_tma(arch) and not strided:
        small, medium, large = _TMA_PREFERENCES[spec.kernel]
        tier = small if spec.head_dim_pad <= 64 else medium if spec.head_dim_pad <= 128 else large
        prefs.insert(0, (*tier, 1))
    for m, n, w, st, tma in prefs:
        cfg = TileConfig(m, n, w, st, tma=tma)
        v = Variant(spec, cfg)
        if not space.violated_rules(v) and resources.estimate(v, arch).feasible:
            return cfg
    for cfg in sorted(space.valid_configs(spec), key=lambda c: resources.estimate(Variant(spec, c), arch).total_bytes):
        if resources.estimate(Variant(spec, cfg), arch).feasible:
            return cfg
    return FALLBACK[spec.kernel]

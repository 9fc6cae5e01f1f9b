"""Named sets of problem sizes to tune.

A preset entry is (head_dim, mask, Shape); :func:`expand` turns entries into
(ProblemKey, Shape) pairs for each requested kernel and dtype, keeping the first shape
of each bucket (:class:`flashgen.spec.ProblemKey`).
"""

from __future__ import annotations

from collections.abc import Iterable

from .spec import KERNELS, KernelSpec, ProblemKey, Shape

Entry = tuple[int, str, Shape]  # (head_dim (= head_dim_v), mask, shape)


def _fa_grid() -> list[Entry]:
    """FlashAttention's benchmark grid: 16384 tokens per batch, model width 2048."""
    return [(d, mask, Shape(16384 // n, 2048 // d, 2048 // d, n, n))
            for d in (64, 128) for mask in ("none", "causal")
            for n in (512, 1024, 2048, 4096, 8192, 16384)]


def _llama3_8b() -> list[Entry]:
    """Llama-3-8B attention: 32 query heads, 8 KV heads, head_dim 128, causal."""
    return [(128, "causal", Shape(b, 32, 8, n, n))
            for b in (1, 2, 4, 8) for n in (1024, 2048, 4096, 8192)]


def _small() -> list[Entry]:
    """Tiny shapes for CPU smoke tests (one MHA, one GQA with odd length)."""
    return [(64, "none", Shape(1, 2, 2, 128, 128)), (64, "causal", Shape(1, 4, 2, 97, 97))]


PRESETS = {"fa-grid": _fa_grid, "llama3-8b": _llama3_8b, "small": _small}


def expand(names: Iterable[str], dtype: str = "bfloat16",
           kernels: Iterable[str] = KERNELS) -> list[tuple[ProblemKey, Shape]]:
    """(ProblemKey, Shape) for every entry of the named presets and every kernel, in
    preset order; a key already produced keeps its first shape.  Raises KeyError naming
    the known presets for an unknown name."""
    kernels = tuple(kernels)
    out: dict[ProblemKey, Shape] = {}
    for name in names:
        if name not in PRESETS:
            raise KeyError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
        for d, mask, shape in PRESETS[name]():
            for k in kernels:
                key = shape.key(KernelSpec(k, dtype, d, d, mask))
                out.setdefault(key, shape)
    return list(out.items())

"""GPU facts the resource model and the heuristics need: compute capability, SM count,
shared memory per block (opt-in), registers per SM.

``current()`` reads the live device; ``TABLE`` holds the same facts for the
architectures flashgen knows, so a config tuned on one GPU can be checked against
another without that GPU present (CUDA C Programming Guide, "Technical
Specifications per Compute Capability").
"""

from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class Arch:
    name: str
    compute_capability: tuple[int, int]
    sm_count: int
    smem_per_block_optin: int  # bytes a block may opt in to
    regs_per_sm: int = 65536

    @property
    def sm(self) -> str:
        return f"sm_{self.compute_capability[0]}{self.compute_capability[1]}"


#: Per-architecture limits (sm count is the flagship part's).  Shared memory is the
#: per-block opt-in maximum (cudaDevAttrMaxSharedMemoryPerBlockOptin).
TABLE: dict[str, Arch] = {
    "sm_80": Arch("NVIDIA A100", (8, 0), 108, 166912),
    "sm_86": Arch("NVIDIA GeForce RTX 3090", (8, 6), 82, 101376),
    "sm_89": Arch("NVIDIA L40S", (8, 9), 142, 101376),
    "sm_90": Arch("NVIDIA H100", (9, 0), 132, 232448),
    "sm_100": Arch("NVIDIA B200", (10, 0), 148, 232448),
    "sm_120": Arch("NVIDIA GeForce RTX 5090", (12, 0), 170, 101376),
}

#: What the Triton interpreter (CPU) is modelled as: shared memory does not limit it,
#: but configs are still checked against sm_90 so a CPU test sees the same space.
INTERPRETER = Arch("triton-interpreter", (9, 0), 132, 232448)


@functools.lru_cache(maxsize=None)
def current(device_index: int | None = None) -> Arch:
    """The Arch of a CUDA device (the current one by default).

    Falls back to :data:`INTERPRETER` when CUDA is not available.
    """
    import torch

    if not torch.cuda.is_available():
        return INTERPRETER
    idx = torch.cuda.current_device() if device_index is None else device_index
    p = torch.cuda.get_device_properties(idx)
    smem = getattr(p, "shared_memory_per_block_optin", 0)
    if not smem:
        import triton

        smem = triton.runtime.driver.active.utils.get_device_properties(idx)["max_shared_mem"]
    return Arch(p.name, (p.major, p.minor), p.multi_processor_count, int(smem),
                int(getattr(p, "regs_per_multiprocessor", 65536) or 65536))


#: Substrings of CUDA device names and the architecture of those parts (for naming a GPU
#: without it present: ``flashgen explain --gpu 'NVIDIA H200'``).
_NAME_PARTS = (("H100", "sm_90"), ("H200", "sm_90"), ("H800", "sm_90"), ("H20", "sm_90"), ("GH200", "sm_90"),
               ("A100", "sm_80"), ("A800", "sm_80"), ("A30", "sm_80"), ("B200", "sm_100"), ("B100", "sm_100"),
               ("L40", "sm_89"), ("L4", "sm_89"), ("RTX 4090", "sm_89"), ("RTX 5090", "sm_120"),
               ("RTX 3090", "sm_86"), ("A10", "sm_86"), ("A40", "sm_86"), ("RTX A6000", "sm_86"))


#: SM counts of parts whose count differs from their architecture's flagship in
#: :data:`TABLE` (or is worth stating), by a substring of the device name, most specific
#: first (vendors' data sheets; what ``flashgen explain --gpu`` assumes without the GPU).
_SM_COUNTS = (("H100 PCIe", 114), ("H100", 132), ("GH200", 132), ("H200", 132), ("H800 PCIe", 114),
              ("H800", 132), ("H20", 78), ("A100", 108), ("A800", 108))


def by_gpu_name(name: str) -> Arch | None:
    """The architecture of a CUDA device name (``torch.cuda.get_device_name``, e.g.
    "NVIDIA H200") as an Arch named ``name``, from :data:`TABLE`'s limits and the part's
    SM count where :data:`_SM_COUNTS` knows it (else the flagship's); None for a name it
    does not know."""
    for part, sm in _NAME_PARTS:
        if part in name:
            a = TABLE[sm]
            sms = next((n for p, n in _SM_COUNTS if p in name), a.sm_count)
            return Arch(name, a.compute_capability, sms, a.smem_per_block_optin, a.regs_per_sm)
    return None


def by_sm(sm: str) -> Arch:
    """Look up ``TABLE`` by ``"sm_90"``-style name; raises KeyError naming the choices."""
    try:
        return TABLE[sm]
    except KeyError:
        raise KeyError(f"unknown architecture {sm!r}; known: {sorted(TABLE)}") from None

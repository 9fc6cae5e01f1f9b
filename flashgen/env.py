"""The environment a measurement was taken in (FlashInfer's tuning-file header).

Every tuning-database row carries one; a row is reused only when the GPU, its compute
capability, the Triton version and the kernel's template hash all match the current
ones.  Rows from another environment are ignored, never silently reused.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from . import families
from .spec import DEFAULT_FAMILY

#: Row columns that must equal the current environment for a row to be reused
#: (besides ``template_hash``, which is per kernel).
MATCH_COLUMNS = ("gpu_name", "compute_capability", "triton_version")


@dataclass(frozen=True)
class Environment:
    gpu_name: str  # e.g. "NVIDIA H200"
    compute_capability: str  # e.g. "9.0"
    sm_count: int
    triton_version: str
    torch_version: str
    flashgen_version: str

    @classmethod
    def current(cls) -> "Environment":
        """The live device (:func:`flashgen.arch.current`) and installed versions."""
        import torch
        import triton

        from ._version import __version__
        from .arch import current

        a = current()
        return cls(a.name, "%d.%d" % a.compute_capability, a.sm_count, triton.__version__,
                   torch.__version__, __version__)

    def template_hash(self, kernel: str, mods: str = "", family: str = DEFAULT_FAMILY) -> str:
        """The current code hash of ``kernel`` compiled with score modifications ``mods``
        by kernel family ``family`` (:meth:`flashgen.families.Family.template_hash`;
        the Triton family's is :func:`flashgen.render.template_hash`)."""
        return families.get(family).template_hash(kernel, mods)

    def match_fields(self, kernel: str, mods: str = "", family: str = DEFAULT_FAMILY) -> dict[str, str]:
        """Column -> value that a row of ``kernel``/``mods``/``family`` must have to match this environment."""
        d = {c: getattr(self, c) for c in MATCH_COLUMNS}
        d["template_hash"] = self.template_hash(kernel, mods, family)
        return d

    def matches(self, row: dict) -> bool:
        """Whether a tuning-DB row was measured in this environment (a row without a
        ``family`` is the Triton family's; one of a family not registered never matches)."""
        family = row.get("family") or DEFAULT_FAMILY
        if family not in families.FAMILIES:
            return False
        return all(row.get(c) == v for c, v in self.match_fields(row["kernel"], row.get("mods") or "", family).items())

    def as_row(self, kernel: str, mods: str = "", family: str = DEFAULT_FAMILY) -> dict:
        """The environment columns of a DB row for ``kernel``/``mods``/``family``."""
        return {**dataclasses.asdict(self), "template_hash": self.template_hash(kernel, mods, family)}

"""The environment a measurement was taken in (FlashInfer's tuning-file header).

Every tuning-database row carries one.  A row matches exactly when the GPU, its compute
capability, the Triton version and the kernel's code hash (template hash) all equal the
current ones; the tuner reuses only such rows.  The dispatcher also serves rows of the
same GPU and code measured under another Triton version, after the exact ones and
flagged (:data:`VERSION_COLUMNS`, ``flashgen.dispatch``).  Rows of another GPU or other
code are never used.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from . import families
from .spec import DEFAULT_FAMILY

#: Row columns that must equal the current environment for a row to be reused
#: (besides ``template_hash``, which is per kernel).
MATCH_COLUMNS = ("gpu_name", "compute_capability", "triton_version")
#: The software versions a row records: a row of the same GPU and code hash measured under
#: other versions still describes the same generated kernel on the same GPU (the dispatcher
#: uses it after the exact rows, flagged); the torch version is recorded, never matched.
VERSION_COLUMNS = ("triton_version", "torch_version")


def installed_versions() -> dict[str, str]:
    """The installed Triton and torch versions, as :class:`Environment` records them
    (``triton_version``, ``torch_version``).  The one place they are read, so a test can
    stand in another installation (monkeypatch this function)."""
    import torch
    import triton

    return {"triton_version": triton.__version__, "torch_version": torch.__version__}


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
        """The live device (:func:`flashgen.arch.current`) and installed versions
        (:func:`installed_versions`)."""
        from ._version import __version__
        from .arch import current

        a = current()
        v = installed_versions()
        return cls(a.name, "%d.%d" % a.compute_capability, a.sm_count, v["triton_version"],
                   v["torch_version"], __version__)

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

    def version_note(self, row: dict) -> str | None:
        """The versions ``row`` was measured under where they differ from this
        environment's, e.g. ``"triton 3.6.0"`` or ``"triton 3.6.0, torch 2.11.0"``
        (None: the same versions)."""
        diff = [f"{c.split('_')[0]} {row.get(c)}" for c in VERSION_COLUMNS
                if row.get(c) is not None and row.get(c) != getattr(self, c)]
        return ", ".join(diff) or None

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

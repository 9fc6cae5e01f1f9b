"""The environment a measurement was taken in (FlashInfer's tuning-file header).

Every tuning-database row carries one.  A row matches exactly when the GPU, its compute
capability, the Triton version and the kernel's code hash (template hash) all equal the
current ones; the tuner reuses only such rows.  The dispatcher also serves rows of the
same GPU and code measured under another Triton version, after the exact ones and
flagged (:data:`VERSION_COLUMNS`, ``flashgen.dispatch``), and, for a key none of this
GPU's rows serves, rows of the same code measured on a *sibling* GPU: another name with
the same compute capability and SM count (:data:`SIBLING_COLUMNS`; e.g. the H100 SXM and
the H200, both sm_90 with 132 SMs and the same shared memory), flagged with that GPU's
name.  Rows of other code, or of a GPU of another compute capability or SM count, are
never used.
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
#: Row columns a *sibling* GPU shares with this one (its ``gpu_name`` differs): the same
#: compiled code runs there, and the same tiles fit (shared memory and registers per SM
#: are a function of the compute capability), over as many SMs.
SIBLING_COLUMNS = ("compute_capability", "sm_count")
#: Suffixes ``flashgen tune`` gives the GPU name of rows it did not measure on a GPU
#: (``--fake`` replays, ``--fake-model`` timings): never a sibling's rows.
SYNTHETIC_GPU_SUFFIXES = (" (fake)", " (model)")
#: The GPU name of the Triton interpreter's environment (:data:`flashgen.arch.INTERPRETER`).
INTERPRETER_GPU = "triton-interpreter"


def real_gpu(gpu_name: str | None) -> bool:
    """Whether rows of ``gpu_name`` were measured on a GPU: not the interpreter's, not
    a ``--fake`` or ``--fake-model`` run's (:data:`SYNTHETIC_GPU_SUFFIXES`)."""
    return bool(gpu_name) and not gpu_name.startswith(INTERPRETER_GPU) and not gpu_name.endswith(
        SYNTHETIC_GPU_SUFFIXES)


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
        """The GPU and versions ``row`` was measured under where they differ from this
        environment's, e.g. ``"triton 3.6.0"``, ``"triton 3.6.0, torch 2.11.0"`` or, for a
        sibling GPU's row, ``"NVIDIA H200 (sm_90, 132 SMs, as this GPU), torch 2.11.0"``
        (None: this GPU and the same versions)."""
        diff = [f"{c.split('_')[0]} {row.get(c)}" for c in VERSION_COLUMNS
                if row.get(c) is not None and row.get(c) != getattr(self, c)]
        if row.get("gpu_name") is not None and row.get("gpu_name") != self.gpu_name:
            cc = str(row.get("compute_capability", "")).replace(".", "")
            diff.insert(0, f"{row['gpu_name']} (sm_{cc}, {row.get('sm_count')} SMs, as this GPU)")
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

"""The plain-Triton kernel family: every kernel, every GPU from sm_80 on, the CPU
interpreter; the portable family that serves every key and gives the heuristic default.

Its pieces: templates in ``templates/`` (rendered by :mod:`flashgen.render`, loaded by
:mod:`flashgen.compile`), knob domains and validity rules in :mod:`flashgen.space`,
resource terms in :mod:`flashgen.resources`, heuristic defaults in
:mod:`flashgen.heuristics`, and its launchers in :mod:`.launch` (also importable as
``flashgen.ops``).  :data:`FAMILY` adapts them to :class:`flashgen.families.Family`.
"""

from __future__ import annotations

import dataclasses

from ... import compile as _compile
from ... import heuristics, render, resources, space
from ...spec import KERNELS, ProblemKey, TileConfig, Variant, is_decode

#: Launcher name -> function name in :mod:`.launch` (looked up at call time).
_LAUNCHERS = {"fwd": "fwd", "bwd": "bwd", "bwd_dq": "bwd_dq", "bwd_dkdv": "bwd_dkdv",
              "fwd_varlen": "fwd_varlen", "bwd_varlen": "bwd_varlen", "bwd_dq_varlen": "bwd_dq_varlen",
              "bwd_dkdv_varlen": "bwd_dkdv_varlen", "decode": "decode", "decode_paged": "decode"}


def odd_sizes(config: TileConfig) -> list[str]:
    """What Triton itself does not launch: num_warps and the ``tl.arange`` spans BLOCK_M
    and BLOCK_N must be powers of two (the search domains hold no other size; a row
    edited by hand may, and ``flashgen import`` refuses it)."""
    return [f"pow2: {n} {getattr(config, n)} (Triton takes num_warps and tile sizes that are powers of two)"
            for n in ("BLOCK_M", "BLOCK_N", "num_warps")
            if getattr(config, n) < 1 or getattr(config, n) & (getattr(config, n) - 1)]


class TritonFamily:
    name = "triton"
    kernels = KERNELS
    _launch = None  # the launch module, once imported

    def unsupported(self, key: ProblemKey, arch) -> str | None:
        """None: it serves every kernel of :data:`KERNELS`, mask, mods and layout (a
        config's shared memory is checked per config).  The whole backward as one kernel
        (``bwd``) is not one of them: its backward is ``bwd_dq`` + ``bwd_dkdv``, each
        tuned under its own key."""
        if key.spec.kernel not in KERNELS:
            return f"its backward is two kernels, bwd_dq and bwd_dkdv, with keys of their own, not {key.spec.kernel}"
        return None

    def domain(self, key: ProblemKey) -> dict[str, tuple]:
        return space.domain(key)

    def violated_rules(self, variant: Variant) -> list[str]:
        """:func:`odd_sizes`, then :func:`flashgen.space.violated_rules`."""
        return odd_sizes(variant.config) + space.violated_rules(variant)

    def config_reasons(self, config: TileConfig) -> list[str]:
        """:func:`odd_sizes` without its rule name: what Triton never launches."""
        return [r.removeprefix("pow2: ") for r in odd_sizes(config)]

    def estimate(self, variant: Variant, arch) -> resources.SmemEstimate:
        return resources.estimate(variant, arch)

    def adapt(self, config: TileConfig, key: ProblemKey) -> TileConfig:
        """A strided layout takes the same tiles on pointer loads; a decode tile's
        BLOCK_M holds this key's packed rows, not another bucket's."""
        if key.layout == "strided" and config.tma:
            config = dataclasses.replace(config, tma=0)
        if is_decode(key.spec.kernel):
            config = dataclasses.replace(config, BLOCK_M=space.decode_block_m(key.group, key.seqlen_q))
        return config

    def default_config(self, key: ProblemKey, arch) -> TileConfig:
        return heuristics.default_config(key.spec, arch, key)

    def template_hash(self, kernel: str, mods: str = "") -> str:
        return render.template_hash(kernel, mods)

    def render(self, variant: Variant) -> str:
        return render.render(variant)

    def load(self, variant: Variant):
        return _compile.load(variant)

    def launcher(self, name: str):
        """The function of :mod:`.launch` (imported on first use: it imports torch), looked
        up on each call so that a patched ``flashgen.ops.fwd`` is what runs."""
        launch = self._launch
        if launch is None:
            from . import launch

            self._launch = launch
        return getattr(launch, _LAUNCHERS[name])


FAMILY = TritonFamily()

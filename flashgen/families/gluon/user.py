"""User score and mask functions (:mod:`flashgen.user_mods`) in the Gluon forward: the
Jinja variables of ``templates/gluon/attn_fwd.py.j2`` for a variant whose
:attr:`.config.GluonFwdSpec.user` names a lowering (:mod:`flashgen.user_render`).
Pure: imports neither torch nor triton.

The code is :class:`flashgen.user_render.Context`'s (the Triton family's, so both
families compute the same expressions in the same order), written in Gluon: ``tl.``
becomes ``gl.`` (the two languages share these operations' names and semantics), with
three exceptions: ``tl.math.exp2`` / ``tl.math.log2`` are ``gl.exp2`` / ``gl.log2``,
``tl.sigmoid`` (Gluon has none) is the template's ``_sigmoid`` (1 / (1 + e^-x)), and a
constant mask predicate is a full tile in the scores' layout.  Index vectors are the
scores' row and column slices (``u_rows``, ``u_cols``), so every value of a score or
mask function has the scores' layout and no conversion is emitted.

The forward computes the score function on s = softmax_scale * q.k in every tile, then
base 2 (no qk_scale in the exponent); the mask function's block mask has tiles of the
program's rows (``BLOCK_MT`` = consumers x 64) by BLOCK_N keys; a mask function that is
a band tightens diag_lo / diag_hi once, before the partitions start.  The variant's
mask mode is "window" whenever there is a mask function (:func:`compiled_mask`), as in
the Triton family (:func:`flashgen.spec.compiled_variant`).
"""

from __future__ import annotations

import re

from ... import user_render

#: What a Triton expression of :class:`flashgen.user_render._Code` becomes in Gluon.
_RENAMES = (("tl.math.exp2(", "gl.exp2("), ("tl.math.log2(", "gl.log2("), ("tl.sigmoid(", "_sigmoid("))
_CONST_MASK = re.compile(r"tl\.full\(\[1, 1\], (True|False), tl\.int1\)")


def gluon(code: str) -> str:
    """Triton code of the user functions (:class:`flashgen.user_render.Context`) in Gluon."""
    code = _CONST_MASK.sub(r"gl.full([BLOCK_M, BLOCK_N], \1, gl.int1, S_LAYOUT)", code)
    for old, new in _RENAMES:
        code = code.replace(old, new)
    return code.replace("tl.", "gl.")


def compiled_mask(mask: str, mods: str) -> str:
    """The mask mode compiled for the built-in ``mask`` with user functions ``mods``:
    "window" when they include a mask function (its block mask's ranges and the window
    kernel's loops serve every built-in mode), else ``mask``."""
    return "window" if mods.endswith("m") else mask


def template_vars(mods: str, indent: str = "        ") -> dict:
    """The template's user variables for the lowering named ``mods`` ("" for none: every
    variable empty, so a plain variant renders as before).  ``indent``: the consumer's
    tile-loop body indentation (the per-(batch, head) setup is written there)."""
    empty = dict(USER=False, USER_NAME="", USER_SCORE=False, USER_MASK=False, USER_GUARD=False,
                 USER_SIGMOID=False, USER_SCORE_BLOCK="", USER_SETUP="", USER_BOUNDS="", QK=" * qk_scale",
                 U_KP="", U_PP="", U_TP="", U_TA="")
    if not mods:
        return empty
    low = user_render.lowered(mods)
    ctx = user_render.Context(low, "fwd")
    score, mask = low.score is not None, ctx.mask
    out = dict(empty, USER_NAME=mods, USER_BOUNDS=gluon(ctx.bounds()).rstrip("\n"))
    if not (score or mask):
        return out
    block = gluon(ctx.score_block("s", "u_rows", "u_cols", False)).rstrip("\n")
    params = ctx.kernel_params(True)
    if low.sinks:  # the Gluon forward takes the sinks before the scale (SINKS_ARG)
        assert params.endswith("SINKS, "), params
        params = params[:-len("SINKS, ")]
    out.update(USER=True, USER_SCORE=score, USER_MASK=mask, USER_GUARD=ctx.guard, USER_SIGMOID="_sigmoid(" in block,
               USER_SCORE_BLOCK=block, USER_SETUP=gluon(ctx.setup("off_z", "off_h", indent)).rstrip("\n"),
               QK="" if score else " * qk_scale", U_KP=", " + params.rstrip(", "),
               U_PP=", UBM, ubm_sz, ubm_sh" if mask else "",
               U_TP="seqlen_q, " + ctx.tile_args(True), U_TA="seqlen_q, " + ctx.tile_args(False))
    return out

"""User mask functions (:mod:`flashgen.user_mods`) in the Gluon backward: the Jinja
variables of ``templates/gluon/attn_bwd.py.j2`` for a variant rendered with
``user=`` (:func:`flashgen.families.gluon.bwd.render`).  Pure: imports neither torch
nor triton.

The code is :class:`flashgen.user_render.Context`'s for the Triton family's dK/dV
kernel (``bwd_dkdv``: the transposed score tile, key rows down and query rows across),
written in Gluon by :func:`.user.gluon`.  Kept apart from :mod:`.user`, whose source is
part of the forward's user code id (:func:`.render.user_code_id`).
"""

from __future__ import annotations

import textwrap

from ... import user_render
from ...errors import UnsupportedError
from .user import _CONST_MASK, gluon


def bwd_template_vars(mods: str, indent: str = "            ") -> dict:
    """The Jinja variables of ``templates/gluon/attn_bwd.py.j2`` for user functions
    ``mods`` ("" for none: every variable empty, so a plain variant renders as before).
    Mask functions only (a score function's derivative and its captured tensors'
    gradients are the Triton family's): a band tightens diag_lo / diag_hi
    (``USER_BOUNDS``); any other mask function's predicate ``u_keep`` is evaluated in
    the masked tiles of S^T, on the key rows ``u_cols`` (down) and the query rows
    ``u_rows`` (across), with its per-(batch, head) values (``USER_SETUP``) computed
    there for the step's query head ``u_h``; its block mask gives each key block's
    query rows [first visited, interior start, interior end, end).  ``indent``: the
    masked branch's indentation in the consumer's step.  Raises UnsupportedError for a
    score function or sinks."""
    empty = dict(USER=False, USER_NAME="", USER_MASK=False, USER_BOUNDS="", USER_MASK_BLOCK="", USER_SETUP="",
                 U_KP="", U_ARGS="")
    if not mods:
        return empty
    low = user_render.lowered(mods)
    if low.score is not None or low.sinks:
        raise UnsupportedError(f"user functions {mods}: the Gluon backward takes mask functions only (a score "
                               "function or sinks: the Triton family's backward)")
    ctx = user_render.Context(low, "bwd_dkdv")
    out = dict(empty, USER=True, USER_NAME=mods, USER_BOUNDS=gluon(ctx.bounds()).rstrip("\n"))
    if not ctx.mask:
        return out
    # a constant predicate (a mask function that keeps nothing) as a full tile of S^T
    block = _CONST_MASK.sub(r"gl.full([PB, BLOCK_M], \1, gl.int1, ST_LAYOUT)",
                            ctx.score_block("s", "u_rows", "u_cols", True))
    lines = gluon(block).rstrip("\n").splitlines()
    cut = next(i for i, ln in enumerate(lines) if ln.strip() == "if MASKED:")
    # the consumer evaluates the predicate in its masked branch: the block without its
    # own "if MASKED:" (the lines before it are comments)
    body = textwrap.dedent("\n".join(lines[:cut])) + "\n" + textwrap.dedent("\n".join(lines[cut + 1:]))
    params = ctx.kernel_params(False).rstrip(", ")
    out.update(USER_MASK=True, USER_MASK_BLOCK=textwrap.indent(body, indent),
               USER_SETUP=gluon(ctx.setup("u_z", "u_h", indent)).rstrip("\n"), U_KP=", " + params,
               U_ARGS=", " + params + ", m_full_lo, m_full_hi")
    return out

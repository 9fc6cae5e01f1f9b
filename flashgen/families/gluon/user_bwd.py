"""User score and mask functions (:mod:`flashgen.user_mods`) in the Gluon backward: the
Jinja variables of ``templates/gluon/attn_bwd.py.j2`` for a variant rendered with
``user=`` (:func:`flashgen.families.gluon.bwd.render`).  Pure: imports neither torch
nor triton.

The code is :class:`flashgen.user_render.Context`'s for the Triton family's dK/dV
kernel (``bwd_dkdv``: the transposed score tile, key rows down and query rows across),
written in Gluon by :func:`.user.gluon`.  Kept apart from :mod:`.user`, whose source is
part of the forward's user code id (:func:`.render.user_code_id`).

A score function f runs in every step on s = softmax_scale * (K Q^T) (natural units):
P^T = exp2(f(s) * log2(e) - LSE2), and dS^T = P^T (dP^T - delta) f'(s), with f' the
derivative :mod:`flashgen.user_mods` traced (:attr:`flashgen.user_render.Lowered.dscore`);
the products that follow scale dQ and dK by softmax_scale as without one, so each is the
gradient through s = softmax_scale * q.k.  Its captured tensors are read as the forward
reads them.  A captured tensor that takes a gradient gets it from each step's
P^T (dP^T - delta) (the gradient through f's value) as the Triton family's dQ kernel
adds it (:meth:`flashgen.user_render.Context.after_ds`, with
:class:`flashgen.user_grads.ReducedContext`'s per-tile sums where the gathered extent is
small), on the transposed tile: float32 atomics into the buffers the caller zeroed.  A
captured tensor read at an index computed from the score is not built here
(:func:`unsupported`).
"""

from __future__ import annotations

import textwrap

import dataclasses
import re

from ... import user_grads, user_render
from ...errors import UnsupportedError
from .user import _CONST_MASK, gluon


_BROADCAST = re.compile(r"gl\.broadcast_to\((\w+), \(BLOCK_M, BLOCK_N\)\)")
_VALUE_LOOP = re.compile(r"( *)for u_v in gl\.static_range\(\d+\):$")
_VALUE_TEST = re.compile(r" *if \(u_rlo(\d+) <= u_v\) & \(u_v <= u_rhi\1\):$")


def _value_loops(code: str) -> str:
    """:class:`flashgen.user_grads.ReducedContext`'s loops over a gradient's index values
    (every value of the extent unrolled, each behind a test of [lo, hi]) as loops over
    [lo, hi] alone: one iteration's registers live, not the unrolled extent's."""
    lines, out, i = code.split("\n"), [], 0
    while i < len(lines):
        loop = _VALUE_LOOP.match(lines[i])
        test = _VALUE_TEST.match(lines[i + 1]) if loop and i + 1 < len(lines) else None
        if test is None:
            out.append(lines[i])
            i += 1
            continue
        ind, n = loop.group(1), test.group(1)
        out.append(f"{ind}for u_v in range(u_rlo{n}, u_rhi{n} + 1):")
        inner = len(lines[i + 1]) - len(lines[i + 1].lstrip())
        i += 2
        while i < len(lines) and len(lines[i]) - len(lines[i].lstrip()) > inner:
            out.append(lines[i][4:])
            i += 1
    return "\n".join(out)


def unsupported(low) -> str | None:
    """Why the Gluon backward cannot compile lowering ``low``
    (:class:`flashgen.user_render.Lowered`, direction "bwd"), or None: sinks (whose
    gradient needs nothing of the kernel reach it without their flag), a read at an
    index computed from the score, or no score or mask function at all."""
    if low.sinks:
        return "sinks: their gradient comes from LSE and delta, the backward's lowering carries none"
    if low.score is None and low.mask is None:
        return "no score or mask function"
    if low.sized_bufs:
        return "a captured tensor read at an index computed from the score (its bounds check is not built)"
    return None


def bwd_template_vars(mods: str, indent: str = "            ", step_indent: str = "        ") -> dict:
    """The Jinja variables of ``templates/gluon/attn_bwd.py.j2`` for user functions
    ``mods`` ("" for none: every variable empty, so a plain variant renders as before).
    A band tightens diag_lo / diag_hi (``USER_BOUNDS``); a score function's code
    (``USER_SCORE_BLOCK``: ``u_s`` from the raw S^T tile to base 2, ``u_g`` its derivative
    where it is not 1) runs in every step, its per-(batch, head) values (``USER_SETUP``)
    computed there for the step's query head ``u_h``; any other mask function's
    predicate ``u_keep`` is evaluated in the masked tiles of S^T, on the key rows
    ``u_cols`` (down) and the query rows ``u_rows`` (across) (its per-(batch, head)
    values there too when there is no score function); its block mask gives each key
    block's query rows [first visited, interior start, interior end, end).  ``indent``:
    the masked branch's indentation in the consumer's step; ``step_indent``: the step's.
    Raises UnsupportedError for what :func:`unsupported` names."""
    empty = dict(USER=False, USER_NAME="", USER_MASK=False, USER_SCORE=False, USER_DSCORE=False,
                 USER_DS_GUARD=False, USER_SIGMOID=False, USER_BOUNDS="", USER_MASK_BLOCK="", USER_SETUP="",
                 USER_SCORE_BLOCK="", USER_GRADS="", U_KP="", U_ARGS="")
    if not mods:
        return empty
    low = user_render.lowered(mods)
    why = unsupported(low)
    if why is not None:
        raise UnsupportedError(f"user functions {mods}: not built in the Gluon backward: {why} (the Triton "
                               "family's backward)")
    # with captured tensors' gradients, the dQ kernel's code (the gradients' loads keep
    # their offsets, their derivatives are computed; its kernel parameters add the
    # gradient buffers), else the dK/dV kernel's: both on the transposed tile here
    kernel = "bwd_dq" if low.grads else "bwd_dkdv"
    ctx = (user_grads.ReducedContext if isinstance(low, user_grads.Reduced) else user_render.Context)(low, kernel)
    out = dict(empty, USER=True, USER_NAME=mods, USER_BOUNDS=gluon(ctx.bounds()).rstrip("\n"))
    score = low.score is not None
    if not (ctx.mask or score):
        return out
    # a constant predicate (a mask function that keeps nothing) as a full tile of S^T
    block = _CONST_MASK.sub(r"gl.full([PB, BLOCK_M], \1, gl.int1, ST_LAYOUT)",
                            ctx.score_block("u_s", "u_rows", "u_cols", True))
    lines = gluon(block).rstrip("\n").splitlines()
    cut = next((i for i, ln in enumerate(lines) if ln.strip() == "if MASKED:"), len(lines))
    params = ctx.kernel_params(False).rstrip(", ")
    kp = ", " + params if params else ""
    setup = gluon(ctx.setup("u_z", "u_h", step_indent if score else indent)).rstrip("\n")
    out.update(U_KP=kp, U_ARGS=kp, USER_SETUP=setup)
    if score:
        # the score function's lines (before the mask function's "if MASKED:"), at the step's level
        out.update(USER_SCORE=True, USER_DSCORE=user_render._nonunit(low.dscore),
                   USER_DS_GUARD=user_render._nonunit(low.dscore) and user_render.may_be_infinite(low.score,
                                                                                                 low.dscore),
                   USER_SCORE_BLOCK=textwrap.indent(textwrap.dedent("\n".join(lines[:cut])), step_indent))
    if low.grads:
        # the gradients alone (f'(s) is the template's): the code with a unit derivative,
        # on u_gds = P^T (dP^T - delta) before f'(s), over the tile (PB, BLOCK_M), written
        # after the step's dQ and dK products are issued
        unit = type(ctx)(dataclasses.replace(low, dscore=1), kernel)
        code = gluon(unit.after_ds("u_gds", "u_rows", "u_cols", True))
        # (Gluon has no broadcast_to: a full tile of zeros in S^T's layout broadcasts)
        code = _BROADCAST.sub(r"(\1 + gl.zeros([PB, BLOCK_M], gl.int64, ST_LAYOUT))", code)
        # the per-tile sums over the index values present: a loop over [lo, hi] rather than
        # every value of the extent unrolled, each with a test (fewer registers live)
        code = _value_loops(code)
        out["USER_GRADS"] = textwrap.indent(textwrap.dedent(code), step_indent).rstrip("\n")
    if ctx.mask:
        # the consumer evaluates the predicate in its masked branch: the block without its
        # own "if MASKED:" (without a score function the lines before it are comments)
        head = "" if score else textwrap.dedent("\n".join(lines[:cut])) + "\n"
        body = head + textwrap.dedent("\n".join(lines[cut + 1:]))
        out.update(USER_MASK=True, USER_MASK_BLOCK=textwrap.indent(body, indent),
                   U_ARGS=kp + ", m_full_lo, m_full_hi")
    out["USER_SIGMOID"] = "_sigmoid(" in out["USER_SCORE_BLOCK"] + out["USER_MASK_BLOCK"]
    return out

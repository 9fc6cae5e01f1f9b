"""Captured tensors' gradients reduced inside the tile: the bwd_dq code of a score
function that reads a small captured tensor at an index depending on both the query row
and the key column (T5's ``table[bucket(kv_idx - q_idx), h]``).  Pure: no torch, no
triton.

:mod:`flashgen.user_render` adds such a gradient with one float32 atomic per score
element (``tl.atomic_add`` of the (BLOCK_M, BLOCK_N) tile at its offsets); with a
(32, heads) table that is 2^29 atomics onto 512 addresses at batch 8, 16 heads,
seqlen 2048, contended in L2.  When the tensor's dimension at that index (the gathered
dimension) has at most :data:`MAX_EXTENT` entries, known when the function is lowered
(the captured tensor's shape), and the other index components do not depend on the
tile's rows or columns (batch, head, constants), each tile instead

* takes the range [lo, hi] of the index values its in-range elements carry (two tile
  reductions), and
* for each value v of ``tl.static_range(extent)`` inside that range, sums
  ``where(index == v, dS * d out / d load, 0)`` over the tile and adds it with one
  scalar atomic at ``v``'s offset:

an extent of compares per element at most (the values outside the tile's range skip
their block), and at most ``extent`` atomics per tile.  Index values outside [0,
extent) (torch raises on them) contribute nothing.  Larger extents keep the
per-element atomics.  docs/design.md gives the operation counts and the predicted time.

Kept apart from :mod:`flashgen.user_render` on purpose: a user variant's name hashes
that module's bytes (:func:`flashgen.user_render.machinery_hash`), so an edit there
would rename every user variant and drop every tuned user row.  A lowering with a
reduced gradient is a :class:`Reduced` (its name also hashes this module and the
reduced gradients' extents); every other lowering, its name and its rendered source
stay as they were.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from pathlib import Path

from . import user_render
from .user_render import Context, Lowered, Ref, _Code, tile_axes

#: The largest gathered extent whose gradient is reduced inside the tile (compares per
#: element grow with it; above it the per-element atomics are kept).
MAX_EXTENT = 64


@dataclasses.dataclass(frozen=True)
class Reduction:
    """The gradient of load node ``load`` (buffer ``buf``) reduced per tile: ``dim`` the
    index component that depends on the tile's rows and columns, ``extent`` the captured
    tensor's size along it."""

    load: int
    buf: int
    dim: int
    extent: int


def reduction(low_score, load: int, buf: int, shape: tuple) -> Reduction | None:
    """The :class:`Reduction` of the gradient of ``load`` (a load node of the score graph
    ``low_score`` reading buffer ``buf``, a captured tensor of ``shape``), or None when
    the per-element atomics stay: the index depends on the rows and columns (or on the
    score, a per-element value too: :func:`flashgen.user_render.tile_axes`) through
    exactly one integer component, the others on neither, and that component's extent is
    at most :data:`MAX_EXTENT`."""
    n = low_score.nodes[load]
    index = n.args[1:]
    tile = [d for d, a in enumerate(index) if tile_axes(low_score.deps(a))]
    if len(tile) != 1:
        return None
    d = tile[0]
    if tile_axes(low_score.deps(index[d])) != {"q", "k"} or low_score.dtype(index[d]) == "float":
        return None
    if not 0 < shape[d] <= MAX_EXTENT:
        return None
    return Reduction(load, buf, d, int(shape[d]))


@functools.lru_cache(maxsize=None)
def module_hash() -> str:
    """sha256 (16 hex digits) of this module: part of a :class:`Reduced` lowering's name."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True, eq=False)
class Reduced(Lowered):
    """A backward lowering whose gradients ``reductions`` (:class:`Reduction`) bwd_dq
    reduces inside the tile; the others keep the per-element atomics."""

    reductions: tuple = ()

    def describe(self) -> str:
        red = ", ".join(f"load %{r.load} buffer {r.buf} dim {r.dim} extent {r.extent}" for r in self.reductions)
        return super().describe() + f"\nreduced in the tile ({module_hash()}): {red}"

    def reduced(self, load: int) -> Reduction | None:
        return next((r for r in self.reductions if r.load == load), None)


class ReducedContext(Context):
    """:class:`flashgen.user_render.Context` whose bwd_dq adds the :class:`Reduced`
    lowering's reduced gradients per index value and tile."""

    def after_ds(self, var: str, qi: str, kj: str, t: bool) -> str:
        low = self.low
        if self.kernel != "bwd_dq" or low.score is None or not low.reductions:
            return super().after_ds(var, qi, kj, t)
        names, valid = self._names(qi, kj, t, var)
        code = _Code(low.score, names, "u", low.bufs, valid)
        lines = [f"u_gv = {valid['q']} & {valid['k']}"]
        for r in low.reductions:
            i, buf, e = r.load, r.buf, r.extent
            index = low.score.nodes[i].args[1:]
            rest = [f"{code.i(a)}.to(tl.int64) * ut{buf}_s{d}" if isinstance(a, Ref) else f"{int(a)} * ut{buf}_s{d}"
                    for d, a in enumerate(index) if d != r.dim]
            ix = code.i(index[r.dim])
            # an index computed from the score: its other dims are checked in the tile too
            ok = f" & u_ok{i}" if "s" in low.score.nodes[i].deps else ""
            lines += [
                f"# gradient of captured tensor {buf}: summed over the tile per index value (extent {e}), "
                "one atomic per value present",
                f"u_rv{i} = tl.where(u_gv, {var} * u_d{i}, 0.0)",
                f"u_ri{i} = tl.where((u_rv{i} != 0.0) & ({ix} >= 0) & ({ix} < {e}){ok}, {ix}, -1).to(tl.int32)",
                f"u_rlo{i} = tl.min(tl.min(tl.where(u_ri{i} >= 0, u_ri{i}, {e}), 1), 0)",
                f"u_rhi{i} = tl.max(tl.max(u_ri{i}, 1), 0)",
                f"u_rp{i} = UG{buf}" + "".join(f" + {x}" for x in rest),
                f"for u_v in tl.static_range({e}):",
                f"    if (u_rlo{i} <= u_v) & (u_v <= u_rhi{i}):",
                f"        tl.atomic_add(u_rp{i} + u_v * ut{buf}_s{r.dim}, "
                f"tl.sum(tl.sum(tl.where(u_ri{i} == u_v, u_rv{i}, 0.0), 1), 0), sem=\"relaxed\")",
            ]
        # the other gradients (per-element atomics) and the score's derivative, as before
        done = {r.load for r in low.reductions}
        rest_low = Lowered(**{f.name: getattr(low, f.name) for f in dataclasses.fields(Lowered)
                              if f.name != "grads"}, grads=tuple(g for g in low.grads if g[0] not in done))
        tail = Context(rest_low, self.kernel).after_ds(var, qi, kj, t)
        return "\n".join("    " + x for x in lines) + ("\n" + tail if tail else "")


def render_args(spec) -> dict:
    """:func:`flashgen.user_render.render_args`, with :class:`ReducedContext` for a
    :class:`Reduced` lowering."""
    args = user_render.render_args(spec)
    if isinstance(args["user"].low, Reduced):
        args["user"] = ReducedContext(args["user"].low, spec.kernel)
    return args


def smem_buffers(low: Lowered, kernel: str, block_m: int, block_n: int, num_stages: int) -> dict[str, int]:
    """:func:`flashgen.user_render.smem_buffers`, less the pointer-conversion scratch of
    the gradients a :class:`Reduced` lowering reduces in the tile (no tile of pointers
    goes to atomics; the reductions' scratch is within the kernel's own)."""
    out = user_render.smem_buffers(low, kernel, block_m, block_n, num_stages)
    if kernel != "bwd_dq" or not isinstance(low, Reduced) or "user_grad_cvt" not in out:
        return out
    out["user_grad_cvt"] -= block_m * block_n * 8 * len(low.reductions)
    if out["user_grad_cvt"] <= 0:
        del out["user_grad_cvt"]
    return out

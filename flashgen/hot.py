"""Recipes: an eager attention call of known sizes replayed from its launch plans alone.

A plain eager call through autograd (:class:`flashgen.library.EagerAttention`) passes
through the op's layers before a kernel runs: ``library.forward`` / ``backward`` (the
kernel choice, the device guard, the score sign), the family's launcher (argument
checks, its plan key over every tensor) and only then the launch plan
(:mod:`flashgen.plans`).  On the H200's host those layers cost more than the plans'
launches themselves, and the backward pays them in autograd's device thread, where
Python runs slower (``benchmarks/host_trace.py``).

A :class:`Recipe` is what one such call did, read from :class:`flashgen.plans.capture`:
the plans it replayed or recorded, in order, with each plan's input tensors named by
where they came from (the call's own tensors, the O buffer the forward allocates with
:func:`flashgen.library.out_like`, or a buffer of an earlier plan) and the call's
results named the same way.  A call is turned into a recipe only when all of it is in
its plans: no launch without a plan, no work a launcher did beside its plan
(:func:`flashgen.plans.taint`), every tensor accounted for.  Otherwise the call's key
keeps None and takes the layers every time.  A call without autograd replays the same
forward recipes (``flashgen.api``'s fast path, where :meth:`Calls.ready`).

:class:`Calls` holds the recipes of one entry of the API's fast table (fixed sizes,
strides, dtypes, devices and mask, with 16-byte aligned q, k, v): the forward's per
(softmax_scale, which of q, k, v are one tensor), the backward's per (deterministic,
softmax_scale, the shapes, strides and dtypes of dO and of the saved q, k, v, O and
LSE, which tensors are one; only with every one 16-byte aligned).  A recipe runs only
where its plans would: plans usable (:func:`flashgen.plans.usable`: no launch hook, no
switch off), a positive scale, and the inputs' device current; and not with
``FLASHGEN_RECIPES=0`` (:data:`ENABLED`).  None is recorded during a CUDA graph
capture (the dispatcher may then answer a default it does not keep).
"""

from __future__ import annotations

import os

from . import dispatch, fastlaunch, library, plans

#: Recipes kept per direction of one fast-table entry; then the table is emptied.
RECIPES_MAX = 16
#: Whether calls replay their recipes (``FLASHGEN_RECIPES=0`` at import: never; the
#: layers run every call, still with their launch plans).
ENABLED = os.environ.get("FLASHGEN_RECIPES", "1") != "0"


class Recipe:
    """Replays the plans of one recorded call (module docstring).

    Every tensor the replay handles has a place in one list: 0 holds None, 1 the
    forward's O (allocated again with :func:`flashgen.library.out_like`, like q, with
    ``out_dim`` columns; ``out_dim`` 0: none), 2 on the call's own tensors, then each
    plan's buffers as it returns them.  ``stages``: ((plan, places of its input tensors,
    names of its buffers to append), ...); ``results``: places of what the call
    returns."""

    __slots__ = ("stages", "results", "out_dim")

    def __init__(self, stages, results, out_dim):
        self.stages, self.results, self.out_dim = stages, results, out_dim

    def run(self, sources: tuple) -> tuple:
        vals = [None, library.out_like(sources[0], self.out_dim) if self.out_dim else None, *sources]
        append = vals.append
        for plan, places, names in self.stages:
            bufs = plan.run(tuple([vals[i] for i in places]))
            for name in names:
                append(bufs[name])
        return tuple([vals[i] for i in self.results])


def build(cap: "plans.capture", sources: tuple, results: tuple, out=None) -> "Recipe | None":
    """The recipe of a captured call (``sources``: the call's tensors, in the order
    :meth:`Recipe.run` takes them; ``out``: the O buffer the call allocated, if any;
    ``results``: what it returned), or None when the call is not all in its plans."""
    if not cap.ok or not cap.stages:
        return None
    where = {}
    if out is not None:
        where[id(out)] = 1
    for i, t in enumerate(sources):
        if t is not None:
            where.setdefault(id(t), 2 + i)
    size = 2 + len(sources)

    def place(t):
        return 0 if t is None else where.get(id(t))

    stages = []
    for inputs, plan, bufs in cap.stages:
        places = tuple(place(t) for t in inputs)
        if plan is None or None in places:
            return None
        names = tuple(bufs)
        for name in names:
            where[id(bufs[name])] = size
            size += 1
        stages.append((plan, places, names))
    res = tuple(place(t) for t in results)
    if None in res:
        return None
    return Recipe(tuple(stages), res, out.shape[3] if out is not None else 0)


class Calls:
    """The recipes of one fast-table entry (module docstring).  ``device``: the inputs'
    CUDA device index, -1 for the CPU."""

    __slots__ = ("device", "fwd", "bwd")

    def __init__(self, device: int):
        self.device = device
        self.fwd: dict = {}
        self.bwd: dict = {}

    def ready(self, scale) -> bool:
        """Whether recipes may run for a call of this scale now (module docstring)."""
        return (ENABLED and type(scale) in (float, int) and scale > 0 and plans.usable()
                and (self.device < 0 or fastlaunch._current_device() == self.device))

    def forward(self, q, k, v, scale, mask, lo, hi):
        """(O, LSE) of :func:`flashgen.library.forward` (no score mods)."""
        if not self.ready(scale):
            return library.forward(q, k, v, scale, mask, lo, hi)
        key = (scale, q is k, q is v, k is v)
        recipe = self.fwd.get(key, self)
        if recipe is not self and recipe is not None:
            return recipe.run((q, k, v))
        if recipe is None or dispatch.graph_capturing():
            # during a capture the dispatcher may answer a capture-safe default it does
            # not keep: no recipe from it
            return library.forward(q, k, v, scale, mask, lo, hi)
        out = library.out_like(q, v.shape[3])  # the O buffer the call writes: a source of its plan
        with plans.capture() as cap:
            o, lse = library.forward(q, k, v, scale, mask, lo, hi, out=out)
        if len(self.fwd) >= RECIPES_MAX:
            self.fwd.clear()
        self.fwd[key] = build(cap, (q, k, v), (o, lse), out)
        return o, lse

    def backward(self, do, q, k, v, o, lse, scale, mask, lo, hi, deterministic):
        """(dQ, dK, dV) of :func:`flashgen.library.backward` (no score mods, no delta)."""
        if not self.ready(scale):
            return library.backward(do, q, k, v, o, lse, scale, mask, lo, hi, deterministic=deterministic)
        # the saved tensors too: a saved-tensor hook (activation offloading) may hand the
        # backward copies in another layout than the forward's
        key = (library.deterministic_backward(deterministic), scale,
               (do.data_ptr() | q.data_ptr() | k.data_ptr() | v.data_ptr() | o.data_ptr() | lse.data_ptr()) & 15,
               do.shape, do.stride(), do.dtype, q.shape, q.stride(), q.dtype, k.shape, k.stride(), k.dtype,
               v.shape, v.stride(), v.dtype, o.shape, o.stride(), o.dtype, lse.shape, lse.stride(), lse.dtype,
               q.get_device(), q is k, q is v, k is v, do is q, do is k, do is v, do is o)
        recipe = self.bwd.get(key, self) if key[2] == 0 else None
        if recipe is not self and recipe is not None:
            return recipe.run((do, q, k, v, o, lse))
        if recipe is None or dispatch.graph_capturing():
            return library.backward(do, q, k, v, o, lse, scale, mask, lo, hi, deterministic=deterministic)
        with plans.capture() as cap:
            grads = library.backward(do, q, k, v, o, lse, scale, mask, lo, hi, deterministic=deterministic)
        if len(self.bwd) >= RECIPES_MAX:
            self.bwd.clear()
        self.bwd[key] = build(cap, (do, q, k, v, o, lse), grads)
        return grads

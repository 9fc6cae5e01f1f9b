"""Launch plans: a repeated call of the same sizes and layouts replays its launches.

A launcher whose per-call host work is mostly argument building (allocations, tensor
descriptors, shape arithmetic, Triton's specialization signature) records, on the first
call of a *plan key*, what it allocated and what it launched; later calls with the same
key allocate the same buffers, rebuild the argument tuples with the new tensors in the
recorded places and call each kept ``CompiledKernel``'s launcher directly.

The key is the caller's, and it must determine everything the recorded launches
depend on besides the tensors' data: sizes, strides, dtypes, the low four bits of
every input's address (Triton specializes pointers on 16-byte alignment), which inputs
are the same tensor, scalar arguments, the config and module, and the devices
(:func:`key_of` builds it).  Buffers the plan allocates come from torch's
caching allocator, whose blocks are 512-byte aligned, so they never lose an alignment
the recorded kernels were specialized on.

A recording is refused (the caller keeps its normal path) when a launch argument is a
tensor that is neither an input, a declared buffer, a declared view of one at its own
address nor a declared kept tensor (the plan could not supply it),
when a launch went through Triton's own path (``fastlaunch`` returned no kept kernel),
or when a launch hook is installed.  Plans are off with ``FLASHGEN_LAUNCH_PLANS=0``, and
with ``FLASHGEN_FAST_LAUNCH=0`` and under Triton's interpreter as the direct launch is
(:func:`flashgen.fastlaunch.enabled`).
"""

from __future__ import annotations

import os
import threading

import torch

from . import fastlaunch

#: Plans kept per launcher; a new key then replaces the oldest (see :func:`remember`).
PLAN_MAX = 512


class Recorder:
    """Collects ``(kernel, grid, args)`` of each launch of one call (see
    :func:`flashgen.fastlaunch.launch`'s return value)."""

    __slots__ = ("launches", "ok")

    def __init__(self):
        self.launches: list = []
        self.ok = True

    def add(self, kernel, grid, args) -> None:
        if kernel is None or not hasattr(kernel, "packed_metadata") or not hasattr(kernel, "run"):
            self.ok = False
        self.launches.append((kernel, tuple(grid), tuple(args)))


class Plan:
    """The replay of one recorded call: ``run(inputs)`` returns the buffers (a dict by
    name, as declared) after launching every recorded kernel on the current stream."""

    __slots__ = ("buffers", "stages")

    def __init__(self, buffers, stages):
        # (name, shape, stride, dtype, device, zero)
        self.buffers = buffers
        # (kernel, gx, gy, gz, constant arguments with None in the places of tensors and
        # descriptors, ((place, slot), ...) of tensors, ((place, slot, class, other
        # fields), ...) of descriptors); slots: the inputs, then the buffers
        self.stages = stages

    def run(self, inputs: tuple) -> dict:
        bufs = {}
        slots = list(inputs)
        for name, shape, stride, dtype, device, zero in self.buffers:
            t = torch.empty_strided(shape, stride, dtype=dtype, device=device)
            if zero:
                t.zero_()
            bufs[name] = t
            slots.append(t)
        dev, stream = fastlaunch._device_and_stream()
        fastlaunch.ensure_context(dev)
        new = object.__new__
        for kernel, gx, gy, gz, template, tensors, descs in self.stages:
            args = list(template)
            for pos, slot in tensors:
                args[pos] = slots[slot]
            if kernel is None:  # a direct stage (_direct_stage): gx is the raw launcher, descs its tensor maps
                args[3] = stream
                for pos, slot, fill, fill_args, cache in descs:
                    ptr = slots[slot].data_ptr()
                    tmap = cache.get(ptr)
                    if tmap is None:
                        tmap = fill(ptr, *fill_args)
                        if len(cache) >= TMAP_CACHE_MAX:
                            cache.clear()
                        cache[ptr] = tmap
                    args[pos] = tmap
                gx(*args)
                continue
            for pos, slot, cls, fields in descs:
                d = new(cls)
                dd = d.__dict__
                dd.update(fields)
                dd["base"] = slots[slot]
                args[pos] = d
            kernel.run(gx, gy, gz, stream, kernel.function, kernel.packed_metadata, None, None, None, *args)
        return bufs


def _is_desc(a) -> bool:
    return hasattr(a, "block_shape") and hasattr(a, "base") and hasattr(a, "strides")


def build(rec: Recorder, inputs: tuple, buffers: dict, zeroed: tuple = (), views: tuple = (),
          kept: tuple = ()) -> Plan | None:
    """The plan of a recorded call, or None when it cannot be replayed (module
    docstring).  ``inputs``: the tensors the caller passes again on every call (in this
    order to :meth:`Plan.run`); ``buffers``: name -> tensor the call allocated, each to be
    allocated again with its shape and strides (``zeroed`` names those that must start
    at zero).  ``views``: (view, tensor) pairs, a launch argument that views an input or
    a buffer at its own address (a transpose), replayed as that tensor (a kernel
    argument is its address; the key fixes the view's strides); ``kept``: tensors the
    plan holds and passes as they are on every replay (never written after the
    recording)."""
    if not rec.ok or not rec.launches:
        return None
    slot_of = {}
    for i, t in enumerate(inputs):
        if t is not None:
            slot_of.setdefault(id(t), i)
    specs = []
    for j, (name, t) in enumerate(buffers.items()):
        slot_of.setdefault(id(t), len(inputs) + j)
        specs.append((name, tuple(t.shape), tuple(t.stride()), t.dtype, t.device, name in zeroed))
    for view, t in views:
        slot = slot_of.get(id(t))
        if slot is None or view.data_ptr() != t.data_ptr() or view.dtype != t.dtype:
            return None
        slot_of.setdefault(id(view), slot)
    held = {id(t) for t in kept}
    stages = []
    for kernel, grid, args in rec.launches:
        template, tensors, descs = [], [], []
        for pos, a in enumerate(args):
            template.append(None)
            if isinstance(a, torch.Tensor):
                slot = slot_of.get(id(a))
                if slot is None and id(a) in held:
                    template[pos] = a
                    continue
                if slot is None:
                    return None
                tensors.append((pos, slot))
            elif _is_desc(a):
                slot = slot_of.get(id(a.base))
                fields = getattr(a, "__dict__", None)
                if slot is None or fields is None or "base" not in fields:
                    return None
                descs.append((pos, slot, type(a), {k: v for k, v in fields.items() if k != "base"}))
            else:
                template[pos] = a
        g = tuple(grid) + (1, 1)
        stage = _direct_stage(kernel, g[:3], args, template, tensors, descs) if DIRECT else None
        stages.append(stage or (kernel, g[0], g[1], g[2], tuple(template), tuple(tensors), tuple(descs)))
    return Plan(tuple(specs), tuple(stages))


#: Whether :func:`build` makes direct stages (:func:`_direct_stage`) where it can.
DIRECT = os.environ.get("FLASHGEN_DIRECT_STAGES", "1") != "0"
#: Tensor maps kept per descriptor argument of a direct stage, by base address.
TMAP_CACHE_MAX = 64


def _direct_stage(kernel, grid, args, template, tensors, descs):
    """A stage that calls the kept kernel's raw launcher itself, or None where this
    Triton's launcher is not the one this was written against (the stage then goes
    through ``kernel.run``).

    Triton 3.6's ``CudaLauncher.__call__`` allocates the scratch buffers (none for these
    kernels) and calls a Python wrapper that, for every tensor-descriptor argument,
    encodes a CUDA tensor map (``make_tensordesc_arg``: ``cuTensorMapEncodeTiled``
    through ``fill_tma_descriptor``) before the C launcher.  Within one plan a
    descriptor's shape, strides, block and swizzle are fixed (the key holds them), so
    its tensor map depends on the base address alone: a direct stage encodes it once per
    address (``TMAP_CACHE_MAX`` kept per argument) and passes the launcher the arguments
    the wrapper would pass.  What the wrapper passes is taken from the wrapper's own
    code at recording: each descriptor is expanded by Triton's ``make_tensordesc_arg``
    with its encoder watched, so the tensor map's arguments are the ones Triton gave.
    The stage tuple: (None, raw launcher, None, None, arguments with None in the
    places of the tensors and the tensor maps and of the stream at 3, tensor places,
    ((place, slot, encoder, encoder arguments after the address, cache), ...))."""
    import sys

    run = getattr(kernel, "run", None)
    cls = type(run)
    drv = sys.modules.get(cls.__module__)
    if (cls.__name__ != "CudaLauncher" or drv is None or getattr(drv, "_BASE_ARGS_FORMAT_LEN", None) != 13
            or getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1)
            or not hasattr(run, "launch_cooperative_grid") or not hasattr(run, "launch_pdl")):
        return None
    wrapped = run.launch
    code = getattr(wrapped, "__code__", None)
    if code is None:  # no descriptor argument: the launcher is the C function itself
        raw, indices, metas = wrapped, set(), []
    else:
        cells = dict(zip(code.co_freevars, (c.cell_contents for c in (wrapped.__closure__ or ()))))
        if set(cells) != {"launcher", "tensordesc_indices", "tensordesc_meta"} \
                or wrapped.__globals__.get("make_tensordesc_arg") is not getattr(drv, "make_tensordesc_arg", None):
            return None
        raw, indices, metas = cells["launcher"], cells["tensordesc_indices"], cells["tensordesc_meta"]
    if len(indices) != len(descs) or (indices and sorted(indices) != [pos for pos, *_ in descs]):
        return None
    slot_at = dict(tensors)
    slot_of_desc = {pos: slot for pos, slot, _, _ in descs}
    # the 13 base arguments (grid, stream, function, cooperative, PDL, the two scratch
    # buffers, packed metadata, launch metadata, the two hooks); the stream per call
    out = [grid[0], grid[1], grid[2], None, kernel.function, run.launch_cooperative_grid, run.launch_pdl,
           None, None, kernel.packed_metadata, None, None, None]
    places, maps = [], []
    meta_i = 0
    for pos, a in enumerate(args):
        if pos not in indices:
            if pos in slot_at:
                places.append((len(out), slot_at[pos]))
            out.append(template[pos])
            continue
        parts = _expand(drv, a, metas[meta_i])
        meta_i += 1
        if parts is None:
            return None
        for part in parts:
            if part is a.base:
                places.append((len(out), slot_of_desc[pos]))
                out.append(None)
            elif type(part) is _Map:
                maps.append((len(out), slot_of_desc[pos], part.encoder, part.args, {}))
                out.append(None)
            else:
                out.append(part)
    return (None, raw, None, None, tuple(out), tuple(places), tuple(maps))


class _Map:
    """A tensor map in a descriptor's expansion: its encoder and the encoder's arguments
    after the base address."""

    __slots__ = ("encoder", "args")

    def __init__(self, encoder, args: tuple):
        self.encoder, self.args = encoder, args


_EXPAND_LOCK = threading.Lock()


def _expand(drv, desc, meta):
    """The arguments Triton's ``make_tensordesc_arg`` gives for ``desc``, with each
    tensor map it encodes replaced by a :class:`_Map`; None when an encoding did not take ``desc``'s base address first, or the
    encoder is not where this reads it."""
    import triton

    utils = triton.runtime.driver.active.utils
    me = threading.get_ident()
    with _EXPAND_LOCK:  # one watcher at a time, so the encoder put back is Triton's own
        real = getattr(utils, "fill_tma_descriptor", None)
        if real is None or getattr(real, "_flashgen_watch", False):
            return None
        seen = []

        def watch(*a):
            m = real(*a)
            if threading.get_ident() == me:  # another thread's launch meanwhile is not this one's
                seen.append((m, a))
            return m

        watch._flashgen_watch = True
        utils.fill_tma_descriptor = watch
        try:
            parts = list(drv.make_tensordesc_arg(desc, meta))
        finally:
            utils.fill_tma_descriptor = real
    ptr = desc.base.data_ptr()
    out = []
    for part in parts:
        hit = next((a for m, a in seen if m is part), None)
        if hit is not None:
            if hit[0] != ptr:
                return None
            out.append(_Map(real, tuple(hit[1:])))
        else:
            out.append(part)
    if len(seen) != sum(type(p) is _Map for p in out):
        return None
    return out


def usable() -> bool:
    """Whether plans may be recorded and replayed now: the direct launch is on
    (:func:`flashgen.fastlaunch.enabled`), ``FLASHGEN_LAUNCH_PLANS`` is not "0", and no
    launch hook (a profiler's) is installed."""
    if fastlaunch.off("FLASHGEN_LAUNCH_PLANS") or not fastlaunch.enabled():
        return False
    if not _KNOBS:
        from triton import knobs

        _KNOBS.append(knobs.runtime)
    rt = _KNOBS[0]
    return not (fastlaunch._hooked(rt.launch_enter_hook) or fastlaunch._hooked(rt.launch_exit_hook))


_KNOBS: list = []


def remember(table: dict, key, plan) -> None:
    """Keep ``plan`` under ``key`` (None is kept too: that key is not recorded again
    while it stays in the table); when the table holds :data:`PLAN_MAX` plans already,
    the oldest goes first (an evicted key records anew when it comes back).  A model
    calls every size once per layer, and a generation loop's seqlen_k grows by one per
    step: a table that stopped recording when full would leave every layer of every
    later step without a plan (after 512 tokens), while a size seen once costs only its
    recording, as every size does before the table fills."""
    while key not in table and len(table) >= PLAN_MAX:
        try:  # another thread may change the table meanwhile
            table.pop(next(iter(table)), None)
        except (RuntimeError, StopIteration):
            break
    table[key] = plan


def extend(inputs: tuple, args, *key_values) -> tuple[tuple, tuple]:
    """(``inputs`` and the tensors of ``args``, the key's further values: ``key_values``
    and the other values of ``args``): a launcher's extra arguments (sinks, a user
    variant's captured tensors, block mask and gradient buffers, with their strides and
    sizes) as a plan's further inputs and as values of its key."""
    return (inputs + tuple(a for a in args if isinstance(a, torch.Tensor)),
            (*key_values, tuple(a for a in args if not isinstance(a, torch.Tensor))))


def key_of(tensors, *scalars):
    """A plan key: ``scalars`` (config, module, mask, scale, bounds, ...); per tensor
    (None for an absent one) its shape, strides, dtype and the low four bits of its
    address; which tensors are the same object (a call that passes one tensor as both k
    and v is recorded apart from one that passes two); the device of the first and the
    current device (the one launches go to).  None (no plan) when a float scalar is NaN,
    which equals no key."""
    for s in scalars:
        if type(s) is float and s != s:
            return None
    ids = [id(t) if t is not None else -i for i, t in enumerate(tensors)]
    alias = None if len(set(ids)) == len(ids) else tuple(ids.index(i) for i in ids)
    return (*scalars, alias, tensors[0].get_device(), fastlaunch._current_device(),
            *[(t.shape, t.stride(), t.dtype, t.data_ptr() & 15) if t is not None else None for t in tensors])


def lookup(table: dict, key):
    """(key, plan): the plan kept under ``key``; (key, None) when none is kept yet (record
    this call); (None, None) when this call is not to be recorded: ``key`` is None, or
    the key was recorded and found not replayable."""
    if key is None:
        return None, None
    plan = table.get(key, table)
    if plan is table:
        return key, None
    return (key, plan) if plan is not None else (None, None)


class capture:
    """``with plans.capture() as cap:`` collects, in this thread, every plan a launcher
    replays or records during the block: ``cap.stages`` is a list of (the launcher's
    input tensors as given to :func:`replay`, the Plan or None when the call could not
    be recorded, the buffers by name that the call returned).  ``cap.ok`` turns False
    when a launcher did work its plan does not hold (:func:`taint`) or launched without
    a plan (:func:`replay` found plans unusable or the call keyless).  What
    :mod:`flashgen.hot` builds its recipes from."""

    __slots__ = ("stages", "ok", "prev")

    def __enter__(self):
        self.stages, self.ok = [], True
        self.prev = getattr(_CAPTURE, "cur", None)
        _CAPTURE.cur = self
        return self

    def __exit__(self, *exc):
        _CAPTURE.cur = self.prev


_CAPTURE = threading.local()


def _captured(inputs, plan, bufs) -> None:
    cur = getattr(_CAPTURE, "cur", None)
    if cur is not None:
        cur.stages.append((inputs, plan, bufs))


def taint() -> None:
    """A launcher did work outside its plan in this call (a copy, a fill): a capture
    around it must not replay the call from its plans alone."""
    cur = getattr(_CAPTURE, "cur", None)
    if cur is not None:
        cur.ok = False


def record(table: dict, key, rec: "Recorder", inputs: tuple, buffers: dict, zeroed: tuple = (),
           views: tuple = (), kept: tuple = ()) -> None:
    """Build the plan of a recorded call (:func:`build`) and keep it under ``key``
    (:func:`remember`)."""
    plan = build(rec, inputs, buffers, zeroed, views, kept)
    remember(table, key, plan)
    _captured(inputs, plan, buffers)


def replay(table: dict, tensors: tuple, *scalars):
    """(key, buffers) of one launcher call: the buffers (by name) of the plan kept for
    this call's key after replaying it, with that key; else (key, None), the key to
    record this call under (:func:`record_one`), None when the call is not to be
    recorded (:func:`usable`, :func:`lookup`).  ``tensors`` and ``scalars`` as
    :func:`key_of` takes them; the tensors are also the plan's inputs."""
    if not usable():
        taint()
        return None, None
    key, plan = lookup(table, key_of(tensors, *scalars))
    if plan is None:
        if key is None:
            taint()
        return key, None
    bufs = plan.run(tensors)
    _captured(tensors, plan, bufs)
    return key, bufs


def record_outputs(table: dict, key, rec: "Recorder", inputs: tuple, outputs: dict, views: tuple = (),
                   kept: tuple = ()) -> None:
    """Record the launches of ``rec`` under ``key`` (:func:`build`, :func:`remember`):
    ``inputs`` as given to :func:`replay`; ``outputs`` (name -> tensor or None) those the
    call made or returns, each a buffer to allocate again unless it is None or one of the
    inputs (an output the caller passed in); ``views``, ``kept`` as :func:`build` takes
    them."""
    given = {id(t) for t in inputs if t is not None}
    record(table, key, rec, inputs, {n: t for n, t in outputs.items() if t is not None and id(t) not in given},
           views=views, kept=kept)


def record_one(table: dict, key, kernel, grid, args, inputs: tuple, outputs: dict) -> None:
    """Record a call of one launch under ``key`` (:func:`record_outputs`)."""
    rec = Recorder()
    rec.add(kernel, grid, args)
    record_outputs(table, key, rec, inputs, outputs)

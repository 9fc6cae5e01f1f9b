"""Launching a compiled Triton or Gluon kernel without Triton's per-call binding.

``fn[grid](*args, **options)`` (Triton's ``JITFunction.run``) binds the arguments,
specializes every one of them (``native_specialize_impl``; for a Gluon tensor
descriptor this goes through Python: the layout's repr and constexpr comparisons),
hashes the specialization into a cache key, checks the kernel's global values, builds
the launch metadata and only then calls the compiled kernel's launcher.  For the
warp-specialized Gluon kernels that is most of the host time of a call.

:func:`launch` calls ``fn[grid]`` the first time it sees an argument *signature* and
keeps the ``CompiledKernel`` it returns; later calls with the same signature call that
kernel's launcher directly (``CompiledKernel.run``: grid, stream, function, packed
metadata, hooks, then every argument in the kernel's parameter order, constexprs
included, as ``JITFunction.run`` passes them).  The signature is at least as fine as
Triton's specialization, so a kept kernel is exactly the one Triton would pick:

* tensor: dtype, and whether ``data_ptr()`` is a multiple of 16;
* int: whether it is 0, 1, a multiple of 16, and its width (int32, int64, larger);
* tensor descriptor: its type, the base's dtype, block shape, layout and padding;
* a constexpr parameter, a bool, None or anything else: the value itself;
* float: the type only (Triton does not specialize floats);
* the device, and the launch options (num_warps, num_stages, maxnreg, ...).

Triton's own path is taken instead when: the call has fewer arguments than the kernel
has parameters (defaults), a launch hook is installed (``knobs.runtime.
launch_enter_hook`` or ``launch_exit_hook``: profilers such as proton see every launch), Triton's interpreter
runs the kernels, or ``FLASHGEN_FAST_LAUNCH=0`` is set.
"""

from __future__ import annotations

import os
import threading

_I32 = 1 << 31
_I64 = 1 << 63

#: (fn, device, options) -> {signature: CompiledKernel}
_KERNELS: dict = {}
#: fn -> tuple of bools: which parameters are constexpr
_CONSTEXPR: dict = {}


def _env_reader():
    """A function (name -> the variable's value, None when unset) that reads ``os.environ``
    as ``os.environ.get`` does, without encoding the name and decoding the value on
    every call: CPython's ``os.environ`` keeps the encoded variables in ``_data``, which
    its ``__setitem__`` and ``__delitem__`` (and so ``monkeypatch.setenv``) update.
    ``os.environ.get`` itself where that is not so."""
    env = os.environ
    data, enc = getattr(env, "_data", None), getattr(env, "encodekey", None)
    dec = getattr(env, "decodevalue", None)
    if not isinstance(data, dict) or enc is None or dec is None:
        return env.get
    keys: dict = {}

    def get(name):
        key = keys.get(name)
        if key is None:
            key = keys[name] = enc(name)
        value = data.get(key)
        return None if value is None else dec(value)

    return get


#: ``os.environ``'s value of a variable, None when unset (:func:`_env_reader`): the launch
#: paths read their switches on every call.
env = _env_reader()


def off(name: str) -> bool:
    """Whether the switch ``name`` (default on) is set to "0"."""
    return env(name) == "0"


def interpreting() -> bool:
    """Whether Triton's interpreter runs the kernels (``TRITON_INTERPRET`` set, not "0")."""
    return env("TRITON_INTERPRET") not in (None, "", "0")


def enabled() -> bool:
    """Whether :func:`launch` may bypass ``JITFunction.run`` (``FLASHGEN_FAST_LAUNCH``,
    default on; never under Triton's interpreter)."""
    return not off("FLASHGEN_FAST_LAUNCH") and not interpreting()


def _signature(args, constexpr) -> tuple:
    import torch

    out = []
    for a, is_const in zip(args, constexpr):
        t = type(a)
        if is_const:
            out.append(a)
        elif t is int:
            out.append((a == 0, a == 1, a % 16 == 0, 0 if -_I32 <= a < _I32 else 1 if -_I64 <= a < _I64 else 2))
        elif t is float:
            out.append(float)
        elif isinstance(a, torch.Tensor):
            out.append((a.dtype, a.data_ptr() % 16 == 0))
        elif hasattr(a, "block_shape") and hasattr(a, "base"):
            out.append((t, a.base.dtype, tuple(a.block_shape), getattr(a, "layout", None), a.padding))
        else:
            out.append((t, a))
    return tuple(out)


def _hooked(hook) -> bool:
    """Whether a launch hook is installed: Triton 3.6 keeps an always-present
    ``HookChain`` whose ``calls`` list is empty when none is; other versions use None."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return bool(calls) if isinstance(calls, list) else True


_THREAD = threading.local()
_LIBCUDA: list = []


def _libcuda():
    """The CUDA driver library through ctypes (None where it cannot be loaded)."""
    if not _LIBCUDA:
        import ctypes

        lib = None
        for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
            try:
                lib = ctypes.CDLL(name)
                break
            except OSError:
                continue
        _LIBCUDA.append(lib)
    return _LIBCUDA[0]


def ensure_context(dev: int) -> None:
    """Make device ``dev``'s primary CUDA context current in the calling thread when no
    context is (once per thread and device).

    A thread that has made no CUDA runtime call that creates a context has none current:
    torch's device guard skips ``cudaSetDevice`` when the device asked for is already
    the thread's current one (device 0 in a new thread), and its caching allocator makes
    no CUDA call when it has a free block.  Autograd runs backward nodes in such a
    thread, and a server may call attention from one.  Triton's launcher makes the
    primary context current itself, but only at the launch: building a tensor
    descriptor before it (``cuTensorMapEncodeTiled``) then fails with "invalid device
    context".  This does what the launcher does (``cuCtxGetCurrent``, else
    ``cuDevicePrimaryCtxRetain`` and ``cuCtxSetCurrent``), before the descriptors."""
    seen = getattr(_THREAD, "devices", None)
    if seen is None:
        seen = _THREAD.devices = set()
    elif dev in seen:
        return
    lib = _libcuda()
    if lib is not None:
        import ctypes

        ctx = ctypes.c_void_p()
        if lib.cuCtxGetCurrent(ctypes.byref(ctx)) == 0 and not ctx.value:
            handle = ctypes.c_int()
            if lib.cuDeviceGet(ctypes.byref(handle), int(dev)) == 0 \
                    and lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), handle) == 0:
                lib.cuCtxSetCurrent(ctx)
    seen.add(dev)


_DRIVER: list = []


def _driver():
    """Triton's active driver (the import kept: an import statement costs about a
    microsecond per call)."""
    if not _DRIVER:
        from triton.runtime.driver import driver

        _DRIVER.append(driver)
    return _DRIVER[0].active


def _current_device() -> int:
    """The current device index, as ``JITFunction.run`` takes it."""
    return _driver().get_current_device()


def _device_and_stream():
    """(current device index, its current raw CUDA stream), as ``JITFunction.run``
    takes them."""
    drv = _driver()
    dev = drv.get_current_device()
    return dev, drv.get_current_stream(dev)


def launch(fn, grid: tuple, args: tuple, **options):
    """Launch ``fn`` (a ``triton.jit`` or ``gluon.jit`` function) on ``grid`` with the
    positional ``args`` and Triton's launch ``options``, on the current device and
    stream.  Returns what ``fn[grid](*args, **options)`` returns (the CompiledKernel;
    None under the interpreter).  The first call of each signature (module docstring)
    compiles or loads through Triton; errors are Triton's."""
    from triton import knobs

    constexpr = _CONSTEXPR.get(fn)
    if constexpr is None:
        params = getattr(fn, "params", None)
        constexpr = tuple(p.is_constexpr for p in params) if params is not None else ()
        _CONSTEXPR[fn] = constexpr
    if interpreting():
        return fn[grid](*args, **options)
    dev, stream = _device_and_stream()
    ensure_context(dev)
    if (len(args) != len(constexpr) or _hooked(knobs.runtime.launch_enter_hook)
            or _hooked(knobs.runtime.launch_exit_hook) or not enabled()):
        return fn[grid](*args, **options)
    kernels = _KERNELS.setdefault((fn, dev, tuple(sorted(options.items()))), {})
    sig = _signature(args, constexpr)
    kernel = kernels.get(sig)
    if kernel is None:
        kernel = fn[grid](*args, **options)
        if kernel is not None and hasattr(kernel, "packed_metadata"):
            kernels[sig] = kernel
        return kernel
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    kernel.run(grid[0], g1, g2, stream, kernel.function, kernel.packed_metadata,
               None, None, None, *args)
    return kernel

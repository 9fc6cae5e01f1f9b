"""The one place flashgen imports Gluon (``triton.experimental.gluon``) from.

Gluon is experimental and renames its API between Triton releases.  The generated
kernels import every Gluon name they use from here, so a rename is handled in one
module.  Tested on Triton 3.6 and 3.9.  Names (Triton 3.6 -> 3.9):

  tma_load        tma.async_copy_global_to_shared -> tma.async_load (the old name
                  still exists in 3.9 but raises when traced; the new name is taken
                  wherever it exists)
  tma_store       tma.async_copy_shared_to_global -> tma.async_store (likewise)
  tma_reduce_add  the builder's ``create_async_tma_reduce`` (no Python wrapper in
                  3.6) -> tma.async_atomic_add
  store_wait      tma.store_wait (both)
  thread_barrier  gl.thread_barrier() -> gl.barrier() (both: one CTA-wide bar.sync)
  warpgroup_mma, warpgroup_mma_wait, warpgroup_mma_init, mbarrier, fence_async_shared
                  language.nvidia.hopper (both)
  TensorDescriptor  gluon.nvidia.hopper (both)
  shared_memory_descriptor._reinterpret (3.6) -> .reinterpret (3.9): the kernels
                  call ``._reinterpret(dtype, shape, layout)``; on a Triton without
                  it, :func:`_alias_reinterpret` adds that name for the public method
                  (same arguments, same operation: ``memdesc_reinterpret``)
  warp_specialize gl.warp_specialize([(fn, args), ...], worker_num_warps,
                  worker_num_regs) (both)

and the tools the sm_90 checks run (:func:`ptxas_sm90`, :func:`cuobjdump`): Triton
3.6 assembles sm_90 with its ``ptxas`` (CUDA 12.8); 3.9 emits PTX ISA 9.x and
assembles sm_90 with ``ptxas-blackwell`` (CUDA 13.x) and ``--regAllocOptLevel=2``.

Raises ImportError (from :func:`require`) naming what is missing when the installed
Triton has no Gluon or a warp_specialize of another form.
"""

from __future__ import annotations

import functools

import inspect

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language._core import builtin as _builtin
    from triton.experimental.gluon.language._core import shared_memory_descriptor as _smem_desc
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_init,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    store_wait = tma.store_wait
    thread_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
    if hasattr(tma, "async_atomic_add"):
        tma_reduce_add = tma.async_atomic_add
    else:
        from triton._C.libtriton import ir as _ir

        @_builtin
        def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
            """TMA reduce-add of shared-memory tile ``src`` into global memory at
            ``coord`` (Triton 3.6 has the builder op, no Python wrapper)."""
            coord = _semantic._convert_to_ir_values(coord, require_i64=False)
            _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                      src.handle)

    def _alias_reinterpret() -> None:
        if not hasattr(_smem_desc, "_reinterpret"):
            _smem_desc._reinterpret = _smem_desc.reinterpret

    _alias_reinterpret()
    _WS_PARAMS = tuple(inspect.signature(gl.warp_specialize).parameters)
    IMPORT_ERROR: str | None = None
    if _WS_PARAMS[:3] != ("functions_and_args", "worker_num_warps", "worker_num_regs"):
        IMPORT_ERROR = (f"gl.warp_specialize{_WS_PARAMS} is not the form the Gluon kernels use "
                        "(functions_and_args, worker_num_warps, worker_num_regs)")
except (ImportError, AttributeError) as e:  # pragma: no cover - depends on the installed Triton
    gluon = gl = TensorDescriptor = None
    IMPORT_ERROR = f"triton.experimental.gluon (Hopper) is not usable: {e}"


def available() -> bool:
    """Whether the installed Triton has the Gluon API the kernels are written against."""
    return IMPORT_ERROR is None


def require() -> None:
    """Raise ImportError with the reason when :func:`available` is False."""
    if IMPORT_ERROR is not None:
        raise ImportError(IMPORT_ERROR)


def nvmma_layout(block_shape, dtype_name: str):
    """The NVMMA shared layout Gluon picks by default for a TMA box of ``block_shape``
    with elements of ``dtype_name`` ("float16" / "bfloat16").  Memoized: the layout is
    a frozen value, and building it costs about a tenth of a Gluon launch's host time
    (every call builds four to eleven tensor descriptors)."""
    require()
    return _nvmma_layout(tuple(block_shape), dtype_name)


@functools.lru_cache(maxsize=None)
def _nvmma_layout(block_shape: tuple, dtype_name: str):
    return gl.NVMMASharedLayout.get_default_for(list(block_shape), getattr(gl, dtype_name))


def descriptor(base, shape: list, strides: list, block_shape: list, layout):
    """``TensorDescriptor(base, shape, strides, block_shape, layout)`` without its
    ``__post_init__`` checks (rank, 16-byte alignment of base and strides, last stride
    1, positive extents, block shape), which every caller has established for ``base``
    (:func:`flashgen.families.gluon.launch.unsupported`, the dispatcher's layout check,
    :func:`flashgen.families.gluon.bwd.check_inputs`, or its own allocation): they cost
    several microseconds per descriptor and a call builds four to eleven.  Falls back
    to the checked constructor where the class keeps no ``__dict__``."""
    require()
    if _DESC_DEFAULTS is None:
        return TensorDescriptor(base, shape, strides, block_shape, layout)
    d = object.__new__(TensorDescriptor)
    d.__dict__.update(_DESC_DEFAULTS)
    d.__dict__.update(base=base, shape=shape, strides=strides, block_shape=block_shape, layout=layout)
    return d


def _desc_defaults():
    import dataclasses

    if TensorDescriptor is None or not dataclasses.is_dataclass(TensorDescriptor) \
            or "__slots__" in TensorDescriptor.__dict__:
        return None
    names = {f.name for f in dataclasses.fields(TensorDescriptor)}
    if not {"base", "shape", "strides", "block_shape", "layout"} <= names:
        return None
    return {f.name: f.default for f in dataclasses.fields(TensorDescriptor) if f.default is not dataclasses.MISSING}


_DESC_DEFAULTS = _desc_defaults()


def ptxas_sm90() -> list[str]:
    """The ptxas command prefix Triton assembles sm_90 kernels with: the binary Triton
    picks for sm_90 (``get_ptxas(90)``: ``bin/ptxas`` in 3.6, ``bin/ptxas-blackwell``
    in 3.9; ``TRITON_PTXAS_PATH`` / ``TRITON_PTXAS_BLACKWELL_PATH`` override) and the
    register-allocation flag Triton's ``make_cubin`` adds (``--regAllocOptLevel=2``,
    from 3.9 on), so that ``-v`` reports the registers and spills of the binary that
    runs.  The caller appends ``-v``, ``--gpu-name``, the PTX file and ``-o``."""
    from triton.backends.nvidia import compiler

    cmd = [compiler.get_ptxas(90).path]
    if "--regAllocOptLevel=2" in inspect.getsource(compiler.CUDABackend.make_cubin):
        cmd.append("--regAllocOptLevel=2")
    return cmd


def cuobjdump() -> str:
    """Path of Triton's bundled cuobjdump (``TRITON_CUOBJDUMP_PATH`` overrides)."""
    from triton import knobs

    return knobs.nvidia.cuobjdump.path

"""The one place flashgen imports Gluon (``triton.experimental.gluon``) from.

Gluon is experimental and renames its API between Triton releases.  The generated
kernels import every Gluon name they use from here, so a rename is handled in one
module.  Names (Triton 3.6 -> later releases):

  tma_load     tma.async_copy_global_to_shared  -> tma.async_load
  tma_store    tma.async_copy_shared_to_global  -> tma.async_store
  store_wait   tma.store_wait (both)
  warp_specialize  gl.warp_specialize([(fn, args), ...], worker_num_warps, worker_num_regs)

Raises ImportError (from :func:`require`) naming what is missing when the installed
Triton has no Gluon or a warp_specialize of another form.
"""

from __future__ import annotations

import inspect

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    tma_load = getattr(tma, "async_copy_global_to_shared", None) or tma.async_load
    tma_store = getattr(tma, "async_copy_shared_to_global", None) or tma.async_store
    store_wait = tma.store_wait
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
    with elements of ``dtype_name`` ("float16" / "bfloat16")."""
    require()
    return gl.NVMMASharedLayout.get_default_for(list(block_shape), getattr(gl, dtype_name))

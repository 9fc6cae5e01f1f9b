"""What Gluon's TMA copy compiles to when two CTAs of a cluster share a tile, on a machine
without a GPU (Triton's compiler and bundled ptxas, sm_90).

The short causal forward tiles read each K/V tile once per 64 query rows (twice cuDNN's
L2 bytes at seqlen 512, the design notes' "where the gap to cuDNN is"); a thread-block
cluster of two programs taking adjacent query tiles could load each K/V tile once and
multicast it to both (``cp.async.bulk.tensor ... .multicast::cluster``).  Triton 3.6's
Gluon ``tma.async_copy_global_to_shared`` takes no multicast argument; this probe checks
whether the copy multicasts on its own when the destination's layout says the tile is the
same in both CTAs (``cga_layout`` [[0, 0]]: CTA 1 holds the offsets CTA 0 holds) with
``num_ctas`` 2, against a one-CTA launch.

    python3 benchmarks/probe_tma_multicast.py

Prints, per case, the cluster directives and the TMA instruction of the PTX.
"""

from __future__ import annotations

import importlib.util
import re
import sys
import tempfile
from pathlib import Path

_KERNEL = '''
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma, mbarrier, fence_async_shared


@gluon.jit
def copy_tile(desc):
    smem = gl.allocate_shared_memory(gl.bfloat16, [64, 128], desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout(BAR_CGA))
    mbarrier.init(bar, count=1)
    fence_async_shared()
    mbarrier.expect(bar, 64 * 128 * 2)
    tma.async_copy_global_to_shared(desc, [0, 0], bar, smem)
    mbarrier.wait(bar, 0)
'''

#: (name, num_ctas, the shared tile's cga_layout, the barrier's cga_layout)
CASES = [("one CTA", 1, [], []), ("two CTAs, the tile the same in both", 2, [[0, 0]], [[0]])]


def compile_case(num_ctas: int, cga: list, bar_cga: list) -> str:
    """The PTX of the copy for sm_90 with ``num_ctas`` CTAs per cluster."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "probe_tma_multicast_kernel.py"
        path.write_text(_KERNEL.replace("BAR_CGA", repr(bar_cga)))
        spec = importlib.util.spec_from_file_location("probe_tma_multicast_kernel", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2, cga_layout=cga)
        sig = {"desc": "tensordesc<bf16[64, 128],%r>" % (layout,)}
        c = triton.compile(GluonASTSource(fn=mod.copy_tile, signature=sig), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": 4, "num_ctas": num_ctas})
    return c.asm["ptx"]


def main() -> int:
    import triton

    print(f"Triton {triton.__version__}")
    for name, n, cga, bar in CASES:
        ptx = compile_case(n, cga, bar)
        lines = [ln.strip() for ln in ptx.splitlines()
                 if re.search(r"cp\.async\.bulk\.tensor|reqnctapercluster|explicitcluster", ln)]
        multicast = any("multicast::cluster" in ln for ln in lines)
        print(f"{name}: multicast {'yes' if multicast else 'no'}")
        for ln in lines:
            print("    " + ln)
    return 0


if __name__ == "__main__":
    sys.exit(main())

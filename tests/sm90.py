"""Compile generated kernels for sm_90 with Triton's real compiler and bundled ptxas (no
GPU needed), in a subprocess without TRITON_INTERPRET; the tests that catch
real-compiler errors the interpreter cannot, and read shared memory and PTX."""

import os
import subprocess
import sys

import pytest

_SCRIPT = '''
import importlib.util, os, tempfile
import triton
from triton.backends.compiler import GPUTarget
from flashgen import render
from flashgen.spec import KernelSpec, TileConfig, Variant
for kernel, dtype, d, dv, mask, cfg, *mods in CASES:
    cfg = TileConfig(*cfg)
    v = Variant(KernelSpec(kernel, dtype, d, dv, mask, *mods), cfg)
    path = os.path.join(tempfile.mkdtemp(), v.id + ".py")
    open(path, "w").write(render.render(v))
    spec = importlib.util.spec_from_file_location(v.id, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    fn = getattr(mod, "attn_" + kernel)
    short = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}[dtype]
    # a tma module takes its streamed tiles as 4-D descriptors (ops._descriptor)
    descs = {}
    if getattr(mod, "TMA", False):
        descs = ({"Q": (cfg.BLOCK_M, mod.D_PAD.value), "DO": (cfg.BLOCK_M, mod.DV_PAD.value)}
                 if kernel.startswith("bwd_dkdv") else
                 {"K": (cfg.BLOCK_N, mod.D_PAD.value), "V": (cfg.BLOCK_N, mod.DV_PAD.value)})
    sig, attrs = {}, {}
    for i, n in enumerate(fn.arg_names):
        if n in descs:
            sig[n] = "tensordesc<%s[1,1,%d,%d]>" % ((short,) + descs[n])
        elif n[0].isupper():
            sig[n] = ("*i32" if n.startswith("CU_") else "*fp32" if n in ("LSE", "DELTA", "ALIBI") else
                      "*i64" if n == "RNG" else "*" + short)
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[n] = "fp32" if n in ("qk_scale", "sm_scale", "softcap", "dropout_p") else "i32"
    k = triton.compile(triton.compiler.ASTSource(fn=fn, signature=sig, constexprs={}, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    ptx = k.asm["ptx"]
    print("OK", v.id, k.metadata.shared, int("cp.async.bulk.tensor" in ptx), int("wgmma.mma_async" in ptx))
'''


def compile_for_sm90(cases, timeout=600):
    """{variant id: (shared bytes, PTX has bulk tensor copies, PTX has wgmma)} for
    ``cases`` of (kernel, dtype, head_dim, head_dim_v, mask, TileConfig fields as a
    tuple[, mods]); skips the test when Triton's bundled ptxas is missing."""
    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("triton's bundled ptxas is missing")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", f"CASES = {list(cases)!r}\n" + _SCRIPT], capture_output=True,
                       text=True, env=env, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    out = {}
    for line in r.stdout.splitlines():
        if line.startswith("OK "):
            _, vid, shared, bulk, wgmma = line.split()
            out[vid] = (int(shared), bulk == "1", wgmma == "1")
    assert len(out) == len(cases), r.stdout
    return out

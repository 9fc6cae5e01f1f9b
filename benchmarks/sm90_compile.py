"""Compile generated dense/varlen kernels for sm_90 with Triton's real compiler and its
bundled ptxas, on a machine without a GPU, and report shared memory, registers and
spills (``ptxas -v``).  Run without TRITON_INTERPRET (the interpreter compiles nothing).

    python3 benchmarks/sm90_compile.py fwd,bfloat16,128,causal,64:64:4:2:1,bias [--launch-like]

Each case is kernel,dtype,head_dim,mask,BLOCK_M:BLOCK_N:num_warps:num_stages[:tma][,mods]
(head_dim_v = head_dim).  ``--launch-like`` compiles with the specializations a launch on
contiguous inputs gets (integer arguments divisible by 16 marked so, the bias's column
stride 1 a constant): how the causal-bias spills were found (docs/design.md).
A tma variant with a bias compiles its descriptor path (BIAS_TMA, what an addressable
bias launches); ``--bias-pointer`` compiles its pointer fallback instead.
``tests/sm90.py`` uses :func:`compile_sm90` for the compile tests.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

_SHORT = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


def compile_sm90(v, *, launch_like: bool = False, templates: str | None = None, bias_tma: bool = True, **extra):
    """Triton's compiled kernel of variant ``v`` for sm_90 (``templates``: another
    template directory, e.g. an edited copy; ``extra``: further template variables, e.g.
    ``dq_atomic="tma"`` for attn_bwd_dkdv).  A tma variant with a bias takes it
    through a descriptor (BIAS_TMA, what a launch with a descriptor-addressable bias
    compiles) unless ``bias_tma`` is False (the pointer fallback's binary)."""
    import triton
    from triton.backends.compiler import GPUTarget

    from flashgen import compile as _compile

    cfg, kernel = v.config, v.spec.kernel
    mod = _compile.load_mode(v, "_sm90", templates, **extra)
    fn = getattr(mod, "attn_" + kernel)
    short = _SHORT[v.spec.dtype]
    # a tma module takes its streamed tiles as 4-D descriptors (ops._descriptor)
    descs = {}
    if getattr(mod, "TMA", False):
        descs = ({"Q": (cfg.BLOCK_M, mod.D_PAD.value), "DO": (cfg.BLOCK_M, mod.DV_PAD.value)}
                 if kernel.startswith("bwd_dkdv") else
                 {"K": (cfg.BLOCK_N, mod.D_PAD.value), "V": (cfg.BLOCK_N, mod.DV_PAD.value)})
    sig, attrs, consts = {}, {}, {}
    user = _user_pointer_types(v)
    if "BIAS_TMA" in fn.arg_names and bias_tma:
        descs["BIAS"] = (cfg.BLOCK_M, cfg.BLOCK_N)  # ops.bias_descriptor
    for i, n in enumerate(fn.arg_names):
        if n == "BIAS_TMA":
            sig[n], consts[n] = "constexpr", bool(bias_tma)
        elif n in descs:
            sig[n] = "tensordesc<%s[1,1,%d,%d]>" % ((short,) + descs[n])
        elif n == "DQACC" and extra.get("dq_atomic") == "tma":
            sig[n] = "tensordesc<fp32[1,%d,%d]>" % (cfg.BLOCK_M, mod.D_PAD.value)
        elif n in user:
            sig[n] = user[n]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif n[0].isupper():
            sig[n] = ("*i32" if n.startswith("CU_") else "*fp32" if n in ("LSE", "DELTA", "ALIBI", "DQACC") else
                      "*i64" if n == "RNG" else "*" + short)
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif launch_like and n == "stride_bn":
            sig[n], consts[n] = "constexpr", 1
        else:
            sig[n] = "fp32" if n in ("qk_scale", "sm_scale", "softcap", "dropout_p") else "i32"
            if launch_like and n.startswith("stride"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})


_POINTER = {"float32": "*fp32", "float16": "*fp16", "bfloat16": "*bf16", "float64": "*fp32", "int64": "*i64",
            "int32": "*i32", "int16": "*i16", "int8": "*i8", "uint8": "*u8", "bool": "*i8"}


def _user_pointer_types(v) -> dict:
    """The pointer types of a user variant's extra arguments (its functions registered in
    this process): captured tensors UT<n> as :class:`flashgen.user_mods.UserArgs` passes
    them (float64 as float32, bool as int8), gradient buffers UG<n> and sinks float32,
    the block mask int32; {} for other variants."""
    from flashgen.spec import is_user_mods

    if not is_user_mods(v.spec.mods):
        return {}
    from flashgen import user_render

    low = user_render.lowered(v.spec.mods)
    out = {f"UT{n}": _POINTER[b.dtype] for n, b in enumerate(low.bufs)}
    out.update({f"UG{n}": "*fp32" for n in range(len(low.bufs))})
    return {**out, "UBM": "*i32", "SINKS": "*fp32"}


def ptxas_report(ptx: str) -> tuple[int | None, int | None]:
    """(registers, spill-store bytes) per thread that ptxas -v reports for ``ptx``."""
    from flashgen.families.gluon.shim import ptxas_sm90  # the ptxas (and flags) Triton assembles sm_90 with

    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "k.ptx")
        with open(p, "w") as f:
            f.write(ptx)
        err = subprocess.run([*ptxas_sm90(), "-v", "--gpu-name", "sm_90a", p, "-o", p + ".o"], capture_output=True,
                             text=True).stderr
    regs = re.search(r"Used (\d+) registers", err)
    spills = re.search(r"(\d+) bytes spill stores", err)
    return (int(regs.group(1)) if regs else None), (int(spills.group(1)) if spills else None)


def _case(text: str):
    from flashgen.spec import KernelSpec, TileConfig, Variant

    kernel, dtype, d, mask, cfg, *mods = text.split(",")
    return Variant(KernelSpec(kernel, dtype, int(d), int(d), mask, *mods), TileConfig(*map(int, cfg.split(":"))))


def main(argv=None) -> int:
    os.environ.pop("TRITON_INTERPRET", None)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("cases", nargs="+", help="kernel,dtype,head_dim,mask,M:N:warps:stages[:tma][,mods]")
    p.add_argument("--launch-like", action="store_true", help="a contiguous launch's specializations")
    p.add_argument("--templates", default=None, help="another template directory")
    p.add_argument("--bias-pointer", action="store_true",
                   help="tma variants: the bias through pointers (BIAS_TMA False, the fallback's binary)")
    args = p.parse_args(argv)
    print(f"{'variant':60} {'regs':>5} {'spill B':>8} {'shared B':>9}")
    for text in args.cases:
        v = _case(text)
        k = compile_sm90(v, launch_like=args.launch_like, templates=args.templates, bias_tma=not args.bias_pointer)
        regs, spills = ptxas_report(k.asm["ptx"])
        print(f"{v.id:60} {regs!s:>5} {spills!s:>8} {k.metadata.shared:>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Compile Gluon forward variants for sm_90 without a GPU, and read what the binary is:
registers and spills (``ptxas -v`` with the ptxas and flags Triton assembles sm_90
with: :func:`flashgen.families.gluon.shim.ptxas_sm90`), ptxas's messages (the info lines
C7512/C7514/C7515: wgmma serialized; the warning C7508: setmaxnreg ignored), and the SASS (``cuobjdump``): HGMMA,
USETMAXREG, the partial wgmma wait, and the exponentials between the two waits.

Run outside TRITON_INTERPRET (the interpreter compiles nothing).
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import tempfile

from .config import GluonFwdVariant, maxnreg, pad

_SHORT = {"float16": "fp16", "bfloat16": "bf16"}
#: ptxas's codes for wgmma it serialized ("Potential Performance Loss", printed as info
#: lines, not warnings).
SERIALIZED = ("C7512", "C7514", "C7515")
#: Triton's pointer element names of the captured tensors' dtypes as the kernels read them
#: (float64 arrives as float32, bool as int8).
_PTR = {"float32": "fp32", "float64": "fp32", "float16": "fp16", "bfloat16": "bf16", "int64": "i64", "int32": "i32",
        "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "i8"}


def descriptor_signature(dtype: str, block_shape, layout) -> str:
    """The signature string a Gluon TensorDescriptor argument gets (Triton's mangling)."""
    return "tensordesc<%s[%s],%r>" % (_SHORT[dtype], ", ".join(map(str, block_shape)), layout)


def compile_sm90(v: GluonFwdVariant):
    """Triton's compiled kernel of ``v`` for sm_90 (a GPU is not needed)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from .render import load
    from .shim import nvmma_layout

    s, c = v.spec, v.config
    mod = load(v)
    boxes = {"q_desc": (c.BLOCK_M, pad(s.head_dim)), "k_desc": (c.BLOCK_N, pad(s.head_dim)),
             "v_desc": (c.BLOCK_N, pad(s.head_dim_v)), "o_desc": (c.BLOCK_M, pad(s.head_dim_v))}
    bufs = {}
    if s.user:  # captured tensors of user functions, as the kernels read them
        from ...user_render import lowered

        bufs = {f"UT{n}": "*" + _PTR[b.dtype] for n, b in enumerate(lowered(s.user).bufs)}
    sig = {}
    for name in mod.attn_fwd.arg_names:
        if name in boxes:
            shape = [1, 1, *boxes[name]]
            sig[name] = descriptor_signature(s.dtype, shape, nvmma_layout(shape, s.dtype))
        elif name in ("LSE", "SINKS"):
            sig[name] = "*fp32"
        elif name in ("qk_scale", "sm_scale"):
            sig[name] = "fp32"
        elif name in ("UBM", "CU_Q", "CU_K"):
            sig[name] = "*i32"
        elif name == "O":  # the varlen variants' pointer store of a sequence's last rows
            sig[name] = "*" + _PTR[s.dtype]
        elif name in bufs:
            sig[name] = bufs[name]
        else:
            sig[name] = "i32"
    attrs = {(mod.attn_fwd.arg_names.index("LSE"),): [["tt.divisibility", 16]]}
    return triton.compile(GluonASTSource(fn=mod.attn_fwd, signature=sig, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": mod.NUM_WARPS, "maxnreg": maxnreg(c)})


@dataclasses.dataclass
class Report:
    """What ptxas and the SASS say about one compiled variant."""

    registers: int | None
    spill_bytes: int
    stack_bytes: int
    warnings: list[str]
    shared_bytes: int
    hgmma: int
    setmaxnreg: list[int]
    partial_waits: int
    exps_between_waits: int
    #: SASS instructions of the kernel (its code size is 16 B each: what the instruction
    #: caches hold; a consumer partition of warp_specialize is its own copy of its code)
    instructions: int = 0
    sass: str = dataclasses.field(repr=False, default="")
    #: ptxas -v's whole output (its info messages too: C7512-C7515, serialized wgmma)
    ptxas_log: str = dataclasses.field(repr=False, default="")

    def problems(self, v: GluonFwdVariant) -> list[str]:
        """What the binary lacks that the variant is for (empty when nothing)."""
        bad = []
        if self.spill_bytes or self.stack_bytes:
            bad.append(f"spills {self.spill_bytes} B, stack {self.stack_bytes} B")
        for line in self.ptxas_log.splitlines():  # C751x are info messages, C7508 a warning
            if any(code in line for code in SERIALIZED + ("C7508",)):
                bad.append("ptxas: " + line.strip())
        if not self.hgmma:
            bad.append("no HGMMA in the SASS")
        if not self.setmaxnreg:
            bad.append("no USETMAXREG in the SASS")
        if not self.partial_waits:
            bad.append("no partial wgmma wait (wgmma.wait_group N > 0) in the PTX")
        if v.config.pin_exps and not self.exps_between_waits:
            bad.append("pin_exps: no MUFU.EX2 between the partial and the full wgmma wait")
        return bad


def _exps_between_waits(sass: str) -> int:
    """The most MUFU.EX2 found between a partial wait (WARPGROUP.DEPBAR.LE gsb0, 0x1)
    and the next full one (..., 0x0), over the kernel."""
    best = n = 0
    inside = False
    for line in sass.splitlines():
        if "WARPGROUP.DEPBAR.LE" in line:
            if re.search(r"gsb0,\s*0x[1-9]", line):
                inside, n = True, 0
            elif inside:
                best, inside = max(best, n), False
        elif inside and "MUFU.EX2" in line:
            n += 1
    return best


def sass_instructions(sass: str) -> int:
    """The instructions of ``cuobjdump -sass`` output (lines ``/*addr*/ OPCODE ...``,
    addresses of any width)."""
    return len(re.findall(r"^\s+/\*[0-9a-f]+\*/\s+[A-Z@{]", sass, flags=re.M))


def report(kernel) -> Report:
    """ptxas -v and cuobjdump -sass over the compiled kernel's PTX."""
    from .shim import cuobjdump, ptxas_sm90

    ptx = kernel.asm["ptx"]
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "k.ptx")
        with open(p, "w") as f:
            f.write(ptx)
        r = subprocess.run([*ptxas_sm90(), "-v", "--gpu-name", "sm_90a", p, "-o", p + ".o"], capture_output=True,
                           text=True)
        if r.returncode:
            raise RuntimeError("ptxas failed: " + r.stderr[-2000:])
        sass = subprocess.run([cuobjdump(), "-sass", p + ".o"], capture_output=True, text=True).stdout
    err = r.stderr
    regs = re.search(r"Used (\d+) registers", err)
    spills = re.search(r"(\d+) bytes spill stores", err)
    stack = re.search(r"(\d+) bytes stack frame", err)
    warnings = [ln.strip() for ln in err.splitlines() if "warning" in ln.lower()]
    return Report(
        registers=int(regs.group(1)) if regs else None,
        spill_bytes=int(spills.group(1)) if spills else 0,
        stack_bytes=int(stack.group(1)) if stack else 0,
        warnings=warnings,
        shared_bytes=kernel.metadata.shared,
        hgmma=sass.count("HGMMA."),
        setmaxnreg=sorted({int(x, 16) if x.startswith("0x") else int(x)
                           # USETMAXREG.DEALLOC.CTAPOOL 0x18 / USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xf0
                           for x in re.findall(r"USETMAXREG(?:\.\w+)+\s+(?:U?P\w+,\s*)?(0x[0-9a-f]+|\d+)", sass)}),
        partial_waits=len(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+[1-9]", ptx)),
        exps_between_waits=_exps_between_waits(sass),
        instructions=sass_instructions(sass),
        sass=sass,
        ptxas_log=err,
    )

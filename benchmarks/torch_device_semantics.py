"""Where torch's CPU and CUDA kernels disagree on the operations that user score and
mask functions may use (:data:`flashgen.user_mods.SUPPORTED`), at edge inputs: NaN,
infinities, signed zeros, subnormals, values past the integer ranges, integer extremes,
zero divisors and shift counts past the width.

flashgen's kernels run on the GPU, where the user's tensors are CUDA tensors, so
torch's CUDA result is the one a kernel is checked against there; on the CPU the
interpreter's result is checked against torch's CPU kernel.  An operation on this list
has no one answer for the edge values shown: the user-function lowering either refuses
it (a constant NaN clamp bound) or documents which one it computes.

Prints one line per (operation, input) where the two devices differ, then a count.
Needs a CUDA device.

    python3 benchmarks/torch_device_semantics.py
"""

from __future__ import annotations

import math
import sys

import torch

F32 = [math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-45, -1e-45, 1e-39, 3e38, -3e38, 2.5, -2.5, 0.5, -0.5,
       1.5, 7.0, -7.0, 2.0 ** 31, -(2.0 ** 31) - 256.0, 2.0 ** 63, -(2.0 ** 64), 1e20, 40000.0, -40000.0, 300.0, -300.0, 3e9, -3e9, 255.5, -1.5, 128.0, -129.0]
I64 = [0, 1, -1, 7, -7, 2 ** 31 - 1, -(2 ** 31), 2 ** 31, 2 ** 63 - 1, -(2 ** 63), 40000, 300, 64, 65]
I32 = [0, 1, -1, 7, -7, 2 ** 31 - 1, -(2 ** 31), 31, 32, 33, 40000]

UNARY_F = {
    "long": lambda x: x.long(), "int": lambda x: x.int(), "short": lambda x: x.short(), "bool": lambda x: x.bool(),
    "to(int8)": lambda x: x.to(torch.int8), "to(uint8)": lambda x: x.to(torch.uint8),
    "to(int64)": lambda x: x.to(torch.int64), "half": lambda x: x.half().float(),
    "bfloat16": lambda x: x.bfloat16().float(), "sign": torch.sign, "floor": torch.floor, "ceil": torch.ceil,
    "trunc": torch.trunc, "exp": torch.exp, "exp2": torch.exp2, "log": torch.log, "log2": torch.log2,
    "sqrt": torch.sqrt, "rsqrt": torch.rsqrt, "sigmoid": torch.sigmoid, "tanh": torch.tanh, "sin": torch.sin,
    "cos": torch.cos, "abs": torch.abs, "neg": torch.neg,
    "clamp(min=0)": lambda x: x.clamp(min=0.0), "clamp(max=0)": lambda x: x.clamp(max=0.0),
    "clamp(-1,1)": lambda x: x.clamp(-1.0, 1.0),
}
UNARY_I = {
    "abs": torch.abs, "neg": torch.neg, "sign": torch.sign, "float": lambda x: x.float(),
    "int": lambda x: x.int(), "short": lambda x: x.short(), "bool": lambda x: x.bool(), "not": lambda x: ~x,
    "to(int8)": lambda x: x.to(torch.int8), "to(uint8)": lambda x: x.to(torch.uint8),
}
BINARY_F = {
    "//": lambda a, b: a // b, "%": lambda a, b: a % b, "/": lambda a, b: a / b, "**": lambda a, b: a ** b,
    "maximum": torch.maximum, "minimum": torch.minimum, "max": torch.max, "min": torch.min,
    "clamp(t,t)": lambda a, b: torch.clamp(a, min=b, max=b + 1),
    "<": lambda a, b: a < b, "==": lambda a, b: a == b, "!=": lambda a, b: a != b,
}
BINARY_I = {
    "//": lambda a, b: a // b, "%": lambda a, b: a % b, "/": lambda a, b: a / b, "*": lambda a, b: a * b,
    "+": lambda a, b: a + b, "-": lambda a, b: a - b, "<<": lambda a, b: a << b, ">>": lambda a, b: a >> b,
    "&": lambda a, b: a & b, "maximum": torch.maximum,
    "**": lambda a, b: a ** b.clamp(min=0),
}


def _same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise equality with NaN equal to NaN and -0.0 distinct from 0.0."""
    if a.dtype != b.dtype:
        return torch.zeros(a.shape, dtype=torch.bool)
    if a.is_floating_point():
        a, b = a.double(), b.double()
        return ((a == b) & (torch.signbit(a) == torch.signbit(b))) | (a.isnan() & b.isnan())
    return a == b


def _run(fn, *args):
    try:
        return fn(*args), None
    except Exception as e:  # noqa: BLE001 - a raise is a result to compare too
        return None, f"{type(e).__name__}"


def _compare(name, fn, args_cpu, labels) -> list[str]:
    out = []
    c, ce = _run(fn, *args_cpu)
    g, ge = _run(fn, *(a.cuda() for a in args_cpu))
    if ce or ge:
        if ce != ge:
            out.append(f"{name}: CPU {'raises ' + ce if ce else 'computes'}, CUDA {'raises ' + ge if ge else 'computes'}")
        return out
    g = g.cpu()
    if c.dtype != g.dtype:
        return [f"{name}: dtype CPU {c.dtype}, CUDA {g.dtype}"]
    same = _same(c, g)
    for i in (~same).nonzero().flatten().tolist():
        out.append(f"{name}({labels[i]}): CPU {c[i].item()!r}, CUDA {g[i].item()!r}")
    return out


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: this compares torch's CPU and CUDA kernels", file=sys.stderr)
        return 2
    lines = []
    xf = torch.tensor(F32, dtype=torch.float32)
    for name, fn in UNARY_F.items():
        lines += _compare(f"float32 {name}", fn, [xf], [repr(v) for v in F32])
    for dt, vals in ((torch.int64, I64), (torch.int32, I32)):
        x = torch.tensor(vals, dtype=dt)
        for name, fn in UNARY_I.items():
            lines += _compare(f"{str(dt)[6:]} {name}", fn, [x], [repr(v) for v in vals])
    a = torch.tensor([x for x in F32 for _ in F32], dtype=torch.float32)
    b = torch.tensor([y for _ in F32 for y in F32], dtype=torch.float32)
    pairs = [f"{x!r}, {y!r}" for x in F32 for y in F32]
    for name, fn in BINARY_F.items():
        lines += _compare(f"float32 {name}", fn, [a, b], pairs)
    for dt, vals in ((torch.int64, I64), (torch.int32, I32)):
        a = torch.tensor([x for x in vals for _ in vals], dtype=dt)
        b = torch.tensor([y for _ in vals for y in vals], dtype=dt)
        pairs = [f"{x!r}, {y!r}" for x in vals for y in vals]
        for name, fn in BINARY_I.items():
            if name in ("//", "%"):  # a zero divisor raises on the CPU: compare without, then alone
                nz = b != 0
                lines += _compare(f"{str(dt)[6:]} {name}", fn, [a[nz], b[nz]], [p for p, k in zip(pairs, nz) if k])
                lines += _compare(f"{str(dt)[6:]} {name} by 0", fn, [a[~nz], b[~nz]], [p for p, k in zip(pairs, ~nz) if k])
            else:
                lines += _compare(f"{str(dt)[6:]} {name}", fn, [a, b], pairs)
    for line in lines:
        print(line)
    ops = sorted({line.split("(")[0].split(":")[0] for line in lines})
    print(f"{len(lines)} differences in {len(ops)} operations: {', '.join(ops)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

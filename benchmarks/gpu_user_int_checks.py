"""Integer arithmetic and powers in user score/mask functions and dropout's default draw, checked
on the GPU (about three minutes on an H100, most of it compiling):

* functions whose integer values leave int32 at the call's sizes (``q_idx * kv_idx *
  10**7``: torch computes it in int64), which run their widened graph
  (``user_ints.widen``), at 1x2x17x23 float16, 2x4x1000x1500 and 1x8x4096x4096 bf16;
* 8- and 16-bit integer tensors captured by a score function (``user_ints.narrow_operands``:
  ``u8 + 300`` and ``u8 > 300`` converted as torch converts them, uint8 * int8 in int16,
  uint8 with a bool, int16 + 40000) and the integer floor remainder near the int32 minimum
  (``user_render._Code._floordiv_int``), at 1x2x17x23 float16 and 2x4x1000x1500 bf16;
* powers (``user_render.Graph.pow``: negative scores to integral constant and float tensor
  powers, a non-integral constant power, integers to a constant power) at 1x2x17x23
  float16 and 2x4x1000x1500 bf16;
* operations at their edges (``check_edges``: NaN through maximum and minimum,
  sign of a bool, a division by a float32-subnormal constant, masks whose integer
  arithmetic wraps, float to integer casts of NaN, infinities and values past the
  targets' ranges, int32 tables beside Python integers, ~ of a uint8, captured 0-dim
  bools, gradients cut off before an infinite slope, pow at base 0 and clamp with a
  tensor bound) at the same two shapes;

each forward (O, LSE) and backward (dQ, dK, dV) against float64 (``bench._ratios``: the
error over torch's own at the input dtype plus a floor; ratio <= 1 passes); and

* dropout without ``rng_state=`` (one ``torch.randint`` draw on the device per call):
  ``torch.utils.checkpoint`` recomputes the same mask (O and gradients bitwise equal to
  the plain call), another seed draws another mask, and a compiled call with a state
  tensor equals the eager call from the same state.

Prints one line per case; exit status 1 if any failed.

    PYTHONPATH=. python3 benchmarks/gpu_user_int_checks.py [--only wide,narrow,pow,edges,dropout]
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

import flashgen
from flashgen import bench, user_mods

DEV = "cuda"


def _check(name, shapes, sm, mm=None) -> list[bool]:
    ok = []
    for (b, h, sq, sk, dt) in shapes:
        q = torch.randn(b, h, sq, 64, device=DEV, dtype=dt)
        k = torch.randn(b, h, sk, 64, device=DEV, dtype=dt)
        v = torch.randn_like(k)
        qs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        try:
            o, lse = flashgen.attention(*qs, score_mod=sm, mask_mod=mm, return_lse=True)
            o.float().sum().backward()
        except Exception as e:  # a refused or failed call is a failure of the check
            print(f"{name} {b}x{h}x{sq}x{sk} {dt}: ERROR {type(e).__name__}: {str(e)[:200]}  FAIL")
            ok.append(False)
            continue
        got = {"O": o.detach(), "LSE": lse, "dQ": qs[0].grad, "dK": qs[1].grad, "dV": qs[2].grad}
        res = {}
        for kind in (torch.float64, dt):
            r = [t.detach().clone().to(kind).requires_grad_() for t in (q, k, v)]
            ro, rl = user_mods.reference(*r, 64 ** -0.5, -sq, sk, sm, mm, None, kind)
            ro.float().sum().backward()
            res[kind] = {"O": ro.detach(), "LSE": rl.detach(), "dQ": r[0].grad, "dK": r[1].grad, "dV": r[2].grad}
        rat = bench._ratios(got, {n: (res[torch.float64][n], res[dt][n]) for n in got}, dt)
        worst = max(x for _, _, x in rat.values())
        names = user_mods.variant_names(q, k, score_mod=sm, mask_mod=mm)
        print(f"{name} {b}x{h}x{sq}x{sk} {dt}: names {names} worst ratio {worst:.3f} "
              f"{'PASS' if worst <= 1 else 'FAIL'}")
        ok.append(worst <= 1)
    return ok


def check_wide() -> list[bool]:
    tab = torch.randn(8, device=DEV)
    sm = lambda s, bb, hh, qi, ki: s + tab[(qi * ki * 10_000_000) // 1_000_000_000 % 8]  # noqa: E731
    mm = lambda bb, hh, qi, ki: (qi * ki * 10_000_000) % 3 != 1  # noqa: E731
    shapes = [(1, 2, 17, 23, torch.float16), (2, 4, 1000, 1500, torch.bfloat16), (1, 8, 4096, 4096, torch.bfloat16)]
    return _check("int64", shapes, sm, mm)


def check_narrow() -> list[bool]:
    u = torch.randint(0, 256, (4096,), device=DEV, dtype=torch.uint8)
    i8 = torch.randint(-128, 128, (16,), device=DEV, dtype=torch.int8)
    i16 = torch.randint(-32768, 32767, (4096,), device=DEV, dtype=torch.int16)
    fl = torch.rand(4096, device=DEV) > 0.5
    cases = {
        "u8+300": lambda s, bb, hh, qi, ki: s + 0.01 * (u[ki] + 300).float() + (u[ki] > 300).float(),
        "u8*i8": lambda s, bb, hh, qi, ki: s + 0.0001 * (u[ki] * i8[hh]).float(),
        "u8+bool": lambda s, bb, hh, qi, ki: s + 0.01 * (u[ki] * fl[ki] + 255).float(),
        "i16+40000": lambda s, bb, hh, qi, ki: s + 0.0001 * (i16[ki] + 40000).float(),
        "floor-min": lambda s, bb, hh, qi, ki: s + 0.1 * (((qi + 1).int() * 2 ** 30) % (ki.int() * 2 - 7)).float(),
    }
    shapes = [(1, 2, 17, 23, torch.float16), (2, 4, 1000, 1500, torch.bfloat16)]
    return [x for name, sm in cases.items() for x in _check(name, shapes, sm)]


def check_pow() -> list[bool]:
    """a ** b as torch computes it: negative scores to integral powers (constant and float
    tensor exponents), a non-integral constant power, integers to a constant power."""
    cases = {
        "s**2.0": lambda s, bb, hh, qi, ki: s ** 2.0 * 0.5,
        "pow(s,5)": lambda s, bb, hh, qi, ki: torch.pow(s, 5) * 0.1,
        "(s*s+1)**-3": lambda s, bb, hh, qi, ki: (s * s + 1.0) ** -3 + s,
        "|s|**2.5": lambda s, bb, hh, qi, ki: (s.abs() + 0.5) ** 2.5 * 0.2,
        "s**(k%4)": lambda s, bb, hh, qi, ki: s + 0.2 * s ** (ki % 4).float(),
        "(-1.)**(k-q)": lambda s, bb, hh, qi, ki: s + (-1.0) ** (ki - qi) + 2.0 ** (-(qi % 8).float()),
        "(q+2)**12%101": lambda s, bb, hh, qi, ki: s + ((qi + 2) ** 12 % 101).float() * 0.05,
    }
    shapes = [(1, 2, 17, 23, torch.float16), (2, 4, 1000, 1500, torch.bfloat16)]
    return [x for name, sm in cases.items() for x in _check(name, shapes, sm)]


def _nan_or(x, a, b):
    """a where x is NaN (x != x), else b."""
    return torch.where(x != x, a, b)


def check_edges() -> list[bool]:
    """Operations at their edges as torch computes them (``user_render``): a NaN first or
    second argument of maximum/minimum gives NaN (read back through x != x, so the
    output stays finite), sign of a bool is the bool, a division by a
    constant whose float32 reciprocal overflows stays a division, masks whose integer
    arithmetic wraps (an int32 cast, an int64 product) are not read as a band, and float
    to integer casts give torch's values on the device (``user_render``: through int32
    for int16, int8 and uint8)."""
    cases = {
        "max(log s,s)": (lambda s, bb, hh, qi, ki: _nan_or(torch.maximum(torch.log(s), s), -s, s), None),
        "min(log s,s)": (lambda s, bb, hh, qi, ki: _nan_or(torch.minimum(torch.log(s), s), -s, s), None),
        "max(s,log s)": (lambda s, bb, hh, qi, ki: _nan_or(torch.maximum(s, torch.log(s)), -s, s), None),
        "sign(bool)": (lambda s, bb, hh, qi, ki: s + (torch.sign(qi > 2) + torch.sign(ki > 2)).float(), None),
        "/2**-149": (lambda s, bb, hh, qi, ki: s * 2.0 ** -120 / 2.0 ** -149 * 2.0 ** -29, None),
        "int32-wrap": (None, lambda bb, hh, qi, ki: ((ki - qi) * 2 ** 32).int() == 0),
        "int64-wrap": (None, lambda bb, hh, qi, ki: (ki - qi) * 2 ** 62 <= 0),
    }
    # float to integer casts past the targets' ranges, NaN and infinities (torch: through
    # int32 for the narrow targets, the GPU's conversion saturating)
    edge = torch.tensor([math.nan, math.inf, -math.inf, 1e20, -1e20, 3e9, -3e9, 2.0 ** 31, 40000.0, -40000.0,
                         300.0, -300.0, 255.5, -1.5, 128.0, -129.0], device=DEV)
    for dt in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        cases[f"cast {str(dt)[6:]}"] = (lambda s, bb, hh, qi, ki, dt=dt: s + 0.01 * (edge[ki % 16].to(dt) % 97).float(),
                                        None)
    # int32 tables beside Python integers and 0-dim int64 tensors stay int32 (wrapping);
    # ~ of a uint8 is 255 - x; a captured 0-dim bool is a bool
    i32 = torch.arange(4096, device=DEV, dtype=torch.int32) * 100_003
    z64 = torch.tensor(2 ** 32 + 1, device=DEV)
    u8 = (torch.arange(4096, device=DEV) * 17 % 256).to(torch.uint8)
    t, f = torch.tensor(True, device=DEV), torch.tensor(False, device=DEV)
    cases["int32 wrap"] = (lambda s, bb, hh, qi, ki: s + 0.1 * ((i32[ki] + 2 ** 32 + 1) % 7).float()
                           + 0.1 * ((i32[ki] * 100_000 + z64) % 11).float(), None)
    cases["~uint8"] = (lambda s, bb, hh, qi, ki: s + 0.01 * (~u8[ki]).float(), None)
    cases["0-dim bool"] = (lambda s, bb, hh, qi, ki: s + (torch.where(ki > qi, t, f) + torch.where(ki > qi + 2, t, f)).float(),
                           lambda bb, hh, qi, ki: torch.where(qi > 3, t, ki <= qi + 5))
    # gradients cut off before an infinite slope, pow at base 0, clamp with a tensor bound
    tb = torch.tensor([0.0, 0.5, -0.25, 1.0], device=DEV)
    cases["grad sqrt(relu)"] = (lambda s, bb, hh, qi, ki: torch.sqrt((s + tb[hh]).clamp(min=0)), None)
    cases["grad relu**1.5"] = (lambda s, bb, hh, qi, ki: s.clamp(min=0) ** (tb[hh] + 1.5), None)
    cases["grad clamp(s,t)"] = (lambda s, bb, hh, qi, ki: torch.clamp(s, min=tb[hh], max=(ki - qi).float()), None)
    shapes = [(1, 2, 17, 23, torch.float16), (2, 4, 1000, 1500, torch.bfloat16)]
    return [x for name, (sm, mm) in cases.items() for x in _check(name, shapes, sm, mm)]


def check_dropout() -> list[bool]:
    from torch.utils.checkpoint import checkpoint

    def grads(fn, seed):
        torch.manual_seed(seed)
        g = torch.Generator(device=DEV).manual_seed(1)
        q, k, v = (torch.randn(2, 8, 1024, 128, device=DEV, dtype=torch.bfloat16, generator=g).requires_grad_()
                   for _ in range(3))
        o = fn(q, k, v)
        o.float().square().sum().backward()
        return [o.detach(), q.grad, k.grad, v.grad]

    f = lambda q, k, v: flashgen.attention(q, k, v, causal=True, dropout_p=0.1)  # noqa: E731
    a = grads(f, 3)
    b = grads(lambda *t: checkpoint(f, *t, use_reentrant=False), 3)
    c = grads(f, 4)
    same = all(torch.equal(x, y) for x, y in zip(a, b))
    other = not torch.equal(a[0], c[0])
    st, st2 = torch.tensor([5, 0], device=DEV), torch.tensor([5, 0], device=DEV)
    comp = torch.compile(lambda q, k, v: flashgen.attention(q, k, v, dropout_p=0.1, rng_state=st))
    e = grads(lambda q, k, v: flashgen.attention(q, k, v, dropout_p=0.1, rng_state=st2), 0)
    d = grads(comp, 0)
    compiled = all(torch.equal(x, y) for x, y in zip(d, e))
    for name, ok in (("dropout: checkpoint recomputes the same mask (bitwise)", same),
                     ("dropout: another seed draws another mask", other),
                     ("dropout: compiled call with a state tensor equals eager (bitwise)", compiled)):
        print(f"{name}: {'PASS' if ok else 'FAIL'}")
    return [same, other, compiled]


CHECKS = {"wide": check_wide, "narrow": check_narrow, "pow": check_pow, "edges": check_edges,
          "dropout": check_dropout}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(CHECKS), help=f"comma-separated subset of {','.join(CHECKS)}")
    a = ap.parse_args(argv)
    only = [x for x in a.only.split(",") if x]
    bad = [x for x in only if x not in CHECKS]
    if bad:
        ap.error(f"--only: unknown check(s) {', '.join(bad)}; one of {', '.join(CHECKS)}")
    if not torch.cuda.is_available():
        print("no CUDA device: these checks run the kernels on a GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    results = [x for name in only for x in CHECKS[name]()]
    print(f"{sum(results)} of {len(results)} checks passed")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())

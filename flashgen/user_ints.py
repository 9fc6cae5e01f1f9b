"""Integer widths of user score and mask functions: where the kernels' int32 arithmetic
can give other values than torch's, and the graph that computes like torch there.

torch evaluates a function with int64 index inputs (b, h, q_idx, kv_idx: ``arange``) and
with bools that meet a Python integer as int64; the kernels take the inputs as int32 and
turn a bool into int32 (:meth:`flashgen.user_render._Code.i`).  Everything else follows
the same promotion in both (a captured integer tensor keeps its dtype, a Python
constant is weak, a constant outside int32 is int64, an explicit integer cast is a cast
in both).  So the two agree unless a value computed in int32 from those sources leaves
int32: ``q_idx * kv_idx * 10**7`` at seqlen 17 x 23 is in [0, 4) after ``// 10**9``
in torch and wrapped to -3..-1 in int32, where it read before its table.

:func:`int32_overflows` bounds every integer value of a graph by interval arithmetic
from the call's sizes and the captured tensors' dtype ranges; where one can leave int32,
:func:`widen` gives the graph with the inputs and those bools cast to int64 (a lowering
of its own name; every other function keeps its graph, code and name).

Beside 8- and 16-bit integer tensors, :func:`narrow_operands` gives the trace torch's
conversions (a Python integer modulo 2**bits, a bool and a uint8 / int8 mix cast to
torch's dtype), which Triton's own promotion and constant checks do not.  Pure: no
torch, no triton.
"""

from __future__ import annotations

from .errors import UnsupportedError
from .user_render import INT32, INT64, Graph, Ref

#: Kernel width (bits) and value range of a captured integer tensor's elements.
_INT_DTYPES = {"int64": (64, INT64), "int32": (32, INT32), "int16": (16, (-2 ** 15, 2 ** 15 - 1)),
               "int8": (8, (-2 ** 7, 2 ** 7 - 1)), "uint8": (8, (0, 2 ** 8 - 1))}

#: Integer operations whose bool operands the kernels turn into int32 (and torch, next
#: to a Python integer or an index, into int64).
_ARITH = ("add", "sub", "mul", "floordiv", "mod", "neg", "abs", "minimum", "maximum", "clamp", "where",
          "and", "or", "xor", "lshift", "rshift", "not")


def _floordiv_range(a, b):
    """Range of floor(a / b) over intervals a, b (a divisor range holding 0 reads it as
    1, as the kernels' safe divisor does)."""
    (al, ah), (bl, bh) = a, b
    divs = [d for d in {bl, bh, -1, 1} if d != 0 and bl <= d <= bh] or [1]
    qs = [x // d for x in (al, ah) for d in divs]
    return min(qs), max(qs)


def _range(op, args, rs):
    """The range of an integer ``op`` over operand ranges ``rs`` (None: unbounded here)."""
    if any(r is None for r in rs):
        return None
    if op in ("add", "sub", "mul"):
        (al, ah), (bl, bh) = rs
        if op == "add":
            return al + bl, ah + bh
        if op == "sub":
            return al - bh, ah - bl
        p = (al * bl, al * bh, ah * bl, ah * bh)
        return min(p), max(p)
    if op in ("floordiv", "mod"):
        (al, ah), (bl, bh) = rs
        m = max(abs(al), abs(ah)) + max(abs(bl), abs(bh))  # bounds b * (a // b) in a % b (conservative)
        if m > INT32[1]:
            return -m, m
        if op == "floordiv":
            return _floordiv_range(rs[0], rs[1])
        d = max(abs(bl), abs(bh), 1)
        return -d, d
    if op == "neg":
        return -rs[0][1], -rs[0][0]
    if op == "abs":
        lo, hi = rs[0]
        return (0 if lo <= 0 <= hi else min(abs(lo), abs(hi))), max(abs(lo), abs(hi))
    if op == "not":
        return -rs[0][1] - 1, -rs[0][0] - 1
    if op in ("minimum", "maximum"):
        f = min if op == "minimum" else max
        return f(rs[0][0], rs[1][0]), f(rs[0][1], rs[1][1])
    if op == "where":
        return min(rs[0][0], rs[1][0]), max(rs[0][1], rs[1][1])
    if op == "clamp":
        lo, hi = rs[0]
        if args[1] is not None:
            lo, hi = max(lo, int(args[1])), max(hi, int(args[1]))
        if args[2] is not None:
            lo, hi = min(lo, int(args[2])), min(hi, int(args[2]))
        return lo, hi
    if op in ("and", "or", "xor"):
        if min(rs[0][0], rs[1][0]) >= 0:
            top = max(rs[0][1], rs[1][1])
            return (0, min(rs[0][1], rs[1][1])) if op == "and" else (0, 2 ** top.bit_length() - 1)
        lo, hi = min(rs[0][0], rs[1][0]), max(rs[0][1], rs[1][1])
        return (INT32 if INT32[0] <= lo and hi <= INT32[1] else None)
    if op in ("lshift", "rshift") and not isinstance(args[1], Ref) and 0 <= int(args[1]) < 64:
        c, (lo, hi) = int(args[1]), rs[0]
        return (lo << c, hi << c) if op == "lshift" else (lo >> c, hi >> c)
    return None


def int32_overflows(g: Graph, sizes: dict, bufs: tuple) -> bool:
    """Whether a value of ``g`` that the kernels compute in int32 where torch computes in
    int64 (from an index input or a bool used as an integer) can leave int32 at these
    ``sizes`` ({"b": batch, "h": heads, "q": seqlen_q, "k": seqlen_k}); ``bufs`` the
    captured tensors (:class:`flashgen.user_render.Buffer`).  Interval arithmetic over
    every integer node: the inputs in [0, size), captured integer tensors in their
    dtype's range, a float converted to an integer unbounded.  Raises UnsupportedError
    where such a value comes from ``torch.where`` (or a minimum, maximum) of Python
    integer constants alone, which :func:`widen` does not widen."""
    info: dict = {}  # node -> (torch int64 / kernel int32, from constants alone, kernel bits, range)

    def get(v):
        if isinstance(v, Ref):
            if g.nodes[v.i].dtype == "bool":  # int32 in the kernels; torch's: the other operand's (below)
                return False, False, 32, (0, 1)
            return info.get(v.i, (False, False, 64, None))
        if isinstance(v, (bool, int)):
            return False, False, (0 if INT32[0] <= int(v) <= INT32[1] else 64), (int(v), int(v))
        return False, False, 64, None

    for i, n in enumerate(g.nodes):
        if n.dtype != "int":
            continue
        op, args = n.op, n.args
        if op == "input":
            info[i] = (True, False, 32, (0, max(0, sizes[args[0]] - 1)))
            continue
        if op == "load":
            bits, rng = _INT_DTYPES.get(bufs[args[0]].dtype, (32, INT32))
            info[i] = (False, False, bits, rng)
            continue
        if op == "cast":  # to an int dtype, in both: an int source keeps its range where it fits
            bits, rng = _INT_DTYPES.get(args[1], (64, INT64))
            src = get(args[0])
            if g.dtype(args[0]) == "bool":
                rng = (0, 1)
            elif g.dtype(args[0]) == "int" and src[3] is not None and rng[0] <= src[3][0] and src[3][1] <= rng[1]:
                rng = src[3]
            elif g.dtype(args[0]) == "float" and bits == 64:
                rng = None
            info[i] = (False, False, bits, rng)
            continue
        operands = [args[1], args[2]] if op == "where" else [a for a in args if a is not None]
        vals = [get(a) for a in operands]
        if _bools_beside_constants(g, op, operands):  # torch: a bool beside Python integers is int64
            vals = [(True, False, 32, (0, 1)) if isinstance(a, Ref) else v for a, v in zip(operands, vals)]
        consts = op in ("where", "minimum", "maximum") and not any(isinstance(a, Ref) for a in
                                                                   (args[1:] if op == "where" else args))
        bits = max(v[2] for v in vals)
        narrow = bits <= 32 and (consts or any(v[0] for v in vals))
        from_consts = narrow and (consts or any(v[1] for v in vals if v[0]))
        rng = _range(op, args, [v[3] for v in vals])
        info[i] = (narrow, from_consts, bits, rng)
        if narrow and (rng is None or rng[0] < INT32[0] or rng[1] > INT32[1]):
            if from_consts:
                raise UnsupportedError("an integer computed from torch.where (or minimum, maximum) of Python integer "
                                       "constants alone can leave int32 here, where torch computes it in int64 and "
                                       "the kernels in int32: give one constant as a tensor or write "
                                       "torch.where(...).long() (an int64 cast)")
            return True
    return False


def _bools_beside_constants(g: Graph, op: str, operands) -> bool:
    """Whether the value ``operands`` of integer ``op`` are bools and Python constants
    alone, where torch makes the bools int64 and the kernels int32 (beside an integer
    tensor torch takes that tensor's dtype, as the kernels' int32 promotion does for
    int32 and int64 values)."""
    return (op in _ARITH and any(isinstance(a, Ref) for a in operands)
            and all(not isinstance(a, Ref) or g.dtype(a) == "bool" for a in operands))


def widen(g: Graph, refs: list) -> tuple[Graph, list]:
    """A copy of ``g`` computing as torch does: each index input (b, h, q, k), and each
    bool that integer arithmetic combines with Python constants alone, cast to int64
    before use (the rest unchanged, in order), and ``refs`` (values of ``g``: Refs,
    constants or None) as values of it.  Nodes equal after the casts are one node
    (two loads may become one: :class:`flashgen.user_mods._Widened` sums their
    derivatives)."""
    w, m = Graph(), {}

    def R(a):
        return m[a.i] if isinstance(a, Ref) else a

    for i, n in enumerate(g.nodes):
        if n.op == "input":
            r = w._add("input", n.args, n.dtype)
            m[i] = w._add("cast", (r, "int64"), "int") if n.args[0] in ("b", "h", "q", "k") else r
            continue
        args = [R(a) for a in n.args]
        first = 1 if n.op == "where" else 0  # where's condition stays a bool
        if n.dtype == "int" and _bools_beside_constants(w, n.op, [a for a in args[first:] if a is not None]):
            args = args[:first] + [w._add("cast", (a, "int64"), "int") if isinstance(a, Ref) else a
                                   for a in args[first:]]
        m[i] = w._add(n.op, tuple(args), n.dtype)
    return w, [R(r) for r in refs]


# -- 8- and 16-bit integers ---------------------------------------------------------------

#: The captured tensors' integer dtypes narrower than torch's int64 for the index inputs:
#: (bits, signed).  torch keeps an operation of such a tensor with Python integers (and
#: 0-dim tensors) in its dtype, the constants converted modulo 2**bits.
NARROW = {"uint8": (8, False), "int8": (8, True), "int16": (16, True), "int32": (32, True)}

#: Integer operations whose operands torch brings to one dtype (and Python integers
#: to it, modulo 2**bits), the comparisons included.
_NARROWED = ("add", "sub", "mul", "floordiv", "mod", "minimum", "maximum", "and", "or", "xor",
             "lshift", "rshift", "lt", "le", "gt", "ge", "eq", "ne", "where")


def narrow_dtype(g: Graph, bufs: tuple, v, memo: dict) -> str | None:
    """The dtype of the integer value ``v`` of ``g`` where torch and the kernels compute
    it in 8 or 16 bits (:data:`NARROW`): a captured tensor of such a dtype, a cast to
    one, and integer operations of such values with bools and Python constants; None
    for every other value (int32, int64, an index input, a bool, a float, a constant).
    ``bufs`` the captured tensors (:class:`flashgen.user_render.Buffer`); ``memo`` a
    dict kept for ``g``."""
    if not isinstance(v, Ref) or g.nodes[v.i].dtype != "int":
        return None
    if v.i in memo:
        return memo[v.i]
    n = g.nodes[v.i]
    out = None
    if n.op == "load":
        out = bufs[n.args[0]].dtype if bufs[n.args[0]].dtype in NARROW else None
    elif n.op == "cast":
        out = n.args[1] if n.args[1] in NARROW else None
    elif n.op in ("neg", "abs", "not", "clamp"):
        out = narrow_dtype(g, bufs, n.args[0], memo)
    elif n.op in _NARROWED:
        out = _narrow_of(g, bufs, n.args[1:] if n.op == "where" else n.args, memo)
    memo[v.i] = out
    return out


def _narrow_of(g: Graph, bufs: tuple, operands, memo: dict) -> str | None:
    """torch's dtype for integer ``operands`` where it is 8 or 16 bits, else None: the
    integer values among them that vary with an input (b, h, q, k, the score) decide it,
    a value that does not (a 0-dim tensor in torch: ``t[0]``, a captured scalar) only
    where none varies, as torch lets dimensioned tensors decide over 0-dim ones."""
    refs = [a for a in operands if isinstance(a, Ref) and g.nodes[a.i].dtype == "int"]
    use = [a for a in refs if g.deps(a)] or refs
    ds = [narrow_dtype(g, bufs, a, memo) for a in use]
    return _promote_narrow(ds) if use and None not in ds else None


def _promote_narrow(ds) -> str:
    """torch's promotion of the :data:`NARROW` dtypes (uint8 with int8 is int16, any of
    them with int32 int32)."""
    ds = set(ds)
    if len(ds) == 1:
        return ds.pop()
    return "int32" if "int32" in ds else "int16"


def wrap(c: int, dtype: str) -> int:
    """``c`` converted to ``dtype`` (:data:`NARROW`) as torch converts a Python integer
    beside a tensor of that dtype: modulo 2**bits."""
    bits, signed = NARROW[dtype]
    m = c % (1 << bits)
    return m - (1 << bits) if signed and m >= 1 << (bits - 1) else m


def checked(c: int, dtype: str, what: str) -> int:
    """``c`` converted to ``dtype`` as torch.where, torch.clamp and ** convert it: wrapped
    where torch allows (a negative value down to -max for an unsigned dtype), else
    UnsupportedError, as torch raises."""
    bits, signed = NARROW[dtype]
    lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (-((1 << bits) - 1), (1 << bits) - 1)
    if not lo <= c <= hi:
        raise UnsupportedError(f"{what}: the constant {c} cannot be converted to {dtype} without overflow "
                               f"(torch raises too)")
    return wrap(c, dtype)


def narrow_operands(g: Graph, bufs: tuple, op: str, vals: list, memo: dict) -> list:
    """The operands ``vals`` of integer ``op`` (``where``: condition, input, other) as the
    kernels must take them to compute in torch's dtype where that is 8 or 16 bits: a
    Python integer converted to it (torch wraps it; Triton refuses a constant outside
    the dtype), a bool and a narrow value of another dtype cast to it (torch computes
    uint8 with a bool in uint8, uint8 with int8 in int16; the kernels' promotion gives
    int32 and uint8).  Other operands unchanged; UnsupportedError for what torch
    refuses (``where`` with a constant that overflows the dtype) and for a shift of a
    narrow value by a constant outside [0, bits), whose result the kernels leave
    undefined."""
    first = 1 if op == "where" else 0
    ops = vals[first:]
    if op not in _NARROWED or any(g.dtype(a) == "float" for a in ops if isinstance(a, Ref)) \
            or any(isinstance(a, float) for a in ops):
        return vals
    t = _narrow_of(g, bufs, ops, memo)
    if t is None:
        return vals
    shift = op in ("lshift", "rshift")
    if shift and not isinstance(ops[1], Ref) and not 0 <= int(ops[1]) < NARROW[t][0]:
        raise UnsupportedError(f"a shift of a {t} value by {int(ops[1])} (flashgen: a constant shift of a "
                               f"{t} value lies in [0, {NARROW[t][0]}))")
    out = list(vals[:first])
    for n, a in enumerate(ops):
        if isinstance(a, Ref):
            # a bool, a narrow value of another dtype, a 0-dim value beside varying ones
            if g.dtype(a) == "bool" or narrow_dtype(g, bufs, a, memo) != t:
                a = g.cast(a, t, keep_width=True)
        elif isinstance(a, int) and not isinstance(a, bool) and not (shift and n == 1):
            a = checked(a, t, "torch.where") if op == "where" else wrap(a, t)
        out.append(a)
    return out


def narrow_bounds(g: Graph, bufs: tuple, x, lo, hi, memo: dict) -> tuple:
    """torch.clamp's constant bounds ``lo``, ``hi`` (None: unbounded) of the value ``x``
    converted to its dtype where that is 8 or 16 bits, as torch converts them
    (UnsupportedError where torch raises)."""
    d = narrow_dtype(g, bufs, x, memo)
    if d is None:
        return lo, hi
    return tuple(checked(b, d, "torch.clamp") if isinstance(b, int) and not isinstance(b, bool) else b
                 for b in (lo, hi))

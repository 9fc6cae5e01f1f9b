"""User score and mask functions in the generated kernels: a small expression IR, its
derivatives, its Triton code, and the rendering of the variants that carry it.  Pure:
no torch, no triton (:mod:`flashgen.user_mods` traces the functions into this IR).

The IR is a list of SSA nodes (:class:`Graph`); a value is a :class:`Ref` to a node or a
Python constant (bool, int, float).  Every node has a dtype category (``bool``,
``int``, ``float``: float32 in the kernels) and the set of inputs it depends on
(``s`` the score, ``b`` batch, ``h`` query head, ``q`` query row, ``k`` key column),
which says its shape in a tile (:func:`tile_axes`): ``s``/``q``+``k`` a (rows, cols)
tile, ``q`` a column vector, ``k`` a row vector, neither a scalar.  Captured tensors are
read by ``load`` nodes (buffers ``UT<n>`` with strides ``ut<n>_s<d>``; a buffer read at
an index that depends on the score also gets its sizes ``ut<n>_n<d>``, see
:meth:`_Code._load`).

A user variant's ``KernelSpec.mods`` is ``u`` + 12 hex digits of the sha256 of its IR
(and of this rendering machinery), + ``m`` when it has a mask function
(:func:`flashgen.spec.is_user_mods`).  Its source is the dense kernels' own templates
rendered with ``templates/_user_mods.j2`` appended to ``_common.j2`` (it redefines the
score-mod hooks: the score point, the mask predicate, the key/query block ranges) and
three hook lines inserted at fixed anchors (:data:`PATCHES`): the templates' files are
not changed, so no existing variant's code or hash changes.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
from pathlib import Path

import jinja2

from .errors import UnsupportedError
from .spec import is_user_mods
from .template_files import templates_dir, text_hash

LOG2E = 1.4426950408889634
LN2 = math.log(2.0)
INT32 = (-2 ** 31, 2 ** 31 - 1)
INT64 = (-2 ** 63, 2 ** 63 - 1)


@dataclasses.dataclass(frozen=True)
class Ref:
    """A reference to node ``i`` of a :class:`Graph`."""

    i: int


@dataclasses.dataclass(frozen=True)
class Node:
    op: str
    args: tuple
    dtype: str  # bool | int | float
    deps: frozenset


@dataclasses.dataclass(frozen=True)
class Buffer:
    """A captured tensor as the kernels see it: its dtype name (float32, float16,
    bfloat16, int64, int32, int16, int8, uint8; bool tensors arrive as int8), its number
    of dims, and whether its gradient is accumulated (float32, by atomics in bwd_dq)."""

    dtype: str
    ndim: int
    grad: bool = False

    @property
    def category(self) -> str:
        return "float" if self.dtype.startswith(("float", "bfloat")) else "int"


CASTS = {"float32": "float", "float64": "float", "float16": "float", "bfloat16": "float", "int64": "int",
         "int32": "int", "int16": "int", "int8": "int", "uint8": "int", "bool": "bool"}
_TL = {"float32": "tl.float32", "float64": "tl.float32", "float16": "tl.float16", "bfloat16": "tl.bfloat16",
       "int64": "tl.int64", "int32": "tl.int32", "int16": "tl.int16", "int8": "tl.int8", "uint8": "tl.uint8"}
_BIN = {"add": "+", "sub": "-", "mul": "*", "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!=",
        "and": "&", "or": "|", "xor": "^", "lshift": "<<", "rshift": ">>"}
_CMP = ("lt", "le", "gt", "ge", "eq", "ne")
_FLOAT_UNARY = {"exp": "tl.exp({})", "log": "tl.log({})", "sqrt": "tl.sqrt({})", "rsqrt": "tl.rsqrt({})",
                "sigmoid": "tl.sigmoid({})", "exp2": "tl.math.exp2({})", "log2": "tl.math.log2({})",
                "sin": "tl.sin({})", "cos": "tl.cos({})", "tanh": None}
_PY = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
       "lt": lambda a, b: a < b, "le": lambda a, b: a <= b, "gt": lambda a, b: a > b, "ge": lambda a, b: a >= b,
       "eq": lambda a, b: a == b, "ne": lambda a, b: a != b}


def _cat(v) -> str:
    if isinstance(v, bool):
        return "bool"
    return "int" if isinstance(v, int) else "float"


def tile_axes(deps) -> frozenset:
    """The tile axes ("q" rows, "k" columns) along which a value that depends on the
    inputs ``deps`` varies: one of the score is a (rows, cols) value like one of q and k
    together; else its q and k."""
    return frozenset(("q", "k")) if "s" in deps else frozenset(deps) & {"q", "k"}


def promote(a: str, b: str) -> str:
    """torch's promotion, by category (bool < int < float)."""
    if "float" in (a, b):
        return "float"
    if "int" in (a, b):
        return "int"
    return "bool"


class Graph:
    """SSA expression graph (see the module docstring); identical nodes are shared."""

    def __init__(self):
        self.nodes: list[Node] = []
        self._index: dict = {}

    # -- queries
    def dtype(self, v) -> str:
        return self.nodes[v.i].dtype if isinstance(v, Ref) else _cat(v)

    def deps(self, v) -> frozenset:
        return self.nodes[v.i].deps if isinstance(v, Ref) else frozenset()

    def uses(self, outs) -> list[int]:
        """Indices of the nodes the values ``outs`` need, in order."""
        need, todo = set(), [o.i for o in outs if isinstance(o, Ref)]
        while todo:
            i = todo.pop()
            if i in need:
                continue
            need.add(i)
            todo += [a.i for a in self.nodes[i].args if isinstance(a, Ref)]
        return sorted(need)

    def describe(self, outs) -> str:
        """A canonical text of the nodes ``outs`` need (what the hash covers)."""
        def arg(a):
            return f"%{a.i}" if isinstance(a, Ref) else f"{type(a).__name__}:{a!r}"
        lines = [f"%{i} = {self.nodes[i].op}({', '.join(arg(a) for a in self.nodes[i].args)}): {self.nodes[i].dtype}"
                 for i in self.uses(outs)]
        return "\n".join(lines + ["-> " + ", ".join(arg(o) if o is not None else "None" for o in outs)])

    # -- construction
    def _add(self, op, args, dtype):
        for a in args:
            if isinstance(a, int) and not isinstance(a, bool) and not INT64[0] <= a <= INT64[1]:
                raise UnsupportedError(f"integer constant {a} in '{op}' is outside the int64 range [-2**63, 2**63 - 1] "
                                       "(integers are int64 at most, as in torch): write it as a float")
        key = (op, tuple((type(a).__name__, a) for a in args), dtype)
        hit = self._index.get(key)
        if hit is not None:
            return hit
        if op == "input":
            deps = frozenset([args[0]])
        else:
            deps = frozenset().union(*(self.deps(a) for a in args if isinstance(a, Ref)))
        self.nodes.append(Node(op, tuple(args), dtype, deps))
        ref = self._index[key] = Ref(len(self.nodes) - 1)
        return ref

    def input(self, name: str, dtype: str) -> Ref:
        return self._add("input", (name,), dtype)

    def load(self, buf: int, bufinfo: Buffer, index: tuple) -> Ref:
        for a in index:
            if self.dtype(a) == "float":
                raise UnsupportedError("a captured tensor is indexed by a float value: convert the index with "
                                       ".long() / .to(torch.int64) (or torch.floor first)")
            if self.dtype(a) == "bool":
                raise UnsupportedError("a captured tensor is indexed by a bool value: torch reads a bool index as "
                                       "a mask, not as 0 / 1; convert it with .long() / .to(torch.int64)")
        dt = "bool" if bufinfo.dtype == "bool" else bufinfo.category
        return self._add("load", (buf, *index), dt)

    def binary(self, op: str, a, b):
        da, db = self.dtype(a), self.dtype(b)
        if op in _CMP:
            dt = "bool"
        elif op in ("and", "or", "xor"):
            dt = "bool" if da == db == "bool" else promote(da, db)
            if dt == "float":
                raise UnsupportedError(f"bitwise '{op}' of a float value")
            if dt == "bool":
                for x, y in ((a, b), (b, a)):
                    if isinstance(x, bool):
                        if op == "and":
                            return y if x else False
                        if op == "or":
                            return True if x else y
        elif op in ("lshift", "rshift"):
            if "float" in (da, db):
                raise UnsupportedError(f"'{op}' of a float value")
            dt = "int"
        elif op == "truediv":
            dt = "float"
        elif op == "pow":
            return self.pow(a, b)
        else:  # add sub mul floordiv mod minimum maximum
            dt = promote(da, db)
            if dt == "bool" and op in ("add", "sub", "mul", "floordiv", "mod"):
                dt = "int"
        if not isinstance(a, Ref) and not isinstance(b, Ref):
            return self._fold(op, a, b)
        return self._add(op, (a, b), dt)

    def _fold(self, op, a, b):
        if op in _PY:
            return _PY[op](a, b)
        if op == "truediv":
            return float(a) / float(b)
        if op == "floordiv":
            return a // b
        if op == "mod":
            return a % b
        if op == "minimum":
            return min(a, b)
        if op == "maximum":
            return max(a, b)
        if op == "and":
            return a & b
        if op == "or":
            return a | b
        if op == "xor":
            return a ^ b
        if op == "lshift":
            return a << b
        if op == "rshift":
            return a >> b
        raise UnsupportedError(f"constant {op}")

    def unary(self, op: str, a):
        dt = self.dtype(a)
        if not isinstance(a, Ref):
            return self._fold_unary(op, a)
        if op in _FLOAT_UNARY:
            return self._add(op, (a,), "float")
        if op in ("floor", "ceil", "trunc"):
            return a if dt != "float" else self._add(op, (a,), "float")
        if op == "neg":
            if dt == "bool":
                raise UnsupportedError("negation of a bool value (use ~ or torch.logical_not)")
            return self._add("neg", (a,), dt)
        if op == "abs":
            return a if dt == "bool" else self._add("abs", (a,), dt)
        if op == "not":
            return self._add("not", (a,), dt)
        if op == "sign":
            if dt == "bool":
                return a  # torch: sign(True) is True, sign(False) False
            zero = 0.0 if dt == "float" else 0
            one = 1.0 if dt == "float" else 1
            return self.where(self.binary("gt", a, zero), one,
                              self.where(self.binary("lt", a, zero), -one, zero))
        raise UnsupportedError(f"operation '{op}'")

    def _fold_unary(self, op, a):
        f = {"exp": math.exp, "log": math.log, "sqrt": math.sqrt, "sigmoid": lambda x: 1 / (1 + math.exp(-x)),
             "exp2": lambda x: 2.0 ** x, "log2": math.log2, "sin": math.sin, "cos": math.cos, "tanh": math.tanh,
             "rsqrt": lambda x: x ** -0.5, "floor": math.floor, "ceil": math.ceil, "trunc": math.trunc,
             "neg": lambda x: -x, "abs": abs, "not": lambda x: (not x) if isinstance(x, bool) else ~x,
             "sign": lambda x: (x > 0) - (x < 0)}[op]
        return f(a)

    def pow(self, a, b):
        """torch's ``a ** b``: a constant integral exponent by repeated multiplication (so
        negative bases keep their sign, and integers stay integers, wrapping in int64 as
        torch's do); other constant exponents and float tensor exponents through
        exp2(b log2|a|) with torch's signs (a negative base to an integral power: the
        sign of its parity; to another power: NaN; anything to the power 0: 1).  Raises
        UnsupportedError for what the kernels would not compute as torch does: an
        integer to a negative constant power (torch refuses it) or to an integer tensor
        power."""
        fa = self.dtype(a) == "float" or isinstance(b, float) or self.dtype(b) == "float"
        if not isinstance(a, Ref) and not isinstance(b, Ref):
            return _fold_pow(a, b)
        if not isinstance(b, Ref):
            if float(b).is_integer() and abs(b) <= 1 << 16:
                n = int(b)
                if n == 0:
                    return 1.0 if fa else 1
                if n < 0 and not fa:
                    raise UnsupportedError("an integer raised to a negative integer power (torch refuses it: "
                                           "'Integers to negative integer powers are not allowed'); write the base "
                                           "as a float")
                base = a if self.dtype(a) == "float" or not fa else self.cast(a, "float32")
                out = self._ipow(base, abs(n))
                return out if n > 0 else self.binary("truediv", 1.0, out)
            if b == 0.5:
                return self.unary("sqrt", a)
            if b == -0.5:
                return self.unary("rsqrt", a)
        elif not fa:
            raise UnsupportedError("an integer raised to an integer tensor power (torch computes it in integers, "
                                   "the kernels would not): write the base or the exponent as a float (e.g. "
                                   "2.0 ** kv_idx), or use a constant exponent")
        return self._add("pow", (a, b), "float")

    def _ipow(self, x, n: int):
        """x ** n for a constant n >= 1 by multiplications: x * x * ... for n <= 4, else
        by squaring."""
        if n <= 4:
            out = x
            for _ in range(n - 1):
                out = self.binary("mul", out, x)
            return out
        out = None
        while n:
            if n & 1:
                out = x if out is None else self.binary("mul", out, x)
            n >>= 1
            if n:
                x = self.binary("mul", x, x)
        return out

    def where(self, c, a, b):
        if isinstance(c, bool):
            return a if c else b
        if self.dtype(c) != "bool":
            c = self.binary("ne", c, 0)
        return self._add("where", (c, a, b), promote(self.dtype(a), self.dtype(b)))

    def clamp(self, x, lo=None, hi=None):
        """torch.clamp with constant bounds (None: unbounded)."""
        dt = promote(self.dtype(x), promote(_cat(lo) if lo is not None else "bool",
                                            _cat(hi) if hi is not None else "bool"))
        if lo is None and hi is None:
            raise UnsupportedError("torch.clamp with neither min nor max")
        for name, bound in (("min", lo), ("max", hi)):
            if isinstance(bound, float) and math.isnan(bound):
                # torch's CPU kernel gives NaN; its CUDA kernel for a single bound gives
                # the input ((x < nan) ? nan : x): no one answer to compile
                raise UnsupportedError(f"torch.clamp with {name}=nan: torch's CPU and CUDA kernels "
                                       f"disagree (NaN on the CPU, the input on CUDA)")
        return self._add("clamp", (x, lo, hi), dt)

    def cast(self, a, target: str, keep_width: bool = False):
        """``a`` converted to ``target``.  ``keep_width``: an integer's cast to int32 or
        int64 is a node of its own (the kernels' integer width is not torch's:
        :mod:`flashgen.user_ints`), else the value as it is."""
        if target not in CASTS:
            raise UnsupportedError(f"conversion to {target}")
        cat = CASTS[target]
        if not isinstance(a, Ref):
            return {"float": float, "int": int, "bool": bool}[cat](a)
        if keep_width and cat == "int" and self.dtype(a) == "int" and target in ("int32", "int64"):
            return self._add("cast", (a, target), "int")
        if self.dtype(a) == cat and target in ("float32", "float64", "int64", "int32", "bool"):
            return a
        return self._add("cast", (a, target), cat)


# -- derivatives (forward mode over the graph) ---------------------------------------

def derivative(g: Graph, out, wrt: Ref):
    """d out / d wrt as a value of ``g`` (None: identically zero).  ``wrt``: the score
    input or a load node.  torch's conventions where the derivative is undefined: abs'(0)
    = 0, clamp passes the gradient where lo <= x <= hi, ties of minimum/maximum split it."""
    if not isinstance(out, Ref):
        return None
    t: dict[int, object] = {}

    def T(v):
        return t.get(v.i) if isinstance(v, Ref) else None

    def add(x, y):
        if x is None:
            return y
        if y is None:
            return x
        return g.binary("add", x, y)

    def mul(x, y):
        if x is None or y is None:
            return None
        if not isinstance(x, Ref) and x == 1:
            return y
        if not isinstance(y, Ref) and y == 1:
            return x
        return g.binary("mul", x, y)

    def smul(x, slope):
        """x * slope for a slope that can be infinite (log, sqrt and the like at 0): 0
        where x is 0, as torch's backward gives where a clamp, a where or a maximum
        before the operation has cut the gradient off (it selects, so 0 * inf never
        forms a NaN)."""
        if x is None:
            return None
        if not isinstance(x, Ref):
            return mul(x, slope)
        return g.where(g.binary("eq", x, 0.0), 0.0, g.binary("mul", x, slope))

    def neg(x):
        return None if x is None else g.unary("neg", x)

    def z(x):
        return 0.0 if x is None else x

    for i in range(out.i + 1):
        n = g.nodes[i]
        r = Ref(i)
        if r == wrt:
            t[i] = 1.0
            continue
        if n.dtype != "float" or n.op in ("input", "load", "floor", "ceil", "trunc"):
            continue
        a = n.args[0] if n.args else None
        b = n.args[1] if len(n.args) > 1 else None
        ta, tb = T(a), (T(b) if n.op not in ("clamp", "cast") else None)
        op = n.op
        if op == "add":
            d = add(ta, tb)
        elif op == "sub":
            d = add(ta, neg(tb))
        elif op == "neg":
            d = neg(ta)
        elif op == "mul":
            d = add(mul(ta, b), mul(a, tb))
        elif op == "truediv":
            # d(a / b) = da / b - (a / b) db / b
            inv = g.binary("truediv", 1.0, b)
            d = add(smul(ta, inv), neg(smul(tb, g.binary("mul", r, inv))))
        elif op == "pow":
            # torch's pow backward: no gradient to the base where the exponent is 0, none
            # to the exponent where the base is 0 and the exponent >= 0
            if not isinstance(b, Ref) and b == 0:
                da = None
            else:
                da = smul(ta, g.binary("mul", b, g.pow(a, g.binary("sub", b, 1))))
                if isinstance(b, Ref) and da is not None:
                    da = g.where(g.binary("eq", b, 0.0), 0.0, da)
            if tb is None:
                d = da
            else:
                db = smul(tb, g.binary("mul", r, g.unary("log", a)))
                if db is not None:
                    db = g.where(g.binary("and", g.binary("eq", a, 0.0), g.binary("ge", b, 0.0)), 0.0, db)
                d = add(da, db)
        elif op == "tanh":
            d = mul(ta, g.binary("sub", 1.0, g.binary("mul", r, r)))
        elif op == "exp":
            d = mul(ta, r)
        elif op == "exp2":
            d = mul(ta, g.binary("mul", r, LN2))
        elif op == "log":
            d = smul(ta, g.binary("truediv", 1.0, a))
        elif op == "log2":
            d = smul(ta, g.binary("truediv", 1.0 / LN2, a))
        elif op == "sqrt":
            d = smul(ta, g.binary("truediv", 0.5, r))
        elif op == "rsqrt":
            d = smul(ta, g.binary("mul", -0.5, g.binary("truediv", r, a)))
        elif op == "sigmoid":
            d = mul(ta, g.binary("mul", r, g.binary("sub", 1.0, r)))
        elif op == "sin":
            d = mul(ta, g.unary("cos", a))
        elif op == "cos":
            d = mul(ta, g.unary("neg", g.unary("sin", a)))
        elif op == "abs":
            d = mul(ta, g.unary("sign", a))
        elif op in ("minimum", "maximum"):
            if ta is None and tb is None:
                d = None
            else:
                first, second = ("lt", "gt") if op == "minimum" else ("gt", "lt")
                half = g.binary("mul", 0.5, add(ta, tb))
                d = g.where(g.binary(first, a, b), z(ta), g.where(g.binary(second, a, b), z(tb), half))
        elif op == "clamp":
            lo, hi = n.args[1], n.args[2]
            inside = True
            if lo is not None:
                inside = g.binary("and", inside, g.binary("ge", a, lo))
            if hi is not None:
                inside = g.binary("and", inside, g.binary("le", a, hi))
            d = None if ta is None else g.where(inside, ta, 0.0)
        elif op == "where":
            tx, ty = T(n.args[1]), T(n.args[2])
            d = None if tx is None and ty is None else g.where(a, z(tx), z(ty))
        elif op == "cast":
            d = ta if g.dtype(a) == "float" else None
        elif op == "floordiv":
            d = None
        elif op == "mod":
            d = add(ta, neg(mul(tb, g.unary("floor", g.binary("truediv", a, b)))))
        else:
            raise UnsupportedError(f"the derivative of operation '{op}'")
        if d is not None:
            t[i] = d
    return t.get(out.i)


# -- masks that are bands on kv - q -------------------------------------------------

_FLIP = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "eq": "eq"}


def _affine(g: Graph, v):
    """``v`` as (a, c, e) with v = a * q + c * k + e (integers), or None when it is not an
    integer affine function of the query row and key column alone."""
    if not isinstance(v, Ref):
        return (0, 0, v) if isinstance(v, int) and not isinstance(v, bool) else None
    n = g.nodes[v.i]
    if n.dtype != "int":
        return None
    if n.op == "input":
        return {"q": (1, 0, 0), "k": (0, 1, 0)}.get(n.args[0])
    if n.op == "cast":
        x = _affine(g, n.args[0]) if n.args[1] in ("int32", "int64") and g.dtype(n.args[0]) == "int" else None
        # an int32 cast is the identity only where the value cannot wrap: kv - q and
        # offsets far inside int32 (q and k below 2**30)
        if x is not None and n.args[1] == "int32" and not (abs(x[0]) <= 1 and abs(x[1]) <= 1 and abs(x[2]) < 1 << 29):
            return None
        return x
    if n.op == "neg":
        x = _affine(g, n.args[0])
        return None if x is None else tuple(-t for t in x)
    if n.op in ("add", "sub", "mul"):
        x, y = _affine(g, n.args[0]), _affine(g, n.args[1])
        if x is None or y is None:
            return None
        if n.op == "add":
            return tuple(a + b for a, b in zip(x, y))
        if n.op == "sub":
            return tuple(a - b for a, b in zip(x, y))
        if x[:2] == (0, 0):
            return tuple(x[2] * t for t in y)
        if y[:2] == (0, 0):
            return tuple(y[2] * t for t in x)
    return None


def band(g: Graph, out):
    """(lo, hi) when the mask function's result ``out`` is exactly lo <= kv - q <= hi
    (None: that side unbounded): a conjunction (``&``, ``torch.logical_and``) of
    comparisons of integer affine functions of q_idx and kv_idx that depend on them
    through kv - q only (``q_idx - kv_idx <= 256``, ``kv_idx <= q_idx``), the kernels'
    own window bounds.  None for any other mask (or an empty band)."""
    if out is True:
        return (None, None)
    if not isinstance(out, Ref):
        return None
    n = g.nodes[out.i]
    if n.op == "and" and n.dtype == "bool":
        x, y = band(g, n.args[0]), band(g, n.args[1])
        if x is None or y is None:
            return None
        lo = max((t for t in (x[0], y[0]) if t is not None), default=None)
        hi = min((t for t in (x[1], y[1]) if t is not None), default=None)
        return None if lo is not None and hi is not None and lo > hi else (lo, hi)
    if n.op not in _FLIP:
        return None
    x, y = _affine(g, n.args[0]), _affine(g, n.args[1])
    if x is None or y is None:
        return None
    # coefficients whose products with q and k (below 2**31) could wrap int64, as torch's
    # would: not a band
    if any(abs(t[0]) >= 1 << 31 or abs(t[1]) >= 1 << 31 or abs(t[2]) >= 1 << 61 for t in (x, y)):
        return None
    a, c, e = (u - v for u, v in zip(x, y))  # a q + c k + e  <op>  0
    if c == 0 or a != -c:
        return None
    op, t = n.op, -e  # c d <op> t, d = kv - q
    if c < 0:
        op, c, t = _FLIP[op], -c, -t
    if op == "lt":
        op, t = "le", t - 1
    elif op == "gt":
        op, t = "ge", t + 1
    if op == "le":
        return (None, t // c)
    if op == "ge":
        return (-(-t // c), None)
    return (t // c, t // c) if t % c == 0 else None  # eq


# -- Triton code ------------------------------------------------------------------------

def _lit(v) -> str:
    """A constant as Triton code.  An integer outside int32 is an int64 scalar: Triton
    casts a Python int combined with an int32 tensor (q_idx, kv_idx) to int32, where
    torch computes in int64; the arithmetic it enters is then int64, as torch's is."""
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int):
        return str(v) if INT32[0] <= v <= INT32[1] else f"tl.full([], {v}, tl.int64)"
    if math.isnan(v):
        return 'float("nan")'
    if math.isinf(v):
        return 'float("inf")' if v > 0 else 'float("-inf")'
    return repr(float(v))


class _Code:
    """Emits the nodes of ``g`` as Triton statements ``<prefix><i> = ...``.  ``names``
    maps the inputs to expressions; ``valid`` gives the in-range predicates of the
    query rows ('q') and key columns ('k') that mask captured-tensor loads;
    ``offsets``: load nodes whose offset is kept in ``u_off<i>`` (gradients);
    ``hoisted``: nodes computed once per program (:func:`program_constant`), which
    arrive by name."""

    def __init__(self, g: Graph, names: dict, prefix: str, bufs: tuple, valid: dict, offsets=(), base: int = 0,
                 hoisted=()):
        self.g, self.names, self.prefix, self.bufs, self.valid, self.base = g, names, prefix, bufs, valid, base
        self.offsets = set(offsets)
        self.lines: list[str] = []
        self.done: set[int] = set(hoisted)

    def name(self, v) -> str:
        if not isinstance(v, Ref):
            return _lit(v)
        n = self.g.nodes[v.i]
        if n.op == "input":
            return self.names[n.args[0]]
        return f"{self.prefix}{v.i}"

    def f(self, v) -> str:
        """``v`` as a float32 expression."""
        if not isinstance(v, Ref):
            return _lit(float(v))
        return self.name(v) if self.g.dtype(v) == "float" else f"{self.name(v)}.to(tl.float32)"

    def i(self, v) -> str:
        """``v`` as an integer expression (bools become 0/1)."""
        if not isinstance(v, Ref):
            return _lit(int(v))
        return f"{self.name(v)}.to(tl.int32)" if self.g.dtype(v) == "bool" else self.name(v)

    def num(self, v, dtype) -> str:
        return self.f(v) if dtype == "float" else self.i(v)

    def emit(self, outs) -> None:
        for i in self.g.uses(outs):
            if i in self.done:
                continue
            self.done.add(i)
            n = self.g.nodes[i]
            if n.op == "input":
                continue
            if n.op == "load":
                self.lines += self._load(i, n)
            else:
                self.lines.append(f"{self.prefix}{i} = {self._expr(n)}")

    def _rows_minus_cols(self, a, b) -> bool:
        """Whether ``a`` depends on the query row and not on the key column, ``b`` the
        other way round."""
        da, db = self.g.deps(a), self.g.deps(b)
        return "q" in da and "k" not in da and "k" in db and "q" not in db

    def _floordiv_int(self, a, b) -> str:
        """Floor division from Triton's truncating ``//`` and remainder ``%``: one less
        where the remainder is nonzero and of the other sign than the divisor (which a
        floor ``//`` and ``%``, as torch's, never give: the same text floors under both).
        No intermediate leaves the operands' width (``-a + b - 1`` and ``|a|`` overflowed
        within |b| of the width's minimum)."""
        A, B = self.i(a), self.i(b)
        if not isinstance(b, Ref):
            return f"tl.where({A} % {B} {'<' if b > 0 else '>'} 0, {A} // {B} - 1, {A} // {B})"
        return f"tl.where(({A} % {B} != 0) & (({A} % {B} < 0) != ({B} < 0)), {A} // {B} - 1, {A} // {B})"

    def _expr(self, n: Node) -> str:
        op, args, dt = n.op, n.args, n.dtype
        if op == "sub" and dt == "int" and self._rows_minus_cols(*args):
            # q - k as -(k - q): the kernels' own bounds form k - q, and Triton 3.6's
            # sm_90 code for (rows - cols) keeps a row offset per row and loses the
            # tile's shared diagonals (ALiBi's |q - k|: 30 abs per thread against 18)
            return f"-({self.num(args[1], dt)} - {self.num(args[0], dt)})"
        if op in ("add", "sub", "mul"):
            return f"{self.num(args[0], dt)} {_BIN[op]} {self.num(args[1], dt)}"
        if op in _CMP:
            return f"{self.name(args[0])} {_BIN[op]} {self.name(args[1])}"
        if op in ("and", "or", "xor", "lshift", "rshift"):
            return f"{self.name(args[0])} {_BIN[op]} {self.name(args[1])}"
        if op == "truediv":
            return f"{self.f(args[0])} / {self.f(args[1])}"
        if op == "floordiv":
            if dt == "float":
                return f"tl.floor({self.f(args[0])} / {self.f(args[1])})"
            return self._floordiv_int(*args)
        if op == "mod":
            a, b = args
            if dt == "float":
                return f"{self.f(a)} - {self.f(b)} * tl.floor({self.f(a)} / {self.f(b)})"
            return f"{self.i(a)} - {self.i(b)} * ({self._floordiv_int(a, b)})"
        if op == "pow":
            A, B = self.f(args[0]), self.f(args[1])
            if not isinstance(args[1], Ref):
                # a constant exponent that is not an integer: NaN for a negative base
                # (log2), 0 or inf at 0, as torch
                return f"tl.math.exp2({B} * tl.math.log2({A}))"
            # a tensor exponent: |a|^b with torch's sign for a negative base (the
            # parity's for an integral b, else NaN: the sqrt of the negative base), and 1
            # at b = 0 whatever a is
            m = f"tl.math.exp2({B} * tl.math.log2(tl.abs({A})))"
            return (f"tl.where({B} == 0.0, 1.0, tl.where({A} < 0.0, tl.where(tl.floor({B}) == {B}, "
                    f"tl.where(tl.floor({B} * 0.5) * 2.0 == {B}, {m}, -{m}), tl.sqrt({A})), {m}))")
        if op == "neg":
            return f"-{self.name(args[0])}"
        if op == "abs":
            return f"tl.abs({self.name(args[0])})"
        if op == "not":
            return f"{self.name(args[0])} == 0" if self.g.dtype(args[0]) == "bool" else f"~{self.name(args[0])}"
        if op == "tanh":
            # As the built-in softcap: Taylor series for |x| < 1/4, else 1 - 2 / (e^(2x) + 1).
            x = self.f(args[0])
            return (f"tl.where({x} * {x} < 0.0625, {x} * (1.0 + {x} * {x} * (-0.3333333333333333 + {x} * {x} * "
                    f"(0.13333333333333333 + {x} * {x} * (-0.05396825396825397 + {x} * {x} * 0.021869488536155203)))), "
                    f"1.0 - 2.0 / (tl.math.exp2({x} * 2.8853900817779268) + 1.0))")
        if op in _FLOAT_UNARY:
            return _FLOAT_UNARY[op].format(self.f(args[0]))
        if op in ("floor", "ceil"):
            return f"tl.{op}({self.f(args[0])})"
        if op == "trunc":
            x = self.f(args[0])
            return f"tl.where({x} >= 0, tl.floor({x}), tl.ceil({x}))"
        if op in ("minimum", "maximum"):
            a, b = self.num(args[0], dt), self.num(args[1], dt)
            cmp = "<" if op == "minimum" else ">"
            # a NaN in either argument is the result, as torch's (a NaN a: a != a)
            if dt == "float" and isinstance(args[0], Ref):
                return f"tl.where(({a} {cmp} {b}) | ({a} != {a}), {a}, {b})"
            return f"tl.where({a} {cmp} {b}, {a}, {b})"
        if op == "clamp":
            x, lo, hi = self.num(args[0], dt), args[1], args[2]
            for bound, cmp in ((lo, "<"), (hi, ">")):
                if bound is None:
                    continue
                B = _lit(float(bound) if dt == "float" else bound)
                x = f"tl.where({x} {cmp} {B}, {B}, {x})"
            return x
        if op == "where":
            c, a, b = args
            A = self.num(a, dt) if dt != "bool" else self.name(a)
            B = self.num(b, dt) if dt != "bool" else self.name(b)
            return f"tl.where({self.name(c)}, {A}, {B})"
        if op == "cast":
            a, target = args
            src = self.g.dtype(a)
            if target == "bool":
                return f"{self.name(a)} != 0"
            if target in ("float16", "bfloat16"):
                return f"{self.f(a)}.to({_TL[target]}).to(tl.float32)"
            if CASTS[target] == "float":
                return self.f(a)
            # a bool, and a float to a narrow integer, pass through a wider integer as torch's
            # casts do: int32 for int16 and int8, int64 for uint8 (c10's conversion); the
            # float's conversion to it is the device's (saturating on the GPU)
            x = self.name(a)
            if src == "bool" or (src == "float" and target in ("int16", "int8")):
                x = f"{x}.to(tl.int32)"
            elif src == "float" and target == "uint8":
                x = f"{x}.to(tl.int64)"
            return f"{x}.to({_TL[target]})"
        raise UnsupportedError(f"operation '{op}'")

    def _load(self, i: int, n: Node) -> list[str]:
        buf, index = self.base + n.args[0], n.args[1:]
        info = self.bufs[buf]
        terms = [f"{self.i(a) if isinstance(a, Ref) else _lit(int(a))}"
                 + (".to(tl.int64)" if isinstance(a, Ref) else "") + f" * ut{buf}_s{d}" for d, a in enumerate(index)]
        off = " + ".join(terms) if terms else "0"
        out = []
        if i in self.offsets:
            out.append(f"u_off{i} = {off}")
            off = f"u_off{i}"
        if "s" in n.deps:
            # an index computed from the score is known in the kernel only: every dim is
            # checked against the tensor's size (u_ok<i>); the score function's result is
            # NaN where it is out of range (Context.score_block), nothing is read there
            ok = []
            for d, a in enumerate(index):
                size = f"ut{buf}_n{d}"
                if isinstance(a, Ref):
                    ok.append(f"({self.i(a)} >= 0) & ({self.i(a)} < {size})")
                else:
                    ok.append(f"({_lit(int(a))} < {size})" if int(a) >= 0 else f"({size} < 0)")
            # != 0: a bool tile (Triton 3.9's interpreter keeps a scalar condition and'ed
            # in as int32, and its masked load refuses an int32 mask)
            out.append(f"u_ok{i} = ({' & '.join(ok)}) != 0")
            masks = [f"u_ok{i}"]
        else:
            masks = [self.valid[x] for x in ("q", "k") if x in tile_axes(n.deps)]
        mask = f", mask={' & '.join(masks)}, other=0" if masks else ""
        expr = f"tl.load(UT{buf} + {off}{mask})"
        if info.dtype in ("float16", "bfloat16"):
            expr += ".to(tl.float32)"
        elif info.dtype == "bool":
            expr = f"{expr} != 0"
        out.append(f"{self.prefix}{i} = {expr}")
        return out


def program_constant(g: Graph, outs, keep=()) -> list[int]:
    """The nodes among those ``outs`` need that depend on nothing but the batch and head
    indices (``slopes[h]``, ``table[0]``) and that a node of the tile (or an output)
    reads: computed once per program (per head in bwd_dkdv's loop over the group)
    instead of once per tile.  ``keep``: nodes that stay in the tile (gradient loads,
    whose offsets the tile's atomics reuse)."""
    need = g.uses(outs)
    const = {i for i in need if g.nodes[i].op != "input" and g.nodes[i].deps <= {"b", "h"} and i not in keep}
    used = {o.i for o in outs if isinstance(o, Ref)}
    for i in need:
        if i not in const:
            used.update(a.i for a in g.nodes[i].args if isinstance(a, Ref))
    return sorted(const & used)


# -- what a variant carries ---------------------------------------------------------

@dataclasses.dataclass(frozen=True, eq=False)
class Lowered:
    """One direction's user functions, lowered: ``direction`` "fwd" (the forward kernel)
    or "bwd" (bwd_dq and bwd_dkdv).  ``score``: the score function's graph with
    ``score_out`` its result, ``dscore`` d out / d score and ``grads`` the (load node,
    buffer, d out / d load) of captured tensors whose gradient bwd_dq accumulates;
    ``mask``/``mask_out`` the mask function's; ``bufs`` the captured tensors, the score
    function's then the mask function's (its loads' buffer n is ``mask_base + n``); ``sinks``: one learnable logit per head in the softmax denominator;
    ``guard``: the score function may produce -inf or overflow (clamped as a bias is)."""

    direction: str
    score: Graph | None
    score_out: object
    dscore: object
    grads: tuple
    mask: Graph | None
    mask_out: object
    mask_base: int
    bufs: tuple
    sinks: bool
    guard: bool

    def describe(self) -> str:
        parts = [f"direction {self.direction}", f"sinks {self.sinks}", f"guard {self.guard}",
                 "bufs " + ", ".join(f"{b.dtype}[{b.ndim}]{'+grad' if b.grad else ''}" for b in self.bufs)]
        if self.score is not None:
            outs = [self.score_out]
            if self.direction == "bwd":
                outs += [self.dscore] + [d for _, _, d in self.grads]
            parts += ["score:", self.score.describe(outs), f"grads {[(i, b) for i, b, _ in self.grads]}"]
        if self.mask is not None:
            parts += [f"mask (buffers from {self.mask_base}):", self.mask.describe([self.mask_out])]
        return "\n".join(parts)

    def score_outs(self, kernel: str) -> list:
        """The score graph's values ``kernel`` computes: the modified score, and in the
        backward its derivative, and in bwd_dq the captured tensors' derivatives."""
        outs = [self.score_out]
        if kernel != "fwd":
            outs.append(self.dscore)
        if kernel == "bwd_dq":
            outs += [d for _, _, d in self.grads]
        return outs

    @functools.cached_property
    def sized_bufs(self) -> frozenset:
        """The captured tensors (buffer numbers) that the score function reads at an index
        depending on the score: the kernels take their sizes (``ut<n>_n<d>``) and check
        those reads (:meth:`_Code._load`); the host checks every other index
        (:mod:`flashgen.user_bounds`)."""
        if self.score is None or not isinstance(self.score_out, Ref):
            return frozenset()
        return frozenset(self.score.nodes[i].args[0] for i in self.score.uses([self.score_out])
                         if self.score.nodes[i].op == "load" and "s" in self.score.nodes[i].deps)

    @functools.cached_property
    def band(self):
        """(lo, hi) when the mask function is a band lo <= kv - q <= hi (:func:`band`):
        the kernels tighten their own bounds on j - i to it and evaluate no mask
        function (no predicate, no block mask: the window's tile ranges); else None."""
        b = band(self.mask, self.mask_out) if self.mask is not None else None
        if b is None:
            return None
        lo, hi = b
        # j - i lies in (-2**31, 2**31) and diag_lo / diag_hi are int32: a bound past int32
        # binds nothing, one beyond the other side leaves nothing visible (the predicate's)
        if (lo is not None and lo > INT32[1]) or (hi is not None and hi < INT32[0]):
            return None
        return (None if lo is None or lo <= INT32[0] else lo, None if hi is None or hi >= INT32[1] else hi)

    @functools.cached_property
    def name(self) -> str:
        """The ``KernelSpec.mods`` of this lowering (:func:`flashgen.spec.is_user_mods`)."""
        h = hashlib.sha256((machinery_hash() + "\n" + self.describe()).encode()).hexdigest()[:12]
        return f"u{h}" + ("m" if self.mask is not None else "")


_registry: dict[str, Lowered] = {}


def register(low: Lowered) -> str:
    """Make ``low`` renderable under its name (process-wide); returns the name."""
    _registry.setdefault(low.name, low)
    return low.name


def registered(mods: str) -> Lowered | None:
    """The lowering registered under ``mods``, or None."""
    return _registry.get(mods)


def lowered(mods: str) -> Lowered:
    try:
        return _registry[mods]
    except KeyError:
        raise UnsupportedError(f"user score/mask functions {mods!r} are not known to this process: they are "
                               "registered when flashgen.attention is called with them") from None


# -- render-time context (the `user` object the overlay macros call) -----------------

_DENSE = ("fwd", "bwd_dq", "bwd_dkdv")


class Context:
    """What ``templates/_user_mods.j2`` asks while one kernel of a user variant renders."""

    def __init__(self, low: Lowered, kernel: str):
        if kernel not in _DENSE:
            raise UnsupportedError(f"user score/mask functions are compiled into {_DENSE}, not {kernel!r}")
        self.low, self.kernel = low, kernel

    @property
    def modifies_scores(self) -> bool:
        """Whether the scores reach the softmax already modified and in base 2 (a score
        function); a mask function alone leaves the kernels' own scaling, qk_scale
        folded into the exp2 argument as in the built-in kernels."""
        return self.low.score is not None

    @property
    def mask(self) -> bool:
        """Whether the kernels evaluate a mask function (its predicate in masked tiles, its
        block mask's ranges); a band (:attr:`Lowered.band`) only tightens the bounds."""
        return self.low.mask is not None and self.low.band is None

    def _hoisted(self) -> list[tuple[Graph, str, list[int], int]]:
        """(graph, prefix, program-constant nodes, buffer base) of the score and mask
        functions in this kernel (:func:`program_constant`)."""
        low, out = self.low, []
        if low.score is not None:
            keep = [i for i, _, _ in low.grads] if self.kernel == "bwd_dq" else []
            out.append((low.score, "u", program_constant(low.score, low.score_outs(self.kernel), keep), 0))
        if self.mask:
            out.append((low.mask, "um", program_constant(low.mask, [low.mask_out]), low.mask_base))
        return out

    def _hoisted_names(self) -> str:
        return "".join(f"{prefix}{i}, " for _, prefix, nodes, _ in self._hoisted() for i in nodes)

    def setup(self, z: str, h: str, indent: str) -> str:
        """Once per program (bwd_dkdv: per query head of the group), before the tiles: the
        values of the functions that depend on the batch and head alone (a captured
        tensor read at [h]), passed to the tiles by name."""
        lines = []
        for g, prefix, nodes, base in self._hoisted():
            if nodes:
                code = _Code(g, {"b": z, "h": h}, prefix, self.low.bufs, {}, base=base)
                code.emit([Ref(i) for i in nodes])
                lines += code.lines
                # a scalar bool of a float comparison (t[h] != t[h]) is a NumPy value in
                # Triton's interpreter that | and & then refuse; != 0 makes it a plain bool
                lines += [f"{prefix}{i} = {prefix}{i} != 0" for i in nodes if g.nodes[i].dtype == "bool"]
        if not lines:
            return ""
        return "".join(f"{indent}{x}\n" for x in ["# user functions' per-(batch, head) values", *lines])

    def bounds(self) -> str:
        """A band mask: the kernels' bounds on j - i tightened to it (before the ranges)."""
        lo, hi = self.low.band if self.low.band is not None else (None, None)
        out = "" if lo is None and hi is None else "    # user mask function: the band lo <= j - i <= hi\n"
        if lo is not None:
            out += f"    diag_lo = tl.maximum(diag_lo, {lo})\n"
        if hi is not None:
            out += f"    diag_hi = tl.minimum(diag_hi, {hi})\n"
        return out

    @property
    def guard(self) -> bool:
        return self.low.score is not None and self.low.guard

    def _grad_bufs(self):
        return [n for n, b in enumerate(self.low.bufs) if b.grad] if self.kernel == "bwd_dq" else []

    def _buf_params(self) -> str:
        out = ""
        for n, b in enumerate(self.low.bufs):
            out += f"UT{n}, " + "".join(f"ut{n}_s{d}, " for d in range(b.ndim))
            if n in self.low.sized_bufs:
                out += "".join(f"ut{n}_n{d}, " for d in range(b.ndim))
        return out + "".join(f"UG{n}, " for n in self._grad_bufs())

    def tile_args(self, params: bool) -> str:
        """The extra arguments of the kernels' _tile() (``params``: its def)."""
        if self.low.score is None and not self.mask:
            return ""
        out = "sm_scale, " if self.low.score is not None else ""
        out += "u_z, u_h, " if params else "off_z, off_h, "
        return out + self._buf_params() + self._hoisted_names()

    def kernel_params(self, scale: bool) -> str:
        """The extra kernel parameters (after diag_lo, diag_hi); the order of
        :meth:`flashgen.user_mods.UserArgs.kernel_args`."""
        out = "sm_scale, " if scale and self.low.score is not None else ""
        out += self._buf_params()
        if self.mask:
            out += "UBM, ubm_sz, ubm_sh, "
        if self.low.sinks and self.kernel == "fwd":
            out += "SINKS, "
        return out

    def _names(self, qi, kj, t, var):
        Q = qi + ("[None, :]" if t else "[:, None]")
        K = kj + ("[:, None]" if t else "[None, :]")
        return {"s": var, "b": "u_z", "h": "u_h", "q": Q, "k": K}, {"q": f"({Q} < seqlen_q)", "k": f"({K} < seqlen_k)"}

    def score_block(self, var: str, qi: str, kj: str, t: bool) -> str:
        """The score point: the score function (and, backward, its derivatives), then the
        mask function's predicate ``u_keep`` in masked tiles.  Without a score function
        ``var`` is left as the raw dot products (the kernels scale them as the built-in
        ones do)."""
        low, ind = self.low, "    "
        names, valid = self._names(qi, kj, t, var)
        lines = []
        if low.score is not None:
            lines.append("# user score function on s = softmax_scale * q.k (natural units), then base 2")
            lines.append(f"{var} = {var} * sm_scale")
            outs = low.score_outs(self.kernel)
            bwd = self.kernel != "fwd"
            grads = low.grads if self.kernel == "bwd_dq" else ()
            hoisted = {i for g, _, nodes, _ in self._hoisted() if g is low.score for i in nodes}
            code = _Code(low.score, names, "u", low.bufs, valid, offsets=[i for i, _, _ in grads], hoisted=hoisted)
            code.emit(outs)
            lines += code.lines
            if bwd and _nonunit(low.dscore):
                lines.append(f"u_g = {code.f(low.dscore)}")
            for i, _, d in grads:
                lines.append(f"u_d{i} = {code.f(d) if d is not None else '0.0'}")
            res = code.f(low.score_out)
            if not (isinstance(low.score_out, Ref) and "s" in low.score.deps(low.score_out)):
                res = f"{res} + tl.zeros_like({var})"
            lines.append(f"{var} = {res}")
            if low.guard:
                lines.append(f"{var} = tl.where({var} == float(\"-inf\"), {var}, "
                             f"tl.minimum(tl.maximum({var}, -2.3e38), 2.3e38))")
            checked = [i for i in low.score.uses([low.score_out])
                       if low.score.nodes[i].op == "load" and "s" in low.score.nodes[i].deps]
            if checked:  # after the guard, whose clamp would turn a NaN into a number
                lines.append("# NaN where an index computed from the score lies outside its tensor")
                lines.append(f"{var} = tl.where({' & '.join(f'u_ok{i}' for i in checked)}, {var}, float(\"nan\"))")
            lines.append(f"{var} = {var} * {LOG2E!r}")
        if self.mask:
            hoisted = {i for g, _, nodes, _ in self._hoisted() if g is low.mask for i in nodes}
            code = _Code(low.mask, names, "um", low.bufs, valid, base=low.mask_base, hoisted=hoisted)
            code.emit([low.mask_out])
            out = low.mask_out
            if isinstance(out, Ref):
                keep = code.name(out) if low.mask.dtype(out) == "bool" else f"{code.name(out)} != 0"
            else:
                keep = f"tl.full([1, 1], {bool(out)}, tl.int1)"
            lines.append("# user mask function (masked tiles only; interior tiles are entirely visible)")
            lines.append("if MASKED:")
            lines += [ind + x for x in code.lines] + [ind + f"u_keep = {keep}"]
        return "\n".join(ind + x for x in lines) + "\n"

    def after_ds(self, var: str, qi: str, kj: str, t: bool) -> str:
        """After dS: captured tensors' gradients (bwd_dq, atomics into float32 buffers),
        then the score function's derivative."""
        low = self.low
        if low.score is None:
            return ""
        ind = "    "
        names, valid = self._names(qi, kj, t, var)
        lines = []
        if self.kernel == "bwd_dq" and low.grads:
            lines.append(f"u_gv = {valid['q']} & {valid['k']}")
            for i, buf, _ in low.grads:
                deps = tile_axes(low.score.deps(Ref(i)))  # the shape of the load's offsets
                val = f"tl.where(u_gv, {var} * u_d{i}, 0.0)"
                if deps == {"q", "k"}:
                    ok = f"u_gv & u_ok{i}" if "s" in low.score.deps(Ref(i)) else "u_gv"
                    lines.append(f"tl.atomic_add(UG{buf} + tl.broadcast_to(u_off{i}, (BLOCK_M, BLOCK_N)), {val}, "
                                 f"mask={ok}, sem=\"relaxed\")")
                elif deps == {"q"}:
                    lines.append(f"tl.atomic_add(UG{buf} + u_off{i}, tl.sum({val}, 1, keep_dims=True), "
                                 f"mask={valid['q']}, sem=\"relaxed\")")
                elif deps == {"k"}:
                    lines.append(f"tl.atomic_add(UG{buf} + u_off{i}, tl.sum({val}, 0, keep_dims=True), "
                                 f"mask={valid['k']}, sem=\"relaxed\")")
                else:
                    lines.append(f"tl.atomic_add(UG{buf} + u_off{i}, tl.sum(tl.sum({val}, 1), 0), sem=\"relaxed\")")
        if _nonunit(low.dscore) and may_be_infinite(low.score, low.dscore):
            # zero outside the valid rows and columns, where dS is 0 but the derivative
            # may be infinite (sqrt(|s|), log(s), 1 / s at the zero-padded s = 0): 0 * inf
            # would be a NaN in every dQ row (bwd_dq) / dK row (bwd_dkdv) through the
            # padded keys (queries); only masked tiles stream padding, an interior tile's
            # padded resident rows (columns) stay in their own unstored dQ (dK, dV) lines
            lines += ["if MASKED:", f"    {var} = tl.where({valid['q']} & {valid['k']}, {var} * u_g, 0.0)",
                      "else:", f"    {var} = {var} * u_g"]
        elif _nonunit(low.dscore):
            lines.append(f"{var} = {var} * u_g")
        return "\n".join(ind + x for x in lines)

    def key_ranges(self) -> str:
        """fwd / bwd_dq: the query block's key ranges from the block mask (int32 (.., 4):
        first visited key, first and end of the interior run, end)."""
        return ("    m_last = m0 + BLOCK_M - 1\n"
                "    u_bm = UBM + off_z * ubm_sz + off_h * ubm_sh + m_blk * 4\n"
                "    n_start = tl.load(u_bm)\n    n_full_lo = tl.load(u_bm + 1)\n"
                "    n_full_hi = tl.load(u_bm + 2)\n    n_end = tl.load(u_bm + 3)\n")

    def query_ranges(self) -> str:
        """bwd_dkdv: the key block's query ranges from the block mask (per kv head)."""
        return ("    n_last = n0 + BLOCK_N - 1\n"
                "    u_bm = UBM + off_z * ubm_sz + off_hkv * ubm_sh + n_blk * 4\n"
                "    m_start = tl.load(u_bm)\n    m_full_lo = tl.load(u_bm + 1)\n"
                "    m_full_hi = tl.load(u_bm + 2)\n    m_end = tl.load(u_bm + 3)\n")

    def sink_init(self) -> str:
        """fwd with sinks: the online softmax starts from the sink's logit (m = sink, l = 1),
        so every row's denominator holds exp(sink) and the LSE includes it."""
        if not (self.low.sinks and self.kernel == "fwd"):
            return ""
        return ("    # learnable sink: one extra logit per head in every row's softmax denominator\n"
                f"    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(SINKS + off_h) * {LOG2E!r}\n"
                "    l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)\n")


#: Bytes per element of a captured tensor as the kernels read it (float64 arrives as
#: float32, bool as int8).
_ELEM_BYTES = {"float32": 4, "float64": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
               "int8": 1, "uint8": 1, "bool": 1}


def _kib(n: int) -> int:
    return -(-n // 1024) * 1024


def smem_buffers(low: Lowered, kernel: str, block_m: int, block_n: int, num_stages: int) -> dict[str, int]:
    """Shared memory (bytes, named buffers) that ``low``'s functions add to ``kernel``
    (fwd, bwd_dq, bwd_dkdv) with tiles (block_m, block_n) and ``num_stages``, on top of
    the plain kernel's buffers (:func:`flashgen.resources.smem_buffers`).  Fitted to
    ``metadata.shared`` of user variants compiled for sm_90 by Triton 3.6
    (tests/test_user_mods.py), as upper bounds:

    * ``user_gather_tiles``: the software pipeliner streams a captured tensor read at a
      (query row, key column) index (``table[bucket(kv - q), h]``) through num_stages - 1
      shared buffers of block_m x block_n elements (cp.async: a gather cannot use TMA),
      each load its own; unpipelined (num_stages 1), a layout-conversion scratch of up
      to 2 KiB.
    * ``user_gather_rows``: the same for a vector read at the streamed index only (the
      key column in fwd/bwd_dq, the query row in bwd_dkdv: ``doc[kv_idx]``), in 1 KiB
      allocations; one read at the resident index or at (b, h) costs nothing.
    * ``user_grad_cvt`` (bwd_dq): a captured tensor's gradient added by atomics at a
      (row, column) index converts the tile's pointers (int64) to the atomics' layout
      through a block_m x block_n x 8 byte scratch (the 131072 bytes that took the
      relative-position table's d128 m128 n64 w8 s3 bwd_dq from 164864 to 295936 bytes,
      over the H200's 232448); one summed over a row or column, the vector's pointers
      and values (12 bytes each, 1 KiB allocations)."""
    streamed = "q" if kernel == "bwd_dkdv" else "k"
    extent = {"q": block_m, "k": block_n}
    stages = max(1, num_stages)
    parts = []
    if low.score is not None:
        parts.append((low.score, low.score_outs(kernel), 0))
    if low.mask is not None:
        parts.append((low.mask, [low.mask_out], low.mask_base))
    tiles = rows = grads = 0
    tile_loads = 0
    for g, outs, base in parts:
        for i in g.uses(outs):
            n = g.nodes[i]
            if n.op != "load":
                continue
            elem = _ELEM_BYTES[low.bufs[base + n.args[0]].dtype]
            deps = tile_axes(n.deps)
            if deps == {"q", "k"}:
                tile_loads += 1
                tiles += (stages - 1) * block_m * block_n * elem
            elif deps == {streamed} and stages > 1:
                rows += _kib((stages - 1) * extent[streamed] * elem)
    if kernel == "bwd_dq":
        for i, _, _ in low.grads:
            deps = tile_axes(low.score.deps(Ref(i)))
            if deps == {"q", "k"}:
                grads += block_m * block_n * 8
            elif deps:
                grads += _kib(extent[next(iter(deps))] * 12)
    out = {}
    if tile_loads:
        out["user_gather_tiles"] = tiles if stages > 1 else 2048
    if rows:
        out["user_gather_rows"] = rows
    if grads:
        out["user_grad_cvt"] = grads
    return out


def _fold_pow(a, b):
    """``a ** b`` of two constants as torch computes it for tensors of their types:
    NaN (not a complex number) for a negative float base to a non-integral power, inf
    (not an error) for 0.0 to a negative power; an integer to a negative integer power
    is refused as torch refuses it."""
    if isinstance(a, float) or isinstance(b, float):
        a, b = float(a), float(b)
        if b == 0:
            return 1.0
        if a == 0 and b < 0:
            return math.inf
        if a < 0 and not b.is_integer():
            return math.nan
        try:
            return a ** b
        except OverflowError:
            return math.copysign(math.inf, a) if a < 0 and b % 2 == 1 else math.inf
    if b < 0:
        raise UnsupportedError("an integer raised to a negative integer power (torch refuses it: 'Integers to "
                               "negative integer powers are not allowed'); write the base as a float")
    return a ** b


def _nonunit(d) -> bool:
    return isinstance(d, Ref) or (d is not None and d != 1)


#: Operations whose result may be infinite or NaN at finite arguments (a pole, an edge
#: of the domain, an overflow): sqrt(|s|)' = 0.5 / sqrt(|s|) is infinite at s = 0.
_SINGULAR = frozenset(("log", "log2", "rsqrt", "sqrt", "pow", "exp", "exp2"))


def may_be_infinite(g: Graph, v) -> bool:
    """Whether value ``v`` of ``g`` may be infinite or NaN where the inputs and the loads
    are finite: it needs an operation of :data:`_SINGULAR` or a division (floor
    division, modulo) by a value that is not a nonzero constant.  False for softcap's
    1 - tanh^2, ALiBi's constants."""
    if not isinstance(v, Ref):
        return False
    for i in g.uses([v]):
        n = g.nodes[i]
        if n.op in _SINGULAR:
            return True
        if n.op in ("truediv", "floordiv", "mod") and (isinstance(n.args[1], Ref) or n.args[1] == 0):
            return True
    return False


# -- rendering -----------------------------------------------------------------------

#: Hook lines inserted into the dense templates' text when a user variant renders:
#: (template, anchor, replacement); each anchor occurs exactly once.
PATCHES = (
    ("attn_fwd.py.j2", '{% if "bias" in mods %}\n', '{% if "bias" in mods or user.guard %}\n'),
    *((f"attn_{k}.py.j2", "{% if sm %}\n{{ c.score_mods(", "{% if sm or user.mask %}\n{{ c.score_mods(")
      for k in _DENSE),
    ("attn_bwd_dq.py.j2", "    ds = p * (dp - delta[:, None])\n",
     '    ds = p * (dp - delta[:, None])\n{{ user.after_ds("ds", "offs_m", "cols", False) }}\n'),
    ("attn_bwd_dkdv.py.j2", "    dst = pt * (dpt - delta[None, :])\n",
     '    dst = pt * (dpt - delta[None, :])\n{{ user.after_ds("dst", "rows", "offs_n", True) }}\n'),
)
OVERLAY = "_user_mods.j2"


@functools.lru_cache(maxsize=None)
def _templates_dir() -> Path:
    """:func:`flashgen.template_files.templates_dir`, or the source checkout's ``templates/``
    when that one lacks the overlay (an installed flashgen.templates of another tree)."""
    for d in (templates_dir(), Path(__file__).resolve().parent.parent / "templates"):
        if (d / OVERLAY).exists():
            return d
    raise FileNotFoundError(f"templates/{OVERLAY} not found next to {templates_dir()}")


def _source(name: str) -> str:
    d = _templates_dir()
    text = (d / name).read_text()
    if name == "_common.j2":
        return text + (d / OVERLAY).read_text()
    for tmpl, anchor, repl in PATCHES:
        if tmpl == name:
            if text.count(anchor) != 1:
                raise RuntimeError(f"flashgen.user_render: the hook anchor {anchor.strip()!r} occurs "
                                   f"{text.count(anchor)} times in templates/{name} (expected once)")
            text = text.replace(anchor, repl)
    return text


@functools.lru_cache(maxsize=None)
def _env() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FunctionLoader(_source), undefined=jinja2.StrictUndefined,
                              keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True)


def machinery_text_hash() -> str:
    """sha256 (16 hex digits) of the text that turns a lowering into source: this
    module, the overlay, and the dense templates with their macros."""
    h = hashlib.sha256(Path(__file__).read_bytes())
    h.update((_templates_dir() / OVERLAY).read_bytes())
    for k in _DENSE:
        h.update(text_hash(k).encode())
    return h.hexdigest()[:16]


#: The record of :func:`machinery_hash` in the templates directory: ``text`` (the
#: :func:`machinery_text_hash` it was written for), ``probes`` (the digest of the probe
#: lowerings' sources, :mod:`flashgen.user_machinery`) and ``code`` (the id).
MACHINERY_RECORD = "user_machinery_id.json"


def read_machinery_record(path: Path | None = None) -> dict:
    """:data:`MACHINERY_RECORD` (or the record at ``path``) as written, {} when it is
    missing or unreadable."""
    try:
        return json.loads((path or _templates_dir() / MACHINERY_RECORD).read_text())
    except (OSError, ValueError):
        return {}


@functools.lru_cache(maxsize=None)
def machinery_hash() -> str:
    """The id of the machinery that turns a lowering into source, part of every user
    variant's name (:attr:`Lowered.name`): the recorded id (:data:`MACHINERY_RECORD`)
    while this module, the overlay and the dense templates are the recorded text, else
    their text hash (so a user variant of edited machinery never takes a row measured
    with other code).  ``python3 -m flashgen.user_machinery`` rewrites the record after
    an edit and keeps the id where the probe lowerings (the user examples' forward and
    backward over the dense kernels' probe variants) render as recorded: an edit that
    leaves their code unchanged keeps every user variant's name and tuned rows."""
    rec, text = read_machinery_record(), machinery_text_hash()
    return rec["code"] if rec.get("text") == text and rec.get("code") else text


def render_args(spec) -> dict:
    """What :func:`flashgen.render.render` renders a user variant of ``spec`` with
    (``spec.mods`` a user name): ``env``, the Jinja environment of the dense templates
    with the overlay and the hook lines, and ``user``, the templates' view of the
    lowered functions."""
    if not is_user_mods(spec.mods):
        raise ValueError(f"{spec.id} carries no user functions")
    return {"env": _env(), "user": Context(lowered(spec.mods), spec.kernel)}

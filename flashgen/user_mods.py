"""User score and mask functions (FlexAttention's ``score_mod`` / ``mask_mod``) compiled
into flashgen's kernels, block sparsity from the mask function, and learnable sinks.

``score_mod(score, b, h, q_idx, kv_idx) -> score`` and ``mask_mod(b, h, q_idx, kv_idx)
-> bool`` are written with torch operations on their arguments (score: float, the
scaled dot product s = softmax_scale * q.k in natural units; b, h, q_idx, kv_idx:
integer batch, query head, query row and key column) and may read captured tensors by
indexing them with integer expressions (``table[bucket, h]``, ``doc_id[q_idx]``).
flashgen traces each function once with ``torch.fx`` (:class:`_Tracer`) into the
expression IR of :mod:`flashgen.user_render`, differentiates it there (the score's
derivative, the captured tensors' gradients) and renders it into the dense kernels.
Python control flow on the traced values (``if score > 0``), reductions, indexing a
traced value, and operations outside :data:`SUPPORTED` raise UnsupportedError naming
the operation.

The mask function also gives the block mask: for each (BLOCK_M, BLOCK_N) tile of the
running config, whether it is empty (skipped), entirely visible (run with no mask
arithmetic) or partial; per query block (forward, dQ) and per key block and kv head
(dK/dV) the kernels read the visited range and its interior run.  It is computed once
per (mask function, captured tensors' versions, sizes, tile shape) by evaluating the
user's function with torch on the index grid, and cached (:func:`block_ranges`).
"""

from __future__ import annotations

import array
import collections
import dataclasses
import functools
import hashlib
import inspect
import math
import operator
import sys
import types
import weakref

import torch
import torch.fx as fx

from . import dispatch, library, user_bounds, user_grads, user_ints, user_render
from .families.gluon import builtin_mods
from .errors import InputError, UnsupportedError
from .reference import SCORE_CLAMP, clamp_scores, softmax_rows
from .user_render import Buffer, Graph, Lowered, Ref, derivative

# -- tracing -------------------------------------------------------------------------

_F = "float"


def _canon():
    """fx call targets -> IR operation names."""
    t = {}

    def add(name, *targets):
        for x in targets:
            if x is not None:
                t[x] = name

    g = lambda n: getattr(torch, n, None)  # noqa: E731
    add("add", operator.add, g("add"))
    add("sub", operator.sub, g("sub"), g("subtract"))
    add("mul", operator.mul, g("mul"), g("multiply"))
    add("truediv", operator.truediv, g("true_divide"))
    add("div", g("div"), g("divide"))
    add("floordiv", operator.floordiv, g("floor_divide"))
    add("mod", operator.mod, g("remainder"))
    add("pow", operator.pow, g("pow"))
    add("neg", operator.neg, g("neg"), g("negative"))
    add("abs", operator.abs, g("abs"), g("absolute"))
    for op in ("lt", "le", "gt", "ge", "eq", "ne"):
        add(op, getattr(operator, op), g(op))
    add("lt", g("less"))
    add("le", g("less_equal"))
    add("gt", g("greater"))
    add("ge", g("greater_equal"))
    add("ne", g("not_equal"))
    add("and", operator.and_, g("bitwise_and"))
    add("or", operator.or_, g("bitwise_or"))
    add("xor", operator.xor, g("bitwise_xor"))
    add("not", operator.invert, g("bitwise_not"))
    add("land", g("logical_and"))
    add("lor", g("logical_or"))
    add("lxor", g("logical_xor"))
    add("lnot", g("logical_not"))
    add("lshift", operator.lshift, g("bitwise_left_shift"))
    add("rshift", operator.rshift, g("bitwise_right_shift"))
    add("getitem", operator.getitem)
    for op in ("tanh", "exp", "exp2", "log", "log2", "sqrt", "rsqrt", "sigmoid", "sin", "cos", "floor", "ceil",
               "trunc", "sign", "minimum", "maximum", "clamp", "where", "full_like", "zeros_like", "ones_like"):
        add(op, g(op))
    add("clamp", g("clip"))
    add("clamp_min", g("clamp_min"))
    add("clamp_max", g("clamp_max"))
    add("min2", g("min"))
    add("max2", g("max"))
    add("sigmoid", torch.nn.functional.sigmoid)
    add("tanh", torch.nn.functional.tanh)
    for op in ("exp", "log", "log2", "sqrt", "floor", "ceil", "trunc", "sin", "cos", "tanh"):
        add(op, getattr(math, op))
    return t


_TARGETS = _canon()
_METHODS = {"add": "add", "sub": "sub", "mul": "mul", "div": "div", "true_divide": "truediv",
            "floor_divide": "floordiv", "remainder": "mod", "pow": "pow", "neg": "neg", "abs": "abs",
            "lt": "lt", "le": "le", "gt": "gt", "ge": "ge", "eq": "eq", "ne": "ne", "logical_and": "land",
            "logical_or": "lor", "logical_not": "lnot", "logical_xor": "lxor", "bitwise_and": "and",
            "bitwise_or": "or", "bitwise_xor": "xor", "bitwise_not": "not", "__getitem__": "getitem",
            "clamp": "clamp", "clip": "clamp", "clamp_min": "clamp_min", "clamp_max": "clamp_max",
            "minimum": "minimum", "maximum": "maximum", "where": "mwhere", "to": "to", "type": "to",
            "float": "float32", "double": "float64", "half": "float16", "bfloat16": "bfloat16", "long": "int64",
            "int": "int32", "short": "int16", "bool": "bool", "sign": "sign"}
for _op in ("tanh", "exp", "exp2", "log", "log2", "sqrt", "rsqrt", "sigmoid", "sin", "cos", "floor", "ceil", "trunc"):
    _METHODS[_op] = _op

#: The operations a score or mask function may use (torch functions, tensor methods,
#: Python operators and math functions of the same names).
SUPPORTED = tuple(sorted(set(_METHODS) | {"where", "full_like", "zeros_like", "ones_like", "min", "max"}))


class _Tracer(fx.Tracer):
    """fx's tracer with every tensor the function reads (closure, globals, created
    inside) recorded by identity as a captured buffer (nn.Parameters included)."""

    def __init__(self):
        super().__init__()
        self.captured: list[torch.Tensor] = []
        self._names: dict[int, str] = {}

    def create_arg(self, a):
        if isinstance(a, torch.Tensor):
            name = self._names.get(id(a))
            if name is None:
                name = self._names[id(a)] = f"_captured{len(self.captured)}"
                self.captured.append(a)
            return self.create_node("get_attr", name, (), {})
        if type(a).__module__ == "numpy" and getattr(a, "ndim", None) == 0 and hasattr(a, "item"):
            return super().create_arg(a.item())  # a NumPy scalar: torch takes it as a Python scalar
        return super().create_arg(a)


class _EagerReads(torch.overrides.TorchFunctionMode):
    """While a function is traced: the ids of the tensors it computes with outside the
    trace (a torch operation with no fx Proxy among its arguments: ``doc.max()``,
    ``t.item()``, ``t[0]``), whose values the trace may then hold as constants."""

    def __init__(self):
        super().__init__()
        self.read: set[int] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = [*args, *kwargs.values()]
        if not any(isinstance(a, fx.Proxy) for a in leaves):
            self.read.update(id(a) for a in leaves if isinstance(a, torch.Tensor))
        return func(*args, **kwargs)


@dataclasses.dataclass(frozen=True)
class _Captured:
    n: int


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


_BUF_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")


#: Operations through which a value reaches the function's result continuously (a change
#: of an ulp in an argument moves the result by about an ulp): a division by a constant
#: that reaches the result only through these may become a multiplication by the
#: constant's reciprocal.  Casts keep continuity only to float32/float64.
_CONTINUOUS = frozenset({"add", "sub", "mul", "truediv", "neg", "abs", "minimum", "maximum", "clamp", "where",
                         "pow", "exp", "log", "sqrt", "rsqrt", "sigmoid", "exp2", "log2", "sin", "cos", "tanh"})


def _continuous_use(node, arg_index: int) -> bool:
    if node.op == "where":
        return arg_index > 0  # the condition is a comparison's input, not a value's
    if node.op == "cast":
        return node.args[1] in ("float32", "float64")
    if node.op == "clamp":
        return arg_index == 0
    return node.op in _CONTINUOUS


#: The least normal float32 and the largest float32: a divisor outside has no finite
#: float32 reciprocal (1 / 1e-39 is inf in float32) or is no float32 itself.
_F32_TINY, _F32_MAX = 2.0 ** -126, 3.4028234663852886e38


def reciprocal_divisions(g: Graph, out) -> int:
    """Rewrite, in place, each division by a finite nonzero constant among the nodes
    ``out`` needs into a multiplication by the constant's reciprocal (rounded once to
    float32 as the kernels' literal), as the built-in score mods scale (softcap:
    ``s * (1 / softcap)``): the kernels' division (``div.full.f32``, about 2 ulp) costs
    several instructions per score element.  A power-of-two constant is exact either
    way and always rewritten; another only when the quotient reaches ``out`` through
    continuous operations alone (:data:`_CONTINUOUS`), so a quotient that is floored,
    cast to an integer, compared or used as an index (T5's bucket: ``log(r / 8) /
    log(16) * 8`` then ``.long()``) keeps the division.  A float result itself is
    continuous; a bool result (a mask function) is not.  Returns the number of nodes
    rewritten.  The derivative graphs built afterwards see the multiplications."""
    if not isinstance(out, Ref):
        return 0
    need = g.uses([out])
    users = collections.defaultdict(list)  # node -> [(user node, argument position)]
    for i in need:
        for pos, a in enumerate(g.nodes[i].args):
            if isinstance(a, Ref):
                users[a.i].append((i, pos))
    memo = {}

    def continuous(i: int) -> bool:
        """Whether node i reaches ``out`` only through continuous operations."""
        if i not in memo:  # the graph is acyclic: memo holds finished nodes only
            memo[i] = (g.nodes[i].dtype == "float" if i == out.i else
                       all(_continuous_use(g.nodes[u], pos) and continuous(u) for u, pos in users[i]))
        return memo[i]

    done = 0
    for i in need:
        n = g.nodes[i]
        if n.op != "truediv" or isinstance(n.args[1], Ref) or not isinstance(n.args[0], Ref):
            continue
        c = n.args[1]
        if isinstance(c, bool) or not isinstance(c, (int, float)) or c == 0 or not math.isfinite(c):
            continue
        if not _F32_TINY <= abs(float(c)) <= _F32_MAX:
            continue  # its float32 reciprocal overflows (a subnormal) or the constant does
        exact = math.frexp(float(c))[0] == 0.5
        if exact or continuous(i):
            g.nodes[i] = dataclasses.replace(n, op="mul", args=(n.args[0], 1.0 / float(c)))
            done += 1
    return done


def _ref(obj):
    """A weak reference to ``obj`` where it takes one, else a strong one (both called to
    get the object; a dead weak reference gives None)."""
    try:
        return weakref.ref(obj)
    except TypeError:  # numbers, strings, tuples, lists: kept
        return lambda: obj


#: Graph ops through which a value reaches the result at its own magnitude (``where``:
#: its branches); a ``mul`` by a constant too (:func:`_added_terms`), as a division by
#: one becomes.
_ADDITIVE_OPS = ("add", "sub", "neg", "abs", "where", "maximum", "minimum", "clamp", "cast")


def _added_terms(g: Graph, out) -> tuple[list[int], list[float]]:
    """(buffers, float constants) whose values reach ``out`` through sums, differences,
    selects, bounds and products with constants alone: a bias tensor's values, not a
    slope's product with a position (a product of two traced values is not followed)."""
    loads, consts, seen, todo = [], [], set(), [out]
    while todo:
        r = todo.pop()
        if not isinstance(r, Ref):
            if isinstance(r, float):
                consts.append(r)
            continue
        if r.i in seen:
            continue
        seen.add(r.i)
        n = g.nodes[r.i]
        if n.op == "load":
            loads.append(n.args[0])
        elif n.op == "mul":
            if sum(isinstance(a, Ref) for a in n.args) == 1:
                todo += n.args
        elif n.op in _ADDITIVE_OPS:
            todo += n.args[1:] if n.op == "where" else n.args
    return loads, consts


class Traced:
    """One user function, traced: its graph and result, its captured tensors, and (score
    functions) the derivatives the backward needs.

    It holds the function and the captured tensors the function's own objects name
    (``weak``: their identities, the objects :func:`_trace_key` keys on) by weak
    reference, so that a cache of traced functions does not keep a user's tensors
    alive; the tensors it reaches otherwise (made inside the function, or attributes of
    an object it names) are held.  A call holds its function and tensors while it needs
    them (:class:`UserArgs`)."""

    def __init__(self, fn, kind: str, weak: frozenset = frozenset()):
        self._fns, self.kind = [_ref(fn)], kind
        arg = "score_mod" if kind == "score" else "mask_mod"
        names = ("score", "b", "h", "q_idx", "kv_idx") if kind == "score" else ("b", "h", "q_idx", "kv_idx")
        try:
            inspect.signature(fn).bind(*names)
        except TypeError:
            raise InputError(f"{arg} must take {len(names)} positional arguments ({', '.join(names)}), got "
                             f"{_describe(fn)}") from None
        except ValueError:
            pass  # builtins without a signature: let the trace decide
        src = f"def traced({', '.join(names)}):\n    return fn({', '.join(names)})\n"
        scope = {"fn": fn}
        exec(src, scope)  # a plain function of exactly these arguments for fx
        tracer = _Tracer()
        eager = _EagerReads()
        try:
            with eager:
                graph = tracer.trace(scope["traced"])
        except fx.proxy.TraceError as e:
            raise UnsupportedError(f"{arg} {_describe(fn)} uses data-dependent Python control flow on a traced "
                                   f"value ({e}): write conditions with torch.where and masks with boolean "
                                   "operators (&, |, ~), not if/and/or/bool()") from None
        except UnsupportedError:
            raise
        except Exception as e:  # noqa: BLE001 (the user's code failed on proxies)
            raise UnsupportedError(f"{arg} {_describe(fn)} cannot be traced: {type(e).__name__}: {e}") from None
        #: ids of the tensors the trace computed with eagerly (:class:`_EagerReads`)
        self.eager_reads = frozenset(eager.read)
        self._captured = [_ref(t) if id(t) in weak else (lambda t=t: t) for t in tracer.captured]
        for t in self.captured:
            if _dtype_name(t.dtype) not in _BUF_DTYPES:
                raise UnsupportedError(f"{arg} reads a captured tensor of dtype {t.dtype} (flashgen: "
                                       f"{', '.join(_BUF_DTYPES)})")
        self.bufs = tuple(Buffer("int8" if t.dtype == torch.bool else _dtype_name(t.dtype), t.dim())
                          for t in self.captured)
        self.graph = Graph()
        self._narrow: dict = {}  # user_ints.narrow_dtype's memo for self.graph
        self.out = self._lower(graph, names, arg)
        g = self.graph
        reciprocal_divisions(g, self.out)
        if kind == "score":
            self.guard = any(n.op in ("log", "log2", "exp", "exp2", "truediv", "pow", "rsqrt")
                             or any(isinstance(a, float) and not math.isfinite(a) for a in n.args)
                             for n in (g.nodes[i] for i in g.uses([self.out])))
            if not self.guard and not getattr(fn, "flashgen_unclamped", False):
                # a captured tensor added to the score (scaled by constants at most) is a
                # bias: a float32 or bfloat16 one can hold values past the clamp (finfo.min
                # as a mask); so can a constant beyond it.  The kernels clamp a guarded
                # result to +-SCORE_CLAMP as bias= scores (reference.clamp_scores)
                loads, consts = _added_terms(g, self.out)
                self.guard = (any(self.bufs[b].dtype in ("float32", "float64", "bfloat16") for b in loads)
                              or any(abs(c) > SCORE_CLAMP for c in consts))
            s = g.input("s", _F)
            # None is "identically zero" (a result that ignores the score, a floor, a
            # comparison): 0.0, since the kernels read a missing derivative as 1
            d = derivative(g, self.out, s)
            self.dscore = 0.0 if d is None else d
            self.loads = [(i, g.nodes[i].args[0]) for i in g.uses([self.out])
                          if g.nodes[i].op == "load" and self.bufs[g.nodes[i].args[0]].category == "float"
                          and self.captured[g.nodes[i].args[0]].dtype != torch.bool]
            self.dloads = {i: derivative(g, self.out, Ref(i)) for i, _ in self.loads}
        elif g.dtype(self.out) != "bool":
            kind = "an int" if g.dtype(self.out) == "int" else "a float"
            raise UnsupportedError(f"mask_mod {_describe(fn)} returns {kind} value: it must return a bool tensor "
                                   "(a comparison, or `!= 0` of an integer)")

    @property
    def fn(self):
        """The traced function: one of the equal functions (same code, same objects) it
        was traced or found for that is still alive (InputError when none is: a call
        holds its own)."""
        for r in self._fns:
            fn = r()
            if fn is not None:
                return fn
        raise InputError("the traced user function was freed; pass it again")

    def seen(self, fn) -> None:
        """Record ``fn``, an equal function :func:`trace` found this trace for."""
        self._fns = ([r for r in self._fns if r() is not None and r() is not fn] + [_ref(fn)])[-8:]

    @property
    def captured(self) -> list[torch.Tensor]:
        """The captured tensors, in buffer order (InputError if one was freed)."""
        out = [r() for r in self._captured]
        if any(t is None for t in out):
            raise InputError("a tensor captured by a user function was freed; pass the function again")
        return out

    def alive(self) -> bool:
        """Whether every captured tensor is still alive."""
        return all(r() is not None for r in self._captured)

    def wide(self, batch: int, heads: int, seqlen_q: int, seqlen_k: int) -> bool:
        """Whether an int32 value the kernels compute where torch computes in int64 can
        leave int32 at these sizes (:func:`flashgen.user_ints.int32_overflows`): the
        call then runs :meth:`widened`.  Memoized per sizes."""
        key = (batch, heads, seqlen_q, seqlen_k)
        memo = self.__dict__.setdefault("_wide", {})
        hit = memo.get(key)
        if hit is None:
            hit = user_ints.int32_overflows(self.graph, {"b": batch, "h": heads, "q": seqlen_q, "k": seqlen_k},
                                            self.bufs)
            if len(memo) >= 64:
                memo.clear()
            memo[key] = hit
        return hit

    def widened(self) -> "_Widened":
        """This function computing as torch does: its index inputs and the bools its
        integer arithmetic uses in int64 (:func:`flashgen.user_ints.widen`); made once."""
        w = self.__dict__.get("_widened")
        if w is None:
            w = self.__dict__["_widened"] = _Widened(self)
        return w

    @functools.cached_property
    def reads(self) -> user_bounds.Reads:
        """The captured-tensor reads whose indices :func:`check_reads` checks."""
        return user_bounds.reads(self.graph, self.out)

    # -- fx graph -> IR
    def _lower(self, graph: fx.Graph, names, arg):
        g = self.graph
        env: dict = {}
        inputs = dict(zip(names, ("s", "b", "h", "q", "k") if self.kind == "score" else ("b", "h", "q", "k")))
        out = None
        for node in graph.nodes:
            if node.op == "placeholder":
                env[node] = g.input(inputs[node.target], _F if inputs[node.target] == "s" else "int")
            elif node.op == "get_attr":
                env[node] = _Captured(int(node.target.removeprefix("_captured")))
            elif node.op in ("call_function", "call_method"):
                args = fx.node.map_arg(node.args, lambda n: env[n])
                kwargs = fx.node.map_arg(node.kwargs, lambda n: env[n])
                if node.op == "call_function":
                    op = _TARGETS.get(node.target)
                    what = getattr(node.target, "__name__", str(node.target))
                else:
                    op = _METHODS.get(node.target)
                    what = f"Tensor.{node.target}"
                if op is None:
                    raise UnsupportedError(f"{arg} uses {what}, which flashgen cannot compile into its kernels "
                                           f"(supported: {', '.join(SUPPORTED)})")
                if op in ("min2", "max2") and (len(node.args) != 2 or node.kwargs
                                               or not isinstance(node.args[1], fx.Node)):
                    raise UnsupportedError(f"{arg} uses torch.{op[:3]} as a reduction: use torch.{op[:3]}(a, b) of "
                                           f"two tensors, torch.minimum or torch.maximum")
                try:
                    env[node] = self._apply(op, list(args), dict(kwargs), what)
                except UnsupportedError as e:
                    raise UnsupportedError(f"{arg}: {what}: {e}") from None
            elif node.op == "output":
                res = node.args[0]
                out = fx.node.map_arg(res, lambda n: env[n]) if not isinstance(res, (tuple, list)) else None
                if out is None:
                    raise UnsupportedError(f"{arg} must return one tensor, got {node.args[0]!r}")
                out = self._value(out)
            else:
                raise UnsupportedError(f"{arg} calls a module ({node.target}); use torch functions")
        return out

    def _value(self, v):
        """A captured 0-dim tensor read as a value; others must be indexed."""
        g = self.graph
        if isinstance(v, _Captured):
            t = self.captured[v.n]
            if t.dim() != 0:
                raise UnsupportedError(f"a captured tensor of shape {tuple(t.shape)} is used whole: index it with "
                                       "b, h, q_idx, kv_idx expressions (e.g. table[bucket, h])")
            return self._read(v.n, ())
        if isinstance(v, (bool, int, float)) or isinstance(v, Ref):
            return v
        raise UnsupportedError(f"a value of type {type(v).__name__} ({v!r})")

    def _read(self, n: int, index: tuple):
        """Captured tensor ``n`` at ``index`` (() for a 0-dim one) as a graph value.  A
        bool tensor's bytes are read as int8 (0 or 1): != 0 makes the value a bool of the
        graph, so ~, casts and arithmetic follow torch's bool semantics."""
        ref = self.graph.load(n, self.bufs[n], index)
        return self.graph.binary("ne", ref, 0) if self.captured[n].dtype == torch.bool else ref

    def _safe_divisor(self, a, b):
        """An integer divisor as the kernels divide by it: 1 where it is 0 (torch raises on
        the CPU and leaves the quotient undefined on CUDA; the kernels' would be
        undefined too, and an index computed from it unchecked: user_bounds evaluates
        the same divisor)."""
        g = self.graph
        if isinstance(b, Ref) and promote_int(g, a, b):
            return g.where(g.binary("eq", b, 0), 1, b)
        if isinstance(b, int) and b == 0 and promote_int(g, a, b):
            raise UnsupportedError("an integer division (//, %) by the constant 0 (torch raises ZeroDivisionError; "
                                   "a divisor converted to an 8-bit or 16-bit tensor's dtype wraps modulo 2**bits)")
        return b

    def _apply(self, op, args, kwargs, what):
        g = self.graph
        if op == "getitem":
            base, index = args
            if not isinstance(base, _Captured):
                raise UnsupportedError("indexing a traced value (only captured tensors can be indexed)")
            t = self.captured[base.n]
            index = index if isinstance(index, tuple) else (index,)
            if len(index) != t.dim():
                raise UnsupportedError(f"a captured tensor of shape {tuple(t.shape)} indexed with {len(index)} "
                                       f"indices: give one integer index per dim")
            idx = []
            for a in index:
                if isinstance(a, (slice, type(None), type(Ellipsis), _Captured)) or isinstance(a, float):
                    raise UnsupportedError(f"index {a!r} (each index must be an integer expression)")
                idx.append(self._value(a))
            return self._read(base.n, tuple(idx))
        if op in ("full_like", "zeros_like", "ones_like"):
            x = self._value(args[0])
            fill = {"zeros_like": 0, "ones_like": 1}.get(op)
            if fill is None:
                fill = args[1] if len(args) > 1 else kwargs.get("fill_value")
            dt = kwargs.get("dtype")
            if dt is not None and _dtype_name(dt) not in ("float32", "float64", "int64", "bool"):
                # the constant would be a Python number here, whose arithmetic neither
                # wraps nor rounds in that dtype as torch's tensor does
                raise UnsupportedError(f"{op}(..., dtype={dt}): write the value as a Python number, or as a "
                                       "float32 / int64 / bool tensor")
            cat = user_render.CASTS[_dtype_name(dt)] if dt is not None else g.dtype(x)
            if not isinstance(fill, (bool, int, float)):
                raise UnsupportedError(f"{op} with a fill value of type {type(fill).__name__}")
            if cat != "float" and isinstance(fill, float) and not math.isfinite(fill):
                raise UnsupportedError(f"{op}: {fill} in an integer tensor")
            return {"float": float, "int": int, "bool": bool}[cat](fill)
        if op in ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "bool"):
            return g.cast(self._value(args[0]), op, keep_width=True)
        if op == "to":
            x = self._value(args[0])
            dt = kwargs.get("dtype", args[1] if len(args) > 1 else None)
            if isinstance(dt, torch.dtype):
                return g.cast(x, _dtype_name(dt), keep_width=True)
            if dt is None or isinstance(dt, (torch.device, str)):
                return x
            raise UnsupportedError(f".to({dt!r})")
        vals = [self._value(a) for a in args]
        if op == "where" or op == "mwhere":
            if op == "mwhere":  # x.where(cond, other)
                vals = [vals[1], vals[0], vals[2] if len(vals) > 2 else self._value(kwargs["other"])]
            if len(vals) != 3:
                raise UnsupportedError("torch.where needs (condition, input, other)")
            return g.where(*user_ints.narrow_operands(g, self.bufs, "where", vals, self._narrow))
        if op in ("clamp", "clamp_min", "clamp_max"):
            x, rest = vals[0], vals[1:]

            def bound(name, pos):
                v = rest[pos] if len(rest) > pos else kwargs.get(name)
                return None if v is None else self._value(v)
            lo = bound("min", 0) if op in ("clamp", "clamp_min") else None
            hi = bound("max", 1 if op == "clamp" else 0) if op in ("clamp", "clamp_max") else None
            if isinstance(lo, Ref) or isinstance(hi, Ref):
                lo, hi = user_ints.narrow_bounds(g, self.bufs, x, lo, hi, self._narrow)
                if "float" in (g.dtype(x), *(g.dtype(v) for v in (lo, hi) if v is not None)):
                    # as torch.clamp: a NaN bound gives NaN, and its backward passes the
                    # input's gradient where lo <= x <= hi and a bound's where it is strictly
                    # active (maximum/minimum would split ties 0.5 / 0.5)
                    for cmp, bnd in (("lt", lo), ("gt", hi)):
                        if bnd is not None:
                            x = g.where(g.binary("or", g.binary(cmp, x, bnd), g.binary("ne", bnd, bnd)), bnd, x)
                    return x
                for m, bnd in (("maximum", lo), ("minimum", hi)):
                    if bnd is not None:
                        x = g.binary(m, *user_ints.narrow_operands(g, self.bufs, m, [x, bnd], self._narrow))
                return x
            return g.clamp(x, *user_ints.narrow_bounds(g, self.bufs, x, lo, hi, self._narrow))
        if op in ("min2", "max2"):
            op = "minimum" if op == "min2" else "maximum"
            return g.binary(op, *user_ints.narrow_operands(g, self.bufs, op, vals, self._narrow))
        _refuse_bool_arithmetic(g, op, vals, kwargs)
        if op == "pow" and len(vals) == 2 and isinstance(vals[1], int) and not isinstance(vals[1], bool):
            narrow = user_ints.narrow_dtype(g, self.bufs, vals[0], self._narrow)
            if narrow is not None:  # torch converts the exponent to the base's dtype first
                user_ints.checked(vals[1], narrow, "pow")
        if op in ("add", "sub") and kwargs.get("alpha", 1) != 1:
            vals[1] = g.binary("mul", vals[1], kwargs.pop("alpha"))
        kwargs.pop("alpha", None)
        if op == "div":
            mode = kwargs.pop("rounding_mode", None)
            if mode is None:
                op = "truediv"
            elif mode == "floor":
                op = "floordiv"
            elif mode == "trunc":
                a, b = vals
                if promote_int(g, a, b):
                    q = g.binary("floordiv", g.unary("abs", a), g.unary("abs", self._safe_divisor(a, b)))
                    same = g.binary("eq", g.binary("lt", a, 0), g.binary("lt", b, 0))
                    return g.where(same, q, g.unary("neg", q))
                return g.unary("trunc", g.binary("truediv", a, b))
            else:
                raise UnsupportedError(f"rounding_mode={mode!r}")
        if kwargs:
            raise UnsupportedError(f"keyword arguments {sorted(kwargs)}")
        if op in ("land", "lor", "lxor"):
            a, b = (g.cast(x, "bool") for x in vals)
            return g.binary(op[1:], a, b)
        if op == "lnot":
            return g.unary("not", g.cast(vals[0], "bool"))
        if len(vals) == 1:
            if op == "not" and user_ints.narrow_dtype(g, self.bufs, vals[0], self._narrow) == "uint8":
                # torch: ~x of a uint8 is 255 - x (Triton's interpreter inverts through -1,
                # which a uint8 cannot hold)
                return g.binary("xor", vals[0], 255)
            return g.unary(op, vals[0])
        if len(vals) == 2:
            if op in ("add", "mul") and g.dtype(vals[0]) == g.dtype(vals[1]) == "bool":
                # torch: bool + bool and bool * bool are bools (or, and), not 0/1/2 integers
                return g.binary("or" if op == "add" else "and", *vals)
            vals = user_ints.narrow_operands(g, self.bufs, op, vals, self._narrow)
            if op in ("floordiv", "mod"):
                vals[1] = self._safe_divisor(*vals)
            return g.binary(op, *vals)
        raise UnsupportedError(f"{len(vals)} arguments")


def _is_bool(g: Graph, v) -> bool:
    return isinstance(v, bool) or (isinstance(v, Ref) and g.dtype(v) == "bool")


def _refuse_bool_arithmetic(g: Graph, op: str, vals: list, kwargs: dict) -> None:
    """Raise UnsupportedError for the arithmetic on bools that torch refuses (a bool
    Python constant counts as a bool tensor beside a tensor, as in torch): subtraction
    with a bool (RuntimeError), abs of a bool, and //, %, a rounded division or ** of two
    bools (NotImplementedError: no bool kernel)."""
    if not any(isinstance(v, Ref) for v in vals):
        return
    if op == "sub" and any(_is_bool(g, v) for v in vals):
        raise UnsupportedError("subtraction with a bool value (torch refuses it: 'Subtraction, the `-` operator, "
                               "with a bool tensor is not supported'): use ^ / torch.logical_xor, or ~ / "
                               "torch.logical_not, or convert the bool with .int() first")
    if op == "abs" and _is_bool(g, vals[0]):
        raise UnsupportedError("abs of a bool value (torch has no abs for bool tensors)")
    rounded = op == "div" and kwargs.get("rounding_mode") is not None
    if (op in ("floordiv", "mod", "pow") or rounded) and len(vals) == 2 and all(_is_bool(g, v) for v in vals):
        what = {"floordiv": "//", "mod": "%", "pow": "**"}.get(op, f"div(rounding_mode={kwargs.get('rounding_mode')!r})")
        raise UnsupportedError(f"{what} of two bool values (torch has no bool kernel for it): convert one with "
                               ".int() first")


def _sum(g: Graph, a, b):
    """a + b of two derivatives (None: identically zero)."""
    if a is None or b is None:
        return b if a is None else a
    if not isinstance(a, Ref) and not isinstance(b, Ref):
        return float(a) + float(b)
    return g.binary("add", a, b)


class _Widened:
    """A :class:`Traced` function whose graph computes its index inputs and the bools its
    integer arithmetic uses in int64 (:func:`flashgen.user_ints.widen`): what
    :func:`_lowered` reads of a trace, the rest (its function, captured tensors) the
    trace's own."""

    def __init__(self, tr: Traced):
        self.trace, self.kind, self.bufs, self.guard = tr, tr.kind, tr.bufs, getattr(tr, "guard", False)
        refs = [tr.out]
        if tr.kind == "score":
            refs += [tr.dscore] + [tr.dloads[i] for i, _ in tr.loads] + [Ref(i) for i, _ in tr.loads]
        self.graph, new = user_ints.widen(tr.graph, refs)
        self.out = new[0]
        if tr.kind == "score":
            self.dscore = new[1]
            n = len(tr.loads)
            self.loads, self.dloads = [], {}
            for r, (_, b), d in zip(new[2 + n:], tr.loads, new[2:2 + n]):
                if r.i in self.dloads:  # two loads that the casts made equal: one load, their derivatives summed
                    d = _sum(self.graph, self.dloads[r.i], d)
                else:
                    self.loads.append((r.i, b))
                self.dloads[r.i] = d

    @property
    def captured(self) -> list[torch.Tensor]:
        return self.trace.captured

    @property
    def fn(self):
        return self.trace.fn


def promote_int(g: Graph, a, b) -> bool:
    return g.dtype(a) != "float" and g.dtype(b) != "float"


def _describe(fn) -> str:
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
    return f"'{name}'"


_traces: collections.OrderedDict = collections.OrderedDict()
_TRACES_MAX = 256


_MISSING = object()
_READ_DEPTH = 3  # how deep the globals of Python functions a function calls are followed


_names_of: dict = {}


def _global_names(code) -> tuple:
    """The names ``code`` and the code nested in it (lambdas, comprehensions) load;
    a superset of the globals it reads (attribute names are among them, and string
    constants that are identifiers: ``getattr(cfg, "alpha")``, ``vars(cfg)["alpha"]``).
    Memoized."""
    names = _names_of.get(code)
    if names is None:
        found = set(code.co_names) | {c for c in code.co_consts if isinstance(c, str) and c.isidentifier()}
        for c in code.co_consts:
            if inspect.iscode(c):
                found.update(_global_names(c))
        names = _names_of[code] = tuple(sorted(found))
    return names


def _reads(fn, out: list, seen: set, depth: int, names: set | None = None) -> None:
    """Append to ``out`` what a Python function's result depends on besides its
    arguments: its closure cells' contents, its defaults, and the current values of the
    module globals its code names, following the Python functions among them (a helper
    such as T5's bucket) ``depth`` levels down; add to ``names`` the names each of
    those functions' code loads."""
    if names is not None:
        names.update(_global_names(fn.__code__))
    values = []
    for c in fn.__closure__ or ():
        try:
            values.append(c.cell_contents)
        except ValueError:
            values.append(None)
    out.extend(values)
    out.append(fn.__defaults__)
    out.append(fn.__kwdefaults__)
    g = fn.__globals__
    for name in _global_names(fn.__code__):
        val = g.get(name, _MISSING)
        if val is not _MISSING:
            out.append(val)
            values.append(val)
    if depth:
        for val in values:
            if isinstance(val, types.ModuleType):
                if _user_module(val):  # its functions that the code names (cfg.shape) are helpers too
                    code_names = _global_names(fn.__code__)
                    for f in [v for v in (vars(val).get(n) for n in code_names) if inspect.isfunction(v)]:
                        if id(f) not in seen:
                            seen.add(id(f))
                            _reads(f, out, seen, depth - 1, names)
            elif (inspect.isfunction(val) and id(val) not in seen
                    and not (getattr(val, "__module__", None) or "").startswith("torch")):
                seen.add(id(val))
                _reads(val, out, seen, depth - 1, names)


#: Top-level packages whose modules a function reads as libraries (their attributes
#: are functions and constants that do not change), not as namespaces of state.
_LIBRARY_PACKAGES = frozenset({"torch", "numpy", "math", "cmath", "operator", "functools", "builtins", "triton",
                               "flashgen", "typing", "collections", "itertools", "random", "os", "sys"})


def _user_module(val) -> bool:
    """Whether ``val`` is a module a function may read state from (``cfg.temperature``
    of an ``import cfg``): a module outside :data:`_LIBRARY_PACKAGES`."""
    return (isinstance(val, types.ModuleType)
            and (getattr(val, "__name__", None) or "").partition(".")[0] not in _LIBRARY_PACKAGES)


_SCALARS = (type(None), bool, int, float, str, bytes, complex)
#: What the state key names by identity alone: code, classes and modules (cheaper to
#: test than inspect's predicates, on every call).
_CODE_TYPES = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.BuiltinMethodType,
               types.WrapperDescriptorType, types.MethodWrapperType, types.MethodDescriptorType, types.ModuleType)


#: What :func:`_trace_key_code` does not key as state (a user module aside).
_NOT_STATE = (torch.Tensor, *_SCALARS, *_CODE_TYPES)


def _scalar_token(val):
    """A token of ``val``'s value when it is a Python number, string or None (a float by
    its bits: NaN equals itself), else None."""
    if isinstance(val, float):
        return ("f", val.hex())
    if isinstance(val, _SCALARS):
        return ("=", type(val).__name__, val)
    return None


def _attributes(obj, names, own: bool) -> list:
    """(name, value) of ``obj``'s attributes among ``names``: the state a traced function
    may read through ``obj.name``.  Its instance dict (a module's parameters, buffers
    and submodules too) and ``__slots__`` members; for the function's own object
    (``own``: a bound method's instance, a callable object) also its class's Python
    properties (run now) and plain class attributes where they give a number, string
    or tensor.  Methods are code, not state; nothing else runs (no C-level descriptors,
    no ``__getattr__``)."""
    try:
        d = object.__getattribute__(obj, "__dict__")
    except Exception:  # noqa: BLE001 (no instance dict; a __getattr__ that raises is not asked)
        d = {}
    if not isinstance(d, dict):
        d = {}
    stores = [d.get(n) for n in ("_parameters", "_buffers", "_modules")] if isinstance(obj, torch.nn.Module) else []
    out = []
    for name in names:
        if name in d:
            out.append((name, d[name]))
            continue
        held = next((st[name] for st in stores if isinstance(st, dict) and name in st), _MISSING)
        if held is not _MISSING:
            out.append((name, held))
            continue
        kind = _class_kind(type(obj), name)
        if kind is None or (not own and kind != "slot"):
            continue
        try:
            val = getattr(type(obj), name) if kind == "plain" else getattr(obj, name)
        except Exception:  # noqa: BLE001 (the trace would have failed on it)
            continue
        if kind == "slot" or isinstance(val, torch.Tensor) or _scalar_token(val) is not None:
            out.append((name, val))
    return out


_class_kinds: dict = {}


def _class_kind(cls, name: str):
    """How :func:`_attributes` reads ``name`` on instances of ``cls`` beyond their
    instance dict: "slot" (a ``__slots__`` member: no user code runs), "property" (a
    Python property: run on the instance), "plain" (a class attribute that is no
    descriptor: read off the class, so a reassigned one is seen), or None (absent, a
    method, another descriptor).  Memoized per class and name (inspect's static lookup
    walks the MRO)."""
    key = (cls, name)
    kind = _class_kinds.get(key, _MISSING)
    if kind is _MISSING:
        static = inspect.getattr_static(cls, name, _MISSING)
        if isinstance(static, types.MemberDescriptorType):
            kind = "slot"
        elif isinstance(static, property):
            kind = "property"
        elif static is _MISSING or hasattr(type(static), "__get__"):
            kind = None
        else:
            kind = "plain"
        if len(_class_kinds) > 4096:
            _class_kinds.clear()
        _class_kinds[key] = kind
    return kind


_STATE_ITEMS = 256  # tokens one key may hold; past them an object is keyed by identity alone


def _is_array(val) -> bool:
    """Whether ``val`` is an array that :func:`_buffer_token` keys by its contents: a
    NumPy ``ndarray`` (when NumPy is imported), ``array.array``, ``bytearray`` or
    ``memoryview``."""
    if isinstance(val, (bytearray, memoryview, array.array)):
        return True
    np = sys.modules.get("numpy")
    return np is not None and isinstance(val, np.ndarray)


def _buffer_token(val):
    """A token of the contents of an object with the buffer protocol other than bytes
    (a NumPy array, ``array.array``, ``bytearray``, ``memoryview``): its type, item
    format, shape and a digest of its bytes (a trace takes ``float(arr[1])`` as a
    constant, and an array has no version to check); None for any other object."""
    if not _is_array(val):
        return None
    with memoryview(val) as view:
        if view.format == "O":  # an object array: its items as the objects they are
            return None
        data = view if view.c_contiguous else view.tobytes()
        return ("buf", type(val).__name__, view.format, view.shape, hashlib.blake2b(data, digest_size=16).digest())


def _state(val, names, depth: int, objs: list, budget: list, own: bool = False):
    """A hashable token of what a trace may have taken from ``val`` as a constant: a
    number or string by value; a tensor by identity (appended to ``objs``; its version
    is checked apart, :func:`trace`); an array (:func:`_buffer_token`) by its contents;
    a list, tuple or dict by its items; a class by its
    own plain attributes among ``names``; another object by identity and its
    attributes among ``names`` (the names the function's code, and its helpers', load;
    :func:`_attributes`, ``own`` for the function's own object), ``depth`` levels down.
    ``budget`` ([tokens left]) bounds the work: past it, identity alone.  Objects keyed
    by identity are appended to ``objs`` except containers (the cache would hold them
    strongly, and the tensors in them with them); their items are tokens."""
    token = _scalar_token(val)
    if token is not None:
        return token
    budget[0] -= 1
    if isinstance(val, torch.Tensor):
        objs.append(val)
        return ("t", id(val))
    buf = _buffer_token(val)
    if buf is not None:
        return buf
    if isinstance(val, (list, tuple, dict)):
        if depth <= 0 or budget[0] <= 0:
            return ("id", id(val))
        items = val.items() if isinstance(val, dict) else enumerate(val)
        return ("items", type(val).__name__, tuple(((k if _scalar_token(k) is not None else id(k)),
                                                    _state(x, names, depth - 1, objs, budget)) for k, x in items))
    objs.append(val)
    if _user_module(val):
        # a module as a namespace of constants (helpers by identity; a submodule as one)
        attrs = vars(val)
        return ("mod", id(val), tuple(sorted(
            (n, ("id", id(attrs[n])) if isinstance(attrs[n], _CODE_TYPES) and not _user_module(attrs[n])
             else _state(attrs[n], names, depth - 1, objs, budget)) for n in names if n in attrs)))
    if isinstance(val, type):  # a class as a namespace of constants
        own_attrs = vars(val)
        return ("cls", id(val), tuple((n, _state(own_attrs[n], names, 0, objs, budget)) for n in names
                                      if n in own_attrs and not isinstance(own_attrs[n], _CODE_TYPES)))
    if depth <= 0 or budget[0] <= 0 or isinstance(val, _CODE_TYPES):
        return ("id", id(val))
    if isinstance(val, functools.partial):
        return ("partial", id(val.func), _state((val.args, val.keywords), names, depth - 1, objs, budget))
    return ("o", id(val), tuple((n, _state(x, names, depth - 1, objs, budget))
                                for n, x in _attributes(val, names, own)))


_STATE_DEPTH = 3  # how deep the attributes of the objects a function reads are followed


_method_names_of: dict = {}


def _method_names(owner, names: set) -> frozenset:
    """``names`` with those loaded by the code of ``owner``'s methods that ``names``
    names (``self._bias()`` reading ``self.alpha``), one level down.  Memoized per
    class and names."""
    key = (type(owner), frozenset(names))
    out = _method_names_of.get(key)
    if out is None:
        found = set(names)
        for name in names:
            static = inspect.getattr_static(type(owner), name, None)
            if isinstance(static, (staticmethod, classmethod)):
                static = static.__func__
            if inspect.isfunction(static):
                found.update(_global_names(static.__code__))
        if len(_method_names_of) > 1024:
            _method_names_of.clear()
        out = _method_names_of[key] = frozenset(found)
    return out


def _ident_token(val):
    """A read's part of a function's identity: a number or string by value (a closure
    over a value computed again per call, equal, is the same function), a container or
    an array (:func:`_is_array`) by its type (its items are state), anything else by
    identity."""
    token = _scalar_token(val)
    if token is not None:
        return token
    if isinstance(val, (list, tuple, dict)):
        return ("container", type(val).__name__)
    if _is_array(val):
        return ("array", type(val).__name__)
    return id(val)


def _trace_key(fn) -> tuple[tuple, tuple, list]:
    """(identity, state, objects) of a function for the trace cache.

    The identity: a Python function by its code and what it reads besides its
    arguments (:func:`_reads`: closure contents, defaults, the module globals it names
    and its helpers'), numbers by value and objects by identity, so a closure made again
    on every forward call over the same objects hits, and a function whose global
    tensor was rebound (a re-run notebook cell, a loaded checkpoint) is traced again; a
    bound method by its function and its instance; a callable object as its bound
    ``__call__``; a ``functools.partial`` by its function; anything else by identity.
    The state: the values a trace may have taken as constants from what the function
    reads (:func:`_state`: ``self.temperature``, a callable object's attribute, a
    property's tensor, a list's items, a partial's arguments), so a changed one traces
    again rather than running the old value.  The objects: those the identity and the
    state name by identity (the cache keeps them, weakly where they take it, so the
    identities stay valid)."""
    if inspect.ismethod(fn) and inspect.isfunction(fn.__func__):
        # a bound method (``self.score_mod`` of a module) is made again on every access:
        # keyed by its function, its instance and the instance's state its code reads
        ident, state, reads, names = _trace_key_code(fn.__func__)
        owner = fn.__self__
        objs: list = [owner]
        owned = _state(owner, _method_names(owner, names), _STATE_DEPTH, objs, [_STATE_ITEMS], own=True)
        return ("method", ident, id(owner)), (state, owned), reads + objs
    if isinstance(fn, functools.partial):
        if inspect.isfunction(fn.func):
            ident, state, reads, names = _trace_key_code(fn.func)
        else:
            (ident, state, reads), names = _trace_key(fn.func), set()
        objs = []
        bound = _state((fn.args, fn.keywords), names, _STATE_DEPTH, objs, [_STATE_ITEMS])
        return ("partial", ident), (state, bound), reads + objs
    if not inspect.isfunction(fn):
        call = getattr(type(fn), "__call__", None)
        if inspect.isfunction(call) and not isinstance(fn, torch.nn.Module):
            ident, state, reads = _trace_key(types.MethodType(call, fn))
            return ("obj", ident), state, reads
        return ("obj", id(fn)), (), [fn]
    ident, state, reads, _ = _trace_key_code(fn)
    return ident, state, reads


def _trace_key_code(fn) -> tuple[tuple, tuple, list, set]:
    """:func:`_trace_key` of a Python function, and the names its code and its helpers'
    load."""
    reads: list = []
    names: set = set()
    _reads(fn, reads, {id(fn)}, _READ_DEPTH, names)
    objs: list = []
    budget = [_STATE_ITEMS]
    state = tuple(_state(r, names, _STATE_DEPTH - 1, objs, budget) for r in reads
                  if not isinstance(r, _NOT_STATE) or _user_module(r))
    held = [r for r in reads if _scalar_token(r) is None and not isinstance(r, (list, tuple, dict))
            and not _is_array(r)]
    ident = ("code", fn.__code__, tuple(_ident_token(r) for r in reads), id(fn.__globals__))
    return ident, state, held + objs, names


def _constant_versions(objs: list, tr: "Traced") -> tuple:
    """(weak reference, version) of the tensors among ``objs`` that ``tr`` does not read
    as buffers, or also computed with outside the trace (``tr.eager_reads``: a buffer
    ``doc`` of ``doc[q_idx]`` whose ``int(doc.max())`` the trace holds): a trace can
    have taken them as constants (``t.item()``, ``float(t)``), so an in-place change
    traces again.  None where one of them is an inference tensor (no version counter):
    such a trace is not cached, the next call traces again."""
    bufs = {id(t) for t in tr.captured} - tr.eager_reads
    out, seen = [], set()
    for t in objs:
        if isinstance(t, torch.Tensor) and id(t) not in bufs and id(t) not in seen:
            if t.is_inference():
                return None
            seen.add(id(t))
            out.append((_ref(t), t._version))
    return tuple(out)


def trace(fn, kind: str) -> Traced:
    """The traced function, cached (:func:`_trace_key`): one entry per function identity,
    traced again (and replaced) when its state or a tensor it took as a constant
    changed.  The cache holds what it names by weak reference where the objects take
    one (functions, tensors, modules), so it keeps no user tensor alive: an entry whose
    objects died (their identities may be reused) is traced again.  ``kind``: "score"
    or "mask"."""
    if not callable(fn):
        raise InputError(f"{kind}_mod must be callable, got {type(fn).__name__}")
    # a module is traced as its forward (torch.fx traces no module call) and held itself
    # (its forward is a bound method made again on every access)
    held = fn
    if isinstance(fn, torch.nn.Module):
        fn = fn.forward
    ident, state, reads = _trace_key(fn)
    key = (ident, kind)
    hit = _traces.get(key)
    if (hit is not None and hit[0].alive() and hit[2] == state and len(hit[1]) == len(reads)
            and all(r() is obj for r, obj in zip(hit[1], reads))
            and all(r() is not None and r()._version == v for r, v in hit[3])):
        _traces.move_to_end(key)
        hit[0].seen(held)  # an equal function (same code and objects), alive for this call
        return hit[0]
    tr = Traced(fn, kind, frozenset(map(id, reads)))
    tr.seen(held)
    versions = _constant_versions(reads, tr)
    if versions is None:  # a constant from an inference tensor: an in-place change is not seen
        _traces.pop(key, None)
        return tr
    _traces[key] = (tr, [_ref(r) for r in reads], state, versions)
    _traces.move_to_end(key)
    if len(_traces) > _TRACES_MAX:
        _traces.popitem(last=False)
    return tr


# -- block mask ----------------------------------------------------------------------

def _versions(tensors) -> tuple | None:
    try:
        return tuple((id(t), t._version) for t in tensors)
    except RuntimeError:  # inference tensors have no version counter: not cached
        return None


_block_cache: collections.OrderedDict = collections.OrderedDict()
_BLOCK_CACHE_MAX = 64


def _tiles(mask_mod, batch, heads, sq, sk, lo, hi, block_m, block_n, device):
    """(any, all) visibility per (block_m, block_n) tile, bool (Bx, Hx, nm, nn), where
    Bx / Hx are 1 when the mask does not depend on the batch / head.  Rows past seqlen_q
    do not count; a tile reaching past seqlen_k is never all visible."""
    nm, nn = -(-sq // block_m), -(-sk // block_n)
    B = torch.arange(batch, device=device).view(-1, 1, 1, 1)
    H = torch.arange(heads, device=device).view(1, -1, 1, 1)
    J = torch.arange(nn * block_n, device=device).view(1, 1, 1, -1)
    chunk = max(1, (1 << 24) // max(1, nn * block_n * block_m * batch * heads))
    anys, alls = [], []
    for m0 in range(0, nm, chunk):
        m1 = min(nm, m0 + chunk)
        I = torch.arange(m0 * block_m, m1 * block_m, device=device).view(1, 1, -1, 1)
        # the user's function sees in-range indices only (it may index tensors with them)
        vis = torch.as_tensor(mask_mod(B, H, I.clamp(max=sq - 1), J.clamp(max=sk - 1)), device=device)
        if vis.dtype != torch.bool:
            vis = vis != 0
        vis = vis & ((J - I) >= lo) & ((J - I) <= hi) & (J < sk)
        shape = torch.broadcast_shapes(vis.shape, (1, 1, I.shape[2], J.shape[3]))
        if len(shape) != 4:
            raise InputError(f"mask_mod returned a tensor of shape {tuple(vis.shape)} for index tensors of shapes "
                             f"{tuple(B.shape)}, {tuple(H.shape)}, {tuple(I.shape)}, {tuple(J.shape)}: it must "
                             "broadcast elementwise")
        vis = vis.expand(shape)
        rows = I < sq
        bx, hx = shape[0], shape[1]
        v_any = (vis & rows).reshape(bx, hx, m1 - m0, block_m, nn, block_n)
        v_all = (vis | ~rows).reshape(bx, hx, m1 - m0, block_m, nn, block_n)
        anys.append(v_any.any(5).any(3))
        alls.append(v_all.all(5).all(3))
    bx = max(a.shape[0] for a in anys)
    hx = max(a.shape[1] for a in anys)
    any_ = torch.cat([a.expand(bx, hx, *a.shape[2:]) for a in anys], 2)
    all_ = torch.cat([a.expand(bx, hx, *a.shape[2:]) for a in alls], 2)
    return any_, all_


def _ranges(any_, full, block: int, extent: int):
    """(..., nb) tile flags -> (..., 4) int32 [first visited, interior start, interior
    end, end) in rows/columns: the visited span is first..last non-empty tile, the
    interior the longest run of full tiles (none: start = end = the span's end)."""
    nb = any_.shape[-1]
    idx = torch.arange(nb, device=any_.device)
    first = torch.where(any_, idx, nb).amin(-1)
    last = torch.where(any_, idx, -1).amax(-1)
    cs = full.to(torch.int32).cumsum(-1)
    run = cs - torch.where(full, 0, cs).cummax(-1).values
    best = run.amax(-1)
    best_end = run.argmax(-1)
    end = torch.clamp((last + 1) * block, max=extent)
    start = first * block
    flo = torch.where(best > 0, (best_end - best + 1) * block, end)
    fhi = torch.where(best > 0, (best_end + 1) * block, end)
    out = torch.stack([start, flo, fhi, end], -1)
    return torch.where((last >= 0)[..., None], out, 0).to(torch.int32).contiguous()


def _divides_by_a_variable(g: Graph) -> bool:
    """Whether integer arithmetic of ``g`` divides (//, %) by a value that is not a
    constant (:meth:`Traced._safe_divisor`: the kernels divide by 1 where it is 0)."""
    return any(n.op in ("floordiv", "mod") and n.dtype == "int" and isinstance(n.args[1], Ref) for n in g.nodes)


def block_ranges(traced: Traced, kind: str, batch: int, heads: int, kv_heads: int, seqlen_q: int, seqlen_k: int,
                 lo: int, hi: int, block_m: int, block_n: int, device, fn=None) -> torch.Tensor:
    """The block mask of ``traced`` (a mask function) with the built-in bounds lo <= j - i
    <= hi, for tiles (block_m, block_n): int32 (Bx, Hx, blocks, 4) of [first visited,
    interior start, interior end, end).  ``kind`` "q": per query block over key columns
    (fwd, bwd_dq; Hx over query heads); "k": per key block over query rows (bwd_dkdv;
    Hx over kv heads, the union over each GQA group).  Cached per (function, captured
    tensors' identities and versions, sizes, tile shape).  ``fn``: the function
    ``traced`` traced (default: the one it holds; a call passes its own)."""
    ver = _versions(traced.captured)
    key = (id(traced), ver, kind, batch, heads, kv_heads, seqlen_q, seqlen_k, lo, hi, block_m, block_n, str(device))
    hit = _block_cache.get(key) if ver is not None else None
    if hit is not None and hit[0]() is traced:
        _block_cache.move_to_end(key)
        return hit[1]
    with torch.no_grad():
        if _divides_by_a_variable(traced.graph):
            # torch's integer division by 0 raises on the CPU and gives its own value on
            # CUDA, where the kernels divide by 1: every tile the bounds leave is partial,
            # so the kernels' predicate alone decides
            any_, all_ = _tiles(lambda b, h, i, j: torch.ones((), dtype=torch.bool, device=device), batch, heads,
                                seqlen_q, seqlen_k, lo, hi, block_m, block_n, device)
            all_ = torch.zeros_like(all_)
        else:
            any_, all_ = _tiles(fn if fn is not None else traced.fn, batch, heads, seqlen_q, seqlen_k, lo, hi,
                                block_m, block_n, device)
        nm, nn = any_.shape[2], any_.shape[3]
        full = all_.clone()
        if seqlen_k % block_n:
            full[..., nn - 1] = False
        if kind == "q":
            out = _ranges(any_, full, block_n, seqlen_k)
        else:
            if seqlen_q % block_m:
                full[:, :, nm - 1, :] = False
            group = heads // kv_heads
            if any_.shape[1] == heads and group > 1:
                any_ = any_.view(any_.shape[0], kv_heads, group, nm, nn).any(2)
                full = full.view(full.shape[0], kv_heads, group, nm, nn).all(2)
            out = _ranges(any_.transpose(-1, -2), full.transpose(-1, -2), block_m, seqlen_q)
    if ver is not None:
        _block_cache[key] = (weakref.ref(traced), out)
        if len(_block_cache) > _BLOCK_CACHE_MAX:
            _block_cache.popitem(last=False)
    return out


# -- captured-tensor index bounds ----------------------------------------------------

_reads_cache: collections.OrderedDict = collections.OrderedDict()
_READS_CACHE_MAX = 256


def check_reads(traced: Traced | None, batch: int, heads: int, seqlen_q: int, seqlen_k: int, device) -> None:
    """Raise InputError when ``traced`` would read one of its captured tensors outside
    its size: at an index >= the size along a dim (torch raises IndexError there) or a
    negative one (torch wraps it; the kernels would read before the tensor), at any
    (b, h, q_idx, kv_idx) of the (batch, heads, seqlen_q, seqlen_k) grid
    (:mod:`flashgen.user_bounds`; indices that depend on the score are not checked).
    Runs once per (function, sizes, captured tensors' shapes, and the versions of the
    captured tensors an index is read from, ``idx`` of ``table[idx[q_idx]]``): a
    repeated call costs a dict lookup.  Not run while a CUDA graph is being captured
    (it reads the ranges back to the host; the warm-up call before a capture checks)."""
    if traced is None or not traced.reads.loads or 0 in (batch, heads, seqlen_q, seqlen_k):
        return
    r = traced.reads
    ver = _versions([traced.captured[n] for n in r.sources])
    key = (id(traced), ver, tuple(tuple(t.shape) for t in traced.captured), batch, heads, seqlen_q, seqlen_k,
           str(device))
    hit = _reads_cache.get(key) if ver is not None else None
    if hit is not None and hit() is traced:
        _reads_cache.move_to_end(key)
        return
    if dispatch.graph_capturing():
        return
    arg = f"{traced.kind}_mod"
    with torch.no_grad():
        ranges = user_bounds.read_ranges(traced.graph, r, traced.captured, batch, heads, seqlen_q, seqlen_k, device)
        msg = user_bounds.bounds_error(arg, traced.captured, traced.graph, r, ranges,
                                       (batch, heads, seqlen_q, seqlen_k), device)
    if msg is not None:
        raise InputError(msg)
    if ver is not None:
        _reads_cache[key] = weakref.ref(traced)
        if len(_reads_cache) > _READS_CACHE_MAX:
            _reads_cache.popitem(last=False)


# -- launch arguments ----------------------------------------------------------------

def _kernel_of(mod) -> str:
    vid = mod.VARIANT_ID
    for k in ("bwd_dkdv", "bwd_dq", "fwd"):
        if vid.startswith(f"attn_{k}_"):
            return k
    raise ValueError(f"not a dense kernel: {vid}")


@dataclasses.dataclass
class UserArgs:
    """The runtime arguments of a user variant (what :class:`flashgen.ops.ScoreMods` is
    to the built-in mods): ``name`` its ``KernelSpec.mods``, the buffers (captured
    tensors as the kernels read them), the gradient buffers (float32, bwd_dq), the mask
    function and sizes for the block mask, the sinks."""

    low: Lowered
    bufs: list
    grads: list
    mask: Traced | None
    sizes: tuple  # (batch, heads, kv_heads, seqlen_q, seqlen_k, lo, hi)
    sinks: torch.Tensor | None
    device: torch.device
    #: the call's mask function and what its functions read, held while the call's
    #: kernels may run (the backward's block masks), since :class:`Traced` holds them weakly
    mask_fn: object = None
    keep: tuple = ()

    #: A launcher may keep launch plans of this variant's calls (:mod:`flashgen.plans`):
    #: its arguments are tensors, which a plan takes as inputs, and values fixed by the
    #: functions, the sizes and the tile, which go into the plan's key (none is drawn per
    #: call, as the built-in dropout's seed is).
    plannable = True

    @property
    def name(self) -> str:
        return self.low.name

    def kernel_args(self, softmax_scale: float, with_scale: bool, mod=None, config=None,
                    kernel: str | None = None) -> list:
        """In the order of :meth:`flashgen.user_render.Context.kernel_params`; ``kernel``
        ("fwd", "bwd_dq", "bwd_dkdv"): the launch's, else read from ``mod``."""
        kernel = kernel or _kernel_of(mod)
        out = self._args(softmax_scale if with_scale else None, kernel, config.BLOCK_M if config else 0,
                         config.BLOCK_N if config else 0)
        if self.low.sinks and kernel == "fwd":
            out.append(self.sinks)
        return out

    def gluon_fwd_args(self, softmax_scale: float, block_m: int, block_n: int) -> list:
        """The Gluon forward's arguments after diag_hi (:func:`flashgen.families.gluon.user.template_vars`:
        :meth:`kernel_args`' order without the sinks, which that kernel takes before the
        scale), the block mask in tiles of ``block_m`` (the program's rows) by ``block_n``."""
        return self._args(softmax_scale, "fwd", block_m, block_n)

    def gluon_bwd_args(self, block_m: int, block_nt: int) -> list:
        """The Gluon backward's arguments after m_pad
        (:func:`flashgen.families.gluon.user_bwd.bwd_template_vars`): the functions'
        captured tensors with their strides, the float32 gradient buffers of those that
        take one (as bwd_dq's), and the mask function's block mask per key block of
        ``block_nt`` rows and kv head in tiles of ``block_m`` query rows."""
        return self._args(None, "bwd_dkdv", block_m, block_nt, grads=True)

    def _args(self, softmax_scale: float | None, kernel: str, block_m: int, block_n: int,
              grads: bool | None = None) -> list:
        """The scale (None: left out), the buffers with their strides (and sizes where read
        at an index computed from the score: checked in the kernel), the gradient buffers
        (``grads``; default: bwd_dq's), and the block mask in (block_m, block_n) tiles (a
        band needs none)."""
        out: list = [softmax_scale] if softmax_scale is not None and self.low.score is not None else []
        for n, t in enumerate(self.bufs):
            out += [t, *t.stride()]
            if n in self.low.sized_bufs:
                out += list(t.shape)
        if kernel == "bwd_dq" if grads is None else grads:
            out += [g for g in self.grads if g is not None]
        if self.low.mask is not None and self.low.band is None:
            b, h, hk, sq, sk, lo, hi = self.sizes
            bm = block_ranges(self.mask, "k" if kernel == "bwd_dkdv" else "q", b, h, hk, sq, sk, lo, hi, block_m,
                              block_n, self.device, self.mask_fn)
            out += [bm, bm.stride(0) if bm.shape[0] > 1 else 0, bm.stride(1) if bm.shape[1] > 1 else 0]
        return out


def _lowered(direction, score: Traced | None, mask: Traced | None, grad_flags, sinks: bool) -> Lowered:
    sbufs = score.bufs if score is not None else ()
    if direction == "bwd":
        sbufs = tuple(dataclasses.replace(b, grad=f) for b, f in zip(sbufs, grad_flags))
    bufs = sbufs + (mask.bufs if mask is not None else ())
    grads = ()
    if score is not None and direction == "bwd":
        grads = tuple((i, n, score.dloads[i]) for i, n in score.loads if grad_flags[n])
    fields = (direction, score.graph if score else None, score.out if score else None,
              score.dscore if score else None, grads, mask.graph if mask else None,
              mask.out if mask else None, len(sbufs), bufs, sinks, bool(score and score.guard))
    reductions = tuple(r for r in (user_grads.reduction(score.graph, i, n, tuple(score.captured[n].shape))
                                   for i, n, _ in grads) if r is not None)
    if reductions:  # small gathered extents: the gradient is summed per index value in the tile
        return user_grads.Reduced(*fields, reductions=reductions)
    return Lowered(*fields)


def score_grad_flags(score: Traced | None) -> list[bool]:
    """Which captured tensors of a traced score function take a gradient (float tensors
    that require grad; the kernels of a backward with grad mode on accumulate them)."""
    return [t.requires_grad and t.is_floating_point() for t in (score.captured if score else ())]


def _weak_or_none(x):
    """A weak reference to ``x``, or a callable giving None for None."""
    return (lambda: None) if x is None else weakref.ref(x)


_lowerings: collections.OrderedDict = collections.OrderedDict()
_LOWERINGS_MAX = 256


def lowering(direction: str, score: Traced | None, mask: Traced | None, grad_flags, sinks: bool) -> Lowered:
    """The lowering that :func:`attention` compiles for ``direction`` ("fwd": the
    forward kernel, with ``sinks``; "bwd": bwd_dq and bwd_dkdv, accumulating the
    gradients of the captured tensors flagged in ``grad_flags``), registered in this
    process; its ``name`` is the variants' ``KernelSpec.mods`` (what tuning rows are
    keyed by).  Made once per (direction, traced functions, flags) and cached (the
    cache holds the traced functions, so their identities stay valid): naming a
    lowering hashes its whole code, which would otherwise be host time on every call.
    ``score`` / ``mask`` may be their :meth:`Traced.widened` forms."""
    sinks = bool(sinks) and direction == "fwd"
    flags = tuple(bool(f) for f in grad_flags) if direction == "bwd" else ()
    shapes = tuple(tuple(t.shape) for t in score.captured) if score is not None and direction == "bwd" else ()
    key = (direction, id(score), id(mask), flags, sinks, shapes)
    hit = _lowerings.get(key)
    if hit is not None and hit[0]() is score and hit[1]() is mask:
        _lowerings.move_to_end(key)
        return hit[2]
    low = _lowered(direction, score, mask, flags, sinks)
    user_render.register(low)
    # the traced functions weakly: a trace the trace cache replaced (its captured tensors
    # with it) is not kept alive here; a dead one's identity never matches again
    _lowerings[key] = (_weak_or_none(score), _weak_or_none(mask), low)
    if len(_lowerings) > _LOWERINGS_MAX:
        _lowerings.popitem(last=False)
    return low


def wide(score: Traced | None, mask: Traced | None, batch: int, heads: int, seqlen_q: int, seqlen_k: int) -> bool:
    """Whether the functions run in their :meth:`Traced.widened` forms at these sizes
    (:meth:`Traced.wide`): an int32 value the kernels compute could leave int32 where
    torch's int64 does not."""
    return any(t is not None and t.wide(batch, heads, seqlen_q, seqlen_k) for t in (score, mask))


def _as_run(score, mask, w: bool):
    """(score, mask) as the kernels compile them: their widened forms when ``w``."""
    if not w:
        return score, mask
    return (score.widened() if score is not None else None), (mask.widened() if mask is not None else None)


def kernel_args(score: Traced | None, mask: Traced | None, grad_flags, sinks, sizes: tuple, device,
                backward: bool, wide_: bool | None = None) -> tuple[UserArgs, UserArgs | None]:
    """(forward UserArgs, backward UserArgs or None) of the functions ``score`` / ``mask``
    (traced) and ``sinks`` for ``sizes`` = (batch, heads, kv_heads, seqlen_q,
    seqlen_k, lo, hi) on ``device`` (in their widened forms where :func:`wide` says so at
    these sizes, or as ``wide_`` says): their lowerings registered, the captured tensors
    as the kernels read them, and, when ``backward`` and there is a function, zeroed
    float32 gradient buffers of the captured tensors flagged in ``grad_flags``."""
    scaptured = score.captured if score else []
    mcaptured = mask.captured if mask else []
    sbufs = [_kernel_buffer(t, "score_mod", device) for t in scaptured]
    mbufs = [_kernel_buffer(t, "mask_mod", device) for t in mcaptured]
    bufs = sbufs + mbufs
    mask_fn = mask.fn if mask is not None else None
    keep = (score.fn if score is not None else None, mask_fn, *scaptured, *mcaptured)
    w = wide(score, mask, sizes[0], sizes[1], sizes[3], sizes[4]) if wide_ is None else wide_
    ls, lm = _as_run(score, mask, w)
    fwd = UserArgs(lowering("fwd", ls, lm, grad_flags, sinks is not None), bufs, [], mask, sizes,
                   sinks.detach().contiguous() if sinks is not None else None, device, mask_fn, keep)
    if not backward or (score is None and mask is None):
        return fwd, None  # sinks alone: the plain backward kernels (sinks' gradient from LSE and delta)
    grads = [torch.zeros(t.shape, dtype=torch.float32, device=device) if f else None
             for t, f in zip(sbufs, grad_flags)] + [None] * len(mbufs)
    return fwd, UserArgs(lowering("bwd", ls, lm, grad_flags, False), bufs, grads, mask, sizes, None, device,
                         mask_fn, keep)


# -- reference (torch, materialized) -------------------------------------------------

def reference(q, k, v, scale, lo, hi, score_mod=None, mask_mod=None, sinks=None, dtype=torch.float64):
    """(O, LSE) in ``dtype`` by materializing the scores: S = scale·QKᵀ, then
    ``score_mod`` on the whole (batch, heads, seqlen_q, seqlen_k) grid, masked where
    the built-in bounds (lo <= j - i <= hi) or ``mask_mod`` hide a key, softmax with one
    extra logit ``sinks[h]`` per row when given (its probability multiplies no value;
    LSE includes it).  Differentiable (autograd) in q, k, v, sinks and the captured
    tensors.  A row that sees no key and has no sink gives O = 0, LSE = -inf."""
    b, h, sq, _ = q.shape
    sk, group = k.shape[2], q.shape[1] // k.shape[1]
    q, k, v = (t.to(dtype) for t in (q, k, v))
    if group > 1:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    dev = q.device
    B = torch.arange(b, device=dev).view(-1, 1, 1, 1)
    H = torch.arange(h, device=dev).view(1, -1, 1, 1)
    I = torch.arange(sq, device=dev).view(1, 1, -1, 1)
    J = torch.arange(sk, device=dev).view(1, 1, 1, -1)
    if score_mod is not None:
        s = clamp_scores((score_mod(s, B, H, I, J) + torch.zeros_like(s)).to(dtype))
    vis = ((J - I) >= lo) & ((J - I) <= hi)
    if mask_mod is not None:
        vis = vis & torch.as_tensor(mask_mod(B, H, I, J), device=dev).to(torch.bool)
    vis = vis.expand(b, h, sq, sk)
    sink = sinks.to(dtype)[None, :, None, None].expand(b, h, sq, 1) if sinks is not None else None
    p, lse = softmax_rows(s, vis, sink)
    return p @ v, lse


# -- autograd ------------------------------------------------------------------------

class _ReadGuard(torch.autograd.Function):
    """The identity on O of the reference path, saving the tensors its backward re-reads
    (q, k, v, the captured tensors, the sinks): autograd's graph there holds float32
    copies of some and values indexed out of others, so an in-place change of one
    before the backward went unnoticed; unpacking them raises autograd's RuntimeError
    ("modified by an inplace operation"), as the kernel path does."""

    @staticmethod
    def forward(ctx, o, *reads):
        ctx.save_for_backward(*reads)
        return o.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.saved_tensors  # the version check
        return (grad, *([None] * len(ctx.needs_input_grad[1:])))


@dataclasses.dataclass
class _Call:
    scale: float
    mask: str
    lo: int
    hi: int
    fwd: UserArgs | None
    bwd: UserArgs | None
    sinks: torch.Tensor | None
    grad_shapes: list  # (index into bufs, original tensor) of captured tensors that get a gradient
    reads: tuple = ()  # the captured tensors the functions read (saved: version-checked in the backward)
    deterministic: bool | None = None  # flashgen.attention's (None: torch's flag at the backward)


class _Attention(torch.autograd.Function):
    """(q, k, v, sinks, call, *captured tensors with gradients) -> (O, LSE); the
    captured tensors are inputs only so that autograd routes their gradients."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, call, *captured):
        o, lse = _forward(q, k, v, call)
        # the tensors the functions read and the sinks too: autograd's version check
        # then refuses a backward after one was modified in place (the backward re-reads them)
        ctx.save_for_backward(q, k, v, o, lse, *library.versioned((sinks, *call.reads)))
        ctx.call = call
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors[:5]
        call = ctx.call
        # bwd_dq (or a whole backward) writes every row's delta; nothing runs when empty
        delta = torch.zeros_like(lse) if library.is_empty(q, k) else torch.empty_like(lse)
        bwd = call.bwd
        if bwd is not None:
            for n, g in enumerate(bwd.grads):
                if g is not None:
                    g.zero_()
        dq, dk, dv = library.backward(do, q, k, v, o, lse, call.scale, call.mask, call.lo, call.hi, bwd, delta=delta,
                                      deterministic=call.deterministic)
        dsinks = None
        if call.sinks is not None and ctx.needs_input_grad[3]:
            # d LSE-softmax / d sink = -P_sink * delta per row (the sink multiplies no value)
            dsinks = -(torch.exp(call.sinks[None, :, None] - lse) * delta).sum((0, 2)).to(call.sinks.dtype)
        grads = []
        for n, t in call.grad_shapes:
            grads.append(bwd.grads[n].to(t.dtype).view(t.shape))
        if torch.is_grad_enabled():  # create_graph=True
            dq, dk, dv, dsinks, *grads = library.no_double_backward((q, k, v, do), (dq, dk, dv, dsinks, *grads))
        return (dq, dk, dv, dsinks, None, *grads)


def _forward(q, k, v, call: _Call):
    o, lse = library.forward(q, k, v, call.scale, call.mask, call.lo, call.hi, call.fwd)
    if library.is_empty(q, k) and call.sinks is not None and q.shape[2]:
        lse = call.sinks[None, :, None].expand_as(lse).contiguous()
    return o, lse


def _check_device(t: torch.Tensor, name: str, device) -> None:
    if t.device != device:
        raise InputError(f"{name} reads a captured tensor on {t.device}; q is on {device}: move it there")


def _kernel_buffer(t: torch.Tensor, name: str, device) -> torch.Tensor:
    _check_device(t, name, device)
    t = t.detach()
    if t.dtype == torch.bool:
        t = t.view(torch.int8)  # the same bytes (0 / 1): no copy kept for the backward
    elif t.dtype == torch.float64:
        t = t.to(torch.float32)
    return t if t.is_contiguous() else t.contiguous()


def _check_sinks(sinks, h: int, device) -> None:
    if not isinstance(sinks, torch.Tensor) or sinks.dtype != torch.float32 or tuple(sinks.shape) != (h,):
        got = f"{sinks.dtype} {tuple(sinks.shape)}" if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise InputError(f"sinks must be a float32 tensor of shape (num_heads,) = ({h},), got {got}")
    if sinks.device != device:
        raise InputError(f"sinks.device ({sinks.device}) must equal q.device ({device})")


def variant_names(q, k, *, score_mod=None, mask_mod=None, sinks=None) -> tuple[str, str]:
    """(forward, backward) ``KernelSpec.mods`` of :func:`flashgen.attention`'s call with
    these functions on q (batch, num_heads, seqlen_q, head_dim) and k (batch,
    num_kv_heads, seqlen_k, head_dim), as a call with gradients enabled compiles them
    (the backward's "" for sinks alone: the plain kernels).  Traces the functions,
    registers their lowerings and checks what :func:`attention` checks before any
    kernel runs: the sinks, the captured tensors' devices and (q not on the meta device)
    every index the functions compute within its tensor (:func:`check_reads`, which reads
    the captured tensors); copies no captured tensor and makes no kernel buffer.  Raises
    InputError for what :func:`attention` refuses, UnsupportedError for functions
    flashgen cannot compile."""
    st, mt = _traced(q, k, score_mod, mask_mod, sinks)
    flags = score_grad_flags(st)
    ls, lm = _as_run(st, mt, wide(st, mt, q.shape[0], q.shape[1], q.shape[2], k.shape[2]))
    fwd = lowering("fwd", ls, lm, flags, sinks is not None)
    bwd = lowering("bwd", ls, lm, flags, False) if st is not None or mt is not None else None
    return fwd.name, bwd.name if bwd is not None else ""


def _traced(q, k, score_mod, mask_mod, sinks, sizes_only: bool = False):
    """(score, mask) functions traced (None where not given), after the checks
    :func:`attention` makes on every path, before anything reads them: the sinks, the
    captured tensors on q's device, and (q not on the meta device and not
    ``sizes_only``) every index the functions compute within its tensor's extent
    (InputError; the reference would wrap a negative index as torch does)."""
    b, h, sq, _ = q.shape
    if sinks is not None:
        _check_sinks(sinks, h, q.device)
    st = trace(score_mod, "score") if score_mod is not None else None
    mt = trace(mask_mod, "mask") if mask_mod is not None else None
    for tr, name in ((st, "score_mod"), (mt, "mask_mod")):
        for t in (tr.captured if tr is not None else ()):
            _check_device(t, name, q.device)
    if not (q.is_meta or sizes_only):
        check_reads(st, b, h, sq, k.shape[2], q.device)
        check_reads(mt, b, h, sq, k.shape[2], q.device)
    return st, mt


#: Tensor types whose storage the kernels read (sinks are usually a Parameter).
_PLAIN = (torch.Tensor, torch.nn.Parameter)


@torch.compiler.disable
def attention(q, k, v, scale: float, mask: str, lo: int, hi: int, *, score_mod=None, mask_mod=None, sinks=None,
              deterministic: bool | None = None):
    """(O, LSE) of :func:`flashgen.attention` with user functions (the caller has checked
    q, k, v and turned causal/window into ``mask``, ``lo``, ``hi``).  See the module
    docstring and :func:`flashgen.attention` (``deterministic``: its argument, which
    the backward passes to :func:`flashgen.library.backward`)."""
    b, h, sq, _ = q.shape
    hk, sk = k.shape[1], k.shape[2]
    # vmap's batched tensors, fake and other subclass tensors: no storage for the kernels'
    # launches or the index checks, and no op to fall back on per sample (the functions
    # are not an op's arguments): the reference, whose torch ops each of them handles.
    # (A dispatch mode over plain tensors, a FLOP counter or a checkpointing policy,
    # still runs the kernels.)
    unreadable = library.functorch_active() or any(isinstance(t, torch.Tensor) and type(t) not in _PLAIN
                                            for t in (q, k, v, sinks))
    st, mt = _traced(q, k, score_mod, mask_mod, sinks, sizes_only=unreadable)
    reads = tuple(t for tr in (st, mt) if tr is not None for t in tr.captured)
    library.no_forward_ad("flashgen.attention", *reads)
    if unreadable or not library.use_kernels(q):
        # CPU without the interpreter (or bfloat16 in it): float32 math, materialized.
        o, lse = reference(q, k, v, scale, lo, hi, score_mod, mask_mod, sinks, torch.float32)
        o = o.to(q.dtype)
        if o.requires_grad:
            o = _ReadGuard.apply(o, *library.versioned((q, k, v, sinks, *reads)))
        return o, lse.detach()
    grad_on = torch.is_grad_enabled()
    sflags = [grad_on and f for f in score_grad_flags(st)]
    needs_grad = grad_on and (q.requires_grad or k.requires_grad or v.requires_grad or any(sflags)
                              or (sinks is not None and sinks.requires_grad))
    fwd, bwd = kernel_args(st, mt, sflags, sinks, (b, h, hk, sq, sk, lo, hi), q.device, needs_grad)
    grad_shapes = [(n, t) for n, (t, f) in enumerate(zip(st.captured if st else (), sflags))
                   if f and bwd is not None]
    call = _Call(scale, mask, lo, hi, fwd, bwd, sinks.detach() if sinks is not None else None, grad_shapes, reads,
                 deterministic)
    if not needs_grad:
        return _forward(q, k, v, call)
    captured = [t for _, t in grad_shapes]
    return _Attention.apply(q, k, v, sinks, call, *captured)


# The Gluon family's built-in softcap and ALiBi are fixed score functions lowered here.
builtin_mods.install(trace=trace, lowering=lowering, UserArgs=UserArgs)

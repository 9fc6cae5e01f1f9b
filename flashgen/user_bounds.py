"""The index ranges at which user functions read their captured tensors, checked on the
host before the kernels run.

A score or mask function indexes captured tensors with integer expressions
(``table[t5_bucket(kv_idx - q_idx), h]``, ``doc[q_idx]``).  torch raises IndexError at
an index past a tensor's size and wraps a negative one; the kernels do neither: they
compute the address and read whatever lies there.  :func:`read_ranges` evaluates, with
torch, exactly the index expressions of each ``load`` node the kernels execute (the
lowered IR of :mod:`flashgen.user_render`, with the kernels' semantics: the index
inputs and bools in integer arithmetic in int64 (the kernels' int32 where that gives
the same values, :func:`flashgen.user_ints.int32_overflows`, else int64), captured
integer tensors in their own dtype (bool as int8), Python constants weak, floor division
and modulo rounding toward -inf, float math in float32, casts truncating toward zero) over every (b, h, q_idx, kv_idx) in [0, batch) x [0, heads) x
[0, seqlen_q) x [0, seqlen_k) (the kernels evaluate the functions on whole tiles, masked
by the sequence lengths only: a mask function's reads in a tile that the built-in
causal/window bounds partly hide happen too), in chunks of at most :data:`CHUNK`
elements per intermediate value, and returns each index component's min and max;
:func:`bounds_error` words the InputError of one outside [0, size).

An index that depends on another load's value (``table[idx[q_idx]]``) reads that load
from the captured tensor itself, clamped into range so that the evaluation can go on (the
inner load's own range is checked, and reported first).  An integer divisor of 0 reads
as 1, as in the kernels (:meth:`flashgen.user_mods.Traced` makes it so).  An index that depends on the
score cannot be known before the kernel runs: such loads are checked in the kernels
(:meth:`flashgen.user_render._Code._load`: masked, the score NaN where out of range).  Float
expressions that feed an index (T5's ``log``) are evaluated by torch in float32, which
may differ from the kernels' by an ulp; an index that lands exactly on a bound through
such an expression may be judged by a value one off the kernels'.

Pure torch, no triton; :func:`flashgen.user_mods.check_reads` runs it once per
(function, sizes, captured tensors' shapes, and the versions of those an index is
computed from).
"""

from __future__ import annotations

import dataclasses

import torch

from .user_render import INT32, Graph, Ref, promote

#: The most elements an intermediate value of one evaluation chunk holds.
CHUNK = 1 << 24

_INPUTS = ("b", "h", "q", "k")
_ARG = {"b": "b", "h": "h", "q": "q_idx", "k": "kv_idx"}
_TORCH = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
          "float64": torch.float32, "int64": torch.int64, "int32": torch.int32, "int16": torch.int16,
          "int8": torch.int8, "uint8": torch.uint8}
_UNARY = {"exp": torch.exp, "log": torch.log, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt, "sigmoid": torch.sigmoid,
          "exp2": torch.exp2, "log2": torch.log2, "sin": torch.sin, "cos": torch.cos, "tanh": torch.tanh,
          "floor": torch.floor, "ceil": torch.ceil, "trunc": torch.trunc}
_CMP = {"lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge, "eq": torch.eq, "ne": torch.ne}
_BITS = {"and": torch.bitwise_and, "or": torch.bitwise_or, "xor": torch.bitwise_xor,
         "lshift": torch.bitwise_left_shift, "rshift": torch.bitwise_right_shift}


@dataclasses.dataclass(frozen=True)
class Reads:
    """What a traced function reads that can be checked: ``loads`` the load nodes with
    at least one index whose indices do not depend on the score; ``nodes`` the nodes
    their indices need, in order; ``deps`` the inputs those depend on (b, h, q, k);
    ``sources`` the captured tensors (by number) whose values an index is computed
    from (the check then depends on their contents)."""

    loads: tuple
    nodes: tuple
    deps: frozenset
    sources: tuple


def reads(g: Graph, out) -> Reads:
    """The :class:`Reads` of the function whose result is ``out`` in ``g``."""
    if not isinstance(out, Ref):
        return Reads((), (), frozenset(), ())
    loads = tuple(i for i in g.uses([out])
                  if g.nodes[i].op == "load" and len(g.nodes[i].args) > 1 and "s" not in g.nodes[i].deps)
    index = [a for i in loads for a in g.nodes[i].args[1:]]
    nodes = tuple(g.uses(index))
    sources = tuple(sorted({g.nodes[i].args[0] for i in nodes if g.nodes[i].op == "load"}))
    deps = frozenset().union(*(g.deps(a) for a in index)) & set(_INPUTS)
    return Reads(loads, nodes, deps, sources)


def _steps(deps, batch: int, heads: int, seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
    """(batch step, row step) of the chunks: at most :data:`CHUNK` elements per value
    (one batch and one row at least)."""
    per_row = (heads if "h" in deps else 1) * (seqlen_k if "k" in deps else 1)
    rows = seqlen_q if "q" in deps else 1
    if "b" not in deps:
        bstep = batch
    else:
        bstep = max(1, min(batch, CHUNK // max(1, rows * per_row)))
    per_b = bstep if "b" in deps else 1
    qstep = seqlen_q if "q" not in deps else max(1, min(seqlen_q, CHUNK // max(1, per_b * per_row)))
    return bstep, qstep


class _Eval:
    """Evaluates the nodes of a :class:`Reads` on one chunk of the index grid."""

    def __init__(self, g: Graph, captured, device):
        self.g, self.captured, self.device = g, captured, device
        self.tensors: dict = {}

    def tensor(self, n: int) -> torch.Tensor:
        """Captured tensor ``n`` as the kernels read its values: floats in float32,
        integers in their dtype (bools arrive as int8)."""
        t = self.tensors.get(n)
        if t is None:
            t = self.captured[n].detach()
            t = self.tensors[n] = (t.to(torch.float32) if t.is_floating_point()
                                   else t.to(torch.int8) if t.dtype == torch.bool else t)
        return t

    def const(self, v):
        """A constant as the kernels' code has it: weak (a 0-dim tensor: the other
        operand's dtype wins, as with Triton's Python scalars) unless an integer outside
        int32, which the kernels make an int64 tensor (user_render._lit)."""
        if isinstance(v, int) and not isinstance(v, bool) and not INT32[0] <= v <= INT32[1]:
            return torch.tensor([v], dtype=torch.int64, device=self.device)
        return torch.tensor(v, device=self.device)

    def val(self, env, v, cat: str):
        """``v`` (a node or a constant) as a tensor of category ``cat``."""
        x = env[v.i] if isinstance(v, Ref) else self.const(v)
        if cat == "float":
            return x.to(torch.float32)
        if cat == "int":  # a bool in integer math: int64 (the kernels' int32 where equal, user_ints)
            return x.to(torch.int64) if x.dtype == torch.bool else x
        return x if x.dtype == torch.bool else x != 0

    def index(self, env, a):
        return self.val(env, a, "int") if isinstance(a, Ref) else int(a)

    def run(self, nodes, inputs: dict) -> dict:
        env = {}
        for i in nodes:
            n = self.g.nodes[i]
            env[i] = inputs[n.args[0]] if n.op == "input" else self.node(env, n)
        return env

    def load(self, env, n):
        t = self.tensor(n.args[0])
        idx = []
        for d, a in enumerate(n.args[1:]):
            x = self.index(env, a)
            if t.shape[d] == 0:  # nothing to read: the range check reports it
                x = 0
            elif isinstance(x, int):
                x = min(max(x, 0), t.shape[d] - 1)
            else:
                x = x.clamp(0, t.shape[d] - 1)
            idx.append(x if isinstance(x, torch.Tensor) else self.const(x))
        if 0 in t.shape:
            shape = torch.broadcast_shapes(*(x.shape for x in idx))
            return torch.zeros(shape, dtype=t.dtype, device=self.device)
        return t[tuple(idx)] if idx else t

    def node(self, env, n):
        op, args, dt = n.op, n.args, n.dtype
        g = self.g
        V = lambda v, c=dt: self.val(env, v, c)  # noqa: E731
        if op == "load":
            return self.load(env, n)
        if op in ("add", "sub", "mul"):
            a, b = V(args[0]), V(args[1])
            return a + b if op == "add" else a - b if op == "sub" else a * b
        if op in _CMP:
            c = promote(g.dtype(args[0]), g.dtype(args[1]))
            return _CMP[op](V(args[0], "int" if c == "bool" else c), V(args[1], "int" if c == "bool" else c))
        if op in _BITS:
            if dt == "bool":
                return {"and": torch.logical_and, "or": torch.logical_or, "xor": torch.logical_xor}[op](
                    V(args[0]), V(args[1]))
            return _BITS[op](V(args[0], "int"), V(args[1], "int"))
        if op == "truediv":
            return V(args[0], "float") / V(args[1], "float")
        if op in ("floordiv", "mod"):
            a, b = V(args[0]), V(args[1])
            if dt == "float":
                q = torch.floor(a / b)
            else:  # the kernels' integer division rounds toward -inf (a divisor is never 0:
                # the trace makes it 1 there)
                q = torch.div(a, torch.where(b == 0, torch.ones_like(b), b), rounding_mode="floor")
            return q if op == "floordiv" else a - b * q
        if op == "pow":
            return torch.exp2(V(args[1], "float") * torch.log2(V(args[0], "float")))
        if op == "neg":
            return -V(args[0])
        if op == "abs":
            return torch.abs(V(args[0]))
        if op == "not":
            if g.dtype(args[0]) == "bool":
                return torch.logical_not(V(args[0], "bool"))
            return torch.bitwise_not(V(args[0], "int"))
        if op in _UNARY:
            return _UNARY[op](V(args[0], "float"))
        if op in ("minimum", "maximum"):
            a, b = V(args[0]), V(args[1])
            return torch.where(a < b if op == "minimum" else a > b, a, b)
        if op == "clamp":
            x = V(args[0])
            for bound, cmp in ((args[1], torch.lt), (args[2], torch.gt)):
                if bound is not None:
                    L = self.val(env, bound, dt)
                    x = torch.where(cmp(x, L), L, x)
            return x
        if op == "where":
            return torch.where(V(args[0], "bool"), V(args[1]), V(args[2]))
        if op == "cast":
            a, target = args
            if target == "bool":
                return V(a, g.dtype(a)) != 0
            if dt == "float":
                x = V(a, "float")
                return x.to(_TORCH[target]).to(torch.float32)
            x = V(a, "int" if g.dtype(a) == "bool" else g.dtype(a))
            return x.to(_TORCH[target])
        raise AssertionError(f"flashgen.user_bounds: no evaluation of IR operation {op!r}")


def _chunks(ev: _Eval, r: Reads, batch: int, heads: int, seqlen_q: int, seqlen_k: int, device):
    """(first batch, first row, values of the nodes of ``r``) per chunk of the grid."""
    bstep, qstep = _steps(r.deps, batch, heads, seqlen_q, seqlen_k)
    H = torch.arange(heads, device=device).view(1, -1, 1, 1)
    J = torch.arange(seqlen_k, device=device).view(1, 1, 1, -1)
    for b0 in range(0, batch, bstep):
        B = torch.arange(b0, min(batch, b0 + bstep), device=device).view(-1, 1, 1, 1)
        for q0 in range(0, seqlen_q, qstep):
            I = torch.arange(q0, min(seqlen_q, q0 + qstep), device=device).view(1, 1, -1, 1)
            yield b0, q0, ev.run(r.nodes, {"b": B, "h": H, "q": I, "k": J})


def read_ranges(g: Graph, r: Reads, captured, batch: int, heads: int, seqlen_q: int, seqlen_k: int,
                device) -> dict:
    """{(load node, index dim): (min, max)} of the indices at which the loads of ``r``
    read ``captured`` (the function's captured tensors) over the whole index grid (see
    the module docstring).  Sizes must be positive."""
    ev = _Eval(g, captured, device)
    lows: dict = {}
    highs: dict = {}
    for _, _, env in _chunks(ev, r, batch, heads, seqlen_q, seqlen_k, device):
        for i in r.loads:
            for d, a in enumerate(g.nodes[i].args[1:]):
                x = ev.index(env, a)
                lo, hi = (x.amin(), x.amax()) if isinstance(x, torch.Tensor) else (ev.const(x), ev.const(x))
                key = (i, d)
                lows[key] = lo if key not in lows else torch.minimum(lows[key], lo)
                highs[key] = hi if key not in highs else torch.maximum(highs[key], hi)
    if not lows:
        return {}
    keys = list(lows)
    lo = torch.stack([lows[k] for k in keys]).tolist()  # one transfer to the host
    hi = torch.stack([highs[k] for k in keys]).tolist()
    return {k: (a, b) for k, a, b in zip(keys, lo, hi)}


def first_outside(g: Graph, r: Reads, captured, load: int, dim: int, batch: int, heads: int, seqlen_q: int,
                  seqlen_k: int, device) -> tuple[int, dict]:
    """The first index value of ``load`` along ``dim`` outside the captured tensor's
    size, and the (b, h, q_idx, kv_idx) it is read at (the inputs it depends on)."""
    ev = _Eval(g, captured, device)
    size = captured[g.nodes[load].args[0]].shape[dim]
    a = g.nodes[load].args[1 + dim]
    deps = g.deps(a)
    for b0, q0, env in _chunks(ev, r, batch, heads, seqlen_q, seqlen_k, device):
        x = ev.index(env, a)
        if not isinstance(x, torch.Tensor):
            return x, {}
        x = x.reshape((1,) * (4 - x.dim()) + tuple(x.shape))
        bad = ((x < 0) | (x >= size)).nonzero()
        if len(bad):
            pos = bad[0].tolist()
            at = {"b": b0 + pos[0], "h": pos[1], "q": q0 + pos[2], "k": pos[3]}
            return int(x[tuple(pos)]), {_ARG[n]: at[n] for n in _INPUTS if n in deps}
    raise AssertionError("flashgen.user_bounds: no index outside the range found")


def bounds_error(arg: str, captured, g: Graph, r: Reads, ranges: dict, sizes: tuple, device) -> str | None:
    """The message of the first load of ``r`` (in the order the function computes them,
    so an inner load of a nested index comes first) that reads outside its captured
    tensor, or None.  ``arg``: score_mod or mask_mod; ``sizes`` (batch, heads,
    seqlen_q, seqlen_k)."""
    for i in r.loads:
        n = g.nodes[i]
        t = captured[n.args[0]]
        for d in range(len(n.args) - 1):
            lo, hi = ranges[(i, d)]
            if lo >= 0 and hi < t.shape[d]:
                continue
            value, at = first_outside(g, r, captured, i, d, *sizes, device)
            where = ", ".join(f"{k}={v}" for k, v in at.items())
            batch, heads, seqlen_q, seqlen_k = sizes
            return (f"{arg} reads a captured tensor of shape {tuple(t.shape)} (#{n.args[0]} in the order {arg} "
                    f"first reads them) at indices {lo}..{hi} along dim {d}: indices must lie in [0, {t.shape[d]}) "
                    f"(flashgen does not wrap negative indices); index {value}"
                    + (f" at {where}" if where else "")
                    + f" (batch {batch}, num_heads {heads}, seqlen_q {seqlen_q}, seqlen_k {seqlen_k})")
    return None

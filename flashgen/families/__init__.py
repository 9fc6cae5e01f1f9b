"""Kernel families: the ways flashgen writes its kernels, behind one small interface.

A family is one way of writing the kernels (plain Triton; Gluon on sm_90+): its
templates, its launchers, its resource terms and its validity rules.  The dispatcher,
the tuner and ``explain`` reach a family only through this registry, so adding or
removing one touches its folder ``flashgen/families/<name>/`` and one line of
:data:`REGISTRY`, nothing else.  The family is part of the variant identity:
``TileConfig.family`` (a prefix of ``TileConfig.id`` and so of ``Variant.id``, the
generated file and the DB row's ``variant_id``, except for the default family
``triton``, whose ids never change), the DB column ``family`` (rows without it are
``triton``'s) and the code hash each row carries (:meth:`Family.template_hash`).

What a family must provide
--------------------------
A package ``flashgen/families/<name>/`` whose ``__init__`` defines ``FAMILY``, an
object with the attributes and methods of :class:`Family` (structural: it need not
subclass it, and must not import this package, which imports it):

``name``
    The registry name (``TileConfig.family``; lower case, no ``_``).
``kernels``
    The :data:`flashgen.spec.KERNELS` it compiles (e.g. ``("fwd",)``).
``unsupported(key, arch) -> str | None``
    None when it serves ``key`` (a ProblemKey: kernel, dtype, head dims, mask, mods,
    layout, sizes) on ``arch`` (:class:`flashgen.arch.Arch`), else why not, in words
    that ``explain`` prints ("needs sm_90 or newer, this is sm_80").  A kernel outside
    ``kernels`` must get a reason too.
``domain(key) -> dict[str, tuple]``
    Its knob domains for ``key``: TileConfig field name -> the values the tuner tries
    (``family`` left out; every combination is a candidate, see :func:`configs`).
``violated_rules(variant) -> list[str]``
    The validity rules ``variant`` breaks, each "name: why" (empty when valid); they
    mirror the kernels' static asserts.
``estimate(variant, arch) -> SmemEstimate``
    The shared-memory estimate as a sum of named terms against ``arch``'s limit
    (:class:`flashgen.resources.SmemEstimate`; ``.feasible``, ``.breakdown()``).  An
    infeasible candidate is never compiled.
``adapt(config, key) -> TileConfig``
    The config a row tuned for another bucket becomes for ``key`` (the dispatcher's
    nearest-bucket answer), e.g. pointer loads for a strided layout.
``default_config(key, arch) -> TileConfig | None``
    A heuristic config for ``key``; the first family of :data:`REGISTRY` (the portable
    one) must always answer; the others may return None (they then run only where a
    measured row says they win).
``template_hash(kernel, mods) -> str``
    The code hash of what the family generates for (kernel, mods): rows carry it and
    count only while it is current.  Distinct families' hashes never coincide.
``render(variant) -> str``, ``load(variant) -> module``
    Source text (pure), and the imported module (memoized per process).
``launcher(name) -> callable``
    The launch function of one of its kernels, looked up at call time.  ``fwd``:
    ``(q, k, v, *, softmax_scale, mask, diag_lo, diag_hi, config, module, addressable,
    mods) -> (O, LSE)`` as :func:`flashgen.ops.fwd`; ``bwd``, ``bwd_dq``,
    ``bwd_dkdv``, ``fwd_varlen``, ``bwd_varlen``, ``decode`` likewise (the
    signatures of :mod:`flashgen.ops`, including the optional output buffers ``out``,
    ``lse``, ``dq``, ``delta``, ``dk``, ``dv`` that the benchmarker passes,
    :func:`flashgen.bench.run_variant`).  Only the names of the kernels it serves.

Optional: ``key_reasons(key, config) -> list[str]``: why ``config`` cannot serve
``key``'s sizes, beyond ``violated_rules`` (which sees the kernel spec alone; e.g. the
Gluon backward's GQA group split, which must divide the key's group); a database row
with such reasons is not loaded (:func:`flashgen.db.rules_admit`).
Optional: ``config_reasons(config) -> list[str]``: what the family never launches
whatever the key (e.g. the Triton family's tile sizes and warp counts that are not
powers of two); ``flashgen import`` and the database's row check refuse a row of this
family whose config has such a reason (``flashgen.db._row_problem``).
Optional: ``prefers_default(key, arch) -> str | None``: the measurement that puts this
family's default ahead of the portable family's for an untuned ``key`` (the dispatcher
then serves that default, :meth:`flashgen.dispatch.Dispatcher._default`, and ``explain``
prints the reason); absent or None: the portable default serves untuned keys.
Optional: ``large_enough(key) -> bool``: whether ``key`` holds enough work for this
family's per-call host time; when False the key takes neither its default nor its rows
of another (nearest) size bucket, only its own tuned rows; absent: any size.

The backward of two shapes
--------------------------
The Triton family's backward is two kernels, ``bwd_dq`` and ``bwd_dkdv``, each with its
own ProblemKey, rows and tiles.  A family whose backward is one launch sequence writing
dQ, dK and dV (Gluon: preprocess, main kernel, dQ convert) lists the kernel name ``bwd``
(:data:`flashgen.spec.WHOLE_BWD`, in :data:`flashgen.spec.ALL_KERNELS`, not in the
Triton family's :data:`flashgen.spec.KERNELS`) and times the whole sequence as one row
of the ``bwd`` key; its ``launcher("bwd")`` takes ``(do, q, k, v, o, lse, *, ...,
config, dq, dk, dv)``.  (The Triton family's ``launcher("bwd")`` is its two kernels in
a row, taking ``config_dq``/``config_dkdv``.)  :meth:`flashgen.dispatch.Dispatcher.backward`
chooses per key: the two kernels when the caller asks for a deterministic backward;
else the best ``bwd`` row (key or nearest bucket) against the sum of the best ``bwd_dq``
and ``bwd_dkdv`` rows of that same bucket, both measured on this GPU, the faster wins;
without such a pair, the family's ``prefers_default`` decides (Gluon: where its
measurements put its default ahead, ``BWD_DEFAULT_AHEAD`` and the tables beside it),
else the two kernels.  The Triton keys, rows and ids are untouched by this.

Then add its name to :data:`REGISTRY` (and its package to ``packages`` in
pyproject.toml, so wheels carry it; tests/test_families.py checks that).
tests/test_families.py also registers an in-test family and checks the tuner, the
dispatcher, the library's launch and ``explain`` through this interface.
"""

from __future__ import annotations

import importlib
import itertools
from typing import Any, Callable, Protocol

from ..spec import DEFAULT_FAMILY, ProblemKey, TileConfig, Variant

#: The families, one line each, the portable one (it serves every key on every arch
#: and gives the heuristic default) first.
REGISTRY = (
    "triton",  # plain Triton: every kernel, sm_80+ and the CPU interpreter
    "gluon",  # Gluon (FlashAttention-3's Hopper schedule): fwd and the whole backward on sm_90
)


class Family(Protocol):
    """The interface of a kernel family (see the module docstring)."""

    name: str
    kernels: tuple[str, ...]

    def unsupported(self, key: ProblemKey, arch) -> str | None: ...

    def domain(self, key: ProblemKey) -> dict[str, tuple]: ...

    def violated_rules(self, variant: Variant) -> list[str]: ...

    def estimate(self, variant: Variant, arch): ...

    def adapt(self, config: TileConfig, key: ProblemKey) -> TileConfig: ...

    def default_config(self, key: ProblemKey, arch) -> TileConfig | None: ...

    def template_hash(self, kernel: str, mods: str = "") -> str: ...

    def render(self, variant: Variant) -> str: ...

    def load(self, variant: Variant) -> Any: ...

    def launcher(self, name: str) -> Callable: ...


#: name -> family, in :data:`REGISTRY` order.  Tests may add a family here (and remove it).
FAMILIES: dict[str, Family] = {n: importlib.import_module(f"{__name__}.{n}").FAMILY for n in REGISTRY}


def get(name: str) -> Family:
    """The registered family ``name``; ValueError naming the registered ones."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown kernel family {name!r}; registered: {sorted(FAMILIES)}") from None


def portable() -> Family:
    """The family that serves every key and gives the heuristic default."""
    return FAMILIES[DEFAULT_FAMILY]


def serving(key: ProblemKey, arch) -> list[Family]:
    """The registered families that serve ``key`` on ``arch``, in registry order."""
    return [f for f in FAMILIES.values() if f.unsupported(key, arch) is None]


def reasons(key: ProblemKey, arch) -> tuple[tuple[str, str], ...]:
    """(name, why not) of each registered family that does not serve ``key`` on ``arch``."""
    out = []
    for f in FAMILIES.values():
        why = f.unsupported(key, arch)
        if why is not None:
            out.append((f.name, why))
    return tuple(out)


def configs(family: Family, key: ProblemKey) -> list[TileConfig]:
    """Every TileConfig of ``family``'s domain for ``key`` (valid or not), in domain order."""
    dom = family.domain(key)
    names = list(dom)
    extra = {} if family.name == DEFAULT_FAMILY else {"family": family.name}
    return [TileConfig(**dict(zip(names, values)), **extra) for values in itertools.product(*dom.values())]


#: A ``mods`` name of user functions that names no lowering: the families give every
#: user variant of a kernel one code hash (the variant's name hashes its functions), so
#: this stands for all of them in :func:`hashes`.
USER_MODS_PROBE = "u" + "0" * 12


def hashes(kernel: str, mods_list) -> list[str]:
    """The current code hashes of ``kernel`` over every registered family that compiles
    it, every ``mods`` of ``mods_list`` and user functions (:data:`USER_MODS_PROBE`, for
    the kernels they compile into, :data:`flashgen.spec.USER_KERNELS`): what a DB row must
    carry to count."""
    from ..spec import USER_KERNELS

    mods_list = [*mods_list, *([USER_MODS_PROBE] if kernel in USER_KERNELS else [])]
    return sorted({f.template_hash(kernel, m) for f in FAMILIES.values() if kernel in f.kernels
                   for m in mods_list})


def load(variant: Variant):
    """The loaded module of ``variant``, by its family."""
    return get(variant.family).load(variant)


def launcher(family: str, name: str) -> Callable:
    """The launch function ``name`` (``fwd``, ``bwd``, ...) of ``family``."""
    return FAMILIES[family].launcher(name)

"""Tuning the kernels of user score/mask functions and sinks (:mod:`flashgen.user_mods`).

A :class:`UserProblem` is one set of user functions at one size: the functions are
traced and lowered once, which gives the variants' names (``KernelSpec.mods`` = ``u`` +
a hash of the lowered code, the same in every process that traces the same functions)
and so their problem keys: ``fwd`` (the forward with the score/mask functions and the
sinks), and, when there is a score or mask function, ``bwd_dq`` and ``bwd_dkdv`` (the
backward's, with the gradients of the captured tensors that require grad), and, unless
a captured tensor is read at an index computed from the score, ``bwd`` too (a family's
whole backward: the Gluon one's user variants, :mod:`flashgen.families.gluon.user_bwd`).  Sinks alone have no backward
variant: their backward runs the plain kernels (tuned as plain keys).

:class:`UserBenchmarker` measures a variant of a problem the way the tuner's
:class:`flashgen.bench.KernelBenchmarker` measures built-in ones: first a check against
the float64 reference (:func:`flashgen.user_mods.reference`: O and LSE for fwd; dQ and
the captured tensors' gradients for bwd_dq; dK, dV for bwd_dkdv; dQ, dK, dV and those
gradients for bwd) on an awkward size
(seqlens not multiples of any tile, memory past seqlen_k holding NaN, outputs poisoned
with NaN) with the rule max error <= 2 x torch's error at the input dtype + floor; then
the kernel alone, timed at the problem's size (CUDA events, L2 flushed, median).  A
failed check is a ``wrong_result`` row, never timed.  The kernels a timed kernel needs
(the forward before bwd_dq, bwd_dq's delta before bwd_dkdv) run once at their default
configs.

:func:`preset_problems` makes the problems of the ``user-examples`` / ``user-small``
presets (:mod:`flashgen.user_examples` at :mod:`flashgen.presets`' sizes), which
``flashgen tune --preset user-examples`` tunes; :func:`tune_mods` tunes a user's own
functions (``flashgen.tune_mods``).  Rows go into the tuning DB keyed by the variants'
ids like any other; the dispatcher finds them for the same functions in any process.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from . import bench, families, heuristics, user_mods
from .errors import InputError
from .masks import mask_bounds
from .spec import DTYPES, USER_KERNELS, WHOLE_BWD, KernelSpec, Measurement, ProblemKey, Shape, Variant
_TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclasses.dataclass
class UserProblem:
    """User functions (``score_mod(score, b, h, q_idx, kv_idx)``, ``mask_mod(b, h, q_idx,
    kv_idx)``, either None; the captured tensors that require grad get gradients),
    ``sinks`` (float32 (num_heads,) or None) and the built-in mask (``causal``,
    ``window``), at ``shape`` with head dims ``head_dim`` / ``head_dim_v`` and q/k/v of
    ``dtype`` (a dtype name).  ``label`` names it in messages.  Construction traces
    the functions (UnsupportedError for what flashgen cannot lower) and registers their
    lowerings; the tensors stay on their device, where the problem is measured."""

    score_mod: Callable | None
    mask_mod: Callable | None
    sinks: torch.Tensor | None
    causal: bool
    window: tuple
    head_dim: int
    head_dim_v: int
    dtype: str
    shape: Shape
    label: str = "user"

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise InputError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        s = self.shape
        if s.num_heads % s.num_kv_heads:
            raise InputError(f"num_heads ({s.num_heads}) must be a multiple of num_kv_heads ({s.num_kv_heads})")
        self.mask, self.lo, self.hi = mask_bounds(s.seqlen_q, s.seqlen_k, causal=self.causal,
                                                  window=tuple(self.window))
        self.score = user_mods.trace(self.score_mod, "score") if self.score_mod is not None else None
        self.mask_fn = user_mods.trace(self.mask_mod, "mask") if self.mask_mod is not None else None
        self.grad_flags = user_mods.score_grad_flags(self.score)
        # the width of the problem's own sizes, also where its checks run smaller sizes
        self.wide = user_mods.wide(self.score, self.mask_fn, s.batch, s.num_heads, s.seqlen_q, s.seqlen_k)
        fwd, bwd = self._args(s.batch, s.seqlen_q, s.seqlen_k, self.lo, self.hi, backward=True)
        self.fwd_mods = fwd.name
        self.bwd_mods = bwd.name if bwd is not None else None

    @property
    def device(self) -> torch.device:
        for t in [self.sinks] + (self.score.captured if self.score else []) + (
                self.mask_fn.captured if self.mask_fn else []):
            if t is not None:
                return t.device
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def _args(self, batch, sq, sk, lo, hi, backward: bool):
        s = self.shape
        return user_mods.kernel_args(self.score, self.mask_fn, self.grad_flags, self.sinks,
                                     (batch, s.num_heads, s.num_kv_heads, sq, sk, lo, hi), self.device, backward,
                                     wide_=self.wide)

    def has(self, kernel: str) -> bool:
        """Whether this problem has a user variant of ``kernel``: the forward always, the
        backward's two kernels with a score or mask function, the whole backward where the
        Gluon backward compiles the functions (no captured tensor read at an index
        computed from the score: :func:`flashgen.families.gluon.family.user_bwd`)."""
        if kernel == "fwd":
            return True
        if kernel == WHOLE_BWD:
            from .families.gluon.family import user_bwd

            return self.bwd_mods is not None and user_bwd(self.bwd_mods)
        return kernel in USER_KERNELS and self.bwd_mods is not None

    def spec(self, kernel: str) -> KernelSpec:
        """The KernelSpec of ``kernel``'s user variant (ValueError for a kernel it has none of)."""
        if not self.has(kernel):
            raise ValueError(f"{self.label}: no user variant of {kernel!r} (sinks alone run the plain backward; "
                             "the whole backward is not built with a captured tensor read at an index computed "
                             "from the score)")
        mods = self.fwd_mods if kernel == "fwd" else self.bwd_mods
        return KernelSpec(kernel, self.dtype, self.head_dim, self.head_dim_v, self.mask, mods)

    def keys(self, kernels: Iterable[str] = USER_KERNELS) -> list[tuple[ProblemKey, Shape]]:
        """(ProblemKey, Shape) of each of ``kernels`` this problem has a user variant of."""
        return [(self.shape.key(self.spec(k)), self.shape) for k in kernels if self.has(k)]


def _awkward(n: int, cap: int = bench.CHECK_SEQLENS[1]) -> int:
    """A check seqlen: at most ``cap`` and at most ``n``, not a multiple of 16 (when n > 3)."""
    m = min(n, cap)
    return m - 3 if m % 16 == 0 and m > 3 else m


def _runner(problem: UserProblem, variant: Variant, q, k, v, do, arch=None):
    """(fn, outputs, captured-gradient buffers): ``fn()`` launches ``variant``'s kernel on
    these inputs (what it needs first ran once here at default configs); outputs
    {name: tensor} it writes."""
    spec, cfg = variant.spec, variant.config
    b, sq, sk = q.shape[0], q.shape[2], k.shape[2]
    mode, lo, hi = mask_bounds(sq, sk, causal=problem.causal, window=tuple(problem.window))
    if mode != spec.mask:
        raise ValueError(f"{problem.label}: seqlens {sq}/{sk} make mask mode {mode!r}, the variant is {spec.mask!r}")
    fwd, bwd = problem._args(b, sq, sk, lo, hi, backward=spec.kernel != "fwd")
    kw = dict(softmax_scale=spec.head_dim ** -0.5, mask=mode, diag_lo=lo, diag_hi=hi)
    if spec.kernel == "fwd":
        assert fwd.name == spec.mods, (fwd.name, spec.mods)
        out = torch.empty(q.shape[:3] + (v.shape[3],), dtype=q.dtype, device=q.device)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        launch = families.launcher(cfg.family, "fwd")
        return (lambda: launch(q, k, v, config=cfg, out=out, lse=lse, mods=fwd, **kw)), {"O": out, "LSE": lse}
    assert bwd is not None and bwd.name == spec.mods, (bwd and bwd.name, spec.mods)
    arch = arch or bench._arch()
    fcfg = heuristics.default_config(problem.spec("fwd"), arch)
    o, lse = families.launcher(fcfg.family, "fwd")(q, k, v, config=fcfg, mods=fwd, **kw)
    grads = [g for g in bwd.grads if g is not None]

    def zero():
        for g in grads:
            g.zero_()  # as the backward of flashgen.attention does before bwd_dq or a whole backward
    if spec.kernel == WHOLE_BWD:
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        launch = families.launcher(cfg.family, WHOLE_BWD)

        def whole():
            zero()
            launch(do, q, k, v, o, lse, config=cfg, dq=dq, dk=dk, dv=dv, mods=bwd, **kw)
        outs = {"dQ": dq, "dK": dk, "dV": dv}
        outs.update({f"d{n}": g for n, g in enumerate(bwd.grads) if g is not None})
        return whole, outs
    if spec.kernel == "bwd_dq":
        dq, delta = torch.empty_like(q), torch.empty_like(lse)
        launch = families.launcher(cfg.family, "bwd_dq")

        def fn():
            zero()
            launch(do, q, k, v, o, lse, config=cfg, dq=dq, delta=delta, mods=bwd, **kw)
        outs = {"dQ": dq}
        outs.update({f"d{n}": g for n, g in enumerate(bwd.grads) if g is not None})
        return fn, outs
    qcfg = heuristics.default_config(problem.spec("bwd_dq"), arch)
    zero()
    _, delta = families.launcher(qcfg.family, "bwd_dq")(do, q, k, v, o, lse, config=qcfg, mods=bwd, **kw)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    launch = families.launcher(cfg.family, "bwd_dkdv")
    return (lambda: launch(do, q, k, v, lse, delta, config=cfg, dk=dk, dv=dv, mods=bwd, **kw)), {"dK": dk, "dV": dv}


def _reference(problem: UserProblem, q, k, v, do, names, dtype) -> dict:
    """{name: tensor} of the outputs ``names`` by :func:`flashgen.user_mods.reference` in
    ``dtype``, gradients by torch.autograd.grad (the captured tensors' own ``.grad``
    stay untouched)."""
    sq, sk = q.shape[2], k.shape[2]
    _, lo, hi = mask_bounds(sq, sk, causal=problem.causal, window=tuple(problem.window))
    qkv = [t.detach().requires_grad_() for t in (q, k, v)]
    o, lse = user_mods.reference(*qkv, problem.head_dim ** -0.5, lo, hi,
                                 problem.score_mod, problem.mask_mod, problem.sinks, dtype)
    out = {"O": o.detach(), "LSE": lse.detach() if dtype == torch.float64 else lse.detach().float()}
    wanted = [n for n in names if n not in ("O", "LSE")]
    if not wanted:
        return out
    captured = problem.score.captured if problem.score else []
    inputs = {"dQ": qkv[0], "dK": qkv[1], "dV": qkv[2]}
    inputs.update({f"d{n}": t for n, t in enumerate(captured)})
    grads = torch.autograd.grad(o, [inputs[n] for n in wanted], grad_outputs=do.to(o.dtype), allow_unused=True)
    for n, g in zip(wanted, grads):
        out[n] = torch.zeros_like(inputs[n], dtype=o.dtype) if g is None else g
    return out


def check_sizes(problem: UserProblem, variant: Variant, sm_count: int) -> tuple[int, int]:
    """(batch, seqlen cap) of ``variant``'s check: batch 2 at most and seqlen
    ``bench.CHECK_SEQLENS[1]``; for a walk of the Gluon forward (``persistent`` >= 1:
    one program per SM slot taking tiles in turn), the problem's own batch and a cap
    that gives its tiles :data:`flashgen.bench.WALK_CHECK_TILES_PER_PROGRAM` times its programs, so the
    check runs a program's later tiles (their block-mask reads, the next tile's Q);
    at the default sizes each program of a walk takes one tile.  Never beyond the
    problem's own batch and seqlens (a captured tensor may be indexed by them)."""
    s = problem.shape
    walk = bench.walk_tiles(variant, sm_count)
    if walk is None:
        return min(2, s.batch), bench.CHECK_SEQLENS[1]
    rows, tiles = walk
    blocks = -(-tiles // (s.batch * s.num_heads))
    return s.batch, max(bench.CHECK_SEQLENS[1], blocks * rows + 1)


def check(problem: UserProblem, variant: Variant, arch=None) -> dict:
    """Run ``variant`` on an awkward size of ``problem`` (:func:`check_sizes`: batch 2 at
    most, its heads, seqlens :func:`_awkward` of its own, longer for a persistent walk; k
    and v slices of buffers holding NaN past seqlen_k; outputs poisoned with NaN) against
    the float64 reference.  Returns {"ok", "ratio" (worst), "ratios" ({output: ratio}),
    "message"}."""
    from .arch import current

    s = problem.shape
    batch, cap = check_sizes(problem, variant, (arch or current()).sm_count)
    shape = Shape(batch, s.num_heads, s.num_kv_heads, _awkward(s.seqlen_q, cap), _awkward(s.seqlen_k, cap))
    if mask_bounds(shape.seqlen_q, shape.seqlen_k, causal=problem.causal, window=tuple(problem.window))[0] \
            != problem.mask:
        shape = dataclasses.replace(shape, seqlen_q=s.seqlen_q, seqlen_k=s.seqlen_k)
    q, k, v, do = bench.make_inputs(variant.spec, shape, device=problem.device, seed=1234)
    k, v = bench._beyond(k), bench._beyond(v)
    fn, outs = _runner(problem, variant, q, k, v, do, arch)
    for t in outs.values():
        t.fill_(float("nan"))
    fn()
    if q.is_cuda:
        torch.cuda.synchronize()
    ref = _reference(problem, q, k, v, do, list(outs), torch.float64)
    base = _reference(problem, q, k, v, do, list(outs), q.dtype)
    res = bench._ratios(outs, {n: (ref[n], base[n]) for n in outs}, q.dtype)
    worst = max(r for _, _, r in res.values())
    msg = "; ".join(f"q{shape.seqlen_q}k{shape.seqlen_k} {n} err {e:.3g} (torch {q.dtype} {b:.3g})"
                    for n, (e, b, _) in res.items())
    return {"ok": worst <= 1.0, "ratio": worst, "ratios": {n: r for n, (_, _, r) in res.items()}, "message": msg}


class UserBenchmarker:
    """The tuner's benchmarker (:class:`flashgen.tuner.Benchmarker`) for the user
    variants of ``problems``: each variant checked once against float64 (a failure is
    a ``wrong_result`` / ``compile_failed`` row), then timed at the key's shape with
    ``timer(fn) -> ms`` (default: :func:`flashgen.bench.time_ms`, CUDA events).  Other
    variants go to ``fallback`` (e.g. a KernelBenchmarker), or are ``launch_failed``."""

    def __init__(self, problems: Iterable[UserProblem], fallback=None, timer: Callable | None = None,
                 warmup_ms: int = 10, rep_ms: int = 40):
        # by (mods, mask): one function serves examples of several masks (document,
        # document-causal), whose checks differ
        self.problems: dict[tuple[str, str], UserProblem] = {}
        for p in problems:
            for mods in (p.fwd_mods, p.bwd_mods):
                if mods is not None:
                    self.problems.setdefault((mods, p.mask), p)
        self.fallback = fallback
        self.timer = timer or (lambda fn: bench.time_ms(fn, warmup_ms, rep_ms))
        self._checked: dict[str, tuple[str | None, dict]] = {}
        self._inputs: dict = {}

    def check_ratios(self) -> dict[str, float]:
        """variant id -> error ratio of its check (<= 1 passes)."""
        return {vid: r["check_ratio"] for vid, (_, r) in self._checked.items() if "check_ratio" in r}

    def problem_of(self, variant: Variant) -> UserProblem | None:
        """The problem whose user functions and mask ``variant`` compiles (None: none of
        this run's)."""
        return self.problems.get((variant.spec.mods, variant.spec.mask))

    def __call__(self, variant: Variant, shape: Shape) -> Measurement:
        problem = self.problem_of(variant)
        if problem is None:
            if self.fallback is not None:
                return self.fallback(variant, shape)
            return Measurement("launch_failed", error=f"{variant.id}: not a variant of this run's user functions")
        if variant.id not in self._checked:
            try:
                d = check(problem, variant)
                report = {**bench.compiler_report(variant), "check_ratio": d["ratio"], "check_ratios": d["ratios"]}
                failure = None if d["ok"] else f"wrong_result: ratio {d['ratio']:.3g}: {d['message']}"
            except Exception as e:  # noqa: BLE001 - a failure is a value
                failure, report = f"compile_failed: {type(e).__name__}: {str(e)[-500:]}", {}
            self._checked[variant.id] = (failure, report)
        failure, report = self._checked[variant.id]
        report = {k: v for k, v in report.items() if k in bench._REPORTED and v is not None}
        if failure is not None:
            return Measurement(failure.split(":", 1)[0], error=failure, **report)
        key = (problem.label, variant.spec, shape)
        if key not in self._inputs:
            self._inputs.clear()
            self._inputs[key] = bench.make_inputs(variant.spec, shape, device=problem.device)
        try:
            fn, _ = _runner(problem, variant, *self._inputs[key])
            fn()  # compiled and warm before timing
            ms = self.timer(fn)
        except Exception as e:  # noqa: BLE001
            return Measurement("launch_failed", error=f"{type(e).__name__}: {e}"[-500:], **report)
        return Measurement("ok", median_ms=float(ms), **report)


# -- the examples' presets and a user's own functions ------------------------------------

def preset_problems(names: Iterable[str], dtype: str = "bfloat16", device=None) -> list[UserProblem]:
    """The UserProblems of the user presets ``names`` (:data:`flashgen.presets.USER_PRESETS`):
    each entry's example (:func:`flashgen.user_examples.make`, learned tensors and sinks
    requiring grad, as a model's parameters do) at its size, tensors on ``device``
    (default: CUDA when available).  KeyError for a preset that is not a user preset."""
    from . import presets, user_examples

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    out = []
    for name in names:
        if name not in presets.USER_PRESETS:
            raise KeyError(f"{name!r} is not a user-function preset; those are {sorted(presets.USER_PRESETS)}")
        for d, example, shape in presets.PRESETS[name]():
            ex = user_examples.make(example, shape.num_heads, shape.seqlen_q, device)
            sm, mm = ex.functions(*ex.tensors)
            out.append(UserProblem(sm, mm, ex.sinks, ex.causal, ex.window, d, d, dtype, shape, example))
    return out


def items(problems: Iterable[UserProblem], kernels: Iterable[str] = USER_KERNELS) -> list[tuple[ProblemKey, Shape]]:
    """The (ProblemKey, Shape) pairs of ``problems`` for ``kernels``, without repeats."""
    kernels = tuple(kernels)
    out: dict[ProblemKey, Shape] = {}
    for p in problems:
        for key, shape in p.keys(kernels):
            out.setdefault(key, shape)
    return list(out.items())


def tune_mods(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, score_mod=None, mask_mod=None,
              sinks: torch.Tensor | None = None, causal: bool = False, window: tuple[int, int] = (-1, -1),
              db: str | Path, trials: int = 20, kernels: Iterable[str] = USER_KERNELS, benchmarker=None,
              env=None, arch=None, seed: int = 0) -> list:
    """Tune the kernels of ``flashgen.attention(q, k, v, score_mod=..., mask_mod=...,
    sinks=..., causal=..., window=...)`` for these sizes and record every measurement
    in the tuning DB ``db`` (created if missing, in a directory that must exist;
    nothing in it is overwritten).

    q (batch, num_heads, seqlen_q, head_dim), k and v (batch, num_kv_heads, seqlen_k,
    head_dim / head_dim_v) give the sizes, dtype and device only (the measurements use
    inputs of their own).  Each kernel (``fwd``; ``bwd_dq`` and ``bwd_dkdv`` when there
    is a score or mask function; ``bwd``, a family's whole backward, with mask functions
    alone where a family serves it) gets ``trials`` Optuna trials over its tile configs,
    each config checked against the float64 reference first.  The dispatcher reads the
    rows when ``db`` is ``$FLASHGEN_DB`` or added (:func:`flashgen.dispatch.Dispatcher.add_database`;
    this function adds it to the process's dispatcher), in this and any other process
    that calls the same functions.  Returns the tuner's TuneResult per key.  Needs a
    CUDA device unless ``benchmarker`` is given (``env``/``arch``: the environment the
    rows are recorded under and the rules they follow; default: this machine's).
    Raises InputError for bad sizes or options (no score_mod, mask_mod or sinks; what
    :func:`flashgen.attention` refuses of the functions: captured tensors off q's device,
    an index outside its tensor; ``trials`` below 1; ``kernels`` a string or naming an
    unknown kernel; ``seed`` outside [0, 2**32); ``env``, ``arch``, ``benchmarker`` of
    the wrong type; a ``db`` that is not a path, is a directory, whose directory does
    not exist, which is never created, or that cannot be written; a file of the user's
    at ``<db>.optuna.journal``), UnsupportedError for functions flashgen cannot
    compile.  Nothing is created before these checks pass."""
    from . import arch as arch_mod, dispatch, tuner
    from .db import TuningDB
    from .env import Environment

    from .db import check_writable

    from .api import _check

    _check(q, k, v, None, causal)  # the sizes, dtypes, devices and causal flag flashgen.attention takes
    mask_bounds(q.shape[2], k.shape[2], causal=causal, window=window)  # its window rules
    if score_mod is None and mask_mod is None and sinks is None:
        raise InputError("tune_mods needs a score_mod, a mask_mod or sinks (without them flashgen.attention runs "
                         "the plain kernels, which `flashgen tune` tunes)")
    # what flashgen.attention checks before any kernel runs: the sinks, the captured
    # tensors on q's device, every index the functions compute within its tensor
    user_mods._traced(q, k, score_mod, mask_mod, sinks)
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise InputError(f"trials must be an int >= 1 (Optuna trials per kernel), got {trials!r}")
    if isinstance(kernels, str) or not isinstance(kernels, Iterable):
        raise InputError(f"kernels must be a sequence of kernel names (e.g. ('fwd',)), got {kernels!r}")
    kernels = tuple(kernels)
    unknown = [n for n in kernels if n not in USER_KERNELS]
    if unknown:
        raise InputError(f"kernels: unknown kernel {unknown[0]!r} (user functions' kernels: "
                         f"{', '.join(USER_KERNELS)})")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 32:
        raise InputError(f"seed must be an int in [0, 2**32 - 1] (the samplers' seed), got {seed!r}")
    if env is not None and not isinstance(env, Environment):
        raise InputError(f"env must be a flashgen.env.Environment or None, got {type(env).__name__}")
    if arch is not None and not isinstance(arch, arch_mod.Arch):
        raise InputError(f"arch must be a flashgen.arch.Arch or None, got {type(arch).__name__}")
    if benchmarker is not None and not callable(benchmarker):
        raise InputError(f"benchmarker must be callable (variant, shape) -> Measurement, got "
                         f"{type(benchmarker).__name__}")
    if not isinstance(db, (str, os.PathLike)):
        raise InputError(f"db must be the path of a tuning database (str or os.PathLike), got {db!r}")
    check_writable(Path(db), "db")
    tuner.check_journal(tuner.default_journal(db), "the Optuna journal beside db,")
    dtype = str(q.dtype).removeprefix("torch.")
    shape = Shape(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2])
    problem = UserProblem(score_mod, mask_mod, sinks, causal, tuple(window), q.shape[3], v.shape[3], dtype, shape)
    if benchmarker is None:
        if not q.is_cuda:
            raise InputError("tune_mods measures kernels on a CUDA device: q is on the CPU (or pass benchmarker=)")
        benchmarker = UserBenchmarker([problem])
    env = env or Environment.current()
    arch = arch or arch_mod.current()
    wanted = items([problem], kernels)
    if not wanted:
        raise InputError(f"no user variant among kernels {tuple(kernels)}: a forward (fwd) always, bwd_dq and "
                         "bwd_dkdv with a score or mask function, bwd unless a captured tensor is read at an "
                         "index computed from the score")
    work = tuner.servable(wanted, arch)  # (the whole backward only where a family serves it here)
    if not work:
        raise InputError(f"no kernel family serves {', '.join(k.id for k, _ in wanted)} on {arch.sm}: "
                         + "; ".join(f"{n}: {why}" for k, _ in wanted for n, why in families.reasons(k, arch)))
    with TuningDB(db, readonly=False) as tdb:
        # the journal checked above, by its path (open_storage would read it again)
        results = tuner.tune(work, benchmarker=benchmarker, db=tdb, env=env, arch=arch, n_trials=trials, seed=seed,
                             storage=tuner.default_journal(db))
    disp = dispatch.default_dispatcher()
    if Path(db).resolve() not in {Path(p).resolve() for p in disp.databases()}:
        disp.add_database(db)
    else:
        disp.clear()
    return results

"""Measuring kernels on the GPU: the tuner's real benchmarker and the peer runners.

Timing is Triton's ``do_bench`` (CUDA events, warm-up, L2 flushed between repetitions,
median in ms).  Correctness is checked per variant on a small awkward shape against the
float64 reference, with FlashAttention's rule: max error <= 2 x the error of the same
computation in torch at the input dtype, plus a floor.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
import os

import torch

from . import ops, reference
from .masks import mask_bounds
from .spec import Measurement, Shape, Variant
from .heuristics import default_config

_TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
FLOOR = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 2e-5}


_max_err = reference.max_error


def make_inputs(spec, shape: Shape, device="cuda", seed=0, requires_grad=False):
    g = torch.Generator(device=device).manual_seed(seed)
    dt = _TORCH_DTYPES[spec.dtype]

    def rnd(*s):
        return torch.randn(*s, device=device, dtype=dt, generator=g).requires_grad_(requires_grad)

    q = rnd(shape.batch, shape.num_heads, shape.seqlen_q, spec.head_dim)
    k = rnd(shape.batch, shape.num_kv_heads, shape.seqlen_k, spec.head_dim)
    v = rnd(shape.batch, shape.num_kv_heads, shape.seqlen_k, spec.head_dim_v)
    do = rnd(shape.batch, shape.num_heads, shape.seqlen_q, spec.head_dim_v)
    return q, k, v, do


def _mask_kw(spec, shape: Shape):
    causal = spec.mask == "causal"
    if spec.mask == "window":
        raise NotImplementedError("tuning window masks needs a window size in the key")
    mode, lo, hi = mask_bounds(shape.seqlen_q, shape.seqlen_k, causal=causal, window=(-1, -1))
    return dict(softmax_scale=spec.head_dim ** -0.5, mask=mode, diag_lo=lo, diag_hi=hi), causal


def run_variant(variant: Variant, q, k, v, do, arch=None):
    """A zero-argument callable that launches ``variant``'s kernel on these inputs (the
    other kernels it needs run once, here, with their default configs), and the outputs
    it checks: {name: tensor}."""
    spec, cfg = variant.spec, variant.config
    shape = Shape(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2])
    kw, _ = _mask_kw(spec, shape)
    if spec.kernel == "fwd":
        out = torch.empty(q.shape[:3] + (v.shape[3],), dtype=q.dtype, device=q.device)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)

        def fn():
            ops.fwd(q, k, v, config=cfg, out=out, lse=lse, **kw)
        return fn, {"O": out, "LSE": lse}
    from .spec import KernelSpec

    arch = arch or _arch()
    fspec = KernelSpec("fwd", spec.dtype, spec.head_dim, spec.head_dim_v, spec.mask)
    o, lse = ops.fwd(q, k, v, config=default_config(fspec, arch), **kw)
    if spec.kernel == "bwd_dq":
        dq = torch.empty_like(q)
        delta = torch.empty_like(lse)

        def fn():
            ops.bwd_dq(do, q, k, v, o, lse, config=cfg, dq=dq, delta=delta, **kw)
        return fn, {"dQ": dq}
    qspec = KernelSpec("bwd_dq", spec.dtype, spec.head_dim, spec.head_dim_v, spec.mask)
    _, delta = ops.bwd_dq(do, q, k, v, o, lse, config=default_config(qspec, arch), **kw)
    dk, dv = torch.empty_like(k), torch.empty_like(v)

    def fn():
        ops.bwd_dkdv(do, q, k, v, lse, delta, config=cfg, dk=dk, dv=dv, **kw)
    return fn, {"dK": dk, "dV": dv}


def _arch():
    from .arch import current

    return current()


def check_variant(variant: Variant, group: int = 1, device="cuda") -> tuple[bool, float, str]:
    """Run ``variant`` on a small awkward shape (seqlens not multiples of any block,
    seqlen_q != seqlen_k) and compare with the float64 reference.

    Returns (ok, worst error ratio err / (2 * baseline + floor), message)."""
    spec = variant.spec
    shape = Shape(2, 2 * group, group, 301, 397) if spec.mask == "none" else Shape(2, 2 * group, group, 397, 301)
    q, k, v, do = make_inputs(spec, shape, device=device, seed=1234)
    fn, outs = run_variant(variant, q, k, v, do)
    for t in outs.values():
        t.fill_(float("nan"))
    fn()
    torch.cuda.synchronize()
    _, causal = _mask_kw(spec, shape)
    rkw = dict(causal=causal, softmax_scale=spec.head_dim ** -0.5)
    dt = q.dtype
    if spec.kernel == "fwd":
        r = reference.forward(q, k, v, **rkw)
        b = reference.forward(q, k, v, dtype=dt, **rkw)
        refs = {"O": (r[0], b[0]), "LSE": (r[1], b[1].float())}
    else:
        r = reference.backward(do, q, k, v, **rkw)
        b = reference.backward(do, q, k, v, dtype=dt, **rkw)
        refs = {"dQ": (r[0], b[0]), "dK": (r[1], b[1]), "dV": (r[2], b[2])}
    worst, msgs = 0.0, []
    for name, out in outs.items():
        ref64, base = refs[name]
        floor = FLOOR[torch.float32 if name == "LSE" else dt]
        err, base_err = _max_err(out, ref64), _max_err(base, ref64)
        ratio = err / (2 * base_err + floor)
        worst = max(worst, ratio)
        msgs.append(f"{name} err {err:.3g} (torch {dt} {base_err:.3g})")
    return worst <= 1.0, worst, "; ".join(msgs)


def time_ms(fn, warmup_ms: int = 10, rep_ms: int = 40) -> float:
    """Median ms of ``fn`` (CUDA events, L2 flushed between repetitions)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def compiler_report(variant: Variant) -> dict:
    k = ops.compiled.get(variant.id)
    if k is None:
        return {}
    return {"smem_bytes_compiled": int(k.metadata.shared), "n_regs": getattr(k, "n_regs", None),
            "n_spills": getattr(k, "n_spills", None)}


def _precompile_one(variant: Variant, group: int = 1) -> tuple[str, str | None, dict]:
    """Worker: compile (by running once on a small shape) and report."""
    try:
        ok, ratio, msg = check_variant(variant, group)
        report = {**compiler_report(variant), "check_ratio": ratio}
        return variant.id, None if ok else f"wrong_result: ratio {ratio:.3g}: {msg}", report
    except Exception as e:  # noqa: BLE001 - a failure is a value
        return variant.id, f"compile_failed: {type(e).__name__}: {str(e)[-500:]}", {}


class KernelBenchmarker:
    """The tuner's benchmarker on a CUDA GPU: compile, verify once per variant, time.

    ``precompile`` compiles (and verifies) many variants in parallel worker processes,
    which fills Triton's on-disk cache so the trials only load binaries.
    """

    def __init__(self, warmup_ms: int = 10, rep_ms: int = 40, workers: int | None = None):
        self.warmup_ms, self.rep_ms = warmup_ms, rep_ms
        self.workers = workers or min(16, os.cpu_count() or 1)
        self._checked: dict[str, tuple[str | None, dict]] = {}  # variant id -> (failure, report)
        self._inputs: dict = {}

    def precompile(self, variants: list[Variant], progress=None) -> dict[str, str | None]:
        """Compile and verify ``variants`` in worker processes; returns {variant id:
        failure message or None}.  ``progress(variant_id, failure)`` after each."""
        todo = [v for v in dict.fromkeys(variants) if v.id not in self._checked]
        if todo:
            ctx = mp.get_context("spawn")
            with cf.ProcessPoolExecutor(self.workers, mp_context=ctx) as ex:
                futs = {ex.submit(_precompile_one, v): v for v in todo}
                for f in cf.as_completed(futs):
                    try:
                        vid, failure, report = f.result()
                    except Exception as e:  # noqa: BLE001 - a crashed worker is a value too
                        vid, failure, report = futs[f].id, f"launch_failed: {type(e).__name__}: {e}", {}
                    self._checked[vid] = (failure, report)
                    if progress:
                        progress(vid, failure)
        return {v.id: self._checked[v.id][0] for v in variants}

    def __call__(self, variant: Variant, shape: Shape) -> Measurement:
        if variant.id not in self._checked:
            self._checked[variant.id] = _precompile_one(variant, shape.num_heads // shape.num_kv_heads)[1:]
        failure, report = self._checked[variant.id]
        report = {k: v for k, v in report.items() if k in _REPORTED and v is not None}
        if failure is not None:
            return Measurement(failure.split(":", 1)[0], error=failure, **report)
        key = (variant.spec, shape)
        if key not in self._inputs:
            self._inputs.clear()
            self._inputs[key] = make_inputs(variant.spec, shape)
        try:
            fn, _ = run_variant(variant, *self._inputs[key])
            ms = time_ms(fn, self.warmup_ms, self.rep_ms)
        except Exception as e:  # noqa: BLE001
            return Measurement("launch_failed", error=f"{type(e).__name__}: {e}"[-500:])
        report.update({k: v for k, v in compiler_report(variant).items() if v is not None})
        return Measurement("ok", median_ms=ms, **report)

    def check_ratios(self) -> dict[str, float]:
        """variant id -> error ratio of its correctness check (<= 1 passes)."""
        return {vid: r["check_ratio"] for vid, (_, r) in self._checked.items() if "check_ratio" in r}


_REPORTED = ("smem_bytes_compiled", "n_regs", "n_spills")

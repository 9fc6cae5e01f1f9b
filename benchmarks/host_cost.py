"""Where the host time of a TMA launch goes (issue 4/5 diagnostics).

Per call, host-bound (tiny shape, best of 5 x N calls): building the two tensor
descriptors, ops.fwd with a TMA config and with the same tile on pointers, a raw launch
with prebuilt descriptors, flashgen.attention without and with autograd.  Then GPU time
(do_bench median) of TMA vs pointer configs on one bench shape through ops.fwd and
through flashgen.attention, to tell host cost from kernel time.

Usage (repository root, on the GPU):  python3 benchmarks/host_cost.py

``--cpu-stubbed`` (no GPU): flashgen's own host path per call, forward and
forward+backward through autograd, with every kernel launch stubbed out (Triton's
interpreter launches replaced by a counter; so neither kernel time nor Triton's
launcher is in the number): ``python3 benchmarks/host_cost.py --cpu-stubbed``.

``--cpu-plans`` (no GPU): flashgen's own host path per call without autograd with launch
plans and recipes running as on a GPU (every launch faked), on the forward kernels' path,
in the flash-decoding form and through the transformers integration:
``python3 benchmarks/host_cost.py --cpu-plans``.

``--cpu-generate`` (no GPU): the same per call of a generation loop (8 layers, the cache
growing by one key per step, 700 steps): ``python3 benchmarks/host_cost.py --cpu-generate``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def per_call_us(fn, n=300, reps=5):
    import torch

    best = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


def _best_cpu_us(fn, n: int, reps: int, log: list) -> float:
    """Host us per call of ``fn`` on the CPU (no device synchronization): 20 untimed calls,
    then the best of ``reps`` loops of ``n`` calls; ``log`` is emptied before each loop,
    so after it holds what the last loop appended."""
    for _ in range(20):
        fn()
    best = float("inf")
    for _ in range(reps):
        log.clear()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


def cpu_stubbed(n: int = 200) -> dict:
    """Host us per flashgen.attention call on the CPU, launches stubbed: forward (no
    grad) and forward+backward (causal, b1 h2 s16 d64 float16), with the launches per
    call; then the same for a window written as a mask function (``mask_mod`` q - kv <=
    4 with causal) against ``window=(4, 0)``, and sinks with that window against none
    (the user-function path's host time against the built-in's)."""
    import os

    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import triton.runtime.interpreter as interp

    import flashgen

    launched = []
    real = interp.GridExecutor.__call__
    interp.GridExecutor.__call__ = lambda self, *a, **kw: launched.append(getattr(self.fn, "__name__", "?"))
    try:
        q, k, v = (torch.randn(1, 2, 16, 64, dtype=torch.float16, requires_grad=True) for _ in range(3))
        qn, kn, vn = (t.detach() for t in (q, k, v))

        sinks = torch.zeros(2, requires_grad=True)

        def mask_mod(b, h, q_idx, kv_idx):
            return q_idx - kv_idx <= 4

        def fwdbwd(**kw):
            o = flashgen.attention(q, k, v, causal=True, **kw)
            torch.autograd.grad(o, (q, k, v), torch.ones_like(o))

        cases = [("forward (no grad)", lambda: flashgen.attention(qn, kn, vn, causal=True)),
                 ("forward+backward", fwdbwd)]
        for label, kw in (("window=(4, 0)", dict(window=(4, 0))), ("mask_mod q - kv <= 4", dict(mask_mod=mask_mod)),
                          ("window=(4, 0), sinks", dict(window=(4, 0), sinks=sinks))):
            cases += [(f"{label}: forward (no grad)", lambda kw=kw: flashgen.attention(qn, kn, vn, causal=True, **kw)),
                      (f"{label}: forward+backward", lambda kw=kw: fwdbwd(**kw))]
        out = {}
        for name, fn in cases:
            best = _best_cpu_us(fn, n, 5, launched)
            out[name] = dict(us=best, launches=len(launched) / n, kernels=sorted(set(launched)))
        return out
    finally:
        interp.GridExecutor.__call__ = real


class _FakedLaunches:
    """``with _FakedLaunches() as replays:`` every kernel launch of the three launchers
    faked (the first call of a signature returns a kept kernel whose replay only
    appends to ``replays``), plans usable as on a GPU; everything patched is restored,
    the Triton launcher's table of compiled kernels put back, and the plan tables and
    the fast table emptied on exit (nothing may keep a fake kernel)."""

    def __enter__(self):
        from flashgen import fastlaunch, library, plans
        from flashgen.families.gluon import bwd as B
        from flashgen.families.gluon import launch as L
        from flashgen.families.triton import launch as T

        replays = self.replays = []

        class Kept:  # what plans.Recorder takes for a kept kernel
            packed_metadata = object()
            function = 0

            def run(self, *args):
                replays.append(1)

        kept = {}
        patches = [(m, "launch", lambda fn, grid, args, **o: kept.setdefault((fn, tuple(sorted(o.items()))), Kept()))
                   for m in (B, L, T)]
        patches += [(plans, "usable", lambda: True), (fastlaunch, "_device_and_stream", lambda: (0, 0)),
                    (fastlaunch, "_current_device", lambda: 0), (fastlaunch, "ensure_context", lambda dev: None),
                    (L, "_sm_count", lambda device: 132), (library, "use_kernels", lambda q: True)]
        self.saved = [(m, name, getattr(m, name)) for m, name, _ in patches]
        self.tables = (B._PLANS, L._PLANS, T._FWD_PLANS, T._DQ_PLANS, T._DKDV_PLANS, T._DECODE_PLANS, T._FORM_PLANS)
        self.compiled = (T.compiled, dict(T.compiled))  # the launcher keeps each variant's first kernel
        for m, name, value in patches:
            setattr(m, name, value)
        return replays

    def __exit__(self, *exc):
        from flashgen import dispatch

        for m, name, value in self.saved:
            setattr(m, name, value)
        for table in self.tables:
            table.clear()
        live, before = self.compiled
        live.clear()
        live.update(before)
        dispatch.default_dispatcher().fast.clear()


def cpu_plans(n: int = 500) -> dict:
    """Host us per call on the CPU with launch plans and recipes as on a GPU: every
    kernel launch faked (:class:`_FakedLaunches`), so the number is flashgen's own
    Python per call, its launches' host cost excluded.  Without autograd, bfloat16, 32 /
    8 heads, head_dim 128, causal: flashgen.attention on the forward kernels' path
    (seqlen_q 1 and 16 over 128 keys) and in the flash-decoding form (seqlen_q 1 over
    4096 keys, batch 1 and 4), and the transformers integration's attention function on
    the form's call.  Returns name -> dict(us=, replays=launches replayed per call)."""
    import torch

    import flashgen

    def qkv(b, sq, sk):
        return (torch.randn(b, 32, sq, 128, dtype=torch.bfloat16), torch.randn(b, 8, sk, 128, dtype=torch.bfloat16),
                torch.randn(b, 8, sk, 128, dtype=torch.bfloat16))

    out = {}
    with _FakedLaunches() as replays:
        def per_call(fn):
            with torch.no_grad():
                best = _best_cpu_us(fn, n, 7, replays)
            return dict(us=best, replays=len(replays) / n)

        for label, (b, sq, sk) in (("forward kernels, b1 sq1 sk128", (1, 1, 128)),
                                   ("forward kernels, b1 sq16 sk128", (1, 16, 128)),
                                   ("flash-decoding form, b1 sq1 sk4096", (1, 1, 4096)),
                                   ("flash-decoding form, b4 sq1 sk4096", (4, 1, 4096))):
            q, k, v = qkv(b, sq, sk)
            out[f"flashgen.attention: {label}"] = per_call(
                lambda q=q, k=k, v=v: flashgen.attention(q, k, v, causal=True))
        try:
            import flashgen.integrations.transformers as fg_tf
        except ImportError:
            return out

        class Attn(torch.nn.Module):
            is_causal = True

        q, k, v = qkv(1, 1, 4096)
        module = Attn()
        out["transformers attention_forward: flash-decoding form, b1 sq1 sk4096"] = per_call(
            lambda: fg_tf.attention_forward(module, q, k, v, None, scaling=128 ** -0.5))
    return out


def cpu_generate(steps: int = 700, layers: int = 8, prefill: int = 1024, window: int = 50) -> list[dict]:
    """Host us per call of a generation loop on the CPU, launches faked as in
    :func:`cpu_plans`: ``layers`` calls per step of flashgen.attention without autograd
    (1 x 32 / 8 heads, head_dim 128, bf16, one query row, causal: the flash-decoding
    form), each layer over its own cache of ``prefill`` + step keys, so every step is a
    new seqlen_k.  Returns per window of ``window`` steps the median us of the step's
    first layer (the new size's first call) and of the others."""
    if layers < 2:
        raise ValueError(f"layers={layers}: at least 2 (the first layer's calls are timed apart from the others')")
    import statistics

    import torch

    import flashgen

    cap = prefill + steps
    caches = [(torch.randn(1, 8, cap, 128, dtype=torch.bfloat16), torch.randn(1, 8, cap, 128, dtype=torch.bfloat16))
              for _ in range(layers)]
    q = torch.randn(1, 32, 1, 128, dtype=torch.bfloat16)
    t = []
    with _FakedLaunches(), torch.no_grad():
        for s in range(steps):
            n = prefill + s
            for kc, vc in caches:
                k, v = kc[:, :, :n], vc[:, :, :n]
                t0 = time.perf_counter()
                flashgen.attention(q, k, v, causal=True)
                t.append((time.perf_counter() - t0) * 1e6)
    out = []
    for w in range(0, steps, window):
        step_t = [t[(s * layers):(s + 1) * layers] for s in range(w, min(steps, w + window))]
        out.append(dict(steps=(w, w + len(step_t)), first_us=statistics.median(x[0] for x in step_t),
                        other_us=statistics.median(y for x in step_t for y in x[1:])))
    return out


def main() -> int:
    if "--cpu-generate" in sys.argv[1:]:
        print("host us per call of a generation loop, launches faked (CPU; 8 layers, 1 x 32/8 heads, d128, bf16, one "
              "query row, causal, 1024 + step keys), median per 50 steps")
        for r in cpu_generate():
            print(f"  steps {r['steps'][0]:>3}-{r['steps'][1]:<3}  first layer {r['first_us']:7.1f}   "
                  f"other layers {r['other_us']:6.1f}")
        return 0
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(__doc__)
        return 0
    if "--cpu-plans" in sys.argv[1:]:
        print("host us per call, launches faked, plans and recipes on (CPU; bf16, 32/8 heads, d128, causal, no grad)")
        for name, r in cpu_plans().items():
            print(f"  {name:<70} {r['us']:8.1f}   {r['replays']:.0f} launches replayed")
        return 0
    if "--cpu-stubbed" in sys.argv[1:]:
        print("host us per call, launches stubbed (CPU; b1 h2 s16 d64 float16, causal)")
        for name, r in cpu_stubbed().items():
            print(f"  {name:<40} {r['us']:8.1f}   {r['launches']:.0f} launches: {', '.join(r['kernels'])}")
        return 0
    import torch
    import triton.testing

    if not torch.cuda.is_available():
        raise SystemExit("host_cost.py: needs a CUDA GPU without --cpu-stubbed, --cpu-plans or --cpu-generate")
    import flashgen
    from flashgen import compile as _compile, ops
    from flashgen.spec import KernelSpec, TileConfig, Variant

    dev = "cuda"
    tma, ptr = TileConfig(64, 64, 4, 3, tma=1), TileConfig(64, 64, 4, 3)
    kw = dict(softmax_scale=128 ** -0.5, mask="none", diag_lo=-10**9, diag_hi=10**9)
    print("host us per call (b1 h2 s128 d128 bf16)")
    q, k, v = (torch.randn(1, 2, 128, 128, device=dev, dtype=torch.bfloat16) for _ in range(3))
    mod = _compile.load(Variant(KernelSpec("fwd", "bfloat16", 128, 128, "none"), tma))
    out = torch.empty_like(q)
    lse = torch.empty(1, 2, 128, device=dev)
    kd, vd = ops._descriptor(k, 64, 128), ops._descriptor(v, 64, 128)
    grid = (2 * 2,)

    def raw_tma():
        mod.attn_fwd[grid](q, kd, vd, out, lse, 1.0, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
                           *out.stride()[:3], 2, 1, 128, 128, 2, -10**9, 10**9, num_warps=4, num_stages=3)

    rows = [
        ("two TensorDescriptor()", lambda: (ops._descriptor(k, 64, 128), ops._descriptor(v, 64, 128))),
        ("raw launch, prebuilt descriptors", raw_tma),
        ("ops.fwd tma", lambda: ops.fwd(q, k, v, config=tma, out=out, lse=lse, **kw)),
        ("ops.fwd pointers", lambda: ops.fwd(q, k, v, config=ptr, out=out, lse=lse, **kw)),
        ("flashgen.attention (no grad)", lambda: flashgen.attention(q, k, v)),
    ]
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    rows.append(("flashgen.attention (requires_grad)", lambda: flashgen.attention(qg, kg, vg)))
    rows.append(("forward+backward (autograd.grad)",
                 lambda: torch.autograd.grad(flashgen.attention(qg, kg, vg), (qg, kg, vg), q)))
    for name, fn in rows:
        fn()
        print(f"  {name:<40} {per_call_us(fn):8.1f}", flush=True)

    print("GPU ms (do_bench median), b32 h16 s512 d128 bf16, none")
    q, k, v = (torch.randn(32, 16, 512, 128, device=dev, dtype=torch.bfloat16) for _ in range(3))
    out = torch.empty_like(q)
    lse = torch.empty(32, 16, 512, device=dev)
    cands = [("ops.fwd tma m64n64w4s3", lambda: ops.fwd(q, k, v, config=tma, out=out, lse=lse, **kw)),
             ("ops.fwd ptr m64n64w4s3", lambda: ops.fwd(q, k, v, config=ptr, out=out, lse=lse, **kw)),
             ("attention (no grad)", lambda: flashgen.attention(q, k, v))]
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    cands.append(("attention (requires_grad)", lambda: flashgen.attention(qg, kg, vg)))
    # The open question: at this shape fwd+bwd took 0.27 ms more than fwd and bwd
    # timed apart; a host-bound per-call time near the GPU time says the host is the gap.
    cands.append(("forward+backward (autograd.grad)",
                  lambda: torch.autograd.grad(flashgen.attention(qg, kg, vg), (qg, kg, vg), q)))
    for name, fn in cands:
        ms = triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
        print(f"  {name:<40} {ms:8.4f} ms   host-bound per call {per_call_us(fn, n=100, reps=3):8.1f} us",
              flush=True)
    print(flashgen.explain(q, k, v))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

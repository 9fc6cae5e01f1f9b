"""Host time per call that flashgen adds on top of launching the same Triton kernel
directly, next to torch SDPA's call, on decode-like shapes (seqlen_q 1, 4, 16 against a
short KV cache, so calls are host-bound; one long-KV row for contrast).

Columns (microseconds per call, forward, no autograd, bf16, causal, GQA 32/8, d 128):

* ``flashgen.attention``: the public call (checks, fast path, dispatch, allocation, launch);
* ``flashgen sdpa``: ``flashgen.scaled_dot_product_attention`` (top-left causal);
* ``ops.fwd``: ``flashgen.ops.fwd`` with preallocated outputs and the op's config at the
  shape (``library.kernel_for`` with the mask bounds: the decode kernel's in the
  flash-decoding form) (the launcher API);
* ``raw launch``: ``kernel[grid](...)`` of each kernel the op launches at the shape (the
  forward kernel, or the decode and combine kernels of the flash-decoding form,
  ``library.decode_form``), with the arguments and preallocated outputs of one recorded
  call of the op, so no argument is built per call (in results before 2026-12-08 the
  column launched the forward kernel at every shape, the decode form's included, and
  read its strides per call): the floor;
* ``raw+alloc``: the raw launch plus allocating O and LSE, as any op returning fresh
  tensors must;
* ``added``: flashgen.attention - raw launch (the number the op-users issue bounds by 5 us);
* ``torch sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` (enable_gqa);
* ``kernel (GPU)``: the GPU time of the raw launch's kernels (triton.testing.do_bench, median).

Per-call time = wall time of N back-to-back calls / N, synchronized once at the end
(best of R repeats); where it exceeds the kernel's GPU time, the call is host-bound.

    PYTHONPATH=. python3 benchmarks/overhead.py --out overhead.json    # on a GPU
    PYTHONPATH=. python3 benchmarks/overhead.py --mock     # on CPU: every launch a no-op

Before timing a shape, flashgen's output and gradients on it are checked against the
float64 reference (``flashgen.compare.check_slice``: batch 0, kv head 0's query heads;
error <= 2x torch's at the dtype + a floor); a failed check makes the exit status 1.
``--out`` writes every row (microseconds per column, and the check's ratios) as JSON.

The kernels each shape launches are printed last on its row (``launches``) and written
to the JSON.

``--mock`` measures the Python side only: CPU tensors, TRITON_INTERPRET=1 so the kernel
path is taken, and every kernel launch (``flashgen.fastlaunch.launch``, through which
each launcher launches, as the launchers hold it) replaced by a no-op while the shapes
are timed, the flash-decoding form's kernels included (the raw launch column then times
passing the recorded arguments to a launch that does nothing; GPU time and torch SDPA are
not measured).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time


@contextlib.contextmanager
def launches_replaced(replacement):
    """Every flashgen module's ``launch`` (``flashgen.fastlaunch.launch``, which the
    families' launchers import by name) replaced by ``replacement`` (same arguments:
    ``fn, grid, args, **options``) inside the block."""
    from flashgen import fastlaunch

    real = fastlaunch.launch
    sites = {id(m): m for name, m in list(sys.modules.items())
             if name.startswith("flashgen") and getattr(m, "launch", None) is real}
    for m in sites.values():
        m.launch = replacement
    try:
        yield
    finally:
        for m in sites.values():
            m.launch = real


def record_launches(call, run: bool) -> list[tuple]:
    """``(fn, grid, args, options)`` of every kernel one ``call()`` launches, with launch
    plans off so that each launch goes through ``launch``; ``run``: the kernels also run
    (else no launch happens)."""
    from flashgen import fastlaunch

    real, seen = fastlaunch.launch, []

    def rec(fn, grid, args, **options):
        seen.append((fn, tuple(grid), tuple(args), options))
        return real(fn, grid, args, **options) if run else None

    plans_env = os.environ.get("FLASHGEN_LAUNCH_PLANS")
    os.environ["FLASHGEN_LAUNCH_PLANS"] = "0"
    try:
        with launches_replaced(rec):
            call()
    finally:
        if plans_env is None:
            del os.environ["FLASHGEN_LAUNCH_PLANS"]
        else:
            os.environ["FLASHGEN_LAUNCH_PLANS"] = plans_env
    return seen


def kernel_name(fn) -> str:
    return getattr(fn, "__name__", None) or getattr(getattr(fn, "fn", None), "__name__", None) or repr(fn)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="flashgen host overhead per call")
    p.add_argument("--mock", action="store_true", help="CPU, every kernel launch replaced by a no-op")
    p.add_argument("-n", type=int, default=2000, help="calls per timing")
    p.add_argument("-r", type=int, default=5, help="repeats (best is reported)")
    p.add_argument("--shapes", default="1x128,4x128,16x128,1x4096", help="seqlen_q x seqlen_k, comma-separated")
    p.add_argument("--out", default=None, help="JSON output path")
    args = p.parse_args(argv)
    if args.mock:
        os.environ["TRITON_INTERPRET"] = "1"

    import torch
    import torch.nn.functional as F

    import flashgen
    from flashgen import library, ops
    from flashgen.compare import Case, check_slice
    from flashgen.masks import mask_bounds

    if not args.mock and not torch.cuda.is_available():
        print("no CUDA device: run with --mock for the CPU-side numbers")
        return 2
    device = "cpu" if args.mock else "cuda"
    sync = (lambda: None) if args.mock else torch.cuda.synchronize

    class NoLaunch:
        def __getitem__(self, grid):
            return lambda *a, **k: None

    def per_call_us(fn):
        for _ in range(20):
            fn()
        best = float("inf")
        for _ in range(args.r):
            sync()
            t = time.perf_counter()
            for _ in range(args.n):
                fn()
            sync()
            best = min(best, (time.perf_counter() - t) / args.n * 1e6)
        return best

    cols = ("flashgen.attention", "flashgen sdpa", "ops.fwd", "raw launch", "raw+alloc", "added", "torch sdpa",
            "kernel (GPU)")
    print(f"device: {'CPU, every kernel launch a no-op' if args.mock else torch.cuda.get_device_name()}; torch "
          f"{torch.__version__}; us per call (best of {args.r} x {args.n})")
    # bfloat16 on the GPU; the mock runs float16 (the interpreter's bfloat16 inputs take
    # the reference path instead of the kernels).
    dtype = torch.float16 if args.mock else torch.bfloat16
    print(f"{'shape (' + ('fp16' if args.mock else 'bf16') + ', causal)':28}" + "".join(f"{c:>19}" for c in cols)
          + "  launches (raw launch replays them)")
    results, failed = [], False
    for spec in args.shapes.split(","):
        sq, sk = (int(x) for x in spec.split("x"))
        b, h, hk, d = 1, 32, 8, 128
        q = torch.randn(b, h, sq, d, device=device, dtype=dtype)
        k = torch.randn(b, hk, sk, d, device=device, dtype=dtype)
        v = torch.randn(b, hk, sk, d, device=device, dtype=dtype)
        check = check_slice(q, k, v, torch.randn_like(q), Case(b, h, hk, sq, sk, d, causal=True))
        if max(check.values()) > 1:
            print(f"float64 check failed at sq{sq} sk{sk}: {check}")
            failed = True
        mode, lo, hi = mask_bounds(sq, sk, causal=True, window=(-1, -1))
        # The op's kernel at this shape (the decode kernel's config where the op takes its
        # flash-decoding form): what ops.fwd is given.
        cfg, _ = library.kernel_for("fwd", q, k, v, mode, bounds=(lo, hi))
        scale = d ** -0.5
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:3], device=device, dtype=torch.float32)

        def op():
            return flashgen.attention(q, k, v, causal=True)

        with torch.no_grad():
            # What one call of the op launches, with the arguments (tensor descriptors
            # and buffers included) of that call: the raw launch replays them, so a TMA
            # config's descriptors are built once, outside the timing (ops.fwd builds
            # them per call).
            launches = record_launches(op, run=not args.mock)
        stub = NoLaunch()
        kernels = [(stub if args.mock else fn, grid, a, opts) for fn, grid, a, opts in launches]

        def raw():
            for fn, grid, a, opts in kernels:
                fn[grid](*a, **opts)

        def raw_alloc():
            torch.empty((b, h, sq, d), device=device, dtype=q.dtype)
            torch.empty((b, h, sq), device=device, dtype=torch.float32)
            raw()

        with torch.no_grad(), (launches_replaced(lambda fn, grid, a, **opts: None) if args.mock
                               else contextlib.nullcontext()):
            t = {
                "flashgen.attention": per_call_us(op),
                "flashgen sdpa": per_call_us(lambda: flashgen.scaled_dot_product_attention(
                    q, k, v, is_causal=True, enable_gqa=True)),
                "ops.fwd": per_call_us(lambda: ops.fwd(q, k, v, softmax_scale=scale, mask=mode, diag_lo=lo,
                                                       diag_hi=hi, config=cfg, out=out, lse=lse)),
                "raw launch": per_call_us(raw) if kernels else float("nan"),
                "raw+alloc": per_call_us(raw_alloc) if kernels else float("nan"),
            }
            t["added"] = t["flashgen.attention"] - t["raw launch"]
            if args.mock:
                t["torch sdpa"] = t["kernel (GPU)"] = float("nan")
            else:
                import triton.testing

                t["torch sdpa"] = per_call_us(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
                t["kernel (GPU)"] = (triton.testing.do_bench(raw, return_mode="median") * 1e3 if kernels
                                     else float("nan"))
        name = f"b{b} h{h}/{hk} sq{sq} sk{sk} d{d}"
        names = [kernel_name(fn) for fn, *_ in launches]
        print(f"{name:28}" + "".join(f"{t[c]:19.1f}" for c in cols)
              + f"  {' + '.join(names) or 'no kernel (the reference path)'}")
        results.append(dict(shape=name, us=t, check=check, launches=names))
    if args.out:
        import json

        meta = dict(device="CPU, every kernel launch a no-op" if args.mock else torch.cuda.get_device_name(),
                    torch=torch.__version__, dtype=str(dtype).replace("torch.", ""), calls=args.n, repeats=args.r,
                    unit="us per call (best of repeats)", check="float64 reference, ratio <= 1 passes")
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=results), f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

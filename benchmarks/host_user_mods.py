"""Host time against GPU time per call of ``flashgen.attention`` with user mask functions,
beside the same call without them (the dense causal call and the built-in window).

For each case (bf16, 16 heads, seqlen 2048, head_dim 128; the mask examples of
:mod:`flashgen.user_examples` at batch 8, and document + causal at batch 16, where the
dispatcher gives it the Gluon whole backward untuned): the backward the dispatcher picks
(``flashgen.explain``), then, for the forward (no grad) and the forward+backward through
autograd:

* ``bench``: ``triton.testing.do_bench`` median (ms, L2 flushed between calls);
* ``host``: ms per call until 30 back-to-back calls return on the host (no
  synchronization inside the loop), so the host's own time when it runs ahead;
* ``wall``: ms per call of the same loop until the GPU has finished;
* ``gpu(q)``: forward+backward GPU time per call by CUDA events over 10 calls launched
  behind a sleep kernel (the queue full, so no launch gap is timed).

A call whose ``host`` nears its ``gpu(q)`` waits on its host.  cProfile of five
forward+backward calls of the dense case and of both document + causal cases goes to
``prof_*.txt`` under --out.  No float64 check here: the user functions' exactness is
``benchmarks/user_mods_bench.py``'s and ``benchmarks/gluon_user_bwd.py``'s.

    PYTHONPATH=$PWD python3 benchmarks/host_user_mods.py --out DIR        # GPU
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="host_user_mods")
    args = p.parse_args(argv)
    import torch
    import triton.testing

    import flashgen
    from flashgen import user_examples

    os.makedirs(args.out, exist_ok=True)
    h, s, d = 16, 2048, 128
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)

    def case(name):
        if name == "dense-causal":
            return dict(causal=True)
        if name == "builtin-window":
            return dict(causal=True, window=(s // 8, 0))
        ex = user_examples.make(name, h, s, dev, requires_grad=False)
        sm, mm = ex.functions(*ex.tensors)
        return dict(causal=ex.causal, window=ex.window, score_mod=sm, mask_mod=mm)

    rows = []
    for name, b in (("dense-causal", 8), ("builtin-window", 8), ("window-causal", 8), ("document-causal", 8),
                    ("document", 8), ("document-causal", 16)):
        q, k, v, do = (torch.randn(b, h, s, d, device=dev, dtype=dt, generator=g) for _ in range(4))
        kw = case(name)
        qkv = [t.clone().requires_grad_() for t in (q, k, v)]

        def fb():
            flashgen.attention(*qkv, softmax_scale=d ** -0.5, **kw).backward(do)

        def f():
            with torch.no_grad():
                flashgen.attention(*qkv, softmax_scale=d ** -0.5, **kw)

        for _ in range(3):
            fb()
        torch.cuda.synchronize()
        r = {"case": f"{name} b{b}", "backward": flashgen.explain(q, k, v, softmax_scale=d ** -0.5, **kw).backward}
        for lab, fn in (("fwd", f), ("fb", fb)):
            r[f"{lab}_bench"] = triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")
            n = 30
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            r[f"{lab}_host"], r[f"{lab}_wall"] = (t1 - t0) / n * 1e3, (t2 - t0) / n * 1e3
        torch.cuda.synchronize()
        torch.cuda._sleep(int(2e8))
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(10):
            fb()
        e1.record()
        torch.cuda.synchronize()
        r["fb_gpu_queued"] = e0.elapsed_time(e1) / 10
        rows.append(r)
        if name in ("document-causal", "dense-causal"):
            pr = cProfile.Profile()
            torch.cuda.synchronize()
            pr.enable()
            for _ in range(5):
                fb()
            pr.disable()
            torch.cuda.synchronize()
            text = io.StringIO()
            pstats.Stats(pr, stream=text).sort_stats("tottime").print_stats(22)
            pstats.Stats(pr, stream=text).sort_stats("cumulative").print_stats(40)
            with open(os.path.join(args.out, f"prof_{name}_b{b}.txt"), "w") as fh:
                fh.write(text.getvalue())
    with open(os.path.join(args.out, "host_user_mods.json"), "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, fh, indent=1)
    print(f"{'case':20s} {'backward':12s} {'fwd bench':>9s} {'fwd host':>8s} {'fb bench':>8s} {'fb host':>8s} "
          f"{'fb wall':>8s} {'fb gpu(q)':>9s}")
    for r in rows:
        print(f"{r['case']:20s} {r['backward'][:12]:12s} {r['fwd_bench']:9.3f} {r['fwd_host']:8.3f} "
              f"{r['fb_bench']:8.3f} {r['fb_host']:8.3f} {r['fb_wall']:8.3f} {r['fb_gpu_queued']:9.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Timelines of small forward+backward calls: torch.profiler chrome traces (host ops and
GPU kernels with their timestamps) of a few back-to-back calls, for flashgen with the
backward in autograd's device thread, in the calling thread, and SDPA cuDNN.

Usage (repository root, on a CUDA GPU):
    python3 benchmarks/trace_call.py --out DIR [--shape B,H,HKV,S]...   (head_dim 128, causal, bf16)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", action="append")
    ap.add_argument("--calls", type=int, default=6)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile

    import flashgen

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for spec in args.shape or ("1,32,8,512", "1,32,8,2048"):
        b, h, hk, n = (int(x) for x in spec.split(","))
        q = torch.randn(b, h, n, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(b, hk, n, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(b, hk, n, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        do = torch.randn(b, h, n, 128, device="cuda", dtype=torch.bfloat16)

        def fg():
            flashgen.attention(q, k, v, causal=True).backward(do)

        def fg_thread():
            with torch.autograd.set_multithreading_enabled(False):
                flashgen.attention(q, k, v, causal=True).backward(do)

        def cudnn():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                 enable_gqa=hk != h).backward(do)

        for name, fn in (("flashgen", fg), ("flashgen-calling-thread", fg_thread), ("cudnn", cudnn)):
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=False) as p:
                for _ in range(args.calls):
                    with torch.profiler.record_function("call"):
                        fn()
                torch.cuda.synchronize()
            f = out / f"{name}_{spec.replace(',', 'x')}.json"
            p.export_chrome_trace(str(f))
            print(f"wrote {f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

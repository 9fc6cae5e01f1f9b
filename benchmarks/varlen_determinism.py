"""The ragged-batch backward through the public call on the GPU: for head_dim 128 causal
and unmasked, head_dim 64 causal and a head_dim 128 sliding window (seven documents of
0-2000 tokens, 32/8 heads, bf16), with torch.use_deterministic_algorithms off and on:
which family's backward the dispatcher runs, whether three forward+backward calls give
bitwise-equal dQ, dK, dV, and the worst error ratio against float64
(flashgen.bench.compare_varlen).  Under the flag the Triton kernels must run and repeat
bit for bit.

    PYTHONPATH=. CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 benchmarks/varlen_determinism.py    # GPU
"""
import argparse
import sys

import torch

import flashgen
from flashgen import bench, library
from flashgen.spec import KernelSpec


def main(argv=None) -> int:
    """Print one line per (case, flag); 1 when a deterministic backward did not repeat,
    2 without a GPU."""
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    if not torch.cuda.is_available():
        print("varlen_determinism.py: needs a CUDA GPU; none is visible", file=sys.stderr)
        return 2
    bad = 0
    lens = [700, 300, 1000, 48, 1, 0, 2000]
    cases = ((128, True, (-1, -1)), (128, False, (-1, -1)), (64, True, (-1, -1)), (128, False, (256, 0)))
    for d, causal, window in cases:
        mode = "window" if window[0] >= 0 else ("causal" if causal else "none")
        spec = KernelSpec("bwd_varlen", "bfloat16", d, d, mode)
        q, k, v, do, cu, _, mx, _ = bench.make_varlen_inputs(spec, lens, lens, 32, 8, seed=3)
        for det in (False, True):
            torch.use_deterministic_algorithms(det)
            plan = library.varlen_backward_kernels(q, k, v, mode, len(lens), mx, mx, det)
            fam = plan[0].family if not isinstance(plan[0], tuple) else plan[0][0].family
            grads = []
            for _ in range(3):
                qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
                o = flashgen.attention_varlen(qq, kk, vv, cu, cu, mx, mx, causal=causal, window=window)
                o.backward(do)
                grads.append((qq.grad, kk.grad, vv.grad))
            same = all(torch.equal(a, b) for g in grads[1:] for a, b in zip(g, grads[0]))
            kw = dict(softmax_scale=d ** -0.5, win_left=window[0], win_right=0 if causal else window[1])
            outs = {"dQ": grads[0][0], "dK": grads[0][1], "dV": grads[0][2]}
            res = bench.compare_varlen(outs, q, k, v, do, cu, cu, kw=kw)
            worst = max(r[2] for r in res.values())
            print(f"d{d} {mode:7s} deterministic={det!s:5s} backward={fam:7s} bitwise_repeat={same} "
                  f"worst_ratio={worst:.3f}", flush=True)
            bad += det and not same
    torch.use_deterministic_algorithms(False)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

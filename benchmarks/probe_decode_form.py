"""The dense op's flash-decoding form at few sizes: wall time per call against the GPU
time of its kernels, beside ``attention_with_kvcache`` on the same inputs.

For each BxSQxSK (32 query heads, 8 kv heads, head_dim 128, bf16; causal from seqlen_q
2): ``flashgen.attention`` in its flash-decoding form (``library.decode_form``), its
median ms per call (``triton.testing.do_bench``, back-to-back calls, so a call whose
host time exceeds its kernels' reads its host time) and the GPU time of its kernels per
call (torch.profiler over 20 calls); ``attention_with_kvcache`` on a cache in its own
(batch, seqlen, kv heads, head_dim) layout and on the form's transposed view of the same
K and V; and the decode config the form runs (``library.decode_form_kernel``).  Needs a
CUDA GPU.

    PYTHONPATH=$PWD python3 benchmarks/probe_decode_form.py 1x4x4096 1x16x4096 8x16x4096
"""

from __future__ import annotations

import argparse


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sizes", nargs="*", default=["8x4x4096", "8x1x4096", "1x1x4096", "8x16x4096"],
                   help="BATCHxSEQLEN_QxSEQLEN_K (default: %(default)s)")
    args = p.parse_args(argv)
    import torch
    from triton.testing import do_bench

    import flashgen
    from flashgen import library

    if not torch.cuda.is_available():
        raise SystemExit("probe_decode_form.py: needs a CUDA GPU")
    torch.manual_seed(0)
    for size in args.sizes:
        b, sq, sk = (int(x) for x in size.split("x"))
        q = torch.randn(b, 32, sq, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, 8, sk, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        causal = sq > 1
        kc, vc = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()  # cache layout (b, s, hk, d)
        kt, vt = k.transpose(1, 2), v.transpose(1, 2)  # the form's view of the same K and V
        qd = q.transpose(1, 2)
        lens = torch.full((b,), sk, dtype=torch.int32, device="cuda")
        with torch.no_grad():
            def f_form():
                flashgen.attention(q, k, v, causal=causal)

            def f_cache():
                flashgen.attention_with_kvcache(qd, kc, vc, cache_seqlens=lens, causal=causal)

            def f_view():
                flashgen.attention_with_kvcache(qd, kt, vt, cache_seqlens=lens, causal=causal)

            cfg, _ = library.decode_form_kernel(q, k, v, "causal" if causal else "none")
            res = [do_bench(f, warmup=50, rep=300) for f in (f_form, f_cache, f_view)]
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    f_form()
                torch.cuda.synchronize()
            gpu = sum(e.device_time_total for e in prof.key_averages()) / 20 / 1000
        print(f"b{b} q{sq} k{sk}: form {res[0]:.4f} ms (GPU {gpu:.4f}), kvcache cache-layout {res[1]:.4f}, "
              f"kvcache on the form's view {res[2]:.4f}; cfg {cfg.BLOCK_M}x{cfg.BLOCK_N} w{cfg.num_warps} "
              f"s{cfg.num_stages} sp{cfg.num_splits}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

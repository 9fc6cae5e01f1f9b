"""A user mask function called again with a new captured tensor: each call's output and
dQ, dK, dV against float64, so that a replayed launch plan (:mod:`flashgen.plans`) is
seen to read the call's own tensors.

Three calls per problem, each with a fresh per-token document-id tensor (the mask
``doc[q] == doc[kv]``): bf16 2x16x1000 head_dim 128 causal, 2x16/4x1000 head_dim 64 (GQA
4), 8x16x2048 head_dim 128 causal (where the dispatcher may pick the Gluon backward);
relative L2 error of O, dQ, dK, dV against ``flashgen.user_mods.reference`` in float64,
and the backward the dispatcher picks (``flashgen.explain``).  Exit status 1 when an
error exceeds 1.5e-2 (bf16's rounding gives about 2e-3 here).

    PYTHONPATH=$PWD python3 benchmarks/user_replay_check.py        # GPU
"""

from __future__ import annotations

import sys


def main() -> int:
    import torch

    import flashgen
    from flashgen import user_mods

    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    worst = 0.0
    for (b, h, hk, s, d, causal) in ((2, 16, 16, 1000, 128, True), (2, 16, 4, 1000, 64, False),
                                     (8, 16, 16, 2048, 128, True)):
        for it in range(3):
            doc = torch.randint(0, 4, (s,), device=dev).sort().values

            def mask_mod(bb, hh, q_idx, kv_idx, doc=doc):
                return doc[q_idx] == doc[kv_idx]

            q = torch.randn(b, h, s, d, device=dev, dtype=dt, requires_grad=True)
            k = torch.randn(b, hk, s, d, device=dev, dtype=dt, requires_grad=True)
            v = torch.randn(b, hk, s, d, device=dev, dtype=dt, requires_grad=True)
            do = torch.randn(b, h, s, d, device=dev, dtype=dt)
            o = flashgen.attention(q, k, v, causal=causal, mask_mod=mask_mod)
            grads = torch.autograd.grad(o, (q, k, v), do)
            q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
            lo, hi = (-s, 0) if causal else (-s, s)
            ref, _ = user_mods.reference(q64, k64, v64, d ** -0.5, lo, hi, None, mask_mod, None, torch.float64)
            ref_grads = torch.autograd.grad(ref, (q64, k64, v64), do.double())
            errors = [float((a.double() - r).norm() / r.norm()) for a, r in zip((o, *grads), (ref, *ref_grads))]
            worst = max(worst, *errors)
            why = flashgen.explain(q, k, v, causal=causal, mask_mod=mask_mod).backward
            print((b, h, hk, s, d, "causal" if causal else "none"), "repetition", it, "O, dQ, dK, dV rel. L2",
                  " ".join(f"{e:.1e}" for e in errors), "|", why[:40], flush=True)
    print(f"worst {worst:.2e}: {'ok' if worst < 1.5e-2 else 'FAIL'}")
    return 0 if worst < 1.5e-2 else 1


if __name__ == "__main__":
    sys.exit(main())

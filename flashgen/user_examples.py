"""The common FlexAttention uses as flashgen user functions, defined once: what
``benchmarks/user_mods_bench.py`` times, what ``flashgen tune --preset user-examples``
tunes (:mod:`flashgen.user_tune`) and what the tests run.

Each example is made for a problem size by :func:`make` (its tensors depend on the
number of heads and the sequence length; its constants, e.g. the prefix length, on the
sequence length, so a user variant's name, a hash of its lowered code, is that of the
size it was made for):

* ``relpos``: T5's bucketed relative-position bias (32 buckets, max distance 128) read
  from a learned float32 table (32, num_heads) that takes a gradient; no mask.
* ``alibi``: ALiBi as a score function (slopes 2^(-8 i / num_heads)), causal; equals
  ``alibi_slopes=``.
* ``softcap``: 30 tanh(s / 30), causal; equals ``softcap=30``.
* ``prefix-lm``: mask (kv <= q) | (kv < seqlen // 4), no built-in mask.
* ``document`` / ``document-causal``: doc[q] == doc[kv] from an int64 per-token document
  id tensor (documents of seqlen/16 .. seqlen/2 tokens), without and with causal.
* ``window-causal``: mask q - kv <= seqlen // 8 with causal; equals ``window=(seqlen // 8, 0)``.
* ``sinks``: learnable sinks (float32 (num_heads,), a gradient) with causal and a window
  of seqlen // 16 (gpt-oss); no score or mask function.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

#: The examples, in the order the benchmark and the tuner take them.
NAMES = ("relpos", "alibi", "softcap", "prefix-lm", "document", "document-causal", "window-causal", "sinks")


@dataclasses.dataclass
class Example:
    """One example made for a size.  ``functions(*tensors)`` returns (score_mod,
    mask_mod) (either may be None) reading ``tensors`` (the learned float32 tensors
    captured by the functions, e.g. the relative-position table; a float64 copy gives
    the reference's functions); ``sinks`` float32 (num_heads,) or None; ``causal`` and
    ``window`` the built-in mask of ``flashgen.attention``; ``builtin`` the keyword
    arguments that give the same attention with flashgen's built-in features (None:
    none; for ``sinks``, {}: the same problem without sinks)."""

    name: str
    functions: Callable
    tensors: list
    causal: bool
    window: tuple = (-1, -1)
    sinks: torch.Tensor | None = None
    builtin: dict | None = None

    def kwargs(self, tensors=None, sinks=None) -> dict:
        """The keyword arguments of ``flashgen.attention`` (besides q, k, v) for this
        example with ``tensors`` (default: its own) and ``sinks`` (default: its own)."""
        sm, mm = self.functions(*(self.tensors if tensors is None else tensors))
        return dict(causal=self.causal, window=self.window, score_mod=sm, mask_mod=mm,
                    sinks=self.sinks if sinks is None else sinks)


def t5_bucket(rel, num_buckets: int = 32, max_distance: int = 128, dtype=torch.long):
    """T5's bidirectional relative-position bucket of ``rel`` = kv - q (int64 tensor),
    as transformers' ``_relative_position_bucket``: half the buckets per direction,
    exact below num_buckets / 4, logarithmic up to max_distance.  ``dtype``: the integer
    type of the casts (T5's ``.long()``; the values are the same in int32)."""
    num_buckets //= 2
    buckets = (rel > 0).to(dtype) * num_buckets
    rel = torch.abs(rel)
    max_exact = num_buckets // 2
    large = max_exact + (torch.log(rel.float() / max_exact) / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).to(dtype)
    large = torch.min(large, torch.full_like(large, num_buckets - 1))
    return buckets + torch.where(rel < max_exact, rel, large)


def document_ids(seqlen: int, seed: int = 5, device="cpu") -> torch.Tensor:
    """int64 (seqlen,) document id per token: documents of seqlen // 16 .. seqlen // 2
    tokens (the last one cut at seqlen), drawn from a generator seeded ``seed``."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    lens, total = [], 0
    while total < seqlen:
        n = min(seqlen - total, int(torch.randint(max(1, seqlen // 16), seqlen // 2 + 1, (1,), generator=g)))
        lens.append(n)
        total += n
    return torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)).to(device)


def make(name: str, num_heads: int, seqlen: int, device="cpu", requires_grad: bool = True) -> Example:
    """Example ``name`` (one of :data:`NAMES`) for ``num_heads`` query heads and
    sequence length ``seqlen`` (seqlen_q = seqlen_k), its tensors on ``device``; the
    learned tensors and sinks require grad when ``requires_grad``.  ValueError for an
    unknown name."""
    g = torch.Generator(device="cpu").manual_seed(5)
    h, s = num_heads, seqlen
    if name == "relpos":
        table = (torch.randn(32, h, generator=g) * 0.5).to(device).requires_grad_(requires_grad)

        def relpos(table):
            def score_mod(score, b, h, q_idx, kv_idx):
                return score + table[t5_bucket(kv_idx - q_idx), h]
            return score_mod, None
        return Example(name, relpos, [table], causal=False)
    if name == "alibi":
        slopes = torch.tensor([2 ** (-8 * (i + 1) / h) for i in range(h)], device=device)

        def alibi():
            def score_mod(score, b, h, q_idx, kv_idx):
                return score - slopes[h] * torch.abs(q_idx - kv_idx)
            return score_mod, None
        return Example(name, alibi, [], causal=True, builtin=dict(alibi_slopes=slopes))
    if name == "softcap":
        def softcap():
            def score_mod(score, b, h, q_idx, kv_idx):
                return 30.0 * torch.tanh(score / 30.0)
            return score_mod, None
        return Example(name, softcap, [], causal=True, builtin=dict(softcap=30.0))
    if name == "prefix-lm":
        prefix = s // 4

        def prefix_lm():
            def mask_mod(b, h, q_idx, kv_idx):
                return (kv_idx <= q_idx) | (kv_idx < prefix)
            return None, mask_mod
        return Example(name, prefix_lm, [], causal=False)
    if name in ("document", "document-causal"):
        doc = document_ids(s, device=device)

        def document():
            def mask_mod(b, h, q_idx, kv_idx):
                return doc[q_idx] == doc[kv_idx]
            return None, mask_mod
        return Example(name, document, [], causal=name == "document-causal")
    if name == "window-causal":
        w = s // 8

        def window():
            def mask_mod(b, h, q_idx, kv_idx):
                return q_idx - kv_idx <= w
            return None, mask_mod
        return Example(name, window, [], causal=True, builtin=dict(window=(w, 0)))
    if name == "sinks":
        sinks = torch.randn(h, generator=g).to(device).requires_grad_(requires_grad)
        return Example(name, lambda: (None, None), [], causal=True, window=(s // 16, 0), sinks=sinks, builtin={})
    raise ValueError(f"unknown example {name!r}; known: {', '.join(NAMES)}")

"""Reference attention with flashgen's conventions, in any precision (float64 for the
exactness checks, the input dtype for the error baseline).

Explicit formulas, forward and backward (FlashAttention-2, Dao 2023, Section 2.2 and
Appendix B.2): S = scale·QK^T, masked entries -inf, LSE = logsumexp(S) per row (natural
log; -inf for a row that sees no key), P = exp(S - LSE) (0 on such rows), O = PV,
delta = rowsum(dO∘O), dS = P∘(dO V^T - delta), dQ = scale·dS K, dK = scale·dS^T Q,
dV = P^T dO; with GQA, dK and dV are summed over each group of query heads.

Score modifications (:data:`flashgen.spec.MODS`), applied to S before the mask:
softcap S <- c·tanh(S/c) (its backward multiplies dS by 1 - tanh²), ALiBi S <- S -
slope·|i + seqlen_k - seqlen_q - j|, an additive bias; dropout multiplies P by
keep/(1 - p) on the way to O and dP by the same on the way back (delta = rowsum(dO∘O)
is unchanged: FlashAttention-2, Appendix B).
"""

from __future__ import annotations

import torch

from .masks import mask_bounds


def _visible(seqlen_q, seqlen_k, lo, hi, device):
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    return ((j - i) >= lo) & ((j - i) <= hi)


def _expand_kv(x, group):
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def _scale_and_bounds(q, k, causal, window, softmax_scale, align):
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    _, lo, hi = mask_bounds(q.shape[2], k.shape[2], causal=causal, window=window, align=align)
    return scale, lo, hi


#: The bound the kernels clamp bias scores (and user score functions that may leave the
#: float32 range, :attr:`flashgen.user_mods.Traced.guard`) to: |s| log2(e) overflows
#: float32 above 2.36e38.
SCORE_CLAMP = 2.3e38


def clamp_scores(s: torch.Tensor) -> torch.Tensor:
    """Scores as the kernels take them: finite in base 2 (clamped to +-SCORE_CLAMP, or to
    the dtype's largest finite value below that: +inf is a very high score), -inf kept (a
    masked key), NaN kept."""
    lim = min(SCORE_CLAMP, torch.finfo(s.dtype).max)
    return torch.where(s == float("-inf"), s, s.clamp(-lim, lim))


def softmax_rows(s: torch.Tensor, vis: torch.Tensor, sink: torch.Tensor | None = None):
    """(P, LSE) of the scores ``s`` (..., seqlen_k) over their last axis, keys where
    ``vis`` is False hidden; ``sink``: one more logit per row, shape (..., 1), that joins
    the denominator and LSE and weighs no key.  Normalized through the row's maximum, so
    that P sums to 1 at any magnitude (exp(s - LSE) does not: at |LSE| near 1e38, LSE
    has lost log(seqlen_k) to rounding); a row with no visible key and no sink gives
    P = 0 and LSE = -inf.  Differentiable in ``s`` and ``sink`` (the maximum is a
    constant of the gradient, as it cancels)."""
    s = s.masked_fill(~vis, float("-inf"))
    neg = torch.full((*s.shape[:-1], 1), float("-inf"), dtype=s.dtype, device=s.device)
    m = s.amax(-1, keepdim=True) if s.shape[-1] else neg
    if sink is not None:
        m = torch.maximum(m, sink)
    m = m.detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.where(vis, torch.exp(s - m), torch.zeros_like(s))
    den = e.sum(-1, keepdim=True)
    if sink is not None:
        den = den + torch.exp(sink - m)
    seen = den != 0  # a NaN row stays NaN (not "no key")
    den = torch.where(seen, den, torch.ones_like(den))
    p = e / den
    lse = torch.where(seen, m + torch.log(den), neg)
    return p, lse.squeeze(-1)


def _modded_scores(q, k, scale, softcap, alibi, bias, dtype):
    """S = scale·QK^T with the score mods, and tanh(S/softcap) (None without softcap)."""
    s = (q @ k.transpose(-1, -2)) * scale
    tc = None
    if softcap:
        tc = torch.tanh(s / softcap)
        s = softcap * tc
    sq, sk = q.shape[2], k.shape[2]
    if alibi is not None:
        a = alibi.to(dtype)
        a = a[None, :] if a.dim() == 1 else a  # (batch or 1, heads)
        i = torch.arange(sq, device=q.device, dtype=dtype)[:, None]
        j = torch.arange(sk, device=q.device, dtype=dtype)[None, :]
        s = s - a[:, :, None, None] * (i + (sk - sq) - j).abs()
    if bias is not None:
        s = clamp_scores(s + bias.to(dtype))  # as the kernels with a bias
    return s, tc


def forward_bounds(q, k, v, scale, lo, hi, dtype=torch.float64, *, softcap=0.0, alibi=None, bias=None,
                   keep=None, dropout_p=0.0):
    """(O, LSE, P) in ``dtype`` for the mask "query i sees key j iff lo <= j - i <= hi"
    (:func:`flashgen.masks.mask_bounds`); LSE is -inf and O, P are 0 on rows that see no
    key.  Score mods as in the module docstring: ``softcap`` (0: off), ``alibi`` slopes
    (heads,) or (batch, heads), ``bias`` broadcastable to (batch, heads, seqlen_q,
    seqlen_k), ``keep`` the boolean dropout mask (batch, heads, seqlen_q, seqlen_k) with
    ``dropout_p``.  P is the undropped probabilities."""
    group = q.shape[1] // k.shape[1]
    q, k, v = (t.to(dtype) for t in (q, k, v))
    k, v = _expand_kv(k, group), _expand_kv(v, group)
    s, _ = _modded_scores(q, k, scale, softcap, alibi, bias, dtype)
    vis = _visible(q.shape[2], k.shape[2], lo, hi, q.device) & (s != float("-inf"))
    p, lse = softmax_rows(s, vis)
    return _dropped(p, keep, dropout_p) @ v, lse, p


def _dropped(x, keep, dropout_p):
    return x if keep is None else torch.where(keep, x / (1.0 - dropout_p), torch.zeros_like(x))


def backward_bounds(do, q, k, v, scale, lo, hi, dtype=torch.float64, *, softcap=0.0, alibi=None, bias=None,
                    keep=None, dropout_p=0.0):
    """(dQ, dK, dV) in ``dtype`` for the same mask and mods as :func:`forward_bounds`."""
    group = q.shape[1] // k.shape[1]
    mods = dict(softcap=softcap, alibi=alibi, bias=bias, keep=keep, dropout_p=dropout_p)
    o, _, p = forward_bounds(q, k, v, scale, lo, hi, dtype, **mods)
    q, k, v, do = (t.to(dtype) for t in (q, k, v, do))
    ke, ve = _expand_kv(k, group), _expand_kv(v, group)
    dv = _dropped(p, keep, dropout_p).transpose(-1, -2) @ do
    dp = _dropped(do @ ve.transpose(-1, -2), keep, dropout_p)
    delta = (do * o).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    if softcap:
        _, tc = _modded_scores(q, ke, scale, softcap, None, None, dtype)
        ds = ds * (1 - tc * tc)
    dq = (ds @ ke) * scale
    dk = (ds.transpose(-1, -2) @ q) * scale
    if group > 1:
        b, hk = k.shape[0], k.shape[1]
        dk = dk.reshape(b, hk, group, *dk.shape[2:]).sum(2)
        dv = dv.reshape(b, hk, group, *dv.shape[2:]).sum(2)
    return dq, dk, dv


def forward(q, k, v, *, causal=False, window=(-1, -1), softmax_scale=None, align="bottom_right",
            dtype=torch.float64, **mods):
    """(O, LSE, P): O in ``dtype``, LSE float in ``dtype`` (natural log), P the
    probabilities (kept for the backward).  ``mods``: as in :func:`forward_bounds`."""
    scale, lo, hi = _scale_and_bounds(q, k, causal, window, softmax_scale, align)
    return forward_bounds(q, k, v, scale, lo, hi, dtype, **mods)


def backward(do, q, k, v, *, causal=False, window=(-1, -1), softmax_scale=None, align="bottom_right",
             dtype=torch.float64, **mods):
    """(dQ, dK, dV) in ``dtype``."""
    scale, lo, hi = _scale_and_bounds(q, k, causal, window, softmax_scale, align)
    return backward_bounds(do, q, k, v, scale, lo, hi, dtype, **mods)


def max_error(got, ref) -> float:
    """max |got - ref| over the finite entries of ``ref``; inf when the non-finite
    entries differ (a NaN where ref is finite, or -inf where ref is not, fails)."""
    got, ref = got.double(), ref.double()
    fin = torch.isfinite(ref)
    if not torch.equal(torch.isfinite(got), fin) or not torch.equal(got[~fin], ref[~fin]):
        return float("inf")
    return (got[fin] - ref[fin]).abs().max().item() if fin.any() else 0.0


def decode_forward(q, k_cache, v_cache, cache_seqlens, block_table=None, *, causal=False, softmax_scale=None,
                   dtype=torch.float64):
    """(O, LSE) of decode attention over a KV cache with
    :func:`flashgen.attention_with_kvcache`'s conventions, in ``dtype``.

    q (batch, seqlen_q, heads, d); the cache (batch, seqlen_cache, kv_heads, d|dv), or
    paged (num_pages, page_size, kv_heads, d|dv) with ``block_table`` (batch, max_pages):
    key j of batch b is row j % page_size of page block_table[b, j // page_size].  Batch
    b sees keys j < cache_seqlens[b]; causal is bottom-right (j <= i + L - seqlen_q).
    O is (batch, seqlen_q, heads, dv), LSE (batch, heads, seqlen_q), -inf (O = 0) for a
    row that sees no key."""
    b, sq, h, _ = q.shape
    dv = v_cache.shape[-1]
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    o = torch.zeros((b, sq, h, dv), dtype=dtype, device=q.device)
    lse = torch.full((b, h, sq), float("-inf"), dtype=dtype, device=q.device)
    lens = cache_seqlens.tolist()
    for z in range(b):
        n = int(lens[z])
        if block_table is None:
            k, v = k_cache[z, :n], v_cache[z, :n]
        else:
            ps = k_cache.shape[1]
            pages = block_table[z, :-(-n // ps)].long()
            k = k_cache[pages].reshape(-1, *k_cache.shape[2:])[:n]
            v = v_cache[pages].reshape(-1, *v_cache.shape[2:])[:n]
        _, lo, hi = mask_bounds(sq, n, causal=causal, window=(-1, -1))
        oz, lz, _ = forward_bounds(q[z:z + 1].transpose(1, 2), k[None].transpose(1, 2), v[None].transpose(1, 2),
                                   scale, lo, hi, dtype)
        o[z] = oz[0].transpose(0, 1)
        lse[z] = lz[0]
    return o, lse

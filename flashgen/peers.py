"""The implementations flashgen is measured against, each as ``fn(q, k, v) -> o``.

- :func:`naive_attention`: standard attention in three kernels of plain torch ops:
  S = (scale·Q) K^T written to memory, P = softmax(S) written, O = P V (a mask adds an
  in-place pass over S).  Its backward is torch autograd's.
- :class:`MaterializedP`: the same forward, saving P (batch, heads, seqlen_q, seqlen_k)
  for an explicit backward (dV = P^T dO, dP = dO V^T, dS = P∘(dP − rowsum(dO∘O)),
  dQ = scale·dS K, dK = scale·dS^T Q): the backward FlashAttention avoids by
  recomputing P from the LSE.
- :func:`sdpa`: ``torch.nn.functional.scaled_dot_product_attention`` restricted to one
  backend (flash, cuDNN, efficient, math).
- :func:`flex`: ``torch.nn.attention.flex_attention`` compiled with ``torch.compile``,
  masks as a block mask.

All follow flashgen's mask conventions (:mod:`flashgen.masks`: causal is bottom-right
aligned; ``window=(left, right)``).  :class:`Unsupported` says a backend cannot serve
a problem, before anything runs.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from .masks import mask_bounds


class Unsupported(Exception):
    """This backend cannot serve this problem (the message says why)."""


def visible(seqlen_q: int, seqlen_k: int, *, causal: bool, window, device) -> torch.Tensor | None:
    """Boolean (seqlen_q, seqlen_k) mask of the visible pairs, or None when every pair is."""
    mode, lo, hi = mask_bounds(seqlen_q, seqlen_k, causal=causal, window=window)
    if mode == "none":
        return None
    rel = torch.arange(seqlen_k, device=device)[None, :] - torch.arange(seqlen_q, device=device)[:, None]
    return (rel >= lo) & (rel <= hi)


def _expand(x: torch.Tensor, group: int) -> torch.Tensor:
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def _scale(q, softmax_scale):
    return q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale


def _scores(q, k, vis, scale):
    """S = (scale·Q) K^T with masked entries -inf (in place)."""
    s = torch.matmul(q * scale, k.transpose(-1, -2))
    if vis is not None:
        s.masked_fill_(~vis, float("-inf"))
    return s


def naive_attention(q, k, v, *, causal: bool = False, window=(-1, -1), softmax_scale=None):
    """Standard attention through memory: S, then P = softmax(S), then O = P V.  A row
    that sees no key gives NaN (softmax of all -inf), unlike flashgen's 0."""
    group = q.shape[1] // k.shape[1]
    k, v = _expand(k, group), _expand(v, group)
    vis = visible(q.shape[2], k.shape[2], causal=causal, window=window, device=q.device)
    s = _scores(q, k, vis, _scale(q, softmax_scale))
    p = torch.softmax(s, dim=-1)
    del s
    return torch.matmul(p, v)


class MaterializedP(torch.autograd.Function):
    """Attention whose forward stores P and whose backward reads it (no recomputation).

    forward(q, k, v, scale, causal, window) -> O.  Saved: P (batch, heads, seqlen_q,
    seqlen_k) in q's dtype, Q, K, V, O.  backward: dV = P^T dO; dP = dO V^T;
    delta = rowsum(dO∘O) (at least float32); dS = P∘(dP − delta), in dP's buffer;
    dQ = scale·dS K; dK = scale·dS^T Q; with GQA dK and dV summed over each group."""

    @staticmethod
    def forward(ctx, q, k, v, scale, causal, window):
        group = q.shape[1] // k.shape[1]
        ke, ve = _expand(k, group), _expand(v, group)
        vis = visible(q.shape[2], k.shape[2], causal=causal, window=window, device=q.device)
        s = _scores(q, ke, vis, scale)
        p = torch.softmax(s, dim=-1)
        del s
        o = torch.matmul(p, ve)
        ctx.save_for_backward(p, q, k, v, o)
        ctx.scale = scale
        return o

    @staticmethod
    def backward(ctx, do):
        p, q, k, v, o = ctx.saved_tensors
        scale = ctx.scale
        group = q.shape[1] // k.shape[1]
        ke, ve = _expand(k, group), _expand(v, group)
        dv = torch.matmul(p.transpose(-1, -2), do)
        dp = torch.matmul(do, ve.transpose(-1, -2))
        acc = torch.promote_types(do.dtype, torch.float32)  # float32 accumulation at least
        delta = (do.to(acc) * o.to(acc)).sum(-1, keepdim=True)
        ds = dp.sub_(delta.to(dp.dtype)).mul_(p)
        del dp
        dq = torch.matmul(ds, ke).mul_(scale)
        dk = torch.matmul(ds.transpose(-1, -2), q).mul_(scale)
        if group > 1:
            b, hk = k.shape[0], k.shape[1]
            dk = dk.reshape(b, hk, group, *dk.shape[2:]).sum(2)
            dv = dv.reshape(b, hk, group, *dv.shape[2:]).sum(2)
        return dq, dk, dv, None, None, None


def materialized_p_attention(q, k, v, *, causal: bool = False, window=(-1, -1), softmax_scale=None):
    return MaterializedP.apply(q, k, v, _scale(q, softmax_scale), causal, tuple(window))


# ---------------------------------------------------------------------------------
# torch SDPA

SDPA_BACKENDS = {"sdpa-flash": "FLASH_ATTENTION", "sdpa-cudnn": "CUDNN_ATTENTION",
                 "sdpa-efficient": "EFFICIENT_ATTENTION", "sdpa-math": "MATH"}


def sdpa(name: str, q, k, *, causal: bool = False, window=(-1, -1), softmax_scale=None, attn_mask=None,
         dropout_p: float = 0.0):
    """``fn(q, k, v)`` running SDPA restricted to backend ``name`` (a key of
    SDPA_BACKENDS) with flashgen's mask: is_causal where top-left and bottom-right
    alignment agree (seqlen_q == seqlen_k), ``causal_lower_right`` otherwise, a boolean
    attn_mask for windows.  An explicit ``attn_mask`` replaces the mask (the caller
    folds causal or a window into it); ``dropout_p`` is passed on.  A backend that
    refuses raises RuntimeError carrying torch's reasons (its warnings)."""
    sq, sk = q.shape[2], k.shape[2]
    mode, _, _ = mask_bounds(sq, sk, causal=causal, window=window)
    kw = dict(scale=_scale(q, softmax_scale))
    if dropout_p:
        kw["dropout_p"] = dropout_p
    if q.shape[1] != k.shape[1]:
        kw["enable_gqa"] = True
    if attn_mask is not None:
        kw["attn_mask"] = attn_mask
    elif mode == "causal" and sq == sk:
        kw["is_causal"] = True
    elif mode == "causal":
        from torch.nn.attention.bias import causal_lower_right

        kw["attn_mask"] = causal_lower_right(sq, sk)
    elif mode == "window":
        kw["attn_mask"] = visible(sq, sk, causal=causal, window=window, device=q.device)

    def fn(q, k, v):
        return run_sdpa(name, q, k, v, **kw)
    return fn


def _sdpa_reason(error: str, warned: list[str]) -> str:
    """SDPA's refusal in one line: its error and the reasons it gave as warnings, without
    the "(Triggered internally at ...)" source locations."""
    import re

    reasons = []
    for w in warned:
        w = re.sub(r"\s*\(Triggered internally at [^)]*\)\.?", "", w).strip().rstrip(".")
        w = re.sub(r"\s+", " ", w)
        if w and not w.endswith("because:"):
            reasons.append(w)
    first = error.splitlines()[0] if error else "RuntimeError"
    if first.startswith(("No available kernel", "No viable backend")):
        first = "no kernel"
    return "; ".join(dict.fromkeys([first, *reasons]))


# ---------------------------------------------------------------------------------
# FlexAttention

_flex_compiled = None
#: The bounds of FlexAttention's mask, read by :func:`_band_mask` (module-level tensors:
#: the compiled graph takes them as inputs, so one compiled graph serves every mask).
_flex_bounds: dict = {}


def _compiled_flex():
    global _flex_compiled
    if _flex_compiled is None:
        import torch._dynamo
        import torch._functorch.config
        from torch.nn.attention.flex_attention import flex_attention

        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        # the benchmark runs a backward with retain_graph=True (timing the backward alone),
        # which donated buffers forbid
        torch._functorch.config.donated_buffer = False
        # dynamic sizes: one compile per head_dim and mask kind, not one per seqlen
        _flex_compiled = torch.compile(flex_attention, dynamic=True)
    return _flex_compiled


def _band_mask(b, h, q_idx, kv_idx):
    lo, hi = _flex_bounds["lo"], _flex_bounds["hi"]
    rel = kv_idx - q_idx
    return (rel >= lo) & (rel <= hi)


def flex(q, k, *, causal: bool = False, window=(-1, -1), softmax_scale=None):
    """``fn(q, k, v)`` running compiled FlexAttention with a block mask built once here
    (fully masked blocks skipped, full blocks unmasked).  The mask bounds live
    in module-level tensors, so fns made by earlier calls must not be used after a
    later call with another mask."""
    from torch.nn.attention.flex_attention import create_block_mask

    sq, sk = q.shape[2], k.shape[2]
    _, lo, hi = mask_bounds(sq, sk, causal=causal, window=window)
    for name, val in (("lo", lo), ("hi", hi)):
        t = _flex_bounds.get(name)
        if t is None or t.device != q.device:
            _flex_bounds[name] = torch.tensor(val, device=q.device, dtype=torch.int32)
        else:
            t.fill_(val)
    # Without a mask every block is full, which is what flex_attention does for
    # block_mask=None (full blocks never call the mask): one compiled graph for all masks.
    block_mask = create_block_mask(_band_mask, B=None, H=None, Q_LEN=sq, KV_LEN=sk, device=q.device)
    kw = dict(block_mask=block_mask, scale=_scale(q, softmax_scale), enable_gqa=q.shape[1] != k.shape[1])
    compiled = _compiled_flex()

    def fn(q, k, v):
        return compiled(q, k, v, **kw)
    return fn


# ---------------------------------------------------------------------------------
# Memory of the implementations that hold seqlen_q x seqlen_k matrices

def matrix_bytes(name: str, batch: int, num_heads: int, seqlen_q: int, seqlen_k: int,
                 dtype_bytes: int) -> int | None:
    """Estimated peak bytes of the (batch, heads, seqlen_q, seqlen_k) matrices one
    forward+backward of backend ``name`` holds, or None for backends that hold none.

    naive: up to four at once in the input dtype (P saved; dP, dS and the masked copy
    of dS in the backward).  sdpa-math: the same four in float32 (torch upcasts half
    inputs in its math path)."""
    nn = batch * num_heads * seqlen_q * seqlen_k
    if name == "naive":
        return 4 * nn * dtype_bytes
    if name == "sdpa-math":
        return 4 * nn * max(4, dtype_bytes)
    return None


# ---------------------------------------------------------------------------------
# Packed documents (ragged batches): FlexAttention with a document mask, SDPA padded

#: What :func:`_document_mask` reads: "doc" (total,) int32 document id of each packed
#: token, "noncausal" a 0-dim bool (module-level tensors: one compiled graph serves
#: every document layout and both masks).
_flex_docs: dict = {}


def _document_mask(b, h, q_idx, kv_idx):
    doc = _flex_docs["doc"]
    return (doc[q_idx] == doc[kv_idx]) & ((q_idx >= kv_idx) | _flex_docs["noncausal"])


def flex_document(q, k, doc_ids: torch.Tensor, *, causal: bool = False, softmax_scale=None,
                  compiled: bool = True):
    """``fn(q, k, v)`` running FlexAttention on packed documents as one batch-1 sequence:
    q (1, heads, total, d), k and v (1, kv_heads, total, d), ``doc_ids`` (total,) the
    document of each token, the same on both sides (self-attention: sequence z has
    seqlen_q == seqlen_k, so causal within a document, q_idx >= kv_idx, is flashgen's
    bottom-right causal).  Query and key attend iff same document (and causal).

    The block mask is built here, once (fully masked blocks skipped, full blocks
    unmasked); ``compiled=False`` runs flex_attention eagerly (its unfused path, for
    the CPU).  Like :func:`flex`, fns from earlier calls must not be used after a
    later call: the mask reads module-level tensors."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    total = q.shape[2]
    if k.shape[2] != total or doc_ids.shape != (total,):
        raise Unsupported(f"flex_document: needs one packing for q and k: q {total} tokens, k {k.shape[2]}, "
                          f"doc_ids {tuple(doc_ids.shape)}")
    doc = doc_ids.to(device=q.device, dtype=torch.int32)
    old = _flex_docs.get("doc")
    if old is not None and old.shape == doc.shape and old.device == doc.device:
        old.copy_(doc)
    else:
        _flex_docs["doc"] = doc
    _flex_docs["noncausal"] = torch.tensor(not causal, device=q.device)
    block_mask = create_block_mask(_document_mask, B=None, H=None, Q_LEN=total, KV_LEN=total, device=q.device)
    kw = dict(block_mask=block_mask, scale=_scale(q, softmax_scale), enable_gqa=q.shape[1] != k.shape[1])
    attn = _compiled_flex() if compiled else flex_attention

    def fn(q, k, v):
        return attn(q, k, v, **kw)
    return fn


def run_sdpa(name: str, q, k, v, **kw):
    """``F.scaled_dot_product_attention(q, k, v, **kw)`` restricted to backend ``name`` (a
    key of SDPA_BACKENDS); a refusal raises RuntimeError carrying torch's reasons (its
    warnings), as in :func:`sdpa`."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with warnings.catch_warnings(record=True) as caught, sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[name])):
        warnings.simplefilter("always")
        try:
            return F.scaled_dot_product_attention(q, k, v, **kw)
        except RuntimeError as e:
            raise RuntimeError(_sdpa_reason(str(e), [str(w.message) for w in caught])) from None


def sdpa_padded(name: str, q, k, seq_lens, *, causal: bool = False, softmax_scale=None, key_mask: bool = True):
    """``fn(q, k, v)`` running SDPA restricted to backend ``name`` on a right-padded
    batch: q, k, v (batch, heads, max_len, d), sequence b holding ``seq_lens[b]`` real
    tokens (the same on both sides).  Causal: ``is_causal`` (top-left, which on the real
    rows of a right-padded self-attention batch is exact: a real query sees no padded
    key).  Not causal: a boolean key-padding ``attn_mask`` (batch, 1, 1, max_len) when
    ``key_mask``; without it padded keys are attended (not the same result: timing of
    the padded work only).  A backend that refuses raises RuntimeError with torch's
    reasons, as :func:`sdpa`."""
    kw = dict(scale=_scale(q, softmax_scale), enable_gqa=q.shape[1] != k.shape[1])
    if causal:
        kw["is_causal"] = True
    elif key_mask:
        lens = torch.as_tensor(seq_lens, device=q.device)
        kw["attn_mask"] = (torch.arange(k.shape[2], device=q.device)[None, :] < lens[:, None])[:, None, None, :]

    def fn(q, k, v):
        return run_sdpa(name, q, k, v, **kw)
    return fn

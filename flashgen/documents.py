"""Packed documents in a mask: recognizing a bool mask that is exactly block-diagonal
(each batch entry's tokens form consecutive documents, each query sees only keys of its
own document), so that the call runs as one ragged batch (:func:`flashgen.attention_varlen`)
instead of reading the mask over whole entries.  Transformers builds such masks for
padding-free packing (``position_ids`` restarting at each document), and packed-dataset
training code (block-causal masks) hands them to ``scaled_dot_product_attention``.
"""

from __future__ import annotations

import weakref

import torch

from . import dispatch

class MaskMemo:
    """Results read from masks' values, kept per (mask object, what was asked) while the
    mask's version is unchanged: the layers of a forward that share a mask read it
    once.  Masks are held weakly; the newest ``size`` entries are kept (a model's
    forward has one mask per layer type live).  An inference tensor has no version
    counter: its results are not kept."""

    def __init__(self, size: int = 8):
        self.entries: dict = {}  # (id(mask), asked) -> (weak reference to the mask, its version, result)
        self.size = size

    def get(self, mask: torch.Tensor, asked):
        """(True, the result) when one is kept for ``mask`` and ``asked``, else (False, None)."""
        hit = self.entries.get((id(mask), asked))
        if hit is not None and hit[0]() is mask and not mask.is_inference() and hit[1] == mask._version:
            return True, hit[2]
        return False, None

    def put(self, mask: torch.Tensor, asked, result) -> None:
        if mask.is_inference():
            return
        self.entries[(id(mask), asked)] = (weakref.ref(mask), mask._version, result)
        while len(self.entries) > self.size:
            self.entries.pop(next(iter(self.entries)))


#: The documents of recent masks (:func:`find`), per mask and pattern asked (sdpa asks
#: causal, then bidirectional).
_memo = MaskMemo()

#: Mask elements compared per step by :func:`find` (bounds its temporaries: a block of
#: query rows at a time, the comparisons accumulated on the device and read once).
ELEMENTS = 1 << 26


def readable(mask, query, key) -> bool:
    """Whether :func:`find` should read ``mask``: a plain bool (batch or 1, 1, seqlen,
    seqlen) tensor with values (not meta or fake) for a square, non-empty problem of
    ``query`` (batch, heads, seqlen, head_dim) and ``key``, outside torch.compile's
    tracing and CUDA graph capture (reading values synchronizes).  Not an inference
    tensor: it has no version counter for the memo (the caller then reads the mask as
    a bias, exact)."""
    if torch.compiler.is_compiling():  # first: tracing cannot ask is_inference()
        return False
    if type(mask) is not torch.Tensor or mask.dtype != torch.bool or mask.dim() != 4:
        return False  # a subclass (fake, functional) holds no values to read
    n = query.shape[2]
    return (mask.shape[1] == 1 and mask.shape[0] in (1, query.shape[0]) and key.shape[2] == n
            and mask.shape[2] == mask.shape[3] == n and query.numel() > 0 and not mask.is_meta
            and not mask.is_inference() and not dispatch.graph_capturing())


def find(mask: torch.Tensor, batch: int, seqlen: int, causal: bool, window_left: int | None, source=None):
    """The packed sequences of ``mask``, when it is exactly block-diagonal: each
    batch entry's tokens form consecutive documents, and query i sees exactly the keys
    of its own document (those up to i when ``causal``; with ``window_left`` also at
    most that many before i).

    Args:
        mask: bool (batch or 1, 1, seqlen, seqlen), True = attend.
        batch: the inputs' batch size.
        seqlen: the query and key length.
        causal, window_left: the pattern within a document (``window_left``: None or
            an int >= 0, with ``causal`` only).
        source: the tensor ``mask`` views, when it is a view made for this call (a
            reshape of the caller's mask): the memo follows its identity and version.

    Returns:
        None when the mask is any other pattern (a padded row sees not even itself,
        so padding masks are None).  Else (cu_seqlens, max_seqlen, doc): cu_seqlens
        int32 of shape (documents + 1,) on the mask's device, the documents' starts in
        the batch's tokens flattened entry after entry (a mask broadcast over the batch
        gives each entry the same documents), ending at batch * seqlen; max_seqlen the
        longest document (a host int); doc (batch or 1, seqlen) int64, each token's
        document number within its entry (the mask's own entries).

    Reads the mask's values (one pass; up to four host synchronizations: the
    diagonal, the comparison, the starts and the longest), once per mask object and
    version (memoized; the layers that share a mask share the result).
    """
    src = mask if source is None else source
    bounds = (batch, seqlen, causal, window_left)
    found, out = _memo.get(src, bounds)
    if found:
        return out
    out = None
    m = mask[:, 0]
    entries = m.shape[0]
    diag = m.diagonal(dim1=-2, dim2=-1)
    # A document starts where a token does not see the one before it (window_left 0
    # would see no neighbour: every token is its own document then, as the pattern).
    starts = torch.ones(entries, seqlen, dtype=torch.bool, device=mask.device)
    if seqlen > 1:
        starts[:, 1:] = ~m.diagonal(offset=-1, dim1=-2, dim2=-1)
    if bool(diag.all()):
        doc = starts.cumsum(-1)
        cols = torch.arange(seqlen, device=mask.device)
        step = max(1, ELEMENTS // (entries * seqlen))
        differs = torch.zeros((), dtype=torch.bool, device=mask.device)
        for r0 in range(0, seqlen, step):
            r1 = min(seqlen, r0 + step)
            want = doc[:, r0:r1, None] == doc[:, None, :]
            rows = cols[r0:r1, None]
            if causal:
                want &= (cols[None, :] <= rows)[None]
            if window_left is not None:
                want &= (cols[None, :] >= rows - window_left)[None]
            differs |= (m[:, r0:r1] != want).any()
        if not bool(differs):
            if entries != batch:  # one mask for every entry: the same documents in each
                starts = starts.expand(batch, seqlen)
            first = starts.reshape(-1).nonzero().reshape(-1)
            ends = torch.cat([first[1:], first.new_tensor([batch * seqlen])])
            cu = torch.cat([first, first.new_tensor([batch * seqlen])]).to(torch.int32)
            out = (cu, int((ends - first).max()), doc)
    _memo.put(src, bounds, out)
    return out

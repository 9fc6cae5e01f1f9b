"""Mask conventions, turned into the kernels' two bounds on j - i.

FlashAttention >= 2.1 (bottom-right) alignment, with off = seqlen_k - seqlen_q:

    causal:           query i sees key j  iff  j <= i + off
    window=(l, r):    query i sees key j  iff  i + off - l <= j <= i + off + r
                      (inclusive; -1 means unbounded on that side)
    causal + window:  the window with r = 0

    seqlen_q = 3, seqlen_k = 5, causal (off = 2):     window=(1, 0), off = 2:
        j: 0 1 2 3 4                                       j: 0 1 2 3 4
    i=0    x x x . .                                   i=0    . x x . .
    i=1    x x x x .                                   i=1    . . x x .
    i=2    x x x x x                                   i=2    . . . x x

torch SDPA's ``is_causal`` is aligned top-left instead (off = 0: j <= i).  When
seqlen_q > seqlen_k with bottom-right causal, the first seqlen_q - seqlen_k queries see
no key: their output is 0 and their LSE is -inf.
"""

from __future__ import annotations

import numbers

from .errors import InputError


def decode_mask(causal: bool, seqlen_q: int) -> str:
    """The decode kernels' mask mode for ``seqlen_q`` new queries at the end of the cache:
    "causal" (bottom-right) when causal with more than one query, else "none" (a single
    last query sees every key either way)."""
    return "causal" if causal and seqlen_q > 1 else "none"


def mask_bounds(seqlen_q: int, seqlen_k: int, *, causal: bool, window: tuple[int, int],
                align: str = "bottom_right") -> tuple[str, int, int]:
    """(mask mode, diag_lo, diag_hi): query i sees key j iff diag_lo <= j - i <= diag_hi.

    Unbounded sides are given as -seqlen_q (lo) and seqlen_k (hi), which every pair
    satisfies; a window side wider than that (e.g. ``sys.maxsize``) is given the same
    bound, so the bounds fit the kernels' integers and the visible pairs are the same.
    Raises InputError for a malformed window or alignment.
    """
    if align not in ("bottom_right", "top_left"):
        raise InputError(f"align must be 'bottom_right' or 'top_left', got {align!r}")
    if (not isinstance(window, (tuple, list)) or len(window) != 2
            or not all(isinstance(w, numbers.Integral) and not isinstance(w, bool) for w in window)):
        raise InputError(f"window must be a pair of ints (left, right), got {window!r}")
    left, right = int(window[0]), int(window[1])
    if left < -1 or right < -1:
        raise InputError(f"window values must be >= 0, or -1 for unbounded; got {window!r}")
    off = seqlen_k - seqlen_q if align == "bottom_right" else 0
    if causal:
        right = 0
    hi = min(off + right, seqlen_k) if right >= 0 else seqlen_k
    lo = max(off - left, -seqlen_q) if left >= 0 else -seqlen_q
    if left >= 0:
        mode = "window"
    elif right >= 0:
        mode = "causal"
    else:
        mode = "none"
    return mode, lo, hi

"""The built-in score modifications softcap and ALiBi (``flashgen.attention``'s
``softcap=`` and ``alibi_slopes=``) in the Gluon family, as fixed score functions.

Each served set of modifications (:data:`SERVED`) is one score function written once
here and lowered by :mod:`flashgen.user_mods` exactly as a user's ``score_mod`` is, so
the Gluon forward (:mod:`.user`) and whole backward (:mod:`.user_bwd`) compile it with
their user-function code.  The runtime values ride in captured tensors, never in the
code, so one compiled variant serves every softcap value, every set of slopes and every
seqlen_k - seqlen_q:

* ``cap``, ``inv``: float32 0-d, softcap and 1 / softcap;
* ``slopes``: float32 (batch, num_heads), the call's (num_heads,) slopes as a view with
  batch stride 0;
* ``off``: float32 0-d, seqlen_k - seqlen_q (FlashAttention-2's bottom-right ALiBi).

On s = softmax_scale * q.k (natural units), for query row i and key column j, in the
order of :func:`flashgen.attention`'s docstring (softcap, then ALiBi):

    softcap:  s <- cap * tanh(s * inv)
    alibi:    s <- s - slopes[b, h] * |float(i - j) + off|   (= |i + seqlen_k - seqlen_q - j|)

the Triton family's template computes the same expressions (``templates/_common.j2``,
``score_mods``; tanh by the same formula, :mod:`flashgen.user_render`); differences are
float32 rounding (s * inv against s * (1 / softcap) rounded in the kernel, i - j
converted before the offset is added, exact below 2^24).  No gradient flows to the
slopes or the softcap (as the built-in's).

The tracing and lowering are :mod:`flashgen.user_mods`'s, which sits above the families
(it calls the library): it hands them to this module when imported (:func:`install`;
``import flashgen`` imports it), so this module imports nothing above the families.

The per-(batch, head) values are loaded once per program and head (the user code's
setup), not per tile.  ``cap``, ``inv`` and ``off`` come from one float32 (3,) tensor
per (softcap, offset, device, stream), filled on the device and kept (:data:`_PARAMS_MAX` of
them, the oldest dropped first); inside a CUDA-graph capture a new one of the capture's
own memory, filled by the captured stream, so a graph never reads a kept tensor that a
later eviction frees.
"""

from __future__ import annotations

import collections
import functools

import torch

from ...spec import WHOLE_BWD_MODS as SERVED

# The tensors the score functions capture when traced: placeholders whose dtype and rank
# the lowering records (their values never reach the code).
_CAP = torch.tensor(1.0)
_INV = torch.tensor(1.0)
_OFF = torch.tensor(0.0)
_SLOPES = torch.zeros(1, 1)


def _softcap(score, b, h, q_idx, kv_idx):
    return _CAP * torch.tanh(score * _INV)


def _alibi(score, b, h, q_idx, kv_idx):
    return score - _SLOPES[b, h] * torch.abs((q_idx - kv_idx).float() + _OFF)


def _softcap_alibi(score, b, h, q_idx, kv_idx):
    return _CAP * torch.tanh(score * _INV) - _SLOPES[b, h] * torch.abs((q_idx - kv_idx).float() + _OFF)


_FUNCTIONS = {"softcap": _softcap, "alibi": _alibi, "softcap_alibi": _softcap_alibi}
# the Triton family's built-in kernels compute these unclamped, and so do these: a slope
# or cap read from a captured tensor is not a bias (user_mods.Traced.guard)
for _fn in _FUNCTIONS.values():
    _fn.flashgen_unclamped = True

#: :mod:`flashgen.user_mods`'s ``trace``, ``lowering`` and ``UserArgs`` (:func:`install`).
_SERVICES: dict = {}


def install(**services) -> None:
    """Called by :mod:`flashgen.user_mods` when imported: its ``trace``, ``lowering`` and
    ``UserArgs``."""
    _SERVICES.update(services)


def _service(name: str):
    if name not in _SERVICES:
        raise RuntimeError("flashgen.user_mods is not imported (import flashgen does it): the Gluon family's "
                           "softcap and ALiBi are lowered by it")
    return _SERVICES[name]
_ROLES = {id(_CAP): "cap", id(_INV): "inv", id(_OFF): "off", id(_SLOPES): "slopes"}


@functools.cache
def _traced(mods: str):
    """(traced score function, the roles of its captured tensors in their order)."""
    if mods not in _FUNCTIONS:
        raise ValueError(f"the Gluon family serves the built-in score mods {SERVED}, not {mods!r}")
    tr = _service("trace")(_FUNCTIONS[mods], "score")
    return tr, tuple(_ROLES[id(t)] for t in tr.captured)


@functools.cache
def lowering(mods: str, direction: str):
    """The registered lowering (:class:`flashgen.user_render.Lowered`) of built-in
    ``mods`` for ``direction`` ("fwd": the forward, "bwd": the whole backward); its
    ``name`` is the Gluon variant's ``user``."""
    tr, roles = _traced(mods)
    return _service("lowering")(direction, tr, None, [False] * len(roles), False)


def name(mods: str, direction: str) -> str:
    """The lowering name (``u`` + 12 hex digits) of built-in ``mods`` in ``direction``."""
    return lowering(mods, direction).name


_params: collections.OrderedDict = collections.OrderedDict()
_PARAMS_MAX = 64


def _values(softcap: float, off: int, alibi: bool, device) -> tuple:
    """(cap, inv, off): the 0-d views of one float32 (3,) [softcap, 1 / softcap, off]
    on ``device`` (module docstring; ``off`` is 0 where ``alibi`` is off, which does not
    read it).  Filled on the device (no host-to-device copy, so no synchronization) and
    kept per value, except inside a CUDA-graph capture: there a tensor of the capture's
    own memory pool is filled by the captured stream, so the graph reads memory that
    lives as long as the graph, never a kept tensor that a later eviction frees."""
    vals = (float(softcap), 1.0 / softcap if softcap > 0 else 0.0, float(off) if alibi else 0.0)
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    capturing = cuda and torch.cuda.is_current_stream_capturing()
    # per stream: a kept tensor is read on the stream it was made on, so its memory is
    # reused (after an eviction) only in that stream's order
    key = (vals, str(dev), torch.cuda.current_stream(dev).cuda_stream if cuda else 0)
    hit = None if capturing else _params.get(key)
    if hit is not None:
        try:
            _params.move_to_end(key)
        except KeyError:  # another thread evicted it meanwhile: it stays valid for this call
            pass
        return hit
    t = torch.empty(3, dtype=torch.float32, device=dev)
    for i, x in enumerate(vals):
        t[i:i + 1].fill_(x)
    views = (t[0], t[1], t[2])
    if not capturing:
        _params[key] = views
        while len(_params) > _PARAMS_MAX:
            _params.popitem(last=False)
    return views


def user_args(mods, q: torch.Tensor, k: torch.Tensor, lo: int, hi: int, direction: str):
    """The :class:`flashgen.user_mods.UserArgs` of the built-in score mods ``mods`` (a
    :class:`flashgen.ops.ScoreMods` with softcap and/or alibi only) for q (batch,
    num_heads, seqlen_q, head_dim) and k (batch, num_kv_heads, seqlen_k, head_dim) with
    the mask's bounds ``lo``, ``hi`` (:func:`flashgen.masks.mask_bounds`), for the Gluon
    forward (``direction`` "fwd") or whole backward ("bwd")."""
    b, h, sq = q.shape[0], q.shape[1], q.shape[2]
    sk = k.shape[2]
    _, roles = _traced(mods.name)
    cap, inv, off = _values(mods.softcap, sk - sq, mods.alibi is not None, q.device)
    slopes = mods.alibi
    if slopes is not None and slopes.dim() == 1:
        slopes = slopes.expand(b, h)  # batch stride 0: the kernels take the strides
    tensors = {"cap": cap, "inv": inv, "off": off, "slopes": slopes}
    bufs = [tensors[r] for r in roles]
    sizes = (b, h, k.shape[1], sq, sk, lo, hi)
    return _service("UserArgs")(lowering(mods.name, direction), bufs, [None] * len(bufs), None, sizes, None,
                                q.device, None, (mods.alibi,))

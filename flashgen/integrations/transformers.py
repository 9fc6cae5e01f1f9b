"""flashgen's attention inside Hugging Face transformers (5.x): one call registers it.

    import flashgen.integrations.transformers as fg_tf
    name = fg_tf.register()                      # "fg_attention"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=name, dtype=torch.bfloat16)

:func:`register` adds :func:`attention_forward` to transformers' ``AttentionInterface`` and
:func:`attention_mask` to its ``AttentionMaskInterface`` under one name.  Both are needed:
``masking_utils`` builds no mask at all for an implementation without a mask function
(padding would be lost).

The name.  It must not contain "flash": transformers 5.x reads any implementation
name containing "flash" (``utils.generic.is_flash_attention_requested``) as a
FlashAttention kernel: ``PreTrainedModel._check_and_adjust_attn_implementation`` then
calls ``lazy_import_flash_attention(name)``, which tries to fetch the name from the
kernels hub ("Could not find the currently requested flash attention implementation at
'flashgen'"), and masking and generation switch to FlashAttention's 2D padding masks
and unpadding.  So ``flashgen`` cannot be used as the name through transformers' public
interfaces; the default is ``"fg_attention"``.  :func:`register` also refuses names
that contain "sdpa" or "flex_attention" (transformers runs those implementations'
dispatch checks on them), a "/" or ":" (read as a hub kernel, "org/repo:function"),
a "|" ("paged|..." prefixes), and transformers' own "eager".

What transformers passes and what flashgen runs (query (batch, num_heads, seqlen_q,
head_dim), key/value (batch, num_kv_heads, seqlen_k, head_dim), as the model's
attention module hands them to ``sdpa_attention_forward``):

* no mask (a causal LM without padding: :func:`attention_mask` returns None where
  transformers' ``sdpa_mask`` does, and where the mask it would build is exactly the
  causal band, or the causal sliding-window band for a model whose attention modules
  pass ``sliding_window``, seen from its first forward on): ``causal=True`` (query i sees key j iff
  j <= i + seqlen_k - seqlen_q; with seqlen_q = 1 every key, as sdpa's
  ``is_causal=False`` there), and for 1 < seqlen_q < seqlen_k the keys are cut to the
  first seqlen_q, as ``sdpa_attention_forward`` does (an empty static cache's prefill);
* ``sliding_window=W`` with no mask: ``window=(W - 1, 0)``, transformers' causal
  sliding-window pattern (key j visible iff i - W < j <= i), so the kernels skip the
  tiles outside the band;
* a mask (padding, packed sequences, static caches, custom 4D masks): the bool (True =
  attend) or additive mask goes to flashgen's ``bias`` (read tile by tile, exact;
  ``sliding_window`` is then already in the mask, as for sdpa).  A query row that sees
  no key (left padding) gives 0.  The other exact route, unpadding into
  :func:`flashgen.attention_varlen`, needs the 2D padding mask and a gather and scatter
  per layer and serves causal padding only; it is not used;
* packed documents (padding-free training: ``position_ids`` restarting at each
  document, no padding mask and no cache, as ``DataCollatorWithFlattening`` gives
  them; transformers then builds a block-diagonal mask), and any custom bool mask of
  that pattern: the mask is checked to be exactly block-diagonal (causal, and the
  layer's ``sliding_window``, within each document; :func:`flashgen.documents.find`, once per mask
  object) and the batch's tokens run as one ragged batch of documents through
  :func:`flashgen.attention_varlen`: no mask is read and no tile spans two documents.
  A mask that is one document per batch entry (exactly the causal / window pattern)
  runs with no mask.  With dropout or softcap (the ragged-batch kernels have neither)
  the mask is read as the bias above;
* ``softcap`` (Gemma 2's ``attn_logit_softcapping``): flashgen's ``softcap``;
* GQA / MQA (num_kv_heads < num_heads): natively, no ``repeat_kv``;
* ``scaling``: ``softmax_scale``; ``dropout`` (training): flashgen's Philox dropout;
* ``s_aux`` (gpt-oss's learnable attention sinks, ``GptOssAttention.sinks``, a
  (num_heads,) parameter in the model's dtype) with no mask (causal, and
  ``sliding_window`` on gpt-oss's sliding layers) or with the bool mask transformers
  builds for padding or packed documents (checked to be that causal / window pattern
  with key padding or within documents; flashgen then runs the pattern and reads the
  (batch, seqlen_k) key padding, or each token's document number, by a ``mask_mod``,
  exact): flashgen's ``sinks`` as
  ``s_aux.float()``, so the sinks' gradient (float32 in the kernels) reaches the
  parameter in its own dtype.  The conventions agree: gpt-oss's
  ``eager_attention_forward`` appends the sink as one more logit to each row of
  scale * QK^T + mask, takes the softmax over the row and drops the sink's
  probability, which is flashgen's LSE_i = log(exp(sinks[h]) + sum_j exp(s_ij)),
  p_ij = exp(s_ij - LSE_i) (its max subtraction changes nothing exactly; it runs the
  softmax in the model's dtype, flashgen in float32).  For gpt-oss without padding
  :func:`attention_mask` returns None on both layer types, so every layer runs here;
  with padding each layer reads its mask's key padding (a query row that sees no key
  gives 0 both ways: eager puts its probability on the sink).

Everything else falls back, with the reason from :func:`fallback_reason` (also given
in a one-time warning per reason): to transformers' ``sdpa_attention_forward`` with the
same arguments, or, for what sdpa lacks (``softcap``, attention sinks ``s_aux``), to
the model's own ``eager_attention_forward``, which also serves ``output_attentions=True``
(the weights, which flashgen never forms).  Reasons: a ``position_bias`` (learned,
needs a gradient), ``s_aux`` with an additive (not bool) mask or a bool one other than
causal / window with key padding or packed documents, with dropout > 0 or with softcap, or that is not a
floating (num_heads,) tensor on the query's device, a mask that is not a tensor (a
flex ``BlockMask``) or that requires grad, of another dtype than bool / the query's, inputs flashgen does not
take (dtype, head dims not a multiple of 8 in [8, 256], empty), dropout where flashgen's
kernels do not run (CPU tensors without ``TRITON_INTERPRET=1``, bfloat16 in the
interpreter).

Returns, as ``sdpa_attention_forward``: (output of shape (batch, seqlen_q, num_heads,
head_dim_v), contiguous, None).
"""

from __future__ import annotations

import math
import numbers
import sys
import warnings
import weakref

import torch

from .. import api, documents
from ..errors import InputError, UnsupportedError

#: The name :func:`register` uses by default (see the module docstring for why not "flashgen").
DEFAULT_NAME = "fg_attention"

_warned: set[str] = set()


def _check_name(name) -> None:
    if not isinstance(name, str) or not name:
        raise InputError(f"name must be a non-empty str, got {name!r}")
    low = name.lower()
    if "flash" in low:
        raise InputError(f"name {name!r} contains 'flash': transformers reads such names as a FlashAttention "
                         "kernel to fetch from its hub and builds FlashAttention's masks for them; pick a name "
                         f"without it (default {DEFAULT_NAME!r})")
    for part, why in (("sdpa", "transformers runs sdpa's dispatch checks on names containing 'sdpa'"),
                      ("flex_attention", "transformers runs flex attention's checks on such names"),
                      ("/", "transformers reads 'org/repo' names as hub kernels"),
                      (":", "transformers reads 'org/repo:function' names as hub kernels"),
                      ("|", "transformers reads 'wrapper|name' as a prefixed implementation")):
        if part in low:
            raise InputError(f"name {name!r} contains {part!r}: {why}; pick another (default {DEFAULT_NAME!r})")
    if low == "eager":
        raise InputError("name 'eager' is transformers' built-in implementation; pick another "
                         f"(default {DEFAULT_NAME!r})")


def register(name: str = DEFAULT_NAME) -> str:
    """Register flashgen's attention with transformers under ``name``; returns ``name``.

    Adds :func:`attention_forward` to ``transformers.AttentionInterface`` and
    :func:`attention_mask` to ``transformers.masking_utils.AttentionMaskInterface``
    (process-wide; registering again is harmless).  Then
    ``attn_implementation=name`` in ``from_pretrained`` / ``from_config``, or
    ``model.set_attn_implementation(name)``, selects it.

    Raises:
        InputError: ``name`` is not a non-empty str, or transformers would read it as
            something else (contains "flash", "sdpa", "flex_attention", "/", ":" or
            "|", or is "eager"; see the module docstring).
        ImportError: transformers is not installed.
    """
    _check_name(name)
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, attention_mask)
    return name


# -- the mask function -----------------------------------------------------------------

#: id(a model's config) -> (a weak reference to it, whether every call of
#: :func:`attention_forward` from that model's attention modules (``module.config``)
#: passed ``sliding_window``; None on a full layer counts): what :func:`attention_mask`
#: needs to drop a sliding-window mask.  Per config object, not class: a model class of
#: remote code may reuse another's config class without passing the window.  A config
#: no call came from is absent (the mask is kept).
_PASSES_WINDOW: dict = {}
_PASSES_WINDOW_MAX = 256
#: ``sliding_window``'s default in :func:`attention_forward`: not passed (unlike None).
_NOT_PASSED = object()


def _window_passed(config) -> bool:
    """Whether every call from ``config``'s model passed ``sliding_window`` (False before
    any call)."""
    entry = _PASSES_WINDOW.get(id(config))
    return entry is not None and entry[0]() is config and entry[1]


def _record_window(config, passed: bool) -> None:
    """Record a call from ``config``'s model that passed ``sliding_window`` or not."""
    entry = _PASSES_WINDOW.get(id(config))
    if entry is None or entry[0]() is not config:
        if len(_PASSES_WINDOW) >= _PASSES_WINDOW_MAX:  # configs that died, then the oldest
            for k in [k for k, (ref, _) in _PASSES_WINDOW.items() if ref() is None] or [next(iter(_PASSES_WINDOW))]:
                del _PASSES_WINDOW[k]
        _PASSES_WINDOW[id(config)] = (weakref.ref(config), passed)
    elif entry[1] and not passed:
        _PASSES_WINDOW[id(config)] = (entry[0], False)

def _band(seqlen_q: int, seqlen_k: int, window_left: int | None, device, top_left: bool = False) -> torch.Tensor:
    """bool (seqlen_q, seqlen_k): the causal pattern flashgen runs for no mask, bottom-right
    (query i sees key j iff j - i <= seqlen_k - seqlen_q; top-left: j <= i), with
    ``window_left`` keys before the diagonal when not None."""
    off = 0 if top_left else seqlen_k - seqlen_q
    rel = torch.arange(seqlen_k, device=device)[None, :] - torch.arange(seqlen_q, device=device)[:, None]
    seen = rel <= off
    if window_left is not None:
        seen &= rel >= off - window_left
    return seen


def attention_mask(*args, **kwargs):
    """transformers' mask function for flashgen (``AttentionMaskInterface``).

    Takes what ``masking_utils.create_causal_mask`` and its siblings pass (batch_size,
    q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
    local_size, allow_is_causal_skip, use_vmap, device, config, ...) and returns what
    ``transformers.masking_utils.sdpa_mask`` returns (a bool mask (batch, 1, q_length,
    kv_length), True = attend, or None), except that a mask that is exactly the pattern
    :func:`attention_forward` runs without one (causal, and for a sliding-window mask
    with ``local_size`` equal to ``config.sliding_window`` the window of that size;
    q_length equal to kv_length or 1) is replaced by None, so no mask is read.  Not
    when ``allow_is_causal_skip`` is False (the caller wants the mask) or while
    torch.compile traces (the check reads the mask's values).

    A sliding-window mask is dropped only for a model whose attention modules were seen
    to pass ``sliding_window`` to :func:`attention_forward` (:data:`_PASSES_WINDOW`, per
    ``config`` object), as transformers' FlashAttention integration needs them to:
    some models (Phimoe, Qwen2-MoE's sliding layers) build the window's mask but never
    pass the window, and without the mask they would attend to every earlier key.  So a
    model's first forward reads the window's mask (exactly, as a bias or as documents).
    A window of at least kv_length keys is the causal band, dropped for any model.
    """
    from transformers.masking_utils import sdpa_mask

    mask = sdpa_mask(*args, **kwargs)
    if (not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 4
            or not kwargs.get("allow_is_causal_skip", True) or torch.compiler.is_compiling()):
        return mask
    sq, sk = mask.shape[-2], mask.shape[-1]
    if sq != sk and sq != 1:
        return mask
    local = kwargs.get("local_size")
    if isinstance(local, int) and not isinstance(local, bool) and local >= sk:
        local = None  # a window of at least seqlen_k keys: the causal band itself
    if local is not None:
        config = kwargs.get("config")
        if (isinstance(local, bool) or not isinstance(local, int) or local < 1 or config is None
                or getattr(config, "sliding_window", None) != local or not _window_passed(config)):
            return mask
    expected = _band(sq, sk, None if local is None else local - 1, mask.device)
    return None if torch.equal(mask, expected.expand_as(mask)) else mask


# -- the attention function ------------------------------------------------------------

def _module_causal(module, is_causal) -> bool:
    return bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))


def fallback_reason(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                    is_causal: bool | None = None, sliding_window: int | None = None, softcap: float | None = None,
                    **kwargs) -> str | None:
    """Why :func:`attention_forward` hands this call to transformers' implementations
    (sdpa, or the model's eager one where sdpa lacks a feature), or None when flashgen
    runs it.  Takes the arguments the attention function takes."""
    return _reason_and_sinks_mask(module, query, key, value, attention_mask, dropout, scaling, is_causal,
                                  sliding_window, softcap, **kwargs)[0]


def _reason_and_sinks_mask(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                           sliding_window=None, softcap=None, **kwargs):
    """(:func:`fallback_reason`'s answer, the ``mask_mod`` that runs attention sinks
    with this bool mask when flashgen runs them with one, else None): the mask is read
    once for both."""
    reason = _reason(module, query, key, value, attention_mask, dropout, scaling, is_causal, sliding_window,
                     softcap, **kwargs)
    if reason is not None or kwargs.get("s_aux") is None or attention_mask is None:
        return reason, None
    mask_mod = _sinks_mask(attention_mask, module, is_causal, sliding_window, query, key)
    if mask_mod is None:
        return ("s_aux (attention sinks) with an attention_mask other than the causal / sliding-window pattern "
                "with key padding or of packed documents (flashgen runs sinks with those bounds and a "
                "key-padding or document mask_mod; a mask made under inference mode is not checked for "
                "packed documents)"), None
    return None, mask_mod


def _reason(module, query, key, value, attention_mask, dropout, scaling, is_causal, sliding_window, softcap,
            **kwargs) -> str | None:
    """:func:`fallback_reason` but for the check of the sinks' bool mask."""
    if kwargs.get("output_attentions"):
        return "output_attentions=True (flashgen never forms the attention weights; the model's eager attention " \
               "returns them)"
    if kwargs.get("position_bias") is not None:
        return "position_bias (a learned per-layer bias; flashgen's bias gets no gradient)"
    s_aux = kwargs.get("s_aux")
    if s_aux is not None:
        reason = _sinks_reason(s_aux, query, attention_mask, dropout, softcap)
        if reason is not None:
            return reason
    if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
        return f"attention_mask of type {type(attention_mask).__name__} (flashgen takes a bool or additive tensor)"
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, numbers.Real)
                                or not math.isfinite(softcap) or softcap < 0):
        return f"softcap = {softcap!r} (flashgen: a finite real >= 0)"
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                       or sliding_window < 1):
        return f"sliding_window = {sliding_window!r} (flashgen: an int >= 1)"
    if scaling is not None and (isinstance(scaling, bool) or not isinstance(scaling, numbers.Real)):
        return f"scaling = {scaling!r} (flashgen: 0 or a magnitude in [{api.SCALE_MIN:g}, {api.SCALE_MAX:g}])"
    if scaling is not None and (reason := api.scale_range_reason("scaling", scaling)):
        return reason
    reason = api.sdpa_fallback_reason(query, key, value, attention_mask, dropout, False, scaling, enable_gqa=True)
    if reason is not None:
        return reason
    if attention_mask is None and _module_causal(module, is_causal) and query.shape[2] > key.shape[2]:
        return (f"causal without a mask and seqlen_q ({query.shape[2]}) > seqlen_k ({key.shape[2]}): sdpa's "
                "top-left alignment")
    return None


#: The key padding of recent masks (:func:`_key_padding`), per mask and bounds.
_padding_memo = documents.MaskMemo()


def _key_padding(mask: torch.Tensor, seqlen_q: int, seqlen_k: int, causal: bool, window_left: int | None):
    """(batch or 1, seqlen_k) bool: the keys ``mask`` lets any query see, when ``mask``
    (bool, True = attend, broadcastable to (batch, 1, seqlen_q, seqlen_k)) is exactly
    the pattern flashgen runs for ``causal`` / ``window_left`` (bottom-right, as
    :func:`_band`) intersected with that key padding; else None (a per-head mask, or
    any other pattern).  The comparison reads the mask's values (a host
    synchronization), once per mask object and version (memoized; an inference tensor,
    which has no version counter, every call)."""
    asked = (seqlen_q, seqlen_k, causal, window_left)
    found, out = _padding_memo.get(mask, asked)
    if found:
        return out
    m = mask if mask.dim() == 4 else mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    out = None
    if m.dim() == 4 and m.shape[1] == 1:
        rows = m[:, 0].expand(m.shape[0], seqlen_q, seqlen_k)
        keys = rows.any(dim=1)  # (batch or 1, seqlen_k)
        band = _band(seqlen_q, seqlen_k, window_left, mask.device) if causal else \
            torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=mask.device)
        if torch.equal(rows, band[None] & keys[:, None, :]):
            out = keys.contiguous()
    if mask.is_inference():
        return _stable_keys(out)
    _padding_memo.put(mask, asked, out)
    return out


#: The last key padding found for an uncached (inference) mask, per shape and device.
_stable: dict = {}


def _stable_keys(keys):
    """``keys`` or, when equal to the last key padding of its shape and device found for
    an uncached mask, that earlier tensor: the layers of one forward under inference
    mode (each handed a mask that is not memoized) then read one tensor, so their
    ``mask_mod`` is traced once and its block masks are reused."""
    if keys is None:
        return None
    slot = (tuple(keys.shape), keys.device)
    prev = _stable.get(slot)
    if prev is not None and torch.equal(prev, keys):
        return prev
    if len(_stable) >= _padding_memo.size:
        _stable.clear()
    with torch.inference_mode(False):  # a normal tensor: a version counter, so block masks are cached
        keys = keys.clone()
    _stable[slot] = keys
    return keys


def _padding_bounds(module, is_causal, sliding_window) -> tuple[bool, int | None]:
    """(causal, window_left) of a layer whose mask is its causal / sliding-window
    pattern with key padding: the bounds :func:`_key_padding` checks and flashgen runs."""
    causal = _module_causal(module, is_causal)
    return causal, (sliding_window - 1 if causal and sliding_window is not None else None)


def _padding_mask_mod(keys: torch.Tensor):
    """A flashgen ``mask_mod`` reading ``keys`` ((batch or 1, seqlen_k) bool, True = a
    key to attend): the key padding, beside flashgen's own causal / window bounds.  It
    reads ``keys``, not the (batch, 1, seqlen_q, seqlen_k) mask it came from, so the
    layers sharing a mask share the traced function and its block masks (flashgen's
    caches of traced functions hold ``keys`` weakly; :func:`_key_padding`'s memo keeps
    the last few)."""
    nb = keys.shape[0] > 1

    def mask_mod(b, h, q_idx, kv_idx):
        return keys[b if nb else 0, kv_idx]

    return mask_mod


def _document_mask_mod(doc: torch.Tensor):
    """A flashgen ``mask_mod`` reading ``doc`` ((batch or 1, seqlen) document numbers,
    from :func:`flashgen.documents.find`): a query sees the keys of its own document, beside
    flashgen's own causal / window bounds."""
    nb = doc.shape[0] > 1

    def mask_mod(b, h, q_idx, kv_idx):
        return doc[b if nb else 0, q_idx] == doc[b if nb else 0, kv_idx]

    return mask_mod


def _sinks_mask(attention_mask, module, is_causal, sliding_window, query, key):
    """The ``mask_mod`` that runs sinks with this bool mask beside flashgen's bounds
    (:func:`_padding_bounds`): the key padding (:func:`_key_padding`) or the packed
    documents (:func:`flashgen.documents.find`) it is exactly; None for any other mask."""
    causal, left = _padding_bounds(module, is_causal, sliding_window)
    keys = _key_padding(attention_mask, query.shape[2], key.shape[2], causal, left)
    if keys is not None:
        return _padding_mask_mod(keys)
    if documents.readable(attention_mask, query, key):
        docs = documents.find(attention_mask, query.shape[0], query.shape[2], causal, left)
        if docs is not None:
            return _document_mask_mod(docs[2])
    return None


def _sinks_reason(s_aux, query, attention_mask, dropout, softcap) -> str | None:
    """Why flashgen cannot serve these attention sinks (``s_aux``), or None: flashgen's
    ``sinks`` take a (num_heads,) tensor on the query's device (any floating dtype here:
    it runs as float32) and combine with causal / window, or with a bool mask (the
    pattern is checked in :func:`fallback_reason`), not with dropout or softcap."""
    if not isinstance(s_aux, torch.Tensor) or not s_aux.is_floating_point():
        got = s_aux.dtype if isinstance(s_aux, torch.Tensor) else type(s_aux).__name__
        return f"s_aux (attention sinks) of {got} (flashgen's sinks: a floating tensor of shape (num_heads,))"
    if not isinstance(query, torch.Tensor) or query.dim() != 4 or tuple(s_aux.shape) != (query.shape[1],):
        heads = query.shape[1] if isinstance(query, torch.Tensor) and query.dim() == 4 else "num_heads"
        return f"s_aux (attention sinks) of shape {tuple(s_aux.shape)} (flashgen's sinks: ({heads},), one per head)"
    if s_aux.device != query.device:
        return f"s_aux (attention sinks) on {s_aux.device}, query on {query.device}"
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor)
                                       or attention_mask.dtype != torch.bool):
        got = attention_mask.dtype if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
        return (f"s_aux (attention sinks) with an attention_mask of {got} (flashgen runs sinks with a bool mask, "
                "True = attend, of causal / window with key padding; not with an additive one)")
    if dropout:
        return "s_aux (attention sinks) with dropout > 0: flashgen's sinks do not combine with its dropout"
    if softcap:
        return "s_aux (attention sinks) with softcap: flashgen's sinks do not combine with its softcap"
    return None


def _eager_mask(mask: torch.Tensor, dtype) -> torch.Tensor:
    """An additive float mask (0 / dtype's min) for the models' eager functions."""
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros((), dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


def _fallback(reason, module, query, key, value, attention_mask, dropout, scaling, is_causal, sliding_window,
              softcap, kwargs):
    causal = _module_causal(module, is_causal)
    sq, sk = query.shape[2], key.shape[2]
    mask = attention_mask
    needs_eager = softcap is not None or kwargs.get("s_aux") is not None or bool(kwargs.get("output_attentions"))
    if mask is None and causal and (needs_eager or sliding_window is not None):
        # The pattern attention_forward would run: :func:`attention_mask` may have dropped
        # a sliding-window mask that sdpa and eager need spelled out.
        top_left = 1 < sq < sk
        window = sliding_window - 1 if sliding_window is not None else None
        mask = _band(sq, sk, window, query.device, top_left=top_left)[None, None]
    if needs_eager:
        eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if eager is None:
            raise UnsupportedError(f"{type(module).__name__}: flashgen cannot serve this call ({reason}), "
                                   "transformers' sdpa has no softcap / s_aux, and the model's module defines no "
                                   "eager_attention_forward")
        if mask is not None:
            mask = _eager_mask(mask, query.dtype)
        return eager(module, query, key, value, mask, dropout=dropout, scaling=scaling, softcap=softcap,
                     sliding_window=sliding_window, **kwargs)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


#: Calls without a mask, sinks, position bias, dropout or softcap that flashgen ran:
#: :func:`_plain_key` (everything the checks and the choices of :func:`attention_forward`
#: read) -> (causal, window, whether the keys were cut to seqlen_q).  A model calls its
#: layers with the same arguments, so every layer after the first skips the checks.
_PLAIN: dict = {}
_PLAIN_MAX = 256


def _plain_key(module, query, key, value, dropout, scaling, is_causal, sliding_window, softcap, kwargs):
    """The key of :data:`_PLAIN` for a call without a mask, or None (sinks, a position
    bias, a tensor subclass: the checks run every call).  Values with their types (the
    checks tell 1 from True); only calls that passed every check are recorded."""
    if kwargs.get("s_aux") is not None or kwargs.get("position_bias") is not None or kwargs.get("output_attentions"):
        return None
    if not (type(query) is torch.Tensor and type(key) is torch.Tensor and type(value) is torch.Tensor):
        return None
    return (query.shape, key.shape, value.shape, query.dtype, key.dtype, value.dtype, query.device, key.device,
            value.device, dropout, type(dropout), scaling, type(scaling), is_causal, type(is_causal),
            getattr(module, "is_causal", True), sliding_window, type(sliding_window), softcap, type(softcap))


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, sliding_window=_NOT_PASSED,
                      softcap: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """flashgen's attention with transformers' attention-function signature
    (``AttentionInterface``; the module docstring says what runs for what).

    Args:
        module: the model's attention module (its ``is_causal`` is the default of
            ``is_causal``).
        query: (batch, num_heads, seqlen_q, head_dim); key, value: (batch, num_kv_heads,
            seqlen_k, head_dim[_v]), num_heads a multiple of num_kv_heads; float16,
            bfloat16 or float32, one device.
        attention_mask: None, or bool (True = attend) / additive (query's dtype),
            broadcastable to (batch, num_heads, seqlen_q, seqlen_k).
        dropout: probability in [0, 1) (training).
        scaling: the softmax scale; None means 1 / sqrt(head_dim).
        sliding_window: W: with no mask, query i sees keys i - W < j <= i; None (a
            full layer) or not passed: no window.  Whether a model's modules pass it
            decides whether :func:`attention_mask` may drop its sliding-window mask.
        softcap: > 0: scores s <- softcap * tanh(s / softcap) before the mask.
        s_aux (keyword): attention sinks, a floating tensor of shape (num_heads,) on the
            query's device (gpt-oss): one extra logit per head in every row's softmax
            denominator, its probability dropped; runs without dropout or softcap and
            with no mask or a bool one (otherwise the model's eager function runs it).

    Returns:
        (O of shape (batch, seqlen_q, num_heads, head_dim_v), contiguous, in the
        query's dtype; None): the attention weights are never materialized.
    """
    passed = sliding_window is not _NOT_PASSED
    if not passed:
        sliding_window = None
    pkey = None
    if attention_mask is None and not torch.compiler.is_compiling():
        pkey = _plain_key(module, query, key, value, dropout, scaling, is_causal, sliding_window, softcap, kwargs)
        hit = _PLAIN.get(pkey) if pkey is not None else None
        if hit is not None:  # the checks and the choices below, made for a call like this one before
            return _dense(query, key, value, *hit, scaling, softcap, None, dropout)
    # Past the memo: it serves calls without a mask only, and a layer whose window's mask
    # is kept arrives with it, so every call that can record "not passed" is recorded.
    # transformers' attention modules keep their config in their instance dict (no
    # nn.Module.__getattr__ and its exception for a module without one).
    config = module.__dict__.get("config")
    if config is not None and not torch.compiler.is_compiling():
        _record_window(config, passed)
    reason, sinks_mask = _reason_and_sinks_mask(module, query, key, value, attention_mask, dropout, scaling,
                                                is_causal, sliding_window, softcap, **kwargs)
    if reason is not None:
        if reason not in _warned:
            _warned.add(reason)
            warnings.warn(f"flashgen: {type(module).__name__} runs transformers' attention: {reason}", stacklevel=2)
        return _fallback(reason, module, query, key, value, attention_mask, dropout, scaling, is_causal,
                         sliding_window, softcap, kwargs)
    s_aux = kwargs.get("s_aux")
    if s_aux is not None and attention_mask is not None:
        # gpt-oss with padding or packed documents: the mask is causal (and the window)
        # with key padding or within documents (fallback_reason checked it): flashgen's
        # bounds, and the padding or the documents as a mask_mod
        causal, left = _padding_bounds(module, is_causal, sliding_window)
        out = api.attention(query, key, value, causal=causal, window=(-1, -1) if left is None else (left, 0),
                            softmax_scale=scaling, sinks=s_aux.float(), mask_mod=sinks_mask)
        return out.transpose(1, 2).contiguous(), None
    if (s_aux is None and not dropout and not softcap and documents.readable(attention_mask, query, key)):
        pattern = _padding_bounds(module, is_causal, sliding_window)
        docs = documents.find(attention_mask, query.shape[0], query.shape[2], *pattern)
        if docs is not None:
            out = api.documents_attention(query, key, value, docs, *pattern, scaling)
            return out.transpose(1, 2).contiguous(), None
    causal = attention_mask is None and _module_causal(module, is_causal)
    window, cut = (-1, -1), False
    if causal:
        # sdpa's is_causal is top-left: the keys past seqlen_q are never seen
        cut = 1 < query.shape[2] < key.shape[2]
        if sliding_window is not None:
            window = (sliding_window - 1, 0)
    if pkey is not None and s_aux is None and not dropout and not softcap:
        if len(_PLAIN) >= _PLAIN_MAX:
            _PLAIN.clear()
        _PLAIN[pkey] = (causal, window, cut)
    if s_aux is None:
        return _dense(query, key, value, causal, window, cut, scaling, softcap, attention_mask, dropout)
    if cut:
        key, value = key[:, :, :query.shape[2]], value[:, :, :query.shape[2]]
    # float32 as flashgen's sinks take them; .float() keeps the gradient's way back to
    # the model's parameter in its own dtype
    out = api.attention(query, key, value, causal=causal, window=window, softmax_scale=scaling, sinks=s_aux.float())
    return out.transpose(1, 2).contiguous(), None


def _dense(query, key, value, causal, window, cut, scaling, softcap, attention_mask, dropout):
    """:func:`attention_forward`'s call of flashgen.attention without sinks, from its
    choices (``cut``: the keys cut to seqlen_q), in transformers' layout."""
    if cut:
        key, value = key[:, :, :query.shape[2]], value[:, :, :query.shape[2]]
    out = api.attention(query, key, value, causal=causal, window=window, softmax_scale=scaling,
                        softcap=float(softcap) if softcap else 0.0, bias=attention_mask,
                        dropout_p=float(dropout) if dropout else 0.0)
    return out.transpose(1, 2).contiguous(), None

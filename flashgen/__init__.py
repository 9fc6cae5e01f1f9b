"""flashgen: exact FlashAttention kernels generated from templates and tuned per GPU.

Public API: :func:`attention`, :func:`attention_varlen` (ragged batches),
:func:`attention_with_kvcache` (decode with a KV cache, flash-decoding),
:func:`scaled_dot_product_attention` (torch's SDPA signature), :func:`explain`,
:func:`dropout_mask` and :func:`manual_seed` (dropout's mask and seed), :func:`tune_mods` (tune the kernels of
user score/mask functions); the ops are registered as ``torch.ops.flashgen.fwd`` /
``torch.ops.flashgen.bwd`` (:mod:`flashgen.library`).  See README.md.
"""

from ._version import __version__  # noqa: E402
from .api import (Explanation, attention, attention_varlen, attention_with_kvcache, explain,  # noqa: E402
                  scaled_dot_product_attention)
from .dropout import dropout_mask, manual_seed  # noqa: E402
from .errors import FlashgenError, InputError, UnsupportedError  # noqa: E402


def tune_mods(q, k, v, **kwargs):
    """Tune the kernels of ``flashgen.attention(q, k, v, score_mod=..., mask_mod=...,
    sinks=...)`` into a tuning DB: :func:`flashgen.user_tune.tune_mods` (imported on
    first use: it needs the tuner's Optuna)."""
    from .user_tune import tune_mods as _tune_mods

    return _tune_mods(q, k, v, **kwargs)


__all__ = ["attention", "attention_varlen", "attention_with_kvcache", "scaled_dot_product_attention", "explain",
           "Explanation", "dropout_mask", "manual_seed", "tune_mods", "FlashgenError", "InputError",
           "UnsupportedError", "__version__"]

"""flashgen: exact FlashAttention kernels generated from templates and tuned per GPU.

Public API: :func:`attention`, :func:`attention_varlen` (ragged batches),
:func:`attention_with_kvcache` (decode with a KV cache, flash-decoding),
:func:`scaled_dot_product_attention` (torch's SDPA signature), :func:`explain`,
:func:`dropout_mask` and :func:`manual_seed` (dropout's mask and seed); the ops are registered as ``torch.ops.flashgen.fwd`` /
``torch.ops.flashgen.bwd`` (:mod:`flashgen.library`).  See README.md.
"""

from ._version import __version__  # noqa: E402
from .api import (Explanation, attention, attention_varlen, attention_with_kvcache, explain,  # noqa: E402
                  scaled_dot_product_attention)
from .dropout import dropout_mask, manual_seed  # noqa: E402
from .errors import FlashgenError, InputError, UnsupportedError  # noqa: E402

__all__ = ["attention", "attention_varlen", "attention_with_kvcache", "scaled_dot_product_attention", "explain",
           "Explanation", "dropout_mask", "manual_seed", "FlashgenError", "InputError", "UnsupportedError", "__version__"]

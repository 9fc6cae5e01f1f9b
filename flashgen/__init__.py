"""flashgen: exact FlashAttention kernels generated from templates and tuned per GPU.

Public API: :func:`attention`, :func:`attention_varlen` (ragged batches), :func:`scaled_dot_product_attention` (torch's SDPA
signature) and :func:`explain`; the ops are registered as ``torch.ops.flashgen.fwd`` /
``torch.ops.flashgen.bwd`` (:mod:`flashgen.library`).  See README.md.
"""

__version__ = "0.1.0"

from .api import Explanation, attention, attention_varlen, explain, scaled_dot_product_attention  # noqa: E402
from .errors import FlashgenError, InputError, UnsupportedError  # noqa: E402

__all__ = ["attention", "attention_varlen", "scaled_dot_product_attention", "explain", "Explanation", "FlashgenError",
           "InputError", "UnsupportedError", "__version__"]

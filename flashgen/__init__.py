"""flashgen: exact FlashAttention kernels generated from templates and tuned per GPU.

Public API: :func:`attention`.  See README.md.
"""

__version__ = "0.1.0"

from .api import attention  # noqa: E402
from .errors import FlashgenError, InputError, UnsupportedError  # noqa: E402

__all__ = ["attention", "FlashgenError", "InputError", "UnsupportedError", "__version__"]

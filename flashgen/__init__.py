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
from . import user_mods  # noqa: E402,F401  (lowers the Gluon family's softcap and ALiBi: families.gluon.builtin_mods)


def tune_mods(q, k, v, *, score_mod=None, mask_mod=None, sinks=None, causal: bool = False,
              window: tuple[int, int] = (-1, -1), db, trials: int = 20, **kwargs) -> list:
    """Tune the kernels of ``flashgen.attention(q, k, v, score_mod=..., mask_mod=...,
    sinks=..., causal=..., window=...)`` at these sizes into the tuning DB ``db`` (a
    path; created if missing, never overwritten), ``trials`` Optuna trials (an int >= 1)
    per kernel, each config checked against float64 first; the process's dispatcher
    reads the rows at once.

    q: (batch, num_heads, seqlen_q, head_dim); k, v: (batch, num_kv_heads, seqlen_k,
    head_dim / head_dim_v); float16 or bfloat16 on a CUDA device (their sizes, dtype and
    device only: the measurements use inputs of their own).  Returns the tuner's
    TuneResult per key.  Raises InputError for bad sizes or options (a CPU tensor
    without ``benchmarker=``, ``trials`` below 1, a ``db`` whose directory is missing
    or not writable) and UnsupportedError for functions flashgen cannot compile.  The
    whole contract (``kernels``, ``benchmarker``, ``env``, ``arch``, ``seed``):
    :func:`flashgen.user_tune.tune_mods` (imported on first use: it needs Optuna)."""
    from .user_tune import tune_mods as _tune_mods

    return _tune_mods(q, k, v, score_mod=score_mod, mask_mod=mask_mod, sinks=sinks, causal=causal, window=window,
                      db=db, trials=trials, **kwargs)


__all__ = ["attention", "attention_varlen", "attention_with_kvcache", "scaled_dot_product_attention", "explain",
           "Explanation", "dropout_mask", "manual_seed", "tune_mods", "FlashgenError", "InputError",
           "UnsupportedError", "__version__"]

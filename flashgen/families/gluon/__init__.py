"""The Gluon kernel family: FlashAttention-3's Hopper forward written in Gluon
(``triton.experimental.gluon``), for sm_90.

  config   knobs (GluonFwdConfig), validity rules, shared-memory and register models
  render   variant -> Gluon source, and the imported module
  launch   fwd(q, k, v, ...) -> (O, LSE)
  sm90     compile for sm_90 without a GPU; ptxas and SASS checks
  shim     the one import point of the Gluon API (names differ between Triton releases)
"""

from .config import GluonFwdConfig, GluonFwdSpec, GluonFwdVariant, check, default_config, space, valid

__all__ = ["GluonFwdConfig", "GluonFwdSpec", "GluonFwdVariant", "check", "default_config", "space", "valid"]

"""The Gluon kernel family: FlashAttention-3's Hopper forward written in Gluon
(``triton.experimental.gluon``), for sm_90.

  config   knobs (GluonFwdConfig), validity rules, shared-memory and register models
  render   variant -> Gluon source, and the imported module
  launch   fwd(q, k, v, ...) -> (O, LSE)
  sm90     compile for sm_90 without a GPU; ptxas and SASS checks
  shim     the one import point of the Gluon API (names differ between Triton releases)
  bwd      the backward: knobs, rules, models, render, load, launcher
  family   FAMILY: the two kernels behind flashgen.families.Family (fwd, bwd)
"""

from .config import GluonFwdConfig, GluonFwdSpec, GluonFwdVariant, check, default_config, space, valid
from .family import FAMILY

__all__ = ["FAMILY", "GluonFwdConfig", "GluonFwdSpec", "GluonFwdVariant", "check", "default_config", "space",
           "valid"]

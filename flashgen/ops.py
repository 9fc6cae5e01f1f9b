"""The Triton family's launchers under their first name: ``flashgen.ops`` *is*
:mod:`flashgen.families.triton.launch` (the same module object, so ``ops.fwd`` and
``monkeypatch.setattr(ops, "fwd", ...)`` reach what the library launches).

Besides the launchers it holds the launch-time argument helpers the library uses for
every family (:class:`ScoreMods`, :func:`tma_ok`, :func:`dtype_name`, the tensor
descriptors).
"""

import sys

from .families.triton import launch

sys.modules[__name__] = launch

"""The user examples' rendered Gluon forward variants, whose digest decides whether a
template edit keeps the user variants' code id (:func:`.render.write_user_code_id`).
Above the renderer (it traces the examples through :mod:`flashgen.user_tune`): only
``python3 -m flashgen.families.gluon`` and the tests import it."""

from __future__ import annotations

import hashlib


def user_probe_digest() -> str:
    """sha256 (16 hex digits) of the rendered user variants of the user examples
    (:data:`flashgen.user_examples.NAMES` with score or mask functions, head_dim 128,
    bfloat16, every config of :func:`.config.space`; header hash left out)."""
    import torch

    from ... import user_examples, user_tune
    from ...spec import KernelSpec, Shape
    from .config import GluonFwdVariant, space
    from .family import fwd_spec
    from .render import render

    shape = Shape(batch=2, num_heads=16, num_kv_heads=16, seqlen_q=2048, seqlen_k=2048)
    h = hashlib.sha256()
    with torch.device("cpu"):
        for name in user_examples.NAMES:
            ex = user_examples.make(name, shape.num_heads, shape.seqlen_q)
            sm, mm = ex.functions(*ex.tensors)
            if sm is None and mm is None:
                continue
            p = user_tune.UserProblem(sm, mm, ex.sinks, ex.causal, ex.window, 128, 128, "bfloat16", shape, label=name)
            spec = fwd_spec(KernelSpec("fwd", "bfloat16", 128, 128, p.mask, p.fwd_mods))
            for c in space(spec):
                h.update(render(GluonFwdVariant(spec, c), header_hash="-").encode())
    return h.hexdigest()[:16]

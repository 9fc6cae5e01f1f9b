"""The rendered Gluon forward variants of a set of user functions, whose digest decides
whether a template edit keeps the user variants' code id (:func:`.render.write_user_code_id`).
Above the renderer (it traces the functions through :mod:`flashgen.user_tune`): only
``python3 -m flashgen.families.gluon`` and the tests import it.

The set covers every user branch of the template: the examples of
:data:`flashgen.user_examples.NAMES` (a captured table read by the score function, a
score function of the score alone and of the positions, mask functions of a band, of
two captured tensors and of the positions, sinks alone), and three more: a sigmoid in the
score function, a score and a mask function together, and a mask function with sinks;
each at head_dims 64 and 128, float16 and bfloat16, every config of
:func:`.config.space`."""

from __future__ import annotations

import hashlib


def _problems():
    """(label, score_mod, mask_mod, sinks, causal, window) of the probe set."""
    import torch

    from ... import user_examples

    seqlen, heads = 2048, 16
    out = []
    for name in user_examples.NAMES:
        ex = user_examples.make(name, heads, seqlen, requires_grad=False)
        sm, mm = ex.functions(*ex.tensors)
        out.append((name, sm, mm, ex.sinks, ex.causal, ex.window))

    def gated(score, b, h, q_idx, kv_idx):
        return score * torch.sigmoid(score)

    doc = user_examples.document_ids(seqlen)

    def same_doc(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    def capped(score, b, h, q_idx, kv_idx):
        return 20.0 * torch.tanh(score / 20.0)

    sinks = torch.linspace(-1.0, 1.0, heads)
    out += [("sigmoid-score", gated, None, None, True, (-1, -1)),
            ("score-and-mask", capped, same_doc, None, False, (-1, -1)),
            ("mask-and-sinks", None, same_doc, sinks, True, (-1, -1))]
    return out


def user_probe_digest() -> str:
    """sha256 (16 hex digits) of the rendered user variants of the probe set (module
    docstring), header hash left out."""
    import torch

    from ... import user_tune
    from ...spec import KernelSpec, Shape
    from .config import GluonFwdVariant, space
    from .family import fwd_spec
    from .render import render

    shape = Shape(batch=2, num_heads=16, num_kv_heads=16, seqlen_q=2048, seqlen_k=2048)
    h = hashlib.sha256()
    with torch.device("cpu"):
        for label, sm, mm, sinks, causal, window in _problems():
            for dtype in ("bfloat16", "float16"):
                for d in (64, 128):
                    p = user_tune.UserProblem(sm, mm, sinks, causal, window, d, d, dtype, shape, label=label)
                    spec = fwd_spec(KernelSpec("fwd", dtype, d, d, p.mask, p.fwd_mods))
                    for c in space(spec):
                        h.update(render(GluonFwdVariant(spec, c), header_hash="-").encode())
    return h.hexdigest()[:16]

"""The record of the user variants' machinery id (:func:`flashgen.user_render.machinery_hash`):
what keeps their names, and so their tuned rows, across an edit of the rendering
machinery that does not change their code.

Every user variant's name hashes its lowered functions and the id of the machinery
that turns them into source (``flashgen/user_render.py``, ``templates/_user_mods.j2``
and the dense templates).  The id is kept in ``templates/user_machinery_id.json`` with
the text hash it was written for and the digest of the probe lowerings' sources: the
user examples (:mod:`flashgen.user_examples`, at 16 heads and seqlen 2048), each one's
forward lowering in ``fwd`` and its backward lowering in ``bwd_dq`` and ``bwd_dkdv``,
rendered for every probe variant of the dense kernels
(:func:`flashgen.render.probe_variants`).  After an edit, ``python3 -m
flashgen.user_machinery`` rewrites the record: the id stays where the probes render as
recorded, else it becomes the new text hash.  Where the record is stale (the text
changed and the record was not rewritten) the id is the text hash, the behaviour
before the record: an unrecorded edit renames every user variant.
"""

from __future__ import annotations

import hashlib
import json

from . import render, user_examples, user_grads, user_mods, user_render
from .spec import compiled_variant


def _probe_lowerings() -> list[tuple[user_render.Lowered, tuple[str, ...]]]:
    """(lowering, the kernels it compiles into) of each user example, in order."""
    out = []
    for name in user_examples.NAMES:
        ex = user_examples.make(name, 16, 2048)
        sm, mm = ex.functions(*ex.tensors)
        st = user_mods.trace(sm, "score") if sm is not None else None
        mt = user_mods.trace(mm, "mask") if mm is not None else None
        flags = user_mods.score_grad_flags(st)
        out.append((user_mods._lowered("fwd", st, mt, flags, ex.sinks is not None), ("fwd",)))
        if st is not None or mt is not None:
            out.append((user_mods._lowered("bwd", st, mt, flags, False), ("bwd_dq", "bwd_dkdv")))
    return out


def probe_sources():
    """The rendered sources of the probe lowerings (header hash left out), each under a
    fixed name of its position, so that the sources do not depend on the id they
    define; a variant that the machinery refuses gives its error's type and text."""
    for n, (low, kernels) in enumerate(_probe_lowerings()):
        name = f"u{n:012x}" + ("m" if low.mask is not None else "")
        low.__dict__["name"] = name  # the cached name, not derived from machinery_hash()
        user_render._registry[name] = low
        try:
            for kernel in kernels:
                for v in render.probe_variants(kernel, name):
                    try:
                        yield render._render(compiled_variant(v), "-", **user_grads.render_args(v.spec))
                    except (ValueError, user_render.UnsupportedError) as e:
                        yield f"{v.id}: {type(e).__name__}: {e}"
        finally:
            del user_render._registry[name]


def probe_digest() -> str:
    """sha256 (16 hex digits) of :func:`probe_sources`."""
    h = hashlib.sha256()
    for src in probe_sources():
        h.update(src.encode())
    return h.hexdigest()[:16]


def write_record(path=None) -> dict:
    """Rewrite the record (``path``, default the templates directory's
    :data:`flashgen.user_render.MACHINERY_RECORD`) for the machinery as it is: the
    recorded id stays where the probe digest is the recorded one, else the id is the
    new text hash."""
    rec = user_render.read_machinery_record(path)
    digest, text = probe_digest(), user_render.machinery_text_hash()
    kept = rec.get("code") and rec.get("probes") == digest
    new = {"text": text, "probes": digest, "code": rec["code"] if kept else text}
    target = path or (user_render._templates_dir() / user_render.MACHINERY_RECORD)
    target.write_text(json.dumps(new, indent=1, sort_keys=True) + "\n")
    user_render.machinery_hash.cache_clear()
    return new


if __name__ == "__main__":
    old = user_render.read_machinery_record().get("code")
    rec = write_record()
    print(f"wrote {user_render._templates_dir() / user_render.MACHINERY_RECORD}: id {rec['code']} "
          f"({'kept' if rec['code'] == old else 'new: every user variant is renamed'})")

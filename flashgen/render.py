"""Variant -> Triton source text.  Pure: no torch, no triton, no side effects.

Templates live in ``templates/`` (``attn_<kernel>.py.j2``), share macros in
``templates/_common.j2``, and are rendered with ``StrictUndefined`` so a misspelt
symbol is an error, not an empty string.  Each generated file starts with the template
hash and the variant id.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from pathlib import Path

import jinja2

from .spec import (DTYPES, MASKS, KernelSpec, Variant, compiled_variant, is_decode, is_user_mods, kernel_mods,
                   mods_set, supports)
from .template_files import macros_name, template_files, template_name, templates_dir, text_hash  # noqa: F401


@functools.lru_cache(maxsize=None)
def _env(directory: str | None = None) -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(directory or str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )


#: Head-dim pairs (head_dim, head_dim_v) of the code-hash probes: every padding case
#: (neither, both, only one side padded to a power of two; the 16 minimum).
_PROBE_HEAD_DIMS = ((64, 64), (72, 72), (192, 128), (128, 72), (8, 8))


def probe_variants(kernel: str, mods: str = "") -> list[Variant]:
    """The variants whose rendered sources define :func:`template_hash`: every config
    of the kernel's tuning domain (with ``ws`` off and on) for each mask mode, and
    every (dtype, head-dim padding case, mask, tma, ws) combination, so that a template
    edit changing the code of any variant the tuner can record changes the hash."""
    from . import space  # space imports spec only; imported here to keep render light

    masks = [m for m in MASKS if supports(kernel, m)]
    out = []
    for mask in masks:
        spec = KernelSpec(kernel, "bfloat16", 64, 64, mask, mods)
        for c in space.configs(kernel):
            for ws in (0, 1):
                out.append(Variant(spec, dataclasses.replace(c, ws=ws, num_splits=c.num_splits or 0)))
    base = next(space.configs(kernel))
    for dtype in DTYPES:
        for d, dv in _PROBE_HEAD_DIMS:
            for mask in masks:
                spec = KernelSpec(kernel, dtype, d, dv, mask, mods)
                for tma in (0, 1):
                    for ws in (0, 1):
                        out.append(Variant(spec, dataclasses.replace(base, tma=tma, ws=ws)))
    return out


def _code_hash(kernel: str, mods: str, directory: str | None = None) -> str:
    h = hashlib.sha256()
    for v in probe_variants(kernel, mods):
        if is_decode(kernel) and v.config.num_splits < 1:
            continue
        h.update(_render(v, "-", directory).encode())
    return h.hexdigest()[:16]


def code_hashes_path() -> Path:
    """The shipped table text hash -> code hash (``templates/code_hashes.json``)."""
    return templates_dir() / "code_hashes.json"


@functools.lru_cache(maxsize=None)
def _shipped_code_hashes() -> dict:
    try:
        return json.loads(code_hashes_path().read_text())
    except (OSError, ValueError):
        return {}


@functools.lru_cache(maxsize=None)
def template_hash(kernel: str, mods: str = "") -> str:
    """The code hash (sha256, 16 hex digits) of ``kernel`` compiled with score
    modifications ``mods``: the hash of the Triton source rendered for every
    :func:`probe_variants` variant (header hash left out).  Tuning rows and compiled
    modules carry it; an edit that changes the generated code of a (kernel, mods)
    changes its hash and so invalidates exactly that code's rows, while an edit that
    leaves it unchanged (a new ``{% if %}`` mode, a comment in another kernel's branch)
    keeps every row valid.

    Rendering the probes takes 0.1-1 s per (kernel, mods); the result for the shipped
    templates is read from ``templates/code_hashes.json`` (keyed by the templates'
    text hash, so an edited template is always re-rendered; ``python -m
    flashgen.render`` rewrites the file).

    User score/mask functions (:func:`flashgen.spec.is_user_mods`) carry the hash of
    their code in their name; their rows carry the plain kernel's code hash."""
    if is_user_mods(mods):
        return template_hash(kernel, "")
    entry = _shipped_code_hashes().get(kernel, {}).get(mods or "-")
    if entry and entry.get("text") == text_hash(kernel):
        return entry["code"]
    return _code_hash(kernel, mods)


def write_code_hashes(path: Path | None = None) -> dict:
    """Compute every (kernel, mods) code hash and write the table (``python -m
    flashgen.render``)."""
    from .spec import KERNELS

    table = {k: {(m or "-"): {"text": text_hash(k), "code": _code_hash(k, m)} for m in kernel_mods(k)}
             for k in KERNELS}
    (path or code_hashes_path()).write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    _shipped_code_hashes.cache_clear()
    template_hash.cache_clear()
    return table


def render(variant: Variant) -> str:
    """Triton source for ``variant``."""
    s = variant.spec
    if is_user_mods(s.mods):
        # the dense templates with the user functions' overlay and hook lines
        from . import user_grads

        return _render(compiled_variant(variant), template_hash(s.kernel, s.mods), **user_grads.render_args(s))
    return _render(variant, template_hash(s.kernel, s.mods))


def _render(variant: Variant, header_hash: str, directory: str | None = None, env: jinja2.Environment | None = None,
            **extra) -> str:
    """``extra``: further template variables (probes of modes that are not tuned knobs,
    e.g. attn_bwd_dkdv's ``dq_atomic``; ``user`` for user functions); ``env``: another
    Jinja environment (:mod:`flashgen.user_render`'s)."""
    s, c = variant.spec, variant.config
    if is_decode(s.kernel) and c.num_splits < 1:
        raise ValueError(f"{variant.id}: the decode kernels need num_splits >= 1, got {c.num_splits}")
    tmpl = (env or _env(directory)).get_template(template_name(s.kernel))
    return tmpl.render(
        variant_id=variant.id,
        template_hash=header_hash,
        kernel=s.kernel,
        dtype=s.dtype,
        head_dim=s.head_dim,
        head_dim_v=s.head_dim_v,
        head_dim_pad=s.head_dim_pad,
        head_dim_v_pad=s.head_dim_v_pad,
        mask=s.mask,
        BLOCK_M=c.BLOCK_M,
        BLOCK_N=c.BLOCK_N,
        num_warps=c.num_warps,
        num_stages=c.num_stages,
        tma=c.tma,
        ws=c.ws,
        num_splits=c.num_splits,
        **{m: m in mods_set(s.mods) for m in ("softcap", "alibi", "bias", "dropout")},
        mods=s.mods,
        **extra,
    )


if __name__ == "__main__":
    t = write_code_hashes()
    print(f"wrote {code_hashes_path()}: {sum(len(v) for v in t.values())} (kernel, mods) code hashes")

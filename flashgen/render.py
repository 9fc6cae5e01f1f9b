"""Variant -> Triton source text.  Pure: no torch, no triton, no side effects.

Templates live in ``templates/`` (``attn_<kernel>.py.j2``), share macros in
``templates/_common.j2``, and are rendered with ``StrictUndefined`` so a misspelt
symbol is an error, not an empty string.  Each generated file starts with the template
hash and the variant id.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
from pathlib import Path

import jinja2

from .spec import Variant, is_decode


def templates_dir() -> Path:
    """The directory holding the Jinja templates (package data when installed, the
    repository's ``templates/`` in a source checkout)."""
    try:
        p = Path(str(importlib.resources.files("flashgen.templates")))
        if (p / "_common.j2").exists():
            return p
    except ModuleNotFoundError:
        pass
    return Path(__file__).resolve().parent.parent / "templates"


@functools.lru_cache(maxsize=None)
def _env() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )


def template_name(kernel: str) -> str:
    return f"attn_{kernel}.py.j2"


def macros_name(kernel: str) -> str:
    """The shared-macro file every kernel's template imports."""
    return "_common.j2"


#: Templates that include another: ``attn_decode_paged.py.j2`` is the paged mode of
#: ``attn_decode.py.j2``.
_INCLUDES = {"decode_paged": ("attn_decode.py.j2",)}


def template_files(kernel: str) -> tuple[str, ...]:
    """Every template file a kernel's source depends on: its template, the templates it
    includes and the shared macros."""
    return (template_name(kernel), *_INCLUDES.get(kernel, ()), macros_name(kernel))


@functools.lru_cache(maxsize=None)
def template_hash(kernel: str) -> str:
    """sha256 (16 hex digits) of the kernel's template files (:func:`template_files`:
    its template, what it includes, the shared macros): a change to any invalidates
    tuning rows and compiled modules of that kernel."""
    h = hashlib.sha256()
    for name in template_files(kernel):
        h.update((templates_dir() / name).read_bytes())
    return h.hexdigest()[:16]


def render(variant: Variant) -> str:
    """Triton source for ``variant``."""
    s, c = variant.spec, variant.config
    if is_decode(s.kernel) and c.num_splits < 1:
        raise ValueError(f"{variant.id}: the decode kernels need num_splits >= 1, got {c.num_splits}")
    tmpl = _env().get_template(template_name(s.kernel))
    return tmpl.render(
        variant_id=variant.id,
        template_hash=template_hash(s.kernel),
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
    )

"""Where the Jinja templates are and which files a kernel's source depends on (a leaf:
:mod:`flashgen.render` and :mod:`flashgen.user_render` both read templates through it,
so neither imports the other's user).  Pure: no torch, no triton, no jinja2.

:mod:`flashgen.render` re-exports every name here (``render.templates_dir`` etc.).
"""

from __future__ import annotations

import hashlib
import importlib.resources
from pathlib import Path


def templates_dir() -> Path:
    """The directory holding the Jinja templates: the repository's ``templates/`` beside
    this package in a source checkout (also one imported through PYTHONPATH while pip's
    editable install points at another checkout), else the installed package data."""
    here = Path(__file__).resolve().parent.parent / "templates"
    if (here / "_common.j2").is_file() and (here / "attn_fwd.py.j2").is_file():
        return here
    try:
        p = Path(str(importlib.resources.files("flashgen.templates")))
        if (p / "_common.j2").exists():
            return p
    except ModuleNotFoundError:
        pass
    return here


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


def text_hash(kernel: str, directory: str | None = None) -> str:
    """sha256 (16 hex digits) of the kernel's template files (:func:`template_files`)
    in ``directory`` (default :func:`templates_dir`).  Before code hashes (flashgen
    0.1 rows of 2026-11) tuning rows carried this as their ``template_hash``."""
    h = hashlib.sha256()
    for name in template_files(kernel):
        h.update((Path(directory or templates_dir()) / name).read_bytes())
    return h.hexdigest()[:16]

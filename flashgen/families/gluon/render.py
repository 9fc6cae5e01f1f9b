"""Gluon forward variant -> Gluon source text (pure: no torch, no triton), and the
imported module of a variant.

The template is ``templates/gluon/attn_fwd.py.j2``, rendered with ``StrictUndefined``
so a misspelt symbol is an error.  The generated file starts with the template hash
(sha256 of the template text, 16 hex digits) and the variant id.
"""

from __future__ import annotations

import functools
import hashlib
import threading
from pathlib import Path
from types import ModuleType

import jinja2

from ...render import templates_dir
from .config import GluonFwdVariant, check, template_vars

TEMPLATE = "attn_fwd.py.j2"


def gluon_templates_dir() -> Path:
    return templates_dir() / "gluon"


@functools.lru_cache(maxsize=None)
def _env() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(gluon_templates_dir())),
                              undefined=jinja2.StrictUndefined, keep_trailing_newline=True, trim_blocks=True,
                              lstrip_blocks=True)


@functools.lru_cache(maxsize=None)
def template_hash() -> str:
    return hashlib.sha256((gluon_templates_dir() / TEMPLATE).read_bytes()).hexdigest()[:16]


def render(v: GluonFwdVariant) -> str:
    """The Gluon source of ``v``.  Raises ValueError naming the broken rules when ``v``
    is not valid (:func:`flashgen.families.gluon.config.check`)."""
    why = check(v)
    if why:
        raise ValueError(f"{v.id} cannot be built: " + "; ".join(why))
    return _env().get_template(TEMPLATE).render(variant_id=v.id, template_hash=template_hash(), **template_vars(v))


_lock = threading.Lock()
_modules: dict[str, ModuleType] = {}


def load(v: GluonFwdVariant) -> ModuleType:
    """The imported module of ``v`` (written once under its content hash; memoized)."""
    from ...compile import import_source

    key = f"{v.id}@{template_hash()}"
    with _lock:
        mod = _modules.get(key)
        if mod is None:
            mod = _modules[key] = import_source(v, render(v), "_gluon")
    return mod

"""Source -> cached module -> kernel handle.

``generated_path`` names the file a variant's source lives in: a content-hash directory
(``<cache>/generated/<sha256 of the source>/<variant id>.py``), so a given source text
is written once and two versions of a template never collide.  ``write_source`` writes
it atomically (temp file + rename, write-if-different), which is safe when several
processes compile at once.  ``load`` imports the module and is memoized per process:
each variant is compiled (by Triton, on first launch) once per process; Triton's own
on-disk cache keeps the binary across processes.

The cache directory is ``$FLASHGEN_CACHE_DIR`` or ``~/.cache/flashgen``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
import threading
from pathlib import Path
from types import ModuleType

from . import render
from .errors import InputError
from .spec import Variant, compiled_variant, is_user_mods

_lock = threading.Lock()
_modules: dict[str, ModuleType] = {}


def cache_dir() -> Path:
    return Path(os.environ.get("FLASHGEN_CACHE_DIR") or Path.home() / ".cache" / "flashgen")


def generated_path(variant: Variant, source: str) -> Path:
    return _generated_path(variant.id, source)


def _generated_path(name: str, source: str) -> Path:
    digest = hashlib.sha256(source.encode()).hexdigest()[:20]
    return cache_dir() / "generated" / digest / f"{name}.py"


def write_source(path: Path, source: str) -> None:
    """Write ``source`` to ``path`` unless it already holds exactly that text."""
    if path.exists() and path.read_text() == source:
        return
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".py")
        with os.fdopen(fd, "w") as f:
            f.write(source)
        os.replace(tmp, path)
    except OSError as e:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        where = "$FLASHGEN_CACHE_DIR" if os.environ.get("FLASHGEN_CACHE_DIR") else "~/.cache/flashgen"
        raise InputError(f"cannot write generated kernels under {cache_dir()} ({where}; it must be a writable "
                         f"directory or creatable as one, with space left): {e.strerror or e}") from None


def load(variant: Variant) -> ModuleType:
    """The imported module of ``variant`` (rendered and written on first use): the code of
    :func:`flashgen.spec.compiled_variant` (a causal fwd/dQ with a bias loads the window
    kernel)."""
    variant = compiled_variant(variant)
    interp = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    cache_key = f"{variant.id}@{render.template_hash(variant.spec.kernel, variant.spec.mods)}@{int(interp)}"
    mod = _modules.get(cache_key)
    if mod is not None:
        return mod
    with _lock:
        mod = _modules.get(cache_key)
        if mod is None:
            mod = _modules[cache_key] = import_source(variant, render.render(variant), "_interp" if interp else "")
    return mod


def load_mode(variant: Variant, suffix: str, templates: str | None = None, **extra) -> ModuleType:
    """``variant`` rendered with further template variables (probe modes that are not
    tuned knobs: attn_bwd_dkdv's ``dq_atomic``, attn_fwd's ``pipe_qk``) and/or from
    another template directory, imported as a new module named with ``suffix`` (not
    cached: the probes and the sm_90 compile script call it once per variant).  A user
    variant (:func:`flashgen.spec.is_user_mods`) renders as :func:`load` renders it, its
    functions registered in this process (:func:`flashgen.user_render.register`)."""
    if is_user_mods(variant.spec.mods):
        if templates is not None or extra:
            raise ValueError(f"{variant.id}: a user variant renders from the dense templates with its overlay "
                             "only (no other template directory or probe modes)")
        return import_source(compiled_variant(variant), render.render(variant), suffix)
    header = render.template_hash(variant.spec.kernel, variant.spec.mods)
    return import_source(variant, render._render(variant, header, templates, **extra), suffix)


def import_source(variant: Variant, source: str, suffix: str = "") -> ModuleType:
    """Write ``source`` (generated code of ``variant``) under its content hash
    (:func:`generated_path`) and import it as a new module (``suffix`` tells apart
    modules of one file, e.g. compiled for the interpreter).  :func:`load` does this for
    the rendered variant, :func:`load_mode` for a render with probe modes."""
    return import_generated(variant.id, source, suffix)


def import_generated(name: str, source: str, suffix: str = "") -> ModuleType:
    """Write ``source`` to ``<cache>/generated/<content hash>/<name>.py`` and import it as
    the new module ``flashgen_generated.<content hash>.<name><suffix>``: what
    :func:`import_source` does for a variant, for sources named otherwise (the Gluon
    backward's variants and probes, the benchmarks' edited renders)."""
    path = _generated_path(name, source)
    write_source(path, source)
    modname = f"flashgen_generated.{path.parent.name}.{name}{suffix}"
    spec = importlib.util.spec_from_file_location(modname, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[modname] = mod
    spec.loader.exec_module(mod)
    return mod

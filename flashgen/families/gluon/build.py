"""A Gluon variant that does not build on the installed Triton: one typed error, one
warning per variant and process, and the Triton family in its place.

Gluon is experimental; a Triton release can rename what a generated kernel uses (the
shim maps the renames flashgen knows of, :mod:`flashgen.families.gluon.shim`).  A
variant whose module does not import, or whose kernel does not compile (Triton's
``CompilationError``, ``PTXASError``, or any error raised inside ``triton.compile``),
raises :class:`GluonBuildError`; the first time per variant it also warns
(:class:`GluonFallbackWarning`, naming the variant and the error's first line), and
the variant is remembered (:func:`failed`), so later calls fail at once without
building it again.  :func:`serve` runs a Gluon call and, on that error, the Triton
family's call instead.  Errors that are not build failures (bad input, a failed
launch, a wrong result) pass through unchanged.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import TypeVar

from ...errors import UnsupportedError

T = TypeVar("T")

_lock = threading.Lock()
_failed: dict[str, str] = {}  # variant id -> "ExceptionType: first line"


class GluonBuildError(UnsupportedError):
    """Gluon variant ``variant_id`` does not build on the installed Triton.

    ``reason`` is the underlying error's type and first line (for a Triton
    ``CompilationError``, of its innermost cause: the renamed or missing name)."""

    def __init__(self, variant_id: str, reason: str):
        self.variant_id, self.reason = variant_id, reason
        super().__init__(f"Gluon variant {variant_id} does not build on triton {_triton_version()}: {reason}")


class GluonFallbackWarning(UserWarning):
    """A Gluon variant failed to build; the Triton family serves its calls."""


def _triton_version() -> str:
    try:
        import triton
    except ImportError:  # pragma: no cover - triton is a dependency
        return "(not installed)"
    return triton.__version__


def reason(e: BaseException) -> str:
    """``"Type: first line"`` of what made a build fail.  A Triton CompilationError's
    text starts with the source position ("at 69:49:"), so the chain of causes is
    followed to its end, whose message names the problem; the code generator keeps
    the Python error as its repr, shown as ``AttributeError: 'shared_memory_descriptor'
    object has no attribute '_reinterpret'``."""
    root, seen = e, {id(e)}
    while root.__cause__ is not None and id(root.__cause__) not in seen:
        root = root.__cause__
        seen.add(id(root))
    msg = getattr(root, "error_message", None) or str(root)
    first = next((ln.strip() for ln in msg.splitlines() if ln.strip()), "")
    # Triton's code generator keeps the Python error as its repr: AttributeError("...")
    wrapped = re.fullmatch(r"""(\w+(?:Error|Exception))\((["'])(.*)\2\)""", first)
    if wrapped:
        return f"{wrapped.group(1)}: {wrapped.group(3)}"
    return f"{type(root).__name__}: {first}" if first else type(root).__name__


def is_build_error(e: BaseException) -> bool:
    """Whether ``e`` was raised by building a kernel (import of its module, Triton's
    front end, its passes or ptxas: anything raised inside ``triton.compile``), not
    by checking inputs or launching."""
    if isinstance(e, (ImportError, SyntaxError)):
        return True
    try:
        from triton.compiler.errors import CompilationError
        from triton.runtime.errors import PTXASError
    except ImportError:  # pragma: no cover - triton is a dependency
        return False
    if isinstance(e, (CompilationError, PTXASError)):
        return True
    # anything else raised inside triton.compile (an MLIR pass, the LLVM back end)
    compiler_py = os.path.join("triton", "compiler", "compiler.py")
    tb = e.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name == "compile" and code.co_filename.endswith(compiler_py):
            return True
        tb = tb.tb_next
    return False


def failed() -> dict[str, str]:
    """The variants that failed to build in this process: {variant id: reason}."""
    with _lock:
        return dict(_failed)


def _fail(variant_id: str, e: BaseException) -> GluonBuildError:
    why = reason(e)
    with _lock:
        first = variant_id not in _failed
        _failed.setdefault(variant_id, why)
    if first:
        warnings.warn(f"Gluon variant {variant_id} does not build on triton {_triton_version()} ({why}); "
                      "the Triton family serves it in this process", GluonFallbackWarning, stacklevel=4)
    return GluonBuildError(variant_id, why)


@contextlib.contextmanager
def building(variant_id: str, *, any_error: bool = False) -> Iterator[None]:
    """Run a build step of ``variant_id`` (import, compile, or a launch that compiles
    on first use).  Raises GluonBuildError at once when the variant failed before;
    turns a build failure (:func:`is_build_error`; with ``any_error``, every
    exception but ValueError, for steps that only build) into GluonBuildError,
    warning the first time.  Other errors pass through."""
    with _lock:
        why = _failed.get(variant_id)
    if why is not None:
        raise GluonBuildError(variant_id, why)
    try:
        yield
    except GluonBuildError:
        raise
    except Exception as e:
        if (any_error and not isinstance(e, ValueError)) or is_build_error(e):
            raise _fail(variant_id, e) from e
        raise


def load_fwd(v):
    """The imported module of forward variant ``v``
    (:func:`flashgen.families.gluon.render.load`).  Raises GluonBuildError when it
    does not import on the installed Triton; ValueError when ``v`` breaks a validity
    rule."""
    from .render import load

    with building(v.id, any_error=True):
        return load(v)


def load_bwd(config, dtype: str, head_dim: int, mask: str, varlen: bool = False, user: str = ""):
    """The imported module of one backward variant (:func:`flashgen.families.gluon.bwd.load`;
    ``varlen``: the ragged-batch one; ``user``: user mask functions').  Raises
    GluonBuildError when it does not import on the installed Triton; ValueError when the
    config breaks a validity rule."""
    from .bwd import load, variant_id, varlen_reasons

    if varlen:
        why = varlen_reasons(config, head_dim)
        if why:
            raise ValueError(f"{variant_id(config, dtype, head_dim, mask, True)}: {'; '.join(why)}")
    with building(variant_id(config, dtype, head_dim, mask, varlen, user), any_error=True):
        return load(config, dtype, head_dim, mask, varlen=varlen, user=user)


def serve(variant_id: str, gluon: Callable[[], T], fallback: Callable[[], T]) -> T:
    """``gluon()`` (a call of Gluon variant ``variant_id``, e.g. ``launch.fwd(...)``,
    which compiles on first use); ``fallback()`` (the Triton family's call) when the
    variant does not build on the installed Triton (warned once per variant), now or
    before in this process."""
    try:
        with building(variant_id):
            return gluon()
    except GluonBuildError:
        return fallback()

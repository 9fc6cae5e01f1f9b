"""The errors flashgen raises that users may want to catch."""


class FlashgenError(Exception):
    """Base class of flashgen's errors."""


class InputError(FlashgenError, ValueError):
    """An argument breaks a rule; the message names the argument and the rule."""


class UnsupportedError(FlashgenError, NotImplementedError):
    """A valid input that flashgen's kernels do not serve (yet)."""


class LaunchLimitError(FlashgenError, ValueError):
    """These inputs' sizes exceed a launch limit of one variant (e.g. CUDA's 65535 programs
    on a grid's second axis): that call runs on the portable family's kernels, and the
    variant keeps serving the calls it can take (it is not marked failed)."""


def type_name(value) -> str:
    """The name of ``value``'s type for an error message: a builtin's bare name (``int``),
    another type's with its module (``numpy.bool``, not the ``bool`` that NumPy's
    ``bool_`` calls itself)."""
    t = type(value)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"

"""The errors flashgen raises that users may want to catch."""


class FlashgenError(Exception):
    """Base class of flashgen's errors."""


class InputError(FlashgenError, ValueError):
    """An argument breaks a rule; the message names the argument and the rule."""


class UnsupportedError(FlashgenError, NotImplementedError):
    """A valid input that flashgen's kernels do not serve (yet)."""

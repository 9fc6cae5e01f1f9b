"""flashgen's version (a leaf module: the environment of every tuning row carries it)."""

__version__ = "0.1.0"

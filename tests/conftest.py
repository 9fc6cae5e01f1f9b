import os

# Kernels run in Triton's interpreter on CPU; set before any generated module is
# imported (the @triton.jit decorator reads it then).
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("FLASHGEN_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".flashgen_cache"))


import pytest  # noqa: E402


@pytest.fixture
def hermetic_dispatcher():
    """Heuristic configs only (no shipped or user database), restored afterwards."""
    from flashgen import arch, dispatch
    from flashgen.dispatch import Dispatcher
    from flashgen.env import Environment

    dispatch.set_default_dispatcher(Dispatcher([], env=Environment.current(), arch=arch.current()))
    yield
    dispatch.set_default_dispatcher(None)

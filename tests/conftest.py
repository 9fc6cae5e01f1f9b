import os

# Kernels run in Triton's interpreter on CPU; set before any generated module is
# imported (the @triton.jit decorator reads it then).
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("FLASHGEN_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".flashgen_cache"))


import pytest  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--sm90-cases", choices=("all", "cover"), default="all",
                     help="the Gluon sm_90 compile tests' cases: all of them, or a subset that covers every "
                          "knob value, head dim, mask and dtype of the whole list (tests/sm90.py: covering), "
                          "for a Triton other than the one the GPU numbers were measured under (.ci/newest-triton)")


@pytest.fixture(autouse=True)
def dropout_from_torch():
    """Every test starts and ends with dropout drawing from torch's generator (a test
    that calls flashgen.manual_seed switches its process to flashgen's own stream)."""
    yield
    import sys

    if "flashgen.dropout" in sys.modules:
        sys.modules["flashgen.dropout"].manual_seed(None)


@pytest.fixture
def hermetic_dispatcher():
    """Heuristic configs only (no shipped or user database), restored afterwards."""
    from flashgen import arch, dispatch
    from flashgen.dispatch import Dispatcher
    from flashgen.env import Environment

    dispatch.set_default_dispatcher(Dispatcher([], env=Environment.current(), arch=arch.current()))
    yield
    dispatch.set_default_dispatcher(None)


#: The Gluon forward's code-id probe variants by extension, and each spec's search space,
#: once per worker process (see :func:`gluon_fwd_probes_once`).
_GLUON_FWD_PROBES: dict = {}
_GLUON_FWD_SPACES: dict = {}


@pytest.fixture
def gluon_fwd_probes_once(monkeypatch, once_per_run):
    """The Gluon forward's code-id probe variants (``render.probe_variants``, a function of
    the search space alone) enumerated once per test run (the xdist workers share them,
    :func:`once_per_run`), each spec's search space once within that, instead of the
    whole space swept again for every extension of every digest.  What the code-id
    checks test still runs per call: each template directory's sources rendered and
    hashed, the records read and written."""
    import dataclasses

    from flashgen.families.gluon import render as R
    from flashgen.families.gluon.config import GluonFwdConfig, GluonFwdSpec, GluonFwdVariant

    real_probes, real_space = R.probe_variants, R.space

    def space_once(s, **fixed):
        key = (s, tuple(sorted(fixed.items())))
        if key not in _GLUON_FWD_SPACES:
            _GLUON_FWD_SPACES[key] = tuple(real_space(s, **fixed))
        return iter(_GLUON_FWD_SPACES[key])

    def probes_once(extension=None):
        if extension not in _GLUON_FWD_PROBES:
            rows = once_per_run(f"gluon-fwd-probes-{extension}", lambda: [
                [dataclasses.asdict(v.spec), dataclasses.asdict(v.config)] for v in real_probes(extension)])
            _GLUON_FWD_PROBES[extension] = tuple(GluonFwdVariant(GluonFwdSpec(**s), GluonFwdConfig(**c))
                                                 for s, c in rows)
        return list(_GLUON_FWD_PROBES[extension])

    monkeypatch.setattr(R, "space", space_once)
    monkeypatch.setattr(R, "probe_variants", probes_once)


@pytest.fixture(scope="session")
def once_per_run(tmp_path_factory):
    """``once_per_run(name, compute)``: ``compute()``'s JSON-able result, computed by the
    first worker process of this pytest run that asks for ``name`` and read back by the
    others (pytest-xdist runs a module-scoped fixture in every worker that runs one of
    its tests): a file beside the workers' temporary directories, written under a lock."""
    import fcntl
    import json

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # shared by the workers of this run

    def get(name, compute):
        path = root / f"once-{name}.json"
        with open(root / f"once-{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if path.exists():
                return json.loads(path.read_text())
            value = compute()
            path.write_text(json.dumps(value))
            return value
    return get

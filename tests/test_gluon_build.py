"""A Gluon variant that does not build on the installed Triton (flashgen/families/gluon/
build.py): one typed GluonBuildError, one warning per variant and process naming the
variant and the error's first line, the Triton family's call in its place, and errors
that are not build failures passed through."""

import json
import os
import subprocess
import sys
import warnings

import pytest

from flashgen.families.gluon import build
from flashgen.families.gluon.build import GluonBuildError, GluonFallbackWarning
from flashgen.families.gluon.config import GluonFwdConfig, GluonFwdSpec, GluonFwdVariant


@pytest.fixture(autouse=True)
def no_failed_variants(monkeypatch):
    monkeypatch.setattr(build, "_failed", {})


# Triton 3.9 renamed shared_memory_descriptor._reinterpret (the name the kernels call);
# removing it reproduces that break with Triton's real front end: compiling the
# forward for sm_90 raises a CompilationError at trace time.
_SCRIPT = r'''
import json, warnings
from triton.experimental.gluon.language._core import shared_memory_descriptor
from flashgen.families.gluon import build, shim
from flashgen.families.gluon.config import GluonFwdConfig, GluonFwdSpec, GluonFwdVariant
from flashgen.families.gluon.sm90 import compile_sm90
del shared_memory_descriptor._reinterpret
v = GluonFwdVariant(GluonFwdSpec("bfloat16", 128, 128, "causal"), GluonFwdConfig())
tried = []
def gluon():
    tried.append(1)
    return compile_sm90(v).metadata.name
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    served = [build.serve(v.id, gluon, lambda: "triton") for _ in range(3)]
try:
    with build.building(v.id):
        pass
    err = None
except build.GluonBuildError as e:
    err = dict(type=type(e).__name__, variant_id=e.variant_id, reason=e.reason, msg=str(e))
print("RESULT " + json.dumps(dict(id=v.id, served=served, tried=len(tried), failed=build.failed(), err=err,
                                  warnings=[str(w.message) for w in seen
                                            if issubclass(w.category, build.GluonFallbackWarning)])))
'''


def test_a_variant_that_does_not_compile_falls_back_with_one_warning(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # a cached kernel would not be traced again
    r = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(next(ln[7:] for ln in r.stdout.splitlines() if ln.startswith("RESULT ")))
    vid = res["id"]
    why = "AttributeError: 'shared_memory_descriptor' object has no attribute '_reinterpret'"
    assert res["served"] == ["triton"] * 3
    assert res["tried"] == 1  # built once; later calls go to the Triton family at once
    assert res["failed"] == {vid: why}
    assert len(res["warnings"]) == 1, res["warnings"]
    assert vid in res["warnings"][0] and why in res["warnings"][0], res["warnings"]
    assert res["err"]["type"] == "GluonBuildError" and res["err"]["variant_id"] == vid
    assert res["err"]["reason"] == why and vid in res["err"]["msg"]


def test_a_module_that_does_not_import_is_a_typed_error(monkeypatch):
    from flashgen.families.gluon import render

    v = GluonFwdVariant(GluonFwdSpec(), GluonFwdConfig())
    calls = []

    def broken_load(variant):
        calls.append(variant.id)
        raise TypeError("NVMMADistributedLayout.__init__() got an unexpected keyword argument 'version'\nmore")

    monkeypatch.setattr(render, "load", broken_load)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            with pytest.raises(GluonBuildError) as e:
                build.load_fwd(v)
            assert e.value.variant_id == v.id
            assert e.value.reason == ("TypeError: NVMMADistributedLayout.__init__() got an unexpected keyword "
                                      "argument 'version'")
            assert isinstance(e.value, NotImplementedError)  # flashgen's UnsupportedError
    assert calls == [v.id]
    assert [(w.category, v.id in str(w.message)) for w in seen] == [(GluonFallbackWarning, True)]


def test_invalid_configs_and_launch_errors_are_not_build_failures():
    s = GluonFwdSpec("bfloat16", 64, 64, "none")
    bad = GluonFwdVariant(s, GluonFwdConfig(BLOCK_N=96))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match="cannot be built"):
            build.load_fwd(bad)

        def launch_fails():
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        with pytest.raises(RuntimeError, match="illegal memory access"):
            build.serve("gluon_fwd_x", launch_fails, lambda: "triton")
    assert build.failed() == {} and seen == []


def test_an_error_inside_triton_compile_is_a_build_error():
    import triton
    from triton.backends.compiler import GPUTarget

    with pytest.raises(Exception) as e:
        triton.compile(object(), target=GPUTarget("cuda", 90, 32))
    assert build.is_build_error(e.value)
    assert not build.is_build_error(RuntimeError("CUDA error: out of memory"))
    assert build.is_build_error(ImportError("cannot import name 'tma' from 'triton.experimental.gluon'"))

"""Compile generated kernels for sm_90 with Triton's real compiler and bundled ptxas (no
GPU needed), in a subprocess without TRITON_INTERPRET; the tests that catch
real-compiler errors the interpreter cannot, and read shared memory and PTX."""

import os
import subprocess
import sys

import pytest

_BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")
_SCRIPT = '''
import sys
sys.path.insert(0, BENCHMARKS)
from sm90_compile import compile_sm90
from flashgen.spec import KernelSpec, TileConfig, Variant
for kernel, dtype, d, dv, mask, cfg, *mods in CASES:
    v = Variant(KernelSpec(kernel, dtype, d, dv, mask, *mods), TileConfig(*cfg))
    k = compile_sm90(v)
    ptx = k.asm["ptx"]
    print("OK", v.id, k.metadata.shared, int("cp.async.bulk.tensor" in ptx), int("wgmma.mma_async" in ptx))
'''


def compile_for_sm90(cases, timeout=600):
    """{variant id: (shared bytes, PTX has bulk tensor copies, PTX has wgmma)} for
    ``cases`` of (kernel, dtype, head_dim, head_dim_v, mask, TileConfig fields as a
    tuple[, mods]); skips the test when Triton's bundled ptxas is missing."""
    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("triton's bundled ptxas is missing")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", f"CASES = {list(cases)!r}\nBENCHMARKS = {_BENCHMARKS!r}\n" + _SCRIPT],
                       capture_output=True,
                       text=True, env=env, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    out = {}
    for line in r.stdout.splitlines():
        if line.startswith("OK "):
            _, vid, shared, bulk, wgmma = line.split()
            out[vid] = (int(shared), bulk == "1", wgmma == "1")
    assert len(out) == len(cases), r.stdout
    return out


def json_rows(script: str, cases, timeout=600) -> list[dict]:
    """Run ``script`` (it reads ``CASES`` and prints ``OK <json>`` per case) in a subprocess
    without TRITON_INTERPRET; the parsed rows, one per case.  Fails (does not skip) when
    Triton's bundled ptxas is missing: the Gluon families' checks need it."""
    import json

    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    assert os.path.exists(ptxas), "triton's bundled ptxas is missing"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", f"CASES = {list(cases)!r}\n" + script], capture_output=True,
                       text=True, env=env, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line[3:]) for line in r.stdout.splitlines() if line.startswith("OK ")]
    assert len(rows) == len(list(cases)), r.stdout
    return rows


def covering(cases, features):
    """The cases of ``cases`` that cover every (knob, value) pair the whole list covers,
    for the compile tests under a Triton other than 3.6.0 (``--sm90-cases
    cover``): ``features(case)`` is the case's set of (knob, value) pairs (every field
    of its spec and config, defaults included).  Picked greedily, each time the case
    that adds the most pairs not yet covered (the first such in list order); then with
    every case that is a picked one with some of its boolean knobs turned off (the
    twins the checks compare a knob's variant with).  In list order."""
    feats = [frozenset(features(c)) for c in cases]
    want = frozenset().union(*feats)
    picked, seen = set(), set()
    while seen != want:
        i = max(range(len(cases)), key=lambda j: (len(feats[j] - seen), -j))
        picked.add(i)
        seen |= feats[i]
    for i in list(picked):
        on = {k for k, v in feats[i] if v is True}
        for j, f in enumerate(feats):
            differ = {k for k, _ in f ^ feats[i]}
            if differ and differ <= on and all(v is False for k, v in f if k in differ):
                picked.add(j)
    return [cases[i] for i in sorted(picked)]


def chosen(config, cases, features):
    """``cases``, or their :func:`covering` subset under ``--sm90-cases cover``."""
    return covering(cases, features) if config.getoption("sm90_cases") == "cover" else list(cases)

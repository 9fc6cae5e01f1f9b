"""The Gluon backward (flashgen/families/gluon/bwd.py) without a GPU: validity rules, the
shared-memory model, and representative variants compiled for sm_90 with Triton's
bundled ptxas (no spills, no wgmma serialization info C7514/C7515) and cuobjdump (HGMMA,
USETMAXREG: warp-specialized with register budgets)."""

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from flashgen.families.gluon import bwd as B  # noqa: E402

#: (config fields, head_dim, mask, probe): compiled and checked for sm_90.  The probe
#: variants (row_load "tma") compile clean but fault on the H200, so the rules reject
#: them; they stay here as the register/shared-memory reference for the structure.
CASES = [
    ((64, 64, 2, 2, "tma", 240, 24, "tma"), 128, "causal", True),
    ((64, 64, 2, 3, "tma", 240, 24, "tma"), 128, "none", True),
    ((64, 64, 2, 2, "atomic", 240, 24, "tma"), 128, "window", True),
    ((64, 64, 2, 4, "tma", 240, 24, "ptr", 4), 64, "none", False),
    ((64, 64, 2, 4, "atomic", 240, 24, "tma"), 64, "causal", True),
]

_SCRIPT = r'''
import json, os, re, subprocess, sys, tempfile
sys.path.insert(0, ROOT)
import triton
from flashgen.families.gluon import bwd as B
bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
for fields, d, mask, probe in CASES:
    cfg = B.GluonBwdConfig(*fields)
    k = B.compile_sm90(cfg, "bfloat16", d, mask, check=not probe)
    with tempfile.TemporaryDirectory() as t:
        ptx, cubin = os.path.join(t, "k.ptx"), os.path.join(t, "k.cubin")
        open(ptx, "w").write(k.asm["ptx"])
        info = subprocess.run([os.path.join(bin_dir, "ptxas"), "-v", "--gpu-name", "sm_90a", ptx, "-o", cubin],
                              capture_output=True, text=True).stderr
        open(cubin, "wb").write(k.asm["cubin"])
        sass = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-sass", cubin], capture_output=True, text=True).stdout
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", info)]
    print("CASE", json.dumps({"id": cfg.id, "d": d, "mask": mask, "smem": k.metadata.shared,
                              "model": B.smem_bytes(cfg, d), "spill": max(spills) if spills else None,
                              "c751x": re.findall(r"C751[45]", info), "hgmma": sass.count("HGMMA"),
                              "usetmaxreg": sass.count("USETMAXREG"), "num_warps": k.metadata.num_warps}))
for kern in ("attn_bwd_preprocess", "attn_bwd_convert"):
    B.compile_sm90(B.default_config(128), "float16", 128, "none", kern)
    print("AUX", kern)
'''


def _have_ptxas():
    import triton

    return os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas"))


@pytest.fixture(scope="module")
def compiled():
    if not _have_ptxas():
        pytest.skip("triton's bundled ptxas is missing")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", f"ROOT = {ROOT!r}\nCASES = {CASES!r}\n" + _SCRIPT], capture_output=True,
                       text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    cases = [json.loads(line[5:]) for line in r.stdout.splitlines() if line.startswith("CASE ")]
    aux = [line for line in r.stdout.splitlines() if line.startswith("AUX ")]
    assert len(cases) == len(CASES) and len(aux) == 2, r.stdout
    return cases


def test_variants_compile_without_spills_or_serialized_wgmma(compiled):
    for c in compiled:
        assert c["spill"] == 0, c
        assert c["c751x"] == [], c


def test_sass_is_warp_specialized_hgmma(compiled):
    for c in compiled:
        assert c["hgmma"] > 0, c
        assert c["usetmaxreg"] > 0, c
        # consumers' warps plus the producer's warpgroup
        assert c["num_warps"] in (8, 12), c


def test_shared_memory_model_matches_the_compiler(compiled):
    for c in compiled:
        assert abs(c["model"] - c["smem"]) <= 256, c
        assert c["smem"] <= B.SMEM_LIMIT_BYTES


def test_rules_reject_what_the_kernels_cannot_take():
    ok = B.default_config(128)
    assert B.is_valid(ok, 128) and B.is_valid(B.default_config(64), 64)
    assert any("faults on the H200" in r for r in B.invalid_reasons(B.GluonBwdConfig(row_load="tma"), 128))
    assert any("shared memory" in r for r in B.invalid_reasons(B.GluonBwdConfig(block_m=128, stages=4), 128))
    assert any("registers per thread" in r for r in B.invalid_reasons(B.GluonBwdConfig(block_m=128), 64))
    assert any("head_dim" in r for r in B.invalid_reasons(ok, 96))
    assert any("dq_mode" in r for r in B.invalid_reasons(B.GluonBwdConfig(dq_mode="x"), 128))
    assert any("setmaxnreg" in r for r in B.invalid_reasons(B.GluonBwdConfig(consumer_regs=244), 128))
    with pytest.raises(ValueError, match="invalid Gluon backward config"):
        B.render(B.GluonBwdConfig(block_m=128, stages=4), "bfloat16", 128, "none")
    for d in B.HEAD_DIMS:
        for c in B.search_space(d):
            assert B.smem_bytes(c, d) <= B.SMEM_LIMIT_BYTES


def test_render_names_the_knobs():
    src = B.render(B.default_config(64), "float16", 64, "causal")
    vid = B.variant_id(B.default_config(64), "float16", 64, "causal")
    assert f'VARIANT_ID = "{vid}"' in src and "PRODUCER_WARPS=4" in src and "DQ_MODE=tma" in src
    assert re.search(r"mask=causal", src)


def test_input_errors_name_the_argument():
    import torch

    q = torch.zeros(1, 2, 8, 64, dtype=torch.bfloat16)
    k = torch.zeros(1, 1, 8, 64, dtype=torch.bfloat16)
    lse = torch.zeros(1, 2, 8)
    with pytest.raises(ValueError, match="lse"):
        B.check_inputs(q, q, k, k, q, lse.double())
    with pytest.raises(ValueError, match="num_heads"):
        B.check_inputs(q, q, torch.zeros(1, 3, 8, 64, dtype=torch.bfloat16), torch.zeros(1, 3, 8, 64, dtype=torch.bfloat16), q, lse)
    with pytest.raises(ValueError, match="do"):
        B.check_inputs(q[:, :, :4], q, k, k, q, lse)

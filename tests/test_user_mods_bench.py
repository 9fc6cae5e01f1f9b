"""benchmarks/user_mods_bench.py: ``--smoke`` runs every case's code paths and float64
checks on the CPU in Triton's interpreter; FlexAttention's compiled path never times
the unfused eager implementation (its fallback is detected and raised)."""

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SCRIPT = os.path.join(ROOT, "benchmarks", "user_mods_bench.py")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import user_mods_bench  # noqa: E402

from flashgen import user_examples  # noqa: E402


def test_smoke_runs_every_example_and_checks_it_against_float64(tmp_path):
    out = tmp_path / "u.json"
    env = {**os.environ, "PYTHONPATH": ROOT, "TRITON_INTERPRET": "1"}
    p = subprocess.run([sys.executable, SCRIPT, "--smoke", "--out", str(out)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["flex"].startswith("eager")  # the smoke run says its Flex rows are the unfused path
    assert list(data["cases"]) == ["plain-causal", *user_examples.NAMES, "sinks-causal"]
    for name, rec in data["cases"].items():
        fg = rec["results"]["flashgen"]
        assert "error" not in fg and fg["check_ratio"] <= 1.0 and fg["fwd_bwd_ms"] > 0, (name, fg)
        assert ("flex" in rec["results"]) == (not name.startswith("sinks"))
        assert ("flashgen-builtin" in rec["results"]) == (name in ("alibi", "softcap", "window-causal", "sinks",
                                                                    "sinks-causal"))


def test_flex_compiled_per_size_without_the_unfused_fallback():
    """Compiled (static shapes) at batch 1, then batch 2: each size is a compiled graph,
    the detector stays quiet and the result is FlexAttention's; the eager path under
    the detector raises."""
    from torch.nn.attention.flex_attention import flex_attention

    mask = user_examples.make("document", 2, 64).functions()[1]
    f = user_mods_bench._Flex(mask, -64, 0, 64, 0.25, "cpu", compiled=True)
    g = torch.Generator().manual_seed(0)
    for batch in (1, 2):
        q, k, v = (torch.randn(batch, 2, 64, 16, generator=g) for _ in range(3))
        before = f.graphs()
        with f.fused():
            o = f([q, k, v], (None, None), None)
        assert f.graphs() > before  # a graph of its own for this size, not the eager path
        with f.fused():
            f([q, k, v], (None, None), None)  # the same size again: nothing compiles
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the eager reference's "without torch.compile()"
            ref = flex_attention(q, k, v, block_mask=f.block_mask, scale=0.25)
        assert (o - ref).abs().max() < 1e-4
    eager = user_mods_bench._Flex(mask, -64, 0, 64, 0.25, "cpu", compiled=False)
    eager.compiled, eager.fn = True, flex_attention  # what a silent fallback would run
    with pytest.raises(RuntimeError, match="unfused"):
        with eager.fused():
            eager([q, k, v], (None, None), None)

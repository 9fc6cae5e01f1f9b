"""benchmarks/ as one entry point (``python -m benchmarks <suite>``): the registry names
scripts that exist, a missing script stops its suite with a message, extra arguments
reach the script, and the plots are drawn from the shipped H200 results."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results" / "h200"
sys.path.insert(0, str(ROOT / "benchmarks"))

import suites  # noqa: E402


def _run(*args, cwd=ROOT):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "benchmarks", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=240)


def test_every_suite_runs_a_script_that_exists_except_the_model_step():
    assert {"grid", "llama", "mods", "varlen", "decode", "overhead", "exactness", "model"} <= set(suites.SUITES)
    for s in suites.SUITES.values():
        for step in s.steps:
            if step[0] == "-m":
                continue
            if s.needs == step[0]:
                continue  # the model suite's script is checked at run time
            assert (ROOT / step[0]).is_file(), (s.name, step[0])
        assert any("{out}" in a for a in s.steps[0]), s.name  # every suite writes into its directory


def test_list_prints_every_suite_and_its_command():
    r = _run("list")
    assert r.returncode == 0, r.stderr
    for name, s in suites.SUITES.items():
        assert name in r.stdout and " ".join(s.steps[0]).replace("{out}", f"bench_out/{name}") in r.stdout


def test_a_missing_script_stops_the_suite_with_a_message(tmp_path):
    s = suites.Suite("x", "nothing", (("benchmarks/no_such_step.py", "--out", "{out}/x.json"),), ("x.json",),
                     needs="benchmarks/no_such_step.py")
    import importlib

    main = importlib.import_module("benchmarks.__main__")
    assert main.run_suite(s, tmp_path / "o", []) == 2
    assert not (tmp_path / "o").exists()


def test_extra_arguments_go_to_the_first_step_only(tmp_path):
    import importlib

    main = importlib.import_module("benchmarks.__main__")
    cmds = main.commands(suites.SUITES["exactness"], tmp_path, ["--smoke"])
    assert cmds[0][1:] == ["benchmarks/gpu_exactness.py", "--out", f"{tmp_path}/exactness.json", "--smoke"]
    assert cmds[1][1:] == ["benchmarks/gpu_op_checks.py"]


def test_unknown_suite_is_refused():
    r = _run("nosuch")
    assert r.returncode == 2 and "invalid choice" in r.stderr


@pytest.mark.parametrize("kind, inputs, files", [
    ("dense", ["fa-grid/five-backends/d64_none.log", "fa-grid/five-backends/d64_causal/bench.json"],
     ["tflops_fwd.png", "tflops_bwd.png", "tflops_fwdbwd.png", "memory.png"]),
    ("mods", ["mods/d64/mods_d64.json"], ["mods.png"]),
    ("varlen", ["varlen/varlen.json"], ["varlen.png"]),
    ("decode", ["decode/tuned/decode.json"], ["decode.png"]),
])
def test_plots_from_the_shipped_results(kind, inputs, files, tmp_path):
    pytest.importorskip("matplotlib")
    import plots

    kw = {"memory": True} if kind == "dense" else {}
    written = plots.KINDS[kind]([str(RESULTS / p) for p in inputs], tmp_path, **kw)
    assert sorted(p.name for p in written) == sorted(files)
    for p in written:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000


def test_every_backend_of_the_memory_plot_is_drawn(tmp_path):
    """flashgen's peak memory (262 MiB) and FlexAttention's (260 MiB) differ by 1%: as
    bars each keeps its own patch, so neither hides the other."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    import plots

    src = RESULTS / "fa-grid" / "pointer-loads-eight-backends" / "bench.json"
    seen = {}
    real = plt.Figure.savefig

    def spy(fig, *a, **k):
        for ax in fig.axes:
            for c in ax.containers:
                seen.setdefault(c.get_label(), 0)
                seen[c.get_label()] += sum(1 for p in c.patches if p.get_height() > 0)
        return real(fig, *a, **k)

    plt.Figure.savefig = spy
    try:
        plots.dense([str(src)], tmp_path, memory=True)  # TFLOP/s lines, memory bars
    finally:
        plt.Figure.savefig = real
    backends = json.loads(src.read_text())["meta"]["backends"]
    assert set(backends) <= set(seen) and all(seen[b] > 0 for b in backends)


@pytest.mark.parametrize("argv, words", [
    (["--padding", "-5"], "--padding must be >= 0"),
    (["--configs", "gptoss", "--padding", "2048"], "--padding 2048 leaves no token of config gptoss (2048 tokens)"),
    (["--smoke", "--padding", "32"], "--padding 32 leaves no token of config smoke (32 tokens)"),
    (["--configs", "h2048,nope"], "unknown config 'nope'"),
    (["--packed", "1"], "--packed must be 0 (off) or >= 2"),
    (["--packed", "4", "--padding", "8"], "--packed and --padding are exclusive"),
    (["--smoke", "--packed", "33"], "--packed 33 is more documents than config smoke has tokens (32)"),
])
def test_transformers_step_refuses_bad_arguments(argv, words, capsys):
    """benchmarks/transformers_step.py: a negative --padding (which would pad all but the
    last tokens), one that leaves an entry no token, and an unknown config stop at the
    argument parser with the rule, before torch is imported."""
    import transformers_step

    with pytest.raises(SystemExit) as e:
        transformers_step._parse(argv)
    assert e.value.code == 2
    assert words in capsys.readouterr().err


def test_transformers_step_takes_a_padding_below_every_configs_tokens():
    import transformers_step

    assert transformers_step._parse(["--configs", "gptoss", "--padding", "256"]).padding == 256
    assert transformers_step._parse(["--smoke", "--padding", "5"]).padding == 5


def test_transformers_step_packs_documents():
    """--packed: each entry's position_ids restart at exactly the drawn document starts,
    covering every token, the cut points different across entries."""
    import torch
    import transformers_step

    assert transformers_step._parse(["--smoke", "--packed", "32"]).packed == 32
    pos = transformers_step._packed_positions(3, 40, 5, torch.Generator().manual_seed(0))
    assert pos.shape == (3, 40)
    for row in pos:
        starts = (row == 0).nonzero().reshape(-1)
        assert starts[0] == 0 and len(starts) == 5
        ends = torch.cat([starts[1:], torch.tensor([40])])
        assert all(torch.equal(row[a:b], torch.arange(b - a)) for a, b in zip(starts.tolist(), ends.tolist()))
    assert not torch.equal(pos[0], pos[1])


def test_transformers_step_gap_table_finds_the_frame_that_launched_after_idle_time():
    """--gaps: the GPU's idle time between kernels is summed by the innermost flashgen
    (else transformers) frame around the launch of the kernel after each gap; kernels
    that overlap are counted once as busy; blocking runtime calls are counted by name."""
    import transformers_step as ts

    def x(cat, name, t, dur, **args):
        return {"ph": "X", "cat": cat, "name": name, "ts": t, "dur": dur, "args": args}

    events = [
        x("python_function", "/m/transformers/models/llama/modeling_llama.py(300): forward", 0, 1000),
        x("python_function", "/r/flashgen/integrations/transformers.py(400): attention_forward", 100, 300),
        x("python_function", "/r/flashgen/library.py(700): forward", 150, 200),
        # another thread's frame around the same time (autograd's device thread)
        dict(x("python_function", "/r/flashgen/ops.py(90): backward", 300, 50), tid=9),
        x("python_function", "<built-in method empty>", 160, 5),
        x("cuda_runtime", "cudaLaunchKernel", 10, 5, correlation=1),
        x("cuda_runtime", "cudaStreamSynchronize", 170, 40),
        x("cuda_runtime", "cuLaunchKernelEx", 320, 5, correlation=2),
        x("cuda_runtime", "cudaLaunchKernel", 600, 5, correlation=3),
        x("cuda_runtime", "cudaLaunchKernel", 610, 5, correlation=4),
        x("kernel", "gemm", 20, 100, correlation=1),         # busy 20-120
        x("kernel", "attn_fwd", 330, 50, correlation=2),     # idle 210 us before it
        x("kernel", "o_proj", 620, 30, correlation=3),       # idle 240 us before it
        x("kernel", "add", 640, 20, correlation=4),          # overlaps o_proj: 10 us more busy
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 0},
    ]
    g = ts.gap_table(events, host_ms=1.5)
    assert g["kernels"] == 4
    assert g["busy_us"] == 100 + 50 + 30 + 10
    assert g["idle_us"] == 210 + 240
    assert g["span_us"] == 660 - 20
    assert g["before_first_kernel_us"] == 10
    frames = list(g["gaps_by_frame"].items())
    assert frames[0] == ("transformers/models/llama/modeling_llama.py(300): forward", [1, 240.0, "o_proj"])
    assert frames[1] == ("flashgen/library.py(700): forward", [1, 210.0, "attn_fwd"])
    assert g["waits"] == {"cudaStreamSynchronize": [1, 40.0]}
    assert ts.gap_table([], 0.1)["kernels"] == 0

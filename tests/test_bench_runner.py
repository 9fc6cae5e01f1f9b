"""``python -m benchmarks plot`` and the suites' runner on bad input (a one-line error
naming the argument, exit status 2, no traceback, nothing written), the plots' legend
in narrow figures, the older bench JSON, and the smoke runs of the exactness suite and
the forward-config probe on the CPU."""

import importlib
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

VARLEN = str(RESULTS / "varlen" / "varlen.json")
MODS = str(RESULTS / "mods" / "d64" / "mods_d64.json")
DECODE = str(RESULTS / "decode" / "tuned" / "decode.json")
BENCH = str(RESULTS / "fa-grid" / "five-backends" / "d64_causal" / "bench.json")
LOG = str(RESULTS / "fa-grid" / "five-backends" / "d64_none.log")
OLD_BENCH = str(RESULTS / "llama3-8b" / "pointer-loads" / "bench.json")


def _main():
    return importlib.import_module("benchmarks.__main__")


def _env():
    return dict(os.environ, PYTHONPATH=str(ROOT))


def _refused(argv, capsys, *words):
    """main(argv) exits 2 with one line on stderr holding ``words``, and no traceback."""
    rc = _main().main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "error: " in lines[0], err
    for w in words:
        assert w in lines[0], (w, err)
    return lines[0]


def _files(tmp_path):
    (tmp_path / "bad.json").write_text("not json\n")
    (tmp_path / "dir.json").mkdir()
    (tmp_path / "rows0.json").write_text('{"rows": []}')
    (tmp_path / "cases0.json").write_text('{"cases": []}')
    (tmp_path / "list.json").write_text("[1, 2]")
    # a mods result whose every case failed, a varlen one whose every problem did
    (tmp_path / "mods_failed.json").write_text(json.dumps(
        {"cases": [{"label": "plain", "causal": False, "results": {"flashgen": {"error": "boom"}}}]}))
    (tmp_path / "varlen_failed.json").write_text(json.dumps(
        {"rows": [{"label": "docs512", "causal": False, "results": {"flashgen": {"error": "boom"}}}]}))
    return tmp_path


@pytest.mark.parametrize("kind, name, words", [
    ("dense", "missing.json", ["missing.json: no such file"]),
    ("dense", "missing.log", ["missing.log: no such file"]),
    ("mods", "missing.json", ["missing.json: no such file"]),
    ("dense", "bad.json", ["bad.json: not a JSON file"]),
    ("decode", "bad.json", ["bad.json: not a JSON file"]),
    ("dense", "dir.json", ["dir.json: not a file"]),
    ("varlen", "dir.json", ["dir.json: not a file"]),
    ("dense", "rows0.json", ["rows0.json: nothing to draw", "no rows"]),
    ("decode", "rows0.json", ["rows0.json: nothing to draw", "no rows"]),
    ("varlen", "rows0.json", ["rows0.json: nothing to draw", "no rows"]),
    ("mods", "cases0.json", ["cases0.json: nothing to draw", "no cases"]),
    ("mods", "rows0.json", ["not a mods_bench.py result", "no 'cases'"]),
    ("dense", "list.json", ["not a flashgen bench JSON", "entry 0"]),
    ("mods", "mods_failed.json", ["nothing to draw as a mods_bench.py result", "fwd_tflops"]),
    ("varlen", "varlen_failed.json", ["nothing to draw as a varlen_bench.py result", "fwd_tflops"]),
])
def test_plot_refuses_bad_input_files(kind, name, words, tmp_path, capsys):
    _files(tmp_path)
    out = tmp_path / "out"
    _refused(["plot", kind, str(tmp_path / name), "--out", str(out)], capsys, f"plot {kind}", "input ", *words)
    assert not out.exists()


@pytest.mark.parametrize("kind, src, words", [
    ("dense", VARLEN, ["not a flashgen bench JSON", "no 'case'"]),
    ("dense", MODS, ["not a flashgen bench JSON", "no 'rows'"]),
    ("decode", VARLEN, ["not a decode_bench.py result", "no 'batch'"]),
    ("decode", BENCH, ["not a decode_bench.py result", "no 'batch'"]),
    ("mods", VARLEN, ["not a mods_bench.py result", "no 'cases'"]),
    ("mods", DECODE, ["not a mods_bench.py result", "no 'cases'"]),
    ("varlen", MODS, ["not a varlen_bench.py result", "no 'rows'"]),
    # the reported case: a decode result drawn as ragged batches gave an empty figure
    ("varlen", DECODE, ["not a varlen_bench.py result", "no 'label'"]),
    ("varlen", BENCH, ["not a varlen_bench.py result"]),
])
def test_plot_refuses_a_result_of_another_kind(kind, src, words, tmp_path, capsys):
    out = tmp_path / "out"
    _refused(["plot", kind, src, "--out", str(out)], capsys, src, *words)
    assert not out.exists()


def test_plot_refuses_a_bad_file_among_good_ones_before_drawing(tmp_path, capsys):
    out = tmp_path / "out"
    _refused(["plot", "varlen", VARLEN, DECODE, "--out", str(out)], capsys, DECODE)
    assert not out.exists()


def test_plot_refuses_an_out_that_is_a_file(tmp_path, capsys):
    f = tmp_path / "mine.txt"
    f.write_text("keep me")
    _refused(["plot", "varlen", VARLEN, "--out", str(f)], capsys, f"--out {f}", "not a directory")
    assert f.read_text() == "keep me"


def test_a_suite_refuses_an_out_that_is_a_file(tmp_path, capsys, monkeypatch):
    f = tmp_path / "mine.txt"
    f.write_text("keep me")
    main = _main()
    monkeypatch.setattr(main.subprocess, "call", lambda *a, **k: pytest.fail("a step ran"))
    _refused(["varlen", "--out", str(f)], capsys, "benchmarks varlen", f"--out {f}", "not a directory")
    assert f.read_text() == "keep me"


def test_memory_of_a_log_is_refused_before_any_png(tmp_path, capsys):
    out = tmp_path / "out"
    _refused(["plot", "dense", LOG, "--memory", "--out", str(out)], capsys, "--memory", "peak_mem_bytes")
    assert not out.exists()


@pytest.mark.parametrize("kind, src", [("varlen", VARLEN), ("mods", MODS), ("decode", DECODE)])
def test_memory_is_refused_for_other_kinds(kind, src, tmp_path, capsys):
    out = tmp_path / "out"
    _refused(["plot", kind, src, "--memory", "--out", str(out)], capsys, "--memory", "only the dense kind")
    assert not out.exists()


def test_a_bad_input_exits_2_without_a_traceback(tmp_path):
    r = subprocess.run([sys.executable, "-m", "benchmarks", "plot", "dense", str(tmp_path / "nope.json"), "--out",
                        str(tmp_path / "o")], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip() == f"python -m benchmarks plot dense: error: input {tmp_path / 'nope.json'}: no such file"


def test_the_docstrings_plot_example_names_a_kind():
    import plots

    examples = [ln.split()[4] for ln in plots.__doc__.splitlines()
                if ln.strip().startswith("python -m benchmarks plot")]
    assert examples and all(k in plots.KINDS for k in examples), examples


def test_dense_reads_the_older_list_of_shapes(tmp_path, capsys):
    """docs/results/h200/llama3-8b/pointer-loads/bench.json (cited by docs/benchmarks.md):
    a top-level list of shapes with forward and backward cells alone."""
    pytest.importorskip("matplotlib")
    import plots

    before = Path(OLD_BENCH).read_bytes()
    written = plots.dense([OLD_BENCH], tmp_path)
    assert sorted(p.name for p in written) == ["tflops_bwd.png", "tflops_fwd.png"]
    assert "tflops_fwdbwd.png not drawn" in capsys.readouterr().err
    for p in written:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000
    assert Path(OLD_BENCH).read_bytes() == before
    rows = plots.merge_bench.tflops_rows(plots._load(OLD_BENCH, plots._bench_rows))
    assert len(rows) == 40
    first = rows[0]
    assert (first["d"], first["mask"], first["shape"]) == (64, "none", "32x32/32x512")
    assert first["backends"]["flashgen"]["fwd"] == pytest.approx(298.5311273989276)
    assert first["backends"]["flashgen"]["fwdbwd"] is None


def _decode_result(names: list[str]) -> dict:
    rows = []
    for sq in (1, 3):
        for cache in (64, 128):
            rows.append(dict(batch=2, seqlen_q=sq, cache_len=cache, causal=sq > 1,
                             results={n: dict(pct_of_copy=10.0 + i) for i, n in enumerate(names)}))
    return dict(meta={}, rows=rows)


def test_the_legend_of_a_narrow_figure_stays_inside_it(tmp_path):
    """Two panels (decode: batch 2, seqlen_q 1 and 3) and eight backends: the legend's
    columns fit the figure's width."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    import plots

    names = ["flashgen", "flashgen-default", "flashgen-paged", "flashgen-paged-default", "flashgen-attention",
             "flashgen-attention-tiles", "sdpa-flash", "sdpa-cudnn"]
    src = tmp_path / "decode.json"
    src.write_text(json.dumps(_decode_result(names)))
    seen = []
    real = plt.Figure.savefig

    def spy(fig, *a, **k):
        renderer = fig.canvas.get_renderer()
        for leg in fig.legends:
            box = leg.get_window_extent(renderer)
            seen.append((box.x0, box.x1, box.y0, fig.bbox.width, len(leg.get_texts())))
        return real(fig, *a, **k)

    plt.Figure.savefig = spy
    try:
        plots.decode([str(src)], tmp_path)
    finally:
        plt.Figure.savefig = real
    assert len(seen) == 1
    x0, x1, y0, width, n = seen[0]
    assert n == len(names) and x0 >= 0 and x1 <= width and y0 >= 0, seen


def test_a_smoke_run_of_the_exactness_suite_skips_the_gpu_steps(tmp_path, capsys, monkeypatch):
    """--smoke reaches the first step (gpu_exactness.py --smoke); the op checks and the
    determinism check take no --smoke and need a GPU: each skipped with a line."""
    main = _main()
    ran = []
    monkeypatch.setattr(main.subprocess, "call", lambda argv, **k: ran.append(argv[1:]) or 0)
    assert main.main(["exactness", "--out", str(tmp_path), "--", "--smoke"]) == 0
    assert ran == [["benchmarks/gpu_exactness.py", "--out", f"{tmp_path}/exactness.json", "--smoke"]]
    out = capsys.readouterr().out
    for step in suites.SUITES["exactness"].steps[1:]:
        assert f"skipped: python3 {step[0]}" in out


def test_without_smoke_every_step_of_the_exactness_suite_runs(tmp_path, monkeypatch):
    main = _main()
    ran = []
    monkeypatch.setattr(main.subprocess, "call", lambda argv, **k: ran.append(argv[1][len("benchmarks/"):]) or 0)
    assert main.main(["exactness", "--out", str(tmp_path)]) == 0
    assert ran == ["gpu_exactness.py", "gpu_op_checks.py", "determinism.py"]


def test_fwd_config_probe_smoke_runs_without_triton_interpret(tmp_path):
    """probe_fwd_configs.py --smoke sets up Triton's interpreter itself (it failed every
    config with '0 active drivers' when TRITON_INTERPRET was unset)."""
    env = {k: v for k, v in _env().items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "f.json"
    r = subprocess.run([sys.executable, "benchmarks/probe_fwd_configs.py", "--smoke", "--out", str(out)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "active drivers" not in r.stdout + r.stderr and "Traceback" not in r.stderr
    rows = json.loads(out.read_text())["rows"]
    assert rows and all("ms" in x and "error" not in x for x in rows)


def test_fwd_config_probe_without_a_gpu_asks_for_smoke(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present")
    env = {k: v for k, v in _env().items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "benchmarks/probe_fwd_configs.py", "--out", str(tmp_path / "f.json")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--smoke runs Triton's CPU interpreter" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "f.json").exists()


def test_probe_head_group_shape_argument():
    """benchmarks/probe_head_group.py --shape: B,H,HKV,S,D[,causal], checked before any GPU work."""
    import argparse
    import importlib.util

    spec = importlib.util.spec_from_file_location("probe_head_group", ROOT / "benchmarks" / "probe_head_group.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.parse_shape("1,32,8,1024,128,causal") == (1, 32, 8, 1024, 128, True)
    assert mod.parse_shape("4,16,16,4096,64") == (4, 16, 16, 4096, 64, False)
    for bad in ("1,32,8", "1,32,8,1024,128,window", "1,32,6,1024,128", "0,32,8,1024,128", "a,32,8,1024,128"):
        with pytest.raises(argparse.ArgumentTypeError, match="--shape"):
            mod.parse_shape(bad)


def test_ordered_schedule_model_runs_on_the_cpu():
    """benchmarks/ordered_schedule_model.py: the model's table for one shape of two waves,
    where the launcher's rule interleaves every pair and the model finds that best."""
    r = subprocess.run([sys.executable, "benchmarks/ordered_schedule_model.py", "--shape", "1,32,8,2048,2"], cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    row = r.stdout.strip().splitlines()[-1]
    assert row.startswith("1,32,8,2048,2 | 16 | 256 |") and row.endswith("16*:1.00"), row
    bad = subprocess.run([sys.executable, "benchmarks/ordered_schedule_model.py", "--shape", "1,32,8,2000,2"], cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "a multiple of 128" in bad.stderr

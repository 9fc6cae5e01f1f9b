"""benchmarks/merge_bench.py: joining flashgen bench runs (JSON, or the printed table of
a run whose JSON was lost) into one table and issue 4's geometric means."""

import json
import math
import os
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import merge_bench  # noqa: E402

sys.path.pop(0)

LOG = """\
                     TFLOP/s fwd / bwd / fwd+bwd, bfloat16, NVIDIA H200
┏━━━━┳━━━━━━┳━━━━━━━━━━━━━━━━━━━━━━━━━━━┳━━━━━━━━━━━━━━━━━┳━━━━━━━━━━━━━━━━━┳━━━━━━━━━━━━━━━━━━━━━━━━┓
┃ d  ┃ mask ┃ batch x heads/kv x seqlen ┃ flashgen        ┃ sdpa-cudnn      ┃ flashgen max err ratio ┃
┡━━━━╇━━━━━━╇━━━━━━━━━━━━━━━━━━━━━━━━━━━╇━━━━━━━━━━━━━━━━━╇━━━━━━━━━━━━━━━━━╇━━━━━━━━━━━━━━━━━━━━━━━━┩
│ 64 │ none │ 32x32/32x512              │ 300 / 200 / 250 │ 400 / 400 / 500 │ 0.05                   │
│ 64 │ none │ 16x32/32x1024             │ 400 / 300 / 300 │ 400 / 300 / 600 │ 0.04                   │
└────┴──────┴───────────────────────────┴─────────────────┴─────────────────┴────────────────────────┘
               peak memory of one fwd+bwd beyond the inputs (MiB), bfloat16, NVIDIA H200
┃ d  ┃ mask ┃ batch x heads/kv x seqlen ┃ flashgen ┃ sdpa-cudnn ┃
│ 64 │ none │ 32x32/32x512              │ 262      │ 388        │
"""


def _json(path, d, causal, seqlen, fg, cudnn):
    cells = {n: {"fwd_tflops": t[0], "bwd_tflops": t[1], "fwdbwd_tflops": t[2], "error": None}
             for n, t in (("flashgen", fg), ("sdpa-cudnn", cudnn))}
    path.write_text(json.dumps({"meta": {}, "rows": [{"case": dict(batch=16384 // seqlen, num_heads=2048 // d,
                                                                   num_kv_heads=2048 // d, seqlen_q=seqlen,
                                                                   seqlen_k=seqlen, head_dim=d, causal=causal,
                                                                   window=[-1, -1]),
                                                      "dtype": "bfloat16", "cells": cells}]}))


def test_log_and_json_runs_merge_into_one_geomean(tmp_path, capsys):
    log = tmp_path / "q1.log"
    log.write_text(LOG)
    rows = merge_bench.from_log(str(log))
    assert [(r["d"], r["mask"], r["shape"]) for r in rows] == [(64, "none", "32x32/32x512"),
                                                               (64, "none", "16x32/32x1024")]
    assert rows[0]["backends"]["flashgen"] == {"fwd": 300.0, "bwd": 200.0, "fwdbwd": 250.0}
    js = tmp_path / "bench.json"
    _json(js, 128, True, 2048, (500, 400, 400), (625, 400, 400))
    md = tmp_path / "m.md"
    assert merge_bench.main([str(log), str(js), "--markdown", str(md)]) == 0
    text = md.read_text()
    fwd = (0.75 * 1.0 * 0.8) ** (1 / 3)
    bwd = (0.5 * 1.0 * 1.0) ** (1 / 3)
    line = next(ln for ln in text.splitlines() if ln.startswith("| flashgen | sdpa-cudnn |"))
    assert f"{fwd:.3f}x (0.750x)" in line and f"{bwd:.3f}x (0.500x)" in line, line
    assert "| 128 | causal | 0.800x | 1.000x | 1.000x |" in text
    assert math.isclose(merge_bench.geomean([0.5, 2.0]), 1.0)


def test_a_shape_in_two_inputs_is_an_error(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    for p in (a, b):
        _json(p, 64, False, 512, (1, 1, 1), (1, 1, 1))
    with pytest.raises(SystemExit):
        merge_bench.main([str(a), str(b)])


def test_a_log_without_the_table_names_the_file(tmp_path):
    p = tmp_path / "x.log"
    p.write_text("flashgen bench: no CUDA device\n")
    with pytest.raises(ValueError, match="x.log"):
        merge_bench.from_log(str(p))


def test_a_no_check_log_and_a_failed_flashgen_cell_keep_their_rows(tmp_path):
    """Review 5: `flashgen bench --no-check` prints no error-ratio column, and a shape
    whose flashgen cell failed prints '-' there; both tables' rows used to be lost (the
    first an error, the second silently, with the peers' cells of that shape)."""
    lines = LOG.splitlines()
    no_check = [ln.rsplit("┃", 2)[0] + "┃" if ln.startswith("┃") and "err ratio" in ln
                else ln.rsplit("│", 2)[0] + "│" if ln.startswith("│") and "/" in ln else ln for ln in lines]
    p = tmp_path / "nc.log"
    p.write_text("\n".join(no_check) + "\n")
    rows = merge_bench.from_log(str(p))
    assert len(rows) == 2 and rows[1]["backends"]["sdpa-cudnn"] == {"fwd": 400.0, "bwd": 300.0, "fwdbwd": 600.0}
    failed = LOG.replace("│ 300 / 200 / 250 │", "│ OOM             │").replace("│ 0.05                   │",
                                                                           "│ -                      │")
    p.write_text(failed)
    rows = merge_bench.from_log(str(p))
    assert len(rows) == 2 and "flashgen" not in rows[0]["backends"] and "sdpa-cudnn" in rows[0]["backends"]


def test_a_cell_without_a_number_is_left_out_not_a_crash(tmp_path):
    """Review 5: a JSON cell with a null metric (a backend that did not run it) raised
    TypeError; it is left out of that metric's ratios and printed as '-'."""
    js = tmp_path / "bench.json"
    _json(js, 64, False, 512, (300, None, 250), (400, 400, 500))
    md = tmp_path / "m.md"
    assert merge_bench.main([str(js), "--markdown", str(md)]) == 0
    text = md.read_text()
    assert "| 300 / - / 250 |" in text and "| 0.75, - |" in text
    line = next(ln for ln in text.splitlines() if ln.startswith("| flashgen | sdpa-cudnn |"))
    assert line == "| flashgen | sdpa-cudnn | 0.750x (0.750x) | - | 0.500x (0.500x) |", line

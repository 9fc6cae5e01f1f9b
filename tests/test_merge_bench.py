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

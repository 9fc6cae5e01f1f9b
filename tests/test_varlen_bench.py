"""benchmarks/varlen_bench.py --smoke (issue 8): the ragged-batch benchmark runs in
Triton's interpreter on the CPU (documents of 5, 0, 17 and 33 tokens, float16), checks
flashgen's outputs (and Flex's, SDPA's) against the float64 reference before timing,
reports the backends that cannot run on the CPU with a reason, and writes its JSON and
table; a wrong flashgen result makes the exit status nonzero.  The GPU run is the same
code with do_bench timing and compiled Flex."""

import importlib.util
import json
import math
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SCRIPT = os.path.join(ROOT, "benchmarks", "varlen_bench.py")


def _load():
    spec = importlib.util.spec_from_file_location("varlen_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _finite_pos(x):
    return isinstance(x, float) and math.isfinite(x) and x > 0


def test_varlen_bench_smoke(tmp_path):
    out = tmp_path / "varlen.json"
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    p = subprocess.run([sys.executable, SCRIPT, "--smoke", "--out", str(out)], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "TFLOP/s on useful FLOPs" in p.stdout and "all checks ok" in p.stdout
    data = json.loads(out.read_text())
    meta, rows = data["meta"], data["rows"]
    assert meta["interpreter"] and meta["dtype"] == "float16" and "2.5 x fwd" in meta["flops"]
    assert [r["causal"] for r in rows] == [False, True] and rows[1]["num_kv_heads"] < rows[1]["num_heads"]
    for r in rows:
        assert "skipped" not in r and 0 in r["lens"]  # an empty document is in the batch
        h, d, lens = r["num_heads"], r["head_dim"], r["lens"]
        pairs = sum(n * (n + 1) // 2 if r["causal"] else n * n for n in lens)
        assert r["fwd_flops"] == 4 * pairs * d * h and r["fwd_bwd_flops"] == 3.5 * r["fwd_flops"]
        assert r["padded_flops"] > r["fwd_flops"]
        res, checks = r["results"], r["checks"]
        fg = res["flashgen"]
        for kind in ("fwd", "fwd_bwd"):
            assert _finite_pos(fg[f"{kind}_ms"]) and _finite_pos(fg[f"{kind}_tflops"]), fg
            assert _finite_pos(res["sdpa-math"][f"{kind}_tflops"])
        # the backward as the op runs it: on the CPU the Triton family's two kernels
        assert set(fg["configs"]) == {"fwd_varlen", "backward"}
        bwd = fg["configs"]["backward"]
        assert bwd["family"] == "triton" and len(bwd["kernels"]) == 2
        assert bwd["kernels"][0]["key"].startswith("attn_bwd_dq_varlen_")
        assert bwd["kernels"][1]["key"].startswith("attn_bwd_dkdv_varlen_")
        c = checks["flashgen"]
        assert c["ok"] and set(c["outputs"]) == {"O", "LSE", "dQ", "dK", "dV"}
        for o in c["outputs"].values():
            assert math.isfinite(o["max_err"]) and 0 <= o["ratio"] <= 1
        # Flex eager on the CPU: forward checked and timed, its backward refused with the reason
        assert checks["flex"]["ok"] and set(checks["flex"]["outputs"]) == {"O"}
        assert _finite_pos(res["flex"]["fwd_tflops"]) and "backward on CPU" in res["flex"]["fwd_bwd_error"]
        assert res["sdpa-cudnn"]["error"].startswith("Unsupported")
        assert res["sdpa-math"]["exact"] and checks["sdpa-math"]["ok"]
        assert set(checks["sdpa-math"]["outputs"]) == {"O", "dQ", "dK", "dV"}
        assert _finite_pos(r["ratios"]["flashgen/flex fwd"])


def test_varlen_bench_wrong_result_fails(tmp_path, monkeypatch, capsys):
    """A flashgen output off by 1 % fails its check: reported, exit status 1."""
    import flashgen

    mod = _load()
    real = flashgen.attention_varlen

    def off(*a, **kw):
        r = real(*a, **kw)
        return (r[0] * 1.01, r[1]) if isinstance(r, tuple) else r * 1.01
    monkeypatch.setattr(flashgen, "attention_varlen", off)
    out = tmp_path / "v.json"
    assert mod.main(["--smoke", "--out", str(out), "--backends", "flashgen", "--only", "causal"]) == 1
    row, = json.loads(out.read_text())["rows"]
    assert not row["checks"]["flashgen"]["ok"] and row["checks"]["flashgen"]["outputs"]["O"]["ratio"] > 1
    assert "FAILED" in capsys.readouterr().out


def test_varlen_bench_budget_skips(tmp_path):
    """A spent budget skips problems, saying so in the JSON and the table."""
    mod = _load()
    out = tmp_path / "v.json"
    assert mod.main(["--smoke", "--out", str(out), "--budget-s", "0"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 and all("time budget" in r["skipped"] and not r["results"] for r in rows)


def test_mask_or_unmasked():
    """A backend refusing the key-padding mask is timed unmasked (and the refusal kept);
    one that refuses both keeps the masked fn, whose error the first call reports."""
    mod = _load()

    def refuses(*_):
        raise RuntimeError("no kernel; attn_mask not supported")

    def runs(*_):
        return 0
    assert mod._mask_or_unmasked(runs, lambda: refuses, ()) == (runs, None)
    assert mod._mask_or_unmasked(refuses, lambda: runs, ()) == (runs, "no kernel; attn_mask not supported")
    assert mod._mask_or_unmasked(refuses, lambda: refuses, ()) == (refuses, None)


def test_the_grid_probe_names_the_skewed_and_short_batches_and_compares_two_runs(tmp_path, capsys):
    """benchmarks/probe_varlen_grid.py: its problems hold the suite's skewed batch, a
    batch of more than 128 short documents (the packed layout's search crosses chunks) and
    the varlen-docs keys; ``--compare`` prints each (problem, tile) with both files' times
    and the first over the last."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location("probe_varlen_grid",
                                                      os.path.join(ROOT, "benchmarks", "probe_varlen_grid.py"))
        P = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(P)
        probs = {name: (d, mask, heads, lens) for name, d, mask, heads, lens in P._problems()}
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    assert "mix d128 h16 causal" in probs and max(probs["mix d128 h16 causal"][3]) > 2048
    short = [v for k, v in probs.items() if k.startswith("short")]
    assert short and all(len(v[3]) > 128 and max(v[3]) <= 96 for v in short)
    assert sum(k.startswith("varlen-docs") for k in probs) == 10
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps([dict(label="per-sequence", problem="mix", tile="default", ms=0.6)]))
    b.write_text(json.dumps([dict(label="packed", problem="mix", tile="default", ms=0.4)]))
    P.compare([str(a), str(b)])
    out = capsys.readouterr().out
    assert "| per-sequence ms | packed ms |" in out and "| mix | default | 0.6000 | 0.4000 | 1.500x |" in out

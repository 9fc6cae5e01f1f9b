"""benchmarks/mods_bench.py (flashgen's score mods against FlexAttention and SDPA):
``--smoke`` runs the GPU run's code paths on the CPU in Triton's interpreter, in a
subprocess as on a GPU, and its JSON says what ran, what was checked against
float64, and what was skipped and why."""

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SCRIPT = os.path.join(ROOT, "benchmarks", "mods_bench.py")
MODS = ("plain", "softcap", "alibi", "bias", "dropout")


def _run(args, tmp_path, prelude=None):
    out = tmp_path / "mods.json"
    env = {**os.environ, "PYTHONPATH": ROOT, "TRITON_INTERPRET": "1"}
    if prelude is None:
        cmd = [sys.executable, SCRIPT, "--smoke", "--out", str(out), *args]
    else:  # patch something, then run the script as __main__
        code = (f"import runpy, sys\n{prelude}\nsys.argv = {[SCRIPT, '--smoke', '--out', str(out), *args]!r}\n"
                f"runpy.run_path({SCRIPT!r}, run_name='__main__')")
        cmd = [sys.executable, "-c", code]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    data = json.loads(out.read_text()) if out.exists() else None
    return p, data


def _finite(*xs):
    return all(isinstance(x, float) and math.isfinite(x) and x > 0 for x in xs)


def test_smoke_runs_every_case_and_checks_against_float64(tmp_path):
    p, data = _run([], tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    meta, cases = data["meta"], data["cases"]
    assert meta["interpreter"] and meta["dtype"] == "float16" and meta["wall_s"] > 0
    assert [(c["mod"], c["causal"]) for c in cases] == [(m, c) for c in (False, True) for m in MODS]
    for c in cases:
        label, res = c["label"], c["results"]
        assert "skipped" not in c and "error" not in c, label
        assert (c["batch"], c["num_heads"], c["seqlen_q"], c["seqlen_k"], c["head_dim"]) == (1, 2, 33, 47, 16)
        assert c["flops"]["fwdbwd"] == pytest.approx(3.5 * c["flops"]["fwd"])
        # flashgen: forward and backward timed, checked against float64, in the interpreter
        fg = res["flashgen"]
        assert "error" not in fg, (label, fg)
        assert _finite(fg["fwd_ms"], fg["fwdbwd_ms"], fg["fwd_tflops"], fg["fwdbwd_tflops"]), (label, fg)
        assert fg["check"]["ok"] and set(fg["check"]["outputs"]) == {"O", "dQ", "dK", "dV"}, (label, fg["check"])
        assert _finite(fg["check"]["ratio"]) and fg["check"]["ratio"] <= 1
        mods = "" if c["mod"] == "plain" else "_" + c["mod"]
        assert fg["fwd_key"].startswith(f"attn_fwd_d16_fp16_{'causal' if c['causal'] else 'none'}{mods}_g1_")
        # FlexAttention (score_mod), uncompiled on the CPU: forward only, checked
        if c["mod"] == "dropout":
            assert "flex" not in res and "no dropout" in c["unsupported"]["flex"]
        else:
            fx = res["flex"]
            assert "error" not in fx, (label, fx)
            assert fx["check"]["ok"] and set(fx["check"]["outputs"]) == {"O"}, (label, fx["check"])
            assert _finite(fx["fwd_tflops"]) and "unsupported" in fx["fwdbwd"]
            assert _finite(c["ratios"]["flashgen/flex_fwd"])
        # SDPA: no softcap; the CPU has its math backend (checked; dropout timed only),
        # and the GPU backends record torch's refusal
        if c["mod"] == "softcap":
            assert "soft-capping" in c["unsupported"]["sdpa"]
            assert not any(n.startswith("sdpa") for n in res)
        else:
            m = res["sdpa-math"]
            assert _finite(m["fwd_ms"], m["fwdbwd_ms"]), (label, m)
            assert ("check" in m) == (c["mod"] != "dropout") and m.get("check", {"ok": True})["ok"], (label, m)
            assert "error" in res["sdpa-efficient" if c["mod"] != "plain" else "sdpa-cudnn"]
            assert c["ratios"]["best_sdpa_fwd"].startswith("sdpa-")
            assert _finite(c["ratios"]["flashgen/best_sdpa_fwd"], c["ratios"]["flashgen/best_sdpa_fwdbwd"])
        if c["mod"] in ("alibi", "bias"):
            assert "materialized" in res["sdpa-math"]["attn_mask"]
    assert "flashgen float64 checks: 10 ok, 0 failed" in p.stdout
    assert "fg/flex" in p.stdout.split("TFLOP/s fwd|fwd+bwd")[-1]  # the table comes last


def test_budget_spent_skips_cases_with_the_reason(tmp_path):
    p, data = _run(["--budget-s", "0", "--mods", "bias,dropout"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert len(data["cases"]) == 4
    assert all("time budget (0 s) spent" in c["skipped"] and not c["results"] for c in data["cases"])
    assert "0/4 cases measured" in p.stdout


def test_a_wrong_flashgen_result_fails_the_run(tmp_path):
    prelude = ("import flashgen\n_a = flashgen.attention\n"
               "flashgen.attention = lambda q, k, v, **kw: _a(q, k, v, **kw) * 1.05")
    p, data = _run(["--mods", "softcap", "--causal", "yes", "--backends", "flashgen"], tmp_path, prelude)
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    fg = data["cases"][0]["results"]["flashgen"]
    assert not fg["check"]["ok"] and fg["check"]["ratio"] > 1
    assert "FAILED flashgen on softcap d16 s33/47 b1 causal" in p.stdout


def test_single_mod_presets_split_mods_bench():
    """mods-<mod> presets (a re-tune of one score mod) are mods-bench's entries of that
    mod, and together they are all of mods-bench."""
    from flashgen import presets
    whole = presets.PRESETS["mods-bench"]()
    parts = {m: presets.PRESETS[f"mods-{m}"]() for m in ("softcap", "alibi", "bias", "dropout")}
    for m, entries in parts.items():
        assert entries and all(e[3] == m for e in entries)
        assert f"mods-{m}" in presets.MODS_PRESETS
    assert sorted(map(repr, whole)) == sorted(repr(e) for es in parts.values() for e in es)


def test_mods_bench_preset_covers_the_scripts_default_shapes():
    """`flashgen tune --preset mods-bench` tunes every (head_dim, seqlen) mods_bench.py
    runs by default (untuned, its head_dim 64 cases ran on rows of other modes, the
    dropout one at 0.21x SDPA-flash); mods-d64 is the head_dim 64 part alone."""
    from flashgen import presets

    import ast
    tree = ast.parse(open(SCRIPT).read())
    shapes = next(n.value.value for n in tree.body if isinstance(n, ast.Assign)
                  and any(getattr(t, "id", "") == "SHAPES" for t in n.targets))
    assert shapes == ",".join(f"{d}:{n}" for d, n in presets.MODS_BENCH_SHAPES)
    whole = presets.PRESETS["mods-bench"]()
    assert {(d, s.seqlen_q) for d, _, s, _ in whole} == set(presets.MODS_BENCH_SHAPES)
    d64 = presets.PRESETS["mods-d64"]()
    assert "mods-d64" in presets.MODS_PRESETS
    assert d64 and sorted(map(repr, d64)) == sorted(repr(e) for e in whole if e[0] == 64)
    assert {e[3] for e in d64} == {"softcap", "alibi", "bias", "dropout"} and {e[1] for e in d64} == {"none", "causal"}

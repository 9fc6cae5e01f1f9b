"""The command line, through typer's CliRunner (fake benchmarker; no GPU)."""

import json
import sqlite3

import pytest
import torch
from typer.testing import CliRunner

import flashgen
from flashgen import presets, render, space
from flashgen.cli import app
from flashgen.spec import Variant

runner = CliRunner(env={"COLUMNS": "250"})


@pytest.fixture(autouse=True)
def template_hashes(monkeypatch):
    monkeypatch.setattr(render, "template_hash", lambda k, mods="": f"tmpl-{k}-{mods}")


@pytest.fixture
def timings(tmp_path):
    """Fake timings (ms) for every variant of the ``small`` preset's keys."""
    t = {}
    for key, _ in presets.expand(["small"]):
        for i, cfg in enumerate(space.configs(key.spec.kernel)):
            t[Variant(key.spec, cfg).id] = 1.0 + (i * 7919 % 97) / 10
    p = tmp_path / "timings.json"
    p.write_text(json.dumps(t))
    return p


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def n_rows(path):
    return sqlite3.connect(path).execute("SELECT COUNT(*) FROM measurements").fetchone()[0]


def test_tune_fake_then_show(tmp_path, timings):
    db = tmp_path / "user.sqlite"
    r = invoke("tune", "--preset", "small", "--fake", timings, "--db", db, "--trials", 5)
    assert r.exit_code == 0, r.output
    keys = [k.id for k, _ in presets.expand(["small"])]
    assert all(k in r.output for k in keys) and "speedup" in r.output
    assert n_rows(db) >= len(keys)

    r = invoke("show", "--db", db)
    assert r.exit_code == 0, r.output
    assert all(k in r.output for k in keys)
    assert "(fake)" in r.output  # replayed timings never pose as the real GPU's
    assert "rows per status: " in r.output and "ok " in r.output

    r = invoke("show", "--db", db, "--key", "bwd_dq", "--all")
    assert r.exit_code == 0, r.output
    shown = [k for k in keys if k in r.output]
    assert shown and all("bwd_dq" in k for k in shown)


def test_tune_only_the_named_kernels(tmp_path, timings):
    db = tmp_path / "user.sqlite"
    r = invoke("tune", "--preset", "small", "--fake", timings, "--db", db, "--trials", 2,
               "--kernels", "bwd_dkdv")
    assert r.exit_code == 0, r.output
    kernels = {k for (k,) in sqlite3.connect(db).execute("SELECT DISTINCT kernel FROM measurements")}
    assert kernels == {"bwd_dkdv"}


def test_tune_only_the_keys_named_by_substring(tmp_path, timings):
    db = tmp_path / "user.sqlite"
    small = [k.id for k, _ in presets.expand(["small"], kernels=["fwd"])]
    want = [k for k in small if "causal" in k]
    assert want and len(want) < len(small)
    r = invoke("tune", "--preset", "small", "--fake", timings, "--db", db, "--trials", 2, "--kernels", "fwd",
               "--key", "causal")
    assert r.exit_code == 0, r.output
    keys = {k for (k,) in sqlite3.connect(db).execute("SELECT DISTINCT key FROM measurements")}
    assert keys == set(want)
    r = invoke("tune", "--preset", "small", "--fake", timings, "--db", db, "--key", "no_such_key")
    assert r.exit_code != 0 and "--key" in r.output and "no_such_key" in r.output
    r = invoke("tune", "--preset", "small", "--fake", timings, "--db", db, "--key", ",")
    assert r.exit_code == 2 and "names no substring" in r.output, r.output
    assert n_rows(db) > 0 and {k for (k,) in sqlite3.connect(db).execute("SELECT DISTINCT key FROM measurements")} \
        == set(want)


def test_merge(tmp_path, timings):
    a, out = tmp_path / "a.sqlite", tmp_path / "out.sqlite"
    assert invoke("tune", "--preset", "small", "--fake", timings, "--db", a, "--trials", 3,
                  "--kernels", "fwd").exit_code == 0
    r = invoke("merge", out, a)
    assert r.exit_code == 0, r.output
    assert f"{n_rows(a)} rows added" in r.output and n_rows(out) == n_rows(a)
    assert "0 rows added" in invoke("merge", out, a).output


@pytest.mark.parametrize("args, name", [
    (["tune", "--preset", "nope"], "--preset"),
    (["tune", "--kernels", "fwd,backward"], "--kernels"),  # (bwd is the whole backward: a kernel name)
    (["tune", "--family", "cuda"], "--family"),
    (["tune", "--preset", "mods-dropout", "--kernels", "decode"], "--kernels"),  # no keys: not a silent no-op
    (["tune", "--preset", "decode-small", "--kernels", "fwd"], "--kernels"),  # nor the decode keys --kernels left out
    (["tune", "--dtype", "int8"], "--dtype"),
    (["tune", "--trials", "0"], "--trials"),
    (["tune", "--fake", "missing.json"], "--fake"),
    (["show", "--db", "missing.sqlite"], "--db"),
    (["merge", "out.sqlite", "missing.sqlite"], "'IN'"),  # the name the help gives it (Append to OUT the rows of each IN)
])
def test_bad_arguments_are_named(tmp_path, monkeypatch, args, name):
    monkeypatch.chdir(tmp_path)
    r = invoke(*args)
    assert r.exit_code == 2 and name in r.output, r.output
    assert not (tmp_path / "flashgen_tuning.sqlite").exists()


def test_bad_fake_file_is_named(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    r = invoke("tune", "--preset", "small", "--fake", bad, "--db", tmp_path / "x.sqlite")
    assert r.exit_code == 2 and "--fake" in r.output, r.output


def test_real_benchmarker_refused_without_cuda(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    r = invoke("tune", "--preset", "small", "--db", tmp_path / "x.sqlite")
    assert r.exit_code == 2 and "no CUDA device" in r.output
    assert not (tmp_path / "x.sqlite").exists()


def test_tune_fake_model_runs_the_whole_path_and_explain_picks_its_rows(tmp_path):
    """No GPU and no hand-made file: studies, table, database, then explain."""
    import shlex

    db = tmp_path / "t.sqlite"
    r = invoke("tune", "--preset", "small", "--fake-model", "--db", db, "--trials", 3)
    assert r.exit_code == 0, r.output
    keys = [k.id for k, _ in presets.expand(["small"])]
    assert all(k in r.output for k in keys) and "speedup" in r.output and "(model)" in r.output
    statuses = {s for (s,) in sqlite3.connect(db).execute("SELECT DISTINCT status FROM measurements")}
    assert "ok" in statuses and statuses <= {"ok", "invalid", "infeasible"}
    (hint,) = [line for line in r.output.splitlines() if "flashgen explain" in line]
    r = invoke(*shlex.split(hint.split("flashgen ", 1)[1]))
    assert r.exit_code == 0, r.output
    assert r.output.count("(tuned; row attn_") == 3 and str(db) in r.output, r.output


def test_simulated_archs_in_one_db_search_their_own_studies(tmp_path):
    """``--arch sm_80`` then ``--arch sm_86`` into one DB (one simulated GPU name): each
    arch's study is its own (the second counted the first's trials and measured only the
    default under its own rules)."""
    db = tmp_path / "a.sqlite"
    for arch in ("sm_80", "sm_86"):
        r = invoke("tune", "--preset", "small", "--kernels", "fwd", "--fake-model", "--arch", arch, "--db", db,
                   "--trials", 3)
        assert r.exit_code == 0, r.output
    rows = sqlite3.connect(db).execute("SELECT compute_capability, key, COUNT(*) FROM measurements "
                                       "GROUP BY compute_capability, key").fetchall()
    assert {cc for cc, _, _ in rows} == {"8.0", "8.6"} and all(n >= 3 for _, _, n in rows), rows


def test_a_worker_with_its_own_database_joins_a_shared_storage_after_another_measured(tmp_path):
    """Workers on several machines share the studies through one storage, each writing
    its own database: a worker that starts after another measured a key's trials finds
    their rows in the other's database, not its own, and tunes (it stopped with "was
    the DB replaced?"); its own database's place is what the check reads."""
    journal = tmp_path / "shared.journal"
    for name in ("a", "b"):
        r = invoke("tune", "--preset", "small", "--kernels", "fwd", "--fake-model", "--db", tmp_path / f"{name}.sqlite",
                   "--storage", journal, "--trials", 3)
        assert r.exit_code == 0, r.output
    rows = {n: sqlite3.connect(tmp_path / f"{n}.sqlite").execute("SELECT COUNT(*) FROM measurements").fetchone()[0]
            for n in "ab"}
    assert rows["a"] >= 3 * 2 and rows["b"] >= 2, rows  # b measured each key's default at least
    (tmp_path / "a.sqlite").unlink()  # and a's own database deleted is still refused at its place
    r = invoke("tune", "--preset", "small", "--kernels", "fwd", "--fake-model", "--db", tmp_path / "a.sqlite",
               "--storage", journal, "--trials", 3)
    assert r.exit_code == 2 and "was the DB replaced?" in r.output, r.output


@pytest.mark.parametrize("how", ["another", "deleted", "emptied", "import-replace", "import-replace-aligned",
                                 "import-replace-own"])
def test_a_resumed_tune_whose_db_was_replaced_stops_before_writing(tmp_path, how):
    """The Optuna journal kept beside a database that was replaced (another database's
    rows, whose ids restart at 1 too), deleted, or whose rows ``import --replace``
    replaced at some keys: the resumed tune stops before its first key, naming the
    storage, before any row is written (every key's study is checked first: a key whose
    trials still name rows would otherwise be tuned and written before the stale one),
    instead of counting the old trials and searching nothing.  "emptied": the user's
    database left as an empty file, which the stopped run leaves empty (it once kept the
    schema it wrote, in WAL mode).  "import-replace-aligned":
    both tunes of the same kernels and trial counts, so every replaced row's id, key and
    variant (the default's, each key's first) recur in the new rows: the measurement
    time tells them apart.  "import-replace-own": the database's own best rows exported
    and imported back with ``--replace``, which replaces some of each key's rows (the
    check once stopped only when none was left: the replaced trials counted, and their
    configs were not measured again)."""
    import shutil

    db = tmp_path / "p.sqlite"
    kernels = ["--kernels", "fwd"] if how == "import-replace-aligned" else []
    r = invoke("tune", "--preset", "small", "--fake-model", "--db", db, "--trials", 1 if how == "import-replace" else 3,
               *kernels)
    assert r.exit_code == 0, r.output
    other = tmp_path / "other.sqlite"
    if how == "import-replace-own":
        r = invoke("export", other.with_suffix(".json"), db)
        other = other.with_suffix(".json")
    elif how.startswith("import-replace"):  # every key, other configs
        r = invoke("tune", "--preset", "small", "--fake-model", "--db", other, "--trials", 3,
                   "--seed", 5 if kernels else 3, *kernels)
    else:
        r = invoke("tune", "--preset", "small", "--kernels", "bwd_dq", "--fake-model", "--db", other, "--trials", 3)
    assert r.exit_code == 0, r.output
    if how.startswith("import-replace"):
        r = invoke("import", other, "--db", db, "--replace")
        assert r.exit_code == 0, r.output
    elif how == "emptied":
        db.write_bytes(b"")
    else:
        db.unlink()
    if how == "another":
        shutil.copy(other, db)
    before = sqlite3.connect(db).execute("SELECT COUNT(*) FROM measurements").fetchone()[0] if db.exists() and db.stat().st_size else 0
    r = invoke("tune", "--preset", "small", "--fake-model", "--db", db, "--trials", 3 + 2 * bool(kernels), *kernels)
    assert r.exit_code == 2 and "was the DB replaced?" in r.output, r.output
    if how == "deleted":
        assert not db.exists() and not list(tmp_path.glob("p.sqlite-*"))  # nothing written, no side files
    elif how == "emptied":
        assert db.stat().st_size == 0 and not list(tmp_path.glob("p.sqlite-*"))
    else:
        assert sqlite3.connect(db).execute("SELECT COUNT(*) FROM measurements").fetchone()[0] == before


def test_write_failures_are_one_line(tmp_path, monkeypatch):
    """A template path that cannot be written (under a file here; a read-only file system
    alike) and a kernel cache directory that is a file: one line naming the path, exit
    code 2 / InputError, and the user's file unchanged."""
    blocker = tmp_path / "afile"
    blocker.write_text("mine")
    r = invoke("tune", "--preset", "small", "--fake-template", blocker / "t.json")
    assert r.exit_code == 2 and "cannot write" in r.output and "Traceback" not in r.output, r.output
    from flashgen import compile as fg_compile

    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(blocker))
    with pytest.raises(flashgen.InputError, match="FLASHGEN_CACHE_DIR"):
        fg_compile.write_source(fg_compile.cache_dir() / "generated" / "x" / "k.py", "pass\n")
    assert blocker.read_text() == "mine"


def test_a_fake_file_lacking_variants_lists_them_all_and_a_template_fills_them(tmp_path):
    from flashgen import arch, tuner

    items = presets.expand(["small"], "bfloat16", ["fwd"])
    needed = [v.id for v in tuner.feasible_variants([k for k, _ in items], arch.current())]
    part = tmp_path / "part.json"
    part.write_text(json.dumps({needed[0]: 1.0, needed[5]: 2.0}))
    db = tmp_path / "t.sqlite"
    r = invoke("tune", "--preset", "small", "--kernels", "fwd", "--fake", part, "--db", db, "--trials", 2)
    assert r.exit_code == 2 and f"lacks timings for {len(needed) - 2} variant(s)" in r.output, r.output
    listed = [line.strip() for line in r.output.splitlines() if line.startswith("  ")]
    assert listed == [v for v in needed if v not in (needed[0], needed[5])]  # all of them, in one run
    assert not db.exists()
    tmpl = tmp_path / "tmpl.json"
    r = invoke("tune", "--preset", "small", "--kernels", "fwd", "--fake-template", tmpl)
    assert r.exit_code == 0 and f"wrote {len(needed)} variant ids" in r.output, r.output
    assert sorted(json.loads(tmpl.read_text())) == sorted(needed) and not db.exists()
    assert invoke("tune", "--preset", "small", "--fake-template", tmpl).exit_code == 2  # never overwrites
    r = invoke("tune", "--preset", "small", "--kernels", "fwd", "--fake", tmpl, "--db", db, "--trials", 2)
    assert r.exit_code == 0 and "(fake)" in r.output, r.output
    r = invoke("tune", "--preset", "small", "--fake", tmpl, "--fake-model", "--db", db)
    assert r.exit_code == 2 and "--fake-model" in r.output


@pytest.mark.parametrize("command", ["tune", "show", "merge", "export", "import", "bench", "iomodel", "explain"])
def test_help_shows_flags_as_flags_and_lists_the_dtypes(command):
    r = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "<bool>" not in r.output
    if command in ("tune", "bench", "iomodel", "explain"):
        assert "--dtype <float16|bfloat16|float32>" in r.output
    flags = {"explain": ["--causal "], "bench": ["--plots / --no-plots", "--check / --no-check"],
             "show": ["--all "], "iomodel": ["--causal / --no-causal"], "tune": ["--fake-model "]}
    for f in flags.get(command, []):
        assert f"  {f}" in r.output, (f, r.output)


def test_refine_measures_the_tuned_winners_with_each_value_of_the_named_knobs(tmp_path):
    db = tmp_path / "t.sqlite"
    base = ["tune", "--preset", "llama3-8b", "--kernels", "bwd", "--family", "gluon", "--fake-model",
            "--arch", "sm_90", "--db", db]
    assert invoke(*base, "--trials", "1").exit_code == 0  # the heuristic default of each key
    con = sqlite3.connect(db)
    keys = {k for (k,) in con.execute("SELECT DISTINCT key FROM measurements")}
    assert keys and not con.execute("SELECT COUNT(*) FROM measurements WHERE variant_id LIKE '%_gs%'").fetchone()[0]
    r = invoke(*base, "--refine", "group_split,half_partials")
    assert r.exit_code == 0, r.output
    assert "refining group_split, half_partials" in r.output
    # GQA group 4: splits 2 and 4, each with float32 and 16-bit partials, per key
    per_key = dict(con.execute("SELECT key, COUNT(DISTINCT variant_id) FROM measurements "
                               "WHERE variant_id LIKE '%_gs%' GROUP BY key").fetchall())
    assert per_key == {k: 4 for k in keys}
    # refining again measures nothing new (the rows are reused)
    n = con.execute("SELECT COUNT(*) FROM measurements").fetchone()[0]
    assert invoke(*base, "--refine", "group_split,half_partials").exit_code == 0
    assert con.execute("SELECT COUNT(*) FROM measurements").fetchone()[0] == n


def test_a_gluon_study_whose_knob_values_changed_is_a_new_study(tmp_path, monkeypatch):
    """A study of the Gluon forward started when a knob offered fewer values (ctas_per_sm
    without 3) is not resumed with the new choices (Optuna refuses a categorical
    parameter whose choices changed): the new run opens another study, and the old
    run's rows still answer its trials."""
    from flashgen.families.gluon.family import GluonFamily

    db = tmp_path / "t.sqlite"
    base = ["tune", "--preset", "small", "--kernels", "fwd", "--family", "gluon", "--fake-model", "--arch", "sm_90",
            "--db", db]
    new_domain = GluonFamily.domain

    def old_domain(self, key):
        dom = new_domain(self, key)
        return {**dom, "ctas_per_sm": (0, 2)} if key.spec.kernel == "fwd" else dom

    monkeypatch.setattr(GluonFamily, "domain", old_domain)
    r = invoke(*base, "--trials", "3")
    assert r.exit_code == 0, r.output
    monkeypatch.setattr(GluonFamily, "domain", new_domain)
    r = invoke(*base, "--trials", "6")
    assert r.exit_code == 0, r.output


def test_refine_names_a_bad_knob(tmp_path):
    r = invoke("tune", "--fake-model", "--arch", "sm_90", "--db", tmp_path / "t.sqlite", "--refine", "warp_count")
    assert r.exit_code == 2 and "--refine" in r.output and "warp_count" in r.output


def test_refine_without_tuned_rows_says_so(tmp_path):
    """--refine starts from tuned rows: with none (a fresh path, or rows of another
    device) it stops with one line, creating nothing; then the ordered dQ of the Gluon
    backward is measured beside each tuned row (--refine dq_ordered)."""
    db = tmp_path / "t.sqlite"
    base = ["tune", "--preset", "llama3-8b", "--kernels", "bwd", "--family", "gluon", "--fake-model",
            "--arch", "sm_90", "--db", db]
    r = invoke(*base, "--refine", "dq_ordered")
    assert r.exit_code == 2 and "holds no tuned row" in r.output and not db.exists(), r.output
    assert invoke(*base, "--trials", "1").exit_code == 0
    r = invoke(*base, "--refine", "dq_ordered")
    assert r.exit_code == 0, r.output
    con = sqlite3.connect(db)
    keys = {k for (k,) in con.execute("SELECT DISTINCT key FROM measurements")}
    ordered = dict(con.execute("SELECT key, COUNT(*) FROM measurements WHERE dq_ordered = 1 AND status = 'ok' "
                               "GROUP BY key").fetchall())
    assert ordered == {k: 1 for k in keys}


@pytest.mark.parametrize("preset, words", [("mods-small", ("--softcap 30", "--alibi")),
                                           ("decode-small", ("see them: flashgen show --db",))])
def test_the_explain_hint_shows_what_the_run_tuned(tmp_path, preset, words):
    """The hint after a simulated run names the score mods of the key it explains (and
    that explain then finds its tuned rows); for keys explain cannot show (decode) it
    points to `flashgen show`.  A path with a space is quoted."""
    import shlex

    db = tmp_path / "my rows.sqlite"
    r = invoke("tune", "--preset", preset, "--fake-model", "--db", db, "--trials", 2)
    assert r.exit_code == 0, r.output
    (hint,) = [line for line in r.output.splitlines() if "these rows are for the device" in line]
    assert all(w in hint for w in words) and shlex.quote(str(db)) in hint, hint
    r = invoke(*shlex.split(hint.split("flashgen ", 1)[1]))
    assert r.exit_code == 0, r.output
    if "flashgen explain" in hint:
        assert r.output.count("(tuned; row attn_") == 3, r.output
    else:
        assert "attn_decode" in r.output, r.output


@pytest.mark.parametrize("args, words", [
    (["--head-dim", "0"], ["'--head-dim'", "multiple of 8 in [8, 256]"]),
    (["--head-dim", "64", "--head-dim-v", "-8"], ["'--head-dim-v'", "multiple of 8 in [8, 256]"]),
    (["--head-dim", "64", "--gpu", " "], ["'--gpu'", "the GPU name is empty"]),
])
def test_explain_names_the_rule_of_a_bad_option(args, words):
    res = runner.invoke(app, ["explain", "--batch", "1", "--heads", "4", "--kv-heads", "2", "--seqlen-q", "16",
                              "--seqlen-k", "16", *args])
    assert res.exit_code == 2 and all(w in res.output for w in words), res.output


def test_merge_points_an_export_to_import(tmp_path):
    exp = tmp_path / "x.json"
    exp.write_text('{"flashgen_export": 1, "rows": []}')
    out = tmp_path / "m.sqlite"
    res = runner.invoke(app, ["merge", str(out), str(exp)])
    assert res.exit_code == 2 and "flashgen import" in res.output and not out.exists(), res.output


def test_a_stopped_single_process_tune_logs_its_interrupted_trial_in_one_line(tmp_path):
    """Inside a tuning run (cli._stoppable) Optuna's record of the interrupted trial
    keeps its one line, without the KeyboardInterrupt's traceback (as the workers'
    records do); other records keep their tracebacks; the filter goes with the run."""
    import io
    import logging

    import optuna  # noqa: F401 (its logger's handler)
    from rich.console import Console

    from flashgen import cli

    log = logging.getLogger("optuna")
    assert log.handlers
    stream = io.StringIO()
    handler = log.handlers[0]
    # the attributes, not setStream(): that flushes the old stream; and a plain formatter:
    # Optuna's colored one asks the stderr it was made with, which an earlier test's
    # capture may have closed, whether it is a terminal
    old = handler.stream, handler.formatter, log.level
    handler.stream, handler.formatter = stream, logging.Formatter("%(message)s")
    log.setLevel(logging.WARNING)  # a tune run earlier in this process may have quieted Optuna
    try:
        def emit(exc):
            try:
                raise exc
            except BaseException:
                log.warning("Trial 3 failed with parameters: {} because of the following error: %r.", exc,
                            exc_info=True)

        with cli._stoppable(Console(file=io.StringIO()), tmp_path / "x.sqlite"):
            emit(KeyboardInterrupt())
            emit(ValueError("boom"))
        emit(KeyboardInterrupt())
    finally:
        handler.stream, handler.formatter = old[:2]
        log.setLevel(old[2])
    lines = stream.getvalue().splitlines()
    first, rest = lines[0], "\n".join(lines[1:])
    assert "KeyboardInterrupt()" in first and not first.startswith("Traceback")
    tracebacks = rest.count("Traceback (most recent call last)")
    assert tracebacks == 2, stream.getvalue()  # the ValueError's, and the one logged after the run


@pytest.mark.parametrize("args, where", [
    (["show", "--db", ""], "the argument after '--db'"),
    (["show", "--db="], "--db"),
    (["import", ""], "the argument after 'import'"),
    (["merge", "out.sqlite", ""], "the argument after 'out.sqlite'"),
])
def test_an_empty_path_is_named_as_empty(tmp_path, monkeypatch, capsys, args, where):
    """click reads "" as the current directory ("file '' is a directory"): the entry
    point names the empty value instead, and nothing is written."""
    import sys

    from flashgen import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["flashgen", *args])
    with pytest.raises(SystemExit) as exc:
        cli.main()
    assert exc.value.code == 2
    assert f"{where} is empty" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_value_that_ends_in_an_equals_sign_is_not_empty():
    from flashgen import cli

    assert cli._empty_argument(["show", "--db=/tmp/runs/a=", "--key", "x="]) is None
    assert cli._empty_argument(["show", "--db="]) == "--db"


def test_a_tune_without_time_for_trials_counts_the_default(tmp_path):
    r = invoke("tune", "--preset", "small", "--kernels", "fwd", "--fake-model", "--arch", "sm_90",
               "--timeout-per-key", "0", "--db", tmp_path / "t.sqlite")
    assert r.exit_code == 0, r.output
    rows = [line for line in r.output.splitlines() if line.startswith("│ attn_fwd")]
    assert rows and all(line.rstrip(" │").endswith("│ 1") for line in rows), r.output


def test_a_log_gets_a_line_per_key_and_per_twentieth_of_the_precompile(tmp_path):
    """Piped to a log, rich draws no live bars: the run says which key it is on, and the
    precompile (thousands of variants for the Gluon family, before any study) says how
    far it got."""
    import io

    from rich.console import Console

    from flashgen import cli

    r = invoke("tune", "--preset", "small", "--kernels", "fwd", "--fake-model", "--arch", "sm_90", "--trials", "1",
               "--db", tmp_path / "t.sqlite")
    assert r.exit_code == 0 and "key 1/2: attn_fwd_" in r.output and "key 2/2: attn_fwd_" in r.output, r.output
    out = io.StringIO()
    log = cli._PlainProgress(Console(file=out, width=200), "precompiled", 45)
    for _ in range(45):
        log.step()
    lines = out.getvalue().splitlines()
    assert len(lines) == 23 and lines[0].startswith("precompiled 2/45 in ") and lines[-1].startswith("precompiled 45/45")


def test_show_tells_architectures_apart_and_names_a_directory(tmp_path, monkeypatch):
    """One GPU name tuned for sm_80 and sm_90 (``--arch``): show's best rows differ in
    their cc column, not only in ids; a directory at the default database's name is
    named as one (it was called missing)."""
    db = tmp_path / "two.sqlite"
    for sm in ("sm_80", "sm_90"):
        r = invoke("tune", "--preset", "small", "--kernels", "fwd", "--fake-model", "--arch", sm, "--trials", 1,
                   "--key", "d64_bf16_causal", "--family", "triton", "--db", db)
        assert r.exit_code == 0, r.output
    out = invoke("show", "--db", db).output
    rows = [line for line in out.splitlines() if "attn_fwd_d64_bf16_causal" in line]
    assert len(rows) == 2 and sorted(line.split("│")[6].strip() for line in rows) == ["8.0", "9.0"], out
    monkeypatch.chdir(tmp_path)
    (tmp_path / "flashgen_tuning.sqlite").mkdir()
    r = invoke("show")
    assert r.exit_code == 2 and "is a directory, not a tuning database" in r.output, r.output

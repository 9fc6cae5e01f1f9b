"""The tuner against a FakeBenchmarker: no GPU, no Triton kernels."""

import dataclasses
import random

import optuna
import pytest

from flashgen import families, heuristics, presets, render, resources, space, tuner
from flashgen.arch import Arch
from flashgen.db import TuningDB
from flashgen.env import Environment
from flashgen.spec import KERNELS, KernelSpec, Measurement, Shape, TileConfig, Variant

ENV = Environment("NVIDIA H200", "9.0", 132, "3.6.0", "2.11.0", "0.1.0")
SPEC = KernelSpec("fwd", "bfloat16", 64, 64, "none")
SHAPE = Shape(2, 4, 4, 256, 256)
KEY = SHAPE.key(SPEC)
NEAR_KEY = Shape(2, 4, 4, 512, 512).key(SPEC)
# fwd d64 bf16 needs q 128*M + (k + v) 256*N*stages bytes: the default (128, 64, 8, 3)
# needs 65536; any BLOCK_N 128 / 3-stage config (>= 106496) exceeds this arch's limit.
ARCH = Arch("test-gpu", (9, 0), 132, 70000)
SMALL = {"BLOCK_M": (64, 128), "BLOCK_N": (64, 128), "num_warps": (4, 8), "num_stages": (1, 3)}


@pytest.fixture(autouse=True)
def template_hashes(monkeypatch):
    monkeypatch.setattr(render, "template_hash", lambda k, mods="": f"tmpl-{k}-{mods}")
    # The Triton family's search alone (ARCH is sm_90-like, where the Gluon family also
    # serves fwd keys; tests/test_gluon_family.py tunes both).
    for name in [n for n in families.FAMILIES if n != "triton"]:
        monkeypatch.delitem(families.FAMILIES, name)


@pytest.fixture
def db(tmp_path):
    with TuningDB(tmp_path / "t.sqlite") as d:
        yield d


def vid(cfg, spec=SPEC):
    return Variant(spec, cfg).id


def random_timings(spec=SPEC, seed=1):
    rng = random.Random(seed)
    return {vid(c, spec): rng.uniform(1.0, 10.0) for c in space.configs(spec.kernel)}


def runnable(spec, arch):
    """Variant ids that are valid and fit ``arch``: the only ones a benchmarker may see."""
    return {vid(c, spec) for c in space.configs(spec.kernel)
            if not space.violated_rules(Variant(spec, c))
            and resources.estimate(Variant(spec, c), arch).feasible}


def run(db, bench, n_trials, key=KEY, shape=SHAPE, arch=ARCH, **kw):
    return tuner.tune_key(key, shape, benchmarker=bench, db=db, env=ENV, arch=arch,
                          n_trials=n_trials, **kw)


def load_study(db, key=KEY):
    return optuna.load_study(study_name=tuner.study_name(ENV, key),
                             storage=tuner.open_storage(None, db))


def test_default_config_is_measured_first_and_enqueued(db):
    default = heuristics.default_config(SPEC, ARCH)
    timings = random_timings()
    bench = tuner.FakeBenchmarker(timings)
    res = run(db, bench, 5)
    assert bench.calls[0] == vid(default)
    assert db.rows()[0]["variant_id"] == vid(default)
    assert load_study(db).trials[0].params == {n: getattr(default, n) for n in space.DOMAINS["fwd"]}
    assert res.default_config == default and res.default_median_ms == timings[vid(default)]
    assert res.n_trials == 5
    ok = [r for r in db.rows() if r["status"] == "ok"]
    assert res.best_median_ms == min(r["median_ms"] for r in ok)
    assert res.speedup == pytest.approx(res.default_median_ms / res.best_median_ms)
    assert res.tflops == pytest.approx(db.best(KEY, ENV)["tflops"]) and res.tflops > 0


def test_invalid_and_infeasible_are_recorded_but_never_benchmarked(db):
    # d128 on a 101 KB GPU: the full fwd domain holds invalid and infeasible configs
    spec = KernelSpec("fwd", "bfloat16", 128, 128, "causal")
    key, arch = SHAPE.key(spec), Arch("small-smem", (8, 6), 82, 101376)
    bench = tuner.FakeBenchmarker(random_timings(spec))
    res = run(db, bench, 120, key=key, arch=arch)
    rows = db.rows(key=key)
    by_status = {s: {r["variant_id"] for r in rows if r["status"] == s}
                 for s in ("ok", "invalid", "infeasible")}
    assert by_status["invalid"] and by_status["infeasible"] and by_status["ok"]
    assert set(bench.calls) == by_status["ok"] <= runnable(spec, arch)
    for r in rows:
        v = Variant(spec, TileConfig.from_dict(r))
        if r["status"] == "invalid":
            assert space.violated_rules(v) and r["error"]
        elif r["status"] == "infeasible":
            assert not resources.estimate(v, arch).feasible
            # too much shared memory, or tensor descriptors on a GPU without TMA
            assert (r["smem_bytes_model"] > arch.smem_per_block_optin
                    or (v.config.tma and "no TMA" in r["error"])) and "limit" in r["error"]
    # one row per variant: repeats of a config reuse the stored row
    assert len({r["variant_id"] for r in rows}) == len(rows)
    # Optuna saw the violations as constraints and a penalty value
    trials = load_study(db, key).trials
    bad = [t for t in trials if t.user_attrs["status"] in ("invalid", "infeasible")]
    assert bad and all(max(t.constraints.values()) > 0 and t.value == tuner.PENALTY_MS
                       for t in bad)
    assert all(max(t.constraints.values()) == 0 for t in trials if t.user_attrs["status"] == "ok")
    assert res.best_config is not None and vid(res.best_config, spec) in by_status["ok"]


def test_rejected_configs_do_not_count_toward_the_budget(db):
    """A config the rules or the shared-memory estimate reject costs no compile and no
    measurement, and is not one of the budget's trials: with much of the space rejected
    (d128 on a 101 KB GPU), a budget of 10 measures 10 configs."""
    spec = KernelSpec("fwd", "bfloat16", 128, 128, "causal")
    key, arch = SHAPE.key(spec), Arch("small-smem", (8, 6), 82, 101376)
    bench = tuner.FakeBenchmarker(random_timings(spec))
    res = run(db, bench, 10, key=key, arch=arch)
    statuses = [t.user_attrs["status"] for t in load_study(db, key).trials
                if t.state == optuna.trial.TrialState.COMPLETE]
    assert res.n_trials == 10 == sum(s not in tuner.REJECTED for s in statuses)
    assert any(s in tuner.REJECTED for s in statuses)  # they ran beside the budget's trials
    assert len(bench.calls) == len(set(bench.calls)) <= 10


def test_best_is_the_argmin_when_the_budget_covers_the_space(db, monkeypatch):
    monkeypatch.setitem(space.DOMAINS, "fwd", SMALL)
    timings = random_timings(seed=7)
    candidates = runnable(SPEC, ARCH)
    assert len(candidates) == 12  # 16 minus the 4 BLOCK_N 128, 3-stage configs
    bench = tuner.FakeBenchmarker(timings)
    res = run(db, bench, 80)
    assert set(bench.calls) == candidates  # covered, and each measured once
    assert len(bench.calls) == len(candidates)
    best = min(candidates, key=timings.get)
    assert vid(res.best_config) == best and res.best_median_ms == timings[best]
    assert len(db.rows(status="infeasible")) == 4


def test_resume_continues_without_remeasuring(db, monkeypatch):
    monkeypatch.setitem(space.DOMAINS, "fwd", SMALL)
    bench = tuner.FakeBenchmarker(random_timings())
    first = run(db, bench, 6)
    calls, n_rows = list(bench.calls), len(db.rows())
    assert first.n_trials == 6 and calls
    again = run(db, bench, 6)  # budget already spent: nothing runs
    assert again.n_trials == 6 and bench.calls == calls and len(db.rows()) == n_rows
    assert again.best_config == first.best_config
    more = run(db, bench, 40)
    assert more.n_trials == 40
    assert bench.calls[:len(calls)] == calls
    assert len(bench.calls) == len(set(bench.calls))  # nothing measured twice
    trials = load_study(db).trials
    assert trials[0].params == {n: getattr(heuristics.default_config(SPEC, ARCH), n) for n in space.DOMAINS[SPEC.kernel]}
    # the budget counts measured trials: rejected configs (infeasible here) run beside them
    complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert sum(t.user_attrs["status"] not in tuner.REJECTED for t in complete) == 40 <= len(complete)
    assert more.best_median_ms <= first.best_median_ms


def test_failures_become_rows_and_the_study_continues(db, monkeypatch):
    monkeypatch.setitem(space.DOMAINS, "fwd", SMALL)
    default = heuristics.default_config(SPEC, ARCH)
    timings = random_timings()
    wrong = TileConfig(64, 64, 4, 1)
    timings[vid(wrong)] = Measurement("wrong_result", max_abs_err=0.25)
    fake = tuner.FakeBenchmarker(timings)

    def bench(variant, shape):
        if variant.id == vid(default):
            raise RuntimeError("out of resources")
        return fake(variant, shape)

    res = run(db, bench, 40)
    failed = db.rows(status="launch_failed")
    assert [r["variant_id"] for r in failed] == [vid(default)]
    assert failed[0]["error"] == "RuntimeError: out of resources"
    assert db.rows(status="wrong_result")[0]["max_abs_err"] == 0.25
    assert res.n_trials == 40 and res.default_median_ms is None and res.speedup is None
    ok = {r["variant_id"]: r["median_ms"] for r in db.rows(status="ok")}
    assert vid(res.best_config) == min(ok, key=ok.get)
    values = {t.user_attrs["variant_id"]: t.value for t in load_study(db).trials}
    assert values[vid(default)] == tuner.PENALTY_MS == values[vid(wrong)]


def test_a_variant_without_a_fake_timing_is_not_recorded(db, monkeypatch):
    """A missing simulated timing is not a GPU failure: no row (not launch_failed), the
    trial pruned, the others measured."""
    monkeypatch.setitem(space.DOMAINS, "fwd", SMALL)
    default = heuristics.default_config(SPEC, ARCH)
    timings = random_timings()
    del timings[vid(default)]
    bench = tuner.FakeBenchmarker(timings)
    res = run(db, bench, 30)
    assert vid(default) in bench.calls and not db.rows(variant_id=vid(default))
    assert not db.rows(status="launch_failed")
    assert res.default_median_ms is None and res.best_config is not None and res.speedup is None
    pruned = [t for t in load_study(db).trials if t.state == optuna.trial.TrialState.PRUNED]
    assert pruned and all(t.user_attrs["variant_id"] == vid(default) for t in pruned)
    assert tuner.FakeBenchmarker({}, default=2.5)(Variant(SPEC, default), SHAPE).median_ms == 2.5
    with pytest.raises(tuner.MissingTiming):
        tuner.FakeBenchmarker({})(Variant(SPEC, default), SHAPE)


def test_model_benchmarker_follows_the_byte_and_occupancy_models():
    from flashgen.arch import TABLE
    from flashgen import iomodel

    arch = TABLE["sm_90"]
    model = tuner.ModelBenchmarker(arch)
    spec = KernelSpec("fwd", "bfloat16", 128, 128, "causal")
    big, tiny = Shape(8, 32, 8, 16384, 16384), Shape(1, 2, 2, 128, 128)
    m64, m128 = TileConfig(64, 64, 4, 2), TileConfig(128, 64, 8, 2)
    # long sequences: memory- or compute-bound with every SM busy; BLOCK_M 128 re-reads K/V half as often
    p = iomodel.Problem(16384, 16384, 128, 128, 8, 32, 8, 2, causal=True)
    assert iomodel.tiled_forward(p, 128, 64).total_bytes < iomodel.tiled_forward(p, 64, 64).total_bytes
    assert model.median_ms(Variant(spec, m128), big) <= model.median_ms(Variant(spec, m64), big)
    # 2 heads x 128 rows: BLOCK_M 64 runs 4 programs, BLOCK_M 128 only 2 (occupancy)
    assert model.median_ms(Variant(spec, m64), tiny) < model.median_ms(Variant(spec, m128), tiny)
    for kernel in ("fwd", "bwd_dq", "bwd_dkdv", "fwd_varlen", "decode"):
        s = KernelSpec(kernel, "bfloat16", 64, 64, "none")
        for v in tuner.feasible_variants([Shape(2, 4, 4, 256, 256).key(s)], arch)[:20]:
            ms = model(v, Shape(2, 4, 4, 256, 256)).median_ms
            assert 0 < ms < 1e3 and ms >= model.launch_s * 1e3


@pytest.mark.parametrize("other", [Environment("NVIDIA H100", "9.0", 132, "3.6.0", "2.11.0", "0.1.0"),
                                   # a new Triton: `flashgen tune` refreshes the rows for it
                                   Environment("NVIDIA H200", "9.0", 132, "3.9.0", "2.11.0", "0.1.0")])
def test_another_environment_measures_again(db, monkeypatch, other):
    monkeypatch.setitem(space.DOMAINS, "fwd", SMALL)
    bench = tuner.FakeBenchmarker(random_timings())
    run(db, bench, 10)
    n = len(bench.calls)
    tuner.tune_key(KEY, SHAPE, benchmarker=bench, db=db, env=other, arch=ARCH, n_trials=10)
    assert bench.calls[n] == vid(heuristics.default_config(SPEC, ARCH))
    assert len(db.rows(env=other)) > 0 and len(db.rows(env=ENV)) == len(db.rows()) - len(db.rows(env=other))


def test_tune_loops_over_keys_with_callbacks(db):
    items = presets.expand(["small"])
    seen_keys, trial_counts = [], {}
    timings = {}
    for key, _ in items:
        timings.update(random_timings(key.spec))

    def on_trial(key, n_done, n_total, row):
        assert row["key"] == key.id and n_total == 4
        trial_counts[key.id] = n_done

    results = tuner.tune(items, benchmarker=tuner.FakeBenchmarker(timings), db=db, env=ENV,
                         arch=ARCH, n_trials=4, on_key=lambda i, n, k: seen_keys.append((i, n, k)),
                         on_trial=on_trial)
    assert [r.key for r in results] == [k for k, _ in items]
    assert seen_keys == [(i, len(items), k) for i, (k, _) in enumerate(items)]
    assert trial_counts == {k.id: 4 for k, _ in items}
    assert {r["key"] for r in db.rows()} == {k.id for k, _ in items}


def test_feasible_variants_for_precompile():
    keys = [KEY, Shape(1, 4, 4, 4096, 4096).key(SPEC)]  # same spec twice
    vs = tuner.feasible_variants(keys, ARCH)
    assert {v.id for v in vs} == runnable(SPEC, ARCH) and len(vs) == len(runnable(SPEC, ARCH))


def test_presets():
    grid = presets.expand(["fa-grid"])
    assert len(grid) == 2 * 2 * 6 * 3  # the dense kernels (KERNELS also holds the varlen ones)
    for key, shape in grid:
        assert shape.batch * shape.seqlen_q == 16384
        assert shape.num_heads * key.spec.head_dim == 2048 and shape.num_kv_heads == shape.num_heads
        assert key.spec.dtype == "bfloat16" and key == shape.key(key.spec)
    llama = presets.expand(["llama3-8b"], dtype="float16", kernels=["fwd"])
    assert len(llama) == 16 and all(k.group == 4 and k.spec.mask == "causal" for k, _ in llama)
    dims = presets.expand(["head-dims"], kernels=["fwd"])
    assert sorted({(k.spec.head_dim, k.spec.head_dim_v, k.group) for k, _ in dims}) == [(96, 96, 1), (256, 256, 2)]
    assert len(dims) == 16 and all(s.batch * s.seqlen_q == 16384 for _, s in dims)
    # keys in one bucket are kept once, with the first shape
    both = presets.expand(["small", "small"], kernels=["fwd"])
    assert both == presets.expand(["small"], kernels=["fwd"])
    with pytest.raises(KeyError, match="fa-grid"):
        presets.expand(["nope"])


def test_a_new_study_measures_what_the_dispatcher_served_before_right_after_the_default(db):
    """prior_configs: the key's rows the dispatcher served this GPU before it had one of
    this environment, in its order (this GPU under another Triton, then a sibling GPU of
    the same compute capability and SM count under this Triton, then under others), then
    a relative's (the same compute capability, another SM count);
    a new study measures them whole (a refined row's knob outside the search included)
    right after the default, and enqueues those the search can suggest."""
    sib = dataclasses.replace(ENV, gpu_name="NVIDIA H100 80GB HBM3")
    refined, plain, old_own = TileConfig(64, 64, 4, 2, ws=1), TileConfig(128, 64, 8, 2), TileConfig(64, 32, 4, 1)
    assert refined.ws and not tuner._suggestable(refined, tuner.search_space(KEY, ARCH))
    db.record(KEY, SHAPE, Variant(SPEC, refined), Measurement("ok", median_ms=0.5), sib, 1)
    db.record(KEY, SHAPE, Variant(SPEC, plain), Measurement("ok", median_ms=0.9),
              dataclasses.replace(sib, triton_version="3.5.0"), 1)
    db.record(KEY, SHAPE, Variant(SPEC, old_own), Measurement("ok", median_ms=2.0),
              dataclasses.replace(ENV, triton_version="3.5.0"), 1)
    pcie = dataclasses.replace(ENV, gpu_name="NVIDIA H100 PCIe", sm_count=114)  # another SM count: no sibling
    db.record(KEY, SHAPE, Variant(SPEC, TileConfig(128, 32, 4, 1)), Measurement("ok", median_ms=0.1), pcie, 1)
    assert tuner.prior_configs(KEY, db, ENV, ARCH, shipped=[]) == [old_own, refined, plain]
    assert tuner.prior_configs(KEY, db, ENV, ARCH, shipped=[], limit=1) == [old_own]
    assert tuner.prior_configs(NEAR_KEY, db, ENV, ARCH, shipped=[]) == []  # another key's rows: none
    for name in ("NVIDIA H200 (model)", "NVIDIA H200 (fake)", "triton-interpreter"):  # no GPU measures these
        assert tuner.prior_configs(KEY, db, dataclasses.replace(ENV, gpu_name=name), ARCH, shipped=[]) == []
    # a GPU of the same compute capability and another SM count (a relative): the
    # configs of the others' rows, this Triton's first, for its first tune; never the
    # rows of another compute capability
    assert tuner.prior_configs(KEY, db, pcie, ARCH, shipped=[]) == [refined, plain, old_own]
    ampere = dataclasses.replace(ENV, gpu_name="NVIDIA A100-SXM4-80GB", compute_capability="8.0", sm_count=108)
    assert tuner.prior_configs(KEY, db, ampere, ARCH, shipped=[]) == []
    bench = tuner.FakeBenchmarker({**random_timings(), vid(refined): 0.3})
    run(db, bench, 4)
    ids = [Variant(SPEC, c).id for c in (heuristics.default_config(SPEC, ARCH), old_own, refined, plain)]
    assert bench.calls[:4] == ids  # measured whole, right after the default
    assert db.best(KEY, ENV)["variant_id"] == vid(refined)  # the refined tile's row of this GPU now serves
    params = [t.params for t in load_study(db).trials]
    dom = space.DOMAINS["fwd"]
    assert {n: getattr(plain, n) for n in dom} in params and {n: getattr(old_own, n) for n in dom} in params


def test_a_new_study_starts_from_the_default_then_the_nearest_keys_winners(db):
    """transfer_configs: the best configs of keys of the same spec already tuned in this
    environment, nearest bucket first; a new study enqueues them after the default."""
    timings = random_timings()
    bench = tuner.FakeBenchmarker(timings)
    near = Shape(2, 4, 4, 512, 512).key(SPEC)      # one bucket away
    far = Shape(2, 4, 4, 8192, 8192).key(SPEC)     # five buckets away
    other_mask = Shape(2, 4, 4, 256, 256).key(KernelSpec("fwd", "bfloat16", 64, 64, "causal"))
    picks = {}
    for k, cfg in ((near, TileConfig(64, 64, 4, 2)), (far, TileConfig(128, 64, 8, 2)),
                   (other_mask, TileConfig(64, 32, 4, 1))):
        picks[k] = cfg
        db.record(k, SHAPE, Variant(k.spec, cfg), Measurement("ok", median_ms=0.5), ENV, 1)
    got = tuner.transfer_configs(KEY, db, ENV, ARCH)
    assert got == [picks[near], picks[far], picks[other_mask]]
    assert tuner.transfer_configs(KEY, db, ENV, ARCH, limit=1) == [picks[near]]
    # another environment's rows are not used
    other_env = Environment("NVIDIA A100", "8.0", 108, "3.6.0", "2.11.0", "0.1.0")
    assert tuner.transfer_configs(KEY, db, other_env, ARCH) == []
    run(db, bench, 5)
    params = [t.params for t in load_study(db).trials[:4]]
    default = heuristics.default_config(SPEC, ARCH)
    dom = space.DOMAINS["fwd"]
    assert params == [{n: getattr(c, n) for n in dom} for c in (default, *got)]


def test_the_grid_sampler_takes_every_config_once(db, monkeypatch):
    """A resumed grid study goes on with the configs no trial took, and stops once every
    config is taken: each config of the domain is one trial."""
    monkeypatch.setitem(space.DOMAINS, "fwd", SMALL)
    bench = tuner.FakeBenchmarker(random_timings())
    assert run(db, bench, 5, sampler="grid").n_trials == 5
    run(db, bench, 80, sampler="grid", seed=1)
    params = [tuple(sorted(t.params.items())) for t in load_study(db).trials]
    assert len(params) == len(set(params)) == 16  # every config of SMALL once, then the study stopped
    assert sorted(bench.calls) == sorted(runnable(SPEC, ARCH))


def test_grid_samplers_sharing_a_study_split_the_grid():
    """Two workers' samplers (other seeds) on one study: a trial's config is one no
    other trial took, a running one's included; an enqueued trial keeps its params; once
    every config is taken, a trial repeats one and the study stops."""
    import itertools

    dom = {"a": (1, 2, 3), "b": ("x", "y"), "c": (False, True)}
    st = optuna.storages.InMemoryStorage()
    sa = optuna.create_study(storage=st, study_name="s", sampler=tuner.ConfigGridSampler({"triton": dom}, 0))
    sb = optuna.load_study(storage=st, study_name="s", sampler=tuner.ConfigGridSampler({"triton": dom}, 1))
    sa.enqueue_trial({"a": 2})

    def suggest(t):
        return tuple(t.suggest_categorical(n, list(v)) for n, v in dom.items())

    seen = []
    for _ in range(6):
        ta, tb = sa.ask(), sb.ask()  # tb asks while ta runs
        seen += [suggest(ta), suggest(tb)]
        sa.tell(ta, 0.0)
        sb.tell(tb, 0.0)
    assert seen[0][0] == 2 and sorted(seen) == sorted(itertools.product(*dom.values()))
    sc = optuna.load_study(storage=st, study_name="s", sampler=tuner.ConfigGridSampler({"triton": dom}, 2))
    sc.optimize(lambda t: len(suggest(t)), n_trials=5)
    assert len(sc.trials) == 13 and suggest(sc.trials[-1]) in seen


def test_the_budget_counts_measured_trials_behind_a_running_one():
    """The trial budget (measured trials, whichever worker ran them) counts the trials
    that finish after another worker's running trial, and that trial once it finishes."""
    study = optuna.create_study()
    running = study.ask()  # another worker's, still running

    def objective(t):
        t.set_user_attr("status", "infeasible" if t.number % 2 else "ok")
        return 0.0

    budget = tuner._MaxMeasured(5)
    study.optimize(objective, n_trials=50, callbacks=[budget])
    assert tuner.measured_trials(study) == 5 and len(study.trials) == 11  # ok: trials 2, 4, .., 10
    study.tell(running, 0.0)  # measured (no rejected status)
    budget.n = 8
    study.optimize(objective, n_trials=50, callbacks=[budget])
    assert tuner.measured_trials(study) == 8 and len(study.trials) == 15

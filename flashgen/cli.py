"""``flashgen`` command line: argument parsing and printing only.

    flashgen tune  [--preset NAME]... [--db PATH] [--dtype D] [--kernels K,...] [--trials N]
                   [--timeout-per-key S] [--fake TIMINGS.json]
    flashgen show  [--db PATH] [--key SUBSTR] [--all]
    flashgen merge OUT IN...
    flashgen bench [--preset NAME]... [--shape B,H,HKV,SQ,SK,D[,causal]]... [--dtype D]
                   [--backends B,...] [--out DIR] [--json PATH]
    flashgen iomodel [--seqlen N,...] [--head-dim D] [--block-m M] [--block-n N] [--dtype D]
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
import warnings
from pathlib import Path
from typing import Annotated, Literal

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from .spec import ALL_KERNELS, DENSE_KERNELS, DTYPES, KERNELS, TileConfig, Variant

#: The user's tuning DB.  The shipped one (tuning_db/h200.sqlite) is written only when
#: --db names it.
DEFAULT_DB = Path("flashgen_tuning.sqlite")

# Plain click help: flags read --causal or --plots/--no-plots and choices are listed
# (typer's rich panels print "<bool>" beside every flag).
app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="Generate, tune and inspect flashgen's Triton attention kernels.")


def _print_version(value: bool) -> None:
    if value:
        from ._version import __version__

        typer.echo(f"flashgen {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                                help="Print flashgen's version and exit.")] = False) -> None:
    """Generate, tune and inspect flashgen's Triton attention kernels."""


def _console() -> Console:
    """A console that does not squeeze tables to 80 columns when output is piped."""
    import sys

    return Console() if sys.stdout.isatty() else Console(width=220)


def _fmt(x: float | None, spec: str = ".4f") -> str:
    """A number for a table; a stored value that is not one (a hand-edited row) as it is."""
    if x is None:
        return "-"
    return format(x, spec) if isinstance(x, (int, float)) and not isinstance(x, bool) else repr(x)


def _config_id(row: dict) -> str:
    """The row's config id; "?" where its columns are not a config (a hand-edited row)."""
    try:
        return TileConfig.from_dict(row).id
    except (KeyError, TypeError, ValueError):
        return "?"


def _check_presets(names: list[str]) -> list[str]:
    from .presets import PRESETS

    bad = [n for n in names if n not in PRESETS]
    if bad:
        raise typer.BadParameter(f"unknown preset {bad[0]!r}; known: {', '.join(sorted(PRESETS))}")
    return names


#: --dtype's choices (listed in --help; anything else is refused naming them).
DtypeName = Literal[DTYPES]


def _check_kernels(kernels: str) -> str:
    names = [k.strip() for k in kernels.split(",") if k.strip()]
    bad = [k for k in names if k not in ALL_KERNELS]
    if bad or not names:
        raise typer.BadParameter(f"{kernels!r}: give a comma-separated subset of {','.join(ALL_KERNELS)}")
    return ",".join(names)


def _check_family(family: str) -> str:
    from . import families

    names = [f.strip() for f in family.split(",") if f.strip()]
    bad = [f for f in names if f != "all" and f not in families.FAMILIES]
    if bad or not names:
        raise typer.BadParameter(f"{family!r}: give all or a comma-separated subset of "
                                 f"{','.join(families.FAMILIES)}")
    return ",".join(names)


def _db_not_json(db: Path) -> Path:
    """--db of a command that writes a tuning database: a *.json name is refused (import,
    merge and export read and write *.json as exports, so such a database could never be
    imported or merged by its name)."""
    if db is not None and db.suffix == ".json":
        raise typer.BadParameter(f"{db.name!r}: a tuning database is SQLite; *.json names an export (`flashgen "
                                 "export`), so give --db another name (e.g. *.sqlite)")
    return db


def _read_timings(path: Path) -> dict[str, float]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise ValueError("expected a JSON object {variant_id: median_ms}")
        # numbers only: a string "0.5" or true is a mistake in the file, not a timing
        from .db import MIN_MEDIAN_MS, finite_real

        bad = [k for k, v in data.items() if not (finite_real(v) and v >= MIN_MEDIAN_MS)]
        out = {str(k): float(v) for k, v in data.items() if k not in bad}
        if bad:
            raise ValueError(f"timings must be finite milliseconds >= {MIN_MEDIAN_MS} (1 ns); {bad[0]!r} has "
                             f"{data[bad[0]]!r:.60}" + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""))
        return out
    except (ValueError, TypeError) as e:
        raise typer.BadParameter(f"{path}: {e}", param_hint="'--fake'") from None


@app.command()
def tune(
    preset: Annotated[list[str], typer.Option(metavar="NAME", callback=_check_presets,
                                              help="Preset(s) of shapes: fa-grid, llama3-8b, head-dims, small, varlen-docs, varlen-small, "
                                                   "decode, decode-form, decode-small, mods-bench, mods-d64, mods-small, mods-softcap, mods-alibi, mods-bias, "
                                                   "mods-dropout; user-examples, user-small (the user score/mask "
                                                   "functions and sinks of flashgen.user_examples: their "
                                                   "variants' fwd, bwd_dq, bwd_dkdv).")] = ["fa-grid"],
    db: Annotated[Path, typer.Option(dir_okay=False, callback=_db_not_json,
                                     help="Tuning DB to append to.")] = DEFAULT_DB,
    dtype: Annotated[DtypeName, typer.Option(help="Element type of q, k, v.")] = "bfloat16",
    kernels: Annotated[str, typer.Option(callback=_check_kernels,
                                         help="Comma-separated kernels to tune (default: all; a preset "
                                              "only yields keys of its own kernels; bwd is the whole "
                                              "backward of the families that compile it in one launch "
                                              "sequence, e.g. gluon).")] = ",".join(ALL_KERNELS),
    family: Annotated[str, typer.Option(callback=_check_family,
                                        help="Kernel families to search: all (default) or a comma-separated "
                                             "subset (triton, gluon); keys none of them serves on this GPU "
                                             "are left out.")] = "all",
    arch: Annotated[str | None, typer.Option(help="With --fake/--fake-model/--fake-template: tune for this "
                                             "architecture's rules and families (e.g. sm_90) instead of the "
                                             "current device's.")] = None,
    trials: Annotated[int, typer.Option(min=1, help="Measured trials per key (earlier runs count; configs the rules reject before compiling do not; "
                                   "with --workers N a key may get up to N - 1 more: a worker starts its next trial "
                                   "while another's last one is still being measured, as Optuna's MaxTrialsCallback).")] = 40,
    timeout_per_key: Annotated[float | None, typer.Option(
        min=0, help="Seconds per key: no trial starts after them (the one under way finishes); 0 measures the "
                    "first trial only (the heuristic default).")] = None,
    fake: Annotated[Path | None, typer.Option(exists=True, dir_okay=False,
                                             help="Replay timings from JSON {variant_id: ms}, variant ids like "
                                             "attn_fwd_d64_bf16_none_m128_n64_w4_s3; every variant the run "
                                             "measures needs one (--fake-template writes them all).")] = None,
    fake_model: Annotated[bool, typer.Option(
        "--fake-model", help="No GPU: time each variant with flashgen's byte and shared-memory models "
                             "(tuner.ModelBenchmarker); the rows are labelled '<device> (model)'.")] = False,
    fake_template: Annotated[Path | None, typer.Option(
        dir_okay=False, help="Write a --fake file for this run's variants (every id it would measure, "
                             "with the model's ms to replace by yours) and exit; never overwrites.")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the sampler (worker i takes seed + i; TPE's, numpy's, "
                                      "range: 0 to 2**32 - 1).")] = 0,
    workers: Annotated[int, typer.Option(min=1, help="Worker processes sharing the studies; "
                                         "one per GPU (round-robin over the visible GPUs).")] = 1,
    storage: Annotated[str | None, typer.Option(
        help="Optuna storage shared by the workers: a journal file path (default: DB path + "
             ".optuna.journal) or an RDB URL (e.g. postgresql://...) that workers on several "
             "machines join.")] = None,
    sampler: Annotated[str, typer.Option(help="tpe (Optuna's TPE) or grid (every config once).")] = "tpe",
    refine: Annotated[str | None, typer.Option(
        metavar="KNOBS", help="Instead of a search: measure each key's best tuned config of each family with "
                              "every value the family gives these comma-separated knobs (e.g. "
                              "group_split,half_partials; dq_ordered measures the Gluon backward's "
                              "bitwise-repeatable dQ, which the deterministic backward runs where it is "
                              "measured ahead, dq_writer its dQ writer warp; tuner.refine); keys without a "
                              "tuned row are left out.")] = None,
    key: Annotated[str | None, typer.Option(
        metavar="SUBSTR,...", help="Only the presets' problem keys whose id contains one of these "
                                   "comma-separated substrings (e.g. d64_bf16_causal).")] = None,
) -> None:
    """Tune tile configs for the preset shapes and record every measurement in the DB."""
    if sampler not in ("tpe", "grid"):
        raise typer.BadParameter(f"must be 'tpe' or 'grid', got {sampler!r}", param_hint="'--sampler'")
    if sampler == "tpe" and refine is None and not 0 <= seed <= 2**32 - workers:
        # TPE seeds numpy's generator (the grid sampler's random.Random takes any int)
        last = f"worker {workers - 1} takes seed {seed + workers - 1}; " if workers > 1 else ""
        raise typer.BadParameter(f"{seed}: {last}the TPE sampler's seeds are 0 to 2**32 - 1 = {2**32 - 1}",
                                 param_hint="'--seed'")
    knobs = _check_refine(refine) if refine is not None else None
    if knobs is not None and workers > 1:
        raise typer.BadParameter("--refine measures a few configs per key in one process", param_hint="'--workers'")
    from . import arch as arch_mod, presets, tuner
    from .db import TuningDB, check_writable, validate as validate_db
    from .env import Environment

    if fake is not None and fake_model:
        raise typer.BadParameter("give one of --fake FILE and --fake-model", param_hint="'--fake' / '--fake-model'")
    console = _console()
    user_presets = [p for p in preset if p in presets.USER_PRESETS]
    items = presets.expand([p for p in preset if p not in presets.USER_PRESETS], dtype, kernels.split(","))
    problems = []
    if user_presets:
        # traced here: their keys are the lowered functions' names (one process: --workers 1)
        if workers > 1:
            raise typer.BadParameter(f"the user-function presets ({', '.join(user_presets)}) are tuned in one "
                                     "process (their functions are traced in it)", param_hint="'--workers'")
        import torch

        from . import user_tune

        simulated = fake is not None or fake_model or fake_template is not None
        device = "cuda" if not simulated and torch.cuda.is_available() else "cpu"
        problems = user_tune.preset_problems(user_presets, dtype, device)
        items += user_tune.items(problems, kernels.split(","))
    if not items:
        raise typer.BadParameter(
            f"preset(s) {', '.join(preset)} yield no problem keys of kernels {kernels}: a preset only yields "
            "keys of its own kernels (e.g. decode presets: decode, decode_paged; the others: fwd, bwd_dq, "
            "bwd_dkdv and their varlen forms)", param_hint="'--kernels'")
    if key is not None:
        wanted = [s for s in key.split(",") if s]
        if not wanted:
            raise typer.BadParameter(f"{key!r} names no substring: comma-separated substrings of problem key ids "
                                     f"(they look like {items[0][0].id})", param_hint="'--key'")
        kept = [(k, s) for k, s in items if any(w in k.id for w in wanted)]
        if not kept:
            raise typer.BadParameter(
                f"no problem key of preset(s) {', '.join(preset)} and kernels {kernels} contains "
                f"{' or '.join(map(repr, wanted))}; their keys look like {items[0][0].id}",
                param_hint="'--key'")
        items = kept
    env = Environment.current()
    if arch is not None:
        if fake is None and not fake_model and fake_template is None:
            raise typer.BadParameter("--arch pretends an architecture for simulated runs only (--fake, "
                                     "--fake-model, --fake-template); a GPU run tunes its own", param_hint="'--arch'")
        try:
            arch_obj = arch_mod.by_sm(arch)
        except KeyError as e:
            raise typer.BadParameter(str(e.args[0]), param_hint="'--arch'") from None
        env = dataclasses.replace(env, compute_capability="%d.%d" % arch_obj.compute_capability,
                                  sm_count=arch_obj.sm_count)
    else:
        arch_obj = arch_mod.current()
    pretended = arch_obj if arch is not None else None  # --arch: the explain hint names it too
    arch = arch_obj
    family_names = None if "all" in family.split(",") else tuple(family.split(","))
    items = tuner.servable(items, arch, family_names)
    if not items:
        raise typer.BadParameter(f"no kernel family of {family} serves the keys of these presets and kernels on "
                                 f"{arch.name} ({arch.sm})", param_hint="'--family'")
    # per key: a decode key's tile height follows its sizes (the group's rows)
    fits = {k.id: tuner.has_feasible(k, arch, family_names) for k, _ in items}
    unfit = [k for k, _ in items if not fits[k.id]]
    if unfit:
        items = [(k, s) for k, s in items if fits[k.id]]
        which = "any family" if family_names is None else f"family {family}"
        msg = (f"{len(unfit)} key(s) have no config of {which} that fits {arch.name} ({arch.sm}, "
               f"{arch.smem_per_block_optin} B of shared memory per block), e.g. {unfit[0].id}: `flashgen explain` "
               "names the smallest tile's needs; use float16/bfloat16 or a smaller head_dim")
        if not items:
            raise typer.BadParameter(msg, param_hint="'--dtype' / '--preset'")
        console.print(Text.assemble(("note: ", "yellow"), msg + "; left out"), soft_wrap=True)
    if fake_template is not None:
        _write_fake_template(fake_template, items, arch, family_names)
        return
    store_file = tuner.storage_file(storage) if storage is not None else None
    if store_file is not None and store_file.resolve() == Path(db).resolve():
        raise typer.BadParameter(f"{storage} is the --db file: Optuna's storage is a file of its own "
                                 "(leave --storage out for DB path + .optuna.journal)", param_hint="'--storage'")
    with _user_errors(db):  # a foreign, corrupt or unwritable --db is refused before anything runs
        check_writable(db)  # first: reading a WAL-mode file creates -wal/-shm beside it
        validate_db(db)
    if storage is None:
        journal = tuner.default_journal(db)
        with _user_errors(Path(journal)):  # the default journal: a user's file there stays theirs
            tuner.check_journal(journal, "the Optuna journal beside --db,")
    elif "://" not in storage:
        with _user_errors(Path(storage)):  # a user's file is never appended to, a directory never opened
            tuner.check_journal(storage)
    else:
        with _user_errors():  # a user's SQLite file never gets Optuna's tables; a missing driver is named
            tuner.check_rdb(storage)
    if fake is not None:
        timings = _read_timings(fake)
        missing = [v.id for v in tuner.feasible_variants([k for k, _ in items], arch, family_names)
                   if v.id not in timings]
        if missing:
            console.print(Text.assemble(("error: ", "red"), f"{fake} lacks timings for {len(missing)} variant(s) "
                                        "this run may measure; add them all (or write a template with "
                                        "--fake-template FILE, then edit its ms):"), soft_wrap=True)
            for vid in missing:
                console.print(f"  {vid}", markup=False, soft_wrap=True)
            raise typer.Exit(2)
        bench = tuner.FakeBenchmarker(timings)
        # replayed timings must never be taken for this GPU's
        env = dataclasses.replace(env, gpu_name=f"{env.gpu_name} (fake)")
    elif fake_model:
        bench = tuner.ModelBenchmarker(arch)
        env = dataclasses.replace(env, gpu_name=f"{env.gpu_name} (model)")  # never taken for a GPU's rows
    else:
        import torch

        if not torch.cuda.is_available():
            console.print("[red]error:[/] no CUDA device; the real benchmarker times kernels on a GPU "
                          "(Triton's interpreter has no timings worth tuning on). Use --fake-model "
                          "(timings from flashgen's models) or --fake TIMINGS.json (recorded timings).")
            raise typer.Exit(2)
        from .bench import KernelBenchmarker
        from .spec import is_user_mods

        bench = KernelBenchmarker()
        checked = [bench]
        if problems:
            # user variants: compiled, checked against float64 and timed in this process
            from . import user_tune

            bench = user_tune.UserBenchmarker(problems, fallback=bench)
            checked.append(bench)
        precompile = getattr(checked[0], "precompile", None)
        built_in = [k for k, _ in items if not is_user_mods(k.spec.mods)]
        if callable(precompile) and built_in:
            if knobs is not None:
                with TuningDB(db) as tdb:
                    by_family = tdb.best_configs_by_family(env)  # one query for every key
                    variants = [Variant(k.spec, c) for k in built_in
                                for _, cands in tuner.refine_configs(k, tdb, env, arch, knobs, family_names,
                                                                     by_family)
                                for c in cands]
            else:
                variants = tuner.feasible_variants(built_in, arch, family_names)
            log = _PlainProgress(console, "precompiled", len(variants))
            if log.on:
                console.print(f"precompiling {len(variants)} variants (compiled and checked against float64 in "
                              f"{getattr(checked[0], 'workers', None) or 'parallel'} processes) before the studies",
                              markup=False)
            with Progress(TextColumn("precompiling"), BarColumn(), MofNCompleteColumn(),
                          TimeElapsedColumn(), console=console) as progress:
                task = progress.add_task("precompile", total=len(variants))

                def advanced(vid, failure):
                    progress.advance(task)
                    log.step()
                failures = precompile(variants, progress=advanced)
            bad = {vid: f for vid, f in failures.items() if f}
            console.print(f"precompiled {len(variants)} variants; {len(bad)} failed", markup=False)
            for vid, f in sorted(bad.items())[:20]:
                console.print(f"  {vid}: {f[:300]}", markup=False)
            _print_checks(console, checked[0])

    if knobs is not None:
        # --refine starts from tuned rows: without one there is nothing to measure
        starts = neighbours = 0
        if Path(db).exists():
            with TuningDB(db, readonly=True) as tdb:
                by_family = tdb.best_configs_by_family(env)
                for k, _ in items:
                    rows = tuner.refine_configs(k, tdb, env, arch, knobs, family_names, by_family)
                    starts += bool(rows)
                    neighbours += sum(len(cands) for _, cands in rows)
        if not starts:
            console.print(Text.assemble(("error: ", "red"), f"--refine {','.join(knobs)}: {db} holds no tuned row of "
                                        f"these keys measured on {env.gpu_name!r} (this Triton and flashgen "
                                        "code) to start from; tune them first"), soft_wrap=True)
            raise typer.Exit(2)
        if not neighbours:
            console.print(Text.assemble(("note: ", "yellow"), f"--refine {','.join(knobs)} varies nothing around the "
                                        f"tuned rows of these {len(items)} keys: no family of theirs takes these "
                                        "knobs for them, or every other value breaks a rule (flashgen explain "
                                        "names a row's family); nothing to measure"), soft_wrap=True)
    console.print(f"tuning {len(items)} keys, " + (f"refining {', '.join(knobs)}" if knobs else f"{trials} trials each")
                  + f", on {env.gpu_name} -> {db}"
                  f"{f' with {workers} workers' if workers > 1 else ''}", markup=False)
    # nothing is left beside --db when the run fails before a row is written
    with _stoppable(console, db), _writing(db):
        if workers > 1:
            results = _tune_with_workers(items, console, db=db, env=env, arch=arch, trials=trials,
                                         timeout_per_key=timeout_per_key, seed=seed, workers=workers,
                                         storage=storage, sampler=sampler,
                                         fake_timings=_read_timings(fake) if fake is not None else None,
                                         fake_model=fake_model, family_names=family_names)
            results, failed = results
            _print_results(console, env, results)
            # every worker stopped by a signal raised above; some of them: 128 + the signal
            crashed = [c for c in failed if not 128 < c < 160]
            if failed:
                what = "failed" if crashed else "were stopped by a signal"
                console.print(Text.assemble(("error: ", "red"), f"{len(failed)} of {workers} workers {what} (exit "
                                            f"codes {', '.join(map(str, failed))}; their output above); the rows "
                                            "recorded are kept"), soft_wrap=True)
                raise typer.Exit(1 if crashed else failed[0])
            _print_explain_hint(console, env, db, items, fake is not None or fake_model, pretended)
            return
        with TuningDB(db, readonly=False) as tdb, Progress(TextColumn("{task.description}"), BarColumn(),
                                            MofNCompleteColumn(), TimeElapsedColumn(),
                                            console=console) as progress:
            keys_task = progress.add_task("keys", total=len(items))
            trials_task = progress.add_task("trials", total=trials)

            plain = not console.is_terminal

            def on_key(i, n, key):
                progress.update(keys_task, completed=i, description=f"key {key.id}")
                progress.reset(trials_task, total=trials)
                if plain:  # a log (no live bars): a line per key
                    console.print(f"key {i + 1}/{n}: {key.id}", markup=False)

            def on_trial(key, n_done, n_total, row):
                progress.update(trials_task, completed=n_done,
                                description=f"{row['variant_id']} {row['status']}")

            with _user_errors(db):
                if knobs is not None:
                    results = tuner.refine(items, knobs=knobs, benchmarker=bench, db=tdb, env=env, arch=arch,
                                           family_names=family_names, on_key=on_key, on_trial=on_trial)
                else:
                    # the default journal by its path: checked above (open_storage would read it again)
                    results = tuner.tune(items, benchmarker=bench, db=tdb, env=env, arch=arch, n_trials=trials,
                                         timeout_per_key_s=timeout_per_key, seed=seed, on_key=on_key,
                                         on_trial=on_trial, storage=storage or tuner.default_journal(db),
                                         sampler=sampler,
                                         family_names=family_names)
            progress.update(keys_task, completed=len(items))
        _print_results(console, env, results)
        if problems and fake is None and not fake_model:
            _print_checks(console, bench, "user-function variants")
        _print_explain_hint(console, env, db, items, fake is not None or fake_model, pretended)


class _PlainProgress:
    """Progress lines for a console that is not a terminal (a log file, a pipe), where
    rich draws no live bars: one line at each twentieth of ``total`` and at the end."""

    def __init__(self, console, what: str, total: int):
        self.on, self.console, self.what, self.total = not console.is_terminal, console, what, total
        self.done, self.every, self.t0 = 0, max(1, total // 20), time.monotonic()

    def step(self) -> None:
        self.done += 1
        if self.on and (self.done % self.every == 0 or self.done == self.total):
            self.console.print(f"{self.what} {self.done}/{self.total} in {time.monotonic() - self.t0:.0f} s",
                               markup=False)


@contextlib.contextmanager
def _stoppable(console, db: Path):
    """Around a tuning run: Ctrl-C, SIGTERM and SIGHUP stop it the same way (the
    workers too: :func:`flashgen.tuner.tune_parallel`): one line, the rows already
    recorded kept, exit code 128 + the signal's number (130 for Ctrl-C, 143 for
    SIGTERM)."""
    import signal

    from . import tuner
    from .db import row_count

    # Optuna logs the interrupted trial ("Trial N failed ... KeyboardInterrupt") with its
    # traceback: one line instead, as the workers do
    with tuner.interrupts_on_one_line(), tuner.stop_signals_raise():
        try:
            yield
        except KeyboardInterrupt as e:
            signum = tuner.stop_signal(e)
            n = row_count(db)
            console.print(f"stopped by {signal.Signals(signum).name}; " + (
                f"{db} keeps the {n} rows recorded so far" if n else "no row was recorded"), markup=False)
            raise typer.Exit(128 + signum) from None


def _print_checks(console, bench, what: str = "variants") -> None:
    """The worst error ratio of the float64 checks ``bench`` ran (check_ratios())."""
    ratios = bench.check_ratios()
    if ratios:
        worst = max(ratios, key=ratios.get)
        console.print(f"correctness: {len(ratios)} {what} checked on an awkward shape against "
                      f"float64; worst error ratio {ratios[worst]:.3f} ({worst}; <= 1 passes)", markup=False)


def _write_fake_template(path: Path, items, arch, family_names=None) -> None:
    """Write {variant_id: ms} for every variant a run over ``items`` may measure (valid,
    fitting ``arch``), with the model's ms (:class:`flashgen.tuner.ModelBenchmarker`)."""
    from . import tuner

    if path.exists():
        raise typer.BadParameter(f"{path} exists; the template never overwrites a file",
                                 param_hint="'--fake-template'")
    model = tuner.ModelBenchmarker(arch)
    out: dict[str, float] = {}
    for key, shape in items:
        for v in tuner.feasible_variants([key], arch, family_names):
            out.setdefault(v.id, round(model.median_ms(v, shape), 6))
    with _user_errors():
        try:
            path.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
        except FileNotFoundError:
            raise
        except OSError as e:  # a read-only or full file system, a directory of another user
            raise typer.BadParameter(f"cannot write {path}: {e.strerror or e}", param_hint="'--fake-template'")
    typer.echo(f"wrote {len(out)} variant ids to {path} (the model's ms: replace them with your timings); "
               f"then: flashgen tune ... --fake {path}")


def _print_explain_hint(console, env, db: Path, items, simulated: bool, arch=None) -> None:
    """After a simulated run: the explain command that reads its rows (they carry the
    labelled device name, never this machine's), for the first key ``flashgen explain``
    can show (a dense kernel's: not decode, varlen or user functions); ``arch``: the
    architecture the run pretended (``--arch``)."""
    import shlex

    from .spec import DENSE_KERNELS, WHOLE_BWD, is_user_mods, mods_set

    shown = [(k, s) for k, s in items
             if k.spec.kernel in (*DENSE_KERNELS, WHOLE_BWD) and not is_user_mods(k.spec.mods)]
    if not simulated:
        return
    if not shown:
        console.print(f"these rows are for the device {env.gpu_name!r} (explain shows dense kernels' keys only); "
                      f"see them: flashgen show --db {shlex.quote(str(db))}", markup=False, soft_wrap=True)
        return
    key, shape = shown[0]
    s = key.spec
    mods = mods_set(s.mods)
    flags = ([f"--head-dim-v {s.head_dim_v}"] if s.head_dim_v != s.head_dim else []) + \
        (["--causal"] if s.mask == "causal" else []) + (["--window 128,0"] if s.mask == "window" else []) + \
        (["--softcap 30"] if "softcap" in mods else []) + (["--alibi"] if "alibi" in mods else []) + \
        (["--bias"] if "bias" in mods else []) + (["--dropout-p 0.1"] if "dropout" in mods else []) + \
        ([f"--arch {arch.sm}"] if arch is not None else [])
    console.print(f"these rows are for the device {env.gpu_name!r}; see the dispatcher pick them: flashgen explain "
                  f"--db {shlex.quote(str(db))} --gpu {shlex.quote(env.gpu_name)} --batch {shape.batch} --heads "
                  f"{shape.num_heads} --kv-heads {shape.num_kv_heads} --seqlen-q {shape.seqlen_q} --seqlen-k "
                  f"{shape.seqlen_k} --head-dim {s.head_dim} --dtype {s.dtype}" + "".join(f" {f}" for f in flags),
                  markup=False, soft_wrap=True)


def _tune_with_workers(items, console, *, db, env, arch, trials, timeout_per_key, seed, workers,
                       storage, sampler, fake_timings, fake_model=False, family_names=None):
    """``workers`` processes over the same keys, sharing each key's study (Optuna's
    distributed optimization); then (the results read back from the DB and studies, the
    non-zero exit codes of the workers that failed)."""
    import time

    from . import tuner
    from .db import TuningDB

    gpus = 0
    if fake_timings is None and not fake_model:
        import torch

        gpus = torch.cuda.device_count()
        if gpus < workers:
            console.print(f"warning: {workers} workers share {gpus} GPU(s); their timings "
                          "interfere", markup=False)
    storage = storage or tuner.default_journal(db)
    configs = [tuner.WorkerConfig(i, str(db), storage, env, arch, trials, timeout_per_key, seed, sampler,
                                  gpu=i % gpus if gpus else None, fake_timings=fake_timings,
                                  fake_model=fake_model, family_names=family_names)
               for i in range(workers)]
    t0 = time.perf_counter()

    def on_exit(name, code, n_failed):
        note = f"; {n_failed} running trial(s) marked FAIL" if n_failed else ""
        console.print(f"worker {name} exited with {code}{note}", markup=False)

    def on_start(pids):
        console.print("workers started: " + ", ".join(f"{n} (pid {pid})" for n, pid in pids.items()),
                      markup=False)

    codes = tuner.tune_parallel(items, configs, on_exit=on_exit, on_start=on_start)
    console.print(f"{workers} workers done in {time.perf_counter() - t0:.1f} s "
                  f"(exit codes {sorted(codes.values())})", markup=False)
    failed = sorted(c for c in codes.values() if c)
    with TuningDB(db) as tdb:
        return (tuner.summarize(items, db=tdb, env=env, arch=arch, storage=storage, family_names=family_names),
                failed)


def _check_refine(value: str) -> tuple[str, ...]:
    import dataclasses

    names = tuple(x.strip() for x in value.split(",") if x.strip())
    fields = {f.name for f in dataclasses.fields(TileConfig)} - {"family"}
    bad = [n for n in names if n not in fields]
    if not names or bad:
        raise typer.BadParameter(f"knobs must be TileConfig fields ({', '.join(sorted(fields))}); got "
                                 f"{', '.join(bad) or repr(value)}", param_hint="'--refine'")
    return names


def _print_results(console, env, results) -> None:
    table = Table(title=Text(f"best configs on {env.gpu_name}"))
    for col in ("key", "best config", "median ms", "TFLOP/s", "default config", "default ms",
                "speedup", "trials"):
        table.add_column(col, no_wrap=col == "key")
    for r in results:
        table.add_row(*map(Text, (
            r.key.id, r.best_config.id if r.best_config else "-", _fmt(r.best_median_ms),
            _fmt(r.tflops, ".4g"), r.default_config.id, _fmt(r.default_median_ms),
            _fmt(r.speedup, ".2f") + ("x" if r.speedup else ""), str(r.n_trials))))
    console.print(table)


@app.command()
def show(
    db: Annotated[Path | None, typer.Option(exists=True, dir_okay=False, help="Tuning DB to read (default: "
                                            f"{DEFAULT_DB} if it exists, else each shipped one).")] = None,
    key: Annotated[str | None, typer.Option(help="Only keys containing this text.")] = None,
    all_: Annotated[bool, typer.Option("--all", help="Every row, not only the best per key.")] = False,
) -> None:
    """Show the best ok row per key and environment that its kernel family's rules admit
    (what a dispatcher can load; or every row) and the row count per status, of one
    database (each shipped one in turn by default)."""
    from .db import TuningDB, shown

    console = _console()
    dbs = [db]
    if db is None:
        from .dispatch import shipped_databases

        shipped = shipped_databases()
        dbs = [DEFAULT_DB] if DEFAULT_DB.exists() or not shipped else shipped
    for db in dbs:
        if not db.exists():
            raise typer.BadParameter(f"{db} does not exist", param_hint="'--db'")
        if db.is_dir():  # the default name, taken by a directory
            raise typer.BadParameter(f"{db} is a directory, not a tuning database", param_hint="'--db'")
        with _user_errors(db):
            TuningDB(db, readonly=True).close()
        with TuningDB(db, readonly=True) as tdb:
            if all_:
                rows = tdb.rows(key_contains=key)
                cols = ("id", "key", "config", "status", "median ms", "TFLOP/s", "smem model B", "gpu",
                        "error")
                cells = [(str(r["id"]), str(r["key"]), _config_id(r), str(r["status"]), _fmt(r["median_ms"]),
                          _fmt(r["tflops"], ".4g"), str(r["smem_bytes_model"]), str(r["gpu_name"]),
                          str(r["error"] or "")[:60]) for r in rows]
            else:
                # what the dispatcher can load: a row its family's rules refuse, or one that
                # does not read as a measurement (a hand-edited NULL key or GPU), is left out
                rows = tdb.best_rows(key_contains=key, admit=shown)
                # rows of one GPU name tuned for two architectures (--arch) differ in cc alone
                cols = ("key", "config", "median ms", "TFLOP/s", "gpu", "cc", "triton", "template")
                cells = [(r["key"], _config_id(r), _fmt(r["median_ms"]), _fmt(r["tflops"], ".4g"),
                          r["gpu_name"], r["compute_capability"], r["triton_version"], r["template_hash"])
                         for r in rows]
            counts = tdb.status_counts(key_contains=key)
        table = Table(title=Text(f"{db}: {'all rows' if all_ else 'best per key'}"))
        for c in cols:
            table.add_column(c, no_wrap=c == "key")
        for row in cells:
            table.add_row(*map(Text, row))
        console.print(table)
        console.print("rows per status: " + (", ".join(f"{s} {n}" for s, n in sorted(counts.items()))
                                             or "none"))


@contextlib.contextmanager
def _user_errors(db: Path | None = None):
    """A user's mistake (a foreign DB file, a bad export, a database SQLite cannot
    write) is one line and exit code 2, not a traceback; ``db``: the database the
    message names when SQLite cannot open or write it."""
    import sqlite3

    from .errors import InputError, UnsupportedError

    try:
        yield
    except (InputError, UnsupportedError, FileNotFoundError, json.JSONDecodeError) as e:
        _console().print(Text.assemble(("error: ", "red"), str(e)), soft_wrap=True)  # one line
        raise typer.Exit(2) from None
    except sqlite3.OperationalError as e:
        if "locked" in str(e):
            where = f" {db}" if db is not None else ""
            _console().print(Text.assemble(("error: ", "red"), f"the tuning database{where} is locked by another "
                                            f"process; nothing was written (SQLite says: {e})"), soft_wrap=True)
            raise typer.Exit(2) from None
        if not any(w in str(e) for w in ("readonly", "unable to open", "disk I/O", "read-only")):
            raise
        where = f" {db}" if db is not None else ""
        _console().print(Text.assemble(("error: ", "red"), f"cannot write the tuning database{where} (its directory "
                                        f"must be writable and the file a writable SQLite file): SQLite says: {e}"),
                         soft_wrap=True)
        raise typer.Exit(2) from None


@contextlib.contextmanager
def _writing(db: Path, what: str = "--db"):
    """Around a command that appends to the tuning database ``db``: first the check that
    it can be written there (:func:`flashgen.db.check_writable`: an existing, writable
    directory, a writable file), then the command; if it fails, the files it created
    beside ``db`` (-wal, -shm, -journal, .optuna.journal) and a ``db`` it created that
    holds no rows are removed, and an empty ``db`` that still holds no rows is left empty
    (without the schema the command wrote).  Errors are one line, exit 2 (:func:`_user_errors`)."""
    from .db import SIDE_FILES, check_writable, row_count, tidy_side_files

    with _user_errors(db):
        check_writable(db, what)
    side = [Path(f"{db}{sfx}") for sfx in SIDE_FILES]
    existed = {p for p in (db, *side) if p.exists()}
    was_empty = db in existed and db.is_file() and db.stat().st_size == 0
    try:
        with _user_errors(db):
            yield
    except BaseException:
        if (db not in existed or was_empty) and row_count(db) == 0:
            # nothing was measured or imported: leave nothing behind (the user's empty
            # file as it was, without the schema the run wrote)
            for p in side:
                if p not in existed and p.exists():
                    p.unlink()
            if was_empty:
                db.write_bytes(b"")
            elif db.exists():
                db.unlink()
        elif db in existed:
            tidy_side_files(db)  # never removed; the -wal / -shm files a read made, tidied
        raise


@app.command()
def export(
    out: Annotated[Path, typer.Argument(metavar="OUT", dir_okay=False,
                                        help="Where to write: *.json (reviews well in a diff) or *.sqlite (a small "
                                        "DB the dispatcher reads).")],
    dbs: Annotated[list[Path], typer.Argument(metavar="DB", exists=True, dir_okay=False,
                                              help="Tuning DBs to read.")],
    gpu: Annotated[list[str], typer.Option(metavar="NAME", help="Only rows measured on this GPU (repeatable).")] = [],
) -> None:
    """Write the best config per (key, environment) of DBS, with provenance, to OUT.
    OUT must not exist (nothing is overwritten)."""
    from .db import TuningDB

    if out.suffix not in (".json", ".sqlite"):
        raise typer.BadParameter(f"must end in .json or .sqlite, got {out.name!r}", param_hint="'OUT'")
    if out.exists():
        raise typer.BadParameter(f"{out} exists; export never overwrites a file", param_hint="'OUT'")
    with _writing(out, "OUT"):
        if gpu:
            _check_export_gpus(dbs, gpu)
        best: dict[tuple, dict] = {}
        for p in dbs:
            with TuningDB(p, readonly=True) as tdb:
                for r in tdb.export_best(gpu or None):
                    # the best row and the best bitwise-repeatable one (TuningDB.best_rows)
                    ident = (r["key"], r["gpu_name"], r["compute_capability"], r["triton_version"],
                             r["template_hash"], r.get("dq_ordered") or 0)
                    if ident not in best or r["median_ms"] < best[ident]["median_ms"]:
                        best[ident] = r
        rows = sorted(best.values(), key=lambda r: (r["gpu_name"], r["key"]))
        if out.suffix == ".json":
            out.write_text(json.dumps({"flashgen_export": 1, "rows": rows}, indent=1, sort_keys=True) + "\n")
        else:
            with TuningDB(out, readonly=False) as tdb:
                tdb.import_rows(rows)
                tdb.use_rollback_journal()  # a file to ship: its readers write nothing beside it
    typer.echo(f"{len(rows)} best configs from {len(dbs)} database(s) -> {out}")


def _check_export_gpus(dbs: list[Path], gpu: list[str]) -> None:
    """InputError (before OUT is written) naming each ``--gpu`` name that no ok row of
    ``dbs`` was measured on, and the names they hold."""
    from .db import TuningDB
    from .errors import InputError

    held: set[str] = set()
    for p in dbs:
        with TuningDB(p, readonly=True) as tdb:
            held |= {r["gpu_name"] for r in tdb.db.query(
                "SELECT DISTINCT gpu_name FROM measurements WHERE status = 'ok'")}
    missing = [g for g in gpu if g not in held]
    if missing:
        raise InputError(f"--gpu {', '.join(map(repr, missing))}: no ok row measured on it in these databases "
                         f"(they hold {', '.join(map(repr, sorted(held))) or 'none'}; --gpu takes the GPU name as "
                         "`flashgen show` lists it); nothing was written")


@app.command(name="import")
def import_(
    source: Annotated[Path, typer.Argument(metavar="SOURCE", exists=True, dir_okay=False,
                                           help="An export (*.json) or a tuning DB (*.sqlite).")],
    db: Annotated[Path, typer.Option(dir_okay=False, callback=_db_not_json,
                                     help="Tuning DB to append to.")] = DEFAULT_DB,
    replace: Annotated[bool, typer.Option(
        "--replace", help="SOURCE's rows replace --db's rows of each problem key and environment (GPU, compute "
                          "capability, Triton version, generated code) in which SOURCE has an ok row, e.g. after "
                          "re-tuning keys whose earlier timings are wrong; the replaced rows are first copied to a "
                          "new DB.replaced-<UTC time>.db beside --db.")] = False,
) -> None:
    """Append to --db the rows of SOURCE it lacks; nothing is overwritten or deleted
    (with --replace, the rows replaced are kept in a copy first).  Every row of SOURCE is
    checked first (a known status, kernel and config fields, a finite positive median_ms
    for ok rows): one that is not a measurement refuses the import and nothing is
    written.  The dispatcher serves a key's fastest ok row of an environment among all the
    databases it reads (--db and the shipped ones), so a re-tune whose timings are slower
    than wrong earlier ones serves only once those rows are replaced where they lie."""
    import datetime

    from .db import NotATuningDB, TuningDB, check_rows, read_rows

    note = ""
    with _writing(db):
        if source.suffix == ".json":
            try:
                data = json.loads(source.read_text(encoding="utf-8"))
            except UnicodeDecodeError:
                raise NotATuningDB(f"{source} is not a flashgen export (not UTF-8 text: an export is JSON; a "
                                   "tuning database is imported by its *.sqlite name)") from None
            except json.JSONDecodeError as e:
                raise NotATuningDB(f"{source} is not a flashgen export (invalid JSON: {e})") from None
            if (not isinstance(data, dict) or type(data.get("flashgen_export")) is not int
                    or data["flashgen_export"] != 1 or not isinstance(data.get("rows"), list)):
                raise NotATuningDB(f"{source} is not a flashgen export (expected {{\"flashgen_export\": 1, "
                                   "\"rows\": [...]})")
            rows = data["rows"]
        else:
            rows = read_rows(source)  # validates it before anything is written
        check_rows(rows, source)  # before --db is opened: a refusal writes nothing
        with TuningDB(db, readonly=False) as tdb:
            if replace:
                stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
                keep = db.with_name(f"{db.name}.replaced-{stamp}.db")  # not *.sqlite: never loaded as shipped
                n, gone = tdb.replace_rows(rows, source, keep)
                if gone:
                    note = f"; {len(gone)} rows of the same keys and environments replaced (kept in {keep})"
            else:
                n = tdb.import_rows(rows) if source.suffix == ".json" else tdb.merge_from(source)
                if tdb.last_conflicts:
                    note = (f"; {tdb.last_conflicts} rows left out that have the identity of a row already held (key, "
                            "config, environment, measurement time) but another status or median_ms: the held row "
                            "stays (--replace takes SOURCE's rows of their keys)")
    typer.echo(f"{source}: {n} rows added to {db}{note}")


@app.command()
def merge(
    out: Annotated[Path, typer.Argument(metavar="OUT", dir_okay=False,
                                        help="DB to append to (created if missing, in an existing directory).")],
    inputs: Annotated[list[Path], typer.Argument(metavar="IN", exists=True, dir_okay=False,
                                                 help="DBs to read.")],
) -> None:
    """Append to OUT the rows of each IN that OUT lacks."""
    from .db import TuningDB

    if out.suffix == ".json":
        raise typer.BadParameter(f"{out}: merge writes a tuning database, not an export (JSON, which `flashgen "
                                 "export` writes); name it *.sqlite", param_hint="'OUT'")
    for p in inputs:
        if p.suffix == ".json":
            raise typer.BadParameter(f"{p} is an export (JSON); merge reads tuning databases: use `flashgen "
                                     f"import {p} --db {out}`", param_hint="'IN'")
    with _writing(out, "OUT"):
        for p in inputs:  # check every input before writing anything
            TuningDB(p, readonly=True).close()
        with TuningDB(out, readonly=False) as tdb:
            for p in inputs:
                typer.echo(f"{p}: {tdb.merge_from(p)} rows added to {out}")


@app.command()
def bench(
    preset: Annotated[list[str], typer.Option(metavar="NAME", callback=_check_presets,
                                              help="Preset(s) of shapes: fa-grid, llama3-8b, head-dims, small "
                                                   "(fa-grid when neither --preset nor --shape is given).")] = [],
    shape: Annotated[list[str], typer.Option("--shape", metavar="SHAPE", help="A shape B,H,HKV,SQ,SK,D[,causal][,window=L:R] "
                                                  "(repeatable).")] = [],
    dtype: Annotated[DtypeName, typer.Option(help="Element type of q, k, v.")] = "bfloat16",
    backends: Annotated[str, typer.Option(help="Comma-separated subset of flashgen, flashgen-default, "
                                          "flashgen-deterministic (deterministic=True), sdpa-flash, sdpa-cudnn, "
                                          "sdpa-efficient, sdpa-math, flex, naive.")] = "all",
    out: Annotated[Path, typer.Option(file_okay=False, help="Directory for bench.json, bench.csv and the "
                                      "plots.")] = Path("bench_out"),
    json_out: Annotated[Path | None, typer.Option("--json", dir_okay=False,
                                                  help="Also write the JSON here.")] = None,
    plots: Annotated[bool, typer.Option(help="Save matplotlib plots (PNG) in --out.")] = True,
    check: Annotated[bool, typer.Option(help="Check flashgen against the float64 reference.")] = True,
    rep_ms: Annotated[int, typer.Option(min=1, help="Timing repetitions, in ms of GPU time (and at least "
                                        "10 repetitions: flashgen.bench.MIN_REPEATS).")] = 25,
    warmup_ms: Annotated[int, typer.Option(min=1, help="Warm-up, in ms of GPU time (and at least 2 calls).")] = 5,
    max_matrix_gb: Annotated[float, typer.Option(min=0, help="Skip naive / sdpa-math where their seqlen_q x "
                                                 "seqlen_k matrices would need more than this.")] = 40.0,
) -> None:
    """flashgen (tuned and default config, and its deterministic backward) against torch
    SDPA's backends, FlexAttention and naive attention: forward, backward,
    forward+backward, peak memory; table, JSON, CSV, plots.  Exits 1 when flashgen's
    float64 check (of its default and, when it runs, its deterministic backward) fails on
    a shape, a flashgen backend fails to run, or the deterministic backward's gradients
    differ between two calls."""
    import torch

    from . import bench, compare

    names = list(compare.BACKENDS) if backends.strip() == "all" else [b.strip() for b in backends.split(",")
                                                                       if b.strip()]
    unknown = sorted(set(names) - set(compare.BACKENDS))
    if unknown or not names:
        raise typer.BadParameter(f"unknown backend(s) {unknown}; known: {list(compare.BACKENDS)}",
                                 param_hint="'--backends'")
    cases = []
    for s in shape:
        try:
            cases.append(compare.parse_shape(s))
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="'--shape'") from None
    if preset or not shape:
        try:
            cases = compare.cases_from_presets(preset or ["fa-grid"]) + cases
        except KeyError as e:
            raise typer.BadParameter(e.args[0], param_hint="'--preset'") from None
    if not torch.cuda.is_available():
        Console().print("[red]error:[/] flashgen bench needs a CUDA GPU (torch.cuda.is_available() is False)")
        raise typer.Exit(2)
    console = _console()
    if any(n.startswith("flashgen") for n in names):
        _precompile_for(cases, dtype, names)
    tdtype = getattr(torch, dtype)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        task = progress.add_task("cells", total=len(cases) * len(names))

        def on_cell(case, name, cell):
            progress.update(task, advance=1, description=f"{case.label} d{case.head_dim} {case.mask} {name}")
        rows = compare.run(cases, dtype=tdtype, backends=names, warmup_ms=warmup_ms, rep_ms=rep_ms, check=check,
                           max_matrix_gb=max_matrix_gb, progress=on_cell)
    device = torch.cuda.get_device_name()
    meta = {"device": device, "torch": torch.__version__, "dtype": dtype, "rep_ms": rep_ms,
            "warmup_ms": warmup_ms, "min_repeats": bench.MIN_REPEATS, "min_warmup_calls": bench.MIN_WARMUP_CALLS,
            "max_matrix_gb": max_matrix_gb, "backends": names}
    out.mkdir(parents=True, exist_ok=True)
    text = compare.to_json(rows, meta)
    (out / "bench.json").write_text(text)
    (out / "bench.csv").write_text(compare.to_csv(rows))
    if json_out:
        json_out.write_text(text)
    _print_bench(console, rows, names, check, f"{dtype}, {device}")
    written = [out / "bench.json", out / "bench.csv"]
    if plots:
        try:
            written += compare.plots(rows, out, title=f"{dtype}, {device}")
        except ImportError as e:
            console.print(f"plots skipped ({e}): pip install 'flashgen[bench]' (matplotlib)", markup=False)
    console.print("wrote " + ", ".join(map(str, written)), markup=False)
    failed = [r.c for r in rows if "error" in r.check or (compare.max_check(r) or 0.0) > 1.0]
    unrepeatable = [r.c for r in rows if r.cells.get("flashgen-deterministic", {}).get("repeatable") is False]
    # a flashgen backend that failed at a stage (not one it was not meant to run)
    broken = [r.c for r in rows if any(n.startswith("flashgen") and c["error"]
                                       and not c["error"].startswith(("skipped", "unsupported"))
                                       for n, c in r.cells.items())]
    for what, cases in (("failed its float64 check", failed),
                        ("flashgen-deterministic gave different gradients in two calls", unrepeatable),
                        ("a flashgen backend failed (the notes above say where)", broken)):
        if cases:
            console.print(f"error: {what} at {len(cases)} shape(s): "
                          + ", ".join(f"{c.label} d{c.head_dim} {c.mask}" for c in cases), markup=False)
    if failed or unrepeatable or broken:
        raise typer.Exit(1)


def _precompile_for(cases, dtype: str, names: list[str]) -> None:
    """Compile every flashgen variant the run will launch, in parallel, before timing."""
    from .bench import KernelBenchmarker
    from .dispatch import Dispatcher, default_dispatcher
    from .spec import KernelSpec, Variant

    disps = ([default_dispatcher()] if {"flashgen", "flashgen-deterministic"} & set(names) else []) + \
        ([Dispatcher(databases=[])] if "flashgen-default" in names else [])
    variants = []
    for disp in disps:
        for c in cases:
            if c.window != (-1, -1):
                continue  # the precompile check has no window sizes; these compile on first call
            for kernel in DENSE_KERNELS:
                spec = KernelSpec(kernel, dtype, c.head_dim, c.head_dim, "causal" if c.causal else "none")
                variants.append(Variant(spec, disp.config_for(c.shape.key(spec))))
    KernelBenchmarker().precompile(list(dict.fromkeys(variants)))


def _short_error(err: str) -> str:
    """A table cell's few words; the full reason is printed under the table."""
    if err.startswith("skipped"):
        return "skipped (memory)"
    if "OOM" in err:
        return "OOM"
    if err.startswith("unsupported"):
        return "unsupported"
    if "no kernel" in err:
        return "no kernel"
    return ": ".join(err.split(": ")[:2])[:28]


def _print_bench(console: Console, rows, names: list[str], check: bool, title: str) -> None:
    from . import compare

    def cells_table(heading, fmt_cell, extra=None):
        table = Table(title=Text(heading))
        for col in ("d", "mask", "batch x heads/kv x seqlen"):
            table.add_column(col, no_wrap=True)
        for n in names:
            table.add_column(n)
        if extra:
            table.add_column(extra[0])
        for r in rows:
            c = r.c
            cells = [fmt_cell(r.cells[n]) if r.cells[n]["error"] is None or r.cells[n]["fwd_ms"]
                     else _short_error(r.cells[n]["error"]) for n in names]
            table.add_row(str(c.head_dim), c.mask, c.label, *cells, *([extra[1](r)] if extra else []))
        console.print(table)

    def tflops(cell):
        s = " / ".join("-" if cell[f"{d}_tflops"] is None else f"{cell[f'{d}_tflops']:.0f}"
                       for d in compare.DIRECTIONS)
        return s + (" *" if cell["error"] else "")

    def mem(cell):
        return "-" if cell["peak_mem_bytes"] is None else f"{cell['peak_mem_bytes'] / 2**20:.0f}"

    def ratio(r):
        m = compare.max_check(r)
        return "-" if m is None else f"{m:.2f}"

    cells_table(f"TFLOP/s fwd / bwd / fwd+bwd, {title}", tflops,
                ("flashgen max err ratio", ratio) if check else None)
    cells_table(f"peak memory of one fwd+bwd beyond the inputs (MiB), {title}", mem)
    notes: dict[tuple[str, str], list[str]] = {}
    for r in rows:
        for n in names:
            if r.cells[n]["error"]:
                notes.setdefault((n, r.cells[n]["error"]), []).append(f"{r.c.label} d{r.c.head_dim} {r.c.mask}")
    for (n, err), where in notes.items():
        more = f" (+{len(where) - 3} more)" if len(where) > 3 else ""
        console.print(f"{n}: {err} [{', '.join(where[:3])}{more}]", markup=False)
    if any(r.cells[n]["error"] and r.cells[n]["fwd_ms"] for r in rows for n in names):
        console.print("* a later stage failed; see the note for that backend", markup=False)
    ref = "sdpa-cudnn" if "sdpa-cudnn" in names else None
    for n in names:
        if ref is None or n == ref:
            continue
        for d in compare.DIRECTIONS:
            ratios = [r.cells[n][f"{d}_tflops"] / r.cells[ref][f"{d}_tflops"] for r in rows
                      if r.cells[n][f"{d}_tflops"] and r.cells[ref][f"{d}_tflops"]]
            if ratios:
                console.print(f"{n} / {ref} {d}: geomean {compare.geomean(ratios):.3f}x, "
                              f"min {min(ratios):.3f}x over {len(ratios)} shapes", markup=False)
    if "flashgen-deterministic" in names:
        seen = [r.cells["flashgen-deterministic"]["repeatable"] for r in rows]
        console.print(f"flashgen-deterministic: dQ, dK, dV bitwise equal in two backward calls at "
                      f"{sum(x is True for x in seen)} of {len(seen)} shapes", markup=False)


#: The largest sequence length (and tile size) ``flashgen iomodel`` takes: its model walks
#: the query and key tiles one by one.
IOMODEL_MAX = 1 << 24


@app.command()
def iomodel(
    seqlen: Annotated[str, typer.Option(help="Comma-separated N (seqlen_q = seqlen_k).")] = "1024,4096,16384",
    head_dim: Annotated[int, typer.Option(min=1)] = 64,
    block_m: Annotated[int, typer.Option("--block-m", min=1, max=IOMODEL_MAX, help="Query tile (forward, dQ); "
                                         "key tile (dK/dV).")] = 128,
    block_n: Annotated[int, typer.Option("--block-n", min=1, max=IOMODEL_MAX,
                                         help="The tile streamed through each program.")] = 64,
    dtype: Annotated[DtypeName, typer.Option(help="Element type (its bytes per element).")] = "float16",
    batch: Annotated[int, typer.Option(min=1)] = 1,
    heads: Annotated[int, typer.Option(min=1)] = 1,
    causal: bool = False,
    tradeoff_n: Annotated[int | None, typer.Option(min=1, max=IOMODEL_MAX,
                                                   help="N of the tile-size table (default: the largest N).")] = None,
    tradeoff_block_m: Annotated[str, typer.Option(help="BLOCK_M values of the tile-size table.")] = "16,32,64,128,256",
) -> None:
    """HBM bytes moved by naive vs tiled (FlashAttention) attention, forward and backward,
    as a model (flashgen/iomodel.py), and the tile-size trade-off."""
    from . import iomodel as io
    from .spec import DTYPE_BYTES

    def ints(text, name):
        try:
            vals = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise typer.BadParameter(f"{text!r}: comma-separated integers", param_hint=name) from None
        if not vals or min(vals) < 1:
            raise typer.BadParameter(f"{text!r}: give positive integers", param_hint=name)
        if max(vals) > IOMODEL_MAX:
            raise typer.BadParameter(f"{text!r}: at most {IOMODEL_MAX:,} (the model walks the tiles one by one)",
                                     param_hint=name)
        return vals

    ns = ints(seqlen, "'--seqlen'")
    bms = ints(tradeoff_block_m, "'--tradeoff-block-m'")
    e = DTYPE_BYTES[dtype]
    console = _console()
    kw = dict(batch=batch, num_heads=heads, causal=causal)
    table = Table(title=Text(f"HBM bytes, model: batch {batch}, heads {heads}, d {head_dim}, {dtype}, "
                             f"{'causal' if causal else 'no mask'}, BLOCK_M {block_m}, BLOCK_N {block_n}"))
    for col in ("N", "fwd naive", "fwd tiled", "fwd naive/tiled", "bwd naive", "bwd tiled", "bwd naive/tiled"):
        table.add_column(col, justify="right")
    for r in io.forward_table(ns, head_dim, block_m, block_n, e, **kw):
        table.add_row(f"{r['N']:,}", io.fmt_bytes(r["naive_fwd_bytes"]), io.fmt_bytes(r["tiled_fwd_bytes"]),
                      f"{r['naive_fwd_bytes'] / r['tiled_fwd_bytes']:.1f}x",
                      io.fmt_bytes(r["naive_bwd_bytes"]), io.fmt_bytes(r["tiled_bwd_bytes"]),
                      f"{r['naive_bwd_bytes'] / r['tiled_bwd_bytes']:.1f}x")
    console.print(table)
    n = max(ns) if tradeoff_n is None else tradeoff_n
    table = Table(title=Text(f"forward bytes as BLOCK_M varies: N {n:,}, d {head_dim}, BLOCK_N {block_n}"))
    for col in ("BLOCK_M", "fwd tiled", "vs naive", "Q + K + V tiles in SRAM"):
        table.add_column(col, justify="right")
    for r in io.block_m_tradeoff(n, head_dim, bms, block_n, e, **kw):
        table.add_row(str(r["BLOCK_M"]), io.fmt_bytes(r["tiled_fwd_bytes"]),
                      f"{r['tiled_fwd_bytes'] / r['naive_fwd_bytes']:.2f}x", io.fmt_bytes(r["tile_smem_bytes"]))
    console.print(table)

@app.command()
def explain(
    batch: Annotated[int, typer.Option(min=0)],
    heads: Annotated[int, typer.Option(min=1, help="Query heads.")],
    kv_heads: Annotated[int, typer.Option(min=1, help="Key/value heads (GQA when fewer than --heads).")],
    seqlen_q: Annotated[int, typer.Option(min=0)],
    seqlen_k: Annotated[int, typer.Option(min=0)],
    head_dim: Annotated[int, typer.Option(help="A multiple of 8 in [8, 256].")],
    head_dim_v: Annotated[int | None, typer.Option(help="Value head dim (default: --head-dim).")] = None,
    causal: Annotated[bool, typer.Option("--causal", help="Bottom-right causal mask.")] = False,
    window: Annotated[str, typer.Option(help="Sliding window LEFT,RIGHT (-1 = unbounded).")] = "-1,-1",
    dtype: Annotated[DtypeName, typer.Option(help="Element type of q, k, v.")] = "bfloat16",
    db: Annotated[Path | None, typer.Option(dir_okay=False,
                                            help="Also read this tuning DB (first, before the shipped ones).")] = None,
    arch: Annotated[str | None, typer.Option(help="Explain for this architecture (e.g. sm_90) instead of "
                                             "this machine's device.")] = None,
    gpu: Annotated[str | None, typer.Option(help="Match tuning rows of this GPU name (e.g. 'NVIDIA H200') "
                                            "instead of this machine's; without a GPU here and without "
                                            "--arch, also explain for that GPU's architecture (a name it does not "
                                            "know needs --arch); with --arch, a name it knows brings its SM count "
                                            "and must be of that architecture.")] = None,
    deterministic: Annotated[bool, typer.Option("--deterministic", help="The backward of "
                                                "flashgen.attention(..., deterministic=True).")] = False,
    softcap: Annotated[float, typer.Option(help="flashgen.attention's softcap (0: off).")] = 0.0,
    alibi: Annotated[bool, typer.Option("--alibi", help="With ALiBi slopes (alibi_slopes).")] = False,
    bias: Annotated[bool, typer.Option("--bias", help="With an additive bias tensor.")] = False,
    dropout_p: Annotated[float, typer.Option(help="flashgen.attention's dropout_p (0: off).")] = 0.0,
) -> None:
    """Which kernels and tile configs flashgen.attention would run for these sizes, where
    each config came from (tuned row, nearest bucket, default), its measured TFLOP/s and
    its shared-memory budget.  Needs no GPU (sizes only)."""
    from . import arch as arch_mod
    from .api import explain_sizes
    from .dispatch import Dispatcher
    from .env import Environment
    from .errors import InputError, UnsupportedError

    try:
        left, right = (int(x) for x in window.split(","))
    except ValueError:
        raise typer.BadParameter(f"{window!r}: give LEFT,RIGHT, e.g. 128,0", param_hint="'--window'") from None
    # The flags' own rules first, so the message names the flag (not the op's q/k/v).
    for flag, val in (("--head-dim", head_dim), ("--head-dim-v", head_dim_v)):
        if val is not None and not (8 <= val <= 256 and val % 8 == 0):
            raise typer.BadParameter(f"{val}: must be a multiple of 8 in [8, 256]", param_hint=f"'{flag}'")
    if heads % kv_heads:
        raise typer.BadParameter(f"--heads ({heads}) must be a multiple of --kv-heads ({kv_heads})",
                                 param_hint="'--heads' / '--kv-heads'")
    if left < -1 or right < -1:
        raise typer.BadParameter(f"{window!r}: each side must be >= 0, or -1 for unbounded", param_hint="'--window'")
    if not 0.0 <= dropout_p < 1.0:
        raise typer.BadParameter(f"{dropout_p}: must be in [0, 1)", param_hint="'--dropout-p'")
    if not (math.isfinite(softcap) and softcap >= 0):
        raise typer.BadParameter(f"{softcap}: must be a finite number >= 0 (0: off)", param_hint="'--softcap'")
    env, a = Environment.current(), arch_mod.current()
    if arch is not None:
        try:
            a = arch_mod.by_sm(arch)
        except KeyError as e:
            raise typer.BadParameter(str(e.args[0]), param_hint="'--arch'") from None
        env = dataclasses.replace(env, gpu_name=a.name, compute_capability="%d.%d" % a.compute_capability,
                                  sm_count=a.sm_count)
    if gpu is not None and not gpu.strip():
        raise typer.BadParameter("the GPU name is empty (give it as `flashgen show` lists it, e.g. 'NVIDIA H200')",
                                 param_hint="'--gpu'")
    if gpu is not None:
        env = dataclasses.replace(env, gpu_name=gpu)
        known = arch_mod.by_gpu_name(gpu)
        if arch is not None and known is not None:
            # the named part's own SM count (an H100 PCIe: 114), within --arch's limits
            if known.compute_capability != a.compute_capability:
                raise typer.BadParameter(
                    f"{gpu!r} is compute capability {'%d.%d' % known.compute_capability}, not --arch {arch}'s "
                    f"{'%d.%d' % a.compute_capability}: leave out --arch, or name a GPU of {arch}",
                    param_hint="'--gpu'")
            a = known
            env = dataclasses.replace(env, compute_capability="%d.%d" % a.compute_capability, sm_count=a.sm_count)
        named = known if arch is None and a.name == arch_mod.INTERPRETER.name else None
        if named is not None:  # no GPU here: explain for the named GPU's architecture
            a = named
            env = dataclasses.replace(env, compute_capability="%d.%d" % a.compute_capability, sm_count=a.sm_count)
        elif arch is None and a.name == arch_mod.INTERPRETER.name and not gpu.startswith(a.name):
            # (the interpreter's own rows, e.g. "triton-interpreter (model)" of --fake-model, keep it)
            raise typer.BadParameter(
                f"{gpu!r}: no GPU here and no architecture known for this name (known names contain "
                f"{', '.join(p for p, _ in arch_mod._NAME_PARTS)}); give its architecture with --arch "
                f"(one of {', '.join(sorted(arch_mod.TABLE))})", param_hint="'--gpu'")
    disp = Dispatcher(env=env, arch=a)
    if db is not None:
        if not db.exists():
            raise typer.BadParameter(f"{db} does not exist", param_hint="'--db'")
        disp.add_database(db)
    try:
        with warnings.catch_warnings():
            # the dispatcher's once-per-process note that a key runs its default: the
            # report says so for each kernel ("default; no tuned row")
            warnings.filterwarnings("ignore", message="flashgen: .* runs the heuristic default config")
            report = explain_sizes(batch=batch, heads=heads, kv_heads=kv_heads, seqlen_q=seqlen_q,
                                   seqlen_k=seqlen_k, head_dim=head_dim, head_dim_v=head_dim_v, dtype=dtype,
                                   causal=causal, window=(left, right), dispatcher=disp,
                                   deterministic=deterministic or None, softcap=softcap, alibi=alibi, bias=bias,
                                   dropout_p=dropout_p)
    except (InputError, UnsupportedError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"{env.gpu_name} (cc {env.compute_capability}, triton {env.triton_version}); databases: "
               + (", ".join(dict.fromkeys(str(p.resolve()) for p in disp.databases())) or "none"))
    typer.echo(str(report))
    from .dispatch import families_left_out

    if (left := families_left_out()) is not None:
        typer.echo(f"note: {left}: its rows and defaults are not served here (unset it for the dispatcher's "
                   "own choice)")
    if arch is not None and gpu is None:
        # --arch alone names the architecture's reference GPU; rows of its other GPUs
        # (the shipped H200 rows under sm_90) apply only with --gpu
        import shlex

        from .db import TuningDB

        from .env import real_gpu

        others: dict[tuple[str, int | None], int] = {}
        for p in dict.fromkeys(disp.databases()):
            if Path(p).exists():
                with TuningDB(p, readonly=True) as tdb:
                    for (name, sms), n in tdb.gpu_sm_counts(env.compute_capability).items():
                        if name != env.gpu_name:
                            others[name, sms] = others.get((name, sms), 0) + n
        for (name, sms), n in sorted(others.items(), key=lambda t: (t[0][0], t[0][1] or 0)):
            held = f"the databases hold {n} rows measured on {name!r} (cc {env.compute_capability}, {sms} SMs)"
            if sms == env.sm_count and real_gpu(name):
                typer.echo(f"note: {held}: a sibling of {env.gpu_name!r} (the same compute capability and SM "
                           f"count), used where it has no row of its own (--arch {arch} explains for "
                           f"{env.gpu_name!r}); --gpu {shlex.quote(name)} explains with them as that GPU's own")
            else:
                typer.echo(f"note: {held}, not used here (--arch {arch} explains for {env.gpu_name!r}); "
                           f"--gpu {shlex.quote(name)} explains with them")


def _empty_argument(args: list[str]) -> str | None:
    """Where ``args`` hold an empty value ("" or ``--opt=``), described; None if nowhere.
    click reads an empty path as the current directory ("file '' is a directory"), and
    no option or argument here takes an empty value."""
    for i, a in enumerate(args):
        if a == "":
            return f"the argument after {args[i - 1]!r}" if i else "the first argument"
        if a.startswith("--") and "=" in a and not a.partition("=")[2]:
            return a.partition("=")[0]
    return None


def main() -> None:
    import sys

    where = _empty_argument(sys.argv[1:])
    if where is not None:
        typer.echo(f"Error: {where} is empty: every option value and argument needs one (a path, a name, a "
                   "number).", err=True)
        raise SystemExit(2)
    app()

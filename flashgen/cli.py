"""``flashgen`` command line: argument parsing and printing only.

    flashgen tune  [--preset NAME]... [--db PATH] [--dtype D] [--kernels K,...] [--trials N]
                   [--timeout-per-key S] [--fake TIMINGS.json]
    flashgen show  [--db PATH] [--key SUBSTR] [--all]
    flashgen merge OUT IN...
    flashgen bench [--preset NAME]... [--dtype D] [--backends B,...] [--json PATH]
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from .spec import DTYPES, KERNELS, TileConfig

#: The user's tuning DB.  The shipped one (tuning_db/h200.sqlite) is written only when
#: --db names it.
DEFAULT_DB = Path("flashgen_tuning.sqlite")

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Generate, tune and inspect flashgen's Triton attention kernels.")


def _console() -> Console:
    """A console that does not squeeze tables to 80 columns when output is piped."""
    import sys

    return Console() if sys.stdout.isatty() else Console(width=220)


def _fmt(x: float | None, spec: str = ".4f") -> str:
    return "-" if x is None else format(x, spec)


def _config_id(row: dict) -> str:
    return TileConfig.from_dict(row).id


def _check_presets(names: list[str]) -> list[str]:
    from .presets import PRESETS

    bad = [n for n in names if n not in PRESETS]
    if bad:
        raise typer.BadParameter(f"unknown preset {bad[0]!r}; known: {', '.join(sorted(PRESETS))}")
    return names


def _check_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise typer.BadParameter(f"{dtype!r} is not one of {', '.join(DTYPES)}")
    return dtype


def _check_kernels(kernels: str) -> str:
    names = [k.strip() for k in kernels.split(",") if k.strip()]
    bad = [k for k in names if k not in KERNELS]
    if bad or not names:
        raise typer.BadParameter(f"{kernels!r}: give a comma-separated subset of {','.join(KERNELS)}")
    return ",".join(names)


def _read_timings(path: Path) -> dict[str, float]:
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ValueError("expected a JSON object {variant_id: median_ms}")
        return {str(k): float(v) for k, v in data.items()}
    except (ValueError, TypeError) as e:
        raise typer.BadParameter(f"{path}: {e}", param_hint="'--fake'") from None


@app.command()
def tune(
    preset: Annotated[list[str], typer.Option(callback=_check_presets,
                                              help="Preset(s) of shapes: fa-grid, llama3-8b, small.")] = ["fa-grid"],
    db: Annotated[Path, typer.Option(dir_okay=False, help="Tuning DB to append to.")] = DEFAULT_DB,
    dtype: Annotated[str, typer.Option(callback=_check_dtype)] = "bfloat16",
    kernels: Annotated[str, typer.Option(callback=_check_kernels,
                                         help="Comma-separated kernels to tune.")] = ",".join(KERNELS),
    trials: Annotated[int, typer.Option(min=1, help="Completed trials per key (earlier runs count).")] = 40,
    timeout_per_key: Annotated[float | None, typer.Option(min=0, help="Seconds per key.")] = None,
    fake: Annotated[Path | None, typer.Option(exists=True, dir_okay=False,
                                             help="Replay timings from JSON {variant_id: ms}.")] = None,
    seed: int = 0,
) -> None:
    """Tune tile configs for the preset shapes and record every measurement in the DB."""
    from . import arch as arch_mod, presets, tuner
    from .db import TuningDB
    from .env import Environment

    console = _console()
    items = presets.expand(preset, dtype, kernels.split(","))
    env = Environment.current()
    arch = arch_mod.current()
    if fake is not None:
        bench = tuner.FakeBenchmarker(_read_timings(fake))
        # replayed timings must never be taken for this GPU's
        env = dataclasses.replace(env, gpu_name=f"{env.gpu_name} (fake)")
    else:
        import torch

        if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            console.print("[red]error:[/] no CUDA device; the real benchmarker needs a GPU "
                          "(or TRITON_INTERPRET=1). Use --fake TIMINGS.json to replay timings.")
            raise typer.Exit(2)
        from .bench import KernelBenchmarker

        bench = KernelBenchmarker()
        precompile = getattr(bench, "precompile", None)
        if callable(precompile):
            variants = tuner.feasible_variants([k for k, _ in items], arch)
            with Progress(TextColumn("precompiling"), BarColumn(), MofNCompleteColumn(),
                          TimeElapsedColumn(), console=console) as progress:
                task = progress.add_task("precompile", total=len(variants))
                failures = precompile(variants, progress=lambda vid, failure: progress.advance(task))
            bad = {vid: f for vid, f in failures.items() if f}
            console.print(f"precompiled {len(variants)} variants; {len(bad)} failed", markup=False)
            for vid, f in sorted(bad.items())[:20]:
                console.print(f"  {vid}: {f[:300]}", markup=False)
            ratios = bench.check_ratios()
            if ratios:
                worst = max(ratios, key=ratios.get)
                console.print(f"correctness: {len(ratios)} variants checked on an awkward shape against "
                              f"float64; worst error ratio {ratios[worst]:.3f} ({worst}; <= 1 passes)",
                              markup=False)

    console.print(f"tuning {len(items)} keys, {trials} trials each, on {env.gpu_name} -> {db}",
                  markup=False)
    with TuningDB(db, readonly=False) as tdb, Progress(TextColumn("{task.description}"), BarColumn(),
                                        MofNCompleteColumn(), TimeElapsedColumn(),
                                        console=console) as progress:
        keys_task = progress.add_task("keys", total=len(items))
        trials_task = progress.add_task("trials", total=trials)

        def on_key(i, n, key):
            progress.update(keys_task, completed=i, description=f"key {key.id}")
            progress.reset(trials_task, total=trials)

        def on_trial(key, n_done, n_total, row):
            progress.update(trials_task, completed=n_done,
                            description=f"{row['variant_id']} {row['status']}")

        results = tuner.tune(items, benchmarker=bench, db=tdb, env=env, arch=arch, n_trials=trials,
                             timeout_per_key_s=timeout_per_key, seed=seed, on_key=on_key,
                             on_trial=on_trial)
        progress.update(keys_task, completed=len(items))

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
    db: Annotated[Path, typer.Option(exists=True, dir_okay=False, help="Tuning DB to read.")] = DEFAULT_DB,
    key: Annotated[str | None, typer.Option(help="Only keys containing this text.")] = None,
    all_: Annotated[bool, typer.Option("--all", help="Every row, not only the best per key.")] = False,
) -> None:
    """Show the best ok row per key and environment (or every row) and the row count per
    status."""
    from .db import TuningDB

    console = _console()
    with TuningDB(db, readonly=True) as tdb:
        if all_:
            rows = tdb.rows(key_contains=key)
            cols = ("id", "key", "config", "status", "median ms", "TFLOP/s", "smem model B", "gpu",
                    "error")
            cells = [(str(r["id"]), r["key"], _config_id(r), r["status"], _fmt(r["median_ms"]),
                      _fmt(r["tflops"], ".4g"), str(r["smem_bytes_model"]), r["gpu_name"],
                      (r["error"] or "")[:60]) for r in rows]
        else:
            rows = tdb.best_rows(key_contains=key)
            cols = ("key", "config", "median ms", "TFLOP/s", "gpu", "triton", "template")
            cells = [(r["key"], _config_id(r), _fmt(r["median_ms"]), _fmt(r["tflops"], ".4g"),
                      r["gpu_name"], r["triton_version"], r["template_hash"]) for r in rows]
        counts = tdb.status_counts(key_contains=key)
    table = Table(title=Text(f"{db}: {'all rows' if all_ else 'best per key'}"))
    for c in cols:
        table.add_column(c, no_wrap=c == "key")
    for row in cells:
        table.add_row(*map(Text, row))
    console.print(table)
    console.print("rows per status: " + (", ".join(f"{s} {n}" for s, n in sorted(counts.items()))
                                         or "none"))


@app.command()
def merge(
    out: Annotated[Path, typer.Argument(dir_okay=False, help="DB to append to (created if missing).")],
    inputs: Annotated[list[Path], typer.Argument(exists=True, dir_okay=False, help="DBs to read.")],
) -> None:
    """Append to OUT the rows of each IN that OUT lacks."""
    from .db import TuningDB

    with TuningDB(out, readonly=False) as tdb:
        for p in inputs:
            typer.echo(f"{p}: {tdb.merge_from(p)} rows added to {out}")


@app.command()
def bench(
    preset: Annotated[list[str], typer.Option(callback=_check_presets,
                                              help="Preset(s) of shapes: fa-grid, llama3-8b, small.")] = ["fa-grid"],
    dtype: Annotated[str, typer.Option(callback=_check_dtype)] = "bfloat16",
    backends: Annotated[str, typer.Option(help="Comma-separated: flashgen, flashgen-default, "
                                          "sdpa-flash, sdpa-cudnn.")] = "flashgen,flashgen-default,sdpa-flash,sdpa-cudnn",
    json_out: Annotated[Path | None, typer.Option("--json", dir_okay=False, help="Write all numbers here.")] = None,
    check: Annotated[bool, typer.Option(help="Check flashgen against the float64 reference.")] = True,
    rep_ms: Annotated[int, typer.Option(min=1, help="Timing repetitions, in ms of GPU time.")] = 50,
) -> None:
    """flashgen (tuned and default config) against torch SDPA's backends, side by side."""
    import torch

    from . import compare
    from .bench import KernelBenchmarker
    from .dispatch import Dispatcher, default_dispatcher
    from .spec import KernelSpec, Variant

    names = [b.strip() for b in backends.split(",") if b.strip()]
    unknown = sorted(set(names) - set(compare.BACKENDS))
    if unknown:
        raise typer.BadParameter(f"unknown backend(s) {unknown}; known: {list(compare.BACKENDS)}",
                                 param_hint="'--backends'")
    if not torch.cuda.is_available():
        Console().print("[red]error:[/] flashgen bench needs a CUDA GPU")
        raise typer.Exit(2)
    console = _console()
    entries = compare.entries_from_presets(preset)
    # Compile every variant the run will launch, in parallel, before timing anything.
    variants = []
    for disp in (default_dispatcher(), Dispatcher(databases=[])):
        for d, causal, shape in entries:
            for kernel in KERNELS:
                spec = KernelSpec(kernel, dtype, d, d, "causal" if causal else "none")
                variants.append(Variant(spec, disp.config_for(shape.key(spec))))
    KernelBenchmarker().precompile(list(dict.fromkeys(variants)))
    tdtype = getattr(torch, dtype)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        task = progress.add_task("shapes", total=len(entries))
        rows = compare.run(entries, dtype=tdtype, backends=names, rep_ms=rep_ms, check=check,
                           progress=lambda row: progress.advance(task))
    if json_out:
        json_out.write_text(compare.to_json(rows))
    table = Table(title=Text(f"TFLOP/s forward / backward, {dtype}, {torch.cuda.get_device_name()}"))
    table.add_column("d")
    table.add_column("causal")
    table.add_column("batch x heads x seqlen")
    for n in names:
        table.add_column(n)
    if check:
        table.add_column("max err ratio")
    for r in rows:
        sh = r.shape
        cells = []
        for n in names:
            c = r.cells[n]
            cells.append(f"{c['fwd_tflops']:.0f} / {c['bwd_tflops']:.0f}" if c["error"] is None
                         else c["error"][:40])
        extra = [f"{max(r.check.values()):.2f}"] if check else []
        table.add_row(str(r.head_dim), "y" if r.causal else "n",
                      f"{sh['batch']}x{sh['num_heads']}/{sh['num_kv_heads']}x{sh['seqlen_q']}", *cells, *extra)
    console.print(table)
    ref = "sdpa-cudnn" if "sdpa-cudnn" in names else None
    if ref:
        for n in names:
            if n == ref:
                continue
            for dirn in ("fwd", "bwd"):
                ratios = [r.cells[n][f"{dirn}_tflops"] / r.cells[ref][f"{dirn}_tflops"] for r in rows
                          if r.cells[n][f"{dirn}_tflops"] and r.cells[ref][f"{dirn}_tflops"]]
                if ratios:
                    console.print(f"{n} / {ref} {dirn}: geomean {compare.geomean(ratios):.3f}x, "
                                  f"min {min(ratios):.3f}x over {len(ratios)} shapes", markup=False)


def main() -> None:
    app()

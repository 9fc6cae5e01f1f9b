"""``python -m benchmarks <suite> [--out DIR] [-- ARGS...]``: run one benchmark suite.

Suites (``python -m benchmarks list``): grid, llama, mods, varlen, decode, overhead,
exactness, model, fwd-configs, dq-atomic, user-mods, profile, gluon.  Each checks
flashgen against the float64 reference before timing, writes JSON into ``--out`` (default ``bench_out/<suite>``),
draws its plots there and prints its table last.  ARGS after ``--`` go to the suite's
script (e.g. ``python -m benchmarks mods -- --shapes 64:2048 --causal yes``; ``--smoke``
runs the mods, varlen, decode, exactness and probe scripts on the CPU interpreter).

With ``--smoke`` among those ARGS the steps after the first, which run on a CUDA GPU
alone and take no ARGS (the exactness suite's op checks and determinism), are skipped,
each with a line saying so.

``python -m benchmarks plot dense|mods|varlen|decode JSON... --out DIR [--memory]``
redraws plots from existing results (what docs/benchmarks.md's plots come from);
``--memory`` (dense alone) adds the peak-memory plot.

Exit status: the first failing step's (a failed float64 check fails its step), 2 for a
suite whose script is missing and for bad arguments (an ``--out`` that is not a
directory; for ``plot``, an input that is missing, not JSON or a result of another
kind), which get a one-line error naming the argument, and nothing is written.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from suites import SUITES, Suite  # noqa: E402


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def commands(suite: Suite, out: Path, extra: list[str]) -> list[list[str]]:
    """The argv of each step of ``suite`` writing into ``out``; ``extra`` to the first."""
    cmds = []
    for i, step in enumerate(suite.steps):
        argv = [sys.executable] + [a.replace("{out}", str(out)) for a in step]
        cmds.append(argv + (extra if i == 0 else []))
    return cmds


def _error(prog: str, message: str) -> int:
    """A bad argument: one line on stderr, exit status 2."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


def _not_a_directory(out: Path) -> str | None:
    """What is wrong with ``--out`` as a directory to write into, None when nothing."""
    if out.exists() and not out.is_dir():
        return f"--out {out}: exists and is not a directory (--out names the directory the files go into)"
    return None


def run_suite(suite: Suite, out: Path, extra: list[str]) -> int:
    if suite.needs and not (ROOT / suite.needs).is_file():
        print(f"suite {suite.name}: {suite.needs} is missing from this checkout, so there is nothing to run "
              f"(it comes with the transformers integration); no results written", file=sys.stderr)
        return 2
    prog = f"python -m benchmarks {suite.name}"
    bad = _not_a_directory(out)
    if bad:
        return _error(prog, bad)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return _error(prog, f"--out {out}: cannot create the directory ({e.strerror or e})")
    results = [str(out / r) for r in suite.results]
    print(f"suite {suite.name}: {suite.what}\n  results: {', '.join(results) or '(printed only)'}", flush=True)
    for i, argv in enumerate(commands(suite, out, extra)):
        if i and "--smoke" in extra:
            print(f"  skipped: python3 {' '.join(argv[1:])} (--smoke runs the first step alone: this step takes no "
                  f"--smoke and runs on a CUDA GPU)", flush=True)
            continue
        print("  $ " + " ".join(["python3", *argv[1:]] if argv[0] == sys.executable else argv), flush=True)
        rc = subprocess.call(argv, cwd=ROOT, env=_env())
        if rc:
            print(f"suite {suite.name}: step failed with exit status {rc}", file=sys.stderr)
            return rc
    present = [r for r in results if Path(r).is_file()]
    if suite.plot and present:
        import plots

        try:
            plots.KINDS[suite.plot](present, out, memory=True) if suite.plot == "dense" \
                else plots.KINDS[suite.plot](present, out)
        except ImportError as e:
            print(f"plots skipped ({e}): pip install matplotlib", file=sys.stderr)
        except plots.InputError as e:
            print(f"plots skipped: {e}", file=sys.stderr)
    if suite.table and present:
        import merge_bench

        merge_bench.main(present)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    if argv[:1] == ["plot"]:
        import plots

        ap = argparse.ArgumentParser(prog="python -m benchmarks plot", description="redraw a suite's plots from JSON")
        ap.add_argument("kind", choices=sorted(plots.KINDS))
        ap.add_argument("inputs", nargs="+", help="result JSON files (dense: also flashgen bench logs)")
        ap.add_argument("--out", required=True, type=Path, help="directory for the PNG files")
        ap.add_argument("--title", default="")
        ap.add_argument("--memory", action="store_true", help="dense alone: also the peak-memory plot (from bench "
                        "JSON with peak memory)")
        a = ap.parse_args(argv[1:])
        prog = f"{ap.prog} {a.kind}"
        if a.memory and a.kind != "dense":
            return _error(prog, f"--memory: only the dense kind has a peak-memory plot, not {a.kind}")
        bad = _not_a_directory(a.out)
        if bad:
            return _error(prog, bad)
        kw = {"memory": a.memory} if a.kind == "dense" else {}
        try:
            written = plots.KINDS[a.kind](a.inputs, a.out, title=a.title, **kw)
        except plots.InputError as e:
            return _error(prog, str(e) if str(e).startswith("--") else f"input {e}")
        except ImportError as e:
            print(f"{prog}: {e}: pip install matplotlib", file=sys.stderr)
            return 1
        except OSError as e:
            return _error(prog, f"--out {a.out}: cannot write the plots there ({e.strerror or e})")
        for p in written:
            print(p)
        return 0
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0],
                                 epilog="suites: " + ", ".join(SUITES))
    ap.add_argument("suite", choices=["list", *SUITES])
    ap.add_argument("--out", type=Path, default=None, help="output directory (default bench_out/<suite>)")
    a = ap.parse_args(argv)
    if a.suite == "list":
        width = max(len(n) for n in SUITES)
        for s in SUITES.values():
            print(f"{s.name:{width}} {s.what}")
            for step in s.steps:
                print(f"{'':{width}}   python3 {' '.join(step).replace('{out}', f'bench_out/{s.name}')}")
        return 0
    return run_suite(SUITES[a.suite], a.out or Path("bench_out") / a.suite, extra)


if __name__ == "__main__":
    sys.exit(main())

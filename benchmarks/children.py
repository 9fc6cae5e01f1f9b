"""One benchmark job in a child process under a timeout (a kernel that deadlocks kills
the child, not the run): the job prints ``RESULT <json>``; the parent reads it."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def run_child(script: str, args: list[str], timeout_s: float, cwd, what: dict) -> dict:
    """``python3 script --child *args`` under ``timeout_s``: its RESULT dict, else ``what``
    with ok False and the error (the exit status and stderr's tail, or the timeout); with
    the wall time in ``wall_s`` either way."""
    t0 = time.perf_counter()
    try:
        r = subprocess.run([sys.executable, script, "--child", *args], capture_output=True, text=True,
                           timeout=timeout_s, cwd=cwd)
        res = [json.loads(x[7:]) for x in r.stdout.splitlines() if x.startswith("RESULT ")]
        row = res[0] if res else dict(what, ok=False, error=f"exit {r.returncode}: {r.stderr[-1500:]}")
    except subprocess.TimeoutExpired:
        row = dict(what, ok=False, error=f"timed out after {timeout_s:g} s")
    row["wall_s"] = time.perf_counter() - t0
    return row


def run_jobs(script: str, names: list[str], dims: list[int], timeout_s: float, cwd, out_json, key: str) -> list[dict]:
    """:func:`run_child` for every (name, head_dim) of ``names`` x ``dims`` in turn, as
    ``--child NAME HEAD_DIM``; the rows (``key``: the name, ``d``) rewritten to
    ``out_json`` after each and printed (cut to 300 characters)."""
    rows = []
    for name in names:
        for d in dims:
            row = run_child(script, [name, str(d)], timeout_s, cwd, {key: name, "d": d})
            rows.append(row)
            out_json.write_text(json.dumps(rows, indent=1))
            print(json.dumps(row)[:300], flush=True)
    return rows


def main_jobs(doc: str, script: str, child, flag: str, choices: tuple, head_dims: tuple, cwd, out_name: str,
              key: str, timeout_s: float = 240.0):
    """The command line of a benchmark that runs ``child(name, head_dim) -> dict`` per
    (``--<flag>`` name of ``choices``, ``--head-dims`` of ``head_dims``) in child
    processes: ``--out DIR`` (default $OUT or .), ``--timeout-s`` per job.  In a child
    (``--child NAME HEAD_DIM``) it prints the RESULT and returns None; else the rows of
    :func:`run_jobs`, written to ``DIR/out_name``."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--timeout-s", type=float, default=timeout_s, help="per job (its child process)")
    ap.add_argument("--head-dims", default=",".join(map(str, head_dims)),
                    help=f"comma-separated, of {', '.join(map(str, head_dims))}")
    ap.add_argument(f"--{flag}", default=",".join(choices), help=f"comma-separated, of {', '.join(choices)}")
    ap.add_argument("--child", nargs=2, metavar=("NAME", "HEAD_DIM"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child[0], int(args.child[1]))), flush=True)
        return None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dims = [int(x) for x in args.head_dims.split(",") if x]
    names = [x for x in getattr(args, flag).split(",") if x]
    if not dims or set(dims) - set(head_dims) or not names or set(names) - set(choices):
        ap.error(f"--head-dims of {head_dims}, --{flag} of {choices}: got {args.head_dims!r}, "
                 f"{getattr(args, flag)!r}")
    return run_jobs(script, names, dims, args.timeout_s, cwd, out / out_name, key)

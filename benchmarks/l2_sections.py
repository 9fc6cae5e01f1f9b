"""The sections of the Gluon forward's persistent causal walk, measured: their L2 size
and their balance.

The walks of 2 and 3 (``persistent`` 2 and 3) with a mask take the tiles longest first
within sections of (z, h) planes whose K and V fit ``config.L2_SECTION_BYTES``
(``config.section_planes``): every query block of a plane is spread over the whole
section's time, so the section's K and V must stay in L2 meanwhile.  The programs take
the tiles round-robin, so the section size also sets how evenly the long tiles are
dealt out; ``config.walk_section`` picks the best balanced size under the cap
(``config.walk_balance``'s model).  This script times the dispatcher's forward
(``flashgen.attention``, the shipped tuning rows) with every section at the cap of each
``--mb`` size (the balance off), and with ``--balanced`` the launcher's own choice at
the default cap, each setting in a child process of its own (a launch plan keeps the
section it was recorded with), against SDPA cuDNN in the same child, and prints the
ratios and each setting's modelled balance.  bf16, random inputs,
``triton.testing.do_bench`` median (L2 flushed between repetitions).

    PYTHONPATH=$PWD python3 benchmarks/l2_sections.py --out DIR --mb 32 --mb 16 --balanced \\
        --shape 32,16,16,512,128,causal --shape 32,32,32,512,64,causal
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SHAPES = ("32,16,16,512,128,causal", "16,16,16,1024,128,causal", "8,16,16,2048,128,causal",
                  "32,32,32,512,64,causal", "16,32,32,1024,64,causal", "8,32,32,2048,64,causal",
                  "1,32,8,2048,128,causal", "4,32,8,1024,128,causal")


def parse(s: str):
    """(b, h, hk, n, d, causal) of ``B,H,HKV,S,D[,causal]``."""
    parts = s.split(",")
    b, h, hk, n, d = (int(x) for x in parts[:5])
    return b, h, hk, n, d, "causal" in parts[5:]


def record_walks(log: list) -> None:
    """Wrap the launcher's ``walk_section`` so that each call appends (section, its
    modelled balance, the cap's) to ``log``."""
    from flashgen.families.gluon import config, launch

    def walk_section(num_hz, group, seqlen_q, seqlen_k, d_pad, dv_pad, mask, diag_lo, diag_hi, block_mt, block_n,
                     programs, snake=False):
        sec = config.walk_section(num_hz, group, seqlen_q, seqlen_k, d_pad, dv_pad, mask, diag_lo, diag_hi,
                                  block_mt, block_n, programs, snake)
        cap = config.section_planes(num_hz, group, seqlen_k, d_pad, dv_pad)
        work = config.block_work(seqlen_q, seqlen_k, mask, diag_lo, diag_hi, block_mt, block_n)
        log.append({"section": sec, "cap": cap, "programs": programs, "block_mt": block_mt, "block_n": block_n,
                    "snake": snake, "balance": config.walk_balance(work, num_hz, sec, programs, snake),
                    "balance_cap": config.walk_balance(work, num_hz, cap, programs, snake)})
        return sec

    launch.walk_section = walk_section


def child(mb: float | None, shapes: list[str], rep_ms: int) -> list[dict]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    import flashgen
    from flashgen.families.gluon import config

    if mb is None:
        config.BALANCE_SECTIONS = True
    else:
        config.BALANCE_SECTIONS = False
        config.L2_SECTION_BYTES = int(mb * 1024 * 1024)
    log: list = []
    record_walks(log)
    rows = []
    for s in shapes:
        b, h, hk, n, d, causal = parse(s)
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, x, n, d, device="cuda", dtype=torch.bfloat16) for x in (h, hk, hk))
        flops = 4.0 * b * h * n * n * d * (0.5 if causal else 1.0)

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hk != h)

        row = {"shape": s, "mb": "balanced" if mb is None else mb}
        del log[:]
        with torch.no_grad():
            for name, fn in (("flashgen", lambda: flashgen.attention(q, k, v, causal=causal)), ("cudnn", cudnn)):
                fn()
                torch.cuda.synchronize()
                row[name] = do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")
        row["tflops"] = flops / row["flashgen"] / 1e9
        row["walk"] = log[0] if log else None  # None: not a persistent walk with a mask
        # every tile taken once: the output agrees with cuDNN's to bf16 rounding
        row["max_abs_diff"] = (flashgen.attention(q, k, v, causal=causal) - cudnn()).abs().max().item()
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", action="append", help="B,H,HKV,S,D[,causal] (repeatable)")
    ap.add_argument("--mb", action="append", type=float, help="every section at the cap of this many MiB, "
                    "the balance off (repeatable)")
    ap.add_argument("--balanced", action="store_true", help="also the launcher's balanced sections under the "
                    "default cap")
    ap.add_argument("--rep", type=int, default=200, help="do_bench rep in ms")
    ap.add_argument("--out", help="directory for l2_sections.json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    shapes = args.shape or list(DEFAULT_SHAPES)
    if args.child is not None:
        print(json.dumps(child(None if args.child == "balanced" else float(args.child), shapes, args.rep)))
        return 0
    settings = [str(m) for m in (args.mb or ([] if args.balanced else [32.0, 16.0, 8.0]))]
    settings += ["balanced"] if args.balanced else []
    rows = []
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{os.environ.get('PYTHONPATH', '')}")
    for setting in settings:
        cmd = [sys.executable, __file__, "--child", setting, "--rep", str(args.rep)]
        for s in shapes:
            cmd += ["--shape", s]
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        if p.returncode != 0:
            print(f"{setting}: child failed\n{p.stderr[-2000:]}")
            continue
        rows += json.loads(p.stdout.strip().splitlines()[-1])
        print(f"{setting} done", flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "l2_sections.json").write_text(json.dumps(rows, indent=1))
    print(report(rows, shapes))
    return 0


def report(rows: list[dict], shapes: list[str]) -> str:
    """The table: per shape and setting, SDPA cuDNN's time over flashgen's (> 1: flashgen
    is faster) and the walk's modelled balance (largest over mean program work; "-" where
    the forward does not walk persistently with a mask); then each setting's geomean."""
    settings = list(dict.fromkeys(r["mb"] for r in rows))
    name = {m: (f"{m:g} MiB" if isinstance(m, (int, float)) else str(m)) for m in settings}
    lines = ["flashgen forward / SDPA cuDNN (> 1: flashgen faster) [modelled walk balance]",
             f"{'shape':28s} " + " ".join(f"{name[m]:>17s}" for m in settings)]
    for s in shapes:
        cells = []
        for m in settings:
            r = next((r for r in rows if r["shape"] == s and r["mb"] == m), None)
            walk = r.get("walk") if r else None
            bal = f"[{walk['balance']:.3f}]" if walk else "[-]"
            cells.append(f"{r['cudnn'] / r['flashgen']:7.3f} {bal:>9s}" if r else f"{'-':>17s}")
        lines.append(f"{s:28s} " + " ".join(cells))
    for m in settings:
        rs = [r for r in rows if r["mb"] == m]
        if rs:
            g = math.exp(sum(math.log(r["cudnn"] / r["flashgen"]) for r in rs) / len(rs))
            worst = max((r.get("max_abs_diff", 0.0) for r in rs), default=0.0)
            lines.append(f"geomean, {name[m]}: {g:.3f}x over {len(rs)} shapes; largest |O - O_cuDNN| {worst:.3g}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

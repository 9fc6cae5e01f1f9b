"""Where a flashgen kernel's warps wait: Nsight Compute's warp-state sampling per SASS
instruction, for the kernel the dispatcher picks at a shape.

For each case (``fwd`` or ``bwd`` and a shape), ncu runs a child python process (this
file with ``--child``) that calls ``flashgen.attention`` (forward, or forward and
backward) twice on random bf16 inputs; the second launch of the case's kernel
(``attn_fwd`` or ``attn_bwd``: the first one may include the compile) is profiled with
the sections WarpStateStats, SourceCounters, SpeedOfLight, ComputeWorkloadAnalysis and
LaunchStats (``--clock-control none``).  Per case it writes the source page
(``CASE.source.csv``: one row per SASS instruction with its warp-stall samples) and
prints:

* the kernel's duration, SM throughput, issue-slot use and registers (details page);
* the share of the samples on parked warps: the unused warps of the producer's
  warpgroup (Triton pads a one-warp partition to a warpgroup for setmaxnreg and parks
  the others on the NOP after a ``BAR.SYNC ... 0x1``), left out of every other share;
* the other samples by stall reason (ncu's ``stall_*`` columns) and by opcode class;
* the instructions with the most samples, with their SASS and, for the branch of an
  mbarrier wait loop (where a wait's samples land), the wait before it.

Besides the dispatcher's choice (``fwd:``, ``bwd:``), a case can be one Gluon forward
config (``gluon:SHAPE@knob=value,...``, the knobs of ``GluonFwdConfig`` as
``ncu_compare.py --gluon-config`` takes them), SDPA's cuDNN forward (``cudnn:SHAPE``,
its ``flash_fprop`` kernel) or cuDNN's backward (``cudnn-bwd:SHAPE``, its ``flash_bprop``
kernel, without the ``dO . O`` and dQ conversion kernels around it), so a tile and the
peer it is measured against are sampled the same way.

A warp-specialized kernel's producer and consumer warps are sampled alike, so a
producer waiting on an empty ring slot shows as mbarrier-wait samples too: read the
instruction list (their addresses fall in the partition's code) before naming a cause.

    PYTHONPATH=$PWD python3 benchmarks/ncu_stalls.py --out DIR \
        --case fwd:32,16,16,512,128,causal --case bwd:4,16,16,4096,128 \
        --case gluon:32,16,16,512,128,causal@num_consumers=2,BLOCK_N=128,persistent=3 \
        --case cudnn:32,16,16,512,128,causal --case cudnn-bwd:4,16,16,4096,128
    python3 benchmarks/ncu_stalls.py --from DIR [--out DIR2]   # summarize DIR's *.source.csv again

The CSV parsing (:func:`parse_source_csv`, :func:`opcode_class`, :func:`summarize`) is
plain Python, tested on CPU in tests/test_ncu_stalls.py.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("WarpStateStats", "SourceCounters", "SpeedOfLight", "ComputeWorkloadAnalysis", "LaunchStats")
#: The profiled kernel of each case kind (ncu's ``--kernel-name`` regex).
KERNEL = {"fwd": "^attn_fwd$", "bwd": "^attn_bwd$", "gluon": "^attn_fwd$", "cudnn": "flash_fprop",
          "cudnn-bwd": "flash_bprop"}
#: Opcode classes, first match wins: (name, regex on the SASS text).
CLASSES = (
    ("mbarrier wait", r"\bSYNCS\.PHASECHK"),
    ("mbarrier arrive", r"\bSYNCS\.ARRIVE"),
    ("wgmma wait", r"\bWARPGROUP\.DEPBAR"),
    ("wgmma issue", r"\bHGMMA\b|\bWARPGROUP\.ARRIVE"),
    ("exp2 / rcp (MUFU)", r"\bMUFU\b"),
    ("named barrier", r"\bBAR\b"),
    ("TMA / bulk copy", r"\bUTMA|\bUBLKCP|\bUTMACCTL|\bUTMAREDG|\bUTMASTG|\bUTMALDG"),
    ("shared memory", r"\b(LDS|STS|LDSM|STSM)\b"),
    ("global memory", r"\b(LDG|STG|RED|ATOM)\b"),
    ("float math", r"\b(FMUL|FADD|FFMA|FMNMX|FSEL|FSETP|F2FP|HADD2|HMUL2|HFMA2)\b"),
)


def opcode_class(sass: str) -> str:
    """The :data:`CLASSES` name of one SASS instruction's text ("other" if none)."""
    for name, pattern in CLASSES:
        if re.search(pattern, sass):
            return name
    return "other"


def _num(text: str) -> float:
    try:
        return float(str(text).replace(",", "").strip() or 0)
    except ValueError:
        return 0.0


def parse_source_csv(text: str) -> tuple[list[str], list[dict]]:
    """(header, rows) of ``ncu --page source --csv --print-source sass`` output: lines
    before the header (``==PROF==`` and the program's own output) are skipped; the
    header is the first line whose first field names an address."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if re.match(r'^"?#?\s*Address', ln)), None)
    if start is None:
        raise ValueError("no source table (a line starting with '# Address') in the CSV")
    reader = csv.reader(io.StringIO("\n".join(lines[start:])))
    header = next(reader)
    rows = [dict(zip(header, r)) for r in reader if len(r) == len(header)]
    return header, rows


def _column(header: list[str], *needles: str) -> str | None:
    for h in header:
        if all(n.lower() in h.lower() for n in needles):
            return h
    return None


#: The predicate an instruction writes (its first operand), and the one a branch tests.
_WRITES_PRED = re.compile(r"^\s*(?:@!?U?P\w+\s+)?[A-Z][\w.]*\s+(U?P\d)\s*,")
_BRANCH_ON = re.compile(r"^\s*@!?(U?P\d)\s+BRA\b")


def wait_loops(rows: list[dict], source: str) -> dict[int, int]:
    """{index of a branch: index of the mbarrier try-wait it loops on}: a branch
    predicated on the predicate a ``SYNCS.PHASECHK...TRYWAIT`` wrote last (the compiler
    may put other instructions between them).  A wait's samples land on its branch."""
    last: dict[str, int | None] = {}
    out = {}
    for i, r in enumerate(rows):
        text = r[source]
        b = _BRANCH_ON.match(text)
        if b and last.get(b.group(1)) is not None:
            out[i] = last[b.group(1)]
        w = _WRITES_PRED.match(text)
        if w:
            last[w.group(1)] = i if "TRYWAIT" in text else None
    return out


def parked(rows: list[dict], source: str) -> set[int]:
    """Indices of the instructions where Triton parks the padding warps of a one-warp
    partition: a NOP right after a ``BAR.SYNC.DEFER_BLOCKING 0x1``."""
    return {i for i in range(1, len(rows)) if rows[i][source].strip().rstrip(" ;") == "NOP"
            and rows[i - 1][source].strip().startswith("BAR.SYNC.DEFER_BLOCKING 0x1")}


def summarize(header: list[str], rows: list[dict], top: int = 30) -> dict:
    """Parked-warp share, stall reasons and opcode classes of the other samples (% of
    them), and the ``top`` instructions by samples (% of the other samples)."""
    samples = _column(header, "(all samples)") or _column(header, "sampling")
    not_issued = _column(header, "(not-issued samples)") or _column(header, "not issued")
    source = _column(header, "source") or header[1]
    address = header[0]
    if samples is None:
        raise ValueError(f"no warp-stall sampling column in {header}")
    total = sum(_num(r[samples]) for r in rows) or 1.0
    idle = parked(rows, source)
    idle_samples = sum(_num(rows[i][samples]) for i in idle)
    active = max(total - idle_samples, 1.0)
    loops = wait_loops(rows, source)
    by_class: dict[str, float] = {}
    for i, r in enumerate(rows):
        if i not in idle:
            c = "mbarrier wait" if i in loops else opcode_class(r[source])
            by_class[c] = by_class.get(c, 0.0) + _num(r[samples])
    reasons = {}
    for col in header:
        if col.startswith("stall_") and "Not Issued" not in col:
            reasons[col[len("stall_"):]] = sum(_num(r[col]) for i, r in enumerate(rows) if i not in idle)
    order = sorted((i for i in range(len(rows)) if i not in idle), key=lambda i: -_num(rows[i][samples]))[:top]

    def entry(i):
        r = rows[i]
        return {"address": r[address], "pct": round(100 * _num(r[samples]) / active, 2),
                "not_issued_pct": round(100 * _num(r[not_issued]) / active, 2) if not_issued else None,
                "sass": r[source].strip(), "after": rows[loops[i]][source].strip() if i in loops else ""}

    specialized = any("USETMAXREG" in r[source] for r in rows)
    return {
        "total_samples": total,
        "parked_pct": round(100 * idle_samples / total, 1),
        # a warp-specialized kernel whose parked warps the pattern did not find: their
        # samples are then inside every other share
        "parked_found": bool(idle) or not specialized,
        "reasons": {k: round(100 * v / active, 1) for k, v in sorted(reasons.items(), key=lambda kv: -kv[1])
                    if v >= 0.005 * active},
        "by_class": {k: round(100 * v / active, 1) for k, v in sorted(by_class.items(), key=lambda kv: -kv[1])
                     if v > 0},
        "top": [entry(i) for i in order],
        "instructions": len(rows),
    }


def details_lines(text: str, wanted=("Duration", "Compute (SM) Throughput", "Registers Per Thread",
                                      "Tensor", "Issue Slots Busy", "Warp Cycles Per Issued Instruction",
                                      "Achieved Occupancy", "No Eligible", "Dynamic Shared Memory")) -> list[str]:
    """The details page's rows (``ncu --page details --csv``) whose metric names contain
    one of ``wanted``, as "name: value unit"."""
    out = []
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"ID"')), None)
    if start is None:
        return out
    for r in csv.DictReader(io.StringIO("\n".join(lines[start:]))):
        if not out and r.get("Kernel Name"):
            out.append(f"kernel: {r['Kernel Name'][:120]}")
        name = r.get("Metric Name", "")
        if any(w.lower() in name.lower() for w in wanted):
            out.append(f"{r.get('Section Name', '')} / {name}: {r.get('Metric Value', '')} {r.get('Metric Unit', '')}")
    return out


def find_ncu() -> str | None:
    """Nsight Compute's ``ncu``: on PATH, else an install under /opt/nvidia/nsight-compute."""
    return shutil.which("ncu") or next((str(p) for p in Path("/opt/nvidia").glob("nsight-compute/*/ncu")), None)


def child(case: str) -> None:
    """The profiled program: two calls of the case (forward, or forward and backward)."""
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import torch

    import flashgen
    from profile_call import inputs, parse

    kind, spec = case.split(":", 1)
    spec, _, config = spec.partition("@")
    q, k, v, do, causal, window = inputs(spec)
    # ",sinks": learnable attention sinks, one float32 logit per query head
    sinks = torch.randn(q.shape[1], device="cuda", dtype=torch.float32) if parse(spec)[7] else None
    if kind == "gluon":
        from gluon_fwd import run_config
        from ncu_compare import gluon_config

        cfg = gluon_config(config)
    for _ in range(2):
        if kind == "gluon":
            with torch.no_grad():
                run_config(q, k, v, cfg, causal)
        elif kind in ("cudnn", "cudnn-bwd"):
            import torch.nn.functional as F
            from torch.nn.attention import SDPBackend, sdpa_kernel

            # with autograd on, as a training forward (and ncu_compare.py): cuDNN then
            # writes the LSE its backward needs, as flashgen's forward always does
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=k.shape[1] < q.shape[1])
                if kind == "cudnn-bwd":
                    o.backward(do)
        else:
            o = flashgen.attention(q, k, v, causal=causal, window=window, sinks=sinks)
            if kind == "bwd":
                o.backward(do)
        torch.cuda.synchronize()


def case_problem(case: str) -> str | None:
    """Why ``case`` is not a case this script profiles as written (None: it is one)."""
    kind, _, spec = case.partition(":")
    if kind not in KERNEL:
        return f"the kind must be one of {sorted(KERNEL)}"
    spec, at, config = spec.partition("@")
    if at and kind != "gluon":
        return "only a gluon: case takes @knob=value,... (the others profile the dispatcher's or cuDNN's kernel)"
    if kind == "gluon" and not config:
        return "a gluon: case names its config: gluon:B,H,HKV,S,D[,causal]@knob=value,..."
    flags = spec.split(",")[5:]
    extra = [f for f in flags if f != "causal"] if kind in ("gluon", "cudnn", "cudnn-bwd") else []
    if extra:
        return f"a {kind}: case takes a causal mask or none, not {extra} (window and sinks: fwd: and bwd: cases)"
    return None


def run_case(case: str, out: Path, ncu: str) -> dict:
    kind = case.split(":", 1)[0]
    why = case_problem(case)
    if why:
        raise SystemExit(f"--case {case!r}: {why}")
    name = re.sub(r"[^A-Za-z0-9]+", "_", case).strip("_")
    rep = out / f"{name}.ncu-rep"
    cmd = [ncu, "--clock-control", "none", "--kernel-name", f"regex:{KERNEL[kind]}", "--launch-skip", "1",
           "--launch-count", "1", "--import-source", "no", "-f", "-o", str(rep)]
    for s in SECTIONS:
        cmd += ["--section", s]
    cmd += [sys.executable, __file__, "--child", case]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{os.environ.get('PYTHONPATH', '')}")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=400)
    if p.returncode != 0 or not rep.exists():
        return {"case": case, "error": (p.stdout + p.stderr)[-3000:]}
    src = subprocess.run([ncu, "-i", str(rep), "--page", "source", "--csv", "--print-source", "sass"],
                         capture_output=True, text=True, timeout=300).stdout
    det = subprocess.run([ncu, "-i", str(rep), "--page", "details", "--csv"],
                         capture_output=True, text=True, timeout=300).stdout
    (out / f"{name}.source.csv").write_text(src)
    rep.unlink()
    try:
        header, rows = parse_source_csv(src)
        summary = summarize(header, rows)
    except ValueError as e:
        summary = {"error": str(e), "head": src[:2000]}
    return {"case": case, "details": details_lines(det), **summary}


def print_summary(results: list[dict], top: int) -> None:
    for r in results:
        print(f"\n== {r['case']}")
        if "error" in r:
            print("  error:", r["error"][-1500:], r.get("head", ""))
            continue
        for ln in r.get("details", []):
            print("  " + ln)
        if r.get("parked_found", True):
            print(f"  parked warps: {r['parked_pct']}% of the samples; the rest (%):")
        else:
            print("  parked warps: not found (no NOP after a BAR.SYNC 0x1 in this warp-specialized kernel's SASS): "
                  "their samples are in the shares below (%):")
        print("  by stall reason:", ", ".join(f"{k} {v}" for k, v in r["reasons"].items()))
        print("  by opcode class:", ", ".join(f"{k} {v}" for k, v in r["by_class"].items()))
        for t in r["top"][:top]:
            after = f"   <- {t['after'][:60]}" if t["after"] else ""
            print(f"  {t['pct']:6.2f}% {t['address'][-6:]:>6} {t['sass'][:80]}{after}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", action="append", default=[],
                    help="fwd:B,H,HKV,S,D[,causal][,window=L][,sinks], bwd:..., gluon:B,H,HKV,S,D[,causal]@knob=value,... "
                         "cudnn:B,H,HKV,S,D[,causal] or cudnn-bwd:... (repeatable)")
    ap.add_argument("--out", help="output directory (source CSVs, stalls.json; with --from: stalls.json)")
    ap.add_argument("--top", type=int, default=30, help="instructions listed per case")
    ap.add_argument("--from", dest="from_dir", metavar="DIR",
                    help="summarize the *.source.csv files an earlier run left in DIR (no GPU, no ncu)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child)
        return 0
    if args.from_dir:
        results = []
        # the details page's lines, from the run's stalls.json where it is there
        try:
            earlier = json.loads((Path(args.from_dir) / "stalls.json").read_text())
        except (OSError, ValueError):
            earlier = []
        details = {re.sub(r"[^A-Za-z0-9]+", "_", r["case"]).strip("_"): r.get("details", []) for r in earlier}
        for path in sorted(Path(args.from_dir).glob("*.source.csv")):
            name = path.name.removesuffix(".source.csv")
            try:
                header, rows = parse_source_csv(path.read_text())
                results.append({"case": name, "details": details.get(name, []), **summarize(header, rows)})
            except ValueError as e:
                results.append({"case": name, "error": f"{path}: {e}"})
        if not results:
            ap.error(f"--from {args.from_dir}: no *.source.csv files there")
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "stalls.json").write_text(json.dumps(results, indent=1))
        print_summary(results, args.top)
        return 0
    if not args.out or not args.case:
        ap.error("--out and at least one --case are required")
    ncu = find_ncu()
    if ncu is None:
        print("ncu_stalls: Nsight Compute (ncu) is not on this machine", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for case in args.case:
        r = run_case(case, out, ncu)
        results.append(r)
        (out / "stalls.json").write_text(json.dumps(results, indent=1))
    print_summary(results, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Hardware counters of flashgen's attention kernels beside SDPA cuDNN's, per kernel.

For each ``--shape`` (``B,H,HKV,S,D[,causal]``, bf16, layout (batch, heads, seqlen,
head_dim)) and backend (``flashgen``: ``flashgen.attention``; ``cudnn``: torch SDPA with
the cuDNN backend, ``enable_gqa`` where HKV < H; ``gluon``: the Gluon forward of one
config, ``--gluon-config`` knob=value pairs of ``GluonFwdConfig``, e.g.
``BLOCK_M=128,num_consumers=1,BLOCK_N=64,num_stages=3,persistent=3,ctas_per_sm=2``, the
register budgets at their default split unless given; causal or unmasked shapes only),
Nsight Compute profiles every kernel of
one forward (``fwd``) or one forward and backward (``fwdbwd``) after two warm-up calls
(the child brackets the call with ``cudaProfilerStart``/``Stop``; ``--clock-control
none``), and prints one row per kernel: its duration, DRAM and L2 bytes and throughput
(% of peak), L2 hit rate, SM and tensor-pipe throughput (% of peak) and achieved
occupancy.  It answers whether a kernel waits on memory (DRAM or L2 near their peaks),
on the tensor pipe, or on neither (latency: the kernel's own schedule).

    PYTHONPATH=$PWD python3 benchmarks/ncu_compare.py --out DIR \\
        --shape 32,16,16,512,128,causal --shape 4,32,8,2048,128,causal --kind fwdbwd

``DIR/ncu_compare.json`` keeps every row; the CSV parsing (:func:`parse_raw_csv`) is
plain Python, tested on CPU in tests/test_ncu_compare.py.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path

from ncu_stalls import find_ncu  # noqa: E402  (benchmarks/ is the script's directory)
from profile_call import parse  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ("flashgen", "cudnn", "gluon")
#: (column title, ncu metric, scale): printed in this order.
METRICS = (
    ("us", "gpu__time_duration.sum", 1e-3),
    ("DRAM MB", "dram__bytes.sum", 1e-6),
    ("DRAM %", "dram__throughput.avg.pct_of_peak_sustained_elapsed", 1.0),
    ("L2 MB", "lts__t_bytes.sum", 1e-6),
    ("L2 %", "lts__throughput.avg.pct_of_peak_sustained_elapsed", 1.0),
    ("L2 hit %", "lts__t_sector_hit_rate.pct", 1.0),
    ("SM %", "sm__throughput.avg.pct_of_peak_sustained_elapsed", 1.0),
    ("tensor %", "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed", 1.0),
    ("occupancy %", "sm__warps_active.avg.pct_of_peak_sustained_active", 1.0),
)
#: Metrics that some ncu versions or GPUs do not know: dropped (and printed as "-") when
#: ncu refuses them.
OPTIONAL = {"sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed"}


def _num(text: str) -> float | None:
    try:
        return float(str(text).replace(",", "").strip())
    except ValueError:
        return None


def parse_raw_csv(text: str) -> list[dict]:
    """Rows of ``ncu --csv --page raw`` output, one per profiled kernel: {"kernel": name,
    metric: float or None}.  Lines before the header (the program's output, ``==PROF==``
    lines) are skipped; the header is the first line whose first field is ``ID``, and the
    line after it (units) is skipped.  Byte metrics are converted to bytes and time to
    ns from the units row."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"ID"')), None)
    if start is None:
        return []
    reader = csv.reader(io.StringIO("\n".join(lines[start:])))
    header = next(reader)
    units = next(reader, [])
    scale = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6, "GB": 1e9,
             "nsecond": 1, "usecond": 1e3, "msecond": 1e6, "ns": 1, "us": 1e3, "ms": 1e6}
    rows = []
    for r in reader:
        if len(r) != len(header):
            continue
        row = {"kernel": r[header.index("Kernel Name")] if "Kernel Name" in header else ""}
        for h, val, u in zip(header, r, units + [""] * (len(header) - len(units))):
            if "__" in h:
                v = _num(val)
                row[h] = None if v is None else v * scale.get(u.strip(), 1)
        rows.append(row)
    return rows


def short_name(kernel: str, width: int = 44) -> str:
    """A kernel's name cut to ``width`` characters (template arguments dropped)."""
    name = kernel.split("(")[0].split("<")[0]
    return name if len(name) <= width else name[: width - 3] + "..."


def gluon_config(text: str):
    """The GluonFwdConfig of ``knob=value,...`` (ints; consumer_regs and producer_regs
    default to :func:`default_regs` of the consumers and programs per SM)."""
    from flashgen.families.gluon.config import GluonFwdConfig, default_regs

    kw = {k: int(v) for k, v in (item.split("=", 1) for item in text.split(",") if item)}
    cr, pr = default_regs(kw.get("num_consumers", 2), kw.get("ctas_per_sm", 1))
    kw.setdefault("consumer_regs", cr)
    kw.setdefault("producer_regs", pr)
    return GluonFwdConfig(**kw)


def run(shape: str, backend: str, kind: str, ncu: str, config: str = "") -> dict:
    metrics = [m for _, m, _ in METRICS]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{os.environ.get('PYTHONPATH', '')}")
    for attempt in range(2):
        cmd = [ncu, "--clock-control", "none", "--profile-from-start", "off", "--csv", "--page", "raw",
               "--metrics", ",".join(metrics), sys.executable, __file__, "--child",
               f"{backend}:{kind}:{shape}:{config}"]
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=500)
        out = p.stdout + p.stderr
        if p.returncode != 0 and attempt == 0 and "metric" in out.lower():
            metrics = [m for m in metrics if m not in OPTIONAL]
            continue
        break
    rows = parse_raw_csv(p.stdout)
    if p.returncode != 0 or not rows:
        return {"shape": shape, "backend": backend, "kind": kind, "error": out[-2500:]}
    return {"shape": shape, "backend": backend, "kind": kind, "kernels": rows,
            **({"config": config} if backend == "gluon" else {})}


def print_table(results: list[dict]) -> None:
    titles = [t for t, _, _ in METRICS]
    for r in results:
        print(f"\n== {r['backend']} {r['kind']} {r['shape']} {r.get('config', '')}")
        if "error" in r:
            print("  error:", r["error"][-1500:])
            continue
        print("  " + f"{'kernel':44s} " + " ".join(f"{t:>11s}" for t in titles))
        total = 0.0
        for k in r["kernels"]:
            cells = []
            for _, m, s in METRICS:
                v = k.get(m)
                cells.append(f"{v * s:11.1f}" if v is not None else f"{'-':>11s}")
            total += (k.get("gpu__time_duration.sum") or 0) * 1e-3
            print("  " + f"{short_name(k['kernel']):44s} " + " ".join(cells))
        print(f"  total {total:.1f} us over {len(r['kernels'])} kernels")


def child(spec: str) -> None:
    """The profiled program: two warm-up calls, then one call between the profiler's
    start and stop."""
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flashgen
    from profile_call import inputs

    backend, kind, shape, config = spec.split(":", 3)
    q, k, v, do, causal, window = inputs(shape)
    if backend == "gluon":
        from gluon_fwd import run_config

        cfg = gluon_config(config)
    gqa = parse(shape)[2] < parse(shape)[1]

    def call():
        if backend == "flashgen":
            o = flashgen.attention(q, k, v, causal=causal, window=window)
        elif backend == "gluon":
            o = run_config(q, k, v, cfg, causal)
        else:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
        if kind == "fwdbwd":
            o.backward(do)
        return o

    for _ in range(2):
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", action="append", default=[], help="B,H,HKV,S,D[,causal] (repeatable)")
    ap.add_argument("--kind", choices=("fwd", "fwdbwd"), default="fwd")
    ap.add_argument("--backend", action="append", choices=BACKENDS,
                    help="default: flashgen and cudnn, and gluon with --gluon-config")
    ap.add_argument("--gluon-config", default="", help="knob=value,... of the gluon backend's GluonFwdConfig")
    ap.add_argument("--out", help="directory for ncu_compare.json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child)
        return 0
    if not args.shape:
        ap.error("at least one --shape is required")
    backends = args.backend or (BACKENDS if args.gluon_config else BACKENDS[:2])
    if "gluon" in backends and (not args.gluon_config or args.kind != "fwd"):
        ap.error("--backend gluon profiles one Gluon forward config: give --gluon-config and --kind fwd")
    if "gluon" in backends and any(parse(s)[6] >= 0 or parse(s)[7] for s in args.shape):
        ap.error("--backend gluon runs causal or unmasked shapes only (no window=, no sinks)")
    if args.gluon_config:
        gluon_config(args.gluon_config)  # a typo fails here, not in the profiled child
    ncu = find_ncu()
    if ncu is None:
        ap.error("ncu (Nsight Compute) is neither on PATH nor under /opt/nvidia/nsight-compute")
    results = [run(s, b, args.kind, ncu, args.gluon_config) for s in args.shape for b in backends]
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "ncu_compare.json").write_text(json.dumps(results, indent=1))
    print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())

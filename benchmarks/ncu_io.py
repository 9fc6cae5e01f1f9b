"""HBM traffic measured by Nsight Compute next to flashgen's IO model (flashgen/iomodel.py).

At one long sequence (default batch 1, N 16384, head_dim 64, float16, no mask, for 1
and 16 heads): DRAM bytes read and written (``dram__bytes_read.sum``,
``dram__bytes_write.sum``) by flashgen's forward kernel (attn_fwd), its backward
kernels (attn_bwd_dq, attn_bwd_dkdv), the naive forward (S = QK^T, softmax, PV through
memory) and the backward from a stored P (flashgen.peers.MaterializedP), each next to
the model's bytes; then the tile-size trade-off: attn_fwd's bytes and time for each
BLOCK_M x BLOCK_N that is valid and fits shared memory.

ncu runs a child python process (this file's :func:`child`) that launches each case
between two marker kernels (``ncu_region_begin`` / ``ncu_region_end``), so the case's
kernels are told apart from the set-up's; ncu flushes the caches before each kernel
(its default ``--cache-control all``), so every kernel starts from cold L2.  Times come
from a second pass in this process, without ncu (CUDA events, flashgen.bench.time_ms).

    PYTHONPATH=. python3 benchmarks/ncu_io.py --out ncu_io.json

The CSV parsing (:func:`parse_ncu_csv`, :func:`split_regions`, :func:`region_bytes`) is
plain Python, tested on CPU in tests/test_iomodel.py.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "ncu_region_begin", "ncu_region_end"
METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum")
_UNITS = {"byte": 1, "bytes": 1, "B": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12,
          "KB": 1e3, "MB": 1e6, "GB": 1e9, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "Kibyte": 2**10,
          "Mibyte": 2**20, "Gibyte": 2**30}


# ---------------------------------------------------------------------------------
# Parsing ncu's CSV

def _number(text: str, unit: str) -> float | None:
    t = text.strip().replace(",", "")
    try:
        x = float(t)
    except ValueError:
        return None
    return x * _UNITS.get(unit.strip(), 1)


def parse_ncu_csv(text: str) -> list[dict]:
    """Kernel launches in launch order, from ``ncu --csv`` output (the "details" page:
    one line per metric and launch; ``==PROF==`` lines and the program's own output
    around it are skipped).  Each: {"id": int, "kernel": str, "metrics": {name: value in
    base units (bytes)}}.  Raises ValueError when no CSV header is found."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"ID"')), None)
    if start is None:
        raise ValueError("no ncu CSV header (a line starting with \"ID\") in the output")
    body = [ln for ln in lines[start:] if ln.startswith('"')]
    launches: dict[int, dict] = {}
    for rec in csv.DictReader(io.StringIO("\n".join(body))):
        try:
            lid = int(rec["ID"])
        except (KeyError, TypeError, ValueError):
            continue
        launch = launches.setdefault(lid, {"id": lid, "kernel": rec.get("Kernel Name", ""), "metrics": {}})
        name = rec.get("Metric Name") or ""
        value = _number(rec.get("Metric Value") or "", rec.get("Metric Unit") or "")
        if name and value is not None:
            launch["metrics"][name] = value
    return [launches[i] for i in sorted(launches)]


def _short(kernel: str) -> str:
    """A kernel's name without "void", anonymous namespaces, template arguments or
    argument list: "void at::<unnamed>::cunn_SoftMaxForwardReg<c10::Half, ...>(...)"
    -> "at::cunn_SoftMaxForwardReg"."""
    name = kernel.replace("<unnamed>::", "").replace("(anonymous namespace)::", "").strip()
    if name.startswith("void "):
        name = name[5:]
    for stop in ("<", "("):
        name = name.split(stop)[0]
    return name.strip()


def split_regions(launches: list[dict]) -> list[list[dict]]:
    """The launches between each ``ncu_region_begin`` and the next ``ncu_region_end``,
    one list per region, in order (set-up kernels outside regions are dropped)."""
    regions, cur = [], None
    for ln in launches:
        name = _short(ln["kernel"])
        if name == BEGIN:
            if cur is not None:
                raise ValueError(f"region begun at launch {ln['id']} inside another")
            cur = []
        elif name == END:
            if cur is None:
                raise ValueError(f"region ended at launch {ln['id']} without a begin")
            regions.append(cur)
            cur = None
        elif cur is not None:
            cur.append(ln)
    if cur is not None:
        raise ValueError("the last region has no end")
    return regions


def region_bytes(region: list[dict]) -> dict:
    """DRAM bytes read/written by a region's launches, in total and per kernel name."""
    out = {"read_bytes": 0, "write_bytes": 0, "launches": len(region), "kernels": {}}
    for ln in region:
        r = int(ln["metrics"].get(METRICS[0], 0))
        w = int(ln["metrics"].get(METRICS[1], 0))
        k = out["kernels"].setdefault(_short(ln["kernel"]), {"read_bytes": 0, "write_bytes": 0, "launches": 0})
        k["read_bytes"] += r
        k["write_bytes"] += w
        k["launches"] += 1
        out["read_bytes"] += r
        out["write_bytes"] += w
    out["total_bytes"] = out["read_bytes"] + out["write_bytes"]
    return out


# ---------------------------------------------------------------------------------
# The cases (run in the child under ncu, and timed in the parent)

def _inputs(c: dict, requires_grad=False):
    import torch

    dt = getattr(torch, c["dtype"])
    g = torch.Generator(device="cuda").manual_seed(0)
    b, h, n, d = c["batch"], c["heads"], c["seqlen"], c["head_dim"]
    q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=dt, generator=g) for _ in range(4))
    if requires_grad:
        q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    return q, k, v, do


def prepare(c: dict):
    """A zero-argument callable that runs case ``c`` once (inputs and anything the case
    does not measure, such as the forward before a backward, are made here)."""
    import torch

    from flashgen import ops, peers
    from flashgen.spec import TileConfig

    kind = c["kind"]
    scale = c["head_dim"] ** -0.5
    kw = dict(softmax_scale=scale, mask="none", diag_lo=-c["seqlen"], diag_hi=c["seqlen"])
    if kind in ("flashgen_fwd", "fwd_config"):
        q, k, v, _ = _inputs(c)
        cfg = TileConfig.from_dict(c["config"])
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:3], device="cuda", dtype=torch.float32)
        return lambda: ops.fwd(q, k, v, config=cfg, out=out, lse=lse, **kw)
    if kind == "flashgen_bwd":
        q, k, v, do = _inputs(c)
        o, lse = ops.fwd(q, k, v, config=TileConfig.from_dict(c["config_fwd"]), **kw)
        cq, ckv = TileConfig.from_dict(c["config_dq"]), TileConfig.from_dict(c["config_dkdv"])
        dq, dk, dv, delta = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(lse)
        return lambda: ops.bwd(do, q, k, v, o, lse, config_dq=cq, config_dkdv=ckv, dq=dq, dk=dk, dv=dv,
                               delta=delta, **kw)
    if kind == "naive_fwd":
        q, k, v, _ = _inputs(c)

        def fn():
            with torch.no_grad():
                return peers.naive_attention(q, k, v)
        return fn
    if kind == "naive_bwd":
        q, k, v, do = _inputs(c, requires_grad=True)
        o = peers.materialized_p_attention(q, k, v)
        return lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
    raise ValueError(f"unknown case kind {kind!r}")


def child(spec_path: str) -> None:
    """Run every case of the spec once, each between the two marker kernels."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def ncu_region_begin(x):
        tl.store(x, 1)

    @triton.jit
    def ncu_region_end(x):
        tl.store(x, 2)

    flag = torch.zeros(1, device="cuda", dtype=torch.int32)
    for c in json.loads(Path(spec_path).read_text())["cases"]:
        fn = prepare(c)
        torch.cuda.synchronize()
        ncu_region_begin[(1,)](flag)
        fn()
        ncu_region_end[(1,)](flag)
        torch.cuda.synchronize()
        del fn
        torch.cuda.empty_cache()


def run_ncu(cases: list[dict], ncu: str = "ncu", timeout_s: int = 420, save_csv: Path | None = None) -> list[dict]:
    """Run ``cases`` in a child process under ncu; one region_bytes dict per case
    (``save_csv``: also keep ncu's raw CSV there)."""
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "cases.json"
        spec.write_text(json.dumps({"cases": cases}))
        log = Path(tmp) / "ncu.csv"
        code = (f"import sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); import ncu_io; "
                "ncu_io.child(sys.argv[1])")
        cmd = [ncu, "--clock-control", "none", "--metrics", ",".join(METRICS), "--csv", "--print-units", "base",
               "--target-processes", "all", "--log-file", str(log), sys.executable, "-c", code, str(spec)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        text = log.read_text() if log.exists() else ""
        if '"ID"' not in text:
            text = proc.stdout
        if save_csv:
            Path(save_csv).write_text(text)
        if proc.returncode != 0 or '"ID"' not in text:
            raise RuntimeError(f"ncu failed (exit {proc.returncode}): {' '.join(cmd[:12])} ...\n"
                               f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{text[-2000:]}")
    regions = split_regions(parse_ncu_csv(text))
    if len(regions) != len(cases):
        raise RuntimeError(f"expected {len(cases)} marked regions in ncu's output, found {len(regions)}")
    return [region_bytes(r) for r in regions]


# ---------------------------------------------------------------------------------
# Models for the cases

def _problem(c: dict):
    from flashgen import iomodel

    return iomodel.Problem(c["seqlen"], c["seqlen"], c["head_dim"], batch=c["batch"], num_heads=c["heads"],
                           dtype_bytes=2 if c["dtype"] in ("float16", "bfloat16") else 4)


def minimum_for(c: dict):
    """The compulsory bytes (each input read once, each output written once)."""
    from flashgen import iomodel

    p = _problem(c)
    return iomodel.minimum_backward(p) if c["kind"] in ("flashgen_bwd", "naive_bwd") else iomodel.minimum_forward(p)


def model_for(c: dict):
    from flashgen import iomodel

    p = _problem(c)
    kind = c["kind"]
    if kind in ("flashgen_fwd", "fwd_config"):
        return iomodel.tiled_forward(p, c["config"]["BLOCK_M"], c["config"]["BLOCK_N"])
    if kind == "flashgen_bwd":
        return iomodel.tiled_backward(p, c["config_dq"]["BLOCK_M"], c["config_dq"]["BLOCK_N"],
                                      c["config_dkdv"]["BLOCK_M"], c["config_dkdv"]["BLOCK_N"])
    if kind == "naive_fwd":
        return iomodel.naive_forward(p)
    return iomodel.naive_backward(p)


def configs_for(c: dict) -> dict:
    """The configs flashgen's dispatcher picks for this problem (tuned DB or default)."""
    from flashgen.dispatch import default_dispatcher
    from flashgen.spec import KernelSpec, Shape

    shape = Shape(c["batch"], c["heads"], c["heads"], c["seqlen"], c["seqlen"])
    disp = default_dispatcher()
    return {f"config_{'fwd' if k == 'fwd' else k[4:]}":
            disp.config_for(shape.key(KernelSpec(k, c["dtype"], c["head_dim"], c["head_dim"], "none"))).as_dict()
            for k in ("fwd", "bwd_dq", "bwd_dkdv")}


def tradeoff_configs(dtype: str, head_dim: int) -> list[dict]:
    """Every forward BLOCK_M x BLOCK_N of flashgen's search space that is valid and fits
    this GPU's shared memory, with 8 warps for BLOCK_M 128 (4 otherwise) and the deepest
    pipeline that fits."""
    from flashgen import resources, space
    from flashgen.arch import current
    from flashgen.spec import KernelSpec, TileConfig, Variant

    arch = current()
    spec = KernelSpec("fwd", dtype, head_dim, head_dim, "none")
    dom = space.DOMAINS["fwd"]
    out = []
    for bm in dom["BLOCK_M"]:
        for bn in dom["BLOCK_N"]:
            w = 8 if bm >= 128 else 4
            for st in sorted(dom["num_stages"], reverse=True):
                v = Variant(spec, TileConfig(bm, bn, w, st))
                if not space.violated_rules(v) and resources.estimate(v, arch).feasible:
                    out.append(v.config.as_dict())
                    break
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--heads", default="1,16", help="comma-separated head counts (batch 1)")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    ap.add_argument("--no-naive", action="store_true", help="skip the naive cases")
    ap.add_argument("--no-tradeoff", action="store_true", help="skip the tile-size trade-off")
    ap.add_argument("--ncu", default=shutil.which("ncu") or "ncu", help="path of the ncu binary")
    ap.add_argument("--rep-ms", type=int, default=25)
    ap.add_argument("--out", type=Path, default=Path("ncu_io.json"))
    ap.add_argument("--save-csv", type=Path, default=None, help="keep ncu's raw CSV output here")
    args = ap.parse_args()
    if shutil.which(args.ncu) is None:
        sys.exit(f"error: {args.ncu!r} not found (Nsight Compute); pass --ncu PATH")
    import torch

    from flashgen.bench import time_ms

    if not torch.cuda.is_available():
        sys.exit("error: needs a CUDA GPU")
    t0 = time.time()
    base = dict(batch=1, seqlen=args.seqlen, head_dim=args.head_dim, dtype=args.dtype)
    cases = []
    heads = [int(h) for h in args.heads.split(",")]
    for h in heads:
        c = {**base, "heads": h}
        cfgs = configs_for(c)
        cases.append({**c, "name": f"flashgen fwd (attn_fwd) h{h}", "kind": "flashgen_fwd",
                      "config": cfgs["config_fwd"]})
        cases.append({**c, "name": f"flashgen bwd (attn_bwd_dq + attn_bwd_dkdv) h{h}", "kind": "flashgen_bwd",
                      **cfgs})
        if not args.no_naive:
            cases.append({**c, "name": f"naive fwd (S, P through HBM) h{h}", "kind": "naive_fwd"})
            cases.append({**c, "name": f"naive bwd (stored P) h{h}", "kind": "naive_bwd"})
    if not args.no_tradeoff:
        for cfg in tradeoff_configs(args.dtype, args.head_dim):
            cases.append({**base, "heads": max(heads), "kind": "fwd_config", "config": cfg,
                          "name": f"attn_fwd m{cfg['BLOCK_M']} n{cfg['BLOCK_N']} h{max(heads)}"})
    print(f"{len(cases)} cases under ncu ...", flush=True)
    measured = run_ncu(cases, args.ncu, save_csv=args.save_csv)
    print(f"ncu done in {time.time() - t0:.0f} s; timing without ncu ...", flush=True)
    results = []
    for c, m in zip(cases, measured):
        fn = prepare(c)
        ms = time_ms(fn, 5, args.rep_ms)
        del fn
        torch.cuda.empty_cache()
        results.append({"case": c, "measured": m, "model": model_for(c).as_dict(),
                        "minimum": minimum_for(c).as_dict(), "median_ms": ms})

    def mib(x):
        return f"{x / 2**20:10.1f}"

    print(f"\nDRAM bytes (ncu: dram__bytes_read.sum + dram__bytes_write.sum, --clock-control none, cold L2 "
          f"per kernel) vs the model (global-memory requests, no cache) and the minimum (each tensor once); "
          f"batch 1, N {args.seqlen}, d {args.head_dim}, {args.dtype}, {torch.cuda.get_device_name()}")
    print(f"{'case':52} {'read MiB':>10} {'write MiB':>10} {'total MiB':>10} {'model MiB':>10} "
          f"{'meas/model':>10} {'min MiB':>10} {'ms':>8}")
    for r in results:
        m, mod = r["measured"], r["model"]
        print(f"{r['case']['name']:52} {mib(m['read_bytes'])} {mib(m['write_bytes'])} {mib(m['total_bytes'])} "
              f"{mib(mod['total_bytes'])} {m['total_bytes'] / mod['total_bytes']:10.2f} "
              f"{mib(r['minimum']['total_bytes'])} {r['median_ms']:8.3f}")
        if len(m["kernels"]) > 1:
            for k, kb in m["kernels"].items():
                print(f"    {k[:48]:48} {mib(kb['read_bytes'])} {mib(kb['write_bytes'])} "
                      f"{mib(kb['read_bytes'] + kb['write_bytes'])}  x{kb['launches']}")
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "metrics": list(METRICS),
           "problem": base, "heads": heads, "results": results, "wall_s": time.time() - t0}
    args.out.write_text(json.dumps(out, indent=1))
    print(f"\nwrote {args.out} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()

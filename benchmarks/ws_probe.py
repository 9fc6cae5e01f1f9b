"""Issue 4: does warp specialization (``tl.range(..., warp_specialize=True)``, the
``ws`` knob) compile, stay exact and pay off on this GPU?  Each forward config runs with
ws 0 and 1 (pointer and TMA loads) on one large shape: compile status, the check against
float64, registers, shared memory and the median time.

Usage (repository root, on the GPU):  python3 benchmarks/ws_probe.py --out $OUT/ws_probe.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import torch

    from flashgen import bench
    from flashgen.spec import KernelSpec, Shape, TileConfig, Variant, attention_flops

    shape = Shape(4, 16, 16, 4096, 4096)
    rows = []
    for mask in ("none", "causal"):
        spec = KernelSpec("fwd", "bfloat16", 128, 128, mask)
        inputs = bench.make_inputs(spec, shape)
        flops = attention_flops(shape.batch, shape.num_heads, shape.seqlen_q, shape.seqlen_k, 128,
                                causal=mask == "causal")
        for m, n, w, s in ((128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3)):
            for tma in (0, 1):
                for ws in (0, 1):
                    v = Variant(spec, TileConfig(m, n, w, s, tma=tma, ws=ws))
                    row = {"variant": v.id}
                    try:
                        ok, ratio, msg = bench.check_variant(v)
                        row.update(check_ok=ok, check_ratio=ratio)
                        fn, _ = bench.run_variant(v, *inputs)
                        ms = bench.time_ms(fn)
                        row.update(ms=ms, tflops=flops / ms / 1e9, **bench.compiler_report(v))
                    except Exception as e:  # noqa: BLE001 - a failure is the finding
                        row["error"] = f"{type(e).__name__}: {str(e)[-300:]}"
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    torch.cuda.synchronize()
    Path(args.out).write_text(json.dumps(rows, indent=1))
    print(f"\n{'variant':<48} {'ok':>5} {'TFLOP/s':>8} {'regs':>5} {'smem':>7}  error")
    for r in rows:
        print(f"{r['variant']:<48} {str(r.get('check_ok', '-')):>5} {r.get('tflops', 0):8.1f} "
              f"{r.get('n_regs') or '-':>5} {r.get('smem_bytes_compiled') or '-':>7}  {r.get('error', '')[:60]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

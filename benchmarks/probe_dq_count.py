"""What counting the dQ adds costs the Gluon backward's writer warp: the writer tile
(``dq_writer``) as the template renders it, and the same tile with each completed
reduce-add counted in an int32 counter per dQ tile by the writer itself (a GPU-scope
release atomic by its first lane, issued once the add has completed, checked one add
later so its round trip overlaps the next add), the count a convert fused into the main
kernel would need to find a tile's last add (docs/design.md, "dQ stored by the main
kernel").  The variant is a text edit of the rendered source (:func:`count_source`,
never tuned or served); both are launched by hand (preprocess, main, convert) with the
same zeroing of the counters, timed by ``do_bench`` twice each in alternation, and the
counts checked after the run (without a mask every tile's count is the number of key
blocks times the consumer partitions).  Random inputs: timing only.

    PYTHONPATH=. python3 benchmarks/probe_dq_count.py   (writes count_probe.json under $OUT)
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flashgen import compile as _compile  # noqa: E402
from flashgen.fastlaunch import launch  # noqa: E402
from flashgen.families.gluon import bwd as B  # noqa: E402

HELPERS = '''

@gluon.jit
def _bulk_done1(x):
    return gl.inline_asm_elementwise("cp.async.bulk.wait_group 1;\\nfence.proxy.async.global;\\nmov.b32 $0, $1;",
                                     "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _bulk_done0(x):
    return gl.inline_asm_elementwise("cp.async.bulk.wait_group 0;\\nfence.proxy.async.global;\\nmov.b32 $0, $1;",
                                     "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _count_add(ptr):
    return gl.inline_asm_elementwise(
        "{\\n.reg .pred p;\\n.reg .b32 l;\\nmov.b32 $0, 0;\\nmov.u32 l, %laneid;\\nsetp.eq.u32 p, l, 0;\\n"
        "@p atom.release.gpu.global.add.s32 $0, [$1], 1;\\n}", "=r,l", [ptr.to(gl.int64, bitcast=True)],
        dtype=gl.int32, is_pure=False, pack=1)
'''
OLD_LOOP = '''            store_wait(0)
            mbarrier.arrive(dq_empty.index(slot))
'''
NEW_LOOP = '''            store_wait(0)
            mbarrier.arrive(dq_empty.index(slot))
            # count the previous add once it has completed; its old value is read one add later
            tile = (off_z * num_heads + off_h) * (m_pad // BLOCK_M) + m0 // BLOCK_M
            if it * NPART + C > 0:
                _bulk_done1(slot)
                got = _count_add(CNT + prev)
                if seen == -7:
                    mbarrier.arrive(dq_empty.index(slot))
                seen = got
            prev = tile
'''
def count_source(src: str) -> str:
    """``src`` (a rendered writer tile, dq_mode "tma") with the counting: a CNT argument
    after DV, passed to the writer, which counts each add once the next one is issued
    and the last one after its loop."""
    src = src.replace("\n\n@gluon.jit\ndef _query_blocks(", HELPERS + "\n\n@gluon.jit\ndef _query_blocks(", 1)
    for a, b in (("def _dq_writer(dq_smem, dq_full, dq_empty, dq_desc, off_z,", "def _dq_writer(dq_smem, dq_full, dq_empty, dq_desc, CNT, off_z,"),
                 ("writer_args = (dq_smem, dq_full, dq_empty, dq_desc, off_z,", "writer_args = (dq_smem, dq_full, dq_empty, dq_desc, CNT, off_z,"),
                 ("DQACC, DK, DV, qk_scale,", "DQACC, DK, DV, CNT, qk_scale,"),
                 ('float32 accumulator by one TMA reduce-add."""\n', 'float32 accumulator by one TMA reduce-add."""\n    prev = 0\n    seen = 0\n'),
                 (OLD_LOOP, NEW_LOOP)):
        assert src.count(a) == 1, a
        src = src.replace(a, b)
    # the last add
    i = src.index("def _dq_writer(")
    j = src.index("\n\n\n", i)
    src = src[:j] + "\n    _bulk_done0(n_iter)\n    if n_iter > 0:\n        got = _count_add(CNT + prev)" + src[j:]
    return src


def mk(src: str, tag: str):
    """The module of an (edited) render."""
    return _compile.import_generated(f"count_{tag}", src)


def run(mod, cfg, a, cnt, counted):
    """One backward by hand: preprocess, main (with the counters when ``counted``), convert."""
    launch(mod.attn_bwd_preprocess, *a["preprocess"], num_warps=4)
    cnt.zero_()
    grid, args = a["main"]
    if counted:
        args = args[:12] + (cnt,) + args[12:]
    launch(mod.attn_bwd, grid, args, num_warps=cfg.num_warps, maxnreg=cfg.maxnreg)
    launch(mod.attn_bwd_convert, *a["convert"], num_warps=4)


def main() -> int:
    import torch
    import triton.testing

    from flashgen.masks import mask_bounds

    rows = []
    for (b, h, s, d, causal, split) in [(4, 16, 4096, 128, False, False), (4, 16, 4096, 128, True, False),
                                        (32, 16, 512, 128, False, False), (32, 16, 512, 128, True, False),
                                        (8, 32, 2048, 64, False, True)]:
        q, do, o, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(5))
        lse = torch.randn(b, h, s, device="cuda", dtype=torch.float32).abs() + 5.0
        mode, lo, hi = mask_bounds(s, s, causal=causal, window=(-1, -1))
        cfg = dataclasses.replace(B.default_config(d, "bfloat16", mode), dq_writer=True)
        src = B.render(cfg, "bfloat16", d, mode)
        mods = {False: mk(src, "plain"), True: mk(count_source(src), "count")}
        a = B.launch_args(do, q, k, v, o, lse, softmax_scale=d ** -0.5, diag_lo=lo, diag_hi=hi, config=cfg)
        cnt = torch.zeros(b * h * (s // 64 + 2), dtype=torch.int32, device="cuda")
        times = {False: [], True: []}
        for counted in (False, True, False, True):
            fn = lambda: run(mods[counted], cfg, a, cnt, counted)  # noqa: E731
            fn()
            torch.cuda.synchronize()
            times[counted].append(float(triton.testing.do_bench(fn, warmup=10, rep=80, return_mode="median")))
        expect = None
        if not causal:
            expect = (s + cfg.block_nt - 1) // cfg.block_nt * cfg.parts  # adds per tile, unmasked
        got = cnt[: b * h * (s // 64)].view(b * h, -1)
        row = {"shape": [b, h, s, d, causal], "config": cfg.id, "plain_ms": times[False], "count_ms": times[True],
               "counts_min_max": [int(got.min()), int(got.max())], "expected_unmasked": expect}
        rows.append(row)
        print(json.dumps(row), flush=True)
    json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "count_probe.json"), "w"), indent=1)
    for r in rows:
        p, c = min(r["plain_ms"]), min(r["count_ms"])
        print(r["shape"], f"{p:.4f} {c:.4f} plain/count {p / c:.3f}x", r["counts_min_max"], r["expected_unmasked"])
    return 0


if __name__ == "__main__":
    sys.exit(main())

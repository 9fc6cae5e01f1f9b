"""Where the dq_convert converter partition's time goes (head_dim 128, lock-step tile
with the dQ writer): the writer tile with the convert kernel; dq_convert "last" with the
writer-to-converter ring 4 or 16 deep; without conversions (the counting alone); and
without the count (the ring alone).  The last two leave dQ unconverted: timing only.

Usage (repository root, on the GPU): python3 benchmarks/probe_dq_convert.py (writes
cv_probe.json under $OUT)."""
import importlib.util, json, os, sys, hashlib
import torch, triton.testing
sys.path.insert(0, os.getcwd())
from flashgen.families.gluon import bwd as B
from flashgen.masks import mask_bounds
from flashgen import compile as _compile

base = B.GluonBwdConfig(block_m=64, block_n=64, consumers=2, stages=2, dq_mode="tma", row_load="tma",
                        dq_stage="fragment", kv_store="tma", dq_writer=True)
cv = B.GluonBwdConfig(**{**base.__dict__, "dq_convert": "last"})
probes = {"writer": (base, []), "convert_ring4": (cv, []),
          "convert_ring16": (cv, [("CV_RING = gl.constexpr(4)", "CV_RING = gl.constexpr(16)")]),
          "count_only_ring16": (cv, [("CV_RING = gl.constexpr(4)", "CV_RING = gl.constexpr(16)"),
                                     ("if old + 1 == _contributors(mb, seqlen_q, seqlen_k, diag_lo, diag_hi) * NPART:", "if old < 0:")]),
          "ring_only_ring16": (cv, [("CV_RING = gl.constexpr(4)", "CV_RING = gl.constexpr(16)"),
                                    ("old = gl.max(_count_add(CNT + (bh * cnt_rows + mb), lead), 0)", "old = gl.max(lead, 0) - 5"),
                                    ("if old + 1 == _contributors(mb, seqlen_q, seqlen_k, diag_lo, diag_hi) * NPART:", "if old > 0:")])}
orig_load = B.load
mods = {}
def make(name, cfg, subs, d, mask):
    src = B.render(cfg, "bfloat16", d, mask)
    for a, b in subs:
        assert a in src, (name, a)
        src = src.replace(a, b)
    dig = hashlib.sha256(src.encode()).hexdigest()[:20]
    path = _compile.cache_dir() / "generated" / dig / f"probe_{name}_{mask}.py"
    _compile.write_source(path, src)
    spec = importlib.util.spec_from_file_location(f"probe_{dig}", path)
    m = importlib.util.module_from_spec(spec); sys.modules[spec.name] = m; spec.loader.exec_module(m)
    return m
rows = []
for (b, h, s, d, causal) in [(4, 16, 4096, 128, False), (4, 16, 4096, 128, True), (32, 16, 512, 128, False)]:
    dt = torch.bfloat16
    q, k, v, do, o = (torch.randn(b, h, s, d, device="cuda", dtype=dt) for _ in range(5))
    lse = torch.randn(b, h, s, device="cuda", dtype=torch.float32).abs() + 5.0
    mode, lo, hi = mask_bounds(s, s, causal=causal, window=(-1, -1))
    for name, (cfg, subs) in probes.items():
        m = make(name, cfg, subs, d, mode)
        B.load = lambda *a, _m=m, **kw: _m
        B._PLANS.clear()
        fn = lambda: B.attention_bwd(do, q, k, v, o, lse, softmax_scale=d ** -0.5, diag_lo=lo, diag_hi=hi,
                                     mask=mode, config=cfg, stage_sync=False)
        fn(); torch.cuda.synchronize()
        ms = float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))
        rows.append({"shape": [b, h, s, d, causal], "probe": name, "ms": ms})
        print(json.dumps(rows[-1]), flush=True)
    B.load = orig_load
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "cv_probe.json"), "w"), indent=1)

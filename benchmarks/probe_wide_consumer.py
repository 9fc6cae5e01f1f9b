"""One consumer partition of two warpgroups (8 warps) in the Gluon forward, as a probe.

Every consumer partition of Gluon's ``warp_specialize`` is its own copy of the key loop,
so the forward's tile of two 64-row consumers sharing each K/V tile compiles to twice
the code of one consumer (7288 SASS instructions against cuDNN's 1448 for its tile of
that shape at head_dim 128, causal, BLOCK_N 128), and 14% of its warps' samples wait on
instruction fetch at 32x16x512 (the design notes, "the short causal forward beside
cuDNN's kernel").  Calling one non-inlined consumer function from both partitions does
not share the code either: ptxas serializes every wgmma of a function that is called
(its message C7510, "wgmma pipeline crossing function boundary").

This probe gives the two warpgroups one partition instead: the variant of one consumer
of 128 query rows (``BLOCK_M`` 128, ``num_consumers`` 1) rendered as the template writes
it, then edited (:func:`wide_source`, never tuned or served) so that its score and
output layouts spread the 128 rows over 8 warps (``warps_per_cta`` [8, 1]: each
warpgroup issues the m64 wgmma of its own 64 rows) and the kernel launches 8 warps in
the default partition with the launch register cap of three warpgroups (168), so
setmaxnreg gives the consumers 240 registers a thread as in the two-partition tile.
The bytes are the two-partition tile's (each K/V tile serves 128 rows); the code is one
copy; the two warpgroups run in lock-step (Triton syncs the partition's 256 threads
before each mbarrier arrive, twice per key tile), so one's softmax no longer overlaps
the other's score product.

A second edit (``wide-nb``, :func:`named_release_source`) removes one of the two
lock-step points: the consumers release K and V slots by arriving on hardware named
barriers (``bar.arrive``, which does not wait, 256 consumer threads and the producer
warp's 32) instead of an mbarrier, and the producer waits on those barriers
(``bar.sync``) before it refills a slot.  Triton still synchronizes the partition once
per key tile, before the wait for the K tile (SASS, ``--sass``).

For each shape: the dispatcher's shipped row, the wide variants, their ``wide-nb``
twins and, for each, its two-partition twin (two consumers of 64 rows, the same
BLOCK_N, stages and walk).  First, in child processes with a timeout (a release that
does not pair hangs): every edited variant through the forward's float64 checks
(``benchmarks/gluon_fwd.py``'s cases for its mask mode).  Then, in one process, each
config that passed timed by ``do_bench`` (median, L2 flushed), twice, alternating.

    PYTHONPATH=. python3 benchmarks/probe_wide_consumer.py --out wide.json

``--edits wide-nb`` builds one edit only, ``--head-dim 128`` one head dim's shapes.

``--sass``: compile the edited variants and their twins for sm_90 on this machine (no
GPU) and print registers, spills, SASS instructions and barriers.

Prints a table last: TFLOP/s of the shipped row, each edited variant and its twin.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

#: (batch, num_heads, num_kv_heads, seqlen, head_dim, causal): the grid's short causal
#: and unmasked shapes, and two Llama-3-8B ones.
SHAPES = [(32, 16, 16, 512, 128, True), (16, 16, 16, 1024, 128, True), (8, 16, 16, 2048, 128, True),
          (32, 16, 16, 512, 128, False), (4, 32, 8, 1024, 128, True), (4, 16, 4, 2048, 128, True),
          (32, 32, 32, 512, 64, True), (16, 32, 32, 1024, 64, True), (32, 32, 32, 512, 64, False)]
#: The launch register cap of three warpgroups (the 8-warp consumer and the producer's).
WIDE_MAXNREG = 168


def wide_configs(d: int, causal: bool):
    """The wide variants timed at head_dim ``d``: (BLOCK_N, stages, skip_masked)."""
    from flashgen.families.gluon.config import GluonFwdConfig

    shapes = [(128, 2), (64, 4)] if d == 128 else [(128, 4), (64, 4)]
    out = []
    for bn, st in shapes:
        for skip in ((False, True) if causal else (False,)):
            out.append(GluonFwdConfig(BLOCK_M=128, num_consumers=1, BLOCK_N=bn, num_stages=st, consumer_regs=240,
                                      producer_regs=24, persistent=3, o_in_q=True, masked_first=causal,
                                      skip_masked=skip))
    return out


def twin(c):
    """The two-partition tile of the same bytes: two consumers of 64 rows."""
    from flashgen.families.gluon.config import default_regs

    cr, pr = default_regs(2, 1)
    return dataclasses.replace(c, BLOCK_M=64, num_consumers=2, consumer_regs=cr, producer_regs=pr)


def wide_source(src: str) -> str:
    """A rendered one-consumer, BLOCK_M 128 forward with its consumer spread over two
    warpgroups: layouts of 8 warps along M, 8 warps in the default partition, the
    register cap of three warpgroups."""
    n = src.count("warps_per_cta=[4, 1]")
    if n != 2:
        raise ValueError(f"expected the score and output layouts of 4 warps, found {n}")
    src = src.replace("warps_per_cta=[4, 1]", "warps_per_cta=[8, 1]")
    for name, value in (("NUM_WARPS", 8), ("MAXNREG", WIDE_MAXNREG)):
        src, k = re.subn(rf"^{name} = \d+$", f"{name} = {value}", src, flags=re.M)
        if k != 1:
            raise ValueError(f"no {name} line in the rendered source")
    if "NUM_CONSUMERS = 1\n" not in src or "BLOCK_M = gl.constexpr(128)" not in src:
        raise ValueError("not a one-consumer BLOCK_M 128 variant")
    return src


#: The first hardware named barrier of the ``named`` release (K slots from here, then V
#: slots); Triton's own partition barriers use ids 0-3 in these kernels' SASS.
NB0 = 8

_NB_HELPERS = """

@gluon.jit
def _nb_arrive(BAR):
    \"\"\"Release: each of the consumer partition's 256 threads arrives on named barrier
    BAR (288 threads: the 256 and the producer warp's 32), without waiting.\"\"\"
    ids = gl.full([256], 0, gl.int32, gl.BlockedLayout([1], [32], [8], [0])) + BAR
    gl.inline_asm_elementwise("bar.arrive $1, 288;\\nmov.b32 $0, 0;", "=r,r", [ids], dtype=gl.int32, is_pure=False,
                              pack=1)


@gluon.jit
def _nb_sync(BAR):
    \"\"\"The producer warp waits on named barrier BAR until the consumers released the slot.\"\"\"
    ids = gl.full([32], 0, gl.int32, gl.BlockedLayout([1], [32], [1], [0])) + BAR
    gl.inline_asm_elementwise("bar.sync $1, 288;\\nmov.b32 $0, 0;", "=r,r", [ids], dtype=gl.int32, is_pure=False,
                              pack=1)
"""


def named_release_source(src: str) -> str:
    """A wide source (:func:`wide_source`) whose consumers release K and V slots by
    arriving on hardware named barriers (``bar.arrive``, which does not wait) instead
    of an mbarrier arrive, before which Triton synchronizes the whole 8-warp partition;
    the producer waits on them (``bar.sync``) before it refills a slot, from each
    slot's second use on.  K slot s uses barrier NB0 + s, V slot s NB0 + STAGES + s.
    Pairing holds because a consumer arrives on a slot's barrier again only after
    reading that slot's next copy, which the producer issues after its wait."""
    import re as _re

    stages = int(_re.search(r"^STAGES = gl.constexpr\((\d+)\)$", src, _re.M).group(1))
    if NB0 + 2 * stages > 16:
        raise ValueError(f"{stages} stages need {2 * stages} named barriers from {NB0}: more than 16")
    anchor = "\n\n@gluon.jit\ndef _producer("
    if anchor not in src:
        raise ValueError("no _producer in the rendered source")
    src = src.replace(anchor, _NB_HELPERS + anchor, 1)
    n_k = len(_re.findall(r"mbarrier\.arrive\(k_empty\.index\((\w+)\)\)", src))
    n_v = len(_re.findall(r"mbarrier\.arrive\(v_empty\.index\((\w+)\)\)", src))
    if not n_k or not n_v:
        raise ValueError("no K/V slot release in the rendered source")
    src = _re.sub(r"mbarrier\.arrive\(k_empty\.index\((\w+)\)\)", rf"_nb_arrive({NB0} + \1)", src)
    src = _re.sub(r"mbarrier\.arrive\(v_empty\.index\((\w+)\)\)", rf"_nb_arrive({NB0} + STAGES + \1)", src)
    waits = (("            mbarrier.wait(k_empty.index(s), ph ^ 1)\n",
              f"            if kv >= STAGES:\n                _nb_sync({NB0} + s)\n"),
             ("            mbarrier.wait(v_empty.index(s), ph ^ 1)\n",
              f"            if kv >= STAGES:\n                _nb_sync({NB0} + STAGES + s)\n"))
    for old, new in waits:
        if src.count(old) != 1:
            raise ValueError(f"expected one {old.strip()!r} in the producer")
        src = src.replace(old, new)
    if "k_empty.index" in src.split("def _producer(")[1].split("\n\n\n")[0]:
        raise ValueError("the producer still waits on an mbarrier of a K slot")
    return src


def noinline_source(src: str) -> str:
    """A rendered two-consumer forward whose partitions call one non-inlined consumer
    function (the consumer index a runtime value) instead of each inlining its own copy."""
    edits = (("@gluon.jit\ndef _consumer(C: gl.constexpr,", "@gluon.jit(noinline=True)\ndef _consumer(C,"),
             ("def _free_q(C: gl.constexpr,", "def _free_q(C,"),
             ("    _consumer(0, o_desc", "    _consumer(_opaque(gl.program_id(0)) * 0, o_desc"),
             ("    _consumer(1, o_desc", "    _consumer(_opaque(gl.program_id(0)) * 0 + 1, o_desc"))
    for old, new in edits:
        if src.count(old) != 1:
            raise ValueError(f"expected one {old!r} in the rendered source")
        src = src.replace(old, new)
    return src


def _variant(d: int, mask: str, g):
    from flashgen.families.gluon import config as C

    return C.GluonFwdVariant(C.GluonFwdSpec("bfloat16", d, d, mask), g)


#: The edits of a rendered one-consumer BLOCK_M 128 variant this probe builds, by role.
EDITS = {"wide": lambda src: wide_source(src),
         "wide-nb": lambda src: named_release_source(wide_source(src))}


def module(v, role: str = "plain"):
    """The loaded module of ``v``, or of its ``role`` edit (:data:`EDITS`; rules off:
    the register model refuses BLOCK_M 128 at head_dim 128 for one warpgroup, which is
    not what the edits build)."""
    import gluon_fwd

    from flashgen import compile as _compile
    from flashgen.families.gluon import render as R

    gluon_fwd.rules_off()
    if role not in EDITS:
        return R.load(v)
    src = EDITS[role](R.render(v))
    return _compile.import_generated(f"probe_{role.replace('-', '_')}_" + re.sub(r"\W", "_", v.id), src)


def _patched_load(mod):
    from flashgen.families.gluon import render as R

    load = R.load
    R.load = lambda *a, **kw: mod
    return load


def _check_child(arg: str) -> int:
    import gluon_fwd

    from flashgen.families.gluon import config as C
    from flashgen.families.gluon import render as R

    a = json.loads(arg)
    v = _variant(a["d"], a["mask"], C.GluonFwdConfig(**a["config"]))
    mod = module(v, a.get("role", "wide"))
    load = _patched_load(mod)
    try:
        res = gluon_fwd.check_variant(v)
    finally:
        R.load = load
    print("RESULT " + json.dumps({"ok": res["ok"], "worst": res["worst"],
                                  "bad": [c for c in res["cases"] if not c["ok"]][:3]}), flush=True)
    return 0


def _run_checks(jobs, timeout: float, workers: int) -> list[dict]:
    from probe_pingpong import run_checks

    return run_checks(jobs, timeout, workers, script=__file__, hang="")


def shipped(shape):
    """The dispatcher's forward config at ``shape`` (a Gluon config, or None)."""
    import torch

    from flashgen import library
    from flashgen.families.gluon.family import fwd_config
    from flashgen.masks import mask_bounds

    b, h, hk, s, d, causal = shape
    q = torch.empty(b, h, s, d, device="cuda", dtype=torch.bfloat16)
    k = torch.empty(b, hk, s, d, device="cuda", dtype=torch.bfloat16)
    mode, _, _ = mask_bounds(s, s, causal=causal, window=(-1, -1))
    cfg, _ = library.kernel_for("fwd", q, k, k, mode)
    return fwd_config(cfg) if cfg.family == "gluon" else None


def _time(jobs, rep: int) -> None:
    import torch
    import triton.testing

    from flashgen.families.gluon import config as C
    from flashgen.families.gluon import launch as L
    from flashgen.families.gluon import render as R

    for job in jobs:
        b, h, hk, s, d, causal = job["shape"]
        mode = "causal" if causal else "none"
        q, k, vv = (torch.randn(b, n, s, d, device="cuda", dtype=torch.bfloat16) for n in (h, hk, hk))
        flops = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)
        runs = []
        for entry in job["configs"]:
            if entry["role"] in EDITS and not entry["check"].get("ok"):
                continue
            g = C.GluonFwdConfig(**entry["config"])
            mod = module(_variant(d, mode, g), entry["role"])
            fn = lambda g=g, m=mod: L.fwd(q, k, vv, softmax_scale=d ** -0.5, mask=mode,  # noqa: E731
                                          diag_lo=0 if causal else -s, diag_hi=0 if causal else s, config=g,
                                          module=m, check_inputs=False)
            load = _patched_load(mod)
            try:
                fn()
                torch.cuda.synchronize()
            finally:
                R.load = load
            runs.append((entry, fn))
        for _ in range(2):
            for entry, fn in runs:
                ms = float(triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median"))
                entry.setdefault("ms", []).append(ms)
        for entry, _ in runs:
            entry["tflops"] = flops / min(entry["ms"]) * 1e-9
        print(json.dumps({"shape": job["shape"], "tflops": {_vid(job, e): round(e["tflops"], 1)
                                                            for e, _ in runs}}), flush=True)


def _vid(job, entry) -> str:
    from flashgen.families.gluon import config as C

    d, causal = job["shape"][4], job["shape"][5]
    vid = _variant(d, "causal" if causal else "none", C.GluonFwdConfig(**entry["config"])).id
    return entry["role"] + ":" + vid.split("_m", 1)[1]


def _sass() -> int:
    import gluon_fwd

    from flashgen.families.gluon import render as R
    from flashgen.families.gluon import sm90

    gluon_fwd.rules_off()
    seen = set()
    for shape in SHAPES:
        d, causal = shape[4], shape[5]
        mask = "causal" if causal else "none"
        for c in wide_configs(d, causal):
            for role, g in (("wide", c), ("wide-nb", c), ("twin", twin(c))):
                v = _variant(d, mask, g)
                if (v.id, role) in seen:
                    continue
                seen.add((v.id, role))
                mod = module(v, role)
                load = _patched_load(mod)
                cap = sm90.maxnreg
                sm90.maxnreg = lambda _c, _m=mod: _m.MAXNREG
                try:
                    rep = sm90.report(sm90.compile_sm90(v))
                finally:
                    R.load, sm90.maxnreg = load, cap
                _print_report(role, v, rep)
    # The other way to one copy of the code: both partitions call one non-inlined function.
    from flashgen import compile as _compile

    v = _variant(128, "causal", twin(wide_configs(128, True)[1]))
    mod = _compile.import_generated("probe_noinline", noinline_source(R.render(v)))
    load = _patched_load(mod)
    try:
        rep = sm90.report(sm90.compile_sm90(v))
    finally:
        R.load = load
    _print_report("noinline", v, rep)
    return 0


def _print_report(role, v, rep) -> None:
    waits = re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x\d)", rep.sass)
    print(f"{role} {v.id}: {rep.instructions} SASS instructions, spills {rep.spill_bytes} B, "
          f"HGMMA {rep.hgmma}, wgmma waits {len(waits)} ({waits.count('0x1')} partial), MUFU.EX2 "
          f"{rep.sass.count('MUFU.EX2')}, BAR.SYNC {rep.sass.count('BAR.SYNC')}, {rep.sass.count(' CALL')} CALL.REL, "
          f"setmaxnreg {rep.setmaxnreg}, shared {rep.shared_bytes} B, "
          f"ptxas {[ln.strip() for ln in rep.ptxas_log.splitlines() if 'C75' in ln][:2]}", flush=True)


def main() -> int:
    from probe_pingpong import probe_args

    def edit_list(text: str) -> list[str]:
        edits = [e for e in text.split(",") if e]
        unknown = [e for e in edits if e not in EDITS]
        if unknown or not edits:
            raise argparse.ArgumentTypeError(f"{unknown or 'nothing'} not among {', '.join(EDITS)}")
        return edits

    def extra(ap):
        ap.add_argument("--edits", type=edit_list, default=list(EDITS),
                        help=f"comma-separated edits to build, check and time on the GPU (default: "
                             f"{','.join(EDITS)}; --sass compiles both)")
        ap.add_argument("--head-dim", type=int, choices=(64, 128),
                        help="only the shapes of this head_dim (the GPU run; --sass compiles every shape's tiles)")

    a, rc = probe_args(__doc__, out="wide.json", rep=40, workers=3,
                       sass_help="compile for sm_90 here and print what the binaries are", child=_check_child,
                       sass=_sass, extra=extra)
    if a is None:
        return rc
    edits = a.edits
    jobs, checks = [], {}
    for shape in SHAPES:
        d, causal = shape[4], shape[5]
        if a.head_dim is not None and d != a.head_dim:
            continue
        configs = []
        g = shipped(shape)
        if g is not None:
            configs.append({"role": "shipped", "config": dataclasses.asdict(g)})
        for c in wide_configs(d, causal):
            for role in edits:
                configs.append({"role": role, "config": dataclasses.asdict(c)})
                checks[(d, causal, json.dumps(dataclasses.asdict(c), sort_keys=True), role)] = None
            configs.append({"role": "twin", "config": dataclasses.asdict(twin(c))})
        jobs.append({"shape": list(shape), "configs": configs})
    keys = list(checks)
    results = _run_checks([{"d": d, "mask": "causal" if causal else "none", "config": json.loads(c), "role": role}
                           for d, causal, c, role in keys], a.timeout, a.workers)
    for key, r in zip(keys, results):
        checks[key] = r
        print("check", key[3], key[0], "causal" if key[1] else "none", key[2], json.dumps(r)[:300], flush=True)
    for job in jobs:
        d, causal = job["shape"][4], job["shape"][5]
        for e in job["configs"]:
            if e["role"] in EDITS:
                e["check"] = checks[(d, causal, json.dumps(e["config"], sort_keys=True), e["role"])]
    Path(a.out).write_text(json.dumps(jobs, indent=1))
    _time(jobs, a.rep)
    Path(a.out).write_text(json.dumps(jobs, indent=1))
    print("\nshape (b, h, hk, s, d, causal) | shipped TFLOP/s | edit TFLOP/s / two-partition twin (config)")
    ratios = {role: [] for role in edits}
    for job in jobs:
        es = job["configs"]
        ship = next((e for e in es if e["role"] == "shipped" and "tflops" in e), None)
        best = {}
        for i, e in enumerate(es):
            if e["role"] not in EDITS:
                continue
            t = next(x for x in es[i:] if x["role"] == "twin")
            if "tflops" not in e or "tflops" not in t:
                print(job["shape"], f"| {e['role']} not timed:", json.dumps(e.get("check"))[:200], _vid(job, e))
                continue
            ratios[e["role"]].append(e["tflops"] / t["tflops"])
            print(job["shape"], f"| {ship['tflops'] if ship else float('nan'):.1f} | {e['tflops']:.1f} / "
                  f"{t['tflops']:.1f} ({e['tflops'] / t['tflops']:.3f}x) | {_vid(job, e)} | worst {e['check']['worst']:.3g}")
            best[e["role"]] = max(best.get(e["role"], 0.0), e["tflops"])
        for role, b in best.items():
            if ship:
                print(job["shape"], f"| best {role} / shipped {b / ship['tflops']:.3f}x")
    for role, rs in ratios.items():
        if rs:
            print(f"geomean {role} / two-partition twin over {len(rs)}: {math.exp(sum(map(math.log, rs)) / len(rs)):.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

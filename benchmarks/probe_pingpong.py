"""Explicit ping-pong of the Gluon forward's consumer warpgroups, as a probe.

The forward's two or three consumers share each K/V tile and run out of step by
themselves: nothing orders their matrix products.  FlashAttention-3 orders them with two
named barriers (its ``warp_scheduler_barrier_sync`` / ``_arrive``): a consumer waits for
its turn before it issues a key tile's score product (and, in the loop, the previous
tile's P V product) and passes the turn to the next consumer right after issuing them,
so the tensor core runs one consumer's products while the other computes its softmax.

This probe renders a forward variant as the template writes it and with those barriers
(:func:`pingpong_source`, a text edit of the rendered source, never tuned or served):
consumer c waits on hardware named barrier 13 + c (``bar.sync``, 256 threads: its own
128 and the 128 of the consumer that passes it the turn) before the issues and arrives
on barrier 13 + (c + 1) mod consumers (``bar.arrive``) after them; the last consumer
arrives once on consumer 0's barrier before its first tile, so consumer 0 goes first.
Every consumer of a program walks the same key tiles (not with ``skip_masked``, whose
consumers skip different numbers of tiles, nor ``cross_tile``, whose loop is its own), so
the turns match.  Triton's own partition barriers use ids 0-3 here (SASS of the
shipped tiles), which the probe's 13-15 stay clear of.

For each shape: the dispatcher's shipped row, the row's ping-pong twin where the row has
two or three consumers, and where it has one (or skips tiles) the fastest two-or-three
consumer row the tuning database holds for the key, with its twin.  First, in child
processes with a timeout (a turn mismatch would hang): every twin through the forward's
float64 checks (``benchmarks/gluon_fwd.py``'s cases for its mask mode), and O of each
twin against its plain variant at the timed shape, bitwise (the barriers change no
arithmetic).  Then, in one process, each variant timed by ``do_bench`` (median, L2
flushed), plain and twin alternately, twice.

    PYTHONPATH=. python3 benchmarks/probe_pingpong.py --out pingpong.json

``--sass``: compile the twins of a few shipped tiles for sm_90 on this machine (no GPU)
and print registers, spills and the BAR instructions of plain and twin, and the twin's
SASS order of barriers, HGMMA, waits and exponentials (:func:`order`).

Prints a table last: ms of each plain variant and its twin, and their ratio.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import json
import math
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

#: (batch, num_heads, num_kv_heads, seqlen, head_dim, causal): the FA grid and four
#: Llama-3-8B shapes.
SHAPES = [(16384 // s, 2048 // d, 2048 // d, s, d, c) for d in (64, 128) for c in (False, True)
          for s in (512, 1024, 2048, 4096, 8192, 16384)] + \
         [(8, 32, 8, 1024, 128, True), (4, 32, 8, 2048, 128, True), (2, 32, 8, 4096, 128, True),
          (1, 32, 8, 8192, 128, True)]
#: The first of the named barriers the turns use (one per consumer, up to three).
BAR0 = 13

_HELPER = '''

@gluon.jit
def _pp_bar(BAR: gl.constexpr, SYNC: gl.constexpr):
    """bar.sync (wait for this consumer's turn) or bar.arrive (pass it on) on named
    barrier BAR, 256 threads: once per thread of the consumer's 128."""
    ids = gl.full([128], BAR, gl.int32, gl.BlockedLayout([1], [32], [4], [0]))
    if SYNC:
        gl.inline_asm_elementwise("bar.sync $1, 256;\\nmov.b32 $0, 0;", "=r,r", [ids], dtype=gl.int32,
                                  is_pure=False, pack=1)
    else:
        gl.inline_asm_elementwise("bar.arrive $1, 256;\\nmov.b32 $0, 0;", "=r,r", [ids], dtype=gl.int32,
                                  is_pure=False, pack=1)
'''
_SYNC = "_pp_bar({b} + C, True)"
_ARRIVE = "_pp_bar({b} + (C + 1) % NC, False)"


def eligible(c) -> str | None:
    """Why a forward config cannot take the turns (None: it can)."""
    if c.num_consumers < 2:
        return "one consumer"
    if c.skip_masked:
        return "skip_masked: consumers skip different numbers of key tiles"
    if c.cross_tile:
        return "cross_tile: its own loop"
    return None


def _insert_after(src: str, anchor: str, text: str, count: int) -> str:
    n = src.count(anchor)
    if n != count:
        raise ValueError(f"expected {count} of {anchor!r} in the rendered source, found {n}")
    return src.replace(anchor, anchor + text)


def pingpong_source(src: str) -> str:
    """``src`` (a rendered forward of two or three consumers) with the turns: the first
    key tile's score product and each loop step's two products issued in turn."""
    sync, arrive = _SYNC.format(b=BAR0), _ARRIVE.format(b=BAR0)
    anchor = "\n\n@gluon.jit\ndef _step("
    if anchor not in src:
        raise ValueError("no _step in the rendered source")
    src = src.replace(anchor, _HELPER + anchor, 1)
    # _step gets the consumer index.
    src = src.replace("def _step(acc,", "def _step(C: gl.constexpr, acc,", 1)
    n_calls = src.count("= _step(acc,")
    if n_calls < 3:
        raise ValueError("expected the three _step loops")
    src = src.replace("= _step(acc,", "= _step(C, acc,")
    # In _step: the turn around the score and P V issues.
    i = src.index("def _step(")
    j = src.index("\n\n@gluon.jit", i)
    body = src[i:j]
    wait_k = "    mbarrier.wait(k_ready.index(s_slot), (kv // STAGES) & 1)\n"
    issue_pv = "    o_tok = warpgroup_mma(p16, v_smem.index(p_slot), acc, is_async=True)\n"
    body = _insert_after(body, wait_k, f"    {sync}\n", 1)
    body = _insert_after(body, issue_pv, f"    {arrive}\n", 1)
    src = src[:i] + body + src[j:]
    # In _consumer: the first key tile's score product in turn, and the first turn.
    i = src.index("def _consumer(")
    j = src.index("\n\n@gluon.jit", i)
    body = src[i:j]
    first = ("            s_tok = warpgroup_mma(q, k_smem.index(s_slot).permute((1, 0)),\n"
             "                                  gl.zeros([BLOCK_M, BLOCK_N], gl.float32, S_LAYOUT), use_acc=False, "
             "is_async=True)\n")
    if body.count(first) != 1:
        raise ValueError("expected one first score product in _consumer")
    body = body.replace(first, f"            {sync}\n" + first + f"            {arrive}\n")
    start = "    kv = 0\n"
    body = _insert_after(body, start, f"    if C == NC - 1:\n        _pp_bar({BAR0}, False)\n", 1)
    return src[:i] + body + src[j:]


def _import(src: str, tag: str):
    from flashgen import compile as _compile

    return _compile.import_generated(f"probe_pingpong_{tag}", src)


def _variant(d: int, mask: str, g):
    from flashgen.families.gluon import config as C

    return C.GluonFwdVariant(C.GluonFwdSpec("bfloat16", d, d, mask), g)


def modules(v):
    """(plain module, ping-pong module) of a forward variant."""
    from flashgen.families.gluon import render as R

    src = R.render(v)
    tag = re.sub(r"\W", "_", v.id)
    return _import(src, tag + "_0"), _import(pingpong_source(src), tag + "_1")


def candidates(shape) -> list[dict]:
    """The configs timed at ``shape``: the shipped row, and the fastest two-or-three
    consumer row of the key when the shipped one cannot take the turns."""
    import torch

    from flashgen import db as D
    from flashgen import dispatch, library
    from flashgen.families.gluon import family as F
    from flashgen.families.gluon.family import fwd_config
    from flashgen.masks import mask_bounds
    from flashgen.spec import TileConfig

    b, h, hk, s, d, causal = shape
    q = torch.empty(b, h, s, d, device="cuda", dtype=torch.bfloat16)
    k = torch.empty(b, hk, s, d, device="cuda", dtype=torch.bfloat16)
    mode, _, _ = mask_bounds(s, s, causal=causal, window=(-1, -1))
    cfg, _ = library.kernel_for("fwd", q, k, k, mode)
    out = []
    if cfg.family == "gluon":
        g = fwd_config(cfg)
        out.append({"role": "shipped", "config": dataclasses.asdict(g)})
        if eligible(g) is None:
            return out
    key = library._dense_key("fwd", q, k, k, mode, "")
    hash_ = F.FAMILY.template_hash("fwd")
    rows = [r for path in dispatch.shipped_databases()
            for r in D.TuningDB(path, readonly=True).rows(key=key, status="ok")]
    best = None
    for r in rows:
        if r.get("family") != "gluon" or r.get("median_ms") is None or r["template_hash"] != hash_:
            continue
        g2 = fwd_config(TileConfig.from_dict(r))
        if eligible(g2) is None and (best is None or r["median_ms"] < best[0]):
            best = (r["median_ms"], g2)
    if best:
        out.append({"role": "best two-or-three-consumer row", "config": dataclasses.asdict(best[1])})
    return out


def _check_child(arg: str) -> int:
    """Float64 checks of the twin and O bitwise against the plain variant."""
    import torch

    import gluon_fwd
    from flashgen.families.gluon import config as C
    from flashgen.families.gluon import launch as L
    from flashgen.families.gluon import render as R

    a = json.loads(arg)
    b, h, hk, s, d, causal = a["shape"]
    g = C.GluonFwdConfig(**a["config"])
    mode = "causal" if causal else "none"
    v = _variant(d, mode, g)
    plain, pp = modules(v)
    load = R.load
    R.load = lambda *x, **kw: pp
    try:
        res = gluon_fwd.check_variant(v)
    finally:
        R.load = load
    torch.manual_seed(0)
    q, k, vv = (torch.randn(b, n, s, d, device="cuda", dtype=torch.bfloat16) for n in (h, hk, hk))
    outs = []
    for mod in (plain, pp):
        o, _ = L.fwd(q, k, vv, softmax_scale=d ** -0.5, mask=mode, diag_lo=0 if causal else -s,
                     diag_hi=0 if causal else s, config=g, module=mod)
        torch.cuda.synchronize()
        outs.append(o)
    print("RESULT " + json.dumps({"ok": res["ok"], "worst": res["worst"],
                                  "o_equal": bool(torch.equal(outs[0], outs[1])),
                                  "bad": [c for c in res["cases"] if not c["ok"]][:3]}), flush=True)
    return 0


def run_checks(jobs, timeout: float, workers: int, script: str = __file__,
               hang: str = " (a turn mismatch hangs)") -> list[dict]:
    """Each job through ``script --child JOB`` in its own process (``workers`` at a time,
    ``timeout`` seconds each): the JSON of its ``RESULT`` line, or why there is none."""
    def one(job):
        try:
            p = subprocess.run([sys.executable, script, "--child", json.dumps(job)], capture_output=True,
                               text=True, timeout=timeout, cwd=ROOT)
        except subprocess.TimeoutExpired:
            return {"ok": False, "error": f"timeout after {timeout} s{hang}"}
        for line in p.stdout.splitlines():
            if line.startswith("RESULT "):
                return json.loads(line[7:])
        return {"ok": False, "error": f"rc {p.returncode}: {p.stderr[-1500:]}"}

    with cf.ThreadPoolExecutor(workers) as ex:
        return list(ex.map(one, jobs))


def _time(jobs, rep: int) -> None:
    import torch
    import triton.testing

    from flashgen.families.gluon import config as C
    from flashgen.families.gluon import launch as L

    for job in jobs:
        if not job["check"].get("ok") or not job["check"].get("o_equal"):
            continue
        b, h, hk, s, d, causal = job["shape"]
        g = C.GluonFwdConfig(**job["config"])
        mode = "causal" if causal else "none"
        mods = modules(_variant(d, mode, g))
        q, k, vv = (torch.randn(b, n, s, d, device="cuda", dtype=torch.bfloat16) for n in (h, hk, hk))
        times = {0: [], 1: []}
        for which in (0, 1, 0, 1):
            fn = lambda m=mods[which]: L.fwd(q, k, vv, softmax_scale=d ** -0.5, mask=mode,  # noqa: E731
                                             diag_lo=0 if causal else -s, diag_hi=0 if causal else s, config=g,
                                             module=m)
            fn()
            torch.cuda.synchronize()
            times[which].append(float(triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median")))
        job["plain_ms"], job["pingpong_ms"] = times[0], times[1]
        flops = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)
        job["tflops"] = [flops / min(times[0]) * 1e-9, flops / min(times[1]) * 1e-9]
        print(json.dumps({k_: job[k_] for k_ in ("shape", "role", "plain_ms", "pingpong_ms")}), flush=True)


def order(sass: str) -> str:
    """The SASS as a sequence of the instructions that show the turns: the named barriers
    of the turns (ids 13-15), HGMMA, the wgmma waits, MUFU.EX2 and the mbarrier waits,
    repeats counted (``xN``)."""
    seq = []
    for line in sass.splitlines():
        m = re.search(r"(BAR\.(?:SYNC\.DEFER_BLOCKING|ARV) 0x[def]|HGMMA|WARPGROUP\.DEPBAR\.LE gsb0, 0x\d|MUFU\.EX2|"
                      r"SYNCS\.PHASECHK)", line)
        if m:
            tok = m.group(1)
            if seq and seq[-1][0] == tok:
                seq[-1][1] += 1
            else:
                seq.append([tok, 1])
    return " | ".join(t if n == 1 else f"{t} x{n}" for t, n in seq)


def _sass() -> int:
    from flashgen.families.gluon import config as C
    from flashgen.families.gluon import sm90

    tiles = [(128, "none", C.GluonFwdConfig(num_consumers=2, BLOCK_N=128, num_stages=2, pin_exps=True)),
             (128, "causal", C.GluonFwdConfig(num_consumers=2, BLOCK_N=128, num_stages=2, pin_exps=True,
                                              persistent=2, snake=True, masked_first=True)),
             (64, "none", C.GluonFwdConfig(num_consumers=3, BLOCK_N=128, num_stages=4, consumer_regs=160,
                                           producer_regs=32))]
    for d, mask, g in tiles:
        g = dataclasses.replace(g, **dict(zip(("consumer_regs", "producer_regs"),
                                              C.default_regs(g.num_consumers, g.ctas_per_sm)))) \
            if not g.consumer_regs else g
        v = _variant(d, mask, g)
        for name, mod in zip(("plain", "pingpong"), modules(v)):
            from flashgen.families.gluon import render as R

            load = R.load
            R.load = lambda *x, _m=mod, **kw: _m
            try:
                rep = sm90.report(sm90.compile_sm90(v))
            finally:
                R.load = load
            bars = sorted(set(re.findall(r"BAR\.(?:SYNC|ARV)[.\w]* [^;]*", rep.sass)))
            print(f"{v.id} {name}: {rep.registers} registers, spills {rep.spill_bytes} B, HGMMA {rep.hgmma}, "
                  f"setmaxnreg {rep.setmaxnreg}, problems {rep.problems(v)}\n    {bars}")
            if name == "pingpong":
                print("    order: " + order(rep.sass))
    return 0


def probe_args(doc: str, *, out: str, rep: int, workers: int, sass_help: str, child, sass, extra=None):
    """A probe's command line (``--out``, ``--rep``, ``--timeout``, ``--workers``,
    ``--sass``, the hidden ``--child`` and whatever ``extra(parser)`` adds): (args, None)
    to go on with the GPU run, or (None, exit status) after running ``child(job)`` or
    ``sass()``, or without a GPU."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    if extra is not None:
        extra(ap)
    ap.add_argument("--out", default=out, help=f"JSON of every timing and check (default: {out})")
    ap.add_argument("--rep", type=int, default=rep, help="do_bench rep (ms)")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per check child")
    ap.add_argument("--workers", type=int, default=workers, help=f"check processes at a time (default: {workers})")
    ap.add_argument("--sass", action="store_true", help=sass_help)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return None, child(a.child)
    if a.sass:
        return None, sass()
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: this probe checks and times on a Hopper GPU (--sass compiles for sm_90 "
              "without one)", file=sys.stderr)
        return None, 2
    return a, None


def main() -> int:
    a, rc = probe_args(__doc__, out="pingpong.json", rep=60, workers=6,
                       sass_help="compile for sm_90 here and print the barriers", child=_check_child, sass=_sass)
    if a is None:
        return rc
    jobs = []
    for shape in SHAPES:
        for c in candidates(shape):
            jobs.append({"shape": list(shape), **c})
    runnable = [j for j in jobs if eligible(_cfg(j)) is None]
    for j, r in zip(runnable, run_checks([{"shape": j["shape"], "config": j["config"]} for j in runnable],
                                          a.timeout, a.workers)):
        j["check"] = r
        print("check", j["shape"], j["role"], json.dumps(r)[:400], flush=True)
    for j in jobs:
        j.setdefault("check", {"ok": False, "skipped": eligible(_cfg(j))})
    Path(a.out).write_text(json.dumps(jobs, indent=1))
    _time(jobs, a.rep)
    Path(a.out).write_text(json.dumps(jobs, indent=1))
    print("\nshape (b, h, hk, s, d, causal) | config | plain ms | ping-pong ms | plain / ping-pong | exact")
    for j in jobs:
        if "plain_ms" in j:
            p, q = min(j["plain_ms"]), min(j["pingpong_ms"])
            print(j["shape"], "|", _vid(j), f"| {p:.4f} | {q:.4f} | {p / q:.3f}x |",
                  f"worst {j['check']['worst']:.3g}, O equal {j['check']['o_equal']}")
        else:
            print(j["shape"], "|", _vid(j), "| not timed:", json.dumps(j["check"])[:200])
    ratios = [min(j["plain_ms"]) / min(j["pingpong_ms"]) for j in jobs if "plain_ms" in j]
    if ratios:
        print(f"geomean plain / ping-pong over {len(ratios)}: "
              f"{math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f}x")
    return 0


def _cfg(j):
    from flashgen.families.gluon import config as C

    return C.GluonFwdConfig(**j["config"])


def _vid(j) -> str:
    b, h, hk, s, d, causal = j["shape"]
    return _variant(d, "causal" if causal else "none", _cfg(j)).id


if __name__ == "__main__":
    sys.exit(main())

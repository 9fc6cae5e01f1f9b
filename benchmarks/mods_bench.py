"""Score modifications on the GPU: flashgen's softcap, ALiBi, bias and dropout kernels
against FlexAttention (score_mod) and torch SDPA, side by side in one run (issue #8).

Cases (bf16, batch x seqlen = 16k tokens, 16 heads, no GQA; head_dim 128 at seqlen 2048
and 8192, head_dim 64 at 2048; non-causal and causal, each shape in this order):

* ``plain``: no modification, for reference: flashgen, Flex, SDPA cuDNN and flash.
* ``softcap``: s <- 30 tanh(s / 30) (Gemma 2): flashgen, Flex (score_mod
  ``c * tanh(score / c)``); SDPA has no soft-capping (recorded as unsupported).
* ``alibi``: s <- s - slope[h] |i + sk - sq - j| with flashgen.bench.alibi_slopes:
  flashgen (``alibi_slopes``), Flex (score_mod, the same bottom-right formula), SDPA
  cuDNN / efficient with the bias materialized as a (1, h, sq, sk) bf16 attn_mask
  (causal folded in as -inf; reported as skipped past --max-mask-gb).
* ``bias``: an additive (1, h, sq, sk) bf16 bias: flashgen (``bias``), Flex (score_mod
  ``score + bias[h, q_idx, kv_idx]``), SDPA cuDNN / efficient (``attn_mask``).
* ``dropout``: p = 0.1: flashgen, SDPA flash / efficient (``dropout_p``), timed only
  against each other (different random streams); FlexAttention has no dropout.

Per backend: forward and forward+backward (autograd, gradients of q, k and v) median ms
(triton.testing.do_bench: warm-up, L2 flushed), TFLOP/s by the FlashAttention
convention (forward 4·b·h·sq·sk·d, halved for causal; backward 2.5x, so forward+backward
3.5x; the modifications' own work is not counted), and per case flashgen/Flex and
flashgen/best-SDPA TFLOP/s ratios.  ``first_call_s`` is the first forward+backward
(compiles: FlexAttention's torch.compile, flashgen's Triton kernels not precompiled).
flashgen's kernels for every case are compiled and checked in parallel first (as
``flashgen bench`` does).

Before timing, each backend's output and gradients on the case's full inputs are
checked on a slice (batch 0, the first and last head: ALiBi's steepest and flattest
slopes) against the float64 reference with the same modifications
(flashgen.reference; dropout through flashgen.dropout_mask's keep mask, flashgen only),
with the project's rule: max error <= 2 x torch's error at bf16 + floor.  A flashgen
check that fails (or a flashgen error) makes the exit status 1; Flex's and SDPA's
checks are reported only.

Budget: no case starts after --budget-s seconds (default 95: the whole run stays near
two minutes on an H200); the rest are recorded as skipped, with the reason.  JSON goes
to --out, rewritten after every case; a short table is printed last.

    PYTHONPATH=. python3 benchmarks/mods_bench.py --out mods.json            # GPU
    PYTHONPATH=. python3 benchmarks/mods_bench.py --smoke --out /tmp/m.json  # CPU, interpreter

``--smoke`` runs the same code paths on the CPU in Triton's interpreter at a tiny
float16 size (b1 h2 sq33 sk47 d16): flashgen and its float64 checks, FlexAttention
uncompiled (forward only: it has no CPU backward), SDPA's backends where they run on
the CPU (the others record torch's reason) plus its math backend, so that the attn_mask
and dropout arguments run and are checked; timing is the wall clock.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
import warnings

import torch  # Triton is imported later, after --smoke has set TRITON_INTERPRET

MODS = ("plain", "softcap", "alibi", "bias", "dropout")
BACKENDS = ("flashgen", "flex", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "sdpa-math")
#: The peers each modification is measured against (beside flashgen).
PEERS = {"plain": ("flex", "sdpa-cudnn", "sdpa-flash"),
         "softcap": ("flex",),
         "alibi": ("flex", "sdpa-cudnn", "sdpa-efficient"),
         "bias": ("flex", "sdpa-cudnn", "sdpa-efficient"),
         "dropout": ("sdpa-flash", "sdpa-efficient")}
#: --smoke also runs SDPA's math backend (the one the CPU has) where SDPA runs, so the
#: attn_mask and dropout paths run and the masks are checked.
SMOKE_PEERS = ("sdpa-math",)
#: What a peer cannot do at all (recorded in the case's "unsupported").
UNSUPPORTED = {"softcap": {"sdpa": "torch SDPA has no logit soft-capping (no softcap argument, and no "
                                   "score hook: an attn_mask is additive)"},
               "dropout": {"flex": "FlexAttention has no dropout"}}
#: (head_dim, seqlen) of the GPU cases, in the order they run.
SHAPES = "128:2048,128:8192,64:2048"
#: (batch, heads, seqlen_q, seqlen_k, head_dim) of --smoke.
SMOKE_SHAPE = (1, 2, 33, 47, 16)
DIRECTIONS = ("fwd", "fwdbwd")


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="mods_bench.json", help="JSON output path")
    p.add_argument("--budget-s", type=float, default=95.0,
                   help="start no case after this many seconds (default 95); the rest are recorded as skipped")
    p.add_argument("--smoke", action="store_true",
                   help="CPU: Triton's interpreter at b1 h2 sq33 sk47 d16, float16, wall-clock timing")
    p.add_argument("--shapes", default=SHAPES, help=f"head_dim:seqlen pairs, in order (default {SHAPES})")
    p.add_argument("--tokens", type=int, default=16384, help="batch x seqlen of every shape (default 16384)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--mods", default=",".join(MODS), help=f"comma-separated subset of {','.join(MODS)}")
    p.add_argument("--causal", choices=("both", "no", "yes"), default="both")
    p.add_argument("--backends", default=",".join(BACKENDS), help=f"comma-separated subset of {','.join(BACKENDS)}")
    p.add_argument("--softcap", type=float, default=30.0)
    p.add_argument("--dropout-p", type=float, default=0.1)
    p.add_argument("--max-mask-gb", type=float, default=8.0,
                   help="largest materialized ALiBi attn_mask for SDPA, in GB (default 8)")
    p.add_argument("--warmup-ms", type=int, default=10)
    p.add_argument("--rep-ms", type=int, default=40)
    p.add_argument("--reps", type=int, default=1, help="--smoke: timed calls per measurement (default 1)")
    p.add_argument("--no-check", action="store_true", help="skip the float64 checks")
    p.add_argument("--no-precompile", action="store_true", help="compile flashgen's kernels on first use instead")
    return p.parse_args(argv)


def _cases(args) -> list[dict]:
    """The cases in run order: shape, then causal, then modification."""
    mods = [m.strip() for m in args.mods.split(",") if m.strip()]
    bad = [m for m in mods if m not in MODS]
    if bad:
        raise SystemExit(f"unknown mods {bad}; known: {', '.join(MODS)}")
    if args.smoke:
        shapes = [SMOKE_SHAPE]
    else:
        shapes = []
        for item in args.shapes.split(","):
            d, s = (int(x) for x in item.split(":"))
            shapes.append((max(1, args.tokens // s), args.heads, s, s, d))
    causals = {"both": (False, True), "no": (False,), "yes": (True,)}[args.causal]
    out = []
    for b, h, sq, sk, d in shapes:
        for causal in causals:
            for mod in mods:
                label = f"{mod} d{d} s{sq}{'' if sq == sk else f'/{sk}'} b{b}{' causal' if causal else ''}"
                out.append(dict(label=label, mod=mod, batch=b, num_heads=h, seqlen_q=sq, seqlen_k=sk, head_dim=d,
                                causal=causal))
    return out


def main(argv=None) -> int:
    args = _parse(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    t_start = time.perf_counter()

    import flashgen
    from flashgen import bench, compare, library
    from flashgen.dispatch import default_dispatcher
    from flashgen.spec import KernelSpec, ProblemKey

    picked = bench.script_device(args.smoke)
    if picked is None:
        return 2
    device, dtype_name, dtype = picked
    wanted = bench.script_backends(args.backends, BACKENDS)
    if wanted is None:
        return 2
    cases = _cases(args)

    meta = {"device": torch.cuda.get_device_name() if device == "cuda" else f"cpu ({platform.processor()})",
            "interpreter": bool(args.smoke), "torch": torch.__version__, "flashgen": flashgen.__version__,
            "dtype": dtype_name, "budget_s": args.budget_s, "softcap": args.softcap, "dropout_p": args.dropout_p,
            "backends": wanted,
            "timing": (f"triton.testing.do_bench median (warmup {args.warmup_ms} ms, rep {args.rep_ms} ms, L2 flushed)"
                       if device == "cuda" else f"wall clock median of {args.reps}"),
            "tflops": "FlashAttention convention: fwd 4*b*h*sq*sk*d, halved for causal; fwd+bwd 3.5x fwd",
            "check": "batch 0, first and last head, vs float64 reference: max err <= 2 x torch-at-dtype err + floor"}
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:  # pragma: no cover
        pass
    results: list[dict] = []

    def save():
        with open(args.out, "w") as f:
            json.dump({"meta": {**meta, "wall_s": round(time.perf_counter() - t_start, 1)}, "cases": results}, f,
                      indent=1, default=str)

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def time_ms(fn) -> float:
        if device == "cuda":
            import triton.testing

            return float(triton.testing.do_bench(fn, warmup=args.warmup_ms, rep=args.rep_ms, return_mode="median"))
        ts = []
        for _ in range(max(1, args.reps)):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
        return sorted(ts)[len(ts) // 2]

    if device == "cuda" and "flashgen" in wanted and not args.no_precompile:
        t0 = time.perf_counter()
        meta["precompile"] = _precompile(cases, dtype_name)
        meta["precompile"]["seconds"] = round(time.perf_counter() - t0, 1)
        print(f"[{time.perf_counter() - t_start:6.1f} s] precompiled {meta['precompile']['variants']} flashgen "
              f"variants, {len(meta['precompile']['failed'])} failed", flush=True)
    save()

    for case in cases:
        rec = {**case, "dtype": dtype_name, "results": {}, "unsupported": {}, "ratios": {}}
        results.append(rec)
        elapsed = time.perf_counter() - t_start
        t_case = time.perf_counter()
        if elapsed > args.budget_s:
            rec["skipped"] = f"time budget ({args.budget_s:.0f} s) spent after {elapsed:.0f} s"
            continue
        b, h, sq, sk, d, causal, mod = (case[n] for n in ("batch", "num_heads", "seqlen_q", "seqlen_k", "head_dim",
                                                          "causal", "mod"))
        flops = {x: compare.Case(b, h, h, sq, sk, d, causal).flops(x) for x in DIRECTIONS}
        rec["flops"] = flops
        rec["unsupported"] = {k: v for k, v in UNSUPPORTED.get(mod, {}).items()
                              if k == "sdpa" or k in wanted}
        scale = d ** -0.5
        try:
            g = torch.Generator(device=device).manual_seed(0)

            def rnd(*s):
                return torch.randn(*s, device=device, dtype=dtype, generator=g)
            q, k, v = (rnd(b, h, n, d).requires_grad_(True) for n in (sq, sk, sk))
            do = rnd(b, h, sq, d)
            fg_kw, ref_kw = _mod_inputs(mod, args, b, h, sq, sk, device, dtype, g)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory: the case says so
            rec["error"] = f"inputs: {_describe(e)}"
            save()
            continue
        # The checked slice: batch 0, the first and the last head.
        heads = sorted({0, h - 1})
        refs: dict = {}

        def check(outs: dict, rng_before=None) -> dict:
            """{ok, ratio, outputs: {name: {err, torch_err, ratio}}} of ``outs`` (full
            tensors) on the slice, against the float64 reference (computed once per
            case; with dropout, per call: the keep mask is the call's)."""
            if rng_before is not None or not refs:
                refs.clear()
                kw = dict(ref_kw)
                if "alibi" in kw:
                    kw["alibi"] = kw["alibi"][heads]
                if "bias" in kw:
                    kw["bias"] = kw["bias"][:, heads]
                if rng_before is not None:
                    kw.update(keep=_keep_mask(rng_before, h, sq, sk, heads, args.dropout_p), dropout_p=args.dropout_p)
                qs, ks, vs, dos = (t.detach()[:1, heads] for t in (q, k, v, do))
                rkw = dict(causal=causal, softmax_scale=scale, **kw)
                from flashgen import reference

                r, base = reference.forward(qs, ks, vs, **rkw), reference.forward(qs, ks, vs, dtype=dtype, **rkw)
                refs["O"] = (r[0], base[0])
                del r, base
                if "dQ" in outs:
                    r, base = reference.backward(dos, qs, ks, vs, **rkw), reference.backward(dos, qs, ks, vs,
                                                                                             dtype=dtype, **rkw)
                    refs.update(dQ=(r[0], base[0]), dK=(r[1], base[1]), dV=(r[2], base[2]))
                    del r, base
            res = bench._ratios({n: t.detach()[:1, heads] for n, t in outs.items()},
                                {n: refs[n] for n in outs}, dtype)
            worst = max(x[2] for x in res.values())
            return {"ok": worst <= 1.0, "ratio": worst,
                    "outputs": {n: {"err": e, "torch_err": be, "ratio": r} for n, (e, be, r) in res.items()}}

        def measure(name, fn, *, checked=True, rng=None, no_bwd=None, extra=None):
            """Time ``fn`` (a zero-argument forward): first forward+backward (compiles)
            and its check, then forward and forward+backward medians."""
            entry = dict(extra or {})
            stage = "first call"
            try:
                t0 = time.perf_counter()
                rng_before = rng.clone() if rng is not None else None
                o = fn()
                outs = {"O": o}
                if no_bwd is None:
                    outs.update(zip(("dQ", "dK", "dV"), torch.autograd.grad(o, (q, k, v), do)))
                sync()
                entry["first_call_s"] = round(time.perf_counter() - t0, 3)
                if checked and not args.no_check:
                    stage = "check"
                    entry["check"] = check(outs, rng_before)
                del o, outs
                stage = "fwd"
                entry["fwd_ms"] = time_ms(fn)
                if no_bwd is None:
                    stage = "fwd+bwd"
                    entry["fwdbwd_ms"] = time_ms(lambda: torch.autograd.grad(fn(), (q, k, v), do))
                else:
                    entry["fwdbwd"] = f"unsupported: {no_bwd}"
            except Exception as e:  # noqa: BLE001 - a backend that fails is a value
                entry["error"] = f"{stage}: {_describe(e)}"
                if os.environ.get("MODS_BENCH_TRACE"):
                    traceback.print_exc()
            for x in DIRECTIONS:
                if entry.get(f"{x}_ms"):
                    entry[f"{x}_tflops"] = flops[x] / entry[f"{x}_ms"] / 1e9
            rec["results"][name] = entry
            if device == "cuda":
                torch.cuda.empty_cache()

        # flashgen: the public call, as a user makes it
        if "flashgen" in wanted:
            def fg():
                return flashgen.attention(q, k, v, causal=causal, softmax_scale=scale, **fg_kw)
            info = {}
            try:
                spec = KernelSpec("fwd", dtype_name, d, d, "causal" if causal else "none", _mods_name(mod))
                key = ProblemKey.from_sizes(spec, batch=b, num_heads=h, num_kv_heads=h, seqlen_q=sq, seqlen_k=sk,
                                            layout=library.layout_signature(q, k, v))
                c = default_dispatcher().choose(key, capturing=False)
                info = {"fwd_key": key.id, "fwd_config": c.config.id, "source": c.source}
            except Exception as e:  # noqa: BLE001 - the run says which config; a failure here is not fatal
                info = {"config_error": _describe(e)}
            measure("flashgen", fg, rng=fg_kw.get("rng_state"), extra=info)

        # FlexAttention: compiled on CUDA; uncompiled (forward only) on the CPU
        peers_ = PEERS[mod] + (SMOKE_PEERS if args.smoke and mod != "softcap" else ())
        if "flex" in wanted and "flex" in peers_:
            try:
                fx, no_bwd = _flex_fn(mod, q, k, v, causal, scale, ref_kw, args.softcap, compiled=device == "cuda")
                measure("flex", fx, no_bwd=no_bwd)
            except Exception as e:  # noqa: BLE001
                rec["results"]["flex"] = {"error": f"setup: {_describe(e)}"}

        # torch SDPA, one backend at a time
        sdpas = [n for n in peers_ if n.startswith("sdpa") and n in wanted]
        if sdpas:
            mask, why = None, None
            try:
                if mod == "alibi":
                    need = h * sq * sk * torch.finfo(dtype).bits / 8
                    if need > args.max_mask_gb * 1e9:
                        why = (f"skipped: the materialized ALiBi attn_mask needs {need / 1e9:.1f} GB "
                               f"(--max-mask-gb {args.max_mask_gb:g})")
                    else:
                        mask = _alibi_bias(ref_kw["alibi"], sq, sk, dtype)
                elif mod == "bias":
                    mask = ref_kw["bias"]
                if mask is not None and causal:
                    mask = mask.masked_fill(~_visible(sq, sk, mask.device), float("-inf"))
            except Exception as e:  # noqa: BLE001 - e.g. out of memory building the mask
                why = f"attn_mask: {_describe(e)}"
            for name in sdpas:
                if why:
                    rec["results"][name] = {"error": why}
                    continue
                fn_ = _sdpa_fn(name, q, k, causal=causal, scale=scale, attn_mask=mask,
                               dropout_p=args.dropout_p if mod == "dropout" else 0.0)
                measure(name, lambda fn_=fn_: fn_(q, k, v), checked=mod != "dropout",
                        extra={"attn_mask": f"materialized (1, {h}, {sq}, {sk}) {dtype_name}"} if mask is not None
                        else None)
            del mask

        rec["ratios"] = _ratios(rec["results"])
        rec["wall_s"] = round(time.perf_counter() - t_case, 2)
        print(f"[{time.perf_counter() - t_start:6.1f} s] {_line(rec)}", flush=True)
        del q, k, v, do, fg_kw, ref_kw
        refs.clear()
        if device == "cuda":
            torch.cuda.empty_cache()
        save()

    meta["wall_s"] = round(time.perf_counter() - t_start, 1)
    save()
    _table(results)
    failed = [(r["label"], _failure(r["results"]["flashgen"])) for r in results
              if "flashgen" in r.get("results", {}) and _failure(r["results"]["flashgen"])]
    # The peers' errors (refusals, mostly), each distinct one once; then failed checks.
    errors: dict = {}
    for r in results:
        for n, x in r.get("results", {}).items():
            if n != "flashgen" and "error" in x:
                errors.setdefault((n, x["error"]), []).append(r["label"])
    for (n, why), labels in errors.items():
        print(f"{n} x: {why}  [{labels[0]}{f' and {len(labels) - 1} more' if len(labels) > 1 else ''}]")
    for r in results:
        for n, x in r.get("results", {}).items():
            if n != "flashgen" and "check" in x and not x["check"]["ok"]:
                print(f"note: {n} check failed on {r['label']}: {_failure(x)}")
    for label, why in failed:
        print(f"FAILED flashgen on {label}: {why}")
    measured = sum("skipped" not in r for r in results)
    n_ok = sum(r.get("results", {}).get("flashgen", {}).get("check", {}).get("ok", False) for r in results)
    print(f"wrote {args.out}; {measured}/{len(results)} cases measured in {time.perf_counter() - t_start:.0f} s; "
          f"flashgen float64 checks: {n_ok} ok, {len(failed)} failed")
    return 1 if failed else 0


# ---------------------------------------------------------------------------------
# Inputs of the modifications

def _mods_name(mod: str) -> str:
    from flashgen.spec import mods_name

    return "" if mod == "plain" else mods_name(**{mod: True})


def _mod_inputs(mod, args, b, h, sq, sk, device, dtype, g):
    """(flashgen.attention keyword arguments, reference keyword arguments) of ``mod``."""
    from flashgen import bench

    if mod == "softcap":
        return dict(softcap=args.softcap), dict(softcap=args.softcap)
    if mod == "alibi":
        slopes = torch.tensor(bench.alibi_slopes(h), dtype=torch.float32, device=device)
        return dict(alibi_slopes=slopes), dict(alibi=slopes)
    if mod == "bias":
        bias = torch.randn(1, h, sq, sk, device=device, dtype=dtype, generator=g)
        return dict(bias=bias), dict(bias=bias)
    if mod == "dropout":
        rng = torch.tensor([1234, 0], dtype=torch.int64, device=device)
        return dict(dropout_p=args.dropout_p, rng_state=rng), {}
    return {}, {}


def _keep_mask(rng_before, h, sq, sk, heads, p):
    """The kernels' keep mask on batch 0's ``heads``: plane z * h + i starts at counter
    offset + (z * h + i) * sq * ceil(sk / 4) (flashgen.dropout), so each head's plane
    is one dropout_mask call with the offset moved there."""
    import flashgen
    from flashgen import dropout

    planes = []
    for i in heads:
        st = rng_before.clone()
        st[1] += i * dropout.counters(1, 1, sq, sk)
        planes.append(flashgen.dropout_mask(st, 1, 1, sq, sk, p))
    return torch.cat(planes, 1)


def _visible(sq, sk, device):
    """Bottom-right causal visibility (sq, sk): j <= i + sk - sq."""
    from flashgen import peers

    return peers.visible(sq, sk, causal=True, window=(-1, -1), device=device)


def _alibi_bias(slopes, sq, sk, dtype):
    """ALiBi as an additive (1, h, sq, sk) tensor in ``dtype``: -slope[h] |i + sk - sq - j|,
    computed in float32 one head at a time."""
    dev = slopes.device
    dist = (torch.arange(sq, device=dev)[:, None] + (sk - sq) - torch.arange(sk, device=dev)[None, :]).abs().float()
    out = torch.empty((1, slopes.numel(), sq, sk), dtype=dtype, device=dev)
    for i in range(slopes.numel()):
        out[0, i] = dist * -slopes[i]
    return out


# ---------------------------------------------------------------------------------
# Peers

#: What the score_mods read (module-level, so that one compiled graph per score_mod and
#: head_dim serves every case: new tensors here are new graph inputs, not recompiles).
_state: dict = {}


def _softcap_mod(score, b, h, q_idx, kv_idx):
    c = _state["softcap"]
    return c * torch.tanh(score / c)


def _alibi_mod(score, b, h, q_idx, kv_idx):
    return score - _state["slopes"][h] * (q_idx + _state["offset"] - kv_idx).abs()


def _bias_mod(score, b, h, q_idx, kv_idx):
    return score + _state["bias"][h, q_idx, kv_idx]


def _flex_fn(mod, q, k, v, causal, scale, ref_kw, softcap, *, compiled: bool):
    """(fn, reason there is no backward or None): FlexAttention with ``mod`` as a
    score_mod and the mask as a block mask (flashgen.peers' band mask: causal and
    non-causal share one compiled graph).  Uncompiled on the CPU, forward only, on
    inputs without grad."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from flashgen import peers
    from flashgen.masks import mask_bounds

    sq, sk = q.shape[2], k.shape[2]
    _, lo, hi = mask_bounds(sq, sk, causal=causal, window=(-1, -1))
    for name, val in (("lo", lo), ("hi", hi)):
        peers._flex_bounds[name] = torch.tensor(val, device=q.device, dtype=torch.int32)
    block_mask = create_block_mask(peers._band_mask, B=None, H=None, Q_LEN=sq, KV_LEN=sk, device=q.device)
    score_mod = {"plain": None, "softcap": _softcap_mod, "alibi": _alibi_mod, "bias": _bias_mod}[mod]
    # Python numbers are constants of the compiled graph (one value per run); tensors are its inputs.
    # The soft cap is a 0-d tensor (a graph input): a captured Python float failed inside
    # the compiled flex HOP on the H200 with torch 2.11 ("all unwrapped values must be
    # FakeTensor, int, or SymInt").
    _state.update(softcap=torch.tensor(float(softcap), device=q.device, dtype=torch.float32), offset=sk - sq)
    if mod == "alibi":
        _state["slopes"] = ref_kw["alibi"]
    if mod == "bias":
        _state["bias"] = ref_kw["bias"][0]
    kw = dict(score_mod=score_mod, block_mask=block_mask, scale=scale)
    if compiled:
        fx = peers._compiled_flex()
        return (lambda: fx(q, k, v, **kw)), None
    qd, kd, vd = (t.detach() for t in (q, k, v))

    def fn():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "called without torch.compile()": known, intended here
            return flex_attention(qd, kd, vd, **kw)
    return fn, "FlexAttention has no backward on the CPU"


def _sdpa_fn(name, q, k, *, causal, scale, attn_mask=None, dropout_p=0.0):
    """``fn(q, k, v)``: :func:`flashgen.peers.sdpa` restricted to backend ``name``, with
    an attn_mask (causal already folded in) or dropout when given.  A refusal raises
    RuntimeError with torch's reasons."""
    from flashgen import peers

    return peers.sdpa(name, q, k, causal=causal, softmax_scale=scale, attn_mask=attn_mask, dropout_p=dropout_p)


def _precompile(cases, dtype_name: str) -> dict:
    """Compile and check, in parallel worker processes, every flashgen variant the cases
    launch (fwd, bwd_dq, bwd_dkdv with the dispatcher's config for each case's key)."""
    from flashgen.bench import KernelBenchmarker
    from flashgen.dispatch import default_dispatcher
    from flashgen.spec import DENSE_KERNELS, KernelSpec, ProblemKey, Variant

    disp = default_dispatcher()
    variants, failed = [], []
    for c in cases:
        for kernel in DENSE_KERNELS:
            spec = KernelSpec(kernel, dtype_name, c["head_dim"], c["head_dim"], "causal" if c["causal"] else "none",
                              _mods_name(c["mod"]))
            key = ProblemKey.from_sizes(spec, batch=c["batch"], num_heads=c["num_heads"], num_kv_heads=c["num_heads"],
                                        seqlen_q=c["seqlen_q"], seqlen_k=c["seqlen_k"])
            try:
                variants.append(Variant(spec, disp.config_for(key, capturing=False)))
            except Exception as e:  # noqa: BLE001 - the case itself will report it
                failed.append(f"{key.id}: {_describe(e)}")
    variants = list(dict.fromkeys(variants))
    # The worker is pickled by reference: only when this file runs as the main script.
    worker = _precompile_worker if _precompile_worker.__module__ == "__main__" else None
    failures = KernelBenchmarker().precompile(variants, worker_fn=worker) if variants else {}
    failed += [f"{vid}: {f}" for vid, f in failures.items() if f]
    return {"variants": len(variants), "failed": failed}


def _precompile_worker(variant, group: int):
    """flashgen's precompile worker (compile, check), then for a bias variant one more
    launch whose bias strides are multiples of 16 elements, as the timed cases' are (the
    check's seqlens are not, and Triton specializes the strides' divisibility)."""
    from flashgen import bench
    from flashgen.spec import Shape

    out = bench._precompile_one(variant, group)
    if out[1] is None and "bias" in variant.spec.mods:
        try:
            dev = "cuda" if torch.cuda.is_available() else "cpu"
            shape = Shape(2, 2 * group, 2, 256, 256)
            q, k, v, do = bench.make_inputs(variant.spec, shape, device=dev)
            mask = dict(causal=variant.spec.mask == "causal", window=(-1, -1), align="bottom_right")
            fn, _ = bench.run_variant(variant, q, k, v, do, mask=mask,
                                      mods=bench.mod_inputs(variant.spec, shape, device=dev))
            fn()
            if dev == "cuda":
                torch.cuda.synchronize()
        except Exception:  # noqa: BLE001, S110 - only a warm-up: the timed run compiles what this missed
            pass
    return out


# ---------------------------------------------------------------------------------
# Results

def _describe(e: BaseException) -> str:
    msg = str(e).splitlines()[0][:300] if str(e) else ""
    if "out of memory" in msg.lower():
        return f"OOM: {msg[:160]}"
    return f"{type(e).__name__}: {msg}"


def _failure(entry: dict) -> str | None:
    """Why a backend's entry fails its check (or errored), None when it passed."""
    if "error" in entry:
        return entry["error"]
    c = entry.get("check")
    if c is not None and not c["ok"]:
        worst = max(c["outputs"], key=lambda n: c["outputs"][n]["ratio"])
        o = c["outputs"][worst]
        return f"{worst} err {o['err']:.3g} vs torch {o['torch_err']:.3g} (ratio {c['ratio']:.3g} > 1)"
    return None


def _ratios(res: dict) -> dict:
    """flashgen's TFLOP/s over Flex's and over the best SDPA backend's, per direction."""
    out = {}
    fg = res.get("flashgen", {})
    for x in DIRECTIONS:
        mine = fg.get(f"{x}_tflops")
        flex = res.get("flex", {}).get(f"{x}_tflops")
        sd = {n: r[f"{x}_tflops"] for n, r in res.items() if n.startswith("sdpa") and f"{x}_tflops" in r}
        if mine and flex:
            out[f"flashgen/flex_{x}"] = mine / flex
        if sd:
            best = max(sd, key=sd.get)
            out[f"best_sdpa_{x}"] = best
            if mine:
                out[f"flashgen/best_sdpa_{x}"] = mine / sd[best]
    return out


def _cell(entry: dict | None) -> str:
    """'fwd|fwd+bwd' TFLOP/s of one entry."""
    if entry is None:
        return "-"
    if "fwd_tflops" not in entry:
        return "x"
    bwd = entry.get("fwdbwd_tflops")
    return f"{entry['fwd_tflops']:.3g}|{'-' if bwd is None else f'{bwd:.3g}'}"


def _best_sdpa(rec: dict) -> tuple[str, dict | None]:
    name = rec["ratios"].get("best_sdpa_fwd")
    if name:
        return name.replace("sdpa-", ""), rec["results"][name]
    if "sdpa" in rec["unsupported"]:
        return "", {}
    tried = [n for n in rec["results"] if n.startswith("sdpa")]
    return "", (rec["results"][tried[0]] if tried else None)


def _line(rec: dict) -> str:
    parts = [f"{n} {_cell(x)}" for n, x in rec["results"].items()]
    return f"{rec['label']}: " + ", ".join(parts) + " TFLOP/s (fwd|fwd+bwd)"


def _table(results: list[dict]) -> None:
    print()
    print("TFLOP/s fwd|fwd+bwd (- : not run or unsupported; x : failed, see JSON); ratios: flashgen / peer, "
          "fwd|fwd+bwd; check: flashgen's worst error ratio (<= 1 passes)")
    print(f"{'case':<30}{'flashgen':>16}{'flex':>16}{'best sdpa':>24}{'fg/flex':>13}{'fg/sdpa':>13}{'check':>8}")
    for r in results:
        if "skipped" in r or "error" in r:
            print(f"{r['label']:<30}{r.get('skipped') or r.get('error')}")
            continue
        res, rat = r["results"], r["ratios"]
        name, sd = _best_sdpa(r)
        sd_cell = "n/a" if sd == {} else _cell(sd) + (f" {name}" if name else "")

        def ratio(peer):
            a, b = rat.get(f"flashgen/{peer}_fwd"), rat.get(f"flashgen/{peer}_fwdbwd")
            return "-" if a is None else f"{a:.2f}|{'-' if b is None else f'{b:.2f}'}"
        fg = res.get("flashgen", {})
        chk = "x" if "error" in fg else (f"{fg['check']['ratio']:.2f}" if "check" in fg else "-")
        print(f"{r['label']:<30} {_cell(res.get('flashgen')):>15} {_cell(res.get('flex')):>15} {sd_cell:>23}"
              f"{ratio('flex'):>13}{ratio('best_sdpa'):>13}{chk:>8}")


if __name__ == "__main__":
    sys.exit(main())

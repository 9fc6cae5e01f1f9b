"""Ragged batches (packed documents) on the GPU, side by side in one run (issue #8):
flashgen.attention_varlen against FlexAttention with a document mask and torch SDPA on
a padded batch, in TFLOP/s on the same useful FLOPs.

Problems (bf16; 16384 tokens packed, split into documents drawn with a fixed seed):
``docs512`` lengths uniform in [128, 896] (mean 512), ``docs2048`` uniform in
[512, 3584] (mean 2048), ``mix`` long documents (uniform [2048, 6144], 1 in 10) among
short ones (uniform [16, 256]) plus one empty document; head_dim 128 and 64, 16 heads,
causal and not; and docs2048 with GQA (16 query heads on 4 key/value heads), d 128.
Each document attends only to itself (seqlen_q == seqlen_k per document; causal is
per document).  For each problem (timing: triton.testing.do_bench, median ms, L2
flushed between repetitions):

* ``flashgen``: the public ``flashgen.attention_varlen`` call on packed
  (tokens, heads, d) tensors, tuned configs of the dispatcher (FLASHGEN_DB / shipped
  DBs; the choice is recorded); ``fwd`` is the forward of a training step (inputs
  require grad), ``fwd_bwd`` adds ``torch.autograd.grad`` of O against dO (dQ, dK, dV).
  The call checks cu_seqlens on the host (one copy to the CPU per call): included.
* ``flex``: ``flex_attention`` compiled as flashgen.peers does (torch.compile,
  dynamic=True), the packed tokens as one batch-1 sequence (1, heads, tokens, d) with a
  document mask (``mask_mod``: same document id, and q_idx >= kv_idx when causal) built
  by ``create_block_mask``; block-mask build and compile time are excluded from the
  timing and reported (``block_mask_s``, ``first_call_s``).
* ``sdpa-cudnn``, ``sdpa-flash``: ``scaled_dot_product_attention`` restricted to one
  backend on a dense batch padded to the longest document (batch = non-empty
  documents, right-padded with zeros); causal is ``is_causal`` (exact on the real rows),
  not causal a boolean key-padding mask where the backend takes it; a backend that
  refuses the mask is timed without it and marked ``exact: false`` (padded keys
  attended: the padded work, not the same result).  It computes the padded work
  (``padded_flops``) but is credited with the same useful FLOPs as the others; where
  the padded batch would not fit in memory it is skipped with that reason.

FLOPs (FlashAttention-2's convention): forward = sum over documents of
2 * visible pairs * (d + dv) * heads = 4 * sq * sk * d * heads per document without a
mask; causal counts the visible pairs exactly (L * (L + 1) / 2 per document of L
tokens); backward = 2.5 x forward, so fwd_bwd = 3.5 x forward.

Before timing, the outputs (O; LSE for flashgen; dQ, dK, dV) of flashgen, Flex and the
exact SDPA runs on that same input are checked against the per-document float64
reference with the project's rule: max error <= 2 x the error of the same computation
in torch at bf16, plus a floor (flashgen.bench.compare_varlen).  A failed flashgen
check (or a flashgen error) makes the exit status 1; the others are reported.  JSON
goes to --out (rewritten after every problem); a short table is printed last.
Problems are not started once --budget-s is (about to be) spent.

    PYTHONPATH=. python3 benchmarks/varlen_bench.py --out varlen.json           # GPU
    PYTHONPATH=. python3 benchmarks/varlen_bench.py --smoke --out /tmp/v.json   # CPU, interpreter

--smoke: Triton's interpreter on the CPU, float16, documents of 5, 0, 17 and 33 tokens,
head_dim 16, wall-clock timing; Flex runs eagerly (unfused, forward only: it has no
CPU backward, reported), the cuDNN backend is skipped (CUDA only), ``sdpa-flash`` is
torch's CPU flash kernel, and ``sdpa-math`` is added to cover the padded path.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
import traceback

BACKENDS = ("flashgen", "flex", "sdpa-cudnn", "sdpa-flash", "sdpa-efficient", "sdpa-math")
DEFAULT_BACKENDS = ("flashgen", "flex", "sdpa-cudnn", "sdpa-flash")
TOTAL_TOKENS = 16384
BWD_FACTOR = 2.5
FLOPS_CONVENTION = ("fwd = sum over documents of 2 * visible pairs * (d + dv) * num_heads (4*sq*sk*d*h per "
                    "unmasked document; causal: visible pairs counted exactly, L*(L+1)/2); bwd = 2.5 x fwd "
                    "(FlashAttention-2 convention); fwd_bwd = 3.5 x fwd; every backend is credited with these "
                    "useful FLOPs (SDPA computes the padded batch: padded_flops)")

#: name -> (description, sampler(rng) -> one document length)
DISTRIBUTIONS = {
    "docs512": ("uniform [128, 896], mean 512", lambda r: r.randint(128, 896)),
    "docs2048": ("uniform [512, 3584], mean 2048", lambda r: r.randint(512, 3584)),
    "mix": ("1 in 10 long uniform [2048, 6144], else short uniform [16, 256]; one empty document",
            lambda r: r.randint(2048, 6144) if r.random() < 0.1 else r.randint(16, 256)),
}
SMOKE_LENS = [5, 0, 17, 33]


def doc_lengths(dist: str, total: int = TOTAL_TOKENS, seed: int = 0) -> list[int]:
    """Document lengths summing to ``total`` exactly (the last one cut), drawn from
    DISTRIBUTIONS[dist] with a fixed seed; ``mix`` gets an empty document second."""
    if dist == "smoke":
        return list(SMOKE_LENS)
    rng, draw = random.Random(f"{dist}/{seed}"), DISTRIBUTIONS[dist][1]
    lens = []
    while sum(lens) < total:
        lens.append(min(draw(rng), total - sum(lens)))
    if dist == "mix":
        lens.insert(1, 0)
    return lens


def visible_pairs(sq: int, sk: int, causal: bool) -> int:
    """Exact count of the (query, key) pairs one document computes with flashgen's
    mask (bottom-right causal)."""
    import torch

    from flashgen.library import varlen_bounds

    lo, hi = varlen_bounds(sq, sk, -1, 0 if causal else -1)
    i = torch.arange(sq, dtype=torch.int64)  # query i sees keys max(0, i + lo) .. min(sk - 1, i + hi)
    return int((torch.clamp(i + hi, max=sk - 1) - torch.clamp(i + lo, min=0) + 1).clamp(min=0).sum())


def fwd_flops(lens, num_heads: int, d: int, dv: int, causal: bool) -> int:
    return sum(2 * visible_pairs(n, n, causal) * (d + dv) * num_heads for n in lens)


def problems(smoke: bool) -> list[dict]:
    """The problems in run order (most wanted first: a spent budget skips the tail)."""
    if smoke:
        return [dict(dist="smoke", head_dim=16, num_heads=2, num_kv_heads=2, causal=False),
                dict(dist="smoke", head_dim=16, num_heads=4, num_kv_heads=2, causal=True)]
    out = []
    for d in (128, 64):
        out += [dict(dist=dist, head_dim=d, num_heads=16, num_kv_heads=16, causal=c)
                for dist in DISTRIBUTIONS for c in (False, True)]
        if d == 128:
            out += [dict(dist="docs2048", head_dim=128, num_heads=16, num_kv_heads=4, causal=c) for c in (False, True)]
    return out


def label(p: dict) -> str:
    heads = f"h{p['num_heads']}" + (f"/{p['num_kv_heads']}" if p["num_kv_heads"] != p["num_heads"] else "")
    return f"{p['dist']} d{p['head_dim']} {heads}{' causal' if p['causal'] else ''}"


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="varlen_bench.json", help="JSON output path")
    p.add_argument("--budget-s", type=float, default=70.0,
                   help="start no problem once the time spent plus its expected duration exceeds this "
                        "(default 70); expected: the last problem's duration, or the first one's (which compiled) "
                        "when it needs new kernels (head dim, GQA group)")
    p.add_argument("--smoke", action="store_true",
                   help="CPU: Triton's interpreter on tiny documents (float16), wall-clock timing")
    p.add_argument("--backends", default=None,
                   help=f"comma-separated subset of {','.join(BACKENDS)} (default {','.join(DEFAULT_BACKENDS)}; "
                        "smoke adds sdpa-math)")
    p.add_argument("--only", default=None, help="run only the problems whose label contains this string")
    p.add_argument("--dtype", default=None, help="bfloat16 (default) or float16; smoke: float16")
    p.add_argument("--warmup-ms", type=int, default=10)
    p.add_argument("--rep-ms", type=int, default=50)
    return p.parse_args(argv)


def _err(e: BaseException) -> str:
    s = str(e)
    return f"{type(e).__name__}: {s.splitlines()[0][:300] if s else ''}"


def main(argv=None) -> int:
    args = _parse(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    t_start = time.perf_counter()

    import torch
    import triton

    import flashgen
    from flashgen import bench, dispatch, peers
    from flashgen.spec import VARLEN_KERNELS, KernelSpec, ProblemKey

    picked = bench.script_device(args.smoke, args.dtype)
    if picked is None:
        return 2
    device, dtype_name, dtype = picked
    wanted = bench.script_backends(args.backends or ",".join(DEFAULT_BACKENDS), BACKENDS)
    if wanted is None:
        return 2
    if args.smoke and args.backends is None:
        wanted.append("sdpa-math")
    todo = [p for p in problems(args.smoke) if args.only is None or args.only in label(p)]

    meta = {"device": torch.cuda.get_device_name() if device == "cuda" else f"cpu ({platform.processor()})",
            "interpreter": bool(args.smoke), "torch": torch.__version__, "flashgen": flashgen.__version__,
            "triton": triton.__version__, "python": platform.python_version(), "dtype": dtype_name,
            "budget_s": args.budget_s,
            "total_tokens": TOTAL_TOKENS if not args.smoke else sum(SMOKE_LENS),
            "distributions": {k: v[0] for k, v in DISTRIBUTIONS.items()} if not args.smoke else {"smoke": SMOKE_LENS},
            "flops": FLOPS_CONVENTION, "backward_factor": BWD_FACTOR,
            "timing": ("triton.testing.do_bench median (L2 flushed)" if device == "cuda" else "wall clock median of 3")
            + "; fwd: forward of a training step (inputs require grad" + ("" if device == "cuda" else
                                                                          ", except on the CPU: no grad")
            + "); fwd_bwd: forward + torch.autograd.grad(O, (q, k, v), dO)",
            "flashgen_call": "flashgen.attention_varlen (public call: cu_seqlens checked on the host, one sync per call, "
                        "included)",
            "flex": ("flex_attention compiled (torch.compile dynamic=True, as flashgen.peers); " if device == "cuda"
                     else "flex_attention eager (unfused; CPU smoke); ")
            + "one batch-1 sequence with a document mask_mod (same document id, q_idx >= kv_idx when causal) "
              "from create_block_mask; block mask build and first call (compile) excluded from timing",
            "sdpa": "padded dense batch (non-empty documents, padded to the longest): SDPA computes the padded work "
                    "(padded_flops) but its TFLOP/s are on the useful FLOPs; causal via is_causal (exact on real "
                    "rows); not causal via a key-padding attn_mask where the backend takes one, else unmasked "
                    "(exact: false, padded keys attended)",
            "check": "max error vs the per-document float64 reference <= 2 x torch's error at the input dtype + "
                     f"floor {bench.FLOOR[dtype]:g} (LSE: {bench.FLOOR[torch.float32]:g}); ratio <= 1 passes"}
    results: list[dict] = []

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def save():
        with open(args.out, "w") as f:
            json.dump({"meta": {**meta, "wall_s": round(time.perf_counter() - t_start, 1)}, "rows": results}, f,
                      indent=1, default=str)

    last_s, first_s, compiled = 0.0, 0.0, set()
    for prob in todo:
        d, h, hk, causal = prob["head_dim"], prob["num_heads"], prob["num_kv_heads"], prob["causal"]
        lens = doc_lengths(prob["dist"])
        nz = [n for n in lens if n]
        flops = fwd_flops(lens, h, d, d, causal)
        rec = {"label": label(prob), **prob, "dtype": dtype_name, "n_docs": len(lens), "max_len": max(lens),
               "mean_len": sum(lens) / len(lens), "lens": lens, "fwd_flops": flops,
               "fwd_bwd_flops": flops * (1 + BWD_FACTOR),
               "padded_flops": len(nz) * 2 * visible_pairs(max(lens), max(lens), causal) * 2 * d * h,
               "results": {}, "checks": {}}
        results.append(rec)
        elapsed = time.perf_counter() - t_start
        kernels = (d, h // hk, causal)  # needing new kernels (compiles): expected to cost the first one's time
        expect = last_s if kernels in compiled else max(last_s, first_s)
        if elapsed + expect > args.budget_s:
            rec["skipped"] = f"time budget ({args.budget_s:.0f} s): {elapsed:.0f} s spent, this problem is " \
                             f"expected to take {expect:.0f} s"
            print(f"[{elapsed:6.1f} s] {rec['label']}: skipped ({rec['skipped']})", flush=True)
            save()
            continue
        t_prob = time.perf_counter()
        print(f"[{elapsed:6.1f} s] {rec['label']}: {len(lens)} docs (max {max(lens)}), "
              f"{flops / 1e9:.1f} GFLOP fwd", flush=True)
        scale = d ** -0.5
        spec = KernelSpec("fwd_varlen", dtype_name, d, d, "causal" if causal else "none")
        q, k, v, do, cu, _, mx, _ = bench.make_varlen_inputs(spec, lens, lens, h, hk, device=device, seed=0)
        ref_kw = dict(softmax_scale=scale, win_left=-1, win_right=0 if causal else -1)

        def check(name, packed_fn, grads=True, extra=None):
            """Outputs of ``packed_fn(q, k, v) -> O`` (packed, differentiable) against the
            float64 reference; recorded under ``name``."""
            qc, kc, vc = (t.detach().requires_grad_(grads) for t in (q, k, v))
            o = packed_fn(qc, kc, vc)
            outs = {"O": o.detach(), **(extra or {})}
            if grads:
                outs.update(zip(("dQ", "dK", "dV"), torch.autograd.grad(o, (qc, kc, vc), do)))
            res = bench.compare_varlen(outs, q, k, v, do, cu, cu, kw=ref_kw)
            worst = max(r[2] for r in res.values())
            rec["checks"][name] = {"ok": worst <= 1.0, "ratio": worst, "outputs": {
                n: {"max_err": e, "torch_err": b, "ratio": r} for n, (e, b, r) in res.items()}}
            print(f"    check {name:<11} {'ok  ' if worst <= 1.0 else 'FAIL'} ratio {worst:.3f}: " + ", ".join(
                f"{n} {e:.2g} (torch {b:.2g})" for n, (e, b, _) in res.items()), flush=True)

        def timed(name, fn, inputs, grad_inputs, do_):
            """fwd and fwd_bwd of ``fn(q, k, v)`` on pre-laid-out inputs, in ms and TFLOP/s."""
            entry = rec["results"].setdefault(name, {})
            runs = (("fwd", lambda: fn(*inputs), flops),
                    ("fwd_bwd", lambda: torch.autograd.grad(fn(*grad_inputs), grad_inputs, do_),
                     flops * (1 + BWD_FACTOR)))
            for kind, f, n in runs:
                try:
                    ms = bench.script_time_ms(f, device == "cuda", args.warmup_ms, args.rep_ms)
                    entry[f"{kind}_ms"], entry[f"{kind}_tflops"] = ms, n / (ms * 1e-3) / 1e12
                except Exception as e:  # noqa: BLE001 - a backend that fails is a value
                    entry[f"{kind}_error"] = _err(e)
                    if os.environ.get("VARLEN_BENCH_TRACE"):
                        traceback.print_exc()

        def first_call(name, fn, inputs) -> bool:
            """Run once (compile, autotune); False (error recorded) when it raises."""
            entry = rec["results"].setdefault(name, {})
            try:
                t0 = time.perf_counter()
                fn(*inputs)
                sync()
                entry["first_call_s"] = round(time.perf_counter() - t0, 3)
                return True
            except Exception as e:  # noqa: BLE001
                entry["error"] = _err(e)
                if os.environ.get("VARLEN_BENCH_TRACE"):
                    traceback.print_exc()
                return False

        def grad_copies(*ts):
            return tuple(t.detach().clone().requires_grad_() for t in ts)

        def fwd_inputs(ts):  # the forward of a training step; on the CPU without grad (Flex has no CPU backward)
            return ts if device == "cuda" else tuple(t.detach() for t in ts)

        # -- flashgen ------------------------------------------------------------------
        if "flashgen" in wanted:
            disp = dispatch.default_dispatcher()
            entry = rec["results"].setdefault("flashgen", {"configs": {}})
            for kern in VARLEN_KERNELS:
                key = ProblemKey.from_varlen_sizes(KernelSpec(kern, dtype_name, d, d, spec.mask), batch=len(lens),
                                                   num_heads=h, num_kv_heads=hk, max_seqlen_q=mx, max_seqlen_k=mx)
                if kern == "bwd_dq_varlen":  # the backward as the op runs it: a whole backward or two kernels
                    plan = disp.backward(key, deterministic=torch.are_deterministic_algorithms_enabled(),
                                         capturing=False)
                    entry["configs"]["backward"] = {"family": plan.family, "reason": plan.reason, "kernels": [
                        {"key": c.key.id, "config": c.config.id, "source": c.source} for c in plan.choices]}
                if kern != "fwd_varlen":
                    continue
                c = disp.choose(key, capturing=False)
                entry["configs"][kern] = {"key": key.id, "config": c.config.id, "source": c.source}

            def fg(q_, k_, v_, **kw):
                return flashgen.attention_varlen(q_, k_, v_, cu, cu, mx, mx, causal=causal, softmax_scale=scale, **kw)

            g = grad_copies(q, k, v)
            if first_call("flashgen", fg, g):
                try:
                    lse = fg(q, k, v, return_lse=True)[1]
                    check("flashgen", fg, extra={"LSE": lse})
                except Exception as e:  # noqa: BLE001
                    rec["checks"]["flashgen"] = {"ok": False, "error": _err(e)}
                timed("flashgen", fg, fwd_inputs(g), g, do)
            del g

        # -- FlexAttention: one batch-1 sequence, document mask -------------------------
        if "flex" in wanted:
            entry = rec["results"].setdefault("flex", {})

            def to_flex(t):  # packed (tokens, heads, d) -> (1, heads, tokens, d)
                return t.transpose(0, 1).unsqueeze(0).contiguous()
            try:
                doc_ids = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)).to(device)
                t0 = time.perf_counter()
                fx = peers.flex_document(to_flex(q), to_flex(k), doc_ids, causal=causal, softmax_scale=scale,
                                         compiled=device == "cuda")
                sync()
                entry["block_mask_s"] = round(time.perf_counter() - t0, 3)
            except Exception as e:  # noqa: BLE001
                entry["error"] = _err(e)
                fx = None
            if fx is not None:
                g = grad_copies(*(to_flex(t) for t in (q, k, v)))
                if first_call("flex", fx, fwd_inputs(g)):
                    try:
                        check("flex", lambda q_, k_, v_: fx(to_flex(q_), to_flex(k_), to_flex(v_))[0].transpose(0, 1),
                              grads=device == "cuda")
                    except Exception as e:  # noqa: BLE001
                        rec["checks"]["flex"] = {"ok": False, "error": _err(e)}
                    timed("flex", fx, fwd_inputs(g), g, to_flex(do))
                del g, fx

        # -- SDPA on the padded batch -----------------------------------------------------
        sdpa_names = [n for n in wanted if n.startswith("sdpa-")]
        if sdpa_names:
            L, b = max(lens), len(nz)
            valid = torch.arange(L, device=device)[None, :] < torch.tensor(nz, device=device)[:, None]

            def pad(t):  # packed (tokens, heads, d) -> (docs, heads, L, d), zeros past each document
                parts = [p for p in t.split(lens) if p.shape[0]]
                return torch.nn.utils.rnn.pad_sequence(parts, batch_first=True).transpose(1, 2).contiguous()

            def unpad(o):
                return o.transpose(1, 2)[valid]

            need = 2 * b * L * (4 * h + 4 * hk) * d * torch.finfo(dtype).bits // 8  # q o do dq, k v dk dv (+ copies)
            free = torch.cuda.mem_get_info()[0] if device == "cuda" else None
            for name in sdpa_names:
                entry = rec["results"].setdefault(name, {})
                if name == "sdpa-cudnn" and device != "cuda":
                    entry["error"] = "Unsupported: the cuDNN backend runs on CUDA only"
                    continue
                if free is not None and need > 0.6 * free:
                    entry["error"] = peers.Unsupported.__name__ + f": the padded batch ({b} x {L} tokens) needs " \
                                                                  f"~{need / 2**30:.1f} GiB, {free / 2**30:.1f} free"
                    continue
                g = grad_copies(pad(q), pad(k), pad(v))
                fn = peers.sdpa_padded(name, g[0], g[1], nz, causal=causal, softmax_scale=scale)
                entry["exact"] = True
                if not causal:  # a backend that refuses the key-padding mask: the padded work, unmasked
                    fn, refused = _mask_or_unmasked(fn, lambda: peers.sdpa_padded(
                        name, g[0], g[1], nz, causal=False, softmax_scale=scale, key_mask=False), g)
                    if refused:
                        entry.update(exact=False, mask_refused=refused)
                if first_call(name, fn, g):
                    if entry["exact"]:
                        try:
                            check(name, lambda q_, k_, v_: unpad(fn(pad(q_), pad(k_), pad(v_))))
                        except Exception as e:  # noqa: BLE001
                            rec["checks"][name] = {"ok": False, "error": _err(e)}
                    timed(name, fn, fwd_inputs(g), g, pad(do))
                del g, fn

        for name in ("fwd", "fwd_bwd"):
            fgt = rec["results"].get("flashgen", {}).get(f"{name}_tflops")
            for peer in (p for p in wanted if p != "flashgen"):
                pt = rec["results"].get(peer, {}).get(f"{name}_tflops")
                if fgt and pt:
                    rec.setdefault("ratios", {})[f"flashgen/{peer} {name}"] = fgt / pt
        del q, k, v, do
        if device == "cuda":
            torch.cuda.empty_cache()
        last_s = time.perf_counter() - t_prob
        first_s = first_s or last_s
        compiled.add(kernels)
        rec["wall_s"] = round(last_s, 1)
        save()

    meta["wall_s"] = round(time.perf_counter() - t_start, 1)
    save()
    _table(results, wanted)
    failed = [r["label"] for r in results if "skipped" not in r and "flashgen" in wanted and (
        not r["checks"].get("flashgen", {}).get("ok") or any(k.endswith("error") for k in r["results"]["flashgen"]))]
    others = [(r["label"], n) for r in results for n, c in r["checks"].items() if n != "flashgen" and not c["ok"]]
    print(f"wrote {args.out}; {sum('skipped' not in r for r in results)}/{len(results)} problems measured in "
          f"{time.perf_counter() - t_start:.0f} s; flashgen: "
          + (f"FAILED (check or error) on {failed}" if failed else "all checks ok")
          + (f"; peers' checks failed: {others}" if others else ""))
    return 1 if failed else 0


def _mask_or_unmasked(fn, unmasked, inputs):
    """(fn, None) when ``fn`` runs on ``inputs`` or when ``unmasked()``'s fn fails too (the
    first call then reports fn's error); (unmasked fn, fn's refusal) otherwise."""
    try:
        fn(*inputs)
        return fn, None
    except RuntimeError as e:
        refused = str(e)[:300]
    fn2 = unmasked()
    try:
        fn2(*inputs)
    except RuntimeError:
        return fn, None
    return fn2, refused


def _table(results, wanted):
    ratio = "flashgen" in wanted and "flex" in wanted
    print()
    print("TFLOP/s on useful FLOPs, fwd|fwd+bwd (bwd = 2.5 x fwd); SDPA computes the padded batch; fg/flex: "
          "flashgen's TFLOP/s over Flex's; * : SDPA unmasked (not exact); - : not run; x : failed (see JSON)")
    print(f"{'problem':<30}" + "".join(f"{c:>16}" for c in wanted) + (f"{'fg/flex':>16}" if ratio else ""))

    def cell(x, kind):
        v = None if x is None else x.get(f"{kind}_tflops")
        if v is None:
            return "-" if x is None else "x"
        return (f"{v:.1f}" if v >= 1 else f"{v:.2g}") + ("" if x.get("exact", True) else "*")

    for r in results:
        if "skipped" in r:
            print(f"{r['label']:<30}skipped")
            continue
        cells = ["|".join(cell(r["results"].get(c), k) for k in ("fwd", "fwd_bwd")) for c in wanted]
        if ratio:
            rat = r.get("ratios", {})
            cells.append("|".join(f"{rat[f'flashgen/flex {k}']:.2f}" if f"flashgen/flex {k}" in rat else "-"
                                  for k in ("fwd", "fwd_bwd")))
        print(f"{r['label']:<30}" + "".join(f"{c:>16}" for c in cells))


if __name__ == "__main__":
    sys.exit(main())

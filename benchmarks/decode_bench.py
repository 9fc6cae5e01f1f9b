"""Decode with a KV cache on the GPU: flashgen's split-KV kernels (flash-decoding) against
torch SDPA's backends, FlexAttention and a device-to-device copy of the same bytes.

For each shape of the ``decode`` preset (bf16, Llama-3-8B heads 32/8, d 128; batch 1, 8,
32; caches of 4k, 32k and 128k tokens, all full; seqlen_q 1, and 4 causal) it times
(triton.testing.do_bench, median ms, L2 flushed between repetitions):

* ``flashgen``: the decode kernels (split + combine) with the tuned config (FLASHGEN_DB /
  shipped DBs; the dispatcher's source is recorded: tuned, nearest or default), timed
  through the launcher on preallocated outputs; ``api_ms`` is the public
  ``flashgen.attention_with_kvcache`` call (checks, dispatch, allocation), whose output
  is the one checked;
* ``flashgen-default``: the same with the heuristic default (no database);
* ``flashgen-paged`` / ``flashgen-paged-default``: the paged cache (page size 64, pages
  shuffled in the pool) where the preset lists it;
* ``flashgen-attention``: the dense op ``flashgen.attention`` on the (b, h, s, d) views of
  the contiguous cache (what a model calls), which runs these shapes in its
  flash-decoding form (``library.decode_form``: the decode kernels); checked;
* ``flashgen-attention-tiles``: the same call with the flash-decoding form off
  (``library.DECODE_FORM_RULES`` empty, its own dispatcher): the forward kernels' tiles,
  one program per (batch, head, query block); checked;
* ``sdpa-flash``, ``sdpa-cudnn``, ``sdpa-efficient``: torch SDPA restricted to one backend
  (``torch.nn.attention.sdpa_kernel``) on the contiguous cache viewed as (b, h, s, d)
  (enable_gqa; bottom-right causal via ``causal_lower_right``); every cache is full, so
  no per-batch lengths are needed; a backend that refuses is reported with its reason;
* ``flex``: compiled ``flex_attention`` with a ``mask_mod`` reading cache_seqlens (and
  the bottom-right diagonal when causal), where it runs;
* ``copy``: ``dst.copy_(src)`` of as many bytes as K and V hold (the bandwidth ceiling:
  its bandwidth counts read + write).

Achieved HBM bandwidth = bytes of K and V actually read (cache_seqlens tokens x kv heads
x (d + dv) x 2 bytes) / time, in GB/s and as % of the copy's bandwidth.  flashgen's
output (both configs, both cache kinds) is checked against the float64 reference (max
error <= 2x torch's bf16 error + floor).  JSON goes to --out (rewritten after every
shape, so a run cut short keeps what it measured); a short table is printed last.

    PYTHONPATH=$PWD python3 benchmarks/decode_bench.py --out decode.json     # GPU
    PYTHONPATH=$PWD python3 benchmarks/decode_bench.py --smoke --out /tmp/d.json  # CPU, interpreter
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
import traceback

BACKENDS = ("flashgen", "flashgen-default", "flashgen-paged", "flashgen-paged-default", "flashgen-attention",
            "flashgen-attention-tiles", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "flex", "copy")


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="decode_bench.json", help="JSON output path")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="stop starting new shapes after this many seconds (default 420)")
    p.add_argument("--smoke", action="store_true",
                   help="CPU: Triton's interpreter on the tiny decode-small preset (float16), wall-clock timing")
    p.add_argument("--backends", default=",".join(BACKENDS), help=f"comma-separated subset of {','.join(BACKENDS)}")
    p.add_argument("--preset", default=None, help="flashgen preset of decode shapes (default: decode; smoke: "
                                                  "decode-small)")
    p.add_argument("--dtype", default=None, help="bfloat16 (default) or float16; smoke: float16")
    p.add_argument("--page-size", type=int, default=None, help="page size of the paged cache (default: the "
                                                               "preset's, 64)")
    p.add_argument("--warmup-ms", type=int, default=25)
    p.add_argument("--rep-ms", type=int, default=100)
    p.add_argument("--no-check", action="store_true", help="skip the float64 checks")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    t_start = time.perf_counter()

    import torch

    import flashgen
    from flashgen import bench, dispatch, library, presets, reference
    from flashgen.dispatch import Dispatcher
    from flashgen.masks import decode_mask
    from flashgen.spec import KernelSpec, ProblemKey, Variant

    picked = bench.script_device(args.smoke, args.dtype)
    if picked is None:
        return 2
    device, dtype_name, dtype = picked
    preset = args.preset or ("decode-small" if args.smoke else "decode")
    page_size = args.page_size or (16 if args.smoke else presets.DECODE_PAGE_SIZE)
    wanted = bench.script_backends(args.backends, BACKENDS)
    if wanted is None:
        return 2
    if args.smoke and "flex" in wanted and args.backends == ",".join(BACKENDS):
        wanted.remove("flex")  # torch.compile on CPU takes minutes: only when asked for

    # One row per (shape, mask): the contiguous and paged kernels of the same shape share it.
    rows: dict[tuple, dict] = {}
    for key, shape in presets.expand([preset], dtype_name):
        r = rows.setdefault((shape, key.spec.mask), {"shape": shape, "mask": key.spec.mask, "head_dim": key.spec.head_dim,
                                                     "kernels": []})
        r["kernels"].append(key.spec.kernel)

    meta = {"device": torch.cuda.get_device_name() if device == "cuda" else f"cpu ({platform.processor()})",
            "interpreter": bool(args.smoke), "torch": torch.__version__, "flashgen": flashgen.__version__,
            "dtype": dtype_name, "preset": preset, "page_size": page_size, "budget_s": args.budget_s,
            "timing": "triton.testing.do_bench median (L2 flushed)" if device == "cuda" else "wall clock median",
            "bandwidth": "bytes of K and V read (cache_seqlens tokens) / time; copy counts read + write"}
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:  # pragma: no cover
        pass
    results = []
    default_disp = Dispatcher(databases=[])
    tuned_disp = dispatch.default_dispatcher()
    # the dense op without its flash-decoding form: a dispatcher of its own, so no call
    # memoized with the form on answers a call with it off
    tiles_disp = Dispatcher(databases=tuned_disp.databases())

    def time_ms(fn) -> float:
        return bench.script_time_ms(fn, device == "cuda", args.warmup_ms, args.rep_ms)

    def save():
        with open(args.out, "w") as f:
            json.dump({"meta": {**meta, "wall_s": round(time.perf_counter() - t_start, 1)}, "rows": results}, f,
                      indent=1, default=str)

    for (shape, mask), row in rows.items():
        b, h, hk, sq, n, d = shape.batch, shape.num_heads, shape.num_kv_heads, shape.seqlen_q, shape.seqlen_k, row["head_dim"]
        causal = mask == "causal"
        rec = {"batch": b, "num_heads": h, "num_kv_heads": hk, "seqlen_q": sq, "cache_len": n, "head_dim": d,
               "causal": causal, "dtype": dtype_name, "kernels": row["kernels"], "results": {}, "checks": {}}
        results.append(rec)
        elapsed = time.perf_counter() - t_start
        if elapsed > args.budget_s:
            rec["skipped"] = f"time budget ({args.budget_s:.0f} s) spent after {elapsed:.0f} s"
            save()
            continue
        nbytes = bench.decode_bytes(KernelSpec("decode", dtype_name, d, d, "none"), hk, [n] * b)
        rec["kv_bytes_read"] = nbytes
        label = f"b{b} sq{sq} cache{n} {'causal' if causal else 'none'}"
        print(f"[{time.perf_counter() - t_start:6.1f} s] {label}: {nbytes / 1e9:.3f} GB of K+V", flush=True)
        try:
            g = torch.Generator(device=device).manual_seed(0)
            q = torch.randn(b, sq, h, d, device=device, dtype=dtype, generator=g)
            kc = torch.randn(b, n, hk, d, device=device, dtype=dtype, generator=g)
            vc = torch.randn(b, n, hk, d, device=device, dtype=dtype, generator=g)
            lens = torch.full((b,), n, dtype=torch.int32, device=device)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory: the row says so
            rec["error"] = f"inputs: {type(e).__name__}: {str(e)[:300]}"
            save()
            continue

        def record(name, fn, out_check=None, extra=None, api_fn=None):
            if name not in wanted:
                return
            entry = dict(extra or {})
            try:
                ms = time_ms(fn)
                gbps = nbytes / (ms * 1e-3) / 1e9
                entry.update(ms=ms, gbps=gbps)
                if api_fn is not None:
                    entry["api_ms"] = time_ms(api_fn)
                if out_check is not None and not args.no_check:
                    rec["checks"][name] = out_check()
            except Exception as e:  # noqa: BLE001 - a backend that fails is a value
                entry["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                if os.environ.get("DECODE_BENCH_TRACE"):
                    traceback.print_exc()
            rec["results"][name] = entry

        refs = {}

        def check(o):
            """O vs the float64 reference of the contiguous cache (the paged cache holds the
            same keys), computed once per shape."""
            if not refs:
                kw = dict(causal=causal, softmax_scale=d ** -0.5)
                refs["64"] = reference.decode_forward(q, kc, vc, lens, **kw)[0]
                base = reference.decode_forward(q, kc, vc, lens, dtype=dtype, **kw)[0]
                refs["base_err"] = reference.max_error(base, refs["64"])
                del base
            err = reference.max_error(o, refs["64"])
            ratio = err / (2 * refs["base_err"] + bench.FLOOR[dtype])
            return {"ok": ratio <= 1.0, "ratio": ratio, "max_abs_err": err, "torch_dtype_err": refs["base_err"]}

        def flashgen_fn(disp, k_, v_, bt_):
            def fn():
                prev = dispatch._default
                dispatch.set_default_dispatcher(disp)
                try:
                    return flashgen.attention_with_kvcache(q, k_, v_, lens, block_table=bt_, causal=causal)
                finally:
                    dispatch.set_default_dispatcher(prev)
            return fn

        def choice(disp, kernel):
            spec = KernelSpec(kernel, dtype_name, d, d, decode_mask(causal, sq))
            key = ProblemKey.from_sizes(spec, batch=b, num_heads=h, num_kv_heads=hk, seqlen_q=sq, seqlen_k=n)
            c = disp.choose(key, capturing=False)
            return Variant(spec, c.config), {"key": key.id, "config": c.config.id, "source": c.source}

        caches = [("flashgen", "decode", kc, vc, None)]
        if "decode_paged" in row["kernels"] and any(x.startswith("flashgen-paged") for x in wanted):
            try:
                pages = -(-n // page_size)
                pad = pages * page_size - n
                perm = torch.randperm(b * pages, generator=torch.Generator().manual_seed(1)).to(device)
                inv = torch.empty_like(perm)
                inv[perm] = torch.arange(perm.numel(), device=device)

                def pool(c):
                    if pad:
                        c = torch.cat([c, c.new_zeros((b, pad, hk, d))], 1)
                    return c.reshape(b * pages, page_size, hk, d)[perm]
                caches.append(("flashgen-paged", "decode_paged", pool(kc), pool(vc),
                               inv.reshape(b, pages).to(torch.int32)))
            except Exception as e:  # noqa: BLE001
                rec["results"]["flashgen-paged"] = {"error": f"paged inputs: {type(e).__name__}: {str(e)[:200]}"}
        for name, kernel, k_, v_, bt_ in caches:
            for suffix, disp in (("", tuned_disp), ("-default", default_disp)):
                # timed: the launcher on preallocated outputs (the kernels' GPU time);
                # api_ms: the public call (checks, dispatch, allocation); checked: its output
                try:
                    variant, info = choice(disp, kernel)
                    fn, _ = bench.run_variant_decode(variant, q, k_, v_, lens, bt_)
                except Exception as e:  # noqa: BLE001
                    rec["results"][name + suffix] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                    continue
                api = flashgen_fn(disp, k_, v_, bt_)
                record(name + suffix, fn, out_check=lambda api=api: check(api()), extra=info, api_fn=api)
        del caches
        refs.clear()
        if device == "cuda":
            torch.cuda.empty_cache()

        # torch SDPA on the (b, h, s, d) views of the contiguous cache
        from flashgen import peers

        qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
        for name, rules, disp in (("flashgen-attention", library.DECODE_FORM_RULES, tuned_disp),
                                  ("flashgen-attention-tiles", (), tiles_disp)):
            def dense(rules=rules, disp=disp):
                keep, prev = library.DECODE_FORM_RULES, dispatch._default
                library.DECODE_FORM_RULES = rules
                dispatch.set_default_dispatcher(disp)
                try:
                    return flashgen.attention(qt, kt, vt, causal=causal)
                finally:
                    library.DECODE_FORM_RULES = keep
                    dispatch.set_default_dispatcher(prev)
            record(name, dense, out_check=lambda dense=dense: check(dense().transpose(1, 2)))
        for name in ("sdpa-flash", "sdpa-cudnn", "sdpa-efficient"):
            if name in wanted:
                fn_ = peers.sdpa(name, qt, kt, causal=causal, softmax_scale=d ** -0.5)
                record(name, lambda fn_=fn_: fn_(qt, kt, vt))
        if "flex" in wanted:
            try:
                fn_ = _flex_fn(qt, kt, vt, lens, causal, d ** -0.5)
                record("flex", fn_)
            except Exception as e:  # noqa: BLE001
                rec["results"]["flex"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
        if "copy" in wanted:
            try:
                src = torch.empty(nbytes, dtype=torch.uint8, device=device)
                dst = torch.empty_like(src)
                record("copy", lambda: dst.copy_(src))
                c = rec["results"]["copy"]
                if "ms" in c:
                    c["gbps"] = 2 * nbytes / (c["ms"] * 1e-3) / 1e9  # read + write
                del src, dst
            except Exception as e:  # noqa: BLE001
                rec["results"]["copy"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        copy_gbps = rec["results"].get("copy", {}).get("gbps")
        for name, r in rec["results"].items():
            if name != "copy" and copy_gbps and "gbps" in r:
                r["pct_of_copy"] = 100.0 * r["gbps"] / copy_gbps
        del q, kc, vc, qt, kt, vt
        if device == "cuda":
            torch.cuda.empty_cache()
        save()

    save()
    _table(results, wanted)
    bad = [(r["batch"], r["seqlen_q"], r["cache_len"], name) for r in results for name, c in r["checks"].items()
           if not c["ok"]]
    print(f"wrote {args.out}; {sum('skipped' not in r for r in results)}/{len(results)} shapes measured in "
          f"{time.perf_counter() - t_start:.0f} s; float64 checks: "
          f"{sum(len(r['checks']) for r in results) - len(bad)} ok, {len(bad)} failed {bad if bad else ''}")
    return 1 if bad else 0


_flex_compiled = None
#: What the mask_mod reads (module-level tensors: one compiled graph serves every shape).
_flex_state: dict = {}


def _flex_mask(b, h, q_idx, kv_idx):
    """Key kv_idx is in batch b's cache and, causal, at or below query q_idx's diagonal
    (diag[b] = cache_seqlens[b] - seqlen_q; cache_seqlens[b] when not causal)."""
    return (kv_idx < _flex_state["lens"][b]) & (kv_idx <= q_idx + _flex_state["diag"][b])


def _flex_fn(q, k, v, lens, causal: bool, scale: float):
    """Compiled flex_attention on (b, h, s, d) views, its mask_mod reading cache_seqlens."""
    global _flex_compiled
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if _flex_compiled is None:
        import torch._dynamo

        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        _flex_compiled = torch.compile(flex_attention, dynamic=True)
    sq, n = q.shape[2], k.shape[2]
    _flex_state["lens"] = lens
    _flex_state["diag"] = (lens - sq) if causal else lens
    bm = create_block_mask(_flex_mask, B=q.shape[0], H=None, Q_LEN=sq, KV_LEN=n, device=q.device)
    gqa = q.shape[1] != k.shape[1]

    def fn():
        return _flex_compiled(q, k, v, block_mask=bm, scale=scale, enable_gqa=gqa)
    return fn


def _table(results, wanted):
    cols = [c for c in BACKENDS if c in wanted]
    head = f"{'shape':<28}" + "".join(f" {c:>25}" for c in cols)
    print()
    print("median ms | achieved GB/s | % of copy bandwidth   (- : not run; x : failed, see JSON)")
    print(head)
    for r in results:
        n = r["cache_len"]
        name = f"b{r['batch']} q{r['seqlen_q']} k{f'{n // 1024}k' if n >= 1024 else n}{' c' if r['causal'] else ''}"
        if "skipped" in r or "error" in r:
            print(f"{name:<28}{r.get('skipped') or r.get('error')}")
            continue
        cells = []
        for c in cols:
            x = r["results"].get(c)
            if x is None:
                cells.append("-")
            elif "ms" not in x:
                cells.append("x")
            else:
                pct = x.get("pct_of_copy")
                cells.append(f"{x['ms']:.4f}|{x['gbps']:.0f}" + (f"|{pct:.0f}%" if pct is not None and
                                                                 math.isfinite(pct) else ""))
        print(f"{name:<28}" + "".join(f" {c:>25}" for c in cells))


if __name__ == "__main__":
    sys.exit(main())

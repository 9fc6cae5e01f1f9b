"""A real client on the GPU: transformers' LlamaForCausalLM (random weights, bf16) with
attention from transformers' ``sdpa`` implementation and from flashgen's
(``flashgen.integrations.transformers.register()``), one model per configuration, the
two implementations switched with ``model.set_attn_implementation`` on the same weights;
on request (``--configs gptoss``) a GptOssForCausalLM against its ``eager`` attention
(gpt-oss's attention sinks; transformers gives it no sdpa).

Configurations (hidden, heads / kv heads, layers, batch x tokens; head_dim 128;
intermediate size and vocabulary recorded in the JSON):

* ``h2048``: 2048, 16 / 4, 8 layers, 4 x 2048 (intermediate 5632, vocab 32000);
* ``h4096``: 4096, 32 / 8, 4 layers, 2 x 4096 (intermediate 14336, vocab 32000);
* ``gptoss`` (not run by default): gpt-oss-20b's attention (hidden 2880, 64 / 8 heads,
  head_dim 64, sinks, layers alternating sliding window 128 and full), 4 layers, 4 x
  2048, with 4 experts (top 2) of intermediate 2880 instead of 32 (vocab 32000); the
  reference is transformers' ``eager`` attention.

For each configuration and implementation:

* check: from the same weights and batch, one forward + backward (training mode, no
  dropout); the loss must agree with the reference's (sdpa; eager for gpt-oss) to 2e-3
  relative, and the gradients are compared per parameter (relative L2 error
  ||g - g_ref|| / ||g_ref||; worst and median over parameters, and over all parameters
  flattened; ``grad_rel_l2``, printed).  Two correct bf16 attentions differ from each
  other by up to the sum of their errors, so the rule is the exactness rule against the
  float32 model (the reference attention, same weights and batch; a bf16 run's
  ``grad_rel_l2_vs_float32``): ``grads_ok`` when flashgen's flattened error is <= 2x the
  bf16 reference's + 2e-3.  gpt-oss routes tokens to experts, so a last-bit difference
  in attention flips routes and two correct bf16 runs differ far more: there the floor
  is 2e-2;
* train step: zero_grad, forward with labels, backward, AdamW step (foreach, lr 1e-5);
  ``--warmup`` steps, then ``--steps`` steps each timed with CUDA events: median ms
  (the weights are restored from the same copy before each implementation's run);
* prefill: forward only under ``torch.no_grad()``, eval mode, ``use_cache=False``,
  logits of the last position only (``logits_to_keep=1``): median ms, and on a GPU the
  median ms until the forward call returned on the host (``prefill_host_ms``; near the
  event time, the prefill waits on the host);
* decode (Llama configurations without ``--padding`` or ``--packed``): after a prefill of
  the batch into a ``DynamicCache``, one generation step per call (one new token per batch
  entry over the cache of ``tokens`` keys, the cache cropped back after each step, so
  every step sees the same length): median ms; attention then gets one query row per
  head, which flashgen runs in its flash-decoding form (``library.decode_form``).  The
  first step's logits against the reference's: ``decode_logits_rel_l2`` (relative L2).

Ratios are flashgen / reference time (below 1: flashgen faster).  JSON goes to --out
(rewritten after each configuration); a table is printed last.  Needs a CUDA GPU, torch,
triton, transformers, and flashgen's runtime dependencies (jinja2; sqlite-utils, read
when the dispatcher opens the shipped tuning database).

    PYTHONPATH=$PWD python3 benchmarks/transformers_step.py --out transformers_step.json
    PYTHONPATH=$PWD python3 benchmarks/transformers_step.py --configs gptoss --out gptoss_step.json
    PYTHONPATH=$PWD python3 benchmarks/transformers_step.py --configs gptoss --padding 256 --out gptoss_pad.json
    PYTHONPATH=$PWD python3 benchmarks/transformers_step.py --packed 8 --out packed_step.json   # padding-free
    PYTHONPATH=$PWD python3 benchmarks/transformers_step.py --gaps --steps 3 --out gaps.json   # idle GPU time
    PYTHONPATH=$PWD python3 benchmarks/transformers_step.py --smoke --out /tmp/t.json   # CPU, interpreter
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

CONFIGS = {
    # name: (hidden, heads, kv_heads, layers, batch, tokens, intermediate, vocab)
    "h2048": (2048, 16, 4, 8, 4, 2048, 5632, 32000),
    "h4096": (4096, 32, 8, 4, 2, 4096, 14336, 32000),
    "gptoss": (2880, 64, 8, 4, 4, 2048, 2880, 32000),
}
DEFAULT_CONFIGS = ("h2048", "h4096")
# --smoke (CPU, Triton's interpreter, float32): tiny models that show the script's paths
SMOKE = {"smoke": (64, 4, 2, 2, 2, 32, 128, 256), "smoke_gptoss": (64, 4, 2, 2, 2, 32, 32, 256)}
GPT_OSS = {"gptoss", "smoke_gptoss"}  # GptOssConfig, reference "eager"; the others LlamaConfig and "sdpa"

LOSS_RTOL = 2e-3
GRAD_RTOL = 2e-2
#: The floor of the gradients' rule against the float32 model (dense models).
GRAD_FLOOR_VS_FLOAT32 = 2e-3


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="transformers_step.json", help="JSON output path")
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help=f"comma-separated subset of {','.join(CONFIGS)}")
    p.add_argument("--steps", type=int, default=10, help="timed train steps / prefills per implementation")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compiles flashgen's kernels)")
    p.add_argument("--profile", action="store_true",
                   help="also profile one train step and one prefill per implementation: GPU time per kernel "
                        "name (JSON step_kernels, prefill_kernels) and a table of the kernels whose time differs "
                        "most")
    p.add_argument("--gaps", action="store_true",
                   help="also trace one train step and one prefill per implementation on the host and the GPU "
                        "(torch.profiler with Python stacks): the GPU's idle time between kernels, and for each "
                        "idle gap the kernel that ended it and the Python frame that launched it (JSON step_gaps, "
                        "prefill_gaps; a table per configuration)")
    p.add_argument("--padding", type=int, default=0,
                   help="left-pad every other batch entry by this many tokens (attention_mask 0 there, "
                        "their labels -100): the models then pass a bool mask to attention")
    p.add_argument("--packed", type=int, default=0,
                   help="pack this many documents into every batch entry (padding-free training: position_ids "
                        "restart at each document, no attention_mask, the label of each document's first token "
                        "-100; lengths drawn at random cut points, seeded): the models then pass a "
                        "block-diagonal bool mask to attention, which flashgen runs as a ragged batch")
    p.add_argument("--generate", type=int, default=0,
                   help="also time this many generation steps after a prefill, the cache growing by one key per "
                        "step (Llama configurations without --padding or --packed): median ms per step over the "
                        "first and the last 100 (JSON generate_ms_first / _last, a table of its own)")
    p.add_argument("--smoke", action="store_true", help="CPU: a tiny float32 model in Triton's interpreter, "
                                                        "wall-clock timing (checks the script, times nothing real)")
    args = p.parse_args(argv)
    if args.smoke:
        chosen = SMOKE
    else:
        names = [n for n in args.configs.split(",") if n]
        unknown = [n for n in names if n not in CONFIGS]
        if unknown:
            p.error(f"unknown config {unknown[0]!r} in --configs (known: {', '.join(CONFIGS)})")
        chosen = {n: CONFIGS[n] for n in names}
    if args.padding < 0:
        p.error(f"--padding must be >= 0 (left-padded tokens per padded entry), got {args.padding}")
    if args.packed < 0 or args.packed == 1:
        p.error(f"--packed must be 0 (off) or >= 2 (documents per batch entry), got {args.packed}")
    if args.packed and args.padding:
        p.error("--packed and --padding are exclusive: transformers detects packed documents only without an "
                "attention_mask")
    for name, spec in chosen.items():
        if args.packed > spec[5]:
            p.error(f"--packed {args.packed} is more documents than config {name} has tokens ({spec[5]})")
        if args.padding >= spec[5]:
            p.error(f"--padding {args.padding} leaves no token of config {name} ({spec[5]} tokens): "
                    f"it must be below the sequence length")
    return args


def _preflight(smoke: bool):
    """torch, CUDA (unless --smoke), transformers and flashgen's runtime imports, or exit 2
    with what is missing."""
    if smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    if not smoke and not torch.cuda.is_available():
        sys.exit("transformers_step.py: needs a CUDA GPU (or --smoke on the CPU)")
    missing = []
    for mod in ("transformers", "triton", "jinja2", "sqlite_utils"):
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod)
    if missing:
        sys.exit(f"transformers_step.py: missing {', '.join(missing)} (flashgen reads its tuning database with "
                 "sqlite-utils): pip install -e . installs them")


def _timed(fn, n: int, cuda: bool, host: list | None = None) -> list[float]:
    """ms of each of ``n`` calls of ``fn``: CUDA events around each, or wall clock.
    ``host``: also appends, per call, the ms until ``fn`` returned on the host (before
    waiting for the GPU): a call whose host time nears its event time waits on the host."""
    import torch

    out = []
    for _ in range(n):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t = time.perf_counter()
            start.record()
            fn()
            end.record()
            if host is not None:
                host.append((time.perf_counter() - t) * 1e3)
            end.synchronize()
            out.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t) * 1e3)
    return out


def _step_kernels(step) -> dict:
    """Kernel name (first 90 characters) -> [calls, total GPU us] of one train step."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        if t > 0:
            out[e.key[:90]] = [e.count, round(t, 1)]
    return out


#: Idle gaps on the GPU shorter than this (us) are not attributed (launch latency).
GAP_US = 8.0
#: Runtime calls that can block the host (synchronizations, copies, allocations).
_WAITS = ("Synchronize", "cudaMemcpy", "cuMemcpy", "cudaMalloc", "cudaFree", "cuMemAlloc", "cuMemFree",
          "cudaHostAlloc")


def _frame(stack: list[str]) -> str:
    """The innermost frame of ``stack`` (outermost first) in flashgen, else in
    transformers, else "?"."""
    for part in ("flashgen/", "transformers/"):
        for name in reversed(stack):
            if part in name:
                return name[name.index(part):][:100]
    return "?"


def _gaps(fn) -> dict:
    """One call of ``fn`` traced on the host and the GPU (torch.profiler, Python
    stacks): :func:`gap_table` of its chrome trace."""
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        t0 = time.perf_counter()
        fn()
        host_ms = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    return gap_table(events, host_ms)


def gap_table(events: list[dict], host_ms: float) -> dict:
    """From a chrome trace's ``traceEvents`` (torch.profiler with CPU and CUDA activity
    and Python stacks; times in us): the GPU's busy and idle us between its first kernel's
    start and its last kernel's end (overlapping kernels counted once), the us between
    the first launch on the host and the first kernel's start, and the idle gaps of at
    least GAP_US summed by the Python frame (:func:`_frame`) around the launch of the
    kernel that ended each (name -> [gaps, us, a kernel's name]); the runtime calls that
    can block the host (``_WAITS``), by name -> [calls, us]."""
    xs = [e for e in events if e.get("ph") == "X"]
    kernels = sorted((e for e in xs if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")), key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in xs if e.get("cat") in ("cuda_runtime", "cuda_driver")
                and "correlation" in e.get("args", {})}
    pyf = [e for e in xs if e.get("cat") == "python_function"
           and ("flashgen/" in e["name"] or "transformers/" in e["name"])]
    waits: dict[str, list] = {}
    for e in xs:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and any(w in e["name"] for w in _WAITS):
            w = waits.setdefault(e["name"], [0, 0.0])
            w[0] += 1
            w[1] += e["dur"]
    out = {"host_ms": host_ms, "kernels": len(kernels), "busy_us": 0.0, "idle_us": 0.0, "span_us": 0.0,
           "before_first_kernel_us": 0.0, "gaps_by_frame": {}, "waits": waits}
    if not kernels:
        return out

    def launch_of(k):
        return launches.get(k.get("args", {}).get("correlation"))

    by_frame: dict[str, list] = {}
    end = kernels[0]["ts"]
    for k in kernels:
        gap = k["ts"] - end
        if gap >= GAP_US:
            launch = launch_of(k)
            # the frames around the launch on its own thread (autograd launches the
            # backward's kernels from its device thread), else on any thread
            around = [] if launch is None else [e for e in pyf if e["ts"] <= launch["ts"] <= e["ts"] + e["dur"]]
            same = [e for e in around if e.get("tid") == launch.get("tid")]
            stack = sorted(same or around, key=lambda e: e["ts"])
            slot = by_frame.setdefault(_frame([e["name"] for e in stack]), [0, 0.0, k["name"][:60]])
            slot[0] += 1
            slot[1] += gap
        if gap > 0:
            out["idle_us"] += gap
            out["busy_us"] += k["dur"]
        else:  # overlaps the kernels before it
            out["busy_us"] += max(k["ts"] + k["dur"] - end, 0.0)
        end = max(end, k["ts"] + k["dur"])
    out["span_us"] = end - kernels[0]["ts"]
    first = [launch_of(k)["ts"] for k in kernels if launch_of(k) is not None]
    out["before_first_kernel_us"] = kernels[0]["ts"] - min(first) if first else 0.0
    out["gaps_by_frame"] = dict(sorted(by_frame.items(), key=lambda kv: -kv[1][1]))
    return out


def _grad_errors(got: dict, ref: dict) -> dict:
    """Relative L2 errors of ``got``'s gradients against ``ref``'s (float32 math)."""
    per, num, den = [], 0.0, 0.0
    worst_name = None
    for name, r in ref.items():
        g = got[name]
        d2 = (g.float() - r.float()).pow(2).sum().item()
        r2 = r.float().pow(2).sum().item()
        num, den = num + d2, den + r2
        e = (d2 / r2) ** 0.5 if r2 > 0 else (0.0 if d2 == 0 else float("inf"))
        if not per or e > max(per):
            worst_name = name
        per.append(e)
    return {"all_params": (num / den) ** 0.5 if den > 0 else 0.0, "worst": max(per), "worst_param": worst_name,
            "median": statistics.median(per), "n_params": len(per)}


def _packed_positions(batch: int, tokens: int, docs: int, g):
    """position_ids (batch, tokens): each entry ``docs`` documents, their lengths set by
    docs - 1 distinct cut points drawn uniformly from 1..tokens-1 (``g`` seeds them)."""
    import torch

    rows = []
    for _ in range(batch):
        cuts = torch.randperm(tokens - 1, generator=g)[:docs - 1].sort().values + 1
        lengths = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([tokens])]))
        rows.append(torch.cat([torch.arange(int(n)) for n in lengths]))
    return torch.stack(rows)


def run_config(name, spec, args, impl_fg: str, device, dtype) -> dict:
    import torch
    import transformers

    hidden, heads, kv_heads, layers, batch, tokens, inter, vocab = spec
    if name in GPT_OSS:
        ref_impl = "eager"
        window = 128 if tokens > 128 else 8
        cfg = transformers.GptOssConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                                        num_hidden_layers=layers, num_attention_heads=heads,
                                        num_key_value_heads=kv_heads, head_dim=64 if hidden > 64 else 16,
                                        num_local_experts=4, num_experts_per_tok=2, sliding_window=window,
                                        attention_dropout=0.0, use_cache=False)  # gpt-oss's YaRN rope
    else:
        ref_impl = "sdpa"
        cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                                       num_hidden_layers=layers, num_attention_heads=heads,
                                       num_key_value_heads=kv_heads, max_position_embeddings=max(tokens, 128),
                                       attention_dropout=0.0, use_cache=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=ref_impl, dtype=dtype)
    model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, vocab, (batch, tokens), generator=g).to(device)
    mask, labels, pos = None, ids, None
    if args.packed:
        pos = _packed_positions(batch, tokens, args.packed, g).to(device)
        labels = ids.masked_fill(pos == 0, -100)  # no document's first token predicted from the one before
    if args.padding:
        mask = torch.ones(batch, tokens, dtype=torch.long)
        mask[1::2, :args.padding] = 0  # left padding of every other entry
        mask = mask.to(device)
        prev = torch.cat([mask[:, :1], mask[:, :-1]], dim=1)  # no label predicted from a padded position
        labels = ids.masked_fill((mask == 0) | (prev == 0), -100)
    cuda = device == "cuda"
    rec = {"model": type(model).__name__, "reference": ref_impl,
           "config": dict(hidden=hidden, num_heads=heads, num_kv_heads=kv_heads, head_dim=cfg.head_dim,
                          layers=layers, batch=batch, tokens=tokens, intermediate=inter, vocab=vocab,
                          params=n_params, dtype=str(dtype).replace("torch.", ""), padding=args.padding,
                          packed=args.packed),
           "impl": {}}
    if name in GPT_OSS:
        rec["config"].update(sliding_window=cfg.sliding_window, layer_types=cfg.layer_types,
                             num_local_experts=cfg.num_local_experts, num_experts_per_tok=cfg.num_experts_per_tok)
    grads, decode_logits = {}, {}
    for impl in (ref_impl, impl_fg):
        model.set_attn_implementation(impl)
        model.load_state_dict(weights)
        # check: one forward + backward from the same weights and batch
        model.train()
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, attention_mask=mask, position_ids=pos, labels=labels).loss
        loss.backward()
        grads[impl] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        r = rec["impl"][impl] = {"loss": loss.item()}
        # train step
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)

        def step():
            opt.zero_grad(set_to_none=True)
            model(input_ids=ids, attention_mask=mask, position_ids=pos, labels=labels).loss.backward()
            opt.step()

        t0 = time.perf_counter()
        _timed(step, args.warmup, cuda)
        r["warmup_s"] = time.perf_counter() - t0
        times = _timed(step, args.steps, cuda)
        r["train_step_ms"] = statistics.median(times)
        r["train_step_ms_all"] = times
        if args.profile and cuda:
            r["step_kernels"] = _step_kernels(step)
        if args.gaps and cuda:
            r["step_gaps"] = _gaps(step)
        del opt
        model.zero_grad(set_to_none=True)
        # prefill: forward only
        model.eval()

        def prefill():
            with torch.no_grad():
                model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False, logits_to_keep=1)

        _timed(prefill, args.warmup, cuda)
        host: list[float] = []
        times = _timed(prefill, args.steps, cuda, host)
        r["prefill_ms"] = statistics.median(times)
        r["prefill_ms_all"] = times
        if cuda:
            r["prefill_host_ms"] = statistics.median(host)
        if args.profile and cuda:
            r["prefill_kernels"] = _step_kernels(prefill)
        if args.gaps and cuda:
            r["prefill_gaps"] = _gaps(prefill)
        if name not in GPT_OSS and not (args.padding or args.packed):
            with torch.no_grad():
                cache = transformers.DynamicCache(config=model.config)
                out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
                nxt = out.logits[:, -1:].argmax(-1)

            def decode():
                with torch.no_grad():
                    logits = model(input_ids=nxt, past_key_values=cache, use_cache=True).logits
                cache.crop(-1)  # back to the prefill's tokens
                return logits

            decode_logits[impl] = decode().float()
            assert cache.get_seq_length() == tokens, (cache.get_seq_length(), tokens)  # every step sees tokens keys
            _timed(decode, args.warmup, cuda)
            times = _timed(decode, args.steps, cuda)
            r["decode_ms"] = statistics.median(times)
            r["decode_ms_all"] = times
            del cache
            if args.generate:
                # generation as a user runs it: the cache grows by one key per step, so
                # every step is a new seqlen_k (flashgen's per-size tables see a new key
                # per step; past 512 steps a table of 512 entries is full)
                with torch.no_grad():
                    cache = transformers.DynamicCache(config=model.config)
                    nxt = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
                    nxt = nxt[:, -1:].argmax(-1)

                    def step():
                        return model(input_ids=nxt, past_key_values=cache, use_cache=True).logits

                    times = _timed(step, args.generate, cuda)
                assert cache.get_seq_length() == tokens + args.generate
                r["generate_ms_all"] = times
                r["generate_ms_first"] = statistics.median(times[:100])
                r["generate_ms_last"] = statistics.median(times[-100:])
                del cache
        if cuda:
            r["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
            torch.cuda.reset_peak_memory_stats()
    ref, got = rec["impl"][ref_impl], rec["impl"][impl_fg]
    rec["loss_rel_diff"] = abs(got["loss"] - ref["loss"]) / abs(ref["loss"])
    rec["loss_ok"] = rec["loss_rel_diff"] <= LOSS_RTOL
    rec["grad_rel_l2"] = _grad_errors(grads[impl_fg], grads[ref_impl])
    if dtype == torch.float32 and name not in GPT_OSS:
        # float32 attentions: flashgen's gradients within GRAD_RTOL of the reference's
        rec["grads_rule"] = f"vs {ref_impl}: {rec['grad_rel_l2']['all_params']:.3g} <= {GRAD_RTOL}"
        rec["grads_ok"] = rec["grad_rel_l2"]["all_params"] <= GRAD_RTOL
    else:
        # Two correct bf16 attentions differ by up to the sum of their errors: the rule is
        # the exactness rule against the float32 model (the reference attention, same
        # weights and batch), flashgen's gradients within 2x the bf16 reference's error
        # plus a floor.  A mixture of experts (gpt-oss) routes each token to its top
        # experts, so a last-bit difference in attention's output flips some routes and
        # the floor there is GRAD_RTOL.
        floor = GRAD_RTOL if name in GPT_OSS else GRAD_FLOOR_VS_FLOAT32
        model.load_state_dict(weights)
        model.to(torch.float32)
        model.set_attn_implementation(ref_impl)
        model.train()
        model.zero_grad(set_to_none=True)
        loss32 = model(input_ids=ids, attention_mask=mask, position_ids=pos, labels=labels).loss
        loss32.backward()
        g32 = {n: p.grad.detach() for n, p in model.named_parameters()}
        rec["float32_loss"] = loss32.item()
        rec["grad_rel_l2_vs_float32"] = {impl: _grad_errors(grads[impl], g32) for impl in (ref_impl, impl_fg)}
        e_ref = rec["grad_rel_l2_vs_float32"][ref_impl]["all_params"]
        e_fg = rec["grad_rel_l2_vs_float32"][impl_fg]["all_params"]
        rec["grads_rule"] = f"vs float32: {e_fg:.3g} <= 2 x {e_ref:.3g} + {floor}"
        rec["grads_ok"] = e_fg <= 2 * e_ref + floor
        model.zero_grad(set_to_none=True)
        del g32
    rec["train_step_ratio"] = got["train_step_ms"] / ref["train_step_ms"]
    rec["prefill_ratio"] = got["prefill_ms"] / ref["prefill_ms"]
    if "generate_ms_first" in got:
        rec["generate_ratio_first"] = got["generate_ms_first"] / ref["generate_ms_first"]
        rec["generate_ratio_last"] = got["generate_ms_last"] / ref["generate_ms_last"]
    if "decode_ms" in got:
        rec["decode_ratio"] = got["decode_ms"] / ref["decode_ms"]
        a, b = decode_logits[impl_fg], decode_logits[ref_impl]
        rec["decode_logits_rel_l2"] = ((a - b).norm() / b.norm()).item()
    del model, grads, weights
    if cuda:
        torch.cuda.empty_cache()
    return rec


def main(argv=None) -> int:
    args = _parse(argv)
    _preflight(args.smoke)
    import torch
    import transformers
    import triton

    import flashgen
    from flashgen.integrations import transformers as fg_tf

    impl_fg = fg_tf.register()
    configs = SMOKE if args.smoke else {n: CONFIGS[n] for n in args.configs.split(",") if n}
    device, dtype = ("cpu", torch.float32) if args.smoke else ("cuda", torch.bfloat16)
    result = {"what": "LlamaForCausalLM (GptOssForCausalLM) training step and prefill, sdpa (eager) vs flashgen "
                      "through AttentionInterface",
              "versions": {"torch": torch.__version__, "triton": triton.__version__,
                           "transformers": transformers.__version__, "flashgen": flashgen.__version__,
                           "python": platform.python_version()},
              "gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
              "flashgen_db": os.environ.get("FLASHGEN_DB"), "attn_implementation": impl_fg,
              "steps": args.steps, "warmup": args.warmup, "loss_rtol": LOSS_RTOL, "grad_rtol": GRAD_RTOL,
              "configs": {}}
    t0 = time.perf_counter()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for name, spec in configs.items():
        print(f"{name}: {spec}", flush=True)
        result["configs"][name] = run_config(name, spec, args, impl_fg, device, dtype)
        result["wall_s"] = time.perf_counter() - t0
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(f"\n{result['gpu']}; torch {torch.__version__}, triton {triton.__version__}, transformers "
          f"{transformers.__version__}; median of {args.steps} (ms); ratio = flashgen / reference (sdpa; eager "
          "for gpt-oss)")
    print(f"{'config':12} {'ref':5} {'step ref':>10} {'step fg':>9} {'ratio':>6} {'prefill ref':>13} {'prefill fg':>11} "
          f"{'ratio':>6} {'decode ref':>11} {'decode fg':>10} {'ratio':>6} {'loss rel':>9} {'grad relL2':>11} ok")
    ok = True
    for name, r in result["configs"].items():
        s, f_ = r["impl"][r["reference"]], r["impl"][impl_fg]
        good = r["loss_ok"] and r["grads_ok"]
        ok &= good
        print(f"{name:12} {r['reference']:5} {s['train_step_ms']:10.2f} {f_['train_step_ms']:9.2f} {r['train_step_ratio']:6.3f} "
              f"{s['prefill_ms']:13.2f} {f_['prefill_ms']:11.2f} {r['prefill_ratio']:6.3f} "
              + (f"{s['decode_ms']:11.3f} {f_['decode_ms']:10.3f} {r['decode_ratio']:6.3f} " if "decode_ratio" in r
                 else f"{'-':>11} {'-':>10} {'-':>6} ") +
              f"{r['loss_rel_diff']:9.2e} {r['grad_rel_l2']['all_params']:11.2e} {'yes' if good else 'NO'}"
              + (f"  (grads {r['grads_rule']})" if "grads_rule" in r else ""))
    hosts = {n: r for n, r in result["configs"].items()
             if all("prefill_host_ms" in r["impl"][i] for i in (r["reference"], impl_fg))}
    if hosts:
        print("\nprefill: ms until the forward call returned on the host (median), against its event time; "
              "near it, the prefill waits on the host")
        for name, r in hosts.items():
            s, f_ = r["impl"][r["reference"]], r["impl"][impl_fg]
            print(f"{name:12} {r['reference']:5} {s['prefill_host_ms']:.2f} / {s['prefill_ms']:.2f}   flashgen "
                  f"{f_['prefill_host_ms']:.2f} / {f_['prefill_ms']:.2f}")
    gen = {n: r for n, r in result["configs"].items() if "generate_ratio_first" in r}
    if gen:
        print(f"\ngeneration, {args.generate} steps, the cache growing by one key per step: median ms per step "
              "over the first / last 100")
        for name, r in gen.items():
            s, f_ = r["impl"][r["reference"]], r["impl"][impl_fg]
            print(f"{name:12} {r['reference']:5} first {s['generate_ms_first']:.3f} / {f_['generate_ms_first']:.3f} "
                  f"({r['generate_ratio_first']:.3f}x)  last {s['generate_ms_last']:.3f} / {f_['generate_ms_last']:.3f} "
                  f"({r['generate_ratio_last']:.3f}x)")
    for (name, r), (field, what) in itertools.product(result["configs"].items(), (("step_gaps", "train step"),
                                                                                 ("prefill_gaps", "prefill"))):
        gs = {i: r["impl"][i].get(field) for i in (r["reference"], impl_fg)}
        if None in gs.values():
            continue
        print(f"\n{name}: one traced {what} (host ms to return; GPU busy / idle us between the first and last "
              f"kernel; idle gaps of >= {GAP_US:g} us by the Python frame that launched the kernel after them)")
        for impl, g in gs.items():
            print(f"  {impl}: host {g['host_ms']:.2f} ms, {g['kernels']} kernels, busy {g['busy_us']:.0f} us, "
                  f"idle {g['idle_us']:.0f} us, first kernel {g['before_first_kernel_us']:.0f} us after its "
                  "launch; runtime calls that can block the host: "
                  + (", ".join(f"{n} x{c} {t:.0f} us" for n, (c, t) in g["waits"].items()) or "none"))
            for where, (count, us, kname) in list(g["gaps_by_frame"].items())[:8]:
                print(f"    {us:9.0f} us in {count:4d} gaps  {where}  (e.g. before {kname})")
    for (name, r), (field, what) in itertools.product(result["configs"].items(), (("step_kernels", "train step"),
                                                                                 ("prefill_kernels", "prefill"))):
        ks, kf = r["impl"][r["reference"]].get(field), r["impl"][impl_fg].get(field)
        if ks is None or kf is None:
            continue
        tot_s, tot_f = sum(t for _, t in ks.values()), sum(t for _, t in kf.values())
        print(f"\n{name}: one {what}'s GPU time, {r['reference']} {tot_s / 1e3:.2f} ms, flashgen "
              f"{tot_f / 1e3:.2f} ms; kernels by |difference| (calls, us: {r['reference']} | flashgen)")
        names = sorted(set(ks) | set(kf), key=lambda n: -abs(kf.get(n, [0, 0])[1] - ks.get(n, [0, 0])[1]))
        for n in names[:14]:
            a, b = ks.get(n, [0, 0.0]), kf.get(n, [0, 0.0])
            print(f"  {a[0]:4d} {a[1]:10.1f} | {b[0]:4d} {b[1]:10.1f}  {n}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""The op as deployments use it, checked on the GPU (about a minute on an H200):

* torch.compile(model, fullgraph=True) of a tiny attention block calling
  flashgen.attention, forward and backward, equals eager (and the op is in the graph);
* capture and replay of forward + backward in a torch.cuda.CUDAGraph gives the eager
  result on new inputs, and the capture read no tuning database; a shape first seen
  inside a capture gets the default config with no database read;
* inputs on cuda:1 (while cuda:0 is current) run on cuda:1 and equal the cuda:0 result
  (skipped with a message when there is one GPU);
* flashgen.scaled_dot_product_attention matches torch's SDPA (is_causal with
  seqlen_q <, =, > seqlen_k, enable_gqa, scale, head_dim_v != head_dim), forward and
  gradients, both measured against a float64 SDPA: flashgen's error is at most 2x
  torch's own at the input dtype plus a small floor; an attn_mask is served as a bias
  (same rule), what flashgen cannot serve is torch's own call (same error);
* dropout under CUDA-graph capture: each replay advances the device-side state (a fresh
  mask) and equals an eager call from the state it started with;
* calls from a new thread (which has made no CUDA call, so no context is current in it)
  after the same shapes ran in the main thread: the forward, and forward + backward with
  the backward in that thread, equal the main thread's (a kernel with tensor
  descriptors needs the context before its launch);
* launch plans (``flashgen.plans``): three calls of each shape and layout with new
  inputs each, after a call that passes one tensor as q, k and v where the head counts
  allow (the second and third replay the first's launches) against float64 and
  against the same inputs with plans off (``FLASHGEN_LAUNCH_PLANS=0``): O bitwise (with
  and without autograd), gradients to the dtype's tolerance (the Gluon backward's dQ
  adds in a varying order); three of the shapes run the dense op's flash-decoding form
  (``library.decode_form``: 4-64 query rows per kv head over 1024-4096 keys).

Prints a PASS/FAIL/SKIP table; exit status 1 if anything failed.

    PYTHONPATH=. python3 benchmarks/gpu_op_checks.py [--dtype bfloat16] [--backend inductor] [--only plans,...]

``run_checks(torch.device("cpu"), dtype=torch.float32, backend="aot_eager")`` runs the
same logic on CPU (flashgen's reference path; CUDA-only rows are SKIP): tests/test_library.py
does that.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import flashgen
from flashgen import dispatch, dropout


@dataclass
class Row:
    name: str
    status: str  # PASS | FAIL | SKIP
    detail: str


def _err(got, want) -> float:
    got, want = got.double(), want.double()
    if not torch.equal(torch.isfinite(got), torch.isfinite(want)):
        return float("inf")
    fin = torch.isfinite(want)
    return (got[fin] - want[fin]).abs().max().item() if fin.any() else 0.0


def compare(name, got, want, *, atol) -> Row:
    """PASS when max |got - want| <= atol (and the non-finite entries agree)."""
    e = _err(got, want)
    return Row(name, "PASS" if e <= atol else "FAIL", f"max err {e:.3g} (allowed {atol:.3g})")


def _tol(dtype, scale=1.0) -> float:
    return {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype] * max(scale, 1.0)


class Tiny(torch.nn.Module):
    """Projections around flashgen.attention (GQA, causal, strided q/k/v views)."""

    def __init__(self, d=64, h=4, hk=2):
        super().__init__()
        self.h, self.hk, self.d = h, hk, d
        self.wq = torch.nn.Linear(d * h, d * h, bias=False)
        self.wkv = torch.nn.Linear(d * h, 2 * d * hk, bias=False)
        self.wo = torch.nn.Linear(d * h, d * h, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.h, self.d).transpose(1, 2)
        k, v = self.wkv(x).view(b, s, 2, self.hk, self.d).permute(2, 0, 3, 1, 4)
        o = flashgen.attention(q, k, v, causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


def _fwd_bwd(f, model, x, w):
    model.zero_grad()
    x = x.clone().requires_grad_()
    out = f(x)
    (out.float() * w).sum().backward()
    return [out.detach(), x.grad, model.wq.weight.grad.clone(), model.wkv.weight.grad.clone()]


def check_compile(device, dtype, backend) -> list[Row]:
    torch.manual_seed(0)
    model = Tiny().to(device=device, dtype=dtype)
    x = torch.randn(2, 77, 256, device=device, dtype=dtype)
    w = torch.randn(2, 77, 256, device=device)
    targets = []

    def recording(gm, example_inputs):
        targets.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return torch._dynamo.backends.registry.lookup_backend(backend)(gm, example_inputs)

    torch._dynamo.reset()
    t0 = time.perf_counter()
    compiled = torch.compile(model, fullgraph=True, backend=recording)
    try:
        got = _fwd_bwd(compiled, model, x, w)
        got = _fwd_bwd(compiled, model, x, w)  # second call: the compiled graph, no retrace
    except Exception as e:  # a graph break raises under fullgraph=True
        return [Row(f"torch.compile fwd+bwd [{backend}]", "FAIL", f"{type(e).__name__}: {str(e)[:200]}")]
    t_compile = time.perf_counter() - t0
    want = _fwd_bwd(model, model, x, w)
    rows = []
    if torch.ops.flashgen.fwd.default not in targets:
        rows.append(Row(f"torch.compile fwd+bwd [{backend}]", "FAIL", "flashgen::fwd is not in the graph"))
    for name, a, b in zip(("out", "dx", "dWq", "dWkv"), got, want):
        r = compare(f"torch.compile fwd+bwd [{backend}] {name}", a, b, atol=_tol(dtype, b.abs().max().item()))
        r.detail += f"; compile + 2 calls {t_compile:.1f} s"
        rows.append(r)
    return rows


def check_cuda_graph(device, dtype) -> list[Row]:
    name = "CUDA graph fwd+bwd"
    if device.type != "cuda":
        return [Row(name, "SKIP", "needs CUDA")]
    torch.manual_seed(1)
    b, h, hk, s, d = 2, 8, 2, 300, 128

    def make():
        return [torch.randn(b, n, s, d, device=device, dtype=dtype) for n in (h, hk, hk)] + \
            [torch.randn(b, h, s, d, device=device, dtype=dtype)]

    static = [t.requires_grad_(i < 3) for i, t in enumerate(make())]

    def step():
        q, k, v, do = static
        o = flashgen.attention(q, k, v, causal=True)
        return (o, *torch.autograd.grad(o, (q, k, v), do))

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up: compile, memoize
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    reads = []
    real_table = dispatch.Dispatcher._table
    dispatch.Dispatcher._table = lambda self, p: reads.append(p) or real_table(self, p)
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            outs = step()
    except Exception as e:
        return [Row(name, "FAIL", f"capture: {type(e).__name__}: {str(e)[:200]}")]
    finally:
        dispatch.Dispatcher._table = real_table
    rows = []
    for trial in range(2):
        new = make()
        with torch.no_grad():
            for st, t in zip(static, new):
                st.copy_(t)
        g.replay()
        torch.cuda.synchronize(device)
        q, k, v, do = (t.detach().clone().requires_grad_(i < 3) for i, t in enumerate(new))
        o = flashgen.attention(q, k, v, causal=True)
        want = (o, *torch.autograd.grad(o, (q, k, v), do))
        errs = [_err(a, w_) for a, w_ in zip(outs, want)]
        ok = all(e == 0.0 for e in errs)  # the same kernels on the same inputs: bitwise equal
        rows.append(Row(f"{name} replay {trial}", "PASS" if ok else "FAIL",
                        "O, dQ, dK, dV max err " + ", ".join(f"{e:.3g}" for e in errs)))
    rows.append(Row(f"{name}: no DB read in capture", "PASS" if not reads else "FAIL",
                    f"{len(reads)} database reads during the capture"))
    return rows


def check_dropout_graph(device, dtype) -> list[Row]:
    """Dropout under CUDA-graph capture: each replay advances the device-side
    [seed, offset] state and so draws a fresh mask, and equals an eager call made from
    the state the replay started with (same kernels: bitwise)."""
    name = "CUDA graph dropout"
    if device.type != "cuda":
        return [Row(name, "SKIP", "needs CUDA")]
    torch.manual_seed(2)
    b, h, hk, s, d = 2, 4, 2, 200, 64
    st = torch.tensor([77, 0], dtype=torch.int64, device=device)
    static = [torch.randn(b, n, s, d, device=device, dtype=dtype).requires_grad_()
              for n in (h, hk, hk)] + [torch.randn(b, h, s, d, device=device, dtype=dtype)]

    def step(state):
        q, k, v, do = static
        o = flashgen.attention(q, k, v, causal=True, dropout_p=0.2, rng_state=state)
        return (o, *torch.autograd.grad(o, (q, k, v), do))

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            step(st)
    torch.cuda.current_stream(device).wait_stream(side)
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            outs = step(st)
    except Exception as e:
        return [Row(name, "FAIL", f"capture: {type(e).__name__}: {str(e)[:200]}")]
    rows, prev = [], None
    n = dropout.counters(b, h, s, s)
    for trial in range(2):
        before = st.clone()
        g.replay()
        torch.cuda.synchronize(device)
        got = [t.clone() for t in outs]
        advanced = st[1].item() - before[1].item()
        want = step(before.clone())
        errs = [_err(a, w_) for a, w_ in zip(got, want)]
        fresh = prev is None or not torch.equal(got[0], prev)
        ok = all(e == 0.0 for e in errs) and advanced == n and fresh
        rows.append(Row(f"{name} replay {trial}", "PASS" if ok else "FAIL",
                        f"vs eager from the same state: O, dQ, dK, dV max err "
                        + ", ".join(f"{e:.3g}" for e in errs)
                        + f"; offset advanced {advanced} (want {n}); mask fresh: {fresh}"))
        prev = got[0]
    return rows


def check_capture_cold(device, dtype) -> list[Row]:
    """A shape first seen inside a capture: the dispatcher must answer with the default
    config without reading a database, and must not memoize it (the next eager call of
    that shape reads the databases).  The default variant is compiled beforehand (a
    Triton compile inside a capture is not what this checks)."""
    name = "CUDA graph, shape first seen in the capture"
    if device.type != "cuda":
        return [Row(name, "SKIP", "needs CUDA")]
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, n, 1024, 128, device=device, dtype=dtype) for n in (32, 8, 8))
    saved = dispatch.default_dispatcher()
    dispatch.set_default_dispatcher(dispatch.Dispatcher(databases=[]))
    with torch.no_grad():
        want = flashgen.attention(q, k, v, causal=True)  # compiles the default variant
    dispatch.set_default_dispatcher(dispatch.Dispatcher())  # cold: nothing cached
    reads = []
    real_table = dispatch.Dispatcher._table
    dispatch.Dispatcher._table = lambda self, p: reads.append(p) or real_table(self, p)
    try:
        g = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(g):
            out = flashgen.attention(q, k, v, causal=True)
    except Exception as e:
        return [Row(name, "FAIL", f"capture: {type(e).__name__}: {str(e)[:200]}")]
    finally:
        dispatch.Dispatcher._table = real_table
    n_reads = len(reads)
    g.replay()
    torch.cuda.synchronize(device)
    e = _err(out, want)
    rep = flashgen.explain(q, k, v, causal=True)
    after = rep.kernels[0].source
    dispatch.set_default_dispatcher(saved)
    ok = n_reads == 0 and e == 0.0
    return [Row(name, "PASS" if ok else "FAIL",
                f"{n_reads} database reads in the capture; replay vs default config max err {e:.3g}; "
                f"after the capture the fwd config comes from: {after}")]


def check_device1(dtype) -> list[Row]:
    name = "inputs on cuda:1"
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return [Row(name, "SKIP", f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} GPU(s); "
                                  "needs 2")]
    torch.cuda.set_device(0)
    torch.manual_seed(2)
    ts = [torch.randn(1, 4, 200, 64, dtype=dtype) for _ in range(4)]
    res = {}
    for dev in ("cuda:0", "cuda:1"):
        q, k, v, do = (t.to(dev).requires_grad_(i < 3) for i, t in enumerate(ts))
        o = flashgen.attention(q, k, v, causal=True)
        grads = torch.autograd.grad(o, (q, k, v), do)
        with torch.no_grad():
            o_nograd = flashgen.attention(q, k, v, causal=True)
        res[dev] = [t.cpu() for t in (o, o_nograd, *grads)]
        devices = {t.device for t in (o, o_nograd, *grads)}
        if devices != {torch.device(dev)}:
            return [Row(name, "FAIL", f"outputs on {devices}, inputs on {dev}")]
    assert torch.cuda.current_device() == 0
    errs = [_err(a, b) for a, b in zip(res["cuda:1"], res["cuda:0"])]
    return [Row(name, "PASS" if all(e == 0 for e in errs) else "FAIL",
                "cuda:1 vs cuda:0 (O, O no-grad, dQ, dK, dV) max err " + ", ".join(f"{e:.3g}" for e in errs))]


SDPA_CASES = [
    # (b, hq, hk, sq, sk, d, dv, is_causal, scale, enable_gqa)
    (2, 4, 4, 128, 128, 64, 64, True, None, False),
    (1, 4, 4, 40, 200, 64, 64, True, None, False),  # seqlen_q < seqlen_k: top-left
    (1, 4, 4, 200, 40, 128, 128, True, None, False),  # seqlen_q > seqlen_k: every row sees key 0
    (2, 8, 2, 97, 131, 128, 128, True, None, True),  # GQA
    (1, 4, 1, 64, 300, 64, 64, False, 0.3, True),  # MQA, explicit scale
    (1, 2, 2, 33, 77, 64, 32, False, None, False),  # head_dim_v != head_dim
]


def check_sdpa(device, dtype) -> list[Row]:
    rows = []
    for case in SDPA_CASES:
        b, hq, hk, sq, sk, d, dv, causal, scale, gqa = case
        name = f"sdpa vs torch [b{b} h{hq}/{hk} sq{sq} sk{sk} d{d}/{dv} causal={causal} scale={scale}]"
        g = torch.Generator().manual_seed(sq * 1000 + sk)
        # rounded to the dtype first: the float64 reference sees the same values
        ts = [torch.randn(*shape, generator=g).to(dtype) for shape in
              ((b, hq, sq, d), (b, hk, sk, d), (b, hk, sk, dv), (b, hq, sq, dv))]
        kw = dict(is_causal=causal, scale=scale, enable_gqa=gqa)

        def run(fn, dt, dev):
            q, k, v, do = (t.to(device=dev, dtype=dt).requires_grad_(i < 3) for i, t in enumerate(ts))
            o = fn(q, k, v, **kw)
            return [o.detach(), *torch.autograd.grad(o, (q, k, v), do)]

        ref = run(F.scaled_dot_product_attention, torch.float64, "cpu")
        base = run(F.scaled_dot_product_attention, dtype, device)
        got = run(flashgen.scaled_dot_product_attention, dtype, device)
        worst, detail = 0.0, []
        for n, a, bb, r in zip(("O", "dQ", "dK", "dV"), got, base, ref):
            e, eb = _err(a.cpu(), r), _err(bb.cpu(), r)
            ratio = e / (2 * eb + 1e-6 * max(1.0, r.abs().max().item()) + (1e-3 if dtype != torch.float32 else 0))
            worst = max(worst, ratio)
            detail.append(f"{n} {e:.2g}/{eb:.2g}")
        rows.append(Row(name, "PASS" if worst <= 1 else "FAIL",
                        f"err flashgen/torch vs fp64: {', '.join(detail)}; worst ratio {worst:.2f} (<= 1)"))
    # attn_mask is served by flashgen (as a bias): within the rule of torch's own error
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 40, 64, generator=g).to(dtype) for _ in range(3))
    mask = torch.rand(40, 40, generator=g) > 0.3
    mask[:, 0] = True
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
    dev = [t.to(device) for t in (q, k, v)]
    a = flashgen.scaled_dot_product_attention(*dev, attn_mask=mask.to(device)).cpu()
    bb = F.scaled_dot_product_attention(*dev, attn_mask=mask.to(device)).cpu()
    e, eb = _err(a, ref), _err(bb, ref)
    ratio = e / (2 * eb + 1e-6 + (1e-3 if dtype != torch.float32 else 0))
    why = flashgen.explain(*dev, sdpa=True, attn_mask=mask.to(device))
    rows.append(Row("sdpa attn_mask served as a bias", "PASS" if ratio <= 1 and why.backend == "flashgen" else "FAIL",
                    f"err flashgen/torch vs fp64 {e:.2g}/{eb:.2g}, ratio {ratio:.2f}; {why.backend}"))
    # what flashgen cannot serve is torch's own call: attn_mask with is_causal raises torch's error
    try:
        F.scaled_dot_product_attention(*dev, attn_mask=mask.to(device), is_causal=True)
        want = None
    except RuntimeError as err:
        want = str(err)
    try:
        flashgen.scaled_dot_product_attention(*dev, attn_mask=mask.to(device), is_causal=True)
        got = None
    except RuntimeError as err:
        got = str(err)
    why = flashgen.explain(*dev, sdpa=True, attn_mask=mask.to(device), causal=True)
    rows.append(Row("sdpa fallback: attn_mask with is_causal", "PASS" if got == want and why.backend ==
                    "torch-sdpa-fallback" else "FAIL", f"torch: {want!r:.80}; flashgen: {got!r:.80}"))
    return rows


def check_bias_tma(device, dtype) -> list[Row]:
    """The bias through a tensor descriptor (tma kernels, BIAS_TMA) on the GPU: a full
    bias, broadcasts over batch, heads and both (extent-1 descriptor dims), and a
    key-padding bias (rows broadcast: the pointer fallback), none and causal, forward and
    backward through flashgen.attention against the float64 reference (FLOOR + 2x torch's
    error, bench.compare).  Counts the descriptors the launches built."""
    from flashgen import ops
    from flashgen.bench import compare as fcompare

    rows = []
    b, h, sq, sk, d = 2, 4, 200, 264, 64
    g = torch.Generator(device=device).manual_seed(11)
    q, k, v, do = (torch.randn(b, h, n, d, device=device, generator=g, dtype=dtype) for n in (sq, sk, sk, sq))
    full = torch.randn(b, h, sq, sk, device=device, generator=g, dtype=dtype)
    cases = {"full": (full, True), "batch-broadcast": (full[:1].expand(b, -1, -1, -1), True),
             "head-broadcast": (full[:, :1].expand(-1, h, -1, -1), True),
             "batch+head-broadcast": (full[:1, :1].expand(b, h, -1, -1), True),
             "key padding (rows broadcast)": (full[:, :, :1].expand(-1, -1, sq, -1), False)}
    # tma configs exist from sm_90 on; Triton's interpreter (CPU, not bfloat16) reports
    # sm_90 and runs them too; the CPU's reference path takes no descriptor
    from flashgen import library

    tma_device = (torch.cuda.get_device_capability(device)[0] >= 9 if device.type == "cuda"
                  else library.use_kernels(q))
    real = ops.bias_descriptor
    made = []
    ops.bias_descriptor = lambda *a: made.append(real(*a)) or made[-1]
    try:
        for name, (bias, want_tma) in cases.items():
            for causal in (False, True):
                made.clear()
                qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
                o = flashgen.attention(qg, kg, vg, causal=causal, bias=bias)
                dq, dk, dv = torch.autograd.grad(o, (qg, kg, vg), do)
                res = fcompare({"O": o.detach(), "dQ": dq, "dK": dk, "dV": dv}, q, k, v, do,
                               mask=dict(causal=causal), softmax_scale=d ** -0.5, mods=dict(bias=bias))
                worst = max(r[2] for r in res.values())
                n_desc = sum(x is not None for x in made)
                ok = worst <= 1 and (n_desc > 0) == (want_tma and tma_device)
                rows.append(Row(f"bias via TMA: {name}{', causal' if causal else ''}", "PASS" if ok else "FAIL",
                                f"worst ratio {worst:.3f} (<= 1); {n_desc} of {len(made)} launches took a "
                                f"descriptor (want {'> 0' if want_tma and tma_device else '0'})"))
    finally:
        ops.bias_descriptor = real
    return rows

def _order(t) -> list[int]:
    """t's dims from the largest stride to the smallest (a memory order)."""
    return sorted(range(t.dim()), key=lambda i: (-t.stride(i), i))


def check_layouts(device, dtype, cases=None) -> list[Row]:
    """Inputs in transformers' memory order ((batch, seqlen, heads, head_dim) seen through
    ``transpose(1, 2)``; K and V as views of one packed tensor) through flashgen.attention,
    forward and backward, against the float64 reference (bench.compare: FLOOR + 2x torch's
    error), on shapes whose tuned rows are the Gluon family's and on an untuned seqlen.
    PASS also needs O in q's memory order and dQ, dK, dV in q's, k's, v's memory order (no
    copies around the call), and reports the kernel family of each kernel (explain)."""
    from flashgen.bench import compare as fcompare

    rows = []
    if cases is None and device.type != "cuda":  # the CPU run of the logic: small sizes
        cases = [(1, 4, 2, 33, 16, True), (2, 2, 2, 40, 32, False)]
    cases = cases or [  # batch, heads, kv heads, seqlen, head_dim, causal
        (1, 32, 8, 2048, 128, True), (8, 16, 16, 2048, 128, False), (4, 16, 4, 2048, 128, True),
        (8, 32, 32, 2048, 64, True), (2, 8, 2, 1000, 128, True)]
    for b, h, hk, s, d, causal in cases:
        g = torch.Generator(device=device).manual_seed(b * 7 + s)
        q = torch.randn(b, s, h, d, device=device, generator=g, dtype=dtype).transpose(1, 2)
        kv = torch.randn(b, s, 2, hk, d, device=device, generator=g, dtype=dtype)
        k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
        do = torch.randn(b, s, h, d, device=device, generator=g, dtype=dtype).transpose(1, 2)
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        o = flashgen.attention(qg, kg, vg, causal=causal)
        dq, dk, dv = torch.autograd.grad(o, (qg, kg, vg), do)
        res = fcompare({"O": o.detach(), "dQ": dq, "dK": dk, "dV": dv}, q, k, v, do,
                       mask=dict(causal=causal), softmax_scale=d ** -0.5)
        worst = max(r[2] for r in res.values())
        want_o = o.transpose(1, 2).is_contiguous()
        strides = all(_order(t) == _order(ref) for t, ref in ((dq, q), (dk, k), (dv, v)))
        why = flashgen.explain(q, k, v, causal=causal)
        fams = ", ".join(f"{c.kernel} {c.family}" for c in why.kernels)
        ok = worst <= 1 and want_o and strides
        rows.append(Row(f"layouts: bshd views b{b} h{h}/{hk} s{s} d{d} causal={causal}",
                        "PASS" if ok else "FAIL",
                        f"worst ratio {worst:.3f} (<= 1); O in q's order {want_o}; grads in q/k/v order "
                        f"{strides}; {fams}"))
    return rows


def check_new_thread(device, dtype) -> list[Row]:
    import threading

    rows = []
    # on the H200 the first shape takes a Triton forward, the second the Gluon family
    shapes = ((1, 4, 128, 64), (2, 16, 1024, 128)) if device.type == "cuda" else ((1, 2, 64, 64),)
    for shape in shapes:
        b, h, n, d = shape
        torch.manual_seed(3)
        q, k, v, do = (torch.randn(b, h, n, d, device=device, dtype=dtype) for _ in range(4))

        def run(q=q, k=k, v=v, do=do):
            qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
            with torch.no_grad():
                o = flashgen.attention(q, k, v, causal=True)
            with torch.autograd.set_multithreading_enabled(False):
                grads = torch.autograd.grad(flashgen.attention(qg, kg, vg, causal=True), (qg, kg, vg), do)
            return [o, *grads]

        want = run()
        got, err = [], []

        def work():
            try:
                got.extend(run())
            except Exception as e:  # noqa: BLE001 - reported as the row's detail
                err.append(f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")

        t = threading.Thread(target=work)
        t.start()
        t.join()
        name = f"new thread {'x'.join(map(str, shape))} causal"
        if err:
            rows.append(Row(name, "FAIL", err[0]))
            continue
        errs = [_err(a, b) for a, b in zip(got, want)]
        ok = errs[0] == 0 and max(errs[1:]) <= _tol(dtype)
        rows.append(Row(name, "PASS" if ok else "FAIL",
                        "vs the main thread (O, dQ, dK, dV) max err " + ", ".join(f"{e:.3g}" for e in errs)))
    return rows


REL_TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def _rel(got, want) -> float:
    """max |got - want| / max |want| (inf where the non-finite entries differ)."""
    return _err(got, want) / max(want.double().abs().max().item(), 1e-30) if want.numel() else _err(got, want)


REPLAY_CASES = [
    # (b, h, hk, s, d, causal, bshd)
    (1, 4, 4, 128, 64, True, False),
    (2, 16, 16, 1024, 128, True, False),
    (1, 32, 8, 2048, 128, True, False),
    (2, 8, 8, 512, 64, False, True),
    (2, 16, 16, 1024, 128, False, True),
    (4, 16, 4, 1024, 128, True, True),
    # (seqlen_q, seqlen_k): the dense op's flash-decoding form (library.decode_form)
    (1, 32, 8, (1, 4096), 128, True, False),
    (4, 16, 4, (4, 2048), 128, True, True),
    (2, 32, 8, (16, 1024), 64, False, True),
]


def check_replay(device, dtype) -> list[Row]:
    import os

    from flashgen import reference

    rows = []
    cases = REPLAY_CASES if device.type == "cuda" else [(1, 2, 2, 48, 32, True, False), (1, 2, 1, 40, 32, False, True)]
    for b, h, hk, s, d, causal, bshd in cases:
        sq, sk = s if isinstance(s, tuple) else (s, s)
        form = " (decode form)" if sq != sk else ""
        name = f"plans {b}x{h}/{hk}x{sq}{f'x{sk}' if form else ''} d{d}{' causal' if causal else ''}" \
               f"{' bshd' if bshd else ''}{form}"
        worst = 0.0
        for call in range(3):
            torch.manual_seed(10 + call)

            def t(heads, n):
                x = torch.randn(b, n, heads, d, device=device, dtype=dtype) if bshd else \
                    torch.randn(b, heads, n, d, device=device, dtype=dtype)
                return x.transpose(1, 2) if bshd else x

            q, k, v, do = t(h, sq), t(hk, sk), t(hk, sk), t(h, sq)
            if call == 0 and form:
                # the form's plan without autograd first (flashgen.attention's direct path)
                with torch.no_grad():
                    flashgen.attention(q, k, v, causal=causal)
            if call == 0 and h == hk and not form:
                # one tensor as q, k and v first (recorded apart from three tensors)
                with torch.no_grad():
                    flashgen.attention(q, q, q, causal=causal)
            outs = {}
            for plans_on in ("1", "0"):
                os.environ["FLASHGEN_LAUNCH_PLANS"] = plans_on
                try:
                    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
                    o = flashgen.attention(qg, kg, vg, causal=causal)
                    outs[plans_on] = [o.detach(), *torch.autograd.grad(o, (qg, kg, vg), do)]
                    with torch.no_grad():  # the op's direct path (no autograd node)
                        outs[plans_on].append(flashgen.attention(q, k, v, causal=causal))
                finally:
                    os.environ.pop("FLASHGEN_LAUNCH_PLANS", None)
            # errors relative to the largest entry of what they are measured against:
            # garbage (zeros, NaN, another buffer) is far above REL_TOL, rounding below
            errs = [_rel(a, b2) for a, b2 in zip(outs["1"], outs["0"])]
            if errs[0] != 0 or errs[4] != 0 or max(errs[1:4]) > REL_TOL[dtype]:
                return rows + [Row(name, "FAIL", f"call {call}: plans on vs off (O, dQ, dK, dV, O without "
                                                 "autograd) relative err "
                                                 + ", ".join(f"{e:.3g}" for e in errs))]
            ro, _, _ = reference.forward(q, k, v, causal=causal)
            refs = [ro, *reference.backward(do, q, k, v, causal=causal)]
            worst = max([worst] + [_rel(a, r) for a, r in zip(outs["1"], refs + [ro])])
        rows.append(Row(name, "PASS" if worst <= REL_TOL[dtype] else "FAIL",
                        f"3 calls: plans on == off (O bitwise, with and without autograd), max relative err vs "
                        f"float64 {worst:.3g}"))
    return rows


#: The groups of checks, by the name ``--only`` takes, in the order they run:
#: name -> (device, dtype, backend) -> rows.
CHECKS = {
    "compile": lambda device, dtype, backend: check_compile(device, dtype, backend),
    "cuda-graph": lambda device, dtype, backend: check_cuda_graph(device, dtype),
    "dropout-graph": lambda device, dtype, backend: check_dropout_graph(device, dtype),
    "capture-cold": lambda device, dtype, backend: check_capture_cold(device, dtype),
    "device1": lambda device, dtype, backend: check_device1(dtype),
    "sdpa": lambda device, dtype, backend: check_sdpa(device, dtype),
    "bias-tma": lambda device, dtype, backend: check_bias_tma(device, dtype),
    "layouts": lambda device, dtype, backend: check_layouts(device, dtype),
    "new-thread": lambda device, dtype, backend: check_new_thread(device, dtype),
    "plans": lambda device, dtype, backend: check_replay(device, dtype),
}
GROUPS = tuple(CHECKS)


def run_checks(device, *, dtype=torch.bfloat16, backend="inductor", only=GROUPS) -> list[Row]:
    rows = []
    for group, check in CHECKS.items():
        if group in only:
            rows += check(device, dtype, backend)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--backend", default="inductor")
    p.add_argument("--only", default=",".join(GROUPS),
                   help=f"comma-separated groups of checks to run (default: all): {', '.join(GROUPS)}")
    args = p.parse_args(argv)
    only = tuple(g.strip() for g in args.only.split(",") if g.strip())
    unknown = [g for g in only if g not in GROUPS]
    if unknown or not only:
        p.error(f"--only takes a comma-separated subset of {', '.join(GROUPS)}; got {args.only!r}")
    if not torch.cuda.is_available():
        print("no CUDA device: these checks are for the GPU (tests/test_library.py runs their logic on CPU)")
        return 2
    t0 = time.perf_counter()
    rows = run_checks(torch.device("cuda:0"), dtype=getattr(torch, args.dtype), backend=args.backend, only=only)
    w = max(len(r.name) for r in rows)
    print(f"{'check':{w}}  result  detail   ({torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{args.dtype})")
    for r in rows:
        print(f"{r.name:{w}}  {r.status:6}  {r.detail}")
    n_fail = sum(r.status == "FAIL" for r in rows)
    print(f"{len(rows)} checks: {sum(r.status == 'PASS' for r in rows)} PASS, {n_fail} FAIL, "
          f"{sum(r.status == 'SKIP' for r in rows)} SKIP in {time.perf_counter() - t0:.0f} s")
    return 1 if n_fail else 0


if __name__ == "__main__":
    sys.exit(main())

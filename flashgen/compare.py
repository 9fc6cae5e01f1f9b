"""flashgen against its peers, side by side in one run (``flashgen bench``).

Backends: flashgen through the dispatcher (tuned: the shipped and user databases),
flashgen with the heuristic default config (no database), and torch SDPA's
FlashAttention-2 and cuDNN backends.  Per shape and backend: forward and backward
median ms (CUDA events, L2 flushed) and TFLOP/s by the FlashAttention papers'
convention (forward 4·b·h·sq·sk·d, halved for causal; backward 2.5x forward).

flashgen's own output and gradients are checked against the float64 reference on a
slice of every shape (batch 0, the query heads of kv head 0) with the same rule as the
tests: max error <= 2 x torch's error at the input dtype + floor.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from . import reference
from .api import attention
from .bench import FLOOR, _max_err, time_ms
from .dispatch import Dispatcher, default_dispatcher, set_default_dispatcher
from .spec import Shape, attention_flops

BACKENDS = ("flashgen", "flashgen-default", "sdpa-flash", "sdpa-cudnn")


@dataclass
class Cell:
    backend: str
    fwd_ms: float | None = None
    bwd_ms: float | None = None
    fwd_tflops: float | None = None
    bwd_tflops: float | None = None
    error: str | None = None


@dataclass
class Row:
    head_dim: int
    causal: bool
    shape: dict
    dtype: str
    cells: dict = field(default_factory=dict)
    check: dict = field(default_factory=dict)  # output -> error ratio (<= 1 passes)


def _sdpa(backend_name):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION}[backend_name]

    def fn(q, k, v, causal):
        with sdpa_kernel(backend):
            gqa = q.shape[1] != k.shape[1]
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    return fn


def _flashgen(q, k, v, causal):
    return attention(q, k, v, causal=causal)


def _time_backend(fn, q, k, v, do, causal, warmup_ms, rep_ms):
    fwd_ms = time_ms(lambda: fn(q, k, v, causal), warmup_ms, rep_ms)
    o = fn(q, k, v, causal)
    bwd_ms = time_ms(lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True), warmup_ms, rep_ms)
    return fwd_ms, bwd_ms


def check_slice(q, k, v, do, causal) -> dict:
    """Error ratios of flashgen's O, dQ, dK, dV on batch 0 / kv head 0's group."""
    g = q.shape[1] // k.shape[1]
    qs, ks, vs, dos = (t[:1, :n].detach().clone().requires_grad_(True)
                       for t, n in ((q, g), (k, 1), (v, 1), (do, g)))
    o = attention(qs, ks, vs, causal=causal)
    grads = torch.autograd.grad(o, (qs, ks, vs), dos)
    r_o, _, _ = reference.forward(qs, ks, vs, causal=causal)
    b_o, _, _ = reference.forward(qs, ks, vs, causal=causal, dtype=q.dtype)
    r_g = reference.backward(dos, qs, ks, vs, causal=causal)
    b_g = reference.backward(dos, qs, ks, vs, causal=causal, dtype=q.dtype)
    out = {}
    for name, got, r, b in zip(("O", "dQ", "dK", "dV"), (o, *grads), (r_o, *r_g), (b_o, *b_g)):
        out[name] = _max_err(got, r) / (2 * _max_err(b, r) + FLOOR[q.dtype])
    return out


def run(entries, *, dtype=torch.bfloat16, backends=BACKENDS, warmup_ms=10, rep_ms=50, check=True,
        progress=None) -> list[Row]:
    """entries: (head_dim, causal, Shape).  Returns one Row per entry."""
    tuned = default_dispatcher()
    untuned = Dispatcher(databases=[])
    rows = []
    for d, causal, shape in entries:
        row = Row(d, causal, asdict(shape), str(dtype).replace("torch.", ""))
        gen = torch.Generator(device="cuda").manual_seed(0)

        def rnd(*s):
            return torch.randn(*s, device="cuda", dtype=dtype, generator=gen).requires_grad_(True)
        q = rnd(shape.batch, shape.num_heads, shape.seqlen_q, d)
        k = rnd(shape.batch, shape.num_kv_heads, shape.seqlen_k, d)
        v = rnd(shape.batch, shape.num_kv_heads, shape.seqlen_k, d)
        do = torch.randn(q.shape, device="cuda", dtype=dtype, generator=gen)
        f_fwd = attention_flops(shape.batch, shape.num_heads, shape.seqlen_q, shape.seqlen_k, d, causal=causal)
        for name in backends:
            cell = Cell(name)
            try:
                if name.startswith("flashgen"):
                    set_default_dispatcher(untuned if name == "flashgen-default" else tuned)
                    fn = _flashgen
                else:
                    fn = _sdpa(name)
                cell.fwd_ms, cell.bwd_ms = _time_backend(fn, q, k, v, do, causal, warmup_ms, rep_ms)
                cell.fwd_tflops = f_fwd / cell.fwd_ms / 1e9
                cell.bwd_tflops = 2.5 * f_fwd / cell.bwd_ms / 1e9
            except Exception as e:  # noqa: BLE001 - a backend that cannot run says why
                cell.error = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            finally:
                set_default_dispatcher(tuned)
            row.cells[name] = asdict(cell)
        if check:
            row.check = check_slice(q, k, v, do, causal)
        rows.append(row)
        if progress:
            progress(row)
        del q, k, v, do
        torch.cuda.empty_cache()
    return rows


def geomean(xs):
    xs = [x for x in xs if x]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def to_json(rows) -> str:
    return json.dumps([asdict(r) for r in rows], indent=1)


def entries_from_presets(names) -> list[tuple[int, bool, Shape]]:
    from .presets import PRESETS

    out = []
    for n in names:
        if n not in PRESETS:
            raise KeyError(f"unknown preset {n!r}; known: {sorted(PRESETS)}")
        out += [(d, mask == "causal", shape) for d, mask, shape in PRESETS[n]()]
    return out

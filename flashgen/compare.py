"""flashgen against its peers, side by side in one run (``flashgen bench``).

Backends (:data:`BACKENDS`): flashgen through the dispatcher (tuned: the shipped and
user databases), flashgen with the heuristic default config (no database), flashgen's
deterministic backward (``deterministic=True``, the tuned rows; its cell also records
whether two backward calls gave bitwise identical gradients), torch
SDPA's flash, cuDNN, efficient and math backends, FlexAttention (compiled), and the
naive three-kernel implementation (:mod:`flashgen.peers`).

Per shape and backend (a :class:`Cell`): forward, backward and forward+backward median
ms (``flashgen.bench.time_ms``: CUDA events, L2 flushed), TFLOP/s by the FlashAttention
papers' convention (forward 4·b·h·sq·sk·d, halved for causal, the exact count of
visible pairs for windows; backward 2.5x the forward, forward+backward 3.5x), and the
peak memory one forward+backward allocates beyond its inputs.  A backend that cannot
serve a shape, fails, or would need more than ``max_matrix_gb`` for its
seqlen_q x seqlen_k matrices gets the reason in its cell, and the run goes on.

flashgen's own output and gradients are checked against the float64 reference on a
slice of every shape (batch 0, the query heads of kv head 0) with the same rule as the
tests: max error <= 2 x torch's error at the input dtype + floor.
"""

from __future__ import annotations

import csv
import gc
import io
import json
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from . import iomodel, peers, reference
from .api import attention
from .bench import FLOOR, _max_err, time_ms
from .dispatch import Dispatcher, default_dispatcher, set_default_dispatcher
from .masks import mask_bounds
from .spec import Shape

BACKENDS = ("flashgen", "flashgen-default", "flashgen-deterministic", "sdpa-flash", "sdpa-cudnn",
            "sdpa-efficient", "sdpa-math", "flex", "naive")
DIRECTIONS = ("fwd", "bwd", "fwdbwd")
#: FLOPs of each direction as a multiple of the forward's.
FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}


@dataclass(frozen=True)
class Case:
    """One problem: q (batch, num_heads, seqlen_q, head_dim), k and v (batch,
    num_kv_heads, seqlen_k, head_dim), flashgen's mask conventions."""

    batch: int
    num_heads: int
    num_kv_heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    causal: bool = False
    window: tuple[int, int] = (-1, -1)

    def __post_init__(self):
        for name in ("batch", "num_heads", "num_kv_heads", "seqlen_q", "seqlen_k", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        mask_bounds(self.seqlen_q, self.seqlen_k, causal=self.causal, window=self.window)
        object.__setattr__(self, "window", tuple(int(w) for w in self.window))

    @property
    def mask(self) -> str:
        """none, causal, or window=L:R."""
        if self.window != (-1, -1):
            return f"window={self.window[0]}:{self.window[1]}" + (",causal" if self.causal else "")
        return "causal" if self.causal else "none"

    @property
    def label(self) -> str:
        sk = "" if self.seqlen_k == self.seqlen_q else f"/{self.seqlen_k}"
        return f"{self.batch}x{self.num_heads}/{self.num_kv_heads}x{self.seqlen_q}{sk}"

    @property
    def shape(self) -> Shape:
        return Shape(self.batch, self.num_heads, self.num_kv_heads, self.seqlen_q, self.seqlen_k)

    def flops(self, direction: str = "fwd") -> float:
        f = iomodel.forward_flops(self.batch, self.num_heads, self.seqlen_q, self.seqlen_k, self.head_dim,
                                  causal=self.causal, window=self.window)
        return f * FLOP_FACTOR[direction]


def parse_shape(text: str) -> Case:
    """``B,H,HKV,SQ,SK,D[,causal][,window=L:R]`` -> Case (ValueError saying what is wrong)."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if len(parts) < 6:
        raise ValueError(f"{text!r}: expected B,H,HKV,SQ,SK,D[,causal][,window=L:R]")
    try:
        nums = [int(p) for p in parts[:6]]
    except ValueError:
        raise ValueError(f"{text!r}: the first six fields (B,H,HKV,SQ,SK,D) must be integers") from None
    causal, window = False, (-1, -1)
    for p in parts[6:]:
        if p == "causal":
            causal = True
        elif p.startswith("window="):
            try:
                left, right = (int(x) for x in p[len("window="):].split(":"))
            except ValueError:
                raise ValueError(f"{text!r}: window is window=LEFT:RIGHT (-1 unbounded)") from None
            window = (left, right)
        else:
            raise ValueError(f"{text!r}: unknown option {p!r} (causal, window=L:R)")
    try:
        return Case(*nums, causal=causal, window=window)
    except ValueError as e:
        raise ValueError(f"{text!r}: {e}") from None


def cases_from_presets(names: Iterable[str]) -> list[Case]:
    from .presets import DECODE_PRESETS, MODS_PRESETS, PRESETS, USER_PRESETS, VARLEN_PRESETS

    out = []
    for n in names:
        if n not in PRESETS:
            raise KeyError(f"unknown preset {n!r}; known: {sorted(PRESETS)}")
        if n in VARLEN_PRESETS:
            raise KeyError(f"preset {n!r} is a ragged (varlen) batch: `flashgen tune` tunes it, but `flashgen "
                           "bench` has no varlen runner: benchmarks/varlen_bench.py measures ragged batches")
        if n in USER_PRESETS:
            raise KeyError(f"preset {n!r} holds user score/mask functions: `flashgen tune` tunes it, `flashgen "
                           "bench` does not run it (benchmarks/user_mods_bench.py does)")
        if n in DECODE_PRESETS or n in MODS_PRESETS:
            what = "decode problems" if n in DECODE_PRESETS else "score mods"
            script = "decode_bench.py" if n in DECODE_PRESETS else "mods_bench.py"
            raise KeyError(f"preset {n!r} holds {what}: `flashgen tune` tunes it, `flashgen bench` does not "
                           f"run it (benchmarks/{script} does)")
        out += [Case(s.batch, s.num_heads, s.num_kv_heads, s.seqlen_q, s.seqlen_k, d, causal=mask == "causal")
                for d, mask, s in PRESETS[n]()]
    return out


@dataclass
class Cell:
    backend: str
    fwd_ms: float | None = None
    bwd_ms: float | None = None
    fwdbwd_ms: float | None = None
    fwd_tflops: float | None = None
    bwd_tflops: float | None = None
    fwdbwd_tflops: float | None = None
    peak_mem_bytes: int | None = None
    error: str | None = None
    wall_s: float | None = None  # how long measuring this cell took (compiles included)
    #: flashgen-deterministic only: dQ, dK and dV bitwise equal in two backward calls on
    #: the same graph (None: not checked, for the other backends or after a failure)
    repeatable: bool | None = None


@dataclass
class Row:
    case: dict
    dtype: str
    cells: dict = field(default_factory=dict)  # backend -> asdict(Cell)
    check: dict = field(default_factory=dict)  # output -> error ratio (<= 1 passes)

    @property
    def c(self) -> Case:
        return Case(**{**self.case, "window": tuple(self.case["window"])})


def _backend_fn(name: str, case: Case, q, k) -> Callable:
    kw = dict(causal=case.causal, window=case.window)
    if name == "flashgen-deterministic":
        return lambda q, k, v: attention(q, k, v, deterministic=True, **kw)
    if name.startswith("flashgen"):
        return lambda q, k, v: attention(q, k, v, **kw)
    if name in peers.SDPA_BACKENDS:
        return peers.sdpa(name, q, k, **kw)
    if name == "flex":
        if q.device.type != "cuda":
            raise peers.Unsupported("compiled FlexAttention is benchmarked on CUDA only")
        return peers.flex(q, k, **kw)
    if name == "naive":
        return lambda q, k, v: peers.naive_attention(q, k, v, **kw)
    raise KeyError(f"unknown backend {name!r}; known: {BACKENDS}")


def _describe(e: BaseException) -> str:
    if isinstance(e, torch.cuda.OutOfMemoryError):
        first = str(e).splitlines()[0] if str(e) else ""
        return f"OOM: {first[:160]}"
    msg = str(e).splitlines()[0][:300] if str(e) else ""
    return f"{type(e).__name__}: {msg}"


def _free(device, collect: bool = False) -> None:
    if collect:
        gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def peak_bytes(fn: Callable, device) -> int | None:
    """Peak allocated bytes during ``fn()`` beyond what was allocated before (CUDA
    only; None elsewhere)."""
    if torch.device(device).type != "cuda":
        fn()
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def measure_cell(name: str, case: Case, q, k, v, do, *, timer: Callable, warmup_ms: int, rep_ms: int,
                 max_matrix_gb: float) -> Cell:
    """Time one backend on one case; a failure at any stage is recorded in ``error``
    (with the stage), keeping what was measured before it."""
    cell = Cell(name)
    need = peers.matrix_bytes(name, case.batch, case.num_heads, case.seqlen_q, case.seqlen_k, q.element_size())
    if need is not None and need > max_matrix_gb * 1e9:
        cell.error = (f"skipped: needs ~{need / 1e9:.0f} GB for its {case.seqlen_q}x{case.seqlen_k} "
                      f"matrices (limit {max_matrix_gb:g} GB)")
        return cell
    stage = "setup"
    try:
        fn = _backend_fn(name, case, q, k)
        grads = (q, k, v)
        stage = "fwd"
        cell.fwd_ms = timer(lambda: fn(q, k, v), warmup_ms, rep_ms)
        stage = "bwd"
        o = fn(q, k, v)
        cell.bwd_ms = timer(lambda: torch.autograd.grad(o, grads, do, retain_graph=True), warmup_ms, rep_ms)
        if name == "flashgen-deterministic":
            stage = "repeatability"
            first = torch.autograd.grad(o, grads, do, retain_graph=True)
            second = torch.autograd.grad(o, grads, do, retain_graph=True)
            cell.repeatable = all(torch.equal(a, b) for a, b in zip(first, second))
            first = second = None
        o = None  # free the retained graph
        stage = "fwd+bwd"
        cell.fwdbwd_ms = timer(lambda: torch.autograd.grad(fn(q, k, v), grads, do), warmup_ms, rep_ms)
        stage = "memory"
        _free(q.device)
        cell.peak_mem_bytes = peak_bytes(lambda: torch.autograd.grad(fn(q, k, v), grads, do), q.device)
    except peers.Unsupported as e:
        cell.error = f"unsupported: {e}"
    except Exception as e:  # noqa: BLE001 - a backend that cannot run says why
        cell.error = f"{stage}: {_describe(e)}"
    for d in DIRECTIONS:
        ms = getattr(cell, f"{d}_ms")
        if ms:
            setattr(cell, f"{d}_tflops", case.flops(d) / ms / 1e9)
    return cell


def check_slice(q, k, v, do, case: Case, deterministic: tuple[bool, ...] = (False,)) -> dict:
    """Error ratios of flashgen's O, dQ, dK, dV on batch 0 / kv head 0's group, for each
    backward of ``deterministic`` against one set of references: the default's as "O",
    "dQ", "dK", "dV", the deterministic one's gradients as "dQ deterministic" etc. (its
    forward is the default's).  The slice is its own, smaller problem key, so the rows it
    runs may differ from the full shape's."""
    g = q.shape[1] // k.shape[1]
    qs, ks, vs, dos = (t[:1, :n].detach().clone().requires_grad_(True)
                       for t, n in ((q, g), (k, 1), (v, 1), (do, g)))
    kw = dict(causal=case.causal, window=case.window)
    r_o, _, _ = reference.forward(qs, ks, vs, **kw)
    b_o, _, _ = reference.forward(qs, ks, vs, dtype=q.dtype, **kw)
    r_g = reference.backward(dos, qs, ks, vs, **kw)
    b_g = reference.backward(dos, qs, ks, vs, dtype=q.dtype, **kw)
    out = {}
    for det in deterministic:
        o = attention(qs, ks, vs, deterministic=det, **kw)
        grads = torch.autograd.grad(o, (qs, ks, vs), dos)
        for name, got, r, b in zip(("O", "dQ", "dK", "dV"), (o, *grads), (r_o, *r_g), (b_o, *b_g)):
            if not (det and name == "O"):
                out[name + (" deterministic" if det else "")] = _max_err(got, r) / (2 * _max_err(b, r) +
                                                                                     FLOOR[q.dtype])
    return out


def run(cases: Iterable[Case], *, dtype=torch.bfloat16, backends=BACKENDS, device="cuda", warmup_ms=5,
        rep_ms=25, check=True, max_matrix_gb=40.0, timer: Callable | None = None,
        progress: Callable | None = None) -> list[Row]:
    """One Row per case, one Cell per backend.  ``timer(fn, warmup_ms, rep_ms) -> ms``
    defaults to :func:`flashgen.bench.time_ms`; ``progress(case, backend, cell)`` is
    called after each cell."""
    timer = timer or time_ms
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise KeyError(f"unknown backend(s) {unknown}; known: {list(BACKENDS)}")
    tuned = default_dispatcher()
    untuned = Dispatcher(databases=[])
    rows = []
    for case in cases:
        row = Row(asdict(case), str(dtype).replace("torch.", ""))
        gen = torch.Generator(device=device).manual_seed(0)

        def rnd(*s):
            return torch.randn(*s, device=device, dtype=dtype, generator=gen)
        q = rnd(case.batch, case.num_heads, case.seqlen_q, case.head_dim).requires_grad_(True)
        k = rnd(case.batch, case.num_kv_heads, case.seqlen_k, case.head_dim).requires_grad_(True)
        v = rnd(case.batch, case.num_kv_heads, case.seqlen_k, case.head_dim).requires_grad_(True)
        do = rnd(case.batch, case.num_heads, case.seqlen_q, case.head_dim)
        for name in backends:
            set_default_dispatcher(untuned if name == "flashgen-default" else tuned)
            t0, cell = time.perf_counter(), None
            try:
                cell = measure_cell(name, case, q, k, v, do, timer=timer, warmup_ms=warmup_ms, rep_ms=rep_ms,
                                    max_matrix_gb=max_matrix_gb)
            finally:
                set_default_dispatcher(tuned)
                _free(device, collect=cell is None or cell.error is not None)
            cell.wall_s = time.perf_counter() - t0
            row.cells[name] = asdict(cell)
            if progress:
                progress(case, name, cell)
        if check:
            try:
                row.check = check_slice(q, k, v, do, case,
                                        (False, True) if "flashgen-deterministic" in backends else (False,))
            except Exception as e:  # noqa: BLE001
                row.check = {"error": _describe(e)}
        rows.append(row)
        del q, k, v, do
        _free(device, collect=True)
    return rows


# ---------------------------------------------------------------------------------
# Output: JSON, CSV, plots

def geomean(xs):
    xs = [x for x in xs if x]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def max_check(row: Row) -> float | None:
    vals = [v for v in row.check.values() if isinstance(v, (int, float))]
    return max(vals) if vals else None


def to_json(rows: list[Row], meta: dict | None = None) -> str:
    return json.dumps({"meta": meta or {}, "rows": [asdict(r) for r in rows]}, indent=1)


CSV_COLUMNS = ("batch", "num_heads", "num_kv_heads", "seqlen_q", "seqlen_k", "head_dim", "mask", "dtype",
               "backend", "fwd_ms", "bwd_ms", "fwdbwd_ms", "fwd_tflops", "bwd_tflops", "fwdbwd_tflops",
               "peak_mem_bytes", "error", "repeatable", "flashgen_check_max_ratio")


def to_csv(rows: list[Row]) -> str:
    """One line per (case, backend)."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, CSV_COLUMNS, lineterminator="\n")
    w.writeheader()
    for r in rows:
        c = r.c
        for name, cell in r.cells.items():
            line = {k: r.case[k] for k in CSV_COLUMNS if k in r.case}
            line.update(mask=c.mask, dtype=r.dtype, flashgen_check_max_ratio=max_check(r))
            line.update({k: cell[k] for k in CSV_COLUMNS if k in cell})
            w.writerow(line)
    return buf.getvalue()


def plot_groups(rows: list[Row]) -> dict[str, list[Row]]:
    """Rows grouped for plotting against seqlen: by (head_dim, mask, heads); a group
    whose seqlens repeat (e.g. Llama's batch sizes) is split by batch."""
    groups: dict[tuple, list[Row]] = {}
    for r in rows:
        c = r.c
        groups.setdefault((c.head_dim, c.mask, c.num_heads, c.num_kv_heads), []).append(r)
    out = {}
    for (d, mask, h, hkv), rs in groups.items():
        seqlens = [r.c.seqlen_q for r in rs]
        base = f"d{d} {mask} h{h}/{hkv}"
        if len(set(seqlens)) == len(seqlens):
            tokens = {r.c.batch * r.c.seqlen_q for r in rs}
            out[base + (f" ({tokens.pop()} tokens)" if len(tokens) == 1 and len(rs) > 1 else "")] = rs
        else:
            for b in sorted({r.c.batch for r in rs}):
                out[f"{base} batch {b}"] = [r for r in rs if r.c.batch == b]
    return out


def plots(rows: list[Row], out_dir: Path, title: str = "") -> list[Path]:
    """PNG files in ``out_dir``: TFLOP/s against seqlen_q per backend, one panel per
    group (:func:`plot_groups`), for fwd, bwd and fwd+bwd; peak memory against seqlen_q."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    groups = plot_groups(rows)
    if not groups:
        return []
    backends = list(dict.fromkeys(b for r in rows for b in r.cells))
    ncols = min(4, len(groups))
    nrows = -(-len(groups) // ncols)
    paths = []
    metrics = [(f"{d}_tflops", f"TFLOP/s ({'fwd+bwd' if d == 'fwdbwd' else d})", f"tflops_{d}.png", False)
               for d in DIRECTIONS]
    metrics.append(("peak_mem_bytes", "peak memory, fwd+bwd (MiB)", "memory.png", True))
    for key, ylabel, fname, logy in metrics:
        fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.4 * nrows), squeeze=False)
        for ax, (gname, rs) in zip(axes.flat, groups.items()):
            rs = sorted(rs, key=lambda r: r.c.seqlen_q)
            for b in backends:
                pts = [(r.c.seqlen_q, r.cells[b][key]) for r in rs if b in r.cells and r.cells[b][key]]
                if pts:
                    xs, ys = zip(*pts)
                    ys = [y / 2**20 for y in ys] if key == "peak_mem_bytes" else ys
                    ax.plot(xs, ys, marker="o", ms=3, label=b)
            ax.set_xscale("log", base=2)
            if logy:
                ax.set_yscale("log")
            ax.set_title(gname, fontsize=9)
            ax.set_xlabel("seqlen")
            ax.set_ylabel(ylabel, fontsize=8)
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[len(groups):]:
            ax.axis("off")
        handles, labels = axes.flat[0].get_legend_handles_labels()
        if handles:
            fig.legend(handles, labels, loc="lower center", ncol=min(8, len(labels)), fontsize=8)
        fig.suptitle(f"{ylabel}{' - ' + title if title else ''}", fontsize=10)
        fig.tight_layout(rect=(0, 0.06, 1, 0.95))
        p = out_dir / fname
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths

"""Plots of the benchmark suites' JSON (matplotlib, PNG), drawn so that every backend
stays visible: each backend has its own colour, marker and line style (lines that
coincide, e.g. flashgen's and FlexAttention's peak memory, still show both markers),
axes are logarithmic where the values span more than one order of magnitude, and
per-shape comparisons are grouped bars rather than lines.

One function per kind of result; each returns the paths it wrote:

* :func:`dense`: ``flashgen bench`` JSON (suites ``grid``, ``llama``), or the printed
  table of a run whose JSON is missing (``merge_bench.from_log``): TFLOP/s against
  seqlen, one panel per (head_dim, mask), for forward, backward and forward+backward;
  with ``memory=True`` also the peak memory of one forward+backward, as grouped bars on
  a log axis.
* :func:`mods`: ``mods_bench.py`` JSON: forward and forward+backward TFLOP/s per case.
* :func:`varlen`: ``varlen_bench.py`` JSON: the same per ragged-batch problem.
* :func:`decode`: ``decode_bench.py`` JSON: achieved bandwidth as a share of a device
  copy against the cache length, one panel per (batch, seqlen_q).

    python -m benchmarks plot grid docs/results/h200/fa-grid/five-backends/*/bench.json --out DIR
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import merge_bench  # noqa: E402  (a sibling script: imported by name, as the tests do)

#: One style per backend, fixed across plots so a backend looks the same everywhere.
STYLE = {
    "flashgen": dict(color="#d62728", marker="o", ls="-"),
    "flashgen-default": dict(color="#ff9896", marker="s", ls="--"),
    "flashgen-deterministic": dict(color="#9467bd", marker="P", ls=":"),
    "flashgen-paged": dict(color="#8c564b", marker="D", ls="-"),
    "flashgen-paged-default": dict(color="#c49c94", marker="d", ls="--"),
    "sdpa-cudnn": dict(color="#1f77b4", marker="^", ls="-"),
    "sdpa-flash": dict(color="#2ca02c", marker="v", ls="-."),
    "sdpa-efficient": dict(color="#9467bd", marker="<", ls=":"),
    "sdpa-math": dict(color="#7f7f7f", marker=">", ls=":"),
    "flex": dict(color="#ff7f0e", marker="x", ls=(0, (5, 2))),
    "naive": dict(color="#17becf", marker="*", ls=(0, (1, 1))),
    "copy": dict(color="#000000", marker="", ls=":"),
}
_EXTRA = ["#bcbd22", "#e377c2", "#aec7e8", "#98df8a"]


def style(backend: str) -> dict:
    if backend not in STYLE:
        STYLE[backend] = dict(color=_EXTRA[len(STYLE) % len(_EXTRA)], marker="P", ls="-")
    return STYLE[backend]


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _wide(values) -> bool:
    """True when the positive values span more than a factor of 10 (log axis)."""
    vals = [v for v in values if v and v > 0 and math.isfinite(v)]
    return bool(vals) and max(vals) / min(vals) > 10


def _grid(plt, n: int, w: float = 4.4, h: float = 3.4, ncols: int = 4):
    ncols = min(ncols, n)
    nrows = -(-n // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(w * ncols, h * nrows), squeeze=False)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    return fig, list(axes.flat)[:n]


def _finish(plt, fig, axes, title: str, path: Path) -> Path:
    handles, labels = {}, []
    for ax in axes:
        for hnd, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in handles:
                handles[lab] = hnd
                labels.append(lab)
    if labels:
        fig.legend([handles[x] for x in labels], labels, loc="lower center", ncol=min(8, len(labels)), fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 0.95))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _bars(ax, labels: list[str], series: dict[str, list[float | None]], ylabel: str) -> None:
    """Grouped bars: one group per label, one bar per backend (missing values left out)."""
    names = [n for n, ys in series.items() if any(y for y in ys)]
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(labels))]
        ys = [y if y else 0.0 for y in series[name]]
        st = style(name)
        ax.bar(xs, ys, width, color=st["color"], label=name, edgecolor="black", linewidth=0.3)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel(ylabel, fontsize=8)
    if _wide([y for ys in series.values() for y in ys]):
        ax.set_yscale("log")
    ax.grid(axis="y", alpha=0.3)


def _seqlen(shape: str) -> int:
    return int(shape.rsplit("x", 1)[1])


def dense(paths: list[str], out_dir: str | Path, title: str = "", memory: bool = False) -> list[Path]:
    """TFLOP/s plots (and, with ``memory``, the peak-memory plot) of ``flashgen bench`` runs."""
    plt = _plt()
    rows = []
    for p in paths:
        rows += merge_bench.from_json(p) if p.endswith(".json") else merge_bench.from_log(p)
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        heads = r["shape"].split("x")[1]
        groups.setdefault((r["d"], r["mask"], heads), []).append(r)
    backends = list(dict.fromkeys(b for r in rows for b in r["backends"]))
    out = []
    for metric, label in (("fwd", "forward"), ("bwd", "backward"), ("fwdbwd", "forward+backward")):
        fig, axes = _grid(plt, len(groups))
        for ax, ((d, mask, heads), rs) in zip(axes, sorted(groups.items())):
            rs = sorted(rs, key=lambda r: _seqlen(r["shape"]))
            for b in backends:
                pts = [(_seqlen(r["shape"]), r["backends"][b][metric]) for r in rs
                       if r["backends"].get(b, {}).get(metric)]
                if pts:
                    xs, ys = zip(*pts)
                    ax.plot(xs, ys, ms=5, mfc="none", lw=1.3, label=b, **style(b))
            ax.set_xscale("log", base=2)
            ax.set_title(f"head_dim {d}, {mask}, heads {heads}", fontsize=9)
            ax.set_xlabel("seqlen (batch x seqlen fixed)", fontsize=8)
            ax.set_ylabel(f"TFLOP/s, {label}", fontsize=8)
            ax.grid(alpha=0.3)
        out.append(_finish(plt, fig, axes, f"TFLOP/s, {label}{' - ' + title if title else ''}",
                           Path(out_dir) / f"tflops_{metric}.png"))
    if memory:
        out.append(_memory([p for p in paths if p.endswith(".json")], out_dir, title))
    return out


def _memory(paths: list[str], out_dir: str | Path, title: str) -> Path:
    plt = _plt()
    groups: dict[tuple, list[dict]] = {}
    for p in paths:
        for r in json.load(open(p))["rows"]:
            c = r["case"]
            groups.setdefault((c["head_dim"], "causal" if c["causal"] else "none"), []).append(r)
    fig, axes = _grid(plt, len(groups), w=5.2)
    for ax, ((d, mask), rs) in zip(axes, sorted(groups.items())):
        rs = sorted(rs, key=lambda r: r["case"]["seqlen_q"])
        backends = list(dict.fromkeys(b for r in rs for b in r["cells"]))
        series = {b: [(r["cells"].get(b) or {}).get("peak_mem_bytes") for r in rs] for b in backends}
        series = {b: [y / 2**20 if y else None for y in ys] for b, ys in series.items()}
        _bars(ax, [str(r["case"]["seqlen_q"]) for r in rs], series, "MiB beyond the inputs")
        ax.set_title(f"head_dim {d}, {mask}: peak memory of one fwd+bwd", fontsize=9)
        ax.set_xlabel("seqlen (empty: skipped, its matrices would not fit)", fontsize=8)
    return _finish(plt, fig, axes, f"peak memory{' - ' + title if title else ''}", Path(out_dir) / "memory.png")


def mods(paths: list[str], out_dir: str | Path, title: str = "") -> list[Path]:
    """Forward and forward+backward TFLOP/s per score-mod case, every backend that ran."""
    plt = _plt()
    cases = [c for p in paths for c in json.load(open(p))["cases"]
             if any(r.get("fwd_tflops") for r in c.get("results", {}).values())]  # not reached: left out
    backends = list(dict.fromkeys(b for c in cases for b, r in c["results"].items() if r.get("fwd_tflops")))
    fig, axes = _grid(plt, 2, w=max(6.0, 0.45 * len(cases)), h=4.0, ncols=1)
    labels = [c["label"] + (" causal" if c["causal"] and "causal" not in c["label"] else "") for c in cases]
    for ax, metric in zip(axes, ("fwd", "fwdbwd")):
        series = {b: [c["results"].get(b, {}).get(f"{metric}_tflops") for c in cases] for b in backends}
        _bars(ax, labels, series, f"TFLOP/s, {'forward' if metric == 'fwd' else 'forward+backward'}")
    return [_finish(plt, fig, axes, f"score mods{' - ' + title if title else ''}", Path(out_dir) / "mods.png")]


def varlen(paths: list[str], out_dir: str | Path, title: str = "") -> list[Path]:
    """Forward and forward+backward TFLOP/s (useful FLOPs) per ragged-batch problem."""
    plt = _plt()
    rows = [r for p in paths for r in json.load(open(p))["rows"]
            if any(x.get("fwd_tflops") for x in r.get("results", {}).values())]
    backends = list(dict.fromkeys(b for r in rows for b, x in r["results"].items() if x.get("fwd_tflops")))
    fig, axes = _grid(plt, 2, w=max(6.0, 0.6 * len(rows)), h=4.0, ncols=1)
    labels = [r["label"] + (" causal" if r["causal"] and "causal" not in r["label"] else "") for r in rows]
    for ax, (metric, name) in zip(axes, (("fwd", "forward"), ("fwd_bwd", "forward+backward"))):
        series = {b: [r["results"].get(b, {}).get(f"{metric}_tflops") for r in rows] for b in backends}
        _bars(ax, labels, series, f"TFLOP/s (useful FLOPs), {name}")
    return [_finish(plt, fig, axes, f"ragged batches{' - ' + title if title else ''}", Path(out_dir) / "varlen.png")]


def decode(paths: list[str], out_dir: str | Path, title: str = "") -> list[Path]:
    """Achieved bandwidth as % of a device copy against cache length, per (batch, seqlen_q)."""
    plt = _plt()
    rows = [r for p in paths for r in json.load(open(p))["rows"]]
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["batch"], r["seqlen_q"], r["causal"]), []).append(r)
    fig, axes = _grid(plt, len(groups))
    for ax, ((b, sq, causal), rs) in zip(axes, sorted(groups.items())):
        rs = sorted(rs, key=lambda r: r["cache_len"])
        names = list(dict.fromkeys(n for r in rs for n in r["results"] if n != "copy"))
        for n in names:
            pts = [(r["cache_len"], r["results"][n].get("pct_of_copy")) for r in rs
                   if n in r["results"] and r["results"][n].get("pct_of_copy")]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, ms=5, mfc="none", lw=1.3, label=n, **style(n))
        ax.axhline(100, color="black", lw=0.8, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"batch {b}, seqlen_q {sq}{' causal' if causal else ''}", fontsize=9)
        ax.set_xlabel("cache length (tokens)", fontsize=8)
        ax.set_ylabel("% of device-copy bandwidth", fontsize=8)
        ax.grid(alpha=0.3, which="both")
    return [_finish(plt, fig, axes, f"decode with a KV cache{' - ' + title if title else ''}",
                    Path(out_dir) / "decode.png")]


#: What ``python -m benchmarks plot KIND`` draws.
KINDS = {"dense": dense, "mods": mods, "varlen": varlen, "decode": decode}

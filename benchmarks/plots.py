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

    python -m benchmarks plot dense docs/results/h200/fa-grid/five-backends/*/bench.json --out DIR

Every input is read and checked before anything is drawn: a file that is missing, not
JSON (a log, for ``dense``) or a result of another kind raises :class:`InputError`,
whose message names the file and what it lacks, and no PNG is written.  ``dense`` also
reads the older ``flashgen bench`` JSON, a list of shapes (``head_dim``, ``causal``,
``shape``, ``cells``: e.g. ``docs/results/h200/llama3-8b/pointer-loads/bench.json``),
which has no forward+backward or peak-memory cells: a figure whose metric no input has
is left out, with a line on stderr.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import merge_bench  # noqa: E402  (a sibling script: imported by name, as the tests do)

_number = merge_bench.number  # a JSON number, else None

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


class InputError(ValueError):
    """An input the plots cannot draw: the message names the file and the rule it breaks."""


class _Bad(Exception):
    """A result file's layout is not the kind's (the message says where)."""


class _Empty(_Bad):
    """A result file of the kind with nothing to draw (the message says what is missing)."""


def _read_json(path: str):
    """The JSON value in the file ``path`` (InputError when it is missing, not a file or
    not JSON)."""
    p = Path(path)
    if not p.exists():
        raise InputError(f"{path}: no such file")
    if not p.is_file():
        raise InputError(f"{path}: not a file")
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise InputError(f"{path}: not a JSON file (not UTF-8 text)") from None
    except json.JSONDecodeError as e:
        raise InputError(f"{path}: not a JSON file ({e.msg}, line {e.lineno} column {e.colno})") from None
    except OSError as e:
        raise InputError(f"{path}: cannot be read ({e.strerror or e})") from None


def _json_type(value) -> str:
    """The JSON name of a parsed value's type."""
    for typ, name in ((bool, "boolean"), (dict, "object"), (list, "array"), (str, "string"), ((int, float), "number")):
        if isinstance(value, typ):
            return name
    return "null" if value is None else type(value).__name__


def _get(obj, key: str, typ: type | tuple | None = None, where: str = "a row"):
    """``obj[key]`` of a JSON object, of type ``typ`` when given (_Bad naming ``where``
    and ``key`` otherwise)."""
    if not isinstance(obj, dict):
        raise _Bad(f"{where} is a JSON {_json_type(obj)}, not an object")
    if key not in obj:
        raise _Bad(f"{where} has no {key!r}")
    value = obj[key]
    if typ is not None and not isinstance(value, typ):
        raise _Bad(f"{where}'s {key!r} is a JSON {_json_type(value)}")
    return value


def _load(path: str, read):
    """``read(data)`` of the JSON in ``path``: its rows; InputError naming the file when it
    is not of ``read``'s kind (``read.what``) or leaves nothing to draw."""
    data = _read_json(path)
    try:
        return read(data)
    except _Empty as e:
        raise InputError(f"{path}: nothing to draw as {read.what}: {e}") from None
    except _Bad as e:
        raise InputError(f"{path}: not {read.what}, which is {read.layout}: {e}") from None
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise InputError(f"{path}: not {read.what}, which is {read.layout} ({type(e).__name__}: {e})") from None


def _kind(what: str, layout: str):
    """Marks a reader of one kind of result file: ``what`` names the kind in errors,
    ``layout`` says what a file of it holds."""
    def mark(read):
        read.what, read.layout = what, layout
        return read
    return mark


def _grid(plt, n: int, w: float = 4.4, h: float = 3.4, ncols: int = 4):
    ncols = min(ncols, n)
    nrows = -(-n // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(w * ncols, h * nrows), squeeze=False)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    return fig, list(axes.flat)[:n]


def _legend(fig, handles: list, labels: list[str]) -> float:
    """The figure's legend below the panels, in as many columns (at most 8) as fit the
    figure's width, so no entry is cut off at the edges; returns its height as a share
    of the figure's."""
    renderer = fig.canvas.get_renderer()
    for ncol in range(min(8, len(labels)), 0, -1):
        leg = fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=8)
        box = leg.get_window_extent(renderer)
        if box.width <= 0.98 * fig.bbox.width or ncol == 1:
            return box.height / fig.bbox.height
        leg.remove()
    return 0.0


def _finish(plt, fig, axes, title: str, path: Path) -> Path:
    handles, labels = {}, []
    for ax in axes:
        for hnd, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in handles:
                handles[lab] = hnd
                labels.append(lab)
    bottom = 0.07
    if labels:
        bottom = max(bottom, _legend(fig, [handles[x] for x in labels], labels) + 0.02)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, bottom, 1, 0.95))
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


_CASE_KEYS = ("batch", "num_heads", "num_kv_heads", "seqlen_q", "head_dim")


@_kind("a flashgen bench JSON", "an object whose 'rows' have a 'case' and 'cells', or the older list of "
       "shapes with 'head_dim', 'causal', 'shape' and 'cells'")
def _bench_rows(data) -> list[dict]:
    """Rows ``{case, cells}`` of a ``flashgen bench`` JSON: an object whose ``rows`` have a
    ``case`` (sizes, ``causal``, ``window``) and ``cells`` (per backend), or the older
    top-level list whose entries have ``head_dim``, ``causal``, ``shape`` (sizes) and
    ``cells`` (forward and backward alone)."""
    if isinstance(data, list):
        rows = []
        for i, r in enumerate(data):
            where = f"entry {i}"
            shape = _get(r, "shape", dict, where)
            case = {k: _get(shape, k, int, f"{where}'s shape") for k in _CASE_KEYS[:4]}
            case.update(head_dim=_get(r, "head_dim", int, where), causal=_get(r, "causal", bool, where),
                        window=[-1, -1])
            rows.append(dict(case=case, cells=_get(r, "cells", dict, where)))
    else:
        rows = []
        for i, r in enumerate(_get(data, "rows", list, "the file")):
            where = f"row {i}"
            c = _get(r, "case", dict, where)
            case = {k: _get(c, k, int, f"{where}'s case") for k in _CASE_KEYS}
            case.update(causal=_get(c, "causal", bool, f"{where}'s case"), window=list(c.get("window", (-1, -1))))
            rows.append(dict(case=case, cells=_get(r, "cells", dict, where)))
    if not rows:
        raise _Empty("no rows")
    for i, r in enumerate(rows):
        for name, cell in r["cells"].items():
            if not isinstance(cell, dict):
                raise _Bad(f"row {i}'s cell {name!r} is a JSON {_json_type(cell)}, not an object")
    return rows


def _log_rows(path: str) -> list[dict]:
    """:func:`merge_bench.from_log` of ``path``, InputError when it has no table."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"{path}: {'no such file' if not p.exists() else 'not a file'}")
    try:
        return merge_bench.from_log(path)
    except UnicodeDecodeError:
        raise InputError(f"{path}: not a flashgen bench log (not UTF-8 text)") from None
    except ValueError as e:  # no TFLOP/s table, or no rows in it
        raise InputError(f"{e}: not a flashgen bench log (its inputs ending in .json are read as JSON)") from None
    except OSError as e:
        raise InputError(f"{path}: cannot be read ({e.strerror or e})") from None


def dense(paths: list[str], out_dir: str | Path, title: str = "", memory: bool = False) -> list[Path]:
    """TFLOP/s plots (and, with ``memory``, the peak-memory plot) of ``flashgen bench`` runs."""
    rows, bench = [], []
    for p in paths:
        if p.endswith(".json"):
            bench += _load(p, _bench_rows)
        else:
            rows += _log_rows(p)
    rows += merge_bench.tflops_rows(bench)
    metrics = [(m, label) for m, label in (("fwd", "forward"), ("bwd", "backward"), ("fwdbwd", "forward+backward"))
               if any(cell.get(m) for r in rows for cell in r["backends"].values())]
    if not metrics:
        raise InputError(f"{', '.join(paths)}: no TFLOP/s in any cell (every backend failed or was skipped)")
    if memory:
        mem = _memory_groups(bench)
        if not mem:
            raise InputError("--memory: no input has a peak memory (peak_mem_bytes in a flashgen bench JSON's "
                             "cells; logs and the older list-of-shapes JSON have none)")
    plt = _plt()
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        heads = r["shape"].split("x")[1]
        groups.setdefault((r["d"], r["mask"], heads), []).append(r)
    backends = list(dict.fromkeys(b for r in rows for b in r["backends"]))
    out = []
    for metric, label in (("fwd", "forward"), ("bwd", "backward"), ("fwdbwd", "forward+backward")):
        if (metric, label) not in metrics:
            print(f"tflops_{metric}.png not drawn: no input has {label} TFLOP/s", file=sys.stderr)
            continue
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
        out.append(_memory(mem, out_dir, title))
    return out


def _memory_groups(rows: list[dict]) -> dict[tuple, list[dict]]:
    """:func:`_bench_rows`' rows by (head_dim, mask), those groups alone where a cell has
    a peak memory."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        c = r["case"]
        groups.setdefault((c["head_dim"], "causal" if c["causal"] else "none"), []).append(r)
    return {g: rs for g, rs in groups.items()
            if any(_number(cell.get("peak_mem_bytes")) for r in rs for cell in r["cells"].values())}


def _memory(groups: dict[tuple, list[dict]], out_dir: str | Path, title: str) -> Path:
    plt = _plt()
    fig, axes = _grid(plt, len(groups), w=5.2)
    for ax, ((d, mask), rs) in zip(axes, sorted(groups.items())):
        rs = sorted(rs, key=lambda r: r["case"]["seqlen_q"])
        backends = list(dict.fromkeys(b for r in rs for b in r["cells"]))
        series = {b: [_number((r["cells"].get(b) or {}).get("peak_mem_bytes")) for r in rs] for b in backends}
        series = {b: [y / 2**20 if y else None for y in ys] for b, ys in series.items()}
        _bars(ax, [str(r["case"]["seqlen_q"]) for r in rs], series, "MiB beyond the inputs")
        ax.set_title(f"head_dim {d}, {mask}: peak memory of one fwd+bwd", fontsize=9)
        ax.set_xlabel("seqlen (empty: skipped, its matrices would not fit)", fontsize=8)
    return _finish(plt, fig, axes, f"peak memory{' - ' + title if title else ''}", Path(out_dir) / "memory.png")


def _ran(rows: list, key: str, what: str) -> list[dict]:
    """The entries of ``rows`` (objects, each with ``label``, ``causal`` and ``results``:
    backend -> object) where some backend has a forward TFLOP/s (``fwd_tflops``); the
    others were not reached and are left out.  _Empty when none is left."""
    out = []
    for i, r in enumerate(rows):
        where = f"{key} {i}"
        results = _get(r, "results", dict, where)
        _get(r, "label", str, where)
        _get(r, "causal", bool, where)
        for name, x in results.items():
            if not isinstance(x, dict):
                raise _Bad(f"{where}'s result {name!r} is a JSON {_json_type(x)}, not an object")
        if any(_number(x.get("fwd_tflops")) for x in results.values()):
            out.append(r)
    if not rows:
        raise _Empty(f"no {key}s")
    if not out:
        raise _Empty(f"none of its {len(rows)} {what}s has a forward TFLOP/s (fwd_tflops) in its results "
                     f"(none ran)")
    return out


@_kind("a mods_bench.py result", "an object whose 'cases' have a 'label', 'causal' and 'results'")
def _mods_cases(data) -> list[dict]:
    return _ran(_get(data, "cases", list, "the file"), "case", "case")


@_kind("a varlen_bench.py result", "an object whose 'rows' (ragged batches) have a 'label', 'causal' and "
       "'results'")
def _varlen_rows(data) -> list[dict]:
    return _ran(_get(data, "rows", list, "the file"), "row", "problem")


def _labels(rows: list[dict]) -> list[str]:
    return [r["label"] + (" causal" if r["causal"] and "causal" not in r["label"] else "") for r in rows]


def mods(paths: list[str], out_dir: str | Path, title: str = "") -> list[Path]:
    """Forward and forward+backward TFLOP/s per score-mod case, every backend that ran."""
    cases = [c for p in paths for c in _load(p, _mods_cases)]
    plt = _plt()
    backends = list(dict.fromkeys(b for c in cases for b, r in c["results"].items() if r.get("fwd_tflops")))
    fig, axes = _grid(plt, 2, w=max(6.0, 0.45 * len(cases)), h=4.0, ncols=1)
    labels = _labels(cases)
    for ax, metric in zip(axes, ("fwd", "fwdbwd")):
        series = {b: [_number(c["results"].get(b, {}).get(f"{metric}_tflops")) for c in cases] for b in backends}
        _bars(ax, labels, series, f"TFLOP/s, {'forward' if metric == 'fwd' else 'forward+backward'}")
    return [_finish(plt, fig, axes, f"score mods{' - ' + title if title else ''}", Path(out_dir) / "mods.png")]


def varlen(paths: list[str], out_dir: str | Path, title: str = "") -> list[Path]:
    """Forward and forward+backward TFLOP/s (useful FLOPs) per ragged-batch problem."""
    rows = [r for p in paths for r in _load(p, _varlen_rows)]
    plt = _plt()
    backends = list(dict.fromkeys(b for r in rows for b, x in r["results"].items() if x.get("fwd_tflops")))
    fig, axes = _grid(plt, 2, w=max(6.0, 0.6 * len(rows)), h=4.0, ncols=1)
    labels = _labels(rows)
    for ax, (metric, name) in zip(axes, (("fwd", "forward"), ("fwd_bwd", "forward+backward"))):
        series = {b: [_number(r["results"].get(b, {}).get(f"{metric}_tflops")) for r in rows] for b in backends}
        _bars(ax, labels, series, f"TFLOP/s (useful FLOPs), {name}")
    return [_finish(plt, fig, axes, f"ragged batches{' - ' + title if title else ''}", Path(out_dir) / "varlen.png")]


@_kind("a decode_bench.py result", "an object whose 'rows' have a 'batch', 'seqlen_q', 'cache_len', 'causal' "
       "and 'results'")
def _decode_rows(data) -> list[dict]:
    rows = _get(data, "rows", list, "the file")
    for i, r in enumerate(rows):
        where = f"row {i}"
        for k in ("batch", "seqlen_q", "cache_len"):
            _get(r, k, int, where)
        _get(r, "causal", bool, where)
        for name, x in _get(r, "results", dict, where).items():
            if not isinstance(x, dict):
                raise _Bad(f"{where}'s result {name!r} is a JSON {_json_type(x)}, not an object")
    if not rows:
        raise _Empty("no rows")
    if not any(_number(x.get("pct_of_copy")) for r in rows for n, x in r["results"].items() if n != "copy"):
        raise _Empty("no result has a share of the copy's bandwidth (pct_of_copy)")
    return rows


def decode(paths: list[str], out_dir: str | Path, title: str = "") -> list[Path]:
    """Achieved bandwidth as % of a device copy against cache length, per (batch, seqlen_q)."""
    rows = [r for p in paths for r in _load(p, _decode_rows)]
    plt = _plt()
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["batch"], r["seqlen_q"], r["causal"]), []).append(r)
    fig, axes = _grid(plt, len(groups))
    for ax, ((b, sq, causal), rs) in zip(axes, sorted(groups.items())):
        rs = sorted(rs, key=lambda r: r["cache_len"])
        names = list(dict.fromkeys(n for r in rs for n in r["results"] if n != "copy"))
        for n in names:
            pts = [(r["cache_len"], _number(r["results"][n].get("pct_of_copy"))) for r in rs
                   if n in r["results"] and _number(r["results"][n].get("pct_of_copy"))]
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

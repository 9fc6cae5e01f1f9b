"""flashgen.iomodel (HBM bytes model, exact visible-pair counts) and the ncu CSV parsing
of benchmarks/ncu_io.py, on CPU."""

import importlib.util
import itertools
from pathlib import Path

import pytest
import torch

from flashgen import iomodel
from flashgen.iomodel import Problem, fmt_bytes

MiB = 2 ** 20


# ---------------------------------------------------------------------------------
# The table the issue asks for: one head, forward, fp16, d 64, tiles of 128

@pytest.mark.parametrize("n, naive, tiled", [(1024, "8.5 MiB", "2.3 MiB"), (4096, "130 MiB", "33 MiB"),
                                             (16384, "2 GiB", "516 MiB")])
def test_forward_table_as_printed(n, naive, tiled):
    p = Problem(n, n, 64, dtype_bytes=2)
    assert fmt_bytes(iomodel.naive_forward(p).total_bytes) == naive
    assert fmt_bytes(iomodel.tiled_forward(p, 128).total_bytes) == tiled
    row = iomodel.forward_table([n], 64, 128)[0]
    assert fmt_bytes(row["naive_fwd_bytes"]) == naive and fmt_bytes(row["tiled_fwd_bytes"]) == tiled


def test_forward_bytes_exactly():
    # N = 1024, d = 64, fp16: Q, K, V, O are 128 KiB each; S and P 2 MiB each
    p = Problem(1024, 1024, 64)
    assert iomodel.naive_forward(p).total_bytes == 2 * 128 * 1024 + 4 * 2 * MiB + 2 * 128 * 1024  # 8.5 MiB
    assert iomodel.naive_forward(p).total_bytes == 8.5 * MiB
    # Q once, K and V once per each of the 8 query tiles, O once, LSE (fp32) once
    assert iomodel.tiled_forward(p, 128).total_bytes == 128 * 1024 + 8 * 2 * 128 * 1024 + 128 * 1024 + 4 * 1024
    t = iomodel.tiled_forward(p, 128)
    assert t.read_bytes == 128 * 1024 + 16 * 128 * 1024 and t.write_bytes == 128 * 1024 + 4096


def test_cli_prints_the_table():
    from typer.testing import CliRunner

    from flashgen.cli import app

    r = CliRunner(env={"COLUMNS": "250"}).invoke(app, ["iomodel"])
    assert r.exit_code == 0, r.output
    lines = {ln.split("│")[1].strip(): ln for ln in r.output.splitlines() if ln.count("│") > 3}
    for n, naive, tiled in (("1,024", "8.5 MiB", "2.3 MiB"), ("4,096", "130 MiB", "33 MiB"),
                            ("16,384", "2 GiB", "516 MiB")):
        cells = [c.strip() for c in lines[n].split("│")]
        assert cells[2:4] == [naive, tiled], lines[n]
    assert "BLOCK_M" in r.output and "256" in r.output  # the tile-size table
    r = CliRunner().invoke(app, ["iomodel", "--seqlen", "10,x"])
    assert r.exit_code == 2 and "--seqlen" in r.output
    # a length past what the model walks tile by tile is refused at once, not run out of memory
    r = CliRunner(env={"COLUMNS": "250"}).invoke(app, ["iomodel", "--seqlen", "99999999999999999999"])
    assert r.exit_code == 2 and "at most 16,777,216" in r.output


def test_fmt_bytes():
    assert [fmt_bytes(x) for x in (512, 2048, 1536 * 1024, 10 * MiB, 1023.6 * MiB, 2 ** 30, 3.25 * 2 ** 30)] == \
        ["512 B", "2 KiB", "1.5 MiB", "10 MiB", "1024 MiB", "1 GiB", "3.2 GiB"]


# ---------------------------------------------------------------------------------
# Backward, against hand counts

def test_naive_backward_by_hand():
    # seqlen 4, d = dv = 2, fp16: Q, K, V, O, dO are 16 B each; S-sized matrices 32 B; delta 16 B
    c = iomodel.naive_backward(Problem(4, 4, 2))
    # dV = P^T dO: P 32 + dO 16 | dP = dO V^T: 16 + 16 | delta: dO 16 + O 16 |
    # dS: P 32 + dP 32 + delta 16 | dQ: dS 32 + K 16 | dK: dS 32 + Q 16
    assert c.read_bytes == (32 + 16) + (16 + 16) + (16 + 16) + (32 + 32 + 16) + (32 + 16) + (32 + 16) == 288
    # dV 16, dP 32, delta 16, dS 32, dQ 16, dK 16
    assert c.write_bytes == 16 + 32 + 16 + 32 + 16 + 16 == 128


def test_tiled_backward_by_hand():
    p = Problem(4, 4, 2)
    dq = iomodel.tiled_bwd_dq(p, 2, 2)
    # Q, dO, O 48 + LSE 16 + (2 query blocks x 4 key rows x (2 + 2) x 2 B) = 64
    assert dq.read_bytes == 48 + 16 + 64 and dq.write_bytes == 16 + 16  # dQ, delta
    kv = iomodel.tiled_bwd_dkdv(p, 2, 2)
    # K, V 32 + 2 key blocks x 4 query rows x ((2 + 2) x 2 B + LSE, delta 8 B)
    assert kv.read_bytes == 32 + 2 * 4 * 8 + 2 * 4 * 8 and kv.write_bytes == 32
    both = iomodel.tiled_backward(p, 2, 2, 2, 2)
    assert both.total_bytes == dq.total_bytes + kv.total_bytes == 352
    # causal: query block 0 sees key block 0 only, key block 1 is seen by query block 1 only
    pc = Problem(4, 4, 2, causal=True)
    assert iomodel.key_rows_per_query_block(pc, 2, 2) == [2, 4]
    assert iomodel.query_rows_per_key_block(pc, 2, 2) == [4, 2]
    assert iomodel.tiled_bwd_dq(pc, 2, 2).read_bytes == 48 + 16 + 6 * 4 * 2


def test_gqa_counts_kv_per_kv_head_in_dkdv():
    p = Problem(256, 256, 64, batch=2, num_heads=8, num_kv_heads=2)
    kv = iomodel.tiled_bwd_dkdv(p, 64, 128)
    terms = {t.what: t.bytes for t in kv.terms}
    assert terms["K, V"] == 2 * 2 * 256 * 128 * 2 and terms["dK, dV"] == terms["K, V"]
    assert terms["Q, dO per key block"] == 2 * 8 * (2 * 256) * 128 * 2  # every query head, twice


def _brute_rows(p, bm, bn, transpose=False):
    """Rows the kernels load per block: the visited tiles are those with a visible pair."""
    vis = _visible(p)
    if transpose:
        vis = vis.T
        bm, bn = bn, bm
    outer, inner = vis.shape
    out = []
    for o0 in range(0, outer, bm):
        rows = 0
        for i0 in range(0, inner, bn):
            if vis[o0:o0 + bm, i0:i0 + bn].any():
                rows += min(bn, inner - i0)
        out.append(rows)
    return out


def _visible(p):
    from flashgen.masks import mask_bounds

    _, lo, hi = mask_bounds(p.seqlen_q, p.seqlen_k, causal=p.causal, window=p.window)
    rel = torch.arange(p.seqlen_k)[None, :] - torch.arange(p.seqlen_q)[:, None]
    return (rel >= lo) & (rel <= hi)


@pytest.mark.parametrize("sq, sk, causal, window, bm, bn", [
    (300, 200, True, (-1, -1), 64, 32), (200, 300, True, (-1, -1), 64, 32), (257, 257, False, (-1, -1), 128, 64),
    (500, 500, False, (100, 0), 64, 64), (300, 460, False, (37, 5), 32, 64), (128, 512, True, (64, -1), 64, 128),
])
def test_block_ranges_match_the_visited_tiles(sq, sk, causal, window, bm, bn):
    p = Problem(sq, sk, 64, causal=causal, window=window)
    assert iomodel.key_rows_per_query_block(p, bm, bn) == _brute_rows(p, bm, bn)
    assert iomodel.query_rows_per_key_block(p, bm, bn) == _brute_rows(p, bm, bn, transpose=True)


def test_tradeoff_bytes_fall_as_block_m_grows():
    rows = iomodel.block_m_tradeoff(16384, 64, [16, 32, 64, 128, 256])
    bytes_ = [r["tiled_fwd_bytes"] for r in rows]
    assert bytes_ == sorted(bytes_, reverse=True) and len(set(bytes_)) == 5
    assert fmt_bytes(rows[3]["tiled_fwd_bytes"]) == "516 MiB"
    assert [r["tile_smem_bytes"] for r in rows] == [(bm * 64 + 2 * 64 * 64) * 2 for bm in (16, 32, 64, 128, 256)]


def test_minimum_is_below_every_tiling():
    p = Problem(4096, 4096, 64, num_heads=4)
    assert iomodel.minimum_forward(p).total_bytes == 4 * (4 * 4096 * 64 * 2 + 4096 * 4)
    for bm in (16, 64, 128, 4096):
        assert iomodel.minimum_forward(p).total_bytes <= iomodel.tiled_forward(p, bm).total_bytes
    # one query tile covering everything reads K and V once: the minimum exactly
    assert iomodel.tiled_forward(p, 4096).total_bytes == iomodel.minimum_forward(p).total_bytes


# ---------------------------------------------------------------------------------
# Exact visible pairs and FLOPs

@pytest.mark.parametrize("sq, sk", [(1, 1), (5, 3), (3, 5), (17, 17), (64, 33), (33, 64)])
def test_visible_pairs_brute_force(sq, sk):
    for causal, window in itertools.product((False, True), ((-1, -1), (0, 0), (3, -1), (-1, 2), (4, 1), (100, 7))):
        p = Problem(sq, sk, 8, causal=causal, window=window)
        assert iomodel.visible_pairs(sq, sk, causal=causal, window=window) == int(_visible(p).sum()), (causal, window)


def test_forward_flops():
    b, h, n, d = 2, 3, 1000, 64
    assert iomodel.forward_flops(b, h, n, n, d) == 4 * b * h * n * n * d
    assert iomodel.forward_flops(b, h, n, n, d, causal=True) == 2 * b * h * n * n * d  # the convention: halved
    pairs = iomodel.visible_pairs(n, 700, window=(128, 0))
    assert pairs == int(_visible(Problem(n, 700, d, window=(128, 0))).sum())
    assert iomodel.forward_flops(b, h, n, 700, d, window=(128, 0)) == 4 * b * h * d * pairs
    # exact window count, not the halved convention, when a window is given with causal
    assert iomodel.forward_flops(1, 1, 8, 8, 8, causal=True, window=(-1, 0)) != \
        iomodel.forward_flops(1, 1, 8, 8, 8, causal=True)


# ---------------------------------------------------------------------------------
# ncu CSV parsing (benchmarks/ncu_io.py)

def _ncu_io():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "ncu_io.py"
    spec = importlib.util.spec_from_file_location("ncu_io", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


#: Recorded on the H200 (ncu 2025.3.1, --csv --print-units base, metrics
#: dram__bytes_read.sum and dram__bytes_write.sum): a fill kernel before any region, then
#: three regions: attn_fwd (b1 h1 N8192 d64 fp16), attn_bwd_dq + attn_bwd_dkdv, and the
#: naive forward (scale, S = QK^T, softmax, PV); the setup launches between them removed.
NCU_SAMPLE = r"""==WARNING== Note: Running with unmodified GPU clocks. If not controlled otherwise, profiling results may be inconsistent.
==PROF== Connected to process 509 (/usr/bin/python3.12)
==PROF== Disconnected from process 509
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","509","python3.12","127.0.0.1","void at::vectorized_elementwise_kernel<4, at::FillFunctor<int>, std::array<char *, 1>>(int, T2, T3)","1","7","(128, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","4,352"
"0","509","python3.12","127.0.0.1","void at::vectorized_elementwise_kernel<4, at::FillFunctor<int>, std::array<char *, 1>>(int, T2, T3)","1","7","(128, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","0"
"5","509","python3.12","127.0.0.1","ncu_region_begin","1","7","(128, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","2,816"
"5","509","python3.12","127.0.0.1","ncu_region_begin","1","7","(128, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","0"
"6","509","python3.12","127.0.0.1","attn_fwd","1","7","(256, 1, 1)","(64, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","3,202,048"
"6","509","python3.12","127.0.0.1","attn_fwd","1","7","(256, 1, 1)","(64, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","0"
"7","509","python3.12","127.0.0.1","ncu_region_end","1","7","(128, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","2,816"
"7","509","python3.12","127.0.0.1","ncu_region_end","1","7","(128, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","0"
"13","509","python3.12","127.0.0.1","ncu_region_begin","1","7","(128, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","2,816"
"13","509","python3.12","127.0.0.1","ncu_region_begin","1","7","(128, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","0"
"14","509","python3.12","127.0.0.1","attn_bwd_dq","1","7","(256, 1, 1)","(64, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","5,299,712"
"14","509","python3.12","127.0.0.1","attn_bwd_dq","1","7","(256, 1, 1)","(64, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","0"
"15","509","python3.12","127.0.0.1","attn_bwd_dkdv","1","7","(256, 1, 1)","(64, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","4,298,496"
"15","509","python3.12","127.0.0.1","attn_bwd_dkdv","1","7","(256, 1, 1)","(64, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","0"
"16","509","python3.12","127.0.0.1","ncu_region_end","1","7","(128, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","2,816"
"16","509","python3.12","127.0.0.1","ncu_region_end","1","7","(128, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","0"
"21","509","python3.12","127.0.0.1","ncu_region_begin","1","7","(128, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","3,072"
"21","509","python3.12","127.0.0.1","ncu_region_begin","1","7","(128, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","0"
"22","509","python3.12","127.0.0.1","void at::vectorized_elementwise_kernel<8, at::AUnaryFunctor<c10::Half, c10::Half, c10::Half, binary_internal::MulFunctor<float>>, std::array<char *, 2>>(int, T2, T3)","1","7","(128, 1, 1)","(512, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","1,054,464"
"22","509","python3.12","127.0.0.1","void at::vectorized_elementwise_kernel<8, at::AUnaryFunctor<c10::Half, c10::Half, c10::Half, binary_internal::MulFunctor<float>>, std::array<char *, 2>>(int, T2, T3)","1","7","(128, 1, 1)","(512, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","0"
"23","509","python3.12","127.0.0.1","nvjet_sm90_hsh_256x128_64x4_1x2_h_bz_coopA_TNT","1","7","(384, 1, 1)","(2, 66, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","3,018,752"
"23","509","python3.12","127.0.0.1","nvjet_sm90_hsh_256x128_64x4_1x2_h_bz_coopA_TNT","1","7","(384, 1, 1)","(2, 66, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","105,036,544"
"24","509","python3.12","127.0.0.1","void at::<unnamed>::cunn_SoftMaxForwardReg<c10::Half, float, c10::Half, at::<unnamed>::SoftMaxForwardEpilogue, long, 8>(T3 *, const T1 *, T5)","1","7","(1024, 1, 1)","(8192, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","134,238,208"
"24","509","python3.12","127.0.0.1","void at::<unnamed>::cunn_SoftMaxForwardReg<c10::Half, float, c10::Half, at::<unnamed>::SoftMaxForwardEpilogue, long, 8>(T3 *, const T1 *, T5)","1","7","(1024, 1, 1)","(8192, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","114,080,256"
"25","509","python3.12","127.0.0.1","nvjet_sm90_hsh_64x80_64x11_1x4_h_bz_NNT","1","7","(384, 1, 1)","(4, 26, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","135,286,784"
"25","509","python3.12","127.0.0.1","nvjet_sm90_hsh_64x80_64x11_1x4_h_bz_NNT","1","7","(384, 1, 1)","(4, 26, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","23,040"
"26","509","python3.12","127.0.0.1","ncu_region_end","1","7","(128, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","2,816"
"26","509","python3.12","127.0.0.1","ncu_region_end","1","7","(128, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","0"
"""


def test_parse_recorded_ncu_csv():
    m = _ncu_io()
    launches = m.parse_ncu_csv(NCU_SAMPLE)
    assert [ln["id"] for ln in launches] == [0, 5, 6, 7, 13, 14, 15, 16, 21, 22, 23, 24, 25, 26]
    fwd = launches[2]
    assert fwd["kernel"] == "attn_fwd"
    assert fwd["metrics"] == {"dram__bytes_read.sum": 3202048, "dram__bytes_write.sum": 0}
    # a templated name with commas inside the quotes stays one field
    assert launches[0]["kernel"].startswith("void at::vectorized_elementwise_kernel<4, at::FillFunctor<int>")
    assert m._short(launches[11]["kernel"]) == "at::cunn_SoftMaxForwardReg"

    regions = m.split_regions(launches)
    assert [[m._short(ln["kernel"]) for ln in r] for r in regions] == [
        ["attn_fwd"], ["attn_bwd_dq", "attn_bwd_dkdv"],
        ["at::vectorized_elementwise_kernel", "nvjet_sm90_hsh_256x128_64x4_1x2_h_bz_coopA_TNT",
         "at::cunn_SoftMaxForwardReg", "nvjet_sm90_hsh_64x80_64x11_1x4_h_bz_NNT"]]
    bwd = m.region_bytes(regions[1])
    assert bwd["read_bytes"] == 5299712 + 4298496 and bwd["write_bytes"] == 0 and bwd["launches"] == 2
    assert bwd["kernels"]["attn_bwd_dkdv"]["read_bytes"] == 4298496
    naive = m.region_bytes(regions[2])
    assert naive["read_bytes"] == 1054464 + 3018752 + 134238208 + 135286784
    assert naive["write_bytes"] == 105036544 + 114080256 + 23040
    assert naive["total_bytes"] == naive["read_bytes"] + naive["write_bytes"]


def test_ncu_parsing_units_and_errors():
    m = _ncu_io()
    head = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
            '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"\n')

    def row(i, k, metric, unit, value):
        return (f'"{i}","1","python3","h","{k}","1","7","(128, 1, 1)","(1, 1, 1)","0","9.0",'
                f'"Command line profiler metrics","{metric}","{unit}","{value}"\n')
    text = ("program output\n==PROF== Connected\n" + head + row(0, "ncu_region_begin", "dram__bytes_read.sum", "byte", "0")
            + row(1, "k(float*)", "dram__bytes_read.sum", "Mbyte", "1.50")
            + row(1, "k(float*)", "dram__bytes_write.sum", "Kbyte", "2,000")
            + row(2, "ncu_region_end", "dram__bytes_read.sum", "byte", "n/a") + "==PROF== Disconnected\n")
    launches = m.parse_ncu_csv(text)
    assert launches[1]["metrics"] == {"dram__bytes_read.sum": 1.5e6, "dram__bytes_write.sum": 2e6}
    assert launches[2]["metrics"] == {}  # n/a is no number
    (region,) = m.split_regions(launches)
    assert m.region_bytes(region)["total_bytes"] == 3_500_000
    with pytest.raises(ValueError, match="header"):
        m.parse_ncu_csv("==ERROR== the profiler could not start\n")
    unended = head + row(0, "ncu_region_begin", "dram__bytes_read.sum", "byte", "0")
    with pytest.raises(ValueError, match="no end"):
        m.split_regions(m.parse_ncu_csv(unended))
    with pytest.raises(ValueError, match="without a begin"):
        m.split_regions(m.parse_ncu_csv(head + row(0, "ncu_region_end", "dram__bytes_read.sum", "byte", "0")))

"""benchmarks/ncu_compare.py's parsing of Nsight Compute's raw CSV page."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import ncu_compare  # noqa: E402

RAW = '''==PROF== Connected to process 7 (/usr/bin/python3.12)
flashgen says hello
==PROF== Profiling "attn_fwd" - 0: 0%....50%....100% - 9 passes
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","dram__bytes.sum","gpu__time_duration.sum","lts__t_sector_hit_rate.pct"
"","","","","","","","Mbyte","usecond","%"
"0","7","python3.12","h","attn_fwd","1","7","326.10","120.30","71.5"
"1","7","python3.12","h","void cudnn::fusion::compute<128, (int)2>(Params)","1","7","1,259.00","n/a","80"
"2","7","python3.12","h","truncated"
'''


def test_parse_raw_csv_reads_each_kernel_with_its_units():
    rows = ncu_compare.parse_raw_csv(RAW)
    assert [r["kernel"] for r in rows] == ["attn_fwd", "void cudnn::fusion::compute<128, (int)2>(Params)"]
    assert rows[0]["dram__bytes.sum"] == pytest.approx(326.10e6)
    assert rows[0]["gpu__time_duration.sum"] == pytest.approx(120.30e3)  # ns
    assert rows[0]["lts__t_sector_hit_rate.pct"] == pytest.approx(71.5)
    # thousands separators are read, a value ncu could not give is None
    assert rows[1]["dram__bytes.sum"] == pytest.approx(1259.0e6)
    assert rows[1]["gpu__time_duration.sum"] is None
    # fields that are not metrics stay out
    assert "Stream" not in rows[0] and "Process ID" not in rows[0]


def test_parse_raw_csv_without_a_header_is_empty():
    assert ncu_compare.parse_raw_csv("==PROF== no kernels were profiled\n") == []


def test_short_name_drops_arguments_and_cuts():
    assert ncu_compare.short_name("void cudnn::fusion::compute<128, (int)2>(Params)") == "void cudnn::fusion::compute"
    assert ncu_compare.short_name("attn_fwd") == "attn_fwd"
    long = "x" * 60
    assert ncu_compare.short_name(long, width=10) == "xxxxxxx..."

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


def test_gluon_config_reads_knobs_and_defaults_the_register_split():
    c = ncu_compare.gluon_config("BLOCK_M=128,num_consumers=1,BLOCK_N=64,num_stages=3,persistent=3,ctas_per_sm=2")
    assert (c.BLOCK_M, c.num_consumers, c.BLOCK_N, c.num_stages, c.persistent, c.ctas_per_sm) == (128, 1, 64, 3, 3, 2)
    assert (c.consumer_regs, c.producer_regs) == (232, 24)  # two one-consumer programs per SM
    assert ncu_compare.gluon_config("num_consumers=3,consumer_regs=152").consumer_regs == 152
    with pytest.raises(TypeError):
        ncu_compare.gluon_config("BLOCK_Q=64")


def test_the_gluon_backend_needs_a_config_and_a_forward(capsys):
    for argv in (["--shape", "1,2,2,64,64", "--backend", "gluon"],
                 ["--shape", "1,2,2,64,64", "--kind", "fwdbwd", "--gluon-config", "BLOCK_M=64"]):
        with pytest.raises(SystemExit):
            ncu_compare.main(argv)
        assert "give --gluon-config and --kind fwd" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # its launch knows the causal and unmasked modes only
        ncu_compare.main(["--shape", "1,2,2,64,64,window=8", "--gluon-config", "BLOCK_M=64"])
    assert "no window=, no sinks" in capsys.readouterr().err

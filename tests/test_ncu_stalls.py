"""benchmarks/ncu_stalls.py's parsing of Nsight Compute's source and details pages."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import ncu_stalls  # noqa: E402

SOURCE = """==PROF== Connected to process 1
"# Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","stall_long_sb","stall_wait","stall_barrier (Not Issued)"
"0x10","SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R2+URZ], R3 ;","10","8","10","0","0"
"0x18","@!P0  BRA 0x90 ;","50","50","50","0","0"
"0x20","HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT ;","10","2","0","10","0"
"0x30","WARPGROUP.DEPBAR.LE gsb0, 0x1 ;","20","20","0","20","0"
"0x40","MUFU.EX2 R5, R6 ;","8","4","0","8","0"
"0x50","IMAD R1, R2, R3, R4 ;","2","0","0","2","0"
"0x60","BAR.SYNC.DEFER_BLOCKING 0x1 ;","0","0","0","0","0"
"0x70","NOP ;","100","100","0","0","100"
"""

DETAILS = '''"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","1","python3","h","attn_fwd","1","7","(256, 1, 1)","(2048, 1, 1)","0","9.0","GPU Speed Of Light Throughput","Duration","us","145.2"
"0","1","python3","h","attn_fwd","1","7","(256, 1, 1)","(2048, 1, 1)","0","9.0","GPU Speed Of Light Throughput","Memory Throughput","%","20.1"
'''


def test_opcode_classes():
    assert ncu_stalls.opcode_class("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R2], R3 ;") == "mbarrier wait"
    assert ncu_stalls.opcode_class("HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ ;") == "wgmma issue"
    assert ncu_stalls.opcode_class("WARPGROUP.DEPBAR.LE gsb0, 0x1 ;") == "wgmma wait"
    assert ncu_stalls.opcode_class("MUFU.EX2 R5, R6 ;") == "exp2 / rcp (MUFU)"
    assert ncu_stalls.opcode_class("IMAD R1, R2, R3, R4 ;") == "other"


def test_summary_of_a_source_page():
    header, rows = ncu_stalls.parse_source_csv(SOURCE)
    assert len(rows) == 8
    s = ncu_stalls.summarize(header, rows, top=2)
    # the parked padding warps (the NOP after BAR.SYNC 0x1) are their own share
    assert s["total_samples"] == 200 and s["parked_pct"] == 50.0
    # the rest by opcode class, a wait loop's branch counted as the mbarrier wait it is
    assert s["by_class"] == {"mbarrier wait": 60.0, "wgmma wait": 20.0, "wgmma issue": 10.0,
                             "exp2 / rcp (MUFU)": 8.0, "other": 2.0}
    assert s["reasons"] == {"long_sb": 60.0, "wait": 40.0}
    assert [t["address"] for t in s["top"]] == ["0x18", "0x30"]
    assert s["top"][0]["not_issued_pct"] == 50.0 and s["top"][0]["after"].startswith("SYNCS.PHASECHK")


def test_a_page_without_a_table_is_an_error():
    with pytest.raises(ValueError, match="no source table"):
        ncu_stalls.parse_source_csv("==PROF== nothing profiled\n")


def test_details_rows():
    """The profiled kernel's name first (a cudnn: case's kernel is cuDNN's choice), then the
    wanted metrics."""
    assert ncu_stalls.details_lines(DETAILS) == ["kernel: attn_fwd", "GPU Speed Of Light Throughput / Duration: 145.2 us"]


def test_offline_summary_of_a_directory(tmp_path, capsys):
    (tmp_path / "fwd_case.source.csv").write_text(SOURCE)
    assert ncu_stalls.main(["--from", str(tmp_path), "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "== fwd_case" in out and "parked warps: 50.0%" in out and "long_sb 60.0" in out
    with pytest.raises(SystemExit):
        ncu_stalls.main(["--from", str(tmp_path / "missing")])


# A wait loop whose branch is not next to its try-wait, a fence before a wgmma issue, and
# the not-issued column listed first; no parked warps in a warp-specialized kernel.
SOURCE2 = """"# Address","Source","Warp Stall Sampling (Not-issued Samples)","Warp Stall Sampling (All Samples)"
"0x10","USETMAXREG.DEALLOC.CTAPOOL 0x18 ;","0","1"
"0x20","SYNCS.PHASECHK.TRANS64.TRYWAIT P2, [UR7+0x20168], RZ ;","1","1"
"0x30","UIADD3.64 UR32, UR36, 0x204, URZ ;","0","1"
"0x40","ISETP.GE.AND P0, PT, R3, 0x40, PT ;","0","1"
"0x50","@!P2  BRA 0x7f21237b2b10 ;","30","40"
"0x60","ISETP.NE.AND P2, PT, R1, RZ, PT ;","0","1"
"0x70","@!P2  BRA 0x100 ;","5","5"
"0x80","WARPGROUP.ARRIVE ;","0","50"
"""


def test_wait_loops_and_columns_of_another_layout():
    header, rows = ncu_stalls.parse_source_csv(SOURCE2)
    s = ncu_stalls.summarize(header, rows, top=3)
    assert s["total_samples"] == 100  # the all-samples column, though listed second
    # the branch on P2 after the try-wait is its wait loop; the one after P2 was rewritten is not
    assert s["by_class"]["mbarrier wait"] == 41.0 and s["by_class"]["other"] == 9.0
    assert s["by_class"]["wgmma issue"] == 50.0
    assert s["top"][1]["sass"].startswith("@!P2  BRA 0x7f") and s["top"][1]["after"].startswith("SYNCS")
    assert not s["parked_found"] and s["parked_pct"] == 0.0


def test_offline_summary_reports_an_unreadable_page(tmp_path, capsys):
    (tmp_path / "good.source.csv").write_text(SOURCE)
    (tmp_path / "bad.source.csv").write_text("==PROF== no kernel profiled\n")
    assert ncu_stalls.main(["--from", str(tmp_path), "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert "== bad" in out and "no source table" in out and "== good" in out
    assert (tmp_path / "o" / "stalls.json").exists()


@pytest.mark.parametrize("kind, kernel, profiled", [
    ("fwd", "attn_fwd", True), ("fwd", "attn_bwd_preprocess", False), ("bwd", "attn_bwd", True),
    ("bwd", "attn_bwd_convert", False), ("gluon", "attn_fwd", True), ("gluon", "attn_bwd", False),
    ("cudnn", "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x128x128_4x1x1_kernel0_0", True),
    ("cudnn", "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_7_64x128x128_4x1x1_kernel0_0", False),
    ("cudnn", "attn_fwd", False),
    ("cudnn-bwd", "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_7_64x128x128_4x1x1_kernel0_0", True),
    ("cudnn-bwd", "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x128x128_4x1x1_kernel0_0", False),
    ("cudnn-bwd", "compute_dot_do_o", False), ("cudnn-bwd", "convert_dq_to_16bits", False)])
def test_each_case_kind_profiles_its_own_kernel(kind, kernel, profiled):
    """ncu's --kernel-name regex of each case kind (a gluon: case is one Gluon forward
    config, a cudnn: case SDPA's cuDNN forward, a cudnn-bwd: case its backward's main
    kernel) picks that kernel and no other of the call."""
    import re

    assert bool(re.search(ncu_stalls.KERNEL[kind], kernel)) is profiled


def test_an_unknown_case_kind_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="kind must be one of"):
        ncu_stalls.run_case("flex:1,1,1,128,64", tmp_path, "ncu")


@pytest.mark.parametrize("case, problem", [
    ("fwd:32,16,16,512,128,causal", None), ("bwd:4,16,4,4096,128,window=256,sinks", None),
    ("gluon:32,16,16,512,128,causal@num_consumers=2,BLOCK_N=128", None), ("cudnn:32,16,16,512,128,causal", None),
    ("flex:1,1,1,128,64", "kind must be one of"),
    ("fwd:32,16,16,512,128@num_consumers=2", "only a gluon: case takes @"),
    ("cudnn:32,16,16,512,128@BLOCK_N=64", "only a gluon: case takes @"),
    ("gluon:32,16,16,512,128,causal", "names its config"),
    ("gluon:32,16,16,512,128,window=128@BLOCK_N=64", "not ['window=128']"),
    ("cudnn:32,16,16,512,128,causal,sinks", "not ['sinks']"), ("cudnn-bwd:4,16,16,4096,128", None),
    ("cudnn-bwd:4,16,16,4096,128,window=64", "not ['window=64']")])
def test_a_case_that_would_profile_something_else_is_refused_before_ncu_starts(case, problem):
    """A gluon: or cudnn: case runs causal or unmasked only, and only a gluon: case takes a
    config: anything else would be dropped silently in the profiled child."""
    why = ncu_stalls.case_problem(case)
    assert (why is None) if problem is None else (problem in why), why

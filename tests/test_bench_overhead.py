"""benchmarks/overhead.py --mock (its CPU mode): every kernel launch a no-op, the
flash-decoding form's included, and the raw launch the kernels the op launches."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_overhead_mock_stubs_the_flash_decoding_forms_launches(tmp_path):
    """seqlen_q 1 over 4096 keys takes the flash-decoding form (decode + combine
    kernels): under --mock neither runs (each ran in the interpreter, seconds a call),
    and the raw launch replays both."""
    out = tmp_path / "o.json"
    r = subprocess.run([sys.executable, "benchmarks/overhead.py", "--mock", "--shapes", "1x4096,1x128", "-n", "20",
                        "-r", "1", "--out", str(out)], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                       capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [x["launches"] for x in rows] == [["attn_decode", "attn_decode_combine"], ["attn_fwd"]]
    for x in rows:
        assert 0 < x["us"]["raw launch"] < x["us"]["flashgen.attention"] < 2000, x
    assert "attn_decode + attn_decode_combine" in r.stdout

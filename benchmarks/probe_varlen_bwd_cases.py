"""The Gluon ragged-batch backward's default tile (head_dim 128, no mask, bf16, 4/2
heads) on seven ragged batches, each in its own process (a fault or hang is reported,
not inherited): one and two sequences of 256 tokens, one of 200, the five awkward
sequences of flashgen.bench.CHECK_VARLEN_LENS with LSE2 / delta loaded by TMA, by the
producer and by pointer (``row_load``), and five non-empty ones; each launch
synchronized (``stage_sync``) and its dQ, dK, dV compared with float64
(flashgen.bench.compare_varlen: error, torch's error, ratio).  On a failure, the first
failing case runs again under compute-sanitizer when the machine has it.

    PYTHONPATH=. python3 benchmarks/probe_varlen_bwd_cases.py      # GPU
"""
import dataclasses
import json
import os
import subprocess
import sys
import time

CASES = {
    "one_seq_256": dict(lq=[256], lk=[256], kw={}),
    "two_eq_256": dict(lq=[256, 256], lk=[256, 256], kw={}),
    "one_seq_200": dict(lq=[200], lk=[200], kw={}),
    "five": dict(lq=[150, 0, 61, 1, 37], lk=[61, 13, 150, 1, 0], kw={}),
    "five_ptr": dict(lq=[150, 0, 61, 1, 37], lk=[61, 13, 150, 1, 0], kw=dict(row_load="ptr")),
    "five_prod": dict(lq=[150, 0, 61, 1, 37], lk=[61, 13, 150, 1, 0], kw=dict(row_load="producer")),
    "nonempty": dict(lq=[150, 70, 61, 10, 37], lk=[61, 13, 150, 9, 40], kw={}),
}


def child(name):
    import torch
    from flashgen import bench, library
    from flashgen.families.gluon import bwd as B
    from flashgen.spec import KernelSpec
    c = CASES[name]
    spec = KernelSpec("bwd_varlen", "bfloat16", 128, 128, "none")
    q, k, v, do, cu_q, cu_k, mq, mk = bench.make_varlen_inputs(spec, c["lq"], c["lk"], 4, 2, seed=1)
    kw = bench._varlen_mask_kw(spec, dict(causal=False, window=(-1, -1)))
    o, lse = library.forward_varlen(q, k, v, cu_q, cu_k, mq, mk, kw["softmax_scale"], "none", -1, -1)
    torch.cuda.synchronize()
    cfg = dataclasses.replace(B.varlen_default_config(128, "bfloat16", "none"), **c["kw"])
    dq, dk, dv = B.attention_bwd_varlen(do, q, k, v, o, lse, cu_q, cu_k, mq, mk, softmax_scale=kw["softmax_scale"],
                                        win_left=-1, win_right=-1, mask="none", config=cfg, stage_sync=True)
    torch.cuda.synchronize()
    res = bench.compare_varlen({"dQ": dq, "dK": dk, "dV": dv}, q, k, v, do, cu_q, cu_k, kw=kw)
    print("RESULT", json.dumps({k2: [float(x) for x in v2] for k2, v2 in res.items()}))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in CASES:
        child(sys.argv[1])
        sys.exit(0)
    import argparse

    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    import torch

    if not torch.cuda.is_available():
        print("probe_varlen_bwd_cases.py: needs a CUDA GPU (sm_90); none is visible", file=sys.stderr)
        sys.exit(2)
    out = os.environ.get("OUT", "/tmp")
    san = None
    for p in ("/usr/local/cuda/bin/compute-sanitizer", "compute-sanitizer"):
        if subprocess.run(["which", p], capture_output=True).returncode == 0 or os.path.exists(p):
            san = p
            break
    fails = []
    t = time.time()
    procs = {n: subprocess.Popen([sys.executable, __file__, n], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True) for n in CASES}
    for name, pr in procs.items():
        try:
            text, _ = pr.communicate(timeout=max(1, 200 - (time.time() - t)))
            lines = text.strip().splitlines()
            res = [l for l in lines if l.startswith("RESULT")]
            msg = res[0] if res else " | ".join(l for l in lines[-4:])
            ok = pr.returncode == 0
        except subprocess.TimeoutExpired:
            pr.kill()
            ok, msg = False, "TIMEOUT"
        print(f"== {name}: {'ok' if ok else 'FAIL'} {time.time()-t:.0f}s {msg[:400]}", flush=True)
        if not ok:
            fails.append(name)
    if fails and san:
        name = fails[0]
        try:
            r = subprocess.run([san, "--tool", "memcheck", "--print-limit", "20", sys.executable, __file__, name],
                               capture_output=True, text=True, timeout=120)
            open(os.path.join(out, "sanitizer.txt"), "w").write(r.stdout + r.stderr)
            print("sanitizer:", "\n".join((r.stdout + r.stderr).splitlines()[:60]), flush=True)
        except subprocess.TimeoutExpired:
            print("sanitizer timeout")
    print("FAILS", fails, "sanitizer", san)
    sys.exit(1 if fails else 0)

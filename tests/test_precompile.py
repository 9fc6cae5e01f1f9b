"""KernelBenchmarker.precompile: a hung candidate is recorded as ``timeout`` and the
others still finish; a candidate that faults and takes its worker's CUDA context with
it fails alone (the compile-and-check function is replaced by a fake here)."""

import os
import time

import pytest

from flashgen.bench import KernelBenchmarker
from flashgen.spec import KernelSpec, TileConfig, Variant

SPEC = KernelSpec("fwd", "float16", 64, 64, "none")
VARIANTS = [Variant(SPEC, TileConfig(m, n, 4, s)) for m in (64, 128) for n in (32, 64) for s in (1, 2)]
HANG = VARIANTS[2].id
CRASH = VARIANTS[5].id


def fake_compile(variant, group):
    if variant.id == HANG:
        time.sleep(3600)
    if variant.id == CRASH:
        raise RuntimeError("ptxas died")
    time.sleep(0.05)
    return variant.id, None, {"check_ratio": 0.1}


def test_a_hung_candidate_times_out_and_the_rest_finish():
    bench = KernelBenchmarker(workers=2, compile_timeout_s=3)
    seen = []
    t0 = time.monotonic()
    out = bench.precompile(VARIANTS, progress=lambda vid, f: seen.append(vid), worker_fn=fake_compile)
    assert time.monotonic() - t0 < 60
    assert out[HANG].startswith("timeout")
    assert out[CRASH].startswith("launch_failed") and "ptxas died" in out[CRASH]
    assert all(out[v.id] is None for v in VARIANTS if v.id not in (HANG, CRASH))
    assert sorted(seen) == sorted(v.id for v in VARIANTS)  # each reported exactly once
    assert bench.check_ratios() == {v.id: 0.1 for v in VARIANTS if v.id not in (HANG, CRASH)}


_STARTED = []


def slow_start_compile(variant, group):
    """Each worker's first call takes 4 s (a worker process that is slow to come up:
    spawning imports torch, seconds on a loaded host), then 0.05 s per variant."""
    if not _STARTED:
        _STARTED.append(1)
        time.sleep(4)
    return fake_compile(variant, group)


def test_slow_worker_startup_is_not_a_timeout():
    """Futures queued while the workers start count as running in the executor; their
    clocks must not run before the pool has produced a result (the flake this fixed:
    variants queued behind a slow start were recorded as timeouts)."""
    bench = KernelBenchmarker(workers=2, compile_timeout_s=3)
    out = bench.precompile(VARIANTS, worker_fn=slow_start_compile)
    assert out[HANG].startswith("timeout")
    assert out[CRASH].startswith("launch_failed")
    assert all(out[v.id] is None for v in VARIANTS if v.id not in (HANG, CRASH)), out


FAULT = VARIANTS[1].id
_BROKEN = []


def faulting_compile(variant, group):
    """VARIANTS[1] faults as a kernel that leaves its process's CUDA context unusable
    does; every later call in that process then fails too (the state of a real one)."""
    lost = {"context_lost": True, "pid": os.getpid(), "t_done": time.monotonic()}
    if _BROKEN:
        return variant.id, "compile_failed: AcceleratorError: CUDA error: an illegal instruction was encountered", lost
    if variant.id == FAULT:
        _BROKEN.append(1)
        return variant.id, "compile_failed: RuntimeError: Triton Error [CUDA]: an illegal instruction was encountered", \
            lost
    time.sleep(0.05)
    return variant.id, None, {"check_ratio": 0.1}


@pytest.mark.parametrize("workers", [1, 2])
def test_a_fault_that_loses_the_cuda_context_fails_only_its_variant(workers):
    """The variants its worker checked after the fault are checked again in a fresh
    process, not recorded as failures of their own."""
    bench = KernelBenchmarker(workers=workers, compile_timeout_s=30)
    seen = []
    out = bench.precompile(VARIANTS, progress=lambda vid, f: seen.append(vid), worker_fn=faulting_compile)
    assert out[FAULT].startswith("compile_failed") and "CUDA context unusable" in out[FAULT]
    assert all(out[v.id] is None for v in VARIANTS if v.id != FAULT), out
    assert sorted(seen) == sorted(v.id for v in VARIANTS)  # each reported exactly once


def test_a_worker_says_when_a_failure_lost_its_cuda_context(monkeypatch):
    from flashgen import bench

    def boom(variant, group):
        raise RuntimeError("CUDA error: an illegal instruction was encountered")

    monkeypatch.setattr(bench, "check_variant_detail", boom)
    for lost in (True, False):
        monkeypatch.setattr(bench, "_cuda_context_lost", lambda lost=lost: lost)
        vid, failure, report = bench._precompile_one(VARIANTS[0])
        assert vid == VARIANTS[0].id and failure.startswith("compile_failed: RuntimeError: CUDA error")
        assert (report.get("context_lost"), report.get("pid")) == ((True, os.getpid()) if lost else (None, None))

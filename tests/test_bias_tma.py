"""The bias tile through a tensor descriptor (tma kernels, BIAS_TMA): which biases a
descriptor addresses (broadcast batch/head dims as extent 1), exactness of the three
kernels on that path against the float64 reference (broadcasts, boolean masks with
fully masked rows, seqlens off the block grid, GQA), the pointer fallback for biases
no descriptor addresses, and the compiled sm_90 kernels' shared memory against the
model."""

import pytest
import torch

from flashgen import arch, ops, reference, resources
from flashgen.spec import KernelSpec, TileConfig, Variant

F16 = torch.float16
SM90 = arch.by_sm("sm_90")
CFG = TileConfig(32, 16, 4, 2, tma=1)


def _inputs(b=2, h=4, hk=2, sq=40, sk=56, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, sq, d, generator=g).to(F16)
    k = torch.randn(b, hk, sk, d, generator=g).to(F16)
    v = torch.randn(b, hk, sk, d, generator=g).to(F16)
    do = torch.randn(b, h, sq, d, generator=g).to(F16)
    return q, k, v, do


@pytest.fixture
def descriptors(monkeypatch):
    """The bias descriptors the launches built (None: the pointer path)."""
    made = []
    real = ops.bias_descriptor
    monkeypatch.setattr(ops, "bias_descriptor", lambda *a: made.append(real(*a)) or made[-1])
    return made


def _run_all(q, k, v, do, bias, mask="none", lo=None, hi=None, cfg=CFG, cfg_dkdv=None):
    """Forward, dQ and dK/dV through ops with a tma config, and the float64 reference's."""
    b, h, sq, d = q.shape
    sk = k.shape[2]
    lo = -sq if lo is None else lo
    hi = sk if hi is None else hi
    scale = d ** -0.5
    m = ops.ScoreMods(bias=bias)
    kw = dict(softmax_scale=scale, mask=mask, diag_lo=lo, diag_hi=hi, mods=m)
    o, lse = ops.fwd(q, k, v, config=cfg, **kw)
    dq, dk, dv = ops.bwd(do, q, k, v, o, lse, config_dq=cfg, config_dkdv=cfg_dkdv or TileConfig(16, 32, 4, 2, tma=1),
                         **kw)
    ro, rlse, _ = reference.forward_bounds(q, k, v, scale, lo, hi, bias=bias)
    rdq, rdk, rdv = reference.backward_bounds(do, q, k, v, scale, lo, hi, bias=bias)
    return (o, lse, dq, dk, dv), (ro, rlse, rdq, rdk, rdv)


def _assert_close(got, want, atol=(4e-3, 4e-3, 2e-2, 2e-2, 2e-2)):
    for name, g, w, tol in zip(("O", "LSE", "dQ", "dK", "dV"), got, want, atol):
        g, w = g.double(), w.double()
        assert torch.equal(torch.isinf(g), torch.isinf(w)), name
        fin = torch.isfinite(w)
        assert not torch.isnan(g).any(), name
        err = (g[fin] - w[fin]).abs().max().item() if fin.any() else 0.0
        assert err < tol, (name, err)


# -- which biases a descriptor addresses --------------------------------------------------

def test_bias_tma_view_rules():
    b, h, sq, sk = 2, 4, 40, 56
    full = torch.randn(b, h, sq, sk).to(F16)
    assert ops.bias_tma_view(full) == ([2, 4, 40, 56], [4 * 40 * 56, 40 * 56, 56, 1])
    # broadcast over batch, heads, both: extent 1, never a stride-0 dim in the descriptor
    for shape, ext in (((1, h, sq, sk), [1, 4]), ((b, 1, sq, sk), [2, 1]), ((sq, sk), [1, 1])):
        shape_, strides = ops.bias_tma_view(torch.randn(*shape).to(F16).expand(b, h, sq, sk))
        assert shape_[:2] == ext and all(s > 0 and (s * 2) % 16 == 0 for s in strides[:3]), shape
    # rows broadcast (a key-padding mask): pointer loads
    assert ops.bias_tma_view(torch.randn(b, 1, 1, sk).to(F16).expand(b, h, sq, sk)) is None
    # rows of 27 halves (54 bytes): pointer loads
    assert ops.bias_tma_view(torch.randn(b, h, sq, 27).to(F16)) is None
    # unaligned base
    assert ops.bias_tma_view(torch.randn(b, h, sq, sk + 8).to(F16)[..., 1:sk + 1]) is None
    # columns not contiguous
    assert ops.bias_tma_view(torch.randn(b, h, sk, sq).to(F16).transpose(-1, -2)) is None
    # a single query row: any row stride
    assert ops.bias_tma_view(torch.randn(b, h, 1, sk).to(F16)) is not None


# -- exactness on the descriptor path -----------------------------------------------------

@pytest.mark.parametrize("shape", [(2, 4, 40, 56), (1, 4, 40, 56), (2, 1, 40, 56), (40, 56)],
                         ids=["full", "over_batch", "over_heads", "over_both"])
@pytest.mark.parametrize("mask", ["none", "window"])
def test_descriptor_bias_is_exact(shape, mask, descriptors):
    q, k, v, do = _inputs()
    g = torch.Generator().manual_seed(3)
    bias = (torch.randn(*shape, generator=g) * 2).to(F16).expand(2, 4, 40, 56)
    lo, hi = (-9, 5) if mask == "window" else (None, None)
    got, want = _run_all(q, k, v, do, bias, mask, lo, hi)
    assert len(descriptors) == 3 and all(d is not None for d in descriptors)
    _assert_close(got, want)


def test_descriptor_bias_boolean_mask_with_fully_masked_rows(descriptors):
    """A boolean mask (-inf where False, as flashgen.attention makes it), some rows and a
    whole key block masked; seqlens off the block grid (40 = 32 + 8 query rows, 56
    keys = 3.5 tiles of 16)."""
    q, k, v, do = _inputs()
    g = torch.Generator().manual_seed(4)
    allowed = torch.rand(1, 4, 40, 56, generator=g) > 0.4
    allowed[:, :, 7] = False
    allowed[:, 1, :, 16:32] = False
    bias = torch.zeros((), dtype=F16).masked_fill(~allowed, float("-inf")).expand(2, 4, 40, 56)
    got, want = _run_all(q, k, v, do, bias)
    assert len(descriptors) == 3 and all(d is not None for d in descriptors)
    _assert_close(got, want)
    o, lse, dq = got[:3]
    assert torch.all(o[:, :, 7] == 0) and torch.all(lse[:, :, 7] == float("-inf")) and torch.all(dq[:, :, 7] == 0)


def test_descriptor_bias_causal_and_tiles_larger_than_the_problem(descriptors):
    """Causal (the fwd/dQ window kernel), and 64-row tiles over 40 x 24: every tile is
    partly past seqlen_q and seqlen_k (the copy engine's zero fill)."""
    q, k, v, do = _inputs(sq=40, sk=24)
    bias = torch.randn(4, 40, 24).to(F16).expand(2, 4, 40, 24)
    for mask, lo, hi, cfg in (("causal", -40, 24 - 40, CFG), ("none", None, None, TileConfig(64, 64, 4, 2, tma=1))):
        got, want = _run_all(q, k, v, do, bias, mask, lo, hi, cfg=cfg, cfg_dkdv=cfg)
        _assert_close(got, want)
    assert len(descriptors) == 6 and all(d is not None for d in descriptors)


# -- the pointer fallback -----------------------------------------------------------------

@pytest.mark.parametrize("case", ["unaligned_rows", "unaligned_base", "key_mask"])
def test_biases_no_descriptor_addresses_fall_back_to_pointer_loads(case, descriptors):
    sk = 27 if case == "unaligned_rows" else 56
    q, k, v, do = _inputs(sk=sk)
    g = torch.Generator().manual_seed(5)
    if case == "unaligned_rows":
        bias = torch.randn(2, 4, 40, 27, generator=g).to(F16)
    elif case == "unaligned_base":
        bias = torch.randn(2, 4, 40, 64, generator=g).to(F16)[..., 1:57]
    else:
        bias = torch.randn(2, 1, 1, 56, generator=g).to(F16).expand(2, 4, 40, 56)
    got, want = _run_all(q, k, v, do, bias)
    assert len(descriptors) == 3 and all(d is None for d in descriptors)
    _assert_close(got, want)


def test_pointer_configs_take_no_descriptor(descriptors):
    q, k, v, do = _inputs()
    bias = torch.randn(2, 4, 40, 56).to(F16)
    got, want = _run_all(q, k, v, do, bias, cfg=TileConfig(32, 16, 4, 2), cfg_dkdv=TileConfig(16, 32, 4, 2))
    assert descriptors == []  # a pointer module has no BIAS_TMA
    _assert_close(got, want)


# -- shared memory: the model against the compiled kernels --------------------------------

def test_bias_tiles_of_tma_kernels_compile_within_the_model():
    """Triton's real compiler for sm_90 (no GPU): the descriptor path streams the bias tile
    through num_stages shared buffers (more shared memory than the pointer path, which
    keeps it in registers); both binaries of a tma variant stay within the estimate."""
    import os
    import subprocess
    import sys

    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("triton's bundled ptxas is missing")
    cases = [("fwd", 64, "none", (128, 64, 4, 3, 1)), ("bwd_dq", 64, "window", (64, 64, 4, 3, 1)),
             ("bwd_dkdv", 64, "none", (32, 128, 4, 3, 1))]
    bench_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")
    script = f'''
import sys
sys.path.insert(0, {bench_dir!r})
from sm90_compile import compile_sm90
from flashgen.spec import KernelSpec, TileConfig, Variant
for kernel, d, mask, cfg in {cases!r}:
    v = Variant(KernelSpec(kernel, "bfloat16", d, d, mask, "bias"), TileConfig(*cfg))
    for bt in (True, False):
        k = compile_sm90(v, launch_like=True, bias_tma=bt)
        print("OK", v.id, int(bt), k.metadata.shared, k.asm["ptx"].count("cp.async.bulk.tensor"))
'''
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    got = {}
    for line in r.stdout.splitlines():
        if line.startswith("OK "):
            _, vid, bt, shared, bulk = line.split()
            got[(vid, bt == "1")] = (int(shared), int(bulk))
    assert len(got) == 2 * len(cases), r.stdout
    for kernel, d, mask, cfg in cases:
        v = Variant(KernelSpec(kernel, "bfloat16", d, d, mask, "bias"), TileConfig(*cfg))
        est = resources.estimate(v, SM90).total_bytes
        (s_tma, bulk_tma), (s_ptr, bulk_ptr) = got[(v.id, True)], got[(v.id, False)]
        assert s_tma <= est and s_ptr <= est, (v.id, s_tma, s_ptr, est)
        # the descriptor path adds a bulk tensor copy and the bias tiles' shared buffers
        assert bulk_tma > bulk_ptr and s_tma > s_ptr, (v.id, s_tma, s_ptr)


# -- the tuner's float64 check runs the path the timings and aligned biases run ------------

def test_the_tuners_check_of_a_tma_bias_variant_takes_the_descriptor_path(descriptors):
    """bench.check_variant (what precompile, the tuner and gpu_exactness's space walk
    run) uses seqlens 301/397: a contiguous bias of 397 (or 301) halves per row is no
    descriptor's, so tma bias variants were checked on the pointer fallback only, while
    their timings (and every user bias with 16-byte rows) ran the unchecked descriptor
    binary.  The check's bias keeps its awkward seqlens in rows padded to 16 bytes."""
    from flashgen import bench
    from flashgen.spec import Shape

    spec = KernelSpec("fwd", "float16", 16, 16, "none", "bias")
    for sq, sk in ((301, 397), (397, 301), (2048, 2048)):
        m = bench.mod_inputs(spec, Shape(2, 2, 1, sq, sk), device="cpu")
        assert m.bias.shape == (2, 2, sq, sk) and ops.bias_tma_view(m.bias) is not None, (sq, sk)
    ok, ratio, msg = bench.check_variant(Variant(spec, TileConfig(64, 64, 4, 2, tma=1)), device="cpu")
    assert ok, msg
    assert descriptors and all(d is not None for d in descriptors)

"""Decode with a KV cache (attention_with_kvcache, issue 8): the split-KV decode kernels
in Triton's interpreter (float16/float32, small shapes) against the float64 decode
reference; contiguous and paged caches, GQA/MQA, empty caches and empty splits, NaN
past cache_seqlens; the input errors; the tuner over a decode key; a real sm_90 compile
of decode variants and the shared-memory model against it.

Pass rule (FlashAttention's): max |kernel - ref64| <= 2 * max |torch at dtype - ref64|
+ floor; outputs poisoned with NaN first, so an unwritten element fails.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import flashgen
from flashgen import InputError, arch, bench, dispatch, heuristics, ops, presets, reference, resources, space
from flashgen.arch import TABLE
from flashgen.dispatch import Dispatcher
from flashgen.env import Environment
from flashgen.spec import DECODE_KERNELS, KernelSpec, ProblemKey, Shape, TileConfig, Variant

F16, F32 = torch.float16, torch.float32
FLOOR = {F16: 2e-3, F32: 2e-5}


@pytest.fixture(autouse=True)
def hermetic_dispatcher():
    dispatch.set_default_dispatcher(Dispatcher([], env=Environment.current(), arch=arch.current()))
    yield
    dispatch.set_default_dispatcher(None)


def _check(o, lse, q, kc, vc, lens, bt, causal, scale=None):
    """O and LSE within the rule; rows that see no key exactly O = 0, LSE = -inf."""
    kw = dict(causal=causal, softmax_scale=scale)
    r64 = reference.decode_forward(q, kc, vc, lens, bt, **kw)
    base = reference.decode_forward(q, kc, vc, lens, bt, dtype=q.dtype, **kw)
    for name, got, r, b in (("O", o, r64[0], base[0]), ("LSE", lse, r64[1], base[1].float())):
        assert not torch.isnan(got).any(), f"{name}: NaN (an element never written, or the cache's tail leaked)"
        floor = FLOOR[F32 if name == "LSE" else q.dtype]
        err, berr = reference.max_error(got, r), reference.max_error(b, r)
        assert err <= 2 * berr + floor, f"{name}: err {err:.3g} > 2 x {berr:.3g} + {floor}"
    empty = torch.isneginf(r64[1])  # (b, h, sq)
    assert torch.equal(torch.isneginf(lse), empty)
    assert (o.permute(0, 2, 1, 3)[empty] == 0).all()
    return empty


def _launch(q, kc, vc, lens, bt, causal, cfg, scale=None):
    """ops.decode on outputs (and partials) poisoned with NaN."""
    b, sq, h, _ = q.shape
    dv = vc.shape[-1]
    out = torch.full((b, sq, h, dv), float("nan"), dtype=q.dtype)
    lse = torch.full((b, h, sq), float("nan"))
    op, lp = ops.decode_partials(b, h, sq, dv, cfg.num_splits, q.device)
    if op is not None:
        op.fill_(float("nan"))
        lp.fill_(float("nan"))
    return ops.decode(q, kc, vc, lens, bt, softmax_scale=q.shape[-1] ** -0.5 if scale is None else scale,
                      mask="causal" if causal else "none", config=cfg, out=out, lse=lse, o_part=op, lse_part=lp)


# (kernel, lens, h, hk, sq, d, causal, dtype, (BLOCK_M, BLOCK_N, splits)); caches filled
# with NaN past the lengths; page size 16 or 32.
CASES = [
    # MHA, seqlen_q 1, one split; a zero length and lengths off the tile
    ("decode", [0, 37, 100], 2, 2, 1, 64, False, F16, (16, 32, 1)),
    # GQA 4, seqlen_q 3, causal, more splits than tiles (empty splits)
    ("decode", [0, 1, 77, 2], 8, 2, 3, 64, True, F32, (16, 16, 8)),
    # MQA, head_dim 72 (padded to 128), seqlen_q 16 (group x sq = 64 rows, two row blocks)
    ("decode", [50, 9], 4, 1, 16, 72, True, F16, (32, 16, 2)),
    # paged: page 16, tile 32 spans two pages, GQA 4, causal, splits > tiles
    ("decode_paged", [0, 33, 96, 2], 4, 1, 3, 64, True, F16, (16, 32, 4)),
    # paged: page 32, tile 16 inside a page, MHA, head_dim 72, float32, one split
    ("decode_paged", [31, 64, 5], 2, 2, 1, 72, False, F32, (16, 16, 1)),
    # paged, MQA, seqlen_q 16, 3 splits (not a power of two), not causal
    ("decode_paged", [70, 0], 4, 1, 16, 64, False, F32, (64, 16, 3)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-g{c[2] // c[3]}-sq{c[4]}-d{c[5]}-"
                         f"{'c' if c[6] else 'n'}-{str(c[7])[6:]}-sp{c[8][2]}")
def test_kernel_matches_float64(case):
    kernel, lens, h, hk, sq, d, causal, dt, (bm, bn, sp) = case
    spec = KernelSpec(kernel, {F16: "float16", F32: "float32"}[dt], d, d, "causal" if causal else "none")
    page = 32 if (kernel == "decode_paged" and d == 72) else 16
    q, kc, vc, lt, bt = bench.make_decode_inputs(spec, len(lens), h, hk, sq, lens, capacity=max(lens) + 5,
                                                 page_size=page, device="cpu", seed=sum(lens))
    assert torch.isnan(kc).any()  # the tails hold NaN
    o, lse = _launch(q, kc, vc, lt, bt, causal, TileConfig(bm, bn, 4, 1, num_splits=sp))
    empty = _check(o, lse, q, kc, vc, lt, bt, causal)
    if 0 in lens:
        assert empty[lens.index(0)].all()


def test_api_contiguous_paged_and_reference_path_agree(monkeypatch):
    """The public op (interpreter kernels, tuned-key dispatch) on both cache kinds, a
    negative scale, return_lse; and the CPU reference path without the interpreter."""
    torch.manual_seed(0)
    b, sq, h, hk, d, ps = 3, 2, 4, 2, 64, 16
    lens = torch.tensor([0, 19, 40], dtype=torch.int32)
    q = torch.randn(b, sq, h, d, dtype=F16)
    kc, vc = torch.randn(b, 48, hk, d, dtype=F16), torch.randn(b, 48, hk, d, dtype=F16)
    for z, n in enumerate(lens.tolist()):
        kc[z, n:], vc[z, n:] = float("nan"), float("nan")
    o, lse = flashgen.attention_with_kvcache(q, kc, vc, lens, causal=True, return_lse=True)
    _check(o, lse, q, kc, vc, lens, None, True)
    o2 = flashgen.attention_with_kvcache(q, kc, vc, lens, causal=True, softmax_scale=-0.3)
    _check(o2, flashgen.attention_with_kvcache(q, kc, vc, lens, causal=True, softmax_scale=-0.3, return_lse=True)[1],
           q, kc, vc, lens, None, True, scale=-0.3)
    # the same cache paged (pages in reverse order)
    kp = kc.reshape(b * 3, ps, hk, d).flip(0).contiguous()
    vp = vc.reshape(b * 3, ps, hk, d).flip(0).contiguous()
    bt = (b * 3 - 1 - torch.arange(b * 3)).reshape(b, 3).int()
    op, lsep = flashgen.attention_with_kvcache(q, kp, vp, lens, block_table=bt, causal=True, return_lse=True)
    _check(op, lsep, q, kp, vp, lens, bt, True)
    # q as a (b, sq, h, d) view of another layout; cache_seqlens a strided view
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)
    strided = torch.stack([lens, lens], 1)[:, 0]
    assert strided.stride(0) == 2
    assert torch.equal(flashgen.attention_with_kvcache(qt, kc, vc, strided, causal=True), o)
    # empty batch / seqlen_q 0
    e = flashgen.attention_with_kvcache(q[:, :0], kc, vc, lens, return_lse=True)
    assert e[0].shape == (b, 0, h, d) and e[1].shape == (b, h, 0)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    r, rl = flashgen.attention_with_kvcache(q, kc, vc, lens, causal=True, return_lse=True)
    assert r.dtype == F16 and (r.float() - o.float()).abs().max() < 2e-3
    assert torch.equal(torch.isneginf(rl), torch.isneginf(lse))


def _good():
    q = torch.randn(2, 1, 4, 16)
    kc, vc = torch.randn(2, 32, 2, 16), torch.randn(2, 32, 2, 16)
    lens = torch.tensor([3, 32], dtype=torch.int32)
    return q, kc, vc, lens


def _paged():
    q = torch.randn(2, 1, 4, 16)
    kc, vc = torch.randn(5, 16, 2, 16), torch.randn(5, 16, 2, 16)
    return q, kc, vc, torch.tensor([3, 32], dtype=torch.int32), torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)


@pytest.mark.parametrize("mutate, match", [
    (lambda a: {**a, "q": a["q"].double()}, "q.dtype"),
    (lambda a: {**a, "q": a["q"][0]}, "q must have 4 dims"),
    (lambda a: {**a, "k_cache": a["k_cache"].half()}, "k_cache.dtype"),
    (lambda a: {**a, "v_cache": a["v_cache"][:, :, :1]}, "k_cache and v_cache"),
    (lambda a: {**a, "k_cache": a["k_cache"][:1], "v_cache": a["v_cache"][:1]}, r"k_cache.shape\[0\]"),
    (lambda a: {**a, "q": torch.randn(2, 1, 3, 16)}, "multiple of num_kv_heads"),
    # a cache in (batch, heads, seqlen, head_dim) layout: the error names the layout it takes
    (lambda a: {**a, "k_cache": a["k_cache"].transpose(1, 2), "v_cache": a["v_cache"].transpose(1, 2)},
     r"multiple of num_kv_heads of k_cache/v_cache \(32\).*\(batch, seqlen_cache, num_kv_heads, head_dim\)"),
    (lambda a: {**a, "q": torch.randn(2, 1, 4, 12), "k_cache": torch.randn(2, 32, 2, 12),
                "v_cache": torch.randn(2, 32, 2, 12)}, "multiple of 8"),
    (lambda a: {**a, "v_cache": torch.randn(2, 32, 2, 264)}, "v_cache head_dim"),
    (lambda a: {**a, "k_cache": torch.randn(2, 32, 2, 8)}, r"k_cache.shape\[-1\]"),
    (lambda a: {**a, "cache_seqlens": a["cache_seqlens"].long()}, "cache_seqlens must be int32"),
    (lambda a: {**a, "cache_seqlens": [3, 32]}, "cache_seqlens must be a torch.Tensor"),
    (lambda a: {**a, "cache_seqlens": a["cache_seqlens"][:1]}, r"cache_seqlens must have shape \(batch,\)"),
    (lambda a: {**a, "cache_seqlens": torch.tensor([3, 33], dtype=torch.int32)}, r"cache_seqlens must be in \[0, 32\]"),
    (lambda a: {**a, "cache_seqlens": torch.tensor([-1, 3], dtype=torch.int32)}, "cache_seqlens must be in"),
    (lambda a: {**a, "causal": 1}, "causal must be a bool"),
    (lambda a: {**a, "softmax_scale": float("nan")}, "softmax_scale must be finite"),
    (lambda a: {**a, "softmax_scale": "x"}, "softmax_scale must be a real"),
    (lambda a: {**a, "return_lse": None}, "return_lse must be a bool"),
    (lambda a: {**a, "q": a["q"].to("meta")}, "k_cache.device"),
    (lambda a: {**a, "block_table": [[0]]}, "block_table must be a torch.Tensor"),
])
def test_invalid_inputs_contiguous(mutate, match):
    q, kc, vc, lens = _good()
    args = mutate(dict(q=q, k_cache=kc, v_cache=vc, cache_seqlens=lens))
    with pytest.raises(InputError, match=match):
        flashgen.attention_with_kvcache(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"),
                                        args.pop("cache_seqlens"), **args)


@pytest.mark.parametrize("mutate, match", [
    (lambda a: {**a, "block_table": a["block_table"].long()}, "block_table must be int32"),
    (lambda a: {**a, "block_table": a["block_table"][:1]}, r"block_table must have shape \(batch, max_pages\)"),
    (lambda a: {**a, "block_table": a["block_table"][:, None]}, "block_table must have shape"),
    (lambda a: {**a, "block_table": a["block_table"].t().contiguous().t()}, "last-dim stride"),
    (lambda a: {**a, "k_cache": a["k_cache"][:, :8], "v_cache": a["v_cache"][:, :8]}, "page_size"),
    (lambda a: {**a, "block_table": torch.tensor([[0, 1], [2, 5]], dtype=torch.int32)}, r"block_table entries"),
    (lambda a: {**a, "block_table": torch.tensor([[-1, 1], [2, 3]], dtype=torch.int32)}, r"block_table entries"),
    (lambda a: {**a, "cache_seqlens": torch.tensor([3, 33], dtype=torch.int32)}, r"in \[0, 32\]"),
])
def test_invalid_inputs_paged(mutate, match):
    q, kc, vc, lens, bt = _paged()
    flashgen.attention_with_kvcache(q, kc, vc, lens, block_table=bt)  # valid as given
    # an unused page may hold anything: batch 0 uses one page of its two
    flashgen.attention_with_kvcache(q, kc, vc, lens, block_table=torch.tensor([[0, -7], [2, 3]], dtype=torch.int32))
    args = mutate(dict(q=q, k_cache=kc, v_cache=vc, cache_seqlens=lens, block_table=bt))
    with pytest.raises(InputError, match=match):
        flashgen.attention_with_kvcache(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"),
                                        args.pop("cache_seqlens"), **args)


@pytest.mark.parametrize("interpret", ["0", "1"])
@pytest.mark.parametrize("which", ["q", "k_cache", "v_cache"])
def test_an_input_that_requires_grad_is_refused_on_every_path(which, interpret, monkeypatch):
    """Not differentiable, and the same on the reference path and in the kernels: an
    InputError while grad mode is on, a result without grad_fn under no_grad."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    q, kc, vc, lens = _good()
    args = dict(q=q, k_cache=kc, v_cache=vc)
    args[which] = args[which].requires_grad_()
    with pytest.raises(InputError, match=f"{which} requires grad.*not differentiable"):
        flashgen.attention_with_kvcache(args["q"], args["k_cache"], args["v_cache"], lens)
    with torch.no_grad():
        o = flashgen.attention_with_kvcache(args["q"], args["k_cache"], args["v_cache"], lens)
    assert o.grad_fn is None and not o.requires_grad
    assert torch.equal(o, flashgen.attention_with_kvcache(q.detach(), kc.detach(), vc.detach(), lens))


# -- keys, defaults, the tuner -----------------------------------------------------------

def test_keys_defaults_and_presets():
    spec = KernelSpec("decode", "bfloat16", 128, 128, "none")
    k1 = ProblemKey.from_sizes(spec, batch=1, num_heads=32, num_kv_heads=8, seqlen_q=1, seqlen_k=131072)
    k4 = ProblemKey.from_sizes(spec, batch=1, num_heads=32, num_kv_heads=8, seqlen_q=3, seqlen_k=131072)
    assert (k1.seqlen_q, k4.seqlen_q, k1.seqlen_k, k1.batch_heads, k1.group) == (1, 4, 131072, 32, 4)
    assert k1.id == "attn_decode_d128_bf16_none_g4_q1_k131072_bh32" and ProblemKey.from_row(k1.as_row()) == k1
    # dense keys keep their buckets
    fwd = KernelSpec("fwd", "bfloat16", 128, 128, "none")
    assert ProblemKey.from_sizes(fwd, batch=1, num_heads=8, num_kv_heads=8, seqlen_q=1, seqlen_k=100).seqlen_q == 16
    with pytest.raises(ValueError, match="serves masks"):
        KernelSpec("decode", "float16", 64, 64, "window")
    sm90 = TABLE["sm_90"]
    d1 = heuristics.default_config(spec, sm90, k1)
    assert d1.BLOCK_M == 16 and d1.num_splits >= 8  # 8 (batch, kv head) pairs: split to fill 132 SMs
    big = ProblemKey.from_sizes(spec, batch=64, num_heads=32, num_kv_heads=8, seqlen_q=1, seqlen_k=4096)
    assert heuristics.default_config(spec, sm90, big).num_splits == 1  # 512 programs already
    short = ProblemKey.from_sizes(spec, batch=1, num_heads=32, num_kv_heads=8, seqlen_q=1, seqlen_k=256)
    assert heuristics.default_config(spec, sm90, short).num_splits == 1  # 4 tiles: not worth splitting
    g16 = ProblemKey.from_sizes(spec, batch=1, num_heads=32, num_kv_heads=8, seqlen_q=16, seqlen_k=4096)
    assert heuristics.default_config(spec, sm90, g16).BLOCK_M == 64 == space.domain(g16)["BLOCK_M"][0]
    v = Variant(spec, d1)
    assert not space.violated_rules(v) and resources.estimate(v, sm90).feasible
    assert list(resources.estimate(v, sm90).buffers) == ["q_tile", "k_tiles", "v_tiles", "p_stage",
                                                         "pipeline_scratch"]
    items = presets.expand(["decode"])
    kinds = {k.spec.kernel for k, _ in items}
    assert kinds == set(DECODE_KERNELS) and len(items) == 30
    assert {k.seqlen_q for k, _ in items} == {1, 4} and {k.seqlen_k for k, _ in items} == {4096, 32768, 131072}
    assert all(k.spec.mask == ("causal" if k.seqlen_q == 4 else "none") for k, _ in items)
    assert {k.spec.kernel for k, _ in presets.expand(["decode"], kernels=["decode_paged"])} == {"decode_paged"}
    assert not any(k.spec.kernel in DECODE_KERNELS for k, _ in presets.expand(["small"], kernels=flashgen.spec.KERNELS))


def test_tuner_over_a_decode_key(tmp_path, monkeypatch):
    from flashgen import render, tuner
    from flashgen.db import TuningDB

    monkeypatch.setattr(render, "template_hash", lambda k, mods="": f"tmpl-{k}")
    env = Environment("NVIDIA H200", "9.0", 132, "3.6.0", "2.11.0", "0.1.0")
    sm90 = TABLE["sm_90"]
    key, shape = presets.expand(["decode"], kernels=["decode_paged"])[0]
    dom = space.domain(key)
    assert dom["BLOCK_M"] == (16,) and "num_splits" in dom
    timings = {Variant(key.spec, c).id: 1.0 + (c.num_splits == 16) * -0.5 + c.BLOCK_N / 1000
               for c in space.configs(key.spec.kernel)}
    bench_ = tuner.FakeBenchmarker(timings)
    with TuningDB(tmp_path / "t.sqlite") as db:
        res = tuner.tune_key(key, shape, benchmarker=bench_, db=db, env=env, arch=sm90, n_trials=25, seed=3)
        default = heuristics.default_config(key.spec, sm90, key)
        assert bench_.calls[0] == Variant(key.spec, default).id and res.default_config == default
        assert res.best_config is not None and res.best_config.BLOCK_M == 16
        assert all(Variant(key.spec, TileConfig.from_dict(r)).config.BLOCK_M == 16 for r in db.rows())
        assert db.best(key, env)["num_splits"] == res.best_config.num_splits
        # the dispatcher serves the tuned row (num_splits included) for this key
        tdb = tmp_path / "t.sqlite"
    disp = Dispatcher([tdb], env=env, arch=sm90)
    choice = disp.choose(key, capturing=False)
    assert choice.source == "tuned" and choice.config == res.best_config
    # a nearby key whose packed rows keep the tile (seqlen_q 4: 16 rows) takes the
    # nearest bucket; one whose rows need a taller tile (seqlen_q 8: 32 rows, BLOCK_M 32)
    # another kernel: the heuristic default, not the row adapted
    near = ProblemKey(key.spec, key.group, 4, key.seqlen_k, key.batch_heads)
    c2 = disp.choose(near, capturing=False)
    assert c2.source == "nearest" and c2.config == res.best_config
    tall = ProblemKey(key.spec, key.group, 8, key.seqlen_k, key.batch_heads)
    c3 = disp.choose(tall, capturing=False)
    assert c3.source == "default" and c3.config == heuristics.default_config(key.spec, sm90, tall)
    assert c3.config.BLOCK_M == 32
    # precompile sees only this key's BLOCK_M
    vs = tuner.feasible_variants([key], sm90)
    assert vs and {v.config.BLOCK_M for v in vs} == {16}


def test_benchmarker_check_catches_a_wrong_decode():
    """bench.check_variant serves the decode kernels (NaN past the lengths, zeros, empty
    splits) and fails a wrong one."""
    v = Variant(KernelSpec("decode_paged", "float32", 16, 16, "causal"), TileConfig(16, 16, 4, 1, num_splits=4))
    ok, ratio, msg = bench.check_variant(v, group=2, device="cpu")
    assert ok and ratio <= 1.0 and "decode lens" in msg, msg
    real = ops.decode

    def broken(*a, **kw):
        o, lse = real(*a, **kw)
        o.mul_(1.01)
        return o, lse
    try:
        ops.decode = broken
        ok, ratio, _ = bench.check_variant(v, group=2, device="cpu")
    finally:
        ops.decode = real
    assert not ok and ratio > 1.0
    # the timing inputs of a preset shape: full caches, paged
    spec = KernelSpec("decode_paged", "float16", 16, 16, "none")
    inputs = bench.make_decode_inputs(spec, 2, 4, 2, 1, [40, 40], page_size=16, device="cpu")
    fn, outs = bench.run_variant(Variant(spec, TileConfig(16, 16, 4, 1, num_splits=2)), *inputs)
    fn()
    assert torch.isfinite(outs["O"]).all()
    assert bench.decode_bytes(spec, 2, [40, 40]) == 80 * 2 * 32 * 2


# -- the real compiler (sm_90, no GPU) and the shared-memory model --------------------------

_COMPILE = textwrap.dedent('''
    import importlib.util, os, tempfile
    os.environ["TRITON_INTERPRET"] = "0"
    import triton
    from triton.backends.compiler import GPUTarget
    from flashgen import render
    from flashgen.spec import KernelSpec, TileConfig, Variant
    for kernel, dtype, d, mask, cfg in CASES:
        v = Variant(KernelSpec(kernel, dtype, d, d, mask), TileConfig(*cfg[:4], num_splits=cfg[4]))
        path = os.path.join(tempfile.mkdtemp(), v.id + ".py")
        open(path, "w").write(render.render(v))
        spec = importlib.util.spec_from_file_location(v.id, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        ptr = {"float16": "*fp16", "bfloat16": "*bf16", "float32": "*fp32"}[dtype]
        for name, warps, stages in (("attn_decode", cfg[2], cfg[3]), ("attn_decode_combine", 4, 1)):
            fn = getattr(mod, name)
            sig, attrs = {}, {}
            for i, n in enumerate(fn.arg_names):
                if n[0].isupper():
                    sig[n] = ("*i32" if n in ("SEQLENS", "BT") else "*fp32" if n in ("LSE", "OP", "LSEP")
                              else ptr)
                    attrs[(i,)] = [["tt.divisibility", 16]]
                else:
                    sig[n] = "fp32" if n == "qk_scale" else "i32"
                    if n.startswith("stride") and n != "stride_btb":
                        # what a launch specializes for strides that are multiples of 16
                        attrs[(i,)] = [["tt.divisibility", 16]]
            k = triton.compile(triton.compiler.ASTSource(fn=fn, signature=sig, constexprs={}, attrs=attrs),
                               target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
            print("OK", name, v.id, k.metadata.shared)
''')

# (kernel, dtype, head_dim, mask, (BLOCK_M, BLOCK_N, num_warps, num_stages, num_splits))
COMPILE_CASES = [
    ("decode", "bfloat16", 128, "none", (16, 64, 4, 2, 8)),
    ("decode", "bfloat16", 128, "none", (16, 64, 4, 1, 1)),
    ("decode_paged", "bfloat16", 128, "causal", (16, 64, 4, 3, 16)),
    ("decode_paged", "bfloat16", 128, "none", (16, 64, 4, 4, 1)),
    ("decode_paged", "float16", 72, "none", (64, 32, 4, 2, 1)),
    ("decode_paged", "bfloat16", 128, "none", (64, 64, 4, 3, 2)),
    ("decode", "float16", 64, "causal", (32, 128, 8, 4, 4)),
    ("decode", "float32", 128, "causal", (16, 64, 4, 2, 4)),
]


def test_decode_kernels_compile_for_sm90_and_fit_the_smem_model():
    """The real compiler (not the interpreter) accepts the split and combine kernels of
    both cache kinds, and the shared memory it allocates never exceeds the model's
    estimate (and is not far below it)."""
    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("triton's bundled ptxas is missing")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", f"CASES = {COMPILE_CASES!r}\n" + _COMPILE], capture_output=True,
                       text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln.split() for ln in r.stdout.splitlines() if ln.startswith("OK ")]
    assert len(lines) == 2 * len(COMPILE_CASES), r.stdout
    sm90 = TABLE["sm_90"]
    for (kernel, dtype, d, mask, cfg), (_, _, vid, shared) in zip(COMPILE_CASES, lines[0::2]):
        v = Variant(KernelSpec(kernel, dtype, d, d, mask), TileConfig(*cfg[:4], num_splits=cfg[4]))
        assert vid == v.id
        model = resources.estimate(v, sm90).total_bytes
        assert 0 <= model - int(shared) <= 1024, (v.id, model, shared)


def test_decode_bench_smoke(tmp_path, capsys):
    """benchmarks/decode_bench.py --smoke runs in the interpreter, checks flashgen's
    outputs against float64 and writes its JSON and table (the GPU run is the same code
    with do_bench timing)."""
    import importlib.util
    import json

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "decode_bench.py")
    spec = importlib.util.spec_from_file_location("decode_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "d.json"
    rc = mod.main(["--smoke", "--out", str(out), "--backends", "flashgen,flashgen-paged,sdpa-cudnn,copy"])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["meta"]["interpreter"] and len(data["rows"]) == 2
    paged = data["rows"][1]
    assert set(paged["results"]) == {"flashgen", "flashgen-paged", "sdpa-cudnn", "copy"}
    assert paged["results"]["flashgen-paged"]["ms"] > 0 and "key" in paged["results"]["flashgen-paged"]
    assert all(c["ok"] for r in data["rows"] for c in r["checks"].values()) and paged["checks"]
    assert "error" in paged["results"]["sdpa-cudnn"]  # no cuDNN on the CPU: reported, not raised
    assert "median ms" in capsys.readouterr().out


@pytest.mark.parametrize("interpret", ["0", "1"])
def test_decode_op_compiles_fullgraph_and_equals_eager(interpret, monkeypatch):
    """attention_with_kvcache is the flashgen::decode op under torch.compile: one graph
    node (no graph break), the eager result; opcheck on the op (fake shapes/strides)."""
    import flashgen
    from flashgen import library

    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    g = torch.Generator().manual_seed(0)
    dtype = torch.float16 if interpret == "1" else torch.float32
    q = torch.randn(2, 3, 8, 64, generator=g).to(dtype)
    k_cache = torch.randn(2, 96, 2, 64, generator=g).to(dtype)
    v_cache = torch.randn(2, 96, 2, 64, generator=g).to(dtype)
    lens = torch.tensor([0, 77], dtype=torch.int32)
    pages = torch.randn(12, 16, 2, 64, generator=g).to(dtype)
    block_table = torch.randperm(12, generator=g).to(torch.int32).view(2, 6)

    def step(q, kc, vc, lens, bt):
        return flashgen.attention_with_kvcache(q, kc, vc, lens, block_table=bt, causal=True, return_lse=True)

    targets = []

    def recording(gm, example_inputs):
        targets.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    for kc, vc, bt in ((k_cache, v_cache, None), (pages, pages.clone(), block_table)):
        torch._dynamo.reset()
        targets.clear()
        compiled = torch.compile(step, fullgraph=True, backend=recording)
        got, want = compiled(q, kc, vc, lens, bt), step(q, kc, vc, lens, bt)
        assert library.DECODE in targets
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        torch.library.opcheck(library.DECODE, (q, kc, vc, lens, bt, 0.125, True),
                              test_utils=("test_schema", "test_faketensor"))


def test_shipped_decode_rows_give_every_decode_size_a_tile_that_fits():
    """On the H200, a seqlen_q 4 row (BLOCK_N 256, two stages) adapted to 64 packed
    rows per kv head no longer fit shared memory, so the dense op's flash-decoding form
    raised at batch 8, 32 / 8 heads, seqlen_q 16, 4096 keys.  Every decode size of the
    shipped rows' GPU now chooses a tile that fits: another bucket's row only where it
    keeps its BLOCK_M, else the heuristic default."""
    import warnings

    from flashgen import resources
    from flashgen.dispatch import Dispatcher

    env = Environment("NVIDIA H200", "9.0", 132, "3.6.0", "2.11.0", "0.1.0")
    sm90 = TABLE["sm_90"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        disp = Dispatcher(env=env, arch=sm90)
        sources = set()
        for kernel in ("decode", "decode_paged"):
            for mask in ("none", "causal"):
                spec = KernelSpec(kernel, "bfloat16", 128, 128, mask)
                for sq in (1, 2, 4, 8, 16, 32, 64):
                    for sk in (4096, 32768, 131072):
                        for bh in (32, 256, 1024):
                            key = ProblemKey(spec, 4, sq, sk, bh)
                            c = disp.choose(key, capturing=False)
                            sources.add(c.source)
                            assert c.config.BLOCK_M == space.decode_block_m(4, sq), key.id
                            assert resources.estimate(Variant(spec, c.config), sm90).feasible, key.id
    assert {"tuned", "nearest", "default"} <= sources

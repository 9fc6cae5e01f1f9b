"""User score/mask functions (and their sinks) in the Gluon forward, on CPU: the Triton
code of a lowering written in Gluon; the family serving user forward keys (and only
those); the launcher's arguments against the rendered kernel's parameters; the register
model's calibration (a variant it admits does not spill, the ones that spilled are
refused); and a handful of the user examples compiled for sm_90 (Triton's compiler and
bundled ptxas in a subprocess without TRITON_INTERPRET) with HGMMA, setmaxnreg and the
partial wait in the binary.  Their exactness against float64 is measured on the GPU (the
tuner checks every variant before timing it)."""

import ast
import dataclasses

import pytest
import torch

from flashgen import families, user_examples, user_tune
from flashgen.arch import by_sm
from flashgen.families.gluon import config as C
from flashgen.families.gluon import family as F
from flashgen.families.gluon import render as R
from flashgen.families.gluon.user import compiled_mask, gluon
from flashgen.spec import KernelSpec, Shape

GLUON = families.get("gluon")
SM90 = by_sm("sm_90")
SHAPE = Shape(batch=2, num_heads=16, num_kv_heads=16, seqlen_q=2048, seqlen_k=2048)


def _problem(name: str, d: int = 128) -> user_tune.UserProblem:
    if name == "document-sinks":  # a mask function with sinks (gpt-oss with a padding mask is one)
        ex = user_examples.make("document-causal", SHAPE.num_heads, SHAPE.seqlen_q)
        sm, mm = ex.functions(*ex.tensors)
        sinks = torch.linspace(-1.0, 1.0, SHAPE.num_heads)
        return user_tune.UserProblem(sm, mm, sinks, True, (-1, -1), d, d, "bfloat16", SHAPE, label=name)
    ex = user_examples.make(name, SHAPE.num_heads, SHAPE.seqlen_q)
    sm, mm = ex.functions(*ex.tensors)
    return user_tune.UserProblem(sm, mm, ex.sinks, ex.causal, ex.window, d, d, "bfloat16", SHAPE, label=name)


def _spec(name: str, d: int = 128) -> C.GluonFwdSpec:
    p = _problem(name, d)
    return F.fwd_spec(KernelSpec("fwd", "bfloat16", d, d, p.mask, p.fwd_mods))


def test_triton_code_is_written_in_gluon():
    assert gluon("u3 = tl.where(x > 0, tl.math.exp2(x), tl.math.log2(x)).to(tl.float32)") == \
        "u3 = gl.where(x > 0, gl.exp2(x), gl.log2(x)).to(gl.float32)"
    assert gluon("u1 = tl.sigmoid(s)") == "u1 = _sigmoid(s)"
    assert gluon("u_keep = tl.full([1, 1], True, tl.int1)") == \
        "u_keep = gl.full([BLOCK_M, BLOCK_N], True, gl.int1, S_LAYOUT)"


def test_the_family_serves_user_forward_keys():
    """A forward key of user score/mask functions is the Gluon family's ``user`` variant
    (mask "window" with a mask function); untuned it takes the Triton default (no
    measurement puts the Gluon default ahead); the backward's two kernels stay the Triton
    family's (its whole backward: tests/test_gluon_user_bwd.py); one code id for every
    lowering."""
    p = _problem("document-causal")
    k = SHAPE.key(p.spec("fwd"))
    assert GLUON.unsupported(k, SM90) is None
    s = F.fwd_spec(k)
    assert (s.user, s.mask, s.sinks) == (p.fwd_mods, "window", False)
    assert GLUON.prefers_default(k, SM90) is None
    # a backward lowering (its derivatives) is not the forward's
    assert "in the forward and" in GLUON.unsupported(SHAPE.key(KernelSpec("fwd", "bfloat16", 128, 128, "causal",
                                                                    p.bwd_mods)), SM90)
    assert "whole backward" in GLUON.unsupported(SHAPE.key(p.spec("bwd_dq")), SM90)
    softcap = _problem("softcap")
    assert F.fwd_spec(KernelSpec("fwd", "bfloat16", 128, 128, "causal", softcap.fwd_mods)).mask == "causal"
    # one code id for every user variant (their names hash their functions), selected
    # by the databases without the functions registered
    ids = {GLUON.template_hash("fwd", m) for m in (p.fwd_mods, softcap.fwd_mods, families.USER_MODS_PROBE)}
    assert ids == {"g" + R.user_code_id()[1:]} and GLUON.template_hash("fwd") != R.user_code_id()
    assert ids <= set(families.hashes("fwd", [""]))
    assert compiled_mask("causal", p.fwd_mods) == "window" and compiled_mask("causal", softcap.fwd_mods) == "causal"


def _params(src: str) -> list[str]:
    fn = next(n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.FunctionDef) and n.name == "attn_fwd")
    return [a.arg for a in fn.args.args]


@pytest.mark.parametrize("name", ["relpos", "document-causal", "window-causal", "prefix-lm", "document-sinks"])
def test_launch_arguments_match_the_kernel_parameters(name):
    """What the launcher passes after diag_hi (:meth:`flashgen.user_mods.UserArgs.gluon_fwd_args`)
    is what the rendered kernel takes there, in order: the scale, each captured tensor
    with its strides (and sizes where read at a score-dependent index), the block mask
    with its batch and head strides."""
    p = _problem(name)
    spec = _spec(name)
    src = R.render(C.GluonFwdVariant(spec, C.default_config(spec)))
    params = _params(src)
    extra = params[params.index("diag_hi") + 1:]
    fwd, _ = p._args(SHAPE.batch, SHAPE.seqlen_q, SHAPE.seqlen_k, p.lo, p.hi, backward=False)
    args = fwd.gluon_fwd_args(0.125, 128, 128)
    assert len(args) == len(extra), (extra, [type(a).__name__ for a in args])
    for pname, a in zip(extra, args):
        if pname.startswith("UT") or pname == "UBM":
            assert isinstance(a, torch.Tensor), pname
        else:
            assert isinstance(a, (int, float)), pname
    if "UBM" in extra:  # the block mask is in tiles of the program's rows
        bm = args[extra.index("UBM")]
        assert bm.shape[-2:] == (SHAPE.seqlen_q // 128, 4) and bm.dtype == torch.int32
    assert ("sm_scale" in extra) == (p.score is not None)
    # sinks come before the scale (the launcher passes them there), the user variant's id says so
    assert ("SINKS" in params[:params.index("qk_scale")]) == (p.sinks is not None) == spec.sinks


def test_a_band_mask_function_tightens_the_bounds_once():
    """window-causal's mask function is a band: no predicate and no block mask in the
    kernel, diag_lo tightened before the partitions start."""
    spec = _spec("window-causal")
    src = R.render(C.GluonFwdVariant(spec, C.default_config(spec)))
    body = src.split("def attn_fwd(")[1]
    assert "diag_lo = gl.maximum(diag_lo, -256)" in body.split("gl.allocate_shared_memory")[0]
    assert "u_keep" not in src and "UBM" not in src


#: (example, head_dim, BLOCK_N, pin_exps, bytes ptxas spilled): the calibration points of
#: the register model (Triton 3.6's ptxas, two consumers, two stages); 0 = no spill.
CALIBRATION = [
    ("relpos", 128, 128, False, 1572), ("relpos", 128, 128, True, 1764), ("relpos", 128, 64, True, 0),
    ("relpos", 128, 64, False, 0), ("relpos", 64, 64, False, 0), ("alibi", 128, 128, False, 0),
    ("alibi", 128, 128, True, 0), ("alibi", 128, 64, True, 0), ("alibi", 64, 128, False, 0),
    ("softcap", 128, 128, False, 0), ("softcap", 128, 128, True, 0), ("softcap", 64, 128, False, 0),
    ("prefix-lm", 128, 128, False, 0), ("prefix-lm", 128, 128, True, 0), ("prefix-lm", 64, 128, False, 0),
    ("document", 128, 128, False, 880), ("document", 128, 128, True, 756), ("document", 128, 64, True, 0),
    ("document", 128, 64, False, 0), ("document", 64, 128, False, 24), ("document", 64, 64, False, 0),
    ("window-causal", 128, 128, False, 0), ("window-causal", 128, 128, True, 0),
    ("window-causal", 64, 128, False, 0),
]


def test_the_walks_take_score_and_mask_functions():
    """``persistent`` 2 and 3 (the walks that load the next tile's Q early) take a score
    function, whose setup runs per tile (checked against float64 on the GPU,
    benchmarks/gluon_mods_fwd_tiles.py), and a mask function, whose block mask is read
    per tile of the walk (checked at three tiles per program, benchmarks/gluon_user.py
    --walks); a mask function's walk renders its block-mask read inside the walk's loop."""
    score, mask = _spec("softcap", 64), _spec("document-causal", 64)
    for persistent in (2, 3):
        cfg = C.GluonFwdConfig(num_consumers=1, BLOCK_N=64, num_stages=2, consumer_regs=232, producer_regs=24,
                               persistent=persistent, ctas_per_sm=2)
        assert C.check(C.GluonFwdVariant(score, cfg)) == []
        assert C.check(C.GluonFwdVariant(mask, cfg)) == []
        lines = R.render(C.GluonFwdVariant(mask, cfg)).splitlines()
        reads = [i for i, line in enumerate(lines) if "u_bm = UBM +" in line]
        assert len(reads) == 2, reads  # the producer's and the consumer's
        for i in reads:
            loop = max(j for j in range(i) if "for tile in range(gl.program_id(0), num_tiles" in lines[j])
            assert not any(lines[j].startswith("def ") for j in range(loop, i))
            indent = len(lines[i]) - len(lines[i].lstrip())
            assert indent > len(lines[loop]) - len(lines[loop].lstrip())


def test_the_register_model_refuses_what_spilled_and_admits_what_did_not():
    specs = {}
    for name, d, bn, pin, spilled in CALIBRATION:
        s = specs.setdefault((name, d), _spec(name, d))
        cfg = C.GluonFwdConfig(BLOCK_N=bn, num_stages=2, pin_exps=pin)
        need = C.consumer_regs_needed(s, cfg)
        assert (need <= cfg.consumer_regs) == (spilled == 0), (name, d, bn, pin, spilled, need)


_SCRIPT = r'''
import json, sys
import torch
from flashgen import user_examples, user_tune
from flashgen.spec import KernelSpec, Shape
from flashgen.families.gluon import family as F
from flashgen.families.gluon.config import GluonFwdConfig, GluonFwdVariant, default_regs, smem_bytes
from flashgen.families.gluon.sm90 import compile_sm90, report
shape = Shape(batch=2, num_heads=16, num_kv_heads=16, seqlen_q=2048, seqlen_k=2048)
for name, d, kw in CASES:
    ex = user_examples.make(name.removeprefix("sinks-"), 16, 2048)
    sm, mm = ex.functions(*ex.tensors)
    sinks = torch.linspace(-1.0, 1.0, 16) if name.startswith("sinks-") else ex.sinks
    p = user_tune.UserProblem(sm, mm, sinks, ex.causal, ex.window, d, d, "bfloat16", shape, label=name)
    spec = F.fwd_spec(KernelSpec("fwd", "bfloat16", d, d, p.mask, p.fwd_mods))
    v = GluonFwdVariant(spec, GluonFwdConfig(**kw))
    r = report(compile_sm90(v))
    print("OK " + json.dumps(dict(id=v.id, problems=r.problems(v), spill=r.spill_bytes, hgmma=r.hgmma,
                                  setmaxnreg=r.setmaxnreg, shared=r.shared_bytes,
                                  model=smem_bytes(v.spec, v.config))))
'''

#: A score function with a gathered table (int64 bucket arithmetic), a mask function with
#: int64 gathers and a block mask, a pinned score function at head_dim 128, and a score
#: function in the walk of 3 (one consumer, three programs per SM).
COMPILE_CASES = [
    ("relpos", 64, dict(BLOCK_N=64, num_stages=4)),
    ("document-causal", 128, dict(BLOCK_N=64, num_stages=2, pin_exps=True)),
    ("softcap", 128, dict(BLOCK_N=128, num_stages=2, pin_exps=True)),
    ("sinks-document", 64, dict(BLOCK_N=64, num_stages=4)),
    ("softcap", 64, dict(num_consumers=1, BLOCK_N=64, num_stages=3, consumer_regs=136, producer_regs=24,
                         persistent=3, ctas_per_sm=3)),
]


#: Spills recorded per Triton minor version (bytes per thread); any other spill fails.
#: Triton 3.9's ptxas spills 4 B in the pinned softcap tile, as in the plain pinned
#: head_dim 128 causal tile (tests/test_gluon_fwd.py).
SPILL_BYTES = {"3.9": {"gluon_fwd_d128_bf16_causal_u9696a9aac09a_m64x2_n128_s2_r240-24_pin": 4}}


def compile_features(case) -> set:
    """The (knob, value) pairs of a COMPILE_CASES entry: its example, head dim and every
    config field (tests/sm90.py: covering)."""
    name, d, kw = case
    return {("example", name), ("head_dim", d)} | \
        {(f"config.{k}", x) for k, x in dataclasses.asdict(C.GluonFwdConfig(**kw)).items()}


def test_user_examples_compile_for_sm90_without_spills(request):
    import triton
    from sm90 import chosen, json_rows

    rows = json_rows(_SCRIPT, chosen(request.config, COMPILE_CASES, compile_features))
    spills = SPILL_BYTES.get(".".join(triton.__version__.split(".")[:2]), {})
    for row in rows:
        known = spills.get(row["id"], 0)
        assert row["spill"] == known, row
        assert [p for p in row["problems"] if not (known and p.startswith("spills "))] == [], row
        assert row["hgmma"] > 0 and row["setmaxnreg"], row
        assert row["shared"] <= row["model"] <= row["shared"] + 2048, row

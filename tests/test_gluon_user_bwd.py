"""The Gluon backward's user mask functions (flashgen.families.gluon.user_bwd.bwd_template_vars):
which query rows each key block's steps visit and which entries of S^T their masked
steps keep, run from the rendered kernel's own statements on the CPU against the mask
function itself (every visible (query, key) pair of every query head exactly once, no
other); every variant compiled for sm_90 with Triton's compiler and bundled ptxas
(HGMMA, the partitions' register budgets, no serialized wgmma, spills as recorded); the
rules, and the family's and the dispatcher's answers.

Gluon kernels do not run in Triton's interpreter: their exactness comes from the GPU
(``python -m benchmarks gluon-user-bwd``)."""

import ast
import dataclasses
import json
import math
import os
import subprocess
import sys
import types

import pytest
import torch

from flashgen import user_examples, user_grads, user_mods
from flashgen.errors import UnsupportedError
from flashgen.families.gluon import bwd as B
from flashgen.families.gluon import user_bwd as U
from flashgen.masks import mask_bounds

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _user_args(score_mod, mask_mod, b, h, hk, sq, sk, lo, hi):
    """The backward UserArgs of the functions for these sizes (CPU tensors)."""
    score = user_mods.trace(score_mod, "score") if score_mod is not None else None
    mask = user_mods.trace(mask_mod, "mask") if mask_mod is not None else None
    return user_mods.kernel_args(score, mask, user_mods.score_grad_flags(score), None, (b, h, hk, sq, sk, lo, hi),
                                 torch.device("cpu"), True)[1]


class _Ptr:
    """A global pointer of the rendered kernel on the CPU: a flat tensor and an offset (an
    int, or a tensor of them)."""

    def __init__(self, flat, off=0):
        self.flat, self.off = flat, off

    def __add__(self, n):
        return _Ptr(self.flat, self.off + n)

    def add(self, val, mask=None):
        """An atomic add at the offsets (where ``mask``), into the flat tensor."""
        off = torch.as_tensor(self.off)
        val = torch.as_tensor(val, dtype=self.flat.dtype).expand(off.shape)
        keep = torch.ones(off.shape, dtype=torch.bool) if mask is None else torch.as_tensor(mask).expand(off.shape)
        self.flat.index_put_((off[keep].long(),), val[keep], accumulate=True)

    def load(self, mask=None, other=0):
        off = self.off
        if isinstance(off, int) or off.dim() == 0:
            return self.flat[off]
        vals = self.flat[off.clamp(0, self.flat.numel() - 1)]
        return vals if mask is None else torch.where(mask, vals, torch.as_tensor(other, dtype=vals.dtype))


_GL = types.SimpleNamespace(
    arange=lambda a, b, layout=None: torch.arange(a, b), expand_dims=lambda x, axis: x.unsqueeze(axis),
    where=lambda c, a, b: (a if c else b) if isinstance(c, bool) else torch.where(c, a, torch.as_tensor(b, dtype=a.dtype)),
    maximum=max, minimum=min,
    cdiv=lambda a, b: -(-a // b), load=lambda p, mask=None, other=0: p.load(mask, other), int64=torch.int64,
    int32=torch.int32)


def _statements(body, wanted):
    """The Assign statements of ``body`` (in order) whose targets are all in ``wanted``."""
    out = []
    for st in body:
        if isinstance(st, ast.Assign):
            names = {t.id for t in ast.walk(st.targets[0]) if isinstance(t, ast.Name)}
            if names and names <= wanted:
                out.append(st)
    return out


def _visited(src: str, args: list, b: int, h: int, hk: int, sq: int, sk: int, lo: int, hi: int):
    """Run the rendered backward ``src``'s own schedule and masking statements on the CPU
    over every program: (visible, visits) bool / int (b, h, sq, sk): the entries of S^T
    its steps keep (P^T not zeroed, a step outside the mask leaving P^T whole), and how
    many steps cover each entry."""
    tree = ast.parse(src).body
    fns = {n.name: n for n in tree if isinstance(n, ast.FunctionDef)}
    consts = {n.targets[0].id: ast.literal_eval(n.value.args[0]) for n in tree if isinstance(n, ast.Assign)
              and isinstance(n.targets[0], ast.Name) and n.targets[0].id in ("BLOCK_M", "BLOCK_NT", "PB", "NPART")}
    helper = fns["_query_blocks"]
    helper.decorator_list = []
    ns = {"gl": _GL, "COL_ST": None, "ROW_ST": None, **consts}
    exec(compile(ast.Module(body=[helper], type_ignores=[]), "<_query_blocks>", "exec"), ns)
    kernel = fns["attn_bwd"]
    params = [a.arg for a in kernel.args.args]
    user_params = params[params.index("m_pad") + 1:]
    assert len(user_params) == len(args), (user_params, len(args))
    top = compile(ast.Module(body=_statements(kernel.body, {"diag_lo", "diag_hi", "u_bm", "m_first", "m_full_lo",
                                                             "m_full_hi", "n_m", "n_iter"}), type_ignores=[]),
                  "<attn_bwd>", "exec")
    consumer = fns["_consumer"]
    loop = next(st for st in consumer.body if isinstance(st, ast.For))
    step = _statements(loop.body, {"g", "m0", "off_h", "need_mask"})
    step += [st for st in loop.body if isinstance(st, ast.If) and ast.unparse(st.test) == "need_mask"]
    step = compile(ast.Module(body=step, type_ignores=[]), "<step>", "exec")
    bm_, n_kb = consts["BLOCK_M"], -(-sk // consts["BLOCK_NT"])
    visible = torch.zeros(b, h, sq, sk, dtype=torch.bool)
    visits = torch.zeros(b, h, sq, sk, dtype=torch.int32)
    uargs = {name: (_Ptr(a.reshape(-1)) if isinstance(a, torch.Tensor) else a) for name, a in zip(user_params, args)}
    for off_z in range(b):
        for off_hk in range(hk):
            for pid_n in range(n_kb):
                # the program's indices as the kernel's scalars (0-d int32 tensors: ``.to`` works)
                env = dict(ns, **uargs, off_z=torch.tensor(off_z, dtype=torch.int32),
                           off_hk=torch.tensor(off_hk, dtype=torch.int32), pid_n=pid_n, n0=pid_n * consts["BLOCK_NT"],
                           group=h // hk, seqlen_q=sq, seqlen_k=sk, diag_lo=lo, diag_hi=hi)
                env["m_first"], env["n_m"] = ns["_query_blocks"](env["n0"], sq, lo, hi)
                exec(top, env)
                env.setdefault("n_iter", env["n_m"] * env["group"])
                env.setdefault("m_full_lo", 0)
                env.setdefault("m_full_hi", 0)
                for c in range(consts["NPART"]):
                    for it in range(int(env["n_iter"])):
                        run = dict(env, it=it, C=c, nc=env["n0"] + c * consts["PB"],
                                   pt=torch.ones(consts["PB"], bm_))
                        exec(step, run)
                        rows_q = int(run["m0"]) + torch.arange(bm_)
                        rows_k = int(run["nc"]) + torch.arange(consts["PB"])
                        qi, ki = rows_q[rows_q < sq], rows_k[rows_k < sk]
                        kept = run["pt"][: len(ki), : len(qi)].T > 0
                        hh = int(run["off_h"])
                        visible[off_z, hh, qi[:, None], ki[None, :]] |= kept
                        visits[off_z, hh, qi[:, None], ki[None, :]] += 1
    return visible, visits


def _document_ids(sq):
    ids = torch.zeros(sq, dtype=torch.int64)
    for cut in (37, 90, 91, 160):  # documents of 37, 53, 1, 69 and the rest
        ids[cut:] += 1
    return ids


def _cases():
    docs = _document_ids(300)
    heads = torch.tensor([3, 0, 1, 5])
    return {
        "document": (lambda b_, h_, q, kv: docs[q] == docs[kv], False, (-1, -1)),
        # a key block's query tiles: two entirely visible, then one crossing the end of
        # its document (a masked tile after the block mask's interior run)
        "long-document": (lambda b_, h_, q, kv: (q < 150) == (kv < 150), False, (-1, -1)),
        "document-causal": (lambda b_, h_, q, kv: docs[q] == docs[kv], True, (-1, -1)),
        "prefix-lm": (lambda b_, h_, q, kv: (kv <= q) | (kv < 70), False, (-1, -1)),
        # per head and batch entry: a captured table read at [h], and the batch index
        "head-batch": (lambda b_, h_, q, kv: (kv + heads[h_] + b_) % 4 != 0, True, (-1, -1)),
        # entirely visible tiles for the even heads only: the interior run is the
        # intersection over each kv head's group
        "half-the-heads": (lambda b_, h_, q, kv: (h_ % 2 == 0) | (kv <= q), False, (-1, -1)),
        "band": (lambda b_, h_, q, kv: q - kv <= 40, True, (-1, -1)),
        # keeps nothing: a constant predicate, and no step at all (dK, dV zero)
        "nothing": (lambda b_, h_, q, kv: torch.zeros_like(q, dtype=torch.bool), False, (-1, -1)),
        "window-and-document": (lambda b_, h_, q, kv: docs[q] == docs[kv], False, (64, 3)),
    }


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("name", list(_cases()))
def test_the_steps_keep_exactly_the_mask_functions_entries(name, d):
    """Over 2 batch entries, 4 query heads on 2 kv heads and seqlens off the tiles
    (200 queries, 300 keys): the rendered kernel's block-mask ranges, masked-step tests
    and predicate (their own statements, run on the CPU) keep exactly the pairs the
    mask function and the built-in bounds leave visible, each in one step."""
    mask_mod, causal, window = _cases()[name]
    b, h, hk, sq, sk = 2, 4, 2, 200, 300
    mode, lo, hi = mask_bounds(sq, sk, causal=causal, window=window)
    ua = _user_args(None, mask_mod, b, h, hk, sq, sk, lo, hi)
    cfg = B.default_config(d, "bfloat16", "window")
    uvars = U.bwd_template_vars(ua.name)
    assert uvars["USER_MASK"] == (name != "band")  # a band only tightens the bounds
    src = B.render(cfg, "bfloat16", d, "window", check=False, user=ua.name)
    visible, visits = _visited(src, ua.gluon_bwd_args(cfg.block_m, cfg.block_nt), b, h, hk, sq, sk, lo, hi)
    B_, H_, I_, J_ = (torch.arange(n).view(*[-1 if i == k else 1 for i in range(4)]) for k, n in
                      enumerate((b, h, sq, sk)))
    want = (torch.as_tensor(mask_mod(B_, H_, I_, J_)).bool() & (J_ - I_ >= lo) & (J_ - I_ <= hi)).expand(b, h, sq, sk)
    assert (want.any() and not want.all()) or name == "nothing"
    assert torch.equal(visible, want), (name, d, (visible != want).nonzero()[:5].tolist())
    # every visible pair in exactly one step
    assert int(visits.max()) == (1 if want.any() else 0) and (not want.any() or int(visits[want].min()) == 1)


def _score_cases():
    """Score functions (score_mod, causal, window) of the step tests and the sm_90 compiles:
    each depends on the query and key index in its own way (the transposed tile's
    orientation), on the head and batch entry, or has a derivative that is not 1."""
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    table = torch.randn(32, 4, generator=torch.Generator().manual_seed(3)) * 0.5
    return {
        "alibi": (lambda s, b_, h_, q, kv: s - slopes[h_] * torch.abs(q - kv), True, (-1, -1)),
        "softcap": (lambda s, b_, h_, q, kv: 30.0 * torch.tanh(s / 30.0), True, (-1, -1)),
        # T5's bucket of kv - q: asymmetric in q and kv, a captured table read at [bucket, h]
        "relpos": (lambda s, b_, h_, q, kv: s + table[user_examples.t5_bucket(kv - q), h_], False, (-1, -1)),
        # a derivative that depends on the position, and the batch entry
        "position-scale": (lambda s, b_, h_, q, kv: s * (1.0 + 0.002 * (kv - q)) + 0.1 * b_, False, (-1, -1)),
        "sigmoid-gate": (lambda s, b_, h_, q, kv: s * torch.sigmoid(s), False, (64, 3)),
    }


_GL_TILE = types.SimpleNamespace(
    arange=lambda a, b, layout=None: torch.arange(a, b, dtype=torch.int32),
    expand_dims=lambda x, axis: x.unsqueeze(axis), exp2=torch.exp2, exp=torch.exp, log=torch.log, log2=torch.log2,
    abs=torch.abs, sqrt=torch.sqrt,
    where=lambda c, a, b: torch.where(torch.as_tensor(c), torch.as_tensor(a), torch.as_tensor(b)),
    maximum=lambda a, b: torch.maximum(torch.as_tensor(a), torch.as_tensor(b)),
    minimum=lambda a, b: torch.minimum(torch.as_tensor(a), torch.as_tensor(b)),
    zeros_like=torch.zeros_like, load=lambda p, mask=None, other=0: p.load(mask, other),
    sum=lambda x, axis: torch.sum(x, dim=axis), min=lambda x, axis: torch.amin(x, dim=axis),
    max=lambda x, axis: torch.amax(x, dim=axis), zeros=lambda shape, dtype, layout=None: torch.zeros(shape, dtype=dtype),
    atomic_add=lambda p, val, mask=None, sem=None: p.add(val, mask),
    float32=torch.float32, float64=torch.float64, int64=torch.int64, int32=torch.int32, int1=torch.bool)


def _score_step(src: str, args: list, st, lse2, dpt, delta, off_z: int, off_h: int, m0: int, nc: int,
                softmax_scale: float, sq: int, sk: int):
    """Run the rendered backward ``src``'s own statements of one unmasked consumer step on
    the CPU: from the user functions' index vectors to P^T, and dS^T (float32, not
    rounded to the input dtype), on the raw S^T tile ``st`` (key rows down, query rows
    across), the step's LSE2 ``lse2``, dP^T ``dpt`` and delta ``delta``; the captured
    tensors' gradients are added into their buffers among ``args``."""
    tree = ast.parse(src).body
    fns = {n.name: n for n in tree if isinstance(n, ast.FunctionDef)}
    ns = {"gl": _GL_TILE}
    if "_sigmoid" in fns:
        fns["_sigmoid"].decorator_list = []
        exec(compile(ast.Module(body=[fns["_sigmoid"]], type_ignores=[]), "<_sigmoid>", "exec"), ns)
    kernel = fns["attn_bwd"]
    params = [a.arg for a in kernel.args.args]
    user_params = params[params.index("m_pad") + 1:]
    assert len(user_params) == len(args), (user_params, len(args))
    loop = next(st_ for st_ in fns["_consumer"].body if isinstance(st_, ast.For))
    body = loop.body
    first = next(i for i, x in enumerate(body) if ast.unparse(x) == "u_z = off_z")
    last = next(i for i, x in enumerate(body) if isinstance(x, ast.Assign) and ast.unparse(x.targets[0]) == "pt")
    # dS^T, and the captured tensors' gradients: the statements of u_* names and their
    # loops and atomics (not the step's products, stores and waits)
    ds = [x for x in body[last + 1:]
          if (isinstance(x, ast.Assign) and (ast.unparse(x.targets[0]) == "ds" or ast.unparse(x.targets[0]).startswith("u_")))
          or (isinstance(x, ast.For) and ast.unparse(x.target) == "u_v")
          or (isinstance(x, ast.Expr) and ast.unparse(x).startswith("gl.atomic_add("))]
    step = compile(ast.Module(body=body[first:last + 1] + ds, type_ignores=[]), "<step>", "exec")
    consts = {n.targets[0].id: ast.literal_eval(n.value.args[0]) for n in tree if isinstance(n, ast.Assign)
              and isinstance(n.targets[0], ast.Name) and n.targets[0].id in ("BLOCK_M", "PB")}
    assert tuple(st.shape) == (consts["PB"], consts["BLOCK_M"])
    env = dict(ns, **consts, **{n: (_Ptr(a.reshape(-1)) if isinstance(a, torch.Tensor) else a)
                                for n, a in zip(user_params, args)},
               off_z=torch.tensor(off_z, dtype=torch.int32), off_h=torch.tensor(off_h, dtype=torch.int32), m0=m0,
               nc=nc, softmax_scale=softmax_scale, st=st, lse=lse2, dpt=dpt, delta=delta, seqlen_q=sq, seqlen_k=sk,
               COL_ST=None, ROW_ST=None, ST_LAYOUT=None, DTYPE=torch.float32)
    exec(step, env)
    return env["pt"], env["ds"]


def _grad_cases():
    """Score functions whose captured tensor takes a gradient: (make(tensor) -> score_mod,
    the tensor, causal, window).  T5's table (32, 4) is summed per index value in the tile
    (``user_grads.Reduced``), a bias of 100 entries by per-element atomics."""
    g = torch.Generator().manual_seed(4)
    table = (torch.randn(32, 4, generator=g) * 0.5).requires_grad_()
    bias = torch.randn(100, generator=g).requires_grad_()
    return {
        "relpos-learned": (lambda t: lambda s, b_, h_, q, kv: s + t[user_examples.t5_bucket(kv - q), h_], table,
                           False, (-1, -1)),
        "bias-100": (lambda t: lambda s, b_, h_, q, kv: s + t[(kv - q) % 100], bias, True, (-1, -1)),
    }


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("name", list(_grad_cases()))
def test_the_steps_add_the_captured_tensors_gradients(name, d):
    """The rendered step's own statements (run on the CPU in float32) add into the
    captured tensor's gradient buffer what float64 autograd gives for that tile: the sum
    over the tile of dS^T (before f'(s)) times d f / d tensor, for query head 3 of batch
    entry 1 at a step off the diagonal."""
    make, tensor, causal, window = _grad_cases()[name]
    b, h, hk, sq, sk = 2, 4, 2, 500, 700
    mode, lo, hi = mask_bounds(sq, sk, causal=causal, window=window)
    ua = _user_args(make(tensor), None, b, h, hk, sq, sk, lo, hi)
    assert len(ua.low.grads) == 1 and (name == "relpos-learned") == isinstance(ua.low, user_grads.Reduced)
    uvars = U.bwd_template_vars(ua.name)
    assert uvars["USER_GRADS"] and ("range(u_rlo" in uvars["USER_GRADS"]) == (name == "relpos-learned")
    cfg = B.default_config(d, "bfloat16", mode)
    src = B.render(cfg, "bfloat16", d, mode, user=ua.name)
    pb, bm = cfg.part_rows, cfg.block_m
    g = torch.Generator().manual_seed(12)
    scale = d ** -0.5
    m0, nc = 320, 192  # query rows [320, 384), key rows [192, 192 + PB): both signs of kv - q at d128
    st = torch.randn(pb, bm, generator=g) * 20.0
    dpt = torch.randn(pb, bm, generator=g)
    delta = torch.randn(bm, generator=g)
    rows_q = (m0 + torch.arange(bm)).view(1, -1).to(torch.int64)
    rows_k = (nc + torch.arange(pb)).view(-1, 1).to(torch.int64)
    t64 = tensor.detach().double().requires_grad_()
    f = make(t64)(scale * st.double(), torch.tensor(1), torch.tensor(3), rows_q, rows_k)
    lse = f.detach().amax(0) + 0.5
    ds_ref = torch.exp(f.detach() - lse) * (dpt.double() - delta.double())  # dL/df of the tile
    (want,) = torch.autograd.grad(f, [t64], ds_ref)
    args = ua.gluon_bwd_args(cfg.block_m, cfg.block_nt)
    _score_step(src, args, st, (lse / math.log(2)).float(), dpt, delta, 1, 3, m0, nc, scale, sq, sk)
    got = ua.grads[0].view(tensor.shape).double()
    assert want.abs().max() > 0.1 and (want != 0).sum() > 1
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("d", [64, 128])
def test_the_per_key_row_sums_probe_adds_the_tables_gradient(d, monkeypatch):
    """``benchmarks/probe_t5_rowsum.py``'s edit (T5's table gradient summed per key row,
    one masked atomic per key row and value) adds what float64 autograd gives, as the
    per-tile sums do, and leaves no per-tile sum in the step."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import probe_t5_rowsum

    loops = U._value_loops
    monkeypatch.setattr(U, "_value_loops", lambda code: probe_t5_rowsum.row_sums(loops(code)))
    _, table, _, _ = _grad_cases()["relpos-learned"]
    ua = _user_args(lambda s, b_, h_, q, kv: s + table[user_examples.t5_bucket(kv - q), h_], None, 2, 4, 2, 500, 700,
                    -700, 700)
    code = U.bwd_template_vars(ua.name)["USER_GRADS"]
    assert "u_rs = gl.sum(" in code and "gl.sum(gl.sum(" not in code, code
    test_the_steps_add_the_captured_tensors_gradients("relpos-learned", d)
    with pytest.raises(ValueError, match="no per-tile sum"):
        probe_t5_rowsum.row_sums("gl.atomic_add(p, v)")


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("name", list(_score_cases()))
def test_the_steps_compute_the_score_functions_p_and_ds(name, d):
    """The rendered kernel's own statements of an unmasked step (the score function, its
    derivative, P^T and dS^T; run on the CPU in float32) against float64 autograd of the
    score function itself, for query head 3 of batch entry 1 at a step off the diagonal:
    P^T = exp(f(s) - LSE) and dS^T = P^T (dP^T - delta) f'(s) on the transposed tile."""
    score_mod, causal, window = _score_cases()[name]
    b, h, hk, sq, sk = 2, 4, 2, 500, 700
    mode, lo, hi = mask_bounds(sq, sk, causal=causal, window=window)
    ua = _user_args(score_mod, None, b, h, hk, sq, sk, lo, hi)
    uvars = U.bwd_template_vars(ua.name)
    assert uvars["USER_SCORE"] and not uvars["USER_MASK"]
    assert uvars["USER_DSCORE"] == (name in ("softcap", "position-scale", "sigmoid-gate"))
    assert uvars["USER_SIGMOID"] == (name == "sigmoid-gate")
    cfg = B.default_config(d, "bfloat16", mode)
    src = B.render(cfg, "bfloat16", d, mode, user=ua.name)
    pb, bm = cfg.part_rows, cfg.block_m
    g = torch.Generator().manual_seed(11)
    scale = d ** -0.5
    m0, nc = 192, 320  # query rows [192, 256), key rows [320, 320 + PB)
    st = torch.randn(pb, bm, generator=g) * 40.0  # raw q.k: s = scale * st
    dpt = torch.randn(pb, bm, generator=g)
    delta = torch.randn(bm, generator=g)
    rows_q = (m0 + torch.arange(bm)).view(1, -1).to(torch.int64)
    rows_k = (nc + torch.arange(pb)).view(-1, 1).to(torch.int64)
    s64 = (scale * st.double()).requires_grad_()
    f = score_mod(s64, torch.tensor(1), torch.tensor(3), rows_q, rows_k)
    (df,) = torch.autograd.grad(f.sum(), [s64])
    lse = f.detach().amax(0) + 0.5  # per query row (across)
    p_ref = torch.exp(f.detach() - lse)
    ds_ref = p_ref * (dpt.double() - delta.double()) * df
    pt, ds = _score_step(src, ua.gluon_bwd_args(cfg.block_m, cfg.block_nt), st, (lse / math.log(2)).float(),
                         dpt, delta, 1, 3, m0, nc, scale, sq, sk)
    assert pt.shape == p_ref.shape and ds.shape == ds_ref.shape
    assert p_ref.max() > 0.5 and p_ref.min() < 1e-3  # the tile spans the softmax's range
    torch.testing.assert_close(pt.double(), p_ref, rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(ds.double(), ds_ref, rtol=2e-5, atol=2e-6 * float(ds_ref.abs().max()))


def test_the_rules_refuse_the_knobs_not_built_with_a_mask_function_and_score_functions():
    """The rules admit the default variant with a mask function; the knobs with ranges
    of their own are refused with a reason (render raises, with or without its checks); a
    score function compiles into the key's mask mode, unless a captured tensor takes a
    gradient or is read at an index computed from the score (the Triton family's); a
    mask function compiles into the window kernel only."""
    ua = _user_args(None, lambda b_, h_, q, kv: (kv <= q) | (kv < 7), 1, 2, 1, 64, 64, -64, 64)
    cfg = B.default_config(128, "bfloat16", "window")
    assert B.user_reasons(cfg, "window") == [] and "UBM" in B.render(cfg, "bfloat16", 128, "window", user=ua.name)
    for knob in (dict(dq_mode="ordered"), dict(longest_first=True), dict(group_split=2)):
        bad = dataclasses.replace(cfg, **knob)
        reasons = B.user_reasons(bad, "window")
        assert len(reasons) == 1 and "not built" in reasons[0], (knob, reasons)
        for check in (True, False):
            with pytest.raises(ValueError, match="not built"):
                B.render(bad, "bfloat16", 128, "window", check=check, user=ua.name)
    with pytest.raises(ValueError, match="window"):
        B.render(cfg, "bfloat16", 128, "causal", check=False, user=ua.name)
    band = _user_args(None, lambda b_, h_, q, kv: q - kv <= 5, 1, 2, 1, 64, 64, -64, 64)
    with pytest.raises(ValueError, match="window"):  # a band's bounds are tested in the window kernel only
        B.render(cfg, "bfloat16", 128, "none", check=False, user=band.name)
    for knob in (dict(dq_mode="ordered"), dict(longest_first=True), dict(group_split=2)):
        with pytest.raises(ValueError, match="not built"):  # not even for a probe (check=False)
            B.render(dataclasses.replace(cfg, **knob), "bfloat16", 128, "window", check=False, user=ua.name)
    q = torch.empty(1, 2, 32, 128)
    with pytest.raises(ValueError, match="made for sizes"):  # UserArgs of other sizes: another block mask
        B.launch_args(q, q, q[:, :1], q[:, :1], q, torch.empty(1, 2, 32), softmax_scale=0.1, diag_lo=-32,
                      diag_hi=32, config=cfg, user=ua)
    with pytest.raises(ValueError, match="varlen"):
        B.render(cfg, "bfloat16", 128, "window", check=False, user=ua.name, varlen=True)
    # a score function compiles into the key's own mask mode; a captured tensor read at an
    # index computed from the score stays the Triton family's
    scored = _user_args(lambda s, b_, h_, q, kv: s * 0.5, None, 1, 2, 1, 64, 64, -64, 64)
    assert "u_g = 0.5\n" in B.render(cfg, "bfloat16", 128, "none", user=scored.name)  # f'(s): a constant
    for knob in (dict(dq_mode="ordered"), dict(longest_first=True), dict(group_split=2)):
        with pytest.raises(ValueError, match="not built"):
            B.render(dataclasses.replace(cfg, **knob), "bfloat16", 128, "none", check=False, user=scored.name)
    table = torch.randn(8)
    ua_t = _user_args(lambda s, b_, h_, q, kv: s + table[(s.abs() * 2).long() % 8], None, 1, 2, 1, 64, 64, -64, 64)
    with pytest.raises(UnsupportedError, match="computed from the score"):
        U.bwd_template_vars(ua_t.name)
    plain = B.render(cfg, "bfloat16", 128, "window")
    assert "UBM" not in plain and "u_keep" not in plain  # a plain variant renders as before


def test_the_user_code_id_follows_the_gluon_code_of_the_mask_function(tmp_path, monkeypatch):
    """An edit of .user (whose Gluon spelling of the Triton code .user_bwd writes) or of
    .user_bwd gives the user variants' rows a new code id."""
    from pathlib import Path

    base = B.user_code_id()
    for name in ("user.py", "user_bwd.py"):
        copy = tmp_path / name
        copy.write_text(Path(B.__file__).with_name(name).read_text() + "\n# edited\n")
        real = Path.read_bytes
        monkeypatch.setattr(Path, "read_bytes", lambda self, c=copy, n=name, r=real:
                            r(c) if self.name == n and self.parent == Path(B.__file__).parent else r(self))
        B.user_code_id.cache_clear()
        assert B.user_code_id() != base, name
        monkeypatch.undo()
        B.user_code_id.cache_clear()
    assert B.user_code_id() == base


def test_deterministic_reaches_the_backward_of_user_functions(monkeypatch):
    """flashgen.attention(..., mask_mod=..., deterministic=True): the backward asks for a
    bitwise-repeatable plan (the whole Gluon backward's reduce-add dQ is not)."""
    import flashgen
    from flashgen import library

    asked = []
    real = library.backward_kernels

    def spy(q, k, v, mask, mods, deterministic):
        asked.append((mods, deterministic))
        return real(q, k, v, mask, mods, deterministic)
    monkeypatch.setattr(library, "backward_kernels", spy)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v = (torch.randn(1, 2, 32, 16, dtype=torch.float16, requires_grad=True) for _ in range(3))
    for det in (True, False):
        o = flashgen.attention(q, k, v, mask_mod=lambda b, h, qi, ki: ki <= qi + 3, deterministic=det)
        o.sum().backward()
    assert [d for _, d in asked] == [True, False] and all(m.startswith("u") for m, _ in asked), asked


def _mask_problem(name, d=128, batch=2, dtype="bfloat16", kv_heads=16, seqlen_q=2048, requires_grad=False):
    from flashgen import user_tune
    from flashgen.spec import Shape

    shape = Shape(batch=batch, num_heads=16, num_kv_heads=kv_heads, seqlen_q=seqlen_q, seqlen_k=2048)
    ex = user_examples.make(name, shape.num_heads, shape.seqlen_q, requires_grad=requires_grad)
    sm, mm = ex.functions(*ex.tensors)
    return user_tune.UserProblem(sm, mm, ex.sinks, ex.causal, ex.window, d, d, dtype, shape, label=name)


def test_the_family_and_the_dispatcher_serve_a_mask_functions_whole_backward(tmp_path):
    """A ``bwd`` key of mask functions alone is the Gluon family's (its variant compiled
    as the window kernel with the block mask); the dispatcher compares its row with the
    Triton family's bwd_dq + bwd_dkdv rows of the same bucket, as for plain keys, takes
    the untuned Gluon default at the head dims where it measured ahead
    (``USER_BWD_DEFAULT_AHEAD``) and the two kernels elsewhere, and a score function's
    backward stays the two kernels."""
    from flashgen import families
    from flashgen.arch import by_sm
    from flashgen.db import TuningDB
    from flashgen.dispatch import Dispatcher
    from flashgen.env import Environment
    from flashgen.families.gluon import family as F
    from flashgen.spec import Measurement, TileConfig, Variant

    gluon, sm90 = families.get("gluon"), by_sm("sm_90")
    h200 = Environment("NVIDIA H200", "9.0", 132, "3.6.0", "2.11.0", "0.1.0")
    p = _mask_problem("document-causal", batch=16)  # enough work for an untuned Gluon default
    key, shape = p.keys(["bwd"])[0]
    assert gluon.large_enough(key) and not gluon.large_enough(_mask_problem("document-causal").keys(["bwd"])[0][0])
    assert key.spec.mask == "causal" and F.bwd_mask(key.spec) == "window" and F.user_bwd(p.bwd_mods)
    assert gluon.unsupported(key, sm90) is None and "H100" in gluon.prefers_default(key, sm90)
    cfg = gluon.default_config(key, sm90)
    assert F.bwd_config(cfg) == B.default_config(128, "bfloat16", "window")
    v = Variant(key.spec, cfg)
    assert gluon.violated_rules(v) == []
    assert gluon.violated_rules(Variant(key.spec, dataclasses.replace(cfg, dq_ordered=1)))  # not built
    src = gluon.render(v)
    assert src == B.render(F.bwd_config(cfg), "bfloat16", 128, "window", user=p.bwd_mods) and "UBM" in src
    # its own code id: the dense backward's rows keep theirs
    assert gluon.template_hash("bwd", p.bwd_mods) == "g" + B.user_code_id()[1:] != gluon.template_hash("bwd")
    assert gluon.template_hash("bwd", p.bwd_mods) in families.hashes("bwd", [""])
    d256 = _mask_problem("document-causal", 256).keys(["bwd"])[0][0]  # the column-split program: not built
    assert "column-split" in gluon.unsupported(d256, sm90)
    # a captured tensor read at an index computed from the score: the two kernels
    from flashgen import user_tune

    table = torch.randn(8)
    scored = user_tune.UserProblem(lambda s, b_, h_, q, kv: s + table[(s.abs() * 2).long() % 8], None, None, True,
                                   (-1, -1), 128, 128, "bfloat16", shape, label="score-index")
    assert scored.keys(["bwd"]) == [] and "computed from the score" in gluon.unsupported(
        shape.key(dataclasses.replace(scored.spec("bwd_dq"), kernel="bwd")), sm90)

    t1, t2 = TileConfig(64, 64, 4, 2), TileConfig(64, 32, 4, 1)
    for gluon_ms, whole in ((1.5, True), (2.5, False)):
        db_path = tmp_path / f"t{gluon_ms}.sqlite"
        with TuningDB(db_path) as db:
            # the fastest rows break a rule of their key (neither the ordered dQ nor the
            # longest-first grid is built with a mask function): an imported row of that
            # kind is never taken, and the row measured next in its group is
            for kernel, c, ms in (("bwd_dq", t1, 1.0), ("bwd_dkdv", t2, 1.0), ("bwd", cfg, gluon_ms),
                                  ("bwd", dataclasses.replace(cfg, dq_ordered=1), 0.1),
                                  ("bwd", dataclasses.replace(cfg, longest_first=1), 0.1)):
                k = shape.key(p.spec(kernel))
                db.record(k, shape, Variant(k.spec, c), Measurement("ok", median_ms=ms), h200, 0)
        plan = Dispatcher([db_path], env=h200, arch=sm90).backward(shape.key(p.spec("bwd_dq")), capturing=False)
        assert plan.whole is whole and "measured at attn_bwd_d128_bf16_causal_u" in plan.reason, plan.reason
        assert plan.family == ("gluon" if whole else "triton")
        assert not plan.whole or (plan.choices[0].median_ms == gluon_ms and plan.choices[0].config == cfg)
        # deterministic: the two kernels (the ordered-dQ row is refused by the rules)
        det = Dispatcher([db_path], env=h200, arch=sm90).backward(shape.key(p.spec("bwd_dq")), deterministic=True,
                                                                  capturing=False)
        assert not det.whole and det.family == "triton", det.reason
    untuned = Dispatcher([], env=h200, arch=sm90).backward(shape.key(p.spec("bwd_dq")), capturing=False)
    assert untuned.whole and untuned.family == "gluon" and "default measured ahead: H100" in untuned.reason
    d64 = _mask_problem("document", 64, batch=16).keys(["bwd"])[0][0]
    assert gluon.large_enough(d64) and "H100" in gluon.prefers_default(d64, sm90)
    # the GPU checked the default in float16 and up to multi-query at 16 heads
    for checked in (_mask_problem("document-causal", batch=16, dtype="float16"),
                    _mask_problem("document-causal", batch=16, kv_heads=1)):
        ckey, cshape = checked.keys(["bwd"])[0]
        assert "H100" in gluon.prefers_default(ckey, sm90), ckey.id
        plan = Dispatcher([], env=h200, arch=sm90).backward(cshape.key(checked.spec("bwd_dq")), capturing=False)
        assert plan.whole and plan.family == "gluon", plan.reason
    # no measurement at head_dim 96, no GPU check of a group over 16 (32 heads on one kv
    # head) or of seqlen_q != seqlen_k: the two kernels (each key large enough for a default)
    group32 = _mask_problem("document-causal", batch=8, kv_heads=1)
    group32 = dataclasses.replace(group32, shape=dataclasses.replace(group32.shape, num_heads=32))
    for other in (_mask_problem("document", 96, batch=16), group32,
                  _mask_problem("document-causal", batch=32, seqlen_q=1024)):
        okey, oshape = other.keys(["bwd"])[0]
        assert gluon.large_enough(okey), okey.id
        assert gluon.unsupported(okey, sm90) is None and gluon.prefers_default(okey, sm90) is None
        untuned = Dispatcher([], env=h200, arch=sm90).backward(oshape.key(other.spec("bwd_dq")), capturing=False)
        assert not untuned.whole and "untuned" in untuned.reason, untuned.reason
    plan = Dispatcher([], env=h200, arch=sm90).backward(shape.key(scored.spec("bwd_dq")), capturing=False)
    assert not plan.whole and "computed from the score" in plan.reason, plan.reason


def test_the_family_and_the_dispatcher_serve_a_score_functions_whole_backward(tmp_path):
    """A score function (its captured tensor with or without a gradient) has a ``bwd``
    key of the key's own mask mode, served by the Gluon family; untuned it takes the
    Gluon default where ``USER_SCORE_BWD_DEFAULT_AHEAD`` (with a captured tensor's
    gradient ``USER_GRAD_BWD_DEFAULT_AHEAD``) names its head_dim, and a tuned
    row faster than the two kernels' rows of its bucket is taken, a slower one not."""
    from flashgen import families
    from flashgen.arch import by_sm
    from flashgen.db import TuningDB
    from flashgen.dispatch import Dispatcher
    from flashgen.env import Environment
    from flashgen.families.gluon import family as F
    from flashgen.spec import Measurement, TileConfig, Variant

    gluon, sm90 = families.get("gluon"), by_sm("sm_90")
    h200 = Environment("NVIDIA H200", "9.0", 132, "3.6.0", "2.11.0", "0.1.0")
    for name, mode, grad in (("alibi", "causal", False), ("softcap", "causal", False), ("relpos", "none", False),
                             ("relpos", "none", True)):
        p = _mask_problem(name, batch=16, requires_grad=grad)
        key, shape = p.keys(["bwd"])[0]
        low = F.user_bwd_lowering(p.bwd_mods)
        assert key.spec.mask == mode and F.bwd_mask(key.spec) == mode and low.score is not None, name
        assert gluon.unsupported(key, sm90) is None, name
        cfg = gluon.default_config(key, sm90)
        src = gluon.render(Variant(key.spec, cfg))
        assert "u_s = st" in src and "UBM" not in src and ("u_g = " in src) == (name == "softcap"), name
        assert ("UG0" in src) == grad and ("UG0" in B.render(F.bwd_config(cfg), "bfloat16", 128, mode,
                                                               user=p.bwd_mods)) == grad
        ahead = (F.USER_GRAD_BWD_DEFAULT_AHEAD if grad else F.USER_SCORE_BWD_DEFAULT_AHEAD).get(128)
        assert bool(low.grads) == grad and (ahead is None) == grad
        assert F.user_bwd_default_ahead(low) is (F.USER_GRAD_BWD_DEFAULT_AHEAD if grad else
                                                 F.USER_SCORE_BWD_DEFAULT_AHEAD)
        assert gluon.prefers_default(key, sm90) == ahead
        untuned = Dispatcher([], env=h200, arch=sm90).backward(shape.key(p.spec("bwd_dq")), capturing=False)
        assert untuned.whole == (ahead is not None), untuned.reason
        for gluon_ms, whole in ((1.5, True), (2.5, False)):
            db_path = tmp_path / f"{name}{grad}{gluon_ms}.sqlite"
            with TuningDB(db_path) as db:
                for kernel, c, ms in (("bwd_dq", TileConfig(64, 64, 4, 2), 1.0),
                                      ("bwd_dkdv", TileConfig(64, 32, 4, 1), 1.0), ("bwd", cfg, gluon_ms)):
                    k = shape.key(p.spec(kernel))
                    db.record(k, shape, Variant(k.spec, c), Measurement("ok", median_ms=ms), h200, 0)
            plan = Dispatcher([db_path], env=h200, arch=sm90).backward(shape.key(p.spec("bwd_dq")), capturing=False)
            assert plan.whole is whole and plan.family == ("gluon" if whole else "triton"), (name, plan.reason)


def _compile_case(name):
    """(score_mod, mask_mod, causal, window) of a compile case: a mask case of
    :func:`_cases`, a score case of :func:`_score_cases`, or "softcap-document" (both)."""
    if name == "softcap-document":
        return _score_cases()["softcap"][0], _cases()["document"][0], True, (-1, -1)
    if name in _grad_cases():
        make, tensor, causal, window = _grad_cases()[name]
        return make(tensor), None, causal, window
    if name in _score_cases():
        score_mod, causal, window = _score_cases()[name]
        return score_mod, None, causal, window
    mask_mod, causal, window = _cases()[name]
    return None, mask_mod, causal, window


_SCRIPT = r'''
import json, re, sys
import torch
sys.path.insert(0, ROOT)
sys.path.insert(0, ROOT + "/tests")
from test_gluon_user_bwd import _compile_case, _user_args
from flashgen.families.gluon import bwd as B
from flashgen.families.gluon.sm90 import SERIALIZED, report
from flashgen.masks import mask_bounds
import dataclasses
for name, d, knobs in CASES:
    score_mod, mask_mod, causal, window = _compile_case(name)
    mode, lo, hi = mask_bounds(256, 256, causal=causal, window=window)
    ua = _user_args(score_mod, mask_mod, 1, 2, 1, 256, 256, lo, hi)
    m = "window" if mask_mod is not None else mode
    cfg = dataclasses.replace(B.default_config(d, "bfloat16", m), **knobs)
    assert B.invalid_reasons(cfg, d, "bfloat16", m) == [], (cfg, knobs)
    r = report(B.compile_sm90(cfg, "bfloat16", d, m, check=False, user=ua))
    print("OK " + json.dumps(dict(name=name, d=d, knobs=sorted(knobs), id=B.variant_id(cfg, "bfloat16", d, m, user=ua.name),
                                  spill=r.spill_bytes, hgmma=r.hgmma, setmaxnreg=r.setmaxnreg,
                                  serialized=[c for c in SERIALIZED if c in r.ptxas_log],
                                  regs=[cfg.consumer_regs, cfg.producer_regs])))
'''

#: (example, head_dim, knobs over the head_dim's default tile): the defaults' tiles for
#: every example, and the document mask on other tiles the rules admit.
COMPILE_CASES = [(name, d, {}) for name in ("document", "prefix-lm", "head-batch", "band") for d in (64, 128)] + \
    [("nothing", 128, {}), ("document", 64, {"stages": 1}), ("document", 64, {"row_load": "ptr"}),
     ("document", 128, {"stages": 1}), ("document", 128, {"split": True, "dq_stage": "swizzled", "kv_store": "ptr"})] + \
    [(name, d, {}) for name in ("alibi", "softcap", "relpos", "position-scale", "sigmoid-gate", "softcap-document",
                                "relpos-learned", "bias-100") for d in (64, 128)]
#: ptxas spill-store bytes per (example, head_dim, knobs) and Triton minor version; any
#: other spill fails.  The head_dim 128 lock-step partition holds dK and dV of 128 key
#: rows (128 of its 240 registers) while a masked step evaluates the predicate: the
#: document mask's two int64 gathers of ids spill there, more with one stage or split
#: partitions, and a little at head_dim 64 with one stage or the rows by pointer (Triton
#: 3.9's ptxas, with --regAllocOptLevel=2, also a few bytes for the other masks); so does
#: the constant tile of a mask that keeps nothing, whose steps never run.  A score
#: function runs in every step beside the in-flight dP^T: at head_dim 128 ptxas spills
#: 26-42 loop-carried scalars (addresses, bounds) to make room for its tile temporaries
#: (104-168 B), more beside the document mask's gathers; a captured tensor's gradient
#: (its index tile and per-value sums, or a tile of int64 pointers for the per-element
#: atomics) spills 0.25-1.4 KB, a bias tensor's the most: its scores carry the clamp to
#: +-2.3e38 as well (user_mods.Traced.guard).
SPILL_BYTES = {"3.6": {("document", 128, ()): 312, ("nothing", 128, ()): 136, ("document", 64, ("stages",)): 44,
                       ("document", 64, ("row_load",)): 44, ("document", 128, ("stages",)): 428,
                       ("document", 128, ("dq_stage", "kv_store", "split")): 880,
                       ("alibi", 64, ()): 8, ("alibi", 128, ()): 168, ("softcap", 128, ()): 164,
                       ("relpos", 128, ()): 108, ("position-scale", 128, ()): 104, ("sigmoid-gate", 128, ()): 168,
                       ("softcap-document", 64, ()): 128, ("softcap-document", 128, ()): 436,
                       ("relpos-learned", 64, ()): 308, ("relpos-learned", 128, ()): 804, ("bias-100", 64, ()): 460,
                       ("bias-100", 128, ()): 992},
               "3.9": {("document", 128, ()): 288, ("prefix-lm", 128, ()): 16, ("head-batch", 128, ()): 24,
                       ("nothing", 128, ()): 8, ("document", 128, ("stages",)): 400,
                       ("document", 128, ("dq_stage", "kv_store", "split")): 676,
                       ("alibi", 128, ()): 208, ("softcap", 128, ()): 160, ("relpos", 128, ()): 400,
                       ("position-scale", 128, ()): 148, ("sigmoid-gate", 128, ()): 144,
                       ("softcap-document", 128, ()): 440, ("relpos-learned", 64, ()): 252,
                       ("relpos-learned", 128, ()): 1008, ("bias-100", 64, ()): 368, ("bias-100", 128, ()): 1316}}


def test_user_variants_compile_for_sm90():
    """Every example at head_dim 64 (split partitions) and 128 (the lock-step one) on the
    defaults' tiles, and the document mask on other admitted tiles: HGMMA, both
    partitions' setmaxnreg budgets in the SASS, no serialized wgmma, and no spill but
    those recorded."""
    import triton

    from sm90 import json_rows

    rows = json_rows(f"ROOT = {ROOT!r}\n" + _SCRIPT, COMPILE_CASES)
    spills = SPILL_BYTES.get(".".join(triton.__version__.split(".")[:2]), {})
    for row in rows:
        assert row["hgmma"] > 0 and set(row["regs"]) <= set(row["setmaxnreg"]), row
        assert row["serialized"] == [], row
        assert row["spill"] == spills.get((row["name"], row["d"], tuple(row["knobs"])), 0), row
    assert len({row["id"] for row in rows}) == len(rows)

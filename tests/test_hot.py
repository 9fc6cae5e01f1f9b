"""flashgen.hot: an eager forward+backward through autograd, replayed from its recipe,
launches what the op's own layers launch for the same inputs (fakes for the kernels
and the device, CPU tensors, as in test_plans; the real launches and their results are
gpu_op_checks.py's), for the Triton family's forward and two-kernel backward and the
Gluon family's forward and whole backward; and calls that are not all in their plans
get no recipe."""

import pytest
import torch

import flashgen
from flashgen import dispatch, hot, library, plans
from flashgen.masks import mask_bounds
from flashgen.families.gluon import bwd as B
from flashgen.families.gluon import config as C
from flashgen.families.gluon import family as GF
from flashgen.families.triton import launch as T

from test_plans import _same, _same_launches, fake_gpu  # noqa: F401  (fixture)


@pytest.fixture
def kernels(fake_gpu, monkeypatch):  # noqa: F811
    """Kernels run for CPU tensors (their launches faked), the fast table emptied;
    yields the launch log."""
    monkeypatch.setattr(library, "use_kernels", lambda q: True)
    disp = dispatch.default_dispatcher()
    disp.fast.clear()
    yield fake_gpu
    disp.fast.clear()


def _gluon(monkeypatch, d):
    """The dispatcher's choice made the Gluon family's, forward and whole backward."""
    fcfg = GF.tile_config(C.default_config(C.GluonFwdSpec("bfloat16", d, d, "causal")))
    bcfg = GF.tile_config(B.default_config(d, "bfloat16", "causal"))
    monkeypatch.setattr(library, "kernel_for", lambda *a, **k: (fcfg, None))
    monkeypatch.setattr(library, "backward_kernels", lambda *a, **k: (bcfg, None))


def _inputs(b, h, hk, s, d, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, s, d, generator=g).to(torch.bfloat16).requires_grad_()
    k = torch.randn(b, hk, s, d, generator=g).to(torch.bfloat16).requires_grad_()
    v = torch.randn(b, hk, s, d, generator=g).to(torch.bfloat16).requires_grad_()
    do = torch.randn(b, h, s, d, generator=g).to(torch.bfloat16)
    return q, k, v, do


def _calls():
    found = [e[7] for e in dispatch.default_dispatcher().fast.values() if isinstance(e, tuple) and len(e) == 8]
    assert len(found) == 1 and isinstance(found[0], hot.Calls)
    return found[0]


@pytest.mark.parametrize("family", ["triton", "gluon"])
def test_a_recipe_launches_what_the_layers_launch(kernels, monkeypatch, family):
    d = 128 if family == "gluon" else 64
    if family == "gluon":
        _gluon(monkeypatch, d)
    shape = (2, 4, 2, 192, d)

    def fwd_bwd(q, k, v, do):
        o = flashgen.attention(q, k, v, causal=True)
        return (o, *torch.autograd.grad(o, (q, k, v), do))

    for seed in (0, 1):  # the first call records the plans and the recipes, the second replays them
        fwd_bwd(*_inputs(*shape, seed))
    calls = _calls()
    assert all(isinstance(r, hot.Recipe) for r in (*calls.fwd.values(), *calls.bwd.values()))
    assert len(calls.fwd) == 1 and len(calls.bwd) == 1
    inputs = _inputs(*shape, 2)
    kernels.clear()
    got = fwd_bwd(*inputs)
    replayed = list(kernels)
    assert replayed and all(how == "replay" for how, *_ in replayed)
    kernels.clear()
    monkeypatch.setattr(plans, "usable", lambda: False)  # the layers, every launch through Triton's path
    want = fwd_bwd(*inputs)
    leaves = inputs[:3] + (inputs[3],)
    pairs = _same_launches(replayed, list(kernels), leaves)
    for x, y in zip(got, want):
        _same(x.detach() if x.requires_grad else x, y.detach() if y.requires_grad else y, leaves, pairs)


def test_no_recipe_for_a_call_not_all_in_its_plans(kernels, monkeypatch):
    """A strided K/V makes the Gluon backward copy dK and dV out of contiguous buffers
    (work beside its plan): the backward keeps the layers; the forward gets its recipe."""
    d = 128
    _gluon(monkeypatch, d)

    def make(seed):
        q, k, v, do = _inputs(1, 2, 2, 128, d, seed)
        # k and v as slices of one (b, s, 2, h, d) tensor: strided, addressable by descriptors
        kv = torch.randn(1, 128, 2, 2, d).to(torch.bfloat16)
        k = kv[:, :, 0].transpose(1, 2).detach().requires_grad_()
        v = kv[:, :, 1].transpose(1, 2).detach().requires_grad_()
        return q, k, v, do

    for seed in range(3):
        q, k, v, do = make(seed)
        o = flashgen.attention(q, k, v, causal=True)
        torch.autograd.grad(o, (q, k, v), do)
    calls = _calls()
    assert list(calls.bwd.values()) == [None]
    assert all(isinstance(r, hot.Recipe) for r in calls.fwd.values())


def test_no_recipe_under_a_capture_that_saw_no_plan():
    cap = plans.capture()
    with cap:
        pass
    assert hot.build(cap, (torch.zeros(1),), (torch.zeros(1),)) is None
    with plans.capture() as cap:
        plans.taint()
    assert not cap.ok


def test_recipes_only_where_plans_would_run(kernels, monkeypatch):
    """A negative scale (the forward negates q), plans switched off: the layers run."""
    q, k, v, do = _inputs(1, 2, 2, 64, 64, 0)
    for _ in range(3):
        o = flashgen.attention(q, k, v, causal=True, softmax_scale=-0.1)
        torch.autograd.grad(o, (q, k, v), do)
    calls = _calls()
    assert not calls.fwd and not calls.bwd
    monkeypatch.setattr(plans, "usable", lambda: False)
    for _ in range(2):
        o = flashgen.attention(q, k, v, causal=True)
        torch.autograd.grad(o, (q, k, v), do)
    assert not calls.fwd and not calls.bwd



def _bshd(b, h, hk, s, d, seed):
    """q, k, v seen through transpose(1, 2) (transformers' layout), and dO."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, h, d, generator=g).to(torch.bfloat16).transpose(1, 2).requires_grad_()
    k = torch.randn(b, s, hk, d, generator=g).to(torch.bfloat16).transpose(1, 2).requires_grad_()
    v = torch.randn(b, s, hk, d, generator=g).to(torch.bfloat16).transpose(1, 2).requires_grad_()
    return q, k, v, torch.randn(b, h, s, d, generator=g).to(torch.bfloat16)


def _replayed_vs_layers(kernels, monkeypatch, run, leaves):
    """run() with recipes, then with plans off (the layers, Triton's path): the same
    kernels, grids and arguments."""
    kernels.clear()
    run()
    replayed = list(kernels)
    kernels.clear()
    with monkeypatch.context() as m:
        m.setattr(plans, "usable", lambda: False)
        run()
    _same_launches(replayed, list(kernels), leaves)


def test_a_saved_tensor_hook_that_changes_the_layout_takes_another_recipe(kernels, monkeypatch):
    """A saved-tensor hook (save_on_cpu, activation offloading) hands the backward
    contiguous copies of bshd q, k, v and O: the backward's recipe key holds the saved
    tensors' layouts, so the replay launches with their strides, not the forward's."""
    shape = (1, 2, 2, 128, 64)

    def fwd_bwd(q, k, v, do):
        return torch.autograd.grad(flashgen.attention(q, k, v, causal=True), (q, k, v), do)

    for seed in (0, 1):
        fwd_bwd(*_bshd(*shape, seed))
    assert [type(r) for r in _calls().bwd.values()] == [hot.Recipe]
    q, k, v, do = _bshd(*shape, 2)

    def offloaded():  # as save_on_cpu does on a GPU: the backward gets contiguous copies
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t.contiguous().clone(), lambda t: t):
            o = flashgen.attention(q, k, v, causal=True)
        return torch.autograd.grad(o, (q, k, v), do)

    offloaded()  # records the offloaded layout's recipe
    assert len(_calls().bwd) == 2
    _replayed_vs_layers(kernels, monkeypatch, offloaded, (q, k, v, do))


def test_no_recipe_from_a_call_under_graph_capture(hermetic_dispatcher, kernels, monkeypatch):
    """A key's first backward during a CUDA graph capture gets the dispatcher's
    capture-time default, which it does not keep: no recipe is recorded from it, and the
    later eager calls replay the tuned row the layers choose."""
    import dataclasses

    capturing = [False]
    monkeypatch.setattr(dispatch, "graph_capturing", lambda: capturing[0])

    def lookup(self, key):  # a tuned row for the backward's dQ kernel
        if key.spec.kernel != "bwd_dq":
            return None
        cfg = self._default(key).config
        return dispatch.Choice(key, dataclasses.replace(cfg, num_warps=8 if cfg.num_warps == 4 else 4), "tuned")

    monkeypatch.setattr(dispatch.Dispatcher, "_lookup", lookup)
    q, k, v, do = (t for t in torch.randn(4, 1, 2, 128, 64).to(torch.bfloat16))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o = flashgen.attention(q, k, v, causal=True)
    capturing[0] = True
    torch.autograd.grad(o, (q, k, v), do)
    capturing[0] = False
    assert not _calls().bwd

    def run():
        return torch.autograd.grad(flashgen.attention(q, k, v, causal=True), (q, k, v), do)

    run()
    assert [type(r) for r in _calls().bwd.values()] == [hot.Recipe]
    _replayed_vs_layers(kernels, monkeypatch, run, (q, k, v, do))


def test_a_scale_that_takes_the_checked_path_keeps_its_recipes(kernels):
    """An int softmax_scale passes the checks on every call (the fast path takes only
    None or a float): the entry made again keeps its Calls, so the recipes recorded
    are replayed, not recorded anew on every call."""
    q, k, v, do = _inputs(1, 2, 2, 64, 64, 0)
    for _ in range(3):
        torch.autograd.grad(flashgen.attention(q, k, v, causal=True, softmax_scale=1), (q, k, v), do)
    calls = _calls()
    kernels.clear()
    torch.autograd.grad(flashgen.attention(q, k, v, causal=True, softmax_scale=1), (q, k, v), do)
    assert _calls() is calls and kernels and all(how == "replay" for how, *_ in kernels)
    assert [type(r) for r in (*calls.fwd.values(), *calls.bwd.values())] == [hot.Recipe, hot.Recipe]


def test_the_decode_form_gets_a_recipe(kernels, monkeypatch):
    """A call the dense op runs in its flash-decoding form (few query rows per kv head,
    many keys: library.decode_form) is all in its plans: its forward replays a recipe that
    launches what the layers launch (the split and combine kernels), its backward too."""
    b, h, hk, sq, sk, d = 1, 8, 2, 2, 700, 64

    def make(seed):
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(b, h, sq, d, generator=g).to(torch.float16).requires_grad_()
        k = torch.randn(b, hk, sk, d, generator=g).to(torch.float16).requires_grad_()
        v = torch.randn(b, hk, sk, d, generator=g).to(torch.float16).requires_grad_()
        return q, k, v, torch.randn(b, h, sq, d, generator=g).to(torch.float16)

    q, k, v, _ = make(0)
    assert library.decode_form(q, k, v, *mask_bounds(sq, sk, causal=True, window=(-1, -1)))

    def fwd_bwd(q, k, v, do):
        o = flashgen.attention(q, k, v, causal=True)
        return (o, *torch.autograd.grad(o, (q, k, v), do))

    for seed in (0, 1):
        fwd_bwd(*make(seed))
    calls = _calls()
    assert all(isinstance(r, hot.Recipe) for r in (*calls.fwd.values(), *calls.bwd.values()))
    inputs = make(2)
    kernels.clear()
    got = fwd_bwd(*inputs)
    replayed = list(kernels)
    assert replayed and all(how == "replay" for how, *_ in replayed)
    assert len(plans_of(T._FORM_PLANS)) == 1
    kernels.clear()
    monkeypatch.setattr(plans, "usable", lambda: False)
    want = fwd_bwd(*inputs)
    pairs = _same_launches(replayed, list(kernels), inputs)
    for x, y in zip(got, want):
        _same(x.detach() if x.requires_grad else x, y.detach() if y.requires_grad else y, inputs, pairs)


def plans_of(table):
    return [p for p in table.values() if p is not None]


def test_a_call_without_autograd_replays_the_same_recipe(kernels, monkeypatch):
    """Without autograd the op replays the forward recipe of its fast-table entry too
    (the one an autograd call records), launching what the layers launch."""
    q, k, v, _ = _inputs(2, 4, 2, 192, 64, 0)
    with torch.no_grad():
        flashgen.attention(q, k, v, causal=True)
    calls = _calls()
    assert len(calls.fwd) == 1 and all(isinstance(r, hot.Recipe) for r in calls.fwd.values())
    inputs = _inputs(2, 4, 2, 192, 64, 1)[:3]
    kernels.clear()
    with torch.no_grad():
        got = flashgen.attention(*inputs, causal=True)
        replayed = list(kernels)
        assert replayed and all(how == "replay" for how, *_ in replayed)
        kernels.clear()
        monkeypatch.setattr(plans, "usable", lambda: False)
        want = flashgen.attention(*inputs, causal=True)
    pairs = _same_launches(replayed, list(kernels), inputs)
    _same(got, want, inputs, pairs)


@pytest.mark.parametrize("shape", [(2, 4, 2, 192, 192, 64), (1, 8, 2, 2, 700, 64)], ids=["fwd-kernels", "decode-form"])
def test_o_is_laid_out_alike_whichever_path_runs_without_autograd(kernels, monkeypatch, shape):
    """Without autograd, O is laid out like q (library.out_like) whether the call replays
    its recipe, launches the memoized kernel (plans off; a q not 16-byte aligned) or
    runs the layers, as with autograd."""
    b, h, hk, sq, sk, d = shape

    def bshd(s, heads, offset=0):
        flat = torch.randn(b * s * heads * d + offset).to(torch.float16)
        return flat[offset:].view(b, s, heads, d).transpose(1, 2)

    q, k, v = bshd(sq, h), bshd(sk, hk), bshd(sk, hk)
    want = library.out_like(q, d).stride()
    with torch.no_grad():
        flashgen.attention(q, k, v, causal=True)
        assert flashgen.attention(q, k, v, causal=True).stride() == want  # the recipe
        with monkeypatch.context() as m:
            m.setattr(plans, "usable", lambda: False)
            assert flashgen.attention(q, k, v, causal=True).stride() == want  # the memoized launch
        q1 = bshd(sq, h, offset=1)  # 2 bytes past 16-byte alignment: no recipe
        assert flashgen.attention(q1, k, v, causal=True).stride() == want
    o = flashgen.attention(q.requires_grad_(), k, v, causal=True)
    assert o.stride() == want

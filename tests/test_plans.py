"""flashgen.plans: a replayed call launches exactly what the launcher's own path would
launch for the same inputs (fakes for the kernels and the device, CPU tensors; the
real launches and their results are the GPU scripts'), for the Gluon backward in each
of its branches, the Gluon forward and the Triton family's three launchers."""

import dataclasses

import pytest
import torch

from flashgen import fastlaunch, plans
from flashgen.families.gluon import bwd as B
from flashgen.families.gluon import config as C
from flashgen.families.gluon import launch as L
from flashgen.families.triton import launch as T
from flashgen.spec import TileConfig


class FakeKernel:
    packed_metadata = object()
    function = 7

    def __init__(self, log):
        self.log = log

    def run(self, gx, gy, gz, stream, function, meta, _a, _b, _c, *args):
        self.log.append(("replay", self, (gx, gy, gz), args))


@pytest.fixture
def fake_gpu(monkeypatch):
    """Every launch is logged as (how, kernel, grid, args); one fake kernel per function."""
    log, kernels = [], {}

    def launch(fn, grid, args, **options):
        k = kernels.setdefault((fn, tuple(sorted(options.items()))), FakeKernel(log))
        g = tuple(grid) + (1,) * (3 - len(grid))
        log.append(("launch", k, g, tuple(args)))
        return k

    for mod in (B, L, T):
        monkeypatch.setattr(mod, "launch", launch)
    monkeypatch.setattr(plans, "usable", lambda: True)
    monkeypatch.setattr(fastlaunch, "_device_and_stream", lambda: (0, 99))
    monkeypatch.setattr(fastlaunch, "_current_device", lambda: 0)
    monkeypatch.setattr(fastlaunch, "ensure_context", lambda dev: None)
    monkeypatch.setattr(L, "_sm_count", lambda device: 132)
    tables = (B._PLANS, L._PLANS, T._FWD_PLANS, T._DQ_PLANS, T._DKDV_PLANS, T._DECODE_PLANS, T._FORM_PLANS)
    for table in tables:
        table.clear()
    yield log
    for table in tables:
        table.clear()


def _same(a, b, inputs, pairs) -> None:
    """``a`` (replayed) launches what ``b`` (the launcher's own path) does: inputs by
    identity, buffers one for one with the same shape, strides and dtype, descriptors
    field by field, everything else equal."""
    if isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor)
        if any(b is t for t in inputs):
            assert a is b
            return
        if b._base is not None:
            # a view at a tensor's own address (the decode form's transposes of q, k, v,
            # which may be views themselves): the kernel reads the address, so a replay
            # passes the input it views, or a buffer where the recording viewed its own
            same = [t for t in inputs if t is not None and t.data_ptr() == b.data_ptr() and t.dtype == b.dtype]
            if same:
                assert any(a is t for t in same)
                return
            base = b._base
            if b.data_ptr() == base.data_ptr() and a._base is None and a.shape != b.shape:
                b = base
        assert not any(a is t for t in inputs)
        assert (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype)
        assert pairs.setdefault(id(b), a) is a  # one buffer for one buffer, in every launch
        return
    if hasattr(b, "block_shape") and hasattr(b, "base"):
        assert type(a) is type(b)
        fa = {k: v for k, v in vars(a).items() if k != "base"}
        fb = {k: v for k, v in vars(b).items() if k != "base"}
        assert fa == fb
        _same(a.base, b.base, inputs, pairs)
        return
    assert type(a) is type(b) and a == b, (a, b)


def _same_launches(replayed, own, inputs) -> dict:
    """Two logs launch alike (:func:`_same`, kernel, grid and argument by argument);
    returns the buffer pairs seen."""
    assert len(own) == len(replayed)
    pairs = {}
    for (_, k1, g1, a1), (_, k2, g2, a2) in zip(replayed, own):
        assert k1 is k2 and g1 == g2 and len(a1) == len(a2)
        for x, y in zip(a1, a2):
            _same(x, y, inputs, pairs)
    return pairs


def _own_tensors(inputs) -> tuple:
    """The tensors a replay must pass as they are: the inputs, and of a user variant's
    arguments (a ``UserArgs`` among them) its captured tensors, gradient buffers and
    sinks, the call's own."""
    out = []
    for t in inputs:
        if hasattr(t, "bufs") and hasattr(t, "grads"):
            out += [*t.bufs, *(g for g in t.grads if g is not None), *(() if t.sinks is None else (t.sinks,))]
        else:
            out.append(t)
    return tuple(out)


def _check_replay(log, call, make_inputs):
    """Record with one set of inputs, replay with a second, compare with the launcher's
    own path on the second (plans off)."""
    call(*make_inputs())
    assert all(how == "launch" for how, *_ in log)
    log.clear()
    inputs = make_inputs()
    out_replay = call(*inputs)
    replayed = list(log)
    assert replayed and all(how == "replay" for how, *_ in replayed)
    log.clear()
    plans.usable, usable = (lambda: False), plans.usable
    try:
        out_own = call(*inputs)
    finally:
        plans.usable = usable
    own = _own_tensors(inputs)
    pairs = _same_launches(replayed, list(log), own)
    for x, y in zip(out_replay, out_own):
        _same(x, y, own, pairs)
    return out_replay


def _bhsd(b, h, s, d, dtype=torch.bfloat16, bshd=False):
    if bshd:  # transformers' layout seen as (batch, heads, seqlen, head_dim)
        return torch.randn(b, s, h, d).to(dtype).transpose(1, 2)
    return torch.randn(b, h, s, d).to(dtype)


@pytest.mark.parametrize("case", ["default", "group_split", "bshd", "ordered", "given_outputs"])
def test_gluon_backward_replays_its_own_launches(fake_gpu, case):
    b, h, hk, s, d = 2, 4, 2, 256, 128
    mask, lo, hi = "causal", -s, 0
    cfg = B.default_config(d, "bfloat16", mask)
    if case == "group_split":
        cfg = dataclasses.replace(cfg, group_split=2, kv_store="ptr")
    if case == "ordered":
        d = 64
        cfg = dataclasses.replace(B.default_config(d, "bfloat16", mask), dq_mode="ordered")
        assert B.is_valid(cfg, d, "bfloat16", mask), B.invalid_reasons(cfg, d, "bfloat16", mask)
    bshd = case == "bshd"

    def make():
        q, do, o = (_bhsd(b, h, s, d, bshd=bshd) for _ in range(3))
        k, v = (_bhsd(b, hk, s, d, bshd=bshd) for _ in range(2))
        lse = torch.randn(b, h, s)
        given = tuple(torch.empty_like(t) for t in (q, k, v)) if case == "given_outputs" else (None,) * 3
        return (do, q, k, v, o, lse, *given, torch.empty(b, h, s))

    def call(do, q, k, v, o, lse, dq, dk, dv, delta):
        return B.attention_bwd(do, q, k, v, o, lse, softmax_scale=0.125, diag_lo=lo, diag_hi=hi, mask=mask,
                               config=cfg, dq=dq, dk=dk, dv=dv, delta_out=delta)

    dq, dk, dv = _check_replay(fake_gpu, call, make)
    if bshd:
        assert dq.stride() == (s * h * d, d, h * d, 1)


def test_gluon_backward_zeroes_the_ordered_semaphores_on_replay(fake_gpu):
    d, mask = 64, "causal"
    cfg = dataclasses.replace(B.default_config(d, "bfloat16", mask), dq_mode="ordered")
    q, do, o = (_bhsd(1, 2, 128, d) for _ in range(3))
    k, v = (_bhsd(1, 2, 128, d) for _ in range(2))
    lse = torch.randn(1, 2, 128)
    run = lambda: B.attention_bwd(do, q, k, v, o, lse, softmax_scale=0.1, diag_lo=-128, diag_hi=0,  # noqa: E731
                                  mask=mask, config=cfg)
    run()
    plan = B._PLANS[next(iter(B._PLANS))]
    assert [name for name, *_, zero in plan.buffers if zero] == ["sem"]
    fake_gpu.clear()
    run()
    sems = [a for _, _, _, args in fake_gpu for a in args if isinstance(a, torch.Tensor) and a.dtype == torch.int32]
    assert sems and all(int(t.abs().sum()) == 0 for t in sems)


def test_gluon_forward_replays_its_own_launch(fake_gpu):
    spec = C.GluonFwdSpec("bfloat16", 128, 128, "causal")
    cfg = dataclasses.replace(C.default_config(spec), persistent=2)

    def make():
        return _bhsd(2, 4, 300, 128), _bhsd(2, 2, 300, 128), _bhsd(2, 2, 300, 128), _bhsd(2, 4, 300, 128)

    def call(q, k, v, out):
        return L.fwd(q, k, v, softmax_scale=0.1, mask="causal", diag_lo=-300, diag_hi=0, config=cfg, out=out,
                     check_inputs=False)

    _check_replay(fake_gpu, call, make)


def test_the_gluon_forward_with_sinks_replays_with_the_new_sinks(fake_gpu):
    spec = C.GluonFwdSpec("bfloat16", 64, 64, "none", sinks=True)
    cfg = C.default_config(spec)

    def make():
        return _bhsd(1, 2, 128, 64), _bhsd(1, 2, 128, 64), _bhsd(1, 2, 128, 64), torch.randn(2)

    _check_replay(fake_gpu, lambda q, k, v, sinks: L.fwd(q, k, v, softmax_scale=0.1, mask="none", diag_lo=-128,
                                                         diag_hi=128, config=cfg, check_inputs=False, sinks=sinks),
                  make)


def _document_args(b, h, hk, s, lo, hi, backward):
    """(forward UserArgs, backward UserArgs) of a document mask over a fresh ids tensor
    (a new captured tensor on every call, as a model's batch brings)."""
    from flashgen import user_mods

    doc = torch.randint(0, 3, (s,)).sort().values

    def mask_mod(bb, hh, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    mask = user_mods.trace(mask_mod, "mask")
    return user_mods.kernel_args(None, mask, [], None, (b, h, hk, s, s, lo, hi), torch.device("cpu"), backward)


def test_triton_launchers_replay_a_user_variant_with_its_new_tensors(fake_gpu):
    """A user mask function's launches keep plans too: its captured tensor, block mask
    and (bwd_dq) gradient buffers are the plan's inputs, so a replay passes the call's
    own, and its strides and sizes are part of the key."""
    d, s, cfg = 64, 200, TileConfig(64, 64, 4, 2, tma=1)
    lo, hi = -s, 0

    def make():
        q, do, o = (_bhsd(1, 4, s, d, dtype=torch.float16) for _ in range(3))
        k, v = (_bhsd(1, 2, s, d, dtype=torch.float16) for _ in range(2))
        fwd, bwd = _document_args(1, 4, 2, s, lo, hi, True)
        return q, k, v, o, do, torch.randn(1, 4, s), fwd, bwd

    kw = dict(softmax_scale=0.125, mask="window", diag_lo=lo, diag_hi=hi, config=cfg, addressable=True)
    for name, call in (("fwd", lambda q, k, v, o, do, lse, fa, ba: T.fwd(q, k, v, mods=fa, **kw)),
                       ("bwd_dq", lambda q, k, v, o, do, lse, fa, ba: T.bwd_dq(do, q, k, v, o, lse, mods=ba, **kw)),
                       ("bwd_dkdv", lambda q, k, v, o, do, lse, fa, ba: T.bwd_dkdv(do, q, k, v, lse, lse, mods=ba,
                                                                                    **kw))):
        fake_gpu.clear()
        _check_replay(fake_gpu, call, make)
        table = {"fwd": T._FWD_PLANS, "bwd_dq": T._DQ_PLANS, "bwd_dkdv": T._DKDV_PLANS}[name]
        assert len(table) == 1, name
    # another mask function (another variant): its own plan
    fake_gpu.clear()
    q, k, v, o, do, lse, _, _ = make()
    from flashgen import user_mods

    prefix = user_mods.trace(lambda bb, hh, q_idx, kv_idx: kv_idx < 64, "mask")
    fa = user_mods.kernel_args(None, prefix, [], None, (1, 4, 2, s, s, lo, hi), torch.device("cpu"), False)[0]
    T.fwd(q, k, v, mods=fa, **kw)
    assert len(T._FWD_PLANS) == 2 and [how for how, *_ in fake_gpu] == ["launch"]


def test_the_gluon_kernels_replay_a_user_mask_function_with_its_new_tensors(fake_gpu):
    """The Gluon forward and whole backward of a user mask function keep plans too,
    each call's captured tensor and block mask passed on replay."""
    b, h, hk, s, d = 1, 4, 2, 256, 128
    lo, hi = -s, 0

    def make():
        q, do, o = (_bhsd(b, h, s, d) for _ in range(3))
        k, v = (_bhsd(b, hk, s, d) for _ in range(2))
        fwd, bwd = _document_args(b, h, hk, s, lo, hi, True)
        return do, q, k, v, o, torch.randn(b, h, s), fwd, bwd

    _check_replay(fake_gpu, lambda do, q, k, v, o, lse, fa, ba: L.fwd(
        q, k, v, softmax_scale=0.1, mask="window", diag_lo=lo, diag_hi=hi, check_inputs=False, user=fa),
        make)
    fake_gpu.clear()
    _check_replay(fake_gpu, lambda do, q, k, v, o, lse, fa, ba: B.attention_bwd(
        do, q, k, v, o, lse, softmax_scale=0.1, diag_lo=lo, diag_hi=hi, mask="window", user=ba), make)
    assert len(L._PLANS) == 1 and len(B._PLANS) == 1
    # the backward builds a call's user arguments once (the plan's key and the launch)
    from flashgen import user_mods

    built = []
    real = user_mods.UserArgs.gluon_bwd_args

    def counted(self, *a):
        built.append(1)
        return real(self, *a)

    user_mods.UserArgs.gluon_bwd_args = counted
    try:
        B._PLANS.clear()
        for _ in range(2):
            do, q, k, v, o, lse, fa, ba = make()
            B.attention_bwd(do, q, k, v, o, lse, softmax_scale=0.1, diag_lo=lo, diag_hi=hi, mask="window", user=ba)
    finally:
        user_mods.UserArgs.gluon_bwd_args = real
    assert len(built) == 2


def test_no_plan_for_the_built_in_score_modifications(fake_gpu):
    """Dropout draws its seed per call, so the built-in modifications keep their own
    path: nothing is recorded."""
    d, s, cfg = 64, 128, TileConfig(64, 64, 4, 2)
    q, k, v = (_bhsd(1, 2, s, d, dtype=torch.float16) for _ in range(3))
    mods = T.ScoreMods(softcap=20.0)
    for _ in range(2):
        T.fwd(q, k, v, softmax_scale=0.125, mask="none", diag_lo=-s, diag_hi=s, config=cfg, mods=mods)
    assert not T._FWD_PLANS and all(how == "launch" for how, *_ in fake_gpu)


@pytest.mark.parametrize("tma", [0, 1])
def test_triton_launchers_replay_their_own_launches(fake_gpu, tma):
    d, s = 64, 200
    cfg = TileConfig(64, 64, 4, 2, tma=tma)

    def make():
        q, do, o = (_bhsd(1, 4, s, d, dtype=torch.float16) for _ in range(3))
        k, v = (_bhsd(1, 2, s, d, dtype=torch.float16) for _ in range(2))
        return q, k, v, o, do, torch.randn(1, 4, s)

    kw = dict(softmax_scale=0.125, mask="causal", diag_lo=-s, diag_hi=0, config=cfg, addressable=True)
    _check_replay(fake_gpu, lambda q, k, v, o, do, lse: T.fwd(q, k, v, **kw), make)
    fake_gpu.clear()
    _check_replay(fake_gpu, lambda q, k, v, o, do, lse: T.bwd_dq(do, q, k, v, o, lse, **kw), make)
    fake_gpu.clear()
    delta = torch.randn(1, 4, s)
    _check_replay(fake_gpu, lambda q, k, v, o, do, lse: T.bwd_dkdv(do, q, k, v, lse, delta, **kw),
                  lambda: make()[:5] + (delta,))


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_replays_its_own_launches(fake_gpu, paged, splits):
    """The decode launcher's plan holds its split kernel and, with more than one split,
    the combine kernel (their partial buffers allocated again), for a contiguous and a
    paged cache; the outputs the caller passes stay the caller's."""
    cfg = TileConfig(16, 32, 4, 2, num_splits=splits)
    b, sq, h, hk, d, n = 2, 1, 8, 2, 64, 96

    def make():
        q = torch.randn(b, sq, h, d, dtype=torch.float16)
        if paged:
            kc, vc = (torch.randn(12, 16, hk, d, dtype=torch.float16) for _ in range(2))
            bt = torch.arange(12, dtype=torch.int32).reshape(b, 6)
        else:
            kc, vc = (torch.randn(b, n, hk, d, dtype=torch.float16) for _ in range(2))
            bt = None
        return q, kc, vc, torch.tensor([n, n - 5], dtype=torch.int32), bt

    kw = dict(softmax_scale=0.125, mask="causal", config=cfg)
    _check_replay(fake_gpu, lambda q, kc, vc, lens, bt: T.decode(q, kc, vc, lens, bt, **kw), make)
    assert {len(fake_gpu)} == {2 if splits > 1 else 1}
    fake_gpu.clear()
    out = torch.empty(b, sq, h, d, dtype=torch.float16)
    got = T.decode(*make(), out=out, **kw)[0]
    assert got is out and [how for how, *_ in fake_gpu] == ["launch"] * len(fake_gpu)


def test_the_decode_form_replays_with_one_lengths_tensor(fake_gpu):
    """The dense forward's flash-decoding form passes the decode kernel a lengths tensor
    kept per device (every entry the int32 maximum, which the kernel clamps to the
    cache's capacity), so a repeated call replays its plan instead of filling one."""
    cfg = TileConfig(16, 32, 4, 2, num_splits=2)
    make = lambda: (torch.randn(1, 8, 1, 64, dtype=torch.float16),  # noqa: E731
                    *(torch.randn(1, 2, 600, 64, dtype=torch.float16) for _ in range(2)))
    T._LENGTHS.clear()
    kw = dict(softmax_scale=0.125, mask="none", diag_lo=-1, diag_hi=600, config=cfg)
    _check_replay(fake_gpu, lambda q, k, v: T.fwd(q, k, v, **kw), make)
    lens = fake_gpu[0][3][3]
    assert lens.dtype == torch.int32 and lens.numel() >= 1 and (lens == 2 ** 31 - 1).all()
    assert lens is T._LENGTHS[lens.device]
    T._LENGTHS.clear()


def test_the_current_device_is_part_of_the_key(fake_gpu, monkeypatch):
    """Launches go to the current device: a call made while another device is current
    is recorded apart (as the launcher's own path would compile it apart)."""
    cfg = TileConfig(64, 64, 4, 2)
    q = k = v = _bhsd(1, 2, 64, 64, dtype=torch.float16)
    kw = dict(softmax_scale=0.125, mask="none", diag_lo=-64, diag_hi=64, config=cfg, addressable=True)
    T.fwd(q, k, v, **kw)
    monkeypatch.setattr(fastlaunch, "_current_device", lambda: 1)
    fake_gpu.clear()
    T.fwd(q, k, v, **kw)
    assert [how for how, *_ in fake_gpu] == ["launch"] and len(T._FWD_PLANS) == 2


def test_a_tensor_the_plan_cannot_supply_refuses_the_recording():
    rec = plans.Recorder()
    rec.add(FakeKernel([]), (1,), (torch.zeros(4), 3))
    assert plans.build(rec, (), {}) is None
    t = torch.zeros(4)
    assert plans.build(rec, (t,), {}) is None  # another tensor than the one launched
    rec = plans.Recorder()
    rec.add(None, (1,), (t,))  # Triton's own path kept no kernel
    assert plans.build(rec, (t,), {}) is None


def _tensor_places(log, inputs):
    """Per launch, which input (by position) or "buf" each tensor argument is."""
    out = []
    for _, _, _, args in log:
        names = []
        for a in args:
            a = getattr(a, "base", a)
            if isinstance(a, torch.Tensor):
                names.append(next((i for i, t in enumerate(inputs) if a is t), "buf"))
        out.append(names)
    return out


@pytest.mark.parametrize("tma", [0, 1])
def test_a_call_with_one_tensor_in_several_places_is_recorded_apart(fake_gpu, tma):
    """attention(x, x, x) first, then three tensors of the same sizes: the replay must
    read q, k and v, not x's places (nor write O over an input given as out)."""
    cfg = TileConfig(64, 64, 4, 2, tma=tma)
    kw = dict(softmax_scale=0.125, mask="none", diag_lo=-128, diag_hi=128, config=cfg, addressable=True)
    x = _bhsd(1, 2, 128, 64, dtype=torch.float16)
    T.fwd(x, x, x, **kw)
    q, k, v = (_bhsd(1, 2, 128, 64, dtype=torch.float16) for _ in range(3))
    fake_gpu.clear()
    T.fwd(q, k, v, **kw)
    T.fwd(q, k, v, **kw)  # recorded on the first of these two, replayed on the second
    assert [how for how, *_ in fake_gpu] == ["launch", "replay"]
    assert _tensor_places(fake_gpu, (q, k, v)) == [[0, 1, 2, "buf", "buf"]] * 2
    # out given as q at recording, then a new out
    T._FWD_PLANS.clear()
    T.fwd(q, k, v, out=q, **kw)
    out = torch.empty_like(q)
    fake_gpu.clear()
    T.fwd(q, k, v, out=out, **kw)
    assert _tensor_places(fake_gpu, (q, k, v, out)) == [[0, 1, 2, 3, "buf"]]


def test_the_module_passed_is_part_of_the_key(fake_gpu):
    """The same config launched with another module (a probe's variant of it) launches
    that module's kernel, not the recorded one's."""
    from flashgen import compile as _compile
    from flashgen.spec import KernelSpec, Variant

    cfg = TileConfig(64, 64, 4, 2)
    kw = dict(softmax_scale=0.125, mask="none", diag_lo=-128, diag_hi=128, config=cfg, addressable=True)
    q = _bhsd(1, 2, 128, 64, dtype=torch.float16)
    mod = _compile.load(Variant(KernelSpec("fwd", "float16", 64, 64, "none"), cfg))

    class Other:  # the same module's attributes, another kernel function
        def __getattr__(self, name):
            return getattr(mod, name)

        attn_fwd = object()

    T.fwd(q, q, q, module=mod, **kw)
    T.fwd(q, q, q, module=mod, **kw)
    T.fwd(q, q, q, module=Other(), **kw)
    kernels = [k for _, k, _, _ in fake_gpu]
    assert [how for how, *_ in fake_gpu] == ["launch", "replay", "launch"] and kernels[2] is not kernels[0]


def test_a_nan_scale_takes_no_plan(fake_gpu):
    cfg = TileConfig(64, 64, 4, 2)
    q = _bhsd(1, 2, 64, 64, dtype=torch.float16)
    for _ in range(3):
        T.fwd(q, q, q, softmax_scale=float("nan"), mask="none", diag_lo=-64, diag_hi=64, config=cfg, addressable=True)
    assert not T._FWD_PLANS and [how for how, *_ in fake_gpu] == ["launch"] * 3


def test_a_full_table_replaces_its_oldest_plan(fake_gpu, monkeypatch):
    # a generation loop's seqlen_k grows by one per step: past PLAN_MAX sizes a table
    # that stopped recording would leave every later call without a plan
    monkeypatch.setattr(plans, "PLAN_MAX", 2)
    cfg = TileConfig(64, 64, 4, 2)
    for s in (64, 80, 96, 96, 64, 96):
        q = _bhsd(1, 2, s, 64, dtype=torch.float16)
        T.fwd(q, q, q, softmax_scale=0.1, mask="none", diag_lo=-s, diag_hi=s, config=cfg, addressable=True)
    # 64 and 80 recorded; 96 replaces 64 and replays; 64 recorded again (replacing 80)
    assert [how for how, *_ in fake_gpu] == ["launch", "launch", "launch", "replay", "launch", "replay"]
    assert len(T._FWD_PLANS) == 2


def test_a_full_table_keeps_a_known_key_without_evicting(monkeypatch):
    monkeypatch.setattr(plans, "PLAN_MAX", 2)
    table = {}
    plans.remember(table, "a", None)
    plans.remember(table, "b", None)
    plans.remember(table, "b", None)
    assert list(table) == ["a", "b"]
    plans.remember(table, "c", None)
    assert list(table) == ["b", "c"]


# -- direct stages: the raw launcher called with what Triton's own wrapper passes ------

def _nvidia_driver():
    try:
        from triton.backends.nvidia import driver as drv
    except Exception:  # noqa: BLE001 - no nvidia backend in this Triton
        return None
    return drv


class _FakeUtils:
    """Triton's ``CudaUtils`` as the launch path uses it: ``fill_tma_descriptor`` returns
    a tensor map recording its arguments (a new object per call), and counts calls."""

    def __init__(self):
        self.fills = 0

    def fill_tma_descriptor(self, ptr, *rest):
        self.fills += 1
        return ("tensor map", ptr, *[tuple(x) if isinstance(x, list) else x for x in rest])


@pytest.fixture
def nvidia_launcher(monkeypatch):
    """(make_kernel(signature, metas, raw), utils): a kept kernel whose ``run`` is Triton
    3.6's real ``CudaLauncher`` (built without compiling) around a fake C launcher, on a
    fake active driver."""
    import triton

    drv = _nvidia_driver()
    if drv is None or getattr(drv, "_BASE_ARGS_FORMAT_LEN", None) != 13 or not hasattr(drv, "wrap_handle_tensordesc"):
        pytest.skip("this Triton's launcher is not the one direct stages are written against (they stay off)")
    utils = _FakeUtils()

    class FakeDriver:
        pass

    fake = FakeDriver()
    fake.utils = utils
    monkeypatch.setattr(triton.runtime.driver, "_active", fake)
    monkeypatch.setattr(fastlaunch, "_device_and_stream", lambda: (0, 99))
    monkeypatch.setattr(fastlaunch, "ensure_context", lambda dev: None)

    def make_kernel(signature, metas, raw):
        run = object.__new__(drv.CudaLauncher)
        run.launch = drv.wrap_handle_tensordesc(raw, signature, metas)
        run.num_ctas = 1
        run.global_scratch_size = run.profile_scratch_size = 0
        run.global_scratch_align = run.profile_scratch_align = 1
        run.launch_cooperative_grid = False
        run.launch_pdl = False

        class Kernel:
            pass

        k = Kernel()
        k.run, k.function, k.packed_metadata = run, 1234, ("packed",)
        return k

    return make_kernel, utils


@pytest.mark.parametrize("with_meta", [True, False])
def test_a_direct_stage_passes_the_raw_launcher_what_tritons_wrapper_does(nvidia_launcher, with_meta):
    from triton.tools.tensor_descriptor import TensorDescriptor

    make_kernel, utils = nvidia_launcher
    calls = []
    raw = lambda *a: calls.append(a)  # noqa: E731
    sig = {0: "tensordesc<bf16[64, 128]>", 1: "*fp32", 2: "tensordesc<bf16[64, 128]>", 3: "fp32", 4: "i32",
           5: "constexpr"}
    meta = {"swizzle": 3, "elem_size": 2, "elem_type": 10, "block_size": [64, 128], "fp4_padded": False}
    kernel = make_kernel(sig, [meta, dict(meta, swizzle=2)] if with_meta else None, raw)

    def args_for(q, out, lse):
        return (TensorDescriptor(q, list(q.shape), list(q.stride()), [64, 128]), lse,
                TensorDescriptor(out, list(out.shape), list(out.stride()), [64, 128]), 0.5, 7, 64)

    q = torch.randn(256, 128).to(torch.bfloat16)
    out, lse = torch.empty_like(q), torch.empty(256)
    rec = plans.Recorder()
    rec.add(kernel, (4, 2), args_for(q, out, lse))
    plan = plans.build(rec, (q,), {"out": out, "lse": lse})
    assert plan is not None and plan.stages[0][0] is None  # direct
    fills = utils.fills
    for _ in range(3):
        q2 = torch.randn(256, 128).to(torch.bfloat16)
        calls.clear()
        bufs = plan.run((q2,))
        direct = calls[-1]
        calls.clear()
        kernel.run(4, 2, 1, 99, kernel.function, kernel.packed_metadata, None, None, None,
                   *args_for(q2, bufs["out"], bufs["lse"]))
        own = calls[-1]
        assert len(direct) == len(own)
        for a, b in zip(direct, own):
            assert a is b if isinstance(b, torch.Tensor) else a == b, (a, b)
    if with_meta:
        # the first replay encodes its addresses; a later one with an address seen before does not
        before = utils.fills
        kept = torch.randn(256, 128).to(torch.bfloat16)
        plan.run((kept,))
        plan.run((kept,))
        assert utils.fills - before <= 2 * 2 - 1
        assert utils.fills > fills


def test_a_stage_stays_on_kernel_run_when_the_launcher_is_not_recognised(nvidia_launcher, monkeypatch):
    make_kernel, _ = nvidia_launcher
    calls = []
    kernel = make_kernel({0: "*fp32", 1: "i32"}, None, lambda *a: calls.append(a))
    t = torch.zeros(16)
    for change in ("scratch", "off"):
        rec = plans.Recorder()
        rec.add(kernel, (1,), (t, 3))
        if change == "scratch":
            kernel.run.global_scratch_size = 64
        else:
            kernel.run.global_scratch_size = 0
            monkeypatch.setattr(plans, "DIRECT", False)
        plan = plans.build(rec, (t,), {})
        assert plan.stages[0][0] is kernel


def test_direct_stages_only_where_tritons_launcher_is_the_one_they_know():
    """On Triton 3.6 a kept kernel whose launcher takes no descriptor becomes a direct
    stage; on a Triton whose launcher differs (3.9: other base arguments) it stays on
    kernel.run."""
    drv = _nvidia_driver()
    if drv is None:
        pytest.skip("no nvidia backend in this Triton")
    run = object.__new__(drv.CudaLauncher)
    run.launch = len  # a C function, as the raw launcher of a kernel without descriptors is
    run.global_scratch_size = run.profile_scratch_size = 0
    run.launch_cooperative_grid = run.launch_pdl = False

    class Kernel:
        pass

    kernel = Kernel()
    kernel.run, kernel.function, kernel.packed_metadata = run, 1, ("packed",)
    t = torch.zeros(16)
    stage = plans._direct_stage(kernel, (2, 1, 1), (t, 5), [None, 5], [(0, 0)], [])
    known = getattr(drv, "_BASE_ARGS_FORMAT_LEN", None) == 13
    assert (stage is not None) is known
    if known:
        assert stage[1] is len and stage[4][:3] == (2, 1, 1) and stage[5] == ((13, 0),) and stage[4][14] == 5


def test_two_threads_recording_put_back_tritons_own_encoder(nvidia_launcher):
    """Two threads recording direct stages at once (two GPUs' autograd threads on their
    first backward): the encoder watched while a descriptor is expanded is put back as
    Triton's own, never as another recording's watcher."""
    import threading

    import triton
    from triton.tools.tensor_descriptor import TensorDescriptor

    _, utils = nvidia_launcher
    drv = _nvidia_driver()
    meta = {"swizzle": 3, "elem_size": 2, "elem_type": 10, "block_size": [64, 128], "fp4_padded": False}
    a_in, a_done = threading.Event(), threading.Event()
    results = {}

    def fill(ptr, *rest):
        if threading.current_thread().name == "A":
            a_in.set()
            a_done.wait(0.5)  # B starts while A is inside the expansion
        return ("map", ptr)

    utils.fill_tma_descriptor = fill
    t = torch.zeros(256, 128, dtype=torch.bfloat16)
    desc = TensorDescriptor(t, list(t.shape), list(t.stride()), [64, 128])

    def expand(name):
        results[name] = plans._expand(drv, desc, meta)

    ta = threading.Thread(target=expand, args=("A",), name="A")
    tb = threading.Thread(target=expand, args=("B",), name="B")
    ta.start()
    assert a_in.wait(5)
    tb.start()
    a_done.set()
    ta.join(5)
    tb.join(5)
    assert triton.runtime.driver.active.utils.fill_tma_descriptor is fill
    for name in "AB":
        parts = results[name]
        assert parts is not None and type(parts[0]) is plans._Map and parts[0].encoder is fill


def test_the_decode_form_replays_its_own_plan(fake_gpu):
    """The dense forward's flash-decoding form keeps one plan over q, k, v (not the
    decode launcher's over their transposed views): a replay passes each tensor where
    the recording passed its view at the same address, and the kept lengths tensor as
    it is; the caller's O stays the caller's."""
    cfg = TileConfig(16, 32, 4, 2, num_splits=3)
    make = lambda: (torch.randn(2, 8, 2, 64, dtype=torch.float16),  # noqa: E731
                    *(torch.randn(2, 2, 700, 64, dtype=torch.float16) for _ in range(2)))
    T._LENGTHS.clear()
    kw = dict(softmax_scale=0.125, mask="causal", diag_lo=698, diag_hi=700, config=cfg)
    _check_replay(fake_gpu, lambda q, k, v: T.fwd(q, k, v, **kw), make)
    assert len(T._FORM_PLANS) == 1 and not T._DECODE_PLANS
    split, combine = fake_gpu  # the replayed launches
    q, k, v = make()
    fake_gpu.clear()
    T.fwd(q, k, v, **kw)
    (_, _, _, args), _ = fake_gpu
    assert args[0] is q and args[1] is k and args[2] is v and args[3] is T._LENGTHS[q.device]
    out = torch.empty(2, 8, 2, 64, dtype=torch.float16)
    fake_gpu.clear()
    got, _ = T.fwd(q, k, v, out=out, **kw)
    assert got is out and [how for how, *_ in fake_gpu] == ["launch", "launch"]  # another key: recorded
    fake_gpu.clear()
    got, _ = T.fwd(q, k, v, out=out, **kw)
    assert got is out and [how for how, *_ in fake_gpu] == ["replay", "replay"]
    assert fake_gpu[0][3][5] is out  # the caller's O, where the recording passed its transpose
    T._LENGTHS.clear()


def test_the_decode_form_records_no_plan_with_a_capture_s_lengths(fake_gpu, monkeypatch):
    """During a CUDA-graph capture the form's lengths tensor is made for the capture and
    not kept: a plan holding it would read memory the graph's pool hands out again, so
    none is recorded (and a capture around the call records no recipe)."""
    cfg = TileConfig(16, 32, 4, 2, num_splits=2)
    q = torch.randn(1, 8, 1, 64, dtype=torch.float16)
    k, v = (torch.randn(1, 2, 600, 64, dtype=torch.float16) for _ in range(2))
    monkeypatch.setattr(T, "_lengths", lambda b, device: torch.full((b,), 2 ** 31 - 1, dtype=torch.int32))
    kw = dict(softmax_scale=0.125, mask="none", diag_lo=-1, diag_hi=600, config=cfg)
    with plans.capture() as cap:
        T.fwd(q, k, v, **kw)
    T.fwd(q, k, v, **kw)
    assert [how for how, *_ in fake_gpu] == ["launch"] * 4 and not T._FORM_PLANS and not cap.ok


def test_views_and_kept_tensors_in_a_plan(fake_gpu):
    """A declared view replays as the tensor it views only at that tensor's own address;
    a kept tensor is passed as it is; any other tensor still refuses the recording."""
    q, held = torch.randn(2, 4, 8), torch.zeros(3, dtype=torch.int32)
    kernel = FakeKernel([])
    rec = plans.Recorder()
    view = q.transpose(0, 1)
    rec.add(kernel, (1,), (view, held, 5))
    plan = plans.build(rec, (q,), {}, views=((view, q),), kept=(held,))
    assert plan is not None
    q2 = torch.randn(2, 4, 8)
    plan.run((q2,))
    (_, _, _, args), = kernel.log
    assert args[0] is q2 and args[1] is held and args[2] == 5
    rec = plans.Recorder()
    shifted = q[1:]
    rec.add(kernel, (1,), (shifted,))
    assert plans.build(rec, (q,), {}, views=((shifted, q),)) is None
    rec = plans.Recorder()
    rec.add(kernel, (1,), (view, held))
    assert plans.build(rec, (q,), {}, views=((view, q),)) is None  # held, not declared kept


@pytest.mark.parametrize("layout", ["bshd", "packed-kv", "bshd-out"])
def test_the_decode_form_replays_views_of_views(fake_gpu, layout):
    """q, k, v (and O) that are views already (transformers' (batch, seqlen, heads,
    head_dim) seen through transpose(1, 2); k and v as slices of one packed tensor): the
    form's plan replays them as the launcher's own path launches them."""
    cfg = TileConfig(16, 32, 4, 2, num_splits=2)

    def make():
        q = torch.randn(2, 3, 8, 64, dtype=torch.float16).transpose(1, 2)
        if layout == "packed-kv":
            kv = torch.randn(2, 700, 2, 2, 64, dtype=torch.float16)
            k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
        else:
            k, v = (torch.randn(2, 700, 2, 64, dtype=torch.float16).transpose(1, 2) for _ in range(2))
        out = torch.empty(2, 3, 8, 64, dtype=torch.float16).transpose(1, 2) if layout == "bshd-out" else None
        return q, k, v, out

    T._LENGTHS.clear()
    kw = dict(softmax_scale=0.125, mask="causal", diag_lo=697, diag_hi=700, config=cfg)
    _check_replay(fake_gpu, lambda q, k, v, out: T.fwd(q, k, v, out=out, **kw), make)
    assert len(T._FORM_PLANS) == 1
    T._LENGTHS.clear()


def test_a_replaced_lengths_tensor_stays_alive():
    """A larger batch replaces the decode form's lengths tensor (at least doubled); the
    one it replaces is kept, since a CUDA graph captured with it reads its address
    whether or not a launch plan holds it (plans off)."""
    import gc
    import weakref

    T._LENGTHS.clear()
    dev = torch.device("cpu")
    first = T._lengths(3, dev)
    assert first.numel() == 64 and T._lengths(64, dev) is first
    ref = weakref.ref(first)
    del first
    grown = T._lengths(65, dev)
    assert grown.numel() == 128 and (grown == 2 ** 31 - 1).all()
    gc.collect()
    assert ref() is not None and ref() is T._LENGTHS_RETIRED[-1]
    T._LENGTHS.clear()
    T._LENGTHS_RETIRED.clear()

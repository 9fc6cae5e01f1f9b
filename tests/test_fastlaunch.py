"""flashgen.fastlaunch: the signature it keys compiled kernels on, and when it launches
through the kept kernel or through Triton's own ``fn[grid]`` (fakes for the kernel and
the device; the real launches are the GPU benchmarks')."""

import os
import types

import pytest
import torch

from flashgen import fastlaunch


class FakeKernel:
    packed_metadata = object()
    function = 7

    def __init__(self):
        self.runs = []

    def run(self, *a):
        self.runs.append(a)


class FakeFn:
    def __init__(self, constexpr):
        self.params = [types.SimpleNamespace(is_constexpr=c) for c in constexpr]
        self.compiled = []

    def __getitem__(self, grid):
        def go(*args, **options):
            k = FakeKernel()
            self.compiled.append((grid, args, options, k))
            return k
        return go


@pytest.fixture
def gpu(monkeypatch):
    monkeypatch.setattr(fastlaunch, "_device_and_stream", lambda: (0, 1234))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("FLASHGEN_FAST_LAUNCH", raising=False)
    fastlaunch._KERNELS.clear()


def test_second_call_of_a_signature_runs_the_kept_kernel(gpu):
    fn = FakeFn([False, False, False, True])
    t = torch.zeros(8)
    k1 = fastlaunch.launch(fn, (3,), (t, 32, 0.5, 64), num_warps=4)
    assert len(fn.compiled) == 1 and k1.runs == []
    k2 = fastlaunch.launch(fn, (5, 2), (t, 48, 0.25, 64), num_warps=4)
    assert k2 is k1 and len(fn.compiled) == 1
    assert k1.runs == [(5, 2, 1, 1234, 7, FakeKernel.packed_metadata, None, None, None, t, 48, 0.25, 64)]


@pytest.mark.parametrize("changed", [
    (torch.zeros(8, dtype=torch.float16), 32, 0.5, 64),  # tensor dtype
    (torch.zeros(9)[1:], 32, 0.5, 64),  # data_ptr not 16-byte aligned
    (torch.zeros(8), 33, 0.5, 64),  # int no longer a multiple of 16
    (torch.zeros(8), 1, 0.5, 64),  # int 1
    (torch.zeros(8), 0, 0.5, 64),  # int 0
    (torch.zeros(8), 1 << 40, 0.5, 64),  # int64
    (torch.zeros(8), 32, 0.5, 128),  # constexpr value
])
def test_any_change_triton_specializes_on_compiles_again(gpu, changed):
    fn = FakeFn([False, False, False, True])
    fastlaunch.launch(fn, (1,), (torch.zeros(8), 32, 0.5, 64), num_warps=4)
    fastlaunch.launch(fn, (1,), changed, num_warps=4)
    assert len(fn.compiled) == 2


def test_options_and_descriptors_are_part_of_the_signature(gpu):
    fn = FakeFn([False])
    fastlaunch.launch(fn, (1,), (torch.zeros(8),), num_warps=4)
    fastlaunch.launch(fn, (1,), (torch.zeros(8),), num_warps=8)
    assert len(fn.compiled) == 2

    def desc(block, layout="L"):
        return types.SimpleNamespace(base=torch.zeros(8), block_shape=block, layout=layout, padding="zero")

    fn = FakeFn([False])
    for d in (desc([1, 64]), desc([1, 64]), desc([1, 128]), desc([1, 64], "M")):
        fastlaunch.launch(fn, (1,), (d,))
    assert len(fn.compiled) == 3


@pytest.mark.parametrize("why", ["interpreter", "off", "defaults", "hook"])
def test_triton_path_when_it_must(gpu, monkeypatch, why):
    from triton import knobs

    fn = FakeFn([False, False])
    args = (torch.zeros(8), 16)
    if why == "interpreter":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    elif why == "off":
        monkeypatch.setenv("FLASHGEN_FAST_LAUNCH", "0")
    elif why == "defaults":
        args = args[:1]
    else:
        chain = knobs.HookChain()
        chain.add(lambda *a: None)
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", chain)
    for _ in range(3):
        fastlaunch.launch(fn, (1,), args)
    assert len(fn.compiled) == 3


def test_an_empty_hook_chain_is_no_hook():
    from triton import knobs

    assert not fastlaunch._hooked(None) and not fastlaunch._hooked(knobs.HookChain())
    chain = knobs.HookChain()
    chain.add(print)
    assert fastlaunch._hooked(chain) and fastlaunch._hooked(print)


class FakeDriver:
    """cuCtxGetCurrent / cuDeviceGet / cuDevicePrimaryCtxRetain / cuCtxSetCurrent of a
    thread with (``current``) or without a current context."""

    def __init__(self, current: int = 0):
        self.current, self.calls = current, []

    def cuCtxGetCurrent(self, out):
        self.calls.append("get")
        out._obj.value = self.current or None
        return 0

    def cuDeviceGet(self, out, ordinal):
        self.calls.append(("device", ordinal))
        out._obj.value = 100 + ordinal
        return 0

    def cuDevicePrimaryCtxRetain(self, out, device):
        self.calls.append(("retain", device.value))
        out._obj.value = 5000 + device.value
        return 0

    def cuCtxSetCurrent(self, ctx):
        self.calls.append(("set", ctx.value))
        self.current = ctx.value
        return 0


def _in_new_thread(fn):
    import threading

    t = threading.Thread(target=fn)
    t.start()
    t.join()


def test_a_thread_without_a_context_gets_the_devices_primary_one_once(monkeypatch):
    drv = FakeDriver(current=0)
    monkeypatch.setattr(fastlaunch, "_LIBCUDA", [drv])
    _in_new_thread(lambda: [fastlaunch.ensure_context(1), fastlaunch.ensure_context(1)])
    assert drv.calls == ["get", ("device", 1), ("retain", 101), ("set", 5101)]


def test_a_thread_with_a_context_keeps_it(monkeypatch):
    drv = FakeDriver(current=42)
    monkeypatch.setattr(fastlaunch, "_LIBCUDA", [drv])
    _in_new_thread(lambda: fastlaunch.ensure_context(0))
    assert drv.calls == ["get"]


def test_every_launch_makes_sure_of_the_context_first(gpu, monkeypatch):
    seen = []
    monkeypatch.setattr(fastlaunch, "ensure_context", seen.append)
    fn = FakeFn([False])
    fastlaunch.launch(fn, (1,), (torch.zeros(8),))
    fastlaunch.launch(fn, (1,), (torch.zeros(8),))
    monkeypatch.setenv("FLASHGEN_FAST_LAUNCH", "0")
    fastlaunch.launch(fn, (1,), (torch.zeros(8),))
    assert seen == [0, 0, 0]


@pytest.mark.parametrize("name", ["FLASHGEN_FAST_LAUNCH", "FLASHGEN_LAUNCH_PLANS", "TRITON_INTERPRET"])
def test_the_switches_read_os_environ_as_it_is_now(monkeypatch, name):
    """The launch paths read their switches through fastlaunch.env, which must see every
    change made through os.environ (monkeypatch.setenv, del), as os.environ.get does."""
    for value in ("0", "1", "", "yes"):
        monkeypatch.setenv(name, value)
        assert fastlaunch.env(name) == os.environ.get(name) == value
        assert fastlaunch.off(name) is (value == "0")
    monkeypatch.delenv(name)
    assert fastlaunch.env(name) is None and not fastlaunch.off(name)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert fastlaunch.interpreting() and not fastlaunch.enabled()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("FLASHGEN_FAST_LAUNCH", "0")
    assert not fastlaunch.interpreting() and not fastlaunch.enabled()

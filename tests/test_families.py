"""Kernel families through the registry: a family defined here (``fwd`` only, sm_90+,
descriptor-addressable layouts only, fake timings, no GPU) is searched by the tuner,
chosen by the dispatcher when its measured row is faster (and not when slower),
launched by the library when chosen, and named by ``explain``, which says why the
Triton family serves the inputs it cannot."""

import tomllib
from pathlib import Path

import pytest
import torch

import flashgen
from flashgen import dispatch, families, library, reference, tuner
from flashgen.api import explain
from flashgen.arch import Arch, by_sm
from flashgen.db import TuningDB
from flashgen.dispatch import Dispatcher
from flashgen.env import Environment
from flashgen.resources import SmemEstimate
from flashgen.spec import KernelSpec, Measurement, ProblemKey, Shape, TileConfig, Variant

H100 = Environment("NVIDIA H100", "9.0", 132, "3.6.0", "2.11.0", "0.1.0")
SM90 = Arch("NVIDIA H100", (9, 0), 132, 232448)
A100 = Environment("NVIDIA A100", "8.0", 108, "3.6.0", "2.11.0", "0.1.0")
SHAPE = Shape(1, 4, 4, 128, 128)
SPEC = KernelSpec("fwd", "float16", 64, 64, "none")
KEY = SHAPE.key(SPEC)
FAST, SLOW = TileConfig(128, 64, 4, 2, family="fake"), TileConfig(128, 128, 4, 2, family="fake")
TRITON = TileConfig(64, 64, 4, 2)


class FakeFamily:
    """A second family as a Gluon one would be: fwd only, sm_90+, descriptor layouts."""

    name = "fake"
    kernels = ("fwd",)

    def __init__(self):
        self.launched = []

    def unsupported(self, key, arch):
        if key.spec.kernel not in self.kernels:
            return f"compiles {self.kernels} only, not {key.spec.kernel}"
        if arch.compute_capability < (9, 0):
            return f"needs sm_90 or newer, this is {arch.sm}"
        if key.layout == "strided":
            return "needs inputs a tensor descriptor can address (layout strided)"
        return None

    def domain(self, key):
        return {"BLOCK_M": (128,), "BLOCK_N": (64, 128, 256), "num_warps": (4,), "num_stages": (2,)}

    def violated_rules(self, v):
        return [] if v.config.BLOCK_N <= 128 else ["kv_tile: BLOCK_N 256 is more than one TMA box"]

    def estimate(self, v, arch):
        c, b = v.config, v.spec.dtype_bytes
        return SmemEstimate({"q_tile": c.BLOCK_M * v.spec.head_dim_pad * b,
                             "kv_ring": 2 * c.BLOCK_N * v.spec.head_dim_pad * b * c.num_stages},
                            arch.smem_per_block_optin)

    def adapt(self, config, key):
        return config

    def default_config(self, key, arch):
        return None

    def template_hash(self, kernel, mods=""):
        return f"fake-{kernel}-{mods or '-'}"

    def render(self, v):
        return f"# {v.id}\n"

    def load(self, v):
        return f"module of {v.id}"

    def launcher(self, name):
        assert name == "fwd", name

        def fwd(q, k, v, *, softmax_scale, mask, diag_lo, diag_hi, config, module, addressable, mods=None,
                out=None):
            self.launched.append((config, module))
            o, lse = library.reference_forward(q, k, v, softmax_scale, diag_lo, diag_hi, mods)
            return (o, lse) if out is None else (out.copy_(o), lse)

        return fwd


@pytest.fixture
def fake(monkeypatch):
    fam = FakeFamily()
    # the registry's interface with one extra family: the fake one alone beside the
    # portable family (tests/test_gluon_family.py covers the registered Gluon family)
    for name in [n for n in families.FAMILIES if n != "triton"]:
        monkeypatch.delitem(families.FAMILIES, name)
    monkeypatch.setitem(families.FAMILIES, fam.name, fam)
    yield fam
    dispatch.set_default_dispatcher(None)


def _db(tmp_path, fake_ms):
    """A DB with a Triton row (1 ms) and the fake family's FAST row (``fake_ms``) for KEY."""
    path = tmp_path / "t.sqlite"
    with TuningDB(path) as db:
        for cfg, ms in ((TRITON, 1.0), (FAST, fake_ms)):
            db.record(KEY, SHAPE, Variant(SPEC, cfg), Measurement("ok", median_ms=ms), H100, 0)
    return path


def test_identity_of_a_family(fake):
    assert FAST.id == "fake_m128_n64_w4_s2" and TRITON.id == "m64_n64_w4_s2"
    assert Variant(SPEC, FAST).id == "attn_fwd_d64_fp16_none_fake_m128_n64_w4_s2"
    assert Variant(SPEC, FAST).family == "fake" and Variant(SPEC, TRITON).family == "triton"
    assert TileConfig.from_dict({**FAST.as_dict()}) == FAST
    assert TileConfig.from_dict({**TRITON.as_dict(), "family": None}) == TRITON  # a row without the column


def test_tuner_searches_the_family(fake, tmp_path):
    space = tuner.search_space(KEY, SM90)
    assert list(space) == ["triton", "fake"] and space["fake"] == fake.domain(KEY)
    assert list(tuner.search_space(KEY, by_sm("sm_80"))) == ["triton"]
    ids = {v.id for v in tuner.feasible_variants([KEY], SM90)}
    assert {Variant(SPEC, FAST).id, Variant(SPEC, SLOW).id} <= ids
    assert Variant(SPEC, TileConfig(128, 256, 4, 2, family="fake")).id not in ids  # breaks its rule
    assert not any("_fake_" in i for i in (v.id for v in tuner.feasible_variants([KEY], by_sm("sm_80"))))
    # every config of both families once (the grid), the fake family's FAST config fastest
    n = sum(1 for f in families.serving(KEY, SM90) for _ in families.configs(f, KEY))
    bench = tuner.FakeBenchmarker({Variant(SPEC, FAST).id: 0.5, Variant(SPEC, SLOW).id: 0.7}, default=1.0)
    with TuningDB(tmp_path / "t.sqlite") as db:
        res = tuner.tune_key(KEY, SHAPE, benchmarker=bench, db=db, env=H100, arch=SM90, n_trials=n,
                             sampler="grid")
        assert Variant(SPEC, FAST).id in bench.calls and Variant(SPEC, SLOW).id in bench.calls
        assert res.best_config == FAST and res.best_median_ms == 0.5
        bad = db.lookup(KEY, Variant(SPEC, TileConfig(128, 256, 4, 2, family="fake")).id, H100)
        assert bad["status"] == "invalid" and "kv_tile" in bad["error"]
        assert db.best_configs(H100)[KEY.id][0] == FAST


@pytest.mark.parametrize("fake_ms, winner", [(0.5, FAST), (2.0, TRITON)])
def test_dispatch_picks_the_faster_family(fake, tmp_path, fake_ms, winner):
    d = Dispatcher([_db(tmp_path, fake_ms)], env=H100, arch=SM90)
    c = d.choose(KEY, capturing=False)
    assert (c.config, c.source, c.family) == (winner, "tuned", winner.family)
    # a key the fake family cannot serve never gets its row, even as the nearest bucket
    strided = ProblemKey(SPEC, KEY.group, KEY.seqlen_q, KEY.seqlen_k, KEY.batch_heads, "strided")
    c = d.choose(strided, capturing=False)
    assert c.family == "triton" and dict(c.unserved)["fake"].startswith("needs inputs a tensor descriptor")


def test_the_chosen_family_launches(fake, tmp_path):
    dispatch.set_default_dispatcher(Dispatcher([_db(tmp_path, 0.5)], env=H100, arch=SM90))
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 128, 64, dtype=torch.float16) for _ in range(3))
    with torch.no_grad():
        out = flashgen.attention(q, k, v)
    assert fake.launched == [(FAST, f"module of {Variant(SPEC, FAST).id}")]
    ref, _, _ = reference.forward(q, k, v)
    assert (out.double() - ref).abs().max().item() < 2e-3


def test_explain_names_the_family_and_why_not(fake, tmp_path):
    path = _db(tmp_path, 0.5)
    q, k, v = (torch.randn(1, 4, 128, 64, dtype=torch.float16) for _ in range(3))
    e = explain(q, k, v, dispatcher=Dispatcher([path], env=H100, arch=SM90))
    fwd, dq, dkdv = e.kernels
    assert (fwd.family, fwd.config, fwd.unserved) == ("fake", FAST.id, ())
    assert "kernel family fake" in str(e)
    assert dq.family == "triton" and "fake does not serve it: compiles ('fwd',) only, not bwd_dq" in str(e)
    # expanded kv heads: no tensor descriptor addresses them
    ke, ve = (t[:, :1].expand(1, 4, 128, 64) for t in (k, v))
    e = explain(q, ke, ve, dispatcher=Dispatcher([path], env=H100, arch=SM90))
    assert e.kernels[0].family == "triton"
    assert "kernel family triton; fake does not serve it: needs inputs a tensor descriptor can address" in str(e)
    # a GPU below sm_90 (the DB's rows are the H100's)
    with pytest.warns(UserWarning, match="no rows for this environment"):
        e = explain(q, k, v, dispatcher=Dispatcher([path], env=A100, arch=by_sm("sm_80")))
    assert e.kernels[0].family == "triton" and e.kernels[0].source == "default"
    assert "kernel family triton; fake does not serve it: needs sm_90 or newer, this is sm_80" in str(e)


def test_every_registered_family_ships_in_the_wheel():
    pyproject = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    packages = set(pyproject["tool"]["setuptools"]["packages"])
    assert {"flashgen.families", *(f"flashgen.families.{n}" for n in families.REGISTRY)} <= packages

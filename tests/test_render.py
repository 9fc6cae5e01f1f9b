"""Templates -> source text -> cached module: rendering, strictness, ids, the compile cache."""

import dataclasses
import hashlib
import json
import os

import jinja2
import pytest

from flashgen import compile as fcompile
from flashgen import render
from flashgen.spec import DENSE_KERNELS, DTYPES, KERNELS, MASKS, KernelSpec, TileConfig, Variant, is_decode, supports, kernel_mods

# (head_dim, head_dim_v): powers of two, padded (40 -> 64, 72 -> 128), and dv != d.
HEAD_DIMS = [(16, 16), (40, 40), (64, 64), (72, 72), (128, 128), (256, 256), (32, 64), (72, 40)]
CFG = TileConfig(64, 32, 4, 2)
DECODE_CFG = TileConfig(64, 32, 4, 2, num_splits=2)  # the decode kernels need num_splits >= 1


def _cfg(kernel):
    return DECODE_CFG if is_decode(kernel) else CFG


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("kernel", KERNELS)
def test_every_variant_renders_and_compiles(kernel, mask, dtype):
    if not supports(kernel, mask):
        with pytest.raises(ValueError, match="serves masks"):
            KernelSpec(kernel, dtype, 64, 64, mask)
        return
    thash = render.template_hash(kernel)
    assert len(thash) == 16 and int(thash, 16) >= 0
    sources = set()
    for d, dv in HEAD_DIMS:
        v = Variant(KernelSpec(kernel, dtype, d, dv, mask), _cfg(kernel))
        src = render.render(v)
        code = compile(src, f"{v.id}.py", "exec")  # valid Python
        assert code.co_filename == f"{v.id}.py"
        head = src.splitlines()[:3]
        assert head[0].startswith("# flashgen generated source"), head
        assert f"template: {render.template_name(kernel)}" in head[1] and f"template_hash: {thash}" in head[1]
        assert head[2].split() == ["#", "variant:", v.id]
        # the module-level identity constants the launchers and the compiled-kernel
        # registry read
        assert f'VARIANT_ID = "{v.id}"' in src and f'TEMPLATE_HASH = "{thash}"' in src
        assert f"NUM_WARPS = {CFG.num_warps}" in src and f"NUM_STAGES = {CFG.num_stages}" in src
        assert f"D_PAD = tl.constexpr({v.spec.head_dim_pad})" in src
        assert f"DV_PAD = tl.constexpr({v.spec.head_dim_v_pad})" in src
        assert "{{" not in src and "{%" not in src
        sources.add(src)
    assert len(sources) == len(HEAD_DIMS)  # the head dims are compiled in


def test_render_is_pure_and_config_dependent():
    spec = KernelSpec("fwd", "float16", 40, 40, "causal")
    a = render.render(Variant(spec, TileConfig(64, 32, 4, 2)))
    assert a == render.render(Variant(spec, TileConfig(64, 32, 4, 2)))
    b = render.render(Variant(spec, TileConfig(128, 32, 4, 2)))
    assert a != b and "BLOCK_M = tl.constexpr(128)" in b and "BLOCK_M = tl.constexpr(64)" in a


def _render_kwargs(kernel):
    v = Variant(KernelSpec(kernel, "float16", 40, 72, "causal" if is_decode(kernel) else "window"), _cfg(kernel))
    s, c = v.spec, v.config
    return dict(variant_id=v.id, template_hash=render.template_hash(kernel), kernel=kernel, dtype=s.dtype,
                head_dim=s.head_dim, head_dim_v=s.head_dim_v, head_dim_pad=s.head_dim_pad,
                head_dim_v_pad=s.head_dim_v_pad, mask=s.mask, BLOCK_M=c.BLOCK_M, BLOCK_N=c.BLOCK_N,
                num_warps=c.num_warps, num_stages=c.num_stages, tma=c.tma, ws=c.ws, num_splits=c.num_splits,
                mods="", softcap=False, alibi=False, bias=False, dropout=False)


@pytest.mark.parametrize("missing", ["variant_id", "template_hash", "dtype", "head_dim", "head_dim_v",
                                     "head_dim_pad", "head_dim_v_pad", "mask", "BLOCK_M", "BLOCK_N",
                                     "num_warps", "num_stages", "mods"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_strict_undefined(kernel, missing):
    tmpl = render._env().get_template(render.template_name(kernel))
    kw = _render_kwargs(kernel)
    assert kw["variant_id"] in tmpl.render(**kw)  # complete: renders
    del kw[missing]
    if missing == "mods" and kernel not in DENSE_KERNELS:
        assert kw["variant_id"] in tmpl.render(**kw)  # score mods exist in the dense kernels only
        return
    with pytest.raises(jinja2.UndefinedError):
        tmpl.render(**kw)


def test_env_is_strict():
    env = render._env()
    assert env.undefined is jinja2.StrictUndefined
    with pytest.raises(jinja2.UndefinedError):
        env.from_string("{{ BLOCK_MM }}").render(BLOCK_M=1)


@pytest.mark.parametrize("spec, cfg, expected", [
    (KernelSpec("fwd", "bfloat16", 128, 128, "causal"), TileConfig(128, 64, 8, 3),
     "attn_fwd_d128_bf16_causal_m128_n64_w8_s3"),
    (KernelSpec("bwd_dq", "float16", 64, 32, "window"), TileConfig(64, 32, 4, 1),
     "attn_bwd_dq_d64v32_fp16_window_m64_n32_w4_s1"),
    (KernelSpec("bwd_dkdv", "float32", 40, 40, "none"), TileConfig(32, 128, 8, 2),
     "attn_bwd_dkdv_d40_fp32_none_m32_n128_w8_s2"),
])
def test_variant_id(spec, cfg, expected):
    assert Variant(spec, cfg).id == expected


def test_text_hash_covers_template_and_macros():
    for kernel in KERNELS:
        h = hashlib.sha256()
        included = ("attn_decode.py.j2",) if kernel == "decode_paged" else ()
        assert render.template_files(kernel) == (render.template_name(kernel), *included, "_common.j2")
        for name in render.template_files(kernel):
            h.update((render.templates_dir() / name).read_bytes())
        assert render.text_hash(kernel) == h.hexdigest()[:16]


def test_shipped_code_hashes_are_current():
    """templates/code_hashes.json matches the templates: run ``python -m flashgen.render``
    after a template edit when this fails."""
    table = json.loads(render.code_hashes_path().read_text())
    for kernel in KERNELS:
        assert set(table[kernel]) == {m or "-" for m in kernel_mods(kernel)}
        for mods in kernel_mods(kernel):
            entry = table[kernel][mods or "-"]
            assert entry["text"] == render.text_hash(kernel), (kernel, mods)
            assert entry["code"] == render._code_hash(kernel, mods) == render.template_hash(kernel, mods)
    hashes = [render.template_hash(k, m) for k in KERNELS for m in kernel_mods(k)]
    assert len(set(hashes)) == len(hashes)


def test_code_hash_follows_the_generated_code_not_the_template_text(tmp_path):
    """Editing what a variant's source contains changes its code hash; adding a branch
    that no recorded variant renders (a new mode) or a Jinja comment does not."""
    import shutil

    d = tmp_path / "t"
    shutil.copytree(render.templates_dir(), d)
    fwd = d / "attn_fwd.py.j2"
    text = fwd.read_text()
    base = {k: render._code_hash(k, "", str(d)) for k in ("fwd", "bwd_dq")}
    assert base == {k: render.template_hash(k) for k in base}
    fwd.write_text(text.replace("import triton\n", "{# a comment #}\n{% if mods == 'nothing' %}x = 1\n{% endif %}import triton\n", 1))
    assert render._code_hash("fwd", "", str(d)) == base["fwd"]
    assert render.text_hash("fwd", str(d)) != render.text_hash("fwd")
    fwd.write_text(text.replace("import triton\n", "import triton  # changed\n", 1))
    assert render._code_hash("fwd", "", str(d)) != base["fwd"]
    assert render._code_hash("bwd_dq", "", str(d)) == base["bwd_dq"]


def test_mods_are_compiled_in_only_when_named():
    spec = KernelSpec("fwd", "float16", 64, 64, "causal")
    plain = render.render(Variant(spec, TileConfig(64, 32, 4, 1)))
    assert "sm_scale" not in plain and "tl.rand" not in plain and "BIAS" not in plain
    full = render.render(Variant(dataclasses.replace(spec, mods="softcap_alibi_bias_dropout"), TileConfig(64, 32, 4, 1)))
    for sym in ("softcap", "ALIBI", "BIAS", "tl.randint4x(seed", "dropout_p"):
        assert sym in full
    only = render.render(Variant(dataclasses.replace(spec, mods="dropout"), TileConfig(64, 32, 4, 1)))
    assert "tl.randint4x(seed" in only and "BIAS" not in only and "sm_scale" not in only


def test_load_memoizes_and_writes_once(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(fcompile, "_modules", {})
    replaced = []
    real_replace = os.replace

    def spy_replace(src, dst):
        replaced.append(str(dst))
        return real_replace(src, dst)

    monkeypatch.setattr(fcompile.os, "replace", spy_replace)
    v = Variant(KernelSpec("fwd", "float16", 40, 40, "causal"), TileConfig(16, 16, 4, 1))
    src = render.render(v)
    m1 = fcompile.load(v)
    m2 = fcompile.load(v)
    assert m1 is m2
    assert m1.VARIANT_ID == v.id and m1.TEMPLATE_HASH == render.template_hash("fwd")
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    digest = hashlib.sha256(src.encode()).hexdigest()[:20]
    expected = tmp_path / "generated" / digest / f"{v.id}.py"
    assert files == [expected] and expected.read_text() == src
    assert fcompile.generated_path(v, src) == expected
    assert replaced == [str(expected)]
    mtime = expected.stat().st_mtime_ns
    # A new process (empty module cache) finds the same text on disk: not rewritten.
    monkeypatch.setattr(fcompile, "_modules", {})
    m3 = fcompile.load(v)
    assert m3 is not m1 and m3.VARIANT_ID == v.id
    assert replaced == [str(expected)] and expected.stat().st_mtime_ns == mtime
    # Another variant gets its own content-hash directory.
    v2 = Variant(v.spec, TileConfig(32, 16, 4, 1))
    assert fcompile.load(v2) is not m1
    assert len({p.parent for p in tmp_path.rglob("*.py")}) == 2 and len(replaced) == 2


def test_write_source_rewrites_different_text(tmp_path):
    p = tmp_path / "a" / "x.py"
    fcompile.write_source(p, "A = 1\n")
    fcompile.write_source(p, "A = 2\n")
    assert p.read_text() == "A = 2\n"
    assert [q.name for q in p.parent.iterdir()] == ["x.py"]  # no temp files left

"""Gluon forward variant -> Gluon source text (pure: no torch, no triton), and the
imported module of a variant.

The template is ``templates/gluon/attn_fwd.py.j2``, rendered with ``StrictUndefined``
so a misspelt symbol is an error.  The generated file starts with the template's code
id (:mod:`.code_id`: it follows the code of the variants the tuner can record, not the
template's text) and the variant id.
"""

from __future__ import annotations

import functools
import hashlib
import json
import threading
from pathlib import Path
from types import ModuleType

import jinja2

from ...render import templates_dir
from .code_id import CodeId, extension_of, read_record
from .config import (
    DTYPES, HEAD_DIMS, MASKS, REFINE_KNOBS, GluonFwdSpec, GluonFwdVariant, check, default_config,
    refinement_space, space, template_vars,
)

TEMPLATE = "attn_fwd.py.j2"
#: The record of the forward's code id, beside the template (relative to the templates
#: directory).
CODE_ID_RECORD = "gluon/attn_fwd.code_id.json"


def gluon_templates_dir() -> Path:
    return templates_dir() / "gluon"


@functools.lru_cache(maxsize=None)
def _env(directory: str | None = None) -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(Path(directory) / "gluon" if directory
                                                                 else gluon_templates_dir())),
                              undefined=jinja2.StrictUndefined, keep_trailing_newline=True, trim_blocks=True,
                              lstrip_blocks=True)


#: Knob values added after the forward's code id was first recorded, each an extension
#: of the id (:class:`.code_id.CodeId`): name -> whether a config has it.
#: A config of two extensions belongs to the first one listed.
EXTENSIONS = {"skip_masked": lambda c: c.skip_masked, "masked_first": lambda c: c.masked_first, "longest_first": lambda c: c.longest_first, "o_in_q": lambda c: c.o_in_q, "cross_tile": lambda c: c.cross_tile, "m128": lambda c: c.BLOCK_M == 128,
              "serial_masked": lambda c: c.serial_masked, "snake": lambda c: c.snake, "ctas3": lambda c: c.ctas_per_sm == 3,
              "persistent2": lambda c: c.persistent == 2, "persistent3": lambda c: c.persistent == 3}


def probe_variants(extension: str | None = None) -> list[GluonFwdVariant]:
    """Every variant of the search space (:func:`.config.space`) of every dtype, head dim
    pair and mask: the sources whose code defines the forward's code id; those of an
    :data:`EXTENSIONS` knob value are that extension's probes (``extension``), not the
    original set's."""
    out = []
    for dtype in DTYPES:
        for d in HEAD_DIMS:
            for dv in HEAD_DIMS:
                for mask in MASKS:
                    s = GluonFwdSpec(dtype, d, dv, mask)
                    for c in space(s):
                        if extension_of(EXTENSIONS, c) == extension:
                            out.append(GluonFwdVariant(s, c))
                    if extension in REFINE_KNOBS and dtype == "bfloat16":
                        # A refinement knob (outside the search): its variants of one dtype
                        # and at most 3 stages cover every source branch it compiles (dtype
                        # and stage count are compile-time constants).
                        out += [GluonFwdVariant(s, c) for c in refinement_space(s, extension, max_stages=3)]
    return out


def _probe_sources(directory: str | None, extension: str | None = None):
    for v in probe_variants(extension):
        yield render(v, header_hash="-", directory=directory)


_CODE_ID = CodeId("gluon/" + TEMPLATE, CODE_ID_RECORD, _probe_sources,
                  {name: functools.partial(_probe_sources, extension=name) for name in EXTENSIONS})


def code_id(directory: str | None = None) -> str:
    """The code id of the forward template in ``directory`` (templates directory; None:
    the package's), :meth:`.code_id.CodeId.code_id`."""
    return _CODE_ID.code_id(directory)


@functools.lru_cache(maxsize=None)
def template_hash() -> str:
    """The forward's code id (:func:`code_id`): generated sources and the family's tuning
    rows carry it.  It began as the template's text hash at the time (c7b289d46acd83ef, what the
    H200 rows carry)."""
    return code_id()


@functools.lru_cache(maxsize=None)
def sinks_code_id() -> str:
    """The forward's code id with the sources of the sinks variant of each default config
    (dtype, head dims, mask), whose only difference from their plain variants is the
    sink's fold after the key loop; so an edit of either changes it.  Part of
    :func:`user_code_id`, which the sinks variants' rows carry."""
    return _defaults_digest(template_hash(), sinks=True)


def _defaults_digest(seed: str, **mode: bool) -> str:
    """sha256 (16 hex digits) of ``seed`` and the sources of the ``mode`` variant
    (``sinks=True``, ``varlen=True``) of each default config (dtype, head dim, mask)."""
    h = hashlib.sha256(seed.encode())
    for dtype in DTYPES:
        for d in HEAD_DIMS:
            for mask in MASKS:
                spec = GluonFwdSpec(dtype, d, d, mask, **mode)
                h.update(render(GluonFwdVariant(spec, default_config(spec)), header_hash="-").encode())
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def varlen_code_id() -> str:
    """The code id of the ragged-batch variants (``fwd_varlen`` rows): the forward's code
    id (:func:`template_hash`) and the sources of the varlen variant of each default
    config (dtype, head dim, mask).  Each varlen variant holds every line the template
    writes for ragged batches, and the code of each knob's mode is in the forward's
    code id, so an edit of either changes it."""
    return _defaults_digest("varlen " + template_hash(), varlen=True)


#: The record of the user variants' code id (:func:`user_code_id`), beside the template.
USER_CODE_ID_RECORD = "gluon/attn_fwd.user_code_id.json"


def _user_inputs() -> dict[str, str]:
    """What the user variants' code is made from: the template's text, :mod:`.user`'s
    bytes (sha256, 16 hex digits each) and :func:`sinks_code_id`."""
    from . import user

    return {"text": _CODE_ID.text_hash(), "user": hashlib.sha256(Path(user.__file__).read_bytes()).hexdigest()[:16],
            "sinks": sinks_code_id()}


def _user_id_from_text() -> str:
    """A new user code id: the sinks code id, the template's text and :mod:`.user`'s."""
    from . import user

    h = hashlib.sha256(sinks_code_id().encode())
    h.update((gluon_templates_dir() / TEMPLATE).read_bytes())
    h.update(Path(user.__file__).read_bytes())
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def user_code_id() -> str:
    """The code id every user variant of the forward carries (the ``sinks`` variants and
    those of user score/mask functions: what their tuning rows carry).  Their names
    (``KernelSpec.mods``) already hash the lowered functions and the code that writes
    them in Triton (:func:`flashgen.user_render.machinery_hash`); this adds what turns
    that code into this family's kernel: the forward's code id, the sources of the
    sinks variant of each default config, the template and :mod:`.user`.  One id for
    every lowering, so a database's rows are selected without the functions being
    registered (:func:`flashgen.families.hashes`).

    Kept in a record (:data:`USER_CODE_ID_RECORD`): the recorded id while the template's
    text, :mod:`.user` and the sinks code id are the recorded ones, else a new id from
    the template's text.  ``python3 -m flashgen.families.gluon`` rewrites the record
    after an edit (:func:`write_user_code_id`), keeping the id when only the template's
    text changed and the user examples' variants render as recorded
    (:func:`.user_probe.user_probe_digest`)."""
    rec = read_record(templates_dir() / USER_CODE_ID_RECORD)
    now = _user_inputs()
    if rec and all(rec.get(k) == v for k, v in now.items()):
        return rec["code"]
    return _user_id_from_text()


def write_user_code_id(probes: str) -> dict:
    """Rewrite :data:`USER_CODE_ID_RECORD` for the template and :mod:`.user` as they are:
    the recorded id is kept when the template's text, :mod:`.user` and the sinks code id
    are the recorded ones (the code is; ``probes`` is recorded anew, e.g. after the probe
    set grew), or when :mod:`.user` and the sinks code id are and ``probes``
    (:func:`.user_probe.user_probe_digest`, the probe set's rendered variants) is the
    recorded digest; else the id is new (from the template's text)."""
    rec, now = read_record(templates_dir() / USER_CODE_ID_RECORD), _user_inputs()
    same_code = rec and all(rec.get(k) == v for k, v in now.items())
    kept = same_code or (rec and rec.get("user") == now["user"] and rec.get("sinks") == now["sinks"]
                         and rec.get("probes") == probes)
    new = {**now, "probes": probes, "code": rec["code"] if kept else _user_id_from_text()}
    (templates_dir() / USER_CODE_ID_RECORD).write_text(json.dumps(new, indent=1, sort_keys=True) + "\n")
    user_code_id.cache_clear()
    return new


def write_code_id(directory: str | None = None) -> dict:
    """Rewrite the record (:data:`CODE_ID_RECORD`) for the template as it is."""
    new = _CODE_ID.write(directory)
    template_hash.cache_clear()
    sinks_code_id.cache_clear()
    varlen_code_id.cache_clear()
    user_code_id.cache_clear()
    return new


def render(v: GluonFwdVariant, *, header_hash: str | None = None, directory: str | None = None) -> str:
    """The Gluon source of ``v``.  Raises ValueError naming the broken rules when ``v``
    is not valid (:func:`flashgen.families.gluon.config.check`).  ``header_hash``: the
    hash the header names (default :func:`template_hash`); ``directory``: another
    templates directory (the code-id checks)."""
    why = check(v)
    if why:
        raise ValueError(f"{v.id} cannot be built: " + "; ".join(why))
    return _env(directory).get_template(TEMPLATE).render(
        variant_id=v.id, template_hash=template_hash() if header_hash is None else header_hash, **template_vars(v))


_lock = threading.Lock()
_modules: dict[str, ModuleType] = {}


def load(v: GluonFwdVariant) -> ModuleType:
    """The imported module of ``v`` (written once under its content hash; memoized)."""
    from ...compile import import_source

    key = f"{v.id}@{template_hash()}"
    with _lock:
        mod = _modules.get(key)
        if mod is None:
            mod = _modules[key] = import_source(v, render(v), "_gluon")
    return mod

"""The code id of a Gluon template: what tuning rows and generated files name as the
template's hash, following the code the template generates rather than its text.

A template edit that leaves the source of every variant the tuner can record unchanged
(a new mode behind a Jinja switch, a Jinja comment) keeps the id, and with it the tuned
rows; an edit that changes any such variant's code gives a new id, so no row measured
with other code is reused.  The id is kept in a JSON record beside the template
(``text``: sha256 of the template text; ``probes``: sha256 of the rendered sources of
the recorded variants, their header hash left out; ``code``: the id), which
``python3 -m flashgen.families.gluon`` rewrites after an edit.

A knob value added later (a new mode of an existing knob) grows the set of variants the
tuner can record.  Its variants form an *extension*: a named group of probe sources
with its own digest in the record (``extensions``).  The id stays while the original
probes are unchanged and every recorded extension's digest is too; an extension the
record does not name yet is recorded at the next write with the id unchanged (no row
can name its variants before the knob value existed); one whose sources change later
gives a new id like any other edit.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path


def read_record(path: Path) -> dict:
    """A code-id record (JSON), {} when it is missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def extension_of(extensions: dict, *variant) -> str | None:
    """The name of the first of ``extensions`` (name -> predicate) whose predicate holds
    for ``variant`` (the arguments the predicates take), None for the original set."""
    return next((name for name, has in extensions.items() if has(*variant)), None)


class CodeId:
    """The code id of one template.

    ``template`` and ``record``: paths relative to the templates directory;
    ``sources(directory)``: the rendered sources of the variants that define the id
    (rendered from the template in ``directory``, None: the package's, with the header
    hash left out).  ``directory`` arguments name another templates directory (the
    tests' edited copies)."""

    def __init__(self, template: str, record: str, sources: Callable[[str | None], Iterable[str]],
                 extensions: dict[str, Callable[[str | None], Iterable[str]]] | None = None):
        self.template, self.record_name, self.sources = template, record, sources
        self.extensions = extensions or {}

    @staticmethod
    def _dir(directory: str | None) -> Path:
        if directory:
            return Path(directory)
        from ...render import templates_dir

        return templates_dir()

    def text_hash(self, directory: str | None = None) -> str:
        """sha256 (16 hex digits) of the template file."""
        return hashlib.sha256((self._dir(directory) / self.template).read_bytes()).hexdigest()[:16]

    def probe_digest(self, directory: str | None = None, sources=None) -> str:
        """sha256 (16 hex digits) of the probe variants' sources (``sources``: an
        extension's instead)."""
        h = hashlib.sha256()
        for src in (sources or self.sources)(directory):
            h.update(src.encode())
        return h.hexdigest()[:16]

    def extension_digests(self, directory: str | None = None) -> dict[str, str]:
        return {name: self.probe_digest(directory, fn) for name, fn in self.extensions.items()}

    @staticmethod
    def _kept(rec: dict, digest: str, ext: dict[str, str]) -> bool:
        """Whether the recorded id still names this code: the original probes as
        recorded, and every extension the record names as recorded."""
        seen = rec.get("extensions", {})
        return rec.get("probes") == digest and all(seen.get(n, d) == d for n, d in ext.items())

    @staticmethod
    def _new_id(digest: str, ext: dict[str, str]) -> str:
        if not ext:
            return digest
        h = hashlib.sha256(digest.encode())
        for name in sorted(ext):
            h.update(f"{name}={ext[name]}".encode())
        return h.hexdigest()[:16]

    def record(self, directory: str | None = None) -> dict:
        return read_record(self._dir(directory) / self.record_name)

    def code_id(self, directory: str | None = None) -> str:
        """The recorded id while the template's text is the recorded one, or while its
        probe sources are the recorded ones; else the new probe digest."""
        rec = self.record(directory)
        if rec and rec.get("text") == self.text_hash(directory):
            return rec["code"]
        if directory is None:
            # the package's template was edited after its record was written: the id now
            # takes every probe variant's render (about a minute), once per process
            warnings.warn(f"flashgen: {self.template} differs from its code-id record {self.record_name}; "
                          "rendering its probe variants to find its code id (about a minute, once per process). "
                          "`python3 -m flashgen.families.gluon` records it after a template edit", stacklevel=2)
        digest, ext = self.probe_digest(directory), self.extension_digests(directory)
        return rec["code"] if rec and self._kept(rec, digest, ext) else self._new_id(digest, ext)

    def write(self, directory: str | None = None) -> dict:
        """Rewrite the record for the template as it is: the id stays while the probe
        sources are the recorded ones, else it becomes their digest."""
        rec, digest, ext = self.record(directory), self.probe_digest(directory), self.extension_digests(directory)
        new = {"text": self.text_hash(directory), "probes": digest,
               "code": rec["code"] if rec and self._kept(rec, digest, ext) else self._new_id(digest, ext)}
        if ext:
            new["extensions"] = ext
        (self._dir(directory) / self.record_name).write_text(json.dumps(new, indent=1, sort_keys=True) + "\n")
        return new

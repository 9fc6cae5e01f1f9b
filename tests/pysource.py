"""Whether generated sources are valid Python, for the tests that render thousands of
variants of one template: each source's top-level statements parsed once across all
the sources that share them, instead of every whole source parsed on its own."""

import ast

_PARSED: set[str] = set()


def _chunks(src: str) -> list[str]:
    """``src`` cut before each line that starts a top-level statement (a line at column 0
    that is not blank, a comment or a closing bracket), a decorator kept with what it
    decorates."""
    out, cur, decorator = [], [], False
    for line in src.splitlines(keepends=True):
        starts = line[:1] not in ("", " ", "\t", "\r", "\n", "#", ")", "]", "}")
        if starts and cur and not decorator:
            out.append("".join(cur))
            cur = []
        if starts:
            decorator = line.startswith("@")
        cur.append(line)
    if cur:
        out.append("".join(cur))
    return out


def assert_parses(src: str) -> None:
    """Raise as ``ast.parse(src)`` does when ``src`` is not valid Python.

    Each chunk of :func:`_chunks` that parses on its own ends outside any bracket, string
    or indented block, so the next chunk, which starts at column 0, tokenizes and parses
    as it does alone: when every chunk parses, so does ``src``, a sequence of statements.
    Chunks already parsed (for another source) are not parsed again; when a chunk does
    not parse on its own (a cut inside a multi-line string), the whole source is parsed.
    """
    chunks = _chunks(src if src.endswith("\n") else src + "\n")
    todo = [c for c in chunks if c not in _PARSED]
    try:
        for c in todo:
            ast.parse(c)
    except SyntaxError:
        ast.parse(src)  # the verdict on the whole source (raises when it is invalid)
        return
    _PARSED.update(todo)

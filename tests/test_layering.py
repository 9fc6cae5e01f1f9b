"""flashgen's modules look down, never up (ARCHITECTURE.md, "The data flow"): no import
cycle, and the few rules that keep the layers apart.  Read from the source with ast
(every import, function-level ones included), so nothing is imported to check it."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "flashgen"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _imports(name: str, path: Path, known: set[str]) -> tuple[set[str], set[str]]:
    """(flashgen modules, top-level outside packages) that module ``name`` imports."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    inner, outer = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                (inner if a.name.split(".")[0] == "flashgen" else outer).add(
                    a.name if a.name.split(".")[0] == "flashgen" else a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            if target.split(".")[0] != "flashgen":
                outer.add(target.split(".")[0])
                continue
            for a in node.names:  # ``from . import x``: the submodule x where there is one
                sub = f"{target}.{a.name}"
                inner.add(sub if sub in known else target)
        elif (isinstance(node, ast.Assign) and name == "flashgen.families"
              and any(isinstance(t, ast.Name) and t.id == "REGISTRY" for t in node.targets)):
            # the family registry imports each named family by name
            inner |= {f"flashgen.families.{e.value}" for e in node.value.elts}
    inner.discard(name)
    return {m for m in inner if m in known}, outer


def import_graph():
    mods = _modules()
    known = set(mods)
    graph, outside = {}, {}
    for name, path in mods.items():
        graph[name], outside[name] = _imports(name, path, known)
    return graph, outside


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as a path [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def reachable(graph, start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo += graph.get(n, ())
    return seen


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"x": {"y"}, "y": {"y2"}, "y2": {"y"}}) == ["y", "y2", "y"]


def test_graph_sees_relative_and_lazy_imports():
    graph, outside = import_graph()
    assert "flashgen.library" in graph["flashgen.api"]
    assert "flashgen.bench" in graph["flashgen.tuner"]  # imported inside a function
    assert "flashgen.families.triton" in graph["flashgen.families"]  # through REGISTRY
    assert "flashgen.compile" in graph["flashgen.families.triton.launch"]  # ``from ... import``
    assert "optuna" in outside["flashgen.tuner"] and "torch" in outside["flashgen.api"]


def test_no_import_cycle():
    graph, _ = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_layers_look_down():
    graph, outside = import_graph()
    # the renderer is pure text: neither it nor anything it imports touches torch/triton
    for m in reachable(graph, "flashgen.render"):
        assert not {"torch", "triton"} & outside[m], f"flashgen.render imports {m}, which imports torch/triton"
    # the dispatcher never reaches the tuner (nor optuna)
    assert "flashgen.tuner" not in reachable(graph, "flashgen.dispatch")
    users = {m for m, out in outside.items() if "optuna" in out}
    assert users == {"flashgen.tuner"}, f"modules importing optuna: {sorted(users)}"
    users = {m for m, out in outside.items() if "sqlite_utils" in out}
    assert users == {"flashgen.db"}, f"modules importing sqlite_utils: {sorted(users)}"
    # the library (ops, autograd) sits below the public functions
    assert "flashgen.api" not in reachable(graph, "flashgen.library")

"""The modules of e2e/, tools/ and bench/ import each other without a cycle, and the
harness (e2e/harness/) imports none of the rest: it is the bottom room.

Read from the source (every import statement, also those inside functions and under
`if TYPE_CHECKING:`), so it needs no cluster and imports nothing it checks. Importing
`a.b.c` runs the `__init__` of `a.b` first, so an import of a module in another package
also counts as an import of that package.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("e2e", "bench", "tools")


def module_files() -> dict[str, Path]:
    """Dotted name -> file of every module under ROOTS."""
    found: dict[str, Path] = {}
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _imported(module: str, path: Path) -> Iterator[str]:
    """Every dotted name an import statement of `module` names (not resolved yet)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of ROOTS that importing it runs (its own packages aside)."""
    files = module_files()
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        own = {*_ancestors(module), module}
        targets: set[str] = set()
        for name in _imported(module, path):
            if name in files:
                targets.update(n for n in (*_ancestors(name), name) if n in files)
        graph[module] = targets - own
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path back to its start) per strongly connected component."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_path_through(graph, set(c)) for c in components]


def _path_through(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A cycle inside one strongly connected component, from its first module."""
    start = min(component)
    path = [start]
    seen = {start}
    while True:
        nxt = min(n for n in graph[path[-1]] if n in component)
        path.append(nxt)
        if nxt in seen:
            return path[path.index(nxt) :]
        seen.add(nxt)


def test_graph_reads_every_module() -> None:
    graph = import_graph()
    assert {"e2e.harness.cluster", "e2e.harness.build", "bench.prepare"} <= set(graph)
    assert "e2e.harness.versions" in graph["e2e.harness.paths"]


def test_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def _room(module: str) -> str:
    if module.startswith("e2e.harness"):
        return "harness"
    return "e2e tests" if module.startswith("e2e") else module.split(".", maxsplit=1)[0]


# Who may import whom: the harness is a library under everything; the tools and the
# benchmarks build on it; only the e2e tests may import the e2e tests.
MAY_IMPORT = {
    "harness": {"harness"},
    "tools": {"harness", "tools"},
    "bench": {"harness", "tools", "bench"},
    "e2e tests": {"harness", "tools", "bench", "e2e tests"},
}


def test_rooms_import_only_the_rooms_below() -> None:
    wrong = [
        f"{module} -> {target}"
        for module, targets in import_graph().items()
        for target in sorted(targets)
        if _room(target) not in MAY_IMPORT[_room(module)] and target != "e2e"
    ]
    assert not wrong, "imports across rooms:\n" + "\n".join(wrong)

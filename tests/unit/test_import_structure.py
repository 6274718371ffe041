"""Imports point down: the graph of every `import` / `from ... import` inside longserve/ (function-level and
TYPE_CHECKING ones included, read with `ast`, nothing imported) has no cycle, the low layers (kernels,
cache, sched) never import the layers above them (models, runner, server, bench), and the compute stack
(kernels <- attention <- models <- runner) imports only downwards."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "longserve"
LOW_LAYERS = ("longserve.kernels", "longserve.cache", "longserve.sched")
UPPER_LAYERS = ("longserve.models", "longserve.runner", "longserve.server", "longserve.bench")
ENTRY_POINTS = ("longserve.engine", "longserve.llm", "longserve.cli", "longserve.server", "longserve.bench")
# the compute stack, bottom up: kernels <- attention backends <- models <- runner (each never imports above)
COMPUTE_RULES = {
    "longserve.kernels": ("longserve.attention", "longserve.models", "longserve.runner", *ENTRY_POINTS),
    "longserve.attention": ("longserve.models", "longserve.runner", *ENTRY_POINTS),
    "longserve.models": ("longserve.runner", *ENTRY_POINTS),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The longserve modules `path` imports anywhere in its body: `from a.b import c` names a.b, and a.b.c
    too when c is a submodule; relative imports are resolved against the file's package."""
    name = module_name(path)
    package = name if is_package(path) else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
    # an import of a.b.c that is not a module of ours (a name in a.b) counts as an import of a.b
    resolved = set()
    for target in found:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            resolved.add(target)
    return resolved


def import_graph() -> dict[str, set[str]]:
    files = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in files}
    return {module_name(p): imported_modules(p, modules) for p in files}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def in_layer(module: str, layers: tuple[str, ...]) -> bool:
    return any(module == layer or module.startswith(layer + ".") for layer in layers)


def test_the_graph_reads_real_imports() -> None:
    """The reader itself: known edges of the tree are found, relative and function-level alike."""
    graph = import_graph()
    assert "longserve.attention.base" in graph["longserve.attention"]
    assert "longserve.models.layers" in graph["longserve.models.decoder"]
    assert len(graph) > 50


def test_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_low_layers_never_import_upper_layers() -> None:
    upward = sorted(
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        if in_layer(module, LOW_LAYERS)
        for target in targets
        if in_layer(target, UPPER_LAYERS)
    )
    assert upward == []


def test_the_compute_stack_imports_only_downwards() -> None:
    """Kernels beside their references import no backend or model; backends no model; models no runner."""
    upward = sorted(
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        for layer, above in COMPUTE_RULES.items()
        if in_layer(module, (layer,))
        for target in targets
        if in_layer(target, above)
    )
    assert upward == []


def test_no_import_cycles() -> None:
    assert cycles(import_graph()) == []

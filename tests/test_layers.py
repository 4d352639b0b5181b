"""The package is a stack (docs/architecture.md): no import runs back up a layer, and no module cycle.

Every import counts, at module level or inside a function (a function-level
import still ties the two modules together), read from the source with
``ast``: nothing is imported.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kerasfeed"

# Bottom to top: a module may import its own top-level part (a package of
# kerasfeed/ or a single module) and the parts of lower layers. Parts of one
# layer do not import each other, except in the base layer.
LAYERS = [
    ["_version", "_validation", "_layout", "_handoff", "_urls", "_leaves", "_quiet", "_records", "_keras_fit",
     "_keras_fit_frames", "_keras_epoch_iterator", "_keras_build", "_keras_callback", "_keras_iterators_at_exit",
     "errors", "_nest", "transforms", "datasets", "_demo_args", "_backend_errors"],
    ["sources", "remote"],
    ["sampling"],
    ["cache"],
    ["hdf5", "execution"],
    ["observe"],
    ["loading"],
    ["streams"],
    ["tfdata"],
    ["loader", "exporting"],
    ["integrations"],
    ["__init__"],  # the public API (its other imports are lazy: importlib)
    ["demo"],
    ["__main__"],
]
LAYER = {part: k for k, parts in enumerate(LAYERS) for part in parts}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("kerasfeed",) + path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: pathlib.Path, modules: dict) -> set[str]:
    """The kerasfeed modules ``name`` imports (a submodule, not its package, for ``from pkg import sub``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
            if subs:
                found.update(subs)
            elif base in modules:
                found.add(base)
    found.discard(name)
    return found


def _part(name: str) -> str:
    parts = name.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_every_part_of_the_package_has_a_layer():
    missing = sorted({_part(name) for name in _modules()} - set(LAYER))
    assert not missing, f"place these in LAYERS (and in docs/architecture.md's picture): {missing}"


def test_no_import_runs_back_up_the_stack():
    wrong = []
    for name, targets in _graph().items():
        here = _part(name)
        for target in targets:
            there = _part(target)
            if there == here or (LAYER[here] == LAYER[there] == 0):
                continue
            if LAYER[there] >= LAYER[here]:
                wrong.append(f"{name} -> {target} ({here} is layer {LAYER[here]}, {there} layer {LAYER[there]})")
    assert not wrong, "imports that run back up (or across) the stack:\n" + "\n".join(sorted(wrong))


def test_no_module_cycle():
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"modules that import each other in a loop: {cycles}"

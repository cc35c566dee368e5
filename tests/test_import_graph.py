"""Layers call down only, with no circle: every import in server/, training/ and modules_store/
(function-local ones included, relative ones resolved) read with `ast`, against one layer order.

LAYERS is the order docs/ARCHITECTURE.md draws, lowest first. A module may import modules of its
own layer or of a layer below it; an import of a layer above fails, and so does any circle, within
a layer too. A new module must be placed in a layer here (the test names the ones that are not)."""
from __future__ import annotations

import ast
from fnmatch import fnmatch
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("modules_store", "server", "training")

LAYERS = [  # lowest first; patterns over dotted module names
    ("store", ["modules_store", "modules_store.*"]),
    ("shared", ["server", "server.command_line", "server.config", "server.errors", "server.logs", "server.metrics",
                "server.host_memory", "server.timings", "server.temp_folders", "server.ports"]),
    ("backbone", ["server.backbone", "server.backbone.*"]),
    ("heads", ["server.heads", "server.heads.*"]),
    ("bridges", ["server.bridges", "server.bridges.*"]),
    ("modules", ["server.modules"]),
    ("plan", ["server.plan", "server.answers"]),
    ("engine", ["server.engine"]),
    ("runner", ["server.runner", "server.runner.*"]),
    ("probe", ["server.probe"]),
    ("runtime", ["server.batcher", "server.windows", "server.runtime"]),
    ("api", ["server.api", "server.api.*"]),
    ("processes", ["server.workers", "server.workers.*", "server.cli"]),
    ("training", ["training", "training.*"]),
]


def module_files() -> dict[str, Path]:
    files = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def imports_of(name: str, path: Path, files: dict[str, Path]) -> set[tuple[str, int]]:
    """(imported project module, line) for every import statement in the file, wherever it stands.
    `from a.b import c` names a.b.c when c is a module, else a.b."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this module's package
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in files:  # `import server.heads.base.Head`-like: the module part
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add((target, node.lineno))
    return found


def import_graph() -> dict[str, set[tuple[str, int]]]:
    files = module_files()
    return {name: imports_of(name, path, files) for name, path in files.items()}


def layer_of(name: str) -> int | None:
    for index, (_, patterns) in enumerate(LAYERS):
        if any(fnmatch(name, pattern) for pattern in patterns):
            return index
    return None


def circles(graph: dict[str, set[tuple[str, int]]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    edges = {name: sorted({target for target, _ in targets}) for name, targets in graph.items()}
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, []):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def upward_imports(graph: dict[str, set[tuple[str, int]]]) -> list[str]:
    out = []
    for name, targets in sorted(graph.items()):
        for target, line in sorted(targets):
            if layer_of(target) > layer_of(name):
                out.append(f"{name}:{line} imports {target} "
                           f"({LAYERS[layer_of(name)][0]} -> {LAYERS[layer_of(target)][0]}, a layer above)")
    return out


def test_the_walk_sees_every_kind_of_import():
    graph = import_graph()
    targets = {name: {target for target, _ in found} for name, found in graph.items()}
    assert "server.heads.base" in targets["server.heads.layermix.model"]  # from ... import at the top
    assert "server.runtime" in targets["server.cli"]  # `from server import runtime` inside a function
    assert "server.heads.embedding" in targets["server.heads"]  # `from server.heads import embedding`


def test_every_module_has_a_layer():
    assert [name for name in import_graph() if layer_of(name) is None] == []


def test_no_import_circle():
    found = circles(import_graph())
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(circle) for circle in found)


def test_layers_import_only_downwards():
    found = upward_imports(import_graph())
    assert not found, "upward imports:\n" + "\n".join(found)


def test_the_checks_fail_on_a_circle_and_an_upward_import():
    graph = {"server.engine": {("server.runner", 1)}, "server.runner": {("server.engine", 2)},
             "modules_store.store": {("server.api.app", 3)}, "server.api.app": set()}
    assert circles(graph) == [["server.engine", "server.runner"]]
    assert [line.split(" ")[0] for line in upward_imports(graph)] == ["modules_store.store:3", "server.engine:1"]


def imports_of_tests(folder: Path) -> list[str]:
    """Every import of the test suite (`tests`, `tests.*`) in the .py files below `folder`, wherever it stands."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            found += [f"{path.relative_to(folder.parent)}:{node.lineno} imports {n}" for n in names
                      if n == "tests" or n.startswith("tests.")]
    return found


def test_the_product_benchmarks_and_deployment_never_import_the_tests(tmp_path):
    """Tests sit on top: they import bench/ (bench/live_server.py), never the other way round."""
    assert [line for folder in (*PACKAGES, "bench", "deploy", "scripts") if (ROOT / folder).is_dir()
            for line in imports_of_tests(ROOT / folder)] == []
    probe = tmp_path / "tool"
    probe.mkdir()
    (probe / "run.py").write_text("import os\n\ndef f():\n    from tests.helpers import free_port\n")
    assert imports_of_tests(probe) == ["tool/run.py:4 imports tests.helpers"]

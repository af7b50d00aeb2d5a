"""The library's import graph: no circles, and nothing imports Snakemake.

Every ``import`` counts, also those inside functions: a lazy import hides a circle
from Python, not from the reader.
"""

import ast
from pathlib import Path

import npuforge
from npuforge.import_graph import import_graph, imported_modules

PACKAGE_DIR = Path(npuforge.__file__).parent


def find_cycle(graph: dict):
    state = {}

    def visit(node, trail):
        state[node] = "open"
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                return trail[trail.index(dep) :] + [dep]
            if dep not in state:
                cycle = visit(dep, trail + [dep])
                if cycle:
                    return cycle
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node, [node])
            if cycle:
                return cycle
    return None


def test_the_library_has_no_import_circle():
    cycle = find_cycle(import_graph(PACKAGE_DIR))
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_planted_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]


def test_a_lazy_import_inside_a_function_is_counted():
    known = {"npuforge.x", "npuforge.y", "npuforge.pkg", "npuforge.pkg.z"}
    lazy = "def f():\n    from npuforge import y\n"
    assert imported_modules(lazy, "npuforge.x", False, known) == {"npuforge.y"}
    relative = "def f():\n    from . import z\n"
    assert imported_modules(relative, "npuforge.pkg", True, known) == {"npuforge.pkg.z"}


def test_the_library_never_imports_snakemake():
    offenders = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            if any(name.split(".")[0] == "snakemake" for name in names):
                offenders.append(str(path.relative_to(PACKAGE_DIR.parent)))
    assert offenders == []

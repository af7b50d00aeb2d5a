"""The code a step runs, as a digest: its step CLI, its rule file and the package files
the CLI can reach.

A step's output depends on its code as much as on its options, so the digest is a
params value of its rule: a code change reruns the step (and misses the output cache)
instead of reusing an artifact the old code built. What the CLI can reach is read from
the package's code graph (``npuforge.import_graph``), following every edge from the CLI:
imports, modules named by string, files named by path (a job script, the bundle's
runner; such a file runs as a script, so its top-level imports of files beside it
count), and each reached module's parent packages.

Modules picked by name at run time are reached through a dispatcher that names every
candidate (``f"npuforge.backends.{name}"``, the family table): a step that may pick any
depends on all of them. A step that knows its pick (a compile, its target's backend; a
model's steps, its family; a step for no model, no family) passes a ``Choice``: then a
dispatcher reaches by name only the chosen module of the candidates' package, and no
file of an unchosen candidate is reached by name from anywhere. Imports always count:
a module another one imports is reached whatever was picked.
"""

import hashlib
from dataclasses import dataclass
from pathlib import Path

from npuforge.errors import NpuforgeError
from npuforge.import_graph import CodeGraph


@dataclass(frozen=True)
class Choice:
    """One module picked by name at run time (None: the step picks none of them), out
    of its candidates (module names)."""

    chosen: str | None
    candidates: frozenset


def dispatch_choices(picks: dict) -> tuple:
    """The Choices of a step from what it picks: ``{"backend": name, "family": name}``,
    a value None for a pick the step never makes (no model: no family), a key absent for
    one it may make (then every candidate counts)."""
    from npuforge import backends, models

    candidates = {
        "backend": {name: backends.module_name(name) for name in backends.BACKENDS},
        "family": dict(models.FAMILIES),
    }
    choices = []
    for kind, name in sorted(picks.items()):
        modules = candidates[kind]
        if name is not None and name not in modules:
            raise NpuforgeError(f"unknown {kind} {name!r}: one of {', '.join(modules)}")
        choices.append(Choice(modules.get(name), frozenset(modules.values())))
    return tuple(choices)


def _inside(path: str, module_path: str) -> bool:
    """``path`` is the module's file or, for a package, any file under its directory."""
    if module_path.endswith("/__init__.py"):
        return path.startswith(module_path[: -len("__init__.py")])
    return path == module_path


def _package_dir(path: str) -> str:
    """The directory of the package holding module ``path`` ("npuforge/backends/")."""
    parts = path.split("/")
    return "/".join(parts[: -2 if parts[-1] == "__init__.py" else -1]) + "/"


def _parents(path: str, graph: CodeGraph) -> list:
    """The ``__init__.py`` of every package above ``path`` (Python runs them first)."""
    parts = path.split("/")[:-1]
    inits = ("/".join(parts[: i + 1]) + "/__init__.py" for i in range(len(parts)))
    return [init for init in inits if init in graph.sha256 and init != path]


def step_scripts(script, graph: CodeGraph) -> list[Path]:
    """``script`` and the scripts beside it that it imports, transitively, in order."""
    found, todo = [], [Path(script).resolve()]
    while todo:
        current = todo.pop(0)
        found.append(current)
        todo += sorted(s for s in graph.script_edges(current)[1] if s not in found + todo)
    return found


def reached_files(script, graph: CodeGraph, choices=()) -> list[str]:
    """Checkout-relative paths of the package files the step CLI ``script`` can reach
    (sorted), given the run-time picks in ``choices``."""
    picks = []  # (candidate paths, the chosen path or None, the candidates' packages)
    for choice in choices:
        paths = {graph.modules[m] for m in choice.candidates if m in graph.modules}
        packages = {_package_dir(path) for path in paths}
        picks.append((paths, graph.modules.get(choice.chosen), packages))

    def kept(targets) -> set:
        kept = set(targets)
        for paths, chosen, packages in picks:
            if kept & paths:
                # A dispatcher of this pick: by name, it reaches the chosen module and
                # nothing else of the candidates' package.
                kept = {
                    t
                    for t in kept
                    if not any(t.startswith(p) for p in packages)
                    or (chosen is not None and _inside(t, chosen))
                }
            # Nobody reaches an unchosen candidate by name.
            kept = {t for t in kept if not any(_inside(t, p) for p in paths if p != chosen)}
        return kept

    def edges(found, run_by_path: bool) -> list:
        # (path, whether it runs by path): a script's siblings are its imports.
        return [
            *((p, False) for p in found.imports),
            *((p, False) for p in kept(found.by_name)),
            *((p, True) for p in kept(found.by_path)),
            *((p, True) for p in (found.siblings if run_by_path else ())),
        ]

    todo = []
    for current in step_scripts(script, graph):
        todo += edges(graph.script_edges(current)[0], False)
    reached = {}  # path -> whether it runs by path
    while todo:
        path, run_by_path = todo.pop()
        if path in reached and (reached[path] or not run_by_path):
            continue
        reached[path] = run_by_path or reached.get(path, False)
        todo += [(parent, False) for parent in _parents(path, graph)]
        todo += edges(graph.edges[path], run_by_path)
    return sorted(reached)


def step_sources(script, graph: CodeGraph, rule_file=None, choices=()) -> list[Path]:
    """The step CLI ``script`` (with the scripts it imports), its ``rule_file`` and the
    package files it reaches, in a fixed order."""
    head = [*step_scripts(script, graph), *([Path(rule_file).resolve()] if rule_file else [])]
    return head + [graph.root / path for path in reached_files(script, graph, choices)]


def step_code_digest(script, graph: CodeGraph, rule_file=None, choices=()) -> str:
    """sha256 over the checkout-relative names and the bytes' sha256 of ``step_sources``
    (the form of ``fileio.files_digest``)."""
    digest = hashlib.sha256()
    head = [*step_scripts(script, graph), *([Path(rule_file).resolve()] if rule_file else [])]
    for path in head:
        digest.update(f"{path.relative_to(graph.root)}\0".encode())
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    for relative in reached_files(script, graph, choices):
        digest.update(f"{relative}\0".encode())
        digest.update(bytes.fromhex(graph.sha256[relative]))
    return digest.hexdigest()

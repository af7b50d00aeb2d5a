"""The package's code graph, read from its source (never run): which files a file reaches.

Edges of a file, found anywhere in its syntax tree (an import inside a function still
runs):

  imports    ``import``/``from`` statements naming a module of the package.
  by name    string constants naming a module: ``"npuforge.models.llama"``, every module
             under a subpackage prefix (``"npuforge.backends."``), or an f-string or
             ``+`` chain starting with ``"npuforge."`` whose computed parts match
             anything (``f"npuforge.backends.{name}"``): what ``importlib.import_module``
             reaches.
  by path    string constants naming a file by a trailing part of its path
             (``"qnn_job.py"``, ``"jobs/qnn_job.py"``), or a pattern ending with a file
             extension (``f"{backend}_job.py"``): job scripts run in a toolchain, files
             read or shipped (the bundle's runner). A pattern ending otherwise ("v{arch}")
             would name files by accident.
  siblings   top-level ``import x`` of a file ``x.py`` beside it: real when the file is
             run by path (its directory is first on ``sys.path``; ``import job_stage``),
             which the walker that follows the edges knows (``npuforge.step_code``).

A missed edge would let a step reuse an artifact built by old code, so the rules err
towards more edges. The import-circle test reads the ``imports`` edges between modules.

Parsing is the cost (~0.3 s for the package): each file's scan is memoized in this
process by file state and, given a cache file, across processes by content.
"""

import ast
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from npuforge.fileio import write_json

PACKAGE = "npuforge"
# Bump when what scan() records changes: cached scans of another version are not read.
SCAN_VERSION = 1
EXTENSION = re.compile(r"\.[A-Za-z0-9]+$")


def module_name(relative: str) -> str | None:
    """The dotted module name of a checkout-relative ``.py`` path (None otherwise)."""
    if not relative.endswith(".py"):
        return None
    parts = relative[: -len(".py")].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _nodes(tree):
    # ast.walk, without its per-node generator calls (half the time on the package).
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for name in node._fields:
            value = getattr(node, name, None)
            if isinstance(value, list):
                stack.extend(v for v in value if isinstance(v, ast.AST))
            elif isinstance(value, ast.AST):
                stack.append(value)


def scan(source, filename: str = "<source>") -> dict:
    """What one Python file says, as JSON-able data: its import statements as
    ``[level, module, names]`` (``level`` -1 for ``import module``) and its string
    constants and patterns (lists of constant texts, None for each computed part)."""
    imports, patterns = [], set()
    for node in _nodes(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            imports += [[-1, alias.name, []] for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            imports.append([node.level, node.module or "", [a.name for a in node.names]])
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            patterns.add((node.value,))
        elif isinstance(node, ast.JoinedStr):
            patterns.add(_pattern(node.values))
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            patterns.add(_pattern(_added(node)))
    patterns = sorted((p for p in patterns if any(p)), key=lambda p: [x or "" for x in p])
    return {"imports": sorted(imports), "patterns": [list(p) for p in patterns]}


def _pattern(parts) -> tuple:
    pieces = []
    for part in parts:
        if isinstance(part, ast.Constant) and isinstance(part.value, str):
            pieces.append(part.value)
        elif not pieces or pieces[-1] is not None:
            pieces.append(None)
    return tuple(pieces)


def _added(node):
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return [*_added(node.left), *_added(node.right)]
    if isinstance(node, ast.JoinedStr):
        return node.values
    return [node]


def resolve_imports(scanned: dict, module: str, is_package: bool, known) -> tuple[set, set]:
    """(the ``known`` modules a scanned file imports, the top-level names it imports
    absolutely). A name imported from a package counts as its submodule when one of that
    name exists, else as the package."""
    here = module.split(".")
    found, top_level = set(), set()
    for level, target, names in scanned["imports"]:
        if level == -1:
            top_level.add(target.split(".")[0])
            found.add(target)
            continue
        if level:
            base = here if is_package else here[:-1]
            base = base[: len(base) - (level - 1)]
            target = ".".join(base + ([target] if target else []))
        else:
            top_level.add(target.split(".")[0])
        found.update(f"{target}.{n}" if f"{target}.{n}" in known else target for n in names)
    return {name for name in found if name in known}, top_level


def imported_modules(source: str, module: str, is_package: bool, known) -> set:
    """The ``known`` modules that ``source`` (the text of ``module``) imports."""
    return resolve_imports(scan(source, module), module, is_package, known)[0]


class _Matcher:
    """Resolves scanned string patterns to package files (memoized: they repeat)."""

    def __init__(self, files, modules):
        self.modules = modules
        self.by_tail = {}
        for path in files:
            parts = path.split("/")
            for i in range(len(parts)):
                self.by_tail.setdefault("/".join(parts[i:]), set()).add(path)
        self._seen = {}

    def by_module(self, pattern) -> frozenset:
        """The modules (their files) ``pattern`` names."""
        return self._memo("module", tuple(pattern))

    def by_path(self, pattern) -> frozenset:
        """The files ``pattern`` names by path."""
        return self._memo("path", tuple(pattern))

    def _memo(self, kind: str, pattern: tuple) -> frozenset:
        if (kind, pattern) not in self._seen:
            match = self._modules if kind == "module" else self._paths
            self._seen[kind, pattern] = frozenset(match(pattern))
        return self._seen[kind, pattern]

    def _modules(self, pattern: tuple) -> set:
        if None not in pattern:
            text = "".join(pattern)
            found = {self.modules[text]} if text in self.modules else set()
            # "npuforge.backends.": a dispatch over the subpackage's modules (the
            # package's own "npuforge." prefix labels things, it picks no module).
            if text.endswith(".") and text.count(".") > 1 and text.startswith(f"{PACKAGE}."):
                found |= {path for name, path in self.modules.items() if name.startswith(text)}
            return found
        head, tail = pattern[0] or "", pattern[-1] or ""
        if not head.startswith(f"{PACKAGE}."):
            return set()
        names = {
            name: {path}
            for name, path in self.modules.items()
            if name.startswith(head) and name.endswith(tail)
        }
        return _fullmatches(pattern, names)

    def _paths(self, pattern: tuple) -> set:
        if None not in pattern:
            return set(self.by_tail.get("".join(pattern), ()))
        head, tail = pattern[0] or "", pattern[-1] or ""
        if not EXTENSION.search(tail):
            return set()
        tails = {
            name: paths
            for name, paths in self.by_tail.items()
            if name.endswith(tail) and name.startswith(head)
        }
        return _fullmatches(pattern, tails)


def _fullmatches(pattern: tuple, candidates: dict) -> set:
    """The files of the candidate names (name -> files) that ``pattern`` matches whole."""
    if not candidates:  # most patterns: no regex to compile
        return set()
    regex = re.compile("".join(".*" if p is None else re.escape(p) for p in pattern), re.S)
    return {path for name, paths in candidates.items() if regex.fullmatch(name) for path in paths}


@dataclass(frozen=True)
class Edges:
    """One file's edges (each a frozenset of checkout-relative paths)."""

    imports: frozenset
    by_name: frozenset
    by_path: frozenset
    siblings: frozenset


@dataclass(frozen=True)
class CodeGraph:
    """A checkout's package files (checkout-relative posix paths) and their edges."""

    root: Path
    sha256: dict  # path -> hex digest of its bytes, for every file of the package
    modules: dict  # dotted module name -> path
    edges: dict  # path -> Edges
    matcher: _Matcher
    scripts: dict = field(default_factory=dict)  # memo of script_edges, by file state

    def module_imports(self) -> dict:
        """{module: the modules it imports}; a package is not its submodules' import."""
        by_path = {path: name for name, path in self.modules.items()}
        return {
            name: {by_path[p] for p in self.edges[path].imports} - {name}
            for name, path in self.modules.items()
        }

    def script_edges(self, script: Path) -> tuple[Edges, set]:
        """(the package Edges, the scripts beside it that it imports) of a Python file
        outside the package that is run by path (a step CLI)."""
        script = Path(script).resolve()
        stat = script.stat()
        key = (script, stat.st_mtime_ns, stat.st_size)
        if key not in self.scripts:
            self.scripts[key] = self._script_edges(script)
        return self.scripts[key]

    def _script_edges(self, script: Path) -> tuple[Edges, set]:
        scanned = _scan_file(script)
        imports, top_level = resolve_imports(scanned, script.stem, False, self.modules)
        siblings = {script.with_name(f"{name}.py") for name in top_level} - {script}
        edges = _edges(self, imports, scanned["patterns"], siblings=())
        return edges, {sibling for sibling in siblings if sibling.is_file()}


def _edges(graph: CodeGraph, imports, patterns, siblings, path=None) -> Edges:
    itself = {path}
    return Edges(
        imports=frozenset(graph.modules[m] for m in imports) - itself,
        by_name=frozenset().union(*map(graph.matcher.by_module, patterns)) - itself,
        by_path=frozenset().union(*map(graph.matcher.by_path, patterns)) - itself,
        siblings=frozenset(siblings) - itself,
    )


def _scan_file(path: Path) -> dict:
    stat = path.stat()
    return _scan_state(path, stat.st_mtime_ns, stat.st_size)


@cache
def _scan_state(path: Path, mtime_ns: int, size: int) -> dict:
    return scan(path.read_bytes(), str(path))


def _package_files(checkout: Path) -> tuple:
    return tuple(
        sorted(
            path.relative_to(checkout).as_posix()
            for path in (checkout / PACKAGE).rglob("*")
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
        )
    )


def code_graph(checkout, cache_file=None) -> CodeGraph:
    """The graph of ``checkout``'s package; parsed once per state of its files in this
    process, and per file content across processes when ``cache_file`` is given."""
    checkout = Path(checkout).resolve()
    files = _package_files(checkout)
    stats = [os.stat(checkout / path) for path in files]
    state = tuple((p, s.st_mtime_ns, s.st_size) for p, s in zip(files, stats, strict=True))
    return _graph(checkout, state, str(cache_file) if cache_file else None)


@cache
def _graph(checkout: Path, state: tuple, cache_file: str | None) -> CodeGraph:
    files = tuple(path for path, _, _ in state)
    data = {path: (checkout / path).read_bytes() for path in files}
    sha256 = {path: hashlib.sha256(data[path]).hexdigest() for path in files}
    stored = _read_cache(cache_file)
    scans = {
        path: stored.get(f"{path}:{sha256[path]}") or scan(data[path], path)
        for path in files
        if path.endswith(".py")
    }
    fresh = {f"{path}:{sha256[path]}": scanned for path, scanned in scans.items()}
    if cache_file and fresh.keys() != stored.keys():
        write_json(cache_file, {"version": SCAN_VERSION, "scans": fresh})

    modules = {module_name(path): path for path in scans}
    graph = CodeGraph(checkout, sha256, modules, {}, _Matcher(files, modules))
    for path in files:
        scanned = scans.get(path, {"imports": [], "patterns": []})
        module = module_name(path) or ""
        imports, top_level = resolve_imports(scanned, module, path.endswith("__init__.py"), modules)
        siblings = sibling_files(path, top_level, sha256)
        graph.edges[path] = _edges(graph, imports, scanned["patterns"], siblings, path)
    return graph


def _read_cache(cache_file) -> dict:
    try:
        stored = json.loads(Path(cache_file).read_text(encoding="utf-8"))
    except (TypeError, OSError, ValueError):
        return {}
    return stored.get("scans", {}) if stored.get("version") == SCAN_VERSION else {}


def sibling_files(path: str, top_level, files) -> set:
    """The ``files`` beside ``path`` that its top-level imports name (``job_stage``)."""
    directory = os.path.dirname(path)
    found = set()
    for name in top_level:
        for candidate in (f"{directory}/{name}.py", f"{directory}/{name}/__init__.py"):
            if candidate in files:
                found.add(candidate)
    return found


def import_graph(package_dir) -> dict:
    """{module: the modules it imports} of the package in ``package_dir``."""
    return code_graph(Path(package_dir).resolve().parent).module_imports()

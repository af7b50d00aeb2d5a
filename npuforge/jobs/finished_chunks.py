"""Finished chunk jobs of a compile, kept beside its output until the compile lands.

A compile that dies in its fifth chunk (the toolkit killed for memory, a node lost, a
gate that fails after every chunk was built) would otherwise build every chunk again.
Each chunk job's outputs are kept under a key of everything the job reads: its files
(the graph and its weights, the feeds, the calibration samples), its spec with the
directories that move between runs named instead of their paths, its environment, the
job's code and the toolchain's stamp. A rerun whose chunk has the same key takes the
kept files instead of running the job, so its bytes are the ones the job wrote; any
other key builds the chunk again. The store is removed once the compile lands.

Standard library only: the host (npuforge.backends) keys and keeps RKNN's and QNN's
chunk jobs, and the TPU-MLIR job, inside its toolchain, keeps its nets' chains.
"""

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path


def store_beside(out_dir) -> Path:
    """Where a compile into ``out_dir`` keeps its finished chunks: beside the output,
    never in it (the output is replaced whole when it lands)."""
    out_dir = Path(out_dir)
    return out_dir.parent / f".{out_dir.name}.finished-chunks"


class FinishedChunks:
    def __init__(self, directory, identity: dict | None = None):
        self.dir = Path(directory)
        self._identity = json.dumps(identity or {}, sort_keys=True, default=str)

    def key(self, description: str, roots: dict, env: dict | None = None, inputs=()) -> str:
        """A job's key: ``description`` (its spec or command lines) with each of ``roots``
        ({name: directory that moves between runs}) named instead of its path, the
        environment, and the content of every file in ``inputs``."""
        for name, root in roots.items():
            description = description.replace(str(root), f"<{name}>")
        digest = hashlib.sha256()
        for part in (self._identity, json.dumps(env or {}, sort_keys=True), description):
            digest.update(part.encode() + b"\0")
        for path in sorted({Path(p) for p in inputs}):
            where = _relative_name(path, roots)
            digest.update(f"{where}\0{sha256_file(path)}\0".encode())
        return digest.hexdigest()[:32]

    def restore(self, key: str, roots: dict) -> dict | None:
        """Put a kept job's outputs back under ``roots``; its record ({} if it kept none),
        or None when nothing is kept under ``key``."""
        entry = self.dir / key
        if not entry.is_dir():
            return None
        for name, root in roots.items():
            if (entry / name).is_dir():
                link_or_copy(entry / name, Path(root))
        record = entry / "record.json"
        return json.loads(record.read_text(encoding="utf-8")) if record.is_file() else {}

    def keep(self, key: str, outputs, roots: dict, record: dict | None = None) -> None:
        """Keep a finished job's ``outputs`` (those it wrote, each under one of ``roots``)
        and its ``record`` under ``key``, whole or not at all."""
        self.dir.mkdir(parents=True, exist_ok=True)
        partial = self.dir / f".{key}.{os.getpid()}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        for output in map(Path, outputs):
            if output.exists():
                name, root = _root_of(output, roots)
                link_or_copy(output, partial / name / output.relative_to(root))
        if record is not None:
            (partial / "record.json").write_text(json.dumps(record, sort_keys=True))
        shutil.rmtree(self.dir / key, ignore_errors=True)
        os.replace(partial, self.dir / key)

    def count(self) -> int:
        if not self.dir.is_dir():
            return 0
        return sum(1 for p in self.dir.iterdir() if p.is_dir() and not p.name.startswith("."))

    def clear(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def drop_if_empty(self) -> None:
        """After a compile that stopped before any chunk finished: leave nothing behind."""
        if self.dir.is_dir() and not any(self.dir.iterdir()):
            self.dir.rmdir()


def files_in(directory, but=()) -> list[Path]:
    """Every file under ``directory`` except ``but``."""
    skip = {Path(p) for p in but}
    return [p for p in Path(directory).rglob("*") if p.is_file() and p not in skip]


def job_identity(job_script, stamp: dict) -> dict:
    """A job's code (every module beside its script) and its toolchain."""
    jobs = Path(job_script).parent
    code = {p.name: sha256_file(p) for p in sorted(jobs.glob("*.py"))}
    return {"job": Path(job_script).name, "code": code, "toolchain": stamp}


def sha256_file(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _root_of(path: Path, roots: dict) -> tuple[str, Path]:
    for name, root in roots.items():
        if path.is_relative_to(root):
            return name, Path(root)
    raise ValueError(f"{path} is under none of {sorted(map(str, roots.values()))}")


def _relative_name(path: Path, roots: dict) -> str:
    for name, root in roots.items():
        if path.is_relative_to(root):
            return f"<{name}>/{path.relative_to(root)}"
    return str(path)


def link_or_copy(source: Path, target: Path) -> None:
    """Hard links where the filesystem allows (a kept 1.5B build costs no second copy)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if source.is_dir():
        shutil.copytree(source, target, copy_function=_link_file, dirs_exist_ok=True)
    else:
        _link_file(source, target)


def _link_file(source, target) -> None:
    if os.path.lexists(target):
        os.unlink(target)
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)

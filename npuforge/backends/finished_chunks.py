"""Finished chunk jobs of a compile, kept beside its output until the compile lands.

A compile that dies in its fifth chunk (the toolkit killed for memory, a node lost, a
gate that fails after every chunk was built) would otherwise build every chunk again.
Each chunk job's outputs are kept under a key of everything the job reads: the files
of its work directory (the rewritten graph, the feeds, the calibration dataset), its
spec with the staging path taken out, the job's environment and the toolchain's stamp.
A rerun whose chunk has the same key takes the kept files instead of running the job,
so its bytes are the ones the job wrote; a different key (another toolchain, options,
graph or feed) builds the chunk again. The store is removed once the compile lands.
"""

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

from npuforge.fileio import sha256_file


class FinishedChunks:
    def __init__(self, out_dir, identity: dict):
        out_dir = Path(out_dir)
        # Beside the output, never in it: the output is replaced whole when it lands.
        self.dir = out_dir.parent / f".{out_dir.name}.finished-chunks"
        self._identity = json.dumps(identity, sort_keys=True, default=str)

    def key(self, spec_path, roots: dict, env: dict | None = None, inputs=()) -> str:
        """What the job of ``spec_path`` would read, hashed: the files beside its spec,
        ``inputs`` (files elsewhere), the spec with each of ``roots`` ({name: directory
        that moves between runs}) named instead of its path, the environment."""
        spec_path = Path(spec_path)
        spec = spec_path.read_text(encoding="utf-8")
        for name, root in roots.items():
            spec = spec.replace(str(root), f"<{name}>")
        digest = hashlib.sha256()
        for part in (self._identity, json.dumps(env or {}, sort_keys=True), spec):
            digest.update(part.encode() + b"\0")
        work = spec_path.parent
        for path in sorted(p for p in work.rglob("*") if p.is_file() and p != spec_path):
            digest.update(f"{path.relative_to(work)}\0{sha256_file(path)}\0".encode())
        for path in inputs:
            digest.update(f"{Path(path).name}\0{sha256_file(path)}\0".encode())
        return digest.hexdigest()[:32]

    def restore(self, key: str, roots: dict) -> bool:
        """Put a kept job's outputs back under ``roots``; False when none is kept."""
        entry = self.dir / key
        if not entry.is_dir():
            return False
        for name, root in roots.items():
            if (entry / name).is_dir():
                _link_or_copy(entry / name, Path(root))
        return True

    def keep(self, key: str, outputs, roots: dict) -> None:
        """Keep a finished job's ``outputs`` (those it wrote, each under one of ``roots``)
        under ``key``, whole or not at all."""
        self.dir.mkdir(parents=True, exist_ok=True)
        partial = self.dir / f".{key}.{os.getpid()}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        for output in map(Path, outputs):
            if not output.exists():
                continue
            name, root = next((n, r) for n, r in roots.items() if output.is_relative_to(r))
            _link_or_copy(output, partial / name / output.relative_to(root))
        shutil.rmtree(self.dir / key, ignore_errors=True)
        os.replace(partial, self.dir / key)

    def count(self) -> int:
        if not self.dir.is_dir():
            return 0
        return sum(1 for p in self.dir.iterdir() if p.is_dir() and not p.name.startswith("."))

    def clear(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def job_identity(job_script, stamp: dict) -> dict:
    """A chunk job's code (every module beside its script) and its toolchain."""
    jobs = Path(job_script).parent
    code = {p.name: sha256_file(p) for p in sorted(jobs.glob("*.py"))}
    return {"job": Path(job_script).name, "code": code, "toolchain": stamp}


def _link_or_copy(source: Path, target: Path) -> None:
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


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)

"""Small helpers for artifacts: hashing, deterministic JSON, atomic outputs."""

import contextlib
import glob
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path


def sha256_file(path, chunk_size: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk_size):
            digest.update(block)
    return digest.hexdigest()


def files_digest(root, files) -> str:
    """sha256 over each file's name relative to ``root`` and its bytes' sha256, in the
    given order: a params value that changes with any of the files' content."""
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{Path(path).relative_to(root)}\0".encode())
        digest.update(hashlib.sha256(Path(path).read_bytes()).digest())
    return digest.hexdigest()


def dumps_json(data) -> str:
    """Stable JSON text: sorted keys, two-space indent, trailing newline."""
    return json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def write_json(path, data) -> None:
    with atomic_path(path) as tmp:
        Path(tmp).write_text(dumps_json(data), encoding="utf-8")


def read_json(path):
    return json.loads(Path(path).read_text(encoding="utf-8"))


def remove_orphans(path) -> None:
    """Remove temporary siblings of ``path`` left by a killed process (SIGKILL, OOM kill,
    power loss skip the cleanup below). Each carries its writer's pid; a live writer's
    temporary is left alone."""
    path = Path(path)
    # "..name.*.tmp": a temporary of a temporary (a writer that itself writes atomically,
    # killed before its inner rename).
    for lead in (".", ".."):
        for orphan in path.parent.glob(f"{lead}{glob.escape(path.name)}.*.tmp"):
            _remove_orphan(orphan, orphan.name[len(lead) + len(path.name) + 1 :])


def _remove_orphan(orphan: Path, rest: str) -> None:
    """Remove ``orphan`` unless the writer whose pid starts ``rest`` is alive."""
    pid = rest.split(".", 1)[0]
    if not pid.isdigit() or _alive(int(pid)):
        return
    if orphan.is_dir() and not orphan.is_symlink():
        shutil.rmtree(orphan, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            orphan.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed process nobody reaped yet (a zombie) is not writing anymore
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            return handle.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True


@contextlib.contextmanager
def atomic_path(path):
    """Yield a temporary sibling path; rename it onto ``path`` only on success.

    On any exception the temporary file or directory is removed, so a failed
    step never leaves a partial artifact behind.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_orphans(path)
    prefix = f".{path.name}.{os.getpid()}."
    fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=path.parent)
    os.close(fd)
    os.unlink(tmp)
    try:
        yield Path(tmp)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        if os.path.isdir(tmp) and not os.path.islink(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        elif os.path.lexists(tmp):
            os.unlink(tmp)
        raise

"""npuforge's per-machine cache: toolchain venvs and downloaded packages, shared by every
checkout and CI run on the machine, outside any checkout (like huggingface_hub's cache).

``$NPUFORGE_CACHE``, else ``$XDG_CACHE_HOME/npuforge``, else ``~/.cache/npuforge``.
Entries are keyed by what determines their content (a lock's hash, a package
version), written whole under a lock and never changed afterwards.
"""

import contextlib
import fcntl
import os
from pathlib import Path

CACHE_ENV = "NPUFORGE_CACHE"


def cache_root() -> Path:
    named = os.environ.get(CACHE_ENV)
    if named:
        return Path(named).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "npuforge"


@contextlib.contextmanager
def entry_lock(entry: Path):
    """Hold an exclusive lock on ``entry`` (a sibling ``.lock`` file) while building it:
    a second builder waits, then finds the entry complete."""
    entry = Path(entry)
    entry.parent.mkdir(parents=True, exist_ok=True)
    with open(entry.parent / f"{entry.name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield

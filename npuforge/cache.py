"""npuforge's per-machine cache: toolchain venvs and downloaded packages, shared by every
checkout and CI run on the machine, outside any checkout (like huggingface_hub's cache).

``$NPUFORGE_CACHE``, else ``$XDG_CACHE_HOME/npuforge``, else ``~/.cache/npuforge``.
Entries are keyed by what determines their content (a lock's hash, a package
version), written whole under a lock and never changed afterwards. An entry's
``.lock`` file is its last-use time: the most recently used versions of each
toolchain stay (``KEPT_VERSIONS``), older ones are evicted unless a job is using them.
"""

import contextlib
import fcntl
import os
import time
from pathlib import Path

CACHE_ENV = "NPUFORGE_CACHE"


def cache_root() -> Path:
    named = os.environ.get(CACHE_ENV)
    if named:
        return Path(named).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "npuforge"


# Versions of one toolchain kept on the machine: the one in use and the one before it,
# so two checkouts (a release branch and main) do not rebuild each other's. A TPU-MLIR
# venv or image is ~6 GB: without a bound, every lock edit left one more behind.
KEPT_VERSIONS = 2


def lock_path(entry: Path) -> Path:
    entry = Path(entry)
    return entry.parent / f"{entry.name}.lock"


# While a lock is held elsewhere, the waiter says so this often (seconds).
WAIT_REPORT_EVERY = 10.0


def _flock(handle, mode: int, entry: Path, say) -> None:
    """Take ``mode`` on ``handle``; while another process holds the entry, ``say`` so
    (when given) every WAIT_REPORT_EVERY seconds: a build can wait an hour on another."""
    if say is None:
        fcntl.flock(handle, mode)
        return
    started = time.monotonic()
    reported = None
    while True:
        try:
            fcntl.flock(handle, mode | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            now = time.monotonic()
            if reported is None or now - reported >= WAIT_REPORT_EVERY:
                say(
                    f"waiting for {entry.name}: another npuforge process on this machine is "
                    f"building or using it ({int(now - started)} s so far)"
                )
                reported = now
            time.sleep(0.5)


@contextlib.contextmanager
def entry_lock(entry: Path, say=None):
    """Hold an exclusive lock on ``entry`` (a sibling ``.lock`` file) while building it:
    a second builder waits, then finds the entry complete. Marks the entry used."""
    entry = Path(entry)
    entry.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path(entry), "w") as handle:
        _flock(handle, fcntl.LOCK_EX, entry, say)
        yield


@contextlib.contextmanager
def entry_in_use(entry: Path, say=None):
    """Hold a shared lock on ``entry`` while a job uses it, so no eviction removes it
    (a builder of the same entry waits too). Marks the entry used."""
    lock = lock_path(entry)
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as handle:
        _flock(handle, fcntl.LOCK_SH, Path(entry), say)
        os.utime(lock)
        yield


def build_once(entry: Path, complete, build, say=None) -> None:
    """Build ``entry`` unless it is complete. A complete entry is checked under a shared
    lock, so a job using it (which holds one) does not hold this up; only a build takes
    the exclusive lock, and a second builder then finds the entry complete."""
    with entry_in_use(entry, say):
        if complete():
            return
    with entry_lock(entry, say):
        if not complete():
            build()


def last_used(entry: Path) -> float:
    """When ``entry`` was last built or used (0 when never, as by an older npuforge)."""
    try:
        return lock_path(entry).stat().st_mtime
    except FileNotFoundError:
        return 0.0


def evict_older(others, remove, keep: int = KEPT_VERSIONS - 1) -> tuple[list, list]:
    """Keep the ``keep`` most recently used of ``others`` (entries beside the current one)
    and call ``remove(entry)`` on the rest, each under its exclusive lock; an entry a job
    or a builder holds is skipped. Returns (removed, busy)."""
    removed, busy = [], []
    for entry in sorted(others, key=last_used, reverse=True)[keep:]:
        lock = lock_path(entry)
        lock.parent.mkdir(parents=True, exist_ok=True)
        with open(lock, "a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                busy.append(entry)
                continue
            # The lock file stays: a builder already waiting on it must keep excluding others.
            remove(entry)
            removed.append(entry)
    return removed, busy

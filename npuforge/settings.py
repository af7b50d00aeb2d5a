"""Checks of the workflow config that a JSON Schema cannot express, made while planning.

The Snakefile imports this module while it parses: standard library only.
"""

import os
from pathlib import Path

from npuforge.errors import NpuforgeError


def results_dir(value) -> str:
    """The ``results`` directory as the rules use it: ``~`` expanded, never the filesystem
    root, not under a regular file, and on a writable filesystem."""
    text = str(value or "").strip()
    if not text:
        raise NpuforgeError("results is empty: set results=<directory> (default: results)")
    path = Path(os.path.expanduser(text))
    if path.resolve() == Path(path.resolve().anchor):
        raise NpuforgeError(
            f"results={text} is the filesystem root: point results= at a directory of its own"
        )
    existing = path.resolve()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise NpuforgeError(
            f"results={text} lies under {existing}, which is a file, not a directory: point "
            "results= elsewhere"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise NpuforgeError(
            f"results={text}: {existing} is not writable (read-only filesystem or permissions): "
            "point results= at a writable directory"
        )
    return str(path).rstrip("/") or "/"


def check_calibration_text(path) -> None:
    """The calibration text (a .txt file or a directory of them) must exist before any job."""
    path = Path(path)
    if path.is_dir():
        if not any(p.is_file() for p in path.rglob("*.txt")):
            raise NpuforgeError(
                f"calibration.text {path} holds no .txt files: add some, or set "
                'calibration.text to "" for the project\'s texts'
            )
    elif not path.is_file():
        raise NpuforgeError(
            f"calibration.text {path} does not exist: give a .txt file or a directory of them, or "
            'set calibration.text to "" for the project\'s texts'
        )


RUN_LOCK = ".npuforge-run.lock"
# The open, locked file of this process's run (see hold_results): kept open until it exits.
_held_run_lock = None


def hold_results(results: str) -> None:
    """Lock ``results`` for this run until the process exits, or refuse in one line.

    Snakemake's own lock checks for other runs' lock files and then writes its own, so two
    runs started together can both pass it and then delete and rewrite each other's
    outputs (the release index above all). An flock is taken or refused atomically.
    """
    import fcntl

    global _held_run_lock
    if _held_run_lock is not None:
        return
    try:
        Path(results).mkdir(parents=True, exist_ok=True)
        handle = open(Path(results, RUN_LOCK), "a+", encoding="utf-8")
    except OSError as err:
        raise NpuforgeError(
            f"results={results} cannot be locked for this run ({err.strerror}): point "
            "results= at a writable directory"
        ) from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise NpuforgeError(
            f"results={results} cannot be locked: another run (pid {holder}) is building into "
            "it; wait for it to finish, or give this run its own results=<directory>"
        ) from None
    try:
        handle.truncate(0)
        handle.write(f"{os.getpid()}\n")
        handle.flush()
    except OSError:
        pass  # the pid only names the holder to a refused run; a full disk is said elsewhere
    _held_run_lock = handle

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

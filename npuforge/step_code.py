"""The code a step runs, as a digest: its step CLI and the whole npuforge package.

A step's output depends on its code as much as on its options, so the digest is a
params value of its rule: a code change reruns the step (and misses the output cache)
instead of reusing an artifact the old code built. The whole package, because every
step CLI reaches nearly all of it (through imports, modules picked by name at run time,
job scripts run by path in a toolchain), and a narrower set that missed one module
would reuse a stale artifact.
"""

from pathlib import Path

from npuforge.fileio import files_digest

PACKAGE = "npuforge"


def step_sources(script: Path, checkout: Path) -> list[Path]:
    """``script`` and every file of the package in ``checkout``, in a fixed order."""
    checkout = Path(checkout).resolve()
    package = sorted(
        path
        for path in (checkout / PACKAGE).rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    )
    return [Path(script).resolve(), *package]


def step_code_digest(script: Path, checkout: Path) -> str:
    """sha256 over the checkout-relative names and bytes of ``step_sources``."""
    checkout = Path(checkout).resolve()
    return files_digest(checkout, step_sources(script, checkout))

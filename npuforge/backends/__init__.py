"""Vendor backends, one module each, on one skeleton (``npuforge.backends.base``).

Each ``npuforge.backends.<name>`` module provides ``NAME``, ``PRECISIONS``, ``Options``
(its target options as a dataclass), ``FLOORS``, ``check_target`` (its chip table,
checked when the registry loads), ``unavailable_reason`` and ``compile(request)``.
Backend modules are imported while Snakemake parses the workflow, so they keep heavy
imports inside functions; their job scripts (``npuforge/jobs/``) run inside the
vendor's toolchain environment and never import npuforge.
"""

import importlib

from npuforge.errors import NpuforgeError

BACKENDS = ("onnx", "qnn", "rknn", "tpumlir")


def get(name: str):
    """The backend module ``name``."""
    if name not in BACKENDS:
        raise NpuforgeError(f"unknown backend {name!r}: choose one of {', '.join(BACKENDS)}")
    return importlib.import_module(f"npuforge.backends.{name}")


def options_of(name: str, mapping: dict, target: str):
    """A target's ``options`` as its backend's typed Options (unknown keys refused)."""
    from npuforge.backends.base import parse_options

    return parse_options(get(name).Options, mapping, f"target {target}")

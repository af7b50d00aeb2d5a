"""Vendor backends, one module each, on one skeleton (``npuforge.backends.base``).

Each ``npuforge.backends.<name>`` module provides ``NAME``, ``PRECISIONS``, ``Options``
(its target options as a dataclass), ``FLOORS``, ``check_target`` (its chip table,
checked when the registry loads), ``unavailable_reason`` and ``compile(request)``.
Backend modules are imported while Snakemake parses the workflow, so they keep heavy
imports inside functions; their job scripts (``npuforge/jobs/``) run inside the
vendor's toolchain environment and never import npuforge.
"""

import dataclasses
import importlib

from npuforge.errors import NpuforgeError

BACKENDS = ("onnx", "qnn", "rknn", "tpumlir")


def module_name(name: str) -> str:
    """The dotted name of backend ``name``'s module."""
    return f"npuforge.backends.{name}"


def get(name: str):
    """The backend module ``name``."""
    if name not in BACKENDS:
        raise NpuforgeError(f"unknown backend {name!r}: choose one of {', '.join(BACKENDS)}")
    return importlib.import_module(module_name(name))


def options_of(name: str, mapping: dict, target: str):
    """A target's ``options`` as its backend's typed Options (unknown keys refused)."""
    return parse_options(get(name).Options, mapping, f"target {target}")


def parse_options(cls, mapping, where: str):
    """A target's ``options`` mapping as the backend's Options dataclass; ``where`` names
    it in errors ("target SM8650"). An unknown key is an error naming the valid ones (a
    typo must not pass silently)."""
    mapping = dict(mapping or {})
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(mapping) - set(fields))
    if unknown:
        raise NpuforgeError(
            f"{where}: unknown option {unknown[0]!r}; valid options: {', '.join(sorted(fields))}"
        )
    missing = [
        name
        for name, f in fields.items()
        if f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
        and name not in mapping
    ]
    if missing:
        raise NpuforgeError(f"{where}: options need {missing[0]!r}; add it in targets.yaml")
    return cls(**mapping)


def options_dict(options) -> dict:
    """Options as the plain mapping they were given as, defaults filled in (for records)."""
    return dataclasses.asdict(options) if dataclasses.is_dataclass(options) else dict(options)

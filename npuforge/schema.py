"""JSON Schema checks of the config and the registries, reported as one line.

jsonschema's own report of a failure is a dump of the schema; here the most
relevant error (jsonschema's ``best_match``) becomes one line that names the
key by its path (``models.my-rwkv.source.hf.revision``), the bad value, and what
would be valid, with the schema's ``description`` of that key as the hint.
The Snakefile imports this module while it parses: PyYAML and jsonschema only (and
jsonschema only when the data has not passed the same schema before).
"""

import difflib
import functools
import hashlib
import json
from importlib import metadata
from pathlib import Path

import yaml

from npuforge.errors import NpuforgeError


@functools.cache
def _validator(schema_path: str):
    import jsonschema

    schema = yaml.safe_load(Path(schema_path).read_text(encoding="utf-8"))
    return jsonschema.Draft202012Validator(schema)


def _where(prefix: str, error) -> str:
    parts = [prefix] + [str(p) for p in error.absolute_path]
    return ".".join(p for p in parts if p)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def describe(error, prefix: str) -> str:
    where = _where(prefix, error) or "the config"
    schema = error.schema if isinstance(error.schema, dict) else {}
    hint = schema.get("description")
    kind = error.validator
    if kind == "additionalProperties":
        allowed = sorted(schema.get("properties", {}))
        unknown = sorted(set(error.instance) - set(allowed))
        key = unknown[0] if unknown else "?"
        close = difflib.get_close_matches(key, allowed, n=1)
        guess = f"did you mean {close[0]!r}? " if close else ""
        return f"{where}: unknown key {key!r}; {guess}valid keys: {', '.join(allowed)}"
    if "propertyNames" in error.schema_path:
        pattern = schema.get("pattern", "")
        return (
            f"{where}: the id {_short(error.instance)} is not allowed; ids are letters, digits, "
            f"'.', '_' and '-' ({pattern})"
        )
    if kind == "required":
        missing = error.message.split("'")[1] if "'" in error.message else error.message
        return f"{where}: the key {missing!r} is missing; add it"
    if kind == "enum":
        choices = ", ".join(str(c) for c in error.validator_value)
        return f"{where}: {_short(error.instance)} is not one of {choices}"
    if kind == "type":
        expected = error.validator_value
        expected = " or ".join(expected) if isinstance(expected, list) else expected
        if error.instance is None:
            line = f"{where} is empty; give a value of type {expected}"
            return f"{line} ({hint})" if hint else line
        note = ""
        if isinstance(error.instance, int) and "string" in str(expected):
            note = " (YAML read it as a number: quote it)"
        line = f"{where}: {_short(error.instance)} is not of type {expected}{note}"
        return f"{line}; {hint}" if hint else line
    if kind == "pattern":
        line = f"{where}: {_short(error.instance)} does not match {error.validator_value}"
        return f"{line}; {hint}" if hint else line
    line = f"{where}: {error.message}"
    return f"{line}; {hint}" if hint else line


def _validated_key(data, schema_path) -> str:
    """What a validation result depends on: the data, the schema's bytes, jsonschema's version."""
    digest = hashlib.sha256()
    digest.update(Path(schema_path).read_bytes())
    digest.update(metadata.version("jsonschema").encode())
    digest.update(json.dumps(data, sort_keys=True, default=repr).encode())
    return digest.hexdigest()


def validate(data, schema_path, prefix: str = "", cache_dir=None) -> None:
    """Raise NpuforgeError with one line for the most relevant schema violation.

    With ``cache_dir``, data that passed this schema before is not checked again:
    importing jsonschema and checking every registry entry is most of a dry run's
    fixed cost, and the answer only changes with the data or the schema.
    """
    stamp = Path(cache_dir) / _validated_key(data, schema_path) if cache_dir else None
    if stamp is not None and stamp.exists():
        return
    import jsonschema

    error = jsonschema.exceptions.best_match(_validator(str(schema_path)).iter_errors(data))
    if error is not None:
        raise NpuforgeError(describe(error, prefix))
    if stamp is not None:
        try:
            stamp.parent.mkdir(parents=True, exist_ok=True)
            stamp.touch()
        except OSError:
            pass  # a read-only working directory: the next run checks again

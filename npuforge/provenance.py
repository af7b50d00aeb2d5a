"""Pinned inputs stay pinned: checks that run while the workflow is planned.

A model's checkpoint is fetched once, checked against the registry's sha256 and
kept as a private copy (``npuforge.fetch``). Two things can still change under a
later build, and both are checked before any job runs, so nothing is rebuilt
from a file that no longer matches its pin:

* a ``path:`` source edited or replaced after its pin was written (the registry
  still claims the old bytes: the build stops instead of shipping a manifest
  that names a checkpoint it was not built from);
* the fetched copy under ``results/models/`` edited or replaced (e.g. by a
  symlink): it must still hash to its fetch record.

Hashing a multi-GB file on every run would cost seconds, so a file is hashed
only when its stat key (size, mtime, ctime, inode) differs from the one recorded
when it last matched; those keys live in npuforge's machine cache
(``<cache>/verified/``), never in the results.
"""

import hashlib
import json
import os
from pathlib import Path

from npuforge.cache import cache_root
from npuforge.errors import NpuforgeError


def _file_key(path: Path) -> list:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def stat_key(path) -> list:
    """What changes when a file or any file of a directory tree is written or replaced."""
    from npuforge.fetch import tree_files

    path = Path(path)
    if path.is_dir():
        return [[p.relative_to(path).as_posix(), *_file_key(p)] for p in tree_files(path)]
    return _file_key(path)


def _memo_path(path: Path) -> Path:
    digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:32]
    return cache_root() / "verified" / f"{digest}.json"


def current_sha256(path) -> str:
    """sha256 of a file (or tree listing, like ``npuforge.fetch.tree_sha256``), hashed
    only when the file changed since it was last hashed here."""
    from npuforge.fetch import tree_sha256
    from npuforge.fileio import sha256_file, write_json

    path = Path(path)
    key = stat_key(path)
    memo = _memo_path(path)
    try:
        known = json.loads(memo.read_text())
        if known.get("path") == str(path.resolve()) and known.get("key") == key:
            return known["sha256"]
    except (OSError, ValueError, KeyError):
        pass
    digest = tree_sha256(path) if path.is_dir() else sha256_file(path)
    try:
        write_json(memo, {"path": str(path.resolve()), "key": key, "sha256": digest})
    except OSError:
        pass  # only a saving; the check itself has been made
    return digest


def check_path_source(model_id: str, source_path, expected: str | None) -> None:
    """A ``path:`` source must still hold the bytes its pin names (when it exists)."""
    path = Path(source_path)
    if not expected or not os.path.exists(path):
        return  # a missing source is the fetch step's one-line error
    actual = current_sha256(path)
    if actual != expected.lower():
        raise NpuforgeError(
            f"model {model_id}: source {path} now hashes to {actual}, but the registry pins "
            f"{expected.lower()}: the file changed after it was pinned; restore it, or set the "
            "new sha256 in the registry to build from the new bytes"
        )


def check_fetched(model_id: str, checkpoint, record_path) -> None:
    """The fetched copy under results/ must still match its fetch record (when both exist)."""
    checkpoint, record_path = Path(checkpoint), Path(record_path)
    if not record_path.is_file() or not os.path.lexists(checkpoint):
        return
    fix = f"delete {checkpoint.parent} to fetch it again"
    if checkpoint.is_symlink():
        raise NpuforgeError(
            f"model {model_id}: the fetched checkpoint {checkpoint} was replaced by a link to "
            f"{os.path.realpath(checkpoint)}; {fix}"
        )
    try:
        expected = json.loads(record_path.read_text())["sha256"]
    except (ValueError, KeyError) as err:
        problem = f"{record_path} is unreadable ({err})"
        raise NpuforgeError(f"model {model_id}: {problem}; {fix}") from None
    actual = current_sha256(checkpoint)
    if actual != expected:
        raise NpuforgeError(
            f"model {model_id}: the fetched checkpoint {checkpoint} hashes to {actual}, its fetch "
            f"record says {expected}: it was changed after the fetch; {fix}"
        )


ARCH_FIELDS = {"layers": "n_layers", "embed": "embed_dim", "vocab": "vocab_size"}


def check_arch(model_id: str, arch: dict, info: dict) -> None:
    """The registry's ``arch`` (what planning used) must be the checkpoint's (what export uses)."""
    for key, detected in ARCH_FIELDS.items():
        if key in arch and detected in info and int(arch[key]) != int(info[detected]):
            raise NpuforgeError(
                f"model {model_id}: the registry says arch.{key}={arch[key]} but the checkpoint "
                f"has {info[detected]}; set arch.{key}: {info[detected]} in the model's entry"
            )


def check_models(models: dict, paths: dict) -> None:
    """Every pin of the selected models; ``paths``: model id -> (fetched checkpoint, record)."""
    from npuforge.fetch import wrong_kind

    for model_id in sorted(paths):
        entry = models[model_id]
        if "path" in entry["source"]:
            local = Path(entry["source"]["path"])
            # A directory where the format wants a file (or the reverse) is that, not a
            # changed file: say so before hashing it.
            if local.exists() and local.is_dir() != (entry.get("format") == "hf"):
                raise NpuforgeError(f"model {model_id}: {wrong_kind(local)}")
            check_path_source(model_id, local, entry.get("sha256"))
        check_fetched(model_id, *paths[model_id])

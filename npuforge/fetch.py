"""Fetch a model checkpoint from its registered source and check its sha256.

Sources (exactly one per model, see config/models.yaml):
  hf         {repo, filename, revision}: huggingface_hub at a pinned commit, through
             the user's HF cache; HF_TOKEN, HF_ENDPOINT and HF_HUB_OFFLINE apply
  path       an absolute path to a local file
  synthetic  {version, layers, embed, vocab, ...}: the deterministic generator

The output appears only after its hash has been checked: a mismatch leaves no file.
"""

import os
import shutil
from pathlib import Path

from npuforge.errors import NpuforgeError
from npuforge.fileio import atomic_path, sha256_file, write_json


def source_kind(source: dict) -> str:
    kinds = [kind for kind in ("hf", "path", "synthetic") if kind in source]
    if len(kinds) != 1:
        raise NpuforgeError(
            f"a model source needs exactly one of hf, path, synthetic; got {sorted(source)}"
        )
    return kinds[0]


def fetch(source: dict, expected_sha256: str | None, out, record) -> dict:
    """Place the checkpoint at ``out`` and its provenance at ``record``; return the record."""
    kind = source_kind(source)
    out = Path(out)
    with atomic_path(out) as tmp:
        if kind == "hf":
            _place(_download_hf(source["hf"]), tmp)
        elif kind == "path":
            local = Path(source["path"])
            if not local.is_file():
                raise NpuforgeError(
                    f"checkpoint {local} does not exist; fix source.path in the model registry"
                )
            _place(local, tmp)
        else:
            _make_synthetic(source["synthetic"], tmp, fmt=out.suffix.lstrip("."))
        actual = sha256_file(tmp)
        if expected_sha256 and actual != expected_sha256.lower():
            raise NpuforgeError(
                f"sha256 mismatch for {_describe(source)}: expected {expected_sha256}, got "
                f"{actual}; the file was not kept (fix the registry's sha256 or the source)"
            )
        size = tmp.stat().st_size
    data = {
        "source": source,
        "sha256": actual,
        "expected_sha256": expected_sha256 or None,
        "size": size,
        "file": out.name,
    }
    write_json(record, data)
    return data


def _describe(source: dict) -> str:
    kind = source_kind(source)
    if kind == "hf":
        hf = source["hf"]
        return f"hf:{hf['repo']}/{hf['filename']}@{hf['revision'][:12]}"
    if kind == "path":
        return source["path"]
    return "synthetic checkpoint"


def _place(src: Path, dst: Path) -> None:
    """Hard-link when possible (no second copy of a multi-GB file), else copy."""
    src = Path(os.path.realpath(src))
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def _download_hf(hf: dict) -> Path:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    where = f"{hf['repo']}/{hf['filename']} at revision {hf['revision']}"
    try:
        path = hf_hub_download(
            repo_id=hf["repo"],
            filename=hf["filename"],
            revision=hf["revision"],
            repo_type=hf.get("repo_type", "model"),
        )
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


def _make_synthetic(spec: dict, out: Path, fmt: str) -> None:
    from npuforge.synthetic import write_synthetic_checkpoint

    write_synthetic_checkpoint(out, fmt=fmt, **spec)

"""Release bundles: the compiled binaries with tokenizer, embedding, manifest and SHA256SUMS.

Layout (the public contract, see README):

    results/release/{model}/{target}/{precision}/
        <binaries listed in compile.json>  tokenizer (tokenizer.bin | tokenizer.json, none
        for a model registered with tokenizer: none)  [embedding.bin]
        run.py (npuforge/bundle_runner.py: generates text from the bundle alone)
        manifest.json  SHA256SUMS
    results/release/{model}/{target}/{precision}.tar.gz

Everything here is byte-deterministic: the manifest holds no timestamps and no
machine-specific paths, and the tarball has sorted entries, fixed mtime, owner
and modes, and a gzip header without time or name.
"""

import gzip
import os
import shutil
import subprocess
import sys
import tarfile
from importlib import metadata
from pathlib import Path

import npuforge
from npuforge import progress
from npuforge.errors import NpuforgeError
from npuforge.fileio import atomic_path, dumps_json, read_json, sha256_file
from npuforge.jobs.finished_chunks import link_or_copy

MANIFEST = "manifest.json"
SUMS = "SHA256SUMS"
# The generation runner every bundle ships (standard library + numpy; see its docstring).
RUNNER_SOURCE = Path(__file__).resolve().parent / "bundle_runner.py"
RUNNER = "run.py"
# The runtime each backend's bundle runs on, as run.py drives it.
RUNNER_RUNTIMES = {
    "onnx": "onnxruntime (CPU)",
    "qnn": "onnxruntime + onnxruntime-qnn (QNN EP, EPContext models; x86: the HTP simulator)",
    "rknn": "rknnlite (rknn-toolkit-lite2) on an aarch64 Rockchip board",
    "tpumlir": "none yet: run.py stops and names TPU-MLIR's runtime",
}
MANIFEST_FORMAT = 1
# inputs.tokenizer of a model registered with tokenizer: none (no invented vocabulary).
NO_TOKENIZER = (
    "the checkpoint has no tokenizer (registry tokenizer: none, e.g. random test weights), "
    "so the bundle ships none"
)
# Main-environment packages whose versions can change the bytes of an artifact.
RECORDED_PACKAGES = (
    "numpy",
    "onnx",
    "onnxruntime",
    "torch",
    "rwkv",
    "huggingface_hub",
    "safetensors",
    "transformers",  # the llama family's reference
    "tokenizers",  # llama calibration texts
)
REPO_ROOT = Path(npuforge.__file__).resolve().parents[1]


def git_provenance(repo=REPO_ROOT) -> dict:
    """Commit of the checkout npuforge runs from; 'unknown' outside a git work tree."""

    def git(*args):
        result = subprocess.run(
            ["git", "-C", str(repo), *args], capture_output=True, text=True, check=False
        )
        return result.stdout.strip() if result.returncode == 0 else None

    try:
        commit = git("rev-parse", "HEAD")
        # Only tracked files count: results/ and other untracked files do not make it dirty.
        status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    except OSError:
        commit, status = None, None
    return {"commit": commit or "unknown", "dirty": bool(status) if commit else None}


def package_versions() -> dict:
    versions = {}
    for name in RECORDED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def _place(src: Path, dst: Path, link: bool) -> None:
    """A build output is hard-linked where the filesystem allows (a 1.5B bundle then costs
    no second copy of its weights); the runner (npuforge's own source) and the tokenizer
    are copied, so editing a bundle's copy never edits them."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    if link:
        link_or_copy(src, dst)
    else:
        shutil.copyfile(src, dst)
    os.chmod(dst, 0o644)


def _safe_relative(name: str, where: str) -> str:
    path = Path(name)
    if path.is_absolute() or ".." in path.parts or not name:
        raise NpuforgeError(f"{where} lists '{name}', which is not a plain relative file name")
    return path.as_posix()


def _export_summary(export_dir: Path) -> dict:
    meta_path = export_dir / "export.json"
    if not meta_path.is_file():
        raise NpuforgeError(f"{export_dir} has no export.json; rebuild the export")
    meta = read_json(meta_path)
    return {
        "key": export_dir.name,
        "meta": meta,
        "graphs": [{"file": g["file"], "sha256": g.get("sha256")} for g in meta.get("graphs", [])],
    }


def _kv_prefix_file(export_dir: Path, meta: dict) -> Path | None:
    """A llama export's precomputed prefix rows (the graphs' starting state), checked."""
    prefix = meta.get("kv_prefix")
    if not prefix:
        return None
    path = export_dir / _safe_relative(prefix["file"], f"{export_dir}/export.json")
    if not path.is_file() or sha256_file(path) != prefix["sha256"]:
        raise NpuforgeError(f"{path} is missing or not the file export.json names; re-export")
    return path


def _embedding_file(export_dir: Path, meta: dict) -> Path | None:
    embedding = meta.get("embedding")
    if not embedding:
        return None
    name = (
        embedding.get("file", "embedding.bin") if isinstance(embedding, dict) else "embedding.bin"
    )
    path = export_dir / _safe_relative(name, f"{export_dir}/export.json")
    if not path.is_file():
        raise NpuforgeError(f"{path} is named in export.json but missing; rebuild the export")
    return path


def _genie(backend, exports):
    if backend != "qnn":
        return None
    from npuforge.backends.qnn_genie import genie_record

    return genie_record([e["meta"] for e in exports])


def runner_record(backend) -> dict:
    """manifest.json ``runner``: how to generate text with the bundle (run.py)."""
    return {
        "file": RUNNER,
        "usage": f"python {RUNNER} --prompt TEXT [--max-new-tokens N] [--temperature T --top-p P "
        "--seed S] [--report FILE]",
        "requires": "Python 3.10+ and numpy; the runtime below",
        "runtime": RUNNER_RUNTIMES.get(backend),
    }


def build_bundle(
    *,
    model_id: str,
    model_entry: dict,
    target_id: str,
    target_entry: dict,
    precision: str,
    compiled_dir,
    export_dirs,
    tokenizer,
    fetch_record,
    dequantize_record=None,
    export_verification=(),
    out_dir,
    tarball,
) -> dict:
    """Assemble the release directory and its tarball; return the manifest."""
    compiled_dir = Path(compiled_dir)
    tokenizer = Path(tokenizer) if tokenizer else None
    compile_json = compiled_dir / "compile.json"
    if not compile_json.is_file():
        raise NpuforgeError(f"{compiled_dir} has no compile.json; rebuild the compile step")
    compiled = read_json(compile_json)
    exports = [_export_summary(Path(d)) for d in export_dirs]
    record = read_json(fetch_record)

    with atomic_path(out_dir) as tmp:
        tmp.mkdir()
        sources = {}
        for artifact in compiled.get("artifacts", []):
            name = _safe_relative(artifact["file"], str(compile_json))
            src = compiled_dir / name
            if not src.is_file():
                raise NpuforgeError(f"{src} is listed in compile.json but missing; recompile")
            if artifact.get("sha256") and sha256_file(src) != artifact["sha256"]:
                raise NpuforgeError(f"{src} does not match its sha256 in compile.json; recompile")
            sources[name] = src
        if tokenizer is not None:
            sources[tokenizer.name] = tokenizer
        if RUNNER in sources:
            raise NpuforgeError(f"{compile_json} lists a file named {RUNNER}, the runner's name")
        sources[RUNNER] = RUNNER_SOURCE
        for export_dir, summary in zip(export_dirs, exports, strict=True):
            embedding = _embedding_file(Path(export_dir), summary["meta"])
            if embedding is not None:
                sources.setdefault(embedding.name, embedding)
            prefix = _kv_prefix_file(Path(export_dir), summary["meta"])
            if prefix is not None:
                sources.setdefault(prefix.name, prefix)
        copied = {RUNNER} | ({tokenizer.name} if tokenizer is not None else set())
        for number, (name, src) in enumerate(sorted(sources.items())):
            progress.stage(f"bundle: placing {name}", number, len(sources))
            _place(src, tmp / name, link=name not in copied)
        progress.stage("bundle: hashing the files")
        files = {name: sha256_file(tmp / name) for name in sorted(sources)}
        progress.clear()

        manifest = {
            "format": MANIFEST_FORMAT,
            "model": {
                "id": model_id,
                "family": model_entry.get("family"),
                "version": model_entry.get("version"),
                "source": portable_source(model_entry.get("source")),
                "sha256": record["sha256"],
                "context_length": model_entry.get("context_length"),
                "tokenizer": model_entry.get("tokenizer"),
                "arch": model_entry.get("arch"),
                # A GGUF source: its quantization, and how it was dequantized for export.
                "dequantized_from": read_json(dequantize_record) if dequantize_record else None,
            },
            "target": {
                "id": target_id,
                "backend": target_entry.get("backend"),
                "description": target_entry.get("description"),
                "options": target_entry.get("options", {}),
                "export": target_entry.get("export", {}),
            },
            "precision": precision,
            "inputs": {
                "checkpoint": {"sha256": record["sha256"], "size": record.get("size")},
                "exports": [
                    {"key": e["key"], "graphs": e["graphs"], "export": e["meta"]} for e in exports
                ],
                "tokenizer": (
                    {"file": tokenizer.name, "sha256": sha256_file(tokenizer)}
                    if tokenizer is not None
                    else {"file": None, "reason": NO_TOKENIZER}
                ),
            },
            "compile": compiled,
            "verification": compiled.get("verification"),
            "export_verification": [read_json(path) for path in export_verification],
            "files": files,
            "runner": runner_record(target_entry.get("backend")),
            # QNN: whether Genie (genie-t2t-run) can run the binaries, and why not.
            "genie": _genie(target_entry.get("backend"), exports),
            "npuforge": {"version": npuforge.__version__, "git": git_provenance()},
            "environment": {
                "python": ".".join(map(str, sys.version_info[:3])),
                "packages": package_versions(),
            },
        }
        (tmp / MANIFEST).write_text(dumps_json(manifest), encoding="utf-8")
        os.chmod(tmp / MANIFEST, 0o644)
        summed = dict(files, **{MANIFEST: sha256_file(tmp / MANIFEST)})
        sums = "".join(f"{digest}  {name}\n" for name, digest in sorted(summed.items()))
        (tmp / SUMS).write_text(sums, encoding="utf-8")
        os.chmod(tmp / SUMS, 0o644)
        os.chmod(tmp, 0o755)
        arcroot = f"{model_id}-{target_id}-{precision}"
        write_deterministic_tarball(tmp, tarball, arcroot)
    return manifest


def portable_source(source):
    """The model's source as any machine would write it: a ``path:`` source names a file
    of the building machine, so only its name is kept (its sha256 identifies the bytes)."""
    if isinstance(source, dict) and isinstance(source.get("path"), str):
        return {**source, "path": Path(source["path"]).name}
    return source


def source_date_epoch() -> int:
    value = os.environ.get("SOURCE_DATE_EPOCH", "0")
    try:
        return int(value)
    except ValueError as err:
        raise NpuforgeError(
            f"SOURCE_DATE_EPOCH={value!r} is not an integer; fix or unset it"
        ) from err


def write_deterministic_tarball(directory, tarball, arcroot: str) -> None:
    """tar.gz of ``directory`` under ``arcroot/``: sorted, root-owned, fixed mtime."""
    directory = Path(directory)
    mtime = source_date_epoch()
    paths = sorted(directory.rglob("*"), key=lambda p: p.relative_to(directory).as_posix())
    with atomic_path(tarball) as tmp, open(tmp, "wb") as raw:
        # filename="" and mtime=0 keep the gzip header free of names and times. Level 1:
        # weights barely compress (level 9 saves ~1% here at 4x the time).
        with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=1) as gz:
            with tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
                tar.addfile(_tar_info(arcroot, tarfile.DIRTYPE, 0o755, 0, mtime))
                for number, path in enumerate(paths):
                    progress.stage(f"tarball: compressing {path.name}", number, len(paths))
                    name = f"{arcroot}/{path.relative_to(directory).as_posix()}"
                    if path.is_dir():
                        tar.addfile(_tar_info(name, tarfile.DIRTYPE, 0o755, 0, mtime))
                        continue
                    size = path.stat().st_size
                    info = _tar_info(name, tarfile.REGTYPE, 0o644, size, mtime)
                    with open(path, "rb") as handle:
                        tar.addfile(info, handle)
    progress.clear()


def _tar_info(name, kind, mode, size, mtime) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = mode
    info.size = size
    info.mtime = mtime
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info

"""The reference backend: the fp32 ONNX graphs themselves, run by onnxruntime on the CPU.

"Compiling" copies the export's graphs (and export.json, which a runtime needs
to chain them) into the output directory, then checks the copies against the
reference implementation with ``npuforge.verify``. Every vendor backend is
compared with these graphs, so this target is the baseline of the matrix.
"""

import shutil
from pathlib import Path

from npuforge.errors import NpuforgeError
from npuforge.fileio import atomic_path, read_json, sha256_file, write_json

PRECISIONS = ("fp32",)


def _export_files(export_dir: Path, meta: dict) -> list[tuple[str, str, int | None]]:
    """(file, role, chunk) of everything a runtime needs from an export, graphs first."""
    files = []
    for chunk, graph in enumerate(meta["graphs"]):
        files.append((graph["file"], "binary", chunk))
        data = export_dir / f"{graph['file']}.data"
        if data.is_file():
            files.append((data.name, "weights", chunk))
    files.append(("export.json", "metadata", None))
    return files


def compile_reference(
    *, exports, checkpoint, target, target_options, precision, out_dir, steps=None
) -> dict:
    if precision not in PRECISIONS:
        raise NpuforgeError(
            f"the onnx reference target builds {', '.join(PRECISIONS)}, not '{precision}'"
        )
    if len(exports) != 1:
        raise NpuforgeError("the onnx reference target takes one --export (the decode graphs)")
    export_dir = Path(exports[0])
    if not (export_dir / "export.json").is_file():
        raise NpuforgeError(f"{export_dir} has no export.json; run the export step first")
    meta = read_json(export_dir / "export.json")
    if meta.get("dtype") != "fp32":
        raise NpuforgeError(
            f"{export_dir} holds {meta.get('dtype')} graphs; the reference needs dtype fp32"
        )
    steps = int(steps or target_options.get("verify_steps", 32))

    with atomic_path(out_dir) as tmp:
        tmp.mkdir()
        artifacts = []
        for name, role, chunk in _export_files(export_dir, meta):
            shutil.copyfile(export_dir / name, tmp / name)
            entry = {"file": name, "sha256": sha256_file(tmp / name), "role": role}
            if chunk is not None:
                entry["chunk"] = chunk
            artifacts.append(entry)
        if meta.get("embedding"):
            # The chain reads the table from beside export.json; the bundle ships it anyway.
            name = meta["embedding"]["file"]
            shutil.copyfile(export_dir / name, tmp / name)
        figures = verify_against_reference(checkpoint, tmp, steps)
        if meta.get("embedding"):
            (tmp / meta["embedding"]["file"]).unlink()
        record = {
            "backend": "onnx",
            "target": target,
            "precision": precision,
            "artifacts": artifacts,
            "split": {"chunks": len(meta["graphs"]), "reason": "export chunks"},
            "toolchain": {"runtime": "main", "versions": _versions()},
            "verification": figures,
            "options": dict(target_options),
        }
        write_json(tmp / "compile.json", record)
    return record


def verify_against_reference(checkpoint, export_dir: Path, steps: int) -> dict:
    from npuforge.verify import verify_export

    report = verify_export([export_dir], checkpoint=checkpoint, steps=steps, reference="auto")
    if report["nan_inf"]:
        raise NpuforgeError(
            f"the reference graphs gave {report['nan_inf']} NaN/inf logits over {steps} steps; "
            "check the checkpoint and the export"
        )
    return report


def _versions() -> dict:
    from importlib import metadata

    return {"onnxruntime": metadata.version("onnxruntime")}

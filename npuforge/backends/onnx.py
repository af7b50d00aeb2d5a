"""The reference backend: the fp32 ONNX graphs themselves, run by onnxruntime on the CPU.

"Compiling" copies the export's graphs (and export.json, which a runtime needs to
chain them) into the output directory, then checks the copies over the held-out
text against the family's own implementation on the checkpoint (BlinkDL's rwkv
package, transformers): the same figures as every vendor backend
(``npuforge.backends.base``), with that implementation as the reference. Every
vendor backend is compared with these graphs, so this target is the baseline of
the matrix.
"""

from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from npuforge import backends
from npuforge.backends import base, gate
from npuforge.errors import NpuforgeError
from npuforge.fileio import atomic_path, sha256_file, write_json
from npuforge.jobs.finished_chunks import link_or_copy

NAME = "onnx"
PRECISIONS = ("fp32",)
# The export must compute what the checkpoint's own implementation computes.
FLOORS = {"fp32": {"min_cosine": 0.9999, "min_top1": 0.99, "max_perplexity_delta": 0.001}}
# Host memory the compile step takes per parameter of a chunk, beside its fp32 reference
# run (npuforge.memory_plan plans chunks and reserves memory from both): onnxruntime runs
# the graphs a chunk at a time like the reference. The whole step measured 5.5 per
# parameter at Qwen2.5-0.5B in one chunk (bench/bench_scale.py, docs/scale.md), against
# the 8 + 8 planned.
COMPILE_BYTES_PER_PARAM = {"fp32": 8.0}


# Target options the toolchain's preparation and checks read (npuforge.toolchain).
TOOLCHAIN_OPTIONS = ()


@dataclass(frozen=True, kw_only=True)
class Options(base.CommonOptions):
    """The reference target takes only the common options (verify_steps, floors)."""


def check_target(target_id: str, options: Options, precisions) -> None:
    unknown = sorted(set(precisions) - set(PRECISIONS))
    if unknown:
        raise NpuforgeError(
            f"target {target_id}: the onnx reference builds {', '.join(PRECISIONS)}, not "
            f"'{unknown[0]}'"
        )


def unavailable_reason(runtime: str, options: Options) -> str | None:
    return None


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


def compile(request: base.CompileRequest) -> dict:  # noqa: A001 - the backend interface
    import numpy as np

    from npuforge.verify import family_reference

    if request.precision not in PRECISIONS:
        raise NpuforgeError(
            f"the onnx reference target builds {', '.join(PRECISIONS)}, not '{request.precision}'"
        )
    if request.checkpoint is None:
        raise NpuforgeError("the onnx reference target needs --checkpoint (its reference)")
    export = base.load_exports(request.exports, NAME, prefill=False)["decode"]
    if export.meta.get("dtype") != "fp32":
        raise NpuforgeError(
            f"{export.dir} holds {export.meta.get('dtype')} graphs; the reference needs dtype fp32"
        )
    schedule = base.verification_schedule({"decode": export}, request.options.verify_steps)
    text = base.verification_tokens(len(schedule), export, request.heldout)
    ids = np.asarray(text["ids"][: len(schedule)], dtype=np.int64)[None, :]
    prefix = export.meta.get("kv_prefix", {}).get("tokens", ())
    expected, reference = family_reference(export.meta["family"], request.checkpoint, ids, prefix)
    with atomic_path(request.out_dir) as tmp:
        tmp.mkdir()
        artifacts = []
        for name, role, chunk in _export_files(export.dir, export.meta):
            link_or_copy(export.dir / name, tmp / name)
            entry = {"file": name, "sha256": sha256_file(tmp / name), "role": role}
            if chunk is not None:
                entry["chunk"] = chunk
            artifacts.append(entry)
        # The chain reads the table and the prefix rows from beside export.json; the
        # bundle ships them from the export anyway.
        beside = [export.meta[k]["file"] for k in ("embedding", "kv_prefix") if export.meta.get(k)]
        for name in beside:
            link_or_copy(export.dir / name, tmp / name)
        shipped = base.Export(tmp, export.meta)
        logits = base.reference_logits({"decode": shipped}, schedule, text["ids"])
        for name in beside:
            (tmp / name).unlink()
        verification = gate.verify(
            request, FLOORS, schedule, text, expected.reshape(len(schedule), -1), logits,
            runner=f"onnxruntime {metadata.version('onnxruntime')} CPU, the shipped graphs",
            reference_label=reference,
        )  # fmt: skip
        record = {
            "backend": NAME,
            "target": request.target,
            "precision": request.precision,
            "artifacts": artifacts,
            "split": {"chunks": len(export.graphs), "reason": "export chunks"},
            "toolchain": {
                "runtime": "main",
                "versions": {"onnxruntime": metadata.version("onnxruntime")},
            },
            "verification": verification,
            "options": backends.options_dict(request.options),
        }
        write_json(tmp / "compile.json", record)
        gate.check_gate(
            request.target,
            request.precision,
            verification,
            "the export does not compute what the checkpoint does: check the checkpoint and "
            "the export",
        )
    return record

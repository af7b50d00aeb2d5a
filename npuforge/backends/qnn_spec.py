"""The QNN job spec: chunks, graphs, calibration samples, verification chains.

The spec is all ``npuforge/jobs/qnn_job.py`` sees: absolute paths, the QDQ
quantization settings and, per chunk, the graphs that share one HTP context.
"""

from pathlib import Path

from npuforge.errors import NpuforgeError

QUANTIZED = ("a16w8", "a16w4")
# Calibrated activation ranges are widened by this share of their span on each
# side that is not zero-bounded: a few samples miss a recurrent model's
# extremes, and 16-bit codes have bits to spare (one span each side costs ~1.6
# bits). On the demo RWKV-7, A16W8 min-step cosine over 32 steps: 0.9920 at
# 0.1, 0.99926 at 1.0, 0.99929 at 2.0 (onnxruntime CPU on the QDQ graphs).
RANGE_MARGIN = 1.0


def calibration_samples(calibration_dir, chunk: int) -> list[dict]:
    """One chunk's samples, [{input name: absolute path of the sample's .npz}]."""
    from npuforge.calibration_formats import chunk_samples

    samples, inputs = chunk_samples(calibration_dir, chunk)
    if not samples:
        raise NpuforgeError(
            f"{calibration_dir} holds no samples of chunk {chunk}: "
            "rerun make_calibration_samples.py"
        )
    return [{spec["name"]: str(path.resolve()) for spec in inputs} for path in samples]


def _input_ranges(export, graph: dict) -> dict:
    """Exact value ranges of inputs fed from a table: embedding rows span the table's range."""
    import numpy as np

    from npuforge.onnx_io import read_embedding_bin

    ranges = {}
    for item in graph["inputs"]:
        if item["role"] == "embedding":
            table = read_embedding_bin(export.dir / export.meta["embedding"]["file"])
            ranges[item["name"]] = [float(np.min(table)), float(np.max(table))]
    return ranges


def ctx_file(chunk: int, variant: str) -> str:
    return f"chunk{chunk}_ctx.onnx" if variant == "decode" else f"chunk{chunk}_{variant}_ctx.onnx"


def keep_16bit_tensors(graph: dict) -> list[str]:
    """The recurrent state path of a chunk: every state input and output."""
    names = [item["name"] for item in graph["inputs"] if item["role"] == "state"]
    names += [item["name"] for item in graph["outputs"] if item["role"] == "state"]
    return names


def check_calibrations(exports: dict, calibrations: dict, precision: str) -> None:
    """Every graph of a quantized precision needs samples captured from its own export."""
    from npuforge.calibration import check_calibration_matches

    for variant, export in exports.items():
        if variant not in calibrations:
            raise NpuforgeError(
                f"{precision} with a {variant} export needs {variant} calibration samples: "
                f"pass --calibration DIR made by make_calibration_samples.py --export "
                f"{export.dir}"
            )
        check_calibration_matches(calibrations[variant], export.meta, export.dir)


def build_spec(exports: dict, calibrations: dict, options, precision, out_dir, work_dir, calls):
    """The job spec; ``calibrations``: ``{variant: calibration directory}`` (quantized only)."""
    quantized = precision in QUANTIZED
    if quantized:
        check_calibrations(exports, calibrations, precision)
    decode = exports["decode"]
    chunks = []
    for index, graph in enumerate(decode.graphs):
        graphs = []
        for variant, export in exports.items():
            meta = export.graphs[index]
            entry = {
                "variant": variant,
                "model": str(export.dir / meta["file"]),
                "ctx_file": ctx_file(index, variant),
                "inputs": meta["inputs"],
            }
            ranges = _input_ranges(export, meta)
            if ranges:
                entry["input_ranges"] = ranges
            if quantized:
                # Each graph is quantized with the samples of its own variant's runs.
                entry["calibration"] = calibration_samples(calibrations[variant], index)
            graphs.append(entry)
        chunks.append(
            {"index": index, "graphs": graphs, "keep_16bit_tensors": keep_16bit_tensors(graph)}
        )
    spec = {
        "precision": precision,
        "soc_model": int(options.soc_model),
        "htp_arch": int(options.htp_arch),
        "vtcm_mb": int(options.vtcm_mb) or None,
        "optimization_mode": int(options.optimization_level),
        # Headroom on calibrated 16-bit activation ranges, as a fraction of each span.
        "range_margin": float(options.range_margin),
        "quantize_op_types": options.quantize_op_types,
        "weights_16bit": list(options.weights_16bit or []),
        "cover_stream": bool(options.cover_stream),
        "weight_block_size": options.weight_block_size,
        "weights_8bit": list(options.weights_8bit or []),
        "out_dir": str(Path(out_dir).resolve()),
        "work_dir": str(Path(work_dir).resolve()),
        "chunks": chunks,
    }
    if calls:
        spec["verify"] = {
            "steps": len(calls),
            # Per call: which graph variant runs and the file holding its host-fed inputs.
            "calls": list(calls),
            "outputs": str((Path(work_dir) / "verify_outputs.npz").resolve()),
            "chains": {
                variant: [
                    {
                        "source": str(exports[variant].dir / graph["file"]),
                        "ctx_file": ctx_file(index, variant),
                        "inputs": graph["inputs"],
                        "outputs": graph["outputs"],
                    }
                    for index, graph in enumerate(exports[variant].graphs)
                ]
                for variant in sorted({call["variant"] for call in calls})
            },
        }
    return spec

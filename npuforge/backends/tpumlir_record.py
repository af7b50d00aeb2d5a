"""The TPU-MLIR backend's compile.json (docs/interfaces.md): the combined bmodel, its
nets, TPU-MLIR's own similarity checks and the options the build used."""

from pathlib import Path

from npuforge import backends
from npuforge.backends import base


def tpumlir_checks(spec: dict, result: dict) -> dict:
    """TPU-MLIR's own single-input similarity checks, each of which gated its step."""
    cosines = [
        t["cosine"]
        for step in result["steps"]
        for cmp in step["comparisons"]
        for t in cmp["tensors"].values()
        if t.get("cosine") is not None
    ]
    return {
        "reference": "TPU-MLIR npz compare: top MLIR vs onnxruntime, "
        "tpu MLIR vs top MLIR, bmodel vs tpu MLIR",
        "tolerance": spec["tolerance"],
        # Each check ran one input: the net's feeds at this held-out text position.
        "test_input_positions": {g["net"]: g["test_input_position"] for g in spec["graphs"]},
        "cosine": min(cosines) if cosines else None,
        "passed": all(step["passed"] for step in result["steps"]),
        "similarity": {
            step["name"]: step["comparisons"] for step in result["steps"] if step["comparisons"]
        },
    }


def compile_record(spec, result, stamp, options, verification, calibrations=()) -> dict:
    """compile.json (docs/interfaces.md) from the spec and the job's result."""
    from npuforge.calibration import calibrations_by_variant
    from npuforge.fileio import sha256_file

    out_dir = Path(spec["out_dir"])
    artifacts = [
        {
            "file": Path(spec["bmodel"]).name,
            "sha256": sha256_file(spec["bmodel"]),
            "role": "binary",
            "chunk": 0,
            "nets": [g["net"] for g in spec["graphs"]],
        }
    ]
    for state in spec["state_files"]:
        name = Path(state).name
        artifacts.append({"file": name, "sha256": sha256_file(out_dir / name), "role": "state"})
    return {
        "backend": spec["backend"],
        "target": spec["target"],
        "precision": spec["precision"],
        "artifacts": artifacts,
        "split": {
            "chunks": max(g["chunk"] for g in spec["graphs"]) + 1,
            "layers": [g["layers"] for g in spec["graphs"] if g["variant"] == "decode"],
            "reason": "one net per chunk and graph variant, combined into one bmodel",
        },
        "toolchain": base.toolchain_record(stamp, result.get("versions")),
        "verification": {**(verification or {}), "tpumlir": tpumlir_checks(spec, result)},
        "nets": [
            {"name": g["net"], "tokens_per_call": g["tokens_per_call"], "inputs": g["inputs"]}
            for g in spec["graphs"]
        ],
        "options": {
            **backends.options_dict(options),
            "quantize": spec["quantize"],
            # The group W4F16 ran with (the option may leave it to the export).
            "q_group_size": spec["q_group_size"],
            "stages": [step["name"] for step in spec["steps"]],
            # run_calibration measures and keeps its INT8 thresholds on the host's CPU.
            "calibration": (
                {
                    variant: base.calibration_summary(directory, hosts=True)
                    for variant, directory in calibrations_by_variant(list(calibrations)).items()
                }
                if spec["quantize"] == "INT8"  # the calibrated mode
                else None
            ),
        },
    }

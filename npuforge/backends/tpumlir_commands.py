"""TPU-MLIR's documented command lines, built as data (argv lists) for the job to run:

model_transform.py  ONNX -> top MLIR, static shapes; compares the MLIR with
                    onnxruntime on --test_input and writes --test_result
run_calibration.py  INT8 only: calibration table from .npz samples (--data_list)
model_deploy.py     top MLIR -> bmodel for --processor at --quantize; compares the
                    tpu MLIR with --test_reference and the bmodel with the tpu
                    MLIR, failing below --tolerance
model_tool --combine  decode + prefill bmodels -> one bmodel with both nets
"""

from npuforge.errors import NpuforgeError

# Group size of W4F16 weights (TPU-MLIR's default for --q_group_size in LLM scripts).
DEFAULT_Q_GROUP_SIZE = 64
# ONNX dtypes -> model_transform.py --input_types; bmodels carry no int64, ids go in as int32.
INPUT_TYPES = {"int64": "int32", "int32": "int32", "float32": "float32", "float16": "float16"}


def shapes_arg(shapes) -> str:
    """model_transform.py --input_shapes: '[[1,1],[1,256]]' (no spaces, graph input order)."""
    return "[" + ",".join("[" + ",".join(str(int(d)) for d in s) + "]" for s in shapes) + "]"


def transform_command(name, onnx_path, inputs, test_input, test_result, mlir) -> list[str]:
    """model_transform.py: ONNX -> top MLIR, validated against onnxruntime on test_input.

    ``inputs`` is the graph's input list in ONNX order: dicts with shape and dtype.
    """
    types = []
    for spec in inputs:
        if spec["dtype"] not in INPUT_TYPES:
            raise NpuforgeError(
                f"graph input '{spec['name']}' has dtype {spec['dtype']}, which TPU-MLIR "
                f"cannot take: export {', '.join(INPUT_TYPES)} inputs"
            )
        types.append(INPUT_TYPES[spec["dtype"]])
    return [
        "model_transform.py",
        "--model_name",
        name,
        "--model_def",
        str(onnx_path),
        "--input_shapes",
        shapes_arg(spec["shape"] for spec in inputs),
        "--input_types",
        ",".join(types),
        "--test_input",
        str(test_input),
        "--test_result",
        str(test_result),
        "--mlir",
        str(mlir),
    ]


# run_calibration.py --cali_method choices (TPU-MLIR 1.30): how a tensor's INT8
# threshold is chosen from its histogram over the samples; kl is the tool's default.
CALIBRATION_METHODS = ("kl", "mse", "max", "percentile9999", "aciq_laplace", "aciq_gauss")


def calibration_command(mlir, data_list, samples, chip, table, method="kl") -> list[str]:
    """run_calibration.py: INT8 thresholds from .npz samples listed one per line."""
    return [
        "run_calibration.py",
        str(mlir),
        "--data_list",
        str(data_list),
        "--input_num",
        str(int(samples)),
        "--processor",
        chip,
        "--cali_method",
        method,
        "-o",
        str(table),
    ]


def deploy_command(
    mlir,
    quantize,
    chip,
    test_input,
    test_reference,
    tolerance,
    model,
    *,
    calibration_table=None,
    q_group_size=None,
    quantize_table=None,
) -> list[str]:
    """model_deploy.py: top MLIR -> bmodel; TPU-MLIR's similarity check gates it."""
    if quantize == "INT8" and not calibration_table:
        raise NpuforgeError("INT8 needs a calibration table: pass --calibration samples")
    cmd = ["model_deploy.py", "--mlir", str(mlir), "--quantize", quantize, "--processor", chip]
    if calibration_table:
        cmd += ["--calibration_table", str(calibration_table)]
    if quantize_table:
        cmd += ["--quantize_table", str(quantize_table)]
    if quantize.startswith("W4"):
        cmd += ["--q_group_size", str(int(q_group_size or DEFAULT_Q_GROUP_SIZE))]
    cmd += [
        "--test_input",
        str(test_input),
        "--test_reference",
        str(test_reference),
        "--tolerance",
        str(tolerance),
        "--model",
        str(model),
    ]
    return cmd


def combine_command(bmodels, out) -> list[str]:
    """model_tool --combine: several bmodels (one net each) -> one bmodel with all nets."""
    return ["model_tool", "--combine", *map(str, bmodels), "-o", str(out)]

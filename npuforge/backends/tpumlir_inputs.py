"""The inputs of a TPU-MLIR build: graph input shapes, the --test_input files that its
own similarity checks run on, and the INT8 calibration samples of each net."""

from pathlib import Path

from npuforge.errors import NpuforgeError

# Decode calls before the captured one when an export has no prefill net.
DECODE_WARMUP = 4


def graph_inputs(onnx_path) -> list[dict]:
    """The graph's real inputs in ONNX order (name, shape, dtype); shapes must be static."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    initializers = {init.name for init in model.graph.initializer}
    inputs = []
    for value in model.graph.input:
        if value.name in initializers:
            continue
        tensor = value.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
        if any(d is None or d <= 0 for d in dims):
            raise NpuforgeError(
                f"{onnx_path}: input '{value.name}' has a dynamic shape {dims}: TPU-MLIR "
                "bmodels are static, export with fixed shapes (tokens per call, batch)"
            )
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type).name
        inputs.append({"name": value.name, "shape": dims, "dtype": dtype})
    return inputs


def test_schedule(exports: dict) -> list:
    """The run whose feeds become each net's --test_input: two prefill calls (the second
    from the state the first left) and one decode call, or one prefill call when the KV
    cache cannot hold two; decode-only exports run ``DECODE_WARMUP`` decode calls first."""
    from npuforge.backends import base
    from npuforge.bundle_runner import context_limit

    if "prefill" not in exports:
        return base.verification_schedule(exports, DECODE_WARMUP + 1)
    tokens = exports["prefill"].tokens_per_call
    limit = context_limit(exports["prefill"].meta)
    calls = 2 if limit is None or limit > 2 * tokens else 1
    return base.verification_schedule(exports, calls * tokens + 1, calls)


def real_test_feeds(exports: dict, schedule, ids) -> dict:
    """Each net's feeds at its variant's last call of ``schedule`` over ``ids`` (held-out
    text), run by onnxruntime on the fp32 exports: real tokens, mask and position rows,
    the hidden state the chunk before hands on and the states a real run carries, so
    TPU-MLIR's own similarity checks see what a device sees. Returns
    ``{variant: {"position": p, "feeds": [{input name: array} per chunk]}}``."""
    import numpy as np

    from npuforge.backends import base

    captured = {variant: [None] * len(export.graphs) for variant, export in exports.items()}

    def capture(variant, chunk, feeds):
        captured[variant][chunk] = {k: np.array(v, copy=True) for k, v in feeds.items()}

    base.reference_logits(exports, schedule, ids, capture=capture)
    last = {call.variant: call.position for call in schedule}
    return {v: {"position": last[v], "feeds": feeds} for v, feeds in captured.items()}


def make_test_input(inputs, feeds: dict, path) -> dict:
    """Write the --test_input .npz from a real run's ``feeds``: keys are the graph's input
    names, values have the graph's exact shapes and dtypes."""
    import numpy as np

    arrays = {}
    for spec in inputs:
        if spec["name"] not in feeds:
            raise NpuforgeError(
                f"the graph takes '{spec['name']}', which the onnxruntime run did not feed: "
                "re-export the model"
            )
        value = np.asarray(feeds[spec["name"]])
        arrays[spec["name"]] = value.astype(spec["dtype"]).reshape(spec["shape"])
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as handle:
        np.savez(handle, **arrays)
    return {k: {"shape": list(v.shape), "dtype": v.dtype.name} for k, v in arrays.items()}


def _as_dirs(calibration_dirs) -> list[Path]:
    if not calibration_dirs:
        return []
    if isinstance(calibration_dirs, str | Path):
        return [Path(calibration_dirs)]
    return [Path(d) for d in calibration_dirs]


def calibration_samples(calibration_dirs, inputs) -> list[str]:
    """The .npz samples of each calibration directory whose keys and shapes fit this graph.

    Layout (docs/interfaces.md): <calibration>/chunk{i}/sample{j}.npz, keys = input
    names. The compile step gets one calibration directory per export; samples of
    another graph (decode samples when compiling prefill: other token count) are left
    out by shape.
    """
    import numpy as np

    wanted = {spec["name"]: tuple(spec["shape"]) for spec in inputs}
    found = [s for d in _as_dirs(calibration_dirs) for s in sorted(d.glob("chunk*/*.npz"))]
    chosen = []
    for sample in found:
        with np.load(sample) as data:
            shapes = {key: tuple(data[key].shape) for key in data.files}
        if shapes == wanted:
            chosen.append(str(sample.resolve()))
    return chosen


def state_path_ops(onnx_path, inputs: list[dict]) -> list[str]:
    """TPU-MLIR names ("<output>_<op type>") of every op on a path from a state input to
    its state output: the recurrence an unrolled prefill repeats once per token."""
    import onnx

    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    producer = {out: node for node in graph.node for out in node.output}
    consumers = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    on_path = set()
    for state in (i for i in inputs if i.get("role") == "state"):
        downstream, todo = set(), [state["name"]]
        while todo:
            for node in consumers.get(todo.pop(), []):
                fresh = [out for out in node.output if out not in downstream]
                downstream.update(fresh)
                todo.extend(fresh)
        upstream, todo = set(), [state["output"]]
        while todo:
            name = todo.pop()
            if name not in upstream:
                upstream.add(name)
                todo.extend(producer[name].input if name in producer else [])
        on_path |= downstream & upstream
    return sorted(f"{name}_{producer[name].op_type}" for name in on_path)


def _weight_matmuls(onnx_path):
    """(node, is a matmul with a weight operand) for every non-Constant node."""
    import onnx

    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    constants = {init.name for init in graph.initializer}
    constants |= {out for node in graph.node if node.op_type == "Constant" for out in node.output}
    for node in graph.node:
        if node.op_type == "Constant":
            continue
        weighted = node.op_type in ("MatMul", "Gemm") and any(i in constants for i in node.input)
        yield node, weighted


def _tpumlir_names(node) -> list[str]:
    return [f"{out}_{node.op_type}" for out in node.output]


def ops_but_weight_matmuls(onnx_path, also_named=()) -> list[str]:
    """TPU-MLIR names ("<output>_<op type>") of every op except the matmuls with a weight
    operand (MatMul/Gemm reading an initializer), and of those whose node name contains
    one of ``also_named``: the ops an INT8 build with only its weight matmuls in INT8
    keeps in another mode."""
    names = []
    for node, weighted in _weight_matmuls(onnx_path):
        if weighted and not any(part in node.name for part in also_named):
            continue
        names.extend(_tpumlir_names(node))
    return sorted(names)


def weight_matmuls_named(onnx_path, named) -> list[str]:
    """TPU-MLIR names of the matmuls with a weight operand whose node name contains one
    of ``named``."""
    names = []
    for node, weighted in _weight_matmuls(onnx_path):
        if weighted and any(part in node.name for part in named):
            names.extend(_tpumlir_names(node))
    return sorted(names)

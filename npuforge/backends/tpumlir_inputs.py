"""The inputs of a TPU-MLIR build: graph input shapes, the --test_input files that its
own similarity checks run on, and the INT8 calibration samples of each net."""

from pathlib import Path

from npuforge.errors import NpuforgeError

# Decode steps run on onnxruntime to give the test input realistic (non-zero) states.
WARMUP_STEPS = 4


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


def _roles(export) -> dict:
    return {spec["name"]: spec for spec in export.graphs[0]["inputs"]}


def warm_states(decode, inputs, seed: int) -> dict:
    """Recurrent states after a few decode steps from zero: realistic test values."""
    import numpy as np
    import onnxruntime as ort

    roles = _roles(decode)
    vocab = decode.meta["vocab_size"]
    session = ort.InferenceSession(
        str(decode.dir / decode.graphs[0]["file"]), providers=["CPUExecutionProvider"]
    )
    rng = np.random.default_rng(seed)
    feed = {spec["name"]: np.zeros(spec["shape"], dtype=spec["dtype"]) for spec in inputs}
    output_names = [o.name for o in session.get_outputs()]
    for _ in range(WARMUP_STEPS):
        for spec in inputs:
            if roles.get(spec["name"], {}).get("role") == "tokens":
                feed[spec["name"]] = rng.integers(0, vocab, spec["shape"]).astype(spec["dtype"])
        outputs = dict(zip(output_names, session.run(None, feed), strict=True))
        for spec in inputs:
            source = roles.get(spec["name"], {}).get("output")
            if source in outputs:
                feed[spec["name"]] = outputs[source].astype(spec["dtype"])
    return {
        name: value for name, value in feed.items() if roles.get(name, {}).get("role") == "state"
    }


def make_test_input(export, inputs, path, *, states=None, seed=0) -> dict:
    """Write the --test_input .npz: token ids in range, states warm (or zeros).

    Keys are the graph's input names, values have the graph's exact shapes and dtypes.
    """
    import numpy as np

    roles = _roles(export)
    rng = np.random.default_rng(seed)
    arrays = {}
    for spec in inputs:
        role = roles.get(spec["name"], {}).get("role")
        if role == "tokens":
            value = rng.integers(0, export.meta["vocab_size"], spec["shape"])
        elif states is not None and spec["name"] in states:
            value = states[spec["name"]]
        elif role == "state":
            value = np.zeros(spec["shape"])
        else:
            value = rng.standard_normal(spec["shape"]) * 0.1
        arrays[spec["name"]] = np.asarray(value).astype(spec["dtype"]).reshape(spec["shape"])
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
    """The .npz samples under each <calibration>/tpumlir/ whose keys and shapes fit this graph.

    Layout (docs/interfaces.md): one .npz per sample, keys = input names. The compile
    step gets one calibration directory per export; samples of another graph (decode
    samples when compiling prefill: other token count) are left out by shape.
    """
    import numpy as np

    wanted = {spec["name"]: tuple(spec["shape"]) for spec in inputs}
    found = [s for d in _as_dirs(calibration_dirs) for s in sorted((d / "tpumlir").rglob("*.npz"))]
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

"""Per-layer quantization error of a chunk's Q/DQ model against its fp32 graph, on the
onnxruntime CPU: the QNN job's counterpart of rknn-toolkit2's ``accuracy_analysis``.

Imported by qnn_job.py in the toolchain environment (numpy, onnx, onnxruntime; never
npuforge). For every compute node whose output the Q/DQ model keeps under the fp32
graph's name, on the chunk's fp32 inputs of each sample:

- ``entire``: the Q/DQ model run whole, so every earlier node of the chunk is quantized;
- ``single``: the node alone, fed the fp32 graph's values through the Q/DQ pairs the
  quantizer put on its inputs, its weights dequantized as quantized.

Graph optimisations are off, so the Q/DQ pairs are computed as written (fake
quantization in float, what the HTP's integer kernels approximate). Given a runner for
the HTP (``analyse(htp=...)``), also

- ``htp``: the whole Q/DQ model compiled for the HTP and run on its simulator, each value
  read through a second DequantizeLinear of its QuantizeLinear (``probe_model``): where
  the HTP's integer execution departs from the fake quantization.

Rows ``{op, tensor, entire_cosine, single_cosine[, htp_cosine]}`` in graph order, the
worst over the samples.
"""

import time
from pathlib import Path

from qnn_log import log

# The nodes a row is made for: the weighted products and the residual additions.
ROW_OPS = ("MatMul", "Gemm", "Conv", "Add")
QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")
PROGRESS_SECONDS = 10.0


def cosine(a, b) -> float:
    import numpy as np

    a = np.asarray(a, dtype=np.float64).ravel()
    b = np.asarray(b, dtype=np.float64).ravel()
    norms = float(np.linalg.norm(a) * np.linalg.norm(b))
    if norms == 0.0:
        return 1.0 if not a.any() and not b.any() else 0.0
    return float(a @ b / norms)


def _session(ort, model_or_path):
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    source = model_or_path if isinstance(model_or_path, str) else model_or_path.SerializeToString()
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def _with_outputs(model_path: str, names: list, out_path: Path) -> str:
    """``model_path`` saved at ``out_path`` with ``names`` as extra float outputs."""
    import onnx

    model = onnx.load(model_path)
    listed = {output.name for output in model.graph.output}
    for name in names:
        if name not in listed:
            model.graph.output.append(
                onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None)
            )
    onnx.save(model, str(out_path), save_as_external_data=True, location=out_path.name + ".data")
    return str(out_path)


def probe_model(qdq_path: str, names: list, out_path: Path) -> dict:
    """The Q/DQ model saved at ``out_path`` with each of ``names`` as an extra output the
    way its quantized unit computes it: a second DequantizeLinear of the QuantizeLinear
    that quantizes it. (The float value itself as an output would take its node out of
    its quantized unit, and the HTP would run that node in float.) Returns
    ``{name: output}``: a chunk output is its own; a value no QuantizeLinear reads, none.
    """
    import onnx

    model = onnx.load(qdq_path)
    graph = model.graph
    outputs = {output.name for output in graph.output}
    quantizers = {}
    for node in graph.node:
        if node.op_type == "QuantizeLinear":
            quantizers.setdefault(node.input[0], node)
    probes = {}
    for name in names:
        if name in outputs:
            probes[name] = name
            continue
        quantizer = quantizers.get(name)
        if quantizer is None:
            continue
        probe = f"probe/{name}"
        node = onnx.helper.make_node(
            "DequantizeLinear", [quantizer.output[0], *quantizer.input[1:3]], [probe], name=probe
        )
        node.attribute.extend(a for a in quantizer.attribute if a.name == "axis")
        graph.node.append(node)
        graph.output.append(onnx.helper.make_tensor_value_info(probe, onnx.TensorProto.FLOAT, None))
        probes[name] = probe
    onnx.save(model, str(out_path), save_as_external_data=True, location=out_path.name + ".data")
    return probes


def _run_all(ort, path: str, samples: list) -> list[dict]:
    return run_samples(_session(ort, path), samples)


def run_samples(session, samples: list) -> list[dict]:
    """Every output of ``session`` by name, once per sample (feeds it does not take are
    left out)."""
    names = [output.name for output in session.get_outputs()]
    wanted = {i.name for i in session.get_inputs()}
    runs = []
    for feeds in samples:
        values = session.run(names, {k: v for k, v in feeds.items() if k in wanted})
        runs.append(dict(zip(names, values, strict=True)))
    return runs


def node_alone(qdq, node, producers: dict, initializers: dict, fed: dict):
    """A model of ``node`` alone: its float inputs through their Q/DQ pairs, its weights'
    DequantizeLinear and their initializers. ``fed``: the fp32 graph's values by name
    (their dtypes type the model's inputs). None where an input comes from elsewhere."""
    import onnx

    taken, inits, inputs = set(), {}, []

    def take(name) -> bool:
        if not name:
            return True
        if name in initializers:
            inits[name] = initializers[name]
            return True
        producer = producers.get(name)
        if producer is not None and producer.op_type in QDQ_OPS:
            taken.add(id(producer))
            return all(take(i) for i in producer.input)
        if name in fed:  # a value of the fp32 graph: fed as it is there
            if name not in inputs:
                inputs.append(name)
            return True
        return False

    if not all(take(name) for name in node.input):
        return None

    def typed(name):
        elem = onnx.helper.np_dtype_to_tensor_dtype(fed[name].dtype)
        return onnx.helper.make_tensor_value_info(name, elem, None)

    graph = onnx.helper.make_graph(
        [n for n in qdq.graph.node if id(n) in taken] + [node],
        f"alone_{node.output[0]}",
        [typed(name) for name in inputs],
        [typed(node.output[0])],
        list(inits.values()),
    )
    model = onnx.helper.make_model(graph, opset_imports=list(qdq.opset_import))
    model.ir_version = qdq.ir_version
    return model, inputs


def analyse(float_path: str, qdq_path: str, samples: list, work: Path, htp=None) -> list[dict]:
    """Rows of the module docstring for one graph; ``samples``: fp32 input feeds (dicts).

    ``htp(model_path, samples)``: the model's outputs on the HTP per sample (dicts), or
    None for the CPU columns only.
    """
    import onnx
    import onnxruntime as ort

    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    qdq = onnx.load(qdq_path)
    float_graph = onnx.load(float_path, load_external_data=False).graph
    float_ops = {out: node.op_type for node in float_graph.node for out in node.output}
    float_names = set(float_ops) | {i.name for i in float_graph.input}
    outputs = {o.name for o in float_graph.output}

    def compared(node) -> bool:
        # The same op under the same name (a quantizer that fused a Relu into its MatMul
        # gives the MatMul the Relu's name); a chunk output is the DequantizeLinear's.
        op = float_ops.get(node.output[0])
        return op in ROW_OPS and (
            node.op_type == op or (node.op_type == "DequantizeLinear" and node.output[0] in outputs)
        )

    rows = [node for node in qdq.graph.node if compared(node)]
    names = [node.output[0] for node in rows]
    # The float values every node alone may read: anything its Q/DQ pairs quantize.
    quantized = [n.input[0] for n in qdq.graph.node if n.op_type == "QuantizeLinear"]
    quantized += [name for node in rows for name in node.input]
    wanted = sorted(
        (set(names) | set(quantized)) & (float_names - {i.name for i in float_graph.input})
    )
    reference = _run_all(ort, _with_outputs(float_path, wanted, work / "float.onnx"), samples)
    quantized_runs = _run_all(ort, _with_outputs(qdq_path, names, work / "qdq.onnx"), samples)
    for j, feeds in enumerate(samples):
        reference[j].update(feeds)
    probes, htp_runs = {}, None
    if htp is not None:
        probes = probe_model(qdq_path, names, work / "probe.onnx")
        log(f"layer error: the Q/DQ model with {len(probes)} probes on the HTP simulator")
        started = time.monotonic()
        htp_runs = htp(str(work / "probe.onnx"), samples)
        log(f"layer error: HTP runs in {time.monotonic() - started:.1f} s")
    producers = {out: n for n in qdq.graph.node for out in n.output}
    initializers = {init.name: init for init in qdq.graph.initializer}
    table, last = [], time.monotonic()
    for k, node in enumerate(rows):
        name = node.output[0]
        entire = min(
            cosine(ref[name], q[name]) for ref, q in zip(reference, quantized_runs, strict=True)
        )
        single = None
        alone = None
        if node.op_type != "DequantizeLinear":
            alone = node_alone(qdq, node, producers, initializers, reference[0])
        if alone is not None:
            model, inputs = alone
            session = _session(ort, model)
            single = min(
                cosine(ref[name], session.run([name], {i: ref[i] for i in inputs})[0])
                for ref in reference
            )
        row = {
            "op": float_ops[name],
            "tensor": name,
            "entire_cosine": entire,
            "single_cosine": single,
        }
        if htp_runs is not None:
            row["htp_cosine"] = (
                min(
                    cosine(ref[name], run[probes[name]])
                    for ref, run in zip(reference, htp_runs, strict=True)
                )
                if name in probes
                else None
            )
        table.append(row)
        if time.monotonic() - last >= PROGRESS_SECONDS:
            log(f"layer error: {k + 1} of {len(rows)} nodes")
            last = time.monotonic()
    return table

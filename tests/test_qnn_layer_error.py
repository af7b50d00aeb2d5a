"""The QNN job's per-layer error (npuforge/jobs/qnn_layer_error.py) against a numpy
fake quantization of the same Q/DQ model."""

import sys

import numpy as np
import onnx
import pytest
from conftest import REPO
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(REPO / "npuforge" / "jobs"))
import qnn_layer_error  # noqa: E402  (a job module: imported from its directory)


def _mlp(path, rng):
    """x -> MatMul -> Relu -> MatMul -> + x: two weighted products and a residual add."""
    w1 = rng.standard_normal((16, 32)).astype(np.float32)
    w2 = rng.standard_normal((32, 16)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w1"], ["h"]),
            helper.make_node("Relu", ["h"], ["r"]),
            helper.make_node("MatMul", ["r", "w2"], ["y0"]),
            helper.make_node("Add", ["y0", "x"], ["y"]),
        ],
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, path)
    return w1, w2


def _fake_quant(value, scale, zero, dtype):
    info = np.iinfo(dtype)
    steps = np.clip(np.rint(value / scale) + zero, info.min, info.max)
    return ((steps - zero) * scale).astype(np.float32)


def _quantized_mlp(tmp_path, seed, count):
    """float.onnx and its Q/DQ model qdq.onnx (8-bit, onnxruntime's quantizer, calibrated
    on the samples) in ``tmp_path``; returns the float weights and the samples."""
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    rng = np.random.default_rng(seed)
    weights = _mlp(tmp_path / "float.onnx", rng)
    samples = [{"x": rng.standard_normal((1, 16)).astype(np.float32)} for _ in range(count)]

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.feeds = iter(samples)

        def get_next(self):
            return next(self.feeds, None)

    quantize_static(
        str(tmp_path / "float.onnx"), str(tmp_path / "qdq.onnx"), Reader(),
        quant_format=QuantFormat.QDQ, activation_type=QuantType.QUInt8,
        weight_type=QuantType.QInt8, per_channel=True,
    )  # fmt: skip
    return weights, samples


def test_entire_and_single_are_the_qdq_models_fake_quantization(tmp_path):
    (float_w1, float_w2), samples = _quantized_mlp(tmp_path, seed=0, count=8)
    rows = qnn_layer_error.analyse(
        str(tmp_path / "float.onnx"), str(tmp_path / "qdq.onnx"), samples[:3], tmp_path / "work"
    )
    # The quantizer fused the Relu into the first MatMul, whose output took the Relu's
    # name: compared with nothing. The chunk's output is its DequantizeLinear's.
    assert [(r["op"], r["tensor"]) for r in rows] == [("MatMul", "y0"), ("Add", "y")]
    assert rows[1]["single_cosine"] is None

    qdq = onnx.load(tmp_path / "qdq.onnx")
    inits = {i.name: numpy_helper.to_array(i) for i in qdq.graph.initializer}
    by_input = {n.input[0]: n for n in qdq.graph.node}

    def activation(name, value):
        node = by_input[name]  # its QuantizeLinear
        zero = inits[node.input[2]]
        return _fake_quant(value, inits[node.input[1]], zero, zero.dtype)

    def weight(name):
        [dq] = [n for n in qdq.graph.node if n.op_type == "DequantizeLinear" and
                n.input[0].startswith(name + "_")]  # fmt: skip
        steps, scale, zero = (inits[i] for i in dq.input)
        return ((steps.astype(np.float32) - zero) * scale).astype(np.float32)

    w1, w2 = weight("w1"), weight("w2")
    singles, entires = [], []
    for feeds in samples[:3]:
        x = feeds["x"]
        r = np.maximum(x @ float_w1, 0)
        y0 = r @ float_w2
        # Alone: fp32 r through its Q/DQ pair, times the dequantized weights.
        singles.append(qnn_layer_error.cosine(y0, activation("r", r) @ w2))
        # Whole: x's pair, the first product (its Relu is the pair's clip at 0), r's pair.
        entires.append(qnn_layer_error.cosine(y0, activation("r", activation("x", x) @ w1) @ w2))
    assert rows[0]["single_cosine"] == pytest.approx(min(singles), abs=1e-6)
    assert rows[0]["entire_cosine"] == pytest.approx(min(entires), abs=1e-6)
    assert rows[0]["entire_cosine"] < rows[0]["single_cosine"] < 0.99999


def test_htp_column_reads_each_value_through_its_own_quantizer(tmp_path):
    """The HTP column's probes: run here on the CPU in place of the simulator, each
    product reads as its QuantizeLinear/DequantizeLinear pair leaves it, the chunk output
    as it is, and the probes leave the model's own outputs alone."""
    import onnxruntime as ort

    _, samples = _quantized_mlp(tmp_path, seed=1, count=6)
    seen = []

    def on_cpu(model_path, feeds):
        seen.append(model_path)
        session = qnn_layer_error._session(ort, model_path)
        names = [o.name for o in session.get_outputs()]
        return [dict(zip(names, session.run(names, f), strict=True)) for f in feeds]

    work = tmp_path / "work"
    rows = qnn_layer_error.analyse(
        str(tmp_path / "float.onnx"), str(tmp_path / "qdq.onnx"), samples[:3], work, htp=on_cpu
    )
    assert seen == [str(work / "probe.onnx")]
    probe_runs = on_cpu(seen[0], samples[:3])
    plain_runs = on_cpu(str(tmp_path / "qdq.onnx"), samples[:3])
    for probed, plain in zip(probe_runs, plain_runs, strict=True):
        assert set(probed) == {"y", "probe/y0"}
        np.testing.assert_array_equal(probed["y"], plain["y"])

    qdq = onnx.load(tmp_path / "qdq.onnx")
    inits = {i.name: numpy_helper.to_array(i) for i in qdq.graph.initializer}
    [quantizer] = [
        n for n in qdq.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == "y0"
    ]
    scale, zero = inits[quantizer.input[1]], inits[quantizer.input[2]]
    # analyse's own copies of both models, y0 among their outputs.
    float_session = qnn_layer_error._session(ort, str(work / "float.onnx"))
    qdq_session = qnn_layer_error._session(ort, str(work / "qdq.onnx"))
    expected = []
    for feeds, probed in zip(samples[:3], probe_runs, strict=True):
        y0 = float_session.run(["y0"], feeds)[0]
        rounded = _fake_quant(qdq_session.run(["y0"], feeds)[0], scale, zero, zero.dtype)
        np.testing.assert_allclose(probed["probe/y0"], rounded, atol=1e-6)
        expected.append(qnn_layer_error.cosine(y0, probed["probe/y0"]))
    assert rows[0]["htp_cosine"] == pytest.approx(min(expected), abs=1e-6)
    # The chunk output is read as it is: the same figure as the whole model's.
    assert rows[1]["htp_cosine"] == pytest.approx(rows[1]["entire_cosine"], abs=1e-9)
    # y0's own rounding on top of the error so far.
    assert rows[0]["htp_cosine"] < rows[0]["entire_cosine"]


def test_summary_carries_the_htp_column_beside_the_cpu_figures():
    from npuforge.backends import layer_error

    def row(tensor, entire, single, htp):
        return {"op": "MatMul", "tensor": tensor, "entire_cosine": entire,
                "single_cosine": single, "htp_cosine": htp}  # fmt: skip

    rows = [
        row("/layers.0/mlp/down_proj/MatMul_output_0", 0.999, 0.9995, 0.99),
        row("/layers.1/mlp/down_proj/MatMul_output_0", 0.998, 0.9990, 0.90),
        row("logits", 0.997, None, None),
    ]
    summary = layer_error.summarize([rows], [4])
    assert summary["htp_cosine_after_layer"] == [[0, 0.99], [1, 0.90]]
    assert summary["entire_cosine_after_layer"] == [[0, 0.999], [1, 0.998]]
    assert summary["htp_cosine_at_chunk_end"] == [None]
    # The kind whose HTP figure falls furthest below the fake quantization's comes first.
    assert summary["htp_departs_by_kind"] == {
        "/layers.N/mlp/down_proj/MatMul_output_0": {"layers": 2, "worst_gap": pytest.approx(0.098)}
    }
    lines = layer_error.report_lines(summary, "Q/DQ model")
    assert any(line.endswith("single 0.99900, entire 0.99800, htp 0.90000") for line in lines)
    assert (
        "  htp departs: /layers.N/mlp/down_proj/MatMul_output_0: entire - htp up to 0.09800 over 2"
        in lines
    )
    assert lines[-1] == "  htp cosine after each decoder layer: 0:0.9900 1:0.9000"
    # Without the column (RKNN, or QNN's CPU figures only) the summary has no htp keys.
    cpu_only = [{k: v for k, v in r.items() if k != "htp_cosine"} for r in rows]
    assert not [key for key in layer_error.summarize([cpu_only], [4]) if key.startswith("htp")]

"""How exactly the HTP computes products of two 16-bit activations, form by form.

For each product an attention graph makes (the KV cache write, the scores, probs @ v)
at prefill's shape (--rows tokens), builds the product in each form the passes can
emit, quantizes it as a16w8 does (uint16 activations, onnxruntime's quantize_static),
compiles it for SM8650's HTP and runs it on the simulator; prints, per form, the error
against fp32 relative to the largest output: on the HTP, as fake quantization on the
onnxruntime CPU, and with the second input cut to 8 bits per tensor in numpy.

    python bench/bench_htp_matmuls.py [--rows 16] [--work /tmp/npuforge-bench-htp-matmuls]
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

IN_TOOLCHAIN = r"""
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import numpy as np, onnx, onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import (CalibrationDataReader, QuantFormat, QuantType,
                                      quantize_static)
import qnn_layer_error, qnn_session
work, T = Path(sys.argv[2]), int(sys.argv[3])
L, D = 256, 64
rng = np.random.default_rng(0)

def write_operands():
    one_hot = np.zeros((L, T), np.float32)
    start = int(rng.integers(0, L - T))
    one_hot[start + np.arange(T), np.arange(T)] = 1
    return one_hot, (2 * rng.standard_normal((T, D))).astype(np.float32)

def scores_operands():
    return (rng.standard_normal((T, D)).astype(np.float32),
            (2 * rng.standard_normal((D, L))).astype(np.float32))

def probs_v_operands():
    logits = 2 * rng.standard_normal((T, L))
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs = (probs / probs.sum(1, keepdims=True)).astype(np.float32)
    return probs, (2 * rng.standard_normal((L, D))).astype(np.float32)

def forms(m, k, n):
    node = helper.make_node
    swap = [1, 0]
    return {
        "MatMul": ([node("MatMul", ["a", "b"], ["out"])], []),
        "swapped": ([node("Transpose", ["a"], ["a_t"], perm=swap),
                     node("Transpose", ["b"], ["b_t"], perm=swap),
                     node("MatMul", ["b_t", "a_t"], ["out_t"]),
                     node("Transpose", ["out_t"], ["out"], perm=swap)], []),
        "Mul+ReduceSum": ([node("Reshape", ["a", "a_shape"], ["a3"]),
                           node("Reshape", ["b", "b_shape"], ["b3"]),
                           node("Mul", ["a3", "b3"], ["terms"]),
                           node("ReduceSum", ["terms", "axis"], ["out"], keepdims=0)],
                          [numpy_helper.from_array(np.array([m, k, 1], np.int64), "a_shape"),
                           numpy_helper.from_array(np.array([1, k, n], np.int64), "b_shape"),
                           numpy_helper.from_array(np.array([1], np.int64), "axis")]),
    }

ort_qnn, devices, htp = qnn_session.register_qnn()
options = qnn_session.provider_options({"soc_model": 57, "htp_arch": 75, "precision": "a16w8"}, htp)
found = {}
for product, make in (("KV write", write_operands), ("scores", scores_operands),
                      ("probs @ v", probs_v_operands)):
    calibration = [dict(zip("ab", make())) for _ in range(32)]
    held_out = [dict(zip("ab", make())) for _ in range(3)]
    (m, k), n = calibration[0]["a"].shape, calibration[0]["b"].shape[1]
    for form, (nodes, constants) in forms(m, k, n).items():
        name = f"{product.replace(' ', '_').replace('@', 'x')}_{form.replace('+', '_')}"
        graph = helper.make_graph(nodes, name,
            [helper.make_tensor_value_info("a", TensorProto.FLOAT, [m, k]),
             helper.make_tensor_value_info("b", TensorProto.FLOAT, [k, n])],
            [helper.make_tensor_value_info("out", TensorProto.FLOAT, [m, n])],
            initializer=constants)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
        model.ir_version = 10
        onnx.save(model, work / f"{name}.onnx")
        class Reader(CalibrationDataReader):
            def __init__(self):
                self.feeds = iter(calibration)
            def get_next(self):
                return next(self.feeds, None)
        qdq, context = str(work / f"{name}_qdq.onnx"), str(work / f"{name}_ctx.onnx")
        quantize_static(str(work / f"{name}.onnx"), qdq, Reader(), quant_format=QuantFormat.QDQ,
                        activation_type=QuantType.QUInt16, weight_type=QuantType.QUInt8)
        qnn_session.generate_contexts(ort_qnn, devices, options, [(qdq, context)], share=False)
        sessions = {"htp": qnn_session.simulator_session(ort_qnn, devices, options, context),
                    "fake": qnn_layer_error._session(ort, qdq)}
        errors = {"htp": 0.0, "fake": 0.0, "b_8bit": 0.0}
        for feeds in held_out:
            exact = feeds["a"] @ feeds["b"]
            scale = np.abs(exact).max()
            step = (feeds["b"].max() - feeds["b"].min()) / 255
            cut = feeds["a"] @ (np.round(feeds["b"] / step) * step)
            errors["b_8bit"] = max(errors["b_8bit"], float(np.abs(cut - exact).max() / scale))
            for where, session in sessions.items():
                out = session.run(["out"], feeds)[0]
                errors[where] = max(errors[where], float(np.abs(out - exact).max() / scale))
        found[f"{product} | {form}"] = errors
print(json.dumps(found))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16, help="tokens of the prefill call")
    parser.add_argument("--work", default=None, help="keep the models here")
    parser.add_argument("--stamp", default=str(REPO / "results" / "toolchains" / "qnn-native.json"))
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from npuforge import toolchain

    stamp = toolchain.prepare("qnn", "native", args.stamp)
    work = Path(args.work or tempfile.mkdtemp(prefix="npuforge-bench-htp-matmuls-"))
    work.mkdir(parents=True, exist_ok=True)
    run = subprocess.run(
        [stamp["python"], "-c", IN_TOOLCHAIN, str(REPO / "npuforge" / "jobs"), str(work),
         str(args.rows)],
        capture_output=True, text=True, cwd=work,
    )  # fmt: skip
    if run.returncode != 0:
        print(run.stderr[-3000:], file=sys.stderr)
        return run.returncode
    found = json.loads(run.stdout.splitlines()[-1])
    print(f"SM8650 HTP simulator, a16w8 options, {args.rows} rows; error relative to max |out|")
    print(f"{'product | form':34} {'HTP':>9} {'fake':>9} {'b 8-bit':>9}")
    for key, errors in found.items():
        print(f"{key:34} {errors['htp']:9.5f} {errors['fake']:9.5f} {errors['b_8bit']:9.5f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Qualcomm HTP backend: capability rules, spec building, and real EP-route compiles.

The compile tests run the real QNN HTP compiler and x86 simulator from
onnxruntime-qnn (the toolchain from envs/qnn/, built once per lock into
results/toolchains/) on a tiny 2-chunk RWKV-shaped graph.
"""

import json
import math
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import qnn_fixtures
import yaml
from conftest import script_env

from npuforge.backends import base, gate, qnn, qnn_spec
from npuforge.errors import NpuforgeError
from npuforge.fileio import sha256_file
from npuforge.jobs import job_stage, qnn_graph, qnn_quantizer

REPO = Path(__file__).resolve().parents[1]
SM8650 = qnn.Options(htp_arch=75, soc_model=57, vtcm_mb=8, verify_steps=32)
SM8550 = qnn.Options(htp_arch=73, soc_model=43, vtcm_mb=8, verify_steps=32)


def qnn_options(**fields) -> qnn.Options:
    return qnn.Options(**{"soc_model": 0, **fields})


# --------------------------------------------------------------------------- pure rules


def test_plan_chunks_keeps_each_context_under_budget():
    assert qnn.plan_chunks(450_000_000, "fp16") == 1  # 0.9 GB of fp16 weights
    assert qnn.plan_chunks(1_600_000_000, "fp16") == 3  # 3.2 GB
    assert qnn.plan_chunks(1_600_000_000, "a16w8") == 2
    assert qnn.plan_chunks(1_600_000_000, "a16w4") == 1
    assert qnn.plan_chunks(7_000_000_000, "a16w4") == 3
    assert qnn.plan_chunks(10, "fp16") == 1
    for n_params in (1e8, 1.6e9, 7e9):
        for precision in qnn.PRECISIONS:
            chunks = qnn.plan_chunks(int(n_params), precision)
            per_chunk = n_params * qnn.BYTES_PER_PARAM[precision] / chunks
            assert per_chunk <= qnn.CONTEXT_WEIGHT_BUDGET < 2 * 1024**3
    with pytest.raises(NpuforgeError):
        qnn.plan_chunks(10, "int8")


def test_v68_refuses_fp16_in_one_line_naming_soc_and_support():
    problem = qnn.precision_problem("SM8350", qnn_options(htp_arch=68, soc_model=30), "fp16")
    assert problem is not None and "\n" not in problem
    assert "SM8350" in problem and "v68" in problem and "a16w8" in problem
    assert qnn.precision_problem("SM8350", qnn_options(htp_arch=68), "a16w8") is None
    assert "v73" in qnn.precision_problem("SM8475", qnn_options(htp_arch=69), "a16w4")
    assert qnn.precision_problem("SM8650", SM8650, "a16w4") is None
    assert qnn.supported_precisions(68) == ["a16w8"]
    assert qnn.supported_precisions(69) == ["fp16", "a16w8"]
    assert qnn.supported_precisions(79) == ["fp16", "a16w8", "a16w4"]


def test_registry_qnn_targets_match_the_sdk_soc_table_and_htp_capabilities():
    targets = yaml.safe_load((REPO / "config" / "targets.yaml").read_text())
    qnn_targets = {k: v for k, v in targets.items() if v["backend"] == "qnn"}
    assert {"SM8650", "SM8550", "SM8750", "SC8380", "SM8475", "SM8350"} <= set(qnn_targets)
    for target_id, target in qnn_targets.items():
        options = target["options"]
        assert (options["soc_model"], options["htp_arch"]) == qnn.SOC_MODELS[target_id]
        allowed = qnn.supported_precisions(options["htp_arch"])
        assert set(target["precisions"]) <= set(allowed), target_id


def test_check_target_rejects_a_wrong_soc_model():
    with pytest.raises(NpuforgeError, match="43/73"):
        qnn.check_target("SM8550", qnn_options(htp_arch=73, soc_model=57), ["fp16"])


def test_unavailable_reason_ep_route_here_and_sdk_route_without_sdk(monkeypatch):
    monkeypatch.delenv("QNN_SDK_ROOT", raising=False)
    monkeypatch.delenv(qnn.ROUTE_ENV, raising=False)
    assert qnn.unavailable_reason("native", SM8650) is None
    reason = qnn.unavailable_reason("native", replace(SM8650, route="sdk"))
    assert reason and "QNN_SDK_ROOT" in reason and "\n" not in reason
    monkeypatch.setenv(qnn.ROUTE_ENV, "sdk")
    assert "QNN_SDK_ROOT" in qnn.unavailable_reason("native", SM8650)
    monkeypatch.setenv(qnn.ROUTE_ENV, "cloud")
    assert "unknown QNN route" in qnn.unavailable_reason("native", SM8650)


def test_verification_figures():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((32, 50)).astype(np.float32)
    next_ids = ref.argmax(-1)  # text the reference predicts well
    same = gate.fidelity(ref, ref.copy(), next_ids)
    assert same["cosine"] == pytest.approx(1.0) and same["top1_agreement"] == 1.0
    assert same["max_abs_rel"] == 0.0 and same["positions"] == 32
    assert same["perplexity"]["delta"] == 0.0 and same["perplexity"]["positions"] == 32
    assert same["top1_misses"] == []
    noisy = ref + 0.1 * rng.standard_normal(ref.shape).astype(np.float32)
    figures = gate.fidelity(ref, noisy, next_ids)
    assert 0.98 < figures["cosine"] < 0.999
    flipped = gate.fidelity(ref, -ref, next_ids)
    assert flipped["cosine"] == pytest.approx(-1.0) and flipped["top1_agreement"] < 0.2
    assert flipped["perplexity"]["delta"] > 1.0
    missed = [m["position"] for m in flipped["top1_misses"]]
    assert missed == [i for i in range(32) if (-ref[i]).argmax() != ref[i].argmax()]
    assert all(m["fp32_margin"] > 0 for m in flipped["top1_misses"])
    assert flipped["worst_cosine_position"] in range(32)
    broken = ref.copy()
    broken[3, 7] = np.nan
    assert gate.fidelity(ref, broken)["nan_inf"] == 1


def test_calibration_listing(tmp_path):
    from npuforge.calibration_formats import LAYOUT

    chunk = tmp_path / "chunk1"
    chunk.mkdir(parents=True)
    inputs = [{"name": "hidden_in"}, {"name": "state"}]
    record = {"layout": LAYOUT, "chunks": [{"index": 1, "inputs": inputs, "npz": []}]}
    record["chunks"][0]["npz"] = ["chunk1/sample0.npz", "chunk1/sample1.npz"]
    for name in record["chunks"][0]["npz"]:
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "calibration.json").write_text(json.dumps(record))
    samples = qnn_spec.calibration_samples(tmp_path, 1)
    first = str(chunk / "sample0.npz")
    assert samples == [
        {"hidden_in": first, "state": first},
        {"hidden_in": first[:-5] + "1.npz", "state": first[:-5] + "1.npz"},
    ]
    # A chunk the directory has no samples of, and a sample gone: one line naming the fix.
    with pytest.raises(NpuforgeError, match="make_calibration_samples") as refused:
        qnn_spec.calibration_samples(tmp_path, 0)
    assert "\n" not in str(refused.value)
    (chunk / "sample1.npz").unlink()
    with pytest.raises(NpuforgeError, match="sample1.npz is missing.*make_calibration_samples"):
        qnn_spec.calibration_samples(tmp_path, 1)
    # A directory of the old three-format layout names no .npz per chunk.
    old = {"chunks": [{"index": 1, "inputs": inputs, "qnn": {"input_list": "qnn/chunk1/x"}}]}
    (tmp_path / "calibration.json").write_text(json.dumps(old))
    with pytest.raises(NpuforgeError, match="older npuforge.*rerun make_calibration_samples"):
        qnn_spec.calibration_samples(tmp_path, 1)


def test_sensitive_overrides_keep_norms_decay_and_state_at_16_bit(tmp_path):
    import onnx

    export = qnn_fixtures.make_export(tmp_path / "export", chunks=2)
    model = onnx.load(export / "chunk1.onnx")
    overrides, norms = qnn_graph.sensitive_overrides(
        model, ["state_1_wkv", "state_1_wkv_out", "not_in_graph"], "U16"
    )
    assert norms == ["ln1_b", "ln1_w", "ln_out_b", "ln_out_w"]
    assert {"decay1", "ln1_w", "state_1_wkv", "state_1_wkv_out"} <= set(overrides)
    assert not {"wk1", "wo1", "head", "not_in_graph"} & set(overrides)
    assert all(value == [{"quant_type": "U16"}] for value in overrides.values())


def test_max_scaled_norm_ranges_bound_the_fp16_safe_llama_norms_on_any_row(tmp_path):
    import math

    import onnx
    import onnxruntime as ort

    from npuforge.models.llama import onnx_export as llama_export
    from npuforge.models.llama import weights as llama_weights
    from npuforge.runtime import GraphChain

    embed = 32
    dims = dict(layers=2, embed=embed, heads=4, kv_heads=2, vocab=50, intermediate=48)
    llama_weights.write_synthetic_checkpoint(tmp_path / "ckpt", seed=3, arch="llama", **dims)
    found = {}
    for fixes in (True, False):
        llama_export.export_llama(
            tmp_path / "ckpt",
            tmp_path / f"x{fixes}",
            variant="decode",
            tokens=1,
            cache_len=8,
            sha=True,
            ext_embedding=True,
            fp16_fixes=fixes,
        )
        model = onnx.load(tmp_path / f"x{fixes}" / "chunk0.onnx")
        found[fixes] = qnn_graph.max_scaled_norm_ranges(model)
    assert found[False] == {}
    ranges = found[True]
    root = math.sqrt(embed)
    # Seven bounded tensors in each of the 2 * layers + 1 norms.
    assert len(ranges) == 7 * 5
    assert set(ranges.values()) == {
        (-1.0, 1.0),
        (0.0, 1.0),
        (0.0, 2.0),
        (0.0, math.sqrt(2.0)),
        (0.0, root),
        (-root, root),
    }

    # The bounds hold on rows calibration text rarely shows: flat (mean of y*y = 1),
    # one spike (rms = max / sqrt(n)), tiny, and massive.
    model = onnx.load(tmp_path / "xTrue" / "chunk0.onnx")
    for name in sorted(ranges):
        model.graph.output.append(onnx.helper.make_tensor_value_info(name, 1, None))
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    captured = {}
    chain = GraphChain(tmp_path / "xTrue", capture=lambda _, feeds: captured.update(feeds))
    chain.step(np.array([[3]]))
    spike = np.full(embed, 1e-3, np.float32)
    spike[5] = 3e4
    rows = [
        np.ones(embed, np.float32),
        spike,
        np.full(embed, 1e-7, np.float32),
        np.random.default_rng(0).normal(0, 2e4, embed).astype(np.float32),
    ]
    extremes = {name: [] for name in ranges}
    for row in rows:
        feeds = {**captured, "embedding": row.reshape(1, 1, embed)}
        values = dict(zip(sorted(ranges), session.run(sorted(ranges), feeds), strict=True))
        for name, (low, high) in ranges.items():
            assert low - 1e-5 <= values[name].min() and values[name].max() <= high + 1e-5, name
            extremes[name] += [values[name].min(), values[name].max()]
    # ... and the flat and spiked rows reach them: the ranges are tight, not just safe.
    first = "/model/layers.0/input_layernorm/"
    assert max(extremes[first + "ReduceMean_output_0"]) == pytest.approx(1.0, rel=1e-5)
    assert max(extremes[first + "Div_2_output_0"]) == pytest.approx(root, rel=1e-3)


def test_squares_become_mul_and_their_exponents_go():
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    two = helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])
    three = helper.make_tensor("three", TensorProto.FLOAT, [], [3.0])
    graph = helper.make_graph(
        [
            helper.make_node("Constant", [], ["exponent"], value=two),
            helper.make_node("Pow", ["x", "exponent"], ["square"], name="square"),
            helper.make_node("Pow", ["x", "three"], ["cube"], name="cube"),
            helper.make_node("Add", ["square", "cube"], ["y"]),
        ],
        "squares",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [6])],
        [three],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    x = np.array([-3.0, -1.5, -1e-3, 0.0, 0.5, 2.0], np.float32)
    want = x**2 + x**3

    assert qnn_graph.squares_to_mul(model) == ["square"]
    ops = [n.op_type for n in model.graph.node]
    # Only the square changes; the cube keeps its exponent, the unused Constant is gone.
    assert ops == ["Mul", "Pow", "Add"]
    assert list(model.graph.node[0].input) == ["x", "x"]
    onnx.checker.check_model(model)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(["y"], {"x": x})[0], want, rtol=1e-6)


def test_residual_branches_get_ranges_covering_their_stream():
    """Only a projection's output added to an activation is a residual branch: a bias add,
    a sum of two activation products and an add of a constant are not."""
    from onnx import TensorProto, helper

    def weight(name):
        return helper.make_tensor(name, TensorProto.FLOAT, [4, 4], [0.1] * 16)

    bias = helper.make_tensor("bias", TensorProto.FLOAT, [4], [0.5] * 4)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w_o"], ["attn"]),
            helper.make_node("Add", ["x", "attn"], ["h"]),
            helper.make_node("MatMul", ["h", "w_down"], ["mlp"]),
            helper.make_node("Add", ["mlp", "h"], ["out"]),
            helper.make_node("MatMul", ["out", "w_b"], ["pre_bias"]),
            helper.make_node("Add", ["pre_bias", "bias"], ["biased"]),
            helper.make_node("MatMul", ["out", "out_t"], ["scores"]),
            helper.make_node("Add", ["scores", "out"], ["not_residual"]),
        ],
        "residual",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 4]),
            helper.make_tensor_value_info("out_t", TensorProto.FLOAT, [4, 4]),
        ],
        [helper.make_tensor_value_info("not_residual", TensorProto.FLOAT, [4, 4])],
        [weight("w_o"), weight("w_down"), weight("w_b"), bias],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    pairs = qnn_graph.residual_branches(model)
    assert pairs == [("x", "attn"), ("h", "mlp")]

    def span(lo, hi):
        return {"rmin": np.float32(lo), "rmax": np.float32(hi)}

    ranges = {"x": span(-10, 40), "attn": span(-1, 2), "h": span(-3, 5), "mlp": span(-60, 1)}
    covered = qnn_graph.ranges_covering_stream(ranges, pairs)
    # The branch reaches as far as its stream on both sides; its own wider side stays.
    assert {k: (float(v["rmin"]), float(v["rmax"])) for k, v in covered.items()} == {
        "attn": (-40.0, 40.0),
        "mlp": (-60.0, 5.0),
    }


def test_row_matmuls_of_two_activations_become_mul_reducesum():
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), "w")
    graph = helper.make_graph(
        [
            # r @ state (RWKV's wkv read-out): one row, two activations -> rewritten
            helper.make_node("MatMul", ["r", "state"], ["read"], name="read"),
            # an activation times a weight matrix stays a MatMul
            helper.make_node("MatMul", ["read", "w"], ["proj"], name="proj"),
            # two rows: not a single-row product, stays a MatMul
            helper.make_node("MatMul", ["rows", "state"], ["both"], name="both"),
            # an input of no known shape (reshaped to a runtime shape): left alone, and named
            helper.make_node("Reshape", ["r", "runtime_shape"], ["unknown"], name="unknown"),
            helper.make_node("MatMul", ["unknown", "state"], ["blind"], name="blind"),
        ],
        "g",
        [
            helper.make_tensor_value_info("r", TensorProto.FLOAT, [1, 4, 1, 8]),
            helper.make_tensor_value_info("state", TensorProto.FLOAT, [1, 4, 8, 8]),
            helper.make_tensor_value_info("rows", TensorProto.FLOAT, [1, 4, 2, 8]),
            helper.make_tensor_value_info("runtime_shape", TensorProto.INT64, ["rank"]),
        ],
        [
            helper.make_tensor_value_info("proj", TensorProto.FLOAT, [1, 4, 1, 8]),
            helper.make_tensor_value_info("both", TensorProto.FLOAT, [1, 4, 2, 8]),
            helper.make_tensor_value_info("blind", TensorProto.FLOAT, [None] * 4),
        ],
        [weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    original = model.SerializeToString()
    assert qnn_graph.row_matmuls_to_mul_reducesum(model) == (["read"], ["blind"])
    onnx.checker.check_model(model)
    ops = [node.op_type for node in model.graph.node]
    assert ops == ["Transpose", "Mul", "ReduceSum", "MatMul", "MatMul", "Reshape", "MatMul"]
    feeds = {
        "r": rng.standard_normal((1, 4, 1, 8)).astype(np.float32),
        "state": rng.standard_normal((1, 4, 8, 8)).astype(np.float32),
        "rows": rng.standard_normal((1, 4, 2, 8)).astype(np.float32),
        "runtime_shape": np.array([1, 4, 1, 8], np.int64),
    }
    cpu = ["CPUExecutionProvider"]
    before = ort.InferenceSession(original, providers=cpu).run(None, feeds)
    after = ort.InferenceSession(model.SerializeToString(), providers=cpu).run(None, feeds)
    for a, b in zip(before, after, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_calibrated_bounds_snap_outward_onto_a_grid_their_last_bits_cannot_move():
    snap, bits = qnn_quantizer.snap_outward, qnn_quantizer.RANGE_BITS
    rng = np.random.default_rng(0)
    values = rng.standard_normal(3000) * 10.0 ** rng.integers(-15, 6, 3000)
    for value in [0.0, 1.0, -0.5, 15.0, *values.astype(np.float32).tolist()]:
        low, high = snap(value, up=False), snap(value, up=True)
        assert low <= value <= high
        # At most one step of bits significant bits outward: under 1/8 of |value| at 4.
        assert high - low <= abs(value) * 2.0 ** (1 - bits)
        for bound in (low, high):
            assert float(np.float32(bound)) == bound
            assert (math.frexp(abs(bound))[0] * 2**bits).is_integer()
            assert snap(bound, up=False) == bound == snap(bound, up=True)
        # A bound off the grid keeps its snapped value when its last bit moves.
        if low < value < high:
            for moved in (np.nextafter(np.float32(value), np.float32(np.inf)),
                          np.nextafter(np.float32(value), np.float32(-np.inf))):  # fmt: skip
                moved = float(moved)
                if low < moved < high:
                    assert (snap(moved, up=False), snap(moved, up=True)) == (low, high)


def test_the_quantizer_runs_on_the_onnxruntime_its_lock_pins():
    # Its replacements of onnxruntime's private quantizer functions were written for
    # that version: a lock bumped alone must fail here, not change models silently.
    lock = (REPO / "envs" / "qnn" / "requirements.lock").read_text().splitlines()
    assert f"onnxruntime=={qnn_quantizer.ONNXRUNTIME_VERSION}" in lock
    assert qnn_quantizer.onnxruntime_problem(qnn_quantizer.ONNXRUNTIME_VERSION) is None


def test_another_onnxruntime_is_refused_in_one_line_before_any_patching(monkeypatch):
    import onnxruntime
    from onnxruntime.quantization import quant_utils

    lookup = quant_utils.find_by_name
    monkeypatch.setattr(onnxruntime, "__version__", "1.32.0")
    with pytest.raises(RuntimeError) as err:
        qnn_quantizer._quantizer_without_quadratic_scans()
    message = str(err.value)
    assert "\n" not in message and "onnxruntime 1.32.0" in message
    assert f"onnxruntime=={qnn_quantizer.ONNXRUNTIME_VERSION} in envs/qnn/requirements.lock" in (
        message
    )
    assert quant_utils.find_by_name is lookup


def test_spec_roles_and_ctx_names(tmp_path):
    decode_dir = qnn_fixtures.make_export(tmp_path / "decode", chunks=2)
    prefill_dir = qnn_fixtures.make_export(
        tmp_path / "prefill", chunks=2, variant="prefill", tokens=4
    )
    exports = base.load_exports([prefill_dir, decode_dir], "qnn")
    assert list(exports) == ["decode", "prefill"]
    tokens = list(range(33))
    schedule = base.verification_schedule(exports, 32)
    calls = base.write_call_feeds(exports, schedule, tokens, tmp_path)
    # One 4-token prefill call, then decode calls up to 32 tokens.
    assert [(c["variant"], c["position"]) for c in calls] == [("prefill", 0)] + [
        ("decode", p) for p in range(4, 32)
    ]
    table = np.fromfile(decode_dir / "embedding.bin", dtype="<f4", offset=32).reshape(-1, 64)
    with np.load(calls[0]["feeds"]) as first, np.load(calls[1]["feeds"]) as second:
        assert sorted(first) == ["chunk0/embedding"]
        np.testing.assert_array_equal(first["chunk0/embedding"], table[None, 0:4])
        np.testing.assert_array_equal(second["chunk0/embedding"], table[None, 4:5])
    spec = qnn_spec.build_spec(exports, {}, SM8650, "fp16", tmp_path / "o", tmp_path / "w", calls)
    assert spec["soc_model"] == 57 and spec["htp_arch"] == 75
    files = [[g["ctx_file"] for g in chunk["graphs"]] for chunk in spec["chunks"]]
    assert files == [
        ["chunk0_ctx.onnx", "chunk0_prefill_ctx.onnx"],
        ["chunk1_ctx.onnx", "chunk1_prefill_ctx.onnx"],
    ]
    assert spec["chunks"][1]["keep_16bit_tensors"] == ["state_1_wkv", "state_1_wkv_out"]
    assert spec["verify"]["steps"] == 29 and spec["verify"]["calls"] == calls
    chains = spec["verify"]["chains"]
    assert sorted(chains) == ["decode", "prefill"]
    assert [c["ctx_file"] for c in chains["prefill"]] == [
        "chunk0_prefill_ctx.onnx",
        "chunk1_prefill_ctx.onnx",
    ]
    with pytest.raises(NpuforgeError, match="raise verify_steps"):
        base.verification_schedule(exports, 4)
    with pytest.raises(NpuforgeError, match="no decode export"):
        base.load_exports([prefill_dir], "qnn")


def test_verification_calls_time_each_variant(tmp_path):
    """The simulator's time per variant, per call and per token (the CPU standing in for
    the HTP): where verification time goes decides how many tokens a call covers."""
    import onnxruntime as ort
    import qnn_session

    exports = base.load_exports(
        [
            qnn_fixtures.make_export(tmp_path / "decode", chunks=2),
            qnn_fixtures.make_export(tmp_path / "prefill", chunks=2, variant="prefill", tokens=4),
        ],
        "qnn",
    )
    schedule = base.verification_schedule(exports, 16)
    calls = base.write_call_feeds(exports, schedule, list(range(17)), tmp_path)
    spec = qnn_spec.build_spec(exports, {}, SM8650, "fp16", tmp_path / "o", tmp_path / "w", calls)
    chains = spec["verify"]["chains"]
    sessions = {
        v: [ort.InferenceSession(c["source"]) for c in chain] for v, chain in chains.items()
    }
    seconds = {}
    out = qnn_session.run_calls(sessions, chains, calls, seconds=seconds)
    assert sorted(seconds) == ["decode", "prefill"] and all(t > 0 for t in seconds.values())
    assert {len(rows) for rows in out.values()} == {16}  # 4 prefill rows, then 12 decode rows
    line = qnn.simulator_time_line(
        {
            "simulator_seconds": 30.0,
            "simulator_seconds_by_variant": {"decode": 24.0, "prefill": 6.0},
        },
        schedule,
    )
    assert line == (
        "simulator verification: 30.0 s: decode 12 calls of 12 tokens 24.0 s (2.00 s per call, "
        "2.00 s per token); prefill 1 call of 4 tokens 6.0 s (6.00 s per call, 1.50 s per token)"
    )


def test_spec_quantizes_each_variant_with_its_own_samples(tmp_path):
    from npuforge.calibration import calibrations_by_variant, make_calibration_samples

    exports = {
        "decode": qnn_fixtures.make_export(tmp_path / "decode", chunks=2),
        "prefill": qnn_fixtures.make_export(
            tmp_path / "prefill", chunks=2, variant="prefill", tokens=4
        ),
    }
    for variant, export in exports.items():
        make_calibration_samples(export, tmp_path / f"cal-{variant}", samples=3, steps=8, seed=0)
    both = base.load_exports([exports["decode"], exports["prefill"]], "qnn")
    args = (SM8650, "a16w8", tmp_path / "o", tmp_path / "w", [])
    only_decode = calibrations_by_variant([tmp_path / "cal-decode"])
    with pytest.raises(NpuforgeError, match="needs prefill calibration samples") as refused:
        qnn_spec.build_spec(both, only_decode, *args)
    assert "\n" not in str(refused.value) and str(exports["prefill"]) in str(refused.value)
    # Without a prefill export the decode samples are all a quantized build needs.
    decode_only = {"decode": both["decode"]}
    spec = qnn_spec.build_spec(decode_only, only_decode, *args)
    assert spec["chunks"][1]["graphs"][0]["calibration"]

    paired = calibrations_by_variant([tmp_path / "cal-prefill", tmp_path / "cal-decode"])
    spec = qnn_spec.build_spec(both, paired, *args)
    for chunk in spec["chunks"]:
        assert [g["variant"] for g in chunk["graphs"]] == ["decode", "prefill"]
        for graph in chunk["graphs"]:
            folder = tmp_path / f"cal-{graph['variant']}" / f"chunk{chunk['index']}"
            assert len(graph["calibration"]) == 3
            for sample in graph["calibration"]:
                assert sorted(sample) == sorted(i["name"] for i in graph["inputs"])
                for item in graph["inputs"]:
                    path = Path(sample[item["name"]])
                    assert path.parent == folder.resolve()
                    # The graph's own shape: [1, 4, 64] for prefill inputs.
                    with np.load(path) as data:
                        assert data[item["name"]].shape == tuple(item["shape"])


def test_cli_refuses_fp16_on_v68_before_any_job(tmp_path):
    export = qnn_fixtures.make_export(tmp_path / "export", chunks=1)
    run = subprocess.run(
        [
            sys.executable,
            str(REPO / "workflow_scripts" / "compile.py"),
            "--backend",
            "qnn",
            "--export",
            str(export),
            "--target",
            "SM8350",
            "--target-options",
            json.dumps({"htp_arch": 68, "soc_model": 30}),
            "--precision",
            "fp16",
            "--toolchain",
            str(tmp_path / "missing.json"),
            "--out-dir",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=script_env(),
    )
    assert run.returncode == 2
    assert run.stderr.count("\n") == 1 and "SM8350" in run.stderr and "a16w8" in run.stderr
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- real compiles


@pytest.fixture(scope="module")
def qnn_stamp():
    from npuforge import toolchain

    reason = toolchain.unavailable_reason("qnn", "native", SM8650)
    if reason:
        pytest.skip(f"QNN EP toolchain unavailable here: {reason}")
    stamp = REPO / "results" / "toolchains" / "qnn-native.json"
    try:
        toolchain.prepare("qnn", "native", stamp)
    except NpuforgeError as err:
        if os.environ.get("CI"):
            raise  # CI installs from the lock: a broken lock must fail there
        pytest.skip(f"could not build the QNN toolchain from envs/qnn/requirements.lock: {err}")
    return stamp


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("qnn")
    export = qnn_fixtures.make_export(root / "export", chunks=2)
    calibration = qnn_fixtures.make_calibration(export, root / "calibration")
    return {"root": root, "export": export, "calibration": calibration}


def _compile(workspace, stamp, name, options, precision, prefill=None):
    exports = [workspace["export"]] + ([prefill] if prefill else [])
    calibration = workspace["calibration"] if precision in qnn_spec.QUANTIZED else None
    out = workspace["root"] / name
    manifest = compile_qnn(exports, calibration, name.split("-")[0], options, precision, stamp, out)
    assert json.loads((out / "compile.json").read_text()) == manifest
    return out, manifest


def compile_qnn(exports, calibrations, target, options, precision, stamp, out, **request):
    """qnn.compile with the request built from the arguments the compile CLI takes."""
    if calibrations is not None and not isinstance(calibrations, list):
        calibrations = [calibrations]
    return qnn.compile(
        base.CompileRequest(
            exports=exports,
            calibrations=calibrations or [],
            target=target,
            options=options,
            precision=precision,
            toolchain=stamp,
            out_dir=out,
            weights="synthetic",
            **request,
        )
    )


@pytest.fixture(scope="module")
def sm8650_fp16(qnn_stamp, workspace):
    return _compile(workspace, qnn_stamp, "SM8650-fp16", SM8650, "fp16")


@pytest.mark.toolchain
def test_fp16_context_binaries_verified_on_the_simulator(sm8650_fp16):
    out, manifest = sm8650_fp16
    assert manifest["backend"] == "qnn" and manifest["target"] == "SM8650"
    binaries = [a for a in manifest["artifacts"] if a["role"] == "binary"]
    contexts = [a for a in manifest["artifacts"] if a["role"] == "ep_context"]
    assert [a["file"] for a in binaries] == ["chunk0_ctx_qnn.bin", "chunk1_ctx_qnn.bin"]
    assert [a["file"] for a in contexts] == ["chunk0_ctx.onnx", "chunk1_ctx.onnx"]
    for artifact in manifest["artifacts"]:
        assert sha256_file(out / artifact["file"]) == artifact["sha256"]
    assert manifest["qairt"]["version"].startswith("2.51.0.")
    assert manifest["qairt"]["version"].encode() in (out / "chunk0_ctx_qnn.bin").read_bytes()
    assert manifest["toolchain"]["versions"]["onnxruntime-qnn"] == "2.7.0"
    figures = manifest["verification"]
    assert figures["positions"] == 32 and figures["nan_inf"] == 0
    assert figures["cosine"] >= 0.9999 and figures["top1_agreement"] == 1.0
    assert figures["passed"]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["compile.json"] + [a["file"] for a in manifest["artifacts"]]
    )


@pytest.mark.toolchain
def test_rebuild_in_place_is_byte_identical(sm8650_fp16, qnn_stamp, workspace, monkeypatch):
    # QAIRT 2.51 writes uninitialised heap bytes into padding of fp16 constants:
    # only the job's pinned heap (MALLOC_PERTURB_, no tcache, a fixed mmap
    # threshold, no ASLR, fixed PYTHONHASHSEED) and prepare-only generation make
    # them repeat. Same place: the heap history depends on path lengths.
    first, manifest = sm8650_fp16
    assert manifest["reproducible"] is True
    assert manifest["options"]["generation_options"] == {"enable_htp_prepare_only": "1"}
    assert all(h["aslr_disabled"] and h["tcache_disabled"] for h in manifest["options"]["heap"])
    assert {h["mmap_threshold"] for h in manifest["options"]["heap"]} == {"131072"}
    assert {h["fixed_clock"] for h in manifest["options"]["heap"]} == {job_stage.FIXED_CLOCK}
    assert {(h["cpus"], h["malloc_arenas"]) for h in manifest["options"]["heap"]} == {(1, "1")}
    assert all(h["ort_telemetry_off"] for h in manifest["options"]["heap"])
    before = {a["file"]: (first / a["file"]).read_bytes() for a in manifest["artifacts"]}
    # Rebuilt as on a machine with one CPU: QAIRT's prepare threads sized by the CPUs
    # allowed wrote other bytes (2 vs 1 CPU) until the job pinned itself to one.
    # The rebuild is killed in its second chunk and run again: only that chunk's job
    # and the simulator's run again; the bytes are those of the one-go build.
    from npuforge import toolchain as toolchains

    real_run_job, ran = toolchains.run_job, []

    def run_job(stamp, script, spec_path, **kwargs):
        spec = json.loads(Path(spec_path).read_text())
        job = [c["index"] for c in spec["chunks"]] or "simulator"
        if job == [1] and "killed" not in ran:
            ran.append("killed")
            raise NpuforgeError("qnn job failed in the native toolchain: killed (signal 9)")
        ran.append(job)
        return real_run_job(stamp, script, spec_path, **kwargs)

    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})
    monkeypatch.setattr(toolchains, "run_job", run_job)
    try:
        with pytest.raises(NpuforgeError, match="signal 9"):
            _compile(workspace, qnn_stamp, "SM8650-fp16", SM8650, "fp16")
        again, rebuilt = _compile(workspace, qnn_stamp, "SM8650-fp16", SM8650, "fp16")
    finally:
        os.sched_setaffinity(0, allowed)
    assert ran == [[0], "killed", [1], "simulator"]
    assert not list(first.parent.glob(".SM8650-fp16.finished-chunks"))
    assert again == first
    for name, data in before.items():
        assert (again / name).read_bytes() == data, name
    assert rebuilt["artifacts"] == manifest["artifacts"]


def test_only_the_ep_route_compiles_chunk_by_chunk(monkeypatch):
    # The sdk route (the QNN SDK's own tools) builds every chunk in the compile.
    monkeypatch.delenv(qnn.ROUTE_ENV, raising=False)
    assert qnn.compiles_by_chunk({}) and qnn.compiles_by_chunk({"route": "ep"})
    assert not qnn.compiles_by_chunk({"route": "sdk"})
    monkeypatch.setenv(qnn.ROUTE_ENV, "sdk")
    assert not qnn.compiles_by_chunk({"route": "ep"})


@pytest.mark.toolchain
def test_chunk_jobs_staged_elsewhere_give_the_one_go_bytes(
    sm8650_fp16, qnn_stamp, workspace, tmp_path, monkeypatch
):
    # The workflow's compile_chunk jobs: each chunk's contexts built alone at another
    # path, then the compile takes them back by their keys and runs only the simulator.
    from npuforge import toolchain as toolchains

    first, manifest = sm8650_fp16
    real_run_job, ran = toolchains.run_job, []

    def run_job(stamp, script, spec_path, **kwargs):
        spec = json.loads(Path(spec_path).read_text())
        ran.append([c["index"] for c in spec["chunks"]] or "simulator")
        return real_run_job(stamp, script, spec_path, **kwargs)

    monkeypatch.setattr(toolchains, "run_job", run_job)
    export = [workspace["export"]]
    built = []
    for chunk in (1, 0):
        out = tmp_path / f"compile-chunks-at-a-longer-path-than-the-compile/{chunk}"
        record = compile_qnn(export, None, "SM8650", SM8650, "fp16", qnn_stamp, out,
                             only_chunk=chunk)  # fmt: skip
        assert sorted(p.name for p in out.iterdir()) == ["chunk.json", qnn.CHUNK_STORE]
        assert [p.name for p in (out / qnn.CHUNK_STORE).iterdir()] == [record["key"]]
        assert not list(out.parent.glob(".*"))  # no work directory or store left beside
        built.insert(0, out)
    assert ran == [[1], [0]]
    out = tmp_path / "SM8650-fp16"
    rebuilt = compile_qnn(export, None, "SM8650", SM8650, "fp16", qnn_stamp, out,
                          chunk_builds=built)  # fmt: skip
    assert ran == [[1], [0], "simulator"]
    assert rebuilt["artifacts"] == manifest["artifacts"]
    for artifact in manifest["artifacts"]:
        name = artifact["file"]
        assert (out / name).read_bytes() == (first / name).read_bytes(), name
    assert rebuilt["verification"] == manifest["verification"]
    with pytest.raises(NpuforgeError, match=r"^chunk 2 of an export in 2 chunks: pass "
                       r"--only-chunk 0 to 1$"):  # fmt: skip
        compile_qnn(export, None, "SM8650", SM8650, "fp16", qnn_stamp, tmp_path / "c2",
                    only_chunk=2)  # fmt: skip
    assert not (tmp_path / "c2").exists()


CLOCK_PROBE = """
import json, os, subprocess, sys, time
sys.path.insert(0, sys.argv[1])
import job_stage

stage = sys.argv[2]
python = job_stage.staged_python(stage)
env = job_stage.fixed_environment(stage, job_stage.fixed_clock(stage))
probe = "import time; print(time.time(), time.monotonic(), time.monotonic())"
reads = []
for _ in range(2):
    reads.append(subprocess.run([python, "-c", probe], env=env, capture_output=True, text=True,
                                check=True).stdout.split())
    time.sleep(1.5)
print(json.dumps(reads))
"""


@pytest.mark.toolchain
def test_context_generation_runs_on_a_counting_clock(qnn_stamp, tmp_path):
    # QAIRT's context bytes follow the elapsed times it reads: the staged process's
    # clock must count reads from a fixed start, whatever the real clock says.
    python = json.loads(qnn_stamp.read_text())["python"]
    jobs = REPO / "npuforge" / "jobs"
    run = subprocess.run(
        [python, "-c", CLOCK_PROBE, str(jobs), str(tmp_path / "stage")],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    first, second = json.loads(run.stdout)
    assert first == second  # 1.5 s of real time apart
    wall, mono, mono_again = map(float, first)
    assert 946684800 <= wall < 946684801  # 2000-01-01 00:00:00 UTC
    assert 0 < mono_again - mono < 0.01


TELEMETRY_PROBE = """
import os, subprocess, sys
sys.path.insert(0, sys.argv[1])
import job_stage

stage, model = sys.argv[2], sys.argv[3]
python = job_stage.staged_python(stage)
probe = ("import onnxruntime as ort, sys; "
         "ort.InferenceSession(sys.argv[1]).run(None, {'x': [[1.0]]})")
for env in ({"HOME": stage}, job_stage.fixed_environment(stage, {})):
    subprocess.run([python, "-c", probe, model], env=env, check=True)
    print(os.path.isdir(os.path.join(stage, ".cache", "Microsoft")), flush=True)
    subprocess.run(["rm", "-rf", os.path.join(stage, ".cache")], check=True)
"""


@pytest.mark.toolchain
def test_a_staged_process_runs_onnx_runtime_without_its_telemetry(qnn_stamp, tmp_path):
    # onnxruntime's telemetry thread keeps state under $HOME and allocated beside
    # QAIRT's serialiser; the staged environment must turn it off.
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1])],
    )
    model = tmp_path / "relu.onnx"
    onnx.save(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), model
    )
    python = json.loads(qnn_stamp.read_text())["python"]
    jobs = REPO / "npuforge" / "jobs"
    run = subprocess.run(
        [python, "-c", TELEMETRY_PROBE, str(jobs), str(tmp_path / "stage"), str(model)],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    # Telemetry on (a bare $HOME) leaves its database; the staged environment does not.
    assert run.stdout.split() == ["True", "False"]


@pytest.fixture(scope="module")
def wide_head_export(tmp_path_factory):
    """A 1-layer RWKV-7 with a 128 x 65536 head: big fp16 constants, whose HVX padding
    QAIRT leaves uninitialised (the toy fixture's graphs are too small to show it)."""
    from npuforge import models
    from npuforge.models.rwkv.synthetic import write_synthetic_checkpoint

    root = tmp_path_factory.mktemp("wide")
    write_synthetic_checkpoint(
        root / "c.pth", version=7, layers=1, embed=128, vocab=65536, head_size=64, seed=0
    )
    export = root / "export"
    options = {"variant": "decode", "chunks": 1, "dtype": "fp32", "ext_embedding": True}
    models.export("rwkv", root / "c.pth", export, options)
    return export


@pytest.mark.toolchain
def test_rebuild_elsewhere_is_byte_identical(wide_head_export, qnn_stamp, tmp_path, monkeypatch):
    # Each chunk compiles from a fixed-path stage with a fixed environment. Before,
    # this copy at a longer path (and a larger environment) gave another .bin.
    import shutil

    first = tmp_path / "a"
    manifest = compile_qnn([wide_head_export], None, "SM8650", SM8650, "fp16", qnn_stamp, first)
    assert manifest["reproducible"] is True
    assert set(manifest["options"]["site_packages"]) <= {"hard-linked", "symlinked"}
    elsewhere = tmp_path / "a-checkout-at-a-much-longer-path-than-the-first-one"
    shutil.copytree(wide_head_export, elsewhere / "export")
    monkeypatch.setenv("NPUFORGE_UNRELATED", "x" * 3000)
    out = elsewhere / "SM8650-fp16"
    rebuilt = compile_qnn([elsewhere / "export"], None, "SM8650", SM8650, "fp16", qnn_stamp, out)
    assert rebuilt["artifacts"] == manifest["artifacts"]
    for artifact in manifest["artifacts"]:
        name = artifact["file"]
        assert (out / name).read_bytes() == (first / name).read_bytes(), name


@pytest.mark.toolchain
def test_each_soc_gets_its_own_verified_binary(sm8650_fp16, qnn_stamp, workspace):
    first, manifest = sm8650_fp16
    other, sm8550 = _compile(workspace, qnn_stamp, "SM8550-fp16", SM8550, "fp16")
    assert sm8550["verification"]["cosine"] >= 0.9999
    shas = {a["sha256"] for a in manifest["artifacts"] if a["role"] == "binary"}
    assert not shas & {a["sha256"] for a in sm8550["artifacts"] if a["role"] == "binary"}


@pytest.mark.toolchain
def test_a16w8_qdq_compile_is_smaller_and_verified(sm8650_fp16, qnn_stamp, workspace):
    out, manifest = _compile(
        workspace, qnn_stamp, "SM8650-a16w8", replace(SM8650, layer_error=2), "a16w8"
    )
    # The analysis runs after the Q/DQ model is written and the compiling process never
    # sees it: the same binaries without it.
    _, plain = _compile(workspace, qnn_stamp, "SM8650-a16w8plain", SM8650, "a16w8")
    assert "layer_error" not in plain
    assert [a["sha256"] for a in plain["artifacts"]] == [a["sha256"] for a in manifest["artifacts"]]
    # The per-layer error of each chunk's Q/DQ model: int8 weights lose something in
    # every weighted product, and the error grows along the chunk.
    errors = manifest["layer_error"]
    assert errors["held_out_steps"] == [8, 24] and len(errors["chunks"]) == 2
    for table in errors["chunks"]:
        products = [row for row in table if row["op"] == "MatMul" and row["single_cosine"]]
        assert products and all(0.9 < row["single_cosine"] < 1.0 for row in products)
        assert min(row["entire_cosine"] for row in table) < 1.0
        # The HTP simulator read at every product, through its own quantizer: it rounds too.
        assert all(0.9 < row["htp_cosine"] < 1.0 for row in products)
    assert len(errors["htp_cosine_at_chunk_end"]) == 2
    assert "layer_error" not in manifest["options"]["chunks"][0]["quantization"]["decode"]
    figures = manifest["verification"]
    assert figures["positions"] == 32 and figures["nan_inf"] == 0 and figures["cosine"] >= 0.999
    chunk = manifest["options"]["chunks"][1]["quantization"]["decode"]
    assert chunk["weight_type"] == "int8" and chunk["activation_type"] == "uint16"
    assert {"ln1_w", "decay1", "state_1_wkv"} <= set(chunk["kept_16bit"])
    fp16_bytes = sum(a["bytes"] for a in sm8650_fp16[1]["artifacts"] if a["role"] == "binary")
    q_bytes = sum(a["bytes"] for a in manifest["artifacts"] if a["role"] == "binary")
    assert q_bytes < fp16_bytes


@pytest.mark.toolchain
def test_a16w8_decode_and_prefill_calibrated_by_their_own_runs(qnn_stamp, workspace):
    from npuforge.calibration import make_calibration_samples

    root = workspace["root"]
    prefill = qnn_fixtures.make_export(
        root / "prefill-a16w8", chunks=2, variant="prefill", tokens=4
    )
    calibrations = []
    for name, export in (("decode", workspace["export"]), ("prefill", prefill)):
        calibrations.append(root / f"calibration-{name}")
        make_calibration_samples(export, calibrations[-1], samples=16, steps=16, seed=0)
    out = root / "SM8650-a16w8-prefill"
    manifest = compile_qnn(
        [workspace["export"], prefill], calibrations, "SM8650", SM8650, "a16w8", qnn_stamp, out
    )
    figures = manifest["verification"]
    assert figures["passed"] and figures["nan_inf"] == 0 and figures["cosine"] >= 0.999
    assert figures["calls"] == {"decode": 28, "prefill": 1}
    assert sorted(manifest["options"]["calibration"]) == ["decode", "prefill"]
    assert manifest["options"]["calibration"]["prefill"]["tokens_per_call"] == 4
    # Its ranges are snapped (bytes hold across instruction sets): no host is recorded.
    assert "hosts" not in manifest["options"]["calibration"]["prefill"]
    for chunk in manifest["options"]["chunks"]:
        assert chunk["weight_sharing"]["one_context"]
        for variant in ("decode", "prefill"):
            quantization = chunk["quantization"][variant]
            assert quantization["samples"] == 16 and quantization["weight_type"] == "int8"
    assert (out / "chunk1_prefill_ctx.onnx").is_file()


@pytest.mark.toolchain
def test_prefill_and_decode_share_one_context(qnn_stamp, workspace):
    prefill = qnn_fixtures.make_export(
        workspace["root"] / "prefill", chunks=2, variant="prefill", tokens=4
    )
    out, manifest = _compile(
        workspace,
        qnn_stamp,
        "SM8750-shared",
        replace(SM8650, htp_arch=79, soc_model=69),
        "fp16",
        prefill=prefill,
    )
    for chunk in manifest["options"]["chunks"]:
        sharing = chunk["weight_sharing"]
        assert sharing["one_context"] and sharing["graphs"] == ["decode", "prefill"]
    binaries = [a["file"] for a in manifest["artifacts"] if a["role"] == "binary"]
    assert binaries == ["chunk0_ctx_qnn.bin", "chunk1_ctx_qnn.bin"]
    import onnx

    node = onnx.load(out / "chunk1_prefill_ctx.onnx").graph.node[0]
    cache = next(a.s.decode() for a in node.attribute if a.name == "ep_cache_context")
    assert node.op_type == "EPContext" and cache == "chunk1_ctx_qnn.bin"


QUANTIZE_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
import qnn_quantizer
args = json.loads(sys.argv[2])
if args.pop("plain", False):
    qnn_quantizer._quantizer_without_quadratic_scans = lambda: None
if args.pop("unsnapped", False):
    qnn_quantizer._snap_measured = lambda measured: None
if args.pop("calibrate_twice", False):
    once = qnn_quantizer._quantize
    qnn_quantizer._quantize = lambda model, target, config, measured, work: once(
        model, target, config, None, work)
reads = []
sample_reader = qnn_quantizer._sample_reader
def counting_reader(samples, inputs):
    reader = sample_reader(samples, inputs)
    class Counting:
        def get_next(self):
            feed = reader.get_next()
            reads.append(feed is not None)
            return feed
        def rewind(self):
            reader.rewind()
    return Counting()
qnn_quantizer._sample_reader = counting_reader
qnn_quantizer.quantize_graph(**args)
import onnxruntime.quantization.onnx_model as m
print(m.ONNXModel.replace_input_of_all_nodes.__qualname__)
print("samples read:", sum(reads))
"""


WIDE_WEIGHTS_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
import onnx, qnn_quantizer
args = json.loads(sys.argv[2])
record = qnn_quantizer.quantize_graph(**args)
model = onnx.load(args["target"])
types = {i.name: i.data_type for i in model.graph.initializer}
weights = {n.input[0]: types[n.input[0]] for n in model.graph.node
           if n.op_type == "DequantizeLinear" and n.input[0] in types}
print(json.dumps({"record": record["weights_16bit"], "weights": weights}))
"""


@pytest.mark.toolchain
def test_weights_16bit_patterns_give_the_named_matrices_int16(qnn_stamp, workspace, tmp_path):
    import onnx

    python = json.loads(qnn_stamp.read_text())["python"]
    graph = json.loads((workspace["export"] / "export.json").read_text())["graphs"][1]
    args = {
        "source": str(workspace["export"] / graph["file"]),
        "target": str(tmp_path / "qdq.onnx"),
        "precision": "a16w8",
        "samples": qnn_spec.calibration_samples(workspace["calibration"], 1),
        "inputs": graph["inputs"],
        "keep_16bit_tensors": [],
        "weights_16bit": ["^wo"],
    }
    run = subprocess.run(
        [python, "-c", WIDE_WEIGHTS_SCRIPT, str(REPO / "npuforge" / "jobs"), json.dumps(args)],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    found = json.loads(run.stdout.splitlines()[-1])
    side = qnn_fixtures.EMBED
    assert found["record"] == {
        "patterns": ["^wo"],
        "tensors": ["wo1"],
        "parameters": side * side,
        "of_parameters": 2 * side * side + side * qnn_fixtures.VOCAB,
    }
    by_matrix = {name.split("_")[0]: dtype for name, dtype in found["weights"].items()}
    assert by_matrix["wo1"] == onnx.TensorProto.INT16
    assert by_matrix["wk1"] == by_matrix["head"] == onnx.TensorProto.INT8


# Compiles args["target"] for SM8650, runs it on the HTP simulator and args["source"] on
# the CPU over the last sample: a (HTP) and b (fp32), flattened.
HTP_AND_FP32_SCRIPT = """
ort, devices, htp = qnn_session.register_qnn()
options = qnn_session.provider_options({"soc_model": 57, "htp_arch": 75, "precision": "a16w4"}, htp)
context = args["target"].replace("qdq.onnx", "ctx.onnx")
qnn_session.generate_contexts(ort, devices, options, [(args["target"], context)], share=False)
htp_run = qnn_session.simulator_session(ort, devices, options, context)
fp32 = qnn_session.cpu_session(ort, args["source"])
feed = {"x": np.load(args["samples"][-1]["x"])["x"]}
a, b = htp_run.run(None, feed)[0].ravel(), fp32.run(None, feed)[0].ravel()
"""

CONV_KERNEL_SCRIPT = (
    """
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import onnx, qnn_quantizer, qnn_session
from onnx import numpy_helper
args = json.loads(sys.argv[2])
record = qnn_quantizer.quantize_graph(**args)
model = onnx.load(args["target"])
values = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
(dq,) = [n for n in model.graph.node if n.input and n.input[0] == "kernel_quantized"]
found = {
    "record": record["weights_16bit"],
    "type": int(next(i.data_type for i in model.graph.initializer if i.name == dq.input[0])),
    "axis": next(a.i for a in dq.attribute if a.name == "axis"),
    "scales": int(values[dq.input[1]].size),
}
"""
    + HTP_AND_FP32_SCRIPT
    + """
found["cosine"] = float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))
print(json.dumps(found))
"""
)


def _save_with_samples(path, name, nodes, weights, rng, x=(1, 4, 64), y=(1, 4, 16)) -> list:
    """Save the graph ``nodes`` (input x, output y, of those shapes) with initializers
    ``weights`` ({name: array}) at ``path``; return 4 calibration samples of x."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(y))],
        [numpy_helper.from_array(v.astype(np.float32), k) for k, v in weights.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, str(path))
    samples = []
    for i in range(4):
        sample = path.parent / f"sample{i}.npz"
        np.savez(sample, x=rng.standard_normal(x).astype(np.float32))
        samples.append({"x": str(sample)})
    return samples


def _conv_graph(path):
    """x [1, 64, 2, 2] through a 1x1 Conv with 16 output channels, each row of its
    kernel on a scale of its own (what a per-output-channel quantizer must see)."""
    from onnx import helper

    rng = np.random.default_rng(3)
    kernel = rng.normal(0, 1, (16, 64, 1, 1)) * rng.uniform(0.01, 0.2, (16, 1, 1, 1))
    nodes = [helper.make_node("Conv", ["x", "kernel"], ["y"], name="conv")]
    shapes = {"x": (1, 64, 2, 2), "y": (1, 16, 2, 2)}
    return _save_with_samples(path, "conv", nodes, {"kernel": kernel}, rng, **shapes)


@pytest.mark.toolchain
@pytest.mark.parametrize("weights_16bit", [[], ["^kernel$"]])
def test_a_conv_kernel_is_quantized_per_output_channel_and_runs_on_the_htp(
    qnn_stamp, tmp_path, weights_16bit
):
    """A Conv kernel's output channels are its axis 0 (a MatMul weight's are axis 1):
    a16w4 quantizes it per output channel, int4 or (named by weights_16bit) int16, and
    the HTP takes the Conv. Per input channel, as every weight was before, the QNN EP
    refused the Conv and the context could not be generated."""
    import onnx

    python = json.loads(qnn_stamp.read_text())["python"]
    samples = _conv_graph(tmp_path / "f32.onnx")
    args = {
        "source": str(tmp_path / "f32.onnx"),
        "target": str(tmp_path / "qdq.onnx"),
        "precision": "a16w4",
        "samples": samples,
        "inputs": [{"name": "x", "shape": [1, 64, 2, 2], "dtype": "float32"}],
        "keep_16bit_tensors": [],
        "weights_16bit": weights_16bit,
    }
    run = subprocess.run(
        [python, "-c", CONV_KERNEL_SCRIPT, str(REPO / "npuforge" / "jobs"), json.dumps(args)],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    found = json.loads(run.stdout.splitlines()[-1])
    assert found["axis"] == 0 and found["scales"] == 16
    assert found["record"]["of_parameters"] == 16 * 64
    if weights_16bit:
        assert found["type"] == onnx.TensorProto.INT16 and found["record"]["tensors"] == ["kernel"]
        assert found["cosine"] >= 0.9999
    else:
        assert found["type"] == onnx.TensorProto.INT4 and found["record"]["tensors"] == []
        assert found["cosine"] >= 0.99


BLOCKS_SCRIPT = (
    """
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import onnx, qnn_quantizer, qnn_session
from onnx import numpy_helper
args = json.loads(sys.argv[2])
record = qnn_quantizer.quantize_graph(**args)
model = onnx.load(args["target"])
values = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
weight = sys.argv[3] + "_quantized"
(dq,) = [n for n in model.graph.node if n.input and n.input[0] == weight]
attributes = {a.name: a.i for a in dq.attribute}
q, scale = values[weight].astype(np.float64), values[dq.input[1]]
types = {i.name: i.data_type for i in model.graph.initializer}
if "block_size" in attributes:
    scale = np.repeat(scale, attributes["block_size"], axis=0)
found = {
    "record": {k: record[k] for k in ("weight_granularity", "weights_in_blocks")},
    "side": record["weights_16bit"]["tensors"],
    "eight": record["weights_8bit"]["tensors"],
    "type": types[weight],
    "attributes": attributes,
    "scales": list(values[dq.input[1]].shape),
    "zero_points": np.unique(values[dq.input[2]].astype(np.int32)).tolist(),
    "dequantized": (q * scale).ravel().tolist(),
}
"""
    + HTP_AND_FP32_SCRIPT
    + """
found["htp_error"] = float(np.linalg.norm(a - b) / np.linalg.norm(b))
print(json.dumps(found))
"""
)


def _blocks_in_toolchain(python, tmp_path, samples, weight_name, **options) -> dict:
    """Quantize tmp_path/f32.onnx for a16w4 with ``options`` by BLOCKS_SCRIPT in the
    toolchain's Python; what it found about ``weight_name``."""
    args = {
        "source": str(tmp_path / "f32.onnx"),
        "target": str(tmp_path / "qdq.onnx"),
        "precision": "a16w4",
        "samples": samples,
        "inputs": [{"name": "x", "shape": [1, 4, 64], "dtype": "float32"}],
        "keep_16bit_tensors": [],
        **options,
    }
    jobs = str(REPO / "npuforge" / "jobs")
    run = subprocess.run(
        [python, "-c", BLOCKS_SCRIPT, jobs, json.dumps(args), weight_name],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.splitlines()[-1])


def _centred_block_graph(path):
    """x [1, 4, 64] @ w [64, 16], whose every block of 32 inputs per column lies on a
    centred 16-level grid (what export option block_centres makes of a Q4_1 checkpoint),
    plus a side matmul of the split."""
    from onnx import helper

    rng = np.random.default_rng(3)
    steps = rng.integers(0, 16, (2, 32, 16))
    steps[:, 0], steps[:, 1] = 0, 15  # Q4_1 blocks span their 16 levels
    weight = (rng.uniform(0.005, 0.03, (2, 1, 16)) * (steps - 8)).reshape(64, 16)
    side = rng.normal(0, 0.02, (64, 16))
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["main"]),
        helper.make_node("MatMul", ["x", "m.group_offsets.weight_t"], ["offsets"]),
        helper.make_node("Add", ["main", "offsets"], ["y"]),
    ]
    weights = {"w": weight, "m.group_offsets.weight_t": side}
    return weight, _save_with_samples(path, "centred_blocks", nodes, weights, rng)


@pytest.mark.toolchain
@pytest.mark.parametrize("block", [32, None])
def test_a16w4_weights_in_blocks_keep_a_centred_4bit_grid_exactly_on_the_htp(
    qnn_stamp, tmp_path, block
):
    """With weight_block_size, A16W4's int4 MatMul weights take a float scale per block
    of inputs and output column (DequantizeLinear block_size, zero point 0): a weight
    whose blocks lie on centred 4-bit grids dequantizes exactly, and the HTP simulator
    runs it as block quantization. Per output channel, onnxruntime's one scale per column
    moves it. A group split's side matmul is int16."""
    import onnx

    python = json.loads(qnn_stamp.read_text())["python"]
    weight, samples = _centred_block_graph(tmp_path / "f32.onnx")
    found = _blocks_in_toolchain(python, tmp_path, samples, "w", weight_block_size=block)
    assert found["side"] == ["m.group_offsets.weight_t"]
    assert found["type"] == onnx.TensorProto.INT4 and found["eight"] == []
    error = np.abs(np.array(found["dequantized"]) - weight.ravel()).max() / np.abs(weight).max()
    if block:
        assert found["record"] == {
            "weight_granularity": "int4 in blocks of 32 inputs per output channel",
            "weights_in_blocks": 1,
        }
        assert found["attributes"] == {"axis": 0, "block_size": 32}
        assert found["scales"] == [2, 16] and found["zero_points"] == [0]
        assert error < 1e-6 and found["htp_error"] < 0.005
    else:
        assert found["record"]["weights_in_blocks"] == 0 and found["scales"] == [16]
        assert error > 0.01


def _q8_0_graph(path):
    """x [1, 4, 64] @ lm_head.weight_t [64, 16] whose every block of 32 inputs per
    column is GGUF Q8_0: steps -127..127 (the block's largest |w| at 127) times a scale
    of its own, which differs 30-fold between blocks."""
    from onnx import helper

    rng = np.random.default_rng(5)
    steps = rng.integers(-127, 128, (2, 32, 16))
    steps[:, 0] = np.where(rng.random((2, 16)) < 0.5, -127, 127)
    scales = rng.uniform(0.0003, 0.009, (2, 1, 16)).astype(np.float16).astype(np.float64)
    weight = (scales * steps).reshape(64, 16)
    nodes = [helper.make_node("MatMul", ["x", "lm_head.weight_t"], ["y"])]
    samples = _save_with_samples(path, "q8_0_blocks", nodes, {"lm_head.weight_t": weight}, rng)
    return weight.astype(np.float32), samples


@pytest.mark.toolchain
@pytest.mark.parametrize("block", [32, None])
def test_a16w4_weights_named_8bit_keep_a_q8_0_grid_exactly_in_blocks_on_the_htp(
    qnn_stamp, tmp_path, block
):
    """weights_8bit makes the A16W4 weights it names int8; with weight_block_size they
    take a scale per block of inputs (max |w| / 127, zero point 0), so a Q8_0 weight
    (an lm_head tied to a Q8_0 embedding) dequantizes exactly and runs on the HTP
    simulator. Per output channel, one scale per column moves its small blocks."""
    import onnx

    python = json.loads(qnn_stamp.read_text())["python"]
    weight, samples = _q8_0_graph(tmp_path / "f32.onnx")
    found = _blocks_in_toolchain(
        python,
        tmp_path,
        samples,
        "lm_head.weight_t",
        weight_block_size=block,
        weights_8bit=["lm_head"],
    )
    assert found["type"] == onnx.TensorProto.INT8 and found["eight"] == ["lm_head.weight_t"]
    dequantized = np.array(found["dequantized"]).reshape(64, 16)
    # The worst error within each block, relative to the block's largest |w|.
    blocks = np.abs(dequantized - weight).reshape(2, 32, 16).max(1)
    error = (blocks / np.abs(weight).reshape(2, 32, 16).max(1)).max()
    if block:
        assert found["record"] == {
            "weight_granularity": "int4 and int8 in blocks of 32 inputs per output channel",
            "weights_in_blocks": 1,
        }
        assert found["attributes"] == {"axis": 0, "block_size": 32}
        assert found["scales"] == [2, 16] and found["zero_points"] == [0]
        assert error < 1e-6 and found["htp_error"] < 0.005
    else:
        assert found["record"]["weights_in_blocks"] == 0 and found["scales"] == [16]
        assert error > 0.01


@pytest.mark.parametrize("block", [12, 0, -8])
def test_a_weight_block_size_the_htp_cannot_take_is_refused(block):
    options = replace(SM8650, weight_block_size=block)
    with pytest.raises(NpuforgeError, match=f"weight_block_size {block} is not a positive") as err:
        qnn.check_target("SM8650", options, ["a16w4"])
    assert "\n" not in str(err.value)
    qnn.check_target("SM8650", replace(SM8650, weight_block_size=32), ["a16w4"])


@pytest.mark.parametrize("field", ["weights_16bit", "weights_8bit"])
def test_a_weight_pattern_that_is_no_regex_is_refused(field):
    options = replace(SM8650, **{field: ["self_attn(["]})
    with pytest.raises(NpuforgeError, match=f"{field} pattern 'self_attn\\(\\[' is not a") as err:
        qnn.check_target("SM8650", options, ["a16w8"])
    assert "\n" not in str(err.value)


def quantize_in_toolchain(python, args, prefix=()) -> tuple[str, dict]:
    """Run QUANTIZE_SCRIPT in the toolchain's Python (behind ``prefix``, e.g. an
    emulator): (its stdout, {file: bytes} of the QDQ model and the preprocessed graph it
    read)."""
    run = subprocess.run(
        [*prefix, python, "-c", QUANTIZE_SCRIPT, str(REPO / "npuforge" / "jobs"), json.dumps(args)],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    # The job's own scratch (the augmented calibration graph) has random tensor names.
    folder = Path(args["target"]).parent
    kept = [p for p in folder.iterdir() if p.name.startswith(("qdq", "preprocessed"))]
    return run.stdout, {p.name: p.read_bytes() for p in kept}


@pytest.mark.toolchain
def test_faster_quantizer_lookups_write_the_same_qdq_model(qnn_stamp, workspace, tmp_path):
    """The job's quicker onnxruntime lookups and graph augmentation change the time,
    never the QDQ bytes."""
    python = json.loads(qnn_stamp.read_text())["python"]
    graph = json.loads((workspace["export"] / "export.json").read_text())["graphs"][1]
    written = {}
    for plain in (True, False):
        target = tmp_path / ("plain" if plain else "fast") / "qdq.onnx"
        args = {
            "plain": plain,
            "source": str(workspace["export"] / graph["file"]),
            "target": str(target),
            "precision": "a16w8",
            "samples": qnn_spec.calibration_samples(workspace["calibration"], 1),
            "inputs": graph["inputs"],
            "keep_16bit_tensors": [],
            "range_margin": 0.05,  # the job's own min/max calibration runs too
        }
        stdout, written[plain] = quantize_in_toolchain(python, args)
        # Which replace_input_of_all_nodes ran: onnxruntime's own, or the job's.
        assert ("_quantizer_without_quadratic_scans" in stdout) is not plain
    assert written[True].keys() == written[False].keys() and "qdq.onnx" in written[True]
    assert written[True] == written[False]


@pytest.mark.toolchain
def test_ranges_measured_once_write_the_same_qdq_model(qnn_stamp, workspace, tmp_path):
    """With ranges of its own (cover_stream, range_margin) the job runs the samples once:
    onnxruntime's quantizer reads those min/max from its calibration cache. The same
    QDQ bytes as when the quantizer calibrates again."""
    python = json.loads(qnn_stamp.read_text())["python"]
    graph = json.loads((workspace["export"] / "export.json").read_text())["graphs"][1]
    samples = qnn_spec.calibration_samples(workspace["calibration"], 1)
    assert len(samples) > 1
    written, reads = {}, {}
    for twice in (True, False):
        target = tmp_path / ("twice" if twice else "once") / "qdq.onnx"
        args = {
            "calibrate_twice": twice,
            "source": str(workspace["export"] / graph["file"]),
            "target": str(target),
            "precision": "a16w8",
            "samples": samples,
            "inputs": graph["inputs"],
            "keep_16bit_tensors": [],
            "range_margin": 0.05,
            "cover_stream": True,
        }
        stdout, written[twice] = quantize_in_toolchain(python, args)
        reads[twice] = int(stdout.rsplit("samples read:", 1)[1])
        assert not (target.parent / "measured_ranges.json").exists()
    assert reads == {True: 2 * len(samples), False: len(samples)}
    assert "qdq.onnx" in written[True] and written[True] == written[False]


def _quantize_args(workspace, target, samples=None, **extra) -> dict:
    """The job's quantization of the workspace's chunk 1 with SM8650's range settings."""
    graph = json.loads((workspace["export"] / "export.json").read_text())["graphs"][1]
    return {
        "source": str(workspace["export"] / graph["file"]),
        "target": str(target),
        "precision": "a16w8",
        "samples": samples or qnn_spec.calibration_samples(workspace["calibration"], 1),
        "inputs": graph["inputs"],
        # The state path reads its ranges from the quantizer's calibration cache.
        "keep_16bit_tensors": qnn_spec.keep_16bit_tensors(graph),
        "range_margin": qnn_spec.RANGE_MARGIN,
        "cover_stream": True,
        **extra,
    }


@pytest.mark.toolchain
def test_a_last_bit_difference_in_the_samples_leaves_the_qdq_model_as_it_was(
    qnn_stamp, workspace, tmp_path
):
    """The same samples captured on another host differ in their last bits, and the job's
    own calibration run differs there too: onnxruntime's and torch's CPU kernels take other
    paths per instruction set (docs/backends/qnn.md, "Reproducibility across hosts"). Every
    16-bit scale followed them, and so did the simulator's figures. With the measured
    min/max snapped to RANGE_BITS significant bits, samples one float step apart write
    the same Q/DQ model; unsnapped (the control) they do not."""
    python = json.loads(qnn_stamp.read_text())["python"]
    samples = qnn_spec.calibration_samples(workspace["calibration"], 1)
    nudged = []
    (tmp_path / "nudged").mkdir()
    for number, sample in enumerate(samples):
        moved = {}
        for name, path in sample.items():
            with np.load(path) as data:
                value = data[name]
            moved[name] = str(tmp_path / "nudged" / f"sample{number}-{name}.npz")
            np.savez(moved[name], **{name: np.nextafter(value, np.float32(np.inf))})
        nudged.append(moved)
    written = {}
    for unsnapped in (True, False):
        for label, chosen in (("captured", samples), ("nudged", nudged)):
            target = tmp_path / f"{label}-{'raw' if unsnapped else 'snapped'}" / "qdq.onnx"
            args = _quantize_args(workspace, target, chosen, unsnapped=unsnapped)
            written[label, unsnapped] = quantize_in_toolchain(python, args)[1]["qdq.onnx"]
    assert written["captured", True] != written["nudged", True]
    assert written["captured", False] == written["nudged", False]


# AVX without FMA or AVX2: onnxruntime's float kernels (MLAS) take other paths there than
# on any host with AVX2, and qemu-user emulates it on any x86-64 host. (Not Nehalem: under
# its emulation the toolchain's numpy 2.4.6 dies on an illegal instruction at import.)
OTHER_CPU = "SandyBridge"


@pytest.mark.toolchain
def test_the_qdq_model_is_the_same_when_the_calibration_runs_on_another_instruction_set(
    qnn_stamp, workspace, tmp_path
):
    """The job's calibration run on an emulated CPU of another instruction set: its ranges
    differ in their last bits (the control, unsnapped, writes another Q/DQ model), and the
    snapped ones write the same Q/DQ model as this host's."""
    qemu = shutil.which("qemu-x86_64")
    if qemu is None:
        pytest.skip("no qemu-x86_64 here to emulate another CPU: envs/base/setup-qemu.sh")
    python = json.loads(qnn_stamp.read_text())["python"]
    written = {}
    for unsnapped in (True, False):
        for host, prefix in (("here", ()), ("other", (qemu, "-cpu", OTHER_CPU))):
            target = tmp_path / f"{host}-{'raw' if unsnapped else 'snapped'}" / "qdq.onnx"
            args = _quantize_args(workspace, target, unsnapped=unsnapped)
            written[host, unsnapped] = quantize_in_toolchain(python, args, prefix)[1]["qdq.onnx"]
    assert written["here", True] != written["other", True]
    assert written["here", False] == written["other", False]


# One decode step's KV cache row write, both ways, quantized to 16-bit activations: the
# export's old MatMul of a [L, 1] one-hot by the [1, D] new row, and the broadcast Mul the
# MHA->SHA pass now writes. Prints each form's worst row error on the HTP simulator and
# in the Q/DQ model on the CPU (fake quantization).
KV_ROW_WRITE_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
from pathlib import Path
import numpy as np, onnx, onnxruntime as ort
from onnx import TensorProto, helper
from onnxruntime.quantization import (CalibrationDataReader, QuantFormat, QuantType,
                                      quantize_static)
import qnn_layer_error, qnn_session
work = Path(sys.argv[2])
L, D = 256, 64
rng = np.random.default_rng(0)
def sample(position, t):
    write = np.zeros((1, L, t), np.float32)
    write[0, position + np.arange(t), np.arange(t)] = 1
    rows = np.clip(2 * rng.standard_normal((1, t, D)), -6, 6).astype(np.float32)
    return {"write": write, "rows": rows}
ort_qnn, devices, htp = qnn_session.register_qnn()
options = qnn_session.provider_options({"soc_model": 57, "htp_arch": 75, "precision": "a16w8"}, htp)
def node(op, inputs, output, **attrs):
    return helper.make_node(op, inputs, [output], **attrs)
swap = [0, 2, 1]
FORMS = {  # one row (decode) and four rows (prefill), each as the pass wrote it and before
    "MatMul": (1, [node("MatMul", ["write", "rows"], "out")]),
    "Mul": (1, [node("Mul", ["write", "rows"], "out")]),
    "MatMul4": (4, [node("MatMul", ["write", "rows"], "out")]),
    "Swapped4": (4, [node("Transpose", ["rows"], "rows_t", perm=swap),
                     node("Transpose", ["write"], "write_t", perm=swap),
                     node("MatMul", ["rows_t", "write_t"], "out_t"),
                     node("Transpose", ["out_t"], "out", perm=swap)]),
}
found = {}
for form, (t, nodes) in FORMS.items():
    calibration = [sample(p, t) for p in range(0, 64, 2)]
    calibration[0]["rows"][0, 0, :2] = [6, -6]  # the range covers every row (no clipping)
    held_out = [sample(p, t) for p in (9, 40)]
    graph = helper.make_graph(nodes, form,
        [helper.make_tensor_value_info("write", TensorProto.FLOAT, [1, L, t]),
         helper.make_tensor_value_info("rows", TensorProto.FLOAT, [1, t, D])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, L, D])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    onnx.save(model, work / f"{form}.onnx")
    class Reader(CalibrationDataReader):
        def __init__(self):
            self.feeds = iter(calibration)
        def get_next(self):
            return next(self.feeds, None)
    qdq = str(work / f"{form}_qdq.onnx")
    quantize_static(str(work / f"{form}.onnx"), qdq, Reader(), quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QUInt16, weight_type=QuantType.QUInt8)
    context = str(work / f"{form}_ctx.onnx")
    qnn_session.generate_contexts(ort_qnn, devices, options, [(qdq, context)], share=False)
    on_htp = qnn_session.simulator_session(ort_qnn, devices, options, context)
    on_cpu = qnn_layer_error._session(ort, qdq)
    errors = {"htp": 0.0, "fake": 0.0}
    for feeds in held_out:
        rows, written = feeds["rows"][0], feeds["write"][0].argmax(0)
        for where, session in (("htp", on_htp), ("fake", on_cpu)):
            out = session.run(["out"], feeds)[0][0]
            errors[where] = max(errors[where], float(np.abs(out[written] - rows).max()))
            assert not np.delete(out, written, 0).any()  # every other row stays zero
    found[form] = errors
print(json.dumps(found))
"""


@pytest.mark.toolchain
def test_htp_writes_kv_cache_rows_as_quantized_only_with_the_one_hot_second(qnn_stamp, tmp_path):
    """Why the MHA->SHA pass writes KV rows as it does: the HTP computes a MatMul of two
    16-bit activations with its second input cut to about 8 bits, so ``one_hot @ rows``
    carries an 8-bit error into every cached row (SmolLM2's a16w8; docs/backends/qnn.md).
    One row is written with a Mul, several as ``(rows^T @ one_hot^T)^T``."""
    python = json.loads(qnn_stamp.read_text())["python"]
    run = subprocess.run(
        [python, "-c", KV_ROW_WRITE_SCRIPT, str(REPO / "npuforge" / "jobs"), str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    found = json.loads(run.stdout.splitlines()[-1])
    step = 12 / 65535  # a 16-bit step of rows in [-6, 6]
    for form in found:
        assert found[form]["fake"] < step, found  # the grid itself holds the rows
    # As the MHA->SHA pass writes them: one row as quantized, several within a few steps
    # (measured 4.5: about 14-bit precision).
    assert found["Mul"]["htp"] <= 1.01 * found["Mul"]["fake"], found
    assert found["Swapped4"]["htp"] <= 8 * step, found
    # As the export wrote them: the rows cut to about 8 bits.
    assert found["MatMul"]["htp"] > 50 * found["MatMul"]["fake"], found
    assert found["MatMul4"]["htp"] > 50 * found["MatMul4"]["fake"], found

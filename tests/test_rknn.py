"""Rockchip backend: graph rewrites, placement parsing, planning, and real rknn-toolkit2 builds.

The toolkit tests need an rknn toolchain: set NPUFORGE_RKNN_STAMP to a stamp
written by workflow_scripts/prepare_toolchain.py --backend rknn, or
NPUFORGE_RKNN_PYTHON to a Python with rknn-toolkit2 2.5.0 installed from
envs/rknn/requirements.lock; a stamp at results/toolchains/rknn-native.json is
used when present. Without one they skip and say so.
"""

import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, rknn_stamp

from npuforge.backends import rknn
from npuforge.backends.base import CompileRequest
from npuforge.errors import NpuforgeError

RK3588 = {"target_platform": "rk3588", "optimization_level": 3}


def options(mapping) -> rknn.Options:
    return rknn.Options(**mapping)


def compile_rknn(exports, calibration, target, mapping, precision, stamp, out, job_runner=None):
    """rknn.compile with the request built from the same arguments the CLI takes."""
    return rknn.compile(
        CompileRequest(
            exports=exports,
            calibrations=[calibration] if calibration else [],
            target=target,
            options=options(mapping),
            precision=precision,
            toolchain=stamp,
            out_dir=out,
            job_runner=job_runner,
            weights="synthetic",
        )
    )


# --------------------------------------------------------------------------- rewrites


def _graph_with_decay_and_outer_product():
    """x -> decay = exp(-c * sigmoid(x)) (provably <= 0 argument), exp(x) (unknown sign),
    and an outer product v[2,4,1] @ k[2,1,4] + s."""
    from onnx import TensorProto, helper, numpy_helper

    nodes = [
        helper.make_node("Sigmoid", ["x"], ["sig"]),
        helper.make_node("Mul", ["sig", "neg_c"], ["arg"]),
        helper.make_node("Exp", ["arg"], ["decay"]),
        helper.make_node("Exp", ["x"], ["free_exp"]),
        helper.make_node(
            "Constant", [], ["c_half"], value=numpy_helper.from_array(np.array(-0.5, np.float32))
        ),  # fmt: skip
        helper.make_node("Neg", ["sig"], ["nsig"]),
        helper.make_node("Add", ["nsig", "c_half"], ["arg2"]),
        helper.make_node("Exp", ["arg2"], ["decay2"]),
        helper.make_node("MatMul", ["v", "k"], ["vk"]),
        helper.make_node("Add", ["vk", "s"], ["s_out"]),
    ]
    f = TensorProto.FLOAT
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", f, [1, 8]),
            helper.make_tensor_value_info("v", f, [2, 4, 1]),
            helper.make_tensor_value_info("k", f, [2, 1, 4]),
            helper.make_tensor_value_info("s", f, [2, 4, 4]),
        ],
        [
            helper.make_tensor_value_info(n, f, shape)
            for n, shape in (
                ("decay", [1, 8]),
                ("free_exp", [1, 8]),
                ("decay2", [1, 8]),
                ("s_out", [2, 4, 4]),
            )
        ],
        [numpy_helper.from_array(np.full((1, 8), -0.606531, np.float32), "neg_c")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_rewrites_are_exact_and_counted(tmp_path):
    import onnx
    import onnxruntime as ort

    from npuforge.backends.rknn_graph import rewrite_file

    src, dst = tmp_path / "src.onnx", tmp_path / "dst.onnx"
    onnx.save(_graph_with_decay_and_outer_product(), src)
    report = rewrite_file(src, dst)
    assert report == {
        "exp_to_elu": 2,
        "exp_kept": 1,
        "outer_matmul_to_mul": 1,
        "l2_normalize": 0,
    }
    ops = [n.op_type for n in onnx.load(dst).graph.node]
    assert ops.count("Exp") == 1 and ops.count("Elu") == 2 and "MatMul" not in ops

    rng = np.random.default_rng(0)
    feeds = {
        "x": rng.standard_normal((1, 8)).astype(np.float32) * 4,
        "v": rng.standard_normal((2, 4, 1)).astype(np.float32),
        "k": rng.standard_normal((2, 1, 4)).astype(np.float32),
        "s": rng.standard_normal((2, 4, 4)).astype(np.float32),
    }
    before = ort.InferenceSession(str(src)).run(None, feeds)
    after = ort.InferenceSession(str(dst)).run(None, feeds)
    for a, b in zip(before, after, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)


def test_l2_normalize_rewrite_is_exact(tmp_path):
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from npuforge.backends.rknn_graph import rewrite_file

    f = TensorProto.FLOAT
    const = numpy_helper.from_array
    # x / sqrt(clip(sum(x * x, axis -1), 1e-12)): how the RWKV-7 export normalises k.
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["x", "x"], ["sq"]),
            helper.make_node("ReduceSum", ["sq", "axes"], ["ss"], keepdims=1),
            helper.make_node("Clip", ["ss", "eps"], ["cl"]),
            helper.make_node("Sqrt", ["cl"], ["norm"]),
            helper.make_node("Div", ["x", "norm"], ["y"]),
        ],
        "g",
        [helper.make_tensor_value_info("x", f, [1, 4, 16])],
        [helper.make_tensor_value_info("y", f, [1, 4, 16])],
        [const(np.array([-1], np.int64), "axes"), const(np.array(1e-12, np.float32), "eps")],
    )
    src, dst = tmp_path / "src.onnx", tmp_path / "dst.onnx"
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.save(model, src)
    assert rewrite_file(src, dst)["l2_normalize"] == 1
    ops = [n.op_type for n in onnx.load(dst).graph.node]
    assert ops == ["ReduceL2", "Clip", "Expand", "Div"]
    x = np.random.default_rng(1).standard_normal((1, 4, 16)).astype(np.float32)
    x[0, 0] = 0  # the eps floor
    before = ort.InferenceSession(str(src)).run(None, {"x": x})[0]
    after = ort.InferenceSession(str(dst)).run(None, {"x": x})[0]
    np.testing.assert_allclose(after, before, rtol=1e-6, atol=1e-7)


def test_sign_analysis_keeps_unprovable_exp():
    from onnx import TensorProto, helper

    from npuforge.backends.rknn_graph import rewrite_for_rknn

    f = TensorProto.FLOAT
    # tanh can be positive: exp(-tanh(x)) must stay an Exp.
    model = helper.make_model(
        helper.make_graph(
            [
                helper.make_node("Tanh", ["x"], ["t"]),
                helper.make_node("Neg", ["t"], ["n"]),
                helper.make_node("Exp", ["n"], ["y"]),
            ],
            "g",
            [helper.make_tensor_value_info("x", f, [1, 4])],
            [helper.make_tensor_value_info("y", f, [1, 4])],
        ),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    assert rewrite_for_rknn(model)["exp_kept"] == 1


# --------------------------------------------------------------------------- job helpers


# Rows as rknn-toolkit2 2.5.0 prints them (columns trimmed), incl. the Exp it puts on the CPU.
_ROWS = [
    ("ID", "OpType", "DataType", "Target", "InputShape", "FullName"),
    ("0", "InputOperator", "FLOAT16", "CPU", "\\", "InputOperator:embedding"),
    ("5", "Reshape", "FLOAT16", "NPU", "(1,128),(4)", "Reshape:embedding_rs"),
    ("6", "exNorm", "FLOAT16", "NPU", "(1,128,1,1)", "exNorm:/ln1/LayerNormalization#1"),
    ("7", "Exp", "FLOAT16", "CPU", "(1,128,1,1)", "Exp:/layers.0/Exp"),
    ("8", "OutputOperator", "FLOAT16", "CPU", "(1,128)", "OutputOperator:logits"),
]
PLACEMENT_LOG = "".join(
    "D RKNN: [02:38:33.864] " + "  ".join(f"{c:<14}" for c in row) + "\n" for row in _ROWS
)


def _job_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("rknn_job", rknn.JOB_SCRIPT)
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    return job


def test_parse_placement_counts_cpu_fallback():
    job = _job_module()
    placement = job.parse_placement(PLACEMENT_LOG)
    assert placement["ops"] == {"NPU": 2, "CPU": 1}
    assert placement["cpu_fallback"] == 1
    assert placement["fallback_ops"] == [
        {"op": "Exp", "target": "CPU", "name": "Exp:/layers.0/Exp"}
    ]


# rknn-toolkit2 2.5.0's error_analysis.txt (accuracy_analysis on the simulator), cut down.
ERROR_ANALYSIS = """\
# simulator_error: calculate the output error of each layer of the simulator.

layer_name                          simulator_error
                                entire              single
                             cos      euc        cos      euc
-------------------------------------------------------------------
[Input] embedding                             1.00000 | 0.00000   1.00000 | 0.00000
[Conv] /layers.0/self_attn/q_proj/MatMul_output_0_mm
[exNorm] /layers.0/input_layernorm/Mul_3_output_0  0.99990 | 0.05045   0.99990 | 0.05045
[Conv] /layers.0/mlp/down_proj/MatMul_output_0_mm  0.98000 | 4.58027   0.99500 | 3.42518
[Add] /layers.0/Add_1_output_0                0.97000 | 5.1e+01   0.99900 | 2.26426
[Conv] /layers.1/mlp/down_proj/MatMul_output_0_mm  0.90000 | 9.00000   0.95000 | 7.00000
[Add] /layers.1/Add_1_output_0                0.89000 | 9.50000   0.99950 | 1.00000
"""


def test_layer_error_table_is_parsed_and_summarised():
    from npuforge.backends import layer_error

    rows = _job_module().parse_error_analysis(ERROR_ANALYSIS)
    # The fused row (no figures) is left out; every figure is read, exponents too.
    assert [r["op"] for r in rows] == ["Input", "exNorm", "Conv", "Add", "Conv", "Add"]
    assert rows[3] == {
        "op": "Add",
        "tensor": "/layers.0/Add_1_output_0",
        "entire_cosine": 0.97,
        "entire_euclid": 51.0,
        "single_cosine": 0.999,
        "single_euclid": 2.26426,
    }
    summary = layer_error.summarize([rows[:4], rows[4:]], [8, 24])
    assert [(r["chunk"], r["tensor"]) for r in summary["worst_layers"][:2]] == [
        (1, "/layers.1/mlp/down_proj/MatMul_output_0_mm"),
        (0, "/layers.0/mlp/down_proj/MatMul_output_0_mm"),
    ]
    assert summary["by_kind"]["/layers.N/mlp/down_proj/MatMul_output_0_mm"] == {
        "layers": 2,
        "worst_single": 0.95,
    }
    assert next(iter(summary["by_kind"])) == "/layers.N/mlp/down_proj/MatMul_output_0_mm"
    assert summary["entire_cosine_after_layer"] == [[0, 0.97], [1, 0.89]]
    assert summary["entire_cosine_at_chunk_end"] == [0.97, 0.89]
    lines = layer_error.report_lines(summary, "rknn-toolkit2 accuracy_analysis")
    assert "held-out steps [8, 24]" in lines[0] and lines[-1].endswith("0:0.9700 1:0.8900")
    assert layer_error.sample_steps(32, 2) == [8, 24]
    assert layer_error.sample_steps(3, 5) == [0, 1, 2]
    with pytest.raises(NpuforgeError, match="option layer_error must be a number"):
        options({**RK3588, "layer_error": -1})


def test_staging_hides_where_inputs_and_toolchain_live(tmp_path):
    """Two checkouts (different absolute paths) stage to the same path and spec bytes."""
    import shutil

    job = _job_module()
    stages = []
    for checkout in ("a", "a-checkout-with-a-much-longer-name"):
        export = tmp_path / checkout / "export"
        export.mkdir(parents=True)
        (export / "chunk0.onnx").write_bytes(b"onnx")
        spec = {
            "onnx": str(export / "chunk0.onnx"),
            "dataset": str(tmp_path / checkout / "cal" / "dataset.txt"),
            "rknn": str(tmp_path / checkout / "out" / "chunk0.rknn"),
            "build_log": str(tmp_path / checkout / "build.log"),
            "result": str(tmp_path / checkout / "result.json"),
            "verify": {"steps": 2, "feeds": {"x": str(tmp_path / checkout / "x.npy")}},
            "precision": "fp16",
        }
        spec_path = tmp_path / checkout / "spec.json"
        spec_path.write_text(json.dumps(spec))
        stage, python, lock = job._stage(str(spec_path))
        try:
            staged = Path(stage, "spec.json").read_bytes()
            assert str(tmp_path) not in staged.decode()
            assert json.loads(staged)["onnx"] == "in/chunk0.onnx"
            assert Path(stage, "in", "chunk0.onnx").read_bytes() == b"onnx"
            assert json.loads(Path(stage, "dest.json").read_text()) == spec
            assert python == f"{stage}/py/bin/python"
            assert Path(python).resolve() == Path(os.path.realpath(sys.executable))
            cfg = Path(stage, "py", "pyvenv.cfg").read_text()
            assert str(tmp_path) not in cfg
            stages.append((stage, staged, cfg))
        finally:
            os.close(lock)
            shutil.rmtree(stage, ignore_errors=True)
    assert stages[0] == stages[1]


def test_precision_checks():
    rknn.check_precision("RK3588", options(RK3588), "w16a16i_dfp")
    with pytest.raises(NpuforgeError, match="cannot build precision 'w16a16i_dfp'"):
        rknn.check_precision("RK3576", options({"target_platform": "rk3576"}), "w16a16i_dfp")
    with pytest.raises(NpuforgeError, match="rk9999"):
        options({"target_platform": "rk9999"})
    assert rknn.unavailable_reason("native", options(RK3588)) is None


def test_gate_hint_suggests_only_the_algorithms_not_in_use():
    for algorithm in rknn.QUANTIZED_ALGORITHMS:
        options = rknn.Options(target_platform="rk3588", quantized_algorithm=algorithm)
        hint = rknn.gate_hint(options, "w8a8")
        suggested = hint.split(",")[0]
        assert algorithm not in suggested
        assert all(a in suggested for a in rknn.QUANTIZED_ALGORITHMS if a != algorithm)
        # An fp16 build has no quantization to tune.
        assert "quantized_algorithm" not in rknn.gate_hint(options, "fp16")


def test_float16_selection_is_checked():
    keep = options({**RK3588, "float16": {"w8a8": {"except_op_types": ["Conv", "Conv"]}}})
    assert rknn.float16_selection(keep, "w8a8") == {"except_op_types": ["Conv"]}
    assert rknn.float16_selection(keep, "fp16") is None
    assert rknn.float16_selection(keep, "w16a16i_dfp") is None
    assert rknn.float16_selection(options(RK3588), "w8a8") is None
    named = {"except_op_types": ["Conv"], "layers_named": ["down_proj", "layernorm", "down_proj"]}
    assert rknn.float16_selection(options({**RK3588, "float16": {"w8a8": named}}), "w8a8") == {
        "except_op_types": ["Conv"],
        "layers_named": ["down_proj", "layernorm"],
    }
    bad = [
        ({"w8a8": {"layers_named": ["down_proj"]}}, "must be {op_types"),
        ({"w8a8": {"op_types": ["Conv"], "layers_named": []}}, "layers_named must be a non-empty"),
        ({"w8a16": {"op_types": ["Conv"]}}, "must map quantized precisions"),
        ({"w8a8": {"op_types": ["Conv"], "except_op_types": ["Mul"]}}, "must be {op_types"),
        ({"w8a8": {"layers": ["Conv"]}}, "must be {op_types"),
        ({"w8a8": {"op_types": []}}, "non-empty list"),
        ({"w8a8": {"op_types": "Conv"}}, "non-empty list"),
    ]
    for table, message in bad:
        with pytest.raises(NpuforgeError, match=message):
            rknn.float16_selection(options({**RK3588, "float16": table}), "w8a8")
    with pytest.raises(NpuforgeError, match="set only one"):
        table = {"w8a8": {"except_op_types": ["Conv"]}}
        rknn.float16_selection(options({**RK3588, "float16": table, "auto_hybrid": True}), "w8a8")


# --------------------------------------------------------------------------- compile flow


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    from test_calibration import small_export

    return small_export(tmp_path_factory.mktemp("rknn_export"))


def test_failed_job_leaves_no_artifact_and_one_line(export_dir, tmp_path):
    stamp = tmp_path / "stamp.json"
    stamp.write_text(json.dumps({"backend": "rknn", "runtime": "native", "python": "/bin/false"}))
    out = tmp_path / "out"

    def failing_runner(stamp_path, spec_path, read_only, writable, log_path):
        spec = json.loads(Path(spec_path).read_text())
        Path(spec["rknn"]).write_bytes(b"half a model")  # a partial output
        raise NpuforgeError("rknn job failed in the native toolchain: error: build failed")

    with pytest.raises(NpuforgeError, match="build failed"):
        compile_rknn(
            [export_dir], None, "RK3588", RK3588, "fp16", stamp, out, job_runner=failing_runner
        )
    assert not out.exists() and not list(tmp_path.glob(".out.*"))

    with pytest.raises(NpuforgeError, match="needs calibration samples"):
        compile_rknn([export_dir], None, "RK3588", RK3588, "w8a8", stamp, out)
    with pytest.raises(NpuforgeError, match="toolchain stamp .* is missing"):
        compile_rknn([export_dir], None, "RK3588", RK3588, "fp16", tmp_path / "no", out)
    assert not out.exists()


# --------------------------------------------------------------------------- real toolkit


def _toolchain_stamp(tmp_path_factory) -> Path:
    # Built where none is yet, at the path the workflow stamps it (later tests find it).
    default = REPO / "results" / "toolchains" / "rknn-native.json"
    try:
        stamp, reason = rknn_stamp(tmp_path_factory.mktemp("toolchain"), built_at=default)
    except NpuforgeError as err:
        if os.environ.get("CI"):
            raise  # CI installs from the lock: a broken lock must fail there
        pytest.skip(f"could not build the rknn toolchain from envs/rknn/requirements.lock: {err}")
    if stamp is None:
        pytest.skip(reason)
    return stamp


@pytest.fixture(scope="module")
def toolchain(tmp_path_factory):
    return _toolchain_stamp(tmp_path_factory)


def _digests(out: Path) -> dict:
    from npuforge.fileio import sha256_file

    return {p.name: sha256_file(p) for p in sorted(out.iterdir())}


@pytest.mark.toolchain
def test_fp16_on_npu_verified_and_byte_reproducible(
    export_dir, toolchain, tmp_path, monkeypatch, capsys
):
    first, second = tmp_path / "a", tmp_path / "b-at-a-longer-path"
    record = compile_rknn([export_dir], None, "RK3588", RK3588, "fp16", toolchain, first)
    # The simulator's time, read from a clock the job's counting clock leaves alone.
    timed = re.search(
        r"simulator verification: ([\d.]+) s: decode 32 calls of 32 tokens through 2 chunks "
        r"\(([\d.]+) s per call; per chunk: ([\d.]+), ([\d.]+) s\)",
        capsys.readouterr().err,
    )
    assert timed and float(timed[1]) > 0 and float(timed[3]) > 0 and float(timed[4]) > 0
    figures = record["verification"]
    assert figures["positions"] == 32 and figures["nan_inf"] == 0 and figures["passed"]
    assert figures["cosine"] >= 0.9999
    assert figures["text"]["tokenizer"]["kind"] == "rwkv-world"
    assert abs(figures["perplexity"]["delta"]) < 0.01
    # Random synthetic weights give near-tied logits; fp16 may flip the odd argmax.
    assert figures["top1_agreement"] >= 0.9
    # Every op on the NPU: the decay's Exp became Elu + 1 (one per layer).
    assert record["placement"]["cpu_fallback"] == 0
    assert sum(r["exp_to_elu"] for r in record["graph_rewrites"]) == 2
    assert sum(r["l2_normalize"] for r in record["graph_rewrites"]) == 2
    assert record["options"]["aslr_disabled"] is True
    assert record["split"]["chunks"] == 2 and record["split"]["layers"] == [[0, 1], [1, 2]]
    assert [a["file"] for a in record["artifacts"]] == ["chunk0.rknn", "chunk1.rknn"]
    assert sorted(p.name for p in first.iterdir()) == ["chunk0.rknn", "chunk1.rknn", "compile.json"]

    assert record["options"]["site_packages"] in ("hard-linked", "symlinked")
    assert not (tmp_path / ".a.finished-chunks").exists()  # the store goes when it lands

    # The toolkit copies stale pointers into the file: the environment's size and the
    # output path moved them (9 and 8 bytes differed) before the job staged itself.
    monkeypatch.setenv("NPUFORGE_UNRELATED", "x" * 3000)
    # This build is killed in its second chunk, then run again: only that chunk is built
    # again, and the bytes are those of the one-go build.
    from npuforge import toolchain as toolchains

    real_run_job, ran = toolchains.run_job, []

    def run_job(stamp, script, spec_path, **kwargs):
        chunk = json.loads(Path(spec_path).read_text())["chunk"]
        if chunk == 1 and "killed" not in ran:
            ran.append("killed")
            raise NpuforgeError("rknn job failed in the native toolchain: killed (signal 9)")
        ran.append(chunk)
        return real_run_job(stamp, script, spec_path, **kwargs)

    monkeypatch.setattr(toolchains, "run_job", run_job)
    with pytest.raises(NpuforgeError, match="signal 9"):
        compile_rknn([export_dir], None, "RK3588", RK3588, "fp16", toolchain, second)
    assert not second.exists() and ran == [0, "killed"]
    compile_rknn([export_dir], None, "RK3588", RK3588, "fp16", toolchain, second)
    assert ran == [0, "killed", 1]
    assert _digests(first) == _digests(second)
    assert not (tmp_path / ".b-at-a-longer-path.finished-chunks").exists()


@pytest.mark.toolchain
def test_deep_llama_rebuild_is_byte_identical(toolchain, tmp_path):
    """On a graph this deep the stale stack slots rknn-toolkit2 copies into its tensor
    records hold its passes' elapsed times: 564 bytes differed between two builds of
    this model before the job ran on a counting clock (job_stage.fixed_clock). They
    also hold what the GIL's handoffs to another thread left, at moments that follow
    the machine's load: 658 bytes differed beside three busy jobs while tqdm's monitor
    thread ran (job_stage.no_tqdm_monitor), so the job must run alone."""
    from npuforge import models
    from npuforge.jobs.job_stage import FIXED_CLOCK
    from npuforge.models.llama.weights import write_synthetic_checkpoint

    checkpoint = tmp_path / "checkpoint"
    dims = dict(layers=16, embed=128, heads=4, kv_heads=2, vocab=512, intermediate=256)
    write_synthetic_checkpoint(checkpoint, seed=0, arch="llama", **dims)
    export = tmp_path / "export"
    options = {"variant": "decode", "dtype": "fp32", "ext_embedding": True, "cache_len": 64}
    models.export("llama", checkpoint, export, options)
    first, second = tmp_path / "a", tmp_path / "b"
    short = {**RK3588, "verify_steps": 8}
    record = compile_rknn([export], None, "RK3588", short, "fp16", toolchain, first)
    assert record["verification"]["passed"]
    assert record["options"]["fixed_clock"] == FIXED_CLOCK
    assert record["options"]["job_threads"] == 1
    compile_rknn([export], None, "RK3588", short, "fp16", toolchain, second)
    assert _digests(first) == _digests(second)


@pytest.mark.toolchain
def test_w8a8_with_real_run_calibration(export_dir, toolchain, tmp_path):
    from npuforge.calibration import make_calibration_samples
    from npuforge.host_cpu import instruction_set

    calibration = tmp_path / "calibration"
    make_calibration_samples(export_dir, calibration, samples=8, steps=32, seed=0)
    # The quality gate is opened here so the figures can be inspected; the default
    # gate (0.999) makes compile_rknn fail with a one-line error instead.
    options = {**RK3588, "min_cosine": 0.0}
    record = compile_rknn(
        [export_dir], calibration, "RK3588", options, "w8a8", toolchain, tmp_path / "out"
    )
    figures = record["verification"]
    assert figures["nan_inf"] == 0 and figures["positions"] == 32
    # Sqrt/Div of the k normalisation would fall back in int8 without the rewrite.
    assert record["placement"]["cpu_fallback"] == 0
    assert record["options"]["calibration"]["zero_state"] is False
    # The toolkit keeps the ranges it measures: the record names both hosts' instruction set.
    host = instruction_set()
    assert record["options"]["calibration"]["hosts"] == {"samples": host, "ranges": host}
    assert record["options"]["quantized_dtype"] == "w8a8"
    if figures["cosine"] < 0.999:
        pytest.xfail(
            f"w8a8 logits cosine {figures['cosine']} (mean {figures['cosine_mean']}) is below "
            "issue 4's 0.999 goal with rknn-toolkit2 2.5.0 int8 activations"
        )


@pytest.mark.toolchain
def test_w8a8_hybrid_float16_recorded_better_and_byte_reproducible(export_dir, toolchain, tmp_path):
    from npuforge.calibration import make_calibration_samples

    calibration = tmp_path / "calibration"
    make_calibration_samples(export_dir, calibration, samples=8, steps=32, seed=0)
    plain_options = {**RK3588, "min_cosine": 0.0}
    # Only the weight matmuls (Conv in the toolkit's graph) stay int8.
    options = {**plain_options, "float16": {"w8a8": {"except_op_types": ["Conv"]}}}
    plain = compile_rknn(
        [export_dir], calibration, "RK3588", plain_options, "w8a8", toolchain, tmp_path / "p"
    )
    first, second = tmp_path / "a", tmp_path / "b"
    # The first build also runs the toolkit's per-layer analysis; the bytes stay the same.
    analysed = {**options, "layer_error": 2}
    record = compile_rknn([export_dir], calibration, "RK3588", analysed, "w8a8", toolchain, first)
    assert plain["options"]["float16"] is None
    float16 = record["options"]["float16"]
    assert float16["selection"] == {"except_op_types": ["Conv"]}
    assert [c["chunk"] for c in float16["chunks"]] == [0, 1]
    for chunk in float16["chunks"]:
        assert 0 < chunk["float16_tensors"] < chunk["tensors"]
        assert len(chunk["config_sha256"]) == 64
    assert record["placement"]["cpu_fallback"] == 0
    figures = record["verification"]
    assert figures["nan_inf"] == 0
    assert figures["cosine"] > plain["verification"]["cosine"]
    assert figures["cosine_mean"] > plain["verification"]["cosine_mean"]

    # Only the Conv layers' outputs are int8: a float16 layer fed fp32 inputs loses nothing
    # an int8 one does, and the error grows along the graph.
    errors = record["layer_error"]
    assert errors["held_out_steps"] == [8, 24] and len(errors["chunks"]) == 2
    rows = [row for chunk in errors["chunks"] for row in chunk]
    convs = [row["single_cosine"] for row in rows if row["op"] == "Conv"]
    others = [row["single_cosine"] for row in rows if row["op"] not in ("Conv", "exDataConvert")]
    print("layer error:", json.dumps(errors["worst_layers"], indent=1))
    assert convs and others and min(convs) < min(others)
    assert errors["worst_layers"][0]["single_cosine"] == min(r["single_cosine"] for r in rows)

    again = compile_rknn([export_dir], calibration, "RK3588", options, "w8a8", toolchain, second)
    binaries = [a["file"] for a in record["artifacts"]]
    assert binaries == ["chunk0.rknn", "chunk1.rknn"]
    assert {b: _digests(first)[b] for b in binaries} == {b: _digests(second)[b] for b in binaries}
    assert again["options"]["float16"] == float16 and "layer_error" not in again


@pytest.mark.toolchain
def test_toolkit_failure_is_one_line(export_dir, toolchain, tmp_path):
    from npuforge.calibration import make_calibration_samples

    calibration = tmp_path / "calibration"
    make_calibration_samples(export_dir, calibration, samples=1, steps=4, seed=0)
    out = tmp_path / "out"
    # rknn-toolkit2 itself fails inside the job: a sample's inputs are empty arrays.
    sample = calibration / "chunk0" / "sample0.npz"
    with np.load(sample) as data:
        empty = {name: np.zeros((0,), data[name].dtype) for name in data.files}
    np.savez(sample, **empty)
    options = RK3588
    with pytest.raises(NpuforgeError) as failure:
        compile_rknn([export_dir], calibration, "RK3588", options, "w8a8", toolchain, out)
    message = str(failure.value)
    assert "\n" not in message and "rknn job failed in the native toolchain" in message
    assert "input shape (1, 1, 0) is wrong" in message
    assert not out.exists()


def test_float16_tensors_by_op_type_and_by_layer_name(tmp_path):
    """The hybrid cfg's float16 layers: op-type rule, plus layers named by a substring."""
    import onnx
    from onnx import helper

    from npuforge.jobs import rknn_job

    def conv(name, out):
        return helper.make_node("Conv", ["x", "w"], [out], name=name)

    nodes = [
        conv("/layers.0/self_attn/q_proj/MatMul#2", "q"),
        conv("/layers.0/mlp/down_proj/MatMul#2", "down"),
        conv("/model/layers.0/input_layernorm/Mul_output_0_rs_mm#1", "norm_sum"),
        helper.make_node("Mul", ["q", "down"], ["product"], name="/layers.0/mul"),
    ]
    graph = helper.make_graph(nodes, "g", [], [])
    path = tmp_path / "chunk.model"
    onnx.save(helper.make_model(graph), str(path))
    by_type = {"except_op_types": ["Conv"]}
    assert rknn_job._float16_tensors(str(path), by_type) == (["product"], 4)
    named = {**by_type, "layers_named": ["down_proj", "layernorm"]}
    assert rknn_job._float16_tensors(str(path), named) == (["down", "norm_sum", "product"], 4)

"""Sophgo TPU-MLIR backend: command lines, inputs, the job runner, the toolchain check.

The command lines are checked against what TPU-MLIR documents:

- TPU-MLIR Quick Start, chapter "Compile the ONNX model"
  (https://tpumlir.org/docs/quick_start/03_onnx.html): model_transform.py with
  --model_name/--model_def/--input_shapes/--test_input/--test_result/--mlir;
  run_calibration.py <mlir> --dataset|--data_list --input_num -o <table>;
  model_deploy.py --mlir --quantize --processor (alias --chip) [--calibration_table]
  --test_input --test_reference --tolerance --model.
- The argparse definitions of tpu_mlir 1.30.2 (python/tools/model_transform.py,
  model_deploy.py, run_calibration.py): --input_types "like: float32,int32",
  --input_shapes "like: [[1,3,224,224],[10],[16]]", --q_group_size for W4A16,
  --quantize choices (F16, BF16, INT8, W8F16, W4F16, ...), --processor choices
  (bm1684x, bm1688, ...); python/calibration/data_selector.py: a data list holds
  one .npz path per line, each .npz keyed by input name.
- model_tool's usage text: "--combine file1 .. fileN -o new_file: combine bmodels
  to one bmodel by filepath".
- numpy_helper/tensor_compare.py (print_result) and npz_compare.py: the lines the
  similarity parser reads ("[name] SIMILAR [PASSED]", "cosine_similarity = x",
  "npz compare PASSED.").

Where CPython 3.10 is present, the tests marked toolchain prepare the native TPU-MLIR
environment as the workflow does (built once per lock in the machine's cache, reused
after), run the tools' own --help, and compile the demo model for real.
"""

import importlib.util
import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import job_estimates  # the TPU-MLIR job's sibling (conftest puts npuforge/jobs on the path)
import numpy as np
import pytest

from npuforge import backends, toolchain
from npuforge.backends import (
    base,
    gate,
    tpumlir,
    tpumlir_commands,
    tpumlir_env,
    tpumlir_inputs,
    tpumlir_record,
    tpumlir_run,
    tpumlir_spec,
)
from npuforge.backends.bmodel import pin_build_time
from npuforge.errors import NpuforgeError

REPO = Path(__file__).resolve().parents[1]
CHIPS = ("bm1684x", "bm1688")
PRECISIONS = ("f16", "bf16", "w8f16", "w4f16", "int8")
PREFILL_TOKENS = 8


def _load_job_module():
    spec = importlib.util.spec_from_file_location("tpumlir_job", tpumlir.JOB_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


job = _load_job_module()


def _run(script, *args):
    out = subprocess.run(
        [sys.executable, str(REPO / "workflow_scripts" / script), *map(str, args)],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-2000:]


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """A demo-sized RWKV-7 checkpoint exported as decode and prefill graphs."""
    root = tmp_path_factory.mktemp("tpumlir_exports")
    checkpoint = root / "demo.pth"
    _run(
        "make_synthetic_checkpoint.py",
        *("--version", 7, "--layers", 2, "--embed", 128, "--vocab", 1024),
        *("--head-size", 64, "--seed", 0, "--out", checkpoint),
    )
    for variant, tokens in (("decode", 1), ("prefill", PREFILL_TOKENS)):
        options = {"family": "rwkv", "variant": variant, "tokens": tokens, "dtype": "fp32"}
        _run(
            "export_onnx.py",
            *("--checkpoint", checkpoint, "--out-dir", root / variant),
            *("--options", json.dumps(options)),
        )
    return root


def _options(chip, **overrides) -> tpumlir.Options:
    """The registry's options of the chip's target (tolerances per precision)."""
    import yaml

    registry = yaml.safe_load((REPO / "config" / "targets.yaml").read_text())
    return tpumlir.Options(**{**registry[chip.upper()]["options"], **overrides})


def _request(export_dirs, chip, precision, tmp_path, **fields) -> base.CompileRequest:
    return base.CompileRequest(
        exports=export_dirs,
        target=chip.upper(),
        options=fields.pop("options", None) or _options(chip),
        precision=precision,
        out_dir=tmp_path / "out",
        **{"weights": "synthetic", **fields},
    )


def _spec(export_dirs, chip, precision, tmp_path, work="work", **fields) -> dict:
    """build_spec for these exports (no verification calls): the job's build steps."""
    request = _request(export_dirs, chip, precision, tmp_path, **fields)
    exports = base.load_exports(request.exports, "tpumlir")
    feeds = tpumlir_spec.net_test_feeds(request, exports)
    return tpumlir_spec.build_spec(request, exports, tmp_path / "out", tmp_path / work, feeds)


# ---------------------------------------------------------------- command lines


def _flags(argv):
    return [a for a in argv if a.startswith("-")]


def test_transform_command_has_static_shapes_and_test_files():
    inputs = [
        {"name": "tokens", "shape": [1, 1], "dtype": "int64"},
        {"name": "state_0_wkv", "shape": [1, 2, 64, 64], "dtype": "float32"},
    ]
    argv = tpumlir_commands.transform_command(
        "decode", "/e/chunk0.onnx", inputs, "/w/in.npz", "/w/top.npz", "/w/d.mlir"
    )
    assert argv[0] == "model_transform.py"
    pairs = dict(zip(argv[1::2], argv[2::2], strict=True))
    assert pairs == {
        "--model_name": "decode",
        "--model_def": "/e/chunk0.onnx",
        "--input_shapes": "[[1,1],[1,2,64,64]]",
        # bmodels have no int64: token ids enter as int32 (TPU-MLIR casts the test input).
        "--input_types": "int32,float32",
        "--test_input": "/w/in.npz",
        "--test_result": "/w/top.npz",
        "--mlir": "/w/d.mlir",
    }


def test_transform_refuses_dtypes_tpumlir_cannot_take():
    with pytest.raises(NpuforgeError, match="dtype bool"):
        tpumlir_commands.transform_command(
            "d", "m.onnx", [{"name": "mask", "shape": [1], "dtype": "bool"}], "i", "r", "m"
        )


@pytest.mark.parametrize("chip", CHIPS)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_deploy_command_per_chip_and_precision(chip, precision):
    quantize = tpumlir.quantize_mode(precision)
    table = "/w/cali_table" if precision == "int8" else None
    argv = tpumlir_commands.deploy_command(
        "/w/d.mlir",
        quantize,
        chip,
        "/w/in.npz",
        "/w/top.npz",
        "0.99,0.90",
        "/o/d.bmodel",
        calibration_table=table,
    )
    assert argv[0] == "model_deploy.py"
    pairs = dict(zip(argv[1::2], argv[2::2], strict=True))
    assert (
        pairs["--quantize"]
        == {"f16": "F16", "bf16": "BF16", "w8f16": "W8F16", "w4f16": "W4F16", "int8": "INT8"}[
            precision
        ]
    )
    assert pairs["--processor"] == chip
    assert pairs["--test_input"] == "/w/in.npz"
    assert pairs["--test_reference"] == "/w/top.npz"
    assert pairs["--tolerance"] == "0.99,0.90"
    assert pairs["--model"] == "/o/d.bmodel"
    assert ("--calibration_table" in pairs) == (precision == "int8")
    # Only the 4-bit weight mode takes a group size.
    assert pairs.get("--q_group_size") == ("64" if precision == "w4f16" else None)


def test_tolerance_per_precision_with_tpumlir_defaults():
    """INT8 of a recurrent prefill net cannot meet the F16 floors on any input (the wkv
    state lands at euclid 0.89-0.91 even on calibration samples), so the registry gives
    int8 TPU-MLIR's own INT8 default and keeps the F16 floors for the float modes."""
    for target in ("bm1684x", "bm1688"):
        options = _options(target)
        assert tpumlir.tolerance(options, "int8") == "0.90,0.80"
        for precision in ("f16", "bf16", "w8f16", "w4f16"):
            assert tpumlir.tolerance(options, precision) == "0.99,0.90"
    # A plain string applies to every precision; a mapping that leaves one out falls back
    # to model_deploy.py's default for that quantize mode.
    assert tpumlir.tolerance(_options("bm1684x", tolerance="0.95,0.85"), "int8") == "0.95,0.85"
    only_f16 = _options("bm1684x", tolerance={"f16": "0.999,0.95"})
    assert tpumlir.tolerance(only_f16, "int8") == "0.90,0.80"
    assert tpumlir.tolerance(_options("bm1684x", tolerance=None), "bf16") == "0.99,0.90"
    for bad in ("0.99", "high,0.9", "0.99,1.5"):
        with pytest.raises(NpuforgeError, match="not 'cos,euclid'") as refused:
            tpumlir.tolerance(_options("bm1684x", tolerance={"int8": bad}), "int8")
        assert "\n" not in str(refused.value)


def test_int8_without_calibration_table_is_refused():
    with pytest.raises(NpuforgeError, match="calibration"):
        tpumlir_commands.deploy_command("m", "INT8", "bm1684x", "i", "r", "0.99,0.9", "o")


def test_calibration_and_combine_commands():
    assert tpumlir_commands.calibration_command(
        "/w/d.mlir", "/w/list.txt", 8, "bm1688", "/w/t"
    ) == [
        "run_calibration.py",
        "/w/d.mlir",
        "--data_list",
        "/w/list.txt",
        "--input_num",
        "8",
        "--processor",
        "bm1688",
        "--cali_method",
        "kl",
        "-o",
        "/w/t",
    ]
    maxed = tpumlir_commands.calibration_command(
        "/w/d.mlir", "/w/l.txt", 8, "bm1688", "/w/t", "max"
    )
    assert maxed[maxed.index("--cali_method") + 1] == "max"
    assert tpumlir_commands.combine_command(
        ["/w/decode.bmodel", "/w/prefill.bmodel"], "/o/m.bmodel"
    ) == [
        "model_tool",
        "--combine",
        "/w/decode.bmodel",
        "/w/prefill.bmodel",
        "-o",
        "/o/m.bmodel",
    ]


def test_precision_and_processor_checks():
    with pytest.raises(NpuforgeError, match="no TPU-MLIR quantize mode"):
        tpumlir.check_target("BM1684X", _options("bm1684x"), ["f16", "w8a8"])
    with pytest.raises(NpuforgeError, match="processor 'rk3588'"):
        _options("bm1684x", processor="rk3588")
    assert _options("bm1688", processor="BM1688").processor == "BM1688"
    tpumlir.check_target("BM1688", _options("bm1688"), list(tpumlir.QUANTIZE))


# ---------------------------------------------------------------- inputs and spec


def _write_calibration(root: Path, exports_root: Path, samples=3) -> list[Path]:
    """Calibration layout of docs/interfaces.md, one directory per export:
    chunk{i}/ one .npz per sample."""
    rng = np.random.default_rng(1)
    for variant in ("decode", "prefill"):
        inputs = tpumlir_inputs.graph_inputs(exports_root / variant / "chunk0.onnx")
        folder = root / variant / "chunk0"
        folder.mkdir(parents=True, exist_ok=True)
        for j in range(samples):
            arrays = {
                s["name"]: (
                    rng.integers(0, 1024, s["shape"])
                    if s["dtype"] == "int64"
                    else rng.standard_normal(s["shape"])
                ).astype(s["dtype"])
                for s in inputs
            }
            np.savez(folder / f"sample{j}.npz", **arrays)
    # A stray sample of some other graph must be left out by its keys.
    np.savez(root / "decode" / "chunk0" / "other.npz", hidden_in=np.zeros((1, 1, 128), np.float32))
    return [root / "decode", root / "prefill"]


@pytest.mark.parametrize("chip", CHIPS)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_spec_inputs_for_each_chip_and_precision(exports, tmp_path, chip, precision):
    calibration = _write_calibration(tmp_path / "calib", exports) if precision == "int8" else []
    spec = _spec(
        [exports / "prefill", exports / "decode"], chip, precision, tmp_path,
        calibrations=calibration,
    )  # fmt: skip
    assert [g["net"] for g in spec["graphs"]] == ["decode", "prefill"]
    decode_export = base.load_exports([exports / "decode"], "tpumlir")["decode"]
    heldout = base.verification_tokens(2 * PREFILL_TOKENS + 1, decode_export)["ids"]
    stages = [s["name"] for s in spec["steps"]]
    per_graph = (
        ["model_transform", "run_calibration", "model_deploy"]
        if precision == "int8"
        else ["model_transform", "model_deploy"]
    )
    assert stages == [f"{g}:{s}" for g in ("decode", "prefill") for s in per_graph] + [
        "model_tool:combine"
    ]
    for graph in ("decode", "prefill"):
        onnx_inputs = tpumlir_inputs.graph_inputs(exports / graph / "chunk0.onnx")
        transform = next(s for s in spec["steps"] if s["name"] == f"{graph}:model_transform")
        pairs = dict(zip(transform["argv"][1::2], transform["argv"][2::2], strict=True))
        assert pairs["--input_shapes"] == tpumlir_commands.shapes_arg(
            s["shape"] for s in onnx_inputs
        )
        tokens = PREFILL_TOKENS if graph == "prefill" else 1
        assert pairs["--input_shapes"].startswith(f"[[1,{tokens}],[1,128],[1,2,64,64],")
        with np.load(pairs["--test_input"]) as data:
            assert list(data.files) == [s["name"] for s in onnx_inputs]
            for s in onnx_inputs:
                assert list(data[s["name"]].shape) == s["shape"]
                assert data[s["name"]].dtype.name == s["dtype"]
            # A real run's feeds: the held-out text's ids at the net's position (the second
            # prefill call, then the decode call after it) and the states that run carried.
            position = {"prefill": PREFILL_TOKENS, "decode": 2 * PREFILL_TOKENS}[graph]
            graph_record = next(g for g in spec["graphs"] if g["net"] == graph)
            assert graph_record["test_input_position"] == position
            assert data["tokens"].tolist() == [heldout[position : position + tokens]]
            assert np.abs(data["state_0_wkv"]).max() > 0
        deploy = next(s for s in spec["steps"] if s["name"] == f"{graph}:model_deploy")
        dpairs = dict(zip(deploy["argv"][1::2], deploy["argv"][2::2], strict=True))
        assert dpairs["--test_input"] == pairs["--test_input"]
        assert dpairs["--test_reference"] == pairs["--test_result"]
        assert dpairs["--processor"] == chip
        assert dpairs["--tolerance"] == ("0.90,0.80" if precision == "int8" else "0.99,0.90")
        if precision == "int8":
            listed = Path(tmp_path / "work" / graph / "calibration_list.txt").read_text().split()
            assert len(listed) == 3
            assert all(f"/calib/{graph}/chunk0/sample" in p for p in listed)
            for path in listed:
                with np.load(path) as data:
                    assert sorted(data.files) == sorted(s["name"] for s in onnx_inputs)
            # The recurrence stays F16 (int8_state_path), everything else INT8.
            qtable = Path(dpairs["--quantize_table"]).read_text().splitlines()
            assert qtable and all(line.endswith(" F16") for line in qtable)
        else:
            assert "--quantize_table" not in dpairs
    combine = spec["steps"][-1]["argv"]
    assert combine[:2] == ["model_tool", "--combine"]
    assert combine[-2:] == ["-o", str((tmp_path / "out" / f"{chip}_{precision}.bmodel").resolve())]
    assert all(os.path.isabs(p) for p in (spec["work_dir"], spec["out_dir"], spec["bmodel"]))


@pytest.fixture(scope="module")
def chunked_exports(exports, tmp_path_factory):
    """The same RWKV-7 checkpoint exported in two chunks per variant."""
    root = tmp_path_factory.mktemp("tpumlir_chunked")
    for variant, tokens in (("decode", 1), ("prefill", PREFILL_TOKENS)):
        options = {"family": "rwkv", "variant": variant, "tokens": tokens, "dtype": "fp32",
                   "chunks": 2}  # fmt: skip
        _run(
            "export_onnx.py",
            *("--checkpoint", exports / "demo.pth", "--out-dir", root / variant),
            *("--options", json.dumps(options)),
        )
    return root


def test_a_chunked_export_is_one_net_per_chunk_handing_its_hidden_state_on(
    chunked_exports, exports, tmp_path
):
    """Two chunks per variant: four nets (transform and deploy each) combined into one
    bmodel; chunk 1's --test_input is what chunk 0 handed on in a real run (RWKV-7: the
    hidden state and v_first), and the cmodel run chains the nets in chunk order."""
    dirs = [chunked_exports / "decode", chunked_exports / "prefill"]
    request = _request(dirs, "bm1688", "f16", tmp_path)
    loaded = base.load_exports(request.exports, "tpumlir")
    schedule = base.verification_schedule(loaded, PREFILL_TOKENS + 3)
    ids = base.verification_tokens(PREFILL_TOKENS + 3, loaded["decode"])["ids"]
    calls = base.write_call_feeds(loaded, schedule, ids, tmp_path)
    feeds = tpumlir_spec.net_test_feeds(request, loaded)
    spec = tpumlir_spec.build_spec(
        request, loaded, tmp_path / "out", tmp_path / "work", feeds, calls
    )
    nets = ["decode_0", "decode_1", "prefill_0", "prefill_1"]
    assert [g["net"] for g in spec["graphs"]] == nets
    assert [s["name"] for s in spec["steps"]] == [
        f"{net}:{stage}" for net in nets for stage in ("model_transform", "model_deploy")
    ] + ["model_tool:combine"]
    combine = spec["steps"][-1]["argv"]
    assert [Path(a).name for a in combine if a.endswith(".bmodel")][:4] == [
        f"{net}_bm1688_f16.bmodel" for net in nets
    ]
    chains = spec["verify"]["nets"]
    assert {v: list(chain) for v, chain in chains.items()} == {
        "decode": ["decode_0", "decode_1"], "prefill": ["prefill_0", "prefill_1"],
    }  # fmt: skip
    assert "logits" in chains["decode"]["decode_1"] and "logits" not in chains["decode"]["decode_0"]
    second = next(s for s in spec["steps"] if s["name"] == "decode_1:model_transform")
    pairs = dict(zip(second["argv"][1::2], second["argv"][2::2], strict=True))
    with np.load(pairs["--test_input"]) as data:
        assert {"hidden_in", "v_first_in"} <= set(data.files) and "tokens" not in data.files
        assert list(data["hidden_in"].shape) == [1, 1, 128]
        assert np.abs(data["hidden_in"]).max() > 0  # a real run's, not zeros
    first = next(s for s in spec["steps"] if s["name"] == "decode_0:model_transform")
    pairs = dict(zip(first["argv"][1::2], first["argv"][2::2], strict=True))
    with np.load(pairs["--test_input"]) as data:
        assert "tokens" in data.files and "hidden_in" not in data.files


def test_each_net_is_keyed_by_what_its_chain_reads_wherever_it_is_staged(chunked_exports, tmp_path):
    """The keys a rerun finds its finished nets by: the same for a build staged
    elsewhere, another for the net whose input changed, and only for it."""
    from npuforge.jobs.finished_chunks import FinishedChunks

    dirs = [chunked_exports / "decode", chunked_exports / "prefill"]
    store = FinishedChunks(tmp_path / "store", {"toolchain": "stamp"})

    def keys(staging, change=None):
        spec = _spec(dirs, "bm1688", "f16", staging, work=staging / "work")
        if change:
            step = next(s for s in spec["steps"] if s["name"] == f"{change}:model_transform")
            test_input = step["argv"][step["argv"].index("--test_input") + 1]
            with np.load(test_input) as data:
                arrays = {name: data[name] * 2 for name in data.files}
            np.savez(test_input, **arrays)
        return tpumlir_run.finished_nets(spec, store, staging)["keys"]

    first = keys(tmp_path / "a")
    assert sorted(first) == ["decode_0", "decode_1", "prefill_0", "prefill_1"]
    assert len(set(first.values())) == 4
    assert keys(tmp_path / "b-elsewhere") == first
    changed = keys(tmp_path / "c", change="decode_1")
    assert {net for net in first if changed[net] != first[net]} == {"decode_1"}


def test_test_input_run_fits_the_kv_cache():
    """Two prefill calls when the cache holds them and a decode token after, else one."""
    from types import SimpleNamespace

    def llama(cache_len, prefix=()):
        meta = {"family": "llama", "cache_len": cache_len, "kv_prefix": {"tokens": list(prefix)}}
        return SimpleNamespace(meta=meta, tokens_per_call=32)

    def calls(exports):
        return [(c.variant, c.position) for c in tpumlir_inputs.test_schedule(exports)]

    roomy = {"prefill": llama(256, [1]), "decode": llama(256, [1])}
    assert calls(roomy) == [("prefill", 0), ("prefill", 32), ("decode", 64)]
    tight = {"prefill": llama(64), "decode": llama(64)}
    assert calls(tight) == [("prefill", 0), ("decode", 32)]
    # 65 slots hold two calls and the decode token; one of them taken by a kv_prefix does not.
    assert len(calls({"prefill": llama(65), "decode": llama(65)})) == 3
    assert len(calls({"prefill": llama(65, [1]), "decode": llama(65, [1])})) == 2
    decode_only = {"decode": llama(64)}
    assert calls(decode_only) == [("decode", p) for p in range(tpumlir_inputs.DECODE_WARMUP + 1)]


def test_state_path_ops_are_the_recurrence_each_token_repeats(exports):
    """Between each wkv state input and its output: per token the ops that update the
    RWKV-7 state; the shift states carry no op from input to output; TPU-MLIR names each
    op "<output>_<op type>"."""
    import onnx

    for graph, tokens in (("decode", 1), ("prefill", PREFILL_TOKENS)):
        path = exports / graph / "chunk0.onnx"
        inputs = json.loads((exports / graph / "export.json").read_text())["graphs"][0]["inputs"]
        names = tpumlir_inputs.state_path_ops(path, inputs)
        nodes = {n.output[0]: n.op_type for n in onnx.load(str(path)).graph.node}
        assert all(name.rsplit("_", 1)[0] in nodes for name in names)
        assert all(nodes[name.rsplit("_", 1)[0]] == name.rsplit("_", 1)[1] for name in names)
        # 2 layers x tokens x (2 Mul, 2 Add, 1 MatMul), as measured on rwkv7-demo's prefill.
        assert len(names) == 2 * tokens * 5
        assert any(name.startswith("state_1_wkv_out_") for name in names)
        assert not any("shift" in name for name in names)
    assert tpumlir_inputs.state_path_ops(path, [i for i in inputs if i["role"] != "state"]) == []


def test_int8_with_weight_matmuls_only_keeps_every_other_op_f16(exports, tmp_path):
    """int8_weight_matmuls_only: the qtable lists every op but the matmuls reading a
    weight (those named in int8_f16_named too); the recurrence keeps its own mode."""
    import onnx

    path = exports / "decode" / "chunk0.onnx"
    graph = onnx.load(str(path)).graph
    weights = {init.name for init in graph.initializer}
    weighted = [n for n in graph.node if n.op_type == "MatMul" and set(n.input) & weights]
    ops = [n for n in graph.node if n.op_type != "Constant"]
    assert weighted
    names = tpumlir_inputs.ops_but_weight_matmuls(path)
    assert len(names) == sum(len(n.output) for n in ops) - len(weighted)
    assert not any(f"{n.output[0]}_MatMul" in names for n in weighted)
    head = tpumlir_inputs.ops_but_weight_matmuls(path, also_named=[weighted[-1].name])
    assert sorted(set(head) - set(names)) == [f"{weighted[-1].output[0]}_MatMul"]

    assert "int8_weight_matmuls_only: true" in tpumlir.gate_hint("int8")
    assert "int8" not in tpumlir.gate_hint("w4f16")
    # A float build has nothing wider to fall back to.
    assert "wider" not in tpumlir.gate_hint("f16") and "fp16_fixes" in tpumlir.gate_hint("f16")
    with pytest.raises(NpuforgeError, match="only with int8_weight_matmuls_only: true"):
        _options("bm1688", int8_f16_named=["head"])
    with pytest.raises(NpuforgeError, match="int8_calibration_method 'entropy' is not one of"):
        _options("bm1688", int8_calibration_method="entropy")
    calibration = _write_calibration(tmp_path / "calib", exports)
    options = _options(
        "bm1688", int8_weight_matmuls_only=True, int8_state_path="BF16",
        int8_calibration_method="mse",
    )  # fmt: skip
    spec = _spec(
        [exports / "decode"], "bm1688", "int8", tmp_path, calibrations=calibration,
        options=options,
    )  # fmt: skip
    deploy = next(s for s in spec["steps"] if s["name"] == "decode:model_deploy")
    pairs = dict(zip(deploy["argv"][1::2], deploy["argv"][2::2], strict=True))
    table = dict(line.split() for line in Path(pairs["--quantize_table"]).read_text().splitlines())
    inputs = json.loads((exports / "decode" / "export.json").read_text())["graphs"][0]["inputs"]
    recurrence = tpumlir_inputs.state_path_ops(path, inputs)
    assert set(table) == set(names) | set(recurrence)
    assert {table[name] for name in recurrence} == {"BF16"}
    assert {table[name] for name in set(names) - set(recurrence)} == {"F16"}
    calibrate = next(s for s in spec["steps"] if s["name"] == "decode:run_calibration")
    assert calibrate["argv"][calibrate["argv"].index("--cali_method") + 1] == "mse"


@pytest.fixture(scope="module")
def q4_1_llama(tmp_path_factory):
    """A tiny Llama on a Q4_1 grid, its decode graph exported plain and with group
    offsets for groups of 32 (its 64-wide inputs: two groups each)."""
    from llama_fixtures import make_q4_1_checkpoint

    from npuforge.models.llama.onnx_export import export_llama

    root = tmp_path_factory.mktemp("q4_1_llama")
    checkpoint = make_q4_1_checkpoint("llama", root / "ckpt")
    common = dict(variant="decode", tokens=1, dtype="fp32", cache_len=64)
    export_llama(checkpoint, root / "plain", **common)
    export_llama(checkpoint, root / "split", group_offsets={"group": 32}, **common)
    return root


def _deploy_flags(spec) -> dict:
    deploy = next(s for s in spec["steps"] if s["stage"] == "deploy")
    return dict(zip(deploy["argv"][1::2], deploy["argv"][2::2], strict=False))


def test_w4f16_of_a_group_offsets_export_takes_its_group_and_keeps_the_side_matmuls_f16(
    q4_1_llama, tmp_path
):
    import onnx

    options = _options("bm1688")
    assert options.w4f16_f16_named == ["lm_head"]  # the registry's
    spec = _spec([q4_1_llama / "split"], "bm1688", "w4f16", tmp_path, options=options)
    flags = _deploy_flags(spec)
    assert flags["--q_group_size"] == "32" and spec["q_group_size"] == 32
    table = dict(line.split() for line in Path(flags["--quantize_table"]).read_text().splitlines())
    graph = onnx.load(str(q4_1_llama / "split" / "chunk0.onnx")).graph
    kept = [n for n in graph.node if n.name.endswith(("/group_offsets/MatMul", "/lm_head/MatMul"))]
    assert len(kept) == 2 * 7 + 1
    assert table == {f"{n.output[0]}_MatMul": "F16" for n in kept}

    # A plain export: TPU-MLIR's group of 64, only the named matmuls kept.
    spec = _spec([q4_1_llama / "plain"], "bm1688", "w4f16", tmp_path, "w2", options=options)
    flags = _deploy_flags(spec)
    assert flags["--q_group_size"] == "64"
    table = Path(flags["--quantize_table"]).read_text().split()
    assert len(table) == 2 and table[0].startswith("logits") and table[1] == "F16"
    # Nothing named, no offsets: no table; other precisions never take one.
    unnamed = _options("bm1688", w4f16_f16_named=None)
    spec = _spec([q4_1_llama / "plain"], "bm1688", "w4f16", tmp_path, "w3", options=unnamed)
    assert "--quantize_table" not in _deploy_flags(spec)
    spec = _spec([q4_1_llama / "split"], "bm1688", "w8f16", tmp_path, "w4", options=options)
    assert "--quantize_table" not in _deploy_flags(spec)
    assert "--q_group_size" not in _deploy_flags(spec)

    options = _options("bm1688", q_group_size=64)
    with pytest.raises(NpuforgeError, match="groups of 32, but the target sets q_group_size: 64"):
        _spec([q4_1_llama / "split"], "bm1688", "w4f16", tmp_path, "w5", options=options)


def test_int8_without_matching_samples_is_refused(exports, tmp_path):
    (tmp_path / "calib" / "chunk0").mkdir(parents=True)
    with pytest.raises(NpuforgeError, match="no calibration sample"):
        _spec([exports / "decode"], "bm1684x", "int8", tmp_path, calibrations=[tmp_path / "calib"])


def test_int8_takes_each_graphs_samples_from_the_calibration_stage(exports, tmp_path):
    """One calibration directory per export (the workflow passes both): the prefill graph
    is calibrated on prefill samples (states carried over real multi-call runs)."""
    from npuforge.calibration import make_calibration_samples

    calibrations = []
    for variant in ("decode", "prefill"):
        calibrations.append(tmp_path / f"cal-{variant}")
        make_calibration_samples(exports / variant, calibrations[-1], samples=2, steps=4, seed=0)
    with pytest.raises(NpuforgeError, match="make_calibration_samples.py --export") as refused:
        _spec(
            [exports / "decode", exports / "prefill"], "bm1684x", "int8", tmp_path, "w0",
            calibrations=calibrations[:1],
        )  # fmt: skip
    assert "prefill graph" in str(refused.value) and "\n" not in str(refused.value)
    spec = _spec(
        [exports / "prefill", exports / "decode"], "bm1684x", "int8", tmp_path, "w",
        calibrations=calibrations,
    )  # fmt: skip
    for variant, tokens in (("decode", 1), ("prefill", PREFILL_TOKENS)):
        step = next(s for s in spec["steps"] if s["name"] == f"{variant}:run_calibration")
        listed = (tmp_path / "w" / variant / "calibration_list.txt").read_text().split()
        assert step["argv"][step["argv"].index("--input_num") + 1] == "2"
        assert listed == [
            str(tmp_path / f"cal-{variant}" / "chunk0" / f"sample{j}.npz") for j in range(2)
        ]
        for path in listed:
            with np.load(path) as data:
                assert data["tokens"].shape == (1, tokens)
                assert np.abs(data["state_0_wkv"]).max() > 0
    # The record names the samples per graph variant and the instruction sets the samples
    # and run_calibration's thresholds were computed on (they follow the host's CPU).
    from npuforge.host_cpu import instruction_set

    Path(spec["bmodel"]).parent.mkdir(parents=True, exist_ok=True)
    Path(spec["bmodel"]).write_bytes(b"bmodel")
    result = {"versions": {}, "steps": []}
    options = _options("bm1684x")
    record = tpumlir_record.compile_record(spec, result, {}, options, None, calibrations)
    recorded = record["options"]["calibration"]
    assert sorted(recorded) == ["decode", "prefill"]
    assert recorded["prefill"]["tokens_per_call"] == PREFILL_TOKENS
    for variant in ("decode", "prefill"):
        assert recorded[variant]["hosts"] == {
            "samples": instruction_set(),
            "ranges": instruction_set(),
        }


def test_exports_must_be_one_decode_and_one_prefill(exports):
    with pytest.raises(NpuforgeError, match="two decode exports"):
        base.load_exports([exports / "decode", exports / "decode"], "tpumlir")
    with pytest.raises(NpuforgeError, match="no decode export"):
        base.load_exports([exports / "prefill"], "tpumlir")


# ---------------------------------------------------------------- job runner


NPZ_COMPARE_LOG = """\
[logits                          ]      SIMILAR [PASSED]
    (1, 1, 1024) float32
    cosine_similarity      = 0.999871
    euclidean_similarity   = 0.984310
    sqnr_similarity        = 36.120001
[state_0_wkv_out                 ]        EQUAL [PASSED]
    (1, 2, 64, 64) float32
2 compared
2 passed
Target    decode_bm1684x_f16_tpu_outputs.npz
Reference decode_top_outputs.npz
npz compare PASSED.
"""


def test_parse_comparisons_reads_npz_tool_output():
    [cmp] = job.parse_comparisons("noise\n" + NPZ_COMPARE_LOG)
    assert cmp["passed"] is True
    assert cmp["target"] == "decode_bm1684x_f16_tpu_outputs.npz"
    assert cmp["reference"] == "decode_top_outputs.npz"
    assert cmp["tensors"]["logits"] == {
        "result": "SIMILAR",
        "passed": True,
        "cosine": 0.999871,
        "euclidean": 0.98431,
        "sqnr": 36.120001,
    }
    assert cmp["tensors"]["state_0_wkv_out"] == {"result": "EQUAL", "passed": True}
    failed = NPZ_COMPARE_LOG.replace("SIMILAR [PASSED]", "NOT_SIMLIAR [FAILED]").replace(
        "compare PASSED", "compare FAILED"
    )
    [bad] = job.parse_comparisons(failed)
    assert bad["passed"] is False and bad["tensors"]["logits"]["passed"] is False


def _fake_step(tmp_path, name, code, expects, graph="decode"):
    return {
        "name": name,
        "graph": graph,
        "stage": "deploy",
        "cwd": str(tmp_path),
        "argv": [sys.executable, "-c", code],
        "expects": [str(p) for p in expects],
    }


def test_job_runs_steps_and_records_similarity(tmp_path):
    out = tmp_path / "d.bmodel"
    code = f"print({NPZ_COMPARE_LOG!r}); open({str(out)!r}, 'wb').write(b'x')"
    spec = {
        "work_dir": str(tmp_path),
        "result": str(tmp_path / "r.json"),
        "check_frontend": False,
        "steps": [_fake_step(tmp_path, "decode:model_deploy", code, [out])],
    }
    result = job.run(spec)
    assert result["steps"][0]["passed"] is True
    assert result["steps"][0]["comparisons"][0]["tensors"]["logits"]["cosine"] == 0.999871
    assert result["steps"][0]["seconds"] >= 0
    assert json.loads((tmp_path / "r.json").read_text()) == result


def test_job_stops_when_similarity_fails_even_with_exit_zero(tmp_path):
    out = tmp_path / "d.bmodel"
    failing = NPZ_COMPARE_LOG.replace("SIMILAR [PASSED]", "NOT_SIMLIAR [FAILED]").replace(
        "compare PASSED", "compare FAILED"
    )
    code = f"print({failing!r}); open({str(out)!r}, 'wb').write(b'x')"
    spec = {
        "work_dir": str(tmp_path),
        "result": str(tmp_path / "r.json"),
        "check_frontend": False,
        "tolerance": "0.99,0.90",
        "steps": [
            _fake_step(tmp_path, "decode:model_deploy", code, [out]),
            _fake_step(tmp_path, "never", "raise SystemExit(3)", []),
        ],
    }
    with pytest.raises(SystemExit, match="similarity below tolerance"):
        job.run(spec)
    recorded = json.loads((tmp_path / "r.json").read_text())
    assert [s["name"] for s in recorded["steps"]] == ["decode:model_deploy"]


def test_job_fails_on_missing_output_and_tool_error(tmp_path):
    spec = {
        "work_dir": str(tmp_path),
        "result": str(tmp_path / "r.json"),
        "check_frontend": False,
        "steps": [_fake_step(tmp_path, "s", "print('ok')", [tmp_path / "missing.bmodel"])],
    }
    with pytest.raises(SystemExit, match="did not write"):
        job.run(spec)
    spec["steps"] = [_fake_step(tmp_path, "s", "raise ValueError('bad shape')", [])]
    with pytest.raises(SystemExit, match="ValueError: bad shape"):
        job.run(spec)


def _waiting_step(tmp_path, net, mine, theirs):
    """A net's transform that marks its start, then waits (5 s at most) for the other's."""
    code = (
        "import pathlib, sys, time\n"
        f"pathlib.Path({str(mine)!r}).write_text('x')\n"
        "end = time.monotonic() + 5\n"
        f"while not pathlib.Path({str(theirs)!r}).exists():\n"
        "    if time.monotonic() > end: sys.exit('the other net never ran beside this one')\n"
        "    time.sleep(0.05)\n"
    )
    return _fake_step(tmp_path, f"{net}:model_transform", code, [], graph=net)


def _side_by_side_spec(tmp_path, steps) -> dict:
    return {
        "work_dir": str(tmp_path),
        "result": str(tmp_path / "r.json"),
        "check_frontend": False,
        "parallel_nets": 2,
        "steps": steps,
    }


def _writing_step(tmp_path, name, path, text, graph):
    code = f"import pathlib; pathlib.Path({str(path)!r}).write_text({text!r})"
    return _fake_step(tmp_path, name, code, [path], graph=graph)


def test_job_runs_the_nets_side_by_side_then_combines(tmp_path, capsys):
    marks = {net: tmp_path / f"{net}.started" for net in ("decode", "prefill")}
    outs = {net: tmp_path / f"{net}.bmodel" for net in ("decode", "prefill")}
    combined = tmp_path / "combined.bmodel"
    inputs = list(map(str, outs.values()))
    combine = (
        f"import pathlib; ins = [pathlib.Path(p).read_text() for p in {inputs!r}]; "
        f"pathlib.Path({str(combined)!r}).write_text('+'.join(ins))"
    )
    spec = _side_by_side_spec(
        tmp_path,
        [
            _waiting_step(tmp_path, "decode", marks["decode"], marks["prefill"]),
            _writing_step(tmp_path, "decode:model_deploy", outs["decode"], "d", "decode"),
            _waiting_step(tmp_path, "prefill", marks["prefill"], marks["decode"]),
            _writing_step(tmp_path, "prefill:model_deploy", outs["prefill"], "p", "prefill"),
            _fake_step(tmp_path, "model_tool:combine", combine, [combined], graph=None),
        ],
    )
    result = job.run(spec)
    # Both transforms waited for each other, so they ran at once; the record keeps the
    # spec's order, and the combine saw both nets' outputs.
    assert [s["name"] for s in result["steps"]] == [s["name"] for s in spec["steps"]]
    assert all(s["passed"] for s in result["steps"])
    assert combined.read_text() == "d+p"
    # The step's log says which tools run at once.
    said = capsys.readouterr().out
    assert any(f"{a}:model_transform (beside {b}:model_transform)" in said
               for a, b in (("decode", "prefill"), ("prefill", "decode")))  # fmt: skip
    # One net at a time, the first transform waits in vain: the job fails on it.
    for path in [*marks.values(), *outs.values(), combined]:
        path.unlink()
    with pytest.raises(SystemExit, match="the other net never ran beside this one"):
        job.run({**spec, "parallel_nets": 1})


def test_transforms_run_one_at_a_time_each_beside_the_other_nets_deploy(tmp_path):
    """model_transform takes most of a net's peak: with ``one_at_a_time`` the second
    net's transform waits for the first's to end, and then runs beside the first net's
    deploy; ``chain_order`` gives the prefill net the first turn though the spec lists it
    last and its transform comes after a step of its own (the decode net's is ready
    first)."""
    ended = tmp_path / "prefill.transformed"
    started = tmp_path / "decode.transforming"
    transform_prefill = (
        f"import pathlib, time; time.sleep(0.3); pathlib.Path({str(ended)!r}).write_text('x')"
    )
    transform_decode = (
        f"import pathlib, sys; pathlib.Path({str(started)!r}).write_text('x')\n"
        f"if not pathlib.Path({str(ended)!r}).exists(): sys.exit('two transforms at once')\n"
    )
    deploy_prefill = (
        "import pathlib, sys, time\n"
        "end = time.monotonic() + 5\n"
        f"while not pathlib.Path({str(started)!r}).exists():\n"
        "    if time.monotonic() > end: sys.exit('no transform beside this deploy')\n"
        "    time.sleep(0.05)\n"
    )

    def step(net, stage, code):
        return {**_fake_step(tmp_path, f"{net}:model_{stage}", code, [], graph=net), "stage": stage}

    spec = {
        **_side_by_side_spec(tmp_path, [
            step("decode", "transform", transform_decode),
            step("decode", "deploy", "pass"),
            step("prefill", "calibration", "import time; time.sleep(0.3)"),
            step("prefill", "transform", transform_prefill),
            step("prefill", "deploy", deploy_prefill),
        ]),
        "one_at_a_time": ["transform"],
        "chain_order": ["prefill", "decode"],
    }  # fmt: skip
    result = job.run(spec)
    assert all(s["passed"] for s in result["steps"])
    # Without the rule both transforms start at once.
    ended.unlink()
    started.unlink()
    with pytest.raises(SystemExit, match="two transforms at once"):
        job.run({k: v for k, v in spec.items() if k != "one_at_a_time"})


def test_nets_starting_at_once_say_so_on_lines_of_their_own(tmp_path, monkeypatch):
    """print writes a line and its newline apart: a slow stream lets the other chain's
    line in between, as it once did in a BM1688 log ("...model_transformTPU-MLIR step")."""
    import io

    class SlowStream(io.StringIO):
        def write(self, text):
            written = super().write(text)
            if not text.endswith("\n"):
                time.sleep(0.3)  # the newline comes late
            return written

    said = SlowStream()
    monkeypatch.setattr(sys, "stdout", said)
    marks = {net: tmp_path / f"{net}.started" for net in ("decode", "prefill")}
    job.run(_side_by_side_spec(tmp_path, [
        _waiting_step(tmp_path, "decode", marks["decode"], marks["prefill"]),
        _waiting_step(tmp_path, "prefill", marks["prefill"], marks["decode"]),
    ]))  # fmt: skip
    steps = [line for line in said.getvalue().splitlines() if "TPU-MLIR step" in line]
    assert len(steps) == 2 and all(line.count("TPU-MLIR step") == 1 for line in steps)


def _net_step(net, stage):
    return {"name": f"{net}:{stage}", "graph": net, "stage": stage}


def test_the_time_left_is_judged_by_finished_steps_of_the_same_kind():
    steps = [
        _net_step("decode_0", "transform"), _net_step("decode_0", "deploy"),
        _net_step("decode_1", "transform"), _net_step("decode_1", "deploy"),
        _net_step("prefill_0", "transform"), _net_step("prefill_0", "deploy"),
        _net_step("prefill_1", "transform"), _net_step("prefill_1", "deploy"),
        {"name": "model_tool:combine", "graph": None, "stage": "combine"},
    ]  # fmt: skip
    passed = {"passed": True}
    # Nothing finished: nothing to judge a net's step by.
    assert job_estimates.time_left(steps, {}, {}, 1) is None
    records = {0: {**passed, "seconds": 10.0}, 1: {**passed, "seconds": 30.0}}
    # decode_1 as decode_0 took (40 s); the prefill nets by their stages in any variant
    # (2 x 40 s) until a prefill step finishes; the combine has nothing to go by.
    assert job_estimates.time_left(steps, records, {}, 1) == (120.0, ["combine"])
    # A running step counts what it has still to run; a failed step is no measure.
    assert job_estimates.time_left(steps, records, {2: 4.0}, 1) == (116.0, ["combine"])
    assert job_estimates.time_left(steps, {**records, 2: {"passed": False, "seconds": 1.0}}, {}, 1)
    # Finished prefill steps judge the prefill nets; two nets at a time halve the chains.
    records.update({4: {**passed, "seconds": 100.0}, 5: {**passed, "seconds": 300.0}})
    assert job_estimates.time_left(steps, records, {}, 1) == (440.0, ["combine"])
    assert job_estimates.time_left(steps, records, {}, 2) == (220.0, ["combine"])
    records.update({2: {**passed, "seconds": 10.0}, 3: {**passed, "seconds": 30.0}})
    records.update({6: {**passed, "seconds": 100.0}})
    assert job_estimates.time_left(steps, records, {7: 100.0}, 2) == (200.0, ["combine"])
    # Only what nothing judges is left: no figure (the combine is no "0 s left").
    records.update({7: {**passed, "seconds": 300.0}})
    assert job_estimates.time_left(steps, records, {}, 2) is None
    # A chunk's job runs its nets only: the other nets and the combine are not its time.
    records = {0: {**passed, "seconds": 10.0}, 1: {**passed, "seconds": 30.0}}
    assert job_estimates.time_left(steps, records, {}, 2, planned={0, 1, 4, 5}) == (40.0, [])


def test_the_cmodel_calls_left_are_judged_by_their_variant():
    calls = ["prefill", "decode", "decode", "decode"]
    assert job_estimates.calls_left(calls, {}) is None
    # A decode call has not run yet: a prefill call's minutes say nothing of it.
    assert job_estimates.calls_left(calls[1:], {"prefill": [120.0]}) is None
    assert job_estimates.calls_left(calls[2:], {"prefill": [120.0], "decode": [2.0, 4.0]}) == 6.0
    assert job_estimates.calls_left(calls, {"prefill": [120.0], "decode": [3.0]}) == 129.0


def test_a_jobs_later_steps_say_how_long_the_rest_should_take(tmp_path, capsys):
    steps = [
        _fake_step(tmp_path, f"{net}:model_deploy", "import time; time.sleep(0.7)", [], graph=net)
        for net in ("decode_0", "decode_1", "decode_2")
    ]
    result = job.run({"work_dir": str(tmp_path), "result": str(tmp_path / "r.json"),
                      "check_frontend": False, "steps": steps})  # fmt: skip
    first, second = (step["seconds"] for step in result["steps"][:2])
    lines = [line for line in capsys.readouterr().out.splitlines() if "TPU-MLIR step" in line]
    # Each deploy left is judged by the finished ones: two of the first's, then their mean.
    assert lines == [
        "TPU-MLIR step 1/3: decode_0:model_deploy",
        f"TPU-MLIR step 2/3 [about {first + first:.0f} s left]: decode_1:model_deploy",
        f"TPU-MLIR step 3/3 [about {(first + second) / 2:.0f} s left]: decode_2:model_deploy",
    ]
    assert first >= 0.7


def test_a_chunks_job_builds_its_nets_only_and_the_compile_takes_them_back(tmp_path):
    runs = tmp_path / "runs.txt"

    def net_steps(root, net):
        out = root / net / f"{net}.bmodel"
        code = (
            f"import pathlib; pathlib.Path({str(out)!r}).write_text({net!r}); "
            f"open({str(runs)!r}, 'a').write({net!r} + '\\n')"
        )
        return _fake_step(root / net, f"{net}:model_deploy", code, [out], graph=net)

    def spec(root, **extra):
        nets = ("decode_0", "decode_1", "prefill_0", "prefill_1")
        for net in nets:
            (root / net).mkdir(parents=True, exist_ok=True)
        combined = root / "combined.bmodel"
        ins = [str(root / net / f"{net}.bmodel") for net in nets]
        combine = (
            f"import pathlib; pathlib.Path({str(combined)!r}).write_text("
            f"'+'.join(pathlib.Path(p).read_text() for p in {ins!r}))"
        )
        steps = [net_steps(root, net) for net in nets]
        steps.append(_fake_step(root, "model_tool:combine", combine, [combined], graph=None))
        keys = {net: f"key-{net}" for net in nets}
        return {
            "work_dir": str(root / "work"), "result": str(root / "r.json"),
            "check_frontend": False, "steps": steps, **extra,
            "finished": {"dir": str(root / "store"), "root": str(root), "keys": keys},
        }  # fmt: skip

    # Chunk 1's job, staged elsewhere: its two nets, kept; no combine, no cmodel check.
    chunk = spec(tmp_path / "chunk1", only_nets=["decode_1", "prefill_1"], verify={"x": 1})
    result = job.run(chunk)
    assert [s["name"] for s in result["steps"]] == [
        "decode_1:model_deploy",
        "prefill_1:model_deploy",
    ]
    assert sorted(p.name for p in (tmp_path / "chunk1" / "store").iterdir()) == [
        "key-decode_1", "key-prefill_1"
    ]  # fmt: skip
    assert not (tmp_path / "chunk1" / "combined.bmodel").exists()
    # The compile finds chunk 1's nets in that job's store, builds chunk 0's and combines.
    runs.unlink()
    whole = tmp_path / "whole"
    ran = job.run({**spec(whole), "finished": {**spec(whole)["finished"],
                   "also": [str(tmp_path / "chunk1" / "store")]}})  # fmt: skip
    assert runs.read_text().split() == ["decode_0", "prefill_0"]
    assert (whole / "combined.bmodel").read_text() == "decode_0+decode_1+prefill_0+prefill_1"
    assert all(step["passed"] for step in ran["steps"])


def test_a_transform_waiting_its_turn_never_starts_after_a_failure(tmp_path):
    def transform(net, code):
        step = _fake_step(tmp_path, f"{net}:model_transform", code, [], graph=net)
        return {**step, "stage": "transform"}

    spec = {
        **_side_by_side_spec(tmp_path, [
            transform("decode", "import time; time.sleep(0.5); raise ValueError('bad graph')"),
            transform("prefill", "print('ran')"),
        ]),
        "one_at_a_time": ["transform"],
        "chain_order": ["decode", "prefill"],
    }  # fmt: skip
    with pytest.raises(SystemExit, match="decode:model_transform failed: ValueError: bad graph"):
        job.run(spec)
    recorded = json.loads((tmp_path / "r.json").read_text())
    assert [s["name"] for s in recorded["steps"]] == ["decode:model_transform"]


def test_a_failing_net_stops_the_job_before_any_later_step(tmp_path):
    started = tmp_path / "prefill_deploy_started"
    spec = _side_by_side_spec(tmp_path, [
        _fake_step(tmp_path, "decode:model_transform", "raise ValueError('bad graph')", []),
        _fake_step(tmp_path, "prefill:model_transform", "import time; time.sleep(1)", [],
                   graph="prefill"),
        _writing_step(tmp_path, "prefill:model_deploy", started, "", "prefill"),
        _fake_step(tmp_path, "model_tool:combine", "raise SystemExit(5)", [], graph=None),
    ])  # fmt: skip
    with pytest.raises(SystemExit, match="decode:model_transform failed: ValueError: bad graph"):
        job.run(spec)
    # The prefill transform already running finished; nothing after it started.
    recorded = json.loads((tmp_path / "r.json").read_text())
    assert [s["name"] for s in recorded["steps"]] == [
        "decode:model_transform",
        "prefill:model_transform",
    ]
    assert not started.exists()


def test_the_spec_runs_as_many_nets_at_once_as_the_step_has_cores(exports, tmp_path):
    both_nets = [exports / "prefill", exports / "decode"]
    one = _spec(both_nets, "bm1684x", "f16", tmp_path)
    two = _spec(both_nets, "bm1684x", "f16", tmp_path, threads=2)
    assert (one["parallel_nets"], two["parallel_nets"]) == (1, 2)
    # One model_transform at a time, the prefill net's chain first.
    assert two["one_at_a_time"] == ["transform"]
    variants = {g["net"]: g["variant"] for g in two["graphs"]}
    assert [variants[net] for net in two["chain_order"]] == ["prefill", "decode"]
    assert {k: v for k, v in one.items() if k != "parallel_nets"} == {
        k: v for k, v in two.items() if k != "parallel_nets"
    }
    # Cores given to each tool's own threads count against the step's.
    wide = _spec(both_nets, "bm1684x", "f16", tmp_path, threads=2,
                 options=_options("bm1684x", threads=2))  # fmt: skip
    assert (wide["parallel_nets"], wide["threads"]) == (1, 2)


def test_tool_environment_preloads_the_system_libc():
    env = job.tool_environment(2)
    assert env["OMP_NUM_THREADS"] == "2"
    assert env["PATH"].split(os.pathsep)[0] == os.path.dirname(sys.executable)
    preload = env.get("LD_PRELOAD", "").split()
    assert any(os.path.basename(p).startswith("libc") for p in preload)
    assert all(os.path.isfile(p) for p in preload)


def _bmodel_bytes(*times: bytes) -> bytes:
    """The layout model_tool 1.30.2 writes: 64-byte header (magic, header size,
    flatbuffer size), then the flatbuffer holding the ctime() string (length 25)."""
    body = b"\x00" * 8 + b"".join(b"\x19\x00\x00\x00" + t + b"\n\x00" for t in times)
    body += b"\x00" * 6
    header = struct.pack("<III", 0xFF55AAEE, 64, len(body)).ljust(64, b"\x00")
    return header + body + b"weights, also 'Mon Jan  5 10:00:00 2026\n' outside the flatbuffer"


def test_pin_build_time_makes_builds_identical(tmp_path, monkeypatch):
    monkeypatch.delenv("SOURCE_DATE_EPOCH", raising=False)
    first, second = tmp_path / "a.bmodel", tmp_path / "b.bmodel"
    first.write_bytes(_bmodel_bytes(b"Sun Nov 22 04:13:18 2026"))
    second.write_bytes(_bmodel_bytes(b"Sun Nov 22 04:17:29 2026"))
    size = first.stat().st_size
    assert pin_build_time(first) == "Thu Jan  1 00:00:00 1970"
    assert pin_build_time(second) == "Thu Jan  1 00:00:00 1970"
    assert first.read_bytes() == second.read_bytes()
    assert first.stat().st_size == size
    assert b"Mon Jan  5 10:00:00 2026" in first.read_bytes()  # the payload is untouched
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    assert pin_build_time(first) == "Tue Nov 14 22:13:20 2023"
    assert b"\x19\x00\x00\x00Tue Nov 14 22:13:20 2023\n" in first.read_bytes()


def test_pin_build_time_refuses_what_it_does_not_recognise(tmp_path):
    path = tmp_path / "x.bmodel"
    path.write_bytes(b"\x00" * 128)
    with pytest.raises(NpuforgeError, match="not a bmodel"):
        pin_build_time(path)
    for times in ([], [b"Sun Nov 22 04:13:18 2026"] * 2):
        path.write_bytes(_bmodel_bytes(*times))
        with pytest.raises(NpuforgeError, match=f"found {len(times)}"):
            pin_build_time(path)


def test_compile_leaves_no_output_when_the_toolchain_fails(exports, tmp_path):
    stamp = tmp_path / "stamp.json"
    # A "toolchain" without tpu_mlir: the job must stop at its front-end check.
    stamp.write_text(
        json.dumps(
            {"backend": "tpumlir", "runtime": "native", "python": sys.executable, "versions": {}}
        )
    )
    with pytest.raises(NpuforgeError, match="tpu_mlir is not installed"):
        tpumlir.compile(
            _request(
                [exports / "decode", exports / "prefill"],
                "bm1684x",
                "f16",
                tmp_path,
                toolchain=stamp,
            )  # fmt: skip
        )
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["stamp.json"]


# ---------------------------------------------------------------- recurrent verification


def test_verification_runs_prefill_then_decode_on_held_out_text(exports, tmp_path):
    """One prefill call of T held-out tokens, then decode calls carrying its states; the
    reference is the same run on onnxruntime. RWKV's prefill of T tokens equals T decode
    steps, so the reference must equal a decode-only run over the same tokens."""
    from npuforge.runtime import GraphChain

    loaded = base.load_exports([exports / "decode", exports / "prefill"], "tpumlir")
    schedule = base.verification_schedule(loaded, PREFILL_TOKENS + 5)
    ids = base.verification_tokens(PREFILL_TOKENS + 5, loaded["decode"])["ids"]
    calls = base.write_call_feeds(loaded, schedule, ids, tmp_path)
    reference = base.reference_logits(loaded, schedule, ids)
    assert [c["variant"] for c in calls] == ["prefill"] + ["decode"] * 5
    assert [c["position"] for c in calls] == [0] + list(range(8, 13))
    fed = [np.load(c["feeds"])["chunk0/tokens"].ravel().tolist() for c in calls]
    assert sum(fed, []) == ids[: PREFILL_TOKENS + 5]
    # Host-fed inputs only: the job carries the states itself.
    assert all(list(np.load(c["feeds"]).files) == ["chunk0/tokens"] for c in calls)
    assert reference.shape == (PREFILL_TOKENS + 5, 1024)
    chain = GraphChain(exports / "decode")
    decoded = np.concatenate([chain.step([[t]]).reshape(1, -1) for t in ids[:-1]])
    assert np.abs(reference - decoded).max() <= 1e-4 * np.abs(decoded).max()
    # Without a prefill net: decode calls only.
    decode_only = {"decode": loaded["decode"]}
    assert [c.variant for c in base.verification_schedule(decode_only, 3)] == ["decode"] * 3


def test_floors_per_precision():
    for target in ("bm1684x", "bm1688"):
        options = _options(target)
        assert gate.floors_for(tpumlir.FLOORS, options, "f16", "synthetic") == {
            "min_cosine": 0.9999
        }
        trained = gate.floors_for(tpumlir.FLOORS, options, "f16", "trained")
        assert trained == gate.TRAINED_FLOORS["f16"]
        assert gate.floors_for(tpumlir.FLOORS, options, "int8", "trained") == {
            "min_top1": 0.95,
            "max_perplexity_delta": 0.03,
        }
    floors = gate.floors_for(
        tpumlir.FLOORS, _options("bm1684x", min_cosine=0.5), "w4f16", "trained"
    )
    assert floors == {"min_top1": 0.90, "max_perplexity_delta": 0.10, "min_cosine": 0.5}
    only_f16 = _options("bm1684x", min_cosine={"f16": 0.5})
    # An f16 override leaves bf16 alone; trained bf16 is held to the 16-bit float figures.
    assert gate.floors_for(tpumlir.FLOORS, only_f16, "bf16", "trained") == {
        "min_cosine": 0.999,
        "min_top1": 0.99,
        "max_perplexity_delta": 0.005,
    }
    assert gate.floors_for(tpumlir.FLOORS, only_f16, "bf16", "synthetic") == tpumlir.FLOORS["bf16"]


def _fake_toolchain(exports, tmp_path, perturb, prefill_calls=1):
    """A compile request whose "job" writes a bmodel, its result and the simulator logits,
    which are the onnxruntime reference run's logits through ``perturb``."""
    positions = PREFILL_TOKENS * prefill_calls + 4

    def run_job(stamp_path, spec_path, read_only, writable, log_path):
        spec = json.loads(Path(spec_path).read_text())
        Path(spec["bmodel"]).write_bytes(_bmodel_bytes(b"Sun Nov 22 04:13:18 2026"))
        Path(spec["result"]).write_text(json.dumps({"versions": {}, "steps": []}))
        (Path(spec["work_dir"]) / "logs").mkdir(exist_ok=True)
        loaded = base.load_exports([exports / "decode", exports / "prefill"], "tpumlir")
        schedule = base.verification_schedule(loaded, positions, prefill_calls)
        ids = base.verification_tokens(positions, loaded["decode"])["ids"]
        np.save(spec["verify"]["outputs"], perturb(base.reference_logits(loaded, schedule, ids)))

    stamp = tmp_path / "stamp.json"
    stamp.write_text(json.dumps({"backend": "tpumlir", "runtime": "native", "python": "py"}))
    return _request(
        [exports / "decode", exports / "prefill"], "bm1684x", "f16", tmp_path,
        options=_options(
            "bm1684x", verify_steps=positions, verify_prefill_calls=prefill_calls
        ),
        toolchain=stamp, job_runner=run_job,
    )  # fmt: skip


def test_simulator_logits_are_recorded(exports, tmp_path):
    request = _fake_toolchain(exports, tmp_path, lambda ref: ref.copy())
    figures = tpumlir.compile(request)["verification"]
    assert figures["cosine"] == 1.0 and figures["top1_agreement"] == 1.0
    assert figures["positions"] == PREFILL_TOKENS + 4
    assert figures["calls"] == {"decode": 4, "prefill": 1}
    assert figures["floors"] == tpumlir.FLOORS["f16"] and figures["passed"] is True
    assert figures["perplexity"]["delta"] == 0.0
    assert figures["prefill"]["positions"] == PREFILL_TOKENS
    assert figures["decode"]["positions"] == 4
    written = json.loads((tmp_path / "out" / "compile.json").read_text())
    assert written["verification"] == json.loads(json.dumps(figures))


def test_a_second_prefill_call_continues_from_the_first_calls_state(exports, tmp_path):
    """verify_prefill_calls: 2 runs the prefill net again from the state it left (a
    prompt longer than one call), so its state inputs are checked on real values, not
    only on zeros; those rows get figures of their own and count in the gate."""
    from npuforge.runtime import GraphChain

    loaded = base.load_exports([exports / "decode", exports / "prefill"], "tpumlir")
    positions = 2 * PREFILL_TOKENS + 4
    schedule = base.verification_schedule(loaded, positions, prefill_calls=2)
    assert [(c.variant, c.position, c.tokens) for c in schedule] == [
        ("prefill", 0, PREFILL_TOKENS),
        ("prefill", PREFILL_TOKENS, PREFILL_TOKENS),
    ] + [("decode", p, 1) for p in range(2 * PREFILL_TOKENS, positions)]
    with pytest.raises(NpuforgeError, match=r"after 2 8-token prefill call\(s\); raise "):
        base.verification_schedule(loaded, 2 * PREFILL_TOKENS, prefill_calls=2)
    # The reference carries the state from call to call: it equals decoding token by token.
    ids = base.verification_tokens(positions, loaded["decode"])["ids"]
    reference = base.reference_logits(loaded, schedule, ids)
    chain = GraphChain(exports / "decode")
    decoded = np.concatenate([chain.step([[t]]).reshape(1, -1) for t in ids[:-1]])
    assert np.abs(reference - decoded).max() <= 1e-4 * np.abs(decoded).max()

    figures = tpumlir.compile(_fake_toolchain(exports, tmp_path, np.copy, 2))["verification"]
    assert figures["calls"] == {"decode": 4, "prefill": 2} and figures["passed"] is True
    assert figures["prefill"]["positions"] == 2 * PREFILL_TOKENS
    assert figures["prefill_from_state"]["positions"] == PREFILL_TOKENS
    assert figures["decode"]["positions"] == 4

    def second_call_drifts(ref):
        out = ref.copy()
        out[PREFILL_TOKENS + 3] = np.roll(out[PREFILL_TOKENS + 3], 1)
        return out

    shutil.rmtree(tmp_path / "out", ignore_errors=True)
    with pytest.raises(NpuforgeError, match="cosine .* < 0.9999;"):
        tpumlir.compile(_fake_toolchain(exports, tmp_path, second_call_drifts, 2))
    assert not (tmp_path / "out").exists()


def test_simulator_logits_below_the_floor_fail_without_output(exports, tmp_path):
    def drift(ref):
        # One decode step far off: cosine well below the fp16 floor on that token only.
        out = ref.copy()
        out[-1] = np.roll(out[-1], 1)
        return out

    request = _fake_toolchain(exports, tmp_path, drift)
    with pytest.raises(NpuforgeError, match="cosine .* < 0.9999;") as failed:
        tpumlir.compile(request)
    assert "\n" not in str(failed.value)
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stamp.json"]


def test_image_jobs_link_their_chips_cmodel_in_private_tmp(tmp_path):
    """TPU-MLIR selects a chip by re-linking libcmodel.so in its package, which a job
    cannot write in the image: there the links point into the container's /tmp and the
    job links its chip's files; a native venv's own links are left to TPU-MLIR."""
    lib, chip = tmp_path / "tpu_mlir" / "lib", tmp_path / "tpumlir-chip"
    lib.mkdir(parents=True)
    for name in ("libcmodel_bm1684x.so", "libcmodel_bm1688.so", "libbmlib_bm1684x.so.0"):
        (lib / name).write_bytes(name.encode())
    (lib / "libcmodel.so").symlink_to(lib / "libcmodel_bm1684x.so")
    assert job.select_chip_libraries("bm1688", lib, chip) is False
    assert not chip.exists()

    (lib / "libcmodel.so").unlink()
    (lib / "libcmodel.so").symlink_to(chip / "libcmodel.so")
    (lib / "libbmlib.so.0").symlink_to(chip / "libbmlib.so.0")
    for processor in ("bm1688", "bm1684x"):
        assert job.select_chip_libraries(processor, lib, chip) is True
        assert (lib / "libcmodel.so").read_bytes() == f"libcmodel_{processor}.so".encode()
        assert (lib / "libbmlib.so.0").read_bytes() == b"libbmlib_bm1684x.so.0"
    with pytest.raises(SystemExit, match="no cmodel for bm1690"):
        job.select_chip_libraries("bm1690", lib, chip)


def test_compile_record_lists_bmodel_states_and_similarity(exports, tmp_path):
    state = tmp_path / "chat.pth"
    state.write_bytes(b"state")
    spec = _spec(
        [exports / "decode", exports / "prefill"], "bm1688", "w4f16", tmp_path,
        state_files=[state],
    )  # fmt: skip
    (tmp_path / "out").mkdir()
    Path(spec["bmodel"]).write_bytes(b"bmodel")
    (tmp_path / "out" / "chat.pth").write_bytes(b"state")
    [cmp] = job.parse_comparisons(NPZ_COMPARE_LOG)
    worse = json.loads(json.dumps(cmp))
    worse["tensors"]["logits"]["cosine"] = 0.995
    result = {
        "versions": {"tpu_mlir": "1.30.2"},
        "steps": [
            {"name": "decode:model_deploy", "passed": True, "comparisons": [cmp]},
            {"name": "prefill:model_deploy", "passed": True, "comparisons": [worse]},
            {"name": "model_tool:combine", "passed": True, "comparisons": []},
        ],
    }
    stamp = {"runtime": "native", "versions": {"tpu_mlir": "1.30.2", "torch": "2.11.0+cpu"}}
    record = tpumlir_record.compile_record(spec, result, stamp, _options("bm1688"), None)
    assert [(a["file"], a["role"]) for a in record["artifacts"]] == [
        ("bm1688_w4f16.bmodel", "binary"),
        ("chat.pth", "state"),
    ]
    assert record["artifacts"][0]["nets"] == ["decode", "prefill"]
    assert record["verification"]["tpumlir"]["cosine"] == 0.995
    assert record["verification"]["tpumlir"]["passed"] is True
    positions = {"prefill": PREFILL_TOKENS, "decode": 2 * PREFILL_TOKENS}
    assert record["verification"]["tpumlir"]["test_input_positions"] == positions
    assert set(record["verification"]["tpumlir"]["similarity"]) == {
        "decode:model_deploy",
        "prefill:model_deploy",
    }
    assert record["toolchain"]["versions"]["tpu_mlir"] == "1.30.2"
    assert record["options"]["quantize"] == "W4F16"
    assert [n["tokens_per_call"] for n in record["nets"]] == [1, PREFILL_TOKENS]


def test_cli_refuses_a_precision_without_a_quantize_mode(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            str(REPO / "workflow_scripts" / "compile.py"),
            "--backend",
            "tpumlir",
            "--export",
            str(tmp_path),
            "--target",
            "BM1688",
            "--target-options",
            json.dumps(backends.options_dict(_options("bm1688"))),
            "--precision",
            "w8a8",
            "--toolchain",
            str(tmp_path / "s.json"),
            "--out-dir",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert out.returncode == 2
    assert out.stderr.startswith("error: precision 'w8a8' has no TPU-MLIR quantize mode")


def test_cli_refuses_chunk_jobs_for_a_backend_that_compiles_in_one_job(tmp_path):
    out = subprocess.run(
        [sys.executable, str(REPO / "workflow_scripts" / "compile.py"), "--backend", "rknn",
         "--export", str(tmp_path), "--target", "RK3588", "--precision", "fp16",
         "--only-chunk", "1", "--out-dir", str(tmp_path / "o")],
        capture_output=True, text=True, cwd=REPO,
    )  # fmt: skip
    assert out.returncode == 2 and not (tmp_path / "o").exists()
    assert out.stderr == (
        "error: the rknn backend compiles every chunk in one job: drop --only-chunk and "
        "--chunk-build\n"
    )


def test_a_chunk_job_outside_the_export_is_refused(exports, tmp_path):
    request = base.CompileRequest(
        exports=[exports / "decode", exports / "prefill"], target="BM1684X",
        options=_options("bm1684x"), precision="f16", out_dir=tmp_path / "o",
        toolchain=tmp_path / "stamp.json", only_chunk=1,
    )  # fmt: skip
    (tmp_path / "stamp.json").write_text(json.dumps({"backend": "tpumlir", "runtime": "native"}))
    with pytest.raises(
        NpuforgeError, match=r"chunk 1 of an export in 1 chunks: pass --only-chunk 0 to 0"
    ):
        tpumlir.compile(request)
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------- toolchain check


def test_unavailable_reason_names_the_missing_python(tmp_path):
    reason = tpumlir.unavailable_reason("native", _options("bm1684x", python=str(tmp_path / "p")))
    assert "CPython 3.10" in reason and "not runnable" in reason
    reason = tpumlir.unavailable_reason("native", _options("bm1684x", python=sys.executable))
    assert f"is Python {sys.version_info[0]}.{sys.version_info[1]}" in reason


def test_native_python_is_named_by_option_then_environment(monkeypatch):
    monkeypatch.setenv("PYTHON310", "/opt/py310/bin/python3.10")
    named = _options("bm1684x", python="/srv/python3.10")
    assert tpumlir_env.native_python(named) == "/srv/python3.10"
    assert tpumlir_env.native_python(_options("bm1684x")) == "/opt/py310/bin/python3.10"


def _python310():
    try:
        python = tpumlir_env.native_python(_options("bm1684x"))
    except NpuforgeError:
        return None
    return python if tpumlir_env._python_version(python) == "3.10" else None


def test_native_toolchain_needs_only_cpython_310(tmp_path, monkeypatch):
    python = _python310()
    if python is None:
        pytest.skip("no CPython 3.10 on this machine: the native check refuses, as tested above")
    # No wheel directory, no other pre-installed file: the lock's packages come from the index.
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    assert tpumlir.unavailable_reason("native", _options("bm1684x")) is None
    assert tpumlir.unavailable_reason("native", _options("bm1684x", python=python)) is None


def test_image_takes_the_native_routes_cpython_without_its_packages_or_bytecode(tmp_path):
    python = _python310()
    if python is None:
        pytest.skip("no CPython 3.10 on this machine: the image has no interpreter to copy")
    named, labels = tpumlir_env.image_build_contexts(_options("bm1684x"), tmp_path / "a")
    prefix = named["python310"]
    assert (prefix / "bin" / "python3.10").is_file()
    assert (prefix / "lib" / "python3.10" / "os.py").is_file()
    assert (prefix / "lib" / "python3.10" / "ensurepip").is_dir()  # venv needs it
    assert not (prefix / "lib" / "python3.10" / "site-packages").exists()
    assert not list(prefix.rglob("__pycache__"))
    assert (prefix / "bin" / "python3").is_symlink()
    version = subprocess.run(
        [python, "-c", "import platform; print(platform.python_version())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert labels["npuforge.python310.version"] == version
    # The tree hash names the copy: the same interpreter staged again gives the same one.
    _, again = tpumlir_env.image_build_contexts(_options("bm1684x"), tmp_path / "b")
    assert again == labels and len(labels["npuforge.python310.sha256"]) == 64


def test_image_refusal_names_the_missing_python(monkeypatch, tmp_path):
    monkeypatch.setattr(tpumlir_env, "_image_built", lambda runtime: False)
    reason = tpumlir.unavailable_reason("podman", _options("bm1684x", python=str(tmp_path / "p")))
    assert reason.startswith(
        f"the TPU-MLIR image copies CPython 3.10 from this machine but {tmp_path / 'p'} is "
        "not runnable: name a 3.10 interpreter with $PYTHON310"
    )
    reason = tpumlir.unavailable_reason("docker", _options("bm1684x", python=sys.executable))
    assert f"{sys.executable} is Python {sys.version_info[0]}.{sys.version_info[1]}" in reason
    # Once the image is built, the machine's interpreter no longer matters.
    monkeypatch.setattr(tpumlir_env, "_image_built", lambda runtime: True)
    assert tpumlir.unavailable_reason("podman", _options("bm1684x", python="/nope")) is None


def test_lock_pins_and_hashes_every_package():
    text = (REPO / "envs" / "tpumlir" / "requirements.lock").read_text().replace("\\\n", " ")
    entries = [line.split() for line in text.splitlines() if line and not line.startswith("#")]
    names = set()
    for requirement, *options in entries:
        name, _, version = requirement.partition("==")
        assert version and not set(version) & set("<>=*, "), requirement
        hashes = [o for o in options if o.startswith("--hash=sha256:")]
        assert hashes and all(len(h) == len("--hash=sha256:") + 64 for h in hashes), requirement
        names.add(name.lower().replace("_", "-"))
    assert {"tpu-mlir", "torch", "psutil"} <= names
    # torch 1.12.1 carries its CUDA libraries inside its wheel: no CUDA package is needed.
    assert not {name for name in names if name.startswith(("nvidia-", "cuda-", "triton"))}


# ---------------------------------------------------------------- the real toolchain


@pytest.fixture(scope="module")
def tpumlir_stamp(tmp_path_factory):
    """The native TPU-MLIR toolchain's stamp in a results directory, prepared as the
    workflow's prepare_toolchain rule does: the venv is built from the lock on the first
    run on a machine (minutes) and reused after."""
    reason = tpumlir.unavailable_reason("native", _options("bm1684x"))
    if reason:
        pytest.skip(f"no native TPU-MLIR toolchain here: {reason}")
    stamp = tmp_path_factory.mktemp("tpumlir_results") / "toolchains" / "tpumlir-native.json"
    toolchain.prepare("tpumlir", "native", stamp, target_options=_options("bm1684x"))
    return stamp


@pytest.fixture(scope="module")
def toolchain_python(tpumlir_stamp):
    return Path(toolchain.read_stamp(tpumlir_stamp)["python"])


@pytest.mark.toolchain
def test_prepared_env_has_the_locked_versions_and_the_doctor_lists_it(tpumlir_stamp):
    from npuforge import doctor

    row = doctor.probe("tpumlir", "native", tpumlir_stamp.parents[1])
    assert row["found"] is True and row["note"] is None
    versions = row["versions"]
    assert versions["python"].startswith("3.10.") and versions["tpu_mlir"] == "1.30.2"
    assert versions["torch"] == "1.12.1" and versions["numpy"] == "1.24.3"
    # The CUDA build of torch imports (its libraries are inside its wheel) and computes on
    # the CPU, which is all TPU-MLIR's ONNX front end asks of it.
    python = toolchain.read_stamp(tpumlir_stamp)["python"]
    code = "import torch; print(torch.tensor([1.5]).numpy()[0])"
    ran = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0 and ran.stdout.split() == ["1.5"], ran.stderr[-1500:]


@pytest.mark.toolchain
def test_flags_exist_in_the_real_tools(tmp_path, toolchain_python):
    python = toolchain_python
    inputs = [{"name": "tokens", "shape": [1, 1], "dtype": "int64"}]
    ours = {
        "model_transform.py": tpumlir_commands.transform_command("d", "m", inputs, "i", "r", "m"),
        "model_deploy.py": tpumlir_commands.deploy_command(
            "m", "W4F16", "bm1688", "i", "r", "0.99,0.9", "o", calibration_table="t"
        ),
    }
    code = (
        "import importlib.util, subprocess, sys; "
        f"spec = importlib.util.spec_from_file_location('j', {str(tpumlir.JOB_SCRIPT)!r}); "
        "j = importlib.util.module_from_spec(spec); spec.loader.exec_module(j); "
        "sys.exit(subprocess.run([sys.argv[1], '--help'], env=j.tool_environment(1)).returncode)"
    )
    for tool, argv in ours.items():
        out = subprocess.run(
            [str(python), "-c", code, tool], capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stdout[-1500:] + out.stderr[-1500:]
        for flag in _flags(argv):
            assert flag in out.stdout, f"{tool} has no {flag}"
    # quantize modes and processors we emit are among the tool's choices
    out = subprocess.run(
        [str(python), "-c", code, "model_deploy.py"], capture_output=True, text=True, timeout=120
    )
    for word in [*tpumlir.QUANTIZE.values(), *tpumlir.PROCESSORS]:
        assert word in out.stdout


# A top MLIR built with TPU-MLIR's own TpuLang API: its ONNX front end needs torch,
# TpuLang does not, so model_deploy and model_tool run for real wherever tpu_mlir is.
TPULANG_GRAPH = """
import sys, numpy as np, tpu_mlir
sys.path.insert(0, tpu_mlir.package_path + "/python")
import transform.TpuLang as tpul
from transform.TpuLangConverter import TpuLangConverter
from utils.mlir_shell import mlir_opt_for_top
from tools.model_runner import mlir_inference
name = sys.argv[1]
rng = np.random.default_rng(0)
tpul.init("bm1684x")
x = tpul.Tensor(dtype="float32", shape=[1, 32], name="x")
w = tpul.Tensor(dtype="float32", shape=[32, 16], ttype="coeff", name="w",
                data=(rng.standard_normal((32, 16)) * 0.1).astype(np.float32))
y = tpul.tanh(tpul.matmul(x, w, out_name="mm"), out_name="y")
tpul.TpuLang.graph.inputs, tpul.TpuLang.graph.outputs = [x], [y]
converter = TpuLangConverter(name=name, graph=tpul.TpuLang.graph, mode="f32")
converter.generate_mlir(name + "_origin.mlir")
mlir_opt_for_top(name + "_origin.mlir", name + ".mlir")
inputs = {"x": rng.standard_normal((1, 32)).astype(np.float32)}
np.savez("in.npz", **inputs)
np.savez(name + "_top_outputs.npz", **mlir_inference(inputs, name + ".mlir", dump_all=False))
"""


def _run_job(python, spec: dict, spec_path: Path, timeout=600):
    """The TPU-MLIR job script over ``spec`` (written to ``spec_path``) in the toolchain."""
    spec_path.write_text(json.dumps(spec))
    return subprocess.run(
        [str(python), str(tpumlir.JOB_SCRIPT), str(spec_path)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _tool_run(python, argv, cwd):
    code = (
        "import importlib.util, subprocess, sys; "
        f"spec = importlib.util.spec_from_file_location('j', {str(tpumlir.JOB_SCRIPT)!r}); "
        "j = importlib.util.module_from_spec(spec); spec.loader.exec_module(j); "
        "sys.exit(subprocess.run(sys.argv[1:], env=j.tool_environment(2)).returncode)"
    )
    return subprocess.run(
        [str(python), "-c", code, *map(str, argv)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.toolchain
def test_real_w4f16_keeps_a_q4_1_checkpoint_exact_with_group_offsets(
    q4_1_llama, tmp_path, toolchain_python
):
    """TPU-MLIR's W4F16 stores an integer zero point per group: with the minima split
    out, the grid it picks is the checkpoint's own and its INT4 graph matches the fp32
    graph to fp16 rounding. The plain export, in the same groups of 32, does not (~8 %
    of each weight lost: logits cosine 0.9967 measured)."""
    options = _options("bm1688", tolerance={"w4f16": "0.99999,0.99"})

    def deploy(export):
        spec = _spec([q4_1_llama / export], "bm1688", "w4f16", tmp_path, export, options=options)
        spec["steps"] = [s for s in spec["steps"] if s["stage"] != "combine"]
        if export == "plain":  # the same groups as the split export
            step = next(s for s in spec["steps"] if s["stage"] == "deploy")
            step["argv"][step["argv"].index("--q_group_size") + 1] = "32"
        (tmp_path / f"{export}.json").write_text(json.dumps(spec))
        ran = subprocess.run(
            [str(toolchain_python), str(tpumlir.JOB_SCRIPT), str(tmp_path / f"{export}.json")],
            capture_output=True,
            text=True,
            timeout=900,
        )
        result = json.loads(Path(spec["result"]).read_text())
        step = next(step for step in result["steps"] if step["name"] == "decode:model_deploy")
        # tpu MLIR (INT4 weights) vs top MLIR (fp32) first.
        return ran, step["comparisons"][0]["tensors"]

    ran, tensors = deploy("split")
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    assert tensors and all(t["cosine"] >= 0.99999 for t in tensors.values())
    ran, tensors = deploy("plain")
    assert ran.returncode != 0 and "decode:model_deploy failed" in ran.stderr
    assert tensors["logits_MatMul"]["cosine"] < 0.999


@pytest.mark.toolchain
def test_real_deploy_gate_and_combine(tmp_path, toolchain_python):
    python = toolchain_python
    nets = ("decode", "prefill")
    for net in nets:
        (tmp_path / net).mkdir()
        made = _tool_run(python, [python, "-c", TPULANG_GRAPH, net], tmp_path / net)
        assert made.returncode == 0, made.stdout[-1500:] + made.stderr[-1500:]

    def deploy_step(net, quantize, tolerance, root=tmp_path):
        d = root / net
        bmodel = d / f"{net}_{quantize}.bmodel"
        argv = tpumlir_commands.deploy_command(
            d / f"{net}.mlir",
            quantize,
            "bm1684x",
            d / "in.npz",
            d / f"{net}_top_outputs.npz",
            tolerance,
            bmodel,
        )
        return bmodel, {
            "name": f"{net}:model_deploy",
            "graph": net,
            "stage": "deploy",
            "cwd": str(d),
            "argv": argv,
            "expects": [str(bmodel)],
        }

    steps, bmodels = [], []
    for net in nets:
        bmodel, step = deploy_step(net, "F16", "0.99,0.90")
        steps.append(step)
        bmodels.append(bmodel)
    combined = tmp_path / "combined.bmodel"
    steps.append(
        {
            "name": "model_tool:combine",
            "graph": None,
            "stage": "combine",
            "cwd": str(tmp_path),
            "argv": tpumlir_commands.combine_command(bmodels, combined),
            "expects": [str(combined)],
        }
    )
    spec = {
        "work_dir": str(tmp_path / "work"),
        "result": str(tmp_path / "result.json"),
        "threads": 2,
        "check_frontend": False,
        "steps": steps,
    }

    def files(net):
        return {p.name for p in (tmp_path / net).rglob("*") if p.is_file()}

    inputs = {net: files(net) for net in nets}
    ran = _run_job(python, spec, tmp_path / "spec.json")
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    # A passed net keeps its inputs and its bmodel, none of what model_deploy made on the
    # way (its TPU MLIR, weight files, the compiler's directory).
    for net, bmodel in zip(nets, bmodels, strict=True):
        assert files(net) == inputs[net] | {bmodel.name}, net
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["versions"]["tpu_mlir"]
    for step in result["steps"][:2]:
        # tpu MLIR vs top MLIR (figures), then the bmodel on the simulator vs tpu MLIR.
        first, second = step["comparisons"]
        assert first["passed"] and first["tensors"]["y"]["cosine"] >= 0.99
        assert second["passed"] and second["target"].endswith("_model_outputs.npz")
    info = _tool_run(python, ["model_tool", "--info", combined], tmp_path)
    assert "net 0: [decode]" in info.stdout and "net 1: [prefill]" in info.stdout

    # A compile stopped in its second net builds only that net again: the first net's
    # chain is kept under its key (the host's; made up here) and taken back, and the
    # combined bmodel is the one-go build's, byte for byte.
    def run_job(spec):
        (tmp_path / "spec.json").write_text(json.dumps(spec))
        return subprocess.run(
            [str(python), str(tpumlir.JOB_SCRIPT), str(tmp_path / "spec.json")],
            capture_output=True,
            text=True,
            timeout=600,
        )

    from npuforge.backends.bmodel import pin_build_time  # as compile() does: it holds a clock

    pin_build_time(combined)
    one_go = combined.read_bytes()
    store = tmp_path / "finished"
    keys = {"decode": "decode-key", "prefill": "prefill-key"}
    store.mkdir()
    for built in [*bmodels, combined]:
        built.unlink()
    _, failing = deploy_step("prefill", "BF16", "0.999999999,0.999999999")
    stopped = {**spec, "steps": [steps[0], failing, steps[2]]}
    stopped["finished"] = {"dir": str(store), "root": str(tmp_path), "keys": keys}
    assert run_job(stopped).returncode != 0
    assert sorted(p.name for p in store.iterdir()) == ["decode-key"]
    bmodels[0].unlink()
    ran = run_job({**spec, "finished": stopped["finished"]})
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    assert "TPU-MLIR net decode: built by an earlier run" in ran.stdout
    assert "decode:model_deploy" not in ran.stdout and "prefill:model_deploy" in ran.stdout
    pin_build_time(combined)
    assert combined.read_bytes() == one_go

    # A chunk's job (the workflow's compile_chunk) builds the decode net alone, staged at
    # another path, into a store of its own; the compile takes it back from there and
    # builds the rest: the one-go build's bytes again.
    there = tmp_path / "a-chunk-job-staged-at-another-path"
    for net in nets:
        shutil.copytree(tmp_path / net, there / net, ignore=shutil.ignore_patterns("*.bmodel"))
    steps_there = [deploy_step(net, "F16", "0.99,0.90", there)[1] for net in nets]
    steps_there.append({**steps[2], "cwd": str(there), "argv": tpumlir_commands.combine_command(
        [there / net / b.name for net, b in zip(nets, bmodels, strict=True)], there / "c.bmodel"
    ), "expects": [str(there / "c.bmodel")]})  # fmt: skip
    chunk_store = tmp_path / "chunk-store"
    chunk_job = {
        **spec, "steps": steps_there, "work_dir": str(there / "work"),
        "result": str(there / "r.json"), "only_nets": ["decode"],
        "finished": {"dir": str(chunk_store), "root": str(there), "keys": keys},
    }  # fmt: skip
    ran = run_job(chunk_job)
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    assert sorted(p.name for p in chunk_store.iterdir()) == ["decode-key"]
    assert not (there / "c.bmodel").exists() and "prefill:model_deploy" not in ran.stdout
    for built in [*bmodels, combined]:
        built.unlink()
    fresh = {"dir": str(tmp_path / "empty"), "root": str(tmp_path), "keys": keys}
    ran = run_job({**spec, "finished": {**fresh, "also": [str(chunk_store)]}})
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    assert "TPU-MLIR net decode: built by its chunk's job, reused" in ran.stdout
    assert "prefill:model_deploy" in ran.stdout
    pin_build_time(combined)
    assert combined.read_bytes() == one_go

    # The similarity check gates the build: BF16 cannot reach a cosine of 1 - 1e-9.
    _, strict = deploy_step("decode", "BF16", "0.999999999,0.999999999")
    spec["steps"], spec["result"] = [strict], str(tmp_path / "strict.json")
    spec.pop("finished", None)
    (tmp_path / "strict_spec.json").write_text(json.dumps(spec))
    ran = subprocess.run(
        [str(python), str(tpumlir.JOB_SCRIPT), str(tmp_path / "strict_spec.json")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert ran.returncode != 0
    assert "decode:model_deploy failed" in ran.stderr
    assert json.loads((tmp_path / "strict.json").read_text())["steps"][0]["passed"] is False


def test_a_failed_steps_log_is_echoed_last(tmp_path, capsys):
    logs = tmp_path / "logs"
    logs.mkdir()
    for name in ("00_decode_model_transform", "02_decode_model_deploy", "04_prefill_cali"):
        (logs / f"{name}.log").write_text(f"output of {name}\n")
    (tmp_path / "toolchain.log").write_text("toolchain output\n")
    step_log = logs / "02_decode_model_deploy.log"
    error = f"error: TPU-MLIR step decode:model_deploy failed: ... (log {step_log})"
    tpumlir_run.echo_logs(tmp_path / "toolchain.log", logs, error)
    echoed = capsys.readouterr().err.splitlines()
    assert echoed[-2:] == [
        "--- 02_decode_model_deploy.log (last 60 lines)",
        "output of 02_decode_model_deploy",
    ]
    assert echoed[0] == "--- toolchain.log (last 60 lines)"


@pytest.mark.toolchain
def test_real_transform_of_a_middle_rwkv7_chunk(tmp_path, toolchain_python):
    """A chunk between the first and the last (RWKV-7 in 3 or more chunks: every 1.5B
    build under a memory budget) goes through model_transform. While middle chunks
    passed v_first straight from input to output, tpuc-opt refused the net ("type of
    return operand ... doesn't match function result type")."""
    checkpoint = tmp_path / "three.pth"
    _run(
        "make_synthetic_checkpoint.py",
        *("--version", 7, "--layers", 3, "--embed", 64, "--vocab", 256),
        *("--head-size", 64, "--seed", 0, "--out", checkpoint),
    )
    options = {"family": "rwkv", "variant": "decode", "tokens": 1, "dtype": "fp32", "chunks": 3}
    _run(
        "export_onnx.py",
        *("--checkpoint", checkpoint, "--out-dir", tmp_path / "decode"),
        *("--options", json.dumps(options)),
    )
    spec = _spec([tmp_path / "decode"], "bm1684x", "f16", tmp_path)
    spec["steps"] = [s for s in spec["steps"] if s["name"] == "decode_1:model_transform"]
    assert spec["steps"]
    ran = _run_job(toolchain_python, spec, tmp_path / "spec.json")
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]

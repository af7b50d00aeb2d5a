"""QNN SDK command-line route, checked up to the SDK's door.

Flags and config keys are checked against Qualcomm's documentation of the
tools: Qualcomm AI Engine Direct SDK, "Tools" (80-63442-50, tools.html:
qnn-onnx-converter --input_network/--output_path/--input_list/--act_bitwidth/
--weights_bitwidth/--bias_bitwidth/--float_bitwidth/--quantization_overrides/
--use_per_channel_quantization; qnn-model-lib-generator -c/-b/-o/-t;
qnn-context-binary-generator --backend/--model/--output_dir/--binary_file/
--config_file) and "HTP backend" (80-63442-10, htp_backend.html, "QNN HTP
Backend Extensions": graphs[].graph_names/vtcm_mb/O/fp16_relaxed_precision,
devices[].soc_model/dsp_arch/cores[]; backend_extensions.shared_library_path/
config_file_path), as used by rwkv-qualcomm (seed 001:
make_context_cache_binary.py, utils/htp_devices_config.py).
"""

import os
from dataclasses import replace
from pathlib import Path

import pytest
import qnn_fixtures

from npuforge.backends import qnn, qnn_sdk
from npuforge.backends.base import CompileRequest, load_exports
from npuforge.errors import NpuforgeError

SM8650 = qnn.Options(htp_arch=75, soc_model=57, vtcm_mb=8, route="sdk")


def sdk_request(exports, out, options=SM8650, precision="fp16"):
    return CompileRequest(
        exports=exports, target="SM8650", options=options, precision=precision, out_dir=out
    )


ROOT = Path("/opt/qcom/aistack/qairt/2.51.0")


def test_htp_config_from_target_options():
    config = qnn_sdk.htp_config(replace(SM8650, optimization_level=2), "fp16", ["chunk0"])
    assert config == {
        "graphs": [{"graph_names": ["chunk0"], "vtcm_mb": 8, "O": 2, "fp16_relaxed_precision": 1}],
        "devices": [
            {
                "soc_model": 57,
                "dsp_arch": "v75",
                "cores": [{"core_id": 0, "perf_profile": "burst", "rpc_control_latency": 100}],
            }
        ],
    }
    quantized = qnn_sdk.htp_config(qnn.Options(htp_arch=68, soc_model=30), "a16w8", ["chunk1"])
    assert "fp16_relaxed_precision" not in quantized["graphs"][0]
    assert quantized["devices"][0]["dsp_arch"] == "v68" and quantized["graphs"][0]["O"] == 3


def test_link_config_points_at_the_htp_extension_library():
    link = qnn_sdk.link_config(ROOT, Path("/w/htp_config.json"))
    assert link == {
        "backend_extensions": {
            "shared_library_path": f"{ROOT}/lib/x86_64-linux-clang/libQnnHtpNetRunExtensions.so",
            "config_file_path": "/w/htp_config.json",
        }
    }


def test_command_lines_use_the_documented_flags():
    bin_dir = f"{ROOT}/bin/x86_64-linux-clang"
    fp16 = qnn_sdk.converter_command(ROOT, "/e/chunk0.onnx", "/w/chunk0.cpp", "fp16")
    assert fp16 == [
        f"{bin_dir}/qnn-onnx-converter",
        "--input_network", "/e/chunk0.onnx",
        "--output_path", "/w/chunk0.cpp",
        "--float_bitwidth", "16",
    ]  # fmt: skip
    w4 = qnn_sdk.converter_command(
        ROOT,
        "/e/c.onnx",
        "/w/c.cpp",
        "a16w4",
        input_list="/c/input_list.txt",
        overrides="/w/o.json",
    )
    assert w4[w4.index("--act_bitwidth") + 1] == "16"
    assert w4[w4.index("--weights_bitwidth") + 1] == "4"
    assert w4[w4.index("--bias_bitwidth") + 1] == "32"
    assert w4[w4.index("--input_list") + 1] == "/c/input_list.txt"
    assert w4[w4.index("--quantization_overrides") + 1] == "/w/o.json"
    assert "--use_per_channel_quantization" in w4
    with pytest.raises(NpuforgeError, match="calibration input list"):
        qnn_sdk.converter_command(ROOT, "/e/c.onnx", "/w/c.cpp", "a16w8")
    lib = qnn_sdk.model_lib_command(ROOT, "/w/c.cpp", "/w/c.bin", "/w/lib")
    assert lib == [f"{bin_dir}/qnn-model-lib-generator", "-c", "/w/c.cpp", "-b", "/w/c.bin",
                   "-o", "/w/lib", "-t", "x86_64-linux-clang"]  # fmt: skip
    ctx = qnn_sdk.context_command(ROOT, "/w/lib/libc.so", "/o", "chunk0", "/w/link.json")
    assert ctx == [
        f"{bin_dir}/qnn-context-binary-generator",
        "--backend", f"{ROOT}/lib/x86_64-linux-clang/libQnnHtp.so",
        "--model", "/w/lib/libc.so",
        "--output_dir", "/o",
        "--binary_file", "chunk0",
        "--config_file", "/w/link.json",
    ]  # fmt: skip


def test_overrides_keep_state_in_16_bit_float(tmp_path):
    export = qnn_fixtures.make_export(tmp_path / "export", chunks=2)
    decode = load_exports([export], "qnn")["decode"]
    overrides = qnn_sdk.quantization_overrides(decode.graphs[1], ["xn1"])
    assert set(overrides["activation_encodings"]) == {"state_1_wkv", "state_1_wkv_out", "xn1"}
    assert overrides["activation_encodings"]["xn1"] == [{"bitwidth": 16, "dtype": "float"}]


def test_unavailable_without_sdk_and_with_a_hollow_sdk(tmp_path, monkeypatch):
    monkeypatch.delenv("QNN_SDK_ROOT", raising=False)
    reason = qnn_sdk.unavailable_reason("native", SM8650)
    assert "QNN_SDK_ROOT" in reason and "\n" not in reason
    monkeypatch.setenv("QNN_SDK_ROOT", str(tmp_path))
    assert "qnn-onnx-converter" in qnn_sdk.unavailable_reason("native", SM8650)
    with pytest.raises(NpuforgeError, match="QNN_SDK_ROOT"):
        qnn_sdk.compile_sdk(sdk_request([tmp_path], tmp_path / "out"), None)


@pytest.mark.toolchain
def test_sdk_route_compiles_where_the_sdk_is_installed(tmp_path):
    root = os.environ.get("QNN_SDK_ROOT")
    if not root or qnn_sdk.unavailable_reason("native", SM8650):
        pytest.skip("QNN SDK not installed here (set QNN_SDK_ROOT to an unpacked QAIRT SDK)")
    export = qnn_fixtures.make_export(tmp_path / "export", chunks=2)
    manifest = qnn_sdk.compile_sdk(sdk_request([export], tmp_path / "out"), None)
    assert [a["file"] for a in manifest["artifacts"]] == ["chunk0.bin", "chunk1.bin"]
    for artifact in manifest["artifacts"]:
        assert (tmp_path / "out" / artifact["file"]).stat().st_size > 0

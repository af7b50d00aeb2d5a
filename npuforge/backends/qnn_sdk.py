"""The QNN SDK command-line route, for users who hold the Qualcomm AI Engine Direct SDK.

    qnn-onnx-converter  ONNX -> model .cpp + weights .bin (quantized with the calibration list)
    qnn-model-lib-generator  .cpp + .bin -> libmodel.so (x86_64-linux-clang)
    qnn-context-binary-generator  libmodel.so + HTP backend-extension config -> context .bin

The SDK is not redistributable, so nothing here runs unless ``QNN_SDK_ROOT``
(or the target option ``qnn_sdk_root``) points at an installed SDK. Flags and
config keys follow Qualcomm's documentation of these tools (AI Engine Direct
"Tools" page, 80-63442-50, and the HTP backend-extension config in
"HTP backend", 80-63442-10) and the rwkv-qualcomm scripts of seed 001.
"""

import os
import shutil
import subprocess
from pathlib import Path

from npuforge.errors import NpuforgeError
from npuforge.fileio import atomic_path, read_json, sha256_file, write_json

HOST = "x86_64-linux-clang"
TOOLS = ("qnn-onnx-converter", "qnn-model-lib-generator", "qnn-context-binary-generator")
WEIGHT_BITS = {"a16w8": 8, "a16w4": 4}


def sdk_root(options=None) -> Path | None:
    value = getattr(options, "qnn_sdk_root", None) or os.environ.get("QNN_SDK_ROOT")
    return Path(value) if value else None


def unavailable_reason(runtime: str, options) -> str | None:
    """One line when the SDK route cannot run here; None when the SDK's tools are present."""
    root = sdk_root(options)
    if root is None:
        return (
            "the QNN SDK route needs the Qualcomm AI Engine Direct SDK, which is not "
            "redistributable: install it and set QNN_SDK_ROOT=/opt/qcom/aistack/qairt/<version> "
            "(or use the default EP route: route: ep)"
        )
    missing = [tool for tool in TOOLS if not (root / "bin" / HOST / tool).is_file()]
    if missing:
        return (
            f"QNN_SDK_ROOT={root} lacks bin/{HOST}/{missing[0]}: point it at an unpacked "
            "QAIRT/QNN SDK (the directory holding bin/, lib/ and include/)"
        )
    if runtime != "native":
        return (
            f"the QNN SDK route runs the SDK's host tools natively: use toolchain runtime "
            f"native for SDK targets (runtime '{runtime}' was selected)"
        )
    return None


def htp_config(options, precision: str, graph_names: list[str]) -> dict:
    """The HTP backend-extension config for qnn-context-binary-generator."""
    graph = {
        "graph_names": list(graph_names),
        "vtcm_mb": int(options.vtcm_mb),
        "O": int(options.optimization_level),
    }
    if precision == "fp16":
        # Float graphs run in fp16 on the HTP: allow it to relax fp32 math.
        graph["fp16_relaxed_precision"] = 1
    return {
        "graphs": [graph],
        "devices": [
            {
                "soc_model": int(options.soc_model),
                "dsp_arch": f"v{int(options.htp_arch)}",
                "cores": [{"core_id": 0, "perf_profile": "burst", "rpc_control_latency": 100}],
            }
        ],
    }


def link_config(root: Path, config_path: Path) -> dict:
    """The --config_file for the generator: which extension library reads the HTP config."""
    return {
        "backend_extensions": {
            "shared_library_path": str(root / "lib" / HOST / "libQnnHtpNetRunExtensions.so"),
            "config_file_path": str(config_path),
        }
    }


def quantization_overrides(graph: dict, norm_tensors: list[str]) -> dict:
    """Keep the recurrent state and the norms in 16-bit float, as seed 001 does."""
    float16 = [{"bitwidth": 16, "dtype": "float"}]
    names = [i["name"] for i in graph["inputs"] if i["role"] == "state"]
    names += [o["name"] for o in graph["outputs"] if o["role"] == "state"]
    names += list(norm_tensors)
    return {"activation_encodings": {n: float16 for n in sorted(set(names))}, "param_encodings": {}}


def converter_command(root, onnx_path, cpp_path, precision, input_list=None, overrides=None):
    cmd = [
        str(Path(root) / "bin" / HOST / "qnn-onnx-converter"),
        "--input_network",
        str(onnx_path),
        "--output_path",
        str(cpp_path),
    ]
    if precision == "fp16":
        cmd += ["--float_bitwidth", "16"]
        return cmd
    if precision not in WEIGHT_BITS:
        raise NpuforgeError(f"the QNN SDK route has no precision '{precision}'")
    if input_list is None:
        raise NpuforgeError(f"{precision} through the SDK needs a calibration input list")
    cmd += [
        "--input_list",
        str(input_list),
        "--act_bitwidth",
        "16",
        "--weights_bitwidth",
        str(WEIGHT_BITS[precision]),
        "--bias_bitwidth",
        "32",
        "--use_per_channel_quantization",
    ]
    if overrides is not None:
        cmd += ["--quantization_overrides", str(overrides)]
    return cmd


def model_lib_command(root, cpp_path, bin_path, out_dir):
    return [
        str(Path(root) / "bin" / HOST / "qnn-model-lib-generator"),
        "-c",
        str(cpp_path),
        "-b",
        str(bin_path),
        "-o",
        str(out_dir),
        "-t",
        HOST,
    ]


def context_command(root, model_lib, out_dir, binary_name, link_path):
    return [
        str(Path(root) / "bin" / HOST / "qnn-context-binary-generator"),
        "--backend",
        str(Path(root) / "lib" / HOST / "libQnnHtp.so"),
        "--model",
        str(model_lib),
        "--output_dir",
        str(out_dir),
        "--binary_file",
        binary_name,
        "--config_file",
        str(link_path),
    ]


def _run(cmd, log_path):
    with open(log_path, "a", encoding="utf-8") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise NpuforgeError(f"{Path(cmd[0]).name} failed (exit {done.returncode}): see {log_path}")


def compile_sdk(request, calibration_dir) -> dict:
    """Run the SDK's three tools per chunk; write <chunk>.bin files and compile.json."""
    from npuforge.backends.base import load_exports
    from npuforge.calibration_formats import chunk_samples, write_qnn_input_list

    options, precision, target_id = request.options, request.precision, request.target
    reason = unavailable_reason("native", options)
    if reason:
        raise NpuforgeError(f"target {target_id}: {reason}")
    root = sdk_root(options)
    exports = load_exports(request.exports, "qnn")
    if "prefill" in exports:
        raise NpuforgeError(
            "the QNN SDK route compiles decode graphs only: drop the prefill export"
        )
    decode = exports["decode"]
    out_dir = request.out_dir
    log_path = Path(request.log_path or out_dir.parent / f"{out_dir.name}.sdk.log")
    with atomic_path(out_dir) as staging:
        staging.mkdir()
        work = staging / "work"
        artifacts = []
        for index, graph in enumerate(decode.graphs):
            name = f"chunk{index}"
            chunk_work = work / name
            chunk_work.mkdir(parents=True)
            input_list = overrides = None
            if precision != "fp16":
                samples, inputs = chunk_samples(calibration_dir, index)
                input_list = write_qnn_input_list(samples, inputs, chunk_work / "samples")
                overrides = chunk_work / "quant_overrides.json"
                write_json(overrides, quantization_overrides(graph, []))
            cpp = chunk_work / f"{name}.cpp"
            onnx_path = decode.dir / graph["file"]
            _run(
                converter_command(root, onnx_path, cpp, precision, input_list, overrides), log_path
            )
            _run(
                model_lib_command(root, cpp, chunk_work / f"{name}.bin", chunk_work / "lib"),
                log_path,
            )
            model_lib = chunk_work / "lib" / HOST / f"lib{name}.so"
            config = chunk_work / "htp_config.json"
            write_json(config, htp_config(options, precision, [name]))
            link = chunk_work / "htp_link.json"
            write_json(link, link_config(root, config))
            _run(context_command(root, model_lib, staging, name, link), log_path)
            binary = staging / f"{name}.bin"
            artifacts.append(
                {
                    "file": binary.name,
                    "sha256": sha256_file(binary),
                    "role": "binary",
                    "chunk": index,
                    "bytes": binary.stat().st_size,
                }
            )
        shutil.rmtree(work)
        manifest = {
            "backend": "qnn",
            "target": target_id,
            "precision": precision,
            "route": "sdk",
            "artifacts": artifacts,
            "split": {"chunks": len(artifacts), "reason": "export chunks"},
            "toolchain": {"runtime": "native", "versions": {"qnn_sdk_root": str(root)}},
            "verification": None,
            "options": {"htp_config": htp_config(options, precision, ["chunk0"])},
        }
        version_file = root / "sdk.yaml"
        if version_file.is_file():
            manifest["toolchain"]["versions"]["qnn_sdk"] = version_file.read_text()[:200]
        write_json(staging / "compile.json", manifest)
    return read_json(out_dir / "compile.json")

"""Sophgo TPU-MLIR backend: ONNX prefill + decode graphs -> one combined bmodel.

Per graph, TPU-MLIR's documented chain (quick start, "Compile the ONNX model"):

    model_transform.py  ONNX -> top MLIR, static shapes; compares the MLIR with
                        onnxruntime on --test_input and writes --test_result
    run_calibration.py  INT8 only: calibration table from .npz samples (--data_list)
    model_deploy.py     top MLIR -> bmodel for --processor at --quantize; compares the
                        tpu MLIR with --test_reference and the bmodel with the tpu
                        MLIR, failing below --tolerance
    model_tool --combine  decode + prefill bmodels -> one bmodel with both nets

Then the combined bmodel runs on TPU-MLIR's cmodel over a recurrent run of held-out
text (one prefill call, then ``verify_steps`` decode calls carrying the states) and
its logits are compared with onnxruntime fp32 on the exports: the compile fails
below ``min_cosine`` (``verification_plan``, ``simulator_figures``).

Every command line is built here as data (lists of argv); the job script
(tpumlir_job.py) runs them inside the toolchain environment and parses the
similarity figures TPU-MLIR prints. This module is imported at parse time: keep
heavy imports (numpy, onnx, onnxruntime) inside the functions that need them.
"""

import functools
import glob
import json
import os
import re
import shutil
import struct
import subprocess
import time
from pathlib import Path

from npuforge.errors import NpuforgeError
from npuforge.verify import logits_agreement

BACKEND = "tpumlir"
JOB_SCRIPT = Path(__file__).with_name("tpumlir_job.py")

# Config precision -> model_deploy.py --quantize.
QUANTIZE = {"f16": "F16", "bf16": "BF16", "w8f16": "W8F16", "w4f16": "W4F16", "int8": "INT8"}
CALIBRATED = frozenset({"int8"})
PROCESSORS = ("bm1684x", "bm1688")
# model_deploy.py's own --tolerance defaults per --quantize (tpu_mlir 1.30.2,
# ModelDeploy.__init__): "cos,euclid" floors for every tensor it compares.
DEFAULT_TOLERANCE = {
    "f16": "0.99,0.90",
    "bf16": "0.99,0.90",
    "int8": "0.90,0.80",
    "w8f16": "0.90,0.80",
    "w4f16": "0.90,0.80",
}
# Lowest acceptable logits cosine (worst token), cmodel simulator vs onnxruntime fp32,
# over the recurrent verification run; option min_cosine overrides it.
MIN_COSINE = {"f16": 0.9999, "bf16": 0.999, "int8": 0.999, "w8f16": 0.999, "w4f16": 0.99}
DEFAULT_VERIFY_STEPS = 32
# Group size of W4F16 weights (TPU-MLIR's default for --q_group_size in LLM scripts).
DEFAULT_Q_GROUP_SIZE = 64
# Decode steps run on onnxruntime to give the test input realistic (non-zero) states.
WARMUP_STEPS = 4
# ONNX dtypes -> model_transform.py --input_types; bmodels carry no int64, ids go in as int32.
INPUT_TYPES = {"int64": "int32", "int32": "int32", "float32": "float32", "float16": "float16"}
# The torch build the lock pins (CPU); the native check looks for its wheel.
TORCH_PIN = "2.11.0+cpu"
PYTHON310_IMAGE = "docker.io/library/python:3.10-slim-bookworm"


# ---------------------------------------------------------------- toolchain checks


def _python_candidates():
    found = shutil.which("python3.10")
    if found:
        yield found
    pyenv_root = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    yield from sorted(glob.glob(f"{pyenv_root}/versions/3.10.*/bin/python3.10"), reverse=True)
    yield from ("/usr/local/bin/python3.10", "/usr/bin/python3.10")


def native_python(target_options) -> str:
    """The CPython 3.10 the native toolchain venv is built from.

    ``python`` in the target options (or $NPUFORGE_TPUMLIR_PYTHON) names it; otherwise
    the first python3.10 that runs, on PATH, under pyenv, or in /usr(/local)/bin.
    """
    named = (target_options or {}).get("python") or os.environ.get("NPUFORGE_TPUMLIR_PYTHON")
    if named:
        return str(named)
    for candidate in _python_candidates():
        # A pyenv shim is on PATH even where its global version is another Python.
        if os.access(candidate, os.X_OK) and _python_version(candidate) == "3.10":
            return candidate
    raise NpuforgeError(_NO_PYTHON)


_NO_PYTHON = (
    "TPU-MLIR needs CPython 3.10 exactly and none was found: install one (e.g. 'pyenv install "
    "3.10') and name it as 'python' in the target's options (or $NPUFORGE_TPUMLIR_PYTHON), or "
    "use a container runtime (toolchain_runtime=podman)"
)


@functools.cache
def _python_version(python: str) -> str | None:
    try:
        out = subprocess.run(
            [python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _find_links_dirs(target_options) -> list[str]:
    dirs = os.environ.get("PIP_FIND_LINKS", "").split()
    if (target_options or {}).get("wheel_dir"):
        dirs.append(str(target_options["wheel_dir"]))
    return [d for d in dirs if os.path.isdir(d)]


def torch_wheel(target_options) -> str | None:
    """The CPU torch wheel for cp310 that the lock's pin can install offline, if any."""
    version = TORCH_PIN.replace("+", "%2B")
    for directory in _find_links_dirs(target_options):
        for pattern in (f"torch-{TORCH_PIN}-cp310-*.whl", f"torch-{version}-cp310-*.whl"):
            hits = sorted(glob.glob(os.path.join(directory, pattern)))
            if hits:
                return hits[0]
    return None


def _container_reason(runtime: str, target_options) -> str | None:
    from npuforge import toolchain

    def exists(image):
        probe = subprocess.run(
            [runtime, "image", "inspect", image], capture_output=True, text=True, timeout=60
        )
        return probe.returncode == 0

    base = (target_options or {}).get("python310_image", PYTHON310_IMAGE)
    if exists(toolchain.image_name(BACKEND)) or exists(base):
        return None
    return (
        f"the TPU-MLIR image needs a CPython 3.10 base image and {runtime} has none: "
        f"'{runtime} pull {base}' (or '{runtime} load' it where no registry is reachable), "
        "then build with a CPU torch (envs/tpumlir/Containerfile explains the build args)"
    )


def unavailable_reason(runtime: str, target_options) -> str | None:
    """Why the TPU-MLIR toolchain cannot run here (one line, with the fix); None if it can."""
    target_options = dict(target_options or {})
    if runtime in ("podman", "docker"):
        return _container_reason(runtime, target_options)
    if runtime != "native":
        return f"unknown toolchain runtime '{runtime}': choose native, podman or docker"
    try:
        python = native_python(target_options)
    except NpuforgeError as err:
        return str(err)
    version = _python_version(python)
    if version != "3.10":
        found = f"Python {version}" if version else "not runnable"
        return (
            f"TPU-MLIR needs CPython 3.10 exactly but {python} is {found}: name a 3.10 "
            "interpreter as 'python' in the target's options (or $NPUFORGE_TPUMLIR_PYTHON)"
        )
    if torch_wheel(target_options) is None:
        return (
            f"TPU-MLIR's ONNX front end imports torch, and no CPU build torch=={TORCH_PIN} "
            "for cp310 was found (PyPI's Linux torch is a multi-GB CUDA build): download "
            "that wheel from the PyPI-compatible PyTorch CPU index into a directory named by "
            "PIP_FIND_LINKS (or 'wheel_dir' in the target's options), or use "
            "toolchain_runtime=podman"
        )
    return None


# ---------------------------------------------------------------- options


def processor(target_options) -> str:
    chip = str((target_options or {}).get("processor", "")).lower()
    if chip not in PROCESSORS:
        raise NpuforgeError(
            f"TPU-MLIR processor '{chip}' is not supported: set options.processor in "
            f"targets.yaml to one of {', '.join(PROCESSORS)}"
        )
    return chip


def quantize_mode(precision: str) -> str:
    try:
        return QUANTIZE[precision]
    except KeyError:
        raise NpuforgeError(
            f"precision '{precision}' has no TPU-MLIR quantize mode: use one of "
            f"{', '.join(QUANTIZE)}"
        ) from None


def tolerance(target_options, precision: str) -> str:
    """model_deploy.py --tolerance for ``precision``.

    Option ``tolerance``: one "cos,euclid" string for every precision, or a mapping
    precision -> string; a precision it leaves out gets TPU-MLIR's own default.
    """
    quantize_mode(precision)
    given = (target_options or {}).get("tolerance")
    if isinstance(given, dict):
        given = given.get(precision)
    value = str(given if given is not None else DEFAULT_TOLERANCE[precision])
    parts = value.split(",")
    try:
        floors = [float(p) for p in parts]
    except ValueError:
        floors = []
    if len(floors) != 2 or not all(0 < f <= 1 for f in floors):
        raise NpuforgeError(
            f"TPU-MLIR tolerance '{value}' for {precision} is not 'cos,euclid' with both in "
            '(0, 1]: fix options.tolerance in targets.yaml (e.g. "0.99,0.90")'
        )
    return value


def check_precision(target: str, precision: str, supported) -> None:
    """Refuse a precision the chip's registry entry does not list (before any job runs)."""
    quantize_mode(precision)
    if supported is not None and precision not in supported:
        raise NpuforgeError(
            f"{target} does not support precision '{precision}': choose one of "
            f"{', '.join(sorted(supported))} (targets.yaml)"
        )


# ---------------------------------------------------------------- command lines


def shapes_arg(shapes) -> str:
    """model_transform.py --input_shapes: '[[1,1],[1,256]]' (no spaces, graph input order)."""
    return "[" + ",".join("[" + ",".join(str(int(d)) for d in s) + "]" for s in shapes) + "]"


def transform_command(name, onnx_path, inputs, test_input, test_result, mlir) -> list[str]:
    """model_transform.py: ONNX -> top MLIR, validated against onnxruntime on test_input.

    ``inputs`` is the graph's input list in ONNX order: dicts with shape and dtype.
    """
    types = []
    for spec in inputs:
        if spec["dtype"] not in INPUT_TYPES:
            raise NpuforgeError(
                f"graph input '{spec['name']}' has dtype {spec['dtype']}, which TPU-MLIR "
                f"cannot take: export {', '.join(INPUT_TYPES)} inputs"
            )
        types.append(INPUT_TYPES[spec["dtype"]])
    return [
        "model_transform.py",
        "--model_name",
        name,
        "--model_def",
        str(onnx_path),
        "--input_shapes",
        shapes_arg(spec["shape"] for spec in inputs),
        "--input_types",
        ",".join(types),
        "--test_input",
        str(test_input),
        "--test_result",
        str(test_result),
        "--mlir",
        str(mlir),
    ]


def calibration_command(mlir, data_list, samples, chip, table) -> list[str]:
    """run_calibration.py: INT8 thresholds from .npz samples listed one per line."""
    return [
        "run_calibration.py",
        str(mlir),
        "--data_list",
        str(data_list),
        "--input_num",
        str(int(samples)),
        "--processor",
        chip,
        "-o",
        str(table),
    ]


def deploy_command(
    mlir,
    quantize,
    chip,
    test_input,
    test_reference,
    tolerance,
    model,
    *,
    calibration_table=None,
    q_group_size=None,
) -> list[str]:
    """model_deploy.py: top MLIR -> bmodel; TPU-MLIR's similarity check gates it."""
    if quantize == "INT8" and not calibration_table:
        raise NpuforgeError("INT8 needs a calibration table: pass --calibration samples")
    cmd = ["model_deploy.py", "--mlir", str(mlir), "--quantize", quantize, "--processor", chip]
    if calibration_table:
        cmd += ["--calibration_table", str(calibration_table)]
    if quantize.startswith("W4"):
        cmd += ["--q_group_size", str(int(q_group_size or DEFAULT_Q_GROUP_SIZE))]
    cmd += [
        "--test_input",
        str(test_input),
        "--test_reference",
        str(test_reference),
        "--tolerance",
        str(tolerance),
        "--model",
        str(model),
    ]
    return cmd


def combine_command(bmodels, out) -> list[str]:
    """model_tool --combine: several bmodels (one net each) -> one bmodel with all nets."""
    return ["model_tool", "--combine", *map(str, bmodels), "-o", str(out)]


# ---------------------------------------------------------------- inputs


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


def load_export(export_dir) -> dict:
    path = Path(export_dir) / "export.json"
    if not path.is_file():
        raise NpuforgeError(f"{path} is missing: pass an export directory made by export_onnx.py")
    export = json.loads(path.read_text(encoding="utf-8"))
    if export.get("chunks", len(export.get("graphs", []))) != 1 or len(export["graphs"]) != 1:
        raise NpuforgeError(
            f"{export_dir}: TPU-MLIR takes one graph per variant, this export has "
            f"{len(export['graphs'])} chunks: set export.chunks: 1 for the target"
        )
    if export.get("options", {}).get("ext_embedding"):
        raise NpuforgeError(
            f"{export_dir}: exported with an external embedding, which the bmodel cannot "
            "take: set export.ext_embedding: false for the target"
        )
    return export


def order_exports(export_dirs) -> dict:
    """{variant: export_dir} for exactly one decode and at most one prefill export."""
    by_variant = {}
    for export_dir in export_dirs:
        variant = load_export(export_dir).get("variant")
        if variant not in ("decode", "prefill"):
            raise NpuforgeError(f"{export_dir}: unknown export variant '{variant}'")
        if variant in by_variant:
            raise NpuforgeError(f"two {variant} exports given: pass one --export per variant")
        by_variant[variant] = Path(export_dir)
    if "decode" not in by_variant:
        raise NpuforgeError("no decode export given: pass the decode export with --export")
    return {v: by_variant[v] for v in ("decode", "prefill") if v in by_variant}


def _roles(export: dict) -> dict:
    graph = export["graphs"][0]
    return {spec["name"]: spec for spec in graph["inputs"]}


def _warm_states(decode_dir: Path, inputs, vocab: int, seed: int) -> dict:
    """Recurrent states after a few decode steps from zero: realistic test values."""
    import numpy as np
    import onnxruntime as ort

    export = load_export(decode_dir)
    roles = _roles(export)
    session = ort.InferenceSession(
        str(decode_dir / export["graphs"][0]["file"]), providers=["CPUExecutionProvider"]
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


def make_test_input(export_dir, inputs, path, *, states=None, seed=0) -> dict:
    """Write the --test_input .npz: token ids in range, states warm (or zeros).

    Keys are the graph's input names, values have the graph's exact shapes and dtypes.
    """
    import numpy as np

    export = load_export(export_dir)
    roles = _roles(export)
    rng = np.random.default_rng(seed)
    arrays = {}
    for spec in inputs:
        role = roles.get(spec["name"], {}).get("role")
        if role == "tokens":
            value = rng.integers(0, export["vocab_size"], spec["shape"])
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


# ---------------------------------------------------------------- recurrent verification


def verification_calls(ordered: dict, steps: int) -> list[tuple]:
    """The recurrent run as (net, first position, token count): one prefill call (when
    there is a prefill net), then ``steps`` decode calls carrying its states."""
    calls = []
    position = 0
    if "prefill" in ordered:
        tokens = int(load_export(ordered["prefill"])["tokens_per_call"])
        calls.append(("prefill", 0, tokens))
        position = tokens
    calls += [("decode", position + i, 1) for i in range(steps)]
    return calls


def verification_plan(ordered: dict, steps: int, work_dir, calibration_dirs=None):
    """The job's ``verify`` section and the reference logits (rows = tokens).

    Host-fed inputs of every call come from ``npuforge.runtime.host_feeds`` (one .npz
    per call); the reference is ``GraphChain`` (onnxruntime CPU) on the fp32 exports,
    the prefill chain's states handed to the decode chain, computed here and not from
    the job's feeds, so a wrongly fed input fails the check.
    """
    import numpy as np

    from npuforge.calibration import verification_tokens
    from npuforge.runtime import GraphChain, host_feeds

    calls = verification_calls(ordered, steps)
    count = calls[-1][1] + calls[-1][2]
    exports = {net: load_export(path) for net, path in ordered.items()}
    ids = np.asarray(verification_tokens(count, exports["decode"]["vocab_size"], calibration_dirs))
    chains = {net: GraphChain(path) for net, path in ordered.items()}
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    planned, rows, previous = [], [], None
    for number, (net, position, length) in enumerate(calls):
        graph = exports[net]["graphs"][0]
        call_ids = ids[position : position + length].reshape(1, length)
        path = work_dir / f"verify_call{number:04d}.npz"
        np.savez(path, **host_feeds(exports[net], graph, call_ids, position))
        planned.append({"net": net, "position": position, "feeds": str(path.resolve())})
        chain = chains[net]
        if previous is not None and chain is not previous:
            chain.state = {k: previous.state[k].astype(v.dtype) for k, v in chain.state.items()}
            chain.position = previous.position
        logits = chain.step(call_ids)
        rows.append(logits.reshape(-1, logits.shape[-1]))
        previous = chain
    nets = {}
    for net, export in exports.items():
        graph = export["graphs"][0]
        logits = [o["name"] for o in graph["outputs"] if o.get("role") == "logits"]
        if len(logits) != 1:
            raise NpuforgeError(
                f"{ordered[net]}: the {net} graph has {len(logits)} logits outputs, the "
                "verification needs one: re-export the graphs with this npuforge"
            )
        nets[net] = {
            "inputs": [
                {k: spec[k] for k in ("name", "shape", "role", "output") if k in spec}
                for spec in graph["inputs"]
            ],
            "outputs": [{"name": o["name"], "role": o.get("role")} for o in graph["outputs"]],
            "logits": logits[0],
        }
    plan = {
        "steps": steps,
        "calls": planned,
        "nets": nets,
        "outputs": str((work_dir / "verify_logits.npy").resolve()),
    }
    return plan, np.concatenate(rows)


def verification_figures(reference, compiled) -> dict:
    """Logits agreement per token (see npuforge.verify.logits_agreement)."""
    return {"rows": int(len(reference)), **logits_agreement(reference, compiled)}


def min_cosine(target_options, precision: str) -> float:
    """The logits floor: option ``min_cosine`` (one number, or precision -> number)."""
    given = (target_options or {}).get("min_cosine")
    if isinstance(given, dict):
        given = given.get(precision)
    return float(MIN_COSINE[precision] if given is None else given)


# ---------------------------------------------------------------- the whole job


def build_spec(
    exports,
    out_dir,
    work_dir,
    target,
    target_options,
    precision,
    *,
    calibration_dir=None,
    state_files=(),
    threads=1,
) -> dict:
    """Prepare every input file and return the job spec (all paths absolute).

    Writes test inputs (and INT8 data lists) into ``work_dir``; the bmodel goes to
    ``out_dir`` (the job's only other writable place).
    """
    chip = processor(target_options)
    quantize = quantize_mode(precision)
    tolerance_arg = tolerance(target_options, precision)
    work_dir = Path(work_dir).resolve()
    out_dir = Path(out_dir).resolve()
    ordered = order_exports(exports)
    if precision in CALIBRATED and not calibration_dir:
        raise NpuforgeError(f"precision {precision} needs calibration samples: pass --calibration")
    seed = int(target_options.get("seed", 0))

    decode_dir = ordered["decode"]
    decode_export = load_export(decode_dir)
    decode_inputs = graph_inputs(decode_dir / decode_export["graphs"][0]["file"])
    states = _warm_states(decode_dir, decode_inputs, decode_export["vocab_size"], seed)

    steps, graphs, bmodels = [], [], []
    for variant, export_dir in ordered.items():
        export = load_export(export_dir)
        onnx_path = (export_dir / export["graphs"][0]["file"]).resolve()
        inputs = graph_inputs(onnx_path)
        gdir = work_dir / variant
        test_input = gdir / "test_input.npz"
        written = make_test_input(export_dir, inputs, test_input, states=states, seed=seed + 1)
        top_outputs = gdir / f"{variant}_top_outputs.npz"
        mlir = gdir / f"{variant}.mlir"
        bmodel = gdir / f"{variant}_{chip}_{precision}.bmodel"
        steps.append(
            {
                "name": f"{variant}:model_transform",
                "graph": variant,
                "stage": "transform",
                "cwd": str(gdir),
                "argv": transform_command(
                    variant, onnx_path, inputs, test_input, top_outputs, mlir
                ),
                "expects": [str(mlir), str(top_outputs)],
            }
        )
        table = None
        if precision in CALIBRATED:
            samples = calibration_samples(calibration_dir, inputs)
            if not samples:
                where = ", ".join(f"{d}/tpumlir/" for d in _as_dirs(calibration_dir))
                raise NpuforgeError(
                    f"no calibration sample in {where} fits the {variant} graph (inputs "
                    f"{[s['name'] for s in inputs]}): pass --calibration with samples made by "
                    f"make_calibration_samples.py --export {export_dir}"
                )
            data_list = gdir / "calibration_list.txt"
            data_list.write_text("".join(f"{s}\n" for s in samples), encoding="utf-8")
            table = gdir / f"{variant}_cali_table"
            steps.append(
                {
                    "name": f"{variant}:run_calibration",
                    "graph": variant,
                    "stage": "calibration",
                    "cwd": str(gdir),
                    "argv": calibration_command(mlir, data_list, len(samples), chip, table),
                    "expects": [str(table)],
                }
            )
        steps.append(
            {
                "name": f"{variant}:model_deploy",
                "graph": variant,
                "stage": "deploy",
                "cwd": str(gdir),
                "argv": deploy_command(
                    mlir,
                    quantize,
                    chip,
                    test_input,
                    top_outputs,
                    tolerance_arg,
                    bmodel,
                    calibration_table=table,
                    q_group_size=target_options.get("q_group_size"),
                ),
                "expects": [str(bmodel)],
            }
        )
        graphs.append(
            {
                "net": variant,
                "export": str(export_dir.resolve()),
                "onnx": str(onnx_path),
                "tokens_per_call": export.get("tokens_per_call"),
                "inputs": written,
            }
        )
        bmodels.append(bmodel)

    final = out_dir / f"{target.lower()}_{precision}.bmodel"
    verify_steps = int(target_options.get("verify_steps", DEFAULT_VERIFY_STEPS))
    verify, reference = None, None
    if verify_steps > 0:
        verify, reference = verification_plan(
            ordered, verify_steps, work_dir / "verify", calibration_dir
        )
        import numpy as np

        np.save(work_dir / "verify" / "reference_logits.npy", reference)
        verify["reference"] = str((work_dir / "verify" / "reference_logits.npy").resolve())
    steps.append(
        {
            "name": "model_tool:combine",
            "graph": None,
            "stage": "combine",
            "cwd": str(work_dir),
            "argv": combine_command(bmodels, final),
            "expects": [str(final)],
        }
    )
    return {
        "backend": BACKEND,
        "target": target,
        "precision": precision,
        "processor": chip,
        "quantize": quantize,
        "tolerance": tolerance_arg,
        "threads": int(threads),
        "work_dir": str(work_dir),
        "out_dir": str(out_dir),
        "bmodel": str(final),
        "graphs": graphs,
        "steps": steps,
        "result": str(work_dir / "job_result.json"),
        "state_files": [str(Path(p).resolve()) for p in state_files],
        "verify": verify,
    }


# The bmodel's build time: a flatbuffers string (uint32 length 25) holding ctime()'s
# "Www Mmm dd hh:mm:ss yyyy\n", written by model_tool --combine. It is the only
# thing that differs between two builds of the same graphs.
_BMODEL_MAGIC = 0xFF55AAEE
_BUILD_TIME = re.compile(
    rb"\x19\x00\x00\x00[A-Z][a-z]{2} [A-Z][a-z]{2} [ 0-9][0-9] "
    rb"[0-9]{2}:[0-9]{2}:[0-9]{2} [0-9]{4}\n\x00"
)


def pin_build_time(bmodel, epoch=None) -> str:
    """Set the bmodel's build-time string to ``epoch`` (default $SOURCE_DATE_EPOCH or 0).

    Same length, same flatbuffer layout: only those 24 characters change, so two
    builds of the same graphs give identical bytes. Returns the time written.
    """
    if epoch is None:
        epoch = int(os.environ.get("SOURCE_DATE_EPOCH", "0"))
    stamp = time.asctime(time.gmtime(epoch)).encode()
    data = bytearray(Path(bmodel).read_bytes())
    magic, header_size, flatbuffer_size = struct.unpack_from("<III", data)
    if magic != _BMODEL_MAGIC:
        raise NpuforgeError(f"{bmodel} is not a bmodel (magic {magic:#x})")
    region = bytes(data[header_size : header_size + flatbuffer_size])
    found = list(_BUILD_TIME.finditer(region))
    if len(found) != 1:
        raise NpuforgeError(
            f"{bmodel}: expected one build-time string in the bmodel header, found "
            f"{len(found)}: this TPU-MLIR writes bmodels differently, check pin_build_time"
        )
    start = header_size + found[0].start() + 4
    data[start : start + len(stamp)] = stamp
    Path(bmodel).write_bytes(bytes(data))
    return stamp.decode()


def simulator_figures(spec, logits, target_options) -> dict | None:
    """``verification`` figures of the cmodel run against the reference (None without one)."""
    import numpy as np

    verify = spec.get("verify")
    if not verify:
        return None
    reference = np.load(verify["reference"])
    figures = verification_figures(reference, logits)
    floor = min_cosine(target_options, spec["precision"])
    calls = [c["net"] for c in verify["calls"]]
    figures.update(
        {
            "reference": "onnxruntime fp32 on the source exports (npuforge.runtime.GraphChain)",
            "simulator": "TPU-MLIR cmodel (pyruntime_bm), the combined bmodel's nets",
            "inputs": "held-out text, recurrent: one prefill call, then decode calls "
            "carrying the states",
            "steps": calls.count("decode"),
            "calls": {net: calls.count(net) for net in ("prefill", "decode") if net in calls},
            "min_cosine": floor,
        }
    )
    # Decode calls give one row each; the rows before them are the prefill call's tokens.
    split = reference.shape[0] - figures["steps"]
    if split:
        figures["prefill"] = verification_figures(reference[:split], logits[:split])
        figures["decode"] = verification_figures(reference[split:], logits[split:])
    figures["passed"] = bool(
        not figures["nan_inf"] and figures["cosine"] is not None and figures["cosine"] >= floor
    )
    return figures


def compile_record(spec, result, stamp, target_options, figures=None) -> dict:
    """compile.json (docs/interfaces.md) from the spec and the job's result."""
    from npuforge.fileio import sha256_file

    out_dir = Path(spec["out_dir"])
    artifacts = [
        {
            "file": Path(spec["bmodel"]).name,
            "sha256": sha256_file(spec["bmodel"]),
            "role": "binary",
            "chunk": 0,
            "nets": [g["net"] for g in spec["graphs"]],
        }
    ]
    for state in spec["state_files"]:
        name = Path(state).name
        artifacts.append({"file": name, "sha256": sha256_file(out_dir / name), "role": "state"})
    cosines = [
        t["cosine"]
        for step in result["steps"]
        for cmp in step["comparisons"]
        for t in cmp["tensors"].values()
        if t.get("cosine") is not None
    ]
    return {
        "backend": BACKEND,
        "target": spec["target"],
        "precision": spec["precision"],
        "artifacts": artifacts,
        "split": {"chunks": 1, "reason": "decode and prefill nets combined into one bmodel"},
        "toolchain": {
            "runtime": stamp.get("runtime"),
            "versions": {**stamp.get("versions", {}), **result.get("versions", {})},
        },
        "verification": {
            **(figures or {"cosine": None, "passed": None}),
            # TPU-MLIR's own single-input checks, each gating its step.
            "tpumlir": {
                "reference": "TPU-MLIR npz compare: top MLIR vs onnxruntime, "
                "tpu MLIR vs top MLIR, bmodel vs tpu MLIR",
                "tolerance": spec["tolerance"],
                "cosine": min(cosines) if cosines else None,
                "passed": all(step["passed"] for step in result["steps"]),
                "similarity": {
                    step["name"]: step["comparisons"]
                    for step in result["steps"]
                    if step["comparisons"]
                },
            },
        },
        "nets": [
            {"name": g["net"], "tokens_per_call": g["tokens_per_call"], "inputs": g["inputs"]}
            for g in spec["graphs"]
        ],
        "options": {
            "processor": spec["processor"],
            "quantize": spec["quantize"],
            "target_options": dict(target_options),
            "stages": [step["name"] for step in spec["steps"]],
        },
    }


def compile_bmodel(
    *,
    exports,
    target,
    target_options,
    precision,
    stamp_path,
    out_dir,
    calibration=None,
    supported=None,
    state_files=(),
    threads=1,
) -> dict:
    """The compile step: spec -> toolchain job -> bmodel + compile.json in ``out_dir``.

    Everything is built in a temporary sibling of ``out_dir`` and renamed on success,
    so a failed compile (or a similarity below tolerance) leaves no output directory.
    """
    from npuforge import toolchain
    from npuforge.fileio import atomic_path, read_json, write_json

    check_precision(target, precision, supported)
    for state in state_files:
        if not Path(state).is_file():
            raise NpuforgeError(f"state file {state} does not exist: fix the model's state path")
    stamp = toolchain.read_stamp(stamp_path)
    with atomic_path(out_dir) as tmp:
        tmp.mkdir()
        work = tmp / "work"
        spec = build_spec(
            exports,
            tmp,
            work,
            target,
            target_options,
            precision,
            calibration_dir=calibration,
            state_files=state_files,
            threads=threads,
        )
        spec_path = work / "spec.json"
        write_json(spec_path, spec)
        read_only = [g["export"] for g in spec["graphs"]] + list(spec["state_files"])
        read_only += [str(d.resolve()) for d in _as_dirs(calibration)]
        try:
            toolchain.run_job(
                stamp_path,
                JOB_SCRIPT,
                spec_path,
                read_only=read_only,
                writable=[str(tmp.resolve())],
                log_path=tmp / "logs" / "toolchain.log",
            )
        except NpuforgeError:
            # The temporary directory goes away with the failure: keep the tools' output.
            _echo_logs(tmp / "logs" / "toolchain.log", work / "logs")
            raise
        result = read_json(spec["result"])
        pinned = pin_build_time(spec["bmodel"])
        for state in spec["state_files"]:
            shutil.copyfile(state, tmp / Path(state).name)
        # Keep the tools' logs and similarity figures; drop MLIR files and per-net bmodels.
        shutil.copytree(work / "logs", tmp / "logs", dirs_exist_ok=True)
        shutil.copyfile(spec["result"], tmp / "logs" / "job_result.json")
        figures = None
        if spec.get("verify"):
            import numpy as np

            figures = simulator_figures(spec, np.load(spec["verify"]["outputs"]), target_options)
            if not figures["passed"]:
                raise NpuforgeError(
                    f"{target} {precision}: cmodel logits cosine {figures['cosine']} (nan/inf "
                    f"{figures['nan_inf']}) is below {figures['min_cosine']} against onnxruntime "
                    f"fp32 over {figures['rows']} tokens of held-out text; build f16, or set "
                    "min_cosine in the target's options after checking the figures"
                )
        record = compile_record(spec, result, stamp, target_options, figures)
        record["artifacts"][0]["build_time"] = pinned
        shutil.rmtree(work)
        write_json(tmp / "compile.json", record)
    return record


def _echo_logs(toolchain_log: Path, tool_logs: Path, tail: int = 60) -> None:
    import sys

    for log in [toolchain_log, *sorted(tool_logs.glob("*.log"))]:
        if log.is_file():
            lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
            print(f"--- {log.name} (last {tail} lines)", file=sys.stderr)
            print("\n".join(lines[-tail:]), file=sys.stderr)

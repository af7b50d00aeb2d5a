"""Compile one ONNX graph chunk with rknn-toolkit2 and run it on the simulator.

Runs inside the rknn toolchain environment (standard library, numpy and the
toolkit only; never npuforge):

    python rknn_job.py spec.json

The spec (written by npuforge.backends.rknn) holds absolute paths and options:
``onnx``, ``rknn`` (output), ``target_platform``, ``precision``,
``quantized_algorithm``, ``optimization_level``, ``dataset`` (or null),
``inputs``/``outputs`` (graph order: name, shape, role, and ``output`` for a
state input), ``verify`` ({steps, feeds: {input: .npy of [steps, *shape]}, start:
{state input: .npy of its first value, when not zeros},
save: {output: .npy to write [steps, *shape]}}), ``build_log``, ``result``, and
``float16`` (null, {op_types: [...]} or {except_op_types: [...]}: hybrid
quantization, see ``_hybrid_build``) with ``hybrid_dir`` (its scratch directory),
``layer_error`` (null, or {inputs: [[.npy per graph input] per sample], dir}: the
toolkit's ``accuracy_analysis`` of each layer against fp32, run after the export).

The simulator only works inside the RKNN object that built the model, so the
build, the export and the recurrent run happen in this one process: state
inputs start at zero and take the simulator's own state outputs on each step.

Reproducible bytes: the job re-executes itself once, pinned, from a fixed-path
stage (``job_stage.py`` explains why and how); the staged spec reaches the inputs
through fixed relative names and ``dest.json`` keeps the real outputs.
"""

import json
import os
import re
import sys

# Where progress lines go while fd 1 is the toolkit's log: the job's own stdout,
# which the caller echoes into the step log as the job runs.
_PROGRESS = {"fd": None}
# A line per this many simulator steps: counted, since the job's clock is not real.
SIMULATOR_REPORT_EVERY = 8


def real_seconds() -> float:
    """Seconds since boot from /proc/uptime, which the counting clock (libfaketime) leaves
    alone; read only after the export, where nothing it allocates reaches the file."""
    try:
        with open("/proc/uptime", encoding="ascii") as uptime:
            return float(uptime.read().split()[0])
    except (OSError, ValueError, IndexError):
        return float("nan")


def time_left(taken: float, done: int, total: int) -> str:
    """The time left at the pace of the ``done`` steps so far (", about N s left"); nothing
    before the first step or without a real clock."""
    if done <= 0 or taken != taken:  # taken is NaN without /proc/uptime
        return ""
    return f", about {taken / done * (total - done):.0f} s left"


def say(message):
    """One progress line on the job's stdout."""
    line = f"[rknn_job] {message}\n".encode()
    fd = _PROGRESS["fd"]
    if fd is None:
        sys.stdout.flush()
        fd = 1
    os.write(fd, line)


def _redirect_fds(path):
    """Send fd 1 and 2 (where the toolkit's C++ part logs) to ``path``; return a restorer."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    _PROGRESS["fd"] = saved[0]
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(target, 1)
    os.dup2(target, 2)
    os.close(target)

    def restore():
        _PROGRESS["fd"] = None
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])

    return restore


# One row of the compiler's "Network Layer Information Table":
#   D RKNN: [hh:mm:ss.mmm] <id> <OpType> <DataType> <Target> <shapes...> ... <OpType>:<name>
_ROW = re.compile(r"RKNN: \[[^\]]*\]\s+(\d+)\s+(\S+)\s+(\S+)\s+(CPU|NPU|GPU)\s+.*\s(\S+)\s*$")
_IO_OPS = {"InputOperator", "OutputOperator"}


def parse_placement(log_text):
    """Ops per target from the layer table; the CPU ones (besides graph I/O) are fallbacks."""
    rows = {}
    for line in log_text.splitlines():
        match = _ROW.search(line)
        if match:
            op_id, op_type, _, target, full_name = match.groups()
            rows[int(op_id)] = (op_type, target, full_name)
    counts = {}
    fallback = []
    for op_type, target, full_name in rows.values():
        if op_type in _IO_OPS:
            continue
        counts[target] = counts.get(target, 0) + 1
        if target != "NPU":
            fallback.append({"op": op_type, "target": target, "name": full_name})
    return {"ops": counts, "cpu_fallback": len(fallback), "fallback_ops": fallback}


_LOG = {}
_PINNED = "NPUFORGE_RKNN_PINNED"
# The pinned process's environment (job_stage.py explains each setting).
_DETERMINISTIC_ENV = {
    "MALLOC_PERTURB_": "85",
    "MALLOC_ARENA_MAX": "1",
    "PYTHONHASHSEED": "0",
    "OMP_NUM_THREADS": "1",
}
# Spec keys naming files the build reads or writes; the staged spec reaches them
# through fixed relative names, and ``dest.json`` keeps the real ones.
_STAGED_NAMES = {"onnx": "in", "dataset": "cal"}


def _stage(spec_path):
    """Lay out the fixed-path stage (job_stage.py); return (stage, interpreter, lock fd).

    The staged spec names inputs by fixed relative paths and leaves out the real
    outputs, which ``dest.json`` keeps for after the export.
    """
    import job_stage

    with open(spec_path, encoding="utf-8") as handle:
        spec = json.load(handle)
    links = {}
    staged = dict(spec)
    for key, link in _STAGED_NAMES.items():
        if spec.get(key):
            real = os.path.abspath(spec[key])
            links[link] = os.path.dirname(real)
            staged[key] = f"{link}/{os.path.basename(real)}"
    staged.update(
        rknn="out.rknn", build_log="build.log", result=None, verify=None, layer_error=None
    )
    if spec.get("hybrid_dir"):
        staged["hybrid_dir"] = "hybrid"  # scratch: nothing outside the job reads it
    stage, python, lock = job_stage.make_stage(
        "rknn", staged, links, [os.path.abspath(__file__), job_stage.__file__]
    )
    os.rename(os.path.join(stage, os.path.basename(__file__)), os.path.join(stage, "job.py"))
    with open(os.path.join(stage, "dest.json"), "w", encoding="utf-8") as handle:
        json.dump(spec, handle)
    return stage, python, lock


def _deterministic_reexec():
    """Re-execute this script once from the staging directory (see module doc)."""
    if os.environ.get(_PINNED):
        return
    import job_stage

    stage, python, lock = _stage(sys.argv[1])
    os.set_inheritable(lock, True)  # held across exec, released when the job ends
    clock = job_stage.fixed_clock(stage)
    env = job_stage.fixed_environment(stage, {**_DETERMINISTIC_ENV, **clock, _PINNED: "aslr-on"})
    if job_stage.disable_aslr():
        env[_PINNED] = "aslr-off"
    job_stage.one_cpu()
    os.chdir(stage)
    os.execve(python, [python, "job.py", "spec.json"], env)


def _last_toolkit_error(log_path):
    try:
        with open(log_path, encoding="utf-8", errors="replace") as handle:
            lines = [line.strip() for line in handle if line.startswith(("E ", "\x1b[1;31mE"))]
    except OSError:
        return ""
    return re.sub(r"\x1b\[[0-9;]*m", "", lines[-1]) if lines else ""


def _check(code, what):
    if code != 0:
        detail = _last_toolkit_error(_LOG.get("path", ""))
        raise RuntimeError(f"rknn-toolkit2 {what} failed ({detail or f'return code {code}'})")


def _destinations(spec):
    """The spec with real paths: ``dest.json`` beside a staged spec, else the spec itself."""
    if os.path.isfile("dest.json") and spec.get("result") is None:
        with open("dest.json", encoding="utf-8") as handle:
            return json.load(handle)
    return spec


def _hybrid_build(rknn, spec, keep):
    """Quantize with the outputs of some op types kept in float16 (hybrid quantization).

    hybrid_quantization_step1 writes <stem>.model (an ONNX ModelProto of the
    toolkit's own graph), <stem>.data and <stem>.quantization.cfg into the working
    directory; the cfg's ``custom_quantize_layers`` gets every output tensor of the
    chosen op types (``op_types``) or of all others (``except_op_types``) as
    ``float16``, and step2 builds from the three files.
    """
    import hashlib

    from rknn.api import RKNN

    # Absolute before the chdir: a staged spec holds paths relative to the stage.
    work, dataset = os.path.abspath(spec["hybrid_dir"]), os.path.abspath(spec["dataset"])
    os.makedirs(work, exist_ok=True)
    cwd = os.getcwd()
    os.chdir(work)
    try:
        _check(rknn.hybrid_quantization_step1(dataset=dataset), "hybrid_quantization_step1")
        rknn.release()
        stem = os.path.join(work, os.path.splitext(os.path.basename(spec["onnx"]))[0])
        with open(stem + ".quantization.cfg", encoding="utf-8") as handle:
            text = handle.read()
        names, total = _float16_tensors(stem + ".model", keep)
        text = _with_float16_layers(text, names)
        with open(stem + ".quantization.cfg", "w", encoding="utf-8") as handle:
            handle.write(text)
        rknn = RKNN(verbose=True)
        _check(
            rknn.hybrid_quantization_step2(
                model_input=stem + ".model",
                data_input=stem + ".data",
                model_quantization_cfg=stem + ".quantization.cfg",
            ),
            "hybrid_quantization_step2",
        )
    finally:
        os.chdir(cwd)
    record = {
        "float16_tensors": len(names),
        "tensors": total,
        "config_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
    }
    return rknn, record


def _float16_tensors(model_path, keep):
    """(output tensors of the chosen ops in graph order, all op output tensors).

    Chosen: by op type, or by a ``layers_named`` substring of the layer's name.
    """
    import onnx  # a dependency of rknn-toolkit2

    graph = onnx.load(model_path, load_external_data=False).graph
    wanted, unwanted = set(keep.get("op_types", ())), set(keep.get("except_op_types", ()))
    named = keep.get("layers_named", ())
    names, total = [], 0
    for node in graph.node:
        total += len(node.output)
        by_type = (node.op_type in wanted) if wanted else (node.op_type not in unwanted)
        if by_type or any(part in node.name for part in named):
            names.extend(node.output)
    return names, total


def _with_float16_layers(text, names):
    """The .quantization.cfg text with ``custom_quantize_layers`` set to ``names``."""
    head, found, rest = text.partition("\nquantize_parameters:")
    if not found or not head.startswith("custom_quantize_layers:"):
        raise RuntimeError("unexpected .quantization.cfg layout from hybrid_quantization_step1")
    lines = ["custom_quantize_layers:"] + [f"    {name}: float16" for name in names]
    return "\n".join(lines) + found + rest


# One row of the toolkit's error_analysis.txt (a fused layer's row has no figures):
#   [OpType] tensor   <entire cos> | <entire euc>   <single cos> | <single euc>
_ERROR_ROW = re.compile(
    r"^\[(\S+)\]\s+(\S+)\s+([-\d.]+)\s*\|\s*([-\d.eE+]+)\s+([-\d.]+)\s*\|\s*([-\d.eE+]+)"
)


def parse_error_analysis(text):
    """Rows of rknn-toolkit2's error_analysis.txt (simulator against fp32), graph order.

    ``entire``: the layer's output with every earlier layer quantized too (errors
    accumulate); ``single``: the layer alone, fed fp32 inputs.
    """
    rows = []
    for line in text.splitlines():
        match = _ERROR_ROW.match(line.strip())
        if match:
            op, tensor, entire, entire_euc, single, single_euc = match.groups()
            rows.append(
                {
                    "op": op,
                    "tensor": tensor,
                    "entire_cosine": float(entire),
                    "entire_euclid": float(entire_euc),
                    "single_cosine": float(single),
                    "single_euclid": float(single_euc),
                }
            )
    return rows


def _layer_error(rknn, layer_error):
    """Per layer, the worst cosine over the samples (``accuracy_analysis``, simulator).

    The dumps of every layer's tensors are deleted after each sample: only the table stays.
    """
    import shutil

    worst = {}
    samples = layer_error["inputs"]
    for j, inputs in enumerate(samples):
        say(f"layer error analysis, sample {j + 1} of {len(samples)}")
        out = os.path.join(layer_error["dir"], f"sample{j}")
        _check(rknn.accuracy_analysis(inputs=inputs, output_dir=out), "accuracy_analysis")
        with open(os.path.join(out, "error_analysis.txt"), encoding="utf-8") as handle:
            rows = parse_error_analysis(handle.read())
        shutil.rmtree(out)
        for row in rows:
            kept = worst.setdefault((row["op"], row["tensor"]), dict(row))
            for key in ("entire_cosine", "single_cosine"):
                kept[key] = min(kept[key], row[key])
            for key in ("entire_euclid", "single_euclid"):
                kept[key] = max(kept[key], row[key])
    return {"samples": len(samples), "layers": list(worst.values())}


def main(spec_path):
    import shutil

    import job_stage
    import numpy as np
    from rknn.api import RKNN

    job_stage.no_tqdm_monitor()
    with open(spec_path, encoding="utf-8") as handle:
        spec = json.load(handle)
    dest = spec
    quantize = spec["precision"] != "fp16"
    log_path = spec["build_log"]
    _LOG["path"] = log_path
    restore = _redirect_fds(log_path)
    try:
        rknn = RKNN(verbose=True)
        config = {
            "target_platform": spec["target_platform"],
            "optimization_level": int(spec["optimization_level"]),
        }
        hybrid = bool(spec.get("auto_hybrid")) and quantize
        if quantize:
            config["quantized_dtype"] = spec["precision"]
            config["quantized_algorithm"] = spec["quantized_algorithm"]
        if hybrid and spec.get("auto_hybrid_cos_thresh") is not None:
            config["auto_hybrid_cos_thresh"] = float(spec["auto_hybrid_cos_thresh"])
        _check(rknn.config(**config), "config")
        say(f"loading {os.path.basename(spec['onnx'])}")
        _check(rknn.load_onnx(model=spec["onnx"]), "load_onnx")
        keep = spec.get("float16") if quantize else None
        say("building (quantizing)" if quantize else "building")
        if keep:
            rknn, hybrid_record = _hybrid_build(rknn, spec, keep)
        else:
            _check(
                rknn.build(do_quantization=quantize, dataset=spec["dataset"], auto_hybrid=hybrid),
                "build",
            )
            hybrid_record = None
        # No seconds here: the staged process's clock counts reads (job_stage.fixed_clock);
        # the caller's heartbeat gives the real time.
        say("built; exporting")
        _check(rknn.export_rknn(spec["rknn"]), "export_rknn")
        # The real paths are read only now: nothing before the export saw them.
        dest = _destinations(spec)

        simulator_seconds = None
        verify = dest.get("verify")
        if verify:
            _check(rknn.init_runtime(), "init_runtime (simulator)")
            feeds = {name: np.load(path) for name, path in verify["feeds"].items()}
            first_state = verify.get("start") or {}
            state = {
                i["name"]: np.load(first_state[i["name"]]).astype(np.float32)
                if i["name"] in first_state
                else np.zeros(i["shape"], dtype=np.float32)
                for i in spec["inputs"]
                if i["role"] == "state"
            }
            by_output = {i["output"]: i["name"] for i in spec["inputs"] if i["role"] == "state"}
            saved = {name: [] for name in verify["save"]}
            # 4-D inputs are NCHW in ONNX; the simulator assumes NHWC unless told.
            formats = ["nchw"] * len(spec["inputs"])
            started = real_seconds()
            for step in range(int(verify["steps"])):
                inputs = []
                for i in spec["inputs"]:
                    value = state[i["name"]] if i["role"] == "state" else feeds[i["name"]][step]
                    inputs.append(np.ascontiguousarray(value, dtype=np.float32))
                if step % SIMULATOR_REPORT_EVERY == 0:
                    left = time_left(real_seconds() - started, step, int(verify["steps"]))
                    say(f"simulator step {step + 1} of {verify['steps']}{left}")
                outputs = rknn.inference(inputs=inputs, data_format=formats)
                if outputs is None:
                    raise RuntimeError(f"simulator inference failed at step {step}")
                for o, value in zip(spec["outputs"], outputs, strict=True):
                    value = np.asarray(value, dtype=np.float32).reshape(o["shape"])
                    if o["name"] in by_output:
                        state[by_output[o["name"]]] = value
                    if o["name"] in saved:
                        saved[o["name"]].append(value)
            simulator_seconds = round(real_seconds() - started, 2)
            for name, path in verify["save"].items():
                np.save(path, np.stack(saved[name]))
        layer_error = _layer_error(rknn, dest["layer_error"]) if dest.get("layer_error") else None
        rknn.release()
    finally:
        restore()
        dest = _destinations(spec)
        if dest["build_log"] != spec["build_log"]:
            shutil.copyfile(spec["build_log"], dest["build_log"])
    if dest["rknn"] != spec["rknn"]:
        shutil.copyfile(spec["rknn"], dest["rknn"])

    with open(log_path, encoding="utf-8", errors="replace") as handle:
        placement = parse_placement(handle.read())
    result = {
        "placement": placement,
        "fixed_clock": job_stage.heap_settings()["fixed_clock"],
        "threads": job_stage.thread_count(),
        "aslr_disabled": os.environ.get(_PINNED) == "aslr-off",
        "site_packages": job_stage.site_packages_mode(),
        "hybrid": hybrid_record,
        "layer_error": layer_error,
        # The simulator calls' wall time (the log's, never the record's: it varies).
        "simulator_seconds": simulator_seconds,
    }
    with open(dest["result"], "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=2, sort_keys=True)


if __name__ == "__main__":
    _deterministic_reexec()
    if os.path.isfile("dest.json"):
        import job_stage

        job_stage.exit_on_sigterm()  # exec reset it; the stage below must still go
    try:
        main(sys.argv[1])
    except Exception as err:  # one line the runner can show; the log has the rest
        print(f"error: {type(err).__name__}: {err}", file=sys.stderr)
        sys.exit(1)
    finally:
        if os.path.isfile("dest.json"):
            import job_stage

            # The lock fd came across exec and is still held until exit.
            job_stage.remove_stage(os.getcwd())

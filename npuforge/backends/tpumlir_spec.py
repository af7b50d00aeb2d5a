"""The TPU-MLIR job's spec: per net (one chunk of one variant), its chain of documented
tool runs (model_transform, run_calibration for INT8, model_deploy; ``tpumlir_commands``)
with its test input and quantize table, then model_tool's combine, and what the cmodel
check needs of each net. The job script (``npuforge/jobs/tpumlir_job.py``) runs it;
``npuforge.backends.tpumlir`` writes it. Imported at parse time: keep heavy imports
inside the functions that need them.
"""

from pathlib import Path

from npuforge.backends import base
from npuforge.backends.tpumlir_commands import (
    DEFAULT_Q_GROUP_SIZE,
    calibration_command,
    combine_command,
    deploy_command,
    transform_command,
)
from npuforge.backends.tpumlir_inputs import (
    _as_dirs,
    calibration_samples,
    graph_inputs,
    make_test_input,
    ops_but_weight_matmuls,
    real_test_feeds,
    state_path_ops,
    test_schedule,
    weight_matmuls_named,
)
from npuforge.backends.tpumlir_run import DATA_LIST
from npuforge.errors import NpuforgeError

# The backend's name (npuforge.backends.tpumlir.NAME), written into every spec.
NAME = "tpumlir"

# Config precision -> model_deploy.py --quantize.
QUANTIZE = {"f16": "F16", "bf16": "BF16", "w8f16": "W8F16", "w4f16": "W4F16", "int8": "INT8"}
CALIBRATED = frozenset({"int8"})
# Node names of a group-offsets export's side matmuls contain this (the attribute of
# npuforge.models.llama.group_offsets.GroupOffsetLinear; that module imports torch).
GROUP_OFFSETS_NODE = "group_offsets"
# model_deploy.py's own --tolerance defaults per --quantize (tpu_mlir 1.30.2,
# ModelDeploy.__init__): "cos,euclid" floors for every tensor it compares.
DEFAULT_TOLERANCE = {
    "f16": "0.99,0.90",
    "bf16": "0.99,0.90",
    "int8": "0.90,0.80",
    "w8f16": "0.90,0.80",
    "w4f16": "0.90,0.80",
}


def int8_modes(options, onnx_path, inputs: list[dict]) -> dict:
    """TPU-MLIR op name -> mode for the ops an INT8 build keeps out of INT8."""
    modes = {}
    if options.int8_weight_matmuls_only:
        named = tuple(options.int8_f16_named or ())
        modes.update(dict.fromkeys(ops_but_weight_matmuls(onnx_path, named), "F16"))
    if options.int8_state_path:
        modes.update(dict.fromkeys(state_path_ops(onnx_path, inputs), options.int8_state_path))
    return modes


def w4f16_group(options, export) -> int:
    """The W4F16 weight group: an export with group offsets was split for its own group."""
    split = (export.meta.get("group_offsets") or {}).get("group")
    if split is None:
        return int(options.q_group_size or DEFAULT_Q_GROUP_SIZE)
    if options.q_group_size not in (None, split):
        raise NpuforgeError(
            f"{export.dir}: exported with group offsets for weight groups of {split}, but "
            f"the target sets q_group_size: {options.q_group_size}; make them equal (or "
            "remove the target's q_group_size)"
        )
    return int(split)


def w4f16_modes(options, onnx_path, export) -> dict:
    """TPU-MLIR op name -> mode for the weight matmuls a W4F16 build keeps in F16: the
    group offsets' side matmuls (their inputs are the group count wide) and the named."""
    named = list(options.w4f16_f16_named or ())
    if export.meta.get("group_offsets"):
        named.append(GROUP_OFFSETS_NODE)
    return dict.fromkeys(weight_matmuls_named(onnx_path, named), "F16")


def quantize_mode(precision: str) -> str:
    try:
        return QUANTIZE[precision]
    except KeyError:
        raise NpuforgeError(
            f"precision '{precision}' has no TPU-MLIR quantize mode: use one of "
            f"{', '.join(QUANTIZE)}"
        ) from None


def tolerance(options, precision: str) -> str:
    """model_deploy.py --tolerance for ``precision``.

    Option ``tolerance``: one "cos,euclid" string for every precision, or a mapping
    precision -> string; a precision it leaves out gets TPU-MLIR's own default.
    """
    quantize_mode(precision)
    given = options.tolerance
    if isinstance(given, dict):
        given = given.get(precision)
    value = str(given if given is not None else DEFAULT_TOLERANCE[precision])
    try:
        floors = [float(p) for p in value.split(",")]
    except ValueError:
        floors = []
    if len(floors) != 2 or not all(0 < f <= 1 for f in floors):
        raise NpuforgeError(
            f"TPU-MLIR tolerance '{value}' for {precision} is not 'cos,euclid' with both in "
            '(0, 1]: fix options.tolerance in targets.yaml (e.g. "0.99,0.90")'
        )
    return value


def net_name(variant: str, chunk: int, chunks: int) -> str:
    """A net's name in the combined bmodel: the variant's, with the chunk's index when
    the export has several."""
    return variant if chunks == 1 else f"{variant}_{chunk}"


def net_plan(export, chunk: int) -> dict:
    """What the cmodel run needs of one chunk's net: its inputs and outputs in graph
    order, and (the last chunk's) the logits output. A chunk's ``hidden`` outputs
    (``<base>_out``) feed the next chunk's ``<base>_in``, as ``npuforge.runtime`` runs them."""
    graph = export.graphs[chunk]
    roles = [o.get("role") for o in graph["outputs"]]
    last = chunk == len(export.graphs) - 1
    if last and roles.count("logits") != 1 or not last and "hidden" not in roles:
        raise NpuforgeError(
            f"{export.dir}: chunk {chunk} of the {export.variant} graphs does not hand on "
            f"{'one logits output' if last else 'a hidden state'}, which the verification "
            "needs: re-export the graphs with this npuforge"
        )
    plan = {
        "chunk": chunk,
        "inputs": [
            {k: spec[k] for k in ("name", "shape", "role", "output") if k in spec}
            for spec in graph["inputs"]
        ],
        "outputs": [{"name": o["name"], "role": o.get("role")} for o in graph["outputs"]],
    }
    if last:
        plan["logits"] = graph["outputs"][roles.index("logits")]["name"]
    return plan


def net_steps(build: dict, export, chunk: int, net: str, work_dir: Path, test_feeds: dict):
    """The chain of one net (one chunk of one variant): model_transform, run_calibration
    (INT8), model_deploy; and its record for the spec's ``graphs``. ``build``: the
    precision, chip, quantize mode, tolerance, calibration directories, W4F16 group and
    options the nets share."""
    precision, chip, options = build["precision"], build["chip"], build["options"]
    graph = export.graphs[chunk]
    onnx_path = (export.dir / graph["file"]).resolve()
    inputs = graph_inputs(onnx_path)
    gdir = work_dir / net
    test_input = gdir / "test_input.npz"
    fed = test_feeds[export.variant]
    written = make_test_input(inputs, fed["feeds"][chunk], test_input)
    top_outputs = gdir / f"{net}_top_outputs.npz"
    mlir = gdir / f"{net}.mlir"
    bmodel = gdir / f"{net}_{chip}_{precision}.bmodel"
    steps = [
        {
            "name": f"{net}:model_transform",
            "graph": net,
            "stage": "transform",
            "cwd": str(gdir),
            "argv": transform_command(net, onnx_path, inputs, test_input, top_outputs, mlir),
            "expects": [str(mlir), str(top_outputs)],
        }
    ]
    table = None
    if precision in CALIBRATED:
        samples = calibration_samples(build["calibration"], inputs)
        if not samples:
            where = ", ".join(str(d) for d in _as_dirs(build["calibration"]))
            raise NpuforgeError(
                f"no calibration sample in {where} fits the {net} graph (inputs "
                f"{[s['name'] for s in inputs]}): pass --calibration with samples made by "
                f"make_calibration_samples.py --export {export.dir}"
            )
        data_list = gdir / DATA_LIST
        data_list.write_text("".join(f"{s}\n" for s in samples), encoding="utf-8")
        table = gdir / f"{net}_cali_table"
        steps.append(
            {
                "name": f"{net}:run_calibration",
                "graph": net,
                "stage": "calibration",
                "cwd": str(gdir),
                "argv": calibration_command(
                    mlir, data_list, len(samples), chip, table, options.int8_calibration_method
                ),
                "expects": [str(table)],
            }
        )
    qtable = None
    # Only INT8 and W4F16 builds take a quantize table: others never read the graph.
    modes = {}
    if precision == "int8":
        modes = int8_modes(options, onnx_path, graph["inputs"])
    elif precision == "w4f16":
        modes = w4f16_modes(options, onnx_path, export)
    if modes:
        qtable = gdir / f"{net}_qtable"
        lines = "".join(f"{name} {mode}\n" for name, mode in sorted(modes.items()))
        qtable.write_text(lines, encoding="utf-8")
    deploy = deploy_command(
        mlir, build["quantize"], chip, test_input, top_outputs, build["tolerance"], bmodel,
        calibration_table=table, q_group_size=build["group"], quantize_table=qtable,
    )  # fmt: skip
    steps.append(
        {
            "name": f"{net}:model_deploy",
            "graph": net,
            "stage": "deploy",
            "cwd": str(gdir),
            "argv": deploy,
            "expects": [str(bmodel)],
        }
    )
    record = {
        "net": net,
        "variant": export.variant,
        "chunk": chunk,
        "layers": graph.get("layers"),
        "export": str(export.dir),
        "onnx": str(onnx_path),
        "tokens_per_call": export.tokens_per_call,
        "inputs": written,
        # --test_input: this net's feeds at this position of a held-out text run.
        "test_input_position": fed["position"],
    }
    return steps, record


def build_spec(request, exports: dict, out_dir, work_dir, test_feeds: dict, calls=None) -> dict:
    """Prepare every input file and return the job spec (all paths absolute).

    Writes test inputs (and INT8 data lists) into ``work_dir``; the bmodel goes to
    ``out_dir`` (the job's only other writable place). ``test_feeds``: each net's
    --test_input (``real_test_feeds``). ``calls``: the verification calls
    (``base.write_call_feeds``), or None to skip the cmodel run.
    """
    options, precision, target = request.options, request.precision, request.target
    chip = options.processor.lower()
    quantize = quantize_mode(precision)
    tolerance_arg = tolerance(options, precision)
    work_dir = Path(work_dir).resolve()
    out_dir = Path(out_dir).resolve()
    calibration = list(request.calibrations)
    if precision in CALIBRATED and not calibration:
        raise NpuforgeError(f"precision {precision} needs calibration samples: pass --calibration")

    # W4F16's weight group (the nets' exports share their options).
    group = w4f16_group(options, next(iter(exports.values()))) if precision == "w4f16" else None
    build = {
        "precision": precision, "chip": chip, "quantize": quantize, "tolerance": tolerance_arg,
        "calibration": calibration, "group": group, "options": options,
    }  # fmt: skip
    steps, graphs, bmodels = [], [], []
    for variant, export in exports.items():
        for chunk in range(len(export.graphs)):
            net = net_name(variant, chunk, len(export.graphs))
            chain, record = net_steps(build, export, chunk, net, work_dir, test_feeds)
            steps += chain
            graphs.append(record)
            bmodels.append(Path(chain[-1]["expects"][0]))

    final = out_dir / f"{target.lower()}_{precision}.bmodel"
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
    verify = None
    if calls:
        verify = {
            "calls": calls,
            # Each variant's nets in chunk order: a call runs them one after another.
            "nets": {
                variant: {
                    net_name(variant, chunk, len(export.graphs)): net_plan(export, chunk)
                    for chunk in range(len(export.graphs))
                }
                for variant, export in exports.items()
            },
            "outputs": str(work_dir / "verify" / "verify_logits.npy"),
        }
    return {
        "backend": NAME,
        "target": target,
        "precision": precision,
        "processor": chip,
        "quantize": quantize,
        "q_group_size": group,
        "tolerance": tolerance_arg,
        "threads": int(options.threads),
        # Nets whose transform/calibration/deploy chains run side by side, each tool
        # process on one thread: the cores Snakemake gave the step.
        "parallel_nets": max(1, request.threads // max(1, int(options.threads))),
        # One model_transform at a time (each takes most of its net's peak), the prefill
        # nets first: their model_deploy is the long step and runs beside the next net's
        # model_transform.
        "one_at_a_time": ["transform"],
        "chain_order": [g["net"] for g in graphs if g["variant"] == "prefill"]
        + [g["net"] for g in graphs if g["variant"] != "prefill"],
        "work_dir": str(work_dir),
        "out_dir": str(out_dir),
        "bmodel": str(final),
        "graphs": graphs,
        "steps": steps,
        "result": str(work_dir / "job_result.json"),
        "state_files": [str(Path(p).resolve()) for p in request.state_files],
        "verify": verify,
    }


def net_test_feeds(request, exports: dict) -> dict:
    """Each net's --test_input: its feeds in an onnxruntime run over held-out text."""
    schedule = test_schedule(exports)
    needed = schedule[-1].position + schedule[-1].tokens
    text = base.verification_tokens(
        needed, exports["decode"], request.heldout, list(request.calibrations)
    )
    return real_test_feeds(exports, schedule, text["ids"])

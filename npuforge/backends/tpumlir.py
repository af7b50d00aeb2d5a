"""Sophgo TPU-MLIR backend: ONNX prefill + decode graphs -> one combined bmodel.

Per graph, TPU-MLIR's documented chain (quick start, "Compile the ONNX model";
``tpumlir_commands``): model_transform, run_calibration (INT8), model_deploy, then
model_tool --combine of every net's bmodel. A chunked export gives one net per chunk
and variant (``decode_0``, ``decode_1``, ...: each chunk's hidden state is the next
one's input), as LLM-TPU compiles one net per block, so no tool holds more than a
chunk; a one-chunk export's nets keep the variant's name.

Then the combined bmodel runs on TPU-MLIR's cmodel over the held-out text (one
prefill call, then decode calls carrying the states; ``npuforge.backends.base``)
and its logits are compared with onnxruntime fp32 on the exports.

The command lines are data (``tpumlir_commands``); the job script
(``npuforge/jobs/tpumlir_job.py``) runs them inside the toolchain environment and
parses the similarity figures TPU-MLIR prints. What the host needs is found by
``tpumlir_env``. This module is imported at parse time: keep heavy imports inside
the functions that need them.
"""

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from npuforge.backends import base, gate
from npuforge.backends.bmodel import pin_build_time
from npuforge.backends.tpumlir_commands import (
    CALIBRATION_METHODS,
    DEFAULT_Q_GROUP_SIZE,
    calibration_command,
    combine_command,
    deploy_command,
    transform_command,
)
from npuforge.backends.tpumlir_env import image_build_contexts, native_python, unavailable_reason
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
from npuforge.backends.tpumlir_record import compile_record
from npuforge.backends.tpumlir_run import (  # noqa: F401 - JOB_SCRIPT: the job it runs
    CHUNK_STORE,
    DATA_LIST,
    JOB_SCRIPT,
    chunk_store,
    finished_nets,
    net_store,
    run_spec,
)
from npuforge.errors import NpuforgeError
from npuforge.jobs.finished_chunks import link_or_copy

NAME = "tpumlir"
# Node names of a group-offsets export's side matmuls contain this (the attribute of
# npuforge.models.llama.group_offsets.GroupOffsetLinear; that module imports torch).
GROUP_OFFSETS_NODE = "group_offsets"
# Config precision -> model_deploy.py --quantize.
QUANTIZE = {"f16": "F16", "bf16": "BF16", "w8f16": "W8F16", "w4f16": "W4F16", "int8": "INT8"}
PRECISIONS = tuple(QUANTIZE)
CALIBRATED = frozenset({"int8"})
PROCESSORS = ("bm1684x", "bm1688")
# The cmodel check feeds and compares one sequence's calls (the job reads each net's
# logits as [tokens, vocab]), so a batch-2 bmodel would go out unverified: refused
# when the matrix is planned (npuforge.matrix.check_batch).
MAX_BATCH = 1
# Host memory a compile takes per parameter of its heaviest chunk (npuforge.memory_plan
# plans and reserves from it): TPU-MLIR's tools, two nets side by side, peaked at 12.3 GB
# for Qwen2.5-0.5B's f16 build on BM1688 in 2 chunks of 315M parameters (38.9 bytes per
# parameter; bench/bench_scale.py --models qwen2.5-0.5b-shape --targets BM1688
# --precisions f16 --verify-steps 36 --budget-gb 16). The other precisions, unmeasured,
# take f16's figure.
COMPILE_BYTES_PER_PARAM = dict.fromkeys(("f16", "bf16", "int8", "w8f16", "w4f16"), 40.0)
# RWKV's nets cost the tools more: model_transform alone took 7.6-9.6 GB for one net of
# an RWKV-7 1.5B chunk of 210-239M parameters; the two nets' transforms side by side
# peaked at 18.1 GB (76 bytes per parameter; bench/bench_scale.py --models
# rwkv7-1.5b-shape --targets BM1688 --precisions f16 --verify-steps 40 --budget-gb 12,
# 2026-12-06). One transform at a time, beside the other net's deploy (the job's
# one_at_a_time), the heaviest chunk's job took 11.3 GB (47.3 bytes per parameter; the
# same command's chunk 6, run again by hand). The Llama figure above is from nets side
# by side, before that, so it errs high.
COMPILE_BYTES_PER_PARAM_BY_FAMILY = {"rwkv": dict.fromkeys(COMPILE_BYTES_PER_PARAM, 48.0)}
# model_deploy.py's own --tolerance defaults per --quantize (tpu_mlir 1.30.2,
# ModelDeploy.__init__): "cos,euclid" floors for every tensor it compares.
DEFAULT_TOLERANCE = {
    "f16": "0.99,0.90",
    "bf16": "0.99,0.90",
    "int8": "0.90,0.80",
    "w8f16": "0.90,0.80",
    "w4f16": "0.90,0.80",
}
# The cmodel check's floors against onnxruntime fp32 (see npuforge.backends.gate).
FLOORS = {
    "f16": {"min_cosine": 0.9999},
    "bf16": {"min_cosine": 0.999},
    "int8": {"min_cosine": 0.999},
    "w8f16": {"min_cosine": 0.999},
    "w4f16": {"min_cosine": 0.99},
}

__all__ = ["image_build_contexts", "native_python", "unavailable_reason"]


# Target options the toolchain's preparation and checks read (npuforge.toolchain).
TOOLCHAIN_OPTIONS = ("python",)
# The toolchain's size on disk, the larger of its venv and image (venv 3.6 GB, image 4.3 GB
# with torch 1.12.1, measured 2026-12-02): a build refuses to start with less free.
TOOLCHAIN_SIZE_MB = 4300


@dataclass(frozen=True, kw_only=True)
class Options(base.CommonOptions):
    """TPU-MLIR target options (config/targets.yaml ``options``)."""

    processor: str
    # model_deploy's "cos,euclid" floors: one string, or precision -> string.
    tolerance: str | dict | None = None
    # W4F16 weight group size (model_deploy --q_group_size); None: the export's
    # group_offsets group if it has one, else TPU-MLIR's 64.
    q_group_size: int | None = None
    # W4F16 builds keep the weight matmuls whose node name contains one of these in F16
    # (model_deploy --quantize_table): say, a tied lm_head that is the embedding table.
    w4f16_f16_named: list | None = None
    # The CPython 3.10 to build the native venv from and to copy into the image
    # (default: $PYTHON310, then python3.10 on PATH, then pyenv's).
    python: str | None = None
    # Threads TPU-MLIR's tools may use.
    threads: int = 1
    # Prefill calls of the cmodel check before its decode calls: from the second on, the
    # prefill net starts from a carried state (a prompt longer than one call), which its
    # INT8 state inputs are quantized for; the first starts from zeros.
    verify_prefill_calls: int = 1
    # INT8 builds keep every op on a recurrent state's path (state input -> its output)
    # in this mode (model_deploy --quantize_table): TPU-MLIR's INT8 code for the
    # prefill's unrolled recurrence disagrees with its own interpreter otherwise
    # (state_3_wkv_out euclid 0.89 < 0.90 on BM1684X and BM1688). None: all INT8.
    int8_state_path: str | None = "F16"
    # INT8 builds with only the weight matmuls in INT8, every other op in F16
    # (model_deploy --quantize_table), as RK3588's w8a8 keeps only its Conv: a trained
    # Llama's norms, softmax and residual adds do not survive per-tensor INT8.
    # int8_f16_named: weight matmuls whose node name contains one of these stay F16 too.
    int8_weight_matmuls_only: bool = False
    int8_f16_named: list | None = None
    # How run_calibration picks each INT8 threshold (--cali_method; TPU-MLIR's kl clips
    # a histogram's tail, max keeps every outlier, mse weighs both).
    int8_calibration_method: str = "kl"

    def __post_init__(self):
        if self.processor.lower() not in PROCESSORS:
            raise NpuforgeError(
                f"TPU-MLIR processor '{self.processor}' is not supported: set options.processor "
                f"in targets.yaml to one of {', '.join(PROCESSORS)}"
            )
        if self.int8_calibration_method not in CALIBRATION_METHODS:
            raise NpuforgeError(
                f"TPU-MLIR int8_calibration_method '{self.int8_calibration_method}' is not "
                f"one of {', '.join(CALIBRATION_METHODS)}: set options.int8_calibration_method "
                f"in targets.yaml to one of them"
            )
        if self.int8_f16_named and not self.int8_weight_matmuls_only:
            raise NpuforgeError(
                "TPU-MLIR option int8_f16_named names weight matmuls to keep out of INT8 "
                "only with int8_weight_matmuls_only: true; set it, or remove int8_f16_named"
            )


def gate_hint(precision: str) -> str:
    """What to try when a binary fails its gate: the levers measured on trained weights."""
    if precision == "int8":
        return (
            "try int8_weight_matmuls_only: true (int8_f16_named for outlier-heavy matmuls), "
            "the model's export.smoothquant, more calibration samples, or w8f16 or f16"
        )
    if precision in ("f16", "bf16"):
        return gate.FP16_HINT
    return "build a wider precision (w8f16 or f16)"


def int8_modes(options: Options, onnx_path, inputs: list[dict]) -> dict:
    """TPU-MLIR op name -> mode for the ops an INT8 build keeps out of INT8."""
    modes = {}
    if options.int8_weight_matmuls_only:
        named = tuple(options.int8_f16_named or ())
        modes.update(dict.fromkeys(ops_but_weight_matmuls(onnx_path, named), "F16"))
    if options.int8_state_path:
        modes.update(dict.fromkeys(state_path_ops(onnx_path, inputs), options.int8_state_path))
    return modes


def w4f16_group(options: Options, export) -> int:
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


def w4f16_modes(options: Options, onnx_path, export) -> dict:
    """TPU-MLIR op name -> mode for the weight matmuls a W4F16 build keeps in F16: the
    group offsets' side matmuls (their inputs are the group count wide) and the named."""
    named = list(options.w4f16_f16_named or ())
    if export.meta.get("group_offsets"):
        named.append(GROUP_OFFSETS_NODE)
    return dict.fromkeys(weight_matmuls_named(onnx_path, named), "F16")


def check_target(target_id: str, options: Options, precisions) -> None:
    """Every listed precision must have a quantize mode and a valid tolerance (parse time)."""
    for precision in precisions:
        tolerance(options, precision)


def quantize_mode(precision: str) -> str:
    try:
        return QUANTIZE[precision]
    except KeyError:
        raise NpuforgeError(
            f"precision '{precision}' has no TPU-MLIR quantize mode: use one of "
            f"{', '.join(QUANTIZE)}"
        ) from None


def tolerance(options: Options, precision: str) -> str:
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


def check_exports(exports: dict) -> None:
    """A bmodel net is one static graph; the first chunk's looks up its own embedding."""
    for export in exports.values():
        if export.meta.get("options", {}).get("ext_embedding"):
            raise NpuforgeError(
                f"{export.dir}: exported with an external embedding, which the bmodel cannot "
                "take: set export.ext_embedding: false for the target"
            )


# ---------------------------------------------------------------- the job spec


def _net_plan(export, chunk: int) -> dict:
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


def _net_steps(build: dict, export, chunk: int, net: str, work_dir: Path, test_feeds: dict):
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
            net_steps, record = _net_steps(build, export, chunk, net, work_dir, test_feeds)
            steps += net_steps
            graphs.append(record)
            bmodels.append(Path(net_steps[-1]["expects"][0]))

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
                    net_name(variant, chunk, len(export.graphs)): _net_plan(export, chunk)
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


# ---------------------------------------------------------------- compile


def net_test_feeds(request, exports: dict) -> dict:
    """Each net's --test_input: its feeds in an onnxruntime run over held-out text."""
    schedule = test_schedule(exports)
    needed = schedule[-1].position + schedule[-1].tokens
    text = base.verification_tokens(
        needed, exports["decode"], request.heldout, list(request.calibrations)
    )
    return real_test_feeds(exports, schedule, text["ids"])


def compiles_by_chunk(options: dict) -> bool:
    """Each chunk's nets can be a job of their own (--only-chunk), combined by the compile."""
    return True


def chunk_job_runs_reference(options: dict) -> bool:
    """A chunk's job runs the fp32 graphs over held-out text for its nets' test feeds."""
    return True


def compile(request: base.CompileRequest) -> dict:  # noqa: A001 - the backend interface
    """Spec -> toolchain job -> bmodel + compile.json in ``out_dir``, verified on the cmodel.

    Everything is built in a temporary sibling of ``out_dir`` and renamed on success,
    so a failed compile (or a similarity below tolerance) leaves no output directory.
    """
    import numpy as np

    from npuforge.fileio import atomic_path, read_json, write_json

    options, precision, target = request.options, request.precision, request.target
    quantize_mode(precision)
    for state in request.state_files:
        if not Path(state).is_file():
            raise NpuforgeError(f"state file {state} does not exist: fix the model's state path")
    exports = base.load_exports(request.exports, NAME)
    check_exports(exports)
    stamp = base.read_toolchain(request.toolchain, NAME)
    if request.only_chunk is not None:
        return compile_chunk(request, exports, stamp)
    schedule = base.verification_schedule(
        exports, options.verify_steps, options.verify_prefill_calls
    )
    positions = schedule[-1].position + schedule[-1].tokens
    text = base.verification_tokens(
        positions, exports["decode"], request.heldout, list(request.calibrations)
    )
    reference = base.reference_logits(exports, schedule, text["ids"])
    store = net_store(request.out_dir, stamp)
    try:
        with atomic_path(request.out_dir) as tmp:
            tmp.mkdir()
            work = tmp / "work"
            (work / "verify").mkdir(parents=True)
            calls = base.write_call_feeds(exports, schedule, text["ids"], work / "verify")
            spec = build_spec(request, exports, tmp, work, net_test_feeds(request, exports), calls)
            spec["finished"] = finished_nets(spec, store, tmp.resolve())
            # The nets the workflow's chunk jobs built (kept as their own stores).
            spec["finished"]["also"] = [str(chunk_store(d)) for d in request.chunk_builds]
            run_spec(request, spec, tmp, work, store)
            result = read_json(spec["result"])
            pinned = pin_build_time(spec["bmodel"])
            for state in spec["state_files"]:
                shutil.copyfile(state, tmp / Path(state).name)
            # Keep the tools' logs and similarity figures; drop MLIR files and per-net bmodels.
            shutil.copytree(work / "logs", tmp / "logs", dirs_exist_ok=True)
            shutil.copyfile(spec["result"], tmp / "logs" / "job_result.json")
            logits = np.load(spec["verify"]["outputs"])
            verification = gate.verify(
                request, FLOORS, schedule, text, reference, logits,
                runner=f"TPU-MLIR {base.version(stamp, 'tpu_mlir')} cmodel (pyruntime_bm), the "
                "combined bmodel's nets",
            )  # fmt: skip
            record = compile_record(
                spec, result, stamp, options, verification, request.calibrations
            )
            record["artifacts"][0]["build_time"] = pinned
            shutil.rmtree(work)
            write_json(tmp / "compile.json", record)
            gate.check_gate(
                target,
                precision,
                verification,
                gate_hint(precision),
            )
    finally:
        store.drop_if_empty()
    store.clear()
    return record


def compile_chunk(request: base.CompileRequest, exports: dict, stamp: dict) -> dict:
    """One chunk's nets (its decode and prefill net), built as the whole compile builds
    them and kept, under the keys the compile looks them up by, in ``out_dir``; the
    compile then takes them back instead of building them (the same bytes), combines
    them with the other chunks' and checks the bmodel. A chunk job stopped part way
    keeps the nets it finished beside its output, as a compile does."""
    from npuforge.fileio import atomic_path, read_json, write_json

    chunks = len(exports["decode"].graphs)
    if not 0 <= request.only_chunk < chunks:
        raise NpuforgeError(
            f"chunk {request.only_chunk} of an export in {chunks} chunks: pass --only-chunk "
            f"0 to {chunks - 1}"
        )
    nets = [net_name(v, request.only_chunk, len(e.graphs)) for v, e in exports.items()]
    store = net_store(request.out_dir, stamp)
    try:
        with atomic_path(request.out_dir) as tmp:
            tmp.mkdir()
            work = tmp / "work"
            spec = build_spec(request, exports, tmp, work, net_test_feeds(request, exports), None)
            spec["only_nets"] = nets
            spec["finished"] = finished_nets(spec, store, tmp.resolve())
            run_spec(request, spec, tmp, work, store)
            keys = {net: spec["finished"]["keys"][net] for net in nets}
            for key in keys.values():
                if not (store.dir / key).is_dir():
                    raise NpuforgeError(f"the chunk job kept no net under {key}: see {tmp}/logs")
                link_or_copy(store.dir / key, tmp / CHUNK_STORE / key)
            record = {"chunk": request.only_chunk, "nets": keys, "job": read_json(spec["result"])}
            shutil.rmtree(work)
            write_json(tmp / "chunk.json", json.loads(json.dumps(record).replace(str(tmp), ".")))
    finally:
        store.drop_if_empty()
    store.clear()
    return record

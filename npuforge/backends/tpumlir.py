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

The command lines are data (``tpumlir_commands``), gathered per net into the job's spec
(``tpumlir_spec``); the job script (``npuforge/jobs/tpumlir_job.py``) runs them inside
the toolchain environment and parses the similarity figures TPU-MLIR prints. What the
host needs is found by ``tpumlir_env``. This module is imported at parse time: keep
heavy imports inside the functions that need them.
"""

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from npuforge.backends import base, gate
from npuforge.backends.bmodel import pin_build_time
from npuforge.backends.tpumlir_commands import CALIBRATION_METHODS
from npuforge.backends.tpumlir_env import image_build_contexts, native_python, unavailable_reason
from npuforge.backends.tpumlir_record import compile_record
from npuforge.backends.tpumlir_run import (  # noqa: F401 - JOB_SCRIPT: the job it runs
    CHUNK_STORE,
    JOB_SCRIPT,
    chunk_store,
    finished_nets,
    net_store,
    run_spec,
)
from npuforge.backends.tpumlir_spec import (
    NAME,
    QUANTIZE,
    build_spec,
    net_name,
    net_test_feeds,
    quantize_mode,
    tolerance,
)
from npuforge.errors import NpuforgeError
from npuforge.jobs.finished_chunks import link_or_copy

# Config precision -> model_deploy.py --quantize (tpumlir_spec.QUANTIZE).
PRECISIONS = tuple(QUANTIZE)
PROCESSORS = ("bm1684x", "bm1688")
# The cmodel check feeds and compares one sequence's calls (the job reads each net's
# logits as [tokens, vocab]), so a batch-2 bmodel would go out unverified: refused
# when the matrix is planned (npuforge.matrix.check_batch).
MAX_BATCH = 1
# Host memory a compile takes per parameter of its heaviest chunk (npuforge.memory_plan
# plans and reserves from it): TPU-MLIR's tools peaked at 12.3 GB for each of Qwen2.5-0.5B's
# two 315M-parameter chunks on BM1688, f16 (39.1-39.3 bytes per parameter; bench/
# bench_scale.py --models qwen2.5-0.5b-shape --targets BM1688 --precisions f16
# --verify-steps 40 --budget-gb 16, 2026-12-06), one model_transform at a time: that
# tool alone takes 11.9-12.3 GB per net, as much as two nets side by side took before.
# The other precisions, unmeasured, take f16's figure.
COMPILE_BYTES_PER_PARAM = dict.fromkeys(("f16", "bf16", "int8", "w8f16", "w4f16"), 40.0)
# RWKV's nets cost the tools more: model_transform alone took 7.6-9.6 GB for one net of
# an RWKV-7 1.5B chunk of 210-239M parameters; the two nets' transforms side by side
# peaked at 18.1 GB (76 bytes per parameter; bench/bench_scale.py --models
# rwkv7-1.5b-shape --targets BM1688 --precisions f16 --verify-steps 40 --budget-gb 12,
# 2026-12-06). One transform at a time, beside the other net's deploy (the job's
# one_at_a_time), the heaviest chunk's job took 11.3 GB (47.3 bytes per parameter; the
# same command's chunk 6, run again by hand).
COMPILE_BYTES_PER_PARAM_BY_FAMILY = {"rwkv": dict.fromkeys(COMPILE_BYTES_PER_PARAM, 48.0)}
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


def check_target(target_id: str, options: Options, precisions) -> None:
    """Every listed precision must have a quantize mode and a valid tolerance (parse time)."""
    for precision in precisions:
        tolerance(options, precision)


def check_exports(exports: dict) -> None:
    """A bmodel net is one static graph; the first chunk's looks up its own embedding."""
    for export in exports.values():
        if export.meta.get("options", {}).get("ext_embedding"):
            raise NpuforgeError(
                f"{export.dir}: exported with an external embedding, which the bmodel cannot "
                "take: set export.ext_embedding: false for the target"
            )


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

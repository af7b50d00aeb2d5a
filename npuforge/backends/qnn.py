"""Qualcomm HTP backend: per-SoC QNN context binaries, verified on the x86 HTP simulator.

Two routes produce the binaries:

* ``ep`` (default, runs here): ONNX Runtime's QNN execution provider from the
  ``onnxruntime-qnn`` wheel (QAIRT host libraries) compiles each graph chunk
  into a QNN HTP context binary for the target's ``soc_model``/``htp_arch``
  (EP-context generation) and runs it on the simulator. The work happens in
  ``npuforge/jobs/qnn_job.py`` inside the toolchain environment; this module and
  ``qnn_spec``/``qnn_record`` write its spec and turn its result into
  ``compile.json``; verification and the gate are ``npuforge.backends.base``'s and ``.gate``'s.
* ``sdk``: the QNN SDK's own command-line tools, for users who hold the SDK
  (``npuforge.backends.qnn_sdk``).

The route is ``route`` in the target options, or ``NPUFORGE_QNN_ROUTE`` for
every QNN target at once.

No heavy imports at module level: the toolchain module imports this one while
Snakemake parses the workflow.
"""

import math
import os
import platform
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from npuforge.backends import base, gate, layer_error, qnn_record
from npuforge.backends.qnn_spec import QUANTIZED, RANGE_MARGIN, build_spec
from npuforge.errors import NpuforgeError
from npuforge.fileio import atomic_path, read_json, write_json
from npuforge.jobs.finished_chunks import (
    FinishedChunks,
    job_identity,
    link_or_copy,
    say,
    store_beside,
)

NAME = "qnn"
JOB_SCRIPT = Path(__file__).resolve().parents[1] / "jobs" / "qnn_job.py"
ROUTES = ("ep", "sdk")
ROUTE_ENV = "NPUFORGE_QNN_ROUTE"
# Where a chunk's job (--only-chunk) keeps its contexts in its output directory: a
# FinishedChunks store the compile takes them back from.
CHUNK_STORE = "chunks"
PRECISIONS = ("fp16", "a16w8", "a16w4")

# SoC model ids from the QNN SDK's Qnn_SocModel_t (QnnTypes.h) and HTP
# versions, for one-line messages and for checking targets.yaml entries.
SOC_MODELS = {
    "SM8350": (30, 68),
    "SM8450": (36, 69),
    "SM8475": (42, 69),
    "SM8550": (43, 73),
    "SM8650": (57, 75),
    "SC8380": (60, 73),
    "SM8750": (69, 79),
}

# What each HTP generation computes natively: no fp16 datapath before v69, and
# 4-bit weights only from v73 on.
MIN_HTP_ARCH = {"a16w8": 68, "fp16": 69, "a16w4": 73}

# A context must stay under the HTP's 2 GB graph allocation; weights take this
# much of it, the rest is activations, spill-fill and the context's own tables.
CONTEXT_WEIGHT_BUDGET = 1_500_000_000
BYTES_PER_PARAM = {"fp16": 2.0, "a16w8": 1.0, "a16w4": 0.5}

# Host memory a compile takes per parameter of a chunk (npuforge.matrix plans chunks and
# reserves memory from it, beside base.REFERENCE_BYTES_PER_PARAM). fp16 measured by
# bench/bench_scale.py (docs/scale.md): Qwen2.5-0.5B's shape in 4 chunks (heaviest 225.6M
# parameters), context generation and the simulator check 3,633 MB, 16.1 bytes/parameter,
# the step itself 2,077 MB (9.2); taken at 18. a16w8, which also builds a Q/DQ model
# beside the float one: the same shape in 2 chunks (heaviest 315.2M), 8,592 MB, 27.3
# bytes/parameter, the step 2,380 MB; taken at 30. a16w4: the same shape in 3 chunks, each
# a job of its own: 3,447-3,707 MB for 134.5M parameters, 6,160 MB for 225.1M (25.6-27.6
# bytes/parameter), so a16w8's 30 holds.
COMPILE_BYTES_PER_PARAM = {"fp16": 18.0, "a16w8": 30.0, "a16w4": 30.0}

# The simulator check's floors against onnxruntime fp32 (see npuforge.backends.gate).
FLOORS = {
    "fp16": {"min_cosine": 0.9999},
    "a16w8": {"min_cosine": 0.999},
    "a16w4": {"min_cosine": 0.99},
}


# Target options the toolchain's preparation and checks read (npuforge.toolchain).
TOOLCHAIN_OPTIONS = ("route", "qnn_sdk_root")
# The toolchain's size on disk, the larger of its venv and image (venv 0.5 GB, image 0.8 GB,
# measured 2026-11-27): a build refuses to start with less free.
TOOLCHAIN_SIZE_MB = 800


@dataclass(frozen=True, kw_only=True)
class Options(base.CommonOptions):
    """QNN target options (config/targets.yaml ``options``)."""

    soc_model: int
    htp_arch: int
    vtcm_mb: int = 8
    # HTP graph finalization mode.
    optimization_level: int = 3
    # Share of each calibrated 16-bit activation range added on its open sides.
    range_margin: float = RANGE_MARGIN
    # Quantize only these op types; the rest runs in fp16.
    quantize_op_types: list | None = None
    # MatMul/Gemm weights whose initializer name a regex here matches are int16 per
    # output channel, not the precision's 8 or 4 bits (e.g. attention projections
    # whose inputs carry outlier channels).
    weights_16bit: list | None = None
    # Residual branches (o_proj, down_proj outputs) get 16-bit ranges covering the stream
    # they are added to: a token whose MLP makes or erases a massive activation the
    # calibration never saw is not clipped.
    cover_stream: bool = False
    # A16W4's int4 MatMul weights take a float scale per this many inputs and output
    # channel (QNN block quantization), not one per output channel.
    weight_block_size: int | None = None
    # A16W4: MatMul weights whose name a regex here matches are int8 (in blocks when
    # weight_block_size is set), e.g. an lm_head the checkpoint itself stores at 8 bits.
    weights_8bit: list | None = None
    # ep (ONNX Runtime's QNN EP, runs here) or sdk (the QNN SDK's tools, QNN_SDK_ROOT).
    route: str = "ep"
    # The QNN SDK for the sdk route (else $QNN_SDK_ROOT).
    qnn_sdk_root: str | None = None
    # a16w8/a16w4: held-out steps of a per-layer error analysis of each chunk's Q/DQ
    # model against its fp32 graph (onnxruntime CPU), worst of them in the log and
    # compile.json; 0: none. The binaries do not change.
    layer_error: int = 0

    def __post_init__(self):
        layer_error.check_steps(self.layer_error)


def check_target(target_id: str, options: Options, precisions) -> None:
    """The SoC table and every listed precision against its HTP generation (parse time)."""
    for precision in precisions:
        problem = precision_problem(target_id, options, precision)
        if problem:
            raise NpuforgeError(problem)
    for field in ("weights_16bit", "weights_8bit"):
        for pattern in getattr(options, field) or []:
            try:
                re.compile(pattern)
            except re.error as err:
                raise NpuforgeError(
                    f"target {target_id}: {field} pattern {pattern!r} is not a regular "
                    f"expression ({err}); fix targets.yaml"
                ) from None
    block = options.weight_block_size
    if block is not None and (block < 8 or block % 8):
        raise NpuforgeError(
            f"target {target_id}: weight_block_size {block} is not a positive multiple of 8, "
            "which the HTP's 4-bit block quantization needs; fix targets.yaml"
        )
    known = SOC_MODELS.get(target_id)
    given = (int(options.soc_model), int(options.htp_arch))
    if known and known != given:
        raise NpuforgeError(
            f"target {target_id}: soc_model/htp_arch {given[0]}/{given[1]} do not match the QNN "
            f"SDK's {known[0]}/{known[1]}; fix targets.yaml"
        )
    route(options)


# --------------------------------------------------------------------------- capability


def route(options: Options | None) -> str:
    chosen = os.environ.get(ROUTE_ENV) or getattr(options, "route", None) or "ep"
    if chosen not in ROUTES:
        raise NpuforgeError(
            f"unknown QNN route '{chosen}': set route (or {ROUTE_ENV}) "
            f"to one of {', '.join(ROUTES)}"
        )
    return chosen


def compiles_by_chunk(options: dict) -> bool:
    """Whether each chunk's contexts can be a job of their own (--only-chunk), taken back
    by the compile, which checks them chained on the simulator: the ep route's chunks
    are independent; the sdk route builds every chunk in the compile."""
    return route(SimpleNamespace(route=options.get("route"))) == "ep"


def chunk_job_runs_reference(options: dict) -> bool:
    """Whether a chunk's job runs the fp32 graphs (the planner reserves their memory):
    only the layer_error analysis feeds the chunk the reference run's inputs."""
    return int(options.get("layer_error") or 0) > 0


def supported_precisions(htp_arch: int) -> list[str]:
    return [p for p in PRECISIONS if int(htp_arch) >= MIN_HTP_ARCH[p]]


def precision_problem(target_id: str, options: Options, precision: str) -> str | None:
    """One line when ``precision`` cannot run on this SoC's HTP, else None."""
    if precision not in PRECISIONS:
        return (
            f"target {target_id}: precision '{precision}' is not a QNN precision; "
            f"choose one of {', '.join(PRECISIONS)}"
        )
    arch = int(options.htp_arch)
    if arch < MIN_HTP_ARCH[precision]:
        supported = ", ".join(supported_precisions(arch)) or "none"
        return (
            f"target {target_id} has HTP v{arch}, which cannot run {precision} "
            f"(needs v{MIN_HTP_ARCH[precision]} or newer); it supports: {supported}"
        )
    return None


def plan_chunks(n_params: int, precision: str, budget_bytes: int = CONTEXT_WEIGHT_BUDGET) -> int:
    """Graph chunks so that each HTP context's weights stay within the budget."""
    if precision not in BYTES_PER_PARAM:
        raise NpuforgeError(
            f"unknown QNN precision '{precision}'; choose one of {', '.join(PRECISIONS)}"
        )
    return max(1, math.ceil(int(n_params) * BYTES_PER_PARAM[precision] / budget_bytes))


def unavailable_reason(runtime: str, options: Options) -> str | None:
    """Cheap parse-time check of what this host lacks for a QNN target, as one line."""
    try:
        chosen = route(options)
    except NpuforgeError as err:
        return str(err)
    if chosen == "sdk":
        from npuforge.backends import qnn_sdk

        return qnn_sdk.unavailable_reason(runtime, options)
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return (
            "the QNN EP route compiles with onnxruntime-qnn's x86_64 Linux host libraries; "
            "build QNN targets on an x86_64 Linux machine"
        )
    if runtime == "native" and sys.version_info[:2] != (3, 11):
        return (
            "onnxruntime-qnn 2.7.0 ships only CPython 3.11 wheels: run the workflow with "
            "Python 3.11 or use a container runtime (toolchain runtime podman/docker)"
        )
    return None


# --------------------------------------------------------------------------- compile


def compile(request: base.CompileRequest) -> dict:  # noqa: A001 - the backend interface
    """Compile every chunk for one SoC and precision; binaries + compile.json in out_dir."""
    from npuforge.calibration import calibrations_by_variant

    options, precision, target = request.options, request.precision, request.target
    problem = precision_problem(target, options, precision)
    if problem:
        raise NpuforgeError(problem)
    calibrations = calibrations_by_variant(list(request.calibrations))
    if route(options) == "sdk":
        from npuforge.backends import qnn_sdk

        return qnn_sdk.compile_sdk(request, calibrations.get("decode"))
    if precision in QUANTIZED and not calibrations:
        raise NpuforgeError(f"{precision} needs calibration samples: pass --calibration DIR")
    exports = base.load_exports(request.exports, NAME)
    stamp = base.read_toolchain(request.toolchain, NAME)
    schedule = base.verification_schedule(exports, options.verify_steps)
    if request.only_chunk is not None:
        return compile_chunk_job(request, exports, calibrations, stamp, schedule)
    out_dir = request.out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.work-", dir=out_dir.parent))
    try:
        with atomic_path(out_dir) as staging:
            staging.mkdir()
            text = base.verification_tokens(
                len(schedule) and schedule[-1].position + schedule[-1].tokens,
                exports["decode"],
                request.heldout,
                list(calibrations.values()),
            )
            ids = text["ids"]
            calls = base.write_call_feeds(exports, schedule, ids, work_dir)
            analysed = LayerErrorInputs(schedule, options, precision, work_dir)
            reference = base.reference_logits(exports, schedule, ids, analysed.capture)
            spec = build_spec(exports, calibrations, options, precision, staging, work_dir, calls)
            analysed.add_to(spec)
            read_only = [e.dir for e in exports.values()]
            read_only += [Path(d).resolve() for d in calibrations.values()]
            jobs = ChunkJobs(request, spec, read_only, staging.resolve(), work_dir, stamp)
            jobs.chunk_stores = [Path(d) / CHUNK_STORE for d in request.chunk_builds]
            compiled = jobs.compile_every_chunk()
            if spec.get("verify"):
                compiled_path = jobs.roots["work"] / "compiled.json"  # absolute: the job's cwd
                write_json(compiled_path, compiled)
                spec_path = jobs.roots["work"] / "spec.json"
                write_json(spec_path, {**spec, "chunks": [], "compiled": str(compiled_path)})
                jobs.run(spec_path)
                result = read_json(work_dir / "result.json")
            else:
                result = compiled
            record = _record(
                request, exports, stamp, spec, result, staging, (schedule, text, reference)
            )
            record.update(layer_error_record(result, analysed.steps))
            write_json(staging / "compile.json", record)
            fix = (
                gate.FP16_HINT
                if precision == "fp16"
                else (
                    "set the model's export kv_prefix and calibration samples, keep more "
                    "weights at 16 bit (target option weights_16bit), or use fp16"
                )
            )
            gate.check_gate(target, precision, record["verification"], fix)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    jobs.finished.clear()
    return record


def compile_chunk_job(request, exports, calibrations, stamp, schedule) -> dict:
    """One chunk's contexts (every graph variant's), built as the compile builds them and
    kept in ``out_dir`` under the key the compile looks them up by: the compile takes
    them back instead of building them (the same bytes, which do not depend on where a
    chunk is staged) and checks every chunk chained on the simulator. The workflow's
    compile_chunk jobs, side by side on a many-core host or a cluster."""
    options, precision, index = request.options, request.precision, request.only_chunk
    chunks = len(exports["decode"].graphs)
    if not 0 <= index < chunks:
        raise NpuforgeError(
            f"chunk {index} of an export in {chunks} chunks: pass --only-chunk 0 to {chunks - 1}"
        )
    out_dir = request.out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.work-", dir=out_dir.parent))
    try:
        with atomic_path(out_dir) as staging:
            build = staging / "build"
            build.mkdir(parents=True)
            analysed = LayerErrorInputs(schedule, options, precision, work_dir)
            if analysed.steps:  # the per-layer analysis feeds the reference's inputs
                text = base.verification_tokens(
                    schedule[-1].position + schedule[-1].tokens,
                    exports["decode"],
                    request.heldout,
                    list(calibrations.values()),
                )
                base.reference_logits(exports, schedule, text["ids"], analysed.capture)
            spec = build_spec(exports, calibrations, options, precision, build, work_dir, None)
            analysed.add_to(spec)
            read_only = [e.dir for e in exports.values()]
            read_only += [Path(d).resolve() for d in calibrations.values()]
            jobs = ChunkJobs(request, spec, read_only, build.resolve(), work_dir, stamp)
            jobs.compile_chunk(spec["chunks"][index])
            key = jobs.keys[index]
            link_or_copy(jobs.finished.dir / key, staging / CHUNK_STORE / key)
            shutil.rmtree(build)
            record = {"chunk": index, "key": key}
            write_json(staging / "chunk.json", record)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    jobs.finished.clear()
    return record


def layer_error_record(result, steps) -> dict:
    """``{"layer_error": summary and each chunk's table}`` when the job analysed the
    chunks' decode graphs (option ``layer_error``), its worst rows in the log; else {}."""
    tables = [
        (chunk.get("quantization", {}).get("decode") or {}).get("layer_error")
        for chunk in result["chunks"]
    ]
    if not any(tables):
        return {}
    tables = [table["layers"] if table else [] for table in tables]
    summary = layer_error.summarize(tables, steps)
    tool = "Q/DQ model on the onnxruntime CPU, graph optimisations off"
    for line in layer_error.report_lines(summary, tool):
        say(line)
    return {"layer_error": {**summary, "chunks": tables}}


class LayerErrorInputs:
    """The fp32 reference's inputs of each chunk's decode graph at the held-out steps the
    ``layer_error`` option analyses, one .npz per step, named in the chunk's spec."""

    def __init__(self, schedule, options, precision, work_dir):
        decode_calls = sum(call.variant == "decode" for call in schedule)
        wanted = options.layer_error if precision in QUANTIZED else 0
        self.steps = layer_error.sample_steps(decode_calls, wanted) if wanted else []
        self.dir = Path(work_dir) / "layer_error"
        self.seen, self.files = {}, {}

    def capture(self, variant, index, feeds):
        if variant != "decode" or not self.steps:
            return
        step = self.seen.get(index, 0)
        self.seen[index] = step + 1
        if step in self.steps:
            import numpy as np

            path = self.dir / f"chunk{index}" / f"step{step}.npz"
            path.parent.mkdir(parents=True, exist_ok=True)
            np.savez(path, **{name: np.asarray(value) for name, value in feeds.items()})
            self.files.setdefault(index, []).append(str(path.resolve()))

    def add_to(self, spec) -> None:
        for chunk in spec["chunks"]:
            for graph in chunk["graphs"]:
                if graph["variant"] == "decode" and self.files.get(chunk["index"]):
                    graph["layer_error_inputs"] = self.files[chunk["index"]]


class ChunkJobs:
    """One toolchain job per chunk (kept when it finishes, so a rerun of a compile that
    stopped builds only the chunks it had not finished), then one for the simulator."""

    def __init__(self, request, spec, read_only, staging, work_dir, stamp):
        self.request, self.spec, self.read_only = request, spec, read_only
        self.roots = {"staging": Path(staging).resolve(), "work": Path(work_dir).resolve()}
        identity = job_identity(JOB_SCRIPT, stamp)
        self.finished = FinishedChunks(store_beside(request.out_dir.resolve()), identity)
        # The stores of the workflow's chunk jobs (compile_chunk_job), searched after ours.
        self.chunk_stores: list[Path] = []
        self.keys: dict = {}  # chunk index -> the key its contexts are kept under

    def restore(self, key) -> str | None:
        """Put a chunk built before back under the roots; who built it, or None."""
        if self.finished.restore(key, self.roots) is not None:
            return "an earlier run of this compile"
        for store in self.chunk_stores:
            if FinishedChunks(store).restore(key, self.roots) is not None:
                return "its chunk's job"
        return None

    def run(self, spec_path) -> None:
        writable = list(self.roots.values())
        base.run_job(
            self.request, JOB_SCRIPT, spec_path, read_only=self.read_only, writable=writable
        )

    def compile_every_chunk(self) -> dict:
        """The chunks' results merged as one job's (its simulator twins by absolute path)."""
        merged = None
        for chunk in self.spec["chunks"]:
            result = self.compile_chunk(chunk)
            merged = merged or {**result, "chunks": []}
            merged["chunks"] += result["chunks"]
        return merged

    def compile_chunk(self, chunk) -> dict:
        index = chunk["index"]
        chunk_dir = self.roots["work"] / f"chunk{index}"
        chunk_dir.mkdir()
        spec = {k: v for k, v in self.spec.items() if k != "verify"}
        spec_path = chunk_dir / "spec.json"
        write_json(spec_path, {**spec, "chunks": [chunk], "work_dir": str(chunk_dir)})
        description = spec_path.read_text(encoding="utf-8")
        key = self.finished.key(description, self.roots, inputs=chunk_inputs(chunk))
        self.keys[index] = key
        reused = self.restore(key)
        if reused:
            say(f"chunk {index}: built by {reused}, reused ({key[:12]})")
        else:
            try:
                self.run(spec_path)
            except BaseException:
                if index:
                    say(f"chunks 0-{index - 1} are kept: a rerun of this compile reuses them")
                raise
            produced = produced_files(read_json(chunk_dir / "result.json"))
            outputs = [chunk_dir / "result.json", chunk_dir / "simulate"]
            outputs += [self.roots["staging"] / name for name in produced]
            self.finished.keep(key, outputs, self.roots)
        result = read_json(chunk_dir / "result.json")
        for entry in result["chunks"]:
            for variant, twin in entry.get("simulate_ctx", {}).items():
                entry["simulate_ctx"][variant] = str(chunk_dir / twin)
        return result


def chunk_inputs(chunk) -> list[Path]:
    """The files a chunk's job reads besides its spec: graphs, their weights, samples."""
    files = []
    for graph in chunk["graphs"]:
        model = Path(graph["model"])
        weights = model.with_name(model.name + ".data")
        files += [model, weights] if weights.is_file() else [model]
        files += [Path(p) for sample in graph.get("calibration", []) for p in sample.values()]
        files += [Path(p) for p in graph.get("layer_error_inputs", [])]
    return files


def produced_files(result) -> list[str]:
    """The files a chunk job wrote into the output (its contexts and their binaries)."""
    return sorted({name for entry in result["chunks"] for name in entry["out_files"]})


def simulator_time_line(run: dict, schedule) -> str:
    """Where the simulator's time went, per variant: per call and per token."""
    parts = []
    for variant, seconds in sorted(run.get("simulator_seconds_by_variant", {}).items()):
        calls = [call for call in schedule if call.variant == variant]
        tokens, plural = sum(call.tokens for call in calls), "s" * (len(calls) != 1)
        parts.append(
            f"{variant} {len(calls)} call{plural} of {tokens} tokens {seconds:.1f} s "
            f"({seconds / len(calls):.2f} s per call, {seconds / tokens:.2f} s per token)"
        )
    detail = f": {'; '.join(parts)}" if parts else ""
    return f"simulator verification: {run['simulator_seconds']} s{detail}"


def _verification(request, checked, result, stamp) -> dict:
    import numpy as np

    schedule, text, reference = checked
    outputs = dict(np.load(result["verification"]["outputs"]))
    logits = [name[len("reference/") :] for name in outputs if name.startswith("reference/")]
    if not logits:
        raise NpuforgeError(
            "the simulator run produced no logits to compare; check the export's output roles"
        )
    compiled = outputs[f"compiled/{logits[0]}"]
    if compiled.shape != reference.shape:
        raise NpuforgeError(
            f"the simulator returned logits of shape {list(compiled.shape)}, npuforge's "
            f"runner {list(reference.shape)}: the spec and the job disagree; rerun with one "
            "npuforge checkout"
        )
    print(simulator_time_line(result["verification"], schedule), file=sys.stderr)
    verification = gate.verify(
        request, FLOORS, schedule, text, reference, compiled,
        runner=f"QNN HTP x86 simulator (onnxruntime-qnn {base.version(stamp, 'onnxruntime-qnn')})",
    )  # fmt: skip
    # The job's own onnxruntime CPU run on the same feeds: tells a compiler error
    # (this is ~0) from a feeding error (this is large too).
    job_cpu = gate.fidelity(reference, outputs[f"reference/{logits[0]}"])
    verification["toolchain_cpu_max_abs_rel"] = job_cpu["max_abs_rel"]
    return verification


def _record(request, exports, stamp, spec, result, staging, checked) -> dict:
    from npuforge.calibration import calibrations_by_variant

    options, precision = request.options, request.precision
    variants = list(exports)
    artifacts, notes, qairt = qnn_record.artifacts_and_notes(result, variants, staging)
    verification = None
    if "verification" in result:
        verification = _verification(request, checked, result, stamp)
    calibrations = calibrations_by_variant(list(request.calibrations)) if (
        precision in QUANTIZED
    ) else {}  # fmt: skip
    return {
        "backend": NAME,
        "target": request.target,
        "precision": precision,
        "route": "ep",
        "artifacts": artifacts,
        "split": {
            "chunks": len(result["chunks"]),
            "reason": (
                "export chunks; plan_chunks keeps each HTP context under "
                f"{CONTEXT_WEIGHT_BUDGET} bytes of weights"
            ),
        },
        "toolchain": base.toolchain_record(stamp),
        "reproducible": qnn_record.heap_pinned(result),
        "qairt": qnn_record.qairt_record(qairt, options, stamp.get("versions", {})),
        "verification": verification,
        "options": {
            **qnn_record.options_record(options, spec, result, exports, precision, calibrations),
            "chunks": notes,
        },
    }

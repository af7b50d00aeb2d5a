"""Rockchip RK3588 / RK3576 backend: .rknn per graph chunk from rknn-toolkit2, verified.

The vendor steps, per chunk of a decode export (the rest is ``npuforge.backends.base``):

1. rewrite the ONNX graph so that every op stays on the NPU and clear of a
   compiler bug (``npuforge.backends.rknn_graph``);
2. write a job spec and run ``npuforge/jobs/rknn_job.py`` in the rknn toolchain,
   which builds the ``.rknn``, exports it and runs the toolkit's simulator over the
   verification steps in the same process (the simulator cannot load an exported
   file);
3. chain the chunks: chunk i's simulator reads the hidden outputs chunk i-1's
   simulator produced, each chunk carrying its own recurrent state, so the last
   chunk's logits are the whole compiled model's; ``compile.json`` adds the op
   placement (CPU-fallback count) and how the model was split.

Reproducible bytes: ``npuforge/jobs/job_stage.py`` (rknn-toolkit2 writes
uninitialised heap bytes and stale pointers into the .rknn).

No heavy imports at module level: the registry imports this module while the
workflow parses.
"""

import math
import platform
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from npuforge import backends
from npuforge.backends import base, gate, layer_error
from npuforge.errors import NpuforgeError
from npuforge.fileio import atomic_path, read_json, sha256_file, write_json
from npuforge.jobs.finished_chunks import (
    FinishedChunks,
    files_in,
    job_identity,
    say,
    store_beside,
)

NAME = "rknn"
JOB_SCRIPT = Path(__file__).resolve().parents[1] / "jobs" / "rknn_job.py"
# What rknn-toolkit2 2.5.0 builds for each platform (checked by compiling).
PLATFORM_PRECISIONS = {
    "rk3588": ("fp16", "w8a8", "w16a16i_dfp"),
    "rk3576": ("fp16", "w8a8", "w16a16i"),
}
PRECISIONS = ("fp16", "w8a8", "w16a16i", "w16a16i_dfp")
QUANTIZED_ALGORITHMS = ("normal", "mmse", "kl_divergence")
# The simulator check's floors against onnxruntime fp32 (see npuforge.backends.gate).
FLOORS = {
    "fp16": {"min_cosine": 0.9999},
    "w8a8": {"min_cosine": 0.999},
    "w16a16i": {"min_cosine": 0.9999},
    "w16a16i_dfp": {"min_cosine": 0.9999},
}
# Peak compile memory per parameter of a chunk, measured by bench/bench_rknn.py: 0.93 GB
# peak RSS for a 20.3M-parameter RWKV-7 chunk, fp16 (46 bytes/param, the toolkit's own
# ~0.4 GB baseline included). npuforge.matrix plans the chunks and reserves memory from it
# and base.REFERENCE_BYTES_PER_PARAM: 54 per parameter of the heaviest chunk for the job.
# bench/bench_scale.py at fp16 (docs/scale.md) measured the job at 58 (SmolLM2-135M, one
# 134.5M chunk: toolkit 4.26 GB, the step itself 3.53 GB) and 53 (Qwen2.5-0.5B's shape,
# heaviest chunk 255M: 7.02 + 6.51 GB): the toolkit takes 28-32 of it, the step ~26 (the
# reference run and the chunk's ONNX loaded whole to be rewritten).
COMPILE_BYTES_PER_PARAM = {"fp16": 46.0, "w8a8": 46.0, "w16a16i": 46.0, "w16a16i_dfp": 46.0}
# rknn-toolkit2 2.5.0 ships cp36..cp312 wheels for x86_64 and aarch64 Linux.
PYTHONS = ((3, 6), (3, 12))
FLOAT16_KEYS = ("op_types", "except_op_types")
# Layers also kept float16 whatever their op type: substrings of the toolkit's layer names.
FLOAT16_NAMED = "layers_named"


# Target options the toolchain's preparation and checks read (npuforge.toolchain).
TOOLCHAIN_OPTIONS = ()
# The toolchain's size on disk, the larger of its venv and image (venv 1.5 GB, image 1.8 GB,
# measured 2026-11-27): a build refuses to start with less free.
TOOLCHAIN_SIZE_MB = 1800


@dataclass(frozen=True, kw_only=True)
class Options(base.CommonOptions):
    """RKNN target options (config/targets.yaml ``options``)."""

    target_platform: str
    optimization_level: int = 3
    quantized_algorithm: str = "normal"
    # Hybrid quantization: {precision: {op_types: [...]} or {except_op_types: [...]}}.
    float16: dict | None = None
    # The toolkit's own hybrid search (layers below the cosine threshold stay float16).
    auto_hybrid: bool = False
    auto_hybrid_cos_thresh: float | None = None
    # Held-out steps of the toolkit's per-layer error analysis (accuracy_analysis) after
    # the build, worst of them in the log and compile.json; 0: none.
    layer_error: int = 0

    def __post_init__(self):
        if self.target_platform.lower() not in PLATFORM_PRECISIONS:
            raise NpuforgeError(
                f"target_platform '{self.target_platform}' is not one this backend knows: use "
                f"one of {', '.join(sorted(PLATFORM_PRECISIONS))} in the target's options"
            )
        if self.quantized_algorithm not in QUANTIZED_ALGORITHMS:
            raise NpuforgeError(
                f"quantized_algorithm '{self.quantized_algorithm}' is not one of "
                f"{', '.join(QUANTIZED_ALGORITHMS)}"
            )
        layer_error.check_steps(self.layer_error)

    @property
    def platform(self) -> str:
        return self.target_platform.lower()


def gate_hint(options: Options, precision: str) -> str:
    """What to try when a binary fails its gate (quantized: the algorithms not tried yet)."""
    if precision == "fp16":
        return gate.FP16_HINT
    others = [a for a in QUANTIZED_ALGORITHMS if a != options.quantized_algorithm]
    return (
        f"try quantized_algorithm {' or '.join(others)}, more calibration samples, a "
        "float16 selection (option float16) or fp16"
    )


def check_target(target_id: str, options: Options, precisions) -> None:
    """Every precision the registry lists must be one the platform builds (parse time)."""
    for precision in precisions:
        check_precision(target_id, options, precision)
        float16_selection(options, precision)


def check_precision(target: str, options: Options, precision: str) -> None:
    supported = PLATFORM_PRECISIONS[options.platform]
    if precision not in supported:
        raise NpuforgeError(
            f"{target} ({options.platform}) cannot build precision '{precision}': "
            f"choose one of {', '.join(supported)}"
        )


def float16_selection(options: Options, precision: str) -> dict | None:
    """What hybrid quantization keeps in float16 for ``precision`` (option ``float16``).

    ``float16: {<precision>: {op_types: [...]}}`` keeps the outputs of those
    rknn-toolkit2 op types (as its layer table names them: Conv, exNorm, Mul, ...)
    in float16; ``{except_op_types: [...]}`` keeps everything else in float16.
    ``layers_named: [...]`` also keeps every layer whose name contains one of
    the strings (e.g. a trained Llama's ``down_proj``, whose input has outliers).
    """
    table = options.float16
    if table is None or precision == "fp16":
        return None
    quantized = [p for p in PLATFORM_PRECISIONS[options.platform] if p != "fp16"]
    if not isinstance(table, dict) or not set(table) <= set(quantized):
        raise NpuforgeError(
            f"option float16 must map quantized precisions ({', '.join(quantized)}) to "
            f"{{op_types: [...]}} or {{except_op_types: [...]}}, got {table!r}"
        )
    chosen = table.get(precision)
    if chosen is None:
        return None
    rules = [k for k in chosen if k in FLOAT16_KEYS] if isinstance(chosen, dict) else []
    if len(rules) != 1 or set(chosen) - {*FLOAT16_KEYS, FLOAT16_NAMED}:
        raise NpuforgeError(
            f"option float16.{precision} must be {{op_types: [...]}} or "
            f"{{except_op_types: [...]}}, optionally with {{{FLOAT16_NAMED}: [...]}}, "
            f"got {chosen!r}"
        )
    selection = {}
    for key in (rules[0], FLOAT16_NAMED):
        values = chosen.get(key)
        if key == FLOAT16_NAMED and values is None:
            continue
        if (
            not isinstance(values, list)
            or not values
            or not all(isinstance(v, str) and v for v in values)
        ):
            example = "[Conv]" if key != FLOAT16_NAMED else "[down_proj, layernorm]"
            raise NpuforgeError(
                f"option float16.{precision}.{key} must be a non-empty list of strings "
                f"(e.g. {example}), got {values!r}"
            )
        selection[key] = sorted(set(values))
    if options.auto_hybrid:
        raise NpuforgeError(
            "options auto_hybrid and float16 both choose the float16 layers: set only one"
        )
    return selection


def unavailable_reason(runtime: str, options: Options) -> str | None:
    """Why rknn jobs cannot run here (one line), or None. Cheap: no imports, no processes."""
    if runtime == "native":
        if platform.system() != "Linux" or platform.machine() not in ("x86_64", "aarch64"):
            return (
                f"rknn-toolkit2 runs on Linux x86_64/aarch64, not {platform.system()} "
                f"{platform.machine()}: use a Linux host or toolchain_runtime=podman"
            )
        low, high = PYTHONS
        if not low <= sys.version_info[:2] <= high:
            return (
                f"rknn-toolkit2 2.5.0 has no wheel for Python {sys.version_info[0]}."
                f"{sys.version_info[1]}: run the workflow with Python 3.8-3.12 or "
                "toolchain_runtime=podman"
            )
    return None


# --------------------------------------------------------------------------- job spec


def _param_count(export: base.Export) -> int:
    import onnx

    total = 0
    for graph in export.graphs:
        model = onnx.load(str(export.dir / graph["file"]), load_external_data=False)
        for init in model.graph.initializer:
            total += math.prod(init.dims)
    return total


def build_spec(graph, chunk, paths, options: Options, precision, dataset, steps) -> dict:
    """The job spec of one chunk (everything absolute; see npuforge/jobs/rknn_job.py)."""
    layer_inputs = paths.get("layer_error_inputs")
    return {
        "onnx": str(paths["onnx"]),
        "rknn": str(paths["rknn"]),
        "target_platform": options.platform,
        "precision": precision,
        "quantized_algorithm": options.quantized_algorithm,
        "optimization_level": int(options.optimization_level),
        "dataset": str(dataset) if dataset else None,
        "auto_hybrid": bool(options.auto_hybrid),
        "auto_hybrid_cos_thresh": options.auto_hybrid_cos_thresh,
        "float16": float16_selection(options, precision),
        "hybrid_dir": str(paths["hybrid_dir"]),
        "inputs": [
            {k: spec[k] for k in ("name", "shape", "role", "output") if k in spec}
            for spec in graph["inputs"]
        ],
        "outputs": [{k: spec[k] for k in ("name", "shape", "role")} for spec in graph["outputs"]],
        "verify": {
            "steps": steps,
            "feeds": {name: str(path) for name, path in paths["feeds"].items()},
            "start": {name: str(path) for name, path in paths.get("start", {}).items()},
            "save": {name: str(path) for name, path in paths["save"].items()},
        },
        "layer_error": {
            "inputs": [[str(path) for path in sample] for sample in layer_inputs],
            "dir": str(paths["layer_error_dir"]),
        }
        if layer_inputs
        else None,
        "build_log": str(paths["build_log"]),
        "result": str(paths["result"]),
        "chunk": chunk,
    }


# --------------------------------------------------------------------------- compile


def compile(request: base.CompileRequest) -> dict:  # noqa: A001 - the backend interface
    """Compile every chunk of the decode export to .rknn, verify, write ``compile.json``."""
    import numpy as np

    from npuforge.backends.rknn_graph import rewrite_file
    from npuforge.calibration import calibrations_by_variant, read_calibration
    from npuforge.calibration_formats import chunk_samples, write_rknn_dataset

    options, precision, target = request.options, request.precision, request.target
    check_precision(target, options, precision)
    float16 = float16_selection(options, precision)
    export = base.load_exports(request.exports, NAME, prefill=False)["decode"]
    if int(export.meta.get("batch", 1)) != 1:
        raise NpuforgeError(
            f"{export.dir}: the rknn backend compiles a batch-1 decode export; export with batch 1"
        )
    quantized = precision != "fp16"
    calibration_dir = calibration = None
    if quantized:
        calibration_dir = calibrations_by_variant(request.calibrations).get("decode")
        if not calibration_dir:
            raise NpuforgeError(f"{precision} needs calibration samples: pass --calibration DIR")
        calibration_dir = Path(calibration_dir).resolve()
        calibration = read_calibration(calibration_dir)
        if len(calibration["chunks"]) != len(export.graphs):
            raise NpuforgeError(
                f"calibration in {calibration_dir} has {len(calibration['chunks'])} chunks, the "
                f"export {len(export.graphs)}; recreate the samples for this export"
            )
    stamp = base.read_toolchain(request.toolchain, NAME)

    n_params = _param_count(export)
    chunks = len(export.graphs)
    exports = {"decode": export}
    schedule = base.verification_schedule(exports, options.verify_steps)
    steps = len(schedule)
    text = base.verification_tokens(
        steps, export, request.heldout, [calibration_dir] if calibration_dir else []
    )
    fed = {}

    def capture(variant, index, feeds):
        for name, value in feeds.items():
            fed.setdefault((index, name), []).append(np.array(value, copy=True))

    reference = base.reference_logits(exports, schedule, text["ids"], capture)

    analysed = layer_error.sample_steps(steps, options.layer_error) if options.layer_error else []
    out_dir = request.out_dir.resolve()
    finished = FinishedChunks(store_beside(out_dir), job_identity(JOB_SCRIPT, stamp))
    with atomic_path(out_dir) as staging:
        staging.mkdir(parents=True)
        work = staging / "work"
        work.mkdir()
        artifacts, placements, rewrites, aslr_disabled, hybrids, errors = [], [], [], [], [], []
        site_packages, clocks, threads, simulated = set(), set(), [], []
        previous_outputs = {}
        logits = None
        for index, graph in enumerate(export.graphs):
            chunk_work = work / f"chunk{index}"
            chunk_work.mkdir()
            onnx_path = chunk_work / "model.onnx"
            rewrites.append({"chunk": index, **rewrite_file(export.dir / graph["file"], onnx_path)})
            feeds, start = {}, {}
            for spec in graph["inputs"]:
                if spec["role"] == "state" and export.meta.get("kv_prefix"):
                    # The state the reference's first call started from: the prefix rows.
                    start[spec["name"]] = chunk_work / f"start_{spec['name']}.npy"
                    np.save(start[spec["name"]], fed[(index, spec["name"])][0])
                if spec["role"] == "state":
                    continue
                path = chunk_work / f"feed_{spec['name']}.npy"
                if spec["role"] == "hidden":
                    value = previous_outputs[spec["name"][: -len("_in")] + "_out"]
                else:
                    value = np.stack(fed[(index, spec["name"])])
                np.save(path, value)
                feeds[spec["name"]] = path
            save = {
                spec["name"]: chunk_work / f"out_{spec['name']}.npy"
                for spec in graph["outputs"]
                if spec["role"] in ("hidden", "logits")
            }
            paths = {
                "onnx": onnx_path,
                "rknn": staging / f"chunk{index}.rknn",
                "feeds": feeds,
                "start": start,
                "save": save,
                "build_log": chunk_work / "build.log",
                "result": chunk_work / "result.json",
                "hybrid_dir": chunk_work / "hybrid",
                "layer_error_inputs": write_layer_error_inputs(
                    graph, index, fed, analysed, chunk_work
                ),
                "layer_error_dir": chunk_work / "layer_error",
            }
            dataset = None
            if quantized:
                samples, sample_inputs = chunk_samples(calibration_dir, index)
                dataset = write_rknn_dataset(samples, sample_inputs, chunk_work / "dataset")
            spec = build_spec(graph, index, paths, options, precision, dataset, steps)
            spec_path = chunk_work / "spec.json"
            write_json(spec_path, spec)
            env = {"MALLOC_PERTURB_": "85", "OMP_NUM_THREADS": "1"}
            outputs = [paths[k] for k in ("rknn", "build_log", "result", "hybrid_dir")]
            outputs += save.values()
            roots = {"staging": staging}
            description = spec_path.read_text(encoding="utf-8")
            key = finished.key(description, roots, env, files_in(chunk_work, but=[spec_path]))
            if finished.restore(key, roots) is not None:
                say(f"chunk {index}: built by an earlier run of this compile, reused ({key[:12]})")
            else:
                run_chunk_job(request, spec_path, [export.dir], staging, env, paths, chunks, index)
                finished.keep(key, outputs, roots)
            result = read_json(paths["result"])
            placements.append({"chunk": index, **result["placement"]})
            if result.get("hybrid"):
                hybrids.append({"chunk": index, **result["hybrid"]})
            if result.get("layer_error"):
                errors.append(result["layer_error"]["layers"])
            aslr_disabled.append(bool(result.get("aslr_disabled")))
            site_packages.add(result.get("site_packages", "none"))
            clocks.add(result.get("fixed_clock"))
            threads.append(result.get("threads"))
            simulated.append(result.get("simulator_seconds"))
            for spec_out in graph["outputs"]:
                if spec_out["role"] == "hidden":
                    previous_outputs[spec_out["name"]] = np.load(save[spec_out["name"]])
                elif spec_out["role"] == "logits":
                    logits = np.load(save[spec_out["name"]])
            artifacts.append(
                {
                    "file": paths["rknn"].name,
                    "sha256": sha256_file(paths["rknn"]),
                    "role": "binary",
                    "chunk": index,
                    "layers": graph.get("layers"),
                }
            )
        shutil.rmtree(work)
        say(simulator_time_line(simulated, steps))
        layer_errors = None
        if errors:
            layer_errors = layer_error.summarize(errors, analysed)
            for line in layer_error.report_lines(layer_errors, "rknn-toolkit2 accuracy_analysis"):
                say(line)

        verification = gate.verify(
            request, FLOORS, schedule, text, reference, logits,
            runner=f"rknn-toolkit2 {base.version(stamp, 'rknn-toolkit2')} simulator, "
            "chunks chained",
        )  # fmt: skip
        record = {
            "backend": NAME,
            "target": target,
            "precision": precision,
            "artifacts": artifacts,
            "split": {
                "chunks": chunks,
                "layers": [g.get("layers") for g in export.graphs],
                "parameters": n_params,
                "reason": (
                    "export chunks: npuforge.matrix plans them so each compile fits the "
                    f"target's memory_budget_gb at ~{COMPILE_BYTES_PER_PARAM[precision]:g} "
                    "bytes/parameter"
                ),
            },
            "toolchain": base.toolchain_record(stamp),
            "verification": verification,
            "placement": {
                "cpu_fallback": sum(p["cpu_fallback"] for p in placements),
                "chunks": placements,
            },
            "graph_rewrites": rewrites,
            **({"layer_error": {**layer_errors, "chunks": errors}} if layer_errors else {}),
            "options": {
                **backends.options_dict(options),
                "quantized_dtype": precision if quantized else None,
                # Which tensors stayed float16 and the hash of the toolkit's quantization config.
                "float16": {"selection": float16, "chunks": hybrids} if float16 else None,
                "malloc_perturb": 85,
                "aslr_disabled": all(aslr_disabled),
                # The toolkit writes its own timings' stale stack bytes into the file.
                "fixed_clock": clocks.pop() if len(clocks) == 1 else None,
                # Another thread's GIL handoffs leave load-dependent stack bytes there too.
                "job_threads": None if None in threads else max(threads),
                # hard-linked: the bytes do not depend on where the toolchain lives.
                "site_packages": ",".join(sorted(site_packages)),
                "calibration": (
                    base.calibration_summary(calibration_dir, hosts=True) if quantized else None
                ),
            },
        }
        write_json(staging / "compile.json", record)
        gate.check_gate(
            target,
            precision,
            verification,
            gate_hint(options, precision),
        )
    finished.clear()
    return record


def simulator_time_line(seconds: list, calls: int) -> str:
    """Where the simulator's time went: per decode call through every chunk, and per
    chunk (a chunk reused from an earlier run reports the time it took then)."""
    if not calls or None in seconds:
        return "simulator verification: time not reported by every chunk's job"
    total = sum(seconds)
    chunks = ", ".join(f"{s:.1f}" for s in seconds)
    return (
        f"simulator verification: {total:.1f} s: decode {calls} calls of {calls} tokens "
        f"through {len(seconds)} chunks ({total / calls:.2f} s per call; per chunk: "
        f"{chunks} s)"
    )


def write_layer_error_inputs(graph, index, fed, steps, chunk_work) -> list[list[Path]]:
    """The fp32 reference's inputs of chunk ``index`` at each analysed step, .npy per input."""
    import numpy as np

    samples = []
    for j, step in enumerate(steps):
        sample = []
        for k, spec in enumerate(graph["inputs"]):
            path = chunk_work / f"layer_error_{j}_{k}.npy"
            value = fed[(index, spec["name"])][step]
            np.save(path, np.ascontiguousarray(value, dtype=spec.get("dtype", "float32")))
            sample.append(path)
        samples.append(sample)
    return samples


def run_chunk_job(request, spec_path, read_only, staging, env, paths, chunks, index) -> None:
    """One chunk's toolkit job; its build log joins the step's log either way."""
    try:
        base.run_job(
            request, JOB_SCRIPT, spec_path, read_only=read_only, writable=[staging], env=env
        )
    except BaseException:
        if index:
            say(f"chunks 0-{index - 1} of {chunks} are kept: a rerun of this compile reuses them")
        raise
    finally:
        if request.log_path and paths["build_log"].is_file():
            with open(request.log_path, "a", encoding="utf-8") as log:
                log.write(paths["build_log"].read_text(errors="replace"))

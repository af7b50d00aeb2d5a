"""Rockchip RK3588 / RK3576 backend: .rknn per graph chunk from rknn-toolkit2, verified.

For each chunk of a decode export this module

1. rewrites the ONNX graph so that every op stays on the NPU and clear of a
   compiler bug (``npuforge.backends.rknn_graph``),
2. writes a JSON job spec and runs ``rknn_job.py`` in the rknn toolchain
   environment (``npuforge.toolchain``: native venv or container), which builds
   the ``.rknn``, exports it and runs the toolkit's simulator over the
   verification steps in the same process,
3. chains the chunks: chunk i's simulator reads the hidden outputs chunk i-1's
   simulator produced, and every chunk carries its own recurrent state, so the
   last chunk's logits are the whole compiled model's,
4. compares them with onnxruntime fp32 on the source export and writes
   ``compile.json`` (docs/interfaces.md) with the figures, the op placement
   (CPU-fallback count) and how the model was split.

Reproducible bytes: rknn-toolkit2 writes heap memory it allocated but never
initialised (fixed by glibc's ``MALLOC_PERTURB_``: 0xaa for 85) and stale pointers
from struct padding into the .rknn file. The pointers follow the process's memory
layout, so ``rknn_job.py`` re-executes itself with randomisation off, one malloc
arena, one CPU, a fixed environment, and from a fixed-path staging directory that
hides where the checkout, the inputs and the toolchain live (compile.json:
``aslr_disabled``, ``site_packages``). What it cannot hide is the interpreter
binary: a native venv and an image with a different Python build differ in about
15-30 bytes at the start of each file, all inside that padding.
Containers need ``--security-opt seccomp=unconfined`` (or a profile allowing
``personality(ADDR_NO_RANDOMIZE)``) for that.

No heavy imports at module level: the toolchain module imports this one while
Snakemake parses the workflow.
"""

import math
import platform
import shutil
import sys
from pathlib import Path

from npuforge.errors import NpuforgeError
from npuforge.fileio import atomic_path, read_json, sha256_file, write_json
from npuforge.verify import logits_agreement

BACKEND = "rknn"
JOB_SCRIPT = Path(__file__).with_name("rknn_job.py")
# What rknn-toolkit2 2.5.0 builds for each platform (checked by compiling).
PLATFORM_PRECISIONS = {
    "rk3588": ("fp16", "w8a8", "w16a16i_dfp"),
    "rk3576": ("fp16", "w8a8", "w16a16i"),
}
PRECISIONS = ("fp16", "w8a8", "w16a16i", "w16a16i_dfp")
QUANTIZED_ALGORITHMS = ("normal", "mmse", "kl_divergence")
# Lowest acceptable logits cosine, simulator vs onnxruntime fp32 (issue 4).
MIN_COSINE = {"fp16": 0.9999, "w8a8": 0.999, "w16a16i": 0.9999, "w16a16i_dfp": 0.9999}
# glibc fills fresh heap blocks with ~85 = 0xaa: the toolkit's uninitialised bytes
# become a fixed pattern, so two compiles give the same file.
MALLOC_PERTURB = "85"
# Peak compile memory per parameter, measured by bench/bench_rknn.py: 0.93 GB peak
# RSS for a 20.3M-parameter RWKV-7 chunk, fp16 (46 bytes/param, the toolkit's own
# ~0.4 GB baseline included, so larger chunks come out conservative).
COMPILE_BYTES_PER_PARAM = {"fp16": 46.0, "w8a8": 46.0, "w16a16i": 46.0, "w16a16i_dfp": 46.0}
# rknn-toolkit2 2.5.0 ships cp36..cp312 wheels for x86_64 and aarch64 Linux.
PYTHONS = ((3, 6), (3, 12))


def platform_of(target_options: dict) -> str:
    name = str(target_options.get("target_platform", "")).lower()
    if name not in PLATFORM_PRECISIONS:
        raise NpuforgeError(
            f"target_platform '{name}' is not one this backend knows: use one of "
            f"{', '.join(sorted(PLATFORM_PRECISIONS))} in the target's options"
        )
    return name


def check_precision(target: str, target_options: dict, precision: str) -> None:
    supported = PLATFORM_PRECISIONS[platform_of(target_options)]
    if precision not in supported:
        raise NpuforgeError(
            f"{target} ({platform_of(target_options)}) cannot build precision '{precision}': "
            f"choose one of {', '.join(supported)}"
        )


FLOAT16_KEYS = ("op_types", "except_op_types")


def float16_selection(target_options: dict, precision: str) -> dict | None:
    """What hybrid quantization keeps in float16 for ``precision`` (option ``float16``).

    ``float16: {<precision>: {op_types: [...]}}`` keeps the outputs of those
    rknn-toolkit2 op types (as its layer table names them: Conv, exNorm, Mul, ...)
    in float16; ``{except_op_types: [...]}`` keeps everything else in float16.
    """
    table = target_options.get("float16")
    if table is None or precision == "fp16":
        return None
    quantized = [p for p in PLATFORM_PRECISIONS[platform_of(target_options)] if p != "fp16"]
    if not isinstance(table, dict) or not set(table) <= set(quantized):
        raise NpuforgeError(
            f"option float16 must map quantized precisions ({', '.join(quantized)}) to "
            f"{{op_types: [...]}} or {{except_op_types: [...]}}, got {table!r}"
        )
    chosen = table.get(precision)
    if chosen is None:
        return None
    if not isinstance(chosen, dict) or len(chosen) != 1 or next(iter(chosen)) not in FLOAT16_KEYS:
        raise NpuforgeError(
            f"option float16.{precision} must be {{op_types: [...]}} or "
            f"{{except_op_types: [...]}}, got {chosen!r}"
        )
    key, types = next(iter(chosen.items()))
    if not isinstance(types, list) or not types or not all(isinstance(t, str) and t for t in types):
        raise NpuforgeError(
            f"option float16.{precision}.{key} must be a non-empty list of rknn-toolkit2 op "
            f"types (e.g. [Conv]), got {types!r}"
        )
    if target_options.get("auto_hybrid"):
        raise NpuforgeError(
            "options auto_hybrid and float16 both choose the float16 layers: set only one"
        )
    return {key: sorted(set(types))}


def plan_chunks(n_params: int, precision: str, memory_budget_gb: float) -> int:
    """Layer chunks so that one chunk's compile fits ``memory_budget_gb``."""
    per_param = COMPILE_BYTES_PER_PARAM.get(precision, max(COMPILE_BYTES_PER_PARAM.values()))
    budget = float(memory_budget_gb) * 1e9
    if budget <= 0:
        raise NpuforgeError("memory_budget_gb must be positive")
    return max(1, math.ceil(n_params * per_param / budget))


def unavailable_reason(runtime: str, target_options: dict) -> str | None:
    """Why rknn jobs cannot run here (one line), or None. Cheap: no imports, no processes."""
    try:
        platform_of(target_options)
    except NpuforgeError as err:
        return str(err)
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


# --------------------------------------------------------------------------- inputs


def _load_export(path) -> dict:
    meta_path = Path(path) / "export.json"
    if not meta_path.is_file():
        raise NpuforgeError(f"{path}: no export.json; run export_onnx.py first")
    meta = read_json(meta_path)
    if meta.get("variant") != "decode" or meta.get("batch") != 1:
        raise NpuforgeError(
            f"{path}: the rknn backend compiles a batch-1 decode export, got "
            f"{meta.get('variant')} batch {meta.get('batch')}; export with --variant decode"
        )
    return meta


def _param_count(export_dir: Path, meta: dict) -> int:
    import onnx

    total = 0
    for graph in meta["graphs"]:
        model = onnx.load(str(export_dir / graph["file"]), load_external_data=False)
        for init in model.graph.initializer:
            total += math.prod(init.dims)
    return total


def reference_run(export_dir, tokens):
    """onnxruntime fp32 over ``tokens``: (per-chunk fed inputs per step, logits per step)."""
    import numpy as np

    from npuforge.runtime import GraphChain

    fed = {}

    def capture(index, feeds):
        for name, value in feeds.items():
            fed.setdefault((index, name), []).append(np.array(value, copy=True))

    chain = GraphChain(export_dir, capture=capture)
    logits = [chain.step(np.asarray([[t]], dtype=np.int64)) for t in tokens]
    stacked = {key: np.stack(values) for key, values in fed.items()}
    return stacked, np.stack(logits)


def verification_figures(reference, compiled) -> dict:
    """Logits agreement over steps (see npuforge.verify.logits_agreement)."""
    figures = logits_agreement(reference, compiled)
    return {"steps": int(reference.shape[0]), "reference": "onnxruntime fp32", **figures}


def build_spec(graph, chunk, paths, target_options, precision, dataset, steps) -> dict:
    """The job spec of one chunk (everything absolute; see rknn_job.py)."""
    return {
        "onnx": str(paths["onnx"]),
        "rknn": str(paths["rknn"]),
        "target_platform": platform_of(target_options),
        "precision": precision,
        "quantized_algorithm": str(target_options.get("quantized_algorithm", "normal")),
        "optimization_level": int(target_options.get("optimization_level", 3)),
        "dataset": str(dataset) if dataset else None,
        # The toolkit's automatic hybrid quantization: layers whose int8 output falls
        # below the cosine threshold against float stay in fp16.
        "auto_hybrid": bool(target_options.get("auto_hybrid", False)),
        "auto_hybrid_cos_thresh": target_options.get("auto_hybrid_cos_thresh"),
        # Hybrid quantization: these op types' outputs (or all but these) stay float16.
        "float16": float16_selection(target_options, precision),
        "hybrid_dir": str(paths["hybrid_dir"]),
        "inputs": [
            {k: spec[k] for k in ("name", "shape", "role", "output") if k in spec}
            for spec in graph["inputs"]
        ],
        "outputs": [{k: spec[k] for k in ("name", "shape", "role")} for spec in graph["outputs"]],
        "verify": {
            "steps": steps,
            "feeds": {name: str(path) for name, path in paths["feeds"].items()},
            "save": {name: str(path) for name, path in paths["save"].items()},
        },
        "build_log": str(paths["build_log"]),
        "result": str(paths["result"]),
        "chunk": chunk,
    }


def _default_job_runner(stamp_path, spec_path, read_only, writable, log_path):
    from npuforge import toolchain

    return toolchain.run_job(
        stamp_path,
        JOB_SCRIPT,
        spec_path,
        read_only=read_only,
        writable=writable,
        env={"MALLOC_PERTURB_": MALLOC_PERTURB, "OMP_NUM_THREADS": "1"},
        log_path=log_path,
    )


def compile_rknn(
    export_dirs,
    calibration_dir,
    target,
    target_options,
    precision,
    toolchain_stamp,
    out_dir,
    *,
    log_path=None,
    job_runner=None,
) -> dict:
    """Compile every chunk of the decode export to .rknn, verify, write ``compile.json``."""
    import numpy as np

    from npuforge.backends.rknn_graph import rewrite_file
    from npuforge.calibration import heldout_tokens, read_calibration
    from npuforge.toolchain import read_stamp

    target_options = dict(target_options or {})
    check_precision(target, target_options, precision)
    float16 = float16_selection(target_options, precision)
    if len(export_dirs) != 1:
        raise NpuforgeError(
            f"the rknn backend compiles one decode export, got {len(export_dirs)}; "
            "remove the prefill variant from the target's export options"
        )
    export_dir = Path(export_dirs[0]).resolve()
    meta = _load_export(export_dir)
    quantized = precision != "fp16"
    calibration = None
    if quantized:
        if not calibration_dir:
            raise NpuforgeError(f"{precision} needs calibration samples: pass --calibration DIR")
        calibration_dir = Path(calibration_dir).resolve()
        calibration = read_calibration(calibration_dir)
        if len(calibration["chunks"]) != len(meta["graphs"]):
            raise NpuforgeError(
                f"calibration in {calibration_dir} has {len(calibration['chunks'])} chunks, the "
                f"export {len(meta['graphs'])}; recreate the samples for this export"
            )
    if not toolchain_stamp:
        raise NpuforgeError("no toolchain given: pass --toolchain results/toolchains/rknn-*.json")
    stamp = read_stamp(toolchain_stamp)
    runner = job_runner or _default_job_runner

    n_params = _param_count(export_dir, meta)
    budget_gb = float(target_options.get("memory_budget_gb", 8))
    needed = plan_chunks(n_params, precision, budget_gb)
    chunks = len(meta["graphs"])
    if chunks < needed:
        raise NpuforgeError(
            f"{n_params / 1e6:.0f}M parameters in {chunks} chunk(s) need about "
            f"{n_params * COMPILE_BYTES_PER_PARAM[precision] / chunks / 1e9:.1f} GB per compile, "
            f"over the {budget_gb:g} GB memory budget: export at least {needed} chunks "
            "(targets.yaml chunk_policy) or raise memory_budget_gb"
        )
    steps = int(target_options.get("verify_steps", 32))
    tokens = heldout_tokens(steps, meta["vocab_size"])
    fed, reference_logits = reference_run(export_dir, tokens)

    out_dir = Path(out_dir).resolve()
    with atomic_path(out_dir) as staging:
        staging.mkdir(parents=True)
        work = staging / "work"
        work.mkdir()
        artifacts, placements, rewrites, aslr_disabled, hybrids = [], [], [], [], []
        site_packages = set()
        previous_outputs = {}
        logits = None
        for index, graph in enumerate(meta["graphs"]):
            chunk_work = work / f"chunk{index}"
            chunk_work.mkdir()
            onnx_path = chunk_work / "model.onnx"
            rewrites.append({"chunk": index, **rewrite_file(export_dir / graph["file"], onnx_path)})
            feeds = {}
            for spec in graph["inputs"]:
                if spec["role"] == "state":
                    continue
                path = chunk_work / f"feed_{spec['name']}.npy"
                if spec["role"] == "hidden":
                    value = previous_outputs[spec["name"][: -len("_in")] + "_out"]
                else:
                    value = fed[(index, spec["name"])]
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
                "save": save,
                "build_log": chunk_work / "build.log",
                "result": chunk_work / "result.json",
                "hybrid_dir": chunk_work / "hybrid",
            }
            dataset = None
            if quantized:
                dataset = calibration_dir / calibration["chunks"][index]["rknn"]["dataset"]
            spec = build_spec(graph, index, paths, target_options, precision, dataset, steps)
            spec_path = chunk_work / "spec.json"
            write_json(spec_path, spec)
            read_only = [export_dir] + ([calibration_dir] if calibration_dir else [])
            try:
                runner(toolchain_stamp, spec_path, read_only, [staging], log_path)
            finally:
                if log_path and paths["build_log"].is_file():
                    with open(log_path, "a", encoding="utf-8") as log:
                        log.write(paths["build_log"].read_text(errors="replace"))
            result = read_json(paths["result"])
            placements.append({"chunk": index, **result["placement"]})
            if result.get("hybrid"):
                hybrids.append({"chunk": index, **result["hybrid"]})
            aslr_disabled.append(bool(result.get("aslr_disabled")))
            site_packages.add(result.get("site_packages", "none"))
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

        figures = verification_figures(reference_logits, logits)
        floor = float(target_options.get("min_cosine", MIN_COSINE[precision]))
        figures["min_cosine"] = floor
        figures["inputs"] = "held-out text (data/calibration/heldout.txt), recurrent"
        record = {
            "backend": BACKEND,
            "target": target,
            "precision": precision,
            "artifacts": artifacts,
            "split": {
                "chunks": chunks,
                "layers": [g.get("layers") for g in meta["graphs"]],
                "parameters": n_params,
                "chunks_needed_for_budget": needed,
                "reason": (
                    f"memory budget {budget_gb:g} GB at ~{COMPILE_BYTES_PER_PARAM[precision]:g} "
                    f"bytes/parameter of compile memory: at least {needed} chunk(s); export has "
                    f"{chunks}"
                ),
            },
            "toolchain": {
                "runtime": stamp.get("runtime"),
                "versions": stamp.get("versions", {}),
            },
            "verification": figures,
            "placement": {
                "cpu_fallback": sum(p["cpu_fallback"] for p in placements),
                "chunks": placements,
            },
            "graph_rewrites": rewrites,
            "options": {
                "target_platform": platform_of(target_options),
                "optimization_level": int(target_options.get("optimization_level", 3)),
                "quantized_dtype": precision if quantized else None,
                "quantized_algorithm": (
                    str(target_options.get("quantized_algorithm", "normal")) if quantized else None
                ),
                "auto_hybrid": bool(target_options.get("auto_hybrid", False)) and quantized,
                "auto_hybrid_cos_thresh": target_options.get("auto_hybrid_cos_thresh"),
                # Which tensors stayed float16 and the hash of the toolkit's quantization config.
                "float16": {"selection": float16, "chunks": hybrids} if float16 else None,
                "malloc_perturb": int(MALLOC_PERTURB),
                "aslr_disabled": all(aslr_disabled),
                # hard-linked: the bytes do not depend on where the toolchain lives.
                "site_packages": ",".join(sorted(site_packages)),
                "calibration": (
                    {
                        "samples": calibration["samples"],
                        "steps": calibration["steps"],
                        "seed": calibration["seed"],
                        "zero_state": calibration.get("zero_state", False),
                        "sha256": sha256_file(calibration_dir / "calibration.json"),
                    }
                    if calibration
                    else None
                ),
            },
        }
        write_json(staging / "compile.json", record)
        if figures["nan_inf"] or figures["cosine"] is None or figures["cosine"] < floor:
            raise NpuforgeError(
                f"{target} {precision}: simulator logits cosine {figures['cosine']} "
                f"(nan/inf {figures['nan_inf']}) is below {floor} against onnxruntime fp32 over "
                f"{steps} steps; try quantized_algorithm kl_divergence, more calibration samples, "
                "a float16 selection (option float16) or fp16"
            )
    return record

"""Host memory of a build's jobs, planned before any job runs: the layer chunks each
compile job needs to stay within its target's memory_budget_gb, and what every other
step reserves, from the registry's dimensions.

Pure data in, data out, like npuforge.matrix, which calls it.
"""

import dataclasses
import math
from dataclasses import dataclass

from npuforge import backends, models
from npuforge.backends import base
from npuforge.errors import NpuforgeError
from npuforge.onnx_io import split_layers
from npuforge.registry import merged_export


def parameter_counts(model: dict) -> dict:
    """A registry model's parameters by where an export puts them: ``embedding`` (the
    token table), ``per_layer``, ``head`` (in the last chunk; a tied head is the table
    again, which the graph still multiplies by) and ``total`` (the checkpoint's).

    With arch.n_params, every parameter but the token table is spread over the layers
    (exact for a tied head; an untied one is then counted twice, which errs high). Else
    counted from the dimensions: a synthetic llama exactly, tensor by tensor as
    npuforge.models.llama.weights.write_synthetic_checkpoint writes them; anything else
    about 12.5 * embed^2 per layer (RWKV's r, k, v, o, 4x channel mix and small LoRAs; a
    downloaded llama's FFN width is not in the registry, so this is a guess).
    """
    arch = model["arch"]
    layers, table = int(arch["layers"]), int(arch["vocab"]) * int(arch["embed"])
    if "n_params" in arch:
        total = int(arch["n_params"])
        per_layer = math.ceil(max(0, total - table) / layers)
        return {"embedding": table, "per_layer": per_layer, "head": table, "total": total}
    spec = model["source"].get("synthetic") if model["family"] == "llama" else None
    if not spec:
        per_layer = 12.5 * int(arch["embed"]) ** 2
        total = int(2 * table + layers * per_layer)
        return {"embedding": table, "per_layer": int(per_layer), "head": table, "total": total}
    per_layer = _llama_layer_params(spec)
    head = table + int(spec["embed"])  # lm_head (tied or not) and the final norm
    total = layers * per_layer + head + (0 if spec.get("tied", False) else table)
    return {"embedding": table, "per_layer": per_layer, "head": head, "total": total}


def _llama_layer_params(spec: dict) -> int:
    """One decoder layer of a synthetic llama source (write_synthetic_checkpoint's
    tensors): q/k/v/o, the gated MLP, two RMSNorms; qwen2 adds QKV biases, qwen3 q/k
    norms."""
    embed, heads, kv_heads = int(spec["embed"]), int(spec["heads"]), int(spec["kv_heads"])
    head_dim = int(spec.get("head_dim") or embed // heads)
    attention = 2 * embed * heads * head_dim + 2 * embed * kv_heads * head_dim
    if spec.get("arch") == "qwen2":
        attention += (heads + 2 * kv_heads) * head_dim
    if spec.get("arch") == "qwen3":
        attention += 2 * head_dim
    return attention + 3 * embed * int(spec["intermediate"]) + 2 * embed


# Peak memory of writing a synthetic checkpoint, per parameter: every tensor is held
# until the file is written. Measured (/usr/bin/time, 2026-12-02) on 2-layer cuts of the
# seed shapes: Qwen2.5-0.5B's (166M parameters, float32) 1.63 GB, RWKV-7 1.5B's (372M,
# bfloat16) 2.28 GB; 4.5 covers both and a whole model's float32 tensors.
SYNTHETIC_BYTES_PER_PARAM = 4.5
# What a download or a copy reserves (it streams).
FETCH_MEM_MB = 2000


def fetch_mem_mb(model: dict) -> int:
    """What a model's fetch job reserves: a synthetic checkpoint is held whole while it
    is written (the 1.5B seed shapes: ~7 GB)."""
    if "synthetic" not in model["source"]:
        return FETCH_MEM_MB
    return max(FETCH_MEM_MB, math.ceil(estimate_params(model) * SYNTHETIC_BYTES_PER_PARAM / 1e6))


# What the steps besides compile reserve, per parameter, and at least (the interpreter,
# torch, onnxruntime). A step that holds the whole model in float32 with its traced and
# serialized copies (an export with a lever that changes the whole model, a GGUF's
# dequantization): 16, from the exports of Qwen2.5-0.5B in one piece
# (10.6 bytes/parameter, bench/bench_scale.py) with headroom.
WHOLE_MODEL_BYTES_PER_PARAM = 16
# An export that reads one chunk at a time (the llama family without such levers, and
# RWKV's), per parameter of its heaviest chunk, measured on Qwen2.5-1.5B: 16.5 for
# SM8650's 6 chunks (6.9 GB, heaviest 420M parameters, MHA->SHA included), 19.8 for
# RK3588's 6 uneven ones (5.6 GB: the chunk of one layer beside the tied head, 281M,
# whose transposed copy the exporter folds in; 27.3 before each chunk's memory was given
# back).
EXPORT_CHUNK_BYTES_PER_PARAM = 22
# verify_onnx: one model at a time (the reference, then each export's graphs), 1.5 times
# the float32 weights in tests/test_streaming_steps.py; 8 leaves room for the activations.
VERIFY_BYTES_PER_PARAM = 8
# Calibration capture, per parameter of the heaviest chunk: one float32 session and its
# samples, 3.3 for a 16-chunk capture in tests/test_streaming_steps.py, 4.6 for Qwen2.5-1.5B
# captured whole (7.1 GB, before it went chunk by chunk); 8 leaves room for the samples.
CALIBRATION_CHUNK_BYTES_PER_PARAM = 8
STEP_FLOOR_MB = 1000


# Inspecting a checkpoint reads its headers (safetensors: 33 MB at Qwen2.5-1.5B) or maps
# its tensors (RWKV's .pth: 224 MB at RWKV-7 1.5B, 0.15 bytes/parameter; bench/
# bench_scale.py, the "inspect" rows); it never holds the model.
INSPECT_BYTES_PER_PARAM = 0.5


def inspect_mem_mb(model: dict) -> int:
    """What inspecting a model's checkpoint reserves."""
    return _step_mb(estimate_params(model) * INSPECT_BYTES_PER_PARAM)


def whole_model_mem_mb(model: dict) -> int:
    """What a step that holds the whole model reserves."""
    return _step_mb(estimate_params(model) * WHOLE_MODEL_BYTES_PER_PARAM)


def heaviest_chunk(model: dict, options: dict) -> int:
    """Parameters of the export's heaviest chunk (the table and the head counted)."""
    layers = int(model["arch"]["layers"])
    sizes = chunk_params(
        parameter_counts(model), layers, int(options.get("chunks", 1)),
        bool(options.get("ext_embedding", False)), options.get("layers_per_chunk"),
    )  # fmt: skip
    return max(sizes)


def calibration_mem_mb(model: dict, options: dict) -> int:
    """What calibration capture reserves: it holds one chunk's graph and samples."""
    return _step_mb(heaviest_chunk(model, options) * CALIBRATION_CHUNK_BYTES_PER_PARAM)


def export_mem_mb(model: dict, options: dict) -> int:
    """What an export job reserves: a chunk's worth where the family's exporter reads one
    chunk at a time (it names its WHOLE_MODEL_OPTIONS) and no such option is set, else the
    whole model's."""
    whole_model_options = getattr(models.family(model["family"]), "WHOLE_MODEL_OPTIONS", None)
    if whole_model_options is None or any(options.get(name) for name in whole_model_options):
        return whole_model_mem_mb(model)
    return _step_mb(heaviest_chunk(model, options) * EXPORT_CHUNK_BYTES_PER_PARAM)


def verify_mem_mb(model: dict) -> int:
    """What verify_onnx reserves (it holds one whole model at a time)."""
    return _step_mb(estimate_params(model) * VERIFY_BYTES_PER_PARAM)


def _step_mb(size: float) -> int:
    return max(STEP_FLOOR_MB, math.ceil(size / 1e6))


def estimate_params(model: dict) -> int:
    """Parameter count from the registry: arch.n_params, else counted from the dimensions."""
    return parameter_counts(model)["total"]


def chunk_params(
    counts: dict, layers: int, chunks: int, ext_embedding: bool, layers_per_chunk=None
) -> list[int]:
    """Parameters in each chunk's graph, split as the exporters split the layers
    (``npuforge.onnx_io.split_layers``): the table in the first unless it is external,
    the head in the last."""
    sizes = []
    for index, (start, end) in enumerate(split_layers(layers, chunks, layers_per_chunk)):
        size = (end - start) * counts["per_layer"]
        if index == 0 and not ext_embedding:
            size += counts["embedding"]
        if index == chunks - 1:
            size += counts["head"]
        sizes.append(size)
    return sizes


def balanced_sizes(layers: int, limits: list[int]) -> list[int] | None:
    """Layers per chunk, chunk i taking at most ``limits[i]``, as even as the limits allow
    and earlier chunks larger (with no limit reached: ``split_layers``' even split); None
    if the chunks cannot take every layer."""
    if min(limits) < 1 or sum(limits) < layers:
        return None
    level = next(t for t in range(1, layers + 1) if sum(min(m, t) for m in limits) >= layers)
    sizes = [min(m, level) for m in limits]
    surplus = sum(sizes) - layers
    for index in reversed(range(len(sizes))):
        if surplus and sizes[index] == level:
            sizes[index] -= 1
            surplus -= 1
    return sizes


# What a compile job reserves at least (the interpreter, onnxruntime, a toolkit's own
# baseline) where its target sets no compile_mem_mb.
DEFAULT_COMPILE_MEM_MB = 4000


@dataclass(frozen=True)
class MemoryPlan:
    """Layer chunks of one build's exports and the host memory its compile job needs."""

    chunks: int
    # Layers per chunk where the chunks are not even (the head's chunk takes fewer), else
    # None: the exporters' even split.
    layers_per_chunk: tuple | None
    # The compile job's peak by the backend's figures: its largest chunk's compile (a
    # toolchain process) beside what the step's fp32 reference run over that chunk kept
    # (the run holds one chunk at a time; the heap it leaves stays with the step).
    need_bytes: int
    budget_bytes: int
    # Why no plan fits (one line, without the build's name), else None.
    problem: str | None = None
    # Each chunk's need where its compile is a job of its own: its compile, with the fp32
    # reference run only where the backend's chunk job runs one (chunk_job_runs_reference).
    chunk_need_bytes: tuple = ()


def compile_costs(backend, family: str) -> dict:
    """What one parameter costs the backend's compile, per precision: the family's own
    figures where the backend measured them (``COMPILE_BYTES_PER_PARAM_BY_FAMILY``), else
    its ``COMPILE_BYTES_PER_PARAM``."""
    by_family = getattr(backend, "COMPILE_BYTES_PER_PARAM_BY_FAMILY", {})
    return {**backend.COMPILE_BYTES_PER_PARAM, **by_family.get(family, {})}


def memory_plan(model: dict, target: dict, precision: str | None = None) -> MemoryPlan:
    """The fewest layer chunks whose compile job stays within the target's
    memory_budget_gb, by what one parameter of the model's family costs its backend's
    compile (``compile_costs``; with no precision, the dearest) plus what the step's
    fp32 reference run keeps of the same chunk (``base.REFERENCE_BYTES_PER_PARAM``).

    Chunks are even where that fits, else the chunks holding the head or the table take
    fewer layers (``layers_per_chunk``). An explicit ``chunks`` wins (even); a
    ``chunk_policy`` (a device's limit on one chunk's weights) caps every chunk.
    ``problem`` says why a plan cannot fit.
    """
    export = merged_export(model, target)
    backend = backends.get(target["backend"])
    costs = compile_costs(backend, model["family"])
    per_param = float(costs.get(precision, max(costs.values())))
    budget = float(target["memory_budget_gb"]) * 1e9
    layers = int(model["arch"]["layers"])
    counts = parameter_counts(model)
    external = bool(export.get("ext_embedding", False))
    reference = base.REFERENCE_BYTES_PER_PARAM
    runs_reference = getattr(backend, "chunk_job_runs_reference", lambda options: True)
    chunk_reference = reference if runs_reference(target.get("options") or {}) else 0.0

    policy = export.get("chunk_policy")
    # The most parameters one chunk may hold: its compile within the budget, its weights
    # within the device's limit.
    most_params = budget / (per_param + reference)
    if policy:
        most_params = min(most_params, policy["max_chunk_bytes"] / policy["bytes_per_param"])

    def needs(chunks: int, sizes=None, reference=reference) -> tuple:
        params = chunk_params(counts, layers, chunks, external, sizes)
        return tuple(int((per_param + reference) * size) for size in params)

    def need(chunks: int, sizes=None) -> int:
        return max(needs(chunks, sizes))

    def sizes_for(chunks: int) -> list[int] | None:
        extra = [0] * chunks
        extra[0] += 0 if external else counts["embedding"]
        extra[-1] += counts["head"]
        limits = [max(0, int((most_params - e) // counts["per_layer"])) for e in extra]
        return balanced_sizes(layers, limits)

    fix = "raise the target's memory_budget_gb or build on a host with more memory"
    fewest = min(layers, policy_chunks(model, export))
    if "chunks" in export:
        chunks = max(1, min(int(export["chunks"]), layers))
        plan = MemoryPlan(
            chunks, None, need(chunks), int(budget), None, needs(chunks, None, chunk_reference)
        )
        fitting = next((n for n in range(fewest, layers + 1) if sizes_for(n)), None)
        if plan.need_bytes > budget:
            instead = f"leave export.chunks out (the plan takes {fitting}), " if fitting else ""
            problem = (
                f"export.chunks: {chunks} makes its compile job need about "
                f"{_gb(plan.need_bytes)}, over the target's memory_budget_gb of "
                f"{budget / 1e9:g}; {instead}{fix}"
            )
            return dataclasses.replace(plan, problem=problem)
        return plan
    for chunks in range(fewest, layers + 1):
        sizes = sizes_for(chunks)
        if sizes is None:
            continue
        even = [end - start for start, end in split_layers(layers, chunks)]
        sizes = None if sizes == even else tuple(sizes)
        return MemoryPlan(
            chunks,
            sizes,
            need(chunks, sizes),
            int(budget),
            None,
            needs(chunks, sizes, chunk_reference),
        )
    heaviest = max(chunk_params(counts, layers, layers, external))
    if need(layers) <= budget:  # the device's limit on a chunk's weights, not the host's
        weights = heaviest * float(policy["bytes_per_param"])
        problem = (
            f"one layer with the head (the heaviest one-layer chunk) holds about "
            f"{_gb(weights)} of weights at {policy['bytes_per_param']:g} bytes/parameter, "
            f"over the target's chunk_policy max_chunk_bytes of "
            f"{_gb(policy['max_chunk_bytes'])}; choose a precision with fewer bytes per "
            "parameter or a target whose device takes larger chunks"
        )
        return MemoryPlan(layers, None, need(layers), int(budget), problem)
    what = (
        f"one layer with the head (the heaviest one-layer chunk) needs about "
        f"{_gb(need(layers))} to compile ({per_param:g} bytes/parameter, "
        f"npuforge.backends.{target['backend']}, and {reference:g} for the fp32 reference run)"
    )
    problem = f"{what}, over the target's memory_budget_gb of {budget / 1e9:g}; {fix}"
    return MemoryPlan(layers, None, need(layers), int(budget), problem)


def policy_chunks(model: dict, export: dict) -> int:
    """The fewest chunks a ``chunk_policy`` allows: a device's limit on one chunk's bytes."""
    policy = export.get("chunk_policy")
    if not policy:
        return 1
    size = estimate_params(model) * float(policy["bytes_per_param"])
    return max(1, math.ceil(size / float(policy["max_chunk_bytes"])))


def _gb(size: float) -> str:
    return f"{size / 1e9:.1f} GB"


def plan_memory(models: dict, targets: dict, builds) -> dict:
    """Every build's MemoryPlan; a build no plan fits stops the run here, before any job."""
    plans = {}
    for build in builds:
        plan = memory_plan(models[build.model], targets[build.target], build.precision)
        if plan.problem:
            raise NpuforgeError(
                f"model {build.model} on {build.target} ({build.precision}): {plan.problem}"
            )
        plans[(build.model, build.target, build.precision)] = plan
    return plans

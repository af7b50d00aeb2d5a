"""The Llama family (Llama, Qwen2, Qwen3, SmolLM2): Hugging Face model directories to
static ONNX graphs with an explicit KV cache.

The same functions as every family package (see ``npuforge.models``): ``inspect``,
``export``, ``reference_logits`` (transformers), ``extra_inputs`` (mask, RoPE rows
and cache slots, fed by the host), ``tokenizer`` and ``write_synthetic``.

Where things live: ``config`` (config.json, RoPE tables), ``weights`` (safetensors,
synthetic checkpoints, the transformers oracle), ``model`` (the torch decoder),
``export`` (graphs, host inputs, export.json).
"""

from npuforge.errors import NpuforgeError
from npuforge.models.llama.config import (  # noqa: F401
    MASK_VALUE,
    PROJECTIONS,
    WHOLE_MODEL_OPTIONS,
)

NAME = "llama"
# Export options this family takes besides the common ones (see npuforge.models).
EXPORT_OPTIONS = (
    "cache_len",
    "sha",
    "mask_value",
    "fp16_fixes",
    "tanh_silu",
    "kv_prefix",
    "smoothquant",
    "group_offsets",
    "block_centres",
    "rotate",
    "awq",
    "gptq",
)


def export_options(model: dict, export: dict, precision: str | None = None) -> dict:
    """The family's export options for a registry model, a target's export choices and
    the precision built from the export.

    KV-cache graphs: the cache holds the model's context; MHA->SHA is a per-target
    graph choice (the Qualcomm HTP targets ask for it) that changes the bytes;
    ``smoothquant: {precision: alpha}``, ``group_offsets: {precision: group}``,
    ``block_centres: {precision: group}``, ``rotate: {precision: seed}``,
    ``awq: {precision: {bits, group, symmetric}}``,
    ``gptq: {precision: {bits, group, symmetric}}`` and ``tanh_silu: [precision, ...]``
    give that precision an export of its own.
    """
    options = {
        "cache_len": int(model["context_length"]),
        "sha": bool(export.get("sha", False)),
        "mask_value": float(export.get("mask_value", MASK_VALUE)),
        "fp16_fixes": bool(export.get("fp16_fixes", True)),
    }
    if export.get("kv_prefix"):
        options["kv_prefix"] = [int(t) for t in export["kv_prefix"]]
    if precision in (export.get("tanh_silu") or []):
        options["tanh_silu"] = True
    alpha = (export.get("smoothquant") or {}).get(precision)
    if alpha is not None:
        options["smoothquant"] = {"alpha": float(alpha)}
    seed = (export.get("rotate") or {}).get(precision)
    if seed is not None:
        if alpha is not None:
            raise NpuforgeError(
                f"export.smoothquant and export.rotate both name {precision}; a rotation "
                f"spreads the outliers SmoothQuant moves: keep {precision} in one of them"
            )
        options["rotate"] = {"seed": int(seed)}
    scales = (export.get("awq") or {}).get(precision)
    if scales is not None:
        if alpha is not None:
            raise NpuforgeError(
                f"export.smoothquant and export.awq both name {precision}; both fold "
                f"input-channel scales into the norms: keep {precision} in one of them"
            )
        options["awq"] = awq_option(precision, scales)
    group = (export.get("group_offsets") or {}).get(precision)
    centres = (export.get("block_centres") or {}).get(precision)
    if group is not None and centres is not None:
        raise NpuforgeError(
            f"export.group_offsets and export.block_centres both name {precision}; they "
            f"are two forms of one split: keep {precision} in one of them"
        )
    if group is not None:
        if options["sha"]:
            raise NpuforgeError(
                f"export.group_offsets names {precision}, which a target builds with the "
                "MHA->SHA pass (sha: true), and that pass cannot split q/k/v's side matmuls "
                f"per head: remove {precision} from the model's group_offsets (block_centres "
                "splits only the MLP)"
            )
        options["group_offsets"] = {"group": int(group)}
    if centres is not None:
        options["block_centres"] = {"group": int(centres)}
    rounding = (export.get("gptq") or {}).get(precision)
    if rounding is not None:
        options["gptq"] = gptq_option(precision, rounding, group if centres is None else centres)
    return options


def awq_option(precision: str, spec: dict) -> dict:
    """The grid a precision's AWQ scales are searched for (the backend's own grid)."""
    bits, group = int(spec["bits"]), spec.get("group")
    symmetric = bool(spec.get("symmetric", group is None))
    if bits == 4 and group is None:
        raise NpuforgeError(
            f"export.awq for {precision}: 4-bit weights per output channel are not a grid "
            "any backend builds here; give the group the backend quantizes in (say 32)"
        )
    option = {"bits": bits, "symmetric": symmetric}
    if group is not None:
        option["group"] = int(group)
    return option


def gptq_option(precision: str, spec: dict, split_group: int | None) -> dict:
    """A precision's GPTQ grid, checked against its group split: a backend keeps GPTQ's
    choice only on the grid it derives itself (npuforge.quantization)."""
    bits, group = int(spec["bits"]), spec.get("group")
    symmetric = bool(spec.get("symmetric", group is None))
    if bits == 4 and group is None:
        raise NpuforgeError(
            f"export.gptq for {precision}: 4-bit weights per output channel are rounded by "
            "each backend on a grid of its own (onnxruntime's int4: 2 max|w| / 15); give a "
            "group (and the same group_offsets or block_centres)"
        )
    if split_group is not None and (group != split_group or symmetric):
        raise NpuforgeError(
            f"export.gptq for {precision} rounds onto {'symmetric ' if symmetric else ''}"
            f"groups of {group}, but its export splits groups of {split_group}: give gptq "
            f"{{bits: {bits}, group: {split_group}}} so the backend's grid is GPTQ's"
        )
    option = {"bits": bits, "symmetric": symmetric}
    if spec.get("integer_zero"):
        if symmetric or split_group is not None:
            raise NpuforgeError(
                f"export.gptq for {precision}: integer_zero is an asymmetric grid over a "
                "range holding 0 (RKNN's per-channel int8); set symmetric: false and no "
                "group split"
            )
        option["integer_zero"] = True
    if group is not None:
        option["group"] = int(group)
    if spec.get("search_range"):
        option["search_range"] = True
    generated = spec.get("generated", 0)
    if not isinstance(generated, int) or isinstance(generated, bool) or generated < 0:
        raise NpuforgeError(
            f"export.gptq for {precision}: generated must be a count of sequences for the "
            f"model to sample (say 64), got {generated!r}"
        )
    if generated:
        option["generated"] = generated
    projections = spec.get("projections")
    if projections is not None:
        unknown = sorted(set(projections) - set(PROJECTIONS))
        if unknown or not projections:
            raise NpuforgeError(
                f"export.gptq for {precision}: projections {unknown or projections} are not "
                f"decoder projections; name some of {', '.join(PROJECTIONS)}"
            )
        option["projections"] = [name for name in PROJECTIONS if name in projections]
    return option


def inspect(path) -> dict:
    from npuforge.models.llama.weights import inspect_llama

    return inspect_llama(path)


def export(checkpoint, out_dir, **options) -> dict:
    from npuforge.models.llama.onnx_export import export_llama

    return export_llama(checkpoint, out_dir, **options)


def reference_logits(checkpoint, tokens) -> tuple:
    from importlib import metadata

    from npuforge.models.llama.weights import reference_logits as transformers_logits

    name = f"transformers {metadata.version('transformers')} fp32 (AutoModelForCausalLM, eager)"
    return transformers_logits(checkpoint, tokens), name


def extra_inputs(meta: dict, spec: dict, position: int):
    from npuforge.models.llama.onnx_export import extra_inputs as llama_inputs

    return llama_inputs(meta, spec, position)


def tokenizer(checkpoint=None) -> tuple:
    """The checkpoint's tokenizer.json, or UTF-8 bytes (labelled so) when it has none."""
    from npuforge.models.llama.weights import checkpoint_tokenizer

    return checkpoint_tokenizer(checkpoint)


def write_synthetic(out, spec: dict, fmt: str):
    from npuforge.errors import NpuforgeError
    from npuforge.models.llama.weights import write_synthetic_checkpoint

    if fmt != "hf":
        raise NpuforgeError("a synthetic llama checkpoint is a model directory: set format: hf")
    args = {k: v for k, v in spec.items() if k != "version"}
    try:
        return write_synthetic_checkpoint(out, **args)
    except TypeError as err:
        raise NpuforgeError(f"synthetic llama source: {err}; see config/models.yaml") from None

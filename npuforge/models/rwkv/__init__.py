"""The RWKV family (v5.2, v6, v7): BlinkDL checkpoints to static ONNX graphs.

Every family package provides the same functions (``npuforge.models.FAMILY_API``):

    inspect(path)                        version, dimensions, sha256 of a checkpoint
    export(checkpoint, out_dir, **opts)  chunked ONNX graphs + export.json
    reference_logits(checkpoint, tokens) (logits, exact name) of the parity oracle
    extra_inputs(meta, spec, position)   host-fed graph inputs beyond tokens/state
    tokenizer(checkpoint)                (tokenizer with .encode, description)
    write_synthetic(out, spec, fmt)      a deterministic random checkpoint

Where things live: ``layout`` (keys, shapes, graph I/O, prepared weights),
``model`` (the torch module), ``export``, ``checkpoint``, ``reference`` (BlinkDL's
``rwkv`` package), ``synthetic``.
"""

from npuforge.errors import NpuforgeError

NAME = "rwkv"
# Export options this family takes (besides variant, tokens, dtype, chunks, batch,
# ext_embedding and external_data, which every family takes).
EXPORT_OPTIONS = ("fp16_fixes", "rescale_every", "wkv_scale", "last_token_logits")
# None of them changes the whole model: the exporter reads the checkpoint chunk by chunk
# (RWKV-7 1.5B in 4 chunks: 1.5 GB).
WHOLE_MODEL_OPTIONS = ()


def export_options(model: dict, export: dict, precision: str | None = None) -> dict:
    """The family's export options for a registry model and a target's export choices
    (the same for every precision)."""
    if export.get("kv_prefix"):
        raise NpuforgeError(
            "kv_prefix is a llama export option (it fills a KV cache); an RWKV model has a "
            "recurrent state: remove kv_prefix from its export"
        )
    if export.get("smoothquant"):
        raise NpuforgeError(
            "smoothquant is a llama export option (it rescales a transformer's norms and "
            "projections): remove it from the RWKV model's export"
        )
    for option in ("group_offsets", "block_centres"):
        if export.get(option):
            raise NpuforgeError(
                f"{option} is a llama export option (it splits a transformer's projections): "
                "remove it from the RWKV model's export"
            )
    for option in ("rotate", "gptq"):
        if export.get(option):
            raise NpuforgeError(
                f"{option} is a llama export option (it rewrites a transformer's "
                "projections): remove it from the RWKV model's export"
            )
    return {
        "fp16_fixes": bool(export.get("fp16_fixes", True)),
        "last_token_logits": bool(export.get("last_token_logits", False)),
    }


def inspect(path) -> dict:
    from npuforge.models.rwkv.checkpoint import inspect as inspect_rwkv

    return inspect_rwkv(path)


def export(checkpoint, out_dir, **options) -> dict:
    from npuforge.models.rwkv.onnx_export import export_rwkv

    return export_rwkv(checkpoint, out_dir, **options)


def reference_logits(checkpoint, tokens) -> tuple:
    from npuforge.models.rwkv import reference

    return reference.reference_logits(checkpoint, tokens), reference.name()


def extra_inputs(meta: dict, spec: dict, position: int):
    raise NpuforgeError(
        f"RWKV graphs take no input of role {spec.get('role')!r} ({spec.get('name')}); "
        "re-export the graphs with this npuforge"
    )


def tokenizer(checkpoint=None) -> tuple:
    """The RWKV World tokenizer (the vocabulary every RWKV-World checkpoint uses)."""
    from npuforge.texts import world_tokenizer

    return world_tokenizer(), {"kind": "rwkv-world"}


def write_synthetic(out, spec: dict, fmt: str):
    from npuforge.models.rwkv.synthetic import write_synthetic_checkpoint

    return write_synthetic_checkpoint(out, fmt=fmt, **spec)

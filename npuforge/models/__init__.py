"""Model families, one package each, all with the same functions.

``FAMILIES`` maps the registry's ``family`` to its package. A family package
provides:

    NAME, EXPORT_OPTIONS                  its name and its own export options
    export_options(model, export, precision)  those options for a model, a target's
                                          choices and the precision built
    inspect(path) -> dict                 what the checkpoint holds (inspect.json)
    export(checkpoint, out_dir, **opts)   chunked ONNX graphs + export.json
    reference_logits(checkpoint, tokens)  (logits [B, S, V], exact name) of its oracle
    extra_inputs(meta, spec, position)    host-fed inputs of roles beyond tokens/state
    tokenizer(checkpoint)                 (tokenizer with .encode, description)
    write_synthetic(out, spec, fmt)       a deterministic random checkpoint

Adding a family is a package here, its entry in ``FAMILIES`` and in the models
schema's ``family`` enum.
"""

import importlib

from npuforge.errors import NpuforgeError

FAMILIES = {"rwkv": "npuforge.models.rwkv", "llama": "npuforge.models.llama"}
# Export options every family takes; the rest are the family's EXPORT_OPTIONS.
COMMON_EXPORT_OPTIONS = (
    "variant",
    "tokens",
    "dtype",
    "chunks",
    "layers_per_chunk",
    "batch",
    "ext_embedding",
    "external_data",
)


def family(name: str):
    """The family package of the registry's ``family`` name."""
    if name not in FAMILIES:
        raise NpuforgeError(
            f"unknown model family {name!r}: npuforge exports {', '.join(FAMILIES)}"
        )
    return importlib.import_module(FAMILIES[name])


def export(name: str, checkpoint, out_dir, options: dict) -> dict:
    """Export ``checkpoint`` with its family's exporter; ``options`` as the matrix plans
    them (None: the family's default). An option of another family is refused."""
    module = family(name)
    allowed = set(COMMON_EXPORT_OPTIONS) | set(module.EXPORT_OPTIONS)
    foreign = sorted(k for k, v in options.items() if k not in allowed and v not in (None, False))
    if foreign:
        raise NpuforgeError(
            f"export option {foreign[0]!r} does not apply to the {name} family; its options: "
            f"{', '.join(sorted(allowed))}"
        )
    kept = {k: v for k, v in options.items() if k in allowed and v is not None}
    return module.export(checkpoint, out_dir, **kept)

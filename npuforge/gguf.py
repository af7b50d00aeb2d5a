"""GGUF checkpoints (llama.cpp's single-file format), dequantized for export.

The fetched, sha256-pinned ``checkpoint.gguf`` stays the model's source. The
``dequantize`` stage writes a Hugging Face model directory from it, which every
later stage reads like any Llama-family checkpoint:

    config.json          the model's configuration (from the GGUF metadata)
    model.safetensors    every weight dequantized to float32
    tokenizer.json       the tokenizer the GGUF metadata carries (+ its config files)
    gguf.json            what the directory was made from: the GGUF's sha256,
                         architecture, file type, tensor types and the library versions

The reading is transformers' own GGUF loader (on the ``gguf`` package): it maps
llama.cpp's tensor names to transformers' and undoes llama.cpp's row permutation
of the Q and K projections. ``describe`` checks what the loader would otherwise
fail on obscurely (a truncated or foreign file, an architecture npuforge does not
export, a tensor type the ``gguf`` package cannot dequantize) and says it in one
line.
"""

from pathlib import Path

from npuforge.errors import NpuforgeError
from npuforge.fileio import atomic_path, sha256_file, write_json

MAGIC = b"GGUF"
# general.architecture values the llama family exports (transformers' model_type).
ARCHITECTURES = ("llama", "qwen2", "qwen3")
# Metadata a tokenizer.json is built from.
TOKENIZER_KEY = "tokenizer.ggml.tokens"


def _field(reader, key):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def dequantizable_types() -> list[str]:
    """GGML tensor types the installed ``gguf`` package can turn into float32."""
    import gguf
    from gguf import GGMLQuantizationType

    return [
        t.name
        for t in GGMLQuantizationType
        if t.name in ("F32", "F16") or isinstance(getattr(gguf.quants, t.name, None), type)
    ]


def _reader(path: Path):
    from gguf import GGUFReader

    with open(path, "rb") as handle:
        magic = handle.read(4)
    if magic != MAGIC:
        raise NpuforgeError(
            f"{path}: not a GGUF file (starts with {magic!r}, not {MAGIC!r}); fix the model's "
            "format or source"
        )
    try:
        return GGUFReader(str(path))
    except ValueError as err:
        if "GGMLQuantizationType" in str(err):
            raise NpuforgeError(
                f"{path}: a tensor has a type the gguf package does not know ({err}); "
                f"supported types: {', '.join(dequantizable_types())}"
            ) from None
        raise NpuforgeError(
            f"{path}: damaged or truncated GGUF file ({str(err).splitlines()[0]}); fetch it again"
        ) from None
    except (IndexError, OSError, KeyError, UnicodeDecodeError) as err:
        raise NpuforgeError(
            f"{path}: damaged or truncated GGUF file ({type(err).__name__}: {err}); fetch it again"
        ) from None


def describe(path) -> dict:
    """Architecture, file type and tensor types of a GGUF file, checked for export."""
    from gguf import LlamaFileType

    path = Path(path)
    reader = _reader(path)
    architecture = _field(reader, "general.architecture")
    if architecture not in ARCHITECTURES:
        raise NpuforgeError(
            f"{path}: a GGUF of architecture {architecture!r}, which npuforge does not export; "
            f"supported: {', '.join(ARCHITECTURES)}"
        )
    supported = set(dequantizable_types())
    types = {}
    parameters = 0
    for tensor in reader.tensors:
        name = tensor.tensor_type.name
        if name not in supported:
            raise NpuforgeError(
                f"{path}: tensor {tensor.name!r} is {name}, which the gguf package cannot "
                f"dequantize; supported types: {', '.join(sorted(supported))}"
            )
        types[name] = types.get(name, 0) + 1
        parameters += int(tensor.n_elements)
    if _field(reader, TOKENIZER_KEY) is None:
        raise NpuforgeError(f"{path}: the GGUF carries no tokenizer ({TOKENIZER_KEY}); use another")
    file_type = _field(reader, "general.file_type")
    try:
        file_type = LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_")
    except (TypeError, ValueError):
        file_type = None
    return {
        "architecture": architecture,
        "name": _field(reader, "general.name"),
        "file_type": file_type,
        "tensor_types": dict(sorted(types.items())),
        "tensors": len(reader.tensors),
        "parameters": parameters,
    }


def dequantize(path, out_dir) -> dict:
    """Write the Hugging Face directory of ``path`` (see the module docstring) to ``out_dir``."""
    from importlib import metadata

    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path).resolve()
    info = describe(path)
    where = {"pretrained_model_name_or_path": str(path.parent), "gguf_file": path.name}
    try:
        tokenizer = AutoTokenizer.from_pretrained(**where)
        model = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32)
    except (ValueError, KeyError, RuntimeError, NotImplementedError) as err:
        raise NpuforgeError(
            f"{path}: transformers could not load this GGUF ({str(err).splitlines()[0]}); "
            "check the file or use a safetensors checkpoint"
        ) from None
    config = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config.pop(key, None)
    config["architectures"] = [type(model).__name__]
    config["dtype"] = "float32"
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    record = {
        "source": {"file": path.name, "sha256": sha256_file(path)},
        **info,
        "dequantized_to": "float32",
        "dequantized_by": {
            "transformers": metadata.version("transformers"),
            "gguf": metadata.version("gguf"),
        },
    }
    with atomic_path(out_dir) as tmp:
        tmp.mkdir()
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        write_json(tmp / "config.json", config)
        tokenizer.save_pretrained(str(tmp))
        write_json(tmp / "gguf.json", record)
    return record

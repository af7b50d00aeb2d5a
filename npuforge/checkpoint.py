"""Load RWKV checkpoints without executing code, and describe them.

Both BlinkDL ``.pth`` files (zip format, read with ``torch.load(weights_only=True,
mmap=True)``) and ``.safetensors`` are supported. The version and dimensions
are detected from the key names and shapes (``npuforge.models.rwkv``); any
other layout, a missing or mis-shaped key, a truncated file or a pickle that
carries code is rejected with one NpuforgeError line.
"""

from pathlib import Path

from npuforge.errors import NpuforgeError
from npuforge.fileio import sha256_file


class Checkpoint:
    """Tensors of one checkpoint, read lazily (mmap) and a detected config."""

    def __init__(self, path, tensors: dict, config):
        self.path = Path(path)
        self.tensors = tensors
        self.config = config

    def __getitem__(self, name):
        return self.tensors[name]

    def __contains__(self, name):
        return name in self.tensors

    def float32(self, name):
        """One tensor as a new float32 torch tensor (the mmap stays untouched)."""
        return self.tensors[name].float()


def _load_pth(path: Path) -> dict:
    import pickle
    import zipfile

    import torch

    if not zipfile.is_zipfile(path):
        raise NpuforgeError(
            f"{path}: not a zip-format torch checkpoint (truncated or legacy file); "
            "re-save it with torch.save or convert it to .safetensors"
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else "unsafe pickle"
        raise NpuforgeError(
            f"{path}: refused to load, the pickle carries code or non-tensor objects ({first}); "
            "use a plain state-dict checkpoint"
        ) from None
    except (RuntimeError, OSError, EOFError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise NpuforgeError(
            f"{path}: cannot read the checkpoint ({first}); the file is damaged or truncated, "
            "download it again"
        ) from None
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise NpuforgeError(f"{path}: not a flat state dict of tensors; use a BlinkDL checkpoint")
    return state


def _load_safetensors(path: Path) -> dict:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        # safetensors maps the file; tensors are views until they are touched.
        return load_file(str(path), device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise NpuforgeError(
            f"{path}: cannot read the safetensors file ({first}); the file is damaged or "
            "truncated, download it again"
        ) from None


def load_checkpoint(path) -> Checkpoint:
    """Open ``path`` (.pth or .safetensors), detect and validate its RWKV layout."""
    from npuforge.models import rwkv

    path = Path(path)
    if not path.is_file():
        raise NpuforgeError(f"{path}: checkpoint file not found; check the path")
    if path.suffix == ".safetensors":
        tensors = _load_safetensors(path)
    elif path.suffix == ".pth":
        tensors = _load_pth(path)
    else:
        raise NpuforgeError(f"{path}: unknown checkpoint extension; use .pth or .safetensors")
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    config = rwkv.config_from_shapes(shapes, source=str(path))
    return Checkpoint(path, tensors, config)


def inspect_checkpoint(path) -> dict:
    """The facts ``inspect_checkpoint.py`` writes to info.json."""
    ckpt = load_checkpoint(path)
    cfg = ckpt.config
    dtypes = sorted({str(t.dtype).replace("torch.", "") for t in ckpt.tensors.values()})
    short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
    return {
        "family": "rwkv",
        "version": cfg.version,
        "n_layers": cfg.n_layers,
        "embed_dim": cfg.embed_dim,
        "head_size": cfg.head_size,
        "n_heads": cfg.n_heads,
        "vocab_size": cfg.vocab_size,
        "ffn_dim": cfg.ffn_dim,
        "lora_ranks": dict(cfg.lora),
        "n_params": int(sum(t.numel() for t in ckpt.tensors.values())),
        "dtype": short.get(dtypes[0], dtypes[0]) if len(dtypes) == 1 else "mixed",
        "file": Path(path).name,
        "file_bytes": Path(path).stat().st_size,
        "sha256": sha256_file(path),
    }

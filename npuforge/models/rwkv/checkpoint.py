"""RWKV checkpoints: BlinkDL .pth or .safetensors files, validated against the layout."""

from pathlib import Path

from npuforge.checkpoint import Checkpoint, read_tensors
from npuforge.fileio import sha256_file
from npuforge.models.rwkv.layout import config_from_shapes


def load(path) -> Checkpoint:
    """Open ``path``, detect and validate its RWKV version and dimensions (one line for
    any other layout, a missing or mis-shaped key)."""
    tensors = read_tensors(path)
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    return Checkpoint(path, tensors, config_from_shapes(shapes, source=str(path)))


def inspect(path) -> dict:
    """Version, dimensions, parameter count, dtype and sha256 of an RWKV checkpoint."""
    ckpt = load(path)
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

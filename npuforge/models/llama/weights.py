"""Llama-family weights: the safetensors files of a Hugging Face model directory, what
they hold, a deterministic random checkpoint for tests, and transformers as the
parity oracle."""

import json
import math
from pathlib import Path

import numpy as np

from npuforge.errors import NpuforgeError
from npuforge.fileio import atomic_path
from npuforge.models.llama.config import SUPPORTED_MODEL_TYPES, load_config


def safetensors_files(checkpoint_dir) -> list[Path]:
    """The weight files: those the shard index names, else model.safetensors, else all."""
    folder = Path(checkpoint_dir)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        files = [folder / name for name in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise NpuforgeError(
                f"{folder}: shard {missing[0]} is missing; fetch the whole snapshot"
            )
        return files
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise NpuforgeError(f"no *.safetensors in {folder}; fetch the whole model snapshot")
    return files


def load_state_dict(checkpoint_dir, dtype=None, wanted=None) -> dict:
    """The checkpoint's tensors as torch tensors of ``dtype`` (default float32): all of
    them, or those whose names ``wanted(name)`` accepts, read one at a time (a chunk's
    layers never bring the rest of the checkpoint into memory)."""
    import torch
    from safetensors import safe_open

    dtype = dtype or torch.float32
    tensors = {}
    for file in safetensors_files(checkpoint_dir):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                if wanted is None or wanted(name):
                    # Tensor by tensor: a bf16 checkpoint never sits in memory twice.
                    tensors[name] = handle.get_tensor(name).to(dtype)
    return tensors


def inspect_llama(checkpoint_dir) -> dict:
    """Dimensions the chunk planners and reports need, from config.json and the weights."""
    from safetensors import safe_open

    cfg = load_config(checkpoint_dir)
    n_params, dtypes = 0, set()
    for file in safetensors_files(checkpoint_dir):
        with safe_open(str(file), framework="numpy") as handle:
            for name in handle.keys():
                tensor = handle.get_slice(name)
                n_params += int(np.prod(tensor.get_shape()))
                dtypes.add(tensor.get_dtype())
    short = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}
    return {
        "family": "llama",
        "arch": cfg.model_type,
        "n_layers": cfg.num_layers,
        "embed_dim": cfg.hidden_size,
        "heads": cfg.num_heads,
        "kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "vocab": cfg.vocab_size,
        # the same facts under the RWKV info.json names, for generic consumers
        "vocab_size": cfg.vocab_size,
        "n_heads": cfg.num_heads,
        "dtype": short.get(min(dtypes), min(dtypes)) if len(dtypes) == 1 else "mixed",
        "n_params": n_params,
        "tied": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
    }


# Files of a Hugging Face snapshot the llama family needs (huggingface_hub
# snapshot_download(allow_patterns=...)); everything else in such repos (original/
# consolidated .pth, pytorch_model*.bin, onnx/, gguf) is skipped.
HF_SNAPSHOT_PATTERNS = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
)


def write_synthetic_checkpoint(
    out_dir,
    *,
    layers: int,
    embed: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    intermediate: int,
    seed: int = 0,
    arch: str = "llama",
    tied: bool = False,
    head_dim: int | None = None,
    rope_theta: float = 10000.0,
    max_position_embeddings: int = 2048,
) -> dict:
    """Write a deterministic random-weight HF folder (config.json + model.safetensors).

    Same arguments -> byte-identical files; transformers loads the folder. arch is
    "llama", "qwen2" (QKV bias) or "qwen3" (q/k RMSNorm). Returns inspect_llama() of the result.
    """
    from safetensors.numpy import save_file

    if arch not in SUPPORTED_MODEL_TYPES:
        raise NpuforgeError(f"synthetic arch must be one of {SUPPORTED_MODEL_TYPES}, got {arch!r}")
    head_dim = head_dim or embed // heads
    config = {
        "architectures": [
            {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[
                arch
            ]
        ],
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": embed,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": rope_theta,
        "tie_word_embeddings": tied,
        "attention_bias": False,
        "torch_dtype": "float32",
    }
    shapes = {"model.embed_tokens.weight": (vocab, embed), "model.norm.weight": (embed,)}
    if not tied:
        shapes["lm_head.weight"] = (vocab, embed)
    for i in range(layers):
        pre = f"model.layers.{i}."
        shapes |= {
            pre + "input_layernorm.weight": (embed,),
            pre + "post_attention_layernorm.weight": (embed,),
            pre + "self_attn.q_proj.weight": (heads * head_dim, embed),
            pre + "self_attn.k_proj.weight": (kv_heads * head_dim, embed),
            pre + "self_attn.v_proj.weight": (kv_heads * head_dim, embed),
            pre + "self_attn.o_proj.weight": (embed, heads * head_dim),
            pre + "mlp.gate_proj.weight": (intermediate, embed),
            pre + "mlp.up_proj.weight": (intermediate, embed),
            pre + "mlp.down_proj.weight": (embed, intermediate),
        }
        if arch == "qwen3":
            shapes[pre + "self_attn.q_norm.weight"] = (head_dim,)
            shapes[pre + "self_attn.k_norm.weight"] = (head_dim,)
        if arch == "qwen2":
            for kind, width in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                shapes[pre + f"self_attn.{kind}_proj.bias"] = (width * head_dim,)
    tensors = {}
    for index, (name, shape) in enumerate(sorted(shapes.items())):
        rng = np.random.default_rng([seed, index])
        if name.endswith("norm.weight"):
            tensors[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            # fan-in scaling keeps activations O(1) at any width
            scale = 0.5 if len(shape) == 1 else 1.0 / math.sqrt(shape[1])
            tensors[name] = (scale * rng.standard_normal(shape)).astype(np.float32)
    with atomic_path(out_dir) as tmp:
        tmp.mkdir()
        (tmp / "config.json").write_text(
            json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8"
        )
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    return inspect_llama(out_dir)


def reference_logits(checkpoint_dir, tokens) -> np.ndarray:
    """Logits [B, S, vocab] of the transformers implementation (the parity oracle)."""
    import torch

    try:
        import transformers
    except ImportError:
        raise NpuforgeError(
            "verifying llama exports needs the transformers package; pip install transformers"
        ) from None
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(checkpoint_dir), attn_implementation="eager", dtype=torch.float32
    ).eval()
    with torch.no_grad():
        ids = torch.from_numpy(np.asarray(tokens, dtype=np.int64))
        return model(ids).logits.numpy()


def checkpoint_tokenizer(checkpoint=None) -> tuple:
    """The checkpoint's tokenizer.json, or UTF-8 bytes (labelled so) when it has none."""
    from npuforge.fileio import sha256_file
    from npuforge.texts import ByteTokenizer, HfTokenizer

    path = Path(checkpoint) / "tokenizer.json" if checkpoint else None
    if path is not None and path.is_file():
        return HfTokenizer(path), {"kind": "hf", "file": path.name, "sha256": sha256_file(path)}
    why = "the checkpoint has no tokenizer.json" if checkpoint else "no checkpoint given"
    return ByteTokenizer(), {
        "kind": "bytes",
        "note": f"{why}: token ids are UTF-8 bytes folded into the vocabulary, not a vocabulary",
    }

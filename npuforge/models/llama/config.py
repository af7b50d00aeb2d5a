"""Llama-family configuration (Llama, Qwen2 with QKV bias, Qwen3 with q/k norms, SmolLM2)
from a Hugging Face config.json, and the RoPE tables the host feeds the graphs."""

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from npuforge.errors import NpuforgeError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")

# Additive mask for hidden slots. Deep enough that exp() of a hidden score is ~1e-28
# of a visible one, shallow enough that quantized activations keep the scores' detail
# next to it: with -1e4, RK3588 w16a16i_dfp verified at cosine 0.98, with -64 at 0.99999.
MASK_VALUE = -64.0

# Export options that change the whole model at once: with one of them the export loads
# the model whole, without them it reads one chunk's weights at a time.
# Every decoder layer's projections, in the order a layer runs them.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WHOLE_MODEL_OPTIONS = ("smoothquant", "group_offsets", "block_centres", "rotate", "awq", "gptq")


@dataclass(frozen=True)
class LlamaConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads


def _rope_settings(raw: dict) -> tuple[float, dict | None]:
    """rope_theta and scaling from either the transformers<5 or >=5 config layout."""
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or None
    theta = raw.get("rope_theta", params.get("rope_theta", 10000.0))
    rope_type = (scaling or params).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type in (None, "default"):
        return float(theta), None
    if rope_type != "llama3":
        raise NpuforgeError(
            f"RoPE type {rope_type!r} is not supported by the llama family "
            "(supported: default, llama3); pick a checkpoint with plain or llama3 RoPE"
        )
    source = scaling or params
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    return float(theta), {"rope_type": "llama3", **{k: float(source[k]) for k in keys}}


def load_config(checkpoint_dir) -> LlamaConfig:
    path = Path(checkpoint_dir) / "config.json"
    if not path.is_file():
        raise NpuforgeError(f"{path} not found; point --checkpoint at a Hugging Face model folder")
    raw = json.loads(path.read_text(encoding="utf-8"))
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise NpuforgeError(
            f"{path}: model_type {model_type!r} is not in the llama family "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    if raw.get("hidden_act", "silu") != "silu":
        raise NpuforgeError(f"{path}: hidden_act {raw['hidden_act']!r} unsupported; need silu")
    if raw.get("use_sliding_window"):
        raise NpuforgeError(f"{path}: sliding-window attention is unsupported; disable it")
    heads = int(raw["num_attention_heads"])
    kv_heads = int(raw.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise NpuforgeError(f"{path}: {heads} heads is not a multiple of {kv_heads} kv heads")
    theta, scaling = _rope_settings(raw)
    # Qwen2 always has q/k/v bias and no o bias; Llama and Qwen3 have one switch for all four.
    is_qwen2 = model_type == "qwen2"
    attention_bias = bool(raw.get("attention_bias", False))
    return LlamaConfig(
        model_type=model_type,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        qkv_bias=True if is_qwen2 else attention_bias,
        o_bias=False if is_qwen2 else attention_bias,
        qk_norm=model_type == "qwen3",
        mlp_bias=bool(raw.get("mlp_bias", False)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
    )


def rope_inv_freq(cfg: LlamaConfig) -> np.ndarray:
    """Inverse frequencies [head_dim/2] (float64), with llama3 scaling when configured."""
    inv_freq = 1.0 / cfg.rope_theta ** (
        np.arange(0, cfg.head_dim, 2, dtype=np.float64) / cfg.head_dim
    )
    if cfg.rope_scaling is None:
        return inv_freq
    s = cfg.rope_scaling
    low_wavelen = s["original_max_position_embeddings"] / s["low_freq_factor"]
    high_wavelen = s["original_max_position_embeddings"] / s["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / s["factor"], inv_freq)
    # Between the two wavelengths, blend the scaled and unscaled frequencies.
    smooth = (s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"]) / (
        s["high_freq_factor"] - s["low_freq_factor"]
    )
    blended = (1 - smooth) * scaled / s["factor"] + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, blended, scaled)


def rope_rows(cfg: LlamaConfig, positions) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [len(positions), head_dim] (float32), halves duplicated as in HF."""
    inv_freq = rope_inv_freq(cfg).astype(np.float32)
    angles = np.asarray(positions, dtype=np.float32)[:, None] * inv_freq[None, :]
    angles = np.concatenate([angles, angles], axis=-1)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def host_inputs(
    cfg: LlamaConfig,
    *,
    batch,
    tokens,
    cache_len,
    position,
    dtype=np.float32,
    mask_value=MASK_VALUE,
):
    """The position-dependent graph inputs of one call, by role.

    mask        [B, 1, T, L]  0 where slot <= position + t, else mask_value (causal + unused)
    rope_cos    [B, 1, T, D]  RoPE cos/sin rows of positions position..position+T-1
    rope_sin    [B, 1, T, D]
    cache_write [B, 1, L, T]  one-hot: slot position+t receives this call's token t
    cache_keep  [B, 1, L, 1]  1 - cache_write.sum(-1): slots that keep their old entry
    """
    if position < 0 or position + tokens > cache_len:
        raise NpuforgeError(
            f"position {position} + {tokens} tokens exceeds the exported cache of {cache_len}; "
            "export with a larger cache_len or shorten the run"
        )
    positions = position + np.arange(tokens)
    slots = np.arange(cache_len)
    mask = np.where(slots[None, :] <= positions[:, None], 0.0, mask_value)
    cos, sin = rope_rows(cfg, positions)
    write = (slots[:, None] == positions[None, :]).astype(np.float64)
    keep = 1.0 - write.sum(-1, keepdims=True)
    values = {
        "mask": mask,
        "rope_cos": cos,
        "rope_sin": sin,
        "cache_write": write,
        "cache_keep": keep,
    }
    return {
        role: np.broadcast_to(value.astype(dtype), (batch, 1, *value.shape)).copy()
        for role, value in values.items()
    }

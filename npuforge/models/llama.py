"""Llama-family decoder (Llama, Qwen2-style QKV bias, SmolLM2) as static NPU graphs.

One file, plain torch, in the spirit of nanoGPT's model.py:

    config.json + *.safetensors ──► LlamaConfig / load_llama ──► Llama (torch)
                                                                    │
                       export_llama ──► chunk{i}.onnx + export.json ┘

The graphs are static: every call processes ``tokens`` positions (AR-N prefill
or AR-1 decode) against a fixed-size KV cache.

KV cache (one K and one V tensor per layer, [batch, kv_heads, cache_len, head_dim])
is explicit graph I/O. The update is mask based, never a shift: the graph takes
the whole cache and returns the whole cache with the new entries written at
their absolute positions, chosen by the one-hot ``cache_write`` input::

    cache_write[b, 0, l, t] = 1 if l == position + t                  # [B, 1, L, T]
    cache_keep = 1 - cache_write.sum(-1)                              # [B, 1, L, 1]
    cache_out = cache * cache_keep + cache_write @ new_entries

so a runner feeds ``cache_out`` back as ``cache`` unchanged. Attention runs over
the updated cache; the additive ``attention_mask`` input hides every slot beyond
the query's own position (stale or empty slots).

Extra graph inputs (roles beyond tokens/embedding/hidden/state/logits), all in
the graph dtype and all built by ``extra_inputs`` / ``host_inputs`` from the
absolute position of the call's first token:

    attention_mask  [batch, 1, tokens, cache_len]   role "mask" (0 or MASK_VALUE)
    rope_cos        [batch, 1, tokens, head_dim]    role "rope_cos"
    rope_sin        [batch, 1, tokens, head_dim]    role "rope_sin"
    cache_write     [batch, 1, cache_len, tokens]   role "cache_write"
    cache_keep      [batch, 1, cache_len, 1]        role "cache_keep"

The graphs hold no integer ops apart from the token Gather.

The attention of layer i is exported under the ONNX name scope
``/layers.{i}/self_attn/`` with projections ``q_proj``/``k_proj``/``v_proj``/
``o_proj``; npuforge.passes.mha_to_sha relies on that layout.
"""

from __future__ import annotations

import json
import math
import shutil
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from npuforge.errors import NpuforgeError
from npuforge.fileio import atomic_path, sha256_file, write_json

# Additive mask for hidden slots. Deep enough that exp() of a hidden score is ~1e-28
# of a visible one, shallow enough that quantized activations keep the scores' detail
# next to it: with -1e4, RK3588 w16a16i_dfp verified at cosine 0.98, with -64 at 0.99999.
MASK_VALUE = -64.0

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
DEFAULT_PREFILL_TOKENS = 16
ONNX_OPSET = 17
# Position-dependent inputs the host computes per call (role -> graph input name).
# Keeping RoPE gathers and the cache-slot one-hot out of the graph leaves only float
# ops inside, which NPUs run without CPU fallback.
HOST_ROLES = {
    "mask": "attention_mask",
    "rope_cos": "rope_cos",
    "rope_sin": "rope_sin",
    "cache_write": "cache_write",
    "cache_keep": "cache_keep",
}
# Weights beyond this go to chunkN.onnx.data: protobuf cannot hold 2 GiB.
EXTERNAL_DATA_BYTES = 1_800_000_000


# --------------------------------------------------------------------------- config


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


# --------------------------------------------------------------------------- weights


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


def load_state_dict(checkpoint_dir, dtype=None) -> dict:
    """All checkpoint tensors as torch tensors of ``dtype`` (default float32)."""
    import torch
    from safetensors.torch import load_file

    dtype = dtype or torch.float32
    tensors = {}
    for file in safetensors_files(checkpoint_dir):
        # Convert file by file so a bf16 checkpoint never sits in memory twice.
        tensors.update({k: t.to(dtype) for k, t in load_file(str(file)).items()})
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


# --------------------------------------------------------------------------- torch model


def _torch_modules():
    """Module classes are built lazily so importing this file does not import torch."""
    import torch
    from torch import nn

    class RMSNorm(nn.Module):
        def __init__(self, dim, eps):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(dim))
            self.eps = eps

        def forward(self, x):
            variance = x.pow(2).mean(-1, keepdim=True)
            return self.weight * (x * torch.rsqrt(variance + self.eps))

    def rotate_half(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    class Attention(nn.Module):
        def __init__(self, cfg: LlamaConfig):
            super().__init__()
            self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
            e, d = cfg.hidden_size, cfg.head_dim
            self.q_proj = nn.Linear(e, self.heads * d, bias=cfg.qkv_bias)
            self.k_proj = nn.Linear(e, self.kv_heads * d, bias=cfg.qkv_bias)
            self.v_proj = nn.Linear(e, self.kv_heads * d, bias=cfg.qkv_bias)
            self.o_proj = nn.Linear(self.heads * d, e, bias=cfg.o_bias)
            if cfg.qk_norm:
                self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
                self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.qk_norm = cfg.qk_norm

        def forward(self, x, cos, sin, write, keep, mask, k_cache, v_cache):
            b, t, _ = x.shape
            h, kv, d = self.heads, self.kv_heads, self.head_dim
            q = self.q_proj(x).view(b, t, h, d)
            k = self.k_proj(x).view(b, t, kv, d)
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, H, T, D], [B, KV, T, D]
            v = self.v_proj(x).view(b, t, kv, d).transpose(1, 2)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            # Mask-based cache update: clear the written slots, add the new rows there.
            k_cache = k_cache * keep + torch.matmul(write, k)
            v_cache = v_cache * keep + torch.matmul(write, v)
            # GQA without repeating K/V: the G query heads sharing a kv head are
            # stacked along the token axis, [B, KV, G*T, D].
            length = k_cache.shape[2]
            q = (q * d**-0.5).reshape(b, kv, (h // kv) * t, d)
            scores = torch.matmul(q, k_cache.transpose(2, 3)).view(b, h, t, length) + mask
            probs = torch.softmax(scores, dim=-1).view(b, kv, (h // kv) * t, length)
            out = torch.matmul(probs, v_cache).view(b, h, t, d).transpose(1, 2)
            return self.o_proj(out.reshape(b, t, h * d)), k_cache, v_cache

    class MLP(nn.Module):
        def __init__(self, cfg: LlamaConfig):
            super().__init__()
            e, f = cfg.hidden_size, cfg.intermediate_size
            self.gate_proj = nn.Linear(e, f, bias=cfg.mlp_bias)
            self.up_proj = nn.Linear(e, f, bias=cfg.mlp_bias)
            self.down_proj = nn.Linear(f, e, bias=cfg.mlp_bias)

        def forward(self, x):
            return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))

    class Block(nn.Module):
        def __init__(self, cfg: LlamaConfig):
            super().__init__()
            self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.self_attn = Attention(cfg)
            self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.mlp = MLP(cfg)

        def forward(self, x, cos, sin, write, keep, mask, k_cache, v_cache):
            a, k_cache, v_cache = self.self_attn(
                self.input_layernorm(x), cos, sin, write, keep, mask, k_cache, v_cache
            )
            x = x + a
            return x + self.mlp(self.post_attention_layernorm(x)), k_cache, v_cache

    class Llama(nn.Module):
        """The whole decoder; ``forward`` runs layers [first, last) of a chunk."""

        def __init__(self, cfg: LlamaConfig, cache_len: int):
            super().__init__()
            self.cfg, self.cache_len = cfg, cache_len
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
            if cfg.tie_word_embeddings:
                self.lm_head.weight = self.embed_tokens.weight

        def forward(self, x, mask, cos, sin, write, keep, caches, first=0, last=None, embed=None):
            """One call of layers [first, last); the position-dependent inputs come from
            ``host_inputs`` (mask [B,1,T,L], cos/sin [B,1,T,D], write [B,1,L,T], keep [B,1,L,1]).

            x: token ids [B, T] when ``embed`` (default: first == 0), else hidden [B, T, E].
            caches: [k_0, v_0, k_1, v_1, ...] for layers first..last-1.
            Returns (hidden or logits, updated caches in the same order).
            """
            last = self.cfg.num_layers if last is None else last
            if first == 0 if embed is None else embed:
                x = self.embed_tokens(x)
            new_caches = []
            for offset, layer in enumerate(self.layers[first:last]):
                x, k, v = layer(
                    x, cos, sin, write, keep, mask, *caches[2 * offset : 2 * offset + 2]
                )
                new_caches += [k, v]
            if last == self.cfg.num_layers:
                x = self.lm_head(self.norm(x))
            return x, new_caches

    return Llama


def build_model(cfg: LlamaConfig, state_dict: dict, cache_len: int):
    """A Llama torch module in eval mode with the checkpoint's weights loaded."""
    import torch

    # Built on the meta device and given the checkpoint tensors themselves (assign=True):
    # no random init, no second copy of the weights.
    with torch.device("meta"):
        model = _torch_modules()(cfg, cache_len)
    weights = {k.removeprefix("model."): v for k, v in state_dict.items()}
    if cfg.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    elif "lm_head.weight" not in weights:
        raise NpuforgeError("checkpoint has no lm_head.weight and config says untied embeddings")
    expected = {
        k for k in model.state_dict() if not (cfg.tie_word_embeddings and k == "lm_head.weight")
    }
    missing, unexpected = expected - weights.keys(), weights.keys() - expected
    # Some checkpoints store derived rotary buffers; they are recomputed here.
    unexpected = {k for k in unexpected if not k.endswith("rotary_emb.inv_freq")}
    if missing or unexpected:
        raise NpuforgeError(
            f"checkpoint tensors do not match the {cfg.model_type} layout "
            f"(missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}); "
            "check config.json belongs to these weights"
        )
    model.load_state_dict({k: weights[k] for k in expected}, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        raise NpuforgeError("llama model has unloaded parameters; this is a bug")
    return model.eval()


def load_llama(checkpoint_dir, cache_len: int):
    cfg = load_config(checkpoint_dir)
    return build_model(cfg, load_state_dict(checkpoint_dir), cache_len)


# --------------------------------------------------------------------------- runner inputs


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


def extra_inputs(export_meta: dict, input_spec: dict, position: int) -> np.ndarray:
    """Value of a llama-specific graph input for a call whose first token is at ``position``."""
    role = input_spec.get("role")
    if role not in HOST_ROLES:
        raise NpuforgeError(f"llama graphs have no input role {role!r} ({input_spec.get('name')})")
    values = host_inputs(
        LlamaConfig(**export_meta["config"]),
        batch=export_meta["batch"],
        tokens=export_meta["tokens_per_call"],
        cache_len=export_meta["cache_len"],
        position=position,
        dtype=np.dtype(input_spec.get("dtype", "float32")),
        mask_value=export_meta.get("options", {}).get("mask_value", MASK_VALUE),
    )
    return values[role]


# --------------------------------------------------------------------------- export


def split_layers(n_layers: int, chunks: int) -> list[tuple[int, int]]:
    if not 1 <= chunks <= n_layers:
        raise NpuforgeError(f"chunks must be between 1 and {n_layers} (n_layers), got {chunks}")
    bounds = [round(i * n_layers / chunks) for i in range(chunks + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def _chunk_io(cfg, first, last, *, batch, tokens, cache_len, np_dtype, ext_embedding):
    """(inputs, outputs) specs of one chunk, in graph order, in export.json shape."""
    fdt = str(np.dtype(np_dtype))
    cache_shape = [batch, cfg.num_kv_heads, cache_len, cfg.head_dim]
    if first == 0 and ext_embedding:
        shape = [batch, tokens, cfg.hidden_size]
        inputs = [{"name": "embedding", "shape": shape, "dtype": fdt, "role": "embedding"}]
    elif first == 0:
        inputs = [{"name": "tokens", "shape": [batch, tokens], "dtype": "int64", "role": "tokens"}]
    else:
        shape = [batch, tokens, cfg.hidden_size]
        inputs = [{"name": "hidden_in", "shape": shape, "dtype": fdt, "role": "hidden"}]
    host_shapes = {
        "mask": [batch, 1, tokens, cache_len],
        "rope_cos": [batch, 1, tokens, cfg.head_dim],
        "rope_sin": [batch, 1, tokens, cfg.head_dim],
        "cache_write": [batch, 1, cache_len, tokens],
        "cache_keep": [batch, 1, cache_len, 1],
    }
    inputs += [
        {"name": HOST_ROLES[role], "shape": shape, "dtype": fdt, "role": role}
        for role, shape in host_shapes.items()
    ]
    if last == cfg.num_layers:
        shape = [batch, tokens, cfg.vocab_size]
        outputs = [{"name": "logits", "shape": shape, "dtype": fdt, "role": "logits"}]
    else:
        shape = [batch, tokens, cfg.hidden_size]
        outputs = [{"name": "hidden_out", "shape": shape, "dtype": fdt, "role": "hidden"}]
    for layer in range(first, last):
        for kind in ("k", "v"):
            name = cache_name(layer, kind)
            state = {"name": name, "shape": cache_shape, "dtype": fdt, "role": "state"}
            inputs.append({**state, "output": f"{name}_out"})
            outputs.append({**state, "name": f"{name}_out"})
    return inputs, outputs


def cache_name(layer: int, kind: str) -> str:
    """Graph input name of layer ``layer``'s K (kind "k") or V cache; the output adds _out."""
    return f"cache_{layer}_{kind}"


def _export_chunk(model, first, last, inputs, outputs, scratch):
    """Trace layers [first, last) to ONNX; return the model with canonical names."""
    import onnx
    import torch

    class Chunk(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, x, mask, cos, sin, write, keep, *caches):
            embed = inputs[0]["role"] == "tokens"
            host = (mask, cos, sin, write, keep)
            y, new_caches = self.model(x, *host, list(caches), first, last, embed)
            return (y, *new_caches)

    examples = []
    for spec in inputs:
        if spec["dtype"] == "int64":
            examples.append(torch.zeros(spec["shape"], dtype=torch.int64))
        else:
            examples.append(torch.zeros(spec["shape"], dtype=model.embed_tokens.weight.dtype))
    # The TorchScript exporter keeps module scopes in node names (/layers.{i}/self_attn/...),
    # which the MHA->SHA pass keys on. Past 2 GB it writes one file per tensor, hence
    # the scratch folder.
    scratch.mkdir()
    path = scratch / "chunk.onnx"
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(
            Chunk().eval(),
            tuple(examples),
            str(path),
            input_names=[s["name"] for s in inputs],
            output_names=[s["name"] for s in outputs],
            opset_version=ONNX_OPSET,
            dynamo=False,
            do_constant_folding=True,
        )
    proto = onnx.load(str(path))
    _canonicalize_names(proto)
    return proto


def save_onnx(proto, path, external: bool | None = None) -> dict | None:
    """Save ``proto``; weights go to ``<file>.data`` when asked or past the protobuf limit.

    Returns the graph's ``external_data`` entry for export.json, or None.
    """
    import onnx

    path = Path(path)
    if external is None:
        weight_bytes = sum(len(t.raw_data) for t in proto.graph.initializer)
        external = weight_bytes > EXTERNAL_DATA_BYTES
    if not external:
        onnx.save(proto, str(path))
        return None
    data = f"{path.name}.data"
    onnx.save(proto, str(path), save_as_external_data=True, location=data)
    return {"file": data, "sha256": sha256_file(path.parent / data)}


def _canonicalize_names(proto):
    """Give nodes and weights stable, readable names the MHA->SHA pass can key on.

    The exporter's wrapper adds '/model' to node names ('/model/layers.0/...' becomes
    '/layers.0/...'), and transposed Linear weights arrive as 'onnx::MatMul_<n>';
    they are renamed '<module path>.weight_t' ([in, out]) after the MatMul that reads them.
    """
    graph = proto.graph
    renames = {}
    for node in graph.node:
        if node.name.startswith("/model/"):
            node.name = node.name[len("/model") :]
        if node.op_type == "MatMul" and node.name.endswith("_proj/MatMul"):
            weight = node.input[1]
            if weight.startswith("onnx::"):
                module = node.name.strip("/").removesuffix("/MatMul").replace("/", ".")
                renames[weight] = f"{module}.weight_t"
        if node.name == "/lm_head/MatMul" and node.input[1].startswith("onnx::"):
            renames[node.input[1]] = "lm_head.weight_t"
    for init in graph.initializer:
        init.name = renames.get(init.name, init.name)
    for node in graph.node:
        for i, name in enumerate(node.input):
            node.input[i] = renames.get(name, name)


def export_llama(
    checkpoint_dir,
    out_dir,
    *,
    variant: str,
    tokens: int | None = None,
    dtype: str = "fp32",
    chunks: int = 1,
    batch: int = 1,
    cache_len: int | None = None,
    sha: bool = False,
    ext_embedding: bool = False,
    external_data: bool | None = None,
    mask_value: float = MASK_VALUE,
) -> dict:
    """Write chunk{i}.onnx + export.json (docs/interfaces.md) for one static graph variant.

    variant "decode" is AR-1 (tokens must be 1); "prefill" is AR-N with N = tokens
    (default DEFAULT_PREFILL_TOKENS). ext_embedding=True writes embedding.bin
    (npuforge.export layout) and the first chunk takes rows of it (role "embedding").
    cache_len defaults to min(max_position_embeddings, 2048). sha=True applies the
    MHA->SHA pass (npuforge.passes.mha_to_sha) to every chunk. external_data: weights
    in chunkN.onnx.data (None: only past the 2 GB protobuf limit). mask_value: the
    additive mask of hidden slots, recorded in export.json for the runner.
    """
    import torch

    if variant not in ("decode", "prefill"):
        raise NpuforgeError(f"variant must be decode or prefill, got {variant!r}")
    if tokens is None:
        tokens = 1 if variant == "decode" else DEFAULT_PREFILL_TOKENS
    if variant == "decode" and tokens != 1:
        raise NpuforgeError(f"the decode variant takes 1 token per call, got tokens={tokens}")
    if tokens < 1 or batch < 1:
        raise NpuforgeError(f"tokens and batch must be positive, got {tokens} and {batch}")
    dtypes = {"fp32": (torch.float32, np.float32), "fp16": (torch.float16, np.float16)}
    if dtype not in dtypes:
        raise NpuforgeError(f"dtype must be fp32 or fp16 for llama exports, got {dtype!r}")
    torch_dtype, np_dtype = dtypes[dtype]

    cfg = load_config(checkpoint_dir)
    cache_len = cache_len or min(cfg.max_position_embeddings, 2048)
    if tokens > cache_len:
        raise NpuforgeError(f"tokens per call ({tokens}) exceed cache_len ({cache_len})")
    state_dict = load_state_dict(checkpoint_dir, torch_dtype)
    model = build_model(cfg, state_dict, cache_len).to(torch_dtype)
    del state_dict
    ranges = split_layers(cfg.num_layers, chunks)

    graphs, embedding = [], None
    with atomic_path(out_dir) as tmp:
        tmp.mkdir()
        if ext_embedding:
            from npuforge.export import write_embedding_bin

            table = model.embed_tokens.weight.detach().numpy().astype(np_dtype)
            write_embedding_bin(tmp / "embedding.bin", table)
            embedding = {
                "file": "embedding.bin",
                "sha256": sha256_file(tmp / "embedding.bin"),
                "dtype": np.dtype(np_dtype).name,
                "rows": cfg.vocab_size,
                "cols": cfg.hidden_size,
            }
        for index, (first, last) in enumerate(ranges):
            inputs, outputs = _chunk_io(
                cfg,
                first,
                last,
                batch=batch,
                tokens=tokens,
                cache_len=cache_len,
                np_dtype=np_dtype,
                ext_embedding=ext_embedding,
            )
            scratch = tmp / f".scratch{index}"
            proto = _export_chunk(model, first, last, inputs, outputs, scratch)
            if sha:
                from npuforge.passes import mha_to_sha

                proto = mha_to_sha.convert(proto, inplace=True)
            path = tmp / f"chunk{index}.onnx"
            external = save_onnx(proto, path, external_data)
            del proto
            shutil.rmtree(scratch)
            graph = {
                "file": path.name,
                "sha256": sha256_file(path),
                "layers": [first, last],
                "inputs": inputs,
                "outputs": outputs,
            }
            if external:
                graph["external_data"] = external
            graphs.append(graph)
        meta = {
            "family": "llama",
            "arch": cfg.model_type,
            "variant": variant,
            "dtype": dtype,
            "batch": batch,
            "tokens_per_call": tokens,
            "cache_len": cache_len,
            "chunks": len(ranges),
            "vocab_size": cfg.vocab_size,
            "embed_dim": cfg.hidden_size,
            "n_layers": cfg.num_layers,
            "heads": cfg.num_heads,
            "kv_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim,
            "config": asdict(cfg),
            "options": {
                "sha": sha,
                "ext_embedding": ext_embedding,
                "mask_value": float(mask_value),
                "opset": ONNX_OPSET,
            },
            "embedding": embedding,
            "graphs": graphs,
        }
        write_json(tmp / "export.json", meta)
    return meta

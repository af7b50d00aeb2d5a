"""Tiny random-weight Llama-family checkpoints made with transformers (config.json + safetensors).

Each config exercises one variant of the family: GQA with untied embeddings
(Llama), QKV bias (Qwen2), tied embeddings (SmolLM2), q/k RMSNorm and head_dim
apart from hidden/heads (Qwen3), llama3 RoPE scaling (Llama 3.2). Weights are
drawn from a seeded generator and scaled up from HF's 0.02 init so attention is
not uniform and the parity checks have teeth.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from npuforge.models.llama import extra_inputs

# The parity protocol of the issue: an AR-N prefill, then AR-1 decode steps.
PREFILL, DECODE_STEPS = 16, 48

TINY_CONFIGS = {
    "llama": {
        "model_type": "llama",
        "vocab_size": 96,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    },
    "qwen2": {
        "model_type": "qwen2",
        "vocab_size": 80,
        "hidden_size": 48,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
    },
    "smollm2": {
        "model_type": "llama",
        "vocab_size": 72,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
    },
    "qwen3": {
        "model_type": "qwen3",
        "vocab_size": 70,
        "hidden_size": 48,
        "intermediate_size": 80,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
    },
    "llama3": {
        "model_type": "llama",
        "vocab_size": 64,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8,
        },
        "tie_word_embeddings": True,
    },
}


def make_checkpoint(kind: str, directory, seed: int = 0) -> Path:
    """Save a tiny random ``kind`` model with transformers; returns the folder."""
    import torch
    import transformers

    settings = dict(TINY_CONFIGS[kind])
    model_type = settings.pop("model_type")
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[model_type]
    config = config_cls(**settings)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(0.15 * torch.randn(param.shape, generator=generator))
    directory = Path(directory)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def load_reference(directory):
    """The transformers model for a saved checkpoint (float32, eager attention)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        directory, attn_implementation="eager", dtype="float32"
    ).eval()


def reference_logits(checkpoint, ids):
    import torch

    with torch.no_grad():
        return load_reference(checkpoint)(torch.from_numpy(ids)).logits.numpy()


class OrtChain:
    """Just enough of a runner: feeds tokens/hidden/position/mask/state roles by the export.json."""

    def __init__(self, export_dir):
        import onnxruntime as ort

        self.meta = json.loads((export_dir / "export.json").read_text())
        self.sessions = [
            ort.InferenceSession(str(export_dir / g["file"]), providers=["CPUExecutionProvider"])
            for g in self.meta["graphs"]
        ]
        self.embedding = None
        if self.meta["embedding"]:
            from npuforge.onnx_io import read_embedding_bin

            self.embedding = read_embedding_bin(export_dir / self.meta["embedding"]["file"])

    def __call__(self, ids, position, state):
        hidden = None
        for graph, session in zip(self.meta["graphs"], self.sessions, strict=True):
            feeds = {}
            for spec in graph["inputs"]:
                role = spec["role"]
                if role == "tokens":
                    feeds[spec["name"]] = ids
                elif role == "embedding":
                    feeds[spec["name"]] = np.asarray(self.embedding[ids])
                elif role == "hidden":
                    feeds[spec["name"]] = hidden
                elif role == "state":
                    value = state.get(spec["name"])
                    if value is None:
                        value = np.zeros(spec["shape"], dtype=spec["dtype"])
                    feeds[spec["name"]] = value
                else:
                    feeds[spec["name"]] = extra_inputs(self.meta, spec, position)
            names = [o["name"] for o in graph["outputs"]]
            results = dict(zip(names, session.run(names, feeds), strict=True))
            for spec in graph["inputs"]:
                if spec["role"] == "state":
                    state[spec["name"]] = results[spec["output"]]
            hidden = results.get("hidden_out")
        return results["logits"]


def run_prefill_then_decode(prefill_dir, decode_dir, ids):
    state = {}
    logits = [OrtChain(prefill_dir)(ids[:, :PREFILL], 0, state)]
    decode = OrtChain(decode_dir)
    for position in range(PREFILL, ids.shape[1]):
        logits.append(decode(ids[:, position : position + 1], position, state))
    return np.concatenate(logits, axis=1)


def snap_to_q4_1(weight, group: int = 32):
    """``weight`` ([out, in]) rounded as GGUF's Q4_1 stores it and dequantized: per group
    of ``group`` inputs, 16 levels from the group's minimum by an fp16 step, the minimum
    also fp16; every group then holds its lowest and highest level."""

    blocks = weight.detach().float().reshape(-1, group)
    low = blocks.amin(-1, keepdim=True).half().float()
    step = ((blocks.amax(-1, keepdim=True) - low) / 15).half().float()
    levels = ((blocks - low) / step).round().clamp(0, 15)
    return (levels * step + low).reshape(weight.shape).to(weight.dtype)


def make_q4_1_checkpoint(kind: str, directory, seed: int = 0, group: int = 32) -> Path:
    """A tiny ``kind`` model whose projections lie on a Q4_1 grid, as a dequantized
    Q4_1 GGUF's do (norms and embeddings stay as they are)."""
    import torch
    import transformers

    source = make_checkpoint(kind, Path(directory) / "source", seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(source).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("_proj.weight"):
                param.copy_(snap_to_q4_1(param, group))
    directory = Path(directory) / "q4_1"
    model.save_pretrained(directory, safe_serialization=True)
    return directory

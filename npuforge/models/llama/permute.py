"""A permuted twin of a Llama-family checkpoint: the same function, other weights.

A test fixture of quantization, not a model to ship. A checkpoint that arrives already
quantized (a dequantized Q4_1 GGUF: every projection row on a 4-bit grid in groups of
32) makes 4-bit group quantizers look lossless when their groups line up with the
source's. Permuting channels keeps every weight and every activation outlier, channel
for channel, and moves them out of those groups: the twin computes the same logits
(within float32 rounding) from weights that lie on no grid.

Three kinds of permutation, all drawn from one seeded generator:

* residual stream (``hidden``): the embedding's columns, every RMSNorm weight, the
  input columns of every reader (q/k/v, gate/up, an untied lm_head) and the output rows
  (and biases) of every writer (o_proj, down_proj);
* FFN channels, one per layer: gate/up rows (and biases), down_proj's input columns;
* head_dim, one per KV head of each layer: v_proj's rows (and bias) of that head and
  o_proj's input columns of every query head reading it. q and k rows stay: RoPE rotates
  fixed pairs of positions within a head, and a Qwen3 q/k norm weighs positions too.

A tied lm_head is the embedding table, already permuted.
"""

import json
import shutil
from pathlib import Path

import numpy as np

from npuforge.errors import NpuforgeError
from npuforge.fileio import atomic_path

# Files of the source directory the twin carries over unchanged (its tokenizer above all).
CARRIED = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "chat_template.jinja",
    "generation_config.json",
)
RECORD = "permutation.json"


def draw_permutations(cfg, seed: int) -> dict:
    """The twin's permutations (numpy int arrays) in a fixed drawing order."""
    rng = np.random.default_rng(seed)
    hidden = rng.permutation(cfg.hidden_size)
    ffn = [rng.permutation(cfg.intermediate_size) for _ in range(cfg.num_layers)]
    head = [
        [rng.permutation(cfg.head_dim) for _ in range(cfg.num_kv_heads)]
        for _ in range(cfg.num_layers)
    ]
    return {"hidden": hidden, "ffn": ffn, "head": head}


def _v_rows(cfg, per_kv_head) -> np.ndarray:
    """v_proj's row order: each KV head's block reordered by its own permutation."""
    d = cfg.head_dim
    return np.concatenate([j * d + perm for j, perm in enumerate(per_kv_head)])


def _o_columns(cfg, per_kv_head) -> np.ndarray:
    """o_proj's column order: each query head takes the permutation of its KV head."""
    d, group = cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
    return np.concatenate([i * d + per_kv_head[i // group] for i in range(cfg.num_heads)])


def permute_state_dict(cfg, tensors: dict, permutations: dict) -> dict:
    """The twin's tensors (Hugging Face names) from ``tensors``; unknown names refused."""
    hidden = permutations["hidden"]
    out, done = {}, set()

    def take(name, value):
        if name not in tensors:
            raise NpuforgeError(f"checkpoint has no {name}; it does not match config.json")
        out[name] = np.ascontiguousarray(value)
        done.add(name)

    def t(name):
        return tensors[name]

    def linear(key, rows, columns):
        """A projection's weight in (rows, columns) order, its bias (if any) in rows'."""
        take(key + "weight", t(key + "weight")[rows][:, columns])
        if key + "bias" in tensors:
            take(key + "bias", t(key + "bias")[rows])

    take("model.embed_tokens.weight", t("model.embed_tokens.weight")[:, hidden])
    take("model.norm.weight", t("model.norm.weight")[hidden])
    if "lm_head.weight" in tensors:
        take("lm_head.weight", t("lm_head.weight")[:, hidden])
    for layer in range(cfg.num_layers):
        pre = f"model.layers.{layer}."
        ffn = permutations["ffn"][layer]
        v_rows = _v_rows(cfg, permutations["head"][layer])
        o_columns = _o_columns(cfg, permutations["head"][layer])
        for norm in ("input_layernorm", "post_attention_layernorm"):
            take(pre + f"{norm}.weight", t(pre + f"{norm}.weight")[hidden])
        every = slice(None)
        linear(pre + "self_attn.q_proj.", every, hidden)
        linear(pre + "self_attn.k_proj.", every, hidden)
        linear(pre + "self_attn.v_proj.", v_rows, hidden)
        linear(pre + "self_attn.o_proj.", hidden, o_columns)
        for norm in ("q_norm", "k_norm"):
            if pre + f"self_attn.{norm}.weight" in tensors:
                take(pre + f"self_attn.{norm}.weight", t(pre + f"self_attn.{norm}.weight"))
        linear(pre + "mlp.gate_proj.", ffn, hidden)
        linear(pre + "mlp.up_proj.", ffn, hidden)
        linear(pre + "mlp.down_proj.", hidden, ffn)
    # Rotary buffers some checkpoints store are derived, not weights.
    left = sorted(k for k in set(tensors) - done if not k.endswith("rotary_emb.inv_freq"))
    if left:
        raise NpuforgeError(
            f"checkpoint tensor {left[0]} has no place in the {cfg.model_type} layout the "
            "twin permutes; check that config.json belongs to these weights"
        )
    return out


def permute_checkpoint(checkpoint_dir, out_dir, seed: int) -> dict:
    """Write the permuted twin of the model directory ``checkpoint_dir`` to ``out_dir``
    (config.json, model.safetensors, the tokenizer files, permutation.json); returns the
    record written as permutation.json."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    from npuforge.fetch import tree_sha256
    from npuforge.models.llama.config import load_config
    from npuforge.models.llama.weights import safetensors_files

    if seed < 0:
        raise NpuforgeError(f"the permutation seed must be 0 or more, got {seed}")
    source = Path(checkpoint_dir)
    cfg = load_config(source)
    tensors = {}
    for file in safetensors_files(source):
        with safe_open(str(file), framework="numpy") as handle:
            tensors.update({name: handle.get_tensor(name) for name in handle.keys()})
    permutations = draw_permutations(cfg, seed)
    twin = permute_state_dict(cfg, tensors, permutations)
    del tensors
    record = {
        "fixture": "a test fixture of quantization, not a model to ship",
        "permuted_from": {"directory": source.name, "sha256": tree_sha256(source)},
        "seed": int(seed),
        "generator": "numpy default_rng(seed).permutation: hidden, then ffn per layer, "
        "then head_dim per layer and KV head",
        "permutations": {
            "hidden": 1,
            "ffn": cfg.num_layers,
            "head_dim": cfg.num_layers * cfg.num_kv_heads,
        },
    }
    with atomic_path(out_dir) as tmp:
        tmp.mkdir()
        shutil.copyfile(source / "config.json", tmp / "config.json")
        for name in CARRIED:
            if (source / name).is_file():
                shutil.copyfile(source / name, tmp / name)
        save_file(twin, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return record


def write_twin(checkpoint_dir, source: dict, expected_sha256, out_dir, record_path) -> dict:
    """The workflow's step: the twin of ``checkpoint_dir`` as ``source`` (the registry's
    ``{"permuted": {"model": id, "seed": n}}``) says, checked against the registry's pin
    when it has one, and its record (the fields of a fetch record, which the release
    manifest reads); nothing is left behind on failure."""
    from npuforge.fetch import tree_sha256
    from npuforge.fileio import write_json

    spec = source.get("permuted") if isinstance(source, dict) else None
    if not isinstance(spec, dict) or "seed" not in spec:
        raise NpuforgeError(
            f"source {source!r} is not a permuted source; give {{permuted: {{model, seed}}}}"
        )
    out_dir, record_path = Path(out_dir), Path(record_path)
    made = permute_checkpoint(checkpoint_dir, out_dir, int(spec["seed"]))
    try:
        actual = tree_sha256(out_dir)
        if expected_sha256 and actual != expected_sha256.lower():
            raise NpuforgeError(
                f"the permuted twin of {spec.get('model')} hashes to {actual}, the registry "
                f"pins {expected_sha256.lower()}: fix the pin or the source checkpoint"
            )
        record = {
            "source": source,
            "sha256": actual,
            "expected_sha256": expected_sha256 or None,
            "size": sum(p.stat().st_size for p in out_dir.iterdir() if p.is_file()),
            "file": out_dir.name,
            "permutation": made,
        }
        write_json(record_path, record)
    except BaseException:
        shutil.rmtree(out_dir, ignore_errors=True)
        raise
    return record

"""Exact rotations of a Llama-family decoder (QuaRot, Ashkboos et al., 2024): the same
function, activations and weights without outlier channels.

A trained model's residual stream carries a few channels far larger than the rest, and
every quantizer that gives a tensor (or a row) one scale spends its levels on them.
With an orthogonal Q (Q Q^T = I) the model computes the same with every tensor of the
stream multiplied by Q, and a Hadamard Q spreads each outlier over all channels:

* RMSNorm weights fold into the matmuls they feed (W diag(w)), leaving norms of weight
  1; then norm(x Q) = norm(x) Q, because rotations keep the mean square (the fp16-safe
  norm's max-scaling is exact for any scale, rotated or not);
* every reader of the stream (q/k/v, gate/up, lm_head) takes W Q, every writer
  (o_proj, down_proj) Q^T W and bias b Q, the embedding E Q: the stream is h Q
  throughout, and the kv_prefix cache computed from this model is its own;
* a tied lm_head becomes a weight of its own, E diag(w_final) Q (the embedding table is
  E Q): the graph carries lm_head as its own matmul, so no runner changes;
* per KV head, V is rotated by an orthogonal H of head_dim (v_proj rows H^T W_v, bias
  b H) and every query head reading it takes o_proj columns W_o H: attention is linear
  in V. Q and K stay (RoPE and the q/k norms act on fixed positions of a head);
* down_proj's input (the FFN channels, where SmolLM2's largest activations live) is
  rotated online: up_proj's rows take random signs D, a constant rotation R = A kron B
  runs in the graph before down_proj (``KroneckerRotation``), and down_proj takes
  W D R. Hadamard A and B quantize without loss as weights (entries of one magnitude).

Every rotation is a Hadamard matrix with seeded random signs where its order has one
(``npuforge.hadamard``), else a seeded random orthogonal matrix. Computed in float64,
stored in float32: the logits move by float32 rounding only.
"""

import numpy as np
import torch

from npuforge.hadamard import kronecker_split, orthogonal


def _fold_norm(norm, linears):
    """W diag(w) for each linear fed by ``norm``; the norm's weight becomes 1."""
    weight = norm.weight.double()
    for linear in linears:
        linear.weight.copy_(linear.weight.double() * weight[None, :])
    norm.weight.fill_(1.0)


def _read(linear, q):
    """A reader of the stream: its input columns rotated, W Q."""
    linear.weight.copy_(linear.weight.double() @ q)


def _write(linear, q):
    """A writer to the stream: its output rows rotated, Q^T W, bias b Q."""
    linear.weight.copy_(q.T @ linear.weight.double())
    if linear.bias is not None:
        linear.bias.copy_(linear.bias.double() @ q)


def _rotate_values(attn, cfg, h):
    """V of every KV head times H: v_proj rows H^T W_v (bias b H), o_proj columns W_o H."""
    d = cfg.head_dim
    v = attn.v_proj.weight.double().reshape(cfg.num_kv_heads, d, -1)
    attn.v_proj.weight.copy_(torch.einsum("dk,jdi->jki", h, v).reshape(attn.v_proj.weight.shape))
    if attn.v_proj.bias is not None:
        bias = attn.v_proj.bias.double().reshape(cfg.num_kv_heads, d) @ h
        attn.v_proj.bias.copy_(bias.reshape(-1))
    o = attn.o_proj.weight.double().reshape(-1, cfg.num_heads, d)
    attn.o_proj.weight.copy_((o @ h).reshape(attn.o_proj.weight.shape))


def rotate(model, seed: int) -> dict:
    """Rotate ``model`` (a float32 ``Llama``, in place) as the module docstring says;
    returns the export's record of it."""
    from npuforge.models.llama.model import KroneckerRotation

    cfg = model.cfg
    rng = np.random.default_rng(seed)
    e, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    stream, stream_kind = orthogonal(e, rng)
    q = torch.from_numpy(stream)
    a, b = kronecker_split(f)
    kinds = {"hidden": stream_kind}
    with torch.no_grad():
        # lm_head gets its own weight (tied or not), then reads the final norm's output.
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
        _fold_norm(model.norm, [model.lm_head])
        _read(model.lm_head, q)
        model.embed_tokens.weight.copy_(model.embed_tokens.weight.double() @ q)
        for block in model.layers:
            attn, mlp = block.self_attn, block.mlp
            _fold_norm(block.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj])
            _fold_norm(block.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj])
            for linear in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
                _read(linear, q)
            head, kinds["head_dim"] = orthogonal(d, rng)
            _rotate_values(attn, cfg, torch.from_numpy(head))
            _write(attn.o_proj, q)
            # Online: h -> (h D)(A kron B); up_proj's rows take D, down_proj W D (A kron B).
            signs = torch.from_numpy(rng.choice([-1.0, 1.0], size=f))
            mlp.up_proj.weight.copy_(mlp.up_proj.weight.double() * signs[:, None])
            if mlp.up_proj.bias is not None:
                mlp.up_proj.bias.copy_(mlp.up_proj.bias.double() * signs)
            left, kinds["ffn_left"] = orthogonal(a, rng)
            right, kinds["ffn_right"] = orthogonal(b, rng)
            left, right = torch.from_numpy(left), torch.from_numpy(right)
            down = mlp.down_proj.weight.double() * signs[None, :]
            down = (left.T @ down.reshape(e, a, b) @ right).reshape(e, f)
            mlp.down_proj.weight.copy_(down)
            _write(mlp.down_proj, q)
            mlp.down_rotation = KroneckerRotation(left.float(), right.float())
    return {
        "seed": int(seed),
        "hidden": {"size": e, "kind": kinds["hidden"]},
        "head_dim": {"size": d, "kind": kinds["head_dim"], "per": "layer"},
        "down_proj_input": {
            "size": f,
            "factors": [a, b],
            "kinds": [kinds["ffn_left"], kinds["ffn_right"]],
            "per": "layer",
        },
        "norms_folded": 2 * cfg.num_layers + 1,
        "lm_head": "its own weight (the final norm and the rotation folded in)",
    }

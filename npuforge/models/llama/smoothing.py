"""SmoothQuant: move activation outliers into the weights before an 8-bit build.

A trained model's normalised stream has a few channels far larger than the rest
(SmolLM2-135M: |x| past 100 where the median is under 1), so one 8-bit scale per
tensor leaves every other channel a handful of levels. For a linear layer fed by a
norm, ``W x = (W diag(s)) (x / s)`` for any positive ``s``: dividing the norm's weight
by ``s`` and multiplying the layer's input columns by ``s`` changes no fp32 result, and
``s_j = max|x_j|**alpha / max|W_j|**(1 - alpha)`` evens the activation channels at
the weights' expense (Xiao et al., 2023). The same holds between ``v_proj``'s output
rows and ``o_proj``'s input columns (attention is linear in V).

The activation ranges come from the fp32 model over calibration text; the first
``prefix`` positions (a kv_prefix, computed in fp32 at export) are left out, since
no compiled graph sees them.
"""

import torch

from npuforge.errors import NpuforgeError

# Floor of a channel's range: keeps an all-zero channel's scale finite.
RANGE_FLOOR = 1e-5
# Tokens per calibration document: enough for each to show its outliers.
TOKENS_PER_DOCUMENT = 256


def activation_ranges(model, sequences: list, prefix: list, room: int, run) -> dict:
    """max |x| per input channel of every linear layer of ``model``, over ``run(prefix +
    sequence)`` calls (at most ``room`` tokens of each), the prefix's positions left out."""
    ranges, hooks = {}, []

    def record(name):
        def hook(_module, args):
            x = args[0][:, len(prefix) :].detach().abs().reshape(-1, args[0].shape[-1])
            seen = x.amax(0)
            ranges[name] = torch.maximum(ranges[name], seen) if name in ranges else seen

        return hook

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            hooks.append(module.register_forward_pre_hook(record(name)))
    try:
        for ids in sequences:
            run(list(prefix) + [int(t) for t in ids[: min(TOKENS_PER_DOCUMENT, room)]])
    finally:
        for hook in hooks:
            hook.remove()
    return ranges


def _scales(act_max, weight_max, alpha):
    act = act_max.clamp(min=RANGE_FLOOR)
    return act**alpha / weight_max.clamp(min=RANGE_FLOOR) ** (1 - alpha)


def _o_column_channels(cfg):
    """The v_proj output channel each o_proj input column reads (heads share kv heads)."""
    columns = torch.arange(cfg.num_heads * cfg.head_dim)
    group = cfg.num_heads // cfg.num_kv_heads
    return (columns // cfg.head_dim // group) * cfg.head_dim + columns % cfg.head_dim


def _per_channel_max(values, channels, count):
    return torch.zeros(count).scatter_reduce(0, channels, values, "amax", include_self=False)


def _fold_into_norm(norm, linears, act_max, alpha):
    """Scale the linears' input columns by s and the norm feeding them by 1 / s."""
    weight_max = torch.cat([linear.weight for linear in linears]).abs().amax(0)
    scale = _scales(act_max, weight_max, alpha)
    norm.weight /= scale
    for linear in linears:
        linear.weight *= scale
    return scale


def _fold_into_v(attn, act_max, alpha, channels, width):
    """Scale o_proj's input columns by s and the v_proj rows they read by 1 / s."""
    act = _per_channel_max(act_max, channels, width)
    weight = _per_channel_max(attn.o_proj.weight.abs().amax(0), channels, width)
    scale = _scales(act, weight, alpha)
    attn.v_proj.weight /= scale[:, None]
    if attn.v_proj.bias is not None:
        attn.v_proj.bias /= scale
    attn.o_proj.weight *= scale[channels]
    return scale


def smooth(model, ranges: dict, alpha: float) -> dict:
    """Fold SmoothQuant scales into ``model`` (fp32) in place; returns their summary."""
    if not 0 < alpha <= 1:
        raise NpuforgeError(f"smoothquant alpha must lie in (0, 1], got {alpha}")
    cfg = model.cfg
    channels = _o_column_channels(cfg)
    width = cfg.num_kv_heads * cfg.head_dim
    scales = []
    with torch.no_grad():
        for index, block in enumerate(model.layers):
            attn, mlp, name = block.self_attn, block.mlp, f"layers.{index}"
            qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
            act = ranges[f"{name}.self_attn.q_proj"]
            scales.append(_fold_into_norm(block.input_layernorm, qkv, act, alpha))
            act = ranges[f"{name}.mlp.gate_proj"]
            norm = block.post_attention_layernorm
            scales.append(_fold_into_norm(norm, (mlp.gate_proj, mlp.up_proj), act, alpha))
            act = ranges[f"{name}.self_attn.o_proj"]
            scales.append(_fold_into_v(attn, act, alpha, channels, width))
    every = torch.cat(scales)
    return {
        "alpha": alpha,
        "channels": every.numel(),
        "scale_range": [every.min().item(), every.max().item()],
    }

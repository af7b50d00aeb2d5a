"""AWQ: input-channel scales that shield the weights large activations read from
rounding (Lin et al., 2024, activation-aware weight quantization).

For a linear layer ``W x = (W diag(s)) (x / s)``: the weights of channel j grow by s_j
before rounding, so their rounding error shrinks relative to them, and the input that
multiplies them shrinks by the same s_j. Where the input's channels differ in size (a
trained model's few outlier channels), scaling the large ones up costs the small ones
little and takes most of the output's error away. The division by s folds, exactly in
fp32, into what feeds the layer: the RMSNorm weight before q/k/v and before gate/up,
and up_proj's output rows before down_proj (the MLP's product is linear in up's rows;
not in a rotated model, whose down_proj reads the product through a rotation).

Per group of layers reading one input, ``s = mean|x|**alpha`` over the calibration
text (normalised to a geometric mean of 1 between its extremes), alpha searched over
``ALPHAS`` for the least output error of the rounded weights on that text,
``tr(dW H dW^T)`` with ``H = X^T X`` (alpha 0 is no scaling: AWQ never does worse there
than round to nearest). Layer by layer from the fp32 model, as ``rounding`` runs GPTQ,
in float64; the inputs after the export's kv_prefix only.
"""

import torch

from npuforge.models.llama.rounding import _layer_inputs, _run_block, layers_in_float64
from npuforge.quantization import WeightGrid, round_to_nearest, rounding_loss

ALPHAS = tuple(i / 20 for i in range(20))
# Floor of a channel's mean |x|: keeps a dead channel's scale finite.
MEAN_FLOOR = 1e-6


def _statistics(block, cfg, states, skip, linears: dict) -> dict:
    """name -> (H = sum x x^T, mean |x| per channel) of each named linear's input, over
    one run of ``block`` per state, the first ``skip`` positions left out."""
    sums = {}

    def record(name):
        def hook(module, args):
            rows = args[0][:, skip:].reshape(-1, module.in_features).double()
            hessian, total, count = sums.get(name, (0, 0, 0))
            sums[name] = (hessian + rows.T @ rows, total + rows.abs().sum(0), count + len(rows))

        return hook

    hooks = [linear.register_forward_pre_hook(record(n)) for n, linear in linears.items()]
    try:
        for x, host in states:
            _run_block(block, cfg, x, host)
    finally:
        for hook in hooks:
            hook.remove()
    return {name: (h, total / count) for name, (h, total, count) in sums.items()}


def best_scale(weights: list, hessian, mean_abs, grid: WeightGrid) -> tuple:
    """(scale, alpha, loss, unscaled loss): the ``ALPHAS`` scale whose rounded weights
    keep the least output error on inputs of Gram matrix ``hessian``."""
    weights = [w.detach().double() for w in weights]
    magnitude = mean_abs.double().clamp(min=MEAN_FLOOR)
    tried = []
    for alpha in ALPHAS:
        scale = magnitude**alpha
        scale = scale / (scale.max() * scale.min()).sqrt()
        loss = sum(
            rounding_loss(w, round_to_nearest(w * scale, grid) / scale, hessian) for w in weights
        )
        tried.append((scale, alpha, loss))
    scale, alpha, loss = min(tried, key=lambda t: t[2])  # the first of equal losses
    return scale, alpha, loss, tried[0][2]


def scale_decoder(model, sequences, prefix, grid: WeightGrid) -> dict:
    """Fold AWQ scales for ``grid`` into ``model`` (float32, in place): the same function
    in fp32, its weights scaled for rounding. Returns the record of it."""
    cfg, skip = model.cfg, len(prefix)
    states = _layer_inputs(model, sequences, prefix)
    chosen, before, after = [], 0.0, 0.0
    for block in layers_in_float64(model, states, "AWQ", "scaled"):
        attn, mlp = block.self_attn, block.mlp
        reads = {"q_proj": attn.q_proj, "gate_proj": mlp.gate_proj, "down_proj": mlp.down_proj}
        stats = _statistics(block, cfg, states, skip, reads)
        groups = [
            (block.input_layernorm, (attn.q_proj, attn.k_proj, attn.v_proj), "q_proj"),
            (block.post_attention_layernorm, (mlp.gate_proj, mlp.up_proj), "gate_proj"),
        ]
        if mlp.down_rotation is None:
            groups.append((mlp.up_proj, (mlp.down_proj,), "down_proj"))
        with torch.no_grad():
            for source, linears, name in groups:
                hessian, mean_abs = stats[name]
                weights = [linear.weight for linear in linears]
                scale, alpha, loss, plain = best_scale(weights, hessian, mean_abs, grid)
                if source is mlp.up_proj:  # its output rows feed down_proj's columns
                    source.weight /= scale[:, None]
                    if source.bias is not None:
                        source.bias /= scale
                else:
                    source.weight /= scale
                for linear in linears:
                    linear.weight *= scale
                chosen.append(alpha)
                before, after = before + plain, after + loss
    return {
        "method": "awq",
        "grid": grid.describe(),
        "alphas": {"min": min(chosen), "max": max(chosen), "mean": sum(chosen) / len(chosen)},
        "groups": "input_layernorm -> q/k/v, post_attention_layernorm -> gate/up"
        + (", up_proj rows -> down_proj" if len(groups) == 3 else " (down_proj reads a rotation)"),
        "output_error": {"rounded": before, "scaled and rounded": after},
        "sequences": len(sequences),
    }

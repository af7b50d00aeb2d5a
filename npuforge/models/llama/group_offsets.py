"""Group offsets: each decoder matmul's per-group weight minimum moved into a side matmul.

A 4-bit asymmetric weight quantizer that stores, per group of ``g`` input weights, a
scale and an *integer* zero point (TPU-MLIR's W4F16) puts the grid's zero point up to
half a step away from the group's minimum, so every weight of the group moves. With the
minimum taken out, each group's minimum is exactly 0: the zero point is 0 and the grid
runs from the true minimum to the true maximum, a float zero point (as GGUF's Q4_1 has).
A checkpoint already on such a grid with the same groups (a dequantized Q4_1 GGUF) then
quantizes without loss.

    x W^T = x (W - O)^T + mean_g(x) (g M)^T

O repeats each group's minimum M over its ``g`` inputs; the side matmul reads the mean of
each group of inputs (a mean, not a sum: it stays inside fp16 wherever x does).

Block centres are the form for a symmetric block quantizer (a float scale per group, no
zero point: QNN's block quantization): the side matmul takes each group's centre, its
minimum plus 8 of the 15 steps of its 16-level grid, and the rest spans exactly -8..7
steps of (max - min) / 15, a signed 4-bit grid with scale (max - min) / 15.
"""

import torch
from torch import nn

from npuforge.errors import NpuforgeError

# The decoder's weight matmuls (the tied lm_head is the embedding table, left alone).
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GRID_LEVELS = 16
# |(w - min) / step - round(...)| below this counts as on the grid (fp32 dequantization
# rounds the grid points by a few ulps).
GRID_SLACK = 1e-3
# Block centres serve the MLP only: the attention projections take the MHA->SHA split
# per head (which cannot split side matmuls), and the Qualcomm targets keep them 16-bit.
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class GroupOffsetLinear(nn.Module):
    """A Linear whose weight's per-group minima (``centred``: centres) are served by a side
    matmul."""

    def __init__(self, linear: nn.Linear, group: int, centred: bool = False):
        super().__init__()
        out_features, in_features = linear.weight.shape
        blocks = linear.weight.detach().float().reshape(out_features, -1, group)
        offset = blocks.amin(-1)
        if centred:
            half = GRID_LEVELS // 2
            offset = offset + half * (blocks.amax(-1) - offset) / (GRID_LEVELS - 1)
        self.group = group
        self.weight = nn.Parameter((blocks - offset[..., None]).reshape(out_features, -1))
        self.bias = linear.bias
        # Its ONNX node is ".../<projection>/group_offsets/MatMul": a backend keeps it in
        # 16 bit (its inputs are the group count wide, not a multiple of a weight group).
        self.group_offsets = nn.Linear(in_features // group, out_features, bias=False)
        self.group_offsets.weight = nn.Parameter(offset * group)

    def forward(self, x):
        # Sizes read from x trace to constants: a static Reshape. unflatten(-1, ...) exports a
        # shape computation that ONNX shape inference cannot follow, and every tensor after
        # it (the next layers' attention too) would lose its shape.
        means = x.reshape(*x.shape[:-1], x.shape[-1] // self.group, self.group).mean(-1)
        return nn.functional.linear(x, self.weight, self.bias) + self.group_offsets(means)


def on_grid(weight: torch.Tensor, group: int, levels: int = GRID_LEVELS) -> bool:
    """Whether every group of ``weight`` ([out, in]) lies on ``levels`` evenly spaced
    values from its minimum to its maximum."""
    blocks = weight.detach().float().reshape(-1, group)
    low = blocks.amin(-1, keepdim=True)
    step = (blocks.amax(-1, keepdim=True) - low) / (levels - 1)
    steps = (blocks - low) / torch.where(step > 0, step, torch.ones_like(step))
    return bool(((steps - steps.round()).abs() < GRID_SLACK).all())


def split_group_offsets(model, group: int, option: str = "group_offsets") -> dict:
    """Replace every decoder projection of ``model`` by a ``GroupOffsetLinear``: their
    minima split out, or for ``option="block_centres"`` the MLP's, centres split out.

    Returns the export's record: the group, how many matmuls were split and how many
    of them already lay on a 4-bit grid of these groups (those quantize without loss).
    """
    if group < 2:
        raise NpuforgeError(f"{option} group must be at least 2, got {group}")
    centred = option == "block_centres"
    names = MLP_PROJECTIONS if centred else PROJECTIONS
    split = on_4bit_grid = 0
    for layer in model.layers:
        for owner in (layer.self_attn, layer.mlp):
            for name in names:
                linear = getattr(owner, name, None)
                if linear is None:
                    continue
                if linear.in_features % group:
                    raise NpuforgeError(
                        f"{option}: {name} has {linear.in_features} inputs, not a multiple "
                        f"of the group {group}; use a group that divides every projection's "
                        "input width"
                    )
                on_4bit_grid += on_grid(linear.weight, group)
                setattr(owner, name, GroupOffsetLinear(linear, group, centred))
                split += 1
    return {"group": group, "matmuls": split, "on_4bit_grid": on_4bit_grid}

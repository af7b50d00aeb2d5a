"""GPTQ over a whole Llama-family decoder, layer by layer, from calibration text.

Each projection is rounded against the Hessian of the inputs it sees once the layers
before it (and the projections before it in its own layer: q/k/v, then o_proj, then
gate/up, then down_proj) are rounded already, as in the GPTQ paper: later layers
correct for what earlier rounding did. The inputs come from the fp32 model run over the
calibration text (the same documents and cap as SmoothQuant's ranges), each sequence
after the export's kv_prefix, whose positions no compiled graph computes and which
are left out of the Hessians.

The layers run in float64 while they are rounded (each layer's inputs, its Hessians and
its outputs), then return to float32. GPTQ's roundings hang on its Hessians' last bits: a
rounding that flips moves its error onto every later column and every later layer, so
float32 Hessians, whose last bits follow the host's kernels (AVX-512, AVX2, SSE paths of
torch, MKL and oneDNN), gave other weights on each host, and on SmolLM2's permuted twin
(4-bit groups of 32) top-1 0.760, 0.823 and 0.875, perplexity +4.6 % to +18 %. Float64
keeps those differences far below any rounding boundary: the same weights on every
host (test: the plainest kernels against the host's own).

Why the Hessians are captured here and not from the calibration samples of
``npuforge.calibration``: those are the inputs of the exported graphs, which exist only
after the export this rounding changes; the samples of a rounded export are then taken
from it as for any other.
"""

import time

import torch

from npuforge.quantization import DAMP, WeightGrid, gptq, round_to_nearest

# Projections rounded together (they read one input), in the order a layer runs them.
SUBLAYERS = (
    ("self_attn", ("q_proj", "k_proj", "v_proj")),
    ("self_attn", ("o_proj",)),
    ("mlp", ("gate_proj", "up_proj")),
    ("mlp", ("down_proj",)),
)


def _layer_inputs(model, sequences, prefix):
    """Per sequence: the embedded tokens [1, T, E] and the host inputs of one call over
    them from an empty cache of T slots."""
    from npuforge.models.llama.config import host_inputs

    cfg, states = model.cfg, []
    for ids in sequences:
        tokens = [*prefix, *(int(t) for t in ids)]
        host = host_inputs(cfg, batch=1, tokens=len(tokens), cache_len=len(tokens), position=0)
        roles = ("rope_cos", "rope_sin", "cache_write", "cache_keep", "mask")
        with torch.no_grad():
            x = model.embed_tokens(torch.tensor([tokens], dtype=torch.int64)).double()
        states.append([x, [torch.from_numpy(host[r]).double() for r in roles]])
    return states


def _run_block(block, cfg, x, host):
    shape = [1, cfg.num_kv_heads, x.shape[1], cfg.head_dim]
    zeros = torch.zeros(shape, dtype=x.dtype)
    with torch.no_grad():
        return block(x, *host, zeros, zeros)[0]


def layers_in_float64(model, states, lever: str, done: str):
    """Each decoder layer of ``model`` in float64 (the module docstring says why), for the
    caller to change; then ``states`` (``_layer_inputs``) through the changed layer, the
    layer back to float32, and a log line: a layer takes seconds, a decoder minutes."""
    started = time.monotonic()
    for index, block in enumerate(model.layers):
        block.double()
        yield block
        for state in states:
            state[0] = _run_block(block, model.cfg, *state)
        block.float()
        print(
            f"{lever}: layer {index + 1} of {len(model.layers)} {done} "
            f"({time.monotonic() - started:.0f} s)",
            flush=True,
        )


class _Captured(Exception):
    """Stops a block's run once the input wanted has been seen."""


def _hessian(block, cfg, linear, states, skip):
    """Sum of x x^T over ``linear``'s inputs (float64), the first ``skip`` positions of
    each sequence left out; and the number of positions summed. Each run of the block
    stops at ``linear``: what follows it is not needed."""
    total = torch.zeros(linear.in_features, linear.in_features, dtype=torch.float64)
    count = [0]

    def record(_module, args):
        rows = args[0][:, skip:].reshape(-1, linear.in_features)
        total.add_(rows.T @ rows)
        count[0] += rows.shape[0]
        raise _Captured

    hook = linear.register_forward_pre_hook(record)
    try:
        for x, host in states:
            try:
                _run_block(block, cfg, x, host)
            except _Captured:
                pass
    finally:
        hook.remove()
    return total, count[0]


def round_decoder(
    model,
    sequences,
    prefix,
    grid: WeightGrid,
    method: str = "gptq",
    damp: float = DAMP,
    act_order: bool = False,
    names=None,
    pin: bool = True,
) -> dict:
    """Round every decoder projection of ``model`` (float32, in place) onto ``grid``:
    ``method`` "gptq" (layer by layer as the module docstring says) or "nearest";
    ``names``: only these projections (say, the MLP's), the rest left as they are;
    ``pin``: see ``npuforge.quantization.gptq``. The embedding, norms and lm_head stay
    as they are. Returns the record of it."""
    chosen = set(names or (n for _, group in SUBLAYERS for n in group))
    if method == "nearest":
        with torch.no_grad():
            for block in model.layers:
                for owner, group in SUBLAYERS:
                    for name in chosen.intersection(group):
                        linear = getattr(getattr(block, owner), name)
                        linear.weight.copy_(round_to_nearest(linear.weight, grid))
        return {"method": "round to nearest", "grid": grid.describe()}
    cfg, skip = model.cfg, len(prefix)
    states = _layer_inputs(model, sequences, prefix)
    positions = 0
    for block in layers_in_float64(model, states, "GPTQ", "rounded"):
        for owner, group in SUBLAYERS:
            linears = [getattr(getattr(block, owner), n) for n in group if n in chosen]
            if not linears:
                continue
            hessian, positions = _hessian(block, cfg, linears[0], states, skip)
            with torch.no_grad():
                for linear in linears:
                    rounded = gptq(linear.weight, hessian, grid, damp, pin, act_order)
                    linear.weight.copy_(rounded)
    return {
        "method": "gptq",
        "grid": grid.describe(),
        "damp": damp,
        "act_order": act_order,
        "projections": sorted(chosen),
        "sequences": len(sequences),
        "positions": positions,
        "order": "layer by layer: q/k/v, o_proj, gate/up, down_proj, each from the inputs "
        "the rounded projections before it give",
        "extremes": "pinned to the grid's end levels, so a backend deriving its grid from "
        "the exported weights rounds each to GPTQ's choice"
        if pin
        else "free (a backend deriving its grid from the weights may round them again)",
    }


def input_ranges(model, calls, run, names=None, positions=slice(None)) -> dict:
    """(min, max) of every decoder projection's input (or only those ``names``d) over
    ``run(call)`` for each of ``calls``, at the token ``positions`` of each call (an index
    or a slice): the per-tensor activation ranges a backend calibrating on them sees."""
    ranges, hooks = {}, []

    def record(key):
        def hook(_module, args):
            x = args[0][:, positions]
            low, high = float(x.min()), float(x.max())
            old = ranges.get(key, (low, high))
            ranges[key] = (min(old[0], low), max(old[1], high))

        return hook

    for index, block in enumerate(model.layers):
        for owner, group in SUBLAYERS:
            for name in group:
                if names is None or name in names:
                    linear = getattr(getattr(block, owner), name)
                    hooks.append(linear.register_forward_pre_hook(record(f"{index}.{name}")))
    try:
        for call in calls:
            run(call)
    finally:
        for hook in hooks:
            hook.remove()
    return ranges

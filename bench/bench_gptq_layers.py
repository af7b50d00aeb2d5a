"""GPTQ against round to nearest, projection by projection, on SmolLM2-135M.

For each projection of the chosen layers: its output error ||X W^T - X Q^T||^2 per
position (``npuforge.quantization.rounding_loss``) for Q rounded to nearest and by GPTQ
(Hessian from the calibration text, as the export takes it), measured on the
calibration text's inputs and on the held-out text's (never calibrated on). Inputs from
the fp32 model: a projection's own error, not what earlier rounding adds to it.

    python bench/bench_gptq_layers.py [--model smollm2-135m] [--bits 4] [--group 64]
                                      [--layers 0,1,5,15,29]
"""

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group", type=int, default=64, help="0: one grid per output row")
    parser.add_argument("--layers", default="0,1,5,15,29")
    parser.add_argument("--positions", type=int, default=300, help="held-out positions")
    parser.add_argument("--results", type=Path, default=Path("/tmp/npuforge-bench-quant"))
    args = parser.parse_args()

    import bench_quant
    import torch

    from npuforge import heldout
    from npuforge.models.llama import rounding
    from npuforge.models.llama.config import load_config
    from npuforge.models.llama.model import build_model
    from npuforge.models.llama.weights import checkpoint_tokenizer, load_state_dict
    from npuforge.quantization import WeightGrid, gptq, round_to_nearest, rounding_loss

    torch.set_grad_enabled(False)
    torch.set_num_threads(1)
    args.models = [args.model]
    model_dir = bench_quant.checkpoints(args)[args.model]
    cfg = load_config(model_dir)
    tokenizer, _ = checkpoint_tokenizer(model_dir)
    held = heldout.tokenize(tokenizer, cfg.vocab_size)[: args.positions]
    sequences = bench_quant.calibration(model_dir, cfg.vocab_size)
    cache_len = len(bench_quant.PREFIX) + max(len(held), *map(len, sequences))
    model = build_model(cfg, load_state_dict(model_dir), cache_len)
    texts = {
        "calibration": rounding._layer_inputs(model, sequences, bench_quant.PREFIX),
        "held-out": rounding._layer_inputs(model, [held], bench_quant.PREFIX),
    }
    grid = WeightGrid(args.bits, args.group or None)
    skip = len(bench_quant.PREFIX)
    print(f"{grid.describe()}; loss per position, calibration | held-out")
    print(f"{'layer':>5} {'projection':10} {'nearest':>21} {'gptq':>21} {'held-out ratio':>15}")
    for index in map(int, args.layers.split(",")):
        block = model.layers[index]
        for owner, names in rounding.SUBLAYERS:
            linear = getattr(getattr(block, owner), names[0])
            hessians = {
                text: rounding._hessian(block, cfg, linear, states, skip)
                for text, states in texts.items()
            }
            weight = linear.weight.detach()
            rounded = {
                "nearest": round_to_nearest(weight, grid),
                "gptq": gptq(weight, hessians["calibration"][0], grid),
            }
            cells, held_loss = [], {}
            for method, q in rounded.items():
                losses = [rounding_loss(weight, q, h) / n for h, n in hessians.values()]
                held_loss[method] = losses[1]
                cells.append(f"{losses[0]:9.4g} | {losses[1]:9.4g}")
            ratio = held_loss["nearest"] / max(held_loss["gptq"], 1e-30)
            print(f"{index:5d} {names[0]:10} {cells[0]:>21} {cells[1]:>21} {ratio:14.1f}x")


if __name__ == "__main__":
    main()

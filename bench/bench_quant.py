"""Quantization levers in torch: SmolLM2-135M and its permuted twin against fp32.

Teacher-forced over the held-out text (data/calibration/heldout.txt, never calibrated
on) after the kv_prefix <|im_start|>, every decoder matmul's weights fake-quantized
(embedding, norms and lm_head fp32), for each weight grid and lever:

  grids   8-bit symmetric per output channel (QNN a16w8, TPU-MLIR W8F16);
          4-bit asymmetric in groups of 32 and of 64 (min..max per group, as TPU-MLIR's
          W4F16 with group_offsets and QNN's int4 blocks with block_centres see them)
  levers  round to nearest; rotation (npuforge.models.llama.rotation); GPTQ
          (npuforge.models.llama.rounding, on the project's calibration text);
          rotation then GPTQ
  w8a8    the 8-bit weights plus every decoder matmul's input fake-quantized to 8 bits
          per tensor, ranges from the calibration text (the kv_prefix position stays fp32,
          as the export computes its cache), with and without rotation

Figures as the compile steps' gates judge them (npuforge.backends.base.fidelity): top-1
agreement with fp32 and the change of the text's perplexity.

    python bench/bench_quant.py [--positions 96] [--models smollm2-135m,smollm2-135m-permuted]
                                [--results /tmp/npuforge-bench-quant] [--rows 4bit-g32,...]

The checkpoints are made by the workflow (fetch, dequantize, permute) into --results.
"""

import argparse
import copy
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PREFIX = [1]  # <|im_start|>, the registry's kv_prefix for SmolLM2
ROTATION_SEED = 0


def checkpoints(args) -> dict:
    """Model id -> model directory, made by the workflow."""
    paths = {}
    for model in args.models:
        kind = "permuted" if model.endswith("-permuted") else "dequantized"
        paths[model] = args.results / "models" / model / f"{kind}.hf"
    missing = [str(p) for p in paths.values() if not p.is_dir()]
    if missing:
        command = [
            sys.executable, "-m", "snakemake", "--cores", "1",
            "--config", f"model={','.join(args.models)}", "target=onnx",
            f"results={args.results}", "--", *missing,
        ]  # fmt: skip
        print("$", " ".join(command), flush=True)
        subprocess.run(command, cwd=REPO, check=True)
    return paths


def grids():
    from npuforge.quantization import WeightGrid

    return {
        "8bit-channel": WeightGrid(8, symmetric=True),
        "4bit-g32": WeightGrid(4, 32),
        "4bit-g64": WeightGrid(4, 64),
    }


def evaluate(model, ids, reference, activation_ranges=None) -> dict:
    """fidelity() of ``model`` over PREFIX + ids against ``reference`` logits."""
    import torch

    from npuforge.backends.base import fidelity
    from npuforge.models.llama.onnx_export import run_from_empty_cache
    from npuforge.quantization import fake_quantize_tensor

    hooks = []
    if activation_ranges:
        for index, block in enumerate(model.layers):
            for owner in (block.self_attn, block.mlp):
                for name, linear in owner.named_children():
                    key = f"{index}.{name}"
                    if key not in activation_ranges:
                        continue
                    low, high = activation_ranges[key]

                    def quantize(_module, args, low=low, high=high):
                        x = args[0]
                        head = x[:, : len(PREFIX)]
                        rest = fake_quantize_tensor(x[:, len(PREFIX) :], low, high)
                        return (torch.cat([head, rest], dim=1),)

                    hooks.append(linear.register_forward_pre_hook(quantize))
    try:
        tokens = [*PREFIX, *ids]
        logits = run_from_empty_cache(model, [tokens], len(tokens))[0][0, len(PREFIX) :].numpy()
    finally:
        for hook in hooks:
            hook.remove()
    if reference is None:
        return logits
    return fidelity(reference, logits, ids[1:])


def run_tokens(model, tokens):
    from npuforge.models.llama.onnx_export import run_from_empty_cache

    return run_from_empty_cache(model, [tokens], len(tokens))


def calibration(model_dir, vocab, cap=None):
    """The project's calibration documents in the model's tokens, each cut at ``cap``."""
    from npuforge import texts
    from npuforge.models.llama.weights import checkpoint_tokenizer

    tokenizer, _ = checkpoint_tokenizer(model_dir)
    sequences = texts.tokenize_documents(texts.read_documents(None), vocab, tokenizer)
    return [list(map(int, s[:cap])) for s in sequences]


def run_model(model_id, model_dir, args, rows):
    import torch

    from npuforge import heldout
    from npuforge.models.llama import rotation, rounding
    from npuforge.models.llama.config import load_config
    from npuforge.models.llama.model import build_model
    from npuforge.models.llama.weights import checkpoint_tokenizer, load_state_dict

    torch.set_grad_enabled(False)
    # One thread: GPTQ's column loop is many small ops, which a second thread only slows
    # (8-10x on a busy 2-core machine).
    torch.set_num_threads(args.threads)
    cfg = load_config(model_dir)
    tokenizer, _ = checkpoint_tokenizer(model_dir)
    ids = heldout.tokenize(tokenizer, cfg.vocab_size)[: args.positions + 1]
    if len(ids) < args.positions + 1:
        raise SystemExit(f"the held-out text has {len(ids)} tokens; lower --positions")
    plain = build_model(cfg, load_state_dict(model_dir), args.positions + 1 + len(PREFIX))
    reference = evaluate(plain, ids[: args.positions], None)
    # GPTQ's Hessians from whole documents (5.8k tokens; cut at the 255 positions the
    # graphs hold, 2.8k, the twin's g32 top-1 fell from 0.76 to 0.69); activation ranges
    # from the positions the graphs hold.
    sequences = calibration(model_dir, cfg.vocab_size)
    held = calibration(model_dir, cfg.vocab_size, 256 - len(PREFIX))
    rotated = copy.deepcopy(plain)
    rotation.rotate(rotated, ROTATION_SEED)
    exact = evaluate(rotated, ids[: args.positions], reference)
    yield {"model": model_id, "row": "rotation, fp32", **exact, "seconds": 0.0}
    bases = {False: plain, True: rotated}
    # w8a8 rows reuse the 8-bit weights of the 8bit-channel rows (the same rounding).
    rounded = {}
    for row in rows:
        name, _, lever = row.partition(":")
        grid_name = "8bit-channel" if name == "w8a8" else name
        grid = grids()[grid_name]
        rotate, method = lever in ("rotation", "rotation+gptq"), "nearest"
        if lever in ("gptq", "rotation+gptq"):
            method = "gptq"
        start = time.perf_counter()
        ranges = None
        if name == "w8a8":
            ranges = rounding.input_ranges(
                bases[rotate], held, PREFIX, lambda t, m=bases[rotate]: run_tokens(m, t)
            )
        model = rounded.get((grid_name, lever))
        if model is None:
            model = copy.deepcopy(bases[rotate])
            rounding.round_decoder(model, sequences, PREFIX, grid, method)
            if grid_name == "8bit-channel":
                rounded[(grid_name, lever)] = model
        figures = evaluate(model, ids[: args.positions], reference, ranges)
        seconds = time.perf_counter() - start
        yield {"model": model_id, "row": f"{name} {lever}", **figures, "seconds": seconds}
        del model


ALL_ROWS = [
    f"{grid}:{lever}"
    for grid in ("8bit-channel", "4bit-g32", "4bit-g64")
    for lever in ("nearest", "rotation", "gptq", "rotation+gptq")
] + ["w8a8:nearest", "w8a8:rotation", "w8a8:gptq", "w8a8:rotation+gptq"]


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--positions", type=int, default=96)
    parser.add_argument("--models", default="smollm2-135m,smollm2-135m-permuted")
    parser.add_argument("--results", type=Path, default=Path("/tmp/npuforge-bench-quant"))
    parser.add_argument("--rows", default=",".join(ALL_ROWS), help="grid:lever, comma list")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args()
    args.models = args.models.split(",")
    if args.positions < 64:
        raise SystemExit("--positions below 64 is too few for the perplexity gate's figures")
    rows = args.rows.split(",")
    unknown = [r for r in rows if r not in ALL_ROWS]
    if unknown:
        raise SystemExit(f"unknown row {unknown[0]}; rows: {', '.join(ALL_ROWS)}")
    paths = checkpoints(args)
    results = []
    print(f"{'model':24} {'weights / lever':32} {'top-1':>6} {'ppl':>9} {'s':>6}", flush=True)
    for model_id, model_dir in paths.items():
        for line in run_model(model_id, model_dir, args, rows):
            ppl = line["perplexity"]["delta"] * 100
            print(
                f"{line['model']:24} {line['row']:32} {line['top1_agreement']:6.3f} "
                f"{ppl:+8.2f}% {line['seconds']:6.0f}",
                flush=True,
            )
            results.append(line)
    print(f"\n| weights / lever | {' | '.join(args.models)} |")
    print(f"|---|{'---|' * len(args.models)}")
    for row in dict.fromkeys(line["row"] for line in results):
        cells = []
        for model_id in args.models:
            line = next(x for x in results if x["model"] == model_id and x["row"] == row)
            cells.append(
                f"{line['top1_agreement']:.3f} / {line['perplexity']['delta'] * 100:+.2f} %"
            )
        print(f"| {row} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()

"""Capture calibration samples of every graph chunk from real runs (docs/interfaces.md)."""

import argparse
import sys
from pathlib import Path

from npuforge.cli import run_cli


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--export", required=True, type=Path, help="export directory (fp32, decode or prefill)"
    )
    parser.add_argument("--out-dir", required=True, type=Path)
    parser.add_argument("--samples", type=int, default=8, help="input sets per chunk")
    parser.add_argument(
        "--steps",
        type=int,
        default=32,
        help="graph calls per run (at most; a prefill call reads T tokens)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--text", type=Path, help=".txt file or directory (default: data/calibration/text)"
    )
    parser.add_argument(
        "--zero-state",
        action="store_true",
        help="capture at the first call (zero states): for comparison only",
    )
    parser.add_argument(
        "--checkpoint", type=Path, help="the exported checkpoint (its tokenizer for llama)"
    )
    args = parser.parse_args(argv)

    from npuforge.calibration import make_calibration_samples

    make_calibration_samples(
        args.export,
        args.out_dir,
        samples=args.samples,
        steps=args.steps,
        seed=args.seed,
        text=args.text,
        zero_state=args.zero_state,
        checkpoint=args.checkpoint,
    )


if __name__ == "__main__":
    sys.exit(run_cli(main))

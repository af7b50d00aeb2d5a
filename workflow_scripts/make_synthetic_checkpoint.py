"""Write a deterministic synthetic RWKV checkpoint in the official layout."""

import argparse
import sys
from pathlib import Path

from npuforge.cli import run_cli


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--version", type=int, choices=(5, 6, 7), default=7)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embed", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=65536)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=("bf16", "fp32", "fp16"), default="bf16")
    parser.add_argument(
        "--stress", action="store_true", help="activations that overflow fp16 without the fixes"
    )
    parser.add_argument("--format", choices=("pth", "safetensors"), default="pth")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)

    from npuforge.models.rwkv.synthetic import write_synthetic_checkpoint

    write_synthetic_checkpoint(
        args.out,
        version=args.version,
        layers=args.layers,
        embed=args.embed,
        vocab=args.vocab,
        head_size=args.head_size,
        seed=args.seed,
        dtype=args.dtype,
        stress=args.stress,
        fmt=args.format,
    )


if __name__ == "__main__":
    sys.exit(run_cli(main))

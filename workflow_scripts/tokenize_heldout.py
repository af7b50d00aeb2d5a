"""Tokenize the held-out verification text with the model's own tokenizer."""

import argparse
import sys

from npuforge.cli import run_cli
from npuforge.heldout import write


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--family", required=True, help="the model's family (registry)")
    parser.add_argument("--vocab", required=True, type=int, help="the model's vocabulary size")
    parser.add_argument("--checkpoint", help="the checkpoint (its tokenizer, where it has one)")
    parser.add_argument("--out", required=True, help="token file to write (JSON)")
    args = parser.parse_args(argv)
    write(args.family, args.vocab, args.out, args.checkpoint)


if __name__ == "__main__":
    sys.exit(run_cli(main))

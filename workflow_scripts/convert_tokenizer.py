"""Convert the RWKV World vocabulary to the compact binary tokenizer (npuforge.tokenizer),
or with --hf-checkpoint copy a Hugging Face checkpoint's tokenizer.json."""

import argparse
import sys
from pathlib import Path

from npuforge.cli import run_cli


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument(
        "--vocab", type=Path, help="rwkv_vocab_*.txt (default: rwkv_vocab_v20230424 from rwkv)"
    )
    parser.add_argument(
        "--hf-checkpoint", type=Path, help="HF model directory whose tokenizer.json is shipped"
    )
    args = parser.parse_args(argv)

    from npuforge.tokenizer import convert_tokenizer, copy_hf_tokenizer

    if args.hf_checkpoint:
        copy_hf_tokenizer(args.hf_checkpoint, args.out)
    else:
        convert_tokenizer(args.out, args.vocab)


if __name__ == "__main__":
    sys.exit(run_cli(main))

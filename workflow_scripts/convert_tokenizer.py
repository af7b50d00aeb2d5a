"""Convert the RWKV World vocabulary to the compact binary tokenizer (npuforge.tokenizer)."""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from npuforge.cli import run_cli  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument(
        "--vocab", type=Path, help="rwkv_vocab_*.txt (default: rwkv_vocab_v20230424 from rwkv)"
    )
    args = parser.parse_args(argv)

    from npuforge.tokenizer import convert_tokenizer

    convert_tokenizer(args.out, args.vocab)


if __name__ == "__main__":
    sys.exit(run_cli(main))

"""Write the permuted twin of a Llama-family model directory (a test fixture of
quantization: the same function, its weights on no grid) and its record."""

import argparse
import sys
from pathlib import Path

from npuforge.cli import run_cli


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--checkpoint", required=True, type=Path, help="model directory")
    parser.add_argument("--source", required=True, help="the registry's source entry, JSON")
    parser.add_argument("--sha256", default="", help="the registry's pin of the twin, if any")
    parser.add_argument("--out", required=True, type=Path, help="twin model directory")
    parser.add_argument("--record", required=True, type=Path, help="its record (JSON)")
    args = parser.parse_args(argv)

    import json

    from npuforge.models.llama.permute import write_twin

    write_twin(args.checkpoint, json.loads(args.source), args.sha256 or None, args.out, args.record)


if __name__ == "__main__":
    sys.exit(run_cli(main))

"""Detect an RWKV checkpoint's version and dimensions; write them as JSON."""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from npuforge.cli import run_cli  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--checkpoint", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path, help="info.json")
    args = parser.parse_args(argv)

    from npuforge.checkpoint import inspect_checkpoint
    from npuforge.fileio import write_json

    write_json(args.out, inspect_checkpoint(args.checkpoint))


if __name__ == "__main__":
    sys.exit(run_cli(main))

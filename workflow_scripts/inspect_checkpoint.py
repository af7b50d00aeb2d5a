"""Detect a checkpoint's family version and dimensions, check them against the registry's
arch, and write them as JSON."""

import argparse
import sys
from pathlib import Path

from npuforge.cli import run_cli


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--checkpoint", required=True, type=Path)
    parser.add_argument("--family", required=True, help="the model's family (registry)")
    parser.add_argument("--model", default="the model", help="model id, for messages")
    parser.add_argument("--arch", default="{}", help="the registry's arch mapping, JSON")
    parser.add_argument("--out", required=True, type=Path, help="info.json")
    args = parser.parse_args(argv)

    import json

    from npuforge.checkpoint import inspect_checkpoint
    from npuforge.fileio import write_json
    from npuforge.provenance import check_arch

    info = inspect_checkpoint(args.checkpoint, args.family)
    check_arch(args.model, json.loads(args.arch), info)
    write_json(args.out, info)


if __name__ == "__main__":
    sys.exit(run_cli(main))

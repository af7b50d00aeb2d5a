"""Fetch a model checkpoint from its registered source and check its sha256."""

import argparse
import json
import sys

from npuforge.cli import run_cli
from npuforge.errors import NpuforgeError
from npuforge.fetch import fetch


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--source", required=True, help="the model's source mapping as JSON (hf, path or synthetic)"
    )
    parser.add_argument("--sha256", default="", help="expected sha256 (empty: record, not check)")
    parser.add_argument("--out", required=True, help="checkpoint file to write")
    parser.add_argument("--record", required=True, help="provenance JSON to write")
    parser.add_argument(
        "--family", default="rwkv", help="the model's family (makes synthetic checkpoints)"
    )
    args = parser.parse_args(argv)
    try:
        source = json.loads(args.source)
    except json.JSONDecodeError as err:
        raise NpuforgeError(f"--source is not valid JSON ({err}); pass a mapping") from err
    fetch(source, args.sha256 or None, args.out, args.record, args.family)


if __name__ == "__main__":
    sys.exit(run_cli(main))

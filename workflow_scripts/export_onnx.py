"""Export a checkpoint to chunked ONNX graphs plus export.json (docs/interfaces.md)."""

import argparse
import json
import sys
from pathlib import Path

from npuforge.cli import run_cli
from npuforge.errors import NpuforgeError


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--checkpoint", required=True, type=Path, help="the fetched checkpoint")
    parser.add_argument("--out-dir", required=True, type=Path)
    parser.add_argument(
        "--options",
        required=True,
        help='the export options as JSON, as npuforge.matrix plans them: {"family": "rwkv", '
        '"variant": "decode", "dtype": "fp32", "chunks": 1, ...}',
    )
    args = parser.parse_args(argv)
    try:
        options = json.loads(args.options)
    except json.JSONDecodeError as err:
        raise NpuforgeError(f"--options is not JSON ({err.msg}); pass a JSON object") from None
    if not isinstance(options, dict) or "family" not in options:
        raise NpuforgeError('--options must be a JSON object naming the "family"')

    from npuforge import models

    family = options.pop("family")
    models.export(family, args.checkpoint, args.out_dir, options)


if __name__ == "__main__":
    sys.exit(run_cli(main))

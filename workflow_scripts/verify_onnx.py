"""Run exported graphs over a token sequence and compare them with a reference (JSON report)."""

import argparse
import sys
from pathlib import Path

from npuforge.cli import run_cli


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--export",
        action="append",
        required=True,
        type=Path,
        help="decode export dir; a second --export (prefill) adds prefill_vs_decode",
    )
    parser.add_argument("--checkpoint", type=Path, help="needed for --reference auto")
    parser.add_argument("--tokens", type=int, default=64, help="steps to run")
    parser.add_argument(
        "--reference",
        default="auto",
        help="auto (= rwkv: the family's reference implementation) | onnx-fp32:DIR",
    )
    parser.add_argument("--out", required=True, type=Path, help="report.json")
    args = parser.parse_args(argv)

    from npuforge.fileio import write_json
    from npuforge.verify import verify_export

    report = verify_export(args.export, args.checkpoint, args.tokens, args.reference)
    write_json(args.out, report)


if __name__ == "__main__":
    sys.exit(run_cli(main))

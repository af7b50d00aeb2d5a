"""Dequantize a GGUF checkpoint into a Hugging Face model directory (float32) for export."""

import argparse
import shutil
import sys
from pathlib import Path

from npuforge.cli import run_cli
from npuforge.fileio import write_json
from npuforge.gguf import dequantize


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gguf", required=True, type=Path, help="the fetched checkpoint.gguf")
    parser.add_argument("--out", required=True, type=Path, help="model directory to write")
    parser.add_argument("--record", required=True, type=Path, help="gguf.json copy beside it")
    args = parser.parse_args(argv)
    record = dequantize(args.gguf, args.out)
    try:
        write_json(args.record, record)
    except BaseException:
        shutil.rmtree(args.out, ignore_errors=True)
        raise


if __name__ == "__main__":
    sys.exit(run_cli(main))

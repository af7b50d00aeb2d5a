"""Build (or reuse) a vendor toolchain environment and write its stamp JSON."""

import argparse
import json
import sys

from npuforge import toolchain
from npuforge.cli import run_cli


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", required=True, help="rknn, qnn, tpumlir, ...")
    parser.add_argument("--runtime", required=True, choices=toolchain.RUNTIMES)
    parser.add_argument(
        "--target-options", help="a target's options as JSON (default: the backend's defaults)"
    )
    parser.add_argument("--out", required=True, help="stamp JSON to write")
    parser.add_argument("--log", help="build log (default: next to the stamp)")
    args = parser.parse_args(argv)
    toolchain.prepare(
        args.backend,
        args.runtime,
        args.out,
        target_options=json.loads(args.target_options) if args.target_options else None,
        log_path=args.log,
    )


if __name__ == "__main__":
    sys.exit(run_cli(main))

"""Compile a decode export to .rknn per chunk for a Rockchip SoC, verified on the simulator."""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from npuforge.backends.rknn import PRECISIONS, compile_rknn  # noqa: E402
from npuforge.cli import run_cli  # noqa: E402
from npuforge.errors import NpuforgeError  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--export", action="append", required=True, help="decode export directory")
    parser.add_argument("--calibration", help="calibration directory (quantized precisions)")
    parser.add_argument("--target", required=True, help="SoC id from targets.yaml, e.g. RK3588")
    parser.add_argument(
        "--target-options", default="{}", help="the target's options from targets.yaml as JSON"
    )
    parser.add_argument("--precision", required=True, choices=PRECISIONS)
    parser.add_argument("--toolchain", help="toolchain stamp JSON (prepare_toolchain.py)")
    parser.add_argument("--out-dir", required=True, help="directory to write")
    parser.add_argument("--log", help="append the toolchain job's output here")
    args = parser.parse_args(argv)
    try:
        options = json.loads(args.target_options)
    except json.JSONDecodeError as err:
        raise NpuforgeError(
            f"--target-options is not JSON ({err.msg}); pass a JSON object"
        ) from None
    compile_rknn(
        args.export,
        args.calibration,
        args.target,
        options,
        args.precision,
        args.toolchain,
        args.out_dir,
        log_path=args.log,
    )


if __name__ == "__main__":
    sys.exit(run_cli(main))

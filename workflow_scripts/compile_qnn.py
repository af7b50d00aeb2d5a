"""Compile graph chunks into Qualcomm QNN HTP context binaries for one SoC and precision.

Writes per chunk <chunk>_ctx_qnn.bin + its _ctx.onnx, and compile.json (QAIRT
version, host-simulator figures, options) into --out-dir.
"""

import argparse
import json
import sys

from npuforge.backends.qnn import PRECISIONS, compile_qnn
from npuforge.cli import run_cli
from npuforge.errors import NpuforgeError


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--export",
        action="append",
        required=True,
        help="export directory (decode; a prefill export joins its context); repeatable",
    )
    parser.add_argument("--calibration", help="calibration directory (quantized precisions)")
    parser.add_argument("--target", required=True, help="SoC id from targets.yaml, e.g. SM8650")
    parser.add_argument(
        "--target-options", default="{}", help="the target's options from targets.yaml as JSON"
    )
    parser.add_argument("--precision", required=True, choices=PRECISIONS)
    parser.add_argument("--toolchain", help="toolchain stamp JSON (EP route)")
    parser.add_argument("--out-dir", required=True, help="directory to write")
    parser.add_argument("--log", help="append the toolchain job's output here")
    args = parser.parse_args(argv)
    try:
        options = json.loads(args.target_options)
    except json.JSONDecodeError as err:
        raise NpuforgeError(
            f"--target-options is not JSON ({err.msg}); pass a JSON object"
        ) from None
    compile_qnn(
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

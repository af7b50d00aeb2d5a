"""The onnx reference target: ship the fp32 graphs, verified against the reference model."""

import argparse
import json
import sys

from npuforge.backends.onnx import PRECISIONS, compile_reference
from npuforge.cli import run_cli
from npuforge.errors import NpuforgeError


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--export", action="append", required=True, help="decode export dir")
    parser.add_argument("--checkpoint", required=True, help="the fetched checkpoint (reference)")
    parser.add_argument("--target", required=True, help="target id, e.g. onnx")
    parser.add_argument("--target-options", default="{}", help="the target's options as JSON")
    parser.add_argument("--precision", required=True, choices=PRECISIONS)
    parser.add_argument("--calibration", help="ignored: the reference is not quantized")
    parser.add_argument("--toolchain", help="ignored: onnxruntime of the main environment")
    parser.add_argument("--out-dir", required=True, help="directory to write")
    args = parser.parse_args(argv)
    try:
        options = json.loads(args.target_options)
    except json.JSONDecodeError as err:
        raise NpuforgeError(f"--target-options is not valid JSON ({err})") from err
    compile_reference(
        exports=args.export,
        checkpoint=args.checkpoint,
        target=args.target,
        target_options=options,
        precision=args.precision,
        out_dir=args.out_dir,
    )


if __name__ == "__main__":
    sys.exit(run_cli(main))

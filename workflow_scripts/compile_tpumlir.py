"""Compile decode + prefill ONNX exports into one Sophgo bmodel with TPU-MLIR."""

import argparse
import json
import sys

from npuforge.backends import tpumlir
from npuforge.cli import run_cli
from npuforge.errors import NpuforgeError


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--export", action="append", required=True, help="export dir (decode, and prefill)"
    )
    parser.add_argument("--calibration", help="calibration dir (int8 only)")
    parser.add_argument("--target", required=True, help="target id, e.g. BM1684X")
    parser.add_argument("--target-options", default="{}", help="JSON options from targets.yaml")
    parser.add_argument("--precision", required=True, help="f16, bf16, w8f16, w4f16 or int8")
    parser.add_argument("--precisions", help="comma list the target supports (refuses others)")
    parser.add_argument("--toolchain", required=True, help="toolchain stamp JSON")
    parser.add_argument(
        "--state", action="append", default=[], help="RWKV state file (.pth) shipped beside"
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out-dir", required=True)
    args = parser.parse_args(argv)
    try:
        options = json.loads(args.target_options)
    except json.JSONDecodeError as err:
        raise NpuforgeError(f"--target-options is not JSON ({err}): pass a JSON object") from None
    tpumlir.compile_bmodel(
        exports=args.export,
        calibration=args.calibration,
        target=args.target,
        target_options=options,
        precision=args.precision,
        supported=args.precisions.split(",") if args.precisions else None,
        stamp_path=args.toolchain,
        state_files=args.state,
        threads=args.threads,
        out_dir=args.out_dir,
    )


if __name__ == "__main__":
    sys.exit(run_cli(main))

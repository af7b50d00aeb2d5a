"""Compile decode + prefill ONNX exports into one Sophgo bmodel with TPU-MLIR."""

import sys

from npuforge.backends import tpumlir
from npuforge.cli import compile_argument_parser, run_cli, target_options


def main(argv=None):
    parser = compile_argument_parser(__doc__)
    parser.add_argument("--precisions", help="comma list the target supports (refuses others)")
    parser.add_argument(
        "--state", action="append", default=[], help="RWKV state file (.pth) shipped beside"
    )
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if not args.toolchain:
        parser.error("--toolchain is required: TPU-MLIR runs in its own environment")
    tpumlir.compile_bmodel(
        exports=args.export,
        calibration=args.calibration,
        target=args.target,
        target_options=target_options(args),
        precision=args.precision,
        supported=args.precisions.split(",") if args.precisions else None,
        stamp_path=args.toolchain,
        state_files=args.state,
        threads=args.threads,
        out_dir=args.out_dir,
    )


if __name__ == "__main__":
    sys.exit(run_cli(main))

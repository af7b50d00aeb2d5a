"""Compile a decode export to .rknn per chunk for a Rockchip SoC, verified on the simulator."""

import sys

from npuforge.backends.rknn import PRECISIONS, compile_rknn
from npuforge.calibration import calibrations_by_variant
from npuforge.cli import compile_argument_parser, run_cli, target_options


def main(argv=None):
    args = compile_argument_parser(__doc__, PRECISIONS).parse_args(argv)
    compile_rknn(
        args.export,
        calibrations_by_variant(args.calibration).get("decode"),
        args.target,
        target_options(args),
        args.precision,
        args.toolchain,
        args.out_dir,
        log_path=args.log,
    )


if __name__ == "__main__":
    sys.exit(run_cli(main))

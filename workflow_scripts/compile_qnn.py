"""Compile graph chunks into Qualcomm QNN HTP context binaries for one SoC and precision.

Writes per chunk <chunk>_ctx_qnn.bin + its _ctx.onnx, and compile.json (QAIRT
version, host-simulator figures, options) into --out-dir. A prefill export given
after the decode export joins its context.
"""

import sys

from npuforge.backends.qnn import PRECISIONS, compile_qnn
from npuforge.cli import compile_argument_parser, run_cli, target_options


def main(argv=None):
    args = compile_argument_parser(__doc__, PRECISIONS).parse_args(argv)
    compile_qnn(
        args.export,
        args.calibration,
        args.target,
        target_options(args),
        args.precision,
        args.toolchain,
        args.out_dir,
        log_path=args.log,
    )


if __name__ == "__main__":
    sys.exit(run_cli(main))

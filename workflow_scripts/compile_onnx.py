"""The onnx reference target: ship the fp32 graphs, verified against the reference model.

--calibration and --toolchain are accepted and ignored: the reference is not
quantized and runs on the main environment's onnxruntime.
"""

import sys

from npuforge.backends.onnx import PRECISIONS, compile_reference
from npuforge.cli import compile_argument_parser, run_cli, target_options


def main(argv=None):
    parser = compile_argument_parser(__doc__, PRECISIONS)
    parser.add_argument("--checkpoint", required=True, help="the fetched checkpoint (reference)")
    args = parser.parse_args(argv)
    compile_reference(
        exports=args.export,
        checkpoint=args.checkpoint,
        target=args.target,
        target_options=target_options(args),
        precision=args.precision,
        out_dir=args.out_dir,
    )


if __name__ == "__main__":
    sys.exit(run_cli(main))

"""Compile export graphs for one target and precision with its vendor backend, verify the
binaries on the vendor's simulator against onnxruntime fp32, and write compile.json."""

import sys

from npuforge import backends
from npuforge.backends.base import CompileRequest
from npuforge.cli import compile_argument_parser, run_cli, target_options


def main(argv=None):
    args = compile_argument_parser(__doc__).parse_args(argv)
    backend = backends.get(args.backend)
    request = CompileRequest(
        exports=args.export,
        calibrations=args.calibration,
        target=args.target,
        options=backends.options_of(args.backend, target_options(args), args.target),
        precision=args.precision,
        toolchain=args.toolchain,
        heldout=args.heldout,
        checkpoint=args.checkpoint,
        state_files=args.state,
        out_dir=args.out_dir,
        log_path=args.log,
        weights=args.weights,
        threads=args.threads,
    )
    backend.compile(request)


if __name__ == "__main__":
    sys.exit(run_cli(main))

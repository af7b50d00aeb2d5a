"""Compile export graphs for one target and precision with its vendor backend, verify the
binaries on the vendor's simulator against onnxruntime fp32, and write compile.json."""

import argparse
import json
import sys

from npuforge import backends
from npuforge.backends.base import WEIGHTS, CompileRequest
from npuforge.cli import run_cli
from npuforge.errors import NpuforgeError


def argument_parser():
    """The arguments of this step (docs/interfaces.md)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", required=True, help="onnx, qnn, rknn or tpumlir")
    parser.add_argument(
        "--export", action="append", required=True, help="export directory; repeatable"
    )
    parser.add_argument(
        "--calibration",
        action="append",
        default=[],
        help="calibration directory of one --export (quantized precisions); repeatable, "
        "paired with the exports by the variant its calibration.json records",
    )
    parser.add_argument(
        "--reference-export",
        action="append",
        default=[],
        help="export directory of the same graphs before rounding at export (GPTQ), one per "
        "--export: the simulator's figures are measured against it; repeatable",
    )
    parser.add_argument("--target", required=True, help="target id from targets.yaml")
    parser.add_argument(
        "--target-options", default="{}", help="the target's options from targets.yaml as JSON"
    )
    parser.add_argument("--precision", required=True)
    parser.add_argument("--toolchain", help="toolchain stamp JSON (prepare_toolchain.py)")
    parser.add_argument("--heldout", help="the model's held-out token file (verification text)")
    parser.add_argument("--checkpoint", help="the fetched checkpoint (the onnx reference target)")
    parser.add_argument(
        "--state", action="append", default=[], help="RWKV state file shipped beside (tpumlir)"
    )
    parser.add_argument(
        "--weights",
        choices=WEIGHTS,
        default="trained",
        help="the checkpoint's weights: trained, or synthetic (random); chooses the floors",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU cores the step may use (tpumlir: nets compiled side by side); "
        "the bytes do not depend on it",
    )
    parser.add_argument(
        "--only-chunk",
        type=int,
        help="build only this chunk's graphs and keep them in --out-dir for the compile "
        "(tpumlir, qnn on its ep route: the workflow's chunk jobs)",
    )
    parser.add_argument(
        "--chunk-build",
        action="append",
        default=[],
        help="a --only-chunk job's output: its graphs are taken back, not built; repeatable",
    )
    parser.add_argument("--out-dir", required=True, help="directory to write")
    parser.add_argument("--log", help="append the toolchain job's output here")
    return parser


def target_options(args) -> dict:
    """``--target-options`` as a dict, or a one-line error."""
    try:
        options = json.loads(args.target_options)
    except json.JSONDecodeError as err:
        raise NpuforgeError(
            f"--target-options is not JSON ({err.msg}); pass a JSON object"
        ) from None
    if not isinstance(options, dict):
        raise NpuforgeError("--target-options must be a JSON object")
    return options


def main(argv=None):
    args = argument_parser().parse_args(argv)
    backend = backends.get(args.backend)
    by_chunk = getattr(backend, "compiles_by_chunk", None)
    if (args.only_chunk is not None or args.chunk_build) and not (
        by_chunk and by_chunk(target_options(args))
    ):
        raise NpuforgeError(
            f"the {args.backend} backend compiles every chunk in one job: drop --only-chunk "
            "and --chunk-build"
        )
    request = CompileRequest(
        exports=args.export,
        calibrations=args.calibration,
        references=args.reference_export,
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
        only_chunk=args.only_chunk,
        chunk_builds=args.chunk_build,
    )
    backend.compile(request)


if __name__ == "__main__":
    sys.exit(run_cli(main))

"""Shared plumbing for the step CLIs in workflow_scripts/."""

import sys

from npuforge.errors import NpuforgeError


def run_cli(main, argv=None) -> int:
    """Run ``main(argv)``; turn an NpuforgeError into one line on stderr and exit 2."""
    try:
        main(argv)
    except NpuforgeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def compile_argument_parser(description: str, precisions=None):
    """The arguments every compile_<backend>.py takes (docs/interfaces.md); add your own after."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--export", action="append", required=True, help="export directory; repeatable"
    )
    parser.add_argument(
        "--calibration",
        action="append",
        help="calibration directory of one --export (quantized precisions); repeatable, "
        "paired with the exports by the variant its calibration.json records",
    )
    parser.add_argument("--target", required=True, help="target id from targets.yaml")
    parser.add_argument(
        "--target-options", default="{}", help="the target's options from targets.yaml as JSON"
    )
    parser.add_argument("--precision", required=True, choices=precisions)
    parser.add_argument("--toolchain", help="toolchain stamp JSON (prepare_toolchain.py)")
    parser.add_argument("--out-dir", required=True, help="directory to write")
    parser.add_argument("--log", help="append the toolchain job's output here")
    return parser


def target_options(args) -> dict:
    """``--target-options`` as a dict, or a one-line error."""
    import json

    try:
        options = json.loads(args.target_options)
    except json.JSONDecodeError as err:
        raise NpuforgeError(
            f"--target-options is not JSON ({err.msg}); pass a JSON object"
        ) from None
    if not isinstance(options, dict):
        raise NpuforgeError("--target-options must be a JSON object")
    return options

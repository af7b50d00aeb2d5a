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

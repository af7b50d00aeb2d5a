"""``npuforge`` / ``python -m npuforge``: small commands around the workflow.

npuforge doctor [--runtime native|podman|docker] [--json]
"""

import argparse
import json
import sys

from npuforge.cli import run_cli


def _doctor(args) -> None:
    from npuforge import doctor

    rows = doctor.report(runtime=args.runtime, results_dir=args.results)
    print(json.dumps(rows, indent=2, sort_keys=True) if args.json else doctor.format_rows(rows))


def _main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="npuforge", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    doctor = commands.add_parser("doctor", help="list each backend's toolchain: found, version")
    doctor.add_argument(
        "--runtime",
        choices=("native", "podman", "docker"),
        help="toolchain runtime to check (default: config/config.yaml)",
    )
    doctor.add_argument("--results", help="results directory holding toolchains/ stamps")
    doctor.add_argument("--json", action="store_true", help="print JSON rows")
    doctor.set_defaults(run=_doctor)
    args = parser.parse_args(argv)
    args.run(args)


def main(argv=None) -> int:
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())

"""``npuforge`` / ``python -m npuforge``: small commands around the workflow.

npuforge doctor [--runtime native|podman|docker] [--json]
npuforge prepare BACKEND RUNTIME [--results DIR]
"""

import argparse
import json
import sys

from npuforge.cli import run_cli


def _doctor(args) -> None:
    from npuforge import doctor

    rows = doctor.report(runtime=args.runtime, results_dir=args.results)
    print(json.dumps(rows, indent=2, sort_keys=True) if args.json else doctor.format_rows(rows))


def _prepare(args) -> None:
    from pathlib import Path

    from npuforge import doctor, toolchain
    from npuforge.errors import NpuforgeError

    options = doctor.target_options(args.backend)
    reason = toolchain.unavailable_reason(args.backend, args.runtime, options)
    if reason:
        raise NpuforgeError(
            f"toolchain {args.backend} ({args.runtime}) cannot be built here: {reason}"
        )
    stamp = Path(args.results) / "toolchains" / f"{args.backend}-{args.runtime}.json"
    toolchain.prepare(args.backend, args.runtime, stamp, target_options=options)
    print(f"{args.backend} ({args.runtime}) ready: {stamp}")


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
    prepare = commands.add_parser(
        "prepare",
        help="build (or check) one backend's toolchain from its lock, as the workflow's "
        "prepare_toolchain rule does, and write its stamp",
    )
    prepare.add_argument("backend", help="rknn, qnn, tpumlir, ... (a directory of envs/)")
    prepare.add_argument("runtime", choices=("native", "podman", "docker"))
    prepare.add_argument("--results", default="results", help="results directory for the stamp")
    prepare.set_defaults(run=_prepare)
    args = parser.parse_args(argv)
    args.run(args)


def main(argv=None) -> int:
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())

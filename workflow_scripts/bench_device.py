"""Benchmark a release bundle on a device over adb: push, run its run.py, pull the report."""

import argparse
import sys

from npuforge.bench import REMOTE_ROOT, bench_device
from npuforge.cli import run_cli


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", required=True, help="adb:SERIAL")
    parser.add_argument("--bundle", required=True, help="release bundle directory")
    parser.add_argument("--out", required=True, help="benchmark JSON to write")
    parser.add_argument("--prompt", required=True, help="prompt text")
    parser.add_argument("--max-new-tokens", type=int, required=True)
    parser.add_argument("--python", default="python3", help="the device's Python")
    parser.add_argument("--remote-root", default=REMOTE_ROOT, help="where bundles go on it")
    args = parser.parse_args(argv)
    bench_device(
        device=args.device,
        bundle=args.bundle,
        out=args.out,
        prompt=args.prompt,
        max_new_tokens=args.max_new_tokens,
        python=args.python,
        root=args.remote_root,
    )


if __name__ == "__main__":
    sys.exit(run_cli(main))

"""Index every release bundle under a release directory (index.json, one row per bundle)."""

import argparse
import sys
from pathlib import Path

from npuforge.cli import run_cli


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--release-dir", required=True, type=Path, help="results/release")
    parser.add_argument("--out", required=True, type=Path, help="index.json")
    args = parser.parse_args(argv)

    from npuforge.release_index import write_index

    index = write_index(args.release_dir, args.out)
    print(f"indexed {len(index['bundles'])} bundles in {args.out}")


if __name__ == "__main__":
    sys.exit(run_cli(main))

"""The report's parts from the release index: the bundle table (HTML) and two plots (PNG)."""

import argparse
import sys
from pathlib import Path

from npuforge.cli import run_cli


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--index", required=True, type=Path, help="results/release/index.json")
    parser.add_argument(
        "--benchmarks",
        required=True,
        type=Path,
        help="Snakemake benchmark records (results/benchmarks)",
    )
    parser.add_argument("--table", required=True, type=Path, help="bundles.html")
    parser.add_argument("--fidelity-plot", required=True, type=Path, help="fidelity.png")
    parser.add_argument("--size-plot", required=True, type=Path, help="size.png")
    args = parser.parse_args(argv)

    from npuforge.release_index import write_report_parts

    write_report_parts(args.index, args.benchmarks, args.table, args.fidelity_plot, args.size_plot)


if __name__ == "__main__":
    sys.exit(run_cli(main))

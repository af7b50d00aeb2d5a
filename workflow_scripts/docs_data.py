"""Measured figures as data: record a release index's builds, regenerate the docs' tables.

python workflow_scripts/docs_data.py           # rewrite the tables from docs/data
python workflow_scripts/docs_data.py --check   # exit 2 naming the pages that are stale
python workflow_scripts/docs_data.py --index results/release/index.json  # record first
"""

import argparse
import sys
from pathlib import Path

from npuforge.cli import run_cli

CHECKOUT = Path(__file__).resolve().parents[1]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=CHECKOUT, help="the checkout (its docs)")
    parser.add_argument("--index", type=Path, help="a release index whose builds to record")
    parser.add_argument("--out", type=Path, help="JSON: the rows added and pages rewritten")
    parser.add_argument("--check", action="store_true", help="only say which pages are stale")
    args = parser.parse_args(argv)

    from npuforge import docs_tables, measurements
    from npuforge.errors import NpuforgeError
    from npuforge.fileio import atomic_path

    if args.check:
        stale = docs_tables.stale_pages(args.root)
        if stale:
            names = ", ".join(str(p.relative_to(args.root)) for p in stale)
            raise NpuforgeError(
                f"generated tables differ from docs/data in {names}; run "
                f"python workflow_scripts/docs_data.py"
            )
        return
    added = []
    if args.index:
        added = measurements.record_index(args.index, args.root / measurements.BUILDS)
    changed = docs_tables.regenerate(args.root)
    summary = docs_tables.summary(added, changed, args.root)
    print(summary)
    if args.out:
        with atomic_path(args.out) as tmp:
            Path(tmp).write_text(summary + "\n", encoding="utf-8")


if __name__ == "__main__":
    sys.exit(run_cli(main))

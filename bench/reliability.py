"""Reliability figures: kill-and-resume trials and the bad-input table.

    python bench/reliability.py                 # 12 onnx + 8 RK3588 kill trials, bad inputs
    python bench/reliability.py --onnx 18 --rknn 2   # N = 20 with two vendor builds
    python bench/reliability.py --onnx 4 --rknn 0

Each trial SIGKILLs a whole build (rwkv7-tiny) at a seeded random moment, runs
``snakemake --unlock`` and the same command again, and compares every release
file with a clean build (tests/crash_trials.py). The bad inputs are the cases of
tests/test_bad_inputs.py (found while planning, and found by jobs: hostile checkpoints,
the hub offline, a full disk, a file size limit, a crashing or out-of-memory vendor
compiler), each required to stop with a non-zero exit, npuforge's line first (problem and
fix, no traceback) and nothing under results/ that a later run would trust.
"""

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--onnx", type=int, default=12, help="kill trials of the onnx build")
    parser.add_argument("--rknn", type=int, default=8, help="kill trials of the RK3588 build")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from crash_trials import run_trials

    trials = []
    with tempfile.TemporaryDirectory(prefix="npuforge-reliability-") as tmp:
        for target, count in (("onnx", args.onnx), ("RK3588", args.rknn)):
            if count:
                config = ["model=rwkv7-tiny", f"target={target}"]
                trials += run_trials(Path(tmp) / target, config, count, args.seed)
    print(f"{'target':8} {'kill at s':>9}  {'killed in':14} resumed  identical  leftovers")
    for t in trials:
        print(f"{t.target:8} {t.kill_at:9.2f}  {t.stage:14} {str(t.resumed):7}  "
              f"{str(t.identical):9}  {len(t.leftovers)}")  # fmt: skip

    bad = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         str(ROOT / "tests" / "test_bad_inputs.py")],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    tail = bad.stdout.strip().splitlines()[-1] if bad.stdout.strip() else bad.stderr
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", tail)}
    tried = sum(counts.values())
    print()
    survived = sum(t.resumed for t in trials)
    rows = [
        ("faults injected (SIGKILL of the whole build)", len(trials)),
        ("survived (the same command completed)", survived),
        ("release bytes identical to a clean build", sum(t.identical for t in trials)),
        ("leftover temporaries found after resuming", sum(len(t.leftovers) for t in trials)),
        ("bad inputs tried", tried),
        ("clean one-line errors, nothing left to trust", counts.get("passed", 0)),
        ("bad inputs not run here (skipped)", counts.get("skipped", 0)),
        ("bad inputs failing their checks", counts.get("failed", 0) + counts.get("error", 0)),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:{width}}  {value:>4}")


if __name__ == "__main__":
    main()

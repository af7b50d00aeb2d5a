"""Reliability figures: kill-and-resume trials and the bad-input table.

    python bench/reliability.py          # 20 onnx + 20 RK3588 + 6 hf-download kill trials
    python bench/reliability.py --onnx 4 --rknn 0 --hf 2

Each trial SIGKILLs a whole build (rwkv7-tiny) at a seeded random moment, runs
``snakemake --unlock`` and the same command again, and compares every release
file with a clean build (tests/crash_trials.py). The hf trials download the
checkpoint from a slow loopback Hugging Face hub and are killed inside the download.
The bad inputs are the cases of tests/test_bad_inputs.py (found while planning,
and found by jobs: hostile checkpoints, the hub offline, a full disk, a file size
limit, a crashing or out-of-memory vendor compiler), each required to stop with a
non-zero exit, npuforge's line first (problem and fix, no traceback) and nothing
under results/ that a later run would trust.
"""

import argparse
import hashlib
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]


def report(trial):
    """One line per trial, as soon as it is done."""
    differs = f"  differs: {', '.join(trial.differs)}" if trial.differs else ""
    print(f"{trial.target:8} {trial.kill_at:9.2f}  {trial.stage:22} {str(trial.resumed):7}  "
          f"{str(trial.identical):9}  {len(trial.leftovers)}{differs}", flush=True)  # fmt: skip


def checkout_digest() -> str:
    """sha256 over every file the trials copy or import from this checkout: every trial
    copies the workflow from here and imports npuforge from here, so an edit during a run
    would mix two versions of the code into one set of figures."""
    from conftest import WORKFLOW_PARTS

    digest = hashlib.sha256()
    for part in sorted({*WORKFLOW_PARTS, "npuforge", "tests"}):
        root = ROOT / part
        for path in sorted(root.rglob("*") if root.is_dir() else [root]):
            if path.is_file() and "__pycache__" not in path.parts:
                digest.update(f"{path.relative_to(ROOT)}\0".encode() + path.read_bytes())
    return digest.hexdigest()


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--onnx", type=int, default=20, help="kill trials of the onnx build")
    parser.add_argument("--rknn", type=int, default=20, help="kill trials of the RK3588 build")
    parser.add_argument("--hf", type=int, default=6, help="kills inside an hf download (onnx)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", type=Path, help="run the trials here and keep this directory")
    args = parser.parse_args()

    from crash_trials import run_fetch_trials, run_trials

    before = checkout_digest()
    trials = []
    print(f"{'target':8} {'kill at s':>9}  {'killed in':22} resumed  identical  leftovers")
    with tempfile.TemporaryDirectory(prefix="npuforge-reliability-") as scratch:
        tmp = args.keep or scratch
        for target, count in (("onnx", args.onnx), ("RK3588", args.rknn)):
            if count:
                config = ["model=rwkv7-tiny", f"target={target}"]
                trials += run_trials(Path(tmp) / target, config, count, args.seed, report)
        if args.hf:
            trials += run_fetch_trials(Path(tmp) / "hf", args.hf, args.seed, on_trial=report)

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
        (
            "partial downloads left in the HF cache (never read)",
            sum(len(t.partial_downloads) for t in trials),
        ),  # fmt: skip
        ("bad inputs tried", tried),
        ("clean one-line errors, nothing left to trust", counts.get("passed", 0)),
        ("bad inputs not run here (skipped)", counts.get("skipped", 0)),
        ("bad inputs failing their checks", counts.get("failed", 0) + counts.get("error", 0)),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:{width}}  {value:>4}")
    if checkout_digest() != before:
        sys.exit(
            f"error: files of {ROOT} changed during the run, so the trials mixed two versions "
            "of the code: these figures are void; run it from a clone nobody edits"
        )


if __name__ == "__main__":
    main()

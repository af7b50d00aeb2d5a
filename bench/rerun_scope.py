"""What a code edit replans: the jobs a dry run plans after an edit to one file, per rule.

    python bench/rerun_scope.py [--checkout DIR] [--models ...] [--edit FILE ...]

A scratch copy of the workflow in ``--checkout`` (default: this one) plans the whole
matrix of ``--models`` over every target and precision, vendor targets included, with
toolchain_runtime native. No toolchain runs: the checkpoints are fetched for real (the
pins are checked while planning), every other output of the plan is an empty
placeholder, and ``snakemake --touch --forceall`` then records each job as done, with
the params (and code digests) it has now. So a dry run after an edit plans what a real build would
rerun: a job whose code digest changed, and everything downstream of it. Each edit
appends a comment to the file and is undone after its dry run.

Run it on a checkout of the commit before step code digests (``git worktree add`` or
``git archive``) and on this one to compare before and after.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from npuforge.cache import CACHE_ENV  # noqa: E402

PARTS = ("Snakefile", "config", "rules", "profiles", "envs", "workflow_scripts", "npuforge",
         "data", "report")  # fmt: skip
EDITS = ("npuforge/jobs/qnn_job.py", "npuforge/models/llama/model.py", "npuforge/fetch.py")
# Rules whose (first) output is a directory (rules/*.smk: directory(...)).
DIRECTORY_RULES = {"fetch_tree", "dequantize", "export", "calibrate", "compile"}


def snakemake(workdir: Path, *args) -> str:
    env = dict(os.environ, PYTHONPATH=str(workdir))
    # The machine cache of this scratch copy only (smollm2-135m's wheel lands there).
    env[CACHE_ENV] = str(workdir / "cache")
    run = subprocess.run(
        [sys.executable, "-m", "snakemake", "--cores", "2", *args],
        cwd=workdir,
        capture_output=True,
        text=True,
        env=env,
    )
    if run.returncode:
        sys.exit(f"snakemake {' '.join(args)} failed:\n{run.stdout[-3000:]}{run.stderr[-3000:]}")
    return run.stdout + run.stderr


def planned(output: str) -> list[tuple[str, list[str]]]:
    """(rule, outputs) of each job of a dry run."""
    jobs = []
    for block in re.split(r"\n(?=(?:local)?rule \w+:\n)", output)[1:]:
        rule = re.match(r"(?:local)?rule (\w+):", block).group(1)
        found = re.search(r"^\s+output: (.*)$", block, re.M)
        jobs.append((rule, found.group(1).split(", ") if found else []))
    return jobs


def counts(jobs) -> dict:
    found = {}
    for rule, _ in jobs:
        found[rule] = found.get(rule, 0) + 1
    return found


def prime(workdir: Path, select: list[str]) -> list[tuple[str, list[str]]]:
    jobs = planned(snakemake(workdir, "--dry-run", *select))
    fetched = [outs[0] for rule, outs in jobs if rule in ("fetch", "fetch_tree")]
    snakemake(workdir, *fetched, *select)
    for rule, outputs in planned(snakemake(workdir, "--dry-run", *select)):
        for i, output in enumerate(outputs):
            path = workdir / output
            path.parent.mkdir(parents=True, exist_ok=True)
            if i == 0 and rule in DIRECTORY_RULES:
                path.mkdir(exist_ok=True)
            else:
                path.touch()
    snakemake(workdir, "--touch", "--forceall", *select)
    left = snakemake(workdir, "--dry-run", *select)
    if "Nothing to be done" not in left:
        sys.exit(f"priming left jobs to do:\n{left[-3000:]}")
    return jobs


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--checkout", type=Path, default=REPO)
    parser.add_argument("--models", default="rwkv7-demo,rwkv7-tiny,llama-tiny,smollm2-135m")
    parser.add_argument("--edit", nargs="+", default=list(EDITS))
    args = parser.parse_args()
    select = ["--config", f"model={args.models}", "target=all", "precision=all"]
    with tempfile.TemporaryDirectory(prefix="npuforge-rerun-") as tmp:
        workdir = Path(tmp)
        for part in PARTS:
            source = args.checkout / part
            if source.is_dir():
                shutil.copytree(
                    source, workdir / part, ignore=shutil.ignore_patterns("__pycache__")
                )
            else:
                shutil.copy2(source, workdir / part)
        config = workdir / "config" / "config.yaml"
        config.write_text(
            config.read_text().replace("toolchain_runtime: auto", "toolchain_runtime: native")
        )
        plan = counts(prime(workdir, select))
        rules = [rule for rule in plan if rule != "all"]
        print(f"checkout {args.checkout}; models {args.models}; every target and precision")
        print(f"{'edit':<34}" + "".join(f"{rule[:10]:>11}" for rule in rules))
        print(f"{'(the whole plan)':<34}" + "".join(f"{plan[rule]:>11}" for rule in rules))
        for relative in args.edit:
            path = workdir / relative
            source = path.read_text()
            path.write_text(source + "# an edit\n")
            try:
                output = snakemake(workdir, "--dry-run", *select)
            finally:
                path.write_text(source)
            found = counts(planned(output))
            print(f"{relative:<34}" + "".join(f"{found.get(rule, 0):>11}" for rule in rules))


if __name__ == "__main__":
    main()

"""Kill-and-resume trials of whole workflow runs (used by tests and bench/reliability.py).

A trial starts a build in its own process group, SIGKILLs the whole group at a
seeded random moment, reruns the same command (after ``snakemake --unlock``: a
killed run leaves Snakemake's directory lock behind), and compares every release
file with a clean build's bytes.
"""

import hashlib
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from conftest import copy_workflow, script_env


@dataclass
class Trial:
    target: str
    kill_at: float
    stage: str
    resumed: bool
    identical: bool
    leftovers: list


def snakemake_cmd(*args):
    return [sys.executable, "-m", "snakemake", "--cores", "2", *map(str, args)]


def release_digests(results: Path) -> dict:
    root = results / "release"
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def leftovers(results: Path) -> list:
    """Temporary files a killed job left where a later run would find them (logs aside)."""
    return sorted(
        str(p.relative_to(results))
        for p in results.rglob(".*.tmp")
        if "logs" not in p.relative_to(results).parts
    )


def clean_build(workdir: Path, config: list) -> tuple[dict, float]:
    wf = copy_workflow(workdir / "clean")
    start = time.monotonic()
    result = subprocess.run(
        snakemake_cmd("--config", *config, f"results={wf / 'results'}"),
        cwd=wf,
        env=script_env(),
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return release_digests(wf / "results"), time.monotonic() - start


def running_rules(log_text: str) -> str:
    """The rules whose jobs had started and not finished when the run was killed."""
    started = dict(
        (job, rule)
        for rule, job in re.findall(r"^(?:localrule|rule) (\w+):\n(?:.*\n)*?\s+jobid: (\d+)",
                                    log_text, re.M)
    )  # fmt: skip
    finished = set(re.findall(r"Finished jobid: (\d+)", log_text))
    running = sorted({rule for job, rule in started.items() if job not in finished})
    return ",".join(running) or ("planning" if not started else "between jobs")


def kill_trial(workdir: Path, config: list, kill_at: float, reference: dict, name: str) -> Trial:
    wf = copy_workflow(workdir / name)
    results = wf / "results"
    cmd = snakemake_cmd("--config", *config, f"results={results}")
    log = wf / "killed-run.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, cwd=wf, env=script_env(), stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            proc.wait(timeout=kill_at)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    stage = running_rules(log.read_text(errors="replace"))
    subprocess.run(snakemake_cmd("--unlock", "--config", *config, f"results={results}"),
                   cwd=wf, env=script_env(), capture_output=True)  # fmt: skip
    rerun = subprocess.run(cmd, cwd=wf, env=script_env(), capture_output=True, text=True)
    resumed = rerun.returncode == 0
    identical = resumed and release_digests(results) == reference
    return Trial(config[1].split("=", 1)[1], round(kill_at, 2), stage, resumed, identical,
                 leftovers(results))  # fmt: skip


def run_trials(workdir: Path, config: list, count: int, seed: int) -> list[Trial]:
    """``count`` kills at seeded moments spread over a clean build's duration."""
    reference, duration = clean_build(workdir, config)
    rng = random.Random(seed)
    trials = []
    for index in range(count):
        kill_at = rng.uniform(0.3, max(0.6, duration * 0.97))
        name = f"trial{index}-{config[1].split('=', 1)[1]}"
        trials.append(kill_trial(workdir, config, kill_at, reference, name))
    return trials

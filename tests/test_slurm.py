"""The demo build through a real single-node Slurm (tests/slurm.py) with
`--workflow-profile profiles/slurm`: every job's threads and mem_mb reach Slurm, and the
release is byte for byte the one a local build makes."""

import os
import re

import pytest
from conftest import copy_workflow, script_env, snakemake
from slurm import PLUGIN_DIR, Cluster, ClusterError, unavailable_reason
from test_workflow import release_files

pytestmark = pytest.mark.slow

# The cheapest selection that still makes a release bundle (rwkv7-demo for onnx).
SELECT = ("--config", "target=onnx")
# One rule asks for more than Slurm's default single CPU, so threads visibly reach it;
# the local build gets the same request, so both run the same jobs.
THREADS = ("--set-threads", "export=2")
# The test cluster has no accounting database (slurmdbd): job states come from squeue
# (slurmctld keeps finished jobs for MinJobAge), and there is no account to guess.
NO_ACCOUNTING = (
    "--slurm-status-command", "squeue",
    "--slurm-no-account",
    "--slurm-init-seconds-before-status-checks", "2",
)  # fmt: skip


@pytest.fixture
def cluster(tmp_path):
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    try:
        cluster = Cluster(tmp_path / "slurm").__enter__()
    except ClusterError as error:
        # CI installs Slurm (envs/base/setup-slurm.sh), so there it must start.
        if os.environ.get("CI"):
            raise
        pytest.skip(f"slurmctld cannot start here: {str(error).splitlines()[0]}")
    try:
        yield cluster
    finally:
        cluster.stop()


def submitted_jobs(output: str) -> dict[str, dict]:
    """{Slurm job id: {rule, threads, mem_mb}} from the run's job blocks and submit lines."""
    blocks = {}
    for block in re.split(r"\n(?=(?:local)?rule \w+:)", output):
        rule = re.match(r"(?:local)?rule (\w+):", block)
        jobid = re.search(r"^\s+jobid: (\d+)$", block, re.M)
        if rule and jobid:
            threads = re.search(r"^\s+threads: (\d+)$", block, re.M)
            mem_mb = re.search(r"^\s+resources: .*\bmem_mb=(\d+)", block, re.M)
            blocks[jobid[1]] = {
                "rule": rule[1],
                "threads": int(threads[1]) if threads else 1,
                "mem_mb": int(mem_mb[1]),
            }
    submits = re.findall(r"Job (\d+) has been submitted with SLURM jobid (\d+)", output)
    return {slurm_id: blocks[jobid] for jobid, slurm_id in submits}


def test_demo_build_through_slurm_matches_the_local_build(cluster, tmp_path):
    local = copy_workflow(tmp_path / "local")
    snakemake(local, *THREADS, *SELECT, check=True)
    expected = release_files(local)
    assert any(name.endswith(".tar.gz") for name in expected)

    remote = copy_workflow(tmp_path / "remote")
    env = script_env(SLURM_CONF=cluster.env["SLURM_CONF"], PATH=cluster.env["PATH"])
    env["PYTHONPATH"] = os.pathsep.join((str(PLUGIN_DIR), env["PYTHONPATH"]))
    run = snakemake(
        remote, "--workflow-profile", "profiles/slurm", *NO_ACCOUNTING, *THREADS, *SELECT,
        env=env, check=True,
    )  # fmt: skip
    output = run.stdout + run.stderr

    submitted = submitted_jobs(output)
    # Everything but the local rules went through Slurm, among them the heavy steps.
    assert {"export", "compile", "package"} <= {job["rule"] for job in submitted.values()}
    slurm_jobs = {job["JobId"]: job for job in cluster.jobs()}
    assert set(submitted) <= set(slurm_jobs)
    for slurm_id, job in submitted.items():
        seen = slurm_jobs[slurm_id]
        assert seen["JobState"] == "COMPLETED", (job, seen)
        assert seen["Comment"].startswith(f"rule_{job['rule']}"), (job, seen)
        assert int(seen["NumCPUs"]) == job["threads"], (job, seen)
        assert seen["MinMemoryNode"] == f"{job['mem_mb']}M", (job, seen)
    # The requests differ between rules, so a dropped one would show.
    assert {job["threads"] for job in submitted.values()} == {1, 2}
    assert len({job["mem_mb"] for job in submitted.values()}) > 1

    assert release_files(remote) == expected

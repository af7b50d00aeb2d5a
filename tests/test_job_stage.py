"""The fixed-path stage that vendor jobs compile from: its lock and its cleanup."""

import os
import subprocess
import sys
import time

from npuforge.jobs import job_stage

WAITER = """
import os, sys
from npuforge.jobs import job_stage
job_stage.STAGE_ROOT = sys.argv[1]
stage, _, lock = job_stage.make_stage("test", {"same": "spec"}, {}, [])
# The lock this waiter got must be the file now at the lock path, not an unlinked one.
print(os.stat(stage + ".lock").st_ino == os.fstat(lock).st_ino, flush=True)
job_stage.remove_stage(stage)
os.close(lock)
"""


def test_remove_stage_leaves_nothing_and_a_waiter_gets_a_fresh_lock(tmp_path, monkeypatch):
    monkeypatch.setattr(job_stage, "STAGE_ROOT", str(tmp_path))
    stage, _, lock = job_stage.make_stage("test", {"same": "spec"}, {}, [])
    waiter = subprocess.Popen(
        [sys.executable, "-c", WAITER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        time.sleep(1.0)  # the waiter now blocks on the lock file we hold
        assert waiter.poll() is None
        job_stage.remove_stage(stage)
        os.close(lock)
        out, _ = waiter.communicate(timeout=60)
    finally:
        waiter.kill()
    assert waiter.returncode == 0 and out.strip() == "True"
    assert sorted(os.listdir(tmp_path)) == []


STOPPED = """
import sys, time
from npuforge.jobs import job_stage
job_stage.STAGE_ROOT = sys.argv[1]
stage, _, lock = job_stage.make_stage("test", {"stopped": "spec"}, {}, [])
try:
    print("staged", flush=True)
    time.sleep(120)
finally:
    job_stage.remove_stage(stage)
"""


def test_a_stopped_job_removes_its_stage(tmp_path):
    """A build step stopped with SIGTERM (the runner's stop, Ctrl-C in Snakemake) exits
    through the job's cleanup: natively its stage in /tmp (gigabytes for QNN) would
    otherwise stay behind."""
    job = subprocess.Popen(
        [sys.executable, "-c", STOPPED, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert job.stdout.readline().strip() == "staged"
        assert len(os.listdir(tmp_path)) == 2  # the stage and its lock
        job.terminate()
        job.wait(timeout=60)
    finally:
        job.kill()
    assert job.returncode == 128 + 15
    assert os.listdir(tmp_path) == []

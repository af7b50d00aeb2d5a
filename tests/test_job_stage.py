"""The fixed-path stage that vendor jobs compile from: its lock and its cleanup."""

import os
import platform
import subprocess
import sys
import time

import pytest

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


# Where glibc serves a 1 MiB block after an 8 MiB mapped block is freed: from the heap
# once freeing it raised the mmap threshold (glibc's default), from a mapping of its own
# while the threshold stays fixed.
THRESHOLD_PROBE = """
import ctypes
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.free(libc.malloc(8 << 20))
block = libc.malloc(1 << 20)
with open("/proc/self/maps") as maps:
    heap = [line.split()[0] for line in maps if line.rstrip().endswith("[heap]")]
low, high = (int(x, 16) for x in heap[0].split("-"))
print("heap" if low <= block < high else "mapped")
"""


def _block_source(env: dict) -> str:
    run = subprocess.run(
        [sys.executable, "-c", THRESHOLD_PROBE], env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc tunables")
def test_a_qnn_chunk_process_runs_with_a_fixed_mmap_threshold():
    """A QAIRT thread freeing a mapped block moved glibc's threshold at a time of its
    own: about one context build in four came out with other padding bytes."""
    import qnn_job

    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    assert _block_source(base) == "heap"  # glibc's default: the threshold moves
    env = qnn_job.chunk_env({**base, "GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=1"})
    assert job_stage.MMAP_THRESHOLD in env["GLIBC_TUNABLES"].split(":")
    assert _block_source(env) == "mapped"
    assert job_stage.tunable(env["GLIBC_TUNABLES"], "glibc.malloc.mmap_threshold") == "131072"


RELAYED = """
import os, stat, sys
sys.path.insert(0, sys.argv[1])
import job_stage
if len(sys.argv) > 2:
    kinds = [stat.S_ISFIFO(os.fstat(fd).st_mode) for fd in (1, 2)]
    print("out", kinds, flush=True)
    print("err", file=sys.stderr, flush=True)
    sys.exit(3)
code = job_stage.run_relayed([sys.executable, __file__, sys.argv[1], "child"])
print("code", code, flush=True)
"""


def test_a_relayed_process_writes_to_a_pipe_wherever_the_job_writes(tmp_path):
    """The chunk's context bytes followed its output's file type; its lines still
    reach the job's log, in order, with its exit code."""
    script = tmp_path / "relayed.py"
    script.write_text(RELAYED)
    jobs = str(job_stage.__file__).rsplit("/", 1)[0]
    with open(tmp_path / "log", "w") as log:  # the job itself writes to a file
        run = subprocess.run([sys.executable, str(script), jobs], stdout=log, stderr=log)
    assert run.returncode == 0
    lines = (tmp_path / "log").read_text().splitlines()
    assert lines == ["out [True, True]", "err", "code 3"]


def test_a_qnn_stage_holds_every_module_the_job_imports():
    """A chunk process imports the QNN job's modules from its stage (make_stage copies
    them in): one left out would fail only inside a real compile."""
    import ast
    from pathlib import Path

    import qnn_job

    jobs = Path(qnn_job.__file__).parent
    staged = {Path(path).stem for path in qnn_job.job_files()}
    imported = set()
    for name in staged:
        for node in ast.walk(ast.parse((jobs / f"{name}.py").read_text())):
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level:
                imported.add(node.module)
    siblings = imported & {path.stem for path in jobs.glob("*.py")}
    assert {"job_stage", "qnn_quantizer", "qnn_session", "qnn_graph", "qnn_log"} <= siblings
    assert "qnn_job" in staged and siblings <= staged


PINNED = """
import os, sys
from npuforge.jobs import job_stage
wanted = int(sys.argv[1])
job_stage.current_cpu = lambda: wanted  # where the scheduler runs it now
job_stage.one_cpu()
print(*sorted(os.sched_getaffinity(0)))
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity here")
def test_a_job_takes_the_cpu_it_runs_on_not_one_its_pid_picks():
    # In a container every job has the same small pid: chosen by pid, side-by-side chunk
    # jobs all took one CPU. Each job stays where the scheduler runs it.
    allowed = sorted(os.sched_getaffinity(0))
    for cpu in [allowed[0], allowed[-1]] * 3:  # by pid: right by chance 1 in 2 each
        ran = subprocess.run(
            [sys.executable, "-c", PINNED, str(cpu)], capture_output=True, text=True, check=True
        )
        assert ran.stdout.split() == [str(cpu)]
    # The CPU /proc says the process runs on: once pinned, the one it is pinned to.
    probe = "import os; from npuforge.jobs import job_stage as j; j.one_cpu(); "
    probe += "print(j.current_cpu(), *os.sched_getaffinity(0))"
    ran = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    now, pinned = ran.stdout.split()
    assert now == pinned and int(now) in allowed

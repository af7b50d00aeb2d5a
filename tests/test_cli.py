"""The step CLIs' shared ending: the resources line a finished or failed step leaves in its
log."""

import os
import subprocess
import sys

from npuforge.cli import read_step_resources

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A step whose toolchain job (a child process) holds 300 MB for 1.5 s, then exits 0 or
# raises.
STEP = """
import subprocess, sys, time
sys.path.insert(0, sys.argv[1])
from npuforge.cli import run_cli
from npuforge.errors import NpuforgeError

HOLD = "import time; b = bytearray(300 << 20); b[::4096] = b'x' * (300 << 8); time.sleep(1.5)"

def touched(megabytes):
    block = bytearray(megabytes << 20)
    block[::4096] = b"x" * (megabytes << 8)
    return block

def main(argv):
    if argv == ["refuse"]:
        raise NpuforgeError("the option is bad; fix it")
    if argv == ["spin"]:  # a child that burns 0.6 s of CPU, then a step that sleeps 1 s
        spin = "import time; exec('while time.process_time() < 0.6: pass')"
        subprocess.run([sys.executable, "-c", spin], check=True)
        time.sleep(1.0)
        return
    if argv == ["overlap"]:  # the step's own 400 MB while its child holds 300 MB
        mine = touched(400)
        subprocess.run([sys.executable, "-c", HOLD], check=True)
        return
    subprocess.run([sys.executable, "-c", HOLD], check=True)
    if argv == ["apart"]:  # the step's own 400 MB after its child is gone
        mine = touched(400)
        time.sleep(1.5)
    if argv == ["fail"]:
        raise NpuforgeError("the input is bad; fix it")

sys.exit(run_cli(main, sys.argv[2:]))
"""


def run_step(*argv):
    return subprocess.run([sys.executable, "-c", STEP, REPO, *argv], capture_output=True, text=True)


def test_a_finished_step_logs_its_wall_time_and_the_peak_memory_of_what_it_ran():
    done = run_step()
    assert done.returncode == 0, done.stderr
    figures = read_step_resources(done.stderr)
    assert figures is not None, done.stderr
    # The child's 300 MB is its own, not the step's (a Python process: tens of MB), even
    # when the step was started from a larger process (this test's, a vfork: getrusage
    # would give the step that process's peak).
    assert figures["child_rss_mb"] >= 300
    assert figures["step_rss_mb"] < 200
    assert figures["seconds"] > 0
    assert done.stderr.strip().splitlines()[-1].startswith("step resources:")


def test_a_failed_step_says_what_it_used_then_ends_on_its_error_line():
    failed = run_step("fail")
    assert failed.returncode == 2
    used, error = failed.stderr.strip().splitlines()
    assert error == "error: the input is bad; fix it"
    assert used.startswith("step resources (failed):")
    # Read as a failed step's, never as a finished one's (bench_scale's rows).
    assert read_step_resources(failed.stderr) is None
    figures = read_step_resources(failed.stderr, failed=True)
    assert figures["child_rss_mb"] >= 300 and figures["seconds"] > 0
    assert read_step_resources(run_step().stderr, failed=True) is None


def test_input_refused_before_any_process_ran_stays_one_error_line():
    refused = run_step("refuse")
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == ["error: the option is bad; fix it"]


def test_the_resources_line_counts_the_cpu_time_of_the_processes_the_step_ran():
    """CPU seconds hold the children's work and not the step's waiting, so a step's CPU
    time stays put when other work shares the host (bench_scale's growth by CPU)."""
    done = run_step("spin")
    assert done.returncode == 0, done.stderr
    figures = read_step_resources(done.stderr)
    assert figures["cpu_seconds"] >= 0.6, figures
    assert figures["seconds"] - figures["cpu_seconds"] >= 0.5, figures


def test_the_resources_line_says_what_the_step_and_its_processes_held_at_once():
    """The step's and its processes' peaks are each measured alone; whether they add up
    depends on when they came (a compile holding its reference logits while its
    toolchain runs, or not): the together figure says which."""
    overlap, apart = (read_step_resources(run_step(when).stderr) for when in ("overlap", "apart"))
    for figures in (overlap, apart):
        assert figures["step_rss_mb"] >= 400 and figures["child_rss_mb"] >= 300, figures
    assert overlap["together_rss_mb"] >= 700, overlap
    assert apart["together_rss_mb"] < 600, apart
    assert apart["together_rss_mb"] >= apart["step_rss_mb"], apart


def test_a_resources_line_without_cpu_seconds_still_reads():
    line = "step resources: 12.5 s wall, peak RSS 90 MB (step), 5000 MB (processes it ran)"
    assert read_step_resources(line) == {
        "seconds": 12.5,
        "cpu_seconds": None,
        "step_rss_mb": 90,
        "child_rss_mb": 5000,
        "together_rss_mb": None,
    }

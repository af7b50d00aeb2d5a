"""Peak resident memory of a piece of code, run in a fresh interpreter: what a streaming
step's tests compare across chunk counts."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Sampled from /proc every 2 ms, above what the process held once ``setup`` ran, so an
# import's transient high-water mark (VmHWM) does not hide the run's own peak.
PROBE = """
import os, sys, threading
sys.path.insert(0, {repo!r})
{setup}

def resident():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

before, peak, done = resident(), [0], threading.Event()

def sample():
    while not done.is_set():
        peak[0] = max(peak[0], resident())
        done.wait(0.002)

sampler = threading.Thread(target=sample)
sampler.start()
{run}
done.set()
sampler.join()
print(peak[0] - before)
"""


def peak_bytes(setup: str, run: str) -> int:
    """Bytes of resident memory ``run`` took at its peak beyond what ``setup`` left (both
    Python statements, run in a new interpreter with the repository importable)."""
    code = PROBE.format(repo=str(REPO), setup=setup, run=run)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    return int(result.stdout.split()[-1])

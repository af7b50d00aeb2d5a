"""Shared plumbing for the step CLIs in workflow_scripts/."""

import errno
import os
import sys

from npuforge.errors import NpuforgeError

# What the machine refused, by errno: the fix to name in the one-line error.
OS_FIXES = {
    errno.ENOSPC: "free disk space or point results= at a larger filesystem",
    errno.EDQUOT: "free disk space (quota) or point results= elsewhere",
    errno.EFBIG: "raise the file size limit (ulimit -f) or point results= elsewhere",
    errno.EROFS: "point results= at a writable filesystem",
    errno.EACCES: "fix the permissions or point results= elsewhere",
    errno.EPERM: "fix the permissions or point results= elsewhere",
}


# The workflow's shell prefix opens this descriptor on the terminal's stderr before the
# rule sends the step's output to its log: a failed step's line then reaches the user
# first, ahead of Snakemake's report of the failed job.
ERROR_FD = "NPUFORGE_ERROR_FD"


def fail(message: str) -> int:
    """Say ``message`` on stderr (the step's log) and on the terminal; return exit code 2."""
    print(f"error: {message}", file=sys.stderr)
    sys.stderr.flush()
    fd = os.environ.get(ERROR_FD, "")
    if fd.isdigit():
        try:
            os.write(int(fd), f"npuforge: {message}\n".encode(errors="replace"))
        except OSError:
            pass  # not opened (a step run by hand): the log has the line
    return 2


def _os_refusal(err: BaseException) -> OSError | None:
    """The OSError with a known fix in ``err`` or the exceptions it was raised from."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in OS_FIXES:
            return err
        err = err.__cause__ or err.__context__
    return None


class Stopped(BaseException):
    """The step received SIGTERM (Snakemake stopping its jobs, a cluster's time limit)."""


def _stopped(signum, frame):
    raise Stopped()


def run_cli(main, argv=None) -> int:
    """Run ``main(argv)``; turn an NpuforgeError, an operating-system refusal (disk full,
    file size limit, read-only filesystem) or running out of memory into one line on
    stderr and exit 2. Outputs are written atomically, so nothing partial is left; a
    SIGTERM unwinds the step the same way (its toolchain job stopped, its temporary
    outputs removed) and exits 143."""
    import signal
    import threading

    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _stopped)
    try:
        return _run_main(main, argv)
    except Stopped:
        fail("stopped by SIGTERM; nothing of this step was kept")
        return 128 + signal.SIGTERM
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _resident_bytes(pid: int, field: str = "VmRSS") -> int:
    """A process's resident memory (``VmRSS``) or its own peak (``VmHWM``: of this
    process image only; getrusage's maxrss also counts the memory of the process it was
    started from, which a vfork'd child shares until it execs)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass  # gone, or no /proc
    return 0


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children", encoding="ascii") as handle:
                    children = [int(c) for c in handle.read().split()]
            except OSError:
                continue
            found += children
            todo += children
    return found


class MemoryPeaks:
    """Peak resident memory sampled every ``interval`` seconds on a thread: ``children``,
    the largest total of a process's descendants (its toolchain jobs and what they
    start), and ``together``, the largest total of the process and its descendants at
    one moment (what the host had to hold, where the two peaks need not coincide). A
    container's processes belong to its engine, not to the step, and are not counted."""

    def __init__(self, interval: float = 0.5):
        import threading

        self.children = 0
        self.together = 0
        self._interval = interval
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()

    def _sample(self):
        pid = os.getpid()
        while not self._done.wait(self._interval):
            children = sum(_resident_bytes(child) for child in _descendants(pid))
            self.children = max(self.children, children)
            self.together = max(self.together, children + _resident_bytes(pid))


def resources_line(started: float, peaks: MemoryPeaks, failed: bool = False) -> str:
    """What the step used, for its log (bench/bench_scale.py reads it): wall seconds, CPU
    seconds (the step's and those of the processes it ran and waited for: a container's
    processes belong to its engine and are not counted), the peak resident memory of
    the step's own process, the largest sampled total of the processes it ran, and the
    largest of the two together (sampled; never below either peak alone); ``failed``:
    the form a failed step writes before its error. CPU seconds barely move when other
    work shares the host; wall seconds do."""
    import resource
    import time

    own = _resident_bytes(os.getpid(), "VmHWM") or (
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    usages = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    cpu = sum(usage.ru_utime + usage.ru_stime for usage in usages)
    together = max(peaks.together, own, peaks.children)
    return (
        f"{FAILED_STEP_RESOURCES if failed else STEP_RESOURCES} "
        f"{time.monotonic() - started:.1f} s wall, {cpu:.1f} s CPU, peak RSS "
        f"{own / 2**20:.0f} MB (step), {peaks.children / 2**20:.0f} MB (processes it ran), "
        f"{together / 2**20:.0f} MB (together)"
    )


# The prefix of the line every step that finishes writes last to its log; a step that
# fails after running processes writes the other just before its error line (what a
# killed toolchain job had used).
STEP_RESOURCES = "step resources:"
FAILED_STEP_RESOURCES = "step resources (failed):"


def read_step_resources(log_text: str, failed: bool = False) -> dict | None:
    """The figures of a log's last resources line: ``seconds``, ``cpu_seconds``,
    ``step_rss_mb``, ``child_rss_mb`` and ``together_rss_mb`` (the CPU and together
    figures None in lines written before they were); None if the step did not finish
    (``failed``: if it did not fail). Reads the first form's lines too ("largest process
    it ran", getrusage's peak of one child)."""
    import re

    pattern = (
        re.escape(FAILED_STEP_RESOURCES if failed else STEP_RESOURCES)
        + r" ([\d.]+) s wall, (?:([\d.]+) s CPU, )?peak RSS (\d+) MB \(step\), "
        r"(\d+) MB \((?:processes it ran|largest process it ran)\)(?:, (\d+) MB \(together\))?"
    )
    found = re.findall(pattern, log_text)
    if not found:
        return None
    seconds, cpu, own, child, together = found[-1]
    return {
        "seconds": float(seconds),
        "cpu_seconds": float(cpu) if cpu else None,
        "step_rss_mb": int(own),
        "child_rss_mb": int(child),
        "together_rss_mb": int(together) if together else None,
    }


def _run_main(main, argv) -> int:
    import time

    from npuforge.progress import Heartbeat

    started = time.monotonic()
    peaks = MemoryPeaks()

    def failed_after_work(out_of_memory: bool = False) -> None:
        # What a failed toolchain job (or an exhausted step) had used; input refused
        # before any process ran stays one error line.
        if peaks.children or out_of_memory:
            print(resources_line(started, peaks, failed=True), file=sys.stderr)

    try:
        with peaks, Heartbeat():
            main(argv)
    except NpuforgeError as err:
        failed_after_work()
        return fail(str(err))
    except MemoryError:
        failed_after_work(out_of_memory=True)
        return fail(
            "out of memory; give the job more memory (targets.yaml compile_mem_mb for "
            "compile jobs, a larger machine, or fewer parallel jobs with --cores)"
        )
    except Exception as err:
        failed_after_work()
        # A library may wrap the refusal (torch.save raises RuntimeError after ENOSPC).
        refused = _os_refusal(err)
        if refused is None:
            raise
        where = f"{refused.filename}: " if refused.filename else ""
        return fail(f"{where}{refused.strerror}; {OS_FIXES[refused.errno]}")
    print(resources_line(started, peaks), file=sys.stderr)
    return 0

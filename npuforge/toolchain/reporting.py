"""Running a command while saying what it does: a build step into its log, a job (or
pip) echoed as its output comes, with a line for every quiet stretch, and stopped with
its step."""

import os
import re
import subprocess
import sys
import tempfile
import time

from npuforge.errors import NpuforgeError
from npuforge.jobs.job_stage import die_with_parent
from npuforge.toolchain.machine_cache import disk_full


def run_logged(cmd, *, log, env=None, what):
    log.write(f"$ {' '.join(map(str, cmd))}\n")
    log.flush()
    result = subprocess.run(
        [str(c) for c in cmd], stdout=log, stderr=subprocess.STDOUT, env=env, text=True
    )
    if result.returncode != 0:
        with open(log.name, encoding="utf-8", errors="replace") as written:
            written.seek(max(0, os.fstat(written.fileno()).st_size - 65536))
            full = disk_full(what, written.read())
        raise NpuforgeError(full or f"{what} failed (exit {result.returncode}): see {log.name}")


def waiting_reporter(log):
    """Says, in the build log and the step's output, that the step waits for another."""
    out = Tee(log, sys.stdout)

    def say(message):
        out.write(message + "\n")
        out.flush()

    return say


class Tee:
    """Writes to several text streams at once (a build log and the step's output)."""

    def __init__(self, *streams):
        self.streams = streams

    def write(self, text):
        for stream in self.streams:
            stream.write(text)

    def flush(self):
        for stream in self.streams:
            stream.flush()


def run_reporting(cmd, env, cwd, what: str, *, quiet_s: float = 10.0, out=None):
    """Run ``cmd``; echo its output to ``out`` (default: stdout, the step's log) as it
    comes, and after every ``quiet_s`` seconds of silence say that it is still running and
    for how long (vendor compilers go quiet for minutes). Returns (exit code, output).

    The job writes into a regular file, read back as it grows: vendor compilers copy
    heap leftovers into their binaries, and a pipe in place of the file changes the heap
    history, hence the bytes (job_stage.py)."""
    out = out or sys.stdout
    with (
        tempfile.TemporaryFile("w+b") as captured,
        open(f"/dev/fd/{captured.fileno()}", "rb") as reader,
    ):
        # A process group of its own: stopping the job stops every process it started.
        process = subprocess.Popen(
            [str(c) for c in cmd],
            stdout=captured,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            start_new_session=True,
            # Killed with the step: a SIGKILLed step gets no chance to stop it.
            preexec_fn=die_with_parent(),
        )
        try:
            return _report_until_done(process, reader, out, what, quiet_s)
        except BaseException:
            # The step was stopped (SIGTERM, Ctrl-C): stop the job (a container engine
            # passes it on) rather than leave it compiling.
            _stop(process)
            raise


def _stop(process, grace_s: float = 30.0) -> None:
    """SIGTERM to the job's process group, SIGKILL after ``grace_s``."""
    import signal

    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


# The lines our jobs print to say what they are doing (qnn_job's log, tpumlir_job's
# steps and verify calls): a vendor library's warning printed after one is not the stage.
JOB_STAGE_LINE = re.compile(r"^(\[qnn_job\] |TPU-MLIR step |verify: call )")
# A stage line's estimate of the job's time left then ("[about 1200 s left ...]").
STAGE_ESTIMATE = re.compile(r" ?\[about (\d+) s left([^\]]*)\]")


def quiet_report(what: str, running_s: float, stage: str, stage_age_s: float, said: str) -> str:
    """The line for a quiet stretch: how long the job has run, the time left by the stage
    line's estimate less the time since that line, the stage and the last output."""
    estimate = STAGE_ESTIMATE.search(stage)
    left = ""
    if estimate:
        seconds = max(0.0, int(estimate[1]) - stage_age_s)
        left = f", about {seconds:.0f} s left{estimate[2]}"
        stage = STAGE_ESTIMATE.sub("", stage, count=1)
        said = STAGE_ESTIMATE.sub("", said, count=1)
    at = f"at: {stage}; " if stage and stage != said else ""
    return f"{what} running for {running_s:.0f} s{left} ({at}last output: {said or 'none yet'})"


def _report_until_done(process, reader, out, what: str, quiet_s: float):
    """Echo the job's output as it comes, and a line after every ``quiet_s`` seconds of
    silence; return (exit code, output) once it ends."""
    chunks, pending = [], b""
    start = last = stage_at = time.monotonic()
    stage = ""

    def echo(data: bytes):
        nonlocal pending, stage, stage_at
        pending += data
        *complete, pending = pending.split(b"\n")
        for line in complete:
            text = line.decode(errors="replace")
            out.write(text + "\n")
            if JOB_STAGE_LINE.match(text):
                stage, stage_at = text.strip()[:120], time.monotonic()
        out.flush()

    while True:
        try:
            process.wait(timeout=min(1.0, quiet_s))
            finished = True
        except subprocess.TimeoutExpired:
            finished = False
        data = reader.read()
        now = time.monotonic()
        if data:
            chunks.append(data)
            echo(data)
            last = now
        elif not finished and now - last >= quiet_s:
            said = b"".join(chunks).strip().rsplit(b"\n", 1)[-1][:120].decode(errors="replace")
            out.write(quiet_report(what, now - start, stage, now - stage_at, said) + "\n")
            out.flush()
            last = now
        if finished:
            break
    if pending:
        out.write(pending.decode(errors="replace") + "\n")
        out.flush()
    return process.returncode, b"".join(chunks).decode(errors="replace")

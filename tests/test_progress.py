"""A long step says in its log what it is doing, how far along it is and about how long
is left (npuforge.progress, run by every step CLI through npuforge.cli.run_cli)."""

import io
import time

from npuforge import progress


def test_the_stage_reports_its_time_and_what_is_left():
    start = time.monotonic()
    progress.stage("export decode: chunk 1 of 4", done=0, total=4)
    progress.stage("export decode: chunk 2 of 4", done=1, total=4)
    # 30 s for the first chunk of four: about 90 s left; 5 s into the second.
    progress._state.update(counting_since=start - 30, since=start - 5)
    line = progress.describe(now=start)
    assert line == (
        "progress: export decode: chunk 2 of 4 (5 s in this stage); 1 of 4 done, about 90 s left"
    )
    progress.stage("bundle: hashing the files")
    assert progress.describe().startswith("progress: bundle: hashing the files (0 s")
    assert "left" not in progress.describe()
    # Once the staged work is over, a toolchain job that follows reports for itself.
    progress.clear()
    assert progress.describe() is None


def test_the_heartbeat_writes_the_stage_while_the_step_runs():
    out = io.StringIO()
    with progress.Heartbeat(every=0.05, out=out):
        progress.stage("reference: llama over 16 tokens")
        time.sleep(0.3)
    lines = out.getvalue().splitlines()
    assert len(lines) >= 3
    assert all(line.startswith("progress: reference: llama over 16 tokens (") for line in lines)
    written = len(lines)
    time.sleep(0.15)
    assert len(out.getvalue().splitlines()) == written  # stopped with the step


def test_a_qnn_job_count_says_the_time_left_at_its_pace():
    """The toolchain jobs log for themselves (standard library only): the HTP simulator's
    calls at 1.5B take about a minute each, so the count says how long is left."""
    from npuforge.jobs.qnn_log import Progress

    count = Progress("HTP simulator calls run", 64)
    count.done = 4
    line = count.line(now=count.started + 200)
    assert line == "HTP simulator calls run: 4 of 64 after 200 s, about 3000 s left"
    bound = Progress("tensors given Q/DQ", 900, bound=True)
    bound.done = 300
    assert bound.line(now=bound.started + 30) == "tensors given Q/DQ: 300 of up to 900 after 30 s"


def test_the_rknn_simulator_steps_say_the_time_left_by_the_real_clock():
    from npuforge.jobs.rknn_job import time_left

    assert time_left(24.0, 8, 64) == ", about 168 s left"
    assert time_left(0.0, 0, 64) == ""  # no pace before the first step
    assert time_left(float("nan"), 8, 64) == ""  # no /proc/uptime: no estimate

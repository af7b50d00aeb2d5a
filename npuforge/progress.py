"""What a long step is doing, said in its log every 10 s.

The library names its stage as it goes (``stage("export chunk 2 of 6", done=1,
total=6)``); a step CLI run by ``npuforge.cli.run_cli`` has a heartbeat that, after every
10 s without a new stage, writes the current one to the step's log with the time spent in
it and, where the stage counts its work, an estimate of the time left. A library call
outside a step (tests, notebooks) only records the stage. Standard library only.
"""

import sys
import threading
import time

_lock = threading.Lock()
_state = {"what": None, "since": 0.0, "done": None, "total": None, "counting_since": 0.0}


def stage(what: str, done: int | None = None, total: int | None = None) -> None:
    """The step is now doing ``what``; ``done`` of ``total`` units of the same work are
    finished (for the estimate of the time left)."""
    now = time.monotonic()
    with _lock:
        if done is None or done == 0 or _state["total"] != total:
            _state["counting_since"] = now
        _state.update(what=what, since=now, done=done, total=total)


def clear() -> None:
    """The staged work is over: the heartbeat says nothing until the next stage (a
    toolchain job reports its own progress)."""
    with _lock:
        _state.update(what=None, done=None, total=None)


def describe(now: float | None = None) -> str | None:
    """The current stage as a log line, or None before the first stage."""
    now = time.monotonic() if now is None else now
    with _lock:
        what, since = _state["what"], _state["since"]
        done, total, counting = _state["done"], _state["total"], _state["counting_since"]
    if what is None:
        return None
    line = f"progress: {what} ({now - since:.0f} s in this stage)"
    if done and total and done < total:
        left = (now - counting) / done * (total - done)
        line += f"; {done} of {total} done, about {left:.0f} s left"
    return line


class Heartbeat:
    """Writes ``describe()`` to ``out`` (default stderr, the step's log) every ``every``
    seconds until the step ends."""

    def __init__(self, every: float = 10.0, out=None):
        self._every, self._out = every, out
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()

    def _beat(self):
        while not self._done.wait(self._every):
            line = describe()
            if line is not None:
                out = self._out or sys.stderr
                print(line, file=out, flush=True)

"""The QNN job's log lines and progress counts.

Every line starts ``[qnn_job] ``: the toolchain runner names the stage a quiet job is
at by that prefix (``npuforge.toolchain``'s ``JOB_STAGE_LINE``). Standard library only.
"""

import time


def log(message: str) -> None:
    print(f"[qnn_job] {message}", flush=True)


class Progress:
    """Counts steps of a long phase and logs how far along it is, every ``every`` seconds,
    with the time left at the pace so far (not for a ``bound``: an upper limit)."""

    def __init__(self, what: str, total: int, every: float = 10.0, bound: bool = False):
        self.what, self.every, self.total, self.bound = what, every, total, bound
        self.done, self.started = 0, time.monotonic()
        self._last = self.started

    def step(self) -> None:
        self.done += 1
        now = time.monotonic()
        if now - self._last >= self.every:
            self._last = now
            log(self.line(now))

    def line(self, now: float) -> str:
        taken = now - self.started
        if self.bound:
            return f"{self.what}: {self.done} of up to {self.total} after {taken:.0f} s"
        left = taken / self.done * (self.total - self.done)
        return (
            f"{self.what}: {self.done} of {self.total} after {taken:.0f} s, about {left:.0f} s left"
        )

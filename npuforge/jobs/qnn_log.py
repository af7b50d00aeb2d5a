"""The QNN job's log lines and progress counts.

Every line starts ``[qnn_job] ``: the toolchain runner names the stage a quiet job is
at by that prefix (``npuforge.toolchain``'s ``JOB_STAGE_LINE``). Standard library only.
"""

import time


def log(message: str) -> None:
    print(f"[qnn_job] {message}", flush=True)


class Progress:
    """Counts steps of a long phase and logs how far along it is, every ``every`` seconds."""

    def __init__(self, what: str, total: int, every: float = 10.0, bound: bool = False):
        self.what, self.every = what, every
        self.total = f"up to {total}" if bound else str(total)
        self.done, self.started = 0, time.monotonic()
        self._last = self.started

    def step(self) -> None:
        self.done += 1
        now = time.monotonic()
        if now - self._last >= self.every:
            self._last = now
            log(f"{self.what}: {self.done} of {self.total} after {now - self.started:.0f} s")

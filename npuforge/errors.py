"""The one error type a user sees: a single line naming the problem and the fix."""


class NpuforgeError(Exception):
    """A user-facing failure. ``str(err)`` is one line: what is wrong, and what to do."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))

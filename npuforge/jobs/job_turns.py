"""Turns for the steps of a TPU-MLIR job's chains that must not run side by side.
Standard library only: the job runs in the toolchain's environment."""

import contextlib
import threading


class OneAtATime:
    """Steps of the given stages run one at a time across the nets' chains, in the order
    of the chains' ranks: model_transform's peak is most of a net's (7.6-8.1 GB of an
    RWKV-7 1.5B chunk's 8-10), so two side by side took twice it, where one beside the
    other net's model_deploy takes it once. A chain's turn comes when every chain ranked
    before it has run its steps of these stages or ended (the pool starts chains in rank
    order, so the one whose turn it is has started)."""

    def __init__(self, stages):
        self.stages = frozenset(stages)
        self.turns = threading.Condition()
        self.busy = False
        self.pending: dict = {}  # rank -> steps of these stages the chain has yet to run

    def expect(self, rank: int, steps: int) -> None:
        if steps:
            self.pending[rank] = steps

    def done(self, rank: int) -> None:
        """The chain ended (finished, failed or reused): it takes no more turns."""
        with self.turns:
            self.pending.pop(rank, None)
            self.turns.notify_all()

    @contextlib.contextmanager
    def turn(self, stage: str, rank: int):
        if stage not in self.stages:
            yield
            return
        with self.turns:
            self.turns.wait_for(lambda: not self.busy and min(self.pending, default=rank) >= rank)
            self.busy = True
        try:
            yield
        finally:
            with self.turns:
                self.busy = False
                left = self.pending.pop(rank, 1) - 1
                if left > 0:
                    self.pending[rank] = left
                self.turns.notify_all()

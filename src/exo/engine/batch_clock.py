"""When a batch's steps are timed for its depth policy (``engine.depth``), and as what.

A step's time is the batch's own only when nothing else ran on the device since the step before it
(``quiet``): a newcomer's prefill, another lane's step. A plain step is pipelined (it computes while the host
emits the step before), so its time is the previous step's compute when it follows a plain step
(``after_plain``). Plain steps are timed as one stretch (``Stretch``: the steps one plan chose), from the first
step's start to the end of the last, or to the change that ends it early (a member joined or left).

Invariants: ``stretch`` is the plain stretch under way, None between stretches; a batch that drained starts
over as a new one (nothing stepped, quiet, no plain step before).
"""

from __future__ import annotations

import time

from .depth import Plan, Stretch


class StepClock:
    """The timing state of one batch's steps (see the module's doc)."""

    def __init__(self) -> None:
        self.stretch: Stretch | None = None  # a plain stretch under way
        self.after_plain = False  # the previous step was a plain one
        self._quiet = True  # nothing else ran on the device since the last step
        self._stepped = False  # a step ran since the batch formed

    def interleaved(self) -> None:
        """Other work ran on the device since the last step: the next step's time (and the running stretch's)
        is not a step's alone."""
        if self._stepped:
            self._quiet = False
            if self.stretch is not None:
                self.stretch.quiet = False

    def step(self) -> tuple[float, bool]:
        """A step starts: its start, and whether nothing else ran on the device since the last step."""
        start = time.perf_counter()
        quiet, self._quiet, self._stepped = self._quiet, True, True
        return start, quiet

    def start_stretch(self, plan: Plan, start: float, quiet: bool) -> Stretch:
        """A plain stretch under ``plan`` starts with the step begun at ``start``."""
        self.stretch = Stretch(plan, start, quiet, self.after_plain)
        return self.stretch

    def end_stretch(self) -> Stretch | None:
        """The stretch under way ends: it, for the depth policy to observe (None: none was)."""
        stretch, self.stretch = self.stretch, None
        return stretch

    def drained(self) -> None:
        """The last member left: the next step starts a new batch."""
        self._stepped = self.after_plain = False
        self._quiet = True

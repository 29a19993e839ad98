"""The depth of a batch's steps: which members draft how many tokens, how long a plain stretch runs, what
the members' heads keep while the batch decodes plainly, and what the depth policies learn from each step
(``exo.engine.adaptive`` holds the policies; this module applies them to a batch's members).

This is the one place where a batch of one and a batch of several differ:

- a batch of one is a solo request: its member's own ``DepthPolicy`` (for an adaptive member, the engine's
  solo policy: ``BatchDepthPolicy``'s size-1 bucket) chooses each depth; a choice of plain decoding runs for
  the policy's budget (``plain_budget``) and is timed as one stretch (``PLAIN_TIMED_MIN`` steps at least, its
  first step not being overlapped); a round is timed from after its head's catch-up on a plain stretch; while
  it decodes plainly an adaptive member's head keeps ``HEAD_WINDOW`` rows waiting;
- a batch of several: a forced member drafts its own depth, the adaptive ones the depth ``BatchDepthPolicy``
  picks for the batch's size, asked every step; a plain step is timed when it follows a plain step, a round
  when it is typical (every member at the round's depth, no head catching up); adaptive members' heads keep
  ``BATCH_HEAD_WINDOW`` rows.

Both: a member after a near tie decodes its next position plainly; a step's time counts only when nothing
else ran on the device since the last step (a newcomer's prefill, another lane).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .adaptive import PLAIN_TIMED_MIN, DepthPolicy
from .sequence import SequenceState

if TYPE_CHECKING:
    from .generate import Engine
    from .round import Decision

# Head rows an adaptive run keeps waiting while its policy decodes plainly (K = 0); the rows before them never
# reach the head. A probe first runs the head over the rows waiting since the last one: on a compute-bound
# CPU a long catch-up cost as much as the probe round itself. The head's context then has a gap before its
# last HEAD_WINDOW rows: too short a window lands fewer drafts, which biases the policy against drafting
# (docs/performance.md, "The engine's constants").
HEAD_WINDOW = 32
BATCH_HEAD_WINDOW = 4  # a batch decoding plainly feeds its members' heads nothing: a head row costs a layer
HEAD_FLUSH_ROWS = 256  # a forced depth's plain stretch feeds its head in batches of this many rows
UNBOUNDED = 1 << 30


@dataclass
class Plan:
    """One decision of the depth policy: the round's depth (``k``, for the adaptive members; a batch of one:
    its member's), or a plain stretch of ``steps`` steps."""

    size: int  # the batch's size when it was made
    k: int
    steps: int = 1  # a plain stretch: plain steps before the next plan
    window: int | None = None  # while plain: head rows an adaptive member keeps (None: all, flushed in batches)
    time_after_catch_up: bool = False  # a round is timed from after its head's catch-up (one extra sync)
    policy: DepthPolicy | None = None  # a batch of one: its member's policy, which chose

    def depth(self, run: SequenceState) -> int:
        """What ``run`` drafts in this step."""
        policy = run.policy
        if policy is None or run.near_tie:
            return 0
        return policy.fixed_k if policy.fixed_k is not None else self.k

    def windowed(self, run: SequenceState) -> bool:
        return self.window is not None and run.adaptive


@dataclass
class Stretch:
    """Plain steps a plan chose, timed as one from the start of the first to the end of the last."""

    plan: Plan
    start: float
    quiet: bool  # nothing else ran on the device since the step before it
    pipelined: bool  # it followed a plain step (its first step's time overlaps that one's compute)
    steps: int = 0

    @property
    def left(self) -> int:
        return self.plan.steps - self.steps

    @property
    def done(self) -> bool:
        return self.steps >= self.plan.steps


class StepDepth:
    """The depth policy of one engine's batches (see the module's doc)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def plan(self, runs: Sequence[SequenceState]) -> Plan:
        size = len(runs)
        if size == 1:
            run = runs[0]
            policy = run.policy
            if run.near_tie:
                return Plan(1, 0, steps=1, policy=policy)
            if policy is None:
                return Plan(1, 0, steps=UNBOUNDED)
            k = policy.choose()
            if k > 0:
                return Plan(1, k, time_after_catch_up=True, policy=policy)
            return Plan(1, 0, steps=policy.plain_budget(), window=HEAD_WINDOW if run.adaptive else None,
                        policy=policy)
        k = self.engine.batch_policy().choose(size) if any(run.adaptive for run in runs) else 0
        return Plan(size, k, window=BATCH_HEAD_WINDOW)

    def plain_ran(self, stretch: Stretch, seconds: float, runs: Sequence[SequenceState]) -> None:
        """``stretch`` ended after ``seconds`` (its members: ``runs``)."""
        plan = stretch.plan
        if plan.size == 1:
            if plan.policy is not None:
                timed = stretch.quiet and stretch.steps >= PLAIN_TIMED_MIN  # shorter: mostly the first step
                plan.policy.observe_plain(stretch.steps, seconds if timed else None)
        elif any(run.adaptive for run in runs):
            # A pipelined step's time is the previous step's compute: timed only after a plain step.
            timed = stretch.quiet and stretch.pipelined
            self.engine.batch_policy().observe_plain(plan.size, seconds if timed else None)

    def round_ran(self, plan: Plan, runs: Sequence[SequenceState], decisions: Sequence[Decision], seconds: float,
                  quiet: bool, waiting: Sequence[int]) -> None:
        """A round under ``plan`` ran in ``seconds`` (from after the head's catch-up where the plan timed it
        apart) for ``runs``, whose heads had ``waiting`` rows before it."""
        k = max(d.drafts.k for d in decisions)
        if plan.size == 1:
            assert plan.policy is not None
            plan.policy.observe_round(k, decisions[0].accepted, seconds if quiet else None)
            return
        for run, decision in zip(runs, decisions, strict=True):
            if decision.drafts.k:
                assert run.policy is not None
                run.policy.tracker.observe(decision.drafts.k, decision.accepted)
        if any(run.adaptive for run in runs):
            # A round that first feeds the heads more than a window of rows is not a typical round's time.
            catch_up = any(w > max(k + 1, BATCH_HEAD_WINDOW) for w in waiting)
            typical = (quiet and len(runs) == plan.size and not catch_up
                       and all(d.drafts.k == k for d in decisions))
            self.engine.batch_policy().observe_round(plan.size, k, seconds if typical else None)

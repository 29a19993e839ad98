"""A speculative round built while the round before computes: the host's work hidden behind the device's.

A plain step is pipelined (the host builds step n + 1 while the device computes step n), a round could not be:
its drafts feed on the round before's verdict. On a GPU at 9B the host then builds a verify call for 4-7 ms while
the device waits (an H200: a K = 1 round cost 1.40 plain steps, ``docs/performance.md``). So, for a batch of one
decoding greedily, once round n's verify call is launched, round n + 1 is built on the assumption that round n
keeps all its drafts (its likeliest outcome where drafting pays): the caches rolled forward as that commit
would (lazily: its tokens are device arrays still), the head's drafts and the next verify call built on them,
nothing of it evaluated. Then round n's verdict is read:

- all K drafts and the token after them kept, the request not ended: round n + 1 is the one the loop would
  build; the next step launches it as it is (``BatchDecoder``), unless the depth policy chose another depth or
  the batch changed, which ``abandon`` the prebuilt round;
- anything else: ``reject`` puts back every state the assumption touched, and round n commits as it always did.

What the assumption touches, snapshotted before it (``Snapshot``): the backbone's caches (attention KV, the
GatedDeltaNet caches and their recorded call), the head's cache and waiting rows, the sequence's pending token and
phase. An MLX array assigned into in place (``a[i] = b``, as mlx-lm's KVCache writes its keys) keeps its handle,
so a snapshot holds new handles of the same arrays (``copy.copy``): the prebuilt graph is dropped with it,
never evaluated.

The same graphs, built in the same order on the same values: output is what the loop without it computes, token
for token (the tests assert it: greedy rounds against plain decoding, and against rounds without this).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from .forward import Forward
from .round import Drafts, VerifyCall, advance, build_verify, draft
from .sequence import SequenceState


def _held(value: Any) -> Any:
    """``value`` with every MLX array in it (in lists, tuples, dicts) as a new handle: assigning into the
    original in place leaves these as they were."""
    kind = type(value)  # exactly these (an nn.Module is a dict: kept as it is)
    if kind is mx.array:
        return copy.copy(value)
    if kind is list:
        return [_held(v) for v in value]
    if kind is tuple:
        return tuple(_held(v) for v in value)
    if kind is dict:
        return {k: _held(v) for k, v in value.items()}
    return value


class Snapshot:
    """The state of some objects (their attributes, arrays held by new handles), to put back."""

    def __init__(self, objects: list[Any]) -> None:
        self.saved = [(obj, {k: _held(v) for k, v in vars(obj).items()}) for obj in objects]

    def restore(self) -> None:
        """Put the state back (as new handles again: the snapshot stays usable)."""
        for obj, attributes in self.saved:
            vars(obj).clear()
            vars(obj).update(_held(attributes))


def touched(run: SequenceState, cache: list[Any]) -> list[Any]:
    """The objects a round's commit and the next round's drafts and verify call change: the backbone's caches,
    the head's rows and cache."""
    return [*cache, run.head, run.head.cache]


@dataclass
class RoundAhead:
    """Round n + 1 of ``run``, built at depth ``k`` while round n computed, on round n kept whole."""

    run: SequenceState
    k: int
    drafts: Drafts
    call: VerifyCall
    waiting: int  # the head's waiting rows before these drafts (what ``StepDepth.round_ran`` is told)
    at_commit: Snapshot  # the state before round n's commit (``reject``)
    before: Snapshot  # the state after round n kept whole, before round n + 1 was built (``abandon``)
    pending: tuple[tuple[Any, Any], tuple[Any, Any]]  # the run's (pending token, phase) at those two points

    def reject(self) -> None:
        """Round n did not keep all its drafts (or the request ended in it): the state before its commit."""
        self.at_commit.restore()
        self.run.pending_token, self.run.phase = self.pending[0]

    def abandon(self) -> None:
        """Round n + 1 will not run as built (another depth, the batch changed, the run ended): the state after
        round n, as if nothing had been built."""
        self.before.restore()
        self.run.pending_token, self.run.phase = self.pending[1]

    @contextlib.contextmanager
    def as_after_round(self, cache: list[Any]) -> Iterator[None]:
        """The state after round n for a while (invariant checks between steps), then back to round n + 1 built."""
        now = Snapshot(touched(self.run, cache))
        pending = (self.run.pending_token, self.run.phase)
        self.abandon()
        try:
            yield
        finally:
            now.restore()
            self.run.pending_token, self.run.phase = pending


def build_ahead(run: SequenceState, call: VerifyCall, forward: Forward, cache: list[Any],
                rollback: Callable[[int, list[int]], None], logits_of: Callable[[mx.array], mx.array],
                time_after_catch_up: bool) -> RoundAhead:
    """Round n + 1 of ``run`` at round n's depth, built on round n's verify ``call`` (launched, not decided)
    kept whole: round n's commit applied lazily (its drafts and the token after them, device arrays), then the
    head's drafts and the verify call, nothing evaluated."""
    k = call.k
    decision = call.decisions[0]
    at_commit = Snapshot(touched(run, cache))
    pending0 = (run.pending_token, run.phase)
    tokens = mx.concatenate([decision.drafts.tokens, decision.verdict.replacement[k : k + 1]]).astype(mx.uint32)
    advance(run, decision, call.hidden, tokens, True)
    rollback(k + 1, [k + 1])
    before = Snapshot(touched(run, cache))
    pending1 = (run.pending_token, run.phase)
    waiting = run.head.waiting
    drafts = draft(run, k, time_after_catch_up, ahead=k + 1)
    following = build_verify([run], [drafts], forward, cache, logits_of, lazy=True)
    return RoundAhead(run, k, drafts, following, waiting, at_commit, before, (pending0, pending1))

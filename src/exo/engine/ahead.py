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
import functools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from .forward import Forward
from .round import Drafts, VerifyCall, advance, build_verify, draft
from .sequence import SequenceState

log = logging.getLogger(__name__)


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


@contextlib.contextmanager
def after_round(built: RoundAhead | ChainedRound, cache: list[Any]) -> Iterator[None]:
    """The state after the round ``built`` follows, for a while (invariant checks between steps), then back to
    ``built`` as it was built."""
    run = built.run
    now = Snapshot(touched(run, cache))
    pending = (run.pending_token, run.phase)
    built.abandon()
    try:
        yield
    finally:
        now.restore()
        run.pending_token, run.phase = pending


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

    def as_after_round(self, cache: list[Any]) -> contextlib.AbstractContextManager[None]:
        return after_round(self, cache)


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


# -- chained rounds: the next round built and launched on this one's verdict as the device holds it -------------
#
# ``EXO_NATIVE_MTP_ROUND_AHEAD=chain``. A round built ahead on the assumption that it keeps everything waits for
# the verdict before it is launched (what it assumed may be wrong); on MLX CUDA the launch is the host's work, and
# the device is idle from its last kernel of round n to the first of round n + 1: the verdict's read, the commit,
# the next round's build. Here round n + 1 is built on round n's verdict as device arrays, whatever it is (how many
# rows it keeps, the token after them), and launched before the host reads round n's:
#
# - the backbone's attention caches are written at a device position (``models.positions``: the position after
#   round n's kept rows), their GatedDeltaNet caches keep round n's state by index (``commit_at``);
# - the head takes all of round n's rows at its device position (the rows past the kept ones are written over by
#   the next call before anything reads them) and drafts from its output at the last kept row;
# - the pending token is round n's replacement at its accepted count.
#
# The host then reads round n's verdict and emits its tokens. Where round n ended the request, or left its next
# token to a plain step (a near tie), ``reject`` puts back the state before round n's commit (round n + 1 ran for
# nothing) and round n commits as it always does. Every row a round keeps computes plain decoding's bits
# (``tests/engine/test_positions.py``): the output is the loop's without chaining, token for token.


def _attention(caches: list[Any]) -> list[Any]:
    """The backbone's attention caches among ``caches``."""
    from .models.layers import RollbackArraysCache

    return [c for c in caches if not isinstance(c, RollbackArraysCache)]


def _light(caches: list[Any]) -> list[tuple[Any, dict[str, Any]]]:
    """What a chained round changes in the backbone's GatedDeltaNet caches (their arrays and the recorded call; the
    attention caches are set from the host's positions, their buffers never need putting back)."""
    from .models.layers import RollbackArraysCache

    return [(c, {k: _held(v) for k, v in vars(c).items()}) for c in caches if isinstance(c, RollbackArraysCache)]


def _put_back(saved: list[tuple[Any, dict[str, Any]]]) -> None:
    for obj, attributes in saved:
        vars(obj).clear()
        vars(obj).update(_held(attributes))


@dataclass
class ChainedRound:
    """Round n + 1 of ``run`` at depth ``k``, built on round n's device verdict and launched; ``first`` is its
    first row's position on the device. ``confirm`` (round n read, the chain goes on), ``reject`` (round n ended
    it: the state before round n's commit) or ``abandon`` (round n + 1 will not run: the state after round n,
    committed as the loop commits) end what it assumed."""

    run: SequenceState
    k: int
    drafts: Drafts
    call: VerifyCall
    first: mx.array
    before_first: int  # round n's first position (the host knows it)
    head_first: mx.array  # the head's entries before it takes round n + 1's rows (its own count: a gap it
    head_before_first: int  # never saw, ``HeadRows.skipped``, is not in it); before round n's rows
    cache: list[Any]
    previous: VerifyCall  # round n's
    at_commit: list[tuple[Any, dict[str, Any]]]  # the GatedDeltaNet caches before round n's commit
    before: list[tuple[Any, dict[str, Any]]]  # ... after round n's commit (on the device), before round n + 1
    pending: tuple[Any, Any]  # the run's (pending token, phase) before round n's commit
    waiting: int = 0  # round n's kept rows, once read: what the head took in first (``StepDepth.round_ran``)
    first_host: int | None = None  # ``first`` once round n's verdict is read
    head_first_host: int | None = None  # ``head_first`` likewise
    kept_tokens: list[int] = field(default_factory=list)  # round n's tokens, once read

    def confirm(self, tokens: list[int]) -> None:
        """Round n was read: it kept ``tokens`` (decided, the request goes on), as round n + 1 assumed. The caches'
        bounds come back to the rows written (each round moves them on by every row it writes: at low acceptance
        they would run ahead of the positions filled, the buffers and the kernel's chunks with them)."""
        self.kept_tokens = tokens
        self.waiting = len(tokens)
        self.first_host = self.before_first + len(tokens)
        self.head_first_host = self.head_before_first + len(tokens)
        for c in _attention(self.cache):
            c.offset = self.first_host + self.k + 1  # (round n + 1's rows)
        # the head: round n's rows, then round n + 1's speculative entries after its kept ones
        self.run.head.cache.offset = max(self.head_before_first + self.previous.k + 1,
                                         self.head_first_host + self.k - 1)

    def reject(self) -> None:
        """Round n ended the request or left its next token to a plain step: the state before its commit (its
        verify call's rows written, the head's speculative entries in), as the loop commits it."""
        _put_back(self.at_commit)
        self._as_built(self.before_first, self.head_before_first, self.previous.k)
        self.run.pending_token, self.run.phase = self.pending

    def unchain(self) -> None:
        """This round (launched, read) commits as the loop commits a round, with no round after it: its caches at
        the host's positions, as after its verify call was built."""
        assert self.first_host is not None and self.head_first_host is not None
        self._as_built(self.first_host, self.head_first_host, self.k)

    def _as_built(self, first: int, head_first: int, k: int) -> None:
        """The caches at the host's positions as after a verify call of depth ``k`` built at ``first`` (the
        backbone's) and ``head_first`` (the head's, before its K - 1 speculative entries)."""
        from .models import positions

        for c in _attention(self.cache):
            positions.settle(c, first + k + 1)
        positions.settle(self.run.head.cache, head_first + k - 1)

    def abandon(self) -> None:
        """Round n + 1 will not run as built: the state after round n committed as the loop commits (the head's
        kept rows waiting for it)."""
        from .models import positions

        assert self.first_host is not None, "a chained round is abandoned once the round before it was read"
        _put_back(self.before)
        for c in _attention(self.cache):
            positions.settle(c, self.first_host)
        head = self.run.head
        positions.settle(head.cache, self.head_before_first)
        kept = len(self.kept_tokens)
        head.wait_only(self.previous.hidden[:, :kept], mx.array(self.kept_tokens, dtype=mx.uint32))
        self.run.pending_token = mx.array(self.kept_tokens[-1:], dtype=mx.uint32)
        self.run.phase = self.pending[1]

    def as_after_round(self, cache: list[Any]) -> contextlib.AbstractContextManager[None]:
        return after_round(self, cache)


def chain_applies(run: SequenceState) -> bool:
    """Whether ``run``'s rounds can be chained: every kept row then computes plain decoding's bits where the
    backbone's attention layers attend at a device position as a plain step attends (exo's attention kernel on
    MLX CUDA; MLX's attention on its CPU backend, whose masked rows round as unmasked ones); the head tracked."""
    from .kernels.cuda_attn import on_cuda
    from .models import layers

    if not run.head.tracked or run.head.module is None:
        return False
    if on_cuda():
        state = run.engine.__dict__  # (found once: a walk of the model's modules is the host's work a round)
        if "_chain_kernels" not in state:
            attention = [m for m in run.model.modules() if isinstance(m, layers.Attention)]
            state["_chain_kernels"] = bool(attention) and all(m.attn_kernel for m in attention) and dynamic_ops()
        return layers.ATTN_KERNEL_ON and state["_chain_kernels"]
    return mx.default_device() == mx.cpu and not run.engine.verify_mode.per_row_attention


@functools.cache
def dynamic_ops() -> bool:
    """Whether this device computes the ops a chained round's positions take (a slice and an update at an array
    offset, a take by an array index) as the same ops at Python offsets do; a device that cannot leaves rounds
    unchained (logged)."""
    try:
        a = mx.arange(2 * 3 * 10 * 4, dtype=mx.float32).reshape(2, 3, 10, 4)
        u = -mx.ones((2, 3, 2, 4))
        at = mx.array(5, dtype=mx.int32).reshape(1)
        got = [mx.slice_update(a, u, at, axes=(2,)), mx.slice(a, at, axes=(2,), slice_size=(2, 3, 3, 4)),
               mx.take(a, at - 1, axis=2)]
        b = mx.array(a)
        b[:, :, 5:7] = u
        want = [b, a[:, :, 5:8], a[:, :, 4:5]]
        return all(bool(mx.array_equal(x, y).item()) for x, y in zip(got, want, strict=True))
    except Exception as e:  # noqa: BLE001 - any failure leaves rounds unchained
        log.warning("chained rounds off on this device: its dynamic slices failed (%s: %s)", type(e).__name__,
                    str(e)[:200])
        return False


def _replay_table(run: SequenceState) -> mx.array:
    """A benchmark's replayed drafts (``engine.replay``) for every output position of ``run``, on the device (a
    chained round's position is one): the drafter's draws depend on the position alone."""
    table = run.__dict__.get("_replay_table")
    if table is None:
        replay = run.engine.replay
        assert replay is not None
        length = run.output.max_tokens + 2 * MAX_CHAIN_DEPTH + 2
        table = mx.array(replay.drafts(run.request.prompt_tokens, 0, length), dtype=mx.uint32)
        run.__dict__["_replay_table"] = table
    return table


MAX_CHAIN_DEPTH = 8


def build_chained(run: SequenceState, call: VerifyCall, forward: Forward, cache: list[Any],
                  logits_of: Callable[[mx.array], mx.array], chained: ChainedRound | None) -> ChainedRound:
    """Round n + 1 of ``run`` at round n's depth, on round n's verify ``call`` (launched, not read) as its verdict
    stands on the device: its caches at the positions after round n's kept rows, the head fed round n's rows, its
    drafts and verify call built (``chained``: round n where it was a chained round, confirmed; None: round n was
    not, its caches at the host's positions)."""
    from .models import positions
    from .models.layers import RollbackArraysCache
    from .sequence import Phase

    k = call.k
    decision = call.decisions[0]
    verdict = decision.verdict
    head = run.head
    if chained is None:
        before_first = _attention(cache)[0].offset - (k + 1)
        first = mx.array(before_first, dtype=mx.int32)
        head_before_first = head.cache.offset - (k - 1)  # (after its speculative entries)
        head_first = mx.array(head_before_first, dtype=mx.int32)
    else:
        assert chained.first_host is not None and chained.head_first_host is not None
        before_first, first = chained.first_host, chained.first
        head_before_first, head_first = chained.head_first_host, chained.head_first
    at_commit = _light(cache)
    pending = (run.pending_token, run.phase)
    output_at = len(run.output.tokens)

    # round n's verdict on the device: its accepted drafts (up to a near tie), the token after them
    ok = verdict.accepted if verdict.decided is None else mx.logical_and(verdict.accepted, verdict.decided[:k])
    accepted = mx.cumprod(ok.astype(mx.int32)).sum().astype(mx.int32)
    kept = accepted + 1
    last = mx.take(verdict.replacement, accepted.reshape(1)).astype(mx.uint32)
    following_tokens = mx.where(mx.arange(k + 1) < accepted,
                                mx.concatenate([decision.drafts.tokens, last]).astype(mx.uint32), last)
    # the backbone's caches after round n's kept rows (one position array for them all)
    following_first = first + kept
    for c in cache:
        if isinstance(c, RollbackArraysCache):
            c.commit_at(kept)
        else:
            positions.start(c, following_first, c.offset)
    before = _light(cache)
    # the head: round n's rows at its position, its drafts from the last kept row
    positions.start(head.cache, head_first, head.cache.offset)
    out = head.module(head.embed(following_tokens[None]), call.hidden, head.cache)
    positions.rewind(head.cache, head_first + kept)
    out = mx.take(out, accepted.reshape(1), axis=1)
    tokens: list[mx.array] = []
    history = run.choice.history
    for i in range(k):
        if i > 0:
            out = head.next_draft(tokens[-1], out)
        token, _, _, history = run.choice.draft(run.model.logits(out)[:, -1], history)
        tokens.append(token)
    draft_tokens = mx.concatenate(tokens).astype(mx.uint32)
    if run.engine.replay is not None:  # a benchmark's known continuation: the head ran, its tokens go
        draft_tokens = mx.take(_replay_table(run), output_at + kept + mx.arange(k, dtype=mx.int32))
    drafts = Drafts(k, draft_tokens, [], [], False)
    run.pending_token, run.phase = last, Phase.EMITTED
    following = build_verify([run], [drafts], forward, cache, logits_of, lazy=True)
    return ChainedRound(run, k, drafts, following, following_first, before_first, head_first + kept,
                        head_before_first, cache, call, at_commit, before, pending)

"""A batch's two kinds of step (a plain step, a speculative round of every member), and what a step hands back.

A plain step (K = 0) is ONE backbone call over a row per member; each row penalised, masked by its grammar
and sampled with its own run's parameters and PRNG key stream (a seed reproduces the solo samples), its
logprobs evaluated with the step. Plain steps are pipelined: a step's ``finish`` emits the tokens fed to it
(its members' pending tokens, computed by the step before) while the step itself computes, so a run that
finishes has one wasted row computed after its last token, unless every run's pending token is its last
(``PlainSteps.settle`` emits them with no step).

A speculative round (``speculative_round``): each member drafts with its head (``round.draft``, its own head
cache), ONE verify call of [B, K+1] rows, then per member its own verdict and commit (``round.build_verify``, ``round.commit``),
and the caches rolled back per member; the depth policy observes the round (``StepDepth.round_ran``).

Invariant (``PlainSteps.last``): the last plain step's tokens are the next step's input row only while the
members' pending tokens are exactly the arrays it computed, in that order (``build`` checks it: a member that
joined or ran a round since has another); a member taken out between steps, or the batch dropped, forgets them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from .ahead import ChainedRound, RoundAhead, build_ahead, build_chained
from .batch_cache import BatchCaches
from .depth import HEAD_FLUSH_ROWS, Plan, StepDepth, Stretch
from .forward import Forward
from .request import GenerationChunk
from .round import advance, build_verify, commit, draft, settle
from .sequence import SequenceState

Results = list[tuple[SequenceState, list[GenerationChunk]]]


@dataclass
class Prepared:
    """A step whose graph is built: evaluate ``arrays`` (none: it has run), then ``finish()`` emits."""

    arrays: list[mx.array]
    finish: Callable[[], Results]


def ended(run: SequenceState, chunks: list[GenerationChunk]) -> bool:
    """Whether ``run`` ended at this step (finished, or cancelled now): then its final chunk is appended."""
    if run.output.finish is None:
        run.cancelled()
    if run.output.finish is None:
        return False
    chunks.append(run.final_chunk())
    return True


@dataclass
class PlainStep:
    """One plain step's graph: ``arrays`` to evaluate; ``emit`` then hands out the tokens fed to it."""

    arrays: list[mx.array]
    fed: list[mx.array]  # each member's token fed to the step (its pending token)
    following: list[mx.array]  # each member's next token, computed by the step
    lp_rows: list[Any]  # each member's logprobs rows (None: none asked)
    fed_last: mx.array | None  # the fed tokens as one array an earlier step computed (None: each its own)

    def emit(self, runs: list[SequenceState], counted: int) -> tuple[Results, list[int]]:
        """Each member's chunks, and the members that stay (the others ended at this step)."""
        # The tokens fed to this step, read while it runs: from the arrays an earlier evaluation computed (the
        # last step's outputs, a first token), not from this step's graph (its input row): MLX signals the
        # arrays of one ``async_eval`` together, at its end, so reading an array of this step waited for all
        # of it, and the host built the next step only then.
        if self.fed_last is not None:
            values = self.fed_last.tolist()  # the last step's tokens, all of them: one read
        else:  # members joined, left or ran a round since: each its own
            values = [int(t.item()) for t in self.fed]
        out: Results = []
        keep: list[int] = []
        for i, run in enumerate(runs):
            chunks: list[GenerationChunk] = []
            if not run.pending_emitted:
                chunks.extend(run.emit_pending(values[i]))
            if not ended(run, chunks):
                keep.append(i)
                run.computed(self.following[i], counted, self.lp_rows[i])
            out.append((run, chunks))
        return out, keep


class PlainSteps:
    """The plain steps of one batch (see the module's doc), and the last one's tokens."""

    def __init__(self) -> None:
        self.last: tuple[mx.array, list[mx.array]] | None = None  # the last plain step's tokens (all, each)

    def forget(self) -> None:
        """The members changed (or a round ran): the next step feeds each member's own pending token."""
        self.last = None

    def build(self, runs: list[SequenceState], stretch: Stretch, hidden_of: Callable[[mx.array], mx.array],
              logits_of: Callable[[mx.array], mx.array]) -> PlainStep:
        """The graph of a plain step of ``runs`` under ``stretch`` (``hidden_of``: the backbone over the input
        row on the batch's caches; ``logits_of``: its logits)."""
        plan = stretch.plan
        fed = [r.pending_token for r in runs]
        # The last plain step's tokens, when this one feeds on all of them (no member joined, left or ran a
        # round since): its input row, and what ``PlainStep.emit`` reads back in one transfer.
        last = self.last
        fed_last = last[0] if last is not None and len(last[1]) == len(fed) and all(
            a is b for a, b in zip(last[1], fed, strict=True)) else None
        inputs = fed_last if fed_last is not None else mx.concatenate([t.reshape(1) for t in fed])  # type: ignore[union-attr]
        hidden = hidden_of(inputs[:, None])
        logits = logits_of(hidden)[:, -1]  # [B, V]
        one = len(runs) == 1
        greedy: mx.array | None = None
        following: list[mx.array] = []
        lp_rows: list[Any] = []
        for i, run in enumerate(runs):
            # While the policy decodes plainly an adaptive member's head takes only its last ``plan.window``
            # rows (engine.depth), so the rows before them are never recorded (keeping and dropping a row per
            # token costs adaptive decoding measurably on plain stretches: docs/performance.md, "The code's reasons").
            windowed = plan.windowed(run)
            skip = windowed and stretch.left > plan.window  # type: ignore[operator]
            row = None if skip else hidden if one else hidden[i : i + 1]  # alone: no slice op
            if run.choice.bare_greedy:  # one argmax for all of them: what ``choose`` takes
                if greedy is None:
                    greedy = mx.argmax(logits, axis=-1).astype(mx.uint32)
                token = greedy if one else greedy[i : i + 1]
                rows = None
            else:
                # Under a grammar ``choose`` reads the member's pending token (the last step's output) for its
                # mask: this step's graph waits for the last step there, as a solo constrained step does.
                token, rows = run.choice.choose(logits[i : i + 1])
            run.head.wait(row, token)
            following.append(token)
            lp_rows.append(rows)
            if windowed:
                if not skip:
                    run.head.keep_window(plan.window)  # type: ignore[arg-type]
            elif run.head.waiting >= HEAD_FLUSH_ROWS:
                run.head.flush_async()
        # The step's tokens in one array too, an output of the same evaluation (the next step's input row).
        all_greedy = greedy is not None and all(run.choice.bare_greedy for run in runs)
        tokens = greedy if all_greedy else mx.concatenate([t.reshape(1) for t in following])
        self.last = (tokens, following)
        logprobs = [a for rows in lp_rows if rows is not None for a in rows.arrays()]  # evaluated with the step
        stretch.steps += 1
        return PlainStep([*following, tokens, *logprobs], fed, following, lp_rows, fed_last)

    @staticmethod
    def settle(runs: list[SequenceState]) -> tuple[Results, list[int]]:
        """Emit the tokens the last plain step computed, with no step (a round feeds on emitted tokens, or every
        pending token is its run's last): each run's chunks, and the runs that stay (a finished one's final
        chunk appended)."""
        out: Results = [(run, []) for run in runs]
        waiting = [i for i, run in enumerate(runs) if not run.pending_emitted]
        if not waiting:
            return out, list(range(len(runs)))
        values = mx.concatenate([runs[i].pending_token.reshape(1) for i in waiting]).tolist()  # type: ignore[union-attr]
        for i, value in zip(waiting, values, strict=True):
            out[i][1].extend(runs[i].emit_pending(value))
        keep = [i for i, run in enumerate(runs) if run.output.finish is None]
        for run, chunks in out:
            if run.output.finish is not None:
                chunks.append(run.final_chunk())
        return out, keep


def speculative_round(runs: list[SequenceState], plan: Plan, out: Results, forward: Forward, caches: BatchCaches,
                      logits_of: Callable[[mx.array], mx.array], depth: StepDepth, quiet: bool,
                      counted: int, built: RoundAhead | ChainedRound | None = None,
                      look_ahead: bool | str = False) -> tuple[list[int], RoundAhead | ChainedRound | None]:
    """One speculative round of every run under ``plan`` (``out``: each run's chunks so far, appended to;
    ``logits_of``: the verify call's logits; ``quiet``: nothing else ran since the last step; ``counted``: the
    batch size a run's stats count). ``built``: this round, built while the round before computed
    (``engine.ahead``); ``look_ahead``: build the next round while this one computes (a batch of one, decoding
    greedily). Returns the runs that stay (the others ended in it) and the next round where it was built and
    this round kept all its drafts."""
    start = time.perf_counter()
    for run in runs:
        run.stats.round_started(start)

    def mark(phase: str) -> None:
        for run in runs:
            run.stats.mark(phase)

    chained = built if isinstance(built, ChainedRound) else None
    if built is not None:  # its host work is done: only its launch and the device's work are left
        waiting, drafts, call = [built.waiting], [built.drafts], built.call
        mark("draft_build")
    else:
        waiting = [run.head.waiting for run in runs]
        drafts = [draft(run, plan.depth(run), plan.time_after_catch_up) for run in runs]
        mark("draft_build")
        call = build_verify(runs, drafts, forward, caches.cache, logits_of)
    mark("verify_build")
    arrays = call.arrays()
    following: RoundAhead | ChainedRound | None = None
    if look_ahead == "chain":  # the next round built on this one's verdict as the device holds it, launched now
        if chained is None:
            mx.async_eval(*arrays)  # (a chained round was launched as it was built)
        following = build_chained(runs[0], call, forward, caches.cache, logits_of, chained)
        mx.async_eval(*following.call.arrays())
    elif look_ahead:
        mx.async_eval(*arrays)  # the device computes this round while the host builds the next
        following = build_ahead(runs[0], call, forward, caches.cache, caches.rollback, logits_of,
                                plan.time_after_catch_up)
    if following is None and chained is not None:
        chained.unchain()  # (no round after it: it commits as any round)
    mx.eval(*arrays)
    mark("device_wait")
    decisions = call.decisions
    if isinstance(following, ChainedRound):
        run, decision = runs[0], decisions[0]
        tokens, decided, last = settle(run, decision)
        if decided and run.output.finish is None:
            following.confirm(tokens)  # the device committed it as the host now reads it
        else:
            following.reject()  # (it ran for nothing) this round commits as the loop commits
            following = None
            advance(run, decision, call.hidden, tokens, decided, last)
            caches.rollback(call.k + 1, [len(tokens)])
    elif following is not None:
        run, decision = runs[0], decisions[0]
        tokens, decided, last = settle(run, decision)
        if not (decided and len(tokens) == call.k + 1 and run.output.finish is None):
            following.reject()  # round n's commit as the loop does it, on the state before the assumption
            following = None
            advance(run, decision, call.hidden, tokens, decided, last)
            caches.rollback(call.k + 1, [len(tokens)])
    else:
        one = len(runs) == 1
        kept = [commit(run, decision, call.hidden if one else call.hidden[b : b + 1])
                for b, (run, decision) in enumerate(zip(runs, decisions, strict=True))]
        caches.rollback(call.k + 1, kept)
    end = time.perf_counter()
    timed_from = drafts[0].timed_from  # (only a batch of one times its head's catch-up apart)
    depth.round_ran(plan, runs, decisions, end - (timed_from or start), quiet, waiting)
    mark("rollback")
    chunks_of = {id(run): chunks for run, chunks in out}
    keep: list[int] = []
    for i, (run, decision) in enumerate(zip(runs, decisions, strict=True)):
        chunks = chunks_of[id(run)]
        run.stats.mark("emit")
        run.stats.round_ended()
        run.stats.round_ran(counted, decision.drafts.k, len(decision.emitted))  # (``commit`` emitted them)
        chunks.extend(run.drain())
        if not ended(run, chunks):
            keep.append(i)
    if following is not None and not keep:
        following.abandon()  # (cancelled now)
        following = None
    return keep, following

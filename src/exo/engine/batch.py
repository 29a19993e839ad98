"""Continuous batching: decode steps and native-MTP rounds for several generation runs of one model at once.

Every generation decodes here: a solo request is a batch of one (``Engine.generate``, the device queue). A run
(``SequenceState``) prefills and emits its first token alone (``SequenceState.begin``), then
``BatchDecoder.add`` takes it. Each ``step`` is, for every run at once, one of:

- a plain step (K = 0): ONE backbone call over a row per run; each row penalised, masked by its grammar and
  sampled with its own run's parameters and PRNG key stream (a seed reproduces the solo samples), its
  logprobs evaluated with the step. Plain steps are pipelined: a step's next tokens are computed while the
  host emits the tokens fed to it (a run that finishes has one wasted row computed after its last token,
  unless every run's pending token is its last);
- a speculative round: each run drafts with its head (``round.draft``, its own head cache), ONE verify call of
  [B, K+1] rows, then per run its own verdict and commit (``round.build_verify``, ``round.commit``), and the caches rolled back
  per run (runs accept different counts). A run whose depth is below the round's fills its rows past its
  drafts with its pending token, and keeps none of them.

Which of the two, at what depth, and what the policies learn from it: ``engine.depth`` (the one place where
a batch of one and a batch of several differ). Each run emits through its own output (stop strings, EOS,
max_tokens inside an accepted run, cancellation). Finished and cancelled runs leave the batch at the step's
end; new runs join between steps.

Where each part lives: ``batch_step`` (the plain step, the round, and what a step hands back), ``batch_clock`` (which
steps are timed for the depth policy), ``batch_cache`` (``BatchCaches``: a lone member's own caches, stepped
on in place so a batch of one costs what a solo loop did, until a second member joins; then a batch's rows,
attention KV in mlx-lm's left-padded ``BatchKVCache``, GatedDeltaNet state a row of a ``RollbackArraysCache``,
until the last leaves; each member's MTP head cache and the rows waiting for its head stay its own),
``batch_memory`` (what a batch may hold, and whether it fits the instance's KV budget). This module holds the
membership and the dispatch of each step (``BatchDecoder``), a run decoded alone (``decode_alone``) and the
lanes (``BatchLanes``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from .ahead import MAX_CHAIN_DEPTH, ChainedRound, RoundAhead, chain_applies
from .batch_cache import BatchCaches
from .batch_clock import StepClock
from .batch_memory import batch_bytes, batch_fits, sequence_bytes, stage_bytes
from .batch_step import PlainStep, PlainSteps, Prepared, Results, speculative_round
from .depth import Plan, StepDepth, Stretch
from .forward import LocalForward
from .models.layers import vector_matmul
from .prefix_cache import store_reply
from .request import GenerationChunk
from .sequence import SequenceState
from .verify import verify_logits

if TYPE_CHECKING:
    from .generate import Engine

log = logging.getLogger(__name__)

# Re-exported: the memory estimates, the caches and a step's results, as the runner and the tests import them.
__all__ = ["BatchCaches", "BatchDecoder", "BatchLanes", "Results", "batch_bytes", "batch_fits", "decode_alone",
           "default_lanes", "lane_streams", "sequence_bytes", "stage_bytes"]


class BatchDecoder:
    """The runs decoding together on one engine (one device thread drives it); ``stream``: the stream its
    steps run on (None: the default one).

    It holds the membership (``runs``, in the order of the caches' rows) and dispatches each step; the parts
    each own one concern: ``caches`` (``BatchCaches``: the one member's own caches, or the batch's rows),
    ``plain`` (``PlainSteps``: the plain steps' graphs and the last one's tokens), ``clock`` (``StepClock``:
    which steps are timed, for the depth policy) and ``depth`` (``StepDepth``: plain or a round, at what depth).
    Invariant between steps: ``runs`` and the caches' rows agree member for member, and no member has ended."""

    def __init__(self, engine: Engine, stream: mx.Stream | None = None) -> None:
        self.engine = engine
        self.stream = stream
        # Runs decoding together with this one's (its lanes' too: BatchLanes), what a run's stats count;
        # None: this batch's own.
        self.together: int | None = None
        self.runs: list[SequenceState] = []
        self.caches = BatchCaches(engine.forward)
        self.depth = StepDepth(engine)
        self.clock = StepClock()
        self.plain = PlainSteps()
        # The next round, built while the last one computed and kept all its drafts (``engine.ahead``): the
        # caches hold it built; ``_abandon`` puts back the state after the last round wherever it will not run.
        self._ahead: RoundAhead | ChainedRound | None = None

    def __len__(self) -> int:
        return len(self.runs)

    @property
    def cache(self) -> list[Any]:
        return self.caches.cache

    # -- membership ----------------------------------------------------------------------------------------
    def add(self, run: SequenceState) -> None:
        """A run at a step boundary (after ``begin()``, not finished) joins the batch."""
        if run.engine is not self.engine:
            raise ValueError("a batch decodes the runs of one engine")
        run.check_joinable()
        self._abandon()
        if self.runs:
            self.interleaved()  # its prefill ran on the device: the running stretch is not timed alone
        self._end_stretch()
        self.caches.join(self.runs, run)
        self.runs.append(run)

    def remove(self, run: SequenceState) -> None:
        """Take ``run`` out of the batch between steps (its consumer failed): the others decode on."""
        index = next(i for i, r in enumerate(self.runs) if r is run)
        self.plain.forget()
        self._keep([i for i in range(len(self.runs)) if i != index])

    def drop(self) -> None:
        """Every run leaves at once, with no final chunk (the batch's step failed: they end with its error);
        the batch's caches are dropped wherever the layers are."""
        self.plain.forget()
        self.clock.stretch = None
        self._keep([])

    def cancel_all(self) -> list[tuple[SequenceState, GenerationChunk]]:
        """End every run now (the device shuts down): each one's final chunk, finish "cancelled"."""
        out = []
        for run in self.runs:
            run.output.finish = run.output.finish or "cancelled"
            out.append((run, run.final_chunk()))
        self._keep([])
        return out

    def check_invariants(self) -> None:
        """Every member's ``SequenceState.check_invariants``, its positions read from its row of the batch's
        attention KV (its own caches: read there)."""
        ahead = self.ahead
        with ahead.as_after_round(self.caches.cache) if ahead is not None else contextlib.nullcontext():
            positions = self.caches.positions(len(self.runs))
            assert len(positions) == len(self.runs)
            for run, at in zip(self.runs, positions, strict=True):
                assert not self.caches.rows or not run.cache, "a member's caches are the batch's"
                run.check_invariants(at)

    @property
    def ahead(self) -> RoundAhead | ChainedRound | None:
        """The next round, built while the last one computed (its run knows it too: ``check_invariants``)."""
        return self._ahead

    @ahead.setter
    def ahead(self, ahead: RoundAhead | ChainedRound | None) -> None:
        if self._ahead is not None:
            self._ahead.run.ahead = None
        if ahead is not None:
            ahead.run.ahead = ahead
        self._ahead = ahead

    def _abandon(self) -> None:
        """A round built ahead will not run as built: the state after the last round, as if it never was."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None:
            ahead.abandon()

    def _keep(self, keep: list[int], ended: bool = False) -> None:
        """The members at ``keep`` stay (in that order); the batch's caches follow, wherever the layers are
        (the last one leaving drops them). ``ended``: the others leave at the end of a step (finished or
        cancelled, not failed): the finished ones store their reply first (``_store_ended``)."""
        self._abandon()
        if len(keep) < len(self.runs):
            self._end_stretch()
        if ended:
            self._store_ended(keep)
        runs, self.runs = self.runs, [self.runs[i] for i in keep]
        self.caches.keep(runs, keep)
        if not keep:
            self.clock.drained()

    def _store_ended(self, keep: list[int]) -> None:
        """Members that finished (not cancelled) keep their reply in the prefix cache (``store_reply``: a
        member's row of the batch's caches, before the filter drops it). Only where the engine has a prefix
        cache (taking a row costs a read of its padding)."""
        if self.engine.prefix_cache is None:
            return
        kept = set(keep)
        for i, run in enumerate(self.runs):
            if i not in kept and run.output.finish in ("stop", "length"):
                store_reply(run, *self.caches.member(i))

    # -- a step --------------------------------------------------------------------------------------------
    def interleaved(self) -> None:
        """Other work ran on the device since the last step (a newcomer's prefill): the next step's time
        (and the running stretch's) is not a step's alone."""
        self.clock.interleaved()

    def step(self) -> Results:
        """One decode step or speculative round of every run: the chunks each run emits (a finished run's
        last is its final chunk, with stats; it has left the batch)."""
        prepared = self.prepare()
        if prepared.arrays:
            mx.async_eval(prepared.arrays)
        return prepared.finish()

    def prepare(self) -> Prepared:
        """``step()`` up to its evaluation: a plain step's graph built (its ``arrays`` not evaluated yet), or
        a speculative round run whole (no arrays). ``BatchLanes`` evaluates several lanes' steps at once."""
        if not self.runs:
            return Prepared([], list)
        with self._on_stream():
            # A batch's rows compute each member as its solo step would (``EngineConfig.batch_invariant``).
            invariant = self.engine.config.batch_invariant and self.caches.rows
            if invariant:
                self.engine.forward.set_batch_invariant(True)
            try:
                prepared = self._prepare()
            finally:
                if invariant:
                    self.engine.forward.set_batch_invariant(False)

        def finish() -> Results:
            with self._on_stream():
                return prepared.finish()

        return Prepared(prepared.arrays, finish)

    def _on_stream(self) -> contextlib.AbstractContextManager[Any]:
        return mx.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def _prepare(self) -> Prepared:
        start, quiet = self.clock.step()
        runs = self.runs
        if all(not run.pending_emitted and len(run.output.tokens) + 1 >= run.output.max_tokens for run in runs):
            self._abandon()
            out = self._settle()  # every pending token is its run's last: no step computes past them
            return Prepared([], lambda: out)
        stretch = self.clock.stretch
        if stretch is None:
            plan = self.depth.plan(runs)
            built, self.ahead = self.ahead, None
            if built is not None and not (len(runs) == 1 and runs[0] is built.run and plan.depth(runs[0]) == built.k):
                built.abandon()  # the policy chose another depth (or plain steps)
                built = None
            if any(plan.depth(run) for run in runs):
                out = self._settle()  # a round feeds on emitted tokens (its time starts after a plain step's)
                if self.runs:
                    self._round(plan, out, quiet, built)
                elif built is not None:
                    built.abandon()
                return Prepared([], lambda: out)
            stretch = self.clock.start_stretch(plan, start, quiet)
        else:
            self._abandon()
        return self._plain_step(stretch, start)

    def _logits(self, hidden: mx.array, *, verify: bool = False) -> mx.array:
        engine = self.engine
        weight = engine.model.output_weight() if engine.config.batch_invariant and self.caches.rows else None
        if weight is not None and hidden.shape[0] * hidden.shape[1] > 1:
            return vector_matmul(hidden, weight)  # each row's logits as a solo step computes them
        return verify_logits(engine.model, hidden, engine.verify_mode) if verify else engine.model.logits(hidden)

    def _end_stretch(self) -> None:
        """The plain stretch under way ends (its steps ran, members joined or left): the depth policy
        observes it."""
        stretch = self.clock.end_stretch()
        if stretch is not None and stretch.steps and self.runs:
            self.depth.plain_ran(stretch, time.perf_counter() - stretch.start, self.runs)

    # -- plain steps (``batch_step``) ----------------------------------------------------------------------
    def _plain_step(self, stretch: Stretch, start: float) -> Prepared:
        """The graph of a plain step; its ``finish`` emits the tokens fed to it while the step computes."""
        step = self.plain.build(self.runs, stretch, lambda inputs: self.engine.forward.hidden(inputs, self.caches.cache),
                                self._logits)
        return Prepared(step.arrays, lambda: self._plain_emit(step))

    def _plain_emit(self, step: PlainStep) -> Results:
        out, keep = step.emit(self.runs, self.together or len(self.runs))
        self.clock.after_plain = True
        if self.clock.stretch is not None and self.clock.stretch.done:
            self._end_stretch()
        if len(keep) < len(self.runs):
            self._keep(keep, ended=True)
        return out

    def _settle(self) -> Results:
        """Before a round: emit the tokens the last plain step computed (a round feeds on emitted tokens);
        the runs they finish leave."""
        out, keep = PlainSteps.settle(self.runs)
        if len(keep) < len(self.runs):
            self._keep(keep, ended=True)
        return out

    # -- speculative rounds (``batch_step``) --------------------------------------------------------------
    def _round(self, plan: Plan, out: Results, quiet: bool, built: RoundAhead | ChainedRound | None = None) -> None:
        """One speculative round of every run under ``plan`` (``out``: each run's chunks so far, appended to;
        ``built``: this round, built while the last one computed)."""
        keep, self.ahead = speculative_round(self.runs, plan, out, self.engine.forward, self.caches,
                                             lambda hidden: self._logits(hidden, verify=True), self.depth, quiet,
                                             self.together or len(self.runs), built, self._looks_ahead(plan))
        self.clock.after_plain = False
        if len(keep) < len(self.runs):
            self._keep(keep, ended=True)

    def _looks_ahead(self, plan: Plan) -> bool | str:
        """Whether this round builds the next one while it computes (``engine.ahead``): a batch of one on this
        process's whole backbone, decoding greedily with nothing applied to its rows (no penalties, grammar or
        logprobs), with room left for another round after this one; "chain": built on this round's verdict as
        the device holds it and launched before the host reads it (``EXO_NATIVE_MTP_ROUND_AHEAD=chain``, where
        ``chain_applies``)."""
        mode = self.engine.config.round_ahead
        if mode == "off" or len(self.runs) != 1 or self.caches.rows:
            return False
        run = self.runs[0]
        k = plan.depth(run)
        if not (k > 0 and isinstance(self.engine.forward, LocalForward) and run.choice.bare_greedy
                and run.head.tracked and len(run.output.tokens) + k + 1 < run.output.max_tokens):
            return False
        if mode == "chain":
            return "chain" if k <= MAX_CHAIN_DEPTH and chain_applies(run) else False
        return True


def decode_alone(run: SequenceState) -> Iterator[GenerationChunk]:
    """``run``'s whole generation alone: ``begin``, then a batch of one until it ends. Finished, cancelled,
    failed or abandoned: its caches are dropped wherever the layers are (a pipeline's other stages too). When
    the loop failed, that error is the one reported: a failure of ``end`` (the stages are likely down for the
    same reason) is logged, never raised in its place."""
    batch = BatchDecoder(run.engine)
    try:
        if run.output.finish is None:  # else stopped during the engine's warm-up (``Engine.start``)
            yield from run.begin()
        if run.output.finish is not None:
            run.release()
            yield run.final_chunk()
            return
        batch.add(run)
        while len(batch):
            for _, chunks in batch.step():
                yield from chunks
    except Exception:
        try:
            _drop(batch, run)
        except Exception:
            log.exception("ending the request on the pipeline failed after the generation failed")
        raise
    except BaseException:  # closed (GeneratorExit) or interrupted: no error of the loop's to keep
        _drop(batch, run)
        raise


def _drop(batch: BatchDecoder, run: SequenceState) -> None:
    if len(batch):
        batch.drop()
    else:
        run.release()


_LANES = threading.local()  # each thread's lane streams past the first (MLX streams belong to their thread)


def lane_streams(lanes: int) -> list[mx.Stream | None]:
    """The streams of ``lanes`` lanes on this thread: the default stream, then CPU streams of their own
    (made once per thread: a stream is never freed)."""
    streams: list[mx.Stream] = _LANES.__dict__.setdefault("streams", [])
    while len(streams) < lanes - 1:
        streams.append(mx.new_stream(mx.cpu))
    return [None, *streams[: lanes - 1]]


def default_lanes(engine: Engine) -> int:
    """How many lanes a batch of ``engine``'s runs decodes in: ``EngineConfig.batch_lanes``, else one.

    Since a step emits from the last step's outputs (``batch_step.PlainStep.emit``), one lane is as fast or faster than two
    on MLX's CPU backend: its ``async_eval`` feeds the lanes' streams one after the other, and building two
    graphs costs the host twice. A pipelined model's batch decodes in one lane too: lanes there are
    micro-batches (``BatchLanes.step`` evaluates each lane's step as soon as it is built), each lane's step a
    round trip of its own through the stages and a graph of its own for the leader's host thread.
    ``EXO_BATCH_LANES`` turns them on where stages have machines of their own (docs/performance.md, "The engine's constants")."""
    if engine.config.batch_lanes is not None:
        return max(1, engine.config.batch_lanes)
    return 1


class BatchLanes:
    """A batch split into lanes: ``BatchDecoder`` s on streams of their own, whose plain steps are built one
    after another and evaluated at once, so that MLX's CPU backend (a thread per stream) computes them on as
    many cores. A newcomer joins the lane with the fewest runs. Every lane's rows round as solo steps on that
    backend (the batch's own guarantee), so lanes change no token; a run's stats count the size of the whole
    batch it decoded in.

    A speculative round runs whole inside its lane's ``prepare`` (its verdicts need its logits), so lanes
    overlap plain steps only (the other lanes wait for a round). While two or more lanes step together no
    step is timed for the batch depth policy (a lane's time is not its own), and a batch-size bucket never
    timed decodes plainly, as batches of more than one do on a CPU anyway (``BatchDepthPolicy``). On a GPU a
    batch has one lane."""

    def __init__(self, engine: Engine, lanes: int | None = None) -> None:
        count = default_lanes(engine) if lanes is None else max(1, lanes)
        self.engine = engine
        self.lanes = [BatchDecoder(engine, stream) for stream in lane_streams(count)]

    def __len__(self) -> int:
        return sum(len(lane) for lane in self.lanes)

    def add(self, run: SequenceState) -> None:
        min(self.lanes, key=len).add(run)

    def remove(self, run: SequenceState) -> None:
        next(lane for lane in self.lanes if any(r is run for r in lane.runs)).remove(run)

    def interleaved(self) -> None:
        for lane in self.lanes:
            lane.interleaved()

    def drop(self) -> None:
        """``BatchDecoder.drop`` in every lane."""
        for lane in self.lanes:
            lane.drop()

    def step(self) -> Results:
        """Every lane's step (``BatchDecoder.step``), their plain steps evaluated at once."""
        busy = [lane for lane in self.lanes if len(lane)]
        if len(busy) > 1:
            self.interleaved()
        together = len(self)
        for lane in busy:
            lane.together = together
        if self.engine.forward.stages > 1:
            # Micro-batches through a pipeline: a lane's step is evaluated as soon as it is built, so this
            # process computes its layers of one lane while the next lane's step (sent when it is built) runs
            # on the other stages; the first lane's next step then goes out while this one computes the last.
            prepared = []
            for lane in busy:
                prepared.append(lane.prepare())
                if prepared[-1].arrays:
                    mx.async_eval(prepared[-1].arrays)
            return [result for p in prepared for result in p.finish()]
        prepared = [lane.prepare() for lane in busy]
        arrays = [a for p in prepared for a in p.arrays]
        if arrays:
            mx.async_eval(arrays)
        return [result for p in prepared for result in p.finish()]

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
  [B, K+1] rows, then per run its own verdict and commit (``round.verify_round``), and the caches rolled back
  per run (runs accept different counts). A run whose depth is below the round's fills its rows past its
  drafts with its pending token, and keeps none of them.

Which of the two, at what depth, and what the policies learn from it: ``engine.depth`` (the one place where
a batch of one and a batch of several differ). Each run emits through its own output (stop strings, EOS,
max_tokens inside an accepted run, cancellation). Finished and cancelled runs leave the batch at the step's
end; new runs join between steps.

The caches (``BatchCaches``): a lone member's own, stepped on in place (a batch of one costs what a solo
loop did), until a second member joins; then a batch's rows (``batch_cache``: attention KV in mlx-lm's
left-padded ``BatchKVCache``, GatedDeltaNet state a row of a ``RollbackArraysCache``) until the last leaves.
Each member's MTP head cache and the rows waiting for its head stay its own.

Memory: a batch's attention KV is left-padded to its longest row, so n runs hold about n x the longest
horizon (prompt + max_tokens) of KV rows, plus each run's GatedDeltaNet state (fixed per sequence).
``batch_bytes`` is that estimate, ``sequence_bytes`` measures its two rates on the model itself; the device
queue admits a run into a batch only while the estimate stays within the instance's KV budget.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from .batch_cache import batch_row
from .depth import HEAD_FLUSH_ROWS, Plan, StepDepth, Stretch
from .forward import Forward
from .models.layers import vector_matmul
from .prefix_cache import store_reply
from .request import GenerationChunk
from .round import draft, verify_round
from .sequence import SequenceState
from .verify import verify_logits

if TYPE_CHECKING:
    from .generate import Engine

log = logging.getLogger(__name__)


def stage_bytes(engine: Engine) -> list[tuple[int, int]]:
    """Per stage of ``engine``'s model (one on a single node; a pipeline's leader last): (bytes of attention
    KV per token, bytes of recurrent state per sequence), each measured where its layers are, once (on the
    device thread), and kept on the engine."""
    measured = getattr(engine, "_stage_bytes", None)
    if measured is None:
        measured = engine._stage_bytes = engine.forward.memory_rates()  # type: ignore[attr-defined]
    return measured


def sequence_bytes(engine: Engine) -> tuple[int, int]:
    """(bytes of attention KV per token, bytes of recurrent state per sequence) of the layers in this process
    (the whole model on a single node; a pipeline's leader: its stage's)."""
    return stage_bytes(engine)[-1]


def batch_bytes(horizons: list[int], per_token: int, per_sequence: int) -> int:
    """The memory a batch of runs with these horizons (prompt + max_tokens each) may reach: every row
    padded to the longest, plus each run's recurrent state."""
    if not horizons:
        return 0
    return len(horizons) * (max(horizons) * per_token + per_sequence)


def batch_fits(engine: Engine, horizons: list[int], budget_tokens: int) -> bool:
    """Whether runs with these horizons may decode together within ``budget_tokens`` tokens of the model's
    KV on every stage (each stage's memory holds its own layers' KV budget, as placement reserved it; a lone
    run always may: its own context limit bounds it)."""
    if len(horizons) < 2:
        return True
    for per_token, per_sequence in stage_bytes(engine):
        # A stage without attention layers holds only the fixed states, which max_batch bounds.
        if per_token and batch_bytes(horizons, per_token, per_sequence) > budget_tokens * per_token:
            return False
    return True


Results = list[tuple[SequenceState, list[GenerationChunk]]]


@dataclass
class _Prepared:
    """A step whose graph is built: evaluate ``arrays`` (none: it has run), then ``finish()`` emits."""

    arrays: list[mx.array]
    finish: Callable[[], Results]


class BatchCaches:
    """The backbone caches a batch steps on, wherever the layers are: its first member's own (a batch of one
    steps on them in place: what a solo step costs) until a second member joins; then a batch's rows
    (``forward.join``), until the last member leaves."""

    def __init__(self, forward: Forward) -> None:
        self.forward = forward
        self.cache: list[Any] = []
        self.rows = False  # a batch's rows (else: the one member's own caches)

    def join(self, members: list[SequenceState], run: SequenceState) -> None:
        """``run`` joins ``members``: its caches become the batch's last row (the first member's stay its own)."""
        if not members:
            self.cache = run.cache
            return
        if not self.rows:  # a second member: the first one's caches become the batch's first row
            self.cache = self.forward.join(None, members[0].hand_caches())
            self.rows = True
        self.cache = self.forward.join(self.cache, run.hand_caches())

    def keep(self, members: list[SequenceState], keep: list[int]) -> None:
        """The members at ``keep`` stay, in that order (the last one leaving drops the caches)."""
        if not self.rows:
            if not keep:
                self.cache = []
                for run in members:
                    run.release()  # the lone member's own caches
            return
        if not keep:
            cache, self.cache, self.rows = self.cache, [], False
            self.forward.end(cache)
            return
        self.forward.filter(self.cache, keep)

    def rollback(self, rows: int, kept: list[int]) -> None:
        """After a verify call of ``rows`` rows per member, member b keeps its first ``kept[b]``."""
        if self.rows:
            self.forward.rollback_per_sequence(self.cache, rows, kept)
        else:
            self.forward.rollback(self.cache, rows, kept[0])

    def member(self, i: int) -> tuple[list[Any], list[Any], int]:
        """Member ``i``'s caches as one sequence's (its row: views, nothing copied), the caches that hold them
        and its row there (-1: its own)."""
        if self.rows:
            return batch_row(self.cache, i), self.cache, i
        return self.cache, self.cache, -1

    def positions(self, members: int) -> list[int | None]:
        """Each member's positions, read from its row of the attention KV (left padding excluded)."""
        kv = next((c for c in self.cache if isinstance(c, BatchKVCache)), None) if self.rows else None
        return kv.offset.tolist() if kv is not None else [None] * members


class BatchDecoder:
    """The runs decoding together on one engine (one device thread drives it); ``stream``: the stream its
    steps run on (None: the default one)."""

    def __init__(self, engine: Engine, stream: mx.Stream | None = None) -> None:
        self.engine = engine
        self.stream = stream
        # Runs decoding together with this one's (its lanes' too: BatchLanes), what a run's stats count;
        # None: this batch's own.
        self.together: int | None = None
        self.runs: list[SequenceState] = []
        self.caches = BatchCaches(engine.forward)
        self.depth = StepDepth(engine)
        self._stretch: Stretch | None = None  # a plain stretch under way
        # Step timing: the previous step was a plain one (a pipelined plain step's time is the previous step's
        # compute); nothing else ran on the device since the last step; a step ran since the batch formed.
        self._after_plain = False
        self._quiet = True
        self._stepped = False
        self._step_tokens: tuple[mx.array, list[mx.array]] | None = None  # the last plain step's tokens (``_plain_step``)

    def __len__(self) -> int:
        return len(self.runs)

    @property
    def cache(self) -> list[Any]:
        return self.caches.cache

    def add(self, run: SequenceState) -> None:
        """A run at a step boundary (after ``begin()``, not finished) joins the batch."""
        if run.engine is not self.engine:
            raise ValueError("a batch decodes the runs of one engine")
        run.check_joinable()
        if self.runs:
            self.interleaved()  # its prefill ran on the device: the running stretch is not timed alone
        self._end_stretch()
        self.caches.join(self.runs, run)
        self.runs.append(run)

    def interleaved(self) -> None:
        """Other work ran on the device since the last step (a newcomer's prefill): the next step's time
        (and the running stretch's) is not a step's alone."""
        if self._stepped:
            self._quiet = False
            if self._stretch is not None:
                self._stretch.quiet = False

    def step(self) -> Results:
        """One decode step or speculative round of every run: the chunks each run emits (a finished run's
        last is its final chunk, with stats; it has left the batch)."""
        prepared = self.prepare()
        if prepared.arrays:
            mx.async_eval(prepared.arrays)
        return prepared.finish()

    def prepare(self) -> _Prepared:
        """``step()`` up to its evaluation: a plain step's graph built (its ``arrays`` not evaluated yet), or
        a speculative round run whole (no arrays). ``BatchLanes`` evaluates several lanes' steps at once."""
        if not self.runs:
            return _Prepared([], list)
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

        return _Prepared(prepared.arrays, finish)

    def _on_stream(self) -> contextlib.AbstractContextManager[Any]:
        return mx.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def _prepare(self) -> _Prepared:
        start = time.perf_counter()
        quiet, self._quiet, self._stepped = self._quiet, True, True
        runs = self.runs
        if all(not run.pending_emitted and len(run.output.tokens) + 1 >= run.output.max_tokens for run in runs):
            out = self._settle()  # every pending token is its run's last: no step computes past them
            return _Prepared([], lambda: out)
        stretch = self._stretch
        if stretch is None:
            plan = self.depth.plan(runs)
            if any(plan.depth(run) for run in runs):
                out = self._settle()  # a round feeds on emitted tokens (its time starts after a plain step's)
                if self.runs:
                    self._round(plan, out, quiet)
                return _Prepared([], lambda: out)
            stretch = self._stretch = Stretch(plan, start, quiet, self._after_plain)
        return self._plain_step(stretch, start)

    def check_invariants(self) -> None:
        """Every member's ``SequenceState.check_invariants``, its positions read from its row of the batch's
        attention KV (its own caches: read there)."""
        positions = self.caches.positions(len(self.runs))
        assert len(positions) == len(self.runs)
        for run, at in zip(self.runs, positions, strict=True):
            assert not self.caches.rows or not run.cache, "a member's caches are the batch's"
            run.check_invariants(at)

    def remove(self, run: SequenceState) -> None:
        """Take ``run`` out of the batch between steps (its consumer failed): the others decode on."""
        index = next(i for i, r in enumerate(self.runs) if r is run)
        self._step_tokens = None
        self._keep([i for i in range(len(self.runs)) if i != index])

    def drop(self) -> None:
        """Every run leaves at once, with no final chunk (the batch's step failed: they end with its error);
        the batch's caches are dropped wherever the layers are."""
        self._step_tokens = None
        self._stretch = None
        self._keep([])

    def cancel_all(self) -> list[tuple[SequenceState, GenerationChunk]]:
        """End every run now (the device shuts down): each one's final chunk, finish "cancelled"."""
        out = []
        for run in self.runs:
            run.output.finish = run.output.finish or "cancelled"
            out.append((run, run.final_chunk()))
        self._keep([])
        return out

    # -- plain steps ---------------------------------------------------------------------------------------
    def _plain_step(self, stretch: Stretch, start: float) -> _Prepared:
        """The graph of a plain step (``following``: each run's next token); its ``finish`` emits the tokens
        fed to it while the step computes."""
        runs = self.runs
        plan = stretch.plan
        fed = [r.pending_token for r in runs]
        # The last plain step's tokens, when this one feeds on all of them (no member joined, left or ran a
        # round since): its input row, and what ``_plain_emit`` reads back in one transfer.
        last = self._step_tokens
        fed_last = last[0] if last is not None and len(last[1]) == len(fed) and all(
            a is b for a, b in zip(last[1], fed, strict=True)) else None
        inputs = fed_last if fed_last is not None else mx.concatenate([t.reshape(1) for t in fed])  # type: ignore[union-attr]
        hidden = self.engine.forward.hidden(inputs[:, None], self.caches.cache)
        logits = self._logits(hidden)[:, -1]  # [B, V]
        one = len(runs) == 1
        greedy: mx.array | None = None
        following: list[mx.array] = []
        lp_rows: list[Any] = []
        for i, run in enumerate(runs):
            # While the policy decodes plainly an adaptive member's head takes only its last ``plan.window``
            # rows (engine.depth), so the rows before them are never recorded (keeping and dropping a row per
            # token cost adaptive decoding ~1.5% of plain on a CPU's plain stretches).
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
        self._step_tokens = (tokens, following)
        logprobs = [a for rows in lp_rows if rows is not None for a in rows.arrays()]  # evaluated with the step
        stretch.steps += 1
        return _Prepared([*following, tokens, *logprobs],
                         lambda: self._plain_emit(fed, following, lp_rows, fed_last))

    def _plain_emit(self, fed: list[mx.array], following: list[mx.array], lp_rows: list[Any],
                    fed_last: mx.array | None) -> Results:
        runs = self.runs
        counted = self.together or len(runs)
        # The tokens fed to this step, read while it runs: from the arrays an earlier evaluation computed (the
        # last step's outputs, a first token), not from this step's graph (its input row): MLX signals the
        # arrays of one ``async_eval`` together, at its end, so reading an array of this step waited for all
        # of it, and the host built the next step only then.
        if fed_last is not None:
            values = fed_last.tolist()  # the last step's tokens, all of them: one read
        else:  # members joined, left or ran a round since: each its own
            values = [int(t.item()) for t in fed]  # type: ignore[union-attr]
        out: Results = []
        keep: list[int] = []
        for i, run in enumerate(runs):
            chunks: list[GenerationChunk] = []
            if not run.pending_emitted:
                chunks.extend(run.emit_pending(values[i]))
            if not _ended(run, chunks):
                keep.append(i)
                run.computed(following[i], counted, lp_rows[i])
            out.append((run, chunks))
        self._after_plain = True
        if self._stretch is not None and self._stretch.done:
            self._end_stretch()
        if len(keep) < len(runs):
            self._keep(keep, ended=True)
        return out

    def _end_stretch(self) -> None:
        """The plain stretch under way ends (its steps ran, members joined or left): the depth policy
        observes it."""
        stretch, self._stretch = self._stretch, None
        if stretch is not None and stretch.steps and self.runs:
            self.depth.plain_ran(stretch, time.perf_counter() - stretch.start, self.runs)

    def _logits(self, hidden: mx.array, *, verify: bool = False) -> mx.array:
        engine = self.engine
        weight = engine.model.output_weight() if engine.config.batch_invariant and self.caches.rows else None
        if weight is not None and hidden.shape[0] * hidden.shape[1] > 1:
            return vector_matmul(hidden, weight)  # each row's logits as a solo step computes them
        return verify_logits(engine.model, hidden, engine.verify_mode) if verify else engine.model.logits(hidden)

    def _settle(self) -> Results:
        """Before a round: emit the tokens the last plain step computed (a round feeds on emitted tokens);
        the runs they finish leave."""
        runs = self.runs
        out: Results = [(run, []) for run in runs]
        waiting = [i for i, run in enumerate(runs) if not run.pending_emitted]
        if not waiting:
            return out
        values = mx.concatenate([runs[i].pending_token.reshape(1) for i in waiting]).tolist()  # type: ignore[union-attr]
        for i, value in zip(waiting, values, strict=True):
            out[i][1].extend(runs[i].emit_pending(value))
        keep = [i for i, run in enumerate(runs) if run.output.finish is None]
        for run, chunks in out:
            if run.output.finish is not None:
                chunks.append(run.final_chunk())
        if len(keep) < len(runs):
            self._keep(keep, ended=True)
        return out

    # -- speculative rounds --------------------------------------------------------------------------------
    def _round(self, plan: Plan, out: Results, quiet: bool) -> None:
        """One speculative round of every run under ``plan`` (``out``: each run's chunks so far, appended to)."""
        engine, runs = self.engine, self.runs
        counted = self.together or len(runs)
        start = time.perf_counter()
        for run in runs:
            run.stats.round_started(start)

        def mark(phase: str) -> None:
            for run in runs:
                run.stats.mark(phase)

        waiting = [run.head.waiting for run in runs]
        drafts = [draft(run, plan.depth(run), plan.time_after_catch_up) for run in runs]
        mark("draft_build")
        decisions = verify_round(runs, drafts, engine.forward, self.caches.cache,
                                 lambda hidden: self._logits(hidden, verify=True), self.caches.rollback, mark)
        end = time.perf_counter()
        timed_from = drafts[0].timed_from  # (only a batch of one times its head's catch-up apart)
        self.depth.round_ran(plan, runs, decisions, end - (timed_from or start), quiet, waiting)
        mark("rollback")
        self._after_plain = False
        chunks_of = {id(run): chunks for run, chunks in out}
        keep: list[int] = []
        for i, (run, decision) in enumerate(zip(runs, decisions, strict=True)):
            chunks = chunks_of[id(run)]
            run.stats.mark("emit")
            run.stats.round_ended()
            run.stats.round_ran(counted, decision.drafts.k, len(decision.emitted))  # (``commit`` emitted them)
            chunks.extend(run.drain())
            if not _ended(run, chunks):
                keep.append(i)
        if len(keep) < len(runs):
            self._keep(keep, ended=True)

    def _keep(self, keep: list[int], ended: bool = False) -> None:
        """The members at ``keep`` stay (in that order); the batch's caches follow, wherever the layers are
        (the last one leaving drops them). ``ended``: the others leave at the end of a step (finished or
        cancelled, not failed): the finished ones store their reply first (``_store_ended``)."""
        if len(keep) < len(self.runs):
            self._end_stretch()
        if ended:
            self._store_ended(keep)
        runs, self.runs = self.runs, [self.runs[i] for i in keep]
        self.caches.keep(runs, keep)
        if not keep:
            self._stepped = self._after_plain = False
            self._quiet = True

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

    Since a step emits from the last step's outputs (``_plain_emit``), one lane is as fast or faster than two
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


def _ended(run: SequenceState, chunks: list[GenerationChunk]) -> bool:
    """Whether ``run`` ended at this step (finished, or cancelled now): then its final chunk is appended."""
    if run.output.finish is None:
        run.cancelled()
    if run.output.finish is None:
        return False
    chunks.append(run.final_chunk())
    return True


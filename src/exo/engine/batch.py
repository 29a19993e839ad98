"""Continuous batching: decode steps and native-MTP rounds for several generation runs of one model at once.

Every generation decodes here: a solo request is a batch of one (``SequenceState.stream``, the device queue).
A run (``SequenceState``) prefills and emits its first token alone (``SequenceState.begin``: its first token
is the solo one), then ``BatchDecoder.add`` takes it. A lone member is stepped on its own caches under its own
``DepthPolicy`` (``_prepare_lone``: the rules of a solo request); a second member moves both into the batch's
caches (``batch_cache``: attention KV into mlx-lm's left-padded ``BatchKVCache``, GatedDeltaNet state a row
of a ``RollbackArraysCache``); each member's MTP head cache and the (hidden, token) rows waiting for its head
stay its own. Each ``step`` is then, for every run at once, one of:

- a plain step (K = 0): ONE backbone call over a row per run; each row penalised, masked by its grammar and
  sampled with its own run's parameters and PRNG key stream (a seed reproduces the solo samples), its
  logprobs evaluated with the step. Plain steps are
  pipelined like a solo plain burst: a step's next tokens are computed while the host emits the tokens
  fed to it (a run that finishes has one wasted row computed after its last token). Meanwhile an
  adaptive run's head is not fed (only its last ``BATCH_HEAD_WINDOW`` rows wait): a head row costs about a
  backbone layer per token, which a batch that decodes plainly would pay for nothing; a later round
  drafts from a head with a gap in its context (exo-demo: acceptance 1.000 -> 0.984 after 60 tokens);
- a speculative round: each run drafts with the head (``SequenceState.draft``, its own head cache), ONE verify
  call of [B, K+1] rows (GatedDeltaNet recording every row's state, MoE routing locked), then per run its
  own verdict (``SequenceState.decide``: greedy argmax match, or its own Leviathan/Chen test with its own
  parameters, penalties, grammar and keys), ``commit`` (its tokens emitted), and the caches rolled back per run
  (``batch_cache.keep_rows_per_sequence``: runs accept different counts). A run whose depth is below the
  round's (a forced smaller K, MTP off for it, a near tie to decode plainly) fills its rows past its
  drafts with its pending token, and keeps none of them.

Each run emits through its own output (stop strings, EOS, max_tokens inside an accepted run,
cancellation). Finished and cancelled runs leave the batch at the step's end; new runs join between steps.

The round's depth: a run with a forced ``mtp_k`` drafts that many, a run without MTP none, and the
adaptive ones as many as the engine's ``BatchDepthPolicy`` picks for this batch size from measured costs
(``exo.engine.adaptive``: on a compute-bound device, or where drafting never pays, always 0).

Memory: a batch's attention KV is left-padded to its longest row, so n runs hold about n x the longest
horizon (prompt + max_tokens) of KV rows, plus each run's GatedDeltaNet state (fixed per sequence).
``batch_bytes`` is that estimate, ``sequence_bytes`` measures its two rates on the model itself; the device
queue admits a run into a batch only while the estimate stays within the instance's KV budget.

On this CPU batched rows round exactly as solo decoding (bench/serving.py measures it; tests check it).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from .adaptive import PLAIN_TIMED_MIN
from .generate import HEAD_FLUSH_ROWS, HEAD_WINDOW, Engine, GenerationChunk, SequenceState, verify_round
from .models.layers import vector_matmul
from .verify import verify_logits

BATCH_HEAD_WINDOW = 4  # head rows an adaptive member keeps waiting while its batch decodes plainly


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
class _Burst:
    """A lone member's stretch of plain steps its depth policy chose (K = 0), timed as one."""

    budget: int  # plain steps before the policy chooses again
    stretch: bool  # the policy chose K = 0 (not one step after a near tie): the head keeps a window only
    start: float
    steps: int = 0


@dataclass
class _Prepared:
    """A step whose graph is built: evaluate ``arrays`` (none: it has run), then ``finish()`` emits."""

    arrays: list[mx.array]
    finish: Callable[[], Results]


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
        self.cache: list[Any] = []
        # Whether ``cache`` is a batch's (mlx-lm's BatchKVCache, rows per member): a lone member's own caches
        # are stepped on where they are (a batch of one costs what a solo loop did) until a second joins.
        self._batched = False
        self._burst: _Burst | None = None  # a lone member's plain stretch under way
        # Timing of steps for the batch depth policy: the previous step was a plain one (a pipelined plain
        # step's time is the previous step's compute), and nothing else ran on the device since.
        self._after_plain = False
        self._quiet = True
        self._step_tokens: tuple[mx.array, list[mx.array]] | None = None  # the last plain step's tokens (``_plain_step``)

    def __len__(self) -> int:
        return len(self.runs)

    def add(self, run: SequenceState) -> None:
        """A run at a step boundary (after ``begin()``, not finished) joins the batch."""
        if run.engine is not self.engine:
            raise ValueError("a batch decodes the runs of one engine")
        run.check_joinable()
        self._end_burst()
        forward = self.engine.forward
        if not self.runs:
            # A lone member: the batch steps on its own caches (they stay its ``cache``) until a second joins.
            self.cache = run.cache
        else:
            if not self._batched:
                # A second member: the lone one's caches become the batch's first row, wherever the layers
                # are (a pipeline's stages mirror it).
                self.cache = forward.join(None, self.runs[0].hand_caches())
                self._batched = True
            # Its backbone caches become the batch's last row; its head cache and waiting head rows stay its own.
            self.cache = forward.join(self.cache, run.hand_caches())
        self.runs.append(run)
        self._quiet = False

    def interleaved(self) -> None:
        """Other work ran on the device since the last step (a newcomer's prefill): the next step's time
        is not a step's alone."""
        self._quiet = False

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
            if not self.engine.config.batch_invariant or not self._batched:  # one member's caches: a solo step
                prepared = self._prepare()
            else:
                self.engine.forward.set_batch_invariant(True)
                try:
                    prepared = self._prepare()
                finally:
                    self.engine.forward.set_batch_invariant(False)

        def finish() -> Results:
            with self._on_stream():
                return prepared.finish()

        return _Prepared(prepared.arrays, finish)

    def _on_stream(self) -> contextlib.AbstractContextManager[Any]:
        return mx.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def _lone(self) -> bool:
        """One member decoding alone, on its own caches: its own depth policy drives it, as a solo request."""
        return not self._batched and len(self.runs) == 1 and (self.together or 1) == 1

    def _prepare(self) -> _Prepared:
        start = time.perf_counter()
        timed, self._quiet = self._quiet, True
        if self._lone():
            return self._prepare_lone(start)
        self._end_burst()
        batch_k = self._batch_depth(len(self.runs))
        if max(self._depth(run, batch_k) for run in self.runs) == 0:
            return self._plain_step(start, timed)
        out = self._settle()  # waits for a plain step still running: the round's time starts after it
        if self.runs:
            self._round([self._depth(run, batch_k) for run in self.runs], out, timed)
        return _Prepared([], lambda: out)

    def check_invariants(self) -> None:
        """Every member's ``SequenceState.check_invariants``, its positions read from its row of the batch's
        attention KV (``offset``: its own positions, left padding excluded)."""
        if not self._batched:
            for run in self.runs:
                run.check_invariants()  # its own caches
            return
        kv = next((c for c in self.cache if isinstance(c, BatchKVCache)), None)
        offsets = kv.offset.tolist() if kv is not None else [None] * len(self.runs)
        assert len(offsets) == len(self.runs)
        for run, positions in zip(self.runs, offsets, strict=True):
            assert not run.cache, "a member's caches are the batch's"
            run.check_invariants(positions)

    def remove(self, run: SequenceState) -> None:
        """Take ``run`` out of the batch between steps (its consumer failed): the others decode on."""
        index = next(i for i, r in enumerate(self.runs) if r is run)
        self._step_tokens = None
        self._keep([i for i in range(len(self.runs)) if i != index])

    def drop(self) -> None:
        """Every run leaves at once, with no final chunk (the batch's step failed: they end with its error);
        the batch's caches are dropped wherever the layers are."""
        self._step_tokens = None
        self._burst = None
        self._keep([])

    def cancel_all(self) -> list[tuple[SequenceState, GenerationChunk]]:
        """End every run now (the device shuts down): each one's final chunk, finish "cancelled"."""
        out = []
        for run in self.runs:
            run.output.finish = run.output.finish or "cancelled"
            out.append((run, run.final_chunk()))
        self._keep([])
        return out

    # -- depth ---------------------------------------------------------------------------------------------
    @staticmethod
    def _adaptive(run: SequenceState) -> bool:
        return run.head is not None and run.policy is not None and run.policy.fixed_k is None

    def _batch_depth(self, size: int) -> int:
        """The depth the adaptive runs draft at in this step (0 when none is adaptive)."""
        if not any(self._adaptive(run) for run in self.runs):
            return 0
        return self.engine.batch_policy().choose(size)

    def _depth(self, run: SequenceState, batch_k: int) -> int:
        if run.head is None or run.policy is None or run.near_tie:
            return 0
        return run.policy.fixed_k if run.policy.fixed_k is not None else batch_k

    # -- plain steps ---------------------------------------------------------------------------------------
    def _plain_step(self, start: float, timed: bool) -> _Prepared:
        """The graph of a plain step (``following``: each run's next token); its ``finish`` emits the tokens
        fed to it while the step computes."""
        runs = self.runs
        burst = self._burst if self._lone() else None
        fed = [r.pending_token for r in runs]
        # The last plain step's tokens, when this one feeds on all of them (no member joined, left or ran a
        # round since): its input row, and what ``_plain_emit`` reads back in one transfer.
        last = self._step_tokens
        fed_last = last[0] if last is not None and len(last[1]) == len(fed) and all(
            a is b for a, b in zip(last[1], fed, strict=True)) else None
        inputs = fed_last if fed_last is not None else mx.concatenate([t.reshape(1) for t in fed])  # type: ignore[union-attr]
        hidden = self.engine.forward.hidden(inputs[:, None], self.cache)
        logits = self._logits(hidden)[:, -1]  # [B, V]
        greedy: mx.array | None = None
        following: list[mx.array] = []
        lp_rows: list[Any] = []
        for i, run in enumerate(runs):
            # A lone adaptive member's plain stretch: the head takes only its last HEAD_WINDOW rows (the solo rule,
            # generate.HEAD_WINDOW says why), so the rows before them are never recorded (keeping and dropping a
            # row per token cost adaptive decoding ~1.5% of plain on this CPU's plain stretches).
            window = burst is not None and burst.stretch and self._adaptive(run)
            skip = window and burst is not None and burst.budget - burst.steps > HEAD_WINDOW
            row = None if skip else hidden if len(runs) == 1 else hidden[i : i + 1]  # alone: no slice op
            if _bare_greedy(run):  # one argmax for all of them: what ``choose`` takes
                if greedy is None:
                    greedy = mx.argmax(logits, axis=-1).astype(mx.uint32)
                following.append(greedy if len(runs) == 1 else greedy[i : i + 1])  # alone: no slice op
                lp_rows.append(None)
                run.wait_for_head(row, following[i])
            else:
                # Under a grammar ``choose`` reads the member's pending token (the last step's output) for its
                # mask: this step's graph waits for the last step there, as a solo constrained step does.
                token, rows = run.choose(logits[i : i + 1], row)
                following.append(token)
                lp_rows.append(rows)
            if burst is not None:
                if window:
                    if not skip:
                        run.keep_head_window(HEAD_WINDOW)
                elif run.head_rows_waiting >= HEAD_FLUSH_ROWS:
                    run.flush_head_async()
            elif self._adaptive(run):
                # While the batch decodes plainly its members' heads are not fed (a head row costs about a
                # layer of the backbone per token, for nothing until a round): only the last few rows wait,
                # so a round drafts from recent context after a gap in the head's.
                run.keep_head_window(BATCH_HEAD_WINDOW)
        # The step's tokens in one array too, an output of the same evaluation (the next step's input row).
        all_greedy = greedy is not None and all(_bare_greedy(run) for run in runs)
        tokens = greedy if all_greedy else mx.concatenate([t.reshape(1) for t in following])
        self._step_tokens = (tokens, following)
        logprobs = [a for rows in lp_rows if rows is not None for a in rows.arrays()]  # evaluated with the step
        if burst is not None:
            burst.steps += 1
        return _Prepared([*following, tokens, *logprobs],
                         lambda: self._plain_emit(fed, following, lp_rows, start, timed, fed_last, burst is not None))

    def _plain_emit(
        self, fed: list[mx.array], following: list[mx.array], lp_rows: list[Any], start: float, timed: bool,
        fed_last: mx.array | None, lone: bool = False,
    ) -> Results:
        runs = self.runs
        size = len(runs)
        counted = 0 if lone else self.together or size  # a lone member's tokens are no batch's
        # The tokens fed to this step, read while it runs: from the arrays an earlier evaluation computed (the
        # last step's outputs, a first token), not from this step's graph (its input row): MLX signals the
        # arrays of one ``async_eval`` together, at its end, so reading an array of this step waited for all
        # of it, and the host built the next step only then (exo-demo, 8 sequences on this CPU: 2.9 ms a step
        # waiting, then 1.8 ms building while the CPU idled).
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
        if not lone and any(self._adaptive(run) for run in runs):
            # A pipelined step's time is the previous step's compute: measured only after a plain step.
            seconds = time.perf_counter() - start if timed and self._after_plain else None
            self.engine.batch_policy().observe_plain(size, seconds)
        self._after_plain = True
        if len(keep) < size:
            self._keep(keep, ended=True)
        return out

    def _logits(self, hidden: mx.array, *, verify: bool = False) -> mx.array:
        weight = self.engine.model.output_weight() if self.engine.config.batch_invariant else None
        if weight is not None and hidden.shape[0] * hidden.shape[1] > 1:
            return vector_matmul(hidden, weight)  # each row's logits as a solo step computes them
        return verify_logits(self.engine.model, hidden, self.engine.verify_mode) if verify else self.engine.model.logits(hidden)

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
    def _round(self, depths: list[int], out: Results, timed: bool) -> None:
        """One speculative round of every run, each drafting ``depths[i]`` (``out``: each run's chunks so far,
        appended to). The pieces are the same for a lone member and a batch; only the depth policy's
        bookkeeping differs: a lone member (``_lone()``) feeds its own ``DepthPolicy`` a round timed from after
        its head's catch-up on a plain stretch (and the phase profile); a batch feeds each member's acceptance
        tracker and the ``BatchDepthPolicy`` bucket a round timed only when typical."""
        engine, runs = self.engine, self.runs
        size = len(runs)
        lone = self._lone()
        k = max(depths)
        start = time.perf_counter()
        if lone:
            runs[0].round_started(start)
        # A batch's round that first feeds the heads more than a window of rows is not a typical round's time.
        catch_up = any(run.head_rows_waiting > max(k + 1, BATCH_HEAD_WINDOW) for run in runs)
        drafts = [run.draft(depth, time_after_catch_up=lone) for run, depth in zip(runs, depths, strict=True)]
        mark = runs[0]._mark if lone else None
        if mark is not None:
            mark("draft_build")
        # The solo round's own scoring (``generate.verify_round``), the batch's caches rolled back per member.
        forward = engine.forward
        decisions = verify_round(
            runs, drafts, forward, self.cache,
            (lambda hidden: verify_logits(engine.model, hidden, engine.verify_mode)) if lone
            else (lambda hidden: self._logits(hidden, verify=True)),
            forward.rollback_per_sequence if self._batched
            else lambda cache, rows, kept: forward.rollback(cache, rows, kept[0]),
            mark,
        )
        end = time.perf_counter()
        if lone:
            policy = runs[0].policy
            assert policy is not None
            policy.observe_round(k, decisions[0].accepted, end - (drafts[0].timed_from or start))
            runs[0]._mark("rollback")
        else:
            for run, decision in zip(runs, decisions, strict=True):
                run.observe_batched_round(decision)
            if any(self._adaptive(run) for run in runs):
                typical = timed and all(d == k for d in depths) and not catch_up
                engine.batch_policy().observe_round(size, k, end - start if typical else None)
        self._after_plain = False
        chunks_of = {id(run): chunks for run, chunks in out}
        keep: list[int] = []
        for i, (run, decision) in enumerate(zip(runs, decisions, strict=True)):
            chunks = chunks_of[id(run)]
            added = len(decision.emitted)  # (``commit`` emitted them)
            if lone:
                run._mark("emit")
                run.round_ended()
            else:
                run.counted_in_batch(self.together or size, added, decision)
            chunks.extend(run.drain())
            if not _ended(run, chunks):
                keep.append(i)
        if len(keep) < size:
            self._keep(keep, ended=True)

    def _keep(self, keep: list[int], ended: bool = False) -> None:
        """The members at ``keep`` stay (in that order); the batch's caches follow, wherever the layers are
        (the last one leaving drops them). ``ended``: the others leave at the end of a step (finished or
        cancelled, not failed): the finished ones store their reply first (``_store_ended``)."""
        if len(keep) < len(self.runs):
            self._end_burst()
        if ended:
            self._store_ended(keep)
        runs, self.runs = self.runs, [self.runs[i] for i in keep]
        if not self._batched:
            if not keep:
                self.cache = []
                for run in runs:
                    run.release()  # the lone member's own caches
            return
        if not keep:
            cache, self.cache = self.cache, []
            self._batched = False
            self.engine.forward.end(cache)
            return
        self.engine.forward.filter(self.cache, keep)

    def _store_ended(self, keep: list[int]) -> None:
        """Members that finished (not cancelled) keep their reply in the prefix cache: each one's row of the
        batch's caches (``batch_row``) goes to ``SequenceState.store_end`` before the filter drops it. Only
        where the engine has a prefix cache (taking a row costs a read of its padding)."""
        if self.engine.prefix_cache is None:
            return
        kept = set(keep)
        for i, run in enumerate(self.runs):
            if i not in kept and run.output.finish in ("stop", "length"):
                run.store_end(batch=(self.cache, i) if self._batched else None)  # (a lone one: its own)

    # -- a lone member: the solo loop's rules ----------------------------------------------------------
    def _prepare_lone(self, start: float) -> _Prepared:
        """A step of a lone member under its own ``DepthPolicy``, as a solo request decodes: plain stretches of
        the policy's budget (pipelined, timed as one), speculative rounds timed alone, one plain step after a
        near tie."""
        run = self.runs[0]
        if not run.pending_emitted and len(run.output.tokens) + 1 >= run.output.max_tokens:
            out = self._settle()  # the pending token is the last one: no step computes past it
            return _Prepared([], lambda: out)
        burst = self._burst
        if burst is not None and burst.steps >= burst.budget:
            self._end_burst()
            burst = None
        if burst is None:
            if run.near_tie:
                self._burst = _Burst(1, False, start)
            else:
                policy = run.policy
                k = policy.choose() if policy is not None else 0
                if run.track_head and policy is not None and not policy.mtp_can_pay_off:
                    run.stop_head()
                if k > 0:
                    out = self._settle()  # a round feeds on emitted tokens
                    if self.runs:
                        self._round([k], out, True)
                    return _Prepared([], lambda: out)
                self._burst = _Burst(policy.plain_budget() if policy is not None else 1 << 30, True, start)
        return self._plain_step(start, False)

    def _end_burst(self) -> None:
        """A lone member's plain stretch ends (its budget ran, it ended, or a second member joined): its depth
        policy observes it, timed when long enough to be mostly pipelined steps (``PLAIN_TIMED_MIN``)."""
        burst, self._burst = self._burst, None
        if burst is None or not self.runs:
            return
        policy = self.runs[0].policy
        if policy is not None:
            timed = burst.steps >= PLAIN_TIMED_MIN  # shorter: mostly the pipeline filling, not plain tokens
            policy.observe_plain(burst.steps, time.perf_counter() - burst.start if timed else None)


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

    Two lanes paid on MLX's CPU backend while a plain step waited for its whole evaluation before the next
    was built (8 sequences: 446 tok/s against one lane's 357); since a step emits from
    the last step's outputs (``_plain_emit``), one lane is as fast or faster at every size measured on a
    2-core x86-64 CPU (exo-demo, ms a step, one lane vs two: 10.3 vs 14.5 at 4 sequences, 12.6 vs 14.4 at 8,
    21.8 vs 21.1 at 16, 43.0 vs 56.7 at 32; bench/batch_steps.py@3c719fd): MLX's ``async_eval`` feeds the lanes'
    streams one after the other, and building two graphs costs the host twice.

    A pipelined model's batch decodes in one lane too. Lanes there are micro-batches (``BatchLanes.step``
    evaluates each lane's step as soon as it is built, so the leader computes one lane's layers while the other
    stages compute the next lane's), and as many as stages measured slower on this 2-core CPU: exo-demo over
    two stages through ``exo serve``, 8 clients 308 tok/s in two lanes against 483-490 in one, 32 clients 338
    against 602-705 (bench/results/cpu-2core-pipeline-batching-2026-11-28.txt): each lane's step is a round
    trip of its own through the stages and a graph of its own for the leader's host thread, and the two
    stages' processes already keep both cores busy. ``EXO_BATCH_LANES`` turns them on where stages have
    machines of their own."""
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


def _bare_greedy(run: SequenceState) -> bool:
    """A member whose plain token is the row's argmax: no penalties, grammar or logprobs to apply."""
    return run.params.greedy and not run.processors and run.matcher is None and run.top_logprobs is None


def _ended(run: SequenceState, chunks: list[GenerationChunk]) -> bool:
    """Whether ``run`` ended at this step (finished, or cancelled now): then its final chunk is appended."""
    if run.output.finish is None:
        run.cancelled()
    if run.output.finish is None:
        return False
    chunks.append(run.final_chunk())
    return True


"""One batch on the device: from its first generation's run until its last member has left.

Each step is one plan of the scheduler (``runner.scheduler``, the one place that decides admission and the
prefill budget), carried out in order: the admitted jobs begin (``GenerationJob.begin``: validated, on the
batch's engine); the newcomers' prompt chunks run (several whole prompts as rows of one call where the engine
can: ``engine.batch_prefill``), and a newcomer whose prompt is all in emits its first token and joins the
batch (``BatchLanes.add``); members whose client went away leave; the members decode one step (a plain step
or a speculative round: ``BatchLanes.step``) and their chunks go to their streams.

Invariants, at every step boundary:

- every generation of the batch is exactly one of: a newcomer (``newcomers``: begun, its prompt in part) or a
  member (``members``: in the batch's lanes), and the scheduler knows it as the same;
- a generation that ends, however (finished, cancelled, its stream broken, failed), leaves both the scheduler
  and the device's running set once (``_leave``) and has its caches dropped wherever the layers are;
- a failure of the batch itself (its step, or a member's removal) ends every member and newcomer with that
  error (``_fail_all``), and the loop ends; a failure confined to one generation (its consumer, its input)
  ends that one alone and the others go on.

The loop reads the device's queue only through ``Device.plan_step`` (under the queue's lock).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

from .scheduler import Scheduler, StepPlan, Waiting, shared_call

if TYPE_CHECKING:
    from exo.engine import Engine
    from exo.engine.batch import BatchLanes, Results
    from exo.engine.sequence import SequenceState

    from .device import Device
    from .job import GenerationJob

log = logging.getLogger(__name__)


class BatchLoop:
    """The members and newcomers of one batch on ``device``, begun by ``first`` (its ``run`` begun)."""

    def __init__(self, device: Device, first: GenerationJob, run: SequenceState) -> None:
        from exo.engine.batch import BatchLanes

        self.device = device
        self.first = first
        self.run = run
        self.engine = engine = run.engine
        config = engine.config
        self.batch = BatchLanes(engine)
        self.scheduler = Scheduler(device.max_batch, lambda horizons: device.fits(engine, horizons),
                                   step_tokens=config.batch_prefill_chunk, idle_tokens=config.prefill_chunk)
        self.members: dict[int, GenerationJob] = {}  # id(run) -> its job
        self.runs: dict[int, SequenceState] = {}  # id(run) -> the run
        self.newcomers: dict[GenerationJob, _Newcomer] = {}
        # The first job, already out of the queue, is the first step's only admission from outside it.
        self._pending: list[Waiting] = [Waiting(first, True, first.horizon, len(run.request.prompt_tokens))]

    def serve(self) -> None:
        """Step until every member and newcomer has ended."""
        try:
            self._serve()
        finally:
            self.device.trace.pause()

    def _serve(self) -> None:
        from exo.engine.memory import keep_cache_room

        trace = self.device.trace
        while True:
            lap = trace.step()
            handed = keep_cache_room()  # a prompt chunk's large buffers never crowd the steps' small ones out of MLX's cache
            lap("room", **({"handed_back": handed} if handed else {}))
            plan = self.device.plan_step(self.scheduler, self._pending, self.first, self.engine)
            self._pending = []
            lap("plan")
            self._begin(plan)
            together = self._prefill(plan)
            if plan.prefill:
                self.batch.interleaved()  # prefill ran on the device: this round's time is not a round's alone
            lap("prefill", admitted=len(plan.admit), held=plan.held, prefill_tokens=sum(c.tokens for c in plan.prefill),
                together=len(together), members=len(self.batch))
            if not self._drop_stopped():
                return
            if not len(self.batch):
                lap("emit", stepped=0)
                if len(self.scheduler):
                    continue
                return
            try:
                results = self._step()
            except Exception as e:
                self._fail_all(e)
                return
            lap("step")
            self.device.on_batch(len(results))
            if not self._emit(results):
                return
            lap("emit", stepped=len(results))

    # -- newcomers ------------------------------------------------------------------------------------------
    def _begin(self, plan: StepPlan) -> None:
        """The admitted jobs begin: each a newcomer of the batch, or ended there (reported)."""
        for job in plan.admit:
            new = self.run if job is self.first else job.begin()
            if new is None:  # ended there (cancelled, timed out, rejected: reported)
                self.scheduler.left(job)
                self.device.finished(job)
            elif new.engine is not self.engine or not new.batchable:
                _release(new)
                self._leave(job, RuntimeError("the model changed under a running batch; retry"))
            else:
                self.newcomers[job] = _Newcomer(new)
                self.scheduler.begun(job, len(new.request.prompt_tokens) - new.prefilled)

    def _prefill(self, plan: StepPlan) -> list[GenerationJob]:
        """The step's prompt chunks, oldest newcomer first; returns the newcomers that prefilled as rows of one
        call."""
        from exo.engine.batch_prefill import can_prefill_together

        fed = {chunk.key: chunk.tokens for chunk in plan.prefill}
        # Newcomers whose whole prompt this step feeds from its start go through the backbone as rows of
        # one call (``engine.batch_prefill``: each row its solo prefill), as many as the budget pads to.
        together = shared_call(((job, len(n.run.request.prompt_tokens)) for job, n in self.newcomers.items()
                                if job in fed and n.fresh and n.run.whole_prompt_in(fed[job])),
                               plan.budget) if can_prefill_together(self.engine) else []
        for job in list(self.newcomers):
            newcomer = self.newcomers.get(job)
            if newcomer is None:  # it failed in the shared call of the newcomers before it
                continue
            if job not in fed:  # no room in this step's budget: it may have left meanwhile
                if job.stopped():
                    newcomer.run.output.finish = "cancelled"
                    self._drop_newcomer(job)
                continue
            if together and job is together[0] and not self._prefill_together(together):
                continue
            self._feed(job, newcomer, fed[job])
        return together

    def _prefill_together(self, together: list[GenerationJob]) -> bool:
        """Their whole prompts as rows of one call; False when it failed (every one of them ended with its
        error: the batch's members are untouched)."""
        from exo.engine.batch_prefill import prefill_together

        try:
            prefill_together([self.newcomers[j].run for j in together])
        except Exception as e:
            for j in together:
                self._drop_newcomer(j, e)
            return False
        for j in together:
            self.newcomers[j].prefilled()
        return True

    def _feed(self, job: GenerationJob, newcomer: _Newcomer, tokens: int) -> None:
        """A newcomer's chunk of ``tokens`` prompt tokens (none when it prefilled with others); at its last, its
        first token, and it joins (or ends there)."""
        # The engine's part (the newcomer's chunk, its first token, its end) and its consumer's part apart: a
        # consumer that raises ends its request alone, with every stage in step.
        new = newcomer.run
        try:
            self.scheduler.fed(job, newcomer.feed(tokens) if newcomer.more else tokens)
            if newcomer.more:  # a chunk done, more to come: the batch steps first
                if new.cancelled():
                    self._drop_newcomer(job)
                return
            del self.newcomers[job]
            last = list(new.first_token(store=False))
            if new.output.finish is not None:  # done at its first token (or cancelled by now)
                new.store_prompt()
                new.release()
                last.append(new.final_chunk())
        except Exception as e:
            self.newcomers.pop(job, None)
            _release(new)
            self._leave(job, e)
            return
        try:
            for chunk in last:
                job.consume(chunk)
        except Exception as e:  # its stream broke: it alone leaves
            if new.output.finish is None:
                _release(new)
            self._leave(job, e)
            return
        if new.output.finish is not None:
            self._leave(job)
            return
        try:
            # The prompt's prefix-cache store, once its first token is out (its copies and the tiers' puts would
            # otherwise delay it), before the batch's next step moves its caches on.
            new.store_prompt()
            self.batch.add(new)
        except Exception as e:
            _release(new)
            self._leave(job, e)
            return
        self.scheduler.joined(job)
        self.members[id(new)] = job
        self.runs[id(new)] = new

    def _drop_newcomer(self, job: GenerationJob, error: BaseException | None = None) -> None:
        """A newcomer that ends before it joined: its caches dropped, then its end (``error``: failed)."""
        newcomer = self.newcomers.pop(job)
        if error is not None:
            _release(newcomer.run)
            self._leave(job, error)
            return
        try:
            newcomer.run.release()  # a pipeline's stages drop its caches too
            job.consume(newcomer.run.final_chunk())
        except Exception as e:
            self._leave(job, e)
            return
        self._leave(job)

    # -- members --------------------------------------------------------------------------------------------
    def _drop_stopped(self) -> bool:
        """A member whose client went away (or whose deadline passed) since the last step leaves before the next
        one: its row is not computed again. False when the batch failed (every generation ended)."""
        for key, job in list(self.members.items()):
            if not job.stopped():
                continue
            ended = self.runs.pop(key)
            del self.members[key]
            try:
                self.batch.remove(ended)  # (a pipeline's stages drop its rows too)
            except Exception as e:
                self._leave(job, e)
                self._fail_all(e)
                return False
            ended.output.finish = "cancelled"
            try:
                job.consume(ended.final_chunk())
            except Exception as e:  # its stream is gone anyway
                self._leave(job, e)
                continue
            self._leave(job)
        return True

    def _emit(self, results: Results) -> bool:
        """The step's chunks to their streams; members that finished leave. False when the batch failed."""
        for ended, chunks in results:
            job = self.members[id(ended)]
            try:
                for chunk in chunks:
                    job.consume(chunk)
            except Exception as e:  # this member's stream broke: it alone leaves, the others go on
                del self.members[id(ended)]
                self.runs.pop(id(ended), None)
                self._leave(job, e)
                if ended.output.finish is None:
                    try:
                        self.batch.remove(ended)  # (a pipeline's stages drop its rows too)
                    except Exception as e:
                        self._fail_all(e)
                        return False
                continue
            if ended.output.finish is not None:
                del self.members[id(ended)]
                self.runs.pop(id(ended), None)
                self._leave(job)
        return True

    # -- ends -----------------------------------------------------------------------------------------------
    def _leave(self, job: GenerationJob, failed: BaseException | None = None) -> None:
        """``job`` ends (``failed``: with that error): out of the scheduler and the device's running set."""
        self.scheduler.left(job)
        if failed is not None:
            job.fail(failed)
        job.end()
        self.device.finished(job)

    def _step(self) -> Any:
        """The batch's step; a device that runs out of memory for it fails its members with the typed error (507
        ``insufficient_memory``) and hands MLX's cache of free buffers back (``engine.memory``)."""
        from exo.engine.memory import out_of_memory

        with out_of_memory(f"decoding a batch of {len(self.batch)}"):
            return self.batch.step()

    def _fail_all(self, error: BaseException) -> None:
        """The batch failed (a step, or a member's leaving): every member and newcomer ends with ``error``."""
        for newcomer in self.newcomers.values():
            _release(newcomer.run)
        _drop(self.batch)
        for member in self.members.values():
            self._leave(member, error)
        for job in self.newcomers:
            self._leave(job, error)


class _Newcomer:
    """A generation admitted to a batch that is still prefilling: its run and where its prompt is."""

    def __init__(self, run: SequenceState) -> None:
        self.run = run
        self.position = run.prefilled  # prompt positions in its caches
        self.more = True  # prompt tokens are left to feed
        self._chunks: Generator[int, int | None, None] | None = None

    @property
    def fresh(self) -> bool:
        """Nothing of its prompt fed yet."""
        return self._chunks is None and self.more

    def prefilled(self) -> None:
        """Its whole prompt went in with others' (``engine.batch_prefill``): its first token is next."""
        self.more = False
        self.position = len(self.run.request.prompt_tokens)

    def feed(self, tokens: int) -> int:
        """The next chunk of at most ``tokens`` prompt tokens (``SequenceState.prefill``: shorter at a prefix
        cache's snapshot edge); returns how many it fed. The last leaves the first token chosen (``more`` False)."""
        before = self.position
        try:
            if self._chunks is None:
                self._chunks = self.run.prefill(tokens)
                self.position = next(self._chunks)
            else:
                self.position = self._chunks.send(tokens)
        except StopIteration:
            self.more = False
            self.position = len(self.run.request.prompt_tokens)
        return self.position - before


def pipeline_failed(engine: Engine | None) -> bool:
    """Whether ``engine`` runs through a pipeline that failed (``PipelineForward.broken``: a call through its
    stages raised, so they may be out of step): its group must be formed anew. A failure confined to one
    request (its consumer, its input, the leader's own evaluation) leaves the pipeline in step, and serving."""
    return engine is not None and getattr(engine.forward, "broken", None) is not None


def _drop(batch: BatchLanes) -> None:
    """A batch whose step failed: its caches dropped (``_free``)."""
    _free(batch.engine, batch.drop, "a failed batch's")


def _release(run: SequenceState) -> None:
    """A newcomer that failed before it joined: its caches dropped (``_free``)."""
    _free(run.engine, run.release, "a failed newcomer's")


def _free(engine: Any, drop: Callable[[], None], whose: str) -> None:
    """Drop caches wherever the layers are, not through a pipeline that failed (its group is formed anew); a
    failure here is logged, never raised: the step's or the newcomer's own error is the one reported."""
    if pipeline_failed(engine):
        return
    try:
        drop()
    except Exception:  # noqa: BLE001
        log.exception("could not drop %s caches", whose)

"""The device queue: ONE thread runs every MLX call (loads and generations), jobs in FIFO order.

MLX work never runs on an event loop or a gRPC handler thread. Every generation decodes in a batch
(``exo.engine.batch``) from its first token: alone, a batch of one (stepped on the request's own caches under
its own depth policy, as fast as a solo loop); every generation of the same model that arrives while it runs
(up to ``max_batch``) joins it (batched plain steps, or batched native-MTP rounds where drafting pays at that
batch size or a request forces a depth): each joins after its own prefill, interleaved chunk by chunk with the
batch's steps (chunks of ``EngineConfig.batch_prefill_chunk`` tokens: a long prompt holds the running streams
for a chunk at a time), and leaves when it ends. A generation joins only while the batch stays within the instance's KV budget (``kv_budget_tokens``,
estimated by ``exo.engine.batch.batch_fits`` from each member's prompt + max_tokens); one that does not fit
waits at the head of the queue until members leave (FIFO: nothing behind it overtakes it). Generations under a grammar or with logprobs batch like any other; a load, or another model's
generation at the head of the queue waits until the batch has drained (FIFO). A runner serves the queue on its MAIN thread (``Device.serve``); an in-process service
(``exo.api.local``) on a parked daemon thread (``Device.start_thread``). Generation jobs count against
a bounded queue (``max_queue`` waiting): submitting to a full queue raises ``QueueFullError`` at once, so
the caller can answer 429 before anything starts. A job talks back through its ``emit`` callback:
``Started`` (it passed validation and the device is on it), the engine's chunks, or ``Failed``; then it
is done (``on_done``).
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Generator, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from exo.cards.schema import CONTEXT_BUDGET_TOKENS
from exo.wire.errors import QueueFullError, RequestTimeoutError
from exo.wire.stream import Failed, Started

from .scheduler import Scheduler, Waiting, shared_call

if TYPE_CHECKING:  # the engine (mlx-lm, transformers: seconds) is imported by the load, not before Status serves
    from exo.engine import Engine, NativeMTPStats
    from exo.engine.batch import BatchLanes
    from exo.engine.prompt import GenerateParams, GenerationRequest, Prompt
    from exo.engine.request import GenerationChunk
    from exo.engine.sequence import SequenceState

log = logging.getLogger(__name__)

__all__ = ["Device", "Failed", "GenerationJob", "Job", "QueueFullError", "RequestTimeoutError", "Started",
           "pipeline_failed"]


class Job(Protocol):
    bounded: bool  # counts against max_queue (generations do; loads do not)

    def run(self) -> None: ...

    def drop(self, reason: str) -> None:
        """Called instead of run() when the device shuts down with the job still queued."""


class GenerationJob:
    """One generation on the device: prompt -> engine chunks, polled for cancellation every step.

    ``engine`` is called on the device thread (it may load the model). ``emit`` receives ``Started``,
    the engine's ``GenerationChunk``s and ``Failed``, in order, from the device thread. ``on_done`` is
    called once with (finish reason, stats, seconds queued, seconds on the device); finish reasons are
    the engine's plus "rejected" (failed before any output), "timeout" and "error".
    """

    bounded = True

    def __init__(
        self,
        device: Device,
        engine: Callable[[], Engine],
        prompt: Prompt,
        params: GenerateParams,
        emit: Callable[[Any], None],
        *,
        timeout_s: float,
        arrived: float | None = None,
        on_done: Callable[[str, NativeMTPStats | None, float, float], None] | None = None,
        step_hook: Callable[[GenerationJob], None] | None = None,
        job_id: str | None = None,
        batch_key: str = "",
    ) -> None:
        self.id = job_id or uuid.uuid4().hex
        self.device = device
        self._engine = engine
        self.prompt = prompt
        self.params = params
        self.emit = emit
        self.timeout_s = timeout_s
        self.arrived = time.monotonic() if arrived is None else arrived
        self.deadline = self.arrived + timeout_s
        self.on_done = on_done
        # Called from should_stop once per decode step (tests inject failures and watch cancellation).
        self.step_hook = step_hook
        self.tokens = 0  # completion tokens so far (written by the device thread)
        self.steps = 0  # decode steps / speculative rounds so far
        self.timed_out = False
        self.cancelled_at: float | None = None  # perf_counter() of cancel()
        self.tokens_at_cancel: int | None = None
        self._cancel = threading.Event()
        # Generations batch with others of the same key (the same model on this device).
        self.batch_key = batch_key
        # The engine's request, tokenized ahead on the device thread to weigh the job for a batch.
        self._prepared: tuple[Engine, GenerationRequest | Exception] | None = None
        self.engine: Engine | None = None  # the engine it runs on, once begun
        self.horizon = 0  # prompt + max_tokens: the KV rows it may hold (0 until known)
        self.prompt_length = 1  # its prompt's tokens, once ``prepare`` tokenized it
        self._queue_s = 0.0
        self._start = 0.0
        self._finish = "error"
        self._stats: NativeMTPStats | None = None

    @property
    def batchable(self) -> bool:
        """Whether this generation can decode in a batch: every one can (grammars and logprobs apply per
        sequence in a batch's steps)."""
        return True

    def prepare(self, engine: Engine) -> int:
        """On the device thread, before it runs: tokenize against ``engine`` (once; ``begin`` reuses it) and
        return the job's horizon (prompt + max_tokens), 0 for a request that ``begin`` will reject."""
        from exo.engine.prompt import generation_request

        if self._prepared is None or self._prepared[0] is not engine:
            try:
                request: GenerationRequest | Exception = generation_request(
                    engine, self.prompt, self.params, self.should_stop
                )
            except Exception as e:
                request = e
            self._prepared = (engine, request)
        request = self._prepared[1]
        if isinstance(request, Exception):
            return 0
        self.prompt_length = len(request.prompt_tokens)
        self.horizon = self.prompt_length + request.max_tokens
        return self.horizon

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def cancel(self) -> None:
        """Any thread: a queued job leaves the queue (done: "cancelled"); a running one stops at its next
        decode step or speculative round."""
        if self._cancel.is_set():
            return
        self.cancelled_at = time.perf_counter()
        self.tokens_at_cancel = self.tokens
        self._cancel.set()
        if self.device.discard(self):
            self._done("cancelled", None, time.monotonic() - self.arrived, 0.0)

    def should_stop(self) -> bool:
        self.steps += 1
        if self.step_hook is not None:
            self.step_hook(self)
        return self.stopped()

    def stopped(self) -> bool:
        """Cancelled, or past the deadline (then timed out), without counting a step (the engine's warm-up
        polls this)."""
        if self._cancel.is_set():
            return True
        if time.monotonic() > self.deadline:
            self.timed_out = True
            self.cancel()
            return True
        return False

    def drop(self, reason: str) -> None:
        from exo.wire.errors import NodeUnavailableError

        self.emit(Failed(NodeUnavailableError(reason)))
        self._done("error", None, time.monotonic() - self.arrived, 0.0)

    def _done(self, finish: str, stats: NativeMTPStats | None, queue_s: float, device_s: float) -> None:
        if self.on_done is not None:
            self.on_done(finish, stats, queue_s, device_s)

    def run(self) -> None:
        """On the device: a batch from its first token (``Device.serve_generations``), which every generation
        that arrives while it runs joins."""
        self.device.serve_generations(self)

    def begin(self) -> SequenceState | None:
        """Leave the queue for the device: the engine's validated run (``Started`` emitted), or None when
        the job ended here (cancelled, timed out, rejected: reported)."""
        from exo.engine.prompt import generation_request

        self._queue_s = queue_s = time.monotonic() - self.arrived
        if self.cancelled:
            self._done("cancelled", None, queue_s, 0.0)
            return None
        if time.monotonic() > self.deadline:
            self.timed_out = True
            self.emit(Failed(RequestTimeoutError(f"the request waited {queue_s:.1f} s for the device and timed out")))
            self._done("timeout", None, queue_s, 0.0)
            return None
        self._start = time.perf_counter()
        try:
            self.engine = engine = self._engine()
            prepared, self._prepared = self._prepared, None
            if prepared is not None and prepared[0] is engine:
                if isinstance(prepared[1], Exception):
                    raise prepared[1]
                request = prepared[1]
            else:
                request = generation_request(engine, self.prompt, self.params, self.should_stop)
            self.horizon = len(request.prompt_tokens) + request.max_tokens
            request.stop_warmup = self.stopped
            run = engine.start(request)
        except Exception as e:
            self.emit(Failed(e))
            self._done("rejected", None, queue_s, time.perf_counter() - self._start)
            return None
        if run.output.finish is not None:  # cancelled or timed out while the engine warmed up
            device_s = time.perf_counter() - self._start
            if self.timed_out:
                self.emit(Failed(RequestTimeoutError("the request timed out while the model warmed up")))
                self._done("timeout", None, queue_s, device_s)
            else:
                self._done("cancelled", None, queue_s, device_s)
            return None
        self.emit(Started(len(request.prompt_tokens), request.max_tokens, queue_s, request.thinking))
        return run

    def consume(self, chunk: GenerationChunk) -> None:
        self.tokens += len(chunk.token_ids)
        self.emit(chunk)
        if chunk.finish_reason is not None:
            self._finish, self._stats = chunk.finish_reason, chunk.stats

    def fail(self, error: BaseException) -> None:
        log.error("generation failed", exc_info=error)
        self._finish = "error"
        try:
            self.emit(Failed(error))
        except Exception:  # the stream that failed may be the one broken: the job still ends
            log.exception("could not report a failed generation")

    def end(self) -> None:
        finish = self._finish
        if finish == "cancelled" and self.timed_out:
            finish = "timeout"
        self._done(finish, self._stats, self._queue_s, time.perf_counter() - self._start)


class Device:
    """A FIFO of jobs, served by whichever thread calls ``serve``."""

    def __init__(
        self,
        max_queue: int,
        *,
        max_batch: int = 1,
        on_depth: Callable[[int], None] | None = None,
        on_batch: Callable[[int], None] | None = None,
        kv_budget_tokens: int | None = None,
    ) -> None:
        """``max_batch``: generations decoding together at most (1: one at a time); ``kv_budget_tokens``:
        the KV a batch may hold together (None: ``CONTEXT_BUDGET_TOKENS``); ``on_batch``: called with the
        batch size after every decode step (1: a generation alone)."""
        self.max_queue = max_queue
        self.max_batch = max(1, max_batch)
        self.kv_budget_tokens = kv_budget_tokens or CONTEXT_BUDGET_TOKENS
        self._on_depth = on_depth or (lambda depth: None)
        self._on_batch = on_batch or (lambda size: None)
        self.active: list[GenerationJob] = []  # generations on the device (device thread writes)
        self._jobs: collections.deque[Job] = collections.deque()
        self._cv = threading.Condition()
        self._closed = False
        self._waiting_bounded = 0
        self.running: Job | None = None
        self.generations = 0
        self._job_seconds = 1.0  # moving average of a generation's duration, for Retry-After
        self._trace = DeviceTrace.from_env()

    @property
    def waiting(self) -> int:
        """Generation requests waiting for the device (the running one excluded)."""
        return self._waiting_bounded

    def retry_after_s(self) -> int:
        return max(1, math.ceil(self._job_seconds * (self._waiting_bounded + 1)))

    def submit(self, job: Job) -> None:
        with self._cv:
            if self._closed:
                raise RuntimeError("the device is shutting down")
            if job.bounded:
                if self._waiting_bounded >= self.max_queue:
                    raise QueueFullError(self._waiting_bounded, self.retry_after_s())
                self._waiting_bounded += 1
            self._jobs.append(job)
            self._on_depth(self._waiting_bounded)
            self._cv.notify()

    def discard(self, job: Job) -> bool:
        """Take a job out of the queue before it runs (its client went away); False if not queued."""
        with self._cv:
            try:
                self._jobs.remove(job)
            except ValueError:
                return False
            if job.bounded:
                self._waiting_bounded -= 1
            self._on_depth(self._waiting_bounded)
            return True

    def close(self, timeout: float = 0.0) -> None:
        """Any thread or a signal handler: stop taking jobs, drop the queued ones, cancel the running one
        and wait up to ``timeout`` s for it; ``serve()`` returns after it."""
        with self._cv:
            self._closed = True
            dropped = list(self._jobs)
            self._jobs.clear()
            self._waiting_bounded = 0
            self._on_depth(0)
            running = self.running
            self._cv.notify_all()
        for job in dropped:
            job.drop("the device is shutting down")
        for job in list(self.active):
            job.cancel()
        if isinstance(running, GenerationJob):
            running.cancel()
        with self._cv:
            deadline = time.monotonic() + timeout
            while self.running is not None and (remaining := deadline - time.monotonic()) > 0:
                self._cv.wait(remaining)

    def serve(self) -> None:
        """Run jobs until ``close()``; call it on the thread that owns the device (MLX)."""
        while True:
            with self._cv:
                while not self._jobs and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                job = self.running = self._jobs.popleft()
                if job.bounded:
                    self._waiting_bounded -= 1
                self._on_depth(self._waiting_bounded)
            start = time.perf_counter()
            if isinstance(job, GenerationJob):
                self.active.append(job)
            try:
                job.run()
            except Exception:  # a job reports its own errors; this keeps the device alive
                log.exception("device job failed")
            finally:
                with self._cv:
                    self.running = None
                    if isinstance(job, GenerationJob) and job in self.active:
                        self.active.remove(job)
                        self.generations += 1
                    self._cv.notify_all()
                if job.bounded:
                    self._job_seconds = 0.8 * self._job_seconds + 0.2 * (time.perf_counter() - start)

    # -- batching ------------------------------------------------------------------------------------------
    def _fits(self, engine: Engine, horizons: list[int]) -> bool:
        from exo.engine.batch import batch_fits

        return batch_fits(engine, [h for h in horizons if h], self.kv_budget_tokens)

    def _waiting(self, key: str, engine: Engine) -> Iterator[Waiting]:
        """The queue from its head as the scheduler weighs it (under the lock; each job tokenized when the
        scheduler gets to it): a generation of this batch's model joins; anything else (a load, another model's
        generation) holds the queue until the batch has drained. A cancelled job joins weightless: it ends when
        it begins."""
        for job in list(self._jobs):
            if not (isinstance(job, GenerationJob) and job.batch_key == key):
                yield Waiting(job, joins=False)
                return
            if job.cancelled:
                yield Waiting(job, joins=True)
                continue
            horizon = job.prepare(engine)
            yield Waiting(job, joins=True, horizon=horizon, prompt=job.prompt_length)

    def _take(self, admitted: tuple[Any, ...]) -> None:
        """The admitted jobs leave the head of the queue (under the lock; ``_waiting`` read them there)."""
        for job in admitted:
            self._jobs.remove(job)
            self._waiting_bounded -= 1
            self.active.append(job)
        if admitted:
            self._on_depth(self._waiting_bounded)

    def serve_generations(self, first: GenerationJob) -> None:
        """Decode ``first`` in a batch with every generation that joins, until all have ended: each step as the
        scheduler (``runner.scheduler``) plans it, newcomers admitted from the head of the queue and prefilled
        in chunks under the step's token budget, then a decode step of the members."""
        from exo.engine.batch import BatchLanes
        from exo.engine.batch_prefill import can_prefill_together, prefill_together

        run = first.begin()
        if run is None:
            return
        engine = run.engine
        config = engine.config
        batch = BatchLanes(engine)
        scheduler = Scheduler(self.max_batch, lambda horizons: self._fits(engine, horizons),
                              step_tokens=config.batch_prefill_chunk, idle_tokens=config.prefill_chunk)
        members: dict[int, GenerationJob] = {}  # id(run) -> its job
        runs: dict[int, SequenceState] = {}  # id(run) -> the run
        newcomers: dict[GenerationJob, _Newcomer] = {}
        pending: list[Waiting] = [Waiting(first, True, first.horizon, len(run.request.prompt_tokens))]

        def leave(job: GenerationJob, failed: BaseException | None = None) -> None:
            scheduler.left(job)
            if failed is not None:
                job.fail(failed)
            job.end()
            with self._cv:
                if job in self.active:
                    self.active.remove(job)
                    self.generations += 1

        def drop_newcomer(job: GenerationJob, error: BaseException | None = None) -> None:
            """A newcomer that ends before it joined: its caches dropped, then its end (``error``: failed)."""
            newcomer = newcomers.pop(job)
            if error is not None:
                _release(newcomer.run)
                leave(job, error)
                return
            try:
                newcomer.run.release()  # a pipeline's stages drop its caches too
                job.consume(newcomer.run.final_chunk())
            except Exception as e:
                leave(job, e)
                return
            leave(job)

        def fail_all(error: BaseException) -> None:
            """The batch failed (a step, or a member's leaving): every member and newcomer ends with ``error``."""
            for newcomer in newcomers.values():
                _release(newcomer.run)
            _drop(batch)
            for member in members.values():
                leave(member, error)
            for job in newcomers:
                leave(job, error)

        trace = self._trace
        while True:
            lap = trace.step()
            with self._cv:
                waiting = itertools.chain(pending, () if self._closed else self._waiting(first.batch_key, engine))
                plan = scheduler.plan(waiting)
                self._take(tuple(job for job in plan.admit if job is not first))
            pending = []
            lap("plan")
            for job in plan.admit:
                new = run if job is first else job.begin()
                if new is None:  # ended there (cancelled, timed out, rejected: reported)
                    scheduler.left(job)
                    with self._cv:
                        self.active.remove(job)
                        self.generations += 1
                elif new.engine is not engine or not new.batchable:
                    _release(new)
                    leave(job, RuntimeError("the model changed under a running batch; retry"))
                else:
                    newcomers[job] = _Newcomer(new)
                    scheduler.begun(job, len(new.request.prompt_tokens) - new.prefilled)
            fed = {chunk.key: chunk.tokens for chunk in plan.prefill}
            # Newcomers whose whole prompt this step feeds from its start go through the backbone as rows of
            # one call (``engine.batch_prefill``: each row its solo prefill), as many as the budget pads to.
            together = shared_call(((job, len(n.run.request.prompt_tokens)) for job, n in newcomers.items()
                                    if job in fed and n.fresh and n.run.whole_prompt_in(fed[job])),
                                   plan.budget) if can_prefill_together(engine) else []
            for job in list(newcomers):
                newcomer = newcomers.get(job)
                if newcomer is None:  # it failed in the shared call of the newcomers before it
                    continue
                if job not in fed:  # no room in this step's budget: it may have left meanwhile
                    if job.stopped():
                        newcomer.run.output.finish = "cancelled"
                        drop_newcomer(job)
                    continue
                if together and job is together[0]:
                    try:
                        prefill_together([newcomers[j].run for j in together])
                    except Exception as e:  # every one of them fails: the batch's members are untouched
                        for j in together:
                            drop_newcomer(j, e)
                        continue
                    for j in together:
                        newcomers[j].prefilled()
                # The engine's part (the newcomer's chunk, its first token, its end) and its consumer's part
                # apart: a consumer that raises ends its request alone, with every stage in step.
                new = newcomer.run
                try:
                    scheduler.fed(job, newcomer.feed(fed[job]) if newcomer.more else fed[job])
                    if newcomer.more:  # a chunk done, more to come: the batch steps first
                        if new.cancelled():
                            drop_newcomer(job)
                        continue
                    del newcomers[job]
                    last = list(new.first_token(store=False))
                    if new.output.finish is not None:  # done at its first token (or cancelled by now)
                        new.store_prompt()
                        new.release()
                        last.append(new.final_chunk())
                except Exception as e:
                    newcomers.pop(job, None)
                    _release(new)
                    leave(job, e)
                    continue
                try:
                    for chunk in last:
                        job.consume(chunk)
                except Exception as e:  # its stream broke: it alone leaves
                    if new.output.finish is None:
                        _release(new)
                    leave(job, e)
                    continue
                if new.output.finish is not None:
                    leave(job)
                    continue
                try:
                    # The prompt's prefix-cache store, once its first token is out (its copies and the tier's
                    # puts would otherwise delay it), before the batch's next step moves its caches on.
                    new.store_prompt()
                    batch.add(new)
                except Exception as e:
                    _release(new)
                    leave(job, e)
                    continue
                scheduler.joined(job)
                members[id(new)] = job
                runs[id(new)] = new
            if plan.prefill:
                batch.interleaved()  # prefill ran on the device: this round's time is not a round's alone
            lap("prefill", admitted=len(plan.admit), held=plan.held, prefill_tokens=sum(c.tokens for c in plan.prefill),
                together=len(together), members=len(batch))
            # A member whose client went away (or whose deadline passed) since the last step leaves before the
            # next one: its row is not computed again.
            for key, job in list(members.items()):
                if job.stopped():
                    ended = runs.pop(key)
                    del members[key]
                    try:
                        batch.remove(ended)  # (a pipeline's stages drop its rows too)
                    except Exception as e:
                        leave(job, e)
                        fail_all(e)
                        return
                    ended.output.finish = "cancelled"
                    try:
                        job.consume(ended.final_chunk())
                    except Exception as e:  # its stream is gone anyway
                        leave(job, e)
                        continue
                    leave(job)
            if not len(batch):
                lap("emit", stepped=0)
                if len(scheduler):
                    continue
                return
            try:
                results = batch.step()
            except Exception as e:
                fail_all(e)
                return
            lap("step")
            self._on_batch(len(results))
            for ended, chunks in results:
                job = members[id(ended)]
                try:
                    for chunk in chunks:
                        job.consume(chunk)
                except Exception as e:  # this member's stream broke: it alone leaves, the others go on
                    del members[id(ended)]
                    runs.pop(id(ended), None)
                    leave(job, e)
                    if ended.output.finish is None:
                        try:
                            batch.remove(ended)  # (a pipeline's stages drop its rows too)
                        except Exception as e:
                            fail_all(e)
                            return
                    continue
                if ended.output.finish is not None:
                    del members[id(ended)]
                    runs.pop(id(ended), None)
                    leave(job)
            lap("emit", stepped=len(results))

    def start_thread(self, name: str = "exo-device") -> threading.Thread:
        """Serve on a new daemon thread that is parked, never ended, once ``close()`` returns: a thread
        that ran MLX frees MLX's per-thread state on exit, which needs the GIL and aborts the process
        when that exit races the interpreter's shutdown. A parked daemon thread goes away with the process."""

        def main() -> None:
            self.serve()
            threading.Event().wait()

        thread = threading.Thread(target=main, name=name, daemon=True)
        thread.start()
        return thread

    def snapshot(self) -> dict[str, Any]:
        with self._cv:
            running = len(self.active)
            return {"queue_depth": self._waiting_bounded, "running": running, "generations": self.generations}


class DeviceTrace:
    """Where the device thread's time goes, step by step (``EXO_DEVICE_TRACE=DIR``: off unless set): one JSON line
    per step of a batch in ``DIR/device-<pid>.jsonl`` with its start (``time.monotonic()``, comparable across
    processes), the seconds of each phase (``plan``: the scheduler and tokenizing the queue's head; ``prefill``:
    beginning the admitted, their chunks and first tokens; ``step``: the members' decode step; ``emit``: their
    tokens to their streams) and what it carried. For benchmarks (bench/serving.py reads it back)."""

    def __init__(self, path: str | None) -> None:
        self._file = open(path, "a", buffering=1 << 16) if path else None  # noqa: SIM115 - open for the process
        self._flushed = time.monotonic()

    @classmethod
    def from_env(cls) -> DeviceTrace:
        import os

        folder = os.environ.get("EXO_DEVICE_TRACE")
        if not folder:
            return cls(None)
        os.makedirs(folder, exist_ok=True)
        return cls(os.path.join(folder, f"device-{os.getpid()}.jsonl"))

    def step(self) -> Callable[..., None]:
        """A new step: returns ``lap(phase, **fields)``, which closes the phase (the last, "emit", writes the line)."""
        if self._file is None:
            return _no_lap
        start = last = time.monotonic()
        line: dict[str, Any] = {"t": start}

        def lap(phase: str, **fields: Any) -> None:
            nonlocal last
            now = time.monotonic()
            line[phase] = now - last
            line.update(fields)
            last = now
            if phase == "emit":
                self._write(line)

        return lap

    def _write(self, line: dict[str, Any]) -> None:
        import json

        assert self._file is not None
        self._file.write(json.dumps(line, separators=(",", ":")) + "\n")
        if line["t"] - self._flushed > 1.0:
            self._file.flush()
            self._flushed = line["t"]


def _no_lap(phase: str, **fields: Any) -> None:
    pass


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
    """A batch whose step failed: its caches dropped wherever the layers are (not through a pipeline that
    failed: its group is formed anew)."""
    if pipeline_failed(batch.engine):
        return
    try:
        batch.drop()
    except Exception:  # noqa: BLE001 - the step's own error is the one reported
        log.exception("could not drop a failed batch's caches")


def _release(run: SequenceState) -> None:
    """A newcomer that failed before it joined: its caches dropped wherever the layers are (not through a
    pipeline that failed: its group is formed anew)."""
    if pipeline_failed(run.engine):
        return
    try:
        run.release()
    except Exception:  # noqa: BLE001 - the newcomer's own error is the one reported
        log.exception("could not drop a failed newcomer's caches")

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
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from exo.cards.schema import CONTEXT_BUDGET_TOKENS
from exo.wire.errors import QueueFullError, RequestTimeoutError
from exo.wire.stream import Failed, Started

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
        self.horizon = len(request.prompt_tokens) + request.max_tokens
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

    @staticmethod
    def _joins(job: Job, key: str) -> bool:
        return isinstance(job, GenerationJob) and job.batchable and job.batch_key == key and not job.cancelled

    def _admit(self, key: str, room: int, engine: Engine, horizons: list[int]) -> list[GenerationJob]:
        """Take from the head of the queue the generations that can join a batch whose members have these
        horizons, within the KV budget (FIFO: stop at the first that cannot)."""
        admitted: list[GenerationJob] = []
        horizons = list(horizons)
        with self._cv:
            while self._jobs and len(admitted) < room and not self._closed:
                head = self._jobs[0]
                if not self._joins(head, key):
                    break
                assert isinstance(head, GenerationJob)
                horizon = head.prepare(engine)
                if not self._fits(engine, [*horizons, horizon]):
                    break
                horizons.append(horizon)
                self._jobs.popleft()
                self._waiting_bounded -= 1
                admitted.append(head)  # type: ignore[arg-type]
            if admitted:
                self.active.extend(admitted)
                self._on_depth(self._waiting_bounded)
        return admitted

    def serve_generations(self, first: GenerationJob) -> None:
        """Decode ``first`` in a batch with every generation that joins, until all have ended. ``first``
        prefills in the engine's solo chunks; newcomers to a batch under way prefill one chunk per step, between
        the batch's decode steps."""
        from exo.engine.batch import BatchLanes

        run = first.begin()
        if run is None:
            return
        batch = BatchLanes(run.engine)
        members: dict[int, GenerationJob] = {}
        prefilling: list[tuple[GenerationJob, SequenceState, Iterator[int]]] = [(first, run, run.prefill())]

        def leave(job: GenerationJob, failed: BaseException | None = None) -> None:
            if failed is not None:
                job.fail(failed)
            job.end()
            with self._cv:
                if job in self.active:
                    self.active.remove(job)
                    self.generations += 1

        def fail_all(error: BaseException) -> None:
            """The batch failed (a step, or a member's leaving): every member and newcomer ends with ``error``."""
            for _, new, _ in prefilling:
                _release(new)
            _drop(batch)
            for member in members.values():
                leave(member, error)
            for job, _, _ in prefilling:
                leave(job, error)

        while True:
            horizons = [m.horizon for m in members.values()] + [job.horizon for job, _, _ in prefilling]
            room = self.max_batch - len(batch) - len(prefilling)
            for job in self._admit(first.batch_key, room, batch.engine, horizons):
                new = job.begin()
                if new is None:
                    with self._cv:
                        self.active.remove(job)
                        self.generations += 1
                elif new.engine is not batch.engine or not new.batchable:
                    _release(new)
                    leave(job, RuntimeError("the model changed under a running batch; retry"))
                else:
                    prefilling.append((job, new, new.prefill(new.engine.config.batch_prefill_chunk)))  # smaller chunks
            still: list[tuple[GenerationJob, SequenceState, Iterator[int]]] = []
            for job, new, chunks in prefilling:
                # The engine's part (the newcomer's prefill, its first token, its end) and its consumer's part
                # apart: a consumer that raises ends its request alone, with every stage in step.
                try:
                    if next(chunks, None) is not None:  # one prefill chunk done, more to come: decode steps first
                        if new.cancelled():
                            new.release()  # a pipeline's stages drop its caches too
                            last = [new.final_chunk()]
                        else:
                            still.append((job, new, chunks))
                            continue
                    else:
                        last = list(new.first_token())
                        if new.output.finish is not None:
                            new.release()
                            last.append(new.final_chunk())
                except Exception as e:
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
                    batch.add(new)
                except Exception as e:
                    _release(new)
                    leave(job, e)
                    continue
                members[id(new)] = job
            if prefilling:
                batch.interleaved()  # prefill ran on the device: this round's time is not a round's alone
            prefilling = still
            if not len(batch):
                if prefilling:
                    continue
                return
            try:
                results = batch.step()
            except Exception as e:
                fail_all(e)
                return
            self._on_batch(len(results))
            for ended, chunks in results:
                job = members[id(ended)]
                try:
                    for chunk in chunks:
                        job.consume(chunk)
                except Exception as e:  # this member's stream broke: it alone leaves, the others go on
                    del members[id(ended)]
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
                    leave(job)

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

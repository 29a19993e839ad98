"""The device queue: ONE thread runs every MLX call (loads and generations), jobs in FIFO order.

MLX work never runs on an event loop or a gRPC handler thread. A runner serves the queue on its MAIN thread
(``Device.serve``); an in-process service (``exo.api.local``) on a parked daemon thread
(``Device.start_thread``). This module is the queue and its admission surface; its parts live beside it:

- ``runner.job``: ``Job`` and ``GenerationJob`` (one generation: prompt -> ``Started``, the engine's chunks
  or ``Failed``, through its ``emit``; then ``on_done`` once);
- ``runner.batch_loop``: ``BatchLoop``, one batch on the device from its first generation until it drained.
  Every generation decodes in a batch (``exo.engine.batch``) from its first token: alone, a batch of one;
  every generation of the same model that arrives while it runs (up to ``max_batch``, within the instance's
  KV budget ``kv_budget_tokens``, estimated by ``exo.engine.batch.batch_fits`` from each member's prompt +
  max_tokens) joins it after its own prefill, interleaved chunk by chunk with the batch's steps, and leaves
  when it ends. Generations under a grammar or with logprobs batch like any other;
- ``runner.scheduler``: the one place that decides, step by step, whom a batch admits and which prompt chunks
  it prefills (``Device.plan_step`` hands it the queue's head);
- ``runner.trace``: ``DeviceTrace`` (``EXO_DEVICE_TRACE``), where the device thread's time goes.

Invariants of the queue (under its lock): a job is in exactly one of the queue (``_jobs``), the running set
(``active``, generations on the device) or done; ``waiting`` counts the generations queued (bounded by
``max_queue``: submitting to a full queue raises ``QueueFullError`` at once, so the caller can answer 429
before anything starts); a job that leaves the queue other than by running is told so (``Job.drop``, or
``GenerationJob.cancel``'s own end). FIFO: a generation that does not fit a running batch holds the queue's
head until members leave, and a load or another model's generation at the head waits until the batch has
drained.
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from exo.cards.schema import CONTEXT_BUDGET_TOKENS
from exo.wire.errors import QueueFullError, RequestTimeoutError
from exo.wire.stream import Failed, Started

from .batch_loop import BatchLoop, pipeline_failed
from .job import GenerationJob, Job
from .scheduler import Scheduler, StepPlan, Waiting
from .trace import DeviceTrace

if TYPE_CHECKING:  # the engine (mlx-lm, transformers: seconds) is imported by the load, not before Status serves
    from exo.engine import Engine

log = logging.getLogger(__name__)

# Re-exported: what the runner's service, the in-process service and the tests import from here.
__all__ = ["Device", "DeviceTrace", "Failed", "GenerationJob", "Job", "QueueFullError", "RequestTimeoutError",
           "Started", "pipeline_failed"]


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
        self.trace = DeviceTrace.from_env()

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

    # -- the batch's side (``runner.batch_loop``) ----------------------------------------------------------
    def fits(self, engine: Engine, horizons: list[int]) -> bool:
        """Whether runs with these horizons may decode together within the KV budget."""
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
        """Decode ``first`` in a batch with every generation that joins, until all have ended
        (``runner.batch_loop``)."""
        run = first.begin()
        if run is None:
            return
        BatchLoop(self, first, run).serve()

    def plan_step(self, scheduler: Scheduler, pending: Iterable[Waiting], first: GenerationJob,
                  engine: Engine) -> StepPlan:
        """A batch's next step as ``scheduler`` plans it over ``pending`` then the queue from its head (none once
        closed); the jobs it admits leave the queue for the running set (``first``: out of it already)."""
        with self._cv:
            waiting = itertools.chain(pending, () if self._closed else self._waiting(first.batch_key, engine))
            plan = scheduler.plan(waiting)
            self._take(tuple(job for job in plan.admit if job is not first))
        return plan

    def finished(self, job: GenerationJob) -> None:
        """A generation of a batch ended: it leaves the running set (once) and counts as served."""
        with self._cv:
            if job in self.active:
                self.active.remove(job)
                self.generations += 1

    def on_batch(self, size: int) -> None:
        """A decode step of ``size`` members ran."""
        self._on_batch(size)

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

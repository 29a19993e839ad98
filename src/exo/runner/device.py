"""The device queue: ONE thread runs every MLX call (loads and generations), jobs in FIFO order.

MLX work never runs on an event loop or a gRPC handler thread, and a device runs one generation at a
time. A runner serves the queue on its MAIN thread (``Device.serve``); an in-process service
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
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from exo.wire.errors import QueueFullError, RequestTimeoutError

if TYPE_CHECKING:  # the engine (mlx-lm, transformers: seconds) is imported by the load, not before Status serves
    from exo.engine import Engine, NativeMTPStats
    from exo.engine.prompt import GenerateParams, Prompt

log = logging.getLogger(__name__)

__all__ = ["Device", "Failed", "GenerationJob", "Job", "QueueFullError", "RequestTimeoutError", "Started"]


@dataclass(frozen=True)
class Started:
    """The first item of a generation: it passed validation and the device is on it."""

    prompt_tokens: int
    max_tokens: int
    queue_s: float


@dataclass(frozen=True)
class Failed:
    error: BaseException


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
        from exo.engine.prompt import generation_request

        queue_s = time.monotonic() - self.arrived
        if self.cancelled:
            self._done("cancelled", None, queue_s, 0.0)
            return
        if time.monotonic() > self.deadline:
            self.timed_out = True
            self.emit(Failed(RequestTimeoutError(f"the request waited {queue_s:.1f} s for the device and timed out")))
            self._done("timeout", None, queue_s, 0.0)
            return
        start = time.perf_counter()
        try:
            engine = self._engine()
            request = generation_request(engine, self.prompt, self.params, self.should_stop)
            chunks = engine.generate(request)
        except Exception as e:
            self.emit(Failed(e))
            self._done("rejected", None, queue_s, time.perf_counter() - start)
            return
        self.emit(Started(len(request.prompt_tokens), request.max_tokens, queue_s))
        finish, stats = "error", None
        try:
            for chunk in chunks:
                self.tokens += len(chunk.token_ids)
                self.emit(chunk)
                if chunk.finish_reason is not None:
                    finish, stats = chunk.finish_reason, chunk.stats
        except Exception as e:
            log.exception("generation failed")
            self.emit(Failed(e))
        finally:
            if finish == "cancelled" and self.timed_out:
                finish = "timeout"
            self._done(finish, stats, queue_s, time.perf_counter() - start)


class Device:
    """A FIFO of jobs, served by whichever thread calls ``serve``."""

    def __init__(self, max_queue: int, *, on_depth: Callable[[int], None] | None = None) -> None:
        self.max_queue = max_queue
        self._on_depth = on_depth or (lambda depth: None)
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
            try:
                job.run()
            except Exception:  # a job reports its own errors; this keeps the device alive
                log.exception("device job failed")
            finally:
                with self._cv:
                    self.running = None
                    if job.bounded:
                        self.generations += 1
                    self._cv.notify_all()
                if job.bounded:
                    self._job_seconds = 0.8 * self._job_seconds + 0.2 * (time.perf_counter() - start)

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
            running = 1 if isinstance(self.running, GenerationJob) else 0
            return {"queue_depth": self._waiting_bounded, "running": running, "generations": self.generations}

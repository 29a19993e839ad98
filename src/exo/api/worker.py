"""The device worker: ONE thread runs every MLX call (model loads and generations), jobs in FIFO order.

MLX work never runs on the event loop, and a device runs one generation at a time. Handlers submit
jobs; a job talks back to its handler through a ``Channel`` (worker thread -> the handler's event
loop, in order). Generation jobs count against a bounded queue (``max_queue`` waiting); submitting to
a full queue raises ``QueueFullError`` at once, so the handler can answer 429 before anything starts.
The thread lives as long as the process (see ``DeviceWorker.close``).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from .errors import QueueFullError

log = logging.getLogger(__name__)


class Job(Protocol):
    bounded: bool  # counts against max_queue (generations do; internal loads do not)

    def run(self) -> None: ...

    def drop(self, reason: str) -> None:
        """Called instead of run() when the worker shuts down with the job still queued."""


class Channel:
    """Items from the worker thread to one handler, in order, through the handler's event loop.

    The worker appends under a lock and wakes the loop only when no wake-up is pending, so a busy
    handler takes everything delivered meanwhile in one batch (one write for several tokens).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._items: collections.deque[Any] = collections.deque()
        self._lock = threading.Lock()
        self._wake_pending = False
        self._waiter: asyncio.Future[None] | None = None  # event loop side only

    def put(self, item: Any) -> None:
        """Thread-safe; a closed loop (server gone) drops the item."""
        with self._lock:
            self._items.append(item)
            if self._wake_pending:
                return
            self._wake_pending = True
        try:
            self._loop.call_soon_threadsafe(self._wake)
        except RuntimeError:
            pass

    def _wake(self) -> None:
        with self._lock:
            self._wake_pending = False
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get_batch(self, deadline: float) -> list[Any]:
        """Everything delivered so far (at least one item); TimeoutError past ``deadline`` (loop time)."""
        while True:
            with self._lock:
                if self._items:
                    items = list(self._items)
                    self._items.clear()
                    return items
            # A put() after the check schedules _wake, which runs after this coroutine yields: no lost wake-up.
            self._waiter = self._loop.create_future()
            try:
                async with asyncio.timeout_at(deadline):
                    await self._waiter
            finally:
                self._waiter = None


class DeviceWorker:
    """A FIFO of jobs served by one thread."""

    def __init__(
        self,
        max_queue: int,
        *,
        name: str = "exo-device",
        on_depth: Callable[[int], None] | None = None,
    ) -> None:
        self.max_queue = max_queue
        self._on_depth = on_depth or (lambda depth: None)
        self._jobs: collections.deque[Job] = collections.deque()
        self._cv = threading.Condition()
        self._closed = False
        self._waiting_bounded = 0
        self.running: Job | None = None
        self._job_seconds = 1.0  # moving average of a job's duration, for Retry-After
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        """Generation requests waiting for the device (the running one excluded)."""
        return self._waiting_bounded

    def retry_after_s(self) -> int:
        return max(1, math.ceil(self._job_seconds * (self._waiting_bounded + 1)))

    def submit(self, job: Job) -> None:
        with self._cv:
            if self._closed:
                raise RuntimeError("the server is shutting down")
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

    def close(self, timeout: float = 10.0) -> None:
        """Stop taking jobs, drop the queued ones, wait for the running one (callers cancel it first).

        The thread itself is never ended, only parked: a thread that ran MLX frees MLX's per-thread
        compile cache on exit, which needs the GIL and aborts the process when that exit races the
        interpreter's shutdown. A parked daemon thread simply goes away with the process.
        """
        with self._cv:
            self._closed = True
            dropped = list(self._jobs)
            self._jobs.clear()
            self._waiting_bounded = 0
            self._on_depth(0)
            deadline = time.monotonic() + timeout
            while self.running is not None and (remaining := deadline - time.monotonic()) > 0:
                self._cv.wait(remaining)
        for job in dropped:
            job.drop("the server is shutting down")

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._jobs:
                    self._cv.wait()
                job = self._jobs.popleft()
                if job.bounded:
                    self._waiting_bounded -= 1
                self._on_depth(self._waiting_bounded)
                self.running = job
            start = time.perf_counter()
            try:
                job.run()
            except Exception:  # a job reports its own errors; this only keeps the device alive
                log.exception("device job failed")
            finally:
                with self._cv:
                    self.running = None
                    self._cv.notify_all()
                if job.bounded:
                    self._job_seconds = 0.8 * self._job_seconds + 0.2 * (time.perf_counter() - start)

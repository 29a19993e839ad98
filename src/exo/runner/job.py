"""A job of the device queue (``runner.device``), and the one that generates: ``GenerationJob``.

A job talks back through its ``emit`` callback: ``Started`` (it passed validation and the device is on it),
the engine's chunks, or ``Failed``; then it is done (``on_done``, called exactly once, whatever the path:
cancelled in the queue, dropped at shutdown, rejected when it began, ended in a batch). Its ``run``, on the
device thread, serves it in a batch (``runner.batch_loop``) that every generation of its model arriving
meanwhile joins.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from exo.wire.errors import RequestTimeoutError
from exo.wire.stream import Failed, Started

if TYPE_CHECKING:  # the engine (mlx-lm, transformers: seconds) is imported by the load, not before Status serves
    from exo.engine import Engine, NativeMTPStats
    from exo.engine.prompt import GenerateParams, GenerationRequest, Prompt
    from exo.engine.request import GenerationChunk
    from exo.engine.sequence import SequenceState

    from .device import Device

log = logging.getLogger(__name__)


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

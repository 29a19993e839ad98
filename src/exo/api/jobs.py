"""The device worker's jobs: one generation (tokenize, check, generate, relay chunks) and one model load.

Both run on the ``DeviceWorker`` thread, so every MLX call (and the tokenizer) stays off the event loop
and one generation runs at a time. A generation talks to its handler through a ``Channel``; its
``should_stop`` (polled by the engine once per decode step or speculative round) ends it when the
client went away or the request's deadline passed.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
import uuid
from typing import TYPE_CHECKING

from exo.engine import GenerationRequest, ResolvedModel
from exo.runner.prompt import completion_budget, tokenize

from .errors import RequestTimeoutError
from .service import Failed, GenerateParams, Prompt, Started
from .worker import Channel

if TYPE_CHECKING:
    from .local import LocalModelService

log = logging.getLogger(__name__)

class GenerationJob:
    """One generation request on the device worker."""

    bounded = True

    def __init__(
        self,
        service: LocalModelService,
        model_id: str,
        prompt: Prompt,
        params: GenerateParams,
        channel: Channel,
        *,
        timeout_s: float,
        arrived: float,
    ) -> None:
        self.id = uuid.uuid4().hex
        self.service = service
        self.model_id = model_id
        self.prompt = prompt
        self.params = params
        self.channel = channel
        self.timeout_s = timeout_s
        self.arrived = arrived
        self.deadline = arrived + timeout_s
        self.tokens = 0  # completion tokens so far (written by the worker thread)
        self.steps = 0  # decode steps / speculative rounds so far
        self.timed_out = False
        self._cancel = threading.Event()
        self._cancelled_at: float | None = None
        self._tokens_at_cancel: int | None = None

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def cancel(self) -> None:
        """Any thread: a queued job leaves the queue; a running one stops at its next step or round."""
        if self._cancel.is_set():
            return
        self._cancelled_at = time.perf_counter()
        self._tokens_at_cancel = self.tokens
        self._cancel.set()
        if self.service.worker.discard(self):
            self.service._record(self, "cancelled", None, time.monotonic() - self.arrived, 0.0)

    def should_stop(self) -> bool:
        self.steps += 1
        if self.service.step_hook is not None:
            self.service.step_hook(self)
        if self._cancel.is_set():
            return True
        if time.monotonic() > self.deadline:
            self.timed_out = True
            self.cancel()
            return True
        return False

    def drop(self, reason: str) -> None:
        self.channel.put(Failed(RuntimeError(reason)))

    def run(self) -> None:
        svc = self.service
        queue_s = time.monotonic() - self.arrived
        svc.metrics.queue_wait.observe(queue_s)
        if self.cancelled:
            svc._record(self, "cancelled", None, queue_s, 0.0)
            return
        if time.monotonic() > self.deadline:
            self.timed_out = True
            self.channel.put(
                Failed(RequestTimeoutError(f"the request waited {queue_s:.1f} s for the device and timed out"))
            )
            svc._record(self, "timeout", None, queue_s, 0.0)
            return
        start = time.perf_counter()
        try:
            engine = svc._engine(self.model_id)
            prompt, params = self.prompt, self.params
            tokens = tokenize(
                engine.loaded.tokenizer,
                messages=prompt.messages,
                text=prompt.text,
                token_ids=prompt.token_ids,
                template_kwargs=prompt.template_kwargs,
            )
            param = "messages" if prompt.messages is not None else "prompt"
            max_tokens = completion_budget(engine, len(tokens), params.max_tokens, params.default_max_tokens, param)
            request = GenerationRequest(
                prompt_tokens=tokens,
                max_tokens=max_tokens,
                sampling=self.params.sampling,
                stop=self.params.stop,
                native_mtp=self.params.native_mtp,
                mtp_k=self.params.mtp_k,
                should_stop=self.should_stop,
            )
            chunks = engine.generate(request)
        except Exception as e:
            self.channel.put(Failed(e))
            svc._record(self, "rejected", None, queue_s, time.perf_counter() - start)
            return
        self.channel.put(Started(len(tokens), max_tokens, queue_s))
        svc.metrics.running.set(1)
        finish, stats = "error", None
        try:
            for chunk in chunks:
                self.tokens += len(chunk.token_ids)
                self.channel.put(chunk)
                if chunk.finish_reason is not None:
                    finish, stats = chunk.finish_reason, chunk.stats
        except Exception as e:
            log.exception("generation failed (model %s)", self.model_id)
            self.channel.put(Failed(e))
        finally:
            svc.metrics.running.set(0)
            if finish == "cancelled" and self.timed_out:
                finish = "timeout"
            svc._record(self, finish, stats, queue_s, time.perf_counter() - start)


class LoadJob:
    """Load one model on the device worker; waiters share a concurrent Future."""

    bounded = False

    def __init__(self, service: LocalModelService, resolved: ResolvedModel) -> None:
        self.service = service
        self.resolved = resolved
        self.future: concurrent.futures.Future[str] = concurrent.futures.Future()

    def run(self) -> None:
        if not self.future.set_running_or_notify_cancel():
            return
        try:
            self.service._engine(self.resolved.model_id, self.resolved)
            self.future.set_result(self.resolved.model_id)
        except BaseException as e:
            self.future.set_exception(e)
        finally:
            self.service._load_finished(self.resolved.model_id)

    def drop(self, reason: str) -> None:
        if self.future.set_running_or_notify_cancel():
            self.future.set_exception(RuntimeError(reason))
        self.service._load_finished(self.resolved.model_id)

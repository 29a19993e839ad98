"""``LocalModelService``: the models of this machine, in this process, behind the ``ModelService`` interface.

For notebooks, benchmarks and tests (``exo serve`` runs models in runner processes: see
``exo.cluster.orchestration``). Serves the catalog's local models (bundled first) and directories
registered by ``exo serve --model``. The runner's device queue (``exo.runner.device.Device``), served by
one parked thread, does every load and generation in FIFO order; chunks reach the handler through a
``Channel``. Loaded engines stay in memory up to ``max_loaded`` (least recently used evicted first).
Requests name models by card id or repo id, never by path: clients cannot make the server read
arbitrary directories.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from exo.cards import Catalog, UnknownModelError, load_catalog
from exo.cluster.listing import LoadedFacts, model_info, model_rows
from exo.cluster.service import (
    DEADLINE_GRACE_S,
    BatchedStream,
    GenerateParams,
    ModelInfo,
    ModelLoadTimeoutError,
    Prompt,
    RequestTimeoutError,
    Started,
)
from exo.engine import Engine, NativeMTPStats, ResolvedModel
from exo.engine.prompt import tokenize
from exo.engine.request import MTPSwitch
from exo.engine.resolve import DEFAULT_MODEL, resolve_model
from exo.metrics import Metrics
from exo.runner.device import Device, GenerationJob
from exo.runner.loading import load_for_serving, ready_engine
from exo.runner.outbox import Pacing
from exo.settings import Settings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class JobRecord:
    """A finished generation, as the service remembers it (``LocalModelService.history``)."""

    id: str
    model: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    queue_s: float
    device_s: float
    tokens_at_cancel: int | None  # tokens generated when cancel() was called (None: not cancelled)
    cancel_latency_s: float | None  # from cancel() to the device being free


class Channel:
    """Items from the device thread to one handler, in order, through the handler's event loop.

    The device appends under a lock and wakes the loop only when no wake-up is pending and the item may go now
    (``runner.outbox.Pacing``: a first token, a last chunk, anything not a token at once; other tokens once
    ``interval_s`` has passed since the handler last took tokens, ``EXO_STREAM_INTERVAL_S``), so the handler takes
    everything delivered meanwhile in one batch (one write for several tokens) and wakes at most once an interval
    while tokens flow.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, interval_s: float = 0.0) -> None:
        self._loop = loop
        self._items: collections.deque[Any] = collections.deque()
        self._lock = threading.Lock()
        self._pacing = Pacing(interval_s)
        self._wake_pending = False
        self._waiter: asyncio.Future[None] | None = None  # event loop side only

    def put(self, item: Any) -> None:
        """Thread-safe; a closed loop (server gone) drops the item."""
        with self._lock:
            self._items.append(item)
            if not self._pacing.wakes(item) or self._wake_pending:
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
        """Everything delivered so far once it may go (at least one item); TimeoutError past ``deadline`` (loop
        time)."""
        while True:
            with self._lock:
                held = bool(self._items)
                if self._pacing.ready(held):
                    items = list(self._items)
                    self._items.clear()
                    self._pacing.taken(items)
                    return items
                # Tokens held inside the interval: up at its end (the loop's clock, from time.monotonic()'s).
                until = self._pacing.until(held, float("inf"))
            # A put() after the check schedules _wake, which runs after this coroutine yields: no lost wake-up.
            self._waiter = self._loop.create_future()
            wait_until = deadline if until == float("inf") else min(deadline, self._loop.time() + until - time.monotonic())
            try:
                async with asyncio.timeout_at(wait_until):
                    await self._waiter
            except TimeoutError:
                if wait_until >= deadline:
                    raise
            finally:
                self._waiter = None


class GenerationStream(BatchedStream):
    """A generation on this process's device."""

    def __init__(self, job: GenerationJob, channel: Channel) -> None:
        self._job = job
        self._channel = channel
        self._buffer: collections.deque[Any] = collections.deque()
        self._error = None
        self.finished = False

    @property
    def id(self) -> str:
        return self._job.id

    @property
    def timeout_s(self) -> float:  # type: ignore[override]
        return self._job.timeout_s

    @property
    def tokens(self) -> int:  # type: ignore[override]
        return self._job.tokens

    def cancel(self) -> None:
        self._job.cancel()

    def _put_back(self, items: list[Any]) -> None:
        self._buffer.extendleft(reversed(items))

    async def _take(self) -> list[Any]:
        if not self._buffer:
            try:
                remaining = self._job.deadline + DEADLINE_GRACE_S - time.monotonic()
                loop_deadline = asyncio.get_running_loop().time() + remaining  # the loop's own clock
                self._buffer.extend(await self._channel.get_batch(loop_deadline))
            except TimeoutError:
                self._job.cancel()
                raise RequestTimeoutError(
                    f"the request exceeded the server's request timeout of {self._job.timeout_s:g} s"
                ) from None
        items = list(self._buffer)
        self._buffer.clear()
        return items


class LoadJob:
    """Load one model on the device; waiters share a concurrent Future."""

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


class LocalModelService:
    """Models on this machine: the catalog's local models, plus directories registered by ``exo serve``."""

    def __init__(
        self,
        settings: Settings,
        *,
        metrics: Metrics | None = None,
        catalog: Catalog | None = None,
        max_loaded: int = 1,
        default_model: str | None = None,
        step_hook: Callable[[GenerationJob], None] | None = None,
    ) -> None:
        self.settings = settings
        self.catalog = catalog if catalog is not None else load_catalog(home=settings.home)
        self.metrics = metrics or Metrics()
        self.max_loaded = max(1, max_loaded)
        self.default_model = default_model or DEFAULT_MODEL
        # Called from should_stop on the device thread once per decode step (tests use it to inject
        # failures and observe cancellation); None in production.
        self.step_hook = step_hook
        self.history: deque[JobRecord] = deque(maxlen=256)
        self._lock = threading.Lock()
        self._engines: OrderedDict[str, Engine] = OrderedDict()  # least recently used first
        self._known: dict[str, ResolvedModel] = {}  # every model loaded or registered, by id
        self._registered: list[str] = []
        self._loading: dict[str, LoadJob] = {}
        # The node-wide switch and the reason given when it is off, replaced together (one assignment).
        self._mtp: tuple[bool, str] = (settings.native_mtp_enabled, "native MTP is disabled")
        self._started = time.monotonic()
        self.device = Device(
            settings.max_queue,
            max_batch=settings.max_batch,
            kv_budget_tokens=settings.kv_budget_tokens,
            on_depth=self.metrics.queue_depth.set,
        )
        self.device.start_thread()

    # -- models ------------------------------------------------------------------------------------------
    def register(self, resolved: ResolvedModel, *, load: bool = False, timeout: float | None = None) -> str:
        """Serve a resolved model under its id (``exo serve --model``); ``load``: load it now (blocking)."""
        with self._lock:
            self._known[resolved.model_id] = resolved
            if resolved.model_id not in self._registered:
                self._registered.append(resolved.model_id)
        if load:
            self._load_future(resolved).result(timeout)
        return resolved.model_id

    def resolve(self, ref: str | None) -> ResolvedModel:
        """A request's model reference -> a model on this machine. Never a path (clients cannot pick
        directories); card ids and repos as the catalog knows them, or a repo in the Hugging Face cache."""
        ref = self.default_model if ref is None else ref
        with self._lock:
            if ref in self._known:
                return self._known[ref]
        resolved = resolve_model(ref, self.catalog, allow_paths=False)
        with self._lock:
            return self._known.get(resolved.model_id, resolved)

    async def acquire(self, model: str | None, timeout: float) -> str:
        resolved = await asyncio.to_thread(self.resolve, model)
        with self._lock:
            if resolved.model_id in self._engines:
                return resolved.model_id
        future = self._load_future(resolved)
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), max(timeout, 0.0))
        except TimeoutError:
            raise ModelLoadTimeoutError(
                f"{resolved.model_id} is still loading after {timeout:.0f} s; the load goes on: retry shortly"
            ) from None
        return resolved.model_id

    def _load_future(self, resolved: ResolvedModel) -> concurrent.futures.Future[str]:
        with self._lock:
            job = self._loading.get(resolved.model_id)
            if job is None:
                job = self._loading[resolved.model_id] = LoadJob(self, resolved)
                self._known.setdefault(resolved.model_id, resolved)
                submit = True
            else:
                submit = False
        if submit:
            self.device.submit(job)
        return job.future

    def _load_finished(self, model_id: str) -> None:
        with self._lock:
            self._loading.pop(model_id, None)

    def _engine(self, model_id: str, resolved: ResolvedModel | None = None) -> Engine:
        """Device thread only: the loaded engine (loading it, evicting the least recently used)."""
        with self._lock:
            engine = self._engines.get(model_id)
            if engine is not None:
                self._engines.move_to_end(model_id)
            resolved = resolved or self._known.get(model_id)
        if engine is None:
            if resolved is None:
                raise UnknownModelError(model_id, [])
            engine = self._load(resolved)
        return engine

    def _load(self, resolved: ResolvedModel) -> Engine:
        with self._lock:
            evict = list(self._engines)[: max(0, len(self._engines) - self.max_loaded + 1)]
            for model_id in evict:
                del self._engines[model_id]
        if evict:
            log.info("unloading %s", ", ".join(evict))
            mx.clear_cache()
        log.info("loading %s from %s", resolved.model_id, resolved.path)
        enabled, reason = self._mtp
        loaded, config = load_for_serving(resolved, self.settings, native_mtp_enabled=enabled, disabled_reason=reason)
        engine = ready_engine(loaded, config, self.settings)  # as a runner makes it (exo.runner.loading says what else is shared)
        with self._lock:
            self._engines[resolved.model_id] = engine
            self._known[resolved.model_id] = resolved
            self.metrics.models_loaded.set(len(self._engines))
        return engine

    def list_models(self) -> list[ModelInfo]:
        with self._lock:
            loaded = {mid: self._engines[mid] for mid in reversed(self._engines)}  # most recent first
            known = dict(self._known)
            registered = [known[mid] for mid in self._registered]
        rows = [
            model_info(known[mid], "loaded", self._mtp, LoadedFacts(engine.loaded.context_length, _head_reason(engine)))
            for mid, engine in loaded.items()
        ]
        return model_rows(self.catalog, rows, registered, self._mtp)

    # -- generation ----------------------------------------------------------------------------------------
    async def count_prompt_tokens(self, model_id: str, prompt: Prompt) -> int:
        """The prompt's tokens as a generation would read them (its chat template, its tokenizer), counted
        here, off the device: nothing is queued (an acquired model's tokenizer is in this process)."""
        with self._lock:
            engine = self._engines.get(model_id)
        if engine is None:  # evicted since acquire (another model loaded): load it again
            await asyncio.wrap_future(self._load_future(self.resolve(model_id)))
            with self._lock:
                engine = self._engines[model_id]
        tokens = await asyncio.to_thread(
            tokenize, engine.loaded.tokenizer, messages=prompt.messages, text=prompt.text,
            token_ids=prompt.token_ids, template_kwargs=prompt.template_kwargs, tools=prompt.tools,
        )
        return len(tokens)

    def generate(
        self, model_id: str, prompt: Prompt, params: GenerateParams, *, timeout_s: float, arrived: float
    ) -> GenerationStream:
        channel = Channel(asyncio.get_running_loop(), self.settings.stream_interval_s)
        job: GenerationJob

        def on_done(finish: str, stats: NativeMTPStats | None, queue_s: float, device_s: float) -> None:
            self._record(model_id, job, finish, stats, queue_s, device_s)

        def emit(item: Any) -> None:
            if isinstance(item, Started):
                self.metrics.running.set(len(self.device.active))
            channel.put(item)

        params = dataclasses.replace(params, mtp_switch=MTPSwitch(*self._mtp))  # this node's switch decides
        job = GenerationJob(
            self.device, lambda: self._engine(model_id), prompt, params, emit, timeout_s=timeout_s,
            arrived=arrived, on_done=on_done, step_hook=self.step_hook, batch_key=model_id,
        )
        self.device.submit(job)  # QueueFullError when full: nothing was queued
        return GenerationStream(job, channel)

    def _record(
        self, model_id: str, job: GenerationJob, finish: str, stats: Any, queue_s: float, device_s: float
    ) -> None:
        self.metrics.running.set(max(0, len(self.device.active) - 1))  # this one is leaving
        self.metrics.queue_wait.observe(queue_s)
        cancel_latency = None
        if job.cancelled_at is not None and finish in ("cancelled", "timeout"):
            cancel_latency = max(0.0, time.perf_counter() - job.cancelled_at)
            self.metrics.cancel_latency.observe(cancel_latency)
        self.metrics.record_generation(model_id, finish, stats)
        if device_s:
            self.metrics.generation_time.observe(device_s)
        self.history.append(
            JobRecord(
                id=job.id,
                model=model_id,
                finish_reason=finish,
                prompt_tokens=stats.prompt_tokens if stats is not None else 0,
                completion_tokens=job.tokens,
                queue_s=queue_s,
                device_s=device_s,
                tokens_at_cancel=job.tokens_at_cancel,
                cancel_latency_s=cancel_latency,
            )
        )

    # -- node state ----------------------------------------------------------------------------------------
    def set_native_mtp(self, enabled: bool, disabled_reason: str) -> None:
        self._mtp = (enabled, disabled_reason)

    @property
    def native_mtp_enabled(self) -> bool:
        return self._mtp[0]

    def status(self) -> dict[str, Any]:
        with self._lock:
            loaded = list(reversed(self._engines))
        snap = self.device.snapshot()
        return {
            "models_loaded": loaded,
            "queue_depth": snap["queue_depth"],
            "running": snap["running"],
            "uptime_s": round(time.monotonic() - self._started, 3),
        }

    def close(self) -> None:
        self.device.close(timeout=10.0)


def _head_reason(engine: Engine) -> str | None:
    return None if engine.loaded.head is not None else engine.loaded.head_status.reason

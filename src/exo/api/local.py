"""``LocalModelService``: the models of this machine behind the ``ModelService`` interface.

Serves the catalog's local models (bundled first) and directories registered by ``exo serve --model``.
One ``DeviceWorker`` thread does every load and generation in FIFO order. Loaded engines stay in memory
up to ``max_loaded`` (least recently used evicted first). Requests name models by card id or repo id,
never by path: clients cannot make the server read arbitrary directories.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from exo.cards import Catalog, UnknownModelError, load_catalog
from exo.engine import Engine, ResolvedModel, engine_config, load_checkpoint
from exo.engine.resolve import DEFAULT_MODEL, resolve_model
from exo.settings import Settings

from .errors import ModelLoadTimeoutError
from .jobs import GenerationJob, LoadJob
from .listing import LoadedFacts, model_info, model_rows
from .metrics import Metrics
from .service import (
    GenerateParams,
    GenerationStream,
    JobRecord,
    ModelInfo,
    Prompt,
)
from .worker import Channel, DeviceWorker

log = logging.getLogger(__name__)


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
        self.worker = DeviceWorker(settings.max_queue, on_depth=self.metrics.queue_depth.set)

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
            self.worker.submit(job)
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
        enabled, reason = self._mtp
        if (engine.config.native_mtp_enabled, engine.config.disabled_reason) != (enabled, reason):
            # Between requests (we are on the device thread): the next generation sees the new switch.
            engine.config = dataclasses.replace(engine.config, native_mtp_enabled=enabled, disabled_reason=reason)
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
        config = engine_config(resolved, self.settings, native_mtp_enabled=enabled, disabled_reason=reason)
        loaded = load_checkpoint(
            resolved.path, model_id=resolved.model_id, head_source_repo=resolved.head_source_repo
        )
        engine = Engine(loaded, config)
        engine.warmup()  # adaptive depth's cost measurement, once, here rather than in a request
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
    def generate(
        self, model_id: str, prompt: Prompt, params: GenerateParams, *, timeout_s: float, arrived: float
    ) -> GenerationStream:
        channel = Channel(asyncio.get_running_loop())
        job = GenerationJob(self, model_id, prompt, params, channel, timeout_s=timeout_s, arrived=arrived)
        self.worker.submit(job)  # QueueFullError when full: nothing was queued
        return GenerationStream(job)

    def _record(self, job: GenerationJob, finish: str, stats: Any, queue_s: float, device_s: float) -> None:
        cancel_latency = None
        if job._cancelled_at is not None and finish in ("cancelled", "timeout"):
            cancel_latency = max(0.0, time.perf_counter() - job._cancelled_at)
            self.metrics.cancel_latency.observe(cancel_latency)
        self.metrics.record_generation(job.model_id, finish, stats)
        if device_s:
            self.metrics.generation_time.observe(device_s)
        self.history.append(
            JobRecord(
                id=job.id,
                model=job.model_id,
                finish_reason=finish,
                prompt_tokens=stats.prompt_tokens if stats is not None else 0,
                completion_tokens=job.tokens,
                queue_s=queue_s,
                device_s=device_s,
                tokens_at_cancel=job._tokens_at_cancel,
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
        return {
            "models_loaded": loaded,
            "queue_depth": self.worker.waiting,
            "running": 1 if self.worker.running is not None and isinstance(self.worker.running, GenerationJob) else 0,
            "uptime_s": round(time.monotonic() - self._started, 3),
        }

    def close(self) -> None:
        running = self.worker.running
        if isinstance(running, GenerationJob):
            running.cancel()
        self.worker.close()



def _head_reason(engine: Engine) -> str | None:
    return None if engine.loaded.head is not None else engine.loaded.head_status.reason

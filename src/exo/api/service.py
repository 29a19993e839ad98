"""Model access behind a small interface, so the HTTP handlers do not care where a model runs.

``ModelService`` is what the handlers use: ``list_models()``, ``acquire(model)`` (resolve it and make
sure it is loaded, waiting at most a timeout) and ``generate(...)`` (a ``GenerationStream``: an async
sequence of engine chunks with ``cancel()``). Prompts travel as messages or text, not token ids: the
chat template and the context check run where the model lives (``local.LocalModelService`` on this
machine; the cluster's implementation on another node).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from exo.engine import GenerationChunk, SamplingParams
from exo.engine.generate import NativeMTPMode

from .errors import RequestTimeoutError

if TYPE_CHECKING:
    from .jobs import GenerationJob

ModelStatus = Literal["loaded", "local", "remote"]
# A running generation notices its deadline by itself (should_stop); the handler waits this much longer.
DEADLINE_GRACE_S = 5.0


# -- what the handlers see -----------------------------------------------------------------------------


@dataclass(frozen=True)
class NativeMTPInfo:
    default_k: int | None
    max_k: int | None
    available: bool
    reason: str | None


@dataclass(frozen=True)
class ModelInfo:
    id: str
    status: ModelStatus
    owned_by: str
    created: int
    native_mtp: NativeMTPInfo
    name: str | None = None
    arch: str | None = None
    context_length: int | None = None


@dataclass(frozen=True)
class Prompt:
    """Exactly one of: chat messages (through the chat template), text, or token ids."""

    messages: list[dict[str, str]] | None = None
    text: str | None = None
    token_ids: list[int] | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class GenerateParams:
    max_tokens: int | None  # None: default_max_tokens, bounded by what is left of the context
    default_max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    native_mtp: NativeMTPMode = "auto"
    mtp_k: int | None = None


@dataclass(frozen=True)
class Started:
    """The first item of a generation: it passed validation and the device is on it."""

    prompt_tokens: int
    max_tokens: int
    queue_s: float


@dataclass(frozen=True)
class Failed:
    error: BaseException


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


class BatchedStream:
    """What a handler sees of one generation: ``start()``, then ``next_batch()`` until a finish_reason.

    Subclasses deliver items (``Started``, engine chunks, ``Failed``) through ``_take()``."""

    timeout_s: float
    tokens: int
    finished: bool
    _error: BaseException | None

    async def _take(self) -> list[Any]:
        """The items delivered so far (at least one)."""
        raise NotImplementedError

    def cancel(self) -> None:
        raise NotImplementedError

    async def start(self) -> Started:
        items = await self._take()
        item = items[0]
        self._put_back(items[1:])
        if isinstance(item, Failed):
            self.finished = True
            raise item.error
        assert isinstance(item, Started), item
        return item

    def _put_back(self, items: list[Any]) -> None:
        raise NotImplementedError

    async def next_batch(self) -> list[GenerationChunk]:
        """The chunks delivered so far (at least one); raises the generation's error after its chunks."""
        if self._error is not None:
            raise self._error
        chunks: list[GenerationChunk] = []
        for item in await self._take():
            if isinstance(item, Failed):
                self._error = item.error
                break
            if item.finish_reason == "cancelled":
                # Only timeouts reach a handler this way (a disconnected client has no handler left).
                self._error = RequestTimeoutError(
                    f"the request exceeded the server's request timeout of {self.timeout_s:g} s "
                    f"after {self.tokens} generated tokens"
                )
                chunks.append(dataclasses.replace(item, finish_reason=None, stats=None))
                break
            chunks.append(item)
            if item.finish_reason is not None:
                self.finished = True
        if not chunks:
            assert self._error is not None
            self.finished = True
            raise self._error
        return chunks


class GenerationStream(BatchedStream):
    """A generation on this process's device worker."""

    def __init__(self, job: GenerationJob) -> None:
        self._job = job
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
                self._buffer.extend(await self._job.channel.get_batch(loop_deadline))
            except TimeoutError:
                self._job.cancel()
                raise RequestTimeoutError(
                    f"the request exceeded the server's request timeout of {self._job.timeout_s:g} s"
                ) from None
        items = list(self._buffer)
        self._buffer.clear()
        return items


class ModelService(Protocol):
    """What the HTTP layer needs from "the models"; a cluster implementation routes to other nodes."""

    default_model: str

    def list_models(self) -> list[ModelInfo]:
        """Loaded first, then local (bundled first), then the rest of the catalog. May block (disk)."""
        ...

    async def acquire(self, model: str | None, timeout: float) -> str:
        """Resolve ``model`` (None: the default) and make sure it can generate; returns its id."""
        ...

    def generate(
        self, model_id: str, prompt: Prompt, params: GenerateParams, *, timeout_s: float, arrived: float
    ) -> BatchedStream:
        """Queue a generation (raises QueueFullError when the queue is full)."""
        ...

    def set_native_mtp(self, enabled: bool, disabled_reason: str) -> None:
        """The node-wide switch; applies from the next request on."""
        ...

    def status(self) -> dict[str, Any]: ...

    def close(self) -> None: ...

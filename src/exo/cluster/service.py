"""What the HTTP layer needs from "the models", behind a small interface, wherever the models run.

``ModelService`` is what the handlers use: ``list_models()``, ``acquire(model)`` (resolve it and make
sure it can generate, waiting at most a timeout) and ``generate(...)`` (a ``BatchedStream``: batches of
engine chunks with ``cancel()``). Prompts travel as messages or text, not token ids: the chat template
and the context check run where the model lives. ``exo serve`` runs the cluster's implementation
(``exo.cluster.orchestration.ClusterModelService``); ``exo.api.local.LocalModelService`` serves models
in-process (notebooks, benchmarks, tests).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from exo.engine import GenerationChunk
from exo.engine.prompt import GenerateParams, Prompt
from exo.wire.errors import NodeUnavailableError, QueueFullError, RequestTimeoutError
from exo.wire.stream import Failed, Started

__all__ = [
    "DEADLINE_GRACE_S", "BatchedStream", "ClusterAuthError", "Failed", "GenerateParams", "InstanceNotFoundError", "ModelInfo",
    "ModelLoadTimeoutError", "ModelService", "ModelStatus", "NativeMTPInfo", "NodeUnavailableError", "Prompt",
    "QueueFullError", "RequestTimeoutError", "Started",
]

ModelStatus = Literal["loaded", "local", "remote"]
# A running generation notices its deadline by itself (should_stop); the handler waits this much longer.
DEADLINE_GRACE_S = 5.0


class ModelLoadTimeoutError(TimeoutError):
    """A model is still loading after the load timeout; the load goes on in the background."""


class InstanceNotFoundError(LookupError):
    """No instance with that id in the cluster."""


class ClusterAuthError(RuntimeError):
    """Another node refused this node's calls (the cluster secrets differ)."""


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

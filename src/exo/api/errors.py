"""OpenAI-style error bodies: every failure a client can see becomes ``{"error": {...}}`` with a status.

``APIError`` is raised inside handlers; ``api_error_from(exc)`` maps the engine's and the catalog's typed
errors (and the service's queue/timeout errors) to the status and ``code`` a client can act on.
"""

from __future__ import annotations

import logging
from typing import Any

from exo.cards import AmbiguousModelError, CardError, UnknownModelError
from exo.cluster.placement import (
    AlreadyPlacedError,
    InvalidPlacementRequest,
    ModelNotOnDiskError,
    NoDiskRoomError,
    NoPlacementError,
    TensorShardingRefusedError,
    TooFewNodesError,
    UnknownNodeError,
)
from exo.cluster.service import (
    ClusterAuthError,
    InstanceNotFoundError,
    ModelLoadTimeoutError,
    NodeUnavailableError,
    QueueFullError,
    RequestTimeoutError,
)
from exo.cluster.supervisor import InstanceFailedError
from exo.engine import (
    CheckpointError,
    ContextLengthError,
    DeviceMemoryError,
    GenerationRequestError,
    ModelNotAvailableError,
    NativeMTPUnavailableError,
    SamplingParamsError,
    UnsupportedModelError,
)
from exo.engine.prompt import PromptError
from exo.settings import SettingsError

log = logging.getLogger(__name__)


class APIError(Exception):
    """An error response: HTTP status plus the OpenAI error object (message, type, param, code)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# The engine's own type: the API raises it too when it checks a prompt before queueing it.
ContextLengthExceededError = ContextLengthError


def _message(exc: BaseException) -> str:
    # LookupError subclasses keep their message in args[0] (str() would add quotes).
    return str(exc.args[0]) if isinstance(exc, LookupError) and exc.args else str(exc)


def api_error_from(exc: BaseException) -> APIError:
    """The response for an exception raised while serving a request."""
    if isinstance(exc, APIError):
        return exc
    msg = _message(exc)
    if isinstance(exc, UnknownModelError):
        return APIError(404, msg, param="model", code="model_not_found")
    if isinstance(exc, AmbiguousModelError):
        return APIError(400, msg, param="model", code="ambiguous_model")
    if isinstance(exc, ModelNotAvailableError):
        return APIError(404, msg, param="model", code="model_not_available")
    if isinstance(exc, UnsupportedModelError):
        return APIError(400, msg, param="model", code="model_not_supported")
    if isinstance(exc, ContextLengthExceededError):
        return APIError(400, msg, param=exc.param, code="context_length_exceeded")
    if isinstance(exc, NativeMTPUnavailableError):
        return APIError(400, msg, param="native_mtp", code="native_mtp_unavailable")
    if isinstance(exc, GenerationRequestError):
        return APIError(400, msg, param=getattr(exc, "param", None), code="invalid_value")
    if isinstance(exc, SamplingParamsError):
        # The engine's messages start with the parameter's name ("top_p must be in (0, 1], got 2").
        return APIError(400, msg, param=msg.split(" ", 1)[0], code="invalid_value")
    if isinstance(exc, (PromptError, SettingsError)):
        return APIError(400, msg, code="invalid_value")
    if isinstance(exc, QueueFullError):
        return APIError(
            429,
            msg,
            type="rate_limit_error",
            code="queue_full",
            headers={"Retry-After": str(exc.retry_after_s)},
        )
    if isinstance(exc, RequestTimeoutError):
        return APIError(408, msg, type="timeout_error", code="request_timeout")
    if isinstance(exc, ModelLoadTimeoutError):
        return APIError(503, msg, type="server_error", code="model_loading", headers={"Retry-After": "5"})
    if isinstance(exc, InstanceNotFoundError):
        return APIError(404, msg, param="id", code="instance_not_found")
    if isinstance(exc, UnknownNodeError):
        return APIError(404, msg, param="node", code="node_not_found")
    if isinstance(exc, AlreadyPlacedError):
        return APIError(409, msg, param="model", code="already_placed")
    if isinstance(exc, TensorShardingRefusedError):
        return APIError(400, msg, param="sharding", code="tensor_sharding_unavailable")
    if isinstance(exc, InvalidPlacementRequest):
        return APIError(400, msg, code="invalid_value")
    if isinstance(exc, TooFewNodesError):
        return APIError(400, msg, param="min_nodes", code="too_few_nodes")
    if isinstance(exc, ModelNotOnDiskError):
        return APIError(404, msg, param="model", code="model_not_available")
    if isinstance(exc, NoDiskRoomError):
        return APIError(507, msg, param="model", type="server_error", code="insufficient_storage")
    if isinstance(exc, DeviceMemoryError):
        return APIError(507, msg, type="server_error", code="insufficient_memory")
    if isinstance(exc, NoPlacementError):
        return APIError(507, msg, param="model", type="server_error", code="insufficient_memory")
    if isinstance(exc, ClusterAuthError):
        return APIError(502, msg, type="server_error", code="cluster_auth")
    if isinstance(exc, NodeUnavailableError):
        return APIError(503, msg, type="server_error", code="node_unavailable", headers={"Retry-After": "2"})
    if isinstance(exc, InstanceFailedError):
        return APIError(500, f"the model could not be loaded: {msg}", type="server_error", code="model_load_failed")
    if isinstance(exc, (CheckpointError, CardError)):
        return APIError(500, f"the model could not be loaded: {msg}", type="server_error", code="model_load_failed")
    log.error("internal error while serving a request", exc_info=exc)
    return APIError(500, f"internal server error: {type(exc).__name__}: {msg}", type="server_error", code="internal_error")

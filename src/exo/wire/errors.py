"""Every error a client can see, and the one table that answers each: code, HTTP status, type, retry.

A failure is answered the same way wherever it was raised: in this process, on this node's runner or on
another node. The runner reports it in a ``GenerateError`` under its row's ``wire`` name
(``convert.error_to_pb``); the API node rebuilds the same exception (``convert.error_from_pb``) and the
HTTP layer answers it from its row (``exo.api.errors.api_error_from``): the status, the OpenAI ``type``,
the ``code`` and ``param`` a client acts on, and ``Retry-After``. Each dialect (OpenAI chat/completions,
Responses, Anthropic Messages, Ollama) keeps its own error *shape* (``exo.api.dialects.error_body``) and
takes status and type from here.

The errors of the rooms above the wire (placement, the cluster service, downloads) live here too, so that
this table can name them while every room that answers one (runner, cluster, api) can read it; their
modules import them back under their old names. So do the HTTP layer's own answers (``HTTP_ERRORS``: codes the
API raises from the request alone, no exception of ``ERRORS`` behind them). Every row says what it means to a
client (``about``): the OpenAPI document's error responses are generated from both tables
(``exo.api.openapi``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from exo.cards import AmbiguousModelError, CardError, UnknownModelError
from exo.engine.loader import CheckpointError
from exo.engine.memory import DeviceMemoryError
from exo.engine.models import UnsupportedModelError
from exo.engine.prompt import PromptError
from exo.engine.request import ContextLengthError, GenerationRequestError, NativeMTPUnavailableError
from exo.engine.resolve import ModelNotAvailableError
from exo.engine.sampling import SamplingParamsError
from exo.settings import SettingsError

from .proto_gen import node_pb2 as pb

if TYPE_CHECKING:
    from exo.cluster.placement import ExistingInstance


# -- serving ---------------------------------------------------------------------------------------------


class QueueFullError(RuntimeError):
    """The device's request queue is full; retry after ``retry_after_s`` (HTTP 429)."""

    def __init__(self, waiting: int, retry_after_s: int, message: str | None = None) -> None:
        super().__init__(
            message or f"the request queue is full ({waiting} requests waiting); retry in {retry_after_s} s"
        )
        self.retry_after_s = retry_after_s


class RequestTimeoutError(TimeoutError):
    """The request ran past the server's request timeout (while queued or while generating)."""


class NodeUnavailableError(RuntimeError):
    """The node, runner or pipeline stage that serves an instance stopped answering, left, or is not ready."""


# -- the cluster service ---------------------------------------------------------------------------------

class ModelLoadTimeoutError(TimeoutError):
    """A model is still loading after the load timeout; the load goes on in the background."""


class InstanceNotFoundError(LookupError):
    """No instance with that id in the cluster."""


class ClusterAuthError(RuntimeError):
    """Another node refused this node's calls (the cluster secrets differ)."""


class InstanceFailedError(RuntimeError):
    """The instance failed (or is not ready); ``.instance`` is its snapshot, ``failure`` filled when known."""

    def __init__(self, instance: pb.Instance, message: str | None = None) -> None:
        if message is None:
            why = instance.failure.message or "no diagnostics"
            message = f"instance {instance.instance_id} of {instance.model_id} failed: {why}"
        super().__init__(message)
        self.instance = instance


# -- placement -------------------------------------------------------------------------------------------


class PlacementError(Exception):
    """The model cannot be placed as asked."""


class NoPlacementError(PlacementError):
    """No node has room (or the weights); the message says what is missing."""

    def __init__(self, message: str, *, needed_bytes: int = 0, best_node: str | None = None, best_free_bytes: int = 0):
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.best_node = best_node
        self.best_free_bytes = best_free_bytes


class ModelNotOnDiskError(NoPlacementError):
    """No node (or not the asked one) has the model's weights on its disk."""


class TooFewNodesError(NoPlacementError):
    """Fewer nodes hold the model (or the asked nodes are fewer) than the placement needs."""


class NoDiskRoomError(NoPlacementError):
    """Nodes with room in memory would have to download the weights and lack the disk for them."""


class AlreadyPlacedError(PlacementError):
    def __init__(self, existing: ExistingInstance) -> None:
        super().__init__(
            f"{existing.model_id} already has instance {existing.instance_id} ({existing.state}) on node "
            f"{existing.node_id}; delete it first to place it elsewhere"
        )
        self.existing = existing


class UnknownNodeError(PlacementError):
    def __init__(self, node_id: str, known: Iterable[str]) -> None:
        known = sorted(known)
        super().__init__(f"no node {node_id!r} in the cluster; nodes: {', '.join(known) or 'none'}")
        self.node_id = node_id


class InvalidPlacementRequest(PlacementError):
    """The request itself is contradictory (e.g. a node and a list of nodes)."""


class TensorShardingRefusedError(InvalidPlacementRequest):
    """Tensor sharding was asked for a model whose card forbids it, or over a node count its heads do not divide."""


# -- downloads -------------------------------------------------------------------------------------------


class DownloadNotFoundError(LookupError):
    """No download with that id on this node."""


class DownloadError(Exception):
    """A download could not be done."""

    code = "download_failed"


class RepoNotFoundError(DownloadError, LookupError):
    """The hub has no such repo or revision (or it is private or gated and the token does not open it)."""

    code = "repo_not_found"


class HubUnavailableError(DownloadError):
    """The hub could not be reached, or answered with a server error."""

    code = "hub_unavailable"


class InvalidRevisionError(DownloadError, ValueError):
    """A revision that is not a branch, tag or commit name (it would escape the cache's refs/)."""

    code = "invalid_value"


class OfflineFilesMissingError(DownloadError, ModelNotAvailableError):
    """Offline (EXO_OFFLINE=1 / HF_HUB_OFFLINE=1) and the cache lacks files the download needs."""

    code = "offline_files_missing"

    def __init__(self, message: str, missing: list[str]) -> None:
        super().__init__(message)
        self.missing = missing


class InsufficientDiskError(DownloadError):
    """Not enough free disk for what the download would write."""

    code = "insufficient_disk"

    def __init__(self, message: str, needed_bytes: int, free_bytes: int) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.free_bytes = free_bytes


class DownloadCancelledError(DownloadError):
    """The download was cancelled (its partial files are gone; finished files stay in the cache)."""

    code = "cancelled"


class DownloadConflictError(DownloadError):
    """The model is already downloading with other head options (a download's options are fixed)."""

    code = "download_conflict"

    def __init__(self, message: str, download_id: str) -> None:
        super().__init__(message)
        self.download_id = download_id


class CheckpointRejectedError(DownloadError, CheckpointError):
    """The downloaded files do not form the checkpoint their config and index describe."""

    code = "checkpoint_rejected"


# -- the table -------------------------------------------------------------------------------------------


Param = str | Callable[[BaseException], str | None] | None


def _own_param(exc: BaseException) -> str | None:
    return getattr(exc, "param", None) or None


def _leading_word(exc: BaseException) -> str | None:
    # The engine's sampling messages start with the parameter's name ("top_p must be in (0, 1], got 2").
    return str(exc).split(" ", 1)[0] or None


@dataclass(frozen=True)
class ErrorRow:
    """How one exception type is answered. ``code`` None: the exception's own ``code`` attribute."""

    exception: type[BaseException]
    code: str | None
    status: int
    type: str = "invalid_request_error"
    param: Param = None  # the request field at fault: a name, or read from the exception
    retry_after_s: int | None = None  # Retry-After; an exception's own ``retry_after_s`` wins
    prefix: str = ""  # put before the message
    wire: str | None = None  # its name in a GenerateError between nodes; None: it crosses as "internal"
    about: str = ""  # what it means to a client (the OpenAPI document's description of the code)

    def param_of(self, exc: BaseException) -> str | None:
        return self.param(exc) if callable(self.param) else self.param

    def code_of(self, exc: BaseException) -> str:
        return self.code or getattr(exc, "code", None) or "internal_error"

    def retry_after(self, exc: BaseException) -> int | None:
        return getattr(exc, "retry_after_s", None) or self.retry_after_s

    def codes(self) -> tuple[str, ...]:
        """The codes a client may see from this row: its own, or (``code`` None) the ``code`` of each exception
        type it answers (its exception and the subclasses no row above it takes)."""
        if self.code is not None:
            return (self.code,)
        found: list[str] = []
        for cls in _subclasses(self.exception):
            code = getattr(cls, "code", None)
            if isinstance(code, str) and row_of_type(cls) is self and code not in found:
                found.append(code)
        return tuple(found)


@dataclass(frozen=True)
class HTTPErrorRow:
    """An answer the HTTP layer gives by itself, from the request alone (``exo.api``: its middlewares and
    request parsing raise an ``APIError`` with this code and status): no exception of ``ERRORS`` is behind it."""

    code: str
    status: int
    about: str
    type: str = "invalid_request_error"
    endpoint: bool = True  # an endpoint's answer (False: for a method no endpoint of the path takes)

    def codes(self) -> tuple[str, ...]:
        return (self.code,)


def _subclasses(cls: type) -> list[type]:
    out = [cls]
    for sub in cls.__subclasses__():
        out.extend(c for c in _subclasses(sub) if c not in out)
    return out


_LOAD_FAILED = "the model could not be loaded: "

# First match wins: a subclass's row comes before its base's.
ERRORS: tuple[ErrorRow, ...] = (
    ErrorRow(UnknownModelError, "model_not_found", 404, param="model",
             about="no model by that name (not a card, not a repo id)"),
    ErrorRow(AmbiguousModelError, "ambiguous_model", 400, param="model",
             about="the name matches several models: name one of them"),
    ErrorRow(ModelNotAvailableError, "model_not_available", 404, param="model",
             about="a known model whose weights are not on this machine (offline, or files missing from the cache)"),
    ErrorRow(UnsupportedModelError, "model_not_supported", 400, param="model",
             about="a model whose architecture exo does not run"),
    ErrorRow(ContextLengthError, "context_length_exceeded", 400, param=_own_param, wire="context_length_exceeded",
             about="the prompt and max_tokens do not fit the model's context"),
    ErrorRow(NativeMTPUnavailableError, "native_mtp_unavailable", 400, param="native_mtp",
             wire="native_mtp_unavailable",
             about="native MTP was required and the model has no MTP head"),
    ErrorRow(GenerationRequestError, "invalid_value", 400, param=_own_param, wire="generation_request",
             about="a generation parameter out of range or contradictory"),
    ErrorRow(SamplingParamsError, "invalid_value", 400, param=_leading_word, wire="sampling_params",
             about="a sampling parameter out of range"),
    ErrorRow(PromptError, "invalid_value", 400, wire="prompt",
             about="the prompt cannot be rendered (chat template, roles, content parts)"),
    ErrorRow(SettingsError, "invalid_value", 400,
             about="a setting's value is not valid"),
    ErrorRow(QueueFullError, "queue_full", 429, type="rate_limit_error", wire="queue_full",
             about="the request queue is full: retry after Retry-After"),
    ErrorRow(RequestTimeoutError, "request_timeout", 408, type="timeout_error", wire="timeout",
             about="the request ran past the server's request timeout (queued or generating)"),
    ErrorRow(ModelLoadTimeoutError, "model_loading", 503, type="server_error", retry_after_s=5,
             about="the model is still loading: retry after Retry-After"),
    ErrorRow(InstanceNotFoundError, "instance_not_found", 404, param="id",
             about="no instance with that id"),
    ErrorRow(UnknownNodeError, "node_not_found", 404, param="node",
             about="no node with that id in the cluster"),
    ErrorRow(AlreadyPlacedError, "already_placed", 409, param="model",
             about="the model already has an instance: delete it first to place it elsewhere"),
    ErrorRow(TensorShardingRefusedError, "tensor_sharding_unavailable", 400, param="sharding",
             about="tensor sharding is not possible for this model or node count"),
    ErrorRow(InvalidPlacementRequest, "invalid_value", 400,
             about="the placement asked is contradictory"),
    ErrorRow(TooFewNodesError, "too_few_nodes", 400, param="min_nodes",
             about="fewer nodes hold the model than the placement needs"),
    ErrorRow(ModelNotOnDiskError, "model_not_available", 404, param="model",
             about="no node (or not the one asked) has the model's weights on its disk"),
    ErrorRow(NoDiskRoomError, "insufficient_storage", 507, type="server_error", param="model",
             about="the nodes with room in memory lack the disk to download the weights"),
    ErrorRow(DeviceMemoryError, "insufficient_memory", 507, type="server_error", wire="device_memory",
             about="the device ran out of memory for the request"),
    ErrorRow(NoPlacementError, "insufficient_memory", 507, type="server_error", param="model",
             about="no node has room for the model (the message says how much is missing)"),
    ErrorRow(ClusterAuthError, "cluster_auth", 502, type="server_error",
             about="another node refused this node's calls (the cluster secrets differ)"),
    ErrorRow(NodeUnavailableError, "node_unavailable", 503, type="server_error", retry_after_s=2,
             wire="model_unavailable",
             about="the node that serves the model is unavailable or not ready: retry after Retry-After"),
    ErrorRow(InstanceFailedError, "model_load_failed", 500, type="server_error", prefix=_LOAD_FAILED,
             about="the model could not be loaded"),
    ErrorRow(DownloadNotFoundError, "download_not_found", 404, param="id",
             about="no download with that id"),
    ErrorRow(RepoNotFoundError, "repo_not_found", 404, param="model",
             about="the hub has no such repo or revision (or the token does not open it)"),
    ErrorRow(InvalidRevisionError, "invalid_value", 400, param="revision",
             about="the revision is not a branch, tag or commit name"),
    ErrorRow(InsufficientDiskError, "insufficient_storage", 507, type="server_error",
             about="not enough free disk for the download (the message says how much)"),
    ErrorRow(DownloadConflictError, "download_conflict", 409, param="quantize_head",
             about="the model is already downloading with other head options"),
    ErrorRow(HubUnavailableError, "hub_unavailable", 503, type="server_error", retry_after_s=30,
             about="the hub cannot be reached: retry after Retry-After"),
    ErrorRow(CheckpointError, "model_load_failed", 500, type="server_error", prefix=_LOAD_FAILED,
             about="the model's files do not form a checkpoint exo can load"),
    ErrorRow(CardError, "model_load_failed", 500, type="server_error", prefix=_LOAD_FAILED,
             about="the model's card does not describe a model exo can load"),
    ErrorRow(DownloadError, None, 502, type="server_error",
             about="the download failed (the code says how)"),  # the download's own code ("download_failed", ...)
)
# Anything else: a 500 that names the exception's type (and is logged).
INTERNAL = ErrorRow(Exception, "internal_error", 500, type="server_error", prefix="internal server error: ",
                    about="an internal error (the message names it)")

# The HTTP layer's own answers, from the request alone (before any exception above could be raised).
HTTP_ERRORS: tuple[HTTPErrorRow, ...] = (
    HTTPErrorRow("invalid_api_key", 401, "missing or wrong API key (when the server has one)", "authentication_error"),
    HTTPErrorRow("request_too_large", 413, "the request body is too large"),
    HTTPErrorRow("invalid_json", 400, "the body is not a JSON object"),
    HTTPErrorRow("invalid_type", 400, "a field of the wrong type"),
    HTTPErrorRow("invalid_value", 400, "a field's value is not valid"),
    HTTPErrorRow("unknown_parameter", 400, "a field the endpoint does not know"),
    HTTPErrorRow("missing_required_parameter", 400, "a required field or query parameter is missing"),
    HTTPErrorRow("unsupported_parameter", 400, "a field exo does not support (or not in this combination)"),
    HTTPErrorRow("model_not_found", 404, "no model by that name (not a card, not a repo id)"),
    HTTPErrorRow("not_found", 404, "no such route, or no stored response with that id"),
    HTTPErrorRow("method_not_allowed", 405, "the path does not take that method", endpoint=False),
    HTTPErrorRow("previous_response_not_found", 404, "previous_response_id names no stored response"),
    HTTPErrorRow("download_on_other_node", 409, "the download runs on another node of the cluster (its `node`): "
                 "act on it there"),
)


def row_of(exc: BaseException) -> ErrorRow | None:
    """The row that answers ``exc``; None for an exception no row names (an internal error)."""
    for row in ERRORS:
        if isinstance(exc, row.exception):
            return row
    return None


def row_of_type(cls: type[BaseException]) -> ErrorRow | None:
    """The row that answers exceptions of type ``cls``."""
    for row in ERRORS:
        if issubclass(cls, row.exception):
            return row
    return None


def message_of(exc: BaseException) -> str:
    # LookupError subclasses keep their message in args[0] (str() would add quotes).
    return str(exc.args[0]) if isinstance(exc, LookupError) and exc.args else str(exc)


def by_wire(name: str) -> ErrorRow | None:
    return _BY_WIRE.get(name)


_BY_WIRE = {row.wire: row for row in ERRORS if row.wire}


def rebuild(err: pb.GenerateError) -> BaseException:
    """The exception a ``GenerateError`` stands for, as the node that raised it had it."""
    row = by_wire(err.type)
    message = err.message
    if row is None:
        return RuntimeError(message)
    cls = row.exception
    if issubclass(cls, ContextLengthError):
        return cls(message, err.param or "messages")
    if issubclass(cls, GenerationRequestError):
        return cls(message, param=err.param or None)
    if issubclass(cls, QueueFullError):
        return cls(0, max(1, math.ceil(err.retry_after_s)), message)
    return cls(message)


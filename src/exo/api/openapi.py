"""The OpenAPI 3.1 document of the server (``GET /openapi.json``), built from the pydantic models."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from exo import __version__
from exo.wire import errors as we

from . import anthropic, ollama, responses
from . import schemas as s

_REF = "#/components/schemas/{model}"

# What an endpoint can answer besides success, as rows of the error table (``exo.wire.errors``): an exception
# type names its row of ``ERRORS``, a string a row of ``HTTP_ERRORS`` (the HTTP layer's own answers).
Key = type[BaseException] | str
AUTH: tuple[Key, ...] = ("invalid_api_key",)
BODY: tuple[Key, ...] = ("request_too_large", "invalid_json", "invalid_type", "invalid_value", "unknown_parameter",
                         "missing_required_parameter")
MODEL: tuple[Key, ...] = (we.UnknownModelError, "model_not_found", we.AmbiguousModelError, we.ModelNotAvailableError,
                          we.UnsupportedModelError)
LOAD: tuple[Key, ...] = (we.ModelLoadTimeoutError, we.InstanceFailedError, we.CheckpointError, we.CardError,
                         we.NodeUnavailableError)
GENERATION: tuple[Key, ...] = (
    *AUTH, *BODY, "unsupported_parameter", *MODEL, *LOAD, we.ContextLengthError, we.NativeMTPUnavailableError,
    we.GenerationRequestError, we.SamplingParamsError, we.PromptError, we.QueueFullError, we.RequestTimeoutError,
    we.DeviceMemoryError, "internal_error",
)
PLACEMENT: tuple[Key, ...] = (
    we.UnknownNodeError, we.AlreadyPlacedError, we.TensorShardingRefusedError, we.InvalidPlacementRequest,
    we.TooFewNodesError, we.ModelNotOnDiskError, we.NoDiskRoomError, we.NoPlacementError,
)
DOWNLOAD: tuple[Key, ...] = (
    we.UnknownModelError, we.RepoNotFoundError, we.ModelNotAvailableError, we.InvalidRevisionError,
    we.InsufficientDiskError, we.DownloadConflictError, we.HubUnavailableError, we.DownloadError,
    "download_on_other_node",
)
_RETRY_AFTER = (429, 503)  # the statuses whose rows answer with Retry-After


def error_rows(*keys: Key) -> list[tuple[int, str, str]]:
    """(status, code, what it means) of the rows ``keys`` name, in the table's order of ``keys``."""
    http = {row.code: row for row in we.HTTP_ERRORS}
    out: list[tuple[int, str, str]] = []
    for key in keys:
        if isinstance(key, str):
            row = we.INTERNAL if key == we.INTERNAL.code else http[key]
        else:
            row = next(r for r in we.ERRORS if r.exception is key)
        out.extend((row.status, code, row.about) for code in row.codes())
    return out


def _error_responses(*keys: Key, schema: dict[str, Any] | None = None) -> dict[str, Any]:
    """The error responses of an endpoint that may answer the rows ``keys`` name: one per status, its
    description each code and what it means, its codes also in ``x-error-codes`` (``schema``: the dialect's
    error shape; None: the OpenAI one)."""
    by_status: dict[int, dict[str, list[str]]] = {}
    for status, code, about in error_rows(*keys):
        abouts = by_status.setdefault(status, {}).setdefault(code, [])
        if about not in abouts:
            abouts.append(about)
    out: dict[str, Any] = {}
    for status in sorted(by_status):
        codes = by_status[status]
        description = "; ".join(f"`{code}`: {', or '.join(abouts)}" for code, abouts in codes.items())
        response: dict[str, Any] = {"description": description,
                                    "content": {"application/json": {"schema": schema or _ref(s.ErrorResponse)}},
                                    "x-error-codes": list(codes)}
        if status in _RETRY_AFTER:
            response["headers"] = {"Retry-After": {"schema": {"type": "string"}, "description": "seconds"}}
        out[str(status)] = response
    return out


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": _REF.format(model=model.__name__)}


def _json(model: type[BaseModel] | dict[str, Any], description: str) -> dict[str, Any]:
    schema = _ref(model) if isinstance(model, type) else model
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _sse_event(chunk: type[BaseModel]) -> dict[str, Any]:
    """One server-sent event (OpenAPI 3.1: the schema of text/event-stream describes each event):
    its data is a JSON chunk, a JSON error, or the final [DONE]."""
    return {
        "type": "object",
        "required": ["data"],
        "properties": {
            "event": {"type": "string"},
            "data": {
                "anyOf": [
                    {"const": "[DONE]"},
                    {
                        "type": "string",
                        "contentMediaType": "application/json",
                        "contentSchema": {"anyOf": [_ref(chunk), _ref(s.ErrorResponse)]},
                    },
                ]
            },
        },
    }


def _generation(request: type[BaseModel], response: type[BaseModel], chunk: type[BaseModel], summary: str) -> dict:
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
            "responses": {
                "200": {
                    "description": f"stream false: one {response.__name__}; stream true: server-sent events, "
                    f"each `data: <{chunk.__name__}>`, ending with `data: [DONE]` (an error mid-stream is "
                    "sent as `data: <ErrorResponse>` before it)",
                    "content": {
                        "application/json": {"schema": _ref(response)},
                        "text/event-stream": {"schema": _sse_event(chunk)},
                    },
                },
                **_error_responses(*GENERATION),
            },
        }
    }


def _cluster_paths() -> dict[str, Any]:
    """The cluster's endpoints (served by ``exo serve``, a node of a cluster)."""
    obj = _json({"type": "object"}, "see docs/architecture.md, \"Cluster\"")
    model_q = {"name": "model", "in": "query", "required": True, "schema": {"type": "string"}}
    node_q = {"name": "node", "in": "query", "required": False, "schema": {"type": "string"}}
    min_nodes_q = {"name": "min_nodes", "in": "query", "required": False,
                   "schema": {"type": "integer", "minimum": 1, "maximum": 64}}
    nodes_q = {"name": "nodes", "in": "query", "required": False, "schema": {"type": "string"},
               "description": "node ids, comma-separated: exactly these, as the stages in this order"}
    sharding_q = {"name": "sharding", "in": "query", "required": False,
                  "schema": {"type": "string", "enum": ["pipeline", "tensor", "auto"]},
                  "description": "how to split the model (default pipeline); the answer's `options` list both splits"}
    id_p = {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}
    return {
        "/v1/cluster": {
            "get": {"summary": "nodes (self marked), links and instances as this node sees the cluster",
                    "responses": {"200": obj, **_error_responses(*AUTH)}}
        },
        "/v1/instances": {
            "get": {"summary": "every instance in the cluster (gone ones for a while)",
                    "responses": {"200": obj, **_error_responses(*AUTH)}},
            "post": {
                "summary": "place a model (on `node`, on `nodes` as pipeline stages or tensor members, or where placement "
                           "decides) and load it",
                "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(s.InstanceCreate)}}},
                "responses": {
                    "201": obj,
                    **_error_responses(*AUTH, *BODY, *MODEL, *PLACEMENT, we.InstanceFailedError,
                                       we.ClusterAuthError),
                },
            },
        },
        "/v1/instances/preview": {
            "get": {"summary": "where a model would be placed, without side effects",
                    "parameters": [model_q, node_q, min_nodes_q, nodes_q, sharding_q],
                    "responses": {"200": obj, **_error_responses(*AUTH, "invalid_value", "missing_required_parameter",
                                                                 *MODEL, *PLACEMENT)}}
        },
        "/v1/instances/{id}": {
            "get": {"summary": "one instance", "parameters": [id_p],
                    "responses": {"200": obj, **_error_responses(*AUTH, we.InstanceNotFoundError)}},
            "delete": {"summary": "stop an instance (its runner) and forget it", "parameters": [id_p],
                       "responses": {"200": obj, **_error_responses(*AUTH, we.InstanceNotFoundError,
                                                                    we.NodeUnavailableError)}},
        },
    }


_ANTHROPIC_ERROR = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
        },
    },
}
_OLLAMA_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}}
_ANY_OBJECT = {"type": "object"}
_SSE_ANY = {  # one server-sent event of a dialect's own stream (see docs/agents.md for the sequence)
    "type": "object",
    "required": ["data"],
    "properties": {"event": {"type": "string"}, "data": {"type": "string", "contentMediaType": "application/json"}},
}


def _dialect_post(
    request: type[BaseModel], summary: str, errors: dict[str, Any], stream_type: str | None, stream_schema: Any
) -> dict[str, Any]:
    content: dict[str, Any] = {"application/json": {"schema": _ANY_OBJECT}}
    if stream_type:
        content[stream_type] = {"schema": stream_schema}
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
            "responses": {"200": {"description": "the dialect's answer (see docs/agents.md)", "content": content}, **errors},
        }
    }


def _dialect_paths() -> dict[str, Any]:
    """The Anthropic Messages, OpenAI Responses and Ollama endpoints (translation layers over chat
    completions; their bodies are documented in docs/agents.md)."""
    anthropic_errors = _error_responses(*GENERATION, schema=_ANTHROPIC_ERROR)
    ollama_errors = _error_responses(*GENERATION, schema=_OLLAMA_ERROR)
    openai_errors = _error_responses(*GENERATION, "previous_response_not_found")
    id_p = {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}
    ollama_get = {"200": _json(_ANY_OBJECT, "Ollama's answer"), **_error_responses(*AUTH, schema=_OLLAMA_ERROR)}
    return {
        "/v1/messages": _dialect_post(
            anthropic.MessagesRequest, "Anthropic Messages (any query string)", anthropic_errors,
            "text/event-stream", _SSE_ANY,
        ),
        "/v1/messages/count_tokens": _dialect_post(
            anthropic.CountTokensRequest, "Anthropic count_tokens: the prompt's tokens", anthropic_errors, None, None
        ),
        "/v1/responses": _dialect_post(
            responses.ResponsesRequest, "OpenAI Responses", openai_errors, "text/event-stream", _SSE_ANY
        ),
        "/v1/responses/{id}": {
            "get": {"summary": "a stored response", "parameters": [id_p],
                    "responses": {"200": _json(_ANY_OBJECT, "the response"), **_error_responses(*AUTH, "not_found")}},
            "delete": {"summary": "forget a stored response", "parameters": [id_p],
                       "responses": {"200": _json(_ANY_OBJECT, "deleted"), **_error_responses(*AUTH, "not_found")}},
        },
        "/api/version": {"get": {"summary": "Ollama: the API version spoken", "responses": ollama_get}},
        "/api/tags": {"get": {"summary": "Ollama: the models", "responses": ollama_get}},
        "/api/ps": {"get": {"summary": "Ollama: the loaded models", "responses": ollama_get}},
        "/api/show": _dialect_post(ollama.ShowRequest, "Ollama: one model", ollama_errors, None, None),
        "/api/chat": _dialect_post(
            ollama.ChatRequest, "Ollama chat (NDJSON stream by default)", ollama_errors,
            "application/x-ndjson", {"type": "string"},
        ),
        "/api/generate": _dialect_post(
            ollama.GenerateRequest, "Ollama generate (NDJSON stream by default)", ollama_errors,
            "application/x-ndjson", {"type": "string"},
        ),
    }


def build_openapi(cluster: bool = False) -> dict[str, Any]:
    models: list[tuple[type[BaseModel], Any]] = [
        (m, "validation")
        for m in (
            s.ChatCompletionRequest,
            s.CompletionRequest,
            s.SettingsUpdate,
            s.InstanceCreate,
            anthropic.MessagesRequest,
            anthropic.CountTokensRequest,
            responses.ResponsesRequest,
            ollama.ChatRequest,
            ollama.GenerateRequest,
            ollama.ShowRequest,
        )
    ] + [
        (m, "serialization")
        for m in (
            s.ChatCompletion,
            s.ChatCompletionChunk,
            s.Completion,
            s.ModelList,
            s.ModelObject,
            s.SettingsView,
            s.Health,
            s.ErrorResponse,
        )
    ]
    _, top = models_json_schema(models, ref_template=_REF)
    extra = _cluster_paths() if cluster else {}
    settings_view = _json(s.SettingsView, "the node's writable settings and where their values came from")
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "exo",
            "version": __version__,
            "description": "OpenAI-compatible API of an exo node, with native-MTP speculative decoding stats. "
            "When the server has an API key (EXO_API_KEY), /v1/* needs `Authorization: Bearer <key>`.",
        },
        "paths": {
            "/health": {"get": {"summary": "liveness and load", "responses": {"200": _json(s.Health, "the node is up")}}},
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics",
                    "responses": {
                        "200": {
                            "description": "Prometheus text exposition format",
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        }
                    },
                }
            },
            "/openapi.json": {
                "get": {"summary": "this document", "responses": {"200": _json({"type": "object"}, "OpenAPI 3.1")}}
            },
            "/v1/models": {
                "get": {
                    "summary": "loaded models, then local ones (bundled first), then the rest of the catalog",
                    "responses": {"200": _json(s.ModelList, "the models"), **_error_responses(*AUTH)},
                }
            },
            "/v1/models/{model}": {
                "get": {
                    "summary": "one model",
                    "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
                    "responses": {"200": _json(s.ModelObject, "the model"), **_error_responses(*AUTH, "model_not_found")},
                }
            },
            "/v1/chat/completions": _generation(
                s.ChatCompletionRequest, s.ChatCompletion, s.ChatCompletionChunk, "chat completion (chat template)"
            ),
            "/v1/completions": _generation(s.CompletionRequest, s.Completion, s.Completion, "text completion"),
            "/v1/settings": {
                "get": {"summary": "node settings", "responses": {"200": settings_view, **_error_responses(*AUTH)}},
                "put": {
                    "summary": "change node settings (persisted in the node's settings file; next request on)",
                    "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(s.SettingsUpdate)}}},
                    "responses": {"200": settings_view, **_error_responses(*AUTH, *BODY, we.SettingsError,
                                                                           "internal_error")},
                },
            },
            **_dialect_paths(),
            **extra,
        },
        "components": {
            "schemas": top.get("$defs", {}),
            "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer"}},
        },
    }

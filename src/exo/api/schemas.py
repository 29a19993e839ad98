"""Request and response bodies of the API as pydantic models: validation, and the OpenAPI schemas.

Requests are validated strictly (JSON types as documented, unknown fields rejected), so a typo or a
feature exo does not have is a 400, never silently ignored. OpenAI fields exo does not implement
(the deprecated functions / function_call, logit_bias, n > 1, ...) are accepted only with their "off" value
and are otherwise rejected by ``reject_unsupported`` with ``code: "unsupported_parameter"``. Tools,
response_format and logprobs are implemented (``api/tools.py``, ``engine/constraints.py``).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from exo.engine.request import MAX_FORCED_K, MAX_TOP_LOGPROBS
from exo.engine.stats import NativeMTPStats

from .errors import APIError

MAX_STOP_SEQUENCES = 16
_STRICT = ConfigDict(extra="forbid", strict=True)

# Known OpenAI fields exo does not implement, with the values that ask for nothing (accepted, dropped).
_OFF: dict[str, tuple[Any, ...]] = {
    "functions": (None, []),
    "function_call": (None, "none"),
    "logit_bias": (None, {}),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
    "service_tier": (None, "auto", "default"),
    "store": (None, False),
    "metadata": (None, {}),
    "verbosity": (None,),
}
_COMPLETIONS_OFF: dict[str, tuple[Any, ...]] = {
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
}


def _same(a: Any, b: Any) -> bool:
    # 0 == False in Python; a JSON false must not match an allowed 0 (or the reverse).
    return type(a) is type(b) and a == b


def reject_unsupported(body: dict[str, Any], endpoint: Literal["chat", "completions"]) -> dict[str, Any]:
    """Raise a 400 for OpenAI features exo does not implement; drop the ones sent with their off value."""
    off = _OFF if endpoint == "chat" else _COMPLETIONS_OFF
    out = {}
    for key, value in body.items():
        if key in off:
            if not any(_same(value, allowed) for allowed in off[key]):
                raise _unsupported(key, f"{key!r} is not supported by exo")
            continue
        out[key] = value
    n = out.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n > 1:
        raise _unsupported("n", "n > 1 is not supported by exo: send one request per completion")
    if endpoint == "chat" and isinstance(out.get("messages"), list):
        for i, message in enumerate(out["messages"]):
            if isinstance(message, dict):
                _reject_unsupported_message(message, f"messages.{i}")
    if endpoint == "completions" and isinstance(out.get("prompt"), list):
        prompt = out["prompt"]
        several_texts = len(prompt) > 1 and all(isinstance(p, str) for p in prompt)
        if several_texts or (prompt and all(isinstance(p, list) for p in prompt)):
            raise _unsupported("prompt", "several prompts in one request are not supported: send one each")
    return out


def _reject_unsupported_message(message: dict[str, Any], where: str) -> None:
    role = message.get("role")
    if role == "function":
        raise _unsupported(f"{where}.role", "'function' messages (deprecated) are not supported by exo: use 'tool'")
    for key in ("function_call", "audio"):
        if message.get(key) not in (None, []):
            raise _unsupported(f"{where}.{key}", f"{key!r} in messages is not supported by exo")
    content = message.get("content")
    if isinstance(content, list):
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise _unsupported(
                    f"{where}.content.{j}.type", f"content parts of type {kind!r} are not supported: text only"
                )


def _unsupported(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="unsupported_parameter")


# -- requests ------------------------------------------------------------------------------------------


class NativeMTPOptions(BaseModel):
    """exo extension: native-MTP speculative decoding for this request."""

    model_config = _STRICT

    enabled: bool | None = Field(
        default=None,
        description="false: plain decoding; true or absent: use the model's MTP head when it can run "
        "(the response's native_mtp stats say why not otherwise)",
    )
    k: int | None = Field(
        default=None, ge=0, le=MAX_FORCED_K, description="force the draft depth (0 = plain); absent: adaptive"
    )


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool | None = Field(
        default=None, description="send a last chunk with empty choices and the same usage as non-streaming"
    )


class TextPart(BaseModel):
    model_config = _STRICT

    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = _STRICT

    name: str = Field(min_length=1)
    arguments: str = Field(description="the arguments as a JSON object, in a string")


class ToolCall(BaseModel):
    model_config = _STRICT

    id: str = Field(min_length=1)
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = _STRICT

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(
        default=None, description="required except on assistant messages that carry tool_calls"
    )
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(default=None, description="assistant messages: the calls it made")
    tool_call_id: str | None = Field(default=None, description="tool messages: the call this is the result of")


TOOL_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"


class FunctionDefinition(BaseModel):
    model_config = _STRICT

    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        default=None, description="a JSON schema (an object); absent: no parameters"
    )
    strict: bool | None = Field(default=None, description="accepted; forced calls always follow the schema")


class Tool(BaseModel):
    model_config = _STRICT

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = _STRICT

    name: str


class NamedToolChoice(BaseModel):
    model_config = _STRICT

    type: Literal["function"]
    function: NamedFunction


class JSONSchemaSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema", description="absent: any JSON object")
    strict: bool | None = Field(default=None, description="accepted; the output always follows the schema")


class TextFormat(BaseModel):
    model_config = _STRICT

    type: Literal["text"]


class JSONObjectFormat(BaseModel):
    model_config = _STRICT

    type: Literal["json_object"]


class JSONSchemaFormat(BaseModel):
    model_config = _STRICT

    type: Literal["json_schema"]
    json_schema: JSONSchemaSpec


ResponseFormat = Annotated[TextFormat | JSONObjectFormat | JSONSchemaFormat, Field(discriminator="type")]


def prompt_cache_key_text(value: Any) -> str | None:
    """A ``prompt_cache_key`` as sent -> the key (a string as is; another value's JSON; null or "": none)."""
    if value is None or value == "":
        return None
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)


class GenerationFields(BaseModel):
    """Fields shared by both generation endpoints (OpenAI names, exo's engine limits)."""

    model_config = _STRICT

    model: str | None = Field(
        default=None,
        description="a model id from GET /v1/models (card id or Hugging Face repo id); absent or null: the "
        "server's default model (exo serve --model, else the bundled exo-demo)",
    )
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=100, description="default 1.0")
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0, description="exo extension; 0 disables it")
    min_p: float | None = Field(default=None, ge=0, le=1, description="exo extension")
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(
        default=None, gt=0, le=10, description="exo extension: multiplicative (mlx-lm semantics)"
    )
    stop: str | list[str] | None = Field(default=None, description="up to 16 stop strings")
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=None, ge=1, le=1, description="only 1 is supported")
    user: str | None = Field(default=None, description="accepted for compatibility; not used")
    prompt_cache_key: Any = Field(
        default=None,
        description="OpenAI's prompt-cache hint (any value, never an error; not a string: its JSON is the key): "
        "requests of one key go to the same instance when none holds their prefix, and the prefix cache keeps "
        "one key's entries together. Prompts are matched by their tokens whatever the key",
    )

    def prompt_cache_key_text(self) -> str | None:
        """``prompt_cache_key`` as the key it stands for (None: none)."""
        return prompt_cache_key_text(self.prompt_cache_key)
    native_mtp: NativeMTPOptions | None = None
    ignore_eos: bool | None = Field(
        default=None,
        description="exo extension (as vLLM's): keep generating past end-of-sequence tokens, up to max_tokens "
        "(benchmarks, tests); not with tools or response_format",
    )

    def stop_list(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise APIError(400, f"at most {MAX_STOP_SEQUENCES} stop sequences", param="stop", code="invalid_value")
        return stops

    def check_combinations(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise APIError(
                400, "stream_options is only allowed with stream: true", param="stream_options", code="invalid_value"
            )
        mtp = self.native_mtp
        if mtp is not None and mtp.enabled is False and mtp.k is not None:
            raise APIError(
                400,
                "native_mtp.k needs native MTP: drop k, or set enabled to true",
                param="native_mtp.k",
                code="invalid_value",
            )


class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, description="same as max_tokens")
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, description="exo extension: extra variables for the chat template (e.g. enable_thinking)"
    )
    tools: list[Tool] | None = Field(default=None, max_length=128, description="functions the model may call")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        default=None,
        description="auto (default with tools): the model decides; required: at least one call; a named function: "
        "a call of it; required and named calls are constrained to the functions' schemas",
    )
    parallel_tool_calls: bool | None = Field(default=None, description="default true: several calls in one answer")
    response_format: ResponseFormat | None = Field(
        default=None, description="json_object / json_schema: the content is constrained to (schema-valid) JSON"
    )
    logprobs: bool | None = Field(default=None, description="log-probabilities of the output tokens")
    top_logprobs: int | None = Field(
        default=None, ge=0, le=MAX_TOP_LOGPROBS, description="with logprobs: this many most likely alternatives per token"
    )

    def completion_budget(self) -> int | None:
        a, b = self.max_tokens, self.max_completion_tokens
        if a is not None and b is not None and a != b:
            raise APIError(
                400,
                "max_tokens and max_completion_tokens differ; send one of them",
                param="max_completion_tokens",
                code="invalid_value",
            )
        return a if a is not None else b


class CompletionRequest(GenerationFields):
    prompt: str | list[int] | list[str] = Field(
        description="text, a list of token ids, or a list holding one text"
    )
    logprobs: int | None = Field(
        default=None, ge=0, le=MAX_TOP_LOGPROBS, description="log-probabilities of the output tokens, with this many alternatives"
    )

    def prompt_value(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            return prompt[0]  # reject_unsupported already refused several prompts
        if isinstance(prompt, list) and not prompt:
            raise APIError(400, "the prompt is empty", param="prompt", code="invalid_value")
        return prompt  # type: ignore[return-value]


class SettingsUpdate(BaseModel):
    model_config = _STRICT

    native_mtp_enabled: bool = Field(description="the node-wide native-MTP switch; persisted")


class InstanceCreate(BaseModel):
    """``POST /v1/instances``."""

    model_config = _STRICT

    model: str = Field(min_length=1, description="card id, repo id, or a model id served by a node")
    node: str | None = Field(
        default=None, min_length=1, description="a node id (GET /v1/cluster); default: placement decides"
    )
    wait: bool = Field(default=False, description="answer once the instance is ready (bounded by the load timeout)")
    min_nodes: int = Field(
        default=1, ge=1, le=64,
        description="spread the model over at least this many nodes (a pipeline), even if it fits on fewer",
    )
    nodes: list[str] | None = Field(
        default=None, min_length=1, max_length=64,
        description="exactly these node ids, as the pipeline's stages in this order (the last one leads)",
    )
    replica: bool = Field(
        default=False,
        description="place another instance of a model that already has one (requests then go to the instance "
        "holding their longest cached prefix: docs/prefix-cache.md); default: a model has one instance",
    )
    sharding: Literal["pipeline", "tensor", "auto"] = Field(
        default="pipeline",
        description="how to split the model over nodes: pipeline (one node when it fits, else layers over the "
        "fewest nodes: the default), tensor (a slice of every layer on each of at least two nodes, joined by "
        "all-reduces), auto (the faster of the two by the estimate the preview shows)",
    )

    def check_combinations(self) -> None:
        if self.node is not None and (self.nodes is not None or self.min_nodes > 1):
            raise APIError(400, "node places on one node: use nodes (or min_nodes) to spread over several",
                           param="node", code="invalid_value")
        if self.nodes is not None and len(set(self.nodes)) != len(self.nodes):
            raise APIError(400, "nodes lists a node more than once", param="nodes", code="invalid_value")
        if self.nodes is not None and any(not n for n in self.nodes):
            raise APIError(400, "nodes: empty node id", param="nodes", code="invalid_value")


# -- responses (documentation: handlers build these shapes as plain dicts on the hot path) -------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens restored from the prefix cache, not prefilled again")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    native_mtp: NativeMTPStats
    ttft_ms: float
    decode_tokens_per_s: float
    queue_ms: float = Field(description="time spent waiting for the device")


class TopLogprobView(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobView(BaseModel):
    token: str = Field(description="the token's text (bytes that are not whole UTF-8 characters: replaced)")
    logprob: float = Field(description="under the distribution the token was chosen from; -9999.0: excluded")
    bytes: list[int] | None
    top_logprobs: list[TopLogprobView]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprobView] | None
    refusal: None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = Field(default=None, description="present when the model called tools")


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"]


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: Usage


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = Field(default=None, description="on a call's first delta, with type and function.name")
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None


class ChatCompletionChunk(BaseModel):
    """One SSE event (``data: {...}``) of a streamed chat completion; the stream ends with ``data: [DONE]``."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChunkChoice]
    native_mtp: NativeMTPStats | None = Field(default=None, description="on the chunk with finish_reason")
    usage: Usage | None = Field(default=None, description="on the last chunk (empty choices) with include_usage")


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage | None = None
    native_mtp: NativeMTPStats | None = None


class ModelNativeMTP(BaseModel):
    default_k: int | None
    max_k: int | None
    available: bool
    reason: str | None


class ModelObject(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    status: Literal["loaded", "local", "remote"]
    name: str | None = None
    arch: str | None = None
    context_length: int | None = None
    native_mtp: ModelNativeMTP


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelObject]


class SettingsView(BaseModel):
    object: Literal["settings"]
    native_mtp_enabled: bool
    sources: dict[str, Literal["default", "file", "env", "app", "cli", "api"]] = Field(
        description="which source set each value: default < file < env < cli at start-up (app: an EXO_* "
        "variable the app that started exo set from its saved choice); api: PUT /v1/settings"
    )
    env_overrides: dict[str, str] = Field(
        description="EXO_* variables set for these fields (not by the app that started exo): they win over the "
        "settings file at the next start"
    )
    settings_file: str


class Health(BaseModel):
    status: Literal["ok"]
    models_loaded: list[str]
    queue_depth: int
    running: int
    uptime_s: float
    api_key_required: bool


class ErrorObject(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorObject

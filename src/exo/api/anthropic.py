"""The Anthropic Messages API: ``POST /v1/messages`` (any query string) and ``/v1/messages/count_tokens``.

A translation layer over chat completions' generation path (``completions.ChatGeneration``): the
request becomes a chat body (``system`` and system-role messages -> one leading system message, content
blocks -> messages, ``tool_use`` / ``tool_result`` -> tool calls and tool messages, ``tools`` /
``tool_choice`` -> functions and OpenAI's choices, ``max_tokens`` -> a budget bounded by the context), and
the answer's parts become content blocks (``thinking``, ``text``, ``tool_use``) or Anthropic's event
stream. Fields exo does not use (``metadata``, ``cache_control``, ``context_management``,
``output_config``, ``anthropic-beta`` features, server tools) are accepted and ignored, as Claude Code
sends them on every request. Errors: ``{"type": "error", "error": {...}}`` (``dialects.error_body``).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from .completions import ChatGeneration, Part, Reasoning, cached_tokens, prepare_chat
from .config import CONFIG, METRICS, SERVICE
from .dialects import (
    arguments_object,
    end_stream,
    error_body,
    hoist_system,
    invalid,
    relay,
    unsupported,
)
from .errors import api_error_from
from .parsing import read_json, validate
from .schemas import MAX_STOP_SEQUENCES
from .tools import Arguments, CallStart, Content

_LENIENT = ConfigDict(extra="ignore", strict=True)  # Anthropic adds fields often; unknown ones are ignored
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


class _ToolChoice(BaseModel):
    model_config = _LENIENT

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class _Tool(BaseModel):
    model_config = _LENIENT

    type: str | None = Field(default=None, description="absent or 'custom': a function; others: server tools")
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None


class _Thinking(BaseModel):
    model_config = _LENIENT

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class _Format(BaseModel):
    model_config = _LENIENT

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class _OutputConfig(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)

    format: _Format | None = Field(default=None, description="structured output: constrained as response_format")


class _Message(BaseModel):
    model_config = _LENIENT

    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]


class MessagesRequest(BaseModel):
    model_config = _LENIENT

    model: str = Field(min_length=1)
    messages: list[_Message] = Field(min_length=1)
    max_tokens: int = Field(ge=1, description="at most this many tokens; beyond what the context leaves: clamped")
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = Field(default=None, max_length=MAX_STOP_SEQUENCES)
    stream: bool | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    tools: list[_Tool] | None = None
    tool_choice: _ToolChoice | None = None
    thinking: _Thinking | None = None
    output_config: _OutputConfig | None = None


class CountTokensRequest(BaseModel):
    model_config = _LENIENT

    model: str = Field(min_length=1)
    messages: list[_Message] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[_Tool] | None = None
    tool_choice: _ToolChoice | None = None
    thinking: _Thinking | None = None


# -- request -> chat body ----------------------------------------------------------------------------------


def _text_of(blocks: str | list[dict[str, Any]], where: str) -> str:
    """Text blocks joined (images and documents refused: exo's models read text)."""
    if isinstance(blocks, str):
        return blocks
    texts = []
    for i, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            text = block.get("text")
            if not isinstance(text, str):
                raise invalid(f"{where}.{i}.text", f"{where}.{i}.text: a string is required", "invalid_type")
            texts.append(text)
        elif kind in ("image", "document", "search_result"):
            raise unsupported(f"{where}.{i}.type", f"{where}.{i}: {kind} blocks are not supported: exo's models read text only")
        else:
            raise invalid(f"{where}.{i}.type", f"{where}.{i}: a block of type {kind!r} is not allowed here")
    return "\n".join(texts)


def _messages(req: MessagesRequest | CountTokensRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if req.system is not None:
        out.append({"role": "system", "content": _text_of(req.system, "system")})
    for i, m in enumerate(req.messages):
        where = f"messages.{i}.content"
        if m.role == "system" or isinstance(m.content, str):
            out.append({"role": m.role, "content": _text_of(m.content, where)})
            continue
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, block in enumerate(m.content):
            kind = block.get("type")
            at = f"{where}.{j}"
            if kind == "text":
                texts.append(_text_of([block], where))
            elif kind in ("thinking", "redacted_thinking") and m.role == "assistant":
                continue  # earlier turns' reasoning: the chat templates leave it out of the prompt
            elif kind == "tool_use" and m.role == "assistant":
                name, call_id, arguments = block.get("name"), block.get("id"), block.get("input", {})
                if not isinstance(name, str) or not isinstance(call_id, str) or not isinstance(arguments, dict):
                    raise invalid(at, f"{at}: a tool_use block needs a string id and name and an object input")
                calls.append({"id": call_id, "type": "function",
                              "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}})
            elif kind == "tool_result" and m.role == "user":
                call_id, content = block.get("tool_use_id"), block.get("content", "")
                if not isinstance(call_id, str):
                    raise invalid(f"{at}.tool_use_id", f"{at}.tool_use_id: a string is required", "invalid_type")
                if not isinstance(content, (str, list)):
                    raise invalid(f"{at}.content", f"{at}.content: a string or a list of blocks", "invalid_type")
                text = _text_of(content, f"{at}.content")
                if block.get("is_error") is True:
                    text = f"Error: {text}"
                out.append({"role": "tool", "tool_call_id": call_id, "content": text})
            elif kind in ("image", "document", "search_result"):
                raise unsupported(f"{at}.type", f"{at}: {kind} blocks are not supported: exo's models read text only")
            else:
                raise invalid(f"{at}.type", f"{at}: a block of type {kind!r} is not allowed in a {m.role} message")
        if m.role == "assistant":
            message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
            if calls:
                message["tool_calls"] = calls
            out.append(message)
        elif texts:
            out.append({"role": "user", "content": "\n".join(texts)})
    return hoist_system(out)


def chat_body(req: MessagesRequest | CountTokensRequest) -> dict[str, Any]:
    body: dict[str, Any] = {"model": req.model, "messages": _messages(req)}
    tools = [t for t in req.tools or [] if t.type in (None, "custom")]  # server tools: exo cannot run them
    choice = req.tool_choice
    if tools and not (choice is not None and choice.type == "none"):
        body["tools"] = [
            {"type": "function", "function": {
                "name": t.name,
                **({"description": t.description} if t.description is not None else {}),
                "parameters": t.input_schema if t.input_schema is not None else {"type": "object", "properties": {}},
            }}
            for t in tools
        ]
        if choice is not None:
            if choice.type == "any":
                body["tool_choice"] = "required"
            elif choice.type == "tool":
                if not choice.name:
                    raise invalid("tool_choice.name", "tool_choice of type 'tool' needs a name", "missing_required_parameter")
                body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
            if choice.disable_parallel_tool_use:
                body["parallel_tool_calls"] = False
    elif choice is not None and choice.type in ("any", "tool"):
        raise invalid("tool_choice", "tool_choice asks for a tool call but tools lists no tool")
    if req.thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": req.thinking.type != "disabled"}
    if isinstance(req, MessagesRequest):
        for key in ("temperature", "top_p", "top_k"):
            if getattr(req, key) is not None:
                body[key] = getattr(req, key)
        if req.stop_sequences:
            body["stop"] = req.stop_sequences
        if req.output_config is not None and req.output_config.format is not None:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": req.output_config.format.schema_}}
    return body


# -- handlers ----------------------------------------------------------------------------------------------


async def messages(request: web.Request) -> web.StreamResponse:
    arrived = time.monotonic()
    req = validate(MessagesRequest, await read_json(request))
    generation = ChatGeneration(request, chat_body(req), arrived, budget=req.max_tokens)
    async with generation:
        answer = _Answer(generation)
        if req.stream:
            return await _stream(request, generation, answer)
        for part in await generation.whole():
            answer.add(part)
        return web.json_response(answer.message())


async def count_tokens(request: web.Request) -> web.Response:
    req = validate(CountTokensRequest, await read_json(request))
    body = chat_body(req)
    body.pop("tool_choice", None)  # a forced call's grammar needs a budget; counting needs none
    body.pop("parallel_tool_calls", None)
    arrived = time.monotonic()
    service = request.app[SERVICE]
    count = getattr(service, "count_prompt_tokens", None)
    if count is not None:
        # Where the model's tokenizer is in this process (a local service): the chat template and the
        # tokenizer only, nothing queued behind running generations.
        req_chat, prompt, _, _ = prepare_chat(body)
        config = request.app[CONFIG]
        model_id = await service.acquire(req_chat.model, min(config.load_timeout_s, config.request_timeout_s))
        return web.json_response({"input_tokens": await count(model_id, prompt)})
    count_here = getattr(service, "count_prompt_tokens_here", None)
    if count_here is not None:
        # A cluster node with the model's files on its disk: their tokenizer and chat template, loaded in
        # this process (no runner, no device queue, the model need not be loaded anywhere).
        req_chat, prompt, _, _ = prepare_chat(body)
        counted = await count_here(req_chat.model, prompt)
        if counted is not None:
            return web.json_response({"input_tokens": counted})
    # Elsewhere (the files are only on the node that owns the model) the prompt as the one path renders
    # and tokenizes it there; the generation is cancelled as soon as it is counted.
    async with ChatGeneration(request, body, arrived, budget=1) as generation:
        assert generation.started is not None
        return web.json_response({"input_tokens": generation.started.prompt_tokens})


# -- answer -> message / events ----------------------------------------------------------------------------


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n".encode()


class _Answer:
    """The content blocks of one answer, built from the chat parts; ``add`` returns the stream's events."""

    def __init__(self, generation: ChatGeneration) -> None:
        self.generation = generation
        self.id = "msg_" + uuid.uuid4().hex[:24]
        self.blocks: list[dict[str, Any]] = []
        self.open: str | None = None  # the kind of the last block while it is open: thinking | text | tool_use
        self.arguments = ""  # the open tool_use block's arguments so far

    def _usage(self, output_tokens: int) -> dict[str, Any]:
        usage = self.generation.usage
        started = self.generation.started
        prompt = usage.get("prompt_tokens", started.prompt_tokens if started else 0)
        cached = cached_tokens(usage)
        out: dict[str, Any] = {
            "input_tokens": prompt - cached,  # Anthropic counts cache reads apart from input_tokens
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
            "output_tokens": output_tokens,
        }
        if "native_mtp" in usage:
            out["native_mtp"] = usage["native_mtp"]
        return out

    def _close(self) -> bytes:
        if self.open is None:
            return b""
        out = b""
        block = self.blocks[-1]
        if self.open == "tool_use":
            # The arguments go out whole and valid at the call's end: a model's unfinished or broken JSON (no
            # constraint under tool_choice auto) would break every client's partial-JSON parser.
            arguments = arguments_object(self.arguments)
            block["input"] = arguments if arguments is not None else {}
            partial = json.dumps(block["input"], ensure_ascii=False)
            out += _sse("content_block_delta", {"type": "content_block_delta", "index": len(self.blocks) - 1,
                                                "delta": {"type": "input_json_delta", "partial_json": partial}})
        elif self.open == "thinking":
            out += _sse("content_block_delta", {"type": "content_block_delta", "index": len(self.blocks) - 1,
                                                "delta": {"type": "signature_delta", "signature": ""}})
        self.open = None
        return out + _sse("content_block_stop", {"type": "content_block_stop", "index": len(self.blocks) - 1})

    def _start(self, block: dict[str, Any]) -> bytes:
        out = self._close()
        self.blocks.append(block)
        self.open = block["type"]
        start = {**block, "input": {}} if block["type"] == "tool_use" else {**block}
        if block["type"] in ("text", "thinking"):
            start[block["type"]] = ""
        return out + _sse("content_block_start", {"type": "content_block_start", "index": len(self.blocks) - 1,
                                                  "content_block": start})

    def _delta(self, kind: str, field: str, text: str) -> bytes:
        return _sse("content_block_delta", {"type": "content_block_delta", "index": len(self.blocks) - 1,
                                            "delta": {"type": kind, field: text}})

    def add(self, part: Part) -> bytes:
        if isinstance(part, Reasoning):
            out = b"" if self.open == "thinking" else self._start({"type": "thinking", "thinking": "", "signature": ""})
            self.blocks[-1]["thinking"] += part.text
            return out + self._delta("thinking_delta", "thinking", part.text)
        if isinstance(part, Content):
            out = b"" if self.open == "text" else self._start({"type": "text", "text": ""})
            self.blocks[-1]["text"] += part.text
            return out + self._delta("text_delta", "text", part.text)
        if isinstance(part, CallStart):
            out = self._close()  # the previous block, with its arguments
            self.arguments = ""
            return out + self._start({"type": "tool_use", "id": part.id, "name": part.name, "input": {}})
        assert isinstance(part, Arguments)
        self.arguments += part.fragment
        return b""

    def stop_reason(self) -> str:
        if self.generation.stop_sequence is not None:
            return "stop_sequence"
        return _STOP_REASONS.get(self.generation.finish_reason or "stop", "end_turn")

    def message(self) -> dict[str, Any]:
        self._close()
        output_tokens = self.generation.usage.get("completion_tokens", 0)
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.generation.model,
            "content": self.blocks,
            "stop_reason": self.stop_reason(),
            "stop_sequence": self.generation.stop_sequence,
            "usage": self._usage(output_tokens),
        }

    def opening(self) -> bytes:
        message = {"id": self.id, "type": "message", "role": "assistant", "model": self.generation.model,
                   "content": [], "stop_reason": None, "stop_sequence": None, "usage": self._usage(0)}
        return _sse("message_start", {"type": "message_start", "message": message}) + _sse("ping", {"type": "ping"})

    def ending(self) -> bytes:
        out = self._close()
        usage = self._usage(self.generation.usage.get("completion_tokens", 0))
        delta = {"type": "message_delta", "delta": {"stop_reason": self.stop_reason(), "stop_sequence": self.generation.stop_sequence},
                 "usage": usage}
        return out + _sse("message_delta", delta) + _sse("message_stop", {"type": "message_stop"})


KEEPALIVE_S = 10.0  # a ping this often while the prompt is read (before the first token)


async def _stream(request: web.Request, generation: ChatGeneration, answer: _Answer) -> web.StreamResponse:
    # The prompt passed validation (errors so far were plain HTTP errors): the stream opens now, as
    # Anthropic's does, and pings while the prompt is read; a failure from here on is an error event.
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
    await response.prepare(request)
    try:
        await response.write(answer.opening())

        async def ping() -> None:
            await response.write(_sse("ping", {"type": "ping"}))

        await relay(response, generation, answer.add, ping, KEEPALIVE_S)
        await response.write(answer.ending())
    except ConnectionError:  # the client went away between our writes
        return response
    except Exception as e:  # noqa: BLE001 - headers are sent: Anthropic's error event ends the stream
        err = api_error_from(e)
        request.app[METRICS].errors.labels(err.code or str(err.status)).inc()
        return await end_stream(response, _sse("error", error_body("anthropic", err)))
    return await end_stream(response)

"""Ollama's API (for Open WebUI and the tools that only speak it): ``GET /api/version``, ``/api/tags``,
``/api/ps``, ``POST /api/show``, ``/api/chat`` and ``/api/generate``.

A translation layer over chat completions' generation path (``completions.ChatGeneration``; a ``raw``
generate over text completions'): ``options`` map onto exo's sampling (``num_predict`` is the budget,
bounded by the context; ``num_ctx``, ``keep_alive`` and the like are accepted and ignored), ``format``
(``"json"`` or a JSON schema) onto ``response_format``, tools onto the chat's tools (Ollama's tool
messages name their function, not a call id: each answers the earliest unanswered call of that name).
Streaming (the default, as Ollama's) is NDJSON: one object a line, the last with ``done: true``, the
counts and durations (nanoseconds). Errors are ``{"error": "..."}``.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import json
import time
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from .completions import ChatGeneration, Part, Reasoning, prepare_completion
from .config import CONFIG, METRICS, SERVICE
from .dialects import arguments_object, end_stream, hoist_system, invalid, unsupported
from .errors import APIError, api_error_from
from .parsing import read_json, validate
from .tools import Arguments, CallStart, Content

OLLAMA_VERSION = "0.13.0"  # the version of Ollama's API this speaks (clients check it)
_LENIENT = ConfigDict(extra="ignore", strict=True)
_DONE_REASONS = {"stop": "stop", "length": "length", "tool_calls": "stop"}


class Options(BaseModel):
    model_config = _LENIENT

    num_predict: int | None = Field(default=None, description="-1 / -2: until the context is full")
    temperature: float | None = Field(default=None, ge=0, le=100)
    top_p: float | None = Field(default=None, ge=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0, le=1)
    seed: int | None = None
    stop: list[str] | None = None
    repeat_penalty: float | None = Field(default=None, ge=0, le=10)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)


class _Message(BaseModel):
    model_config = _LENIENT

    role: str
    content: str | None = None
    images: list[str] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_name: str | None = None
    thinking: str | None = None


class ChatRequest(BaseModel):
    model: str = Field(min_length=1)
    messages: list[_Message] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    format: str | dict[str, Any] | None = None
    options: Options | None = None
    stream: bool = True
    think: bool | str | None = None
    keep_alive: str | int | float | None = None

    model_config = _LENIENT


class GenerateRequest(BaseModel):
    model_config = _LENIENT

    model: str = Field(min_length=1)
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    images: list[str] | None = None
    format: str | dict[str, Any] | None = None
    options: Options | None = None
    stream: bool = True
    raw: bool = False
    think: bool | str | None = None
    keep_alive: str | int | float | None = None


class ShowRequest(BaseModel):
    model_config = _LENIENT

    model: str | None = None
    name: str | None = None  # older clients


def add_routes(app: web.Application) -> None:
    app.router.add_get("/api/version", version)
    app.router.add_get("/api/tags", tags)
    app.router.add_get("/api/ps", ps)
    app.router.add_post("/api/show", show)
    app.router.add_post("/api/chat", chat)
    app.router.add_post("/api/generate", generate)


# -- models ----------------------------------------------------------------------------------------------


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat().replace("+00:00", "Z")


def _model_entry(info: Any) -> dict[str, Any]:
    arch = info.arch or ""
    return {
        "name": info.id,
        "model": info.id,
        "modified_at": datetime.datetime.fromtimestamp(info.created, datetime.UTC).isoformat().replace("+00:00", "Z"),
        "size": 0,
        "digest": hashlib.sha256(info.id.encode()).hexdigest(),  # stable per model id (exo has no blobs)
        "details": {
            "parent_model": "",
            "format": "safetensors",
            "family": arch,
            "families": [arch] if arch else [],
            "parameter_size": "",
            "quantization_level": "",
        },
    }


async def _infos(request: web.Request) -> list[Any]:
    return await asyncio.to_thread(request.app[SERVICE].list_models)


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": OLLAMA_VERSION})


async def tags(request: web.Request) -> web.Response:
    return web.json_response({"models": [_model_entry(i) for i in await _infos(request) if i.status != "remote"]})


async def ps(request: web.Request) -> web.Response:
    models = []
    for info in await _infos(request):
        if info.status == "loaded":
            entry = _model_entry(info)
            del entry["modified_at"]
            models.append({**entry, "expires_at": "0001-01-01T00:00:00Z", "size_vram": 0,
                           "context_length": info.context_length or 0})
    return web.json_response({"models": models})


async def show(request: web.Request) -> web.Response:
    req = validate(ShowRequest, await read_json(request))
    name = req.model or req.name
    if not name:
        raise invalid("model", "model: required", "missing_required_parameter")
    for info in await _infos(request):
        if info.id == name:
            entry = _model_entry(info)
            arch = info.arch or "unknown"
            model_info: dict[str, Any] = {"general.architecture": arch}
            if info.context_length:
                model_info[f"{arch}.context_length"] = info.context_length
            return web.json_response({
                "modelfile": "", "parameters": "", "template": "",
                "details": entry["details"], "model_info": model_info,
                "capabilities": ["completion", "tools"],
                "modified_at": entry["modified_at"],
            })
    raise APIError(404, f"model {name!r} not found", param="model", code="model_not_found")


# -- requests -> chat / completion bodies ----------------------------------------------------------------------


def _options(options: Options | None, body: dict[str, Any]) -> int | None:
    """The options onto the body's sampling fields; returns the budget (None: until the context is full)."""
    if options is None:
        return None
    for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"), ("min_p", "min_p"),
                         ("seed", "seed"), ("repetition_penalty", "repeat_penalty"),
                         ("presence_penalty", "presence_penalty"), ("frequency_penalty", "frequency_penalty")):
        value = getattr(options, theirs)
        if value is not None:
            body[ours] = value
    if options.top_p == 0:
        body.pop("top_p")  # Ollama reads 0 as "off"
    if options.repeat_penalty == 0:
        body.pop("repetition_penalty")
    if options.stop:
        body["stop"] = options.stop
    n = options.num_predict
    if n is None or n < 0:
        return None
    if n == 0:
        raise invalid("options.num_predict", "options.num_predict: 0 generates nothing; send at least 1")
    return n


def _format(fmt: str | dict[str, Any] | None) -> dict[str, Any] | None:
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt}}
    raise invalid("format", "format: \"json\" or a JSON schema (an object)")


def _think(think: bool | str | None, body: dict[str, Any]) -> None:
    if think is not None:
        body["chat_template_kwargs"] = {"enable_thinking": think is not False}


def chat_messages(req: ChatRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    unanswered: list[tuple[str, str]] = []  # (call id, function name), oldest first
    for i, m in enumerate(req.messages):
        where = f"messages.{i}"
        if m.images:
            raise unsupported(f"{where}.images", f"{where}: images are not supported: exo's models read text only")
        if m.role not in ("system", "user", "assistant", "tool"):
            raise invalid(f"{where}.role", f"{where}.role: one of system, user, assistant, tool")
        content = m.content or ""
        if m.role == "assistant" and m.tool_calls:
            calls = []
            for j, call in enumerate(m.tool_calls):
                function = call.get("function") if isinstance(call, dict) else None
                name = function.get("name") if isinstance(function, dict) else None
                arguments = function.get("arguments", {}) if isinstance(function, dict) else None
                if isinstance(arguments, str):
                    arguments = arguments_object(arguments)
                if not isinstance(name, str) or not isinstance(arguments, dict):
                    raise invalid(f"{where}.tool_calls.{j}", f"{where}.tool_calls.{j}: a function with a name and "
                                  "object arguments is required")
                call_id = call["id"] if isinstance(call.get("id"), str) else f"call_{i}_{j}"
                unanswered.append((call_id, name))
                calls.append({"id": call_id, "type": "function",
                              "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}})
            out.append({"role": "assistant", "content": content, "tool_calls": calls})
        elif m.role == "tool":
            if not unanswered:
                raise invalid(f"{where}", f"{where}: a tool message answers no earlier tool call")
            match = next((c for c in unanswered if c[1] == m.tool_name), unanswered[0])
            unanswered.remove(match)
            out.append({"role": "tool", "tool_call_id": match[0], "content": content})
        else:
            out.append({"role": m.role, "content": content})
    return hoist_system(out)


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        function = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise invalid(f"tools.{i}", f"tools.{i}: a function tool ({{\"type\": \"function\", \"function\": ...}})")
        out.append({"type": "function", "function": function})
    return out


# -- handlers ----------------------------------------------------------------------------------------------


class _Answer:
    """One answer as Ollama's objects: a message (chat) or a response string (generate)."""

    def __init__(self, generation: ChatGeneration, chat: bool, arrived: float) -> None:
        self.generation = generation
        self.chat = chat
        self.arrived = arrived
        self.content = ""
        self.thinking = ""
        self.calls: list[dict[str, Any]] = []
        self._arguments: list[str] = []  # each call's arguments so far (the last one's may be unfinished)
        self._pending_name = ""

    def _object(self, content: str, thinking: str, calls: list[dict[str, Any]] | None, done: bool) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.generation.model, "created_at": _now()}
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = calls
            out["message"] = message
        else:
            out["response"] = content
            if thinking:
                out["thinking"] = thinking
        out["done"] = done
        return out

    def _close_call(self) -> list[dict[str, Any]]:
        if len(self._arguments) == len(self.calls) or not self._arguments:
            return []
        arguments = arguments_object(self._arguments[-1])
        call = {"function": {"name": self._pending_name, "arguments": arguments if arguments is not None else {}}}
        self.calls.append(call)
        return [call]

    def add(self, parts: list[Part]) -> list[dict[str, Any]]:
        """The objects these parts make (streaming: text as it comes, a tool call once whole)."""
        content = thinking = ""
        calls: list[dict[str, Any]] = []
        for part in parts:
            if isinstance(part, Reasoning):
                thinking += part.text
            elif isinstance(part, Content):
                calls += self._close_call()
                content += part.text
            elif isinstance(part, CallStart):
                calls += self._close_call()
                self._pending_name = part.name
                self._arguments.append("")
            else:
                assert isinstance(part, Arguments)
                self._arguments[-1] += part.fragment
        if self.generation.finished:
            calls += self._close_call()
        self.content += content
        self.thinking += thinking
        return [self._object(content, thinking, calls, False)] if content or thinking or calls else []

    def final(self, stream: bool) -> dict[str, Any]:
        usage = self.generation.usage
        ttft_s = usage.get("ttft_ms", 0.0) / 1000.0
        completion = usage.get("completion_tokens", 0)
        rate = usage.get("decode_tokens_per_s") or 0.0
        if stream:
            out = self._object("", "", None, True)
        else:
            out = self._object(self.content, self.thinking, self.calls, True)
        out["done_reason"] = _DONE_REASONS.get(self.generation.finish_reason or "stop", "stop")
        out["total_duration"] = int((time.monotonic() - self.arrived) * 1e9)
        out["load_duration"] = 0
        out["prompt_eval_count"] = usage.get("prompt_tokens", 0)
        out["prompt_eval_duration"] = int(ttft_s * 1e9)
        out["eval_count"] = completion
        out["eval_duration"] = int(completion / rate * 1e9) if rate > 0 else 0
        if "native_mtp" in usage:
            out["native_mtp"] = usage["native_mtp"]
        return out


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


async def _run(request: web.Request, generation: ChatGeneration, answer: _Answer, stream: bool) -> web.StreamResponse:
    async with generation:
        if not stream:
            answer.add(await generation.whole())
            return web.json_response(answer.final(stream=False))
        first = await generation.first()  # an error before the first token is a plain HTTP error
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson", "Cache-Control": "no-cache"})
        await response.prepare(request)
        try:
            await response.write(b"".join(_line(o) for o in answer.add(first)))
            while not generation.finished:
                lines = b"".join(_line(o) for o in answer.add(await generation.next()))
                if lines:
                    await response.write(lines)
            await response.write(_line(answer.final(stream=True)))
        except ConnectionError:
            return response
        except Exception as e:  # noqa: BLE001 - headers are sent: Ollama's error line ends the stream
            err = api_error_from(e)
            request.app[METRICS].errors.labels(err.code or str(err.status)).inc()
            return await end_stream(response, _line({"error": err.message}))
        return await end_stream(response)


async def chat(request: web.Request) -> web.StreamResponse:
    arrived = time.monotonic()
    req = validate(ChatRequest, await read_json(request))
    if not req.messages:
        return await _loaded(request, req.model, arrived, chat=True)
    body: dict[str, Any] = {"model": req.model, "messages": chat_messages(req)}
    tools = _tools(req.tools)
    if tools:
        body["tools"] = tools
    fmt = _format(req.format)
    if fmt is not None:
        body["response_format"] = fmt
    _think(req.think, body)
    budget = _options(req.options, body)
    generation = ChatGeneration(request, body, arrived, budget=budget if budget is not None else _FILL)
    return await _run(request, generation, _Answer(generation, chat=True, arrived=arrived), req.stream)


async def generate(request: web.Request) -> web.StreamResponse:
    arrived = time.monotonic()
    req = validate(GenerateRequest, await read_json(request))
    if req.images:
        raise unsupported("images", "images are not supported: exo's models read text only")
    if req.suffix:
        raise unsupported("suffix", "suffix (fill in the middle) is not supported by exo")
    if not req.prompt:
        return await _loaded(request, req.model, arrived, chat=False)
    body: dict[str, Any] = {"model": req.model}
    budget = _options(req.options, body)
    budget = budget if budget is not None else _FILL
    if req.raw:
        if req.format:
            raise unsupported("format", "format is not supported with raw: true")
        prepared = prepare_completion({**body, "prompt": req.prompt})
        generation = ChatGeneration(request, {}, arrived, budget=budget, prepared=prepared)
    else:
        messages = ([{"role": "system", "content": req.system}] if req.system else []) + [
            {"role": "user", "content": req.prompt}
        ]
        body["messages"] = messages
        fmt = _format(req.format)
        if fmt is not None:
            body["response_format"] = fmt
        _think(req.think, body)
        generation = ChatGeneration(request, body, arrived, budget=budget)
    return await _run(request, generation, _Answer(generation, chat=False, arrived=arrived), req.stream)


_FILL = 1 << 30  # no num_predict (or -1, -2): until the end of sequence or the context is full


async def _loaded(request: web.Request, model: str, arrived: float, *, chat: bool) -> web.Response:
    """An empty prompt: Ollama loads the model and answers at once (``done_reason: "load"``)."""
    service, config = request.app[SERVICE], request.app[CONFIG]
    model_id = await service.acquire(model, config.load_timeout_s)
    out: dict[str, Any] = {"model": model_id, "created_at": _now()}
    if chat:
        out["message"] = {"role": "assistant", "content": ""}
    else:
        out["response"] = ""
    return web.json_response({**out, "done": True, "done_reason": "load"})

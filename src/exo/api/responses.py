"""The OpenAI Responses API: ``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}``.

A translation layer over chat completions' generation path (``completions.ChatGeneration``): ``input``
(a string, or items: messages of any role, ``function_call``, ``function_call_output``, ``reasoning``)
and ``instructions`` become chat messages (system and developer ones joined at the start), function
tools and ``tool_choice`` the chat's, ``text.format`` its ``response_format``, ``max_output_tokens`` a
budget bounded by the context. Tool types exo cannot run (``web_search``, ``custom``, ...) are accepted
and never called. The answer's parts become output items (``reasoning``, ``message``,
``function_call``) or the Responses event stream. ``store`` (the default, as OpenAI's) keeps the
response and its conversation under ``EXO_HOME/responses`` (bounded: the oldest go first), for
``previous_response_id`` and GET / DELETE. Errors are OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from .completions import ChatGeneration, Part, Reasoning, cached_tokens
from .config import METRICS
from .dialects import arguments_object, end_stream, hoist_system, invalid, relay, unsupported
from .errors import APIError, api_error_from
from .parsing import read_json, validate
from .tools import Arguments, CallStart, Content

_LENIENT = ConfigDict(extra="ignore", strict=True)
MAX_STORED_RESPONSES = 1000
MAX_STORED_BYTES = 256 << 20
_ID = re.compile(r"^resp_[0-9a-f]{32}$")
KEEPALIVE_S = 10.0  # response.in_progress this often while the prompt is read (before the first token)


class _TextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class _Text(BaseModel):
    model_config = _LENIENT

    format: _TextFormat | None = None


class _Reasoning(BaseModel):
    model_config = _LENIENT

    effort: str | None = None


class ResponsesRequest(BaseModel):
    model_config = _LENIENT

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    text: _Text | None = None
    reasoning: _Reasoning | None = None
    include: list[str] | None = None
    prompt_cache_key: Any = None  # any value: a hint, never an error (schemas.prompt_cache_key_text)
    store: bool | None = None
    previous_response_id: str | None = None
    stream: bool | None = None
    metadata: dict[str, str] | None = None
    background: bool | None = None
    user: str | None = None


# -- the store ---------------------------------------------------------------------------------------------


class ResponseStore:
    """Stored responses, one JSON file each (the response and the conversation it ends), bounded in count and
    bytes: the least recently written go first."""

    def __init__(self, directory: Path, max_count: int = MAX_STORED_RESPONSES, max_bytes: int = MAX_STORED_BYTES):
        self.directory = directory
        self.max_count = max_count
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._last_ns = 0  # each write gets a later mtime than the one before (coarse clocks tie)

    def _path(self, response_id: str) -> Path | None:
        return self.directory / f"{response_id}.json" if _ID.match(response_id) else None

    def put(self, response_id: str, record: dict[str, Any]) -> None:
        path = self._path(response_id)
        assert path is not None
        data = json.dumps(record, ensure_ascii=False).encode()
        with self._lock:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(data)
            self._last_ns = max(time.time_ns(), self._last_ns + 1)
            os.utime(tmp, ns=(self._last_ns, self._last_ns))
            os.replace(tmp, path)
            self._evict()

    def _evict(self) -> None:
        entries = []
        for f in self.directory.glob("resp_*.json"):
            try:
                st = f.stat()
            except FileNotFoundError:
                continue
            entries.append((st.st_mtime_ns, f.name, st.st_size, f))
        entries.sort()
        count, size = len(entries), sum(e[2] for e in entries)
        for _, _, bytes_, f in entries:
            if count <= self.max_count and size <= self.max_bytes:
                break
            f.unlink(missing_ok=True)
            count, size = count - 1, size - bytes_

    def get(self, response_id: str) -> dict[str, Any] | None:
        path = self._path(response_id)
        try:
            return json.loads(path.read_bytes()) if path is not None else None
        except (FileNotFoundError, ValueError):
            return None

    def delete(self, response_id: str) -> bool:
        path = self._path(response_id)
        with self._lock:
            if path is None or not path.exists():
                return False
            path.unlink(missing_ok=True)
            return True


STORE = web.AppKey("responses_store", ResponseStore)


def add_routes(app: web.Application, home: Path) -> None:
    app[STORE] = ResponseStore(Path(home) / "responses")
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses/{id}", get_response)
    app.router.add_delete("/v1/responses/{id}", delete_response)


# -- request -> chat body ----------------------------------------------------------------------------------


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(where, f"{where}: a string or a list of content parts", "invalid_type")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            text = part.get("text")
            if not isinstance(text, str):
                raise invalid(f"{where}.{j}.text", f"{where}.{j}.text: a string is required", "invalid_type")
            texts.append(text)
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif kind in ("input_image", "input_file", "input_audio"):
            raise unsupported(f"{where}.{j}.type", f"{where}.{j}: {kind} is not supported: exo's models read text only")
        else:
            raise invalid(f"{where}.{j}.type", f"{where}.{j}: unknown content part type {kind!r}")
    return "\n".join(texts)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``input`` as chat messages (function calls joined to the assistant message before them)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input.{i}"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise invalid(f"{where}.role", f"{where}.role: one of user, assistant, system, developer")
            out.append({"role": role, "content": _content_text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
            if not all(isinstance(v, str) for v in (call_id, name, arguments)):
                raise invalid(where, f"{where}: a function_call needs string call_id, name and arguments")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise invalid(f"{where}.call_id", f"{where}.call_id: a string is required", "invalid_type")
            output = item.get("output", "")
            out.append({"role": "tool", "tool_call_id": call_id, "content": _content_text(output, f"{where}.output")})
        elif kind == "reasoning":
            continue  # earlier reasoning: the chat templates leave it out of the prompt
        else:
            raise unsupported(f"{where}.type", f"{where}: input items of type {kind!r} are not supported by exo")
    return out


def chat_body(req: ResponsesRequest, conversation: list[dict[str, Any]]) -> dict[str, Any]:
    head = [{"role": "system", "content": req.instructions}] if req.instructions else []
    body: dict[str, Any] = {"model": req.model, "messages": hoist_system(head + conversation)}
    tools = []
    for i, tool in enumerate(req.tools or []):
        if tool.get("type") != "function":
            continue  # hosted or custom tools (web_search, ...): exo cannot run them, so never calls them
        name = tool.get("name")
        if not isinstance(name, str):
            raise invalid(f"tools.{i}.name", f"tools.{i}.name: a string is required", "missing_required_parameter")
        function: dict[str, Any] = {"name": name}
        for key in ("description", "parameters", "strict"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        tools.append({"type": "function", "function": function})
    choice = req.tool_choice
    if tools and choice != "none":
        body["tools"] = tools
        if choice in ("auto", "required"):
            body["tool_choice"] = choice
        elif isinstance(choice, dict) and choice.get("type") == "function":
            body["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
        elif choice is not None:
            raise unsupported("tool_choice", f"tool_choice {choice!r} is not supported: auto, none, required or a function")
        if req.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = req.parallel_tool_calls
    elif choice == "required" or isinstance(choice, dict):
        raise invalid("tool_choice", "tool_choice asks for a call but tools lists no function")
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        spec: dict[str, Any] = {"name": fmt.name or "output"}
        for key, value in (("schema", fmt.schema_), ("description", fmt.description), ("strict", fmt.strict)):
            if value is not None:
                spec[key] = value
        body["response_format"] = {"type": "json_schema", "json_schema": spec}
    if req.reasoning is not None and req.reasoning.effort == "none":
        body["chat_template_kwargs"] = {"enable_thinking": False}
    for key in ("temperature", "top_p", "prompt_cache_key"):  # the key: the chat's prefix-cache hint
        if getattr(req, key) is not None:
            body[key] = getattr(req, key)
    return body


# -- handlers ----------------------------------------------------------------------------------------------


async def create_response(request: web.Request) -> web.StreamResponse:
    arrived = time.monotonic()
    req = validate(ResponsesRequest, await read_json(request))
    if req.background:
        raise unsupported("background", "background responses are not supported by exo")
    store = request.app[STORE]
    conversation: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        previous = await asyncio.to_thread(store.get, req.previous_response_id)
        if previous is None:
            raise APIError(404, f"no stored response {req.previous_response_id!r} (store it with store: true)",
                           param="previous_response_id", code="previous_response_not_found")
        conversation = previous["conversation"]
    conversation = conversation + input_messages(req.input)
    generation = ChatGeneration(request, chat_body(req, conversation), arrived, budget=req.max_output_tokens)
    async with generation:
        answer = _Answer(generation, req)
        if req.stream:
            return await _stream(request, generation, answer, conversation)
        for part in await generation.whole():
            answer.add(part)
        answer.finish()
        response = answer.response("completed")
        await _store(request, req, response, answer, conversation)
        return web.json_response(response)


async def _store(
    request: web.Request, req: ResponsesRequest, response: dict[str, Any], answer: _Answer,
    conversation: list[dict[str, Any]],
) -> None:
    if req.store is False:
        return
    record = {"response": response, "conversation": [*conversation, answer.chat_message()]}
    await asyncio.to_thread(request.app[STORE].put, response["id"], record)


async def get_response(request: web.Request) -> web.Response:
    record = await asyncio.to_thread(request.app[STORE].get, request.match_info["id"])
    if record is None:
        raise APIError(404, f"no stored response {request.match_info['id']!r}", param="id", code="not_found")
    return web.json_response(record["response"])


async def delete_response(request: web.Request) -> web.Response:
    response_id = request.match_info["id"]
    if not await asyncio.to_thread(request.app[STORE].delete, response_id):
        raise APIError(404, f"no stored response {response_id!r}", param="id", code="not_found")
    return web.json_response({"id": response_id, "object": "response", "deleted": True})


# -- answer -> output items / events -----------------------------------------------------------------------


class _Answer:
    """The output items of one answer, built from the chat parts; ``add`` returns the stream's events."""

    def __init__(self, generation: ChatGeneration, req: ResponsesRequest) -> None:
        self.generation = generation
        self.req = req
        self.id = "resp_" + uuid.uuid4().hex
        self.created_at = int(time.time())
        self.items: list[dict[str, Any]] = []
        self.open: str | None = None  # the last item's type while it is open
        self.sequence = 0

    def _event(self, kind: str, **data: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n".encode()

    def response(self, status: str) -> dict[str, Any]:
        req, usage = self.req, self.generation.usage
        incomplete = status == "completed" and self.generation.finish_reason == "length"
        fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else {"type": "text"}
        out: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": "incomplete" if incomplete else status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.generation.model,
            "output": self.items if status != "in_progress" else [],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
            "store": req.store is not False,
            "temperature": req.temperature if req.temperature is not None else 1.0,
            "text": {"format": fmt},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": req.tools or [],
            "top_p": req.top_p if req.top_p is not None else 1.0,
            "truncation": "disabled",
            "usage": None,
            "user": req.user,
            "metadata": req.metadata or {},
        }
        if usage:
            cached = cached_tokens(usage)
            out["usage"] = {
                "input_tokens": usage["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": self.generation.reasoning_tokens},
                "total_tokens": usage["total_tokens"],
                "native_mtp": usage.get("native_mtp"),
            }
        return out

    def _close(self) -> bytes:
        if self.open is None:
            return b""
        item, index = self.items[-1], len(self.items) - 1
        self.open = None
        item["status"] = "incomplete" if self.generation.finish_reason == "length" else "completed"
        out = b""
        if item["type"] == "message":
            part = item["content"][0]
            out += self._event("response.output_text.done", item_id=item["id"], output_index=index,
                               content_index=0, text=part["text"], logprobs=[])
            out += self._event("response.content_part.done", item_id=item["id"], output_index=index,
                               content_index=0, part=part)
        elif item["type"] == "reasoning":
            part = item["content"][0]
            del item["status"]
            out += self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                               content_index=0, text=part["text"])
            out += self._event("response.content_part.done", item_id=item["id"], output_index=index,
                               content_index=0, part=part)
        else:
            out += self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                               name=item["name"], arguments=item["arguments"])
        return out + self._event("response.output_item.done", output_index=index, item=item)

    def _start(self, item: dict[str, Any], part: dict[str, Any] | None) -> bytes:
        out = self._close()
        self.items.append(item)
        self.open = item["type"]
        index = len(self.items) - 1
        added = {**item, "content": []} if part is not None else dict(item)
        out += self._event("response.output_item.added", output_index=index, item=added)
        if part is not None:
            item["content"] = [part]
            out += self._event("response.content_part.added", item_id=item["id"], output_index=index,
                               content_index=0, part=dict(part))
        return out

    def add(self, part: Part) -> bytes:
        index = len(self.items) - 1
        if isinstance(part, Reasoning):
            out = b""
            if self.open != "reasoning":
                item = {"type": "reasoning", "id": "rs_" + uuid.uuid4().hex[:24], "summary": [], "status": "in_progress"}
                out = self._start(item, {"type": "reasoning_text", "text": ""})
                index += 1
            self.items[-1]["content"][0]["text"] += part.text
            return out + self._event("response.reasoning_text.delta", item_id=self.items[-1]["id"],
                                     output_index=index, content_index=0, delta=part.text)
        if isinstance(part, Content):
            out = b""
            if self.open != "message":
                item = {"type": "message", "id": "msg_" + uuid.uuid4().hex[:24], "status": "in_progress",
                        "role": "assistant"}
                out = self._start(item, {"type": "output_text", "text": "", "annotations": [], "logprobs": []})
                index += 1
            self.items[-1]["content"][0]["text"] += part.text
            return out + self._event("response.output_text.delta", item_id=self.items[-1]["id"], output_index=index,
                                     content_index=0, delta=part.text, logprobs=[])
        if isinstance(part, CallStart):
            item = {"type": "function_call", "id": "fc_" + uuid.uuid4().hex[:24], "call_id": part.id,
                    "name": part.name, "arguments": "", "status": "in_progress"}
            return self._start(item, None)
        assert isinstance(part, Arguments)
        self.items[-1]["arguments"] += part.fragment
        return self._event("response.function_call_arguments.delta", item_id=self.items[-1]["id"],
                           output_index=index, delta=part.fragment)

    def finish(self) -> bytes:
        return self._close()

    def chat_message(self) -> dict[str, Any]:
        """The answer as the assistant message a later turn (previous_response_id) continues from."""
        text = "".join(c["text"] for item in self.items if item["type"] == "message" for c in item["content"])
        message: dict[str, Any] = {"role": "assistant", "content": text}
        calls = [
            {"id": item["call_id"], "type": "function", "function": {
                "name": item["name"],
                # A model's broken arguments would make the continued conversation invalid: {} instead.
                "arguments": item["arguments"] if arguments_object(item["arguments"]) is not None else "{}",
            }}
            for item in self.items if item["type"] == "function_call"
        ]
        if calls:
            message["tool_calls"] = calls
        return message


async def _stream(
    request: web.Request, generation: ChatGeneration, answer: _Answer, conversation: list[dict[str, Any]]
) -> web.StreamResponse:
    # The prompt passed validation (errors so far were plain HTTP errors): the stream opens now and repeats
    # response.in_progress while the prompt is read (Codex gives up on a stream silent for 5 minutes); a
    # failure from here on is an error event and response.failed.
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
    await response.prepare(request)
    try:
        opening = answer._event("response.created", response=answer.response("in_progress"))
        opening += answer._event("response.in_progress", response=answer.response("in_progress"))
        await response.write(opening)

        async def in_progress() -> None:
            await response.write(answer._event("response.in_progress", response=answer.response("in_progress")))

        await relay(response, generation, answer.add, in_progress, KEEPALIVE_S)
        done = answer.finish()
        final = answer.response("completed")
        await _store(request, answer.req, final, answer, conversation)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        await response.write(done + answer._event(kind, response=final))
    except ConnectionError:  # the client went away between our writes
        return response
    except Exception as e:  # noqa: BLE001 - headers are sent: an error event, then response.failed
        err = api_error_from(e)
        request.app[METRICS].errors.labels(err.code or str(err.status)).inc()
        failed = answer.response("failed")
        failed["error"] = {"code": err.code or "server_error", "message": err.message}
        return await end_stream(
            response,
            answer._event("error", code=err.code, message=err.message, param=err.param)
            + answer._event("response.failed", response=failed),
        )
    return await end_stream(response)

"""``POST /v1/chat/completions`` and ``POST /v1/completions``: parse, generate, answer or stream.

The handler validates on the event loop, then hands the prompt to the ``ModelService`` and waits for
the generation's first output: errors found before any token (validation, context length, a full queue,
a pipeline stage or node lost during prefill: 503) are plain HTTP errors, also for ``stream: true``,
whose headers go out with the first token's chunk. Then it relays chunks: one JSON body, or server-sent
events written as they arrive (all chunks already delivered go out in one write). A client that goes
away cancels the handler (aiohttp ``handler_cancellation``), which cancels the generation at its next
decode step; an error after the headers went out is sent as an error event before ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from exo.cluster.service import BatchedStream, GenerateParams, Prompt, Started
from exo.engine import GenerationChunk, SamplingParams
from exo.engine.constraints import ConstraintSpec
from exo.engine.request import TokenLogprob

from .config import CONFIG, METRICS, SERVICE
from .errors import APIError, api_error_from
from .parsing import read_json, validate
from .reasoning import ReasoningSplitter, split_whole
from .schemas import ChatCompletionRequest, CompletionRequest, GenerationFields, reject_unsupported
from .tools import (
    END,
    Arguments,
    CallStart,
    Content,
    Event,
    ToolCallParser,
    chat_messages,
    constraint_for,
    logprobs_for,
    parses_tool_calls,
    tool_choice,
    tool_definitions,
)

DEFAULT_CHAT_MAX_TOKENS = 4096  # chat: until EOS, at most this (and what is left of the context)
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def _sampling(req: GenerationFields) -> SamplingParams:
    def value(v: Any, default: Any) -> Any:
        return default if v is None else v

    return SamplingParams(
        temperature=float(value(req.temperature, 1.0)),
        top_p=float(value(req.top_p, 1.0)),
        top_k=value(req.top_k, 0),
        min_p=float(value(req.min_p, 0.0)),
        seed=req.seed,
        repetition_penalty=req.repetition_penalty,
        presence_penalty=float(value(req.presence_penalty, 0.0)),
        frequency_penalty=float(value(req.frequency_penalty, 0.0)),
    )


def _params(
    req: GenerationFields,
    max_tokens: int | None,
    default_max_tokens: int,
    *,
    constraint: ConstraintSpec | None = None,
    logprobs: int | None = None,
) -> GenerateParams:
    req.check_combinations()
    if req.ignore_eos and constraint is not None:
        raise APIError(400, "ignore_eos cannot be combined with a constrained output (a required or named "
                       "tool_choice, response_format): the constraint decides where the output ends",
                       param="ignore_eos", code="invalid_value")
    mtp = req.native_mtp
    mode = "off" if mtp is not None and mtp.enabled is False else "auto"
    return GenerateParams(
        max_tokens=max_tokens,
        default_max_tokens=default_max_tokens,
        sampling=_sampling(req),
        stop=tuple(req.stop_list()),
        native_mtp=mode,
        mtp_k=mtp.k if mtp is not None else None,
        constraint=constraint,
        logprobs=logprobs,
        ignore_eos=bool(req.ignore_eos),
        prompt_cache_key=req.prompt_cache_key_text(),
    )


def prepare_chat(body: dict[str, Any]) -> tuple[ChatCompletionRequest, Prompt, GenerateParams, _Writer]:
    """A chat completions body (as sent, or as a dialect translated it) -> what ``_generate`` runs."""
    req = validate(ChatCompletionRequest, reject_unsupported(body, "chat"))
    tools = tool_definitions(req)
    prompt = Prompt(messages=chat_messages(req), template_kwargs=dict(req.chat_template_kwargs or {}), tools=tools)
    params = _params(
        req, req.completion_budget(), DEFAULT_CHAT_MAX_TOKENS, constraint=constraint_for(req), logprobs=logprobs_for(req)
    )
    if parses_tool_calls(req) and tool_choice(req) == "auto" and req.parallel_tool_calls is False:
        # At most one call: the generation ends with the first call's closing tag (kept out of the text; the
        # parser closes the call without it).
        params = dataclasses.replace(params, stop=(*params.stop, END))
    writer = _Writer(chat=True, tools=tools if parses_tool_calls(req) else None, logprobs=params.logprobs is not None)
    return req, prompt, params, writer


async def chat_completions(request: web.Request) -> web.StreamResponse:
    arrived = time.monotonic()
    req, prompt, params, writer = prepare_chat(await read_json(request))
    return await _generate(request, req, prompt, params, arrived, writer)


def prepare_completion(body: dict[str, Any]) -> tuple[CompletionRequest, Prompt, GenerateParams, _Writer]:
    req = validate(CompletionRequest, reject_unsupported(body, "completions"))
    value = req.prompt_value()
    prompt = Prompt(text=value) if isinstance(value, str) else Prompt(token_ids=list(value))
    params = _params(req, req.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS, logprobs=req.logprobs)
    writer = _Writer(chat=False, logprobs=req.logprobs is not None)
    return req, prompt, params, writer


async def completions(request: web.Request) -> web.StreamResponse:
    arrived = time.monotonic()
    req, prompt, params, writer = prepare_completion(await read_json(request))
    return await _generate(request, req, prompt, params, arrived, writer)


# -- generation -----------------------------------------------------------------------------------------


def _usage(stats: Any, started: Started) -> dict[str, Any]:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},  # OpenAI's field: the prefix cache's hit
        "native_mtp": stats.model_dump(mode="json"),
        "ttft_ms": stats.ttft_ms,
        "decode_tokens_per_s": stats.decode_tokens_per_s,
        "queue_ms": round(started.queue_s * 1000.0, 3),
    }


async def _open(
    request: web.Request, req: GenerationFields, prompt: Prompt, params: GenerateParams, arrived: float
) -> tuple[BatchedStream, str]:
    """The model acquired and the generation queued (the caller cancels the stream unless it finished)."""
    service, config = request.app[SERVICE], request.app[CONFIG]
    remaining = arrived + config.request_timeout_s - time.monotonic()
    model_id = await service.acquire(req.model, min(config.load_timeout_s, remaining))
    stream = service.generate(model_id, prompt, params, timeout_s=config.request_timeout_s, arrived=arrived)
    return stream, model_id


async def _generate(
    request: web.Request,
    req: GenerationFields,
    prompt: Prompt,
    params: GenerateParams,
    arrived: float,
    writer: _Writer,
) -> web.StreamResponse:
    stream, model_id = await _open(request, req, prompt, params, arrived)
    try:
        started = await stream.start()  # errors before any output (validation, context) are plain 4xx
        writer.model = model_id
        writer.started(started)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return await _stream(request, stream, writer, started, include_usage)
        chunks: list[GenerationChunk] = []
        while not stream.finished:
            chunks.extend(await stream.next_batch())
        return web.json_response(writer.whole(chunks, started))
    finally:
        if not stream.finished:
            stream.cancel()  # client gone (handler cancelled), timeout, or an error: free the device


async def _first_token(stream: BatchedStream) -> list[GenerationChunk]:
    """The chunks up to the first token (or the end). Headers wait for it: a failure before it (a stage lost
    during prefill, a timeout) is a plain HTTP error, raised to the error middleware, never a 200 with
    nothing in it."""
    first = await stream.next_batch()
    while not stream.finished and not any(c.token_ids for c in first):
        first += await stream.next_batch()  # a timeout before any token: its empty chunk, then the error
    return first


async def _stream(
    request: web.Request, stream: BatchedStream, writer: _Writer, started: Started, include_usage: bool
) -> web.StreamResponse:
    writer.include_usage = include_usage
    first = await _first_token(stream)
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
    await response.prepare(request)
    try:
        events = writer.opening() + b"".join(writer.events(chunk, started) for chunk in first)
        await response.write(events)
        while not stream.finished:
            chunks = await stream.next_batch()
            events = b"".join(writer.events(chunk, started) for chunk in chunks)
            if events:
                await response.write(events)
    except ConnectionError:  # the client went away between our writes
        stream.cancel()
        return response
    except Exception as e:  # noqa: BLE001 - headers are sent: report it in the stream, then end it
        err = api_error_from(e)
        request.app[METRICS].errors.labels(err.code or str(err.status)).inc()
        try:
            await response.write(_sse(err.body()))
        except ConnectionError:
            return response
    try:
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionError:
        pass
    return response


@dataclasses.dataclass(frozen=True)
class Reasoning:
    text: str


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def _logprob_value(value: float) -> float:
    return max(value, -9999.0)


def _token_text(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


class _Writer:
    """OpenAI response shapes for one generation (chat or text completion).

    ``tools``: the answer's text is searched for tool calls (``api/tools.py``), which become
    ``tool_calls`` (streamed as OpenAI's deltas); ``logprobs``: the chunks' token log-probabilities are
    reported (chat: ``logprobs.content``; completions: the legacy tokens / token_logprobs shape)."""

    def __init__(self, *, chat: bool, tools: list[dict[str, Any]] | None = None, logprobs: bool = False) -> None:
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.model = ""
        self.include_usage = False
        self.tools = tools
        self.logprobs = logprobs
        self.parser = ToolCallParser(tools) if tools is not None else None
        self.reasoning = ReasoningSplitter() if chat else None
        self.thinking = False
        self.text_offset = 0  # completions: where the next token's text starts

    def _base(self, obj: str) -> dict[str, Any]:
        base = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "system_fingerprint": None}
        if self.include_usage:
            base["usage"] = None
        return base

    def _chunk(self, delta: dict[str, Any], finish: str | None, logprobs: Any = None) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            return {**self._base("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": delta.get("content") or "", "logprobs": logprobs, "finish_reason": finish}
        return {**self._base("text_completion"), "choices": [choice]}

    def started(self, started: Started) -> None:
        """The generation began: a prompt that opened a think block makes the output start with reasoning."""
        self.thinking = started.thinking
        if self.chat:
            self.reasoning = ReasoningSplitter(opened=started.thinking)

    def opening(self) -> bytes:
        return _sse(self._chunk({"role": "assistant", "content": ""}, None)) if self.chat else b""

    # -- logprobs ----------------------------------------------------------------------------------------
    def _chat_logprobs(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        content = [
            {
                "token": _token_text(e.bytes),
                "logprob": _logprob_value(e.logprob),
                "bytes": list(e.bytes),
                "top_logprobs": [
                    {"token": _token_text(t.bytes), "logprob": _logprob_value(t.logprob), "bytes": list(t.bytes)}
                    for t in e.top
                ],
            }
            for e in entries
        ]
        return {"content": content, "refusal": None}

    def _completion_logprobs(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        tokens, offsets = [], []
        for e in entries:
            text = _token_text(e.bytes)
            tokens.append(text)
            offsets.append(self.text_offset)
            self.text_offset += len(text)
        top = [{_token_text(t.bytes): _logprob_value(t.logprob) for t in e.top} for e in entries]
        return {
            "tokens": tokens,
            "token_logprobs": [_logprob_value(e.logprob) for e in entries],
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def _logprobs(self, entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        entries = entries or []
        return self._chat_logprobs(entries) if self.chat else self._completion_logprobs(entries)

    # -- tool calls --------------------------------------------------------------------------------------
    def _events(self, text: str, final: bool) -> list[Event | Reasoning]:
        out: list[Event | Reasoning] = []
        if self.reasoning is not None:
            thought, text = self.reasoning.feed(text) if text else ("", "")
            if final:
                more = self.reasoning.finish()
                thought, text = thought + more[0], text + more[1]
            if thought:
                out.append(Reasoning(thought))
        if self.parser is None:
            return out + ([Content(text)] if text else [])
        out += self.parser.feed(text) if text else []
        return out + self.parser.finish() if final else out

    @staticmethod
    def _delta(event: Event | Reasoning) -> dict[str, Any]:
        if isinstance(event, Reasoning):
            return {"reasoning_content": event.text}
        if isinstance(event, Content):
            return {"content": event.text}
        if isinstance(event, CallStart):
            call = {"index": event.index, "id": event.id, "type": "function",
                    "function": {"name": event.name, "arguments": ""}}
            return {"tool_calls": [call]}
        assert isinstance(event, Arguments)
        return {"tool_calls": [{"index": event.index, "function": {"arguments": event.fragment}}]}

    def _finish_reason(self, finish: str) -> str:
        if finish == "stop" and self.parser is not None and self.parser.calls:
            return "tool_calls"
        return finish

    # -- streaming and whole answers -----------------------------------------------------------------------
    def events(self, chunk: GenerationChunk, started: Started) -> bytes:
        out = b""
        final = chunk.finish_reason is not None
        logprobs = self._logprobs(chunk.logprobs) if (chunk.logprobs or (final and self.logprobs)) else None
        for event in self._events(chunk.text, final):
            out += _sse(self._chunk(self._delta(event), None, logprobs))
            logprobs = None
        if logprobs is not None and (logprobs.get("content") or logprobs.get("tokens")):
            out += _sse(self._chunk({}, None, logprobs))
        if final:
            assert chunk.finish_reason is not None
            final_chunk = self._chunk({} if self.chat else {"content": ""}, self._finish_reason(chunk.finish_reason))
            final_chunk["native_mtp"] = chunk.stats.model_dump(mode="json") if chunk.stats else None
            out += _sse(final_chunk)
            if self.include_usage and chunk.stats is not None:
                usage_chunk = {**self._base("chat.completion.chunk" if self.chat else "text_completion"), "choices": []}
                usage_chunk["usage"] = _usage(chunk.stats, started)
                out += _sse(usage_chunk)
        return out

    def whole(self, chunks: list[GenerationChunk], started: Started) -> dict[str, Any]:
        text = "".join(c.text for c in chunks)
        last = chunks[-1]
        assert last.finish_reason is not None and last.stats is not None
        entries = [e for c in chunks for e in (c.logprobs or [])]
        logprobs = self._logprobs(entries)
        if self.chat:
            thought, text = split_whole(text, opened=self.thinking)
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if thought:
                message["reasoning_content"] = thought
            if self.parser is not None:
                events = self.parser.feed(text) + self.parser.finish()
                content = "".join(e.text for e in events if isinstance(e, Content))
                message["content"] = content if content or not self.parser.calls else None
                if self.parser.calls:
                    message["tool_calls"] = [
                        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                        for c in self.parser.calls
                    ]
            choice = {
                "index": 0,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": self._finish_reason(last.finish_reason),
            }
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": last.finish_reason}
            obj = "text_completion"
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": [choice],
            "usage": _usage(last.stats, started),
        }


# -- the one chat path, for the other dialects ---------------------------------------------------------------

Part = Event | Reasoning  # what a chat answer is made of: reasoning, content, tool calls (start, arguments)


def cached_tokens(usage: dict[str, Any]) -> int:
    """Prompt tokens served from a prefix cache, as chat completions' usage reports them (0: none, or the
    node has no prefix cache)."""
    details = usage.get("prompt_tokens_details")
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    return value if isinstance(value, int) else 0


class ChatGeneration:
    """A chat generation opened for another dialect (Anthropic Messages, OpenAI Responses, Ollama): the
    dialect translates its request into a chat completions body, and its answer from the ``Part``s this
    yields, so tools, constraints, reasoning and native-MTP stats are handled once, here.

        async with ChatGeneration(request, body, arrived) as gen:   # errors before any output raise here
            parts = await gen.first()                                # up to the first token (headers wait)
            while not gen.finished:
                parts = await gen.next()
        gen.finish_reason, gen.usage                                 # once finished

    Leaving the block before the end (client gone, an error) cancels the generation. ``budget``: at most
    this many tokens, fewer when the context has less room (Anthropic's max_tokens is required, and Claude
    Code always asks for 32000); None: the body's max_tokens, as chat completions reads it."""

    def __init__(
        self,
        request: web.Request,
        body: dict[str, Any],
        arrived: float,
        *,
        budget: int | None = None,
        prepared: tuple[GenerationFields, Prompt, GenerateParams, _Writer] | None = None,
    ) -> None:
        self.request = request
        self.req, self.prompt, self.params, self.writer = prepared or prepare_chat(body)
        if budget is not None:
            self.params = dataclasses.replace(self.params, max_tokens=None, default_max_tokens=budget)
        self.arrived = arrived
        self.reasoning_tokens = 0  # output tokens generated inside the think block
        self.model = ""
        self.finish_reason: str | None = None  # stop | length | tool_calls
        self.stop_sequence: str | None = None  # the client's stop string that ended the answer, if one did
        self.usage: dict[str, Any] = {}  # chat completions' usage (prompt/completion tokens, native_mtp, ...)
        self.started: Started | None = None
        self._stream: BatchedStream | None = None

    @property
    def finished(self) -> bool:
        return self._stream is None or self._stream.finished

    async def __aenter__(self) -> ChatGeneration:
        self._stream, self.model = await _open(self.request, self.req, self.prompt, self.params, self.arrived)
        try:
            self.started = await self._stream.start()
        except BaseException:
            self._stream.cancel()
            raise
        self.writer.model = self.model
        self.writer.started(self.started)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._stream is not None and not self._stream.finished:
            self._stream.cancel()

    def _parts(self, chunks: list[GenerationChunk]) -> list[Part]:
        parts: list[Part] = []
        for chunk in chunks:
            final = chunk.finish_reason is not None
            splitter = self.writer.reasoning
            thinking = splitter is not None and splitter.thinking  # before this chunk
            events = self.writer._events(chunk.text, final)
            if (thinking or any(isinstance(e, Reasoning) for e in events)) and not any(
                isinstance(e, Content | CallStart) for e in events
            ):
                self.reasoning_tokens += len(chunk.token_ids)
            parts += events
            if final:
                assert self.started is not None
                self.finish_reason = self.writer._finish_reason(chunk.finish_reason or "stop")
                if self.finish_reason == "stop" and chunk.stop_sequence in self.req.stop_list():
                    self.stop_sequence = chunk.stop_sequence  # not exo's own (a single call's closing tag)
                if chunk.stats is not None:
                    self.usage = _usage(chunk.stats, self.started)
        return parts

    async def first(self) -> list[Part]:
        assert self._stream is not None
        return self._parts(await _first_token(self._stream))

    async def first_keeping_alive(self, keepalive: Callable[[], Awaitable[None]], every_s: float) -> list[Part]:
        """``first()``, calling ``keepalive`` every ``every_s`` meanwhile: a long prompt's prefill (minutes on
        a CPU for an agent's 15k-token prompt) must not look like a dead connection to a client that gives
        up on a silent stream (Claude Code and Codex retry after a few minutes)."""
        task = asyncio.ensure_future(self.first())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=every_s)
                if done:
                    return task.result()
                await keepalive()
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    async def next(self) -> list[Part]:
        assert self._stream is not None
        return self._parts(await self._stream.next_batch())

    async def whole(self) -> list[Part]:
        parts: list[Part] = []
        while not self.finished:
            parts += await self.next()
        return parts

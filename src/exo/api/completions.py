"""``POST /v1/chat/completions`` and ``POST /v1/completions``: parse, generate, answer or stream.

The handler validates on the event loop, then hands the prompt to the ``ModelService`` and waits for
the generation's first event: errors found before any output (validation, context length, a full
queue) are plain 4xx responses, also for ``stream: true``. Then it relays chunks: one JSON body, or
server-sent events written as they arrive (all chunks already delivered go out in one write). A client
that goes away cancels the handler (aiohttp ``handler_cancellation``), which cancels the generation at
its next decode step; an error after the headers went out is sent as an error event before
``data: [DONE]``.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from aiohttp import web

from exo.cluster.service import BatchedStream, GenerateParams, Prompt, Started
from exo.engine import GenerationChunk, SamplingParams

from .config import CONFIG, METRICS, SERVICE
from .errors import api_error_from
from .parsing import read_json, validate
from .schemas import ChatCompletionRequest, CompletionRequest, GenerationFields, reject_unsupported

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


def _params(req: GenerationFields, max_tokens: int | None, default_max_tokens: int) -> GenerateParams:
    req.check_combinations()
    mtp = req.native_mtp
    mode = "off" if mtp is not None and mtp.enabled is False else "auto"
    return GenerateParams(
        max_tokens=max_tokens,
        default_max_tokens=default_max_tokens,
        sampling=_sampling(req),
        stop=tuple(req.stop_list()),
        native_mtp=mode,
        mtp_k=mtp.k if mtp is not None else None,
    )


def _chat_messages(req: ChatCompletionRequest) -> list[dict[str, str]]:
    out = []
    for m in req.messages:
        content = m.content if isinstance(m.content, str) else "\n".join(p.text for p in m.content)
        role = "system" if m.role == "developer" else m.role  # chat templates know "system"
        out.append({"role": role, "content": content})
    return out


async def chat_completions(request: web.Request) -> web.StreamResponse:
    arrived = time.monotonic()
    req = validate(ChatCompletionRequest, reject_unsupported(await read_json(request), "chat"))
    prompt = Prompt(messages=_chat_messages(req), template_kwargs=dict(req.chat_template_kwargs or {}))
    params = _params(req, req.completion_budget(), DEFAULT_CHAT_MAX_TOKENS)
    return await _generate(request, req, prompt, params, arrived, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    arrived = time.monotonic()
    req = validate(CompletionRequest, reject_unsupported(await read_json(request), "completions"))
    value = req.prompt_value()
    prompt = Prompt(text=value) if isinstance(value, str) else Prompt(token_ids=list(value))
    params = _params(req, req.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS)
    return await _generate(request, req, prompt, params, arrived, chat=False)


# -- generation -----------------------------------------------------------------------------------------


def _usage(stats: Any, started: Started) -> dict[str, Any]:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
        "native_mtp": stats.model_dump(mode="json"),
        "ttft_ms": stats.ttft_ms,
        "decode_tokens_per_s": stats.decode_tokens_per_s,
        "queue_ms": round(started.queue_s * 1000.0, 3),
    }


async def _generate(
    request: web.Request,
    req: GenerationFields,
    prompt: Prompt,
    params: GenerateParams,
    arrived: float,
    *,
    chat: bool,
) -> web.StreamResponse:
    service, config = request.app[SERVICE], request.app[CONFIG]
    remaining = arrived + config.request_timeout_s - time.monotonic()
    model_id = await service.acquire(req.model, min(config.load_timeout_s, remaining))
    stream = service.generate(model_id, prompt, params, timeout_s=config.request_timeout_s, arrived=arrived)
    try:
        started = await stream.start()  # errors before any output (validation, context) are plain 4xx
        writer = _Writer(model_id, chat)
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


async def _stream(
    request: web.Request, stream: BatchedStream, writer: _Writer, started: Started, include_usage: bool
) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
    await response.prepare(request)
    writer.include_usage = include_usage
    try:
        await response.write(writer.opening())
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


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


class _Writer:
    """OpenAI response shapes for one generation (chat or text completion)."""

    def __init__(self, model: str, chat: bool) -> None:
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.model = model
        self.include_usage = False

    def _base(self, obj: str) -> dict[str, Any]:
        base = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "system_fingerprint": None}
        if self.include_usage:
            base["usage"] = None
        return base

    def _chunk(self, text: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {**self._base("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return {**self._base("text_completion"), "choices": [choice]}

    def opening(self) -> bytes:
        return _sse(self._chunk("", None, role=True)) if self.chat else b""

    def events(self, chunk: GenerationChunk, started: Started) -> bytes:
        out = b""
        if chunk.text:
            out += _sse(self._chunk(chunk.text, None))
        if chunk.finish_reason is not None:
            final = self._chunk(None if self.chat else "", chunk.finish_reason)
            final["native_mtp"] = chunk.stats.model_dump(mode="json") if chunk.stats else None
            out += _sse(final)
            if self.include_usage and chunk.stats is not None:
                usage_chunk = {**self._base("chat.completion.chunk" if self.chat else "text_completion"), "choices": []}
                usage_chunk["usage"] = _usage(chunk.stats, started)
                out += _sse(usage_chunk)
        return out

    def whole(self, chunks: list[GenerationChunk], started: Started) -> dict[str, Any]:
        text = "".join(c.text for c in chunks)
        last = chunks[-1]
        assert last.finish_reason is not None and last.stats is not None
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": last.finish_reason,
            }
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": last.finish_reason}
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

"""Engine values <-> the proto's generation messages (GenerateRequest, GenerateChunk, GenerateError).

Shared by the runner (which reads requests and builds chunks) and the API node (which builds requests and
turns chunks back into the engine's ``GenerationChunk``), so both ends agree on every field.
"""

from __future__ import annotations

import json
import math
import re
import uuid

from exo.engine import (
    ContextLengthError,
    DeviceMemoryError,
    GenerationChunk,
    GenerationRequestError,
    NativeMTPStats,
    SamplingParams,
)
from exo.engine.constraints import ConstraintSpec
from exo.engine.prompt import GenerateParams, Prompt, PromptError
from exo.engine.request import MTPSwitch, NativeMTPUnavailableError, TokenLogprob, TopLogprob
from exo.engine.sampling import SamplingParamsError

from .errors import NodeUnavailableError, QueueFullError, RequestTimeoutError
from .proto_gen import node_pb2 as pb

INT32_MAX = (1 << 31) - 1
_SURROGATE = re.compile("[\ud800-\udfff]")


def utf8_safe(text: str) -> str:
    """``text`` with any lone UTF-16 surrogate replaced by U+FFFD: protobuf strings are UTF-8, which cannot
    hold one (a JSON body may: ``"\\ud800"``), and encoding one raised UnicodeEncodeError (a 500)."""
    return _SURROGATE.sub("\ufffd", text)


def sampling_to_pb(params: SamplingParams) -> pb.SamplingParams:
    out = pb.SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=min(params.top_k, INT32_MAX),  # any top_k >= the vocabulary keeps every token
        min_p=params.min_p,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
    )
    if params.seed is not None:
        out.seed = params.seed
    if params.repetition_penalty is not None:
        out.repetition_penalty = params.repetition_penalty
    return out


def sampling_from_pb(msg: pb.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=msg.temperature,
        top_p=msg.top_p,
        top_k=msg.top_k,
        min_p=msg.min_p,
        seed=msg.seed if msg.HasField("seed") else None,
        repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else None,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
    )


def _logprob_to_pb(entry: TokenLogprob) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        token=entry.token,
        bytes=entry.bytes,
        logprob=entry.logprob,
        top=[pb.TopLogprob(token=t.token, bytes=t.bytes, logprob=t.logprob) for t in entry.top],
    )


def _logprob_from_pb(msg: pb.TokenLogprob) -> TokenLogprob:
    top = tuple(TopLogprob(t.token, t.bytes, t.logprob) for t in msg.top)
    return TokenLogprob(msg.token, msg.bytes, msg.logprob, top)


def chunk_to_pb(chunk: GenerationChunk) -> pb.GenerateChunk:
    return pb.GenerateChunk(
        text=utf8_safe(chunk.text),
        token_ids=chunk.token_ids,
        finish_reason=chunk.finish_reason or "",
        native_mtp_json=chunk.stats.model_dump_json() if chunk.stats is not None else "",
        logprobs=[_logprob_to_pb(e) for e in chunk.logprobs or ()],
        stop_sequence=utf8_safe(chunk.stop_sequence or ""),
    )


def chunk_from_pb(msg: pb.GenerateChunk) -> GenerationChunk:
    stats = NativeMTPStats.model_validate_json(msg.native_mtp_json) if msg.native_mtp_json else None
    logprobs = [_logprob_from_pb(e) for e in msg.logprobs] or None
    return GenerationChunk(
        msg.text, list(msg.token_ids), msg.finish_reason or None, stats, logprobs, msg.stop_sequence or None  # type: ignore[arg-type]
    )


def error_chunk(type: str, message: str, *, param: str = "", retry_after_s: float = 0.0) -> pb.GenerateChunk:
    return pb.GenerateChunk(
        error=pb.GenerateError(
            type=type, message=utf8_safe(message), param=utf8_safe(param), retry_after_s=retry_after_s
        )
    )


def error_to_pb(exc: BaseException) -> pb.GenerateChunk:
    """A generation's failure as the chunk the API node turns back into the same HTTP error."""
    message = str(exc.args[0]) if isinstance(exc, LookupError) and exc.args else str(exc)
    if isinstance(exc, ContextLengthError):
        return error_chunk("context_length_exceeded", message, param=exc.param or "")
    if isinstance(exc, PromptError):
        return error_chunk("prompt", message)
    if isinstance(exc, NativeMTPUnavailableError):
        return error_chunk("native_mtp_unavailable", message)
    if isinstance(exc, GenerationRequestError):
        return error_chunk("generation_request", message, param=getattr(exc, "param", "") or "")
    if isinstance(exc, SamplingParamsError):
        return error_chunk("sampling_params", message)
    if isinstance(exc, QueueFullError):
        return error_chunk("queue_full", message, retry_after_s=exc.retry_after_s)
    if isinstance(exc, RequestTimeoutError):
        return error_chunk("timeout", message)
    if isinstance(exc, NodeUnavailableError):
        return error_chunk("model_unavailable", message)
    if isinstance(exc, DeviceMemoryError):
        return error_chunk("device_memory", message)
    return error_chunk("internal", f"{type(exc).__name__}: {message}")


def error_from_pb(err: pb.GenerateError) -> BaseException:
    """The owning node's error as the exception that gives the same HTTP answer here."""
    message = err.message
    if err.type == "context_length_exceeded":
        return ContextLengthError(message, err.param or "messages")
    if err.type == "prompt":
        return PromptError(message)
    if err.type == "sampling_params":
        return SamplingParamsError(message)
    if err.type == "native_mtp_unavailable":
        return NativeMTPUnavailableError(message)
    if err.type == "generation_request":
        return GenerationRequestError(message, param=err.param or None)
    if err.type == "queue_full":
        return QueueFullError(0, max(1, math.ceil(err.retry_after_s)), message)
    if err.type == "timeout":
        return RequestTimeoutError(message)
    if err.type == "model_unavailable":
        return NodeUnavailableError(message)
    if err.type == "device_memory":
        return DeviceMemoryError(message)
    return RuntimeError(message)


def generate_request(
    model_id: str, instance_id: str, prompt: Prompt, params: GenerateParams, timeout_s: float
) -> pb.GenerateRequest:
    request = pb.GenerateRequest(
        request_id=uuid.uuid4().hex,
        model=utf8_safe(model_id),
        instance_id=instance_id,
        default_max_tokens=params.default_max_tokens,
        sampling=sampling_to_pb(params.sampling),
        stop=[utf8_safe(s) for s in params.stop],
        native_mtp=params.native_mtp,
        timeout_s=timeout_s,
    )
    if prompt.messages is not None:
        request.messages.CopyFrom(pb.Messages(messages=[_message_to_pb(m) for m in prompt.messages]))
    elif prompt.token_ids is not None:
        # Ids that int64 cannot carry are invalid anyway: send -1 so the owner refuses them with its own
        # message ("prompt token ids must be in [0, vocab)"), as it would refuse them on its own API.
        ids = [t if 0 <= t < 1 << 63 else -1 for t in prompt.token_ids]
        request.token_ids.CopyFrom(pb.TokenIds(ids=ids))
    else:
        request.text = utf8_safe(prompt.text or "")
    if prompt.template_kwargs:
        request.template_kwargs_json = json.dumps(prompt.template_kwargs)
    if prompt.rendered is not None:
        request.rendered.CopyFrom(pb.TokenIds(ids=prompt.rendered))
    if params.max_tokens is not None:
        # Beyond 2**63 - 1 no context fits either: the owner refuses it the same way.
        request.max_tokens = min(params.max_tokens, (1 << 63) - 1)
    if params.mtp_k is not None:
        request.mtp_k = params.mtp_k
    if prompt.tools:
        request.tools_json = json.dumps(prompt.tools)
    if params.constraint is not None:
        request.constraint_json = params.constraint.to_json()
    if params.logprobs is not None:
        request.logprobs = params.logprobs
    request.ignore_eos = params.ignore_eos
    if params.prompt_cache_key:
        request.prompt_cache_key = utf8_safe(params.prompt_cache_key)
    return request


def _message_to_pb(message: dict) -> pb.ChatMessage:
    out = pb.ChatMessage(role=utf8_safe(message["role"]), content=utf8_safe(message.get("content") or ""))
    if message.get("tool_calls"):
        out.tool_calls_json = json.dumps(message["tool_calls"])  # ASCII: surrogates escaped
    if message.get("tool_call_id") is not None:
        out.tool_call_id = utf8_safe(message["tool_call_id"])
    if message.get("name") is not None:
        out.name = utf8_safe(message["name"])
    return out


def _message_from_pb(msg: pb.ChatMessage) -> dict:
    out: dict = {"role": msg.role, "content": msg.content}
    if msg.tool_calls_json:
        out["tool_calls"] = json.loads(msg.tool_calls_json)
    if msg.tool_call_id:
        out["tool_call_id"] = msg.tool_call_id
    if msg.name:
        out["name"] = msg.name
    return out


def request_from_pb(req: pb.GenerateRequest) -> tuple[Prompt, GenerateParams]:
    """What ``generate_request`` sent, back as the engine-level prompt and parameters."""
    kind = req.WhichOneof("prompt")
    prompt = Prompt(
        messages=[_message_from_pb(m) for m in req.messages.messages] if kind == "messages" else None,
        text=req.text if kind == "text" else None,
        token_ids=list(req.token_ids.ids) if kind == "token_ids" else None,
        template_kwargs=json.loads(req.template_kwargs_json) if req.template_kwargs_json else {},
        tools=json.loads(req.tools_json) if req.tools_json else None,
        rendered=list(req.rendered.ids) if req.HasField("rendered") else None,
    )
    if prompt.messages is None and prompt.token_ids is None and prompt.text is None:
        prompt = Prompt(text="", template_kwargs=prompt.template_kwargs, rendered=prompt.rendered)
    params = GenerateParams(
        max_tokens=req.max_tokens if req.HasField("max_tokens") else None,
        default_max_tokens=req.default_max_tokens,
        # An absent message means the defaults (its zero values would read as top_p=0).
        sampling=sampling_from_pb(req.sampling) if req.HasField("sampling") else SamplingParams(),
        stop=tuple(req.stop),
        native_mtp=req.native_mtp or "auto",  # type: ignore[arg-type]
        mtp_k=req.mtp_k if req.HasField("mtp_k") else None,
        constraint=ConstraintSpec.from_json(req.constraint_json) if req.constraint_json else None,
        logprobs=req.logprobs if req.HasField("logprobs") else None,
        ignore_eos=req.ignore_eos,
        prompt_cache_key=req.prompt_cache_key or None,
        # The serving node's switch (its daemon adds it: ``ClusterNode.generate_local``).
        mtp_switch=MTPSwitch(req.node_mtp.enabled, req.node_mtp.disabled_reason) if req.HasField("node_mtp") else None,
    )
    return prompt, params

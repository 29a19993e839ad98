"""Engine values <-> the proto's generation messages (GenerateRequest, GenerateChunk).

Shared by the runner (which builds chunks) and the API node (which turns them back into the engine's
``GenerationChunk``), so both ends agree on every field.
"""

from __future__ import annotations

from exo.cluster.proto_gen import node_pb2 as pb
from exo.engine import (
    ContextLengthError,
    GenerationChunk,
    GenerationRequestError,
    NativeMTPStats,
    SamplingParams,
)
from exo.engine.generate import NativeMTPUnavailableError
from exo.engine.sampling import SamplingParamsError

from .prompt import PromptError

INT32_MAX = (1 << 31) - 1


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


def chunk_to_pb(chunk: GenerationChunk) -> pb.GenerateChunk:
    return pb.GenerateChunk(
        text=chunk.text,
        token_ids=chunk.token_ids,
        finish_reason=chunk.finish_reason or "",
        native_mtp_json=chunk.stats.model_dump_json() if chunk.stats is not None else "",
    )


def chunk_from_pb(msg: pb.GenerateChunk) -> GenerationChunk:
    stats = NativeMTPStats.model_validate_json(msg.native_mtp_json) if msg.native_mtp_json else None
    return GenerationChunk(msg.text, list(msg.token_ids), msg.finish_reason or None, stats)  # type: ignore[arg-type]


def error_chunk(type: str, message: str, *, param: str = "", retry_after_s: float = 0.0) -> pb.GenerateChunk:
    return pb.GenerateChunk(
        error=pb.GenerateError(type=type, message=message, param=param, retry_after_s=retry_after_s)
    )


def error_to_pb(exc: BaseException) -> pb.GenerateChunk:
    """A generation's failure as the chunk the API node turns back into the same HTTP error."""
    message = str(exc.args[0]) if isinstance(exc, LookupError) and exc.args else str(exc)
    if isinstance(exc, ContextLengthError):
        return error_chunk("context_length_exceeded", message, param=exc.param)
    if isinstance(exc, PromptError):
        return error_chunk("prompt", message)
    if isinstance(exc, NativeMTPUnavailableError):
        return error_chunk("native_mtp_unavailable", message)
    if isinstance(exc, GenerationRequestError):
        return error_chunk("generation_request", message, param=getattr(exc, "param", "") or "")
    if isinstance(exc, SamplingParamsError):
        return error_chunk("sampling_params", message)
    return error_chunk("internal", f"{type(exc).__name__}: {message}")

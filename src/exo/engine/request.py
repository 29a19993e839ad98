"""What a generation is asked and what it yields: the request, its chunks and result, and the errors of a
request that cannot run. Validation lives here, in one place (``check_request``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from .constraints import Grammar
from .sampling import SamplingParams
from .stats import NativeMTPStats

NativeMTPMode = Literal["auto", "on", "off"]
FinishReason = Literal["stop", "length", "cancelled"]
MAX_FORCED_K = 8
MAX_TOP_LOGPROBS = 20


class NativeMTPUnavailableError(RuntimeError):
    """``native_mtp="on"`` was asked for but this model/configuration cannot run it."""


class GenerationRequestError(ValueError):
    """A generation request is invalid (too long for the context, bad max_tokens, bad K...)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextLengthError(GenerationRequestError):
    """The prompt plus the completion budget does not fit in the model's context."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class MTPSwitch:
    """A node's native-MTP switch as a request carries it (the serving node's setting when the request reached
    it): it decides for that request; the engine's configuration is never changed for it."""

    enabled: bool
    disabled_reason: str = "native MTP is disabled"


@dataclass
class GenerationRequest:
    prompt_tokens: Sequence[int]
    max_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: Sequence[str] = ()
    native_mtp: NativeMTPMode = "auto"
    mtp_k: int | None = None  # force a depth (0..8); None: adaptive
    # Polled once per decode step or speculative round; True ends the generation ("cancelled").
    should_stop: Callable[[], bool] | None = None
    # Tokens must follow this grammar (engine/constraints.py): every position's logits are masked.
    constraint: Grammar | None = None
    # Log-probabilities of the emitted tokens with this many alternatives (0..20); None: none.
    logprobs: int | None = None
    # The prompt ends inside a think block its chat template opened: the output starts with reasoning.
    thinking: bool = False
    # End-of-sequence tokens are ordinary tokens: the generation runs to max_tokens (or a stop string).
    ignore_eos: bool = False
    # OpenAI's prompt_cache_key: the prefix cache keeps (and evicts) the entries of one key together.
    prompt_cache_key: str | None = None
    # Polled through the engine's one-time warm-up that the first adaptive request waits on (round costs, the
    # head's warm acceptance); True ends the request before it starts ("cancelled"). None: ``should_stop``.
    stop_warmup: Callable[[], bool] | None = None
    # The serving node's native-MTP switch (None: the engine's own, ``EngineConfig.native_mtp_enabled``).
    mtp_switch: MTPSwitch | None = None


def check_request(request: GenerationRequest, vocab_size: int, context_length: int | None) -> None:
    """Raise ``GenerationRequestError`` (``ContextLengthError``) where ``request`` cannot run on a model with
    this vocabulary and context."""
    if not request.prompt_tokens:
        raise GenerationRequestError("the prompt is empty")
    if request.max_tokens < 1:
        raise GenerationRequestError(f"max_tokens must be >= 1, got {request.max_tokens}")
    if request.mtp_k is not None and not 0 <= request.mtp_k <= MAX_FORCED_K:
        raise GenerationRequestError(f"the MTP depth must be in 0..{MAX_FORCED_K}, got {request.mtp_k}")
    if request.logprobs is not None and not 0 <= request.logprobs <= MAX_TOP_LOGPROBS:
        raise GenerationRequestError(f"top logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {request.logprobs}")
    if any(not 0 <= t < vocab_size for t in request.prompt_tokens):
        raise GenerationRequestError(f"prompt token ids must be in [0, {vocab_size})")
    if context_length is not None and len(request.prompt_tokens) + request.max_tokens > context_length:
        raise ContextLengthError(
            f"the prompt ({len(request.prompt_tokens)} tokens) plus max_tokens ({request.max_tokens}) "
            f"exceeds the model's context of {context_length} tokens"
        )


@dataclass(frozen=True)
class TopLogprob:
    token: int
    bytes: bytes
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability under the distribution it was chosen from (after penalties,
    the grammar's mask, and for sampling the filters and temperature), with the most likely alternatives."""

    token: int
    bytes: bytes
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass
class GenerationChunk:
    """One streamed piece: new text, the tokens behind it, and on the last chunk the outcome."""

    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    stats: NativeMTPStats | None = None
    # With GenerationRequest.logprobs: one entry per token of token_ids, EOS excepted.
    logprobs: list[TokenLogprob] | None = None
    # On the last chunk: the stop string that ended the output (finish_reason "stop"), if one did.
    stop_sequence: str | None = None


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    stats: NativeMTPStats
    logprobs: list[TokenLogprob] | None = None

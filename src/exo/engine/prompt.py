"""A request before tokenization (``Prompt``, ``GenerateParams``) -> token ids and the completion budget.

Checked where the model lives, with one definition for every path (in-process, a node's runner, a
pipeline's leader), so a request fails or succeeds the same way wherever it is served.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .generate import ContextLengthError, Engine, GenerationRequest, NativeMTPMode
from .sampling import SamplingParams

# apply_chat_template arguments a request must not override through chat_template_kwargs.
RESERVED_TEMPLATE_ARGS = frozenset(
    {
        "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
        "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
        "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    }
)


class PromptError(ValueError):
    """The prompt cannot be turned into tokens (chat template or tokenizer failure)."""


@dataclass(frozen=True)
class Prompt:
    """Exactly one of: chat messages (through the chat template), text, or token ids."""

    messages: list[dict[str, str]] | None = None
    text: str | None = None
    token_ids: list[int] | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class GenerateParams:
    max_tokens: int | None  # None: default_max_tokens, bounded by what is left of the context
    default_max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    native_mtp: NativeMTPMode = "auto"
    mtp_k: int | None = None


def tokenize(
    tokenizer: Any,
    *,
    messages: list[dict[str, str]] | None = None,
    text: str | None = None,
    token_ids: list[int] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """The prompt's token ids: chat messages through the model's chat template, text encoded as is."""
    if token_ids is not None:
        return list(token_ids)
    template_kwargs = template_kwargs or {}
    try:
        if messages is not None:
            if not getattr(tokenizer, "chat_template", None):
                raise PromptError("this model's tokenizer has no chat template: use /v1/completions")
            reserved = sorted(RESERVED_TEMPLATE_ARGS & set(template_kwargs))
            if reserved:
                raise PromptError(f"chat_template_kwargs cannot set {', '.join(reserved)}")
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **template_kwargs)
        else:
            assert text is not None
            ids = tokenizer.encode(text)
        ids = list(ids)
    except PromptError:
        raise
    except Exception as e:  # template errors, text the tokenizer refuses (lone surrogates, ...)
        raise PromptError(f"the prompt could not be tokenized: {type(e).__name__}: {e}") from e
    if not all(isinstance(t, int) for t in ids):
        raise PromptError("the chat template did not produce token ids")
    return ids


def completion_budget(
    engine: Engine, prompt_tokens: int, max_tokens: int | None, default_max_tokens: int, param: str = "messages"
) -> int:
    """max_tokens as asked, or the default bounded by the context; raises if it does not fit."""
    limit = engine.loaded.context_length
    budget = max_tokens if max_tokens is not None else default_max_tokens
    if max_tokens is None and limit is not None:
        budget = min(budget, limit - prompt_tokens)
    if limit is not None and (budget < 1 or prompt_tokens + budget > limit):
        raise ContextLengthError(
            f"this model's maximum context length is {limit} tokens, but {prompt_tokens + max(budget, 1)} were "
            f"requested ({prompt_tokens} in the prompt, {max(budget, 1)} for the completion); shorten the "
            "prompt or lower max_tokens",
            param,
        )
    return budget


def generation_request(
    engine: Engine, prompt: Prompt, params: GenerateParams, should_stop: Any = None
) -> GenerationRequest:
    """The engine's request for a prompt and its parameters: tokenized, its budget checked."""
    tokens = tokenize(
        engine.loaded.tokenizer,
        messages=prompt.messages,
        text=prompt.text,
        token_ids=prompt.token_ids,
        template_kwargs=prompt.template_kwargs,
    )
    param = "messages" if prompt.messages is not None else "prompt"
    max_tokens = completion_budget(engine, len(tokens), params.max_tokens, params.default_max_tokens, param)
    return GenerationRequest(
        prompt_tokens=tokens,
        max_tokens=max_tokens,
        sampling=params.sampling,
        stop=params.stop,
        native_mtp=params.native_mtp,
        mtp_k=params.mtp_k,
        should_stop=should_stop,
    )

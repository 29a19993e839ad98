"""A request before tokenization (``Prompt``, ``GenerateParams``) -> token ids and the completion budget.

Checked where the model lives, with one definition for every path (in-process, a node's runner, a
pipeline's leader), so a request fails or succeeds the same way wherever it is served.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .constraints import ConstraintError, ConstraintSpec, ToolFormat, tool_format
from .generate import Engine
from .request import ContextLengthError, GenerationRequest, GenerationRequestError, MTPSwitch, NativeMTPMode
from .sampling import SamplingParams

# apply_chat_template arguments a request must not override through chat_template_kwargs.
RESERVED_TEMPLATE_ARGS = frozenset(
    {
        "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
        "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
        "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    }
)


# For chat templates that render no tools (the bundled demo models' ChatML): tools, the calls an assistant
# made and the tools' results in Qwen3's format (JSON calls in <tool_call> blocks, results in
# <tool_response> blocks of a user turn), which is also the format exo parses and constrains.
FALLBACK_TOOL_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for call in message.tool_calls %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' "
    "+ (call.function.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


class PromptError(ValueError):
    """The prompt cannot be turned into tokens (chat template or tokenizer failure)."""


@dataclass(frozen=True)
class Prompt:
    """Exactly one of: chat messages (through the chat template), text, or token ids.

    A message is ``{"role", "content"}``, plus ``tool_calls`` (assistant: ``[{"id", "type": "function",
    "function": {"name", "arguments": dict}}]``) or ``tool_call_id`` and ``name`` (tool); ``tools`` are
    OpenAI tool definitions (``{"type": "function", "function": {...}}``) for the chat template."""

    messages: list[dict[str, Any]] | None = None
    text: str | None = None
    token_ids: list[int] | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    tools: list[dict[str, Any]] | None = None
    # Its token ids as ``prompt_tokens`` renders them, where a router computed them already (the prompt is
    # tokenized once on its way to the model); None: where the model lives tokenizes it.
    rendered: list[int] | None = None


@dataclass(frozen=True)
class GenerateParams:
    max_tokens: int | None  # None: default_max_tokens, bounded by what is left of the context
    default_max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    native_mtp: NativeMTPMode = "auto"
    mtp_k: int | None = None
    constraint: ConstraintSpec | None = None  # the output must follow it (constrained decoding)
    logprobs: int | None = None  # report log-probabilities, with this many alternatives (0..20)
    ignore_eos: bool = False  # generate past end-of-sequence tokens, up to max_tokens
    prompt_cache_key: str | None = None  # a hint for the prefix cache and the router (None: none)
    mtp_switch: MTPSwitch | None = None  # the serving node's native-MTP switch, set where the model lives


def renders_tools(tokenizer: Any) -> bool:
    """Whether the model's chat template renders tools (else exo's FALLBACK_TOOL_TEMPLATE does)."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


def uses_tools(messages: list[dict[str, Any]] | None, tools: list[dict[str, Any]] | None) -> bool:
    return bool(tools) or any(m.get("role") == "tool" or m.get("tool_calls") for m in messages or [])


def prompt_tool_format(tokenizer: Any) -> ToolFormat:
    """The tool-call format this model is taught: its template's, or the fallback's (JSON)."""
    return tool_format(getattr(tokenizer, "chat_template", None)) if renders_tools(tokenizer) else "json"


THINK_OPEN, THINK_CLOSE = "<think>", "</think>\n\n"


def opens_think(tokenizer: Any, tokens: list[int]) -> bool:
    """Whether the prompt ends inside a think block its template opened (``<think>`` with no ``</think>``
    after it in the generation prompt)."""
    tail = tokenizer.decode(tokens[-24:])
    at = tail.rfind(THINK_OPEN)
    return at >= 0 and "</think>" not in tail[at:]


def tokenize(
    tokenizer: Any,
    *,
    messages: list[dict[str, Any]] | None = None,
    text: str | None = None,
    token_ids: list[int] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
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
            extra: dict[str, Any] = {}
            if tools:
                extra["tools"] = tools
            if uses_tools(messages, tools) and not renders_tools(tokenizer):
                extra["chat_template"] = FALLBACK_TOOL_TEMPLATE
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **extra, **template_kwargs)
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


def prompt_tokens(tokenizer: Any, prompt: Prompt, params: GenerateParams) -> list[int]:
    """The prompt's tokens as a generation reads them (a constrained chat asks its template not to think;
    the cluster's router hashes the same tokens)."""
    kwargs = prompt.template_kwargs
    if params.constraint is not None and prompt.messages is not None:
        kwargs = {"enable_thinking": False, **kwargs}
    return tokenize(tokenizer, messages=prompt.messages, text=prompt.text, token_ids=prompt.token_ids,
                    template_kwargs=kwargs, tools=prompt.tools)


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
    """The engine's request for a prompt and its parameters: tokenized, its budget checked.

    A constrained chat answer starts after any thinking: the template is asked not to think
    (``enable_thinking=False``, unless the request says otherwise) and a think block the generation prompt
    still opens is closed, so the grammar applies to the answer itself."""
    constrained_chat = params.constraint is not None and prompt.messages is not None
    tokens = list(prompt.rendered) if prompt.rendered is not None else prompt_tokens(engine.loaded.tokenizer, prompt, params)
    thinking = prompt.messages is not None and opens_think(engine.loaded.tokenizer, tokens)
    if constrained_chat and thinking:
        tokens += list(engine.loaded.tokenizer.encode(THINK_CLOSE, add_special_tokens=False))
        thinking = False
    param = "messages" if prompt.messages is not None else "prompt"
    max_tokens = completion_budget(engine, len(tokens), params.max_tokens, params.default_max_tokens, param)
    grammar = None
    if params.constraint is not None:
        try:
            grammar = engine.grammar(params.constraint, prompt_tool_format(engine.loaded.tokenizer))
        except ConstraintError as e:
            raise GenerationRequestError(str(e), param=e.param) from None
        if grammar.min_tokens is not None and max_tokens < grammar.min_tokens:
            raise GenerationRequestError(
                f"max_tokens is {max_tokens}, but the shortest output this constraint allows takes "
                f"{grammar.min_tokens} tokens (the end of sequence included): raise max_tokens to at least "
                f"{grammar.min_tokens}",
                param="max_tokens",
            )
    return GenerationRequest(
        prompt_tokens=tokens,
        max_tokens=max_tokens,
        sampling=params.sampling,
        stop=params.stop,
        native_mtp=params.native_mtp,
        mtp_k=params.mtp_k,
        should_stop=should_stop,
        constraint=grammar,
        logprobs=params.logprobs,
        thinking=thinking,
        ignore_eos=params.ignore_eos,
        prompt_cache_key=params.prompt_cache_key,
        mtp_switch=params.mtp_switch,
    )
